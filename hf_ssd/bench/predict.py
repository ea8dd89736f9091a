"""Directly measured latencies fed to the speed model: predicted next to measured, and why they differ."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .common import ALL, _ratio
from .measure import BenchSettings, MethodSpec

# --- latencies and the speed model -------------------------------------------------------------------------------


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def measure_latencies(target, draft, input_ids, lookahead: int, budget: int, threads: int = 1, repeats: int = 3,
                      fanout: str = "geometric", tree: bool = True, verify_ks=None) -> dict[str, Any]:
    """Milliseconds of the forwards the speed model needs, at `threads` intra-op threads, after `input_ids`.

    - target_step_ms: target forward over 1 token with the prompt's KV cache (an AR step);
    - target_verify_ms: target forward over k+1 tokens (a verification of k draft tokens), for k in `verify_ks`
      (default: K alone);
    - draft_step_ms: draft forward over 1 token (SD drafting; the just-in-time backup);
    - draft_forward_ms: draft forward over K+1 tokens (the glue after a fast backup);
    - draft_round_ms / draft_tree_ms: one real SSD draft round (`SaguaroCandidateGenerator.prepare`: glue over
      s_K, fork, K tree steps over B branches) and (round − draft step) / K, one tree step of width B.
    The KV cache is cropped back after every timed forward. Medians of `repeats` after one warm-up.
    """
    import torch
    from transformers import DynamicCache

    from ..compat import cache_kwarg
    from ..config import SSDConfig
    from ..generation.candidate_generator import SaguaroCandidateGenerator
    from ..generation.checks import model_vocab_size as _vocab_size

    def forward_cost(model, n: int) -> float:
        name = cache_kwarg(model)
        cache = DynamicCache()
        model(input_ids=input_ids, use_cache=True, **{name: cache})
        length = input_ids.shape[1]
        tokens = input_ids[:, -n:] if n <= length else input_ids[:, -1:].repeat(1, n)
        positions = torch.arange(length, length + n)[None]

        def run():
            model(input_ids=tokens, position_ids=positions, use_cache=True, logits_to_keep=n, **{name: cache})
            cache.crop(-n)

        return _median_ms(run, repeats)

    saved = torch.get_num_threads()
    result: dict[str, Any] = {"threads": threads, "context_tokens": int(input_ids.shape[1]), "repeats": repeats,
                              "K": lookahead, "B": budget}
    try:
        torch.set_num_threads(threads)
        with torch.no_grad():
            result["target_step_ms"] = forward_cost(target, 1)
            result["target_verify_ms"] = {str(k): forward_cost(target, k + 1) for k in (verify_ks or [lookahead])}
            result["draft_step_ms"] = forward_cost(draft, 1)
            result["draft_forward_ms"] = {str(lookahead + 1): forward_cost(draft, lookahead + 1)}
            if tree:
                config = SSDConfig(lookahead=lookahead, fanout_budget=budget, fanout=fanout, backup="random")
                drafter = SaguaroCandidateGenerator(draft, config, vocab_size=_vocab_size(target), seed=0)
                drafter.begin(input_ids.to(draft.device), None)

                def draft_round():  # a steady-state round: prepare, then commit the first prepared outcome (a hit)
                    drafter.prepare(lookahead)
                    row, accepted, bonus = drafter.spec_cache.keys()[0]
                    drafter.resolve([(accepted, bonus)], lookahead)

                round_ms = _median_ms(draft_round, repeats)
                result["draft_round_ms"] = {str(budget): round_ms}
                result["draft_tree_ms"] = {str(budget): max(round_ms - result["draft_step_ms"], 0.0) / lookahead}
    finally:
        torch.set_num_threads(saved)
    return result


def latencies_for_model(measured: Mapping[str, Any], overlap_efficiency: float = 0.9):
    """`speed_model.Latencies` from a `measure_latencies` dict."""
    from ..speed_model import Latencies

    def table(key: str) -> dict[int, float]:
        return {int(k): float(v) for k, v in (measured.get(key) or {}).items()}

    return Latencies(
        target_step_ms=float(measured["target_step_ms"]), draft_step_ms=float(measured["draft_step_ms"]),
        target_verify_ms=table("target_verify_ms"), draft_forward_ms=table("draft_forward_ms"),
        draft_tree_ms=table("draft_tree_ms"), overlap_efficiency=overlap_efficiency,
    )


def statistics_for_model(ssd: Mapping[str, Any]):
    """`speed_model.Statistics` from `aggregate_ssd_metrics` output."""
    from ..speed_model import Statistics

    return Statistics.from_metrics(ssd)


def _backup_kind(backup: str) -> str:
    from ..speed_model import FAST_BACKUPS

    return backup if backup in FAST_BACKUPS else "draft"


def adaptive_prediction(lat, stats, lookahead: int, budget: int, backup: str, label: str,
                        mix: Mapping[str, Sequence] | None = None, lat_all=None,
                        serial_token_ms: float | None = None, overhead_ms: float | None = None,
                        draft_round_ms: float | None = None, serial_fixed_ms: float | None = None
                        ) -> dict[str, Any]:
    """The speed model for a run whose rounds verify K = 0..K_max (`lookahead_schedule="adaptive"`): SD and AR as
    usual at K_max; SSD over the rounds the policy chose, `mix` (`rounds_by_lookahead`: per K, rounds with the
    draft paused / working and the tokens they brought): tokens Σ n_K·E(K) over time Σ n_K·R(K), with R(K) the
    model's mean SSD round at K and E(K) the tokens those rounds brought (the policy speculates where the draft is
    right, so the run's pooled acceptance would understate them), else from the acceptance profile and hit rate. A
    plain step (K = 0) is one target step on every core (`lat_all`: latencies on the draft's and the target's
    threads together; `lat` if not given), beside the draft's probe (a glue and one tree step) when the draft
    worked; a serial round (K > 0, the draft paused) is a verification on every core plus K tokens drafted just in
    time (`serial_token_ms` per token after the first and `serial_fixed_ms` for the first with the forward feeding
    the committed tokens, as the run measured them; else a draft step per token).
    Where the mix gives the mean forward of the paused rounds at K (timed by the run at the contexts its prompts
    reached, on every core with nothing beside it), that is their verification; otherwise `lat_all`'s.
    `overhead_ms`, the loop's overhead per round as the run measured it, replaces the latencies' where given, and
    `draft_round_ms`, the draft's round beside a verification as the drafter timed it (K_max deep, at the run's
    contexts and fan-outs), the probe's glue and tree steps; that time already holds what the verification beside
    it cost the draft, so the concurrent body is then the longer of the two (no overlap penalty on top).
    Without a mix: the best single K for these latencies and statistics (K = 0: plain target steps)."""
    from ..speed_model import _concurrent, predict

    pred = predict(lat, stats, lookahead, budget, backup, label=label)
    if not mix or not sum(counts[0] + counts[1] for counts in mix.values()):
        best_k, best = 0, pred["ar_tok_s"]
        for k in range(1, lookahead + 1):
            candidate = predict(lat, stats, k, budget, backup, label=label)["ssd_tok_s"]
            if candidate > best:
                best_k, best = k, candidate
        return dict(pred, ssd_tok_s=best, ssd_over_ar=best / pred["ar_tok_s"], ssd_over_sd=best / pred["sd_tok_s"],
                    adaptive_best_k=best_k)
    per_k = dataclasses.replace(stats, e_hit=None, e_miss=None)  # the measured means mix every K: use the profile
    if overhead_ms is not None:
        lat = dataclasses.replace(lat, round_overhead_ms=max(overhead_ms, 0.0))
    if draft_round_ms is not None:  # d_hit = a draft step + K tree steps (speed_model.predict)
        tree = max(draft_round_ms - lat.draft_step_ms, 0.0) / lookahead
        table = lat.draft_tree_ms if isinstance(lat.draft_tree_ms, dict) else {}
        lat = dataclasses.replace(lat, draft_tree_ms={**table, budget: tree}, overlap_efficiency=1.0)
    probe = lat.draft_forward(2) + lat.tree_step(budget)
    every = lat_all or lat
    per_token = max(serial_token_ms or 0.0, every.draft_step_ms)
    tokens = seconds = 0.0
    breakdown = {}
    for key, (paused, working, *brought) in mix.items():
        k, measured = int(key), brought[0] if brought else None
        timed = brought[1] if len(brought) > 1 else None  # the paused rounds' mean forward, ms
        if k == 0:
            plain = (timed if timed is not None else every.target_step_ms) + lat.round_overhead_ms
            beside = _concurrent(every.target_step_ms, probe, lat.overlap_efficiency) + lat.round_overhead_ms
            tokens += paused + working
            seconds += paused * plain + working * beside
            breakdown["0"] = {"rounds": [paused, working], "E": 1.0, "round_ms": [plain, beside]}
        else:
            at_k = predict(lat, per_k, k, budget, backup, label=label)
            e = at_k["p_hit"] * at_k["E_hit"] + (1 - at_k["p_hit"]) * at_k["E_miss"]
            if measured is not None and paused + working:
                e = measured / (paused + working)
            round_ms = at_k["breakdown_ms"]["ssd_mean_round"]
            drafting = k * per_token if serial_fixed_ms is None else serial_fixed_ms + (k - 1) * per_token
            serial_ms = (timed if timed is not None else every.verify(k)) + drafting + lat.round_overhead_ms
            tokens += (paused + working) * e
            seconds += working * round_ms + paused * serial_ms
            breakdown[key] = {"rounds": [paused, working], "E": e, "round_ms": [serial_ms, round_ms]}
    ssd = 1e3 * tokens / seconds
    return dict(pred, ssd_tok_s=ssd, ssd_over_ar=ssd / pred["ar_tok_s"], ssd_over_sd=ssd / pred["sd_tok_s"],
                adaptive_mix=breakdown)


def predictions(summary: Mapping[str, Mapping[str, Any]], methods: Sequence[MethodSpec],
                latencies: Mapping[int, Mapping[str, Any]], settings: BenchSettings,
                by_dataset: Mapping[str, Mapping[int, Mapping[str, Any]]] | None = None) -> dict[str, Any]:
    """Predicted (speed model, measured latencies + this run's statistics) next to measured decode tok/s.

    `latencies[threads]`: `measure_latencies` output at that thread count; the one at the SSD target's thread
    count (with the draft measured) predicts SSD as well as AR and SD; others predict AR and SD only.
    `by_dataset[name][threads]`, where measured, replaces them for that prompt set (latencies at the context the
    set's prompts decoded at). An adaptive lookahead is predicted over the K its policy chose (`adaptive_prediction`).
    """
    from ..speed_model import explain_gap, predict

    ssd_spec = next((m for m in methods if m.kind == "ssd"), None) or next(
        (m for m in methods if m.kind == "ssd-sync"), None)
    out: dict[str, Any] = {}
    for dataset, by_method in summary.items():
        out_pred = None
        ssd = by_method[ssd_spec.key]["ssd"] if ssd_spec else None
        if not ssd or not ssd["rounds"]:
            continue
        stats = statistics_for_model(ssd)
        backup = _backup_kind(ssd.get("backup") or "draft")
        rows = []
        measured_here = (by_dataset or {}).get(dataset) or latencies
        measured_here = {threads: _calibrated(measured, by_method, methods, threads)
                         for threads, measured in measured_here.items()}
        base = measured_here.get(settings.target_threads) or next(iter(measured_here.values()))
        for threads, measured in sorted(measured_here.items()):
            merged = {**base, **{k: v for k, v in measured.items() if v is not None}}
            lat = latencies_for_model(merged, settings.overlap_efficiency)
            label = f"CPU, latencies measured at {threads} thread(s)"
            if settings.lookahead_schedule == "adaptive":
                every_core = measured_here.get(settings.draft_threads + settings.target_threads)
                lat_all = latencies_for_model({**base, **every_core}, settings.overlap_efficiency) if (
                    every_core and threads == settings.target_threads) else None
                pred = adaptive_prediction(lat, stats, settings.lookahead, settings.budget, backup, label,
                                           ssd.get("rounds_by_lookahead"), lat_all,
                                           ssd.get("serial_draft_ms_per_token"), ssd.get("round_overhead_ms"),
                                           ssd.get("draft_round_ms"), ssd.get("serial_draft_ms_fixed"))
            else:
                pred = predict(lat, stats, settings.lookahead, settings.budget, backup, label=label)
            for m in methods:
                at_k = m.kind == "sd" and m.lookahead in (0, settings.lookahead)  # the K the model predicts
                if (m.kind == "ar" or at_k) and m.threads == threads:
                    got = by_method[m.key]["decode_tok_s"]
                    want = pred[f"{m.kind}_tok_s"]
                    row = {"method": m.key, "predicted_tok_s": want, "measured_tok_s": got,
                           "measured_over_predicted": _ratio(got, want) if got else None, "gap": []}
                    if got and want and abs(got / want - 1) > 0.10:
                        row["gap"] = (_explain_sd_gap(pred, by_method[m.key], settings.lookahead) if m.kind == "sd"
                                      else _explain_ar_gap(pred, by_method[m.key]))
                    rows.append(row)
                elif m.kind == "ssd" and threads == m.target_threads:
                    got = by_method[m.key]["decode_tok_s"]
                    want = pred["ssd_tok_s"]
                    rows.append({"method": m.key, "predicted_tok_s": want, "measured_tok_s": got,
                                 "measured_over_predicted": _ratio(got, want) if got else None,
                                 "gap": explain_gap(pred, got, by_method[m.key]["ssd_decode_window"])})
            if threads == settings.target_threads:
                out_pred = pred
        out[dataset] = {"statistics": vars(stats), "backup": backup, "rows": rows, "prediction": out_pred}
    return out


def _calibrated(measured: Mapping[str, Any], by_method: Mapping[str, Any], methods: Sequence[MethodSpec],
                threads: int) -> dict[str, Any]:
    """The target's latencies at `threads` scaled to the level this run's plain decoding measured at that thread
    count (its ms per token over the target step the direct probe timed), the probe's curve over K kept. The probe
    times a few forwards at the set's decode context; on a shared machine its level drifted 10-30 % from the
    decoding timed around it, so the AR run, which steps through the same contexts in the same window, sets the
    level (`calibration` records the factor; AR's own prediction is then its measurement)."""
    ar = next((m for m in methods if m.kind == "ar" and m.threads == threads), None)
    got = by_method.get(ar.key, {}).get("decode_tok_s") if ar is not None else None
    step = measured.get("target_step_ms")
    if not got or not step:
        return dict(measured)
    factor = 1e3 / got / step
    verify = {k: v * factor for k, v in (measured.get("target_verify_ms") or {}).items()}
    return {**measured, "target_step_ms": step * factor, "target_verify_ms": verify, "calibration": factor}


def _explain_ar_gap(pred: Mapping[str, Any], ar: Mapping[str, Any]) -> list[str]:
    got, want = ar["decode_tok_s"], pred["ar_tok_s"]
    reasons = [f"measured {got:.2f} tok/s is {abs(got / want - 1):.0%} {'below' if got < want else 'above'} the "
               f"predicted {want:.2f} tok/s (one target step {pred['breakdown_ms']['ar_per_token']:.1f} ms)"]
    window = ar.get("decode_window")
    if window:
        reasons.append(f"measured step {window['round_ms']:.1f} ms = target forward {window['target_forward_ms']:.1f}"
                       f" + other {window['other_ms']:.1f} (the context grows during decoding; the direct forward "
                       "ran at the prompt's length; machine load)")
    return reasons


def _explain_sd_gap(pred: Mapping[str, Any], sd: Mapping[str, Any], K: int) -> list[str]:
    """Why transformers' assisted generation differs from the SD prediction (round time and tokens per round)."""
    got = sd["decode_tok_s"]
    want = pred["sd_tok_s"]
    reasons = [f"measured {got:.2f} tok/s is {abs(got / want - 1):.0%} {'below' if got < want else 'above'} the "
               f"predicted {want:.2f} tok/s"]
    window = sd.get("decode_window")
    if not window:
        return reasons
    br = pred["breakdown_ms"]["sd_round"]
    reasons.append(f"measured round {window['round_ms']:.1f} ms = target verify {window['target_forward_ms']:.1f} + "
                   f"draft {window['draft_ms']:.1f} ({window['draft_forwards_per_round']:.1f} forwards) + other "
                   f"{window['other_ms']:.1f}; predicted {br['total']:.1f} ms = verify {br['verify']:.1f} + {K} draft "
                   f"steps {br['draft']:.1f}")
    accepted = window["tokens_per_round"]
    if accepted < 0.95 * pred["E_sd"]:
        reasons.append(f"SD emitted {accepted:.2f} tokens per round vs {pred['E_sd']:.2f} predicted from SSD's "
                       "acceptance")
    if window["target_forward_ms"] > 1.1 * br["verify"]:
        reasons.append(f"verification took {window['target_forward_ms']:.1f} ms vs {br['verify']:.1f} measured "
                       "directly (longer context as the answer grows, or machine load)")
    if window["draft_ms"] > 1.1 * br["draft"]:
        reasons.append(f"drafting took {window['draft_ms']:.1f} ms vs {br['draft']:.1f} predicted (transformers "
                       "runs the assistant through generate() each round)")
    if window["other_ms"] > 0.05 * window["round_ms"]:
        reasons.append(f"{window['other_ms']:.1f} ms per round outside the forwards (assisted-generation loop: "
                       "assistant generate() setup, logits processing, cache cropping, Python)")
    return reasons


def h100_predictions(summary: Mapping[str, Mapping[str, Any]], methods: Sequence[MethodSpec],
                     settings: BenchSettings) -> dict[str, Any]:
    """`predict_h100` with this run's pooled statistics (all datasets), per published setting: a PREDICTION."""
    from ..speed_settings import predict_h100

    ssd_spec = next((m for m in methods if m.kind in ("ssd", "ssd-sync")), None)
    if ssd_spec is None:
        return {}
    ssd = summary[ALL][ssd_spec.key]["ssd"]
    if not ssd["rounds"]:
        return {}
    stats = statistics_for_model(ssd)
    backup = _backup_kind(ssd.get("backup") or "draft")
    return {name: predict_h100(stats, settings.lookahead, settings.budget, name, backup)
            for name in settings.h100_settings}




# Measured by `benchmarks/overlap.py --workload model` on 2-core CPUs: two threads running small forwards reach 1.66
# of an ideal 2.0 (each side slowed by the GIL), two processes 1.90.
OVERLAP_EFFICIENCY = {"thread": 0.83, "process": 0.95, "stream": 1.0}


def predict_from_runs(latencies: Mapping[str, Any], metrics: Sequence[Mapping[str, Any]], lookahead: int,
                      budget: int, executor: str) -> dict[str, Any]:
    """The speed model's AR / SD / SSD tok/s from directly measured forwards (`measure_latencies`) and the
    acceptance and hit statistics of SSD runs (`SSDMetrics.to_dict()` each), for an executor's overlap."""
    from ..speed_model import predict
    from .aggregate import aggregate_ssd_metrics

    pooled = aggregate_ssd_metrics(metrics)
    lat = latencies_for_model(latencies, OVERLAP_EFFICIENCY.get(executor, 1.0))
    backup = _backup_kind(pooled.get("backup") or "draft")
    return predict(lat, statistics_for_model(pooled), lookahead, budget, backup,
                   label=f"CPU, forwards measured directly, {executor} overlap {lat.overlap_efficiency}")
