"""How a round's next speculation is made (`LookaheadPolicy._mode`) and how much speculation must promise before it
is chosen over plain steps (the margins)."""

from __future__ import annotations

from .estimates import expected_tokens

# How the next speculation is made (`LookaheadPolicy._mode`): by the draft during this verification, by the draft
# after it (the draft sits the verification out and both run on every core in turn), or not at all.
CONCURRENT, SERIAL, PLAIN = "concurrent", "serial", "plain"
# Speculation must promise this much more than plain steps before it is chosen over them: the estimates are noisy
# and a wrong switch costs a speculative round instead of a plain step, so near a tie plain decoding wins. Returning
# from plain steps asks more (hysteresis): the estimates then rest on probes of the first position only. Both are
# the margins where a speculative round costs twice a plain step (MKL's fp32 curve on CPUs); they shrink in
# proportion to what a wrong switch costs (`_margin`): with a flat curve (packed CPU kernels, GPUs) a speculative
# round costs little more than a plain step, and waiting for certainty costs more than it saves.
SPECULATE_MARGIN = 1.05
RESUME_MARGIN = 1.2


def _margin(base: float, acceptance: list[float], speeds: dict[int, float], *more: dict[int, float]) -> float:
    """`base` scaled by the price of a wrong switch: the fastest speculative round's time over a plain step's, minus
    one (capped at 1: the steep curve the base margins were set for)."""
    if 0 not in speeds:
        return base
    options = [(k, v) for table in (speeds, *more) for k, v in table.items() if k > 0 and v > 0]
    if not options:
        return base
    k, v = max(options, key=lambda kv: kv[1])
    extra = expected_tokens(acceptance, k) / v * speeds[0] - 1.0  # R(k) / R(0) - 1
    return 1.0 + (base - 1.0) * min(max(extra, 0.0), 1.0)


def _best(speeds: dict[int, float], margin: float = SPECULATE_MARGIN) -> int:
    """The fastest K, but a plain step (K = 0) unless speculation beats it by `margin`."""
    best = max(speeds, key=speeds.get)
    if best > 0 and 0 in speeds and speeds[best] < margin * speeds[0]:
        return 0
    return best
