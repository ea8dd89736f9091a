"""benchmarks/replay_policy.py: the agreement runs and the policy driven offline (no model)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from hf_ssd.generation import lookahead as lookahead_module

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "replay_policy.py"
_SPEC = importlib.util.spec_from_file_location("replay_policy", _PATH)
replay_policy = sys.modules["replay_policy"] = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(replay_policy)


def test_agreement_runs_count_consecutive_matches():
    assert replay_policy.agreement_runs([True, True, False, True, False, False]) == [2, 1, 0, 1, 0, 0]
    assert replay_policy.agreement_runs([True] * 20, cap=16)[:5] == [16, 16, 16, 16, 16]


@pytest.mark.parametrize("serial", [False, True])
def test_replay_emits_every_token_and_restores_the_clock(serial):
    profile = replay_policy.PROFILES["epyc"]
    predictable = replay_policy.agreement_runs([True] * 63 + [False])
    tokens, seconds, ks = replay_policy.replay_ssd(predictable, profile, 4, hit_rate=1.0, serial=serial)
    assert lookahead_module.time.perf_counter is not None and not isinstance(lookahead_module.time,
                                                                             replay_policy._Clock)
    assert ks[0] == 4 and ks[-3] == 4 and tokens == 64 - 5  # the first round (5 tokens) is left out
    plain = (profile["verify_all"][0] + profile["overhead"]) / 1e3
    assert tokens / seconds > 1.5 / plain  # deep speculation pays on a predictable text
    useless = [0] * 64
    tokens, seconds, ks = replay_policy.replay_ssd(useless, profile, 4, hit_rate=1.0, serial=serial)
    assert tokens == 63 and ks[-20:] == [0] * 20 and tokens / seconds > 0.9 / plain  # plain steps
    sd_tokens, sd_seconds = replay_policy.replay_sd(predictable, profile, 4)
    assert sd_tokens == 64 - 5 and sd_seconds > 0


def test_replay_with_confidences_drafts_past_k_max_where_the_draft_is_sure():
    """Recorded confidences: the policy as `draft_confidence=True` runs it. A sure, always-right draft speculates
    past K_max (the stop rule's serial speculations); a hesitant, always-wrong one falls back to plain steps; every
    token is emitted either way, and transformers' default schedule drafts while the draft is sure."""
    profile = replay_policy.PROFILES["xeon-packed"]
    plain = (profile["verify_all"][0] + profile["overhead"]) / 1e3
    predictable = replay_policy.agreement_runs([True] * 63 + [False])
    tokens, seconds, ks = replay_policy.replay_ssd(predictable, profile, 4, 1.0, True, confidence=[0.995] * 64)
    assert tokens == 64 - 5 and max(ks) > 4 and tokens / seconds > 2.0 / plain
    useless = [0] * 64
    tokens, seconds, ks = replay_policy.replay_ssd(useless, profile, 4, 1.0, True, confidence=[0.05] * 64)
    assert tokens == 63 and ks[-10:] == [0] * 10 and tokens / seconds > 0.9 / plain
    sd_tokens, sd_seconds = replay_policy.replay_sd_default(predictable, [0.995] * 64, profile)
    assert sd_tokens == 64 - 21 and sd_tokens / sd_seconds > 2.0 / plain  # 20 drafted in the first round
    sd_tokens, sd_seconds = replay_policy.replay_sd_default(useless, [0.05] * 64, profile)
    assert sd_tokens == 63 and sd_tokens / sd_seconds < 1 / plain  # one token drafted, and rejected, each round


def test_warm_up_leaves_the_first_prompts_opening_in_the_memory():
    """The bench's warm-up call runs through the same `LookaheadMemory` as the measured calls: a hard opening
    (every drafted token rejected) leaves a remembered acceptance below a fresh policy's prior, an easy one above."""
    profile = replay_policy.PROFILES["xeon-packed"]
    hard = {"agree": [0] * 64, "confidence": [0.3] * 64}
    easy = {"agree": replay_policy.agreement_runs([True] * 64), "confidence": [0.99] * 64}
    remembered = {}
    for name, run in (("hard", hard), ("easy", easy)):
        memory = lookahead_module.LookaheadMemory()
        replay_policy.warm_up(run, profile, 4, 1.0, True, memory, 8, run["confidence"])
        remembered[name] = memory.acceptance[1]
    assert remembered["hard"] < 0.75 < remembered["easy"], remembered


@pytest.mark.parametrize("profile_name", ["epyc", "xeon-mkl-dec06", "xeon-packed"])
def test_the_oracle_schedule_bounds_every_fixed_k_and_takes_plain_steps_where_nothing_is_accepted(profile_name):
    profile = replay_policy.PROFILES[profile_name]
    mixed = replay_policy.agreement_runs(([True] * 9 + [False]) * 4 + [False] * 20 + [True] * 23 + [False])
    tokens, seconds = replay_policy.replay_oracle(mixed, profile)
    for k in (1, 2, 4, 8):
        sd_tokens, sd_seconds = replay_policy.replay_sd(mixed, profile, k)
        assert tokens / seconds >= sd_tokens / sd_seconds - 1e-9
    useless = replay_policy.agreement_runs([False] * 40)
    tokens, seconds = replay_policy.replay_oracle(useless, profile)
    plain = (profile["verify_all"][0] + profile["overhead"]) / 1e3
    assert tokens == 39 and seconds == pytest.approx(39 * plain)  # every round a plain step: nothing to gain


def test_the_confidence_rule_follows_the_drafts_confidence_and_is_fitted_on_the_other_prompts():
    """`ConfidenceRule`: a sure draft's runs are drafted and verified deep, an unsure first token is a plain step
    (one token drafted, none verified); `held_out_rules` replays each answer under the rule fitted on the answers of
    the other prompt-index parity, and the oracle bounds it."""
    profile = replay_policy.PROFILES["epyc"]
    matches = ([True] * 9 + [False]) * 4 + [False] * 20 + [True] * 23 + [False]
    agree = replay_policy.agreement_runs(matches)
    confidence = [0.99 if m else 0.05 for m in matches]  # the draft knows when it is right
    deep = replay_policy.ConfidenceRule(first=0.3, base=3, sure=0.9, deep=5)
    tokens, seconds = replay_policy.replay_rule(agree, confidence, profile, deep)
    assert tokens == len(matches) - 10  # the first round (9 drafted and accepted, and the bonus) left out
    sd_tokens, sd_seconds = replay_policy.replay_sd(agree, profile, 4)
    assert tokens / seconds > 1.2 * sd_tokens / sd_seconds
    oracle_tokens, oracle_seconds = replay_policy.replay_oracle(agree, profile)
    assert tokens / seconds <= oracle_tokens / oracle_seconds + 1e-9
    useless = replay_policy.agreement_runs([False] * 40)
    unsure = [0.05] * 40
    tokens, seconds = replay_policy.replay_rule(useless, unsure, profile, deep)
    plain = (profile["verify_all"][0] + profile["overhead"]) / 1e3
    drafted = profile.get("draft_fixed_all", profile["draft_token_all"]) / 1e3
    # plain steps, each after one drafted token (none after the last: nothing is left to draft)
    assert tokens == 39 and seconds == pytest.approx(39 * plain + 38 * drafted)
    runs = [{"dataset": "code", "index": i, "agree": agree, "confidence": confidence} for i in range(2)] + [
        {"dataset": "noise", "index": i, "agree": useless, "confidence": unsure} for i in range(2, 4)]
    rules = replay_policy.held_out_rules(runs + [{"dataset": "old", "index": 4, "agree": agree}], profile, 64)
    assert sorted(rules) == [0, 1, 2, 3]  # a run recorded without confidences has no rule to replay
    assert rules[0] == rules[2] == replay_policy.fit_rule([(agree, confidence), (useless, unsure)], profile)
    assert rules[0].first > 0.05 and rules[0].sure <= 0.99  # plain steps on noise, deep on the sure runs


def test_noise_scales_each_forward_around_the_profile_and_leaves_the_bounds_noiseless():
    """`--noise`: every read of a verification curve is one forward, scaled by a lognormal factor of mean 1, drawn from
    the seed's stream; the policy and the fixed schedules meet it, the oracle (a bound) does not."""
    profile = replay_policy.PROFILES["epyc"]
    shaky = replay_policy.noisy(profile, 0.15, seed=3)
    reads = [replay_policy._at(shaky["verify_all"], 2) for _ in range(4000)]
    assert len(set(reads)) == len(reads)  # one draw a read
    assert abs(sum(reads) / len(reads) / profile["verify_all"][2] - 1.0) < 0.02  # mean 1
    again = replay_policy.noisy(profile, 0.15, seed=3)
    assert replay_policy._at(again["verify_all"], 2) == reads[0]  # the seed fixes the stream
    assert replay_policy._at(profile["verify_all"], 2) == profile["verify_all"][2]  # a plain profile as ever
    agree = replay_policy.agreement_runs([True, True, False] * 21)
    assert replay_policy.replay_oracle(agree, shaky) == replay_policy.replay_oracle(agree, profile)
    quiet, loud = replay_policy.replay_sd(agree, profile, 2), replay_policy.replay_sd(agree, shaky, 2)
    assert quiet[0] == loud[0] and quiet[1] != loud[1]  # the same rounds, other times
    tokens, seconds, _ = replay_policy.replay_ssd(agree, shaky, 4, 1.0, True)
    assert tokens == replay_policy.replay_ssd(agree, profile, 4, 1.0, True)[0] == 63 - 3 and seconds > 0  # every
    # token emitted; the first round (2 accepted and the bonus) left out
