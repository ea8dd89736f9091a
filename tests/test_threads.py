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
