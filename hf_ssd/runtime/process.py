"""`executor="process"`: one generation's drafter runs in a pooled worker process (`pool.py`), so neither side waits
for the other's GIL.

Per round only fixed-size headers cross the pipe (prepare, resolve and their replies); tokens, outcome keys and q
rows go through `wire.RoundBuffers`, which both processes map. A dead worker surfaces as `DraftWorkerError` in the
caller's `generate`; an error raised in the worker arrives as itself, with the worker's traceback as its cause.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch

from ..cache.speculation_cache import NOT_LOOKED_UP, Resolution, Speculation, plain_resolutions
from ..config import SSDConfig
from ..generation.candidate_generator import DraftTimings
from . import wire
from .executor import DraftCancelled, DraftExecutor, DraftRequest
from .pool import CLOSE_TIMEOUT, POOL, Worker, raise_remote

logger = logging.getLogger(__name__)

_generations = itertools.count(1)


class _Pending:
    """The result of one request, available once its reply (and every earlier one) has arrived."""

    def __init__(self, executor: ProcessExecutor, seq: int, build):
        self.executor, self.seq, self.build = executor, seq, build

    def result(self, timeout=None):
        self.executor._await(self.seq)
        return self.build()


class _Known:
    """A result known without the worker's reply (which is read later, in order, with the next one awaited)."""

    def __init__(self, value):
        self.value = value

    def result(self, timeout=None):
        return self.value


class ProcessExecutor(DraftExecutor):
    """Runs one generation's drafter in a pooled worker process."""

    kind = "process"

    def __init__(self, draft_model: torch.nn.Module, request: DraftRequest):
        super().__init__(request, draft_model.device)
        self.draft_model = draft_model
        self.worker: Worker | None = None
        self.generation = next(_generations)
        self.round = 0
        self.slot = 0
        self.buffers: wire.RoundBuffers | None = None
        self._sent = 0  # requests sent this generation
        self._answered = 0  # replies read
        self._report = None
        self._depth: int | None = None  # the last prepare's depth (0: the draft sat the verification out)
        self._paused_prepare = 0  # what the last prepare of depth 0 was to verify (sent if a serial round needs it)
        self._sat_out: list[tuple] = []  # rounds the draft sat out, not sent yet: (outcomes, verified, keep_rows)

    def start(self) -> None:
        self.worker, self.start_seconds, self.load_seconds = POOL.acquire(self.draft_model, self.request.draft_threads)

    # --- requests and replies ----------------------------------------------------------------------------------
    def _send(self, op: int, a: int = 0, b: int = 0, c: int = 0, payload=None, d: int = 0) -> int:
        self.worker.send(op, self.generation, a, b, c, payload, d)
        self._sent += 1
        return self._sent

    def _await(self, seq: int) -> None:
        while self._answered < seq:
            status, _, op, payload = self.worker.receive(None, "while drafting")
            self._answered += 1
            if status == wire.CANCELLED:
                raise DraftCancelled()
            if status != wire.OK:
                raise_remote(payload, "hf_ssd draft worker failed")
            if op == wire.FINISH:
                self._report = payload

    def _speculations(self, slot: int, count: int) -> list[Resolution]:
        buffers = self.buffers
        meta = buffers.meta[slot, :count].tolist()
        out = []
        for i, (source, hit, length, runner_up) in enumerate(meta):
            probs = None if buffers.probs is None else buffers.probs[slot, i, :length]
            confidence = buffers.confidence[slot, i, :length]
            known = length > 0 and not bool(confidence[0].isnan())
            speculation = Speculation(buffers.tokens[slot, i, :length], probs, wire.source_name(source),
                                      confidence=confidence if known else None,
                                      runner_up=runner_up if runner_up >= 0 else None)
            out.append(Resolution(speculation, bool(hit), looked_up=speculation.source not in NOT_LOOKED_UP))
        return out

    # --- the round protocol ------------------------------------------------------------------------------------
    def begin(self, input_ids, attention_mask, depth):
        rows = input_ids.shape[0]
        vocab = self.request.vocab_size if self.request.do_sample else None
        lookahead = SSDConfig.coerce(self.request.config).serial_lookahead  # the longest speculation
        previous = self.worker.buffers
        if previous is not None and previous.fits(rows, lookahead, vocab, self.draft_device):
            self.buffers, sent = previous, None  # the worker kept them
        else:
            self.buffers = sent = self.worker.buffers = wire.RoundBuffers.allocate(
                rows, lookahead, vocab, self.draft_device
            )
        self.slot = 0
        mask = None if attention_mask is None else attention_mask.detach().cpu().numpy()
        key = POOL.key_of(self.draft_model)
        payload = (key, self.request, input_ids.detach().cpu().numpy(), mask, sent)
        seq = self._send(wire.BEGIN, depth, payload=payload)
        return _Pending(self, seq, lambda: [r.speculation for r in self._speculations(0, rows)])

    def prepare(self, verified: int, depth: int, budget: int):
        """As `DraftExecutor.prepare`; at depth 0 (the draft sits the verification out) nothing is sent: the round
        reaches the worker with its outcomes (`_sat_out`), when the draft next has work."""
        self.round += 1
        self._depth = depth
        if depth == 0:
            self._paused_prepare = verified
            return _Known(None)
        self._flush()
        return _Pending(self, self._send(wire.PREPARE, self.round, verified, depth, d=budget), lambda: None)

    def announce(self, accepted, bonus) -> None:
        if self._depth == 0:  # nothing is preparing
            return
        n = len(accepted)
        self.buffers.outcomes[:n, 0] = torch.tensor(accepted)
        self.buffers.outcomes[:n, 1] = torch.tensor(bonus)
        self.worker.control[wire.ANNOUNCED] = wire.announcement(self.generation, self.round)

    def resolve(self, accepted, bonus, verified, keep_rows, backup, serial=0, stop=None, runner_up=()):
        """As `DraftExecutor.resolve`; after a plain step the draft sat out (a prepare of depth 0, nothing drafted
        just in time) the result is known — an empty speculation per kept row — and nothing is sent: the round
        waits with the others the draft sat out until the draft next has work (`_flush`)."""
        if self._depth == 0 and serial == 0:
            # (the rows that took a runner-up, where any did: `DraftExecutor.sat_out`)
            taken = [list(runner_up)] if runner_up else []
            self._sat_out.append((list(zip(accepted, bonus)), verified, list(keep_rows), *taken))
            return _Known(plain_resolutions(len(keep_rows), self.draft_device))
        if self._depth == 0:  # a serial round: the worker drafts now, after the verification it sat out
            self._flush()
            self._send(wire.PREPARE, self.round, self._paused_prepare, 0)
        n = len(accepted)
        self.buffers.outcomes[:n, 0] = torch.tensor(accepted)
        self.buffers.outcomes[:n, 1] = torch.tensor(bonus)
        self.buffers.outcomes[:n, 2] = 0
        if runner_up:
            self.buffers.outcomes[list(runner_up), 2] = 1
        self.buffers.keep[: len(keep_rows)] = torch.tensor(keep_rows, dtype=torch.long)
        self.slot ^= 1
        slot, count = self.slot, len(keep_rows)
        self.buffers.stop_rule.zero_()
        if stop is not None:  # (its per-position gains fit: at most one per further token of the longest speculation)
            values = stop.to_list()
            self.buffers.stop_rule[: len(values)] = torch.tensor(values, dtype=torch.float64)
        seq = self._send(wire.RESOLVE, verified, wire.BACKUPS.index(backup), count, d=serial)
        return _Pending(self, seq, lambda: self._speculations(slot, count))

    def sat_out(self, rounds):
        """As `DraftExecutor.sat_out`: the result is known; the rounds wait with the others the draft sat out until
        the draft next has work (`_flush`)."""
        self._sat_out.extend(rounds)
        return _Known(plain_resolutions(len(rounds[-1][2]), self.draft_device))

    def _flush(self) -> None:
        """Send the rounds the draft sat out since it last worked, in one request (their tokens pickled: a few
        hundred bytes); its reply is read with the next one awaited. One message per stretch of plain steps
        instead of two per round: on 2 cores a message to the worker cost ~0.6 ms, a third of a small pair's
        plain step."""
        if self._sat_out:
            rounds, self._sat_out = self._sat_out, []
            self._send(wire.SAT_OUT, payload=rounds)

    def timings(self) -> DraftTimings:
        (calls, seconds, backup_calls, backup_seconds, serial_calls, serial_seconds, serial_tokens, backup_tokens,
         serial_steps, serial_step_seconds, _) = self.buffers.stats.tolist()
        return DraftTimings(int(calls), seconds, int(backup_calls), backup_seconds, int(serial_calls), serial_seconds,
                            int(serial_tokens), int(backup_tokens), int(serial_steps), serial_step_seconds)

    def finish(self):
        self._stop_in_flight()
        self._report = None
        self._await(self._send(wire.FINISH))
        return self._report

    @property
    def busy_seconds(self) -> float:
        return float(self.buffers.stats[wire.STATS - 1]) if self.buffers is not None else 0.0

    def _stop_in_flight(self) -> None:
        """Cancel the tasks sent and not answered (the running one stops at its next check); read their replies."""
        if self._answered == self._sent:
            return
        self.worker.control[wire.CANCELLED_GENERATION] = self.generation
        deadline = time.perf_counter() + CLOSE_TIMEOUT
        while self._answered < self._sent:
            status, _, _, payload = self.worker.receive(max(deadline - time.perf_counter(), 0.01),
                                                        "stopping a cancelled task")
            self._answered += 1
            if status == wire.ERROR:
                logger.warning("hf_ssd: abandoned draft work failed: %s", payload[1] if payload else "?")

    def close(self) -> None:
        worker = self.worker
        if worker is None:
            return
        healthy = worker.alive()
        if healthy:
            try:
                self._stop_in_flight()
            except BaseException:
                healthy = False
        self.worker = None
        POOL.release(worker, healthy and worker.alive())
