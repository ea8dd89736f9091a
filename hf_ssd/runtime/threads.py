"""CPU cores and intra-op thread counts: how many each side gets while SSD runs, and every core for a prefill."""

from __future__ import annotations

import contextlib
import os

import torch


def available_cores() -> int:
    """CPU cores this process may run on (respects affinity masks and container limits where the OS tells)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def split_threads(draft_threads: int | None, target_threads: int | None) -> tuple[int, int]:
    """Intra-op threads for (draft, target): by default half the cores each, at least one."""
    cores = available_cores()
    draft = draft_threads or max(1, cores // 2)
    target = target_threads or max(1, cores - draft)
    return draft, target


@contextlib.contextmanager
def torch_threads(count: int | None):
    """Run the block with `count` intra-op threads in the calling thread (None: unchanged), then restore."""
    if count is None:
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
