"""Saguaro sampling (Definition 14): reshape the draft distribution so the bonus token lands in the cache.

After a rejection the bonus token is drawn from max(p - q, 0). Down-weighting the draft's own top candidates by
C < 1 raises p - q exactly where the next round's cache has branches. Verification must use the SAME rescaled
q the tokens were sampled from, which keeps the scheme lossless.
"""

from __future__ import annotations

import math

import torch

from .warpers import warp


def saguaro_logits(logits: torch.Tensor, top: int, c: float) -> torch.Tensor:
    """Add log(C) to the `top` largest logits of each row (σ_{F,C}); a no-op for C = 1 or top = 0."""
    if c >= 1.0 or top <= 0:
        return logits
    top = min(top, logits.shape[-1])
    idx = logits.topk(top, dim=-1).indices
    return logits.scatter_add(-1, idx, torch.full_like(idx, math.log(c), dtype=logits.dtype))


def draft_probs(logits: torch.Tensor, warpers, top: int, c: float) -> torch.Tensor:
    """The draft's sampling distribution q: sampling warpers (temperature, top-k/p, min-p), then Saguaro.

    `warpers` take `(input_ids, scores)` and ignore `input_ids`, as transformers' warpers do. Warpers run
    first, so the candidates Saguaro down-weights are the ones the warped draft ranks highest.
    """
    scores = saguaro_logits(warp(warpers, logits.float()), top, c)
    return torch.softmax(scores, dim=-1)
