"""Shared-prefix tree attention over the draft's KV cache: visibility patterns, positions and 4D masks.

Every tensor has a leading row (batch) dimension b. All branches of all rows are decoded together, one draft
forward per tree step. Per row the cache holds [main path M | tree step 1 (B slots) | ... ]: the main path is
the row's committed tokens plus its glue [t_prev, s_1..s_K], possibly with invalid slots (left padding, holes
left by dummy queries) in between. Main-path slots carry unique logical positions, so a branch that forks after
glue position j sees exactly the main-path slots at positions <= glue_start + j, plus its own earlier tree tokens.
RoPE positions are logical positions, not slots.
"""

from __future__ import annotations

import torch


def causal_visibility(key_valid: torch.Tensor, num_new: int, new_valid: torch.Tensor | None = None) -> torch.Tensor:
    """[b, N, L+N]: N new tokens per row see every valid cached slot and the earlier valid new tokens.

    `key_valid` [b, L]; `new_valid` [b, N] marks the real new tokens (default: all). An invalid (dummy) query
    sees only itself, so its softmax stays finite; nothing else ever sees it.
    """
    rows = key_valid.shape[0]
    old = key_valid[:, None, :].expand(rows, num_new, -1)
    causal = torch.ones(num_new, num_new, dtype=torch.bool, device=key_valid.device).tril()
    new = causal[None].expand(rows, -1, -1)
    if new_valid is not None:
        new = (new & new_valid[:, None, :]) | torch.eye(num_new, dtype=torch.bool, device=key_valid.device)
    return torch.cat([old, new], dim=2)


def main_path_visibility(key_valid: torch.Tensor, key_pos: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """[b, Q, M]: query q of row r sees the valid main-path slots at logical positions <= limit[r, q]."""
    return key_valid[:, None, :] & (key_pos[:, None, :] <= limit[:, :, None])


def tree_step_visibility(
    main_valid: torch.Tensor, main_pos: torch.Tensor, glue_start: torch.Tensor, forks: torch.Tensor, step: int
) -> torch.Tensor:
    """[b, B, M + step·B]: visibility for the `step`-th tree forward (1-based), whose B tokens per row come last.

    Branch β of row r forks after glue position forks[r, β]: it sees the main path up to glue_start[r] +
    forks[r, β] and its own tokens of the earlier steps.
    """
    rows, branches = forks.shape
    limit = glue_start[:, None] + forks
    main = main_path_visibility(main_valid, main_pos, limit)
    own = torch.eye(branches, dtype=torch.bool, device=forks.device).repeat(1, step)
    return torch.cat([main, own[None].expand(rows, -1, -1)], dim=2)


def tree_step_positions(glue_start: torch.Tensor, forks: torch.Tensor, step: int) -> torch.Tensor:
    """[b, B]: logical position of each branch's token in tree step `step` (the candidate is step 1);
    `forks` [b, B]."""
    return glue_start[:, None] + forks + step


def additive_mask(
    visible: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    dtype: torch.dtype,
    window: int | None = None,
) -> torch.Tensor:
    """[b, 1, N, L] float mask (0 = attend, dtype-min = masked) from a visibility pattern [b, N, L].

    With a sliding `window`, a query at position p also only sees keys at positions > p - window (the same
    rule as transformers' `sliding_window_overlay`, applied to logical positions [b, N] and [b, L]).
    """
    allowed = visible
    if window is not None:
        allowed = allowed & (key_pos[:, None, :] > query_pos[:, :, None] - window)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=visible.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]
