"""Ragged rows in one rectangular batch: which slots each row keeps, right-aligned to a common edge.

After a round, rows have kept different numbers of slots (ragged acceptance). `compact` turns a per-row keep mask
into a gather index that packs every row's kept slots, in order, against the right edge, with left padding. The
target's tokens, attention mask, positions and KV and the draft's KV all go through it, so real tokens stay
contiguous (2D masks, positions and sliding windows keep their standard meaning) and memory stays bounded by
rows x the longest row.
"""

from __future__ import annotations

import torch


def compact(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index [b, W], valid [b, W]) from `keep` [b, L]: row r's kept slots, in order, right-aligned.

    W is the largest number of slots any row keeps; row r's first W - kept_r entries are padding
    (`valid` False, `index` pointing at some dropped or first slot).
    """
    width = int(keep.sum(dim=1).max()) if keep.numel() else 0
    order = torch.argsort(keep.to(torch.int8), dim=1, stable=True)  # dropped slots first, kept ones after, in order
    index = order[:, keep.shape[1] - width :]
    return index, keep.gather(1, index)


def keep_leading(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[b, width] mask keeping the first lengths[r] slots of each row."""
    return torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]


def gather_slots(tensor: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """`tensor` [b, ..., L, ...] gathered along slot dimension `dim` with a per-row `index` [b, W]."""
    dim = dim % tensor.dim()
    shape = [index.shape[0]] + [1] * (tensor.dim() - 1)
    shape[dim] = index.shape[1]
    expanded = index.reshape(shape).expand(*[s if i != dim else index.shape[1] for i, s in enumerate(tensor.shape)])
    return tensor.gather(dim, expanded)
