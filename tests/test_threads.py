"""Intra-op thread counts: the split between draft and target, and the count just-in-time drafting learns
(`ThreadChoice`)."""

from __future__ import annotations

import torch

from hf_ssd.runtime.threads import ThreadChoice, drafted_tokens, drafting_threads, split_threads, torch_threads


def test_split_threads_gives_each_side_at_least_one():
    draft, target = split_threads(None, None)
    assert draft >= 1 and target >= 1
    assert split_threads(3, 5) == (3, 5)


def test_a_thread_choice_tries_each_count_then_keeps_the_fastest():
    choice = ThreadChoice((2, 1, 2), tries=2, retry=1000)
    assert choice.candidates == (2, 1)
    seconds = {2: 0.090, 1: 0.050}  # per token: one thread is faster here
    picks = []
    for _ in range(8):
        count = choice.pick()
        picks.append(count)
        choice.record(count, 3 * seconds[count], 3)
    assert picks[:4] == [2, 2, 1, 1] and picks[4:] == [1, 1, 1, 1]
    assert abs(choice.mean[1] - 0.050) < 1e-9 and abs(choice.mean[2] - 0.090) < 1e-9


def test_a_thread_choice_tries_the_others_again_and_follows_a_change():
    choice = ThreadChoice((2, 1), tries=1, retry=4)
    seconds = {2: 0.090, 1: 0.050}
    picks = []
    for call in range(1, 41):
        if call == 12:
            seconds = {2: 0.040, 1: 0.050}  # the machine changed: two threads now win
        count = choice.pick()
        picks.append(count)
        choice.record(count, seconds[count], 1)
    assert picks[:2] == [2, 1] and 2 in picks[2:8]  # the loser is retried every 4 calls
    assert picks[-4:-1] == [2, 2, 2]  # and wins once it is faster


def test_a_thread_choice_ignores_runs_without_work_and_restores_the_threads():
    choice = ThreadChoice((2, 1), tries=1)
    choice.record(2, 1.0, 0)
    choice.record(7, 1.0, 1)  # not a candidate
    assert choice.mean == {} and choice.runs == {2: 0, 1: 0}
    with torch_threads(3):
        seen = choice.run(torch.get_num_threads, lambda result: 1)
        assert seen == 2 and torch.get_num_threads() == 3
    assert choice.runs[2] == 1


def test_the_choice_is_kept_per_draft_and_per_candidates():
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    assert drafting_threads(a, (2, 1)) is drafting_threads(a, (2, 1))
    assert drafting_threads(a, (2, 1)) is not drafting_threads(b, (2, 1))
    assert drafting_threads(a, (4, 1)) is not drafting_threads(a, (2, 1))
    assert drafted_tokens([]) == 0


def test_openmp_threads_spin_briefly_unless_the_caller_chose():
    from hf_ssd.openmp import SPIN_COUNT, openmp_wait_env

    assert openmp_wait_env({}) == {"GOMP_SPINCOUNT": SPIN_COUNT}
    assert openmp_wait_env({"OMP_WAIT_POLICY": "PASSIVE"}) == {}
    assert openmp_wait_env({"GOMP_SPINCOUNT": "0"}) == {}


def test_a_worker_is_spawned_with_the_short_spin_and_the_environment_is_restored(monkeypatch):
    import os

    from hf_ssd.openmp import SPIN_COUNT
    from hf_ssd.runtime.pool import _short_spin_waits

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    with _short_spin_waits():
        assert os.environ["GOMP_SPINCOUNT"] == SPIN_COUNT  # what the spawned child reads
    assert "GOMP_SPINCOUNT" not in os.environ
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    with _short_spin_waits():
        assert "GOMP_SPINCOUNT" not in os.environ  # the caller's policy stands


def _count_seen_by_a_new_thread(initializer) -> int:
    """The intra-op count a pool thread started with `initializer(1)` works with when the caller's thread sets 2
    between that start and the pool thread's first op (what the draft's thread met: the target's prefill on every
    core)."""
    from concurrent.futures import ThreadPoolExecutor
    from threading import Event

    started, go = Event(), Event()

    def first_op():
        started.set()
        go.wait(10)
        torch.ones(64, 64).sum()  # a parallel region's first use initialises the thread's count
        return torch.get_num_threads()

    saved = torch.get_num_threads()
    with ThreadPoolExecutor(1, initializer=initializer, initargs=(1,)) as pool:
        try:
            future = pool.submit(first_op)
            started.wait(10)
            torch.set_num_threads(2)
            go.set()
            return future.result(10)
        finally:
            torch.set_num_threads(saved)


def test_a_draft_thread_keeps_its_own_count_when_the_caller_sets_another():
    from hf_ssd.runtime.threads import own_threads

    assert _count_seen_by_a_new_thread(own_threads) == 1
    # the plain setter (what the draft's thread used): torch's lazy per-thread initialisation replaced it by the
    # caller's count, and the draft's OpenMP team of 2 beside the target's made libgomp stop spinning
    assert _count_seen_by_a_new_thread(torch.set_num_threads) == 2


def test_a_worker_process_is_started_only_for_drafts_with_short_steps():
    from hf_ssd.generation.candidate_generator import DraftTimings
    from hf_ssd.runtime.local import WORKER_PAYS_BELOW, worker_pays

    assert worker_pays(DraftTimings())  # nothing timed: as before
    short, long = WORKER_PAYS_BELOW / 4, WORKER_PAYS_BELOW * 2
    assert worker_pays(DraftTimings(serial_steps=10, serial_step_seconds=10 * short))
    assert not worker_pays(DraftTimings(serial_steps=10, serial_step_seconds=10 * long))  # the 0.5B int8 draft
    assert worker_pays(DraftTimings(prepare_calls=5, prepare_seconds=5 * 2 * short, fastest_prepare=2 * short))
    assert not worker_pays(DraftTimings(prepare_calls=5, prepare_seconds=5 * 2 * long, fastest_prepare=2 * long))
    # a short call's cold first prepare does not hide short steps: the quickest decides
    assert worker_pays(DraftTimings(prepare_calls=3, prepare_seconds=0.3, fastest_prepare=2 * short))
    # the quicker of the two kinds of timing decides
    assert not worker_pays(DraftTimings(prepare_calls=5, prepare_seconds=5 * 2 * long, fastest_prepare=2 * long,
                                        serial_steps=4, serial_step_seconds=4 * long))
    assert worker_pays(DraftTimings(prepare_calls=5, prepare_seconds=5 * 2 * long, fastest_prepare=2 * long,
                                    serial_steps=4, serial_step_seconds=4 * short))
