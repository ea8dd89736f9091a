"""Sampling warpers: the logits processors that act on scores alone (no token ids, no per-row state).

The draft applies exactly these, in the target's order, to q (`saguaro.draft_probs`); the target applies the
ones that end its processor list to every verified position in one call (`target_rows.process_rows`), since a
warper's output at a position depends on that position's scores only.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

SAMPLING_WARPERS = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TopHLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
)


def sampling_warpers(logits_processor) -> list:
    """The processors among `logits_processor` that the draft applies to q too (see `SAMPLING_WARPERS`)."""
    return [p for p in (logits_processor or []) if isinstance(p, SAMPLING_WARPERS)]


def split_trailing_warpers(logits_processor) -> tuple[list, list]:
    """`logits_processor` as (the processors up to its last one that reads token ids or row state, the sampling
    warpers after it): transformers puts the warpers last, so for sampling the second part is usually all of them."""
    processors = list(logits_processor or [])
    cut = len(processors)
    while cut and isinstance(processors[cut - 1], SAMPLING_WARPERS):
        cut -= 1
    return processors[:cut], processors[cut:]


def warp(warpers: list, scores: torch.Tensor) -> torch.Tensor:
    """`scores` [..., V] through `warpers` in order, every leading position at once (warpers ignore token ids)."""
    if not warpers:
        return scores
    flat = scores.reshape(-1, scores.shape[-1])
    for warper in warpers:
        flat = warper(None, flat)
    return flat.reshape(scores.shape)
