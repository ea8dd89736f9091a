"""`executor="process"`: a persistent worker process per interpreter, shared draft weights, faults and deaths
surfacing in the caller, nothing left behind. (Output equality and the sampling law for this executor are in the
greedy, sampling, batch and streaming test modules, next to the other executors.)"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_pair
from draft_faults import DraftBoom, failing_copy
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.streamers import BaseStreamer

from hf_ssd import SSDConfig
from hf_ssd.runtime import DraftWorkerError, close_workers
from hf_ssd.runtime.pool import POOL, worker_pids

VOCAB = 96
NEW = 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def pair():
    return tiny_pair("llama", seed=14)


@pytest.fixture(scope="module")
def case(pair):
    target, _ = pair
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(8))
    return ids, target.generate(ids, max_new_tokens=NEW, do_sample=False)


def ssd(target, draft, ids, executor="process", **kwargs):
    # the constant schedule: every round runs the worker's whole protocol (prepare, tree, resolve), which an
    # adaptive one would replace by plain steps or serial rounds where the tiny models make them faster
    config = SSDConfig(lookahead=3, executor=executor, lookahead_schedule="constant")
    return target.generate(ids, assistant_model=draft, ssd_config=config, max_new_tokens=NEW, do_sample=False,
                           **kwargs)


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited and waiting to be reaped by whoever adopted it, does not)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def assert_idle_and_working(target, draft, ids, expected):
    """No generation in flight, every pooled worker alive (none a zombie), no other child process, and a next call
    that is correct."""
    assert not POOL._busy
    pids = worker_pids()
    assert all(pid_alive(pid) for pid in pids)
    assert {p.pid for p in multiprocessing.active_children()} <= set(pids)
    assert torch.equal(ssd(target, draft, ids), expected)
    assert target.ssd_metrics.executor == "process" and target.ssd_metrics.generated_tokens == NEW


def test_worker_persists_and_shares_the_draft(pair, case):
    target, draft = pair
    ids, expected = case
    assert torch.equal(ssd(target, draft, ids), expected)
    first = target.ssd_metrics
    pid = worker_pids()
    assert torch.equal(ssd(target, draft, ids), expected)
    second = target.ssd_metrics
    assert worker_pids() == pid  # the same worker served both calls
    assert second.worker_start_seconds == 0.0 and second.draft_load_seconds == 0.0  # nothing paid again
    assert first.executor == second.executor == "process" and second.draft_seconds > 0
    assert set(second.draft_phase_seconds) >= {"glue_forward", "prepare", "resolve", "begin"}
    # the tree's forwards ran, or each was dropped because the verification had already announced a miss (the
    # tiny target can finish first on a loaded machine)
    assert "tree_forward" in second.draft_phase_seconds or second.tree_steps_skipped > 0
    # the weights were moved to shared memory once (the worker maps them), not copied per call
    assert all(p.is_shared() for p in draft.parameters())
    # a weight replaced in place is seen by the worker (shared); a replaced tensor makes the pool hand it over again
    with torch.no_grad():
        draft.lm_head.weight = torch.nn.Parameter(draft.lm_head.weight.clone())
    assert torch.equal(ssd(target, draft, ids), expected)
    assert target.ssd_metrics.draft_load_seconds > 0


@pytest.mark.parametrize("fail_after", [0, 1, 4])
def test_draft_fault_in_the_worker_surfaces_with_its_traceback(pair, case, fail_after):
    target, draft = pair
    ids, expected = case
    ssd(target, draft, ids)  # a running worker
    pids = set(worker_pids())
    failing = failing_copy(draft, fail_after)
    with pytest.raises(DraftBoom, match="draft forward failed") as info:
        ssd(target, failing, ids)
    assert "draft_faults.py" in str(info.value.__cause__)  # the worker's traceback travels with the error
    assert any(f"pid {pid}" in str(info.value) for pid in pids)  # it ran in a worker ...
    assert set(worker_pids()) == pids  # ... which keeps serving
    assert_idle_and_working(target, draft, ids, expected)


class RecordThreads(LogitsProcessor):
    def __init__(self):
        self.seen = set()

    def __call__(self, input_ids, scores):
        self.seen.add(torch.get_num_threads())
        return scores


def test_thread_counts(pair, case):
    """The target runs on `target_threads` while SSD runs (the worker on `draft_threads`, reported); the caller's
    count is restored."""
    target, draft = pair
    ids, expected = case
    before = torch.get_num_threads()
    processor = RecordThreads()
    config = SSDConfig(executor="process", draft_threads=2, target_threads=3)
    out = target.generate(ids, assistant_model=draft, ssd_config=config, max_new_tokens=NEW, do_sample=False,
                          logits_processor=LogitsProcessorList([processor]))
    assert torch.equal(out, expected) and processor.seen == {3} and torch.get_num_threads() == before
    assert (target.ssd_metrics.draft_threads, target.ssd_metrics.target_threads) == (2, 3)


def test_keyboard_interrupt_in_the_worker_reaches_the_caller(pair, case):
    target, draft = pair
    ids, expected = case
    with pytest.raises(KeyboardInterrupt):
        ssd(target, failing_copy(draft, 3, "interrupt"), ids)
    assert_idle_and_working(target, draft, ids, expected)


class InterruptOnCall(LogitsProcessor):
    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.n:
            raise KeyboardInterrupt
        return scores


def test_keyboard_interrupt_from_the_target_cancels_the_worker(pair, case):
    target, draft = pair
    ids, expected = case
    ssd(target, draft, ids)
    pids = set(worker_pids())
    processor = InterruptOnCall(3)
    with pytest.raises(KeyboardInterrupt):
        ssd(target, draft, ids, logits_processor=LogitsProcessorList([processor]))
    assert processor.calls == 3 and set(worker_pids()) == pids  # cancelled, not killed
    assert_idle_and_working(target, draft, ids, expected)


def test_ctrl_c_while_the_worker_drafts(pair, case):
    """A real SIGINT to the caller while the worker is mid-task: KeyboardInterrupt, the worker's task is cancelled
    through the control block (the worker itself ignores SIGINT) and the worker is reused."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are handled on the main thread only")
    target, draft = pair
    ids, expected = case
    ssd(target, draft, ids)
    pids = set(worker_pids())

    class Interrupt(BaseStreamer):
        def __init__(self):
            self.puts = 0

        def put(self, value):
            self.puts += 1
            if self.puts == 3:  # the prompt, then the first round: the worker is preparing round two
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
                time.sleep(0.05)

        def end(self):
            pass

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            ssd(target, draft, ids, streamer=Interrupt())
    finally:
        signal.signal(signal.SIGINT, previous)
    assert set(worker_pids()) == pids
    assert_idle_and_working(target, draft, ids, expected)


class KillWorker(BaseStreamer):
    """Kills the draft worker with SIGKILL from the caller's thread after the first round's tokens."""

    def __init__(self):
        self.puts, self.killed_at = 0, None

    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            [worker] = POOL._busy  # the one serving this generation
            self.pid = worker.pid
            os.kill(worker.pid, signal.SIGKILL)
            self.killed_at = time.perf_counter()

    def end(self):
        pass


def test_worker_killed_mid_generation(pair, case):
    """kill -9 of the worker: a clear error in the caller within a second, the dead worker reaped (no zombie, no
    orphan), and the next call starts a fresh worker and is correct."""
    target, draft = pair
    ids, expected = case
    ssd(target, draft, ids)
    streamer = KillWorker()
    with pytest.raises(DraftWorkerError, match=r"killed by signal 9") as info:
        try:
            ssd(target, draft, ids, streamer=streamer)
        finally:
            raised_at = time.perf_counter()
    old = streamer.pid
    assert "next generate() call starts a new worker" in str(info.value)
    assert raised_at - streamer.killed_at < 1.0
    assert not pid_alive(old) and old not in worker_pids()
    assert old not in {p.pid for p in multiprocessing.active_children()}  # reaped: no zombie
    assert_idle_and_working(target, draft, ids, expected)
    assert old not in worker_pids()


def test_worker_dying_inside_a_forward(pair, case):
    target, draft = pair
    ids, expected = case
    with pytest.raises(DraftWorkerError, match=r"killed by signal 9"):
        ssd(target, failing_copy(draft, 2, "die"), ids)
    assert_idle_and_working(target, draft, ids, expected)


def test_close_workers_and_restart(pair, case):
    target, draft = pair
    ids, expected = case
    ssd(target, draft, ids)
    pids = worker_pids()
    close_workers()
    assert worker_pids() == [] and not any(pid_alive(pid) for pid in pids)
    assert torch.equal(ssd(target, draft, ids), expected)
    assert target.ssd_metrics.worker_start_seconds > 0  # a fresh worker, its start-up reported


def test_auto_runs_on_a_thread_until_a_worker_is_ready(pair, case):
    target, draft = pair
    ids, expected = case
    close_workers()
    assert torch.equal(ssd(target, draft, ids, executor="auto"), expected)
    assert target.ssd_metrics.executor == "thread"  # no worker yet: one starts in the background
    deadline = time.time() + 120
    while not POOL._idle and time.time() < deadline:
        time.sleep(0.1)
    assert torch.equal(ssd(target, draft, ids, executor="auto"), expected)
    assert target.ssd_metrics.executor == "process"


def test_a_worker_started_ahead_serves_auto_from_the_first_call(pair, case):
    from hf_ssd.runtime import start_draft_worker

    target, draft = pair
    ids, expected = case
    close_workers()
    assert start_draft_worker(draft) > 0 and len(worker_pids()) == 1
    assert torch.equal(ssd(target, draft, ids, executor="auto"), expected)
    m = target.ssd_metrics
    assert m.executor == "process" and m.worker_start_seconds == 0.0 and m.draft_load_seconds == 0.0


def test_a_draft_with_hooks_does_not_cross(pair, case):
    target, draft = pair
    ids, expected = case
    local = failing_copy(draft, -1)  # never fails; a fresh object with a hook that cannot be pickled
    hook = local.register_forward_hook(lambda *args: None)
    try:
        with pytest.raises(ValueError, match="does not pickle|do not pickle"):
            ssd(target, local, ids)
        assert not POOL._busy and all(pid_alive(pid) for pid in worker_pids())  # the worker was left as it was
        assert torch.equal(ssd(target, local, ids, executor="auto"), expected)
        assert target.ssd_metrics.executor == "thread"
        assert torch.equal(ssd(target, local, ids, executor="auto"), expected)  # tried once: stays on the thread
        assert target.ssd_metrics.executor == "thread"
    finally:
        hook.remove()
    # the hook removed, the draft crosses: auto hands it to the worker, which was left as it was
    assert torch.equal(ssd(target, local, ids, executor="auto"), expected)
    assert target.ssd_metrics.executor == "process"


def test_a_draft_defined_in_main_cannot_cross(pair, case):
    target, draft = pair
    ids, expected = case
    local_cls = type("LocalDraft", (type(draft),), {"__module__": "__main__"})
    local = local_cls(draft.config).eval()
    local.load_state_dict(draft.state_dict())
    with pytest.raises(ValueError, match="defined in the script being run"):
        ssd(target, local, ids)
    assert torch.equal(ssd(target, local, ids, executor="auto"), expected)
    assert target.ssd_metrics.executor == "thread"


SCRIPT = textwrap.dedent("""
    import os, sys, time, torch
    sys.path[:0] = [{tests!r}, {root!r}]
    from conftest import tiny_pair
    from hf_ssd import SSDConfig
    from hf_ssd.runtime.pool import worker_pids
    target, draft = tiny_pair("llama", seed=3)
    ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(0))
    executor = "auto" if sys.argv[1] == "auto" else "process"
    target.generate(ids, assistant_model=draft, ssd_config=SSDConfig(executor=executor), max_new_tokens=8,
                    do_sample=False)
    print(target.ssd_metrics.executor, *worker_pids(), flush=True)
    if sys.argv[1] == "hang":
        time.sleep(600)
""")


def marked_processes(mark: str) -> list[int]:
    """Running processes whose environment carries `mark` (a script's children inherit it)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as fh:
                    if mark.encode() in fh.read() and pid_alive(int(entry)):
                        found.append(int(entry))
            except OSError:
                pass
    return found


@pytest.mark.parametrize("how", ["exit", "kill", "auto"])
def test_no_orphan_after_the_interpreter_ends(how, tmp_path):
    """Unguarded script (no `if __name__ == "__main__"`), no explicit close: at a normal exit the worker is closed;
    when the parent is killed with SIGKILL the worker notices and exits by itself; a worker still starting (auto
    starts one as its first call returns) is abandoned at exit, cleanly (exit status 0)."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.format(tests=os.path.join(ROOT, "tests"), root=ROOT))
    mark = f"hf-ssd-test-{os.getpid()}-{time.time_ns()}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_SSD_TEST_MARK": mark}
    proc = subprocess.Popen([sys.executable, str(script), {"kill": "hang"}.get(how, how)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    assert line.strip(), proc.stderr.read()
    executor, *pids = line.split()
    assert executor == ("thread" if how == "auto" else "process") and len(pids) == (0 if how == "auto" else 1)
    if how == "kill":
        proc.kill()
    assert proc.wait(timeout=120) == (-signal.SIGKILL if how == "kill" else 0), proc.stderr.read()
    deadline = time.time() + 10
    while marked_processes(mark) and time.time() < deadline:
        time.sleep(0.05)
    assert marked_processes(mark) == [], f"a worker outlived its parent ({how})"


class _FakeWorker:
    """Records the requests sent; answers each with the next queued reply, counting the replies read."""

    def __init__(self, replies):
        from hf_ssd.runtime import wire

        self.control = wire.shared_control()
        self.sent, self.payloads, self.replies, self.read = [], [], list(replies), 0

    def send(self, op, generation, a=0, b=0, c=0, payload=None, d=0):
        self.sent.append((op, a, b, c, d))
        if payload is not None:
            self.payloads.append(payload)

    def receive(self, timeout, what):
        self.read += 1
        return self.replies.pop(0)


def _executor(replies):
    from hf_ssd.runtime import wire
    from hf_ssd.runtime.executor import DraftRequest
    from hf_ssd.runtime.process import ProcessExecutor

    request = DraftRequest(SSDConfig(lookahead=3).to_dict(), False, [], VOCAB, 0, 1, 1)
    executor = ProcessExecutor(SimpleNamespace(device=torch.device("cpu")), request)
    executor.worker = _FakeWorker(replies)
    executor.buffers = wire.RoundBuffers.allocate(2, 3, None, torch.device("cpu"))
    return executor


def test_rounds_the_draft_sat_out_reach_it_together_and_their_fault_still_surfaces():
    """Rounds the draft sits out (a prepare of depth 0, a resolve with nothing drafted just in time, a plain
    stretch) send nothing: their results are known at once (empty speculations). They reach the worker in one
    request, in order, when the draft next works — ahead of that work — and an error in it is raised in the
    caller at the next reply it waits for."""
    from hf_ssd.runtime import wire

    executor = _executor([])
    for bonus in ([5, 6], [7, 8]):
        assert executor.prepare(0, 0, 1).result() is None
        executor.announce([0, 0], bonus)
        resolutions = executor.resolve([0, 0], bonus, 0, [0, 1], "draft").result()
        assert [(r.speculation.tokens.numel(), r.speculation.source, r.hit, r.looked_up) for r in resolutions] == [
            (0, "plain", False, False)] * 2
    stretch = [([(0, 9), (0, 10)], 0, [0, 1]), ([(0, 11), (0, 12)], 0, [1])]
    assert len(executor.sat_out(stretch).result()) == 1  # the rows the last round keeps
    assert executor.worker.sent == [] and executor.worker.read == 0
    executor.worker.replies += [(wire.OK, 0, wire.SAT_OUT, None), (wire.OK, 0, wire.PREPARE, None)]
    executor.prepare(1, 3, 2).result()
    assert [request[0] for request in executor.worker.sent] == [wire.SAT_OUT, wire.PREPARE]
    assert executor.worker.payloads == [[([(0, 5), (0, 6)], 0, [0, 1]), ([(0, 7), (0, 8)], 0, [0, 1]), *stretch]]
    assert executor.worker.read == 2
    # a serial round after one the draft sat out: the paused prepare goes first, then the resolve, waited for
    executor.worker.replies += [(wire.OK, 0, wire.PREPARE, None), (wire.OK, 0, wire.RESOLVE, None)]
    executor.prepare(2, 0, 1).result()
    executor.resolve([1, 0], [7, 8], 2, [0, 1], "draft", serial=2).result()
    assert executor.worker.sent[2:] == [(wire.PREPARE, 4, 2, 0, 0), (wire.RESOLVE, 2, 0, 2, 2)]  # round 4, verify 2
    assert executor.worker.read == 4

    boom = (wire.ERROR, 0, wire.SAT_OUT, (DraftBoom("sat out failed"), "DraftBoom: sat out failed", "traceback"))
    failing = _executor([boom, (wire.OK, 0, wire.PREPARE, None)])
    failing.prepare(0, 0, 1).result()
    failing.resolve([0, 0], [5, 6], 0, [0, 1], "draft").result()  # known: returns
    with pytest.raises(DraftBoom, match="sat out failed"):
        failing.prepare(1, 3, 2).result()
