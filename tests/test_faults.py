"""Failures during SSD generation: draft-side exceptions surface in the caller, KeyboardInterrupt from the target
side stops cleanly, and in every case the worker thread is gone, the torch thread count restored and the next
call correct. Concurrent generate() calls on one model are serialised and correct."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch
from conftest import tiny_pair
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from hf_ssd import SSDConfig
from hf_ssd.generation.candidate_generator import SaguaroCandidateGenerator

VOCAB = 96
NEW = 20


class DraftBoom(RuntimeError):
    pass


@pytest.fixture(scope="module")
def pair():
    return tiny_pair("llama", seed=4)


@pytest.fixture(scope="module")
def case(pair):
    target, _ = pair
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(21))
    return ids, target.generate(ids, max_new_tokens=NEW, do_sample=False)


def draft_threads_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("hf-ssd-draft") and t.is_alive()]


def ssd(target, draft, ids, executor, **kwargs):
    """SSD with the draft at work every round (a constant schedule: the adaptive one pauses a useless draft)."""
    config = SSDConfig(lookahead=3, executor=executor, lookahead_schedule="constant")
    return target.generate(ids, assistant_model=draft, ssd_config=config, max_new_tokens=NEW, do_sample=False,
                           **kwargs)


def assert_clean_and_working(target, draft, ids, expected, executor, threads_before):
    assert draft_threads_alive() == []
    assert torch.get_num_threads() == threads_before
    assert torch.equal(ssd(target, draft, ids, executor), expected)
    assert target.ssd_metrics.generated_tokens == NEW
    assert draft_threads_alive() == []
    assert torch.get_num_threads() == threads_before


class EndCounter(BaseStreamer):
    def __init__(self):
        self.ends = 0

    def put(self, value):
        pass

    def end(self):
        self.ends += 1


def raise_after(original, n: int, error: BaseException):
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) > n:
            raise error
        return original(*args, **kwargs)

    return wrapped, calls


@pytest.mark.parametrize("executor", ["thread", "stream", "sync"])
@pytest.mark.parametrize("where", ["prepare", "begin", "resolve"])
def test_drafter_exception_surfaces(pair, case, monkeypatch, executor, where):
    target, random_draft = pair
    ids, expected = case
    threads_before = torch.get_num_threads()
    n = 0 if where == "begin" else 2
    wrapped, calls = raise_after(getattr(SaguaroCandidateGenerator, where), n, DraftBoom(f"boom in {where}"))
    monkeypatch.setattr(SaguaroCandidateGenerator, where, wrapped)
    for draft in (target, random_draft):
        calls.clear()
        streamer = EndCounter()
        with pytest.raises(DraftBoom, match=f"boom in {where}"):
            ssd(target, draft, ids, executor, streamer=streamer)
        assert len(calls) == n + 1
        assert streamer.ends == 1  # a waiting consumer is released
        assert draft_threads_alive() == []
        assert torch.get_num_threads() == threads_before
    monkeypatch.undo()
    for draft in (target, random_draft):
        assert_clean_and_working(target, draft, ids, expected, executor, threads_before)


@pytest.mark.parametrize("executor", ["thread", "stream", "sync"])
def test_draft_model_forward_exception_surfaces(pair, case, monkeypatch, executor):
    target, random_draft = pair
    ids, expected = case
    threads_before = torch.get_num_threads()
    for n in (0, 1, 4):
        wrapped, calls = raise_after(random_draft.forward, n, DraftBoom("draft forward failed"))
        monkeypatch.setattr(random_draft, "forward", wrapped)
        with pytest.raises(DraftBoom, match="draft forward failed"):
            ssd(target, random_draft, ids, executor)
        assert len(calls) == n + 1
        monkeypatch.undo()
        assert_clean_and_working(target, random_draft, ids, expected, executor, threads_before)


class InterruptOnCall(LogitsProcessor):
    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.n:
            raise KeyboardInterrupt
        return scores


class InterruptingCriterion(StoppingCriteria):
    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls == self.n:
            raise KeyboardInterrupt
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.parametrize("executor", ["thread", "stream", "sync"])
def test_keyboard_interrupt_from_target_side(pair, case, executor):
    target, random_draft = pair
    ids, expected = case
    threads_before = torch.get_num_threads()
    for draft in (target, random_draft):
        processor = InterruptOnCall(3)
        with pytest.raises(KeyboardInterrupt):
            ssd(target, draft, ids, executor, logits_processor=LogitsProcessorList([processor]))
        assert processor.calls == 3
        assert_clean_and_working(target, draft, ids, expected, executor, threads_before)

        criterion = InterruptingCriterion(6)  # mid-way through the second round
        with pytest.raises(KeyboardInterrupt):
            ssd(target, draft, ids, executor, stopping_criteria=StoppingCriteriaList([criterion]))
        assert criterion.calls == 6
        assert_clean_and_working(target, draft, ids, expected, executor, threads_before)


def test_keyboard_interrupt_in_draft_worker(pair, case, monkeypatch):
    """Even a KeyboardInterrupt inside draft work reaches the caller (not swallowed by the worker thread)."""
    target, random_draft = pair
    ids, expected = case
    threads_before = torch.get_num_threads()
    for executor in ("thread", "sync"):
        wrapped, _ = raise_after(SaguaroCandidateGenerator.prepare, 1, KeyboardInterrupt())
        monkeypatch.setattr(SaguaroCandidateGenerator, "prepare", wrapped)
        with pytest.raises(KeyboardInterrupt):
            ssd(target, random_draft, ids, executor)
        monkeypatch.undo()
        assert_clean_and_working(target, random_draft, ids, expected, executor, threads_before)


def test_ctrl_c_while_the_draft_works(pair, case, monkeypatch):
    """A real SIGINT delivered to the main thread while the worker is busy drafting: KeyboardInterrupt in the
    caller, the worker stops at its next check and is joined."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are handled on the main thread only")
    target, random_draft = pair
    ids, expected = case
    threads_before = torch.get_num_threads()
    original = SaguaroCandidateGenerator.prepare
    calls = []

    def prepare(self, *args):
        calls.append(1)
        if len(calls) == 2:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            time.sleep(0.2)  # still drafting when the caller is interrupted
        return original(self, *args)

    monkeypatch.setattr(SaguaroCandidateGenerator, "prepare", prepare)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            ssd(target, random_draft, ids, "thread")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert len(calls) == 2
    monkeypatch.undo()
    assert_clean_and_working(target, random_draft, ids, expected, "thread", threads_before)


@pytest.mark.parametrize("executor", ["thread", "stream", "sync", "process"])
def test_concurrent_generate_on_one_model(pair, executor):
    target, random_draft = pair
    prompts = [torch.randint(0, VOCAB, (1, 6 + i), generator=torch.Generator().manual_seed(30 + i))
               for i in range(2)]
    expected = [target.generate(p, max_new_tokens=NEW, do_sample=False) for p in prompts]
    threads_before = torch.get_num_threads()
    results: dict[int, object] = {}
    barrier = threading.Barrier(2)

    def work(i):
        try:
            barrier.wait(timeout=30)
            for _ in range(2):
                draft = target if i == 0 else random_draft
                out = ssd(target, draft, prompts[i], executor, return_dict_in_generate=True)
                assert torch.equal(out.sequences, expected[i])
                assert out.ssd_metrics.generated_tokens == NEW
            results[i] = "ok"
        except BaseException as err:
            results[i] = err

    workers = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert not any(worker.is_alive() for worker in workers)
    assert results == {0: "ok", 1: "ok"}, results
    assert draft_threads_alive() == []
    assert torch.get_num_threads() == threads_before


class RecordThreads(LogitsProcessor):
    def __init__(self):
        self.seen = set()

    def __call__(self, input_ids, scores):
        self.seen.add(torch.get_num_threads())
        return scores


@pytest.mark.parametrize("executor", ["thread", "stream", "sync"])
def test_thread_counts_during_and_after(pair, case, monkeypatch, executor):
    """The draft worker and the target run with the configured intra-op thread counts; the caller's is restored."""
    target, random_draft = pair
    ids, expected = case
    threads_before = torch.get_num_threads()
    original = SaguaroCandidateGenerator.prepare
    draft_seen = set()

    def prepare(self, *args):
        drafting = args[1] != 0  # a paused prepare (depth 0) drafts nothing: it runs inline, in the caller's thread
        draft_seen.add((drafting, threading.current_thread().name.startswith("hf-ssd-draft"), torch.get_num_threads()))
        return original(self, *args)

    monkeypatch.setattr(SaguaroCandidateGenerator, "prepare", prepare)
    processor = RecordThreads()
    config = SSDConfig(executor=executor, draft_threads=2, target_threads=3)
    out = target.generate(ids, assistant_model=random_draft, ssd_config=config, max_new_tokens=NEW, do_sample=False,
                          logits_processor=LogitsProcessorList([processor]))
    assert torch.equal(out, expected)
    if executor in ("thread", "stream"):
        assert processor.seen == {3} and {seen for seen in draft_seen if seen[0]} == {(True, True, 2)}
        assert {seen for seen in draft_seen if not seen[0]} == {(False, False, 3)}  # paused: inline
        assert (target.ssd_metrics.draft_threads, target.ssd_metrics.target_threads) == (2, 3)
    else:  # inline: the caller's own thread and thread count
        assert processor.seen == {threads_before}
        assert {seen[1:] for seen in draft_seen} == {(False, threads_before)}
    assert torch.get_num_threads() == threads_before
    assert draft_threads_alive() == []


@pytest.mark.parametrize("executor", ["thread", "stream"])
def test_only_drafting_prepares_leave_the_callers_thread(pair, case, monkeypatch, executor):
    """`begin` and `resolve` are waited for at once, so they run in the caller's thread (the prefill and just-in-time
    drafting on every core there); only a `prepare` that drafts runs on the draft's thread, never on more than the
    draft's intra-op threads: a second OpenMP team there that, with the target's, outnumbers the cores makes libgomp
    stop spinning, and every parallel region of the target's then waits for a futex wake-up."""
    target, random_draft = pair
    ids, expected = case
    seen: dict[str, set] = {"begin": set(), "prepare": set(), "resolve": set()}
    for name in seen:
        original = getattr(SaguaroCandidateGenerator, name)

        def spy(self, *args, _name=name, _original=original, **kwargs):
            on_draft_thread = threading.current_thread().name.startswith("hf-ssd-draft")
            drafting = _name != "prepare" or args[1] != 0
            seen[_name].add((on_draft_thread, drafting, torch.get_num_threads()))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(SaguaroCandidateGenerator, name, spy)
    for draft in (target, random_draft):  # a draft that speculates, and one the policy pauses and probes with
        config = SSDConfig(executor=executor, draft_threads=2, target_threads=3)
        out = target.generate(ids, assistant_model=draft, ssd_config=config, max_new_tokens=NEW, do_sample=False)
        assert torch.equal(out, expected)
    assert {on for on, _, _ in seen["begin"] | seen["resolve"]} == {False}
    assert (True, True, 2) in seen["prepare"]  # speculation was drafted beside the verification
    assert all(threads == 2 for on, _, threads in seen["prepare"] if on)
    assert {(drafting, on) for on, drafting, _ in seen["prepare"]} <= {(True, True), (False, False)}
    assert draft_threads_alive() == []
