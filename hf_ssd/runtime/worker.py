"""The draft's worker process: holds drafts (weights mapped from the parent), runs one generation's drafter at a
time, answering the parent's requests in order (see `wire.py` for what crosses).

It ignores SIGINT (the parent's Ctrl-C cancels its work through the control block instead), exits when the parent
closes the pipe or dies, and keeps serving after a fault in a generation (the parent gets the error).
"""

from __future__ import annotations

import os
import pickle
import signal
import time
import traceback
import warnings
from collections import OrderedDict

import torch

from ..generation.confidence import StopRule
from . import wire
from .allocator import tune_allocator
from .executor import DraftCancelled
from .threads import drafted_tokens, drafting_threads


class _Session:
    """One generation's drafter and buffers, as the worker sees them."""

    def __init__(self, generation: int, drafter, buffers: wire.RoundBuffers, draft_threads: int = 1,
                 threads: int = 1):
        self.generation, self.drafter, self.buffers = generation, drafter, buffers
        self.draft_threads, self.threads = draft_threads, threads  # its own, and every core of the generation
        self.round = 0
        self.slot = 0
        self.busy = 0.0


class _Server:
    def __init__(self, conn, control: torch.Tensor):
        self.conn, self.control = conn, control
        self.drafts: OrderedDict[int, torch.nn.Module] = OrderedDict()
        self.session: _Session | None = None
        self.buffers: wire.RoundBuffers | None = None  # the last generation's, reused while they fit

    # --- messages ----------------------------------------------------------------------------------------------
    def reply(self, status: int, generation: int, op: int, payload=None) -> None:
        self.conn.send_bytes(wire.REPLY.pack(status, generation, op, int(payload is not None)))
        if payload is not None:
            self.conn.send(payload)

    def serve(self) -> None:
        while True:
            try:
                op, generation, a, b, c, d = wire.REQUEST.unpack(self.conn.recv_bytes())
            except (EOFError, OSError):  # the parent is gone
                return
            if op == wire.CLOSE:
                self.reply(wire.OK, generation, op)
                return
            try:
                payload = self.handle(op, generation, a, b, c, d)
                self.reply(wire.OK, generation, op, payload)
            except DraftCancelled:
                self.reply(wire.CANCELLED, generation, op)
            except BaseException as err:  # reported to the caller's generate(); the worker keeps serving
                self.session = None
                self.reply(wire.ERROR, generation, op, _error_payload(err))

    def handle(self, op: int, generation: int, a: int, b: int, c: int, d: int = 0):
        if op == wire.LOAD:
            self.drafts[a] = self.conn.recv().eval()
            return None
        if op == wire.FORGET:
            self.drafts.pop(a, None)
            return None
        if op == wire.BEGIN:
            request = self.conn.recv()  # the payload is read even if this generation was already cancelled
            if request[-1] is not None:  # new buffers (else the parent reuses the previous generation's)
                self.buffers = request[-1]
            self._check(generation)
            return self.begin(generation, *request[:-1], depth=a)
        stretch = self.conn.recv() if op == wire.SAT_OUT else None  # its payload is read whatever happens next
        session = self.session
        if session is None or session.generation != generation:
            raise RuntimeError(f"hf_ssd draft worker: no generation {generation} is running here (op {op}).")
        if op == wire.FINISH:  # also after a cancellation: the parent stops work in flight before asking
            return session.drafter.report()
        self._check(generation)
        start = time.perf_counter()
        try:
            with torch.no_grad():
                if op == wire.SAT_OUT:
                    session.drafter.sat_out(stretch)
                elif op == wire.PREPARE:
                    session.round = a
                    session.drafter.prepare(verified=b, depth=c, budget=d or None)
                elif op == wire.RESOLVE:
                    self.resolve(session, verified=a, backup=wire.BACKUPS[b], kept=c, serial=d)
                else:
                    raise RuntimeError(f"hf_ssd draft worker: unknown request {op}.")
                _synchronize(session.drafter.device)
        finally:
            session.busy += time.perf_counter() - start
            self._publish(session)
        return None

    # --- the round protocol ------------------------------------------------------------------------------------
    def begin(self, generation, draft_key, request, input_ids, attention_mask, depth: int):
        from ..config import SSDConfig
        from ..generation.candidate_generator import SaguaroCandidateGenerator

        draft = self.drafts[draft_key]
        self.drafts.move_to_end(draft_key)
        control, buffers = self.control, self.buffers

        def check() -> None:
            if int(control[wire.CANCELLED_GENERATION]) == generation:
                raise DraftCancelled()

        def announced():
            session = self.session
            if session is None or int(control[wire.ANNOUNCED]) != wire.announcement(generation, session.round):
                return None
            return [tuple(row) for row in buffers.outcomes[: session.drafter.rows, :2].tolist()]

        drafter = SaguaroCandidateGenerator(
            draft, SSDConfig.coerce(request.config), request.do_sample, request.warpers, request.vocab_size,
            request.seed, check=check, announced=announced,
        )
        self.session = session = _Session(generation, drafter, buffers, request.draft_threads,
                                          request.draft_threads + request.target_threads)
        start = time.perf_counter()
        try:
            # The target waits for the prefill: it gets every core of this generation.
            torch.set_num_threads(request.draft_threads + request.target_threads)
            with torch.no_grad():
                ids = torch.from_numpy(input_ids)
                mask = None if attention_mask is None else torch.from_numpy(attention_mask)
                speculations = drafter.begin(ids, mask, depth)
                self._write(session, [(s, False) for s in speculations])
                _synchronize(drafter.device)
        finally:
            torch.set_num_threads(request.draft_threads)
            session.busy += time.perf_counter() - start
            self._publish(session)
        return None

    def resolve(self, session: _Session, verified: int, backup: str, kept: int, serial: int = 0) -> None:
        buffers, drafter = session.buffers, session.drafter
        rows = buffers.outcomes[: drafter.rows].tolist()
        outcomes = [(accepted, bonus) for accepted, bonus, _ in rows]
        runner_up = [r for r, (_, _, replaced) in enumerate(rows) if replaced]
        keep_rows = buffers.keep[:kept].tolist()
        stop = StopRule.from_list(buffers.stop_rule.tolist())

        def job():
            return drafter.resolve(outcomes, verified, keep_rows, backup, serial, stop, runner_up)

        if serial:  # the target waits for this speculation: drafted on every core or on its own, whichever is faster
            choice = drafting_threads(drafter.model, (session.threads, session.draft_threads))
            resolutions = choice.run(job, drafted_tokens)
        else:
            resolutions = job()
        session.slot ^= 1
        self._write(session, [(r.speculation, r.hit) for r in resolutions])

    def _write(self, session: _Session, speculations) -> None:
        buffers, slot = session.buffers, session.slot
        for i, (spec, hit) in enumerate(speculations):
            length = spec.tokens.shape[0]
            buffers.tokens[slot, i, :length] = spec.tokens
            if buffers.probs is not None and length:
                buffers.probs[slot, i, :length] = spec.probs
            if length:  # NaN: unknown (a fast backup's tokens, or not tracked)
                buffers.confidence[slot, i, :length] = float("nan") if spec.confidence is None else spec.confidence
            runner_up = -1 if spec.runner_up is None else spec.runner_up
            buffers.meta[slot, i] = torch.tensor([wire.source_code(spec.source), int(hit), length, runner_up])

    def _publish(self, session: _Session) -> None:
        t = session.drafter.timings
        session.buffers.stats.copy_(torch.tensor(
            [t.prepare_calls, t.prepare_seconds, t.backup_calls, t.backup_seconds, t.serial_calls, t.serial_seconds,
             t.serial_tokens, t.backup_tokens, t.serial_steps, t.serial_step_seconds, session.busy],
            dtype=torch.float64
        ))

    def _check(self, generation: int) -> None:
        if int(self.control[wire.CANCELLED_GENERATION]) == generation:
            raise DraftCancelled()


def _synchronize(device: torch.device) -> None:
    if device.type not in ("cpu", "meta"):
        torch.get_device_module(device).synchronize(device)


def _error_payload(err: BaseException) -> tuple:
    """(the exception if it pickles, else None; its type name and message; the formatted traceback)."""
    text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    try:
        pickle.loads(pickle.dumps(err))
        picklable = err
    except Exception:
        picklable = None
    return picklable, f"{type(err).__name__}: {err}", text


def main(conn, control: torch.Tensor, threads: int) -> None:
    """Entry point of the spawned process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tune_allocator()  # before anything large is allocated: the draft's forwards reuse what they free
    # an int8 draft's weights are requantized on arrival; torch.ao's deprecation notice says nothing to the user
    warnings.filterwarnings("ignore", message="torch.quantize_per_tensor", category=UserWarning)
    start = time.perf_counter()
    torch.set_num_threads(threads)
    import transformers  # noqa: F401  (the drafts' modules import it; paid here, at start-up)

    from ..generation import candidate_generator  # noqa: F401

    conn.send_bytes(wire.REPLY.pack(wire.READY, os.getpid(), int((time.perf_counter() - start) * 1e6), 0))
    try:
        _Server(conn, control).serve()
    finally:
        conn.close()
