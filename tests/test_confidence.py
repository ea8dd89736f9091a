"""The draft's confidence: its calibration against acceptance, this round's K from the speculation in hand, where
just-in-time drafting stops, and losslessness when speculations stop early (greedy across executors and a batch,
the sampling law with a negative control)."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import tiny_model, tiny_pair, truncated_copy
from test_lookahead import _script, batch_greedy_runs, law_models, shift_just_in_time_q  # noqa: F401  (law_models: a fixture)
from test_sampling_law import ALPHA, REJECT, SAMPLES, TEMPERATURE, WARPED, exact_law, law_pvalues, ssd_samples

from hf_ssd import SSDConfig, enable_ssd
from hf_ssd.ema import DecayedMean
from hf_ssd.generation.confidence import (
    EDGES,
    NEXT,
    ConfidenceCalibration,
    StopRule,
    bin_of,
    call_shift,
    confident_speed,
    expected_tokens_per_row,
    shifted,
)
from hf_ssd.generation.confident_rounds import SHARE_PRIOR
from hf_ssd.generation.costs import FLAT_SHAPE
from hf_ssd.generation.lookahead import LookaheadPolicy

# --- the calibration and the stop rule, on tensors -------------------------------------------------------------


def test_bins_cover_zero_to_one():
    c = torch.tensor([0.0, 0.05, 0.1, 0.5, 0.9, 0.97, 0.99, 1.0])
    assert bin_of(c).tolist() == [0, 0, 1, 5, 9, 10, 11, 11]
    assert int(bin_of(torch.tensor([1.0]))[0]) == len(EDGES)


def test_calibration_starts_at_the_confidence_and_learns_the_pair():
    cal = ConfidenceCalibration()
    f = cal.acceptance(torch.tensor([0.05, 0.55, 0.99]))
    assert f.tolist() == pytest.approx([0.05, 0.55, 0.99], abs=1e-6)  # the prior: a calibrated draft
    for _ in range(40):  # an over-confident draft: its sure tokens are accepted half the time
        cal.add(0.99, 1.0)
        cal.add(0.99, 0.0)
    assert float(cal.acceptance(torch.tensor([0.99]))[0]) == pytest.approx(0.5, abs=0.05)
    assert cal.samples == 80


def test_calibration_is_non_decreasing_in_confidence():
    cal = ConfidenceCalibration(prior_weight=0.1)
    for _ in range(20):
        cal.add(0.35, 1.0)  # a lucky middle bin
        cal.add(0.75, 0.0)  # an unlucky upper one
    table = cal.table()
    assert all(a <= b + 1e-12 for a, b in zip(table, table[1:]))
    assert table[3] == pytest.approx(table[7])  # pooled across the violation


def test_forgetting_lets_the_calibration_follow_the_text():
    cal = ConfidenceCalibration(decay=0.5)
    for _ in range(10):
        cal.add(0.95, 0.0)
    for _ in range(10):
        cal.forget()
        cal.add(0.95, 1.0)
    assert float(cal.acceptance(torch.tensor([0.95]))[0]) > 0.9


def test_the_first_token_and_the_later_ones_are_calibrated_apart():
    """Acceptance comes in runs: a token whose drafted predecessors were accepted is accepted more often than a
    speculation's first at the same confidence; each position kind learns its own f, and a speculation's first
    column is read from the first token's table, the others from the later ones'."""
    cal = ConfidenceCalibration()
    for _ in range(40):
        cal.add(0.85, 0.0, position=0)  # first tokens at c = 0.85 rejected
        cal.add(0.85, 1.0, position=2)  # third tokens at c = 0.85 accepted
    first, later = cal.tables()
    b = int(bin_of(torch.tensor([0.85]))[0])
    assert first[b] < 0.2 and later[b] > 0.9  # (the first pooled with the bins under it: non-decreasing)
    f = cal.acceptance(torch.full((2, 3), 0.85))
    assert f[:, 0].tolist() == pytest.approx([first[b]] * 2) and f[:, 1:].flatten().tolist() == pytest.approx(
        [later[b]] * 4)
    assert cal.acceptance(torch.empty(1, 0)).shape == (1, 0)
    # unmeasured bins stand at each kind's own prior
    first, later = ConfidenceCalibration().tables(first=0.3, later=0.8)
    assert first == pytest.approx([0.3] * (len(EDGES) + 1)) and later == pytest.approx([0.8] * (len(EDGES) + 1))


def test_an_unmeasured_later_token_is_taken_at_least_as_often_as_a_first_one():
    """Later tokens are reached only when the ones before are accepted: early in a run their table rests on a few
    samples. Their prior at a bin is the higher of the run's later-position acceptance and the first token's f
    there, so two early rejections do not make a confident later token look hopeless."""
    cal = ConfidenceCalibration()
    for _ in range(30):  # first tokens: confident ones accepted, hesitant ones not
        cal.add(0.99, 1.0, position=0)
        cal.add(0.15, 0.0, position=0)
    cal.add(0.55, 0.0, position=1)  # two later tokens, both rejected
    cal.add(0.55, 0.0, position=1)
    first, later = cal.tables(first=0.5, later=0.08)
    sure, hesitant = int(bin_of(torch.tensor([0.99]))[0]), int(bin_of(torch.tensor([0.15]))[0])
    assert later[sure] == pytest.approx(first[sure]) and later[sure] > 0.9
    assert later[hesitant] == pytest.approx(0.08, abs=0.02)  # the run's later rate where it is the higher
    assert later[int(bin_of(torch.tensor([0.55]))[0])] < first[int(bin_of(torch.tensor([0.55]))[0])]  # measured
    assert later == sorted(later)
    # where the run's later positions do better than first tokens, its rate stands
    first, later = ConfidenceCalibration().tables(first=0.3, later=0.8)
    assert later == pytest.approx([0.8] * (len(EDGES) + 1))


def test_stop_rule_prices_the_first_token_and_the_later_ones_apart():
    """A hesitant first position (f 0.4) with sure later ones (f 0.9), gain 0.2: reach after the first token is
    0.4 and each next one is worth reach x 0.9 (0.36, 0.32, 0.29, 0.26, 0.24, 0.21, then 0.19): seven tokens; one
    table at 0.4 values the second at 0.16 and stops after the first."""
    first, later = (0.4,) * (len(EDGES) + 1), (0.9,) * (len(EDGES) + 1)
    assert _drafted(StopRule(first, 0.2, later), 10) == 7
    assert _drafted(StopRule(first, 0.2), 10) == 1
    assert _drafted(StopRule(later, 0.2, first), 10) == 2  # the other way round: 0.9 x 0.4 = 0.36, 0.14
    assert _drafted(StopRule(first, 0.2, at_least=2), 10) == 2  # the second drafted whatever it is worth
    assert _drafted(StopRule(first, 0.2, later, at_least=2), 10) == 7


def test_expected_tokens_per_row():
    e = expected_tokens_per_row(torch.tensor([[1.0, 0.5, 0.5], [0.0, 1.0, 1.0]]))
    assert e.tolist() == [[1.0, 2.0, 2.5, 2.75], [1.0, 1.0, 1.0, 1.0]]


GAINS = {1: 2.0, 2: 0.6, 3: 0.5}  # with f = 0.8 everywhere: reach x f falls 0.64, 0.51, 0.41 token after token


def _drafted(rule: StopRule, length: int, confidence: float = 0.5) -> int:
    """Tokens drafted under `rule` (at most `length`), as `_draft_just_in_time` drafts them."""
    reach, rows = torch.ones(2), torch.tensor([True, False])
    for i in range(length):
        if i + 1 < length:
            going, reach = rule.keeps_going(reach, torch.full((2,), confidence), rows, i + 1)
            if not going:
                return i + 1
    return length


def test_stop_rule_drafts_while_the_next_token_pays():
    table = (0.8,) * (len(EDGES) + 1)
    for n, gain in GAINS.items():
        assert _drafted(StopRule(table, gain), 4) == n
    assert _drafted(StopRule(table, 1e-6), 4) == 4
    # f rises with confidence: a sure draft goes deeper than a hesitant one under the same gain
    rising = tuple(min(1.0, 0.05 + 0.1 * b) for b in range(len(EDGES) + 1))
    assert _drafted(StopRule(rising, 0.3), 4, confidence=0.99) == 4
    assert _drafted(StopRule(rising, 0.3), 4, confidence=0.3) == 1


def test_a_batch_drafts_on_while_its_rows_expect_the_next_token_to_pay_on_average():
    """Every row of a batch waits for a drafted token, so the rows' gains are averaged: one sure row (f 0.95, its
    next token worth 0.90) and one hesitant row (f 0.1, worth 0.01) expect 0.455 on average, under a gain of 0.5:
    the batch stops after its first token, where the sure row drafting alone (the other a rider) goes on."""
    table = tuple(0.95 if edge > 0.9 else 0.1 for edge in (*EDGES, 1.0))
    rule = StopRule(table, 0.5)
    confidence = torch.tensor([0.99, 0.15])

    def drafted(rows: torch.Tensor, length: int = 4) -> int:
        reach = torch.ones(2)
        for i in range(length - 1):
            going, reach = rule.keeps_going(reach, confidence, rows, i + 1)
            if not going:
                return i + 1
        return length

    assert drafted(torch.tensor([True, True])) == 1
    assert drafted(torch.tensor([True, False])) == 4  # 0.90, 0.86, 0.81: each worth its 0.5
    assert drafted(torch.tensor([False, True])) == 1
    assert drafted(torch.tensor([False, False])) == 1  # no row drafting: nothing pays
    # at a gain under the mean the pair goes on together
    assert StopRule(table, 0.4).keeps_going(torch.ones(2), confidence, torch.tensor([True, True]), 1)[0]


def test_the_next_token_is_priced_by_what_follows_a_token_of_that_confidence():
    """The rule decides whether to draft a token before its confidence is known: it reads the acceptance of a token
    after one of the latest token's confidence (`next`), learnt apart from a token's own (`later`). Hesitant tokens
    followed by sure, accepted ones (a word's first piece, then the rest): `later` at a hesitant bin says under 0.4,
    `next` over 0.8, and the speculation goes on past a hesitant token."""
    hesitant, sure = 0.45, 0.99
    cal = ConfidenceCalibration()
    for _ in range(30):
        cal.add(hesitant, 0.0, position=1, previous=0.05)  # hesitant later tokens rejected ...
        cal.add(sure, 1.0, position=2, previous=hesitant)  # ... the sure ones after a hesitant token accepted
    first, later = cal.tables(first=0.5, later=0.5)
    after = cal.next_table(later)
    b = int(bin_of(torch.tensor([hesitant]))[0])
    assert later[b] < 0.4 and after[b] > 0.8  # (pooled with the unmeasured bins above it: non-decreasing)
    # bins without a sample after them stand at the `LATER` table: as if the next token were as sure as this one
    low = int(bin_of(torch.tensor([0.25]))[0])
    assert after[low] == pytest.approx(later[low])
    # a hesitant first token: the one after it is drafted (f_next 0.82, where its own bin's f_later says 0.12); that
    # one hesitant too (every token at 0.45 here), the rule stops there
    assert _drafted(StopRule(tuple(first), 0.2, tuple(later), 1, (), tuple(after)), 6, confidence=hesitant) == 2
    assert _drafted(StopRule(tuple(first), 0.2, tuple(later)), 6, confidence=hesitant) == 1
    # the first sample of a speculation has no token before it: `FIRST` only
    fresh = ConfidenceCalibration()
    fresh.add(sure, 1.0, position=0, previous=hesitant)
    assert fresh.reached[NEXT] == [0.0] * (len(EDGES) + 1)


def test_the_scripted_split_rule_drafts_three_tokens():
    assert _drafted(SPLIT_RULE, 8) == 3  # at least 2; then 0.36 x 0.9 >= 0.2; then 0.32 x 0.9 < 0.2 + 0.5


def test_stop_rule_crosses_processes_as_a_list():
    rule = StopRule(tuple(float(i) / 12 for i in range(len(EDGES) + 1)), 0.25)
    assert StopRule.from_list(rule.to_list()) == rule
    split = StopRule(rule.table, 0.25, tuple(0.5 + float(i) / 30 for i in range(len(EDGES) + 1)))
    assert StopRule.from_list(split.to_list()) == split and split != rule
    sampling = StopRule(rule.table, 0.25, at_least=2)
    assert StopRule.from_list(sampling.to_list()) == sampling
    after = StopRule(rule.table, 0.25, split.later, 2, (0.1, 0.2), tuple(0.9 for _ in range(len(EDGES) + 1)))
    assert StopRule.from_list(after.to_list()) == after and after.next != after.later
    assert StopRule.from_list([0.0] * (len(EDGES) + 2)) is None  # gain 0: no rule


# --- this round's K from the speculation in hand -------------------------------------------------------------------


def _ratio(share, first, after, verify, drafting, depths) -> float:
    """E[tokens] / E[seconds] of serial rounds verifying depths[b] tokens after a first token in bin b."""
    tokens = seconds = 0.0
    for p, f1, fn, h in zip(share, first, after, depths):
        tokens += p * (1.0 + sum(f1 * fn ** (i - 1) for i in range(1, h + 1)))
        seconds += p * (verify[h] + drafting[max(h, 1) - 1])
    return tokens / seconds


def test_confident_speed_is_the_best_depth_per_confidence():
    """The speed of serial rounds whose depth follows the first token's confidence is the best over every choice of
    depth per bin (checked against all of them), at least each fixed depth's, and with a draft that is never
    accepted below plain steps: its drafted first token is paid for and verified at no depth."""
    verify = [0.25, 0.27, 0.28, 0.30, 0.45]  # h = 0..4 verified tokens (a jump at 4)
    drafting = [0.05, 0.09, 0.13, 0.17]  # n = 1..4 drafted tokens
    cases = [([0.3, 0.7], [0.95, 0.1], [0.9, 0.2]), ([1.0, 0.0], [0.5, 0.5], [0.5, 0.5]),
             ([0.2, 0.3, 0.5], [1.0, 0.6, 0.0], [1.0, 0.7, 0.0])]
    for share, first, after in cases:
        speed = confident_speed(share, first, after, verify, drafting)
        best = max(_ratio(share, first, after, verify, drafting, depths)
                   for depths in itertools.product(range(len(verify)), repeat=len(share)))
        assert speed == pytest.approx(best, rel=1e-6)
        for h in range(len(verify)):
            assert speed >= _ratio(share, first, after, verify, drafting, [h] * len(share)) - 1e-9
    useless = confident_speed([1.0], [0.0], [0.0], verify, drafting)
    assert useless == pytest.approx(1.0 / (verify[0] + drafting[0])) and useless < 1.0 / verify[0]
    sure = confident_speed([1.0], [1.0], [1.0], verify, drafting)  # every token accepted: as deep as pays, short
    assert sure == pytest.approx(4.0 / (verify[3] + drafting[2]))  # of the jump at 4 (its token costs 0.19 s)


def _plain_or_serial(first_share: float) -> LookaheadPolicy:
    """A serial-capable policy whose run's average acceptance (0.2 at every position) makes plain steps beat every
    serial K, with every cost measured (nothing left to explore) and a calibration in which a share of first tokens
    is sure (c = 0.99: taken, and the tokens after them too) and the rest hesitant (c = 0.01: rejected)."""
    policy = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.2, concurrent=True, cost_shape=FLAT_SHAPE,
                             serial=True, confidence=True, serial_lookahead=8)
    for k, seconds in {0: 0.25, 1: 0.45, 2: 0.46, 3: 0.47, 4: 0.48}.items():  # beside the working draft
        policy.verify[k] = DecayedMean(0.5)
        policy.verify[k].add(seconds)
    for k in range(1, 9):  # on every core, the draft sitting out
        policy.serial_verify[k] = DecayedMean(0.5)
        policy.serial_verify[k].add(0.26 + 0.005 * k)
    policy.serial_token.add(0.04)
    policy.serial_fixed.add(0.05)
    policy.draft.add(0.2)
    policy.overhead.add(0.0)
    policy._rounds = 3
    policy.acceptance.reached = [10.0] * 9
    policy.acceptance.passed = [2.0] * 9
    for _ in range(round(20 * first_share)):
        for position in range(4):
            policy.calibration.add_at([0.99] * 4, position, 1.0)
    for _ in range(round(20 * (1 - first_share))):
        policy.calibration.add(0.01, 0.0, 0)
    return policy


def test_serial_speculation_is_priced_by_the_spread_of_the_drafts_confidence():
    """Where the run's average acceptance says plain steps, but the draft is sure of some first tokens (taken, with
    the ones after them) and hesitant about the rest, serial rounds that draft deep when sure and verify nothing when
    not beat plain steps: the policy speculates (assisted generation's default, drafting while sure, caught 8-14
    token runs in an mt_bench answer where the average kept plain steps for 25 tokens). With every first token
    hesitant, it stays plain."""
    some_sure = _plain_or_serial(0.3)
    some_sure.choose(8)
    entry = some_sure.trace[-1]
    assert max(entry["serial_tok_s"].values()) < entry["tok_s"][0]  # the average alone: plain steps
    assert entry["confident_serial_tok_s"] > 1.2 * entry["tok_s"][0]
    assert entry["mode"] == "serial" and entry["wanted"] > 0
    none_sure = _plain_or_serial(0.0)
    none_sure.choose(8)
    entry = none_sure.trace[-1]
    assert entry["confident_serial_tok_s"] < entry["tok_s"][0]
    assert entry["mode"] == "plain" and entry["k"] == 0
    batch = _plain_or_serial(0.3)  # a batch: one K for all rows, the spread per row not priced
    batch.choose(8, rows=2)
    assert "confident_serial_tok_s" not in batch.trace[-1]


def test_serial_speculation_is_priced_by_this_calls_spread_of_confidence():
    """The pair's calibration (earlier calls) has 30 % of first tokens sure, but on this call's text the draft is
    hesitant about every first token: serial rounds are priced by the call's own share of confidences (shrunk to the
    pair's, `SHARE_PRIOR` samples' worth), and plain steps win. On an AVX2 EPYC a summarization answer was priced at
    the pair's share (3.6-3.8 tok/s against a plain step's 2.4) and made 1.8, 39 of 43 speculations declined.
    A call whose share matches the pair's keeps the serial rounds."""
    hesitant = _plain_or_serial(0.3)
    hesitant.call_calibration = ConfidenceCalibration()
    for _ in range(60):
        hesitant.call_calibration.add(0.01, 0.0, 0)
    share = hesitant.first_share()
    assert share[0] == pytest.approx((60 + SHARE_PRIOR * 0.7) / (60 + SHARE_PRIOR))
    hesitant.choose(8)
    entry = hesitant.trace[-1]
    assert entry["confident_serial_tok_s"] < entry["tok_s"][0] and entry["mode"] == "plain"
    alike = _plain_or_serial(0.3)
    alike.call_calibration = ConfidenceCalibration()
    for confidence in [0.99] * 3 + [0.01] * 7:
        alike.call_calibration.add(confidence, float(confidence > 0.5), 0)
    alike.choose(8)
    assert alike.trace[-1]["mode"] == "serial"


def test_stop_rule_prices_time_no_higher_than_serial_rounds_make():
    """The run's average acceptance is high at every position, so the best serial K at the average is the deepest and
    its speed high; but a sure token is followed by a taken one only half the time (the `NEXT` table), so serial rounds
    drafted as the confidence pays make less. The stop rule prices a drafted token's time at that speed, not at the
    deepest K's, which speculations it stops short of never make (on code: two tokens deep every round, all taken)."""
    def sure_then_half(rows: int) -> LookaheadPolicy:
        policy = _plain_or_serial(1.0)
        policy.acceptance.passed = [9.5] * 9  # a = 0.95 at every position
        for _ in range(40):
            policy.calibration.add_at([0.99, 0.99], 1, 0.5)  # after a sure token, the next taken half the time
        policy.choose(8, rows=rows)
        policy.serial = 8  # this round's speculation drafted just in time (`depth` sets it in the loop)
        return policy

    policy = sure_then_half(1)
    assert policy._mode == "serial" and policy._serial_speed < policy._rate
    rule = policy.stop_rule()
    assert rule.gain == pytest.approx(policy._serial_speed * policy.serial_step(), rel=1e-6)
    batch = sure_then_half(2)  # a batch: the spread of confidence not priced, the chosen speed
    assert batch._serial_speed is None
    assert batch.stop_rule().gain == pytest.approx(batch._rate * batch.serial_step(), rel=1e-6)


def _measured_policy(**kwargs) -> LookaheadPolicy:
    """A concurrent policy past its first rounds, with a flat verification curve measured for every K."""
    policy = LookaheadPolicy(3, True, 0.7, concurrent=True, cost_shape=FLAT_SHAPE, **kwargs)
    policy._rounds = 5
    for k in range(4):
        policy.verify[k] = DecayedMean(0.7)
        policy.verify[k].add(0.100 + 0.01 * k)
    policy.draft.add(0.05)
    policy.overhead.add(0.0)
    policy.hit_rate.add(1.0)
    return policy


def test_the_round_verifies_as_deep_as_its_confidences_pay():
    policy = _measured_policy(confidence=True)
    # unmeasured, every bin stands at the run's acceptance (of the first position, of the later ones): confidence
    # tells nothing yet
    first, later = policy.confidence_tables()
    assert first == pytest.approx([policy.acceptance.estimates()[0]] * (len(EDGES) + 1))
    assert later == pytest.approx([policy.acceptance.beyond_first()] * (len(EDGES) + 1))
    assert policy.choose(3, confidence=[torch.tensor([0.99, 0.99, 0.01])]) == 3
    for _ in range(20):  # what this pair has shown: sure tokens accepted, hesitant ones not, at every position
        for position in (0, 1):
            policy.calibration.add(0.99, 1.0, position)
            policy.calibration.add(0.01, 0.0, position)
    assert policy.choose(3, confidence=[torch.tensor([0.99, 0.99, 0.01])]) == 2
    entry = policy.trace[-1]
    assert entry["tok_s"][3] > entry["tok_s"][2]  # the average acceptance alone would verify all three
    assert entry["confident_tok_s"][2] > entry["confident_tok_s"][3]
    # a hesitant first token: one position (a step beside the working draft costs no less)
    assert policy.choose(3, confidence=[torch.tensor([0.02, 0.99, 0.99])]) == 1
    # a batch: one K for every row, the rows' expected tokens averaged
    assert policy.choose(3, rows=2, confidence=[torch.tensor([0.99, 0.99, 0.99]),
                                                torch.tensor([0.99, 0.99, 0.01])]) == 3


def test_without_confidences_the_average_decides():
    for policy, confidence in ((_measured_policy(confidence=False), [torch.tensor([0.99, 0.99, 0.01])]),
                               (_measured_policy(confidence=True), [None])):  # an n-gram backup's speculation
        assert policy.choose(3, confidence=confidence) == 3
        assert "confident_tok_s" not in policy.trace[-1]


def test_the_policy_learns_its_calibration_from_verifications():
    from types import SimpleNamespace

    policy = _measured_policy(confidence=True)
    spec = SimpleNamespace(tokens=torch.tensor([5, 6, 7]), probs=None, confidence=torch.tensor([0.99, 0.99, 0.5]),
                           runner_up=None)
    scores = torch.zeros(1, 3, 8)
    scores[0, 2, 7] = 5.0  # the target would take s_3: a free sample one position beyond the two verified
    for _ in range(30):  # sure tokens rejected at the first position
        policy.observe_verification([SimpleNamespace(speculation=spec)],
                                    SimpleNamespace(verified=2, accepted=[0], scores=scores, runner_up=None))
    # from 0.99 (the prior) to well below; pooled with the bins under it, still at their priors (non-decreasing fit)
    assert float(policy.calibration.acceptance(torch.tensor([0.99]))[0]) < 0.4
    for _ in range(30):
        policy.observe_verification([SimpleNamespace(speculation=spec)],
                                    SimpleNamespace(verified=2, accepted=[2], scores=scores, runner_up=None))
    # the free samples at c = 0.5, three tokens in: the later tokens' table; the first token's has none
    assert float(policy.calibration.acceptance(torch.tensor([0.99, 0.99, 0.5]))[2]) > 0.6
    assert float(policy.calibration.acceptance(torch.tensor([0.5]))[0]) == pytest.approx(0.55)  # its prior


def test_the_calibration_carries_over_to_the_next_call_on_the_same_pair():
    from hf_ssd.generation.estimates import LookaheadMemory

    memory = LookaheadMemory()
    first = LookaheadPolicy(3, True, 0.7, concurrent=True, memory=memory, draft_key=1, confidence=True)
    first.calibration.add(0.99, 1.0)
    again = LookaheadPolicy(3, True, 0.7, concurrent=True, memory=memory, draft_key=1, confidence=True)
    other = LookaheadPolicy(3, True, 0.7, concurrent=True, memory=memory, draft_key=2, confidence=True)
    assert again.calibration is first.calibration and other.calibration.samples == 0


def test_a_calls_shift_follows_its_own_samples_and_moves_little_on_a_few():
    """δ is 0 without samples, takes the sign of the call's departure from the pair's tables, grows with the samples
    that show it, and shifts every bin's log-odds by the same amount (order kept, δ = 0 the identity)."""
    pair = ([0.5] * (len(EDGES) + 1), [0.8] * (len(EDGES) + 1))
    call = ConfidenceCalibration()
    assert call_shift(call, pair) == 0.0
    shifts = []
    for _ in range(3):
        for _ in range(10):
            call.add(0.99, 1.0, 1)  # later tokens the pair takes 80 % of the time, all taken in this call
        shifts.append(call_shift(call, pair))
    assert 0.0 < shifts[0] < shifts[1] < shifts[2] < 6.0
    assert shifted(pair[1], shifts[0])[-1] < shifted(pair[1], shifts[2])[-1] < 1.0
    worse = ConfidenceCalibration()
    for _ in range(30):
        worse.add(0.99, 0.0, 0)  # first tokens the pair takes half the time, all rejected here
    assert call_shift(worse, pair) < -1.0
    table = [0.1, 0.4, 0.4, 0.9]
    assert shifted(table, 0.0) == table
    up = shifted(table, 1.0)
    assert all(a < b for a, b in zip(table, up)) and up[1] == up[2] and up == sorted(up)


def test_a_call_matching_the_pairs_calibration_leaves_it_unshifted():
    """Samples drawn at the rates the pair's tables give fit δ close to 0: the shift moves a call only as far as its
    own acceptance departs."""
    pair = ([0.3, 0.6, 0.9], [0.5, 0.7, 0.95])
    call = ConfidenceCalibration()
    call.reached = [[100.0, 100.0, 100.0], [100.0, 100.0, 100.0], [0.0] * 3]
    call.passed = [[30.0, 60.0, 90.0], [50.0, 70.0, 95.0], [0.0] * 3]
    assert abs(call_shift(call, pair)) < 1e-6


def test_a_calls_own_acceptance_shifts_the_pairs_calibration_for_it_alone():
    """The pair's calibration, pooled over earlier calls (prose: a token after a sure one taken half the time), held
    a call on text the draft knows (every token taken) shallow; the call's own samples shift the tables its stop rule
    and K are priced by, and leave the pool's (what the next call starts from) as they were."""
    from types import SimpleNamespace

    from hf_ssd.generation.estimates import LookaheadMemory

    memory = LookaheadMemory()
    earlier = LookaheadPolicy(3, True, 0.7, concurrent=True, memory=memory, draft_key=1, confidence=True)
    for _ in range(60):
        earlier.calibration.add_at([0.99, 0.99], 1, 0.5)
    pool_next = earlier.calibration.next_table(earlier.calibration.tables()[1])[-1]
    policy = LookaheadPolicy(3, True, 0.7, concurrent=True, memory=memory, draft_key=1, confidence=True)
    before = policy.calibrated_tables()
    assert before[2][-1] == pytest.approx(pool_next, abs=0.05)  # unshifted before the call has samples
    spec = SimpleNamespace(tokens=torch.tensor([5, 6, 7]), probs=None, confidence=torch.tensor([0.99, 0.99, 0.99]),
                           runner_up=None)
    scores = torch.zeros(1, 3, 8)
    scores[0, 2, 7] = 5.0  # the free sample beyond the two verified: taken
    for _ in range(20):
        policy.observe_verification([SimpleNamespace(speculation=spec)],
                                    SimpleNamespace(verified=2, accepted=[2], scores=scores, runner_up=None))
    after = policy.calibrated_tables()
    assert after[2][-1] > before[2][-1] + 0.2 and after[1][-1] > before[1][-1]
    fresh = LookaheadPolicy(3, True, 0.7, concurrent=True, memory=memory, draft_key=1, confidence=True)
    assert fresh.calibrated_tables()[2][-1] < after[2][-1] - 0.2  # the next call starts from the pool
    alone = LookaheadPolicy(3, True, 0.7, concurrent=True, confidence=True)  # no pool: nothing to shift from
    assert alone.call_calibration is None


def test_stop_rule_prices_a_drafted_token_at_the_chosen_speed():
    policy = _measured_policy(confidence=True)
    assert policy.stop_rule() is None  # nothing chosen yet
    policy.choose(3, confidence=[torch.tensor([0.99, 0.99, 0.99])])
    assert policy.stop_rule() is None  # no backup token timed yet: the backup drafts the full depth
    policy.backup_token.add(0.02)
    rule = policy.stop_rule()
    assert rule.gain == pytest.approx(policy._rate * 0.02, rel=1e-6)  # drafting it
    assert rule.extra == pytest.approx([policy._rate * 0.01] * 2, rel=1e-6)  # + one more verified position each
    assert rule.gain_after(1) == pytest.approx(rule.gain_after(5)) == pytest.approx(policy._rate * 0.03, rel=1e-6)
    assert policy.trace[-1]["stop_gain"] == pytest.approx([rule.gain_after(1)] * 2, abs=1e-3)
    assert _measured_policy(confidence=False).stop_rule() is None


def test_a_calls_first_serial_speculation_is_priced_as_earlier_calls_measured_it():
    """A serial speculation's further token is priced as this call measured it, else as earlier calls with this
    draft did (`LookaheadMemory.serial_step`): a call's first serial speculations are no longer held to K_max while
    its own drafting is untimed. Nothing remembered (another draft, a first call): no rule, the full length."""
    from hf_ssd.generation.estimates import LookaheadMemory

    memory = LookaheadMemory()
    confidence = [torch.tensor([0.99, 0.99, 0.99])]
    first = _measured_policy(confidence=True, memory=memory, draft_key=1)
    first.choose(3, confidence=confidence)
    first.serial = 8
    assert first.stop_rule() is None and first.just_in_time() == (3, None)  # K_max deep
    first.serial_fixed.add(0.05)
    first.serial_token.add(0.03)
    assert first.stop_rule().gain == pytest.approx(first._rate * 0.03, rel=1e-6)
    first.metrics()
    assert memory.serial_step[(1, first.setting)] == pytest.approx(0.03)
    again = _measured_policy(confidence=True, memory=memory, draft_key=1)
    again.choose(3, confidence=confidence)
    again.serial = 8
    serial, rule = again.just_in_time()
    assert serial == 8 and rule.gain == pytest.approx(again._rate * 0.03, rel=1e-6)
    again.serial_fixed.add(0.05)
    again.serial_token.add(0.01)  # its own measurement replaces the remembered one
    assert again.stop_rule().gain == pytest.approx(again._rate * 0.01, rel=1e-6)
    other = _measured_policy(confidence=True, memory=memory, draft_key=2)
    other.choose(3, confidence=confidence)
    other.serial = 8
    assert other.stop_rule() is None


def test_stop_rule_prices_each_position_at_the_cost_curve_step_there():
    """A curve flat to three positions, then a jump (a packed target on one 2-core Xeon: K = 1, 2 at 240-250 ms,
    K = 3 at 450 ms): the second drafted token costs its draft step and 5 ms of verification, the third the jump.
    Priced at the average slope, every token after the first looked as dear as the jump."""
    from hf_ssd.generation.costs import position_costs

    curve = {0: 0.230, 1: 0.242, 2: 0.247, 3: 0.452, 4: 0.467}
    assert position_costs(curve, 4) == pytest.approx([0.005, 0.205, 0.015, 0.09])  # the last: the median slope
    assert position_costs({}, 2) == [0.0, 0.0]
    rule = StopRule((0.8,) * (len(EDGES) + 1), 5.0 * 0.036, extra=tuple(5.0 * c for c in position_costs(curve, 3)))
    assert rule.gain_after(1) == pytest.approx(5.0 * 0.041) and rule.gain_after(2) == pytest.approx(5.0 * 0.241)
    assert _drafted(rule, 8) == 2  # reach x f after two tokens: 0.51 (< 1.2, the jump's price)
    assert StopRule.from_list([*rule.to_list(), 0.0, 0.0]) == rule  # a longer buffer's tail ignored


def test_stop_rule_crosses_a_jump_where_the_tokens_past_it_pay_for_it():
    """Code on the real pair: 6 verified positions cost 33 ms more than 5, the ones after 1-13 ms each. Priced one
    token at a time the jump stopped every speculation at 5 tokens; the tokens past it share its price, so a sure
    draft runs on (and an unsure one still stops before the jump)."""
    jump = (0.0, 0.0, 0.0, 0.0, 0.8) + (0.0,) * 6  # gains of the 2nd .. 12th token's verification
    sure, unsure = (0.95,) * (len(EDGES) + 1), (0.6,) * (len(EDGES) + 1)
    assert _drafted(StopRule(sure, 0.2, extra=jump), 12) == 12
    assert _drafted(StopRule(sure, 0.2, extra=jump[:5]), 12) == 5  # no flat run past the jump to share it
    assert _drafted(StopRule(unsure, 0.2, extra=jump), 12) == 3  # 0.6^3 x 0.6 < 0.2 before the jump


def test_the_price_of_a_further_verified_position_is_a_robust_slope():
    """The slope of T_v over K as the median of pairwise slopes: one outlying end timing (a 600 ms K = 8 among
    100-160 ms) leaves it at the curve's 10 ms a position, where the end-to-end slope read 71 ms."""
    from hf_ssd.generation.costs import position_slope

    assert position_slope({1: 0.10, 2: 0.11, 3: 0.12, 4: 0.13}) == pytest.approx(0.01)
    assert position_slope({2: 0.30}) == 0.0 and position_slope({1: 0.2, 2: 0.1}) == 0.0
    outlier = {1: 0.10, 2: 0.11, 3: 0.12, 4: 0.13, 5: 0.14, 6: 0.15, 7: 0.16, 8: 0.60}
    assert position_slope(outlier) == pytest.approx(0.01)


# --- losslessness when speculations stop early -------------------------------------------------------------------

# a rule of every kind the policy makes: one table, gain alone (1, 2, all, 3 tokens); a first token's table apart
# from the later ones', two tokens at least and a per-position gain with a jump at the fourth position (3 tokens)
SPLIT_RULE = StopRule((0.4,) * (len(EDGES) + 1), 0.2, (0.9,) * (len(EDGES) + 1), at_least=2, extra=(0.0, 0.0, 0.5))
STOP_GAINS = [GAINS[1], GAINS[2], 1e-6, GAINS[3], SPLIT_RULE]


def _script_stops(monkeypatch, gains):
    """Just-in-time drafting stops as `gains` say (a gain with f = 0.8 for every confidence, or a `StopRule`), round
    after round."""
    table = (0.8,) * (len(EDGES) + 1)
    cycle = itertools.cycle(gains)

    def stop_rule(self):
        gain = next(cycle)
        return gain if isinstance(gain, StopRule) else StopRule(table, gain)

    monkeypatch.setattr(LookaheadPolicy, "stop_rule", stop_rule)


# serial rounds asking for 3 tokens and concurrent ones of depth 3 (an unrelated draft misses: the backup drafts)
STOP_SCRIPT = [(0, 0, 3), (3, 0, 3), (3, 3), (3, 3), (3, 0, 3), (1, 3), (3, 3), (3, 0, 3)]


def _early_stops(metrics, k_max=3) -> int:
    """Rounds that could verify fewer than K tokens though nothing but the drafting capped them (the last rounds
    excepted: max_length caps them too)."""
    return sum(0 < entry["limit"] < k_max for entry in metrics.lookahead_decisions[1:-2])


@pytest.mark.parametrize("executor", ["sync", "thread", "stream", "process"])
@pytest.mark.parametrize("arch", ["llama", "qwen2_hybrid"])
def test_greedy_identical_when_speculations_stop_early(monkeypatch, arch, executor):
    _script(monkeypatch, STOP_SCRIPT)
    _script_stops(monkeypatch, STOP_GAINS)
    target, random_draft = tiny_pair(arch, seed=130)
    ids = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(13))
    expected = target.generate(ids, max_new_tokens=33, do_sample=False)
    for draft in (target, random_draft):
        out = target.generate(ids, assistant_model=draft, max_new_tokens=33, do_sample=False,
                              ssd_config=SSDConfig(lookahead=3, executor=executor))
        assert torch.equal(out, expected), (arch, executor)
        m = target.ssd_metrics
        assert _early_stops(m) >= 2, m.lookahead_decisions
        if draft is random_draft:
            assert m.rounds_by_source.get("draft", 0) >= 1  # backups drafted just in time (under the stop rule)


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_batch_greedy_identical_when_speculations_stop_early(monkeypatch, executor):
    _script(monkeypatch, STOP_SCRIPT)
    _script_stops(monkeypatch, STOP_GAINS)
    for metrics in batch_greedy_runs(73, 10, 23, SSDConfig(lookahead=3, executor=executor)):
        assert _early_stops(metrics) >= 1


def deep_target_and_its_head() -> tuple:
    """(a 6-layer target whose last 4 layers add nothing to the residual stream, a draft made of its first 2): the
    draft agrees with every token at a third of the cost, so speculating pays on any machine load (with the target
    as its own draft, drafting K tokens costs K target steps and the choice is a tie that timing noise decides)."""
    target = enable_ssd(tiny_model("llama", layers=6, seed=131))
    with torch.no_grad():
        for layer in target.model.layers[2:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return target, truncated_copy(target, layers=2)


def test_greedy_identical_under_the_learnt_confidence_policy():
    """Unscripted: the default policy, its calibration and stop rule deciding, on a pair that agrees often."""
    target, draft = deep_target_and_its_head()
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(14))
    expected = target.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=0)
    out = target.generate(ids, assistant_model=draft, max_new_tokens=40, do_sample=False, pad_token_id=0,
                          ssd_config=SSDConfig(lookahead=4, executor="sync"))
    assert torch.equal(out, expected)
    decisions = target.ssd_metrics.lookahead_decisions
    assert any("confident_tok_s" in e for e in decisions)
    drafted = [e for e in decisions if "drafted" in e]  # the speculation in hand, recorded beside the K chosen
    assert drafted and all(e["k"] <= e["drafted"] for e in drafted), decisions


# 4 new tokens counted of 6 generated (so that the room left lets a 3-token speculation stop early): a plain step into
# a serial round asking for 3 (stopping after 1, 2, all or 3), another, a concurrent round
LAW_STOP_SCRIPT = [(0, 0, 3), (2, 0, 3), (3, 3)]


@pytest.mark.parametrize("draft, c, executor, sampling", [
    pytest.param("random", 0.3, "sync", TEMPERATURE, id="rand-C0.3-sync"),
    pytest.param("self", 1.0, "process", WARPED, id="self-C1-process-warped"),
])
def test_sampling_law_when_speculations_stop_early(monkeypatch, law_models, draft, c, executor,  # noqa: F811
                                                    sampling):
    _script(monkeypatch, LAW_STOP_SCRIPT)
    _script_stops(monkeypatch, STOP_GAINS)
    target = law_models["target"]
    config = SSDConfig(lookahead=3, fanout_budget=4, saguaro_c=c, backup="draft", executor=executor)
    counts, hits, misses = ssd_samples(target, law_models[draft], config, sampling, seed=131, generated=6)
    pvalues = law_pvalues(exact_law(target, sampling), counts)
    print(f"p-values {pvalues}, hits {hits}, misses {misses}")
    assert min(pvalues.values()) >= ALPHA, pvalues


def test_negative_control_q_shifted_when_drafting_stops_early(monkeypatch, law_models):  # noqa: F811
    """Power check: speculations that stopped early handed over with q shifted by one position (C = 0.3, so the
    positions' q differ) are rejected by the same harness."""
    _script(monkeypatch, LAW_STOP_SCRIPT)
    _script_stops(monkeypatch, [GAINS[2]])  # two tokens of the three asked for
    shift_just_in_time_q(monkeypatch, lambda phase, asked, drafted: drafted < asked)
    target = law_models["target"]
    config = SSDConfig(lookahead=3, fanout_budget=4, saguaro_c=0.3, backup="draft", executor="sync")
    counts, _, _ = ssd_samples(target, law_models["self"], config, TEMPERATURE, seed=132, samples=SAMPLES,
                               generated=6)
    pvalues = law_pvalues(exact_law(target, TEMPERATURE), counts)
    print(f"negative control p-values {pvalues}")
    assert min(pvalues.values()) < REJECT, pvalues


@pytest.mark.parametrize("executor", ["sync", "process"])
def test_confidences_arrive_where_known_and_only_there(monkeypatch, executor):
    """Drafted tokens come with their confidences (a value in (0, 1] each); a fast backup's with none, never a stale
    buffer's; none at all when the policy does not use them."""
    seen = []
    original = LookaheadPolicy.observe_verification

    def record(self, rows, verdict):
        for row in rows:
            spec = row.speculation
            if spec.tokens.shape[0]:
                seen.append((spec.source, None if spec.confidence is None else spec.confidence.tolist(),
                             spec.tokens.shape[0]))
        return original(self, rows, verdict)

    monkeypatch.setattr(LookaheadPolicy, "observe_verification", record)
    target, random_draft = tiny_pair("llama", seed=132)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(15))
    for draft, backup in ((target, "draft"), (random_draft, "ngram")):
        for tracked in (True, False):
            seen.clear()
            target.generate(ids, assistant_model=draft, max_new_tokens=24, do_sample=False,
                            ssd_config=SSDConfig(lookahead=3, backup=backup, executor=executor,
                                                 draft_confidence=tracked, lookahead_schedule="constant"
                                                 if not tracked else "adaptive"))
            assert seen
            for source, confidence, length in seen:
                if not tracked or source in ("ngram", "random"):
                    assert confidence is None, (source, confidence)
                else:
                    assert len(confidence) == length and all(0.0 < c <= 1.0 for c in confidence), (source, confidence)
            if backup == "ngram" and tracked:
                assert any(source == "ngram" for source, _, _ in seen)


def _serial_priced_sure(monkeypatch):
    """The confident pricing of serial speculation forced to win wherever it applies (a single row, serial rounds
    possible): serial rounds, a plain step among them whenever the speculation in hand is not worth verifying."""
    from hf_ssd.generation.confident_rounds import ConfidentRounds

    priced = []

    def sure(self, table, serial_table):
        applies = self.calibration is not None and self.serial_option and self._active_rows == 1
        priced.append(applies)
        return 1e9 if applies else None

    monkeypatch.setattr(ConfidentRounds, "confident_serial_speed", sure)
    return priced


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_greedy_identical_when_the_spread_of_confidence_keeps_serial_rounds(monkeypatch, executor):
    """Unscripted, a draft that rarely agrees: where the average would step plainly, the confident pricing keeps
    serial rounds, most verifying nothing (a plain step with the next speculation drafted after it)."""
    _serial_priced_sure(monkeypatch)
    target, draft = tiny_pair()
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(15))
    expected = target.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
    out = target.generate(ids, assistant_model=draft, max_new_tokens=24, do_sample=False, pad_token_id=0,
                          ssd_config=SSDConfig(lookahead=3, executor=executor))
    assert torch.equal(out, expected)
    decisions = target.ssd_metrics.lookahead_decisions
    serial = [e for e in decisions[1:] if e["mode"] == "serial"]
    assert len(serial) >= len(decisions) // 2 and any(e["k"] == 0 for e in serial), decisions
    assert all(e["mode"] != "plain" for e in decisions[1:] if "confident_serial_tok_s" in e), decisions


def test_sampling_law_when_the_spread_of_confidence_keeps_serial_rounds(monkeypatch, law_models):  # noqa: F811
    """The sampling law with serial rounds kept by the confident pricing (plain steps, speculations stopped by the
    learnt rule and verified at the K their confidences pay), Saguaro C < 1."""
    priced = _serial_priced_sure(monkeypatch)
    target = law_models["target"]
    config = SSDConfig(lookahead=3, fanout_budget=4, saguaro_c=0.3, backup="draft", executor="thread")
    counts, hits, misses = ssd_samples(target, law_models["random"], config, TEMPERATURE, seed=133)
    pvalues = law_pvalues(exact_law(target, TEMPERATURE), counts)
    print(f"p-values {pvalues}, hits {hits}, misses {misses}, rounds priced {sum(priced)}")
    assert sum(priced) >= SAMPLES // 2  # the pricing decided rounds in most calls, not only in a few
    assert min(pvalues.values()) >= ALPHA, pvalues
