"""Where the draft runs: a background worker thread (concurrent with verification) or inline.

All runtime concerns live here: the worker thread and its intra-op thread count, the target's thread count
while SSD runs, device synchronisation of the worker's results, cancellation and clean shutdown.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class DraftCancelled(Exception):
    """Raised inside draft work when the generation it served has ended."""


def available_cores() -> int:
    """CPU cores this process may run on (respects affinity masks and container limits where the OS tells)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def resolve_executor(kind: str, draft_device: torch.device, target_device: torch.device) -> str:
    """The concrete executor for `kind` ("auto" picks the background thread wherever two can run)."""
    if kind == "stream":
        raise ValueError(
            "SSDConfig.executor='stream' is reserved for the CUDA stream path, which is not available yet; "
            "use 'thread' (the draft on a background thread) or 'sync'."
        )
    if kind == "auto":
        return "thread" if available_cores() >= 2 or draft_device != target_device else "sync"
    return kind


def split_threads(draft_threads: int | None, target_threads: int | None) -> tuple[int, int]:
    """Intra-op threads for (draft, target): by default half the cores each, at least one."""
    cores = available_cores()
    draft = draft_threads or max(1, cores // 2)
    target = target_threads or max(1, cores - draft)
    return draft, target


class DraftRuntime:
    """Runs the drafter's methods on a single background thread ("thread") or inline ("sync").

    Used as a context manager around one generation: on exit (normal, error or KeyboardInterrupt) pending work
    is cancelled, the running task stops at its next check, the worker thread is joined and the caller's torch
    thread count is restored. `busy_seconds` is the time spent in draft work.
    """

    def __init__(self, kind: str, draft_threads: int, target_threads: int, draft_device: torch.device):
        self.kind = kind
        self.draft_threads, self.target_threads = draft_threads, target_threads
        self.draft_device = torch.device(draft_device)
        self.stop = threading.Event()
        self.busy_seconds = 0.0
        self._pool: ThreadPoolExecutor | None = None
        self._saved_threads: int | None = None

    def __enter__(self) -> DraftRuntime:
        if self.draft_device.type == "cpu" or self.kind == "sync":
            self._saved_threads = torch.get_num_threads()
            torch.set_num_threads(self.target_threads if self.kind == "thread" else self._saved_threads)
        if self.kind == "thread":
            self._pool = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="hf-ssd-draft", initializer=torch.set_num_threads,
                initargs=(self.draft_threads,),
            )
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.stop.set()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self._saved_threads is not None:
            torch.set_num_threads(self._saved_threads)
            self._saved_threads = None

    @contextlib.contextmanager
    def all_cores(self):
        """While the other side is idle or nearly so (the prefill), let the calling thread use every core this
        generation was given (draft + target threads); restores its own count after."""
        if self.kind != "thread" or self._saved_threads is None:
            yield
            return
        saved = torch.get_num_threads()
        torch.set_num_threads(self.draft_threads + self.target_threads)
        try:
            yield
        finally:
            torch.set_num_threads(saved)

    def on_all_cores(self, fn):
        """`fn` wrapped to run under `all_cores()` (for draft work submitted while the target waits)."""
        def wrapped(*args):
            with self.all_cores():
                return fn(*args)

        return wrapped

    def check(self) -> None:
        """Called by draft work between forwards: abandon the task once the generation has ended."""
        if self.stop.is_set():
            raise DraftCancelled()

    def _run(self, fn, args):
        start = time.perf_counter()
        try:
            with torch.no_grad():
                result = fn(*args)
                if self.draft_device.type not in ("cpu", "meta"):
                    torch.get_device_module(self.draft_device).synchronize(self.draft_device)
            return result
        finally:
            self.busy_seconds += time.perf_counter() - start

    def submit(self, fn, *args) -> Future:
        """Schedule `fn(*args)`; tasks run one at a time, in submission order."""
        if self._pool is not None:
            return self._pool.submit(self._run, fn, args)
        future: Future = Future()
        try:
            future.set_result(self._run(fn, args))
        except Exception as err:  # KeyboardInterrupt and SystemExit propagate at once
            future.set_exception(err)
        return future
