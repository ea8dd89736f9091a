"""The interpreter's draft worker processes: spawning them, handing them drafts, and keeping them.

Workers are spawned (torch.multiprocessing, "spawn", without the caller's `__main__`), persist across `generate`
calls and are pooled: a worker keeps the drafts it was handed (their weights move to shared memory once and are
mapped by the worker, never copied per call; a CUDA draft's tensors travel as CUDA IPC handles) and serves one
generation at a time. A worker that dies is noticed at once (every wait includes its process sentinel) and is
reaped; the next call starts a fresh one. Workers are closed at interpreter exit or by `close_workers()`, and exit
by themselves when their parent dies. `process.ProcessExecutor` runs a generation on one of them.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import itertools
import logging
import multiprocessing.connection
import multiprocessing.spawn
import os
import threading
import time
import weakref
from collections import OrderedDict
from multiprocessing.reduction import ForkingPickler  # torch.multiprocessing registers its tensor reductions here

import torch
import torch.multiprocessing as mp

from ..openmp import openmp_wait_env
from . import wire
from .executor import DraftWorkerError
from .worker import main as worker_main

logger = logging.getLogger(__name__)

START_TIMEOUT = 180.0  # seconds for a new worker to import torch and transformers
CLOSE_TIMEOUT = 10.0  # seconds for a worker to stop a cancelled task before it is killed
MAX_IDLE_WORKERS = 2
MAX_DRAFTS_PER_WORKER = 4


class DraftNotShareable(ValueError):
    """The draft cannot be handed to a worker process (its class or something it holds does not pickle)."""


class _RemoteTraceback(Exception):
    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f"\n\"\"\"\n{self.text}\"\"\""


_spawn_lock = threading.Lock()


WORKER_NAME = "hf-ssd-draft-worker"


@contextlib.contextmanager
def _without_main_module():
    """Spawn a worker without re-running the caller's `__main__` in it.

    The worker needs hf_ssd and the draft's classes, never the user's script: re-importing it would run an
    unguarded script's generate() a second time. So the spawn preparation data of our worker (recognised by its
    process name; other processes spawned meanwhile are untouched) omits the main module.
    """
    original = multiprocessing.spawn.get_preparation_data

    def preparation_data(name):
        data = original(name)
        if name == WORKER_NAME:
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
        return data

    with _spawn_lock:
        multiprocessing.spawn.get_preparation_data = preparation_data
        try:
            yield
        finally:
            multiprocessing.spawn.get_preparation_data = original


@contextlib.contextmanager
def _short_spin_waits():
    """Spawn with a short OpenMP spin (`hf_ssd.openmp.openmp_wait_env`) unless the caller chose a policy or a spin
    count: the worker hands work to and from the caller's process every round, so its threads must not spin on after
    their work (libgomp's default), nor sleep after every parallel region (PASSIVE: a 2-thread draft step ~1.6x
    slower).
    Read by the child at start."""
    added = openmp_wait_env()
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


class _DraftPickler(ForkingPickler):
    """torch's multiprocessing pickler (tensors travel as shared memory), except for quantized tensors (an int8
    draft's packed weights), which its shared-memory path cannot rebuild: they travel as their integer
    representation (shared) and are requantized, i.e. copied once, by the worker."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.is_quantized:
            if obj.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
                return torch._make_per_tensor_quantized_tensor, (obj.int_repr(), obj.q_scale(), obj.q_zero_point())
            return torch._make_per_channel_quantized_tensor, (
                obj.int_repr(), obj.q_per_channel_scales(), obj.q_per_channel_zero_points(), obj.q_per_channel_axis()
            )
        return NotImplemented

    @classmethod
    def dumps(cls, obj, protocol=None) -> bytes:
        buffer = io.BytesIO()
        cls(buffer, protocol).dump(obj)
        return buffer.getvalue()


def _draft_fingerprint(draft: torch.nn.Module) -> tuple:
    """Where the draft's tensors live: changes when a parameter or buffer is replaced (the worker must reload)."""
    return tuple(t.data_ptr() for t in itertools.chain(draft.parameters(), draft.buffers()))


# A module's hook tables: a hook that does not pickle (a lambda, a closure) keeps the draft from crossing while it
# is attached; once it is removed the draft may cross
_HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                "_load_state_dict_post_hooks")


def _attachments(draft: torch.nn.Module) -> tuple:
    """The handles of the hooks attached to the draft's modules: changes when one is added or removed."""
    return tuple(tuple(getattr(module, table, {})) for module in draft.modules() for table in _HOOK_TABLES)


def shareable(draft: torch.nn.Module) -> str | None:
    """Why `draft` cannot be handed to a worker process, or None when it can."""
    for module in draft.modules():
        if type(module).__module__ == "__main__":
            return (f"its class {type(module).__name__} is defined in the script being run (__main__), which a "
                    "worker process cannot import; define it in a module")
    if any(p.device.type == "meta" for p in draft.parameters()):
        return "it has parameters on the meta device (offloaded)"
    return None


class Worker:
    """The parent's handle on one worker process."""

    def __init__(self, threads: int, abandon=None):
        """Spawn the process and wait until it is ready; `abandon()` (polled while waiting) returning True kills it
        and raises (the interpreter is exiting)."""
        self.control = wire.shared_control()
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=worker_main, args=(child, self.control, threads), daemon=True,
                                   name=WORKER_NAME)
        start = time.perf_counter()
        with _without_main_module(), _short_spin_waits():
            self.process.start()
        child.close()
        self.conn = parent
        self.drafts: OrderedDict[int, tuple] = OrderedDict()  # key -> fingerprint, of the drafts it holds
        self.buffers: wire.RoundBuffers | None = None
        self.broken = False
        deadline = start + START_TIMEOUT
        while abandon is not None and not multiprocessing.connection.wait([self.conn, self.process.sentinel], 0.05):
            if abandon() or time.perf_counter() > deadline:
                self.process.kill()
                self.process.join()
                raise DraftWorkerError("hf_ssd draft worker start-up abandoned.")
        status, pid, _, _ = self._read_header(START_TIMEOUT, "start")
        if status != wire.READY:
            raise DraftWorkerError(f"hf_ssd draft worker sent {status} instead of READY on start-up.")
        self.pid = pid
        self.start_seconds = time.perf_counter() - start

    # --- messages ----------------------------------------------------------------------------------------------
    def send(self, op: int, generation: int = 0, a: int = 0, b: int = 0, c: int = 0, payload=None, d: int = 0) -> None:
        try:
            self.conn.send_bytes(wire.REQUEST.pack(op, generation, a, b, c, d))
            if payload is not None:
                self.conn.send(payload)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as err:
            self.broken = True
            raise DraftWorkerError(self._death_message("while being sent a request")) from err
        except BaseException:  # e.g. Ctrl-C in the middle of a write
            self.broken = True
            raise

    def _wait_readable(self, timeout: float | None, what: str) -> None:
        ready = multiprocessing.connection.wait([self.conn, self.process.sentinel], timeout)
        if self.conn in ready:
            return
        self.broken = True
        if not ready:
            raise DraftWorkerError(f"hf_ssd draft worker (pid {self.process.pid}) did not answer within "
                                   f"{timeout:.0f} s ({what}).")
        raise DraftWorkerError(self._death_message(what))

    def _read_header(self, timeout: float | None, what: str) -> tuple[int, int, int, int]:
        self._wait_readable(timeout, what)
        try:
            return wire.REPLY.unpack(self.conn.recv_bytes())
        except (EOFError, OSError) as err:
            self.broken = True
            raise DraftWorkerError(self._death_message(what)) from err
        except BaseException:
            self.broken = True
            raise

    def receive(self, timeout: float | None = None, what: str = "drafting"):
        """(status, generation, op, payload or None) of the next reply.

        Interrupting the wait (Ctrl-C) leaves the stream intact; an interrupted read marks the worker broken."""
        status, generation, op, has_payload = self._read_header(timeout, what)
        payload = None
        if has_payload:
            self._wait_readable(timeout, what)
            try:
                payload = self.conn.recv()
            except BaseException:
                self.broken = True
                raise
        return status, generation, op, payload

    def _death_message(self, what: str) -> str:
        self.process.join(timeout=1.0)
        code = self.process.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        return (f"hf_ssd draft worker (pid {self.process.pid}) {how} {what}; the generation was abandoned. "
                "The next generate() call starts a new worker.")

    # --- drafts and lifetime -----------------------------------------------------------------------------------
    def load(self, key: int, draft: torch.nn.Module) -> float:
        """Make sure the worker holds `draft` as it is now; seconds spent (0 when it already did)."""
        fingerprint = _draft_fingerprint(draft)
        if self.drafts.get(key) == fingerprint:
            self.drafts.move_to_end(key)
            return 0.0
        start = time.perf_counter()
        try:  # before anything is sent: a draft that does not pickle leaves the worker as it was
            payload = _DraftPickler.dumps(draft)  # weights move to shared memory (once); the worker maps them
        except Exception as err:
            raise DraftNotShareable(
                f"executor='process' cannot hand this draft to a worker process ({type(err).__name__}: {err}); "
                "hooks or other local objects attached to it do not pickle. Use executor='thread'."
            ) from err
        while len(self.drafts) >= MAX_DRAFTS_PER_WORKER:
            self.forget(next(iter(self.drafts)))
        self.send(wire.LOAD, 0, key)
        try:
            self.conn.send_bytes(payload)
        except BaseException:
            self.broken = True
            raise
        self._expect(wire.LOAD, "loading the draft")
        self.drafts[key] = _draft_fingerprint(draft)  # after the move: the tensors now live in shared memory
        return time.perf_counter() - start

    def forget(self, key: int) -> None:
        if self.drafts.pop(key, None) is not None:
            self.send(wire.FORGET, 0, key)
            self._expect(wire.FORGET, "dropping a draft")

    def _expect(self, op: int, what: str) -> None:
        status, _, _, payload = self.receive(START_TIMEOUT, what)
        if status != wire.OK:
            raise_remote(payload, f"hf_ssd draft worker failed {what}")

    def alive(self) -> bool:
        return not self.broken and self.process.is_alive()

    def close(self) -> None:
        """Stop the process: politely, then by force. Always reaps it."""
        if self.process.is_alive() and not self.broken:
            with contextlib.suppress(Exception):
                self.send(wire.CLOSE)
                self.receive(2.0, "closing")
        self.process.join(timeout=2.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5.0)
        with contextlib.suppress(Exception):
            self.conn.close()


def raise_remote(payload, fallback: str):
    """Raise the worker's error in this process, with the worker's traceback as its cause."""
    if payload is None:
        raise DraftWorkerError(fallback)
    error, summary, text = payload
    if not isinstance(error, BaseException):
        error = DraftWorkerError(f"{fallback}: {summary}")
    raise error from _RemoteTraceback(text)


class WorkerPool:
    """The interpreter's draft workers: idle ones are reused (preferring one that holds the draft), at most
    `MAX_IDLE_WORKERS` are kept, and a worker that misbehaved is discarded."""

    def __init__(self):
        self._lock = threading.Lock()
        self._idle: list[Worker] = []
        self._busy: set[Worker] = set()
        self._warming: threading.Thread | None = None
        self._failure: str | None = None  # why workers cannot start here (auto then stays on threads)
        self._keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._counter = itertools.count(1)
        self._collected: set[int] = set()  # keys of drafts garbage-collected here; workers drop them when next used
        # keys of drafts that failed to pickle, with their hooks then: auto keeps them on threads until those change
        self._unshareable: dict[int, tuple[str, tuple]] = {}
        self._shutting_down = False

    def key_of(self, draft: torch.nn.Module) -> int:
        with self._lock:
            key = self._keys.get(draft)
            if key is None:
                key = self._keys[draft] = next(self._counter)
                weakref.finalize(draft, self._collected.add, key)
            return key

    def ready_for(self, draft: torch.nn.Module) -> bool:
        """Whether an idle worker holds `draft` (it is handed over now if need be), for `executor="auto"`; no when
        no worker runs, when the draft cannot cross, or when the worker fails to take it."""
        if shareable(draft) is not None:
            return False
        key = self.key_of(draft)
        with self._lock:
            failed = self._unshareable.get(key)
            if self._failure is not None or (failed is not None and failed[1] == _attachments(draft)):
                return False
            alive = [w for w in self._idle if w.alive()]
            worker = next((w for w in alive if key in w.drafts), alive[0] if alive else None)
            if worker is None:
                return False
            self._idle.remove(worker)
            self._busy.add(worker)
        try:
            self._drop_forgotten(worker)
            worker.load(key, draft)
        except DraftNotShareable as err:
            with self._lock:
                self._unshareable[key] = (str(err), _attachments(draft))
            self.release(worker, healthy=True)
            return False
        except Exception as err:
            logger.warning("hf_ssd: a draft worker failed to take the draft (%s); this call drafts on a thread.", err)
            self.release(worker, healthy=False)
            return False
        with self._lock:
            self._unshareable.pop(key, None)
        self.release(worker, healthy=True)
        return True

    def started(self) -> bool:
        """Whether a worker runs or is starting (`executor="auto"` starts one after a call where it pays)."""
        with self._lock:
            return self._started()

    def _started(self) -> bool:  # under the lock
        return self._warming is not None or bool(self._idle) or bool(self._busy)

    def warm(self) -> None:
        """Start a worker in the background unless one runs, is starting, or cannot start here."""
        with self._lock:
            if self._failure is None and not self._started():
                self._warming = threading.Thread(target=self._warm, name="hf-ssd-worker-start", daemon=True)
                self._warming.start()

    def _warm(self) -> None:
        try:
            worker = Worker(threads=1, abandon=lambda: self._shutting_down)
        except Exception as err:  # e.g. no shared memory here: stay on threads
            with self._lock:
                self._warming = None
                if self._shutting_down:
                    return
                self._failure = str(err)
            logger.warning("hf_ssd: could not start a draft worker process (%s); drafts run on threads.", err)
            return
        with self._lock:
            self._warming = None
            if not self._shutting_down:
                self._idle.append(worker)
                return
        worker.close()  # the interpreter is exiting

    def acquire(self, draft: torch.nn.Module, threads: int) -> tuple[Worker, float, float]:
        """A worker holding `draft`: (worker, start-up seconds paid now, draft hand-over seconds)."""
        reason = shareable(draft)
        if reason is not None:
            raise DraftNotShareable(f"executor='process' cannot hand this draft to a worker process: {reason}. Use "
                                    "executor='thread'.")
        key = self.key_of(draft)
        warming = self._warming
        if warming is not None:
            warming.join(START_TIMEOUT)
        with self._lock:
            candidates = [w for w in self._idle if w.alive()]
            for w in self._idle:
                if w not in candidates:
                    w.close()
            worker = next((w for w in candidates if key in w.drafts), candidates[0] if candidates else None)
            self._idle = [w for w in candidates if w is not worker]
            if worker is not None:
                self._busy.add(worker)
        start_seconds = 0.0
        if worker is None:
            worker = Worker(threads)
            start_seconds = worker.start_seconds
            with self._lock:
                self._busy.add(worker)
        try:
            self._drop_forgotten(worker)
            load_seconds = worker.load(key, draft)
        except DraftNotShareable:
            self.release(worker, healthy=True)
            raise
        except BaseException:
            self.release(worker, healthy=False)
            raise
        return worker, start_seconds, load_seconds

    def _drop_forgotten(self, worker: Worker) -> None:
        for key in [k for k in worker.drafts if k in self._collected]:
            worker.forget(key)

    def release(self, worker: Worker, healthy: bool) -> None:
        with self._lock:
            self._busy.discard(worker)
            keep = healthy and worker.alive() and len(self._idle) < MAX_IDLE_WORKERS
            if keep:
                self._idle.append(worker)
        if not keep:
            worker.close()

    def workers(self) -> list[Worker]:
        with self._lock:
            return [*self._idle, *self._busy]

    def close_all(self, wait_for_start: bool = True) -> None:
        """Stop every worker (`close_workers()`; a worker still starting is waited for and stopped too)."""
        warming = self._warming
        if warming is not None and wait_for_start:
            warming.join(START_TIMEOUT)
        with self._lock:
            workers, self._idle = [*self._idle, *self._busy], []
            self._busy = set()
        for worker in workers:
            worker.close()

    def shutdown(self) -> None:
        """At interpreter exit: a worker still starting is abandoned (killed within ~50 ms rather than waited for),
        the others are closed."""
        self._shutting_down = True
        warming = self._warming
        if warming is not None:
            warming.join(10.0)
        self.close_all(wait_for_start=False)


POOL = WorkerPool()
atexit.register(POOL.shutdown)


def start_draft_worker(draft: torch.nn.Module) -> float:
    """Start a worker now and hand it `draft`, so that `executor="auto"` runs the draft in a process from the first
    generation on (a server's or a benchmark's warm-up). Returns the seconds it took (0 when one was ready)."""
    start = time.perf_counter()
    worker, _, _ = POOL.acquire(draft, threads=1)
    POOL.release(worker, healthy=True)
    return time.perf_counter() - start


def adopt_started_worker(draft: torch.nn.Module) -> float | None:
    """After a warm-up call: where `executor="auto"` started a worker for `draft` (`worker_pays`), wait for it and
    hand it the draft, so that measured calls see what "auto" settles on without its start-up; seconds taken, None
    where no worker was started or the draft cannot cross."""
    if draft.device.type != "cpu" or shareable(draft) is not None or not POOL.started():
        return None
    return start_draft_worker(draft)


def close_workers() -> None:
    """Stop the draft worker processes of this interpreter (they are restarted on demand)."""
    POOL.close_all()


def worker_pids() -> list[int]:
    """Process ids of this interpreter's draft workers (idle and busy)."""
    return [w.pid for w in POOL.workers()]
