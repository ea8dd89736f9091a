"""Shared-prefix tree attention over the draft's KV cache: visibility patterns, positions and 4D masks.

All branches of a round are decoded together, one draft forward per tree step. The cache holds
[prefix P | glue G = K+1 | tree step 1 (B slots) | ... ]. Branch b forks after glue position j_b: it sees the
prefix, glue positions 0..j_b and its own earlier tree tokens. RoPE positions are logical positions, not slots.
"""

from __future__ import annotations

import torch


def causal_visibility(key_valid: torch.Tensor, num_new: int) -> torch.Tensor:
    """[N, L+N]: N new tokens appended after L cached slots see every valid slot and earlier new tokens."""
    old = key_valid[None, :].expand(num_new, -1)
    new = torch.ones(num_new, num_new, dtype=torch.bool, device=key_valid.device).tril()
    return torch.cat([old, new], dim=1)


def fork_visibility(forks: torch.Tensor, glue_len: int) -> torch.Tensor:
    """[B, G]: glue position j is visible to a branch that forks after position j_b iff j <= j_b."""
    return torch.arange(glue_len, device=forks.device)[None, :] <= forks[:, None]


def tree_step_visibility(prefix_valid: torch.Tensor, forks: torch.Tensor, glue_len: int, step: int) -> torch.Tensor:
    """[B, P + G + step·B]: visibility for the `step`-th tree forward (1-based), whose B tokens come last."""
    branches = forks.shape[0]
    prefix = prefix_valid[None, :].expand(branches, -1)
    own = torch.eye(branches, dtype=torch.bool, device=forks.device).repeat(1, step)
    return torch.cat([prefix, fork_visibility(forks, glue_len), own], dim=1)


def tree_step_positions(glue_start: int, forks: torch.Tensor, step: int) -> torch.Tensor:
    """[B]: logical position of each branch's token in tree step `step` (the candidate is step 1)."""
    return glue_start + forks + step


def additive_mask(
    visible: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    dtype: torch.dtype,
    window: int | None = None,
) -> torch.Tensor:
    """[1, 1, N, L] float mask (0 = attend, dtype-min = masked) from a visibility pattern.

    With a sliding `window`, a query at position p also only sees keys at positions > p - window (the same
    rule as transformers' `sliding_window_overlay`, applied to logical positions).
    """
    allowed = visible
    if window is not None:
        allowed = allowed & (key_pos[None, :] > query_pos[:, None] - window)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=visible.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]
