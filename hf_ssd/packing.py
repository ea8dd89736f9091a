"""Packed fp32 Linear layers for CPU targets: oneDNN's pre-reordered weights, so verifying K+1 positions costs
about what one position does.

Why: a verification feeds K+1 rows through every Linear layer. For so few rows a layer is bound by reading its
weights, so K+1 rows should cost about what one does — but MKL's fp32 GEMM, which `torch.nn.functional.linear`
calls on CPUs, runs 2-3x slower at 2-9 rows than at one on the AMD EPYC machines this project measures on (its
matrix-vector path is fine, its small matrix-matrix path is not). oneDNN's matmul over weights reordered once
into its blocked layout (what inductor's `freezing` emits for CPU Linear layers) stays near flat up to 9-16 rows,
and it scales with threads where MKL's matrix-vector product does not. Measured on a 2-core AMD EPYC (AVX-512),
the 1.5B Qwen2.5-Coder target, 200 tokens of context, one thread: 1 / 2 / 3 / 5 / 9 positions took 527 / 864 /
1,323 / 945 / 1,273 ms with MKL and 528 / 565 / 411 / 347 / 462 ms packed. A flat cost curve is what speculative
decoding assumes; with it, speculation pays whenever the draft is right at all.

Exactness: packing changes the kernel, not the model. Logits move by rounding only (max |diff| ~5e-5 on the
1.5B model, the size of the difference between MKL's 1-row and 5-row products that every speculative decoder
already lives with); neither kernel is batch-invariant. Pack the target once, then compare everything (plain
decoding, assisted generation, SSD) on the packed model: `hf-ssd demo` and `hf-ssd bench` do.

Padding: the packed kernel computes rows in blocks (its microkernel's register block), and a few rows short of a
block can cost more than the whole block: on a 2-core AMD EPYC with AVX-512 a forward of the 1.5B target took 287 /
316 / 269 ms for 1 / 2 / 3 rows and 236 / 238 / 245 ms with the rows padded to 6. `pack_linear_layers` measures the
fastest small row count on the model's largest layers (`padding_rows`) and pads fewer rows to it with zero rows,
whose outputs are dropped: a plain step and a short verification then cost the block's time, and every count up to
the block runs the same kernel (a row's logits do not depend on how many rows shared its forward, up to the block).

Inference only (no autograd), CPU and fp32 only, and the packed model cannot be moved, cast or saved: reload it for
that. `pack_linear_layers` replaces each `nn.Linear` in place and frees its unpacked weight (memory-neutral; a head
tied to the input embeddings keeps the embeddings and adds its packed copy).
"""

from __future__ import annotations

import time
from statistics import median_high

import torch
from torch import nn


def packing_available() -> bool:
    """Whether this torch build has oneDNN's packed Linear kernels (CPU builds with mkldnn)."""
    ops = torch.ops.mkldnn
    return bool(torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise")
                and hasattr(ops, "_reorder_linear_weight"))


class PackedLinear(nn.Module):
    """`nn.Linear` with its weight reordered once for oneDNN's matmul (fp32, CPU, inference). Inputs of fewer than
    `pad_rows` rows are padded with zero rows to `pad_rows` (0: never) and the extra rows' outputs dropped: where the
    kernel's register blocking makes a few rows dearer than its block (`padding_rows`), a plain step and a short
    verification run at the block's speed, and every count up to it through the same kernel."""

    def __init__(self, linear: nn.Linear, pad_rows: int = 0):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.pad_rows = pad_rows
        # a plain attribute, not a buffer: `.to()`, casts and state dicts cannot handle the opaque layout
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dtype != torch.float32:
            raise RuntimeError(f"PackedLinear runs fp32 on CPU (packed by hf_ssd.pack_linear_layers), got {x.dtype} "
                               f"on {x.device}; reload the model to move or cast it.")
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError("PackedLinear is for inference: it has no gradient (reload the model to train it).")
        shape = x.shape
        flat = x.reshape(-1, self.in_features).contiguous()
        rows = flat.shape[0]
        if 0 < rows < self.pad_rows:
            flat = nn.functional.pad(flat, (0, 0, 0, self.pad_rows - rows))  # zero rows below: one op
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed_weight, self.bias, "none", [], "")
        return out[:rows].reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        padded = f", pad_rows={self.pad_rows}" if self.pad_rows else ""
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}{padded}"


def _check_packable(model: nn.Module) -> None:
    if not packing_available():
        raise ValueError("precision='fp32-packed' needs oneDNN (torch.backends.mkldnn), which this torch build "
                         "lacks; use precision='fp32'.")
    devices = {p.device.type for p in model.parameters()}
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if devices - {"cpu"} or dtypes - {torch.float32}:
        raise ValueError(f"precision='fp32-packed' packs fp32 models on CPU; this one has parameters on "
                         f"{sorted(devices)} in {sorted(map(str, dtypes))}.")


def pack_linear_layers(model: nn.Module, pad_rows: int | None = None) -> nn.Module:
    """Run `model`'s Linear layers through oneDNN's packed fp32 kernels, so a verification of K+1 positions costs
    about what one position does on CPUs where MKL's small matrix products are slow.

    Every `nn.Linear` is replaced in place by a `PackedLinear` (its weight reordered once, the unpacked copy
    freed). The model stays fp32 and gives the same logits up to rounding; pack it before comparing anything, so
    plain decoding and SSD run the same kernels. Afterwards it is for inference on the CPU only: it cannot be
    moved, cast, trained or saved (reload it for that).

    Args:
        model: an fp32 model on the CPU.
        pad_rows: inputs of fewer rows are padded to this many (`PackedLinear`); None (the default) measures it
            here on the model's largest layers (`padding_rows`), 0 never pads.

    Returns:
        `model` itself, in eval mode.

    Raises:
        ValueError: if this torch build lacks oneDNN, the model is not fp32 on the CPU, or `pad_rows` is not None or
            an int >= 0.

    Example:
        ```python
        from hf_ssd import enable_ssd, pack_linear_layers

        target = enable_ssd(pack_linear_layers(target))
        out = target.generate(**inputs, assistant_model=draft, ssd_config=SSDConfig())
        ```
    """
    if pad_rows is not None and (not isinstance(pad_rows, int) or pad_rows < 0):
        raise ValueError(f"pad_rows={pad_rows!r} is invalid: expected None (measured here), 0 (never pad) or a "
                         f"positive number of rows.")
    _check_packable(model)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, PackedLinear(child))
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if pad_rows is None:
        with torch.no_grad():
            pad_rows = padding_rows(_largest_linears(model, PackedLinear))
    for layer in packed:
        layer.pad_rows = pad_rows
    return model.eval()


def packed_pad_rows(model: nn.Module) -> int | None:
    """The row count `model`'s packed Linear layers pad to (0: none), None where it has none packed."""
    return next((m.pad_rows for m in model.modules() if isinstance(m, PackedLinear)), None)


# The probe's layers hold at least this many bytes of weights (or all of the model's, where it has fewer): more than
# a CPU's last-level cache (a 2-core cloud Xeon reports 480 MiB of L3), so that each call reads its weights from
# memory, as a forward does. One layer of the 1.5B target (55 MB) timed over and over stayed in that Xeon's cache and
# read 0.84-0.92x at one row, whole plain steps about 0.9x: the decision flipped from run to run. The packed copies
# live only during the probe.
PROBE_BYTES = 1 << 30


def _weight_bytes(layer: nn.Module) -> int:
    return layer.in_features * layer.out_features * 4 if isinstance(layer, PackedLinear) else (
        layer.weight.numel() * layer.weight.element_size())


def _largest_linears(model: nn.Module, kind: type = nn.Linear) -> list[nn.Module]:
    """The largest Linear layers (of type `kind`: `nn.Linear`, or `PackedLinear` once packed) of `model`, the head
    excluded unless it is the only one, up to `PROBE_BYTES`."""
    linears = [m for m in model.modules() if type(m) is kind]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    body = sorted([m for m in linears if m is not head] or linears, key=lambda m: -_weight_bytes(m))
    chosen, total = [], 0
    for layer in body:
        if total >= PROBE_BYTES:
            break
        chosen.append(layer)
        total += _weight_bytes(layer)
    return chosen


def _pass_seconds(layers: list[nn.Module], inputs: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    for layer, x in zip(layers, inputs):
        layer(x)
    return time.perf_counter() - start


# Padding is measured up to this many rows (an AVX-512 or AVX2 kernel's register block of rows is 4-8), and adopted
# where the fastest count is at least 5 % faster than one row.
PAD_MAX_ROWS = 8
PAD_GAIN = 0.95


def padding_rows(layers: list[PackedLinear], max_rows: int = PAD_MAX_ROWS, repeats: int = 3) -> int:
    """The row count to pad fewer rows to: the one of 1..`max_rows` a pass over the packed `layers` takes least time
    at (the median of `repeats` passes, the counts interleaved), where it beats one row by 5 % (`PAD_GAIN`); else 0.

    oneDNN's packed matmul computes a block of rows at a time (its microkernel's register block); a count short of
    it runs a remainder kernel, which can be dearer than the whole block. Measured on a 2-core AMD EPYC with
    AVX-512, the 1.5B Qwen2.5-Coder target, two threads, whole forwards at 200 tokens of context: 1 / 2 / 3 rows
    287 / 316 / 269 ms, padded to 6 rows 236 / 238 / 245 ms."""
    if not layers:
        return 0
    saved = [layer.pad_rows for layer in layers]
    for layer in layers:
        layer.pad_rows = 0
    try:
        noise = torch.Generator().manual_seed(0)  # the caller's global RNG stays where it was
        inputs = {m: [torch.randn(m, layer.in_features, generator=noise) for layer in layers]
                  for m in range(1, max_rows + 1)}
        for m in inputs:  # warm-up: first calls pick kernels
            _pass_seconds(layers, inputs[m])
        passes: dict[int, list[float]] = {m: [] for m in inputs}
        for _ in range(repeats):
            for m in inputs:
                passes[m].append(_pass_seconds(layers, inputs[m]))
    finally:
        for layer, pad in zip(layers, saved):
            layer.pad_rows = pad
    median = {m: median_high(times) for m, times in passes.items()}
    best = min(median, key=lambda m: (median[m], m))
    return best if best > 1 and median[best] <= PAD_GAIN * median[1] else 0


def _pass_ratios(layers: list[nn.Module], packed: list[PackedLinear], rows: int, repeats: int,
                 noise: torch.Generator) -> list[float]:
    """MKL's time over the packed kernel's for a pass over the layers at `rows` rows, `repeats` times, each MKL pass
    followed by the packed one (interleaved, so that a machine's drift during the probe moves both kernels alike)."""
    inputs = [torch.randn(rows, layer.in_features, generator=noise) for layer in layers]
    _pass_seconds(layers, inputs), _pass_seconds(packed, inputs)  # warm-up: first calls pick kernels
    return [_pass_seconds(layers, inputs) / _pass_seconds(packed, inputs) for _ in range(repeats)]


# Where the one-row ratio lands this close to the bar it is decided against, `SETTLE_REPEATS` more passes decide it.
# On a 2-core AVX2 EPYC (whole plain steps of the 1.5B target: MKL 694 ms, packed 704) the median of 9 passes read
# 0.81-1.12 as the first probe of five processes, 2 below the 0.9 bar, so such runs packed nothing and decoded on
# MKL's curve (verifications 2-3x dearer); the median of 60 passes read 1.05 in both of two processes.
NEAR_BAR = 0.2
SETTLE_REPEATS = 27


def packing_speedup(model: nn.Module, rows: int, repeats: int = 9, bar: float | None = None) -> dict[int, float]:
    """MKL's time over the packed kernel's for 1 row and for `rows` rows (a verification's K+1), measured on
    `model`'s largest Linear layers (the head excluded) holding `PROBE_BYTES` of weights: a pass over them with each
    kernel in turn, `repeats` times, the median of the passes' ratios (interleaved, so that a machine's drift
    during the probe moves both kernels alike). Where `bar` is given and the one-row ratio lands within `NEAR_BAR`
    of it, `SETTLE_REPEATS` more passes are timed and the median of all of them is returned: a decision against
    `bar` then flips less with a shared machine's noise. The packed kernel pads fewer rows as `pack_linear_layers`
    would (`padding_rows`, measured first). Above 1, packing is faster."""
    layers = _largest_linears(model)
    if not layers:
        return {}
    packed = [PackedLinear(layer) for layer in layers]
    ratios, noise = {}, torch.Generator().manual_seed(0)  # the caller's global RNG stays where it was
    with torch.no_grad():
        pad = padding_rows(packed)
        for layer in packed:
            layer.pad_rows = pad
        for m in sorted({1, rows}):
            passes = _pass_ratios(layers, packed, m, repeats, noise)
            if m == 1 and bar is not None and abs(median_high(passes) - bar) < NEAR_BAR:
                passes += _pass_ratios(layers, packed, m, SETTLE_REPEATS, noise)
            ratios[m] = median_high(passes)
    return ratios


# Packing pays where the packed kernel is faster for a verification's rows and at least this fast (MKL's time over
# its) for one row: a plain step, what plain decoding and every rejected speculation's round pay.
PACK_AT_ONE_ROW = 0.9


def packing_decision(model: nn.Module, rows: int) -> tuple[bool, dict[int, float]]:
    """(whether packing pays for `model` here, the `packing_speedup` ratios it was decided on: empty where the model
    cannot be packed): oneDNN available, an fp32 CPU model, and the packed kernel measured faster for a
    verification's `rows` and at most 10 % slower for one row (`PACK_AT_ONE_ROW`), timed longer where the one-row
    ratio lands near that bound (`packing_speedup`'s `bar`). A machine whose one-row ratio sits at the bound may still
    decide differently from run to run: runs to be compared name the precision."""
    try:
        _check_packable(model)
    except ValueError:
        return False, {}
    ratios = packing_speedup(model, rows, bar=PACK_AT_ONE_ROW)
    return bool(ratios) and ratios.get(rows, 0.0) > 1.0 and ratios.get(1, 0.0) >= PACK_AT_ONE_ROW, ratios
