"""Unit tests of the algorithm's pure parts: fan-out, Saguaro rescaling, greedy verification, keys, backups."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_ssd import SSDConfig
from hf_ssd.cache.speculation_cache import SpeculationCache
from hf_ssd.generation.backup import backup_speculation, ngram_lookup
from hf_ssd.generation.fanout import (
    FanoutEstimator,
    cap_fanout,
    fit_power_law,
    geometric_fanout,
    geometric_weights,
    outcome_probabilities,
    round_preserving_sum,
    uniform_fanout,
)
from hf_ssd.generation.saguaro import draft_probs, saguaro_logits
from hf_ssd.generation.verification import greedy_verify, residual_distribution

# --- fan-out -------------------------------------------------------------------------------------------------


def test_geometric_weights_match_theorem_12_example():
    """a=0.8, r=1, K=7, B=24 → about [3.9, 3.5, 3.1, 2.8, 2.5, 2.2, 2.0, 4.0] (Theorem 12 of the paper)."""
    w = geometric_weights(0.8, 1.0, 7)
    scaled = [x * 24 / sum(w) for x in w]
    expected = [3.9, 3.5, 3.1, 2.8, 2.5, 2.2, 2.0, 4.0]
    assert [round(x, 1) for x in scaled] == pytest.approx(expected, abs=0.11)
    assert sum(geometric_fanout(0.8, 1.0, 7, 24)) == 24


def test_outcome_probabilities_sum_to_one():
    assert sum(outcome_probabilities(0.63, 5)) == pytest.approx(1.0)


@given(
    a=st.floats(0.01, 0.99), r=st.floats(0.1, 4.0), k=st.integers(1, 10), budget=st.integers(1, 64)
)
@settings(max_examples=200, deadline=None)
def test_geometric_fanout_is_a_valid_allocation(a, r, k, budget):
    fanout = geometric_fanout(a, r, k, budget)
    assert len(fanout) == k + 1 and sum(fanout) == budget and min(fanout) >= 0
    # never more than one branch away from the real-valued optimum
    w = geometric_weights(a, r, k)
    assert all(abs(f - x * budget / sum(w)) < 1 for f, x in zip(fanout, w))


def test_geometric_fanout_decreases_with_k_before_the_last_position():
    fanout = geometric_fanout(0.6, 1.0, 5, 40)
    assert fanout[:-1] == sorted(fanout[:-1], reverse=True)
    low = geometric_fanout(0.1, 1.0, 4, 10)  # a weak (backup) speculation: nearly everything at k=0
    assert low[0] >= 6 and low[0] == max(low)


def test_uniform_and_round_preserving():
    assert uniform_fanout(3, 10) == [3, 3, 2, 2]
    assert round_preserving_sum([1, 1, 1], 4) == [2, 1, 1]
    with pytest.raises(ValueError):
        round_preserving_sum([0, 0], 3)
    assert cap_fanout([10, 10, 10], 6) == [5, 5, 6]


def test_power_law_fit_recovers_exponent():
    r = 1.3
    hits = {f: [round(1000 * (1 - 0.6 * f**-r)), 1000] for f in (1, 2, 4, 8)}
    assert fit_power_law(hits, prior=0.5) == pytest.approx(r, abs=0.1)
    assert fit_power_law({1: [3, 5]}, prior=0.7) == 0.7  # too little data: the prior


def test_estimator_adapts_acceptance_and_keeps_schedules_apart():
    est = FanoutEstimator("geometric", 12, 3, 1000, a_prior=0.5, r_prior=1.0)
    prior = est.schedules()
    for _ in range(50):
        est.record_round("hit", 3, 3)  # everything accepted after cached speculations
        est.record_round("miss", 0, 3)  # nothing after backup ones
    assert est.acceptance("hit") > 0.9 and est.acceptance("miss") < 0.1
    sched = est.schedules()
    assert sched["hit"][-1] > prior["hit"][-1]  # budget moves to "all accepted"
    assert sched["miss"][0] >= 10  # and to k=0 after a backup
    fixed = FanoutEstimator([1, 2, 3, 4], 10, 3, 1000, 0.5, 1.0)
    assert fixed.schedule("hit") == [1, 2, 3, 4]
    frozen = FanoutEstimator("geometric", 12, 3, 1000, 0.5, 1.0, adaptive=False)
    frozen.record_round("hit", 3, 3)
    assert frozen.schedules() == prior


# --- Saguaro -------------------------------------------------------------------------------------------------


def test_saguaro_scales_exactly_the_top_candidates():
    logits = torch.tensor([[2.0, 0.5, 1.0, -1.0]])
    out = saguaro_logits(logits, top=2, c=0.25)
    assert torch.allclose(out, logits + torch.tensor([[math.log(0.25), 0.0, math.log(0.25), 0.0]]))
    assert saguaro_logits(logits, 2, 1.0) is logits and saguaro_logits(logits, 0, 0.5) is logits
    p = torch.softmax(logits, -1)
    q = draft_probs(logits, [], top=2, c=0.25)
    # q ∝ C·p on the top set, p elsewhere
    ratio = q / p
    assert ratio[0, 0] == pytest.approx(ratio[0, 2].item()) and ratio[0, 1] == pytest.approx(ratio[0, 3].item())
    assert (ratio[0, 0] / ratio[0, 1]).item() == pytest.approx(0.25)
    # the residual of p against the rescaled q lives on the top set: where the next round's cache has branches
    assert residual_distribution(p, q)[0, [1, 3]].sum() == 0


# --- greedy verification ---------------------------------------------------------------------------------------


def _scores_with_argmax(argmaxes: list[int], vocab: int = 8) -> torch.Tensor:
    scores = torch.zeros(1, len(argmaxes), vocab)
    scores[0, torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 1.0
    return scores


@pytest.mark.parametrize(
    "draft, argmaxes, accepted, bonus",
    [
        ([1, 2, 3], [1, 2, 3, 4], 3, 4),
        ([1, 2, 3], [1, 5, 3, 4], 1, 5),
        ([1, 2, 3], [0, 2, 3, 4], 0, 0),
        ([], [6], 0, 6),
    ],
)
def test_greedy_verify(draft, argmaxes, accepted, bonus):
    n, b = greedy_verify(torch.tensor([draft], dtype=torch.long).reshape(1, -1), _scores_with_argmax(argmaxes))
    assert (n.item(), b.item()) == (accepted, bonus)


def test_residual_falls_back_to_p_without_mass():
    p = torch.tensor([[0.5, 0.5, 0.0]])
    assert torch.equal(residual_distribution(p, p), p)
    r = residual_distribution(p, torch.tensor([[1.0, 0.0, 0.0]]))
    assert r.tolist() == [[0.0, 1.0, 0.0]]


# --- speculation cache keys --------------------------------------------------------------------------------------


def test_speculation_cache_lookup_by_outcome():
    forks = torch.tensor([0, 0, 1, 2])
    cands = torch.tensor([7, 9, 7, 3])
    tokens = torch.arange(12).reshape(4, 3)
    probs = torch.rand(4, 3, 10)
    cache = SpeculationCache(torch.zeros(4, dtype=torch.long), forks, cands, tokens, probs)
    assert len(cache) == 4 and cache.keys() == [(0, 0, 7), (0, 0, 9), (0, 1, 7), (0, 2, 3)]
    hit = cache.lookup(0, 0, 9)
    assert hit.tokens.tolist() == [3, 4, 5] and torch.equal(hit.probs, probs[1]) and hit.from_cache
    assert cache.lookup(0, 2, 7) is None and cache.lookup(1, 0, 7) is None and cache.lookup(0, 1, 9) is None
    partial = SpeculationCache(torch.zeros(4, dtype=torch.long), forks, cands, tokens, probs,
                               valid=torch.tensor([True, False, True, True]))
    assert len(partial) == 3 and partial.lookup(0, 0, 9) is None  # an unusable branch is never found


# --- backups --------------------------------------------------------------------------------------------------------


def test_ngram_lookup_prefers_longest_recent_match():
    ctx = [1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3]
    assert ngram_lookup(ctx, 2, 3) == [4, 9]  # "1 2 3" matched at the start
    assert ngram_lookup([5, 6, 7], 3, 3) == []
    assert ngram_lookup([4, 8, 4], 2, 2) == [8, 4]
    assert ngram_lookup([7], 3, 3) == [] and ngram_lookup([], 3, 3) == []


def _ngram_reference(context, lookahead, ngram_max):
    """The definition, token by token: the longest suffix n-gram's most recent earlier occurrence, continued."""
    for n in range(min(ngram_max, len(context) - 1), 0, -1):
        suffix = context[len(context) - n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == suffix:
                return context[start + n:start + n + lookahead]
    return []


@given(st.lists(st.integers(0, 4), max_size=40), st.integers(1, 6), st.integers(1, 4))
@settings(max_examples=300, deadline=None)
def test_ngram_lookup_matches_its_definition(context, lookahead, ngram_max):
    assert ngram_lookup(context, lookahead, ngram_max) == _ngram_reference(context, lookahead, ngram_max)


def test_backup_speculation_probs_are_what_was_sampled():
    g = torch.Generator().manual_seed(0)
    tokens, probs = backup_speculation([1, 2, 3, 1, 2], 4, 10, g, "cpu", ngram_max=2, with_probs=True)
    assert tokens[:3].tolist() == [3, 1, 2]  # n-gram continuation of "1 2"
    assert probs[0, 3] == 1.0 and probs[1, 1] == 1.0 and probs[2, 2] == 1.0  # deterministic → one-hot
    assert torch.allclose(probs[3:], torch.full((1, 10), 0.1))  # random fill → uniform
    tokens, probs = backup_speculation([1, 2], 3, 10, g, "cpu", ngram_max=None, with_probs=False)
    assert tokens.shape == (3,) and probs is None


# --- config ----------------------------------------------------------------------------------------------------


def test_config_branches_and_round_trip():
    cfg = SSDConfig(lookahead=2, fanout=[1, 2, 3])
    assert cfg.branches == 6 and SSDConfig.from_dict(cfg.to_dict()) == cfg
    assert SSDConfig(fanout_budget=5).branches == 5


def test_fork_candidates_skip_the_drafted_token_and_fill_the_fanout():
    from hf_ssd.generation.fanout import fork_candidates

    row_top = torch.tensor([[[5, 1, 2, 3], [7, 8, 9, 1], [4, 6, 0, 2]],
                            [[1, 5, 2, 3], [9, 7, 8, 1], [0, 6, 4, 2]]])
    drafted = torch.tensor([[5, 9], [2, 7]])  # row 0: s_1 = 5 (out of fork 0), s_2 = 9 (out of fork 1)
    fanout = torch.tensor([[2, 3, 1], [3, 1, 2]])  # per-row schedules with the same total
    forks, cands, valid = fork_candidates(row_top, drafted, fanout)
    assert forks.tolist() == [[0, 0, 1, 1, 1, 2], [0, 0, 0, 1, 2, 2]]
    assert cands[0].tolist() == [1, 2, 7, 8, 1, 4]  # fork 2 = "all accepted": nothing excluded
    assert cands[1].tolist() == [1, 5, 3, 9, 0, 6]
    assert bool(valid.all())
    with pytest.raises(ValueError, match="same total"):
        fork_candidates(row_top, drafted, torch.tensor([[2, 3, 1], [1, 1, 1]]))


def test_fork_candidates_mark_branches_a_tiny_vocabulary_cannot_fill():
    from hf_ssd.generation.fanout import fork_candidates

    row_top = torch.tensor([[[3, 1, 0], [2, 0, 1]]])  # vocabulary of 3: W = 3
    forks, cands, valid = fork_candidates(row_top, torch.tensor([[3]]), torch.tensor([[3, 1]]))
    assert forks.tolist() == [[0, 0, 0, 1]]
    assert valid.tolist() == [[True, True, False, True]] and cands[0, :2].tolist() == [1, 0]


# --- realigning ragged rows ------------------------------------------------------------------------------------------


def test_realign_rows_moves_every_row_input_with_the_tokens():
    """Rows that emitted different counts are right-aligned again: tokens, attention mask, token types,
    multimodal token types and KV all go through the same gather (padding gets mask 0 and type 0); a finished row
    leaves."""
    from transformers import DynamicCache

    from hf_ssd.generation.target_rows import realign_rows

    ids = torch.tensor([[0, 5, 6, 7, 8, 9], [1, 2, 3, 4, 10, 11], [20, 21, 22, 23, 24, 25]])
    kwargs = {
        "attention_mask": torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]),
        "token_type_ids": ids % 2 + 1,
        "mm_token_type_ids": ids % 3 + 1,
    }
    cache = DynamicCache()
    cache.update(ids[:, :5, None, None].float().expand(3, 5, 1, 2).transpose(1, 2).contiguous(),
                 ids[:, :5, None, None].float().expand(3, 5, 1, 2).transpose(1, 2).contiguous(), 0)
    # row 0 keeps all 6 tokens, row 1 only its first 4 (it emitted two fewer), row 2 has finished
    out = realign_rows(cache, kwargs, ids, keep_rows=[0, 1], id_lengths=[6, 4, 6])
    assert out[0].tolist() == [0, 5, 6, 7, 8, 9] and out[1, 2:].tolist() == [1, 2, 3, 4]
    mask = kwargs["attention_mask"]
    assert mask.tolist() == [[0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]]
    for key, mod in (("token_type_ids", 2), ("mm_token_type_ids", 3)):
        values = kwargs[key]
        assert values.shape == (2, 6)
        assert values[0].tolist() == (ids[0] % mod + 1).tolist()
        assert values[1, 2:].tolist() == (ids[1, :4] % mod + 1).tolist() and values[1, :2].tolist() == [0, 0]
    keys = cache.layers[0].keys[:, 0, :, 0]  # each slot's key holds its token id
    assert keys.shape == (2, 5) and keys[0].tolist() == [0, 5, 6, 7, 8] and keys[1, 2:].tolist() == [1, 2, 3]
