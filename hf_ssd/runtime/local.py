"""The drafter in this process: inline ("sync") or on one background thread ("thread", concurrent with verification).

Both run the same calls in the same order as far as the draft's state and random generator are concerned, so they
(and the process executor) give identical outputs for a seed.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..config import SSDConfig
from ..generation.candidate_generator import SaguaroCandidateGenerator
from .executor import DraftCancelled, DraftExecutor, DraftRequest
from .threads import drafted_tokens, drafting_threads, own_threads, torch_threads

logger = logging.getLogger(__name__)


# A draft step (one token's forward) at least this long gains nothing from a worker process over a thread: the GIL's
# share of it is small. Measured on 2 cores: the small pair's 4-25 ms forwards ran 10-25 % faster in a process; the
# Qwen 0.5B int8 draft's 35 ms steps ran as fast on the thread (SSD 4.79 against 4.53 tok/s over four prompts, one
# run), where the worker's start and the draft's hand-over (~9 s of a core, 6 s of it the int8 draft's pickling and
# repacking) slowed the calls they overlapped to 0.70-0.80x plain decoding.
WORKER_PAYS_BELOW = 0.02


def worker_pays(timings) -> bool:
    """Whether a worker process would pay for this draft, from the seconds of its steps in the generation just run
    (`DraftTimings`): the quicker of a token drafted just in time (on average) and the quickest prepare's forwards
    (at least two: glue and tree; a short warm-up call's mean is its cold first prepare); no steps timed: yes."""
    steps = []
    if timings.serial_steps:
        steps.append(timings.serial_step_seconds / timings.serial_steps)
    if timings.prepare_calls:
        steps.append(timings.fastest_prepare / 2)
    return not steps or min(steps) < WORKER_PAYS_BELOW


class LocalExecutor(DraftExecutor):
    """Runs the drafter's tasks one at a time, in submission order, inline or on a single worker thread (the stream
    executor, `stream.py`, is this with the draft's work on a side stream of its device)."""

    def __init__(self, kind: str, draft_model: torch.nn.Module, request: DraftRequest):
        if kind not in ("sync", "thread"):
            raise ValueError(f"LocalExecutor runs 'sync' or 'thread', not {kind!r}")
        super().__init__(request, draft_model.device)
        self.kind = kind
        self._stop = threading.Event()
        self._busy = 0.0
        self._pool: ThreadPoolExecutor | None = None
        self._last: Future | None = None
        self.after_close = None  # called once the generation is over (see `open_executor`)
        self.drafter = SaguaroCandidateGenerator(
            draft_model, SSDConfig.coerce(request.config), request.do_sample, request.warpers, request.vocab_size,
            request.seed, check=self._check,
        )

    def start(self) -> None:
        if self.kind != "sync":
            self._pool = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="hf-ssd-draft", initializer=own_threads,
                initargs=(self.request.draft_threads,),
            )

    def close(self) -> None:
        """Stop work in flight (the running task at its next check), join the thread."""
        self._stop.set()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        after, self.after_close = self.after_close, None
        if after is not None and worker_pays(self.drafter.timings):
            after()
        last, self._last = self._last, None
        if last is not None and last.done() and not last.cancelled():
            error = last.exception()
            if error is not None and not isinstance(error, DraftCancelled):
                logger.warning("hf_ssd: abandoned draft work failed: %r", error)

    def _check(self) -> None:
        if self._stop.is_set():
            raise DraftCancelled()

    def _run(self, fn, args, settle: bool = True):
        start = time.perf_counter()
        try:
            with torch.no_grad():
                result = fn(*args)
                if settle:
                    self._settle()
            return result
        finally:
            self._busy += time.perf_counter() - start

    def _settle(self) -> None:
        """Once a task has issued its work: wait until the draft's device has run it (the stream executor hands
        off with events instead)."""
        if self.draft_device.type not in ("cpu", "meta"):
            torch.get_device_module(self.draft_device).synchronize(self.draft_device)

    def _submit(self, fn, *args, inline: bool = False, settle: bool = True) -> Future:
        """Run `fn(*args)` on the draft's thread, or in the caller's (`inline`: work the caller waits for at once)
        once the draft's thread has nothing in flight, so the draft's state is never shared. `settle`: wait until
        the draft's device has run the work (nothing to wait for after a paused round's bookkeeping)."""
        if self._pool is not None and not (inline and (self._last is None or self._last.done())):
            self._last = self._pool.submit(self._run, fn, args)
            return self._last
        future: Future = Future()
        try:
            future.set_result(self._run(fn, args, settle=settle))
        except Exception as err:  # KeyboardInterrupt and SystemExit propagate at once
            future.set_exception(err)
        return future

    # --- the round protocol ----------------------------------------------------------------------------------
    # Only `prepare` runs beside the verification; the caller waits at once for `begin` and `resolve`, so those run
    # inline, in its thread. That also keeps the draft's thread to the draft's own intra-op threads: once a second
    # thread of the process has run an OpenMP team, libgomp sees more threads than cores and stops spinning, and
    # every parallel region of the target's then pays a futex wake-up (a tiny Llama's plain step at batch 4 on 2
    # cores ran 3x slower for the rest of the generation after the draft's prefill on every core in its thread).
    def begin(self, input_ids, attention_mask, depth) -> Future:
        def on_all_cores(ids, mask, depth):  # the target waits for it: every core this generation has
            threads = self.request.draft_threads + self.request.target_threads if self.kind != "sync" else None
            with torch_threads(threads):
                return self.drafter.begin(ids, mask, depth)

        return self._submit(on_all_cores, input_ids, attention_mask, depth, inline=True)

    def prepare(self, verified: int, depth: int, budget: int) -> Future:
        self.drafter.announce(None)
        # paused (depth 0): nothing to draft, so no hand-off to the draft's thread beside the target's plain step
        return self._submit(self.drafter.prepare, verified, depth, None, budget, inline=depth == 0,
                            settle=depth != 0)

    def announce(self, accepted, bonus) -> None:
        self.drafter.announce(list(zip(accepted, bonus)))

    def resolve(self, accepted, bonus, verified, keep_rows, backup, serial: int = 0, stop=None, runner_up=()
                ) -> Future:
        args = (list(zip(accepted, bonus)), verified, keep_rows, backup, serial, stop, list(runner_up))
        request = self.request
        if serial and self.kind != "sync":  # the target waits for this speculation: every core drafts it, or the
            # draft's own threads where that is faster (`ThreadChoice`)
            choice = drafting_threads(self.drafter.model,
                                      (request.draft_threads + request.target_threads, request.draft_threads))

            def drafted_just_in_time(*args):
                return choice.run(lambda: self.drafter.resolve(*args), drafted_tokens)

            return self._submit(drafted_just_in_time, *args, inline=True)
        paused = self.drafter.depth == 0  # then resolving is bookkeeping: the committed tokens wait to be glued

        def on_draft_threads(*args):  # a backup drafts on the draft's own intra-op threads, as on its thread
            with torch_threads(request.draft_threads if self.kind != "sync" and not paused else None):
                return self.drafter.resolve(*args)

        return self._submit(on_draft_threads, *args, inline=True, settle=not paused)

    def sat_out(self, rounds) -> Future:
        return self._submit(self.drafter.sat_out, rounds, inline=True, settle=False)  # bookkeeping

    def timings(self):
        return dataclasses.replace(self.drafter.timings)

    def finish(self):
        self.close()  # the drafter is idle from here on
        return self.drafter.report()

    @property
    def busy_seconds(self) -> float:
        return self._busy
