"""Speed model (hf_ssd.speed_model): closed forms, limits, bounds, batch, the CPU sanity check, H100 framing, CLI."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hf_ssd.cli import main
from hf_ssd.metrics import SSDMetrics
from hf_ssd.speed_model import (
    Latencies,
    Statistics,
    acceptance_for_tokens,
    critical_batch_size,
    expected_tokens,
    expected_tokens_hit,
    expected_tokens_miss,
    expected_tokens_sd,
    explain_gap,
    predict,
    speedup_sd,
    speedup_ssd,
    speedup_ssd_batch,
    ssd_over_sd_bounds,
)
from hf_ssd.speed_settings import CPU_QWEN_INT8, H100_PUBLISHED, h100_latencies, h100_statistics, predict_h100

unit = st.floats(0.0, 1.0)
tokens = st.floats(1.0, 9.0)
latency = st.floats(0.0, 3.0)

# --- expected tokens -----------------------------------------------------------------------------------------


def test_expected_tokens_hand_values():
    assert expected_tokens_sd(0.8, 3) == pytest.approx((1 - 0.8**4) / 0.2) == pytest.approx(2.952)
    assert expected_tokens_sd(1.0, 5) == 6.0
    assert expected_tokens_sd(0.0, 5) == 1.0
    # per-position conditional profile, last value repeats: 1 + .85 + .85·.69 + .85·.69²
    assert expected_tokens([0.85, 0.69], 3) == pytest.approx(1 + 0.85 + 0.85 * 0.69 + 0.85 * 0.69**2)
    assert expected_tokens_hit(0.8, 3) == pytest.approx(2.952)
    assert expected_tokens_miss("draft", 0.8, 3) == pytest.approx(2.952)
    assert expected_tokens_miss("random", 0.8, 3) == 1.0
    assert expected_tokens_miss("ngram", 0.8, 3, backup_acceptance=0.5) == pytest.approx(1.875)


@given(unit, st.integers(0, 12))
def test_iid_profile_matches_closed_form_and_inverts(a, K):
    E = expected_tokens_sd(a, K)
    assert expected_tokens(a, K) == pytest.approx(E)
    assert expected_tokens([a] * (K + 1), K) == pytest.approx(E)
    if K >= 1 and 0.01 < a < 0.99:
        assert acceptance_for_tokens(E, K) == pytest.approx(a, abs=1e-6)


def test_invalid_inputs_raise():
    with pytest.raises(ValueError):
        expected_tokens_sd(1.2, 3)
    with pytest.raises(ValueError):
        speedup_ssd(1.5, 2.0, 1.0, 0.5, 0.5)
    with pytest.raises(ValueError):
        predict(CPU_QWEN_INT8, Statistics(0.8, 0.9), 0, 8)
    with pytest.raises(ValueError):
        speedup_ssd_batch(0.5, 0, 2.0, 1.0, 0.5, 0.5)


# --- closed forms ----------------------------------------------------------------------------------------------


def test_speedup_formulas_hand_values():
    assert speedup_sd(3.0, 0.5) == pytest.approx(2.0)
    assert speedup_sd(3.0, 0.5, v=1.2) == pytest.approx(3.0 / 1.8)
    # num = .8·3 + .2·2 = 2.8; den = .8·1 + .2·1.5 = 1.1
    assert speedup_ssd(0.8, 3.0, 2.0, 0.5, 0.5) == pytest.approx(2.8 / 1.1)
    # primary slower than verification: den = .8·1.5 + .2·1.5 = 1.5
    assert speedup_ssd(0.8, 3.0, 2.0, 1.5, 0.5) == pytest.approx(2.8 / 1.5)
    assert speedup_ssd(0.8, 3.0, 2.0, 0.5, 0.5, v=1.1) == pytest.approx(2.8 / 1.1 / 1.1)


@given(tokens, tokens, st.floats(0.0, 1.0), latency, st.floats(0.5, 2.0))
def test_limits_all_hits_and_all_misses(E_hit, E_miss, T_p, T_b, v):
    # every outcome cached and the primary hidden: speedup = E_hit (per unit verification cost)
    assert speedup_ssd(1.0, E_hit, E_miss, T_p, T_b) == pytest.approx(E_hit)
    assert speedup_ssd(1.0, E_hit, E_miss, T_p, T_b, v) == pytest.approx(E_hit / v)
    # never a hit: SD with the backup as drafter
    assert speedup_ssd(0.0, E_hit, E_miss, T_p, T_b, v) == pytest.approx(speedup_sd(E_miss, T_b, v))


@settings(max_examples=300)
@given(unit, tokens, tokens, latency, st.floats(0.0, 1.0), latency, unit)
def test_corollary_9_bounds_contain_theorem_7(p, E_hit, E_sd, T_sd, T_p, T_b, u):
    """Preconditions (see ssd_over_sd_bounds): T_p <= 1 and p·E_hit·T_b <= E_miss <= E_hit."""
    low_miss = max(1.0, p * E_hit * T_b)
    assume(low_miss <= E_hit)
    E_miss = low_miss + u * (E_hit - low_miss)
    ratio = speedup_ssd(p, E_hit, E_miss, T_p, T_b) / speedup_sd(E_sd, T_sd)
    lower, upper = ssd_over_sd_bounds(p, E_hit, E_sd, T_sd)
    assert lower * (1 - 1e-9) <= ratio <= upper * (1 + 1e-9)


@given(unit, tokens, tokens, latency, latency, st.floats(0.5, 2.0))
def test_batch_formula_reduces_to_theorem_7_at_b1(p, E_hit, E_miss, T_p, T_b, v):
    assert speedup_ssd_batch(p, 1, E_hit, E_miss, T_p, T_b, v) == pytest.approx(
        speedup_ssd(p, E_hit, E_miss, T_p, T_b, v)
    )


@given(st.floats(0.05, 0.99), tokens, tokens, st.floats(0.0, 1.0), latency)
def test_batch_speedup_does_not_grow_with_b_when_misses_cost_more(p, E_hit, E_miss, T_p, T_b):
    values = [speedup_ssd_batch(p, b, E_hit, E_miss, T_p, T_b) for b in (1, 2, 4, 8, 16, 64)]
    assert all(later <= earlier * (1 + 1e-12) for earlier, later in zip(values, values[1:]))


def test_critical_batch_size_hand_example():
    """p=.9, E_hit=E_SD=4, T_p=.8, T_b=.6: fast = 3.7 for all b; neural = 4/(1.6 − .6·.9^b) → b* = 2."""
    assert critical_batch_size(0.9, 4.0, 4.0, 0.8, 0.6) == 2
    assert critical_batch_size(0.9, 4.0, 4.0, 0.8, 0.0) is None  # a free neural backup is never beaten
    assert critical_batch_size(1.0, 4.0, 4.0, 0.8, 0.6) is None  # no misses: both backups are equal


@settings(max_examples=100)
@given(st.floats(0.3, 0.98), st.floats(1.5, 6.0), st.floats(0.0, 1.0), st.floats(0.05, 2.0))
def test_critical_batch_size_monotonic(p, E_hit, T_p, T_b):
    E_sd = E_hit
    b_star = critical_batch_size(p, E_hit, E_sd, T_p, T_b, max_batch=4096)
    if b_star is not None:  # fast stays ahead for every larger b
        for b in (b_star, b_star + 1, 2 * b_star, 8 * b_star):
            assert speedup_ssd_batch(p, b, E_hit, 1.0, T_p, 0.0) > speedup_ssd_batch(p, b, E_hit, E_sd, T_p, T_b)
    # a slower neural backup switches no later; a better neural backup (larger E_sd) no earlier
    slower = critical_batch_size(p, E_hit, E_sd, T_p, 2 * T_b, max_batch=4096)
    better = critical_batch_size(p, E_hit, E_sd + 1.0, T_p, T_b, max_batch=4096)
    if b_star is not None:
        assert slower is not None and slower <= b_star
        assert better is None or better >= b_star


# --- latencies and predict -------------------------------------------------------------------------------------


def test_latency_tables_interpolate():
    lat = CPU_QWEN_INT8
    assert lat.verify(0) == 211.0 and lat.verify(4) == 238.0 and lat.verify(8) == 317.0
    assert lat.verify(1) == pytest.approx(211 + 27 / 4)
    assert lat.verify(10) == pytest.approx(317 + 2 * 79 / 4)  # linear extrapolation
    assert lat.tree_step(12) == pytest.approx(137.5)
    assert lat.draft_forward(1) == 100.0 and lat.draft_forward(5) == 116.0
    assert Latencies(10.0, 1.0).verify(7) == 10.0  # the paper's idealisation: verify = one step
    assert Latencies.from_dict(json.loads(json.dumps(lat.to_dict()))) == lat


@pytest.mark.parametrize("K,B,p", [(1, 8, 0.86), (2, 16, 0.7), (4, 24, 0.5)])
def test_predict_equals_theorem_7_without_cpu_effects(K, B, p):
    lat = replace(CPU_QWEN_INT8, overlap_efficiency=1.0, draft_step_ms=20.0, draft_tree_ms={8: 22.0, 24: 30.0})
    result = predict(lat, Statistics([0.85, 0.7], p), K, B)
    n = result["normalised"]
    assert n["T_p"] <= 1.0
    assert result["ssd_over_ar"] == pytest.approx(n["theorem7_ssd_over_ar"])
    assert result["sd_over_ar"] == pytest.approx(n["sd_formula_over_ar"])
    assert n["corollary9_preconditions"]
    lower, upper = n["corollary9_ssd_over_sd"]
    assert lower <= result["ssd_over_sd"] <= upper


@pytest.mark.parametrize("K,B,backup", [(1, 8, "draft"), (3, 16, "draft"), (2, 8, "random"), (4, 24, "ngram")])
def test_effective_normalisation_reproduces_predict(K, B, backup):
    lat = replace(CPU_QWEN_INT8, round_overhead_ms=7.0, backup_ms=2.0)
    result = predict(lat, Statistics(0.8, 0.75, backup_acceptance=0.3), K, B, backup)
    n, eff = result["normalised"], result["normalised"]["effective"]
    assert result["ssd_over_ar"] == pytest.approx(
        speedup_ssd(0.75, result["E_hit"], result["E_miss"], eff["T_p"], eff["T_b"], n["v"])
    )
    assert result["sd_over_ar"] == pytest.approx(speedup_sd(result["E_sd"], eff["T_sd"], n["v"]))
    assert result["ssd_tok_s"] == pytest.approx(result["ssd_over_ar"] * result["ar_tok_s"])


def test_round_breakdown_cpu_threads():
    """K=1, B=8 int8: hit = max(217.75, 100 + 110) + 210·(1/.9 − 1); miss adds the 100 ms just-in-time draft."""
    br = predict(CPU_QWEN_INT8, Statistics(0.85, 0.86), 1, 8)["breakdown_ms"]
    hit = 217.75 + 210 * (1 / 0.9 - 1)
    assert br["ssd_hit_round"]["total"] == pytest.approx(hit)
    assert br["ssd_miss_round"]["total"] == pytest.approx(hit + 100)
    assert br["sd_round"]["total"] == pytest.approx(100 + 217.75)
    assert br["ssd_mean_round"] == pytest.approx(0.86 * hit + 0.14 * (hit + 100))


# --- sanity check: the speed model on the measured int8 Qwen pair ----------------------------------------------
# Assumptions (not in the doc): per-position conditional acceptance [0.85, 0.69, 0.69, ...] (0.85 reproduces
# SD 1.23x at K=1; 0.69 after it is consistent with the 2x-draft and limit figures); AR = one target forward
# (211 ms); two torch threads overlap at 0.9 efficiency (doc's "Threads"); no per-round overhead; this
# project's round (glue over s_K + K tree steps; just-in-time draft backup); hit rate 0.88 at K=3 with the
# faster draft (the doc gives 0.86 only for K=1).

PROFILE = [0.85, 0.69]


def test_cpu_best_sd_is_k1_at_1_23x():
    sd = {K: predict(CPU_QWEN_INT8, Statistics(PROFILE, 0.86), K, 8)["sd_over_ar"] for K in range(1, 7)}
    assert max(sd, key=sd.get) == 1
    assert sd[1] == pytest.approx(1.23, rel=0.03)


def test_cpu_ssd_k1_b8():
    result = predict(CPU_QWEN_INT8, Statistics(PROFILE, 0.86), 1, 8)
    assert result["ssd_over_ar"] == pytest.approx(1.56, rel=0.05)  # model: 1.53
    assert result["ssd_over_sd"] == pytest.approx(1.27, rel=0.05)  # model: 1.25


def test_cpu_twice_faster_draft():
    fast = replace(CPU_QWEN_INT8, draft_step_ms=50.0, draft_forward_ms={5: 58.0},
                   draft_tree_ms={8: 55.0, 16: 82.5, 24: 118.5})
    ssd = {K: predict(fast, Statistics(PROFILE, 0.88), K, 8) for K in range(1, 7)}
    assert max(ssd, key=lambda K: ssd[K]["ssd_over_ar"]) == 3
    assert ssd[3]["ssd_over_ar"] == pytest.approx(2.2, rel=0.05)  # model: 2.19
    assert ssd[3]["ssd_over_sd"] == pytest.approx(1.4, rel=0.05)  # model: 1.40


def test_cpu_limit_draft_hidden_all_hits():
    free = replace(CPU_QWEN_INT8, draft_step_ms=0.0, draft_forward_ms={}, draft_tree_ms=lambda b: 0.0)
    ssd = {K: predict(free, Statistics(PROFILE, 1.0), K, 8)["ssd_over_ar"] for K in range(1, 9)}
    assert max(ssd, key=ssd.get) == 4
    assert ssd[4] == pytest.approx(2.7, rel=0.05)  # model: 2.77


# --- H100 framing ------------------------------------------------------------------------------------------------


def test_h100_latencies_follow_stated_assumptions():
    lat = h100_latencies("llama-70b")
    assert lat.target_step_ms == pytest.approx(1e3 / 54.7)  # ≈ 18.3 ms
    assert lat.verify(4) / lat.target_step_ms == pytest.approx(1.05)
    assert lat.verify(8) / lat.target_step_ms == pytest.approx(1.10)
    assert lat.draft_step_ms == pytest.approx(0.1 * lat.target_step_ms)
    assert lat.overlap_efficiency == 1.0 and lat.round_overhead_ms == 0.0


@pytest.mark.parametrize("setting", list(H100_PUBLISHED))
def test_h100_calibrated_on_sd_predicts_published_ssd(setting):
    """Acceptance fitted to the published SD tok/s; with p_hit = 0.9 the SSD prediction lands near the paper's."""
    pub = H100_PUBLISHED[setting]
    K = pub.lookahead
    result = predict_h100(h100_statistics(setting), K, pub.fanout_per_position * (K + 1), setting)
    assert "PREDICTION" in result["label"]
    assert result["ar_tok_s"] == pytest.approx(pub.ar_tok_s)
    assert result["sd_tok_s"] == pytest.approx(pub.sd_tok_s, rel=1e-6)
    assert result["ssd_tok_s"] == pytest.approx(pub.ssd_tok_s, rel=0.10)
    assert result["published"]["ssd_tok_s"] == pub.ssd_tok_s


# --- explaining a gap ----------------------------------------------------------------------------------------------


def _metrics(**kw) -> dict:
    base = dict(rounds=100, generated_tokens=185, cache_lookups=99, cache_hits=85, cache_hit_rate=0.86,
                mean_accepted_length=1.85, draft_acceptance_rate=0.85, per_position_acceptance=[0.85],
                tokens_per_round_hit=1.85, tokens_per_round_miss=1.85, verify_seconds=21.8,
                target_wait_seconds=4.0, wall_seconds=25.5, lookahead=1, branches=8, backup="draft")
    base.update(kw)
    return SSDMetrics(**base).to_dict()


def test_explain_gap():
    predicted = predict(CPU_QWEN_INT8, Statistics(0.85, 0.86), 1, 8)
    assert explain_gap(predicted, predicted["ssd_tok_s"] * 0.95) == []
    slow = _metrics(target_wait_seconds=15.0, wall_seconds=45.0, cache_hit_rate=0.6, mean_accepted_length=1.5)
    reasons = explain_gap(predicted, None, slow)  # measured = 185 / 45 s
    text = "\n".join(reasons)
    assert "below the predicted" in reasons[0]
    assert "waited" in text and "Python" in text and "hit rate 0.60" in text and "acceptance" in text
    unexplained = explain_gap(predicted, predicted["ssd_tok_s"] * 0.5, None)
    assert "no measured overhead explains" in unexplained[-1]


# --- CLI -------------------------------------------------------------------------------------------------------------


def test_cli_predict_defaults(capsys):
    assert main(["predict"]) == 0
    out = capsys.readouterr().out
    assert "SD (K=1)" in out and "1.23" in out and "H100 PREDICTION" in out and "published" in out


def test_cli_predict_options_and_json(capsys):
    argv = ["predict", "-K", "3", "-B", "8", "--draft-step-ms", "50", "--draft-tree-ms", "8:55",
            "--p-hit", "0.88", "--acceptance", "0.85", "0.69", "--h100", "qwen3-32b", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cpu"]["ssd_over_ar"] == pytest.approx(2.2, rel=0.05)
    assert "PREDICTION" in data["h100_prediction"]["label"]


def test_cli_predict_from_metrics_json(tmp_path, capsys):
    path = tmp_path / "metrics.json"
    path.write_text(json.dumps(_metrics(target_wait_seconds=15.0, wall_seconds=45.0)))
    assert main(["predict", "--from-json", str(path), "--h100", "none"]) == 0
    out = capsys.readouterr().out
    assert "K=1, B=8" in out and "note: latencies are" in out and "measured vs predicted" not in out
    latencies = ["--target-step-ms", "211", "--target-verify-ms", "4:238,8:317", "--draft-step-ms", "100",
                 "--draft-tree-ms", "8:110,16:165,24:237", "--overlap-efficiency", "0.9"]
    assert main(["predict", "--from-json", str(path), "--h100", "none", *latencies]) == 0
    out = capsys.readouterr().out
    assert "measured vs predicted" in out and "waited" in out


def test_cli_predict_from_bench_json(tmp_path, capsys):
    metrics = _metrics(lookahead=3, per_position_acceptance=[0.9, 0.8, 0.7])
    payload = {"plain_decode_tok_s": 5.0, "methods": [
        {"method": "plain", "kind": "plain"},
        {"method": "ssd-thread K=3 B=16", "kind": "ssd", "lookahead": 3, "budget": 16, "executor": "thread",
         "decode_tok_s_median": 6.0, "metrics": [metrics], "metrics_median": metrics},
    ]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(payload))
    argv = ["predict", "--from-json", str(path), "--json", "--target-step-ms", "190", "--draft-step-ms", "90"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["cpu"]["K"], data["cpu"]["B"]) == (3, 16)
    assert data["latencies"]["ar_ms_per_token"] == pytest.approx(200.0)  # from plain_decode_tok_s
    assert data["latencies"]["target_verify_ms"]["3"] == pytest.approx(218.0)  # verify_seconds / rounds
    assert data["statistics"]["acceptance"] == [0.9, 0.8, 0.7]
