"""The per-round fan-out budget (B_r in {B, B/2, ..., 1}): the choice on synthetic measurements, and losslessness
when the budget changes between rounds under greedy decoding (every architecture and executor, a batch) and
sampling (the exact law, with a negative control)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_pair
from test_lookahead import batch_greedy_runs, law_models  # noqa: F401  (law_models: a fixture)
from test_sampling_law import (
    REJECT,
    SAMPLES,
    TEMPERATURE,
    WARPED,
    exact_law,
    law_pvalues,
    ssd_samples,
    swap_cached_q,
)

from hf_ssd import SSDConfig
from hf_ssd.generation.budget import FanoutBudget, budget_options
from hf_ssd.generation.fanout import FanoutEstimator

# --- the choice, on synthetic measurements ---------------------------------------------------------------------


def test_budget_options_halve_down_to_one():
    assert budget_options(8) == [8, 4, 2, 1]
    assert budget_options(5) == [5, 2, 1]
    assert budget_options(1) == [1]
    assert FanoutBudget(8, adaptive=False, power=1.0, concurrent=True).options == [8]


def _choose(budget: FanoutBudget, verify=0.4, backup=0.2, e=3.0):
    return budget.choose(verify, backup, 0.0, e, e, 0.3)[0]


def test_the_full_budget_stays_while_the_draft_fits_inside_the_verification():
    budget = FanoutBudget(8, adaptive=True, power=1.0, concurrent=True)
    for _ in range(10):
        assert _choose(budget) == 8
        budget.observe(8, 0.3, hits=7, lookups=10)  # 300 ms of drafting beside a 400 ms verification
    # half the budget is guessed in proportion to branches (cheaper), but the round is the verification's anyway:
    # fewer branches would only miss more; smaller ones are not considered before half the budget is measured
    rates = budget.choose(0.4, 0.2, 0.0, 3.0, 3.0, 0.3)[1]
    assert set(rates) == {8, 4} and rates[8] > rates[4]


def test_a_draft_that_outlasts_the_verification_tries_fewer_branches_and_keeps_what_pays():
    budget = FanoutBudget(8, adaptive=True, power=1.0, concurrent=True)
    budget.observe(8, 0.9, hits=9, lookups=10)  # the draft's round: 900 ms beside a 400 ms verification
    assert _choose(budget) == 4  # guessed 450 ms at 4 branches: tried
    budget.observe(4, 0.5, hits=8, lookups=10)  # measured: 500 ms, and it still hits often
    assert budget.draft_seconds(2) == pytest.approx(0.3)  # on the line through 4 and 8 (100 ms a branch)
    assert _choose(budget) == 2  # might be faster still: tried
    budget.observe(2, 0.48, hits=5, lookups=10)  # hardly cheaper (the glue and the steps' fixed costs), more misses
    assert _choose(budget) == 4
    assert _choose(budget) == 4


def test_a_flat_draft_cost_returns_to_the_full_budget():
    """Tree steps cost about the same at any width (memory-bound): after one try at half the budget, the full one
    wins again (same time, fewer misses)."""
    budget = FanoutBudget(8, adaptive=True, power=1.0, concurrent=True)
    budget.observe(8, 0.9, hits=8, lookups=10)
    assert _choose(budget, backup=0.4) == 4
    budget.observe(4, 0.88, hits=6, lookups=10)  # a miss costs the draft's 400 ms just-in-time backup
    assert _choose(budget, backup=0.4) == 8


def test_misses_follow_the_power_law_until_measured():
    budget = FanoutBudget(8, adaptive=True, power=1.0, concurrent=True)
    assert budget.miss_rate(4, fallback=0.2) == pytest.approx(0.4)  # from the run's hit rate, at the budget in use
    budget.observe(8, 0.1, hits=9, lookups=10)
    assert budget.miss_rate(8, fallback=0.5) == pytest.approx(0.1)
    assert budget.miss_rate(2, fallback=0.5) == pytest.approx(0.4)
    assert budget.miss_rate(1, fallback=0.5) == pytest.approx(0.8)


def test_inline_draft_time_adds_to_the_round():
    """With the draft inline (no overlap) its time always adds up: fewer branches pay once they save more than the
    extra misses cost."""
    budget = FanoutBudget(8, adaptive=True, power=0.5, concurrent=False)
    budget.observe(8, 0.3, hits=9, lookups=10)
    budget.observe(4, 0.1, hits=9, lookups=10)
    budget.current = 8
    assert _choose(budget, backup=0.05) == 4


def test_the_estimator_schedules_a_smaller_budget():
    estimator = FanoutEstimator("geometric", 8, 3, 100, 0.7, 1.0)
    assert sum(estimator.schedule("hit")) == 8
    assert sum(estimator.schedule("hit", budget=3)) == 3
    assert sum(estimator.schedule("hit", 2, budget=1)) == 1
    assert sum(estimator.schedule("hit", budget=50)) == 8  # never more than B
    explicit = FanoutEstimator([2, 1, 1, 0], 4, 3, 100, 0.7, 1.0)
    assert explicit.schedule("hit", budget=1) == [2, 1, 1, 0]  # an explicit fan-out is prepared whole


# --- losslessness when the budget changes ----------------------------------------------------------------------

BUDGETS = [8, 1, 3, 2, 8, 4, 1, 5]  # scripted per round (capped at B by the drafter)


def _script_budgets(monkeypatch, budgets):
    """The policy's budget choice cycles through `budgets`, whatever the timing."""
    seen = []

    def choose(self, *args, **kwargs):
        self.current = budgets[len(seen) % len(budgets)]
        seen.append(self.current)
        return self.current, {}

    monkeypatch.setattr(FanoutBudget, "choose", choose)
    return seen


ARCHS = ["llama", "qwen2", "mistral_sliding", "qwen2_hybrid"]


@pytest.mark.parametrize("executor", ["sync", "thread", "stream", "process"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identical_while_the_budget_changes(monkeypatch, arch, executor):
    seen = _script_budgets(monkeypatch, BUDGETS)
    target, random_draft = tiny_pair(arch, seed=90 + ARCHS.index(arch))
    ids = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(ARCHS.index(arch) + 2))
    expected = target.generate(ids, max_new_tokens=31, do_sample=False)
    for draft in (target, random_draft):
        seen.clear()
        out = target.generate(ids, assistant_model=draft, max_new_tokens=31, do_sample=False,
                              ssd_config=SSDConfig(lookahead=3, fanout_budget=8, executor=executor,
                                                   lookahead_schedule="constant"))
        assert torch.equal(out, expected), (arch, executor)
        m = target.ssd_metrics
        assert len(seen) >= 5 and m.fanout_budget_per_round == seen
        if draft is target:
            assert m.cache_hits > 0 and m.draft_acceptance_rate == 1.0


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_batch_greedy_identical_while_the_budget_changes(monkeypatch, executor):
    seen = _script_budgets(monkeypatch, BUDGETS)
    for _ in batch_greedy_runs(72, 8, 21, SSDConfig(lookahead=3, executor=executor)):
        pass  # each run's output is checked against plain batched decoding
    assert len(set(seen)) > 1


LAW_BUDGETS = [1, 4, 2, 3]


@pytest.mark.parametrize("draft, c, backup, executor, sampling", [
    pytest.param("self", 0.3, "draft", "sync", TEMPERATURE, id="self-C0.3-draft-sync"),
    pytest.param("random", 1.0, "ngram", "process", WARPED, id="rand-C1-ngram-process-warped"),
])
def test_sampling_law_while_the_budget_changes(monkeypatch, law_models, draft, c, backup, executor,  # noqa: F811
                                               sampling):
    """4 new tokens per sample; each round prepares 1, 4, 2, then 3 branches: the law is the target's."""
    _script_budgets(monkeypatch, LAW_BUDGETS)
    target = law_models["target"]
    config = SSDConfig(lookahead=2, fanout_budget=4, saguaro_c=c, backup=backup, executor=executor,
                       lookahead_schedule="constant")
    counts, hits, misses = ssd_samples(target, law_models[draft], config, sampling, seed=97)
    pvalues = law_pvalues(exact_law(target, sampling), counts)
    print(f"p-values {pvalues}, hits {hits}, misses {misses}")
    assert hits > 0 and min(pvalues.values()) >= 1e-5, pvalues


def test_negative_control_hit_path_q_misaligned_while_the_budget_changes(monkeypatch, law_models):  # noqa: F811
    """Power check under the same scripted budgets: cached branches handed over with their two steps' q swapped
    are rejected."""
    _script_budgets(monkeypatch, LAW_BUDGETS)
    swap_cached_q(monkeypatch)
    target = law_models["target"]
    config = SSDConfig(lookahead=2, fanout_budget=4, saguaro_c=0.05, backup="ngram", executor="sync",
                       lookahead_schedule="constant")
    counts, hits, _ = ssd_samples(target, target, config, TEMPERATURE, seed=2024, samples=SAMPLES // 2)
    pvalues = law_pvalues(exact_law(target, TEMPERATURE), counts)
    print(f"negative control p-values {pvalues}, hits {hits}")
    assert hits > 0 and min(pvalues.values()) < REJECT, pvalues
