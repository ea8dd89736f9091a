"""CPU cores and intra-op thread counts: how many each side gets while SSD runs, every core for a prefill, how many
draft a speculation just in time (measured: `ThreadChoice`). What more threads gain the target is probed on its
layers (`layer_probe.thread_gain`)."""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from collections.abc import Callable

import torch

from ..ema import DecayedMean


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


def own_threads(count: int) -> None:
    """Give the calling (new) thread `count` intra-op threads for good. torch initialises a thread's OpenMP team size
    lazily, at its first parallel region, from the last `torch.set_num_threads` of any thread: a plain
    `set_num_threads(count)` here is undone if the target's thread sets another count before the draft's first op.
    The draft's thread then ran two threads beside the target's on 2 cores, libgomp stopped spinning (more threads
    than cores) and every parallel region of the target's thread paid a wake-up from then on: the draft's steps on
    every core took 55 ms instead of 34 (0.5B int8, 2-core Xeon), as slow as on one."""
    torch.get_num_threads()  # the lazy initialisation, now, so that the count set next stays
    torch.set_num_threads(count)


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


class ThreadChoice:
    """Which of a few intra-op thread counts runs a recurring job fastest here, learnt from its own runs.

    Used for the draft's just-in-time drafting (a serial round's speculation, drafted while the target waits): each
    count is tried in turn until it has `tries` runs, then the one with the lowest running mean of seconds per unit
    of work (a drafted token) wins, the others tried again every `retry` runs since a machine's load moves. Tiny
    decode steps of a small or int8 draft often run slower on more threads (0.5B int8 on a 2-core EPYC: 46-76 ms a
    token on one thread, 85-110 ms on two), a larger draft's faster: only timing tells."""

    def __init__(self, candidates: tuple[int, ...], tries: int = 2, retry: int = 32, decay: float = 0.7):
        self.candidates = tuple(dict.fromkeys(c for c in candidates if c >= 1)) or (1,)

        self.tries, self.retry = tries, retry
        self._seconds = {count: DecayedMean(decay) for count in self.candidates}  # per unit of work
        self.runs: dict[int, int] = dict.fromkeys(self.candidates, 0)
        self.calls = 0

    @property
    def mean(self) -> dict[int, float]:
        """Seconds per unit of work of each count run so far (decayed means)."""
        return {count: ema.value for count, ema in self._seconds.items() if ema.value is not None}

    def pick(self) -> int:
        """The thread count for the next run."""
        self.calls += 1
        for count in self.candidates:
            if self.runs[count] < self.tries:
                return count
        mean = self.mean
        best = min(mean, key=mean.get)
        if self.calls % self.retry == 0:  # one of the others, in turn
            others = [c for c in self.candidates if c != best]
            if others:
                return others[(self.calls // self.retry) % len(others)]
        return best

    def record(self, count: int, seconds: float, units: int) -> None:
        """A run on `count` threads took `seconds` for `units` of work."""
        if units < 1 or count not in self.runs:
            return
        self.runs[count] += 1
        self._seconds[count].add(seconds / units)

    def run(self, job: Callable[[], object], units: Callable[[object], int]):
        """`job()` on the picked thread count (the caller's restored after), recorded with `units(result)` units of
        work; its result."""
        count = self.pick()
        with torch_threads(count):
            start = time.perf_counter()
            result = job()
            seconds = time.perf_counter() - start
        self.record(count, seconds, units(result))
        return result


_CHOICES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def drafting_threads(draft: torch.nn.Module, candidates: tuple[int, ...]) -> ThreadChoice:
    """The `ThreadChoice` of just-in-time drafting for `draft` among `candidates`, kept as long as the model lives
    (every generation with the same draft and cores learns from the earlier ones)."""
    per_model = _CHOICES.setdefault(draft, {})
    return per_model.setdefault(tuple(candidates), ThreadChoice(tuple(candidates)))


def drafted_tokens(resolutions) -> int:
    """Tokens a just-in-time resolve drafted per row (its speculations share one length): `ThreadChoice`'s unit."""
    return int(resolutions[0].speculation.tokens.shape[0]) if resolutions else 0
