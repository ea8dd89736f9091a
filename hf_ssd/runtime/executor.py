"""The one interface through which the round loop reaches the draft, wherever it runs.

An executor owns the drafter of one generation and runs its tasks in order: `begin` (prefill and first
speculations), then per round `prepare` (glue, fork, tree: concurrent with verification), `announce` (the
verification outcomes, so a running `prepare` can stop early) and `resolve` (commit the outcomes, look the next
speculations up, run the backup on a miss); after plain steps taken in a row with the draft paused, `sat_out`.
`prepare`, `begin`, `resolve` and `sat_out` return a pending result (anything with `.result()`); the loop never
knows whether an inline call, a thread or a process answered.

Kinds: "sync" (inline), "thread" (one background thread, `local.py`), "stream" (that thread issuing onto a side
stream of the draft's device, hand-offs by events, `stream.py`), "process" (a persistent worker process that
shares the draft's weights, `process.py`). `choose_executor` resolves "auto".
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from .threads import available_cores, torch_threads


class DraftCancelled(Exception):
    """Raised inside draft work when the generation it served has ended."""


class DraftWorkerError(RuntimeError):
    """The draft's worker process died, or could not be started or reached."""


@dataclass
class DraftRequest:
    """Everything needed to build the drafter of one generation (plain data, so it can cross processes)."""

    config: dict[str, Any]  # `SSDConfig.to_dict()`
    do_sample: bool
    warpers: list  # the target's sampling warpers; q is shaped by the same ones
    vocab_size: int
    seed: int
    draft_threads: int
    target_threads: int


class DraftExecutor(ABC):
    """Runs one generation's drafter; a context manager that cancels pending work and cleans up on exit
    (normal return, error or KeyboardInterrupt)."""

    kind: str = ""

    def __init__(self, request: DraftRequest, draft_device: torch.device):
        self.request = request
        self.draft_device = torch.device(draft_device)
        self.start_seconds = 0.0  # start-up this call paid (the process executor's worker)
        self.load_seconds = 0.0  # handing the draft over (the process executor)
        self._saved_threads: int | None = None

    # --- the round protocol ----------------------------------------------------------------------------------
    @abstractmethod
    def begin(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, depth: int):
        """Prefill the prompts and draft the first speculations, `depth` tokens (0: none, the first round is a plain
        step); pending `list[Speculation]`, one per row."""

    @abstractmethod
    def prepare(self, verified: int, depth: int, budget: int):
        """Start preparing the outcomes of verifying the first `verified` tokens of the speculations handed out last,
        the next speculations `depth` tokens long, `budget` branches per row; pending None."""

    @abstractmethod
    def announce(self, accepted: list[int], bonus: list[int]) -> None:
        """The outcomes of the verification `prepare` works for (a hint: `prepare` may stop early)."""

    @abstractmethod
    def resolve(self, accepted: list[int], bonus: list[int], verified: int, keep_rows: list[int], backup: str,
                serial: int = 0, stop=None, runner_up: list[int] = ()):
        """Commit the outcomes; pending `list[Resolution]` for the rows in `keep_rows` (positions in the batch).
        After a verification the draft sat out (`prepare` of depth 0), `serial` > 0 drafts up to that many tokens
        now, on every core (the target waits for them). Drafting just in time stops early where `stop` (a
        `StopRule`; None: never) says. `runner_up`: the rows (positions in the batch) whose first drafted token the
        target replaced by the draft's runner-up (`Speculation.runner_up`): their accepted tokens start with it."""

    @abstractmethod
    def sat_out(self, rounds: list[tuple]):
        """Commit rounds the draft sat out after a paused round (a plain stretch), each (outcomes as (accepted,
        bonus) per row, verified, keep_rows[, runner_up rows]); pending `list[Resolution]` (empty speculations) for
        the rows the last keeps. The same as a `prepare` at depth 0 and a `resolve` per round, in one call."""

    @abstractmethod
    def timings(self):
        """The drafter's running `DraftTimings` (for `backup="auto"`)."""

    @abstractmethod
    def finish(self):
        """The drafter's `DraftReport`, once the last task has been waited for."""

    @property
    @abstractmethod
    def busy_seconds(self) -> float:
        """Time spent in draft tasks so far."""

    # --- threads and lifetime --------------------------------------------------------------------------------
    def target_cores(self):
        """Context for the target's prefill, when the draft is (nearly) idle: every core this generation has."""
        if self._saved_threads is None:
            return contextlib.nullcontext()
        return torch_threads(self.request.draft_threads + self.request.target_threads)

    def __enter__(self) -> DraftExecutor:
        if self.kind != "sync" and self.draft_device.type == "cpu":
            self._saved_threads = torch.get_num_threads()
            torch.set_num_threads(self.request.target_threads)
        try:
            self.start()
        except BaseException:
            self._restore_threads()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.close()
        finally:
            self._restore_threads()

    def _restore_threads(self) -> None:
        if self._saved_threads is not None:
            torch.set_num_threads(self._saved_threads)
            self._saved_threads = None

    @abstractmethod
    def start(self) -> None:
        """Acquire what the executor runs on (a thread, a worker process)."""

    @abstractmethod
    def close(self) -> None:
        """Cancel pending work, wait until the draft side is idle, release it. Idempotent."""


def choose_executor(kind: str, draft_model, target_device: torch.device) -> str:
    """The concrete executor for `kind`.

    "auto" (rule measured on 2-core CPUs, docs/design.md "Executors"): with at least two cores or a draft on its own
    device, the draft runs concurrently with verification; a CPU draft in a worker process once one is running for
    this interpreter (the GIL then costs neither side: on small pairs SSD runs 10-25 % faster than with a thread,
    on large ones the same), else on a thread, the worker starting in the background when that call returns if the
    draft's steps were short enough for it to pay (`local.worker_pays`; its start-up, 3-4 s of a core, and the
    draft's hand-over exceed many whole generations and slow the calls they overlap). A CUDA draft
    runs on the stream executor (a thread issuing onto a side stream of its device). One core and one device:
    inline ("sync").
    """
    if kind != "auto":
        return kind
    draft_device = torch.device(draft_model.device)
    if available_cores() < 2 and draft_device == torch.device(target_device):
        return "sync"
    if draft_device.type == "cpu":
        from .pool import POOL

        if POOL.ready_for(draft_model):
            return "process"
        return "thread"
    return "stream"


def open_executor(kind: str, draft_model, request: DraftRequest, requested: str | None = None,
                  target_device: torch.device | str = "cpu") -> DraftExecutor:
    """A new executor of `kind` ("sync", "thread", "stream" or "process") for one generation; use it as a context
    manager. `target_device` is where the target consumes the draft's results (the stream executor's hand-offs).

    `requested` is what the configuration asked for: when "auto" settled on a thread for a CPU draft, a worker
    process is started in the background once this generation is over, for the calls that follow, where the
    draft's steps were short enough for it to pay (`local.worker_pays`)."""
    if kind == "process":
        from .process import ProcessExecutor

        return ProcessExecutor(draft_model, request)
    if kind == "stream":
        from .stream import StreamExecutor

        return StreamExecutor(draft_model, request, target_device)
    from .local import LocalExecutor

    executor = LocalExecutor(kind, draft_model, request)
    if requested == "auto" and kind == "thread" and torch.device(draft_model.device).type == "cpu":
        from .pool import POOL, shareable

        if shareable(draft_model) is None:
            executor.after_close = POOL.warm
    return executor
