"""What the target's forward costs on this machine, probed on one of its middle blocks before the first round: what
more intra-op threads gain it (`thread_gain`) and how its cost rises with the positions a forward covers
(`cost_curve`). Each is probed once per model and shape, on the model's own layers with its own dtype and kernels,
and never stops a generation: None where it cannot be probed (no linear layer on the CPU, a layer that wants other
inputs)."""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Callable

import torch

from .threads import torch_threads

_GAINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CURVES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def thread_gain(model: torch.nn.Module, threads: int, more: int, rows: int = 3, repeats: int = 5) -> float | None:
    """How many times faster `model` runs on `more` intra-op threads than on `threads`: the median of `repeats`
    runs of one middle block's linear layers (`_probe_layers`) over `rows` positions at each count, after two
    warm-up runs; probed once per model, thread counts and rows (~0.17 s for Qwen2.5-Coder 1.5B fp32 on 2 cores).
    What the target gains when the draft sits a verification out (every core) over one beside the working draft
    (its own cores), known before the first round. On a 2-core Xeon it read 1.8-2.0 (int8: 1.9-2.1), where the
    whole model gained 1.80-1.91x and a verification beside the working draft took 1.8x a serial one; a single
    layer read 0.3-2.7 (1 ms runs) and the output embedding alone takes 68 ms a run. 1.0 where `more` is no more
    than `threads`; None where the model has no linear layer on the CPU or the probe fails."""
    if more <= threads or threads < 1:
        return 1.0
    return _cached(_GAINS, model, (threads, more, rows), lambda: _probe_gain(model, threads, more, rows, repeats))


def cost_curve(model: torch.nn.Module, threads: int, positions: tuple[int, ...], passes: int = 2
               ) -> dict[int, float] | None:
    """A forward's cost over n positions relative to one position, for each n of `positions`, on `threads` intra-op
    threads: one middle block's linear layers timed at each n (the fastest of `passes` interleaved passes, after one
    warm-up run), made non-decreasing in n and never below 1 (noise never makes more positions cheaper; where the
    kernels truly are, pricing the deeper K at the shallower one's cost only leaves its tokens to decide). Probed
    once per model, threads and positions (~0.2 s for Qwen2.5-Coder 1.5B fp32 on 2 cores at 1-5, 8, 12 and 17).

    The shape the policy prices an unmeasured K by: on a 2-core Xeon with MKL's kernels it read 1.0 at 1-3
    positions, 2.0-2.1 at 4-6, 2.6 at 7-9 and 3.2 at 12, where the whole model took 234, 261, 486, 493, 670 and
    816 ms at 1, 3, 4, 5, 7 and 12 positions (1.0, 1.1, 2.1, 2.1, 2.9, 3.5); the prior shape (`costs.CPU_SHAPE`)
    says 2.0 at 2 positions and +0.1 per further one. None where it cannot be probed."""
    sizes = tuple(sorted({1, *(n for n in positions if n >= 1)}))
    return _cached(_CURVES, model, (threads, sizes), lambda: _probe_curve(model, threads, sizes, passes))


def _cached(store: weakref.WeakKeyDictionary, model: torch.nn.Module, key: tuple, probe: Callable[[], object]):
    try:
        known = store.setdefault(model, {})
    except TypeError:  # not weakly referable: probed every time
        known = {}
    if key not in known:
        known[key] = probe()
    return known[key]


def _probe_gain(model: torch.nn.Module, threads: int, more: int, rows: int, repeats: int) -> float | None:
    run = _block_runner(model, (rows,))
    if run is None:
        return None

    def seconds(count: int) -> float:
        with torch_threads(count):
            for _ in range(2):
                run(rows)
            return statistics.median(_timed(run, rows) for _ in range(repeats))

    try:
        with torch.no_grad():
            few, many = seconds(threads), seconds(more)
    except Exception:  # an exotic layer (a quantized or packed one that wants other inputs): no probe
        return None
    return few / many if many > 0 else None


def _probe_curve(model: torch.nn.Module, threads: int, sizes: tuple[int, ...], passes: int
                 ) -> dict[int, float] | None:
    run = _block_runner(model, sizes)
    if run is None:
        return None
    fastest = dict.fromkeys(sizes, float("inf"))
    try:
        with torch.no_grad(), torch_threads(threads):
            run(sizes[-1])
            for _ in range(max(passes, 1)):  # interleaved: a slow moment slows one size's run, not all of its runs
                for n in sizes:
                    fastest[n] = min(fastest[n], _timed(run, n))
    except Exception:  # as in `_probe_gain`
        return None
    if not fastest[1] > 0:
        return None
    curve, highest = {}, 1.0
    for n in sizes:
        highest = max(highest, fastest[n] / fastest[1])
        curve[n] = highest
    return curve


def _timed(run: Callable[[int], None], n: int) -> float:
    start = time.perf_counter()
    run(n)
    return time.perf_counter() - start


def _block_runner(model: torch.nn.Module, sizes: tuple[int, ...]) -> Callable[[int], None] | None:
    """A function running `_probe_layers(model)` over n positions (n among `sizes`, inputs made once, from a
    generator of its own: the caller's random stream stays as it was); None where there is nothing to probe on the
    CPU."""
    layers = _probe_layers(model)
    if not layers:
        return None
    generator, inputs = torch.Generator().manual_seed(0), []
    for layer in layers:
        weight = next(layer.parameters(), None)
        if weight is not None and weight.device.type != "cpu":
            return None
        dtype = weight.dtype if weight is not None and weight.is_floating_point() else torch.float32
        inputs.append(torch.randn(1, max(sizes), layer.in_features, generator=generator).to(dtype))

    def run(n: int) -> None:
        for layer, x in zip(layers, inputs):
            layer(x[:, :n])

    return run


def _probe_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The linear layers of one of `model`'s middle blocks (the longest `ModuleList`'s middle entry; the whole model
    where it has none), the output embedding left out: modules with `in_features` and `out_features` (plain,
    quantized and packed linear layers alike), the outermost where one holds another."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    blocks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    scope = blocks and max(blocks, key=len)
    root = scope[len(scope) // 2] if scope else model
    linear = [m for m in root.modules() if m is not output and isinstance(getattr(m, "in_features", None), int)
              and isinstance(getattr(m, "out_features", None), int)]
    inner = {id(c) for m in linear for c in m.modules() if c is not m}
    return [m for m in linear if id(m) not in inner]
