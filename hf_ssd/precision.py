"""CPU precision options: fp32; fp32 with oneDNN-packed Linear layers (`packing.py`: the same model, a kernel whose
cost stays near flat from 1 to 9 rows); or int8 weights with dynamic int8 activations (fbgemm) for every Linear
layer.

On AVX2 CPUs a forward over K+1 tokens costs about 3× one token in fp32 but about 1.5× in int8, and the int8
forward is several times faster overall (README, "Real models offline, CPU precision").

Exactness: the DRAFT's numerics never change SSD's output — verification is exact for whatever distribution the
draft proposes from — so an int8 draft keeps greedy output token-identical to the fp32 target. Quantizing the
TARGET changes the model itself: `quantize_dynamic` picks one activation scale per input tensor, so a forward
over K+1 tokens quantizes each token differently than decoding it alone, and verification then disagrees with
plain int8 decoding at some positions. Measure and report agreement with plain decoding whenever the target is
int8.
"""

from __future__ import annotations

import warnings

import torch

from .packing import PACK_AT_ONE_ROW, PackedLinear, pack_linear_layers, packing_decision

PRECISIONS = ("fp32", "fp32-packed", "int8")
TARGET_PRECISIONS = ("auto", *PRECISIONS)  # "auto": fp32-packed where it measures faster here, else fp32


def resolve_precision(model: torch.nn.Module, precision: str, rows: int) -> str:
    """`precision`, with "auto" decided on this machine: "fp32-packed" when the packed kernel measures faster on
    `model`'s largest Linear layers for a verification's `rows` (K+1) and at most 10 % slower for one row
    (`packing.packing_decision`), else "fp32"."""
    return decide_precision(model, precision, rows)[0]


def decide_precision(model: torch.nn.Module, precision: str, rows: int) -> tuple[str, dict[int, float]]:
    """(`resolve_precision`'s answer, the packed kernel's measured speed-up per row count it was decided on: MKL's
    time over the packed kernel's, `packing.packing_speedup`; empty unless "auto" measured it)."""
    if precision not in TARGET_PRECISIONS:
        raise ValueError(f"precision={precision!r} is invalid: expected one of {TARGET_PRECISIONS}.")
    if precision != "auto":
        return precision, {}
    pack, ratios = packing_decision(model, rows)
    return ("fp32-packed" if pack else "fp32"), ratios


def describe_decision(precision: str, ratios: dict[int, float], pad_rows: int | None = None) -> str:
    """One line on what "auto" chose and on what, e.g. "fp32-packed, auto: the packed kernel 1.31x at 5 rows, 0.91x at
    1 row of MKL's speed; packs where faster at the verification's rows and >= 0.9x at one"; the precision alone
    where it was named; with "; fewer rows padded to 6" where the packed layers pad (`pad_rows`)."""
    padded = f"; fewer rows padded to {pad_rows}" if pad_rows else ""
    if not ratios:
        return f"{precision}{padded}"
    measured = ", ".join(f"{ratios[r]:.2f}x at {r} row{'s' if r > 1 else ''}" for r in sorted(ratios, reverse=True))
    return (f"{precision}, auto: the packed kernel {measured} of MKL's speed; packs where faster at the "
            f"verification's rows and >= {PACK_AT_ONE_ROW}x at one{padded}")


def apply_precision(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """Return `model` in `precision` ("fp32": unchanged; "fp32-packed": its Linear layers packed for oneDNN, in
    place, CPU only; "int8": dynamic int8 Linear layers, CPU only)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is invalid: expected one of {PRECISIONS}.")
    if precision == "fp32":
        return model
    if precision == "fp32-packed":
        return pack_linear_layers(model)
    if model.device.type != "cpu":
        raise ValueError(f"precision='int8' (dynamic quantization) runs on CPU only; the model is on {model.device}.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notice
        quantized = torch.ao.quantization.quantize_dynamic(model.float(), {torch.nn.Linear}, dtype=torch.qint8)
    return quantized.eval()


def count_parameters(model: torch.nn.Module) -> int:
    """The model's parameter count as its architecture has it, quantized layers included (a dynamically quantized
    Linear keeps its weight and bias in packed params, which `model.parameters()` does not list; a quantized head
    tied to the input embeddings is that one matrix, counted once)."""
    total = sum(p.numel() for p in model.parameters())
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    config = getattr(model, "config", None)
    tied = bool(getattr(config, "tie_word_embeddings", False)) if config is not None else False
    for module in model.modules():
        if tied and module is head:
            continue
        if isinstance(module, torch.ao.nn.quantized.dynamic.Linear):
            weight, bias = module._weight_bias()
            total += weight.numel() + (bias.numel() if bias is not None else 0)
        elif isinstance(module, PackedLinear):  # its bias is a parameter, its weight is not
            total += module.in_features * module.out_features
    return total
