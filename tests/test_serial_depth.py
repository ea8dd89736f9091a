"""Serial speculations deeper than K (`SSDConfig.max_serial_lookahead`): the policy lets a speculation drafted just in
time run past K while the draft stays confident, and verifies it as deep as its confidences pay. Covered here: the
config, the policy's choice of a deep K, and losslessness through deep rounds (greedy across executors and
architectures, a left-padded batch, the sampling law with Saguaro C < 1)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_pair
from test_confidence import _script_stops
from test_lookahead import _script, batch_greedy_runs, law_models, shift_just_in_time_q  # noqa: F401  (law_models: a fixture)
from test_sampling_law import ALPHA, REJECT, SAMPLES, TEMPERATURE, exact_law, law_pvalues, ssd_samples

from hf_ssd import SSDConfig
from hf_ssd.ema import DecayedMean
from hf_ssd.generation import lookahead as lookahead_module
from hf_ssd.generation.costs import FLAT_SHAPE
from hf_ssd.generation.lookahead import LookaheadPolicy
from hf_ssd.generation.modes import PLAIN, SERIAL


def test_config_bounds_serial_depth():
    assert SSDConfig(lookahead=3).serial_lookahead == 16
    assert SSDConfig(lookahead=3, max_serial_lookahead=2).serial_lookahead == 3  # never shorter than K
    assert SSDConfig(lookahead=3, draft_confidence=False).serial_lookahead == 3  # nothing would stop it: K
    assert SSDConfig(lookahead=3, lookahead_schedule="constant").serial_lookahead == 3
    with pytest.raises(ValueError, match="max_serial_lookahead"):
        SSDConfig(max_serial_lookahead=0)


def _serial_policy(deep_known: bool = True, **kwargs) -> LookaheadPolicy:
    """A policy whose costs are measured: serial rounds pay (a flat verification curve, a cheap draft); the pair's
    calibration counted as holding `DEEP_AFTER` samples of later tokens (`deep_known`) unless told otherwise."""
    policy = LookaheadPolicy(3, True, 0.9, concurrent=True, cost_shape=FLAT_SHAPE, serial=True, confidence=True,
                             **kwargs)
    if deep_known:  # (its tables as they are: the samples themselves would move them)
        policy.deep_known = lambda: True
    policy.verify.setdefault(0, DecayedMean(0.7)).add(0.078)  # a plain step, on every core as a serial verification
    for k in range(1, 4):
        policy.verify.setdefault(k, DecayedMean(0.7)).add(0.100 + 0.002 * k)
    for k in range(1, 4):
        policy.serial_verify.setdefault(k, DecayedMean(0.7)).add(0.080 + 0.002 * k)
    policy.serial_token.add(0.004)
    policy.serial_length.add(3.0)
    policy.draft.add(0.150)  # the concurrent tree outlasts the verification: serial rounds win
    policy.overhead.add(0.0)
    policy._rounds = 5
    return policy


def test_a_serial_round_verifies_past_k_where_the_draft_is_sure():
    policy = _serial_policy(serial_lookahead=10)
    assert policy.k_serial == 10
    sure = torch.full((10,), 0.99)
    k = policy.choose(10, confidence=[sure])
    assert policy._mode == SERIAL and k > 3, policy.trace[-1]
    assert policy.depth(k) == 0 and policy.serial == 10  # the next speculation may run 10 deep again
    unsure = torch.tensor([0.99, 0.99, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05])
    for _ in range(30):  # the pair has shown that unsure tokens (past the first) are rejected
        policy.calibration.add(0.05, 0.0, position=2)
    assert policy.choose(10, confidence=[unsure]) == 2


def test_a_speculation_runs_past_k_only_once_the_pair_has_shown_its_later_tokens():
    """Until the pair's calibration holds `DEEP_AFTER` samples of later tokens, a serial speculation is drafted and
    verified K_max deep at most: f(c) then rests on its prior and a call's opening rounds (cold calls on the real pair
    expected 76 tokens of rounds verifying 3-16 tokens and got 44). Past them, as deep as the draft is sure."""
    policy = _serial_policy(deep_known=False, serial_lookahead=10)
    sure = torch.full((10,), 0.99)
    k = policy.choose(10, confidence=[sure])
    assert policy._mode == SERIAL and k == 3 and policy.trace[-1]["limit"] == 10
    assert policy.depth(k) == 0 and policy.serial == 3
    for _ in range(int(lookahead_module.DEEP_AFTER)):
        policy.calibration.add(0.99, 1.0, position=1)
    k = policy.choose(10, confidence=[sure])
    assert policy._mode == SERIAL and k > 3 and policy.depth(k) == 0 and policy.serial == 10


def test_a_sure_hand_is_verified_where_the_average_acceptance_says_plain_steps():
    """Plain steps win at the run's average acceptance (a few rejections pulled it down), but the speculation in hand
    holds tokens the draft is sure of, and the pair takes such tokens: a serial round verifies them (the next
    speculation drafted after it). An unsure hand, or none, leaves the plain step."""
    def decide(hand):
        policy = _serial_policy(serial_lookahead=10)
        policy.acceptance.reached, policy.acceptance.passed = [10.0] * 4, [0.5] * 4
        policy.acceptance.pooled_reached, policy.acceptance.pooled_passed = 100.0, 5.0
        for _ in range(10):  # the draft is rarely sure; where it is, its tokens are taken
            for position in range(3):
                policy.calibration.add(0.99, 1.0, position=position)
                for _ in range(9):
                    policy.calibration.add(0.05, 0.0, position=position)
        k = policy.choose(0 if hand is None else 3, confidence=None if hand is None else [hand])
        return k, policy._mode, policy.trace[-1]

    k, mode, entry = decide(torch.full((3,), 0.99))
    assert k == 3 and mode == SERIAL and entry["why"] == "sure hand", entry
    assert entry["tok_s"][0] > max(entry["serial_tok_s"].values())  # plain, at the average
    for hand in (torch.full((3,), 0.05), None):
        k, mode, entry = decide(hand)
        assert k == 0 and mode == PLAIN, entry
        # the declined hand's speeds are a serial round's, traced as such, not as this plain round's
        assert "confident_tok_s" not in entry and ("sure_hand_tok_s" in entry) == (hand is not None), entry


def test_a_batch_of_rows_stays_within_k_and_its_last_row_runs_deep():
    """Several rows: serial speculations stay K deep (the batch waits for its last row, and deep ones spread the
    rows apart); one row left: as deep as its confidences pay."""
    policy = _serial_policy(serial_lookahead=10)
    sure = torch.full((10,), 0.99)
    k = policy.choose(10, rows=2, confidence=[sure, sure])
    assert policy._mode == SERIAL and k == 3, policy.trace[-1]
    assert policy.depth(k) == 0 and policy.serial == 3
    k = policy.choose(10, rows=1, confidence=[sure])
    assert k > 3 and policy.depth(k) == 0 and policy.serial == 10


def test_without_a_stop_rule_serial_drafting_stays_within_k():
    policy = _serial_policy(serial_lookahead=10)
    policy.choose(3, confidence=[torch.full((3,), 0.99)])
    policy.depth(3)
    assert policy.serial == 10
    policy.serial_token.value = None  # the draft's cost per token unknown: no stop rule
    assert policy.just_in_time() == (3, None)
    policy.serial_token.add(0.004)
    serial, stop = policy.just_in_time()
    assert serial == 10 and stop is not None


def test_serial_drafting_stops_where_the_next_round_can_verify_no_more():
    """Near max_new_tokens a sure run drafted 16 tokens for a round that could verify one: just-in-time drafting is
    capped at the room the rows have left (`Batch.room`), and the trace says how deep it went."""
    policy = _serial_policy(serial_lookahead=10)
    policy.choose(3, confidence=[torch.full((3,), 0.99)])
    policy.depth(3)
    policy.serial_token.add(0.004)
    assert policy.just_in_time(room=20)[0] == 10  # room to spare: as the rule says
    serial, stop = policy.just_in_time(room=2)
    assert serial == 2 and stop is not None and policy.trace[-1]["serial"] == 2
    assert policy.just_in_time(room=0)[0] == 0


def test_a_batchs_room_is_what_max_length_and_the_positions_leave():
    from transformers import GenerationConfig

    from hf_ssd.generation.rows import Batch

    config = GenerationConfig(max_length=16)
    rows = Batch(torch.zeros(2, 10, dtype=torch.long), [], config)
    rows.rows[1].ids = torch.zeros(12, dtype=torch.long)  # one row further on: the other bounds max_length's room
    assert rows.room(16, 4096) == 16 - 10 - 1
    assert rows.room(16, 13) == 13 - 12 - 1  # the position embeddings bound the furthest row
    rows.rows[0].ids = torch.zeros(15, dtype=torch.long)  # both rows one token from max_length: the bonus only
    rows.rows[1].ids = torch.zeros(15, dtype=torch.long)
    assert rows.room(16, 4096) == 0


def test_concurrent_rounds_stay_within_k():
    """Without serial rounds (a draft on its own device) every speculation is prepared K deep and verified so."""
    policy = _serial_policy(serial_lookahead=10)
    policy.serial_option = False
    k = policy.choose(10, confidence=[torch.full((10,), 0.99)])
    assert k == 3 and policy.depth(k) == 3 and policy.serial == 0


# serial rounds deeper than K = 3 (9, 12 and 7 tokens asked; a stop rule that lets some run whole and stops others
# after 2), verified 5 to 12 deep, into a concurrent round that verifies 5 of a deep speculation, a plain step
DEEP_SCRIPT = [(0, 0, 9), (9, 0, 12), (5, 3), (3, 0, 12), (12, 0, 7), (2, 0, 0), (0, 0, 9), (7, 3), (3, 3)]


@pytest.mark.parametrize("executor", ["sync", "thread", "stream", "process"])
@pytest.mark.parametrize("arch", ["llama", "qwen2_hybrid"])
def test_greedy_identical_through_deep_serial_rounds(monkeypatch, arch, executor):
    _script(monkeypatch, DEEP_SCRIPT)
    monkeypatch.setattr(LookaheadPolicy, "deep_known", lambda self: True)  # a warm pair: past K from the start
    _script_stops(monkeypatch, [1e-6, 1e-6, 0.6])  # all, all, 2 tokens
    target, random_draft = tiny_pair(arch, seed=140)
    ids = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(16))
    expected = target.generate(ids, max_new_tokens=48, do_sample=False)
    for draft in (target, random_draft):
        out = target.generate(ids, assistant_model=draft, max_new_tokens=48, do_sample=False,
                              ssd_config=SSDConfig(lookahead=3, max_serial_lookahead=12, executor=executor))
        assert torch.equal(out, expected), (arch, executor)
        m = target.ssd_metrics
        assert max(m.lookahead_per_round) > 3, m.lookahead_per_round  # rounds verified past K
        if draft is target:
            assert len(m.per_position_acceptance) > 3 and m.per_position_acceptance[5] == 1.0


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_batch_greedy_identical_through_deep_serial_rounds(monkeypatch, executor):
    _script(monkeypatch, DEEP_SCRIPT)
    _script_stops(monkeypatch, [1e-6, 0.6])
    # the policy keeps a batch of several rows within K (`serial_depth`) and lets its last row run deep: the rows'
    # data path serves deep speculations, here from the start
    monkeypatch.setattr(LookaheadPolicy, "serial_depth", property(lambda self: self.k_serial))
    for metrics in batch_greedy_runs(74, 11, 30, SSDConfig(lookahead=3, max_serial_lookahead=12,
                                                           executor=executor)):
        assert max(metrics.lookahead_per_round) > 3


# 4 new tokens with K = 1: a plain step, then a serial speculation 3 deep (past K: Saguaro's reshaping past the
# schedule's end) verified as deep as max_length lets it (2), then one asked 3 deep stopping after 2 or running whole
LAW_DEEP_SCRIPT = [(0, 0, 3), (3, 0, 3), (3, 1)]


@pytest.mark.parametrize("draft, c, executor", [
    pytest.param("random", 0.3, "sync", id="rand-C0.3-sync"),
    pytest.param("self", 0.5, "process", id="self-C0.5-process"),
])
def test_sampling_law_through_deep_serial_rounds(monkeypatch, law_models, draft, c, executor):  # noqa: F811
    _script(monkeypatch, LAW_DEEP_SCRIPT)
    monkeypatch.setattr(LookaheadPolicy, "deep_known", lambda self: True)  # a warm pair: past K from the start
    _script_stops(monkeypatch, [1e-6, 0.6])
    target = law_models["target"]
    config = SSDConfig(lookahead=1, max_serial_lookahead=3, fanout_budget=2, saguaro_c=c, backup="draft",
                       executor=executor)
    counts, hits, misses = ssd_samples(target, law_models[draft], config, TEMPERATURE, seed=141)
    pvalues = law_pvalues(exact_law(target, TEMPERATURE), counts)
    print(f"p-values {pvalues}, hits {hits}, misses {misses}")
    assert min(pvalues.values()) >= ALPHA, pvalues


def test_negative_control_q_shifted_in_deep_serial_speculations(monkeypatch, law_models):  # noqa: F811
    """Power check: speculations drafted past K handed over with q shifted by one position are rejected."""
    _script(monkeypatch, LAW_DEEP_SCRIPT)
    monkeypatch.setattr(LookaheadPolicy, "deep_known", lambda self: True)  # a warm pair: past K from the start
    _script_stops(monkeypatch, [1e-6])
    shift_just_in_time_q(monkeypatch, lambda phase, asked, drafted: phase == "serial" and drafted > 1)
    target = law_models["target"]
    config = SSDConfig(lookahead=1, max_serial_lookahead=3, fanout_budget=2, saguaro_c=0.3, backup="draft",
                       executor="sync")
    counts, _, _ = ssd_samples(target, law_models["self"], config, TEMPERATURE, seed=142, samples=SAMPLES)
    pvalues = law_pvalues(exact_law(target, TEMPERATURE), counts)
    print(f"negative control p-values {pvalues}")
    assert min(pvalues.values()) < REJECT, pvalues


def test_the_stop_rule_prices_positions_on_the_curve_the_policy_chooses_k_by():
    """Past the deepest verification timed the stop rule's per-position gains follow the curve K is chosen by
    (`serial_verify_seconds`: the prior shape), not the median slope of a few timed K (one jump among them made
    every further position cost ~90 ms there, against ~20 ms on the curve)."""
    policy = _serial_policy(serial_lookahead=10)
    policy.serial_verify[3] = DecayedMean(0.7)
    policy.serial_verify[3].add(0.300)  # a jump at K = 3
    policy.choose(10, confidence=[torch.full((10,), 0.99)])
    policy.depth(policy.trace[-1]["k"])
    policy.serial_fixed.add(0.004)
    rule = policy.stop_rule()
    curve = policy._curve(policy.serial)
    assert sorted(curve) == list(range(1, 11))
    steps = [curve[k + 1] - curve[k] for k in range(1, 10)]
    assert rule.extra == pytest.approx([policy._rate * max(step, 0.0) for step in steps])
    assert curve[3] - curve[2] > 0.1 and max(steps[2:]) < 0.05  # the jump, then the prior shape's few ms
