"""Aggregation of per-call records into per-dataset and pooled figures."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from .common import ALL, METHOD_KINDS, _ratio, _spread
from .measure import MethodSpec, RunRecord

# --- aggregation -------------------------------------------------------------------------------------------------






def aggregate_acceptance(metrics_list: Sequence[Mapping[str, Any]]) -> list[float]:
    """Pooled per-position conditional acceptance: each run's rounds reaching position i are rounds·Π_{j<i} a_j."""
    width = max((len(m.get("per_position_acceptance") or []) for m in metrics_list), default=0)
    reached, passed = [0.0] * width, [0.0] * width
    for m in metrics_list:
        survive = float(m.get("rounds") or 0)
        for i, a in enumerate(m.get("per_position_acceptance") or []):
            reached[i] += survive
            passed[i] += survive * a
            survive *= a
    return [p / r if r else 0.0 for p, r in zip(passed, reached)]


def fit_power_law(hits_by_fanout: Mapping[Any, Sequence[int]], min_count: int = 1) -> dict[str, float] | None:
    """Fit miss(F) = m·F^(−r) by lookup-weighted least squares of log miss on log F (F >= 1, 0 < miss < 1)."""
    xs, ys, ws = [], [], []
    for f, (hits, n) in hits_by_fanout.items():
        f = int(f)
        if f >= 1 and n >= min_count and 0 < hits < n:
            xs.append(math.log(f))
            ys.append(math.log(1 - hits / n))
            ws.append(float(n))
    from ..generation.fanout import weighted_line_fit

    line = weighted_line_fit(xs, ys, ws)
    if line is None:
        return None
    slope, intercept = line
    return {"r": -slope, "m": math.exp(intercept), "points": len(xs)}


def rounds_by_lookahead(metrics_list: Sequence[Mapping[str, Any]]) -> dict[str, list[float]]:
    """Decode rounds (the first, with the prefills, left out) by the K the lookahead policy verified:
    {K: [rounds with the draft paused, rounds with it working beside the verification, tokens per row they
    brought, mean target forward ms of the paused rounds]} (a plain step, K = 0, has the draft working on its first
    steps and probes; the tokens are None when the runs did not record them, the forward ms when no paused round
    timed one). A paused round's forward ran on every core with nothing beside it, at the context the prompt had
    reached: what the speed model takes for those rounds (`predict.adaptive_prediction`)."""
    mix: dict[int, list] = {}
    for m in metrics_list:
        for entry in (m.get("lookahead_decisions") or [])[1:]:
            counts = mix.setdefault(int(entry["k"]), [0, 0, 0.0, 0.0, 0])
            paused = entry.get("depth", 1) == 0
            counts[int(not paused)] += 1
            tokens = entry.get("tokens")
            counts[2] = None if tokens is None or counts[2] is None else counts[2] + tokens
            if paused and entry.get("forward_ms") is not None:
                counts[3] += entry["forward_ms"]
                counts[4] += 1
    return {str(k): [*mix[k][:3], mix[k][3] / mix[k][4] if mix[k][4] else None] for k in sorted(mix)}


def rounds_by_budget(metrics_list: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Rounds the draft prepared beside by the fan-out budget they used (`fanout_budget_schedule="adaptive"`)."""
    counts: dict[int, int] = {}
    for m in metrics_list:
        for budget in m.get("fanout_budget_per_round") or []:
            if budget:
                counts[int(budget)] = counts.get(int(budget), 0) + 1
    return {str(b): counts[b] for b in sorted(counts, reverse=True)}


def aggregate_ssd_metrics(metrics_list: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Pool `SSDMetrics.to_dict()`s of several runs (sums; rates as total / total)."""
    def total(key: str) -> float:
        return float(sum(m.get(key) or 0 for m in metrics_list))

    rounds, hits, lookups = total("rounds"), total("cache_hits"), total("cache_lookups")
    hit_rounds = hits  # every hit's speculation is verified next round
    miss_rounds = rounds - hit_rounds
    hits_by_f: dict[str, list[int]] = {}
    for m in metrics_list:
        for f, (h, n) in (m.get("hits_by_fanout") or {}).items():
            bucket = hits_by_f.setdefault(str(f), [0, 0])
            bucket[0] += int(h)
            bucket[1] += int(n)
    hits_by_f = dict(sorted(hits_by_f.items(), key=lambda kv: int(kv[0])))
    hits_by_k: list[list[int]] = []
    for m in metrics_list:
        for k, (h, n) in enumerate(m.get("hits_by_position") or []):
            while len(hits_by_k) <= k:
                hits_by_k.append([0, 0])
            hits_by_k[k][0] += int(h)
            hits_by_k[k][1] += int(n)
    generated = total("generated_tokens")
    wall, wait = total("wall_seconds"), total("target_wait_seconds")
    return {
        "runs": len(metrics_list),
        "rounds": rounds,
        "generated_tokens": generated,
        "cache_lookups": lookups,
        "cache_hits": hits,
        "cache_hit_rate": _ratio(hits, lookups) or 0.0,
        "mean_accepted_length": _ratio(sum((m.get("mean_accepted_length") or 0) * (m.get("rounds") or 0)
                                           for m in metrics_list), rounds) or 0.0,
        "per_position_acceptance": aggregate_acceptance(metrics_list),
        "draft_acceptance_rate": _ratio(sum((m.get("draft_acceptance_rate") or 0) * (m.get("rounds") or 0)
                                            for m in metrics_list), rounds) or 0.0,
        "tokens_per_round_hit": _ratio(sum((m.get("tokens_per_round_hit") or 0) * (m.get("cache_hits") or 0)
                                           for m in metrics_list), hit_rounds) or 0.0,
        "tokens_per_round_miss": _ratio(sum((m.get("tokens_per_round_miss") or 0)
                                            * ((m.get("rounds") or 0) - (m.get("cache_hits") or 0))
                                            for m in metrics_list), miss_rounds) or 0.0,
        "verify_seconds": total("verify_seconds"),
        "draft_seconds": total("draft_seconds"),
        "target_wait_seconds": wait,
        "wall_seconds": wall,
        "target_wait_share": _ratio(wait, wall) or 0.0,
        "target_wait_ms_per_token": 1e3 * (_ratio(wait, generated) or 0.0),
        "hits_by_fanout": hits_by_f,
        "hits_by_position": hits_by_k,
        "power_law_fit": fit_power_law(hits_by_f),
        "power_law_estimate_mean": _ratio(total("power_law_estimate"), len(metrics_list)) if metrics_list else None,
        "backup": next((m.get("backup") for m in metrics_list if m.get("backup")), ""),
        "executor": next((m.get("executor") for m in metrics_list if m.get("executor")), ""),
        "draft_threads": next((m.get("draft_threads") for m in metrics_list), None),
        "target_threads": next((m.get("target_threads") for m in metrics_list), None),
        "fanout_schedule_last": next((m.get("fanout_schedule") for m in reversed(metrics_list)), None),
        "rounds_by_lookahead": rounds_by_lookahead(metrics_list),
        "rounds_by_fanout_budget": rounds_by_budget(metrics_list),
        **measured_round_costs(metrics_list),
    }


def measured_round_costs(metrics_list: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """What the lookahead policy measured of its rounds (the last estimate of each run, averaged over runs): the
    draft's cost per token drafted just in time after a verification it sat out (`serial_draft_ms_per_token`: a
    draft step plus the drafter's own work per token after the first; `serial_draft_ms_fixed`: the first token with
    the forward feeding the committed tokens and the bookkeeping), the loop's overhead per round
    (`round_overhead_ms`) and the draft's round beside a verification (`draft_round_ms`: glue and tree, as the
    drafter timed its prepares); None where no run measured it."""
    def last(m, key):
        return next((d[key] for d in reversed(m.get("lookahead_decisions") or []) if d.get(key)), None)

    out = {}
    names = {"serial_draft_ms_per_token": "serial_draft_ms_per_token",
             "serial_draft_ms_fixed": "serial_draft_ms_fixed", "overhead_ms": "round_overhead_ms",
             "draft_ms": "draft_round_ms"}
    for key, name in names.items():
        values = [v for v in (last(m, key) for m in metrics_list) if v is not None]
        out[name] = sum(values) / len(values) if values else None
    return out


def round_statistics(records: Sequence[RunRecord]) -> dict[str, Any]:
    """Per-round emitted tokens (accepted + bonus) from the streamer; each generation's last round is left out
    (max_new_tokens or EOS may cut it short)."""
    sizes = [s for r in records for s in r.round_sizes[:-1]]
    hist: dict[str, int] = {}
    for s in sizes:
        hist[str(s)] = hist.get(str(s), 0) + 1
    return {"rounds": len(sizes), "mean_accepted_length": _ratio(sum(sizes), len(sizes)),
            "histogram": dict(sorted(hist.items(), key=lambda kv: int(kv[0])))}


def summarise_method(records: Sequence[RunRecord], kind: str) -> dict[str, Any]:
    """Totals (tokens / time) over `records` of one method, their spread over repeats and prompts, exactness."""
    decode_tokens = sum(r.decode_tokens for r in records)
    decode_s = sum(r.decode_s for r in records)
    new_tokens = sum(r.new_tokens for r in records)
    e2e_s = sum(r.e2e_s for r in records)
    by_repeat: dict[int, list[RunRecord]] = {}
    for r in records:
        by_repeat.setdefault(r.repeat, []).append(r)
    repeat_decode = [_ratio(sum(r.decode_tokens for r in rs), sum(r.decode_s for r in rs))
                     for _, rs in sorted(by_repeat.items())]
    repeat_e2e = [_ratio(sum(r.new_tokens for r in rs), sum(r.e2e_s for r in rs))
                  for _, rs in sorted(by_repeat.items())]
    prompt_decode = [_ratio(r.decode_tokens, r.decode_s) for r in records]
    compared = [r for r in records if r.identical is not None]
    divergences = [r.first_divergence for r in compared if r.first_divergence is not None]
    decode_tok_s = _ratio(decode_tokens, decode_s)
    out: dict[str, Any] = {
        "kind": kind,
        "runs": len(records),
        "new_tokens": new_tokens,
        "decode_tokens": decode_tokens,
        "decode_seconds": decode_s,
        "e2e_seconds": e2e_s,
        "decode_tok_s": decode_tok_s,
        "e2e_tok_s": _ratio(new_tokens, e2e_s),
        "decode_ms_per_token": 1e3 / decode_tok_s if decode_tok_s else None,
        "e2e_ms_per_token": 1e3 * e2e_s / new_tokens if new_tokens else None,
        "first_emission_seconds_mean": _ratio(sum(r.first_s for r in records), len(records)),
        "decode_tok_s_by_repeat": repeat_decode,
        "decode_tok_s_repeat_spread": _spread(repeat_decode),
        "e2e_tok_s_by_repeat": repeat_e2e,
        "e2e_tok_s_repeat_spread": _spread(repeat_e2e),
        "decode_tok_s_prompt_spread": _spread(prompt_decode),
        "compared": len(compared),
        "identical_share": _ratio(sum(bool(r.identical) for r in compared), len(compared)),
        "first_divergence": [r.first_divergence for r in compared],
        "first_divergence_min": min(divergences) if divergences else None,
        "rounds_from_streamer": round_statistics(records) if kind != "ar" else None,
    }
    out["decode_window"] = decode_window(records)
    if kind in ("ssd", "ssd-sync"):
        from .critical_path import critical_path

        out["ssd"] = aggregate_ssd_metrics([r.metrics for r in records if r.metrics])
        out["ssd_decode_window"] = ssd_decode_window(records, out["ssd"])
        out["critical_path"] = critical_path([r.metrics for r in records if r.metrics])
    return out


def decode_window(records: Sequence[RunRecord]) -> dict[str, Any] | None:
    """Per-round breakdown after the first emission, from the forward hooks: one target forward per round (an AR
    step, or a verification for SD/SSD). Draft time is serial for SD, concurrent (its own thread or process) for
    SSD."""
    timed = [r for r in records if r.timing]
    rounds = sum(max(r.timing["target_forwards"] - 1, 0) for r in timed)
    if not rounds:
        return None
    wall = sum(r.decode_s for r in timed)
    target = sum(r.timing["target_decode_s"] for r in timed)
    draft = sum(_draft_decode_seconds(r) for r in timed)
    return {
        "rounds": rounds,
        "tokens_per_round": sum(r.decode_tokens for r in timed) / rounds,
        "round_ms": 1e3 * wall / rounds,
        "target_forward_ms": 1e3 * target / rounds,
        "draft_ms": 1e3 * draft / rounds,
        "draft_forwards_per_round": sum(r.timing["draft_decode_forwards"] for r in timed) / rounds,
        "other_ms": 1e3 * (wall - target - draft) / rounds,
        "prefill_target_forward_ms": 1e3 * sum(r.timing["target_first_s"] for r in timed) / len(timed),
    }


def _draft_decode_seconds(record: RunRecord) -> float:
    """The draft's forward time after the first target forward: from the hooks, or, when the draft ran in a worker
    process the hooks cannot see, from the run's own metrics (its model calls after the prefill)."""
    phases = (record.metrics or {}).get("draft_phase_seconds") or {}
    if record.timing["draft_forwards"] == 0 and phases:
        return sum(v for k, v in phases.items() if k.endswith("_forward") and k != "prefill_forward")
    return record.timing["draft_decode_s"]


def ssd_decode_window(records: Sequence[RunRecord], pooled: Mapping[str, Any]) -> dict[str, Any]:
    """SSDMetrics-like totals without the first round (prefills), for `speed_model.explain_gap`.

    The first round's verification is the first target forward (hooks); its target wait is the draft's prefill
    and first speculation, i.e. first emission − first target forward. Both are subtracted (approximately: the
    per-round bookkeeping of the first round stays in).
    """
    timed = [r for r in records if r.metrics and r.timing]
    first_wait = sum(max(r.first_s - r.timing["target_first_s"], 0.0) for r in timed)
    rounds = sum(r.metrics["rounds"] - 1 for r in timed)
    return {
        "rounds": rounds,
        "generated_tokens": sum(r.decode_tokens for r in timed),
        "wall_seconds": sum(r.decode_s for r in timed),
        "verify_seconds": sum(r.metrics["verify_seconds"] - r.timing["target_first_s"] for r in timed),
        "target_wait_seconds": max(sum(r.metrics["target_wait_seconds"] for r in timed) - first_wait, 0.0),
        "cache_lookups": pooled.get("cache_lookups"),
        "cache_hit_rate": pooled.get("cache_hit_rate"),
        "mean_accepted_length": _ratio(sum(r.decode_tokens for r in timed), rounds),
    }


def summarise(records: Sequence[RunRecord], methods: Sequence[MethodSpec], datasets: Sequence[str]) -> dict:
    """summary[dataset or "all"][method key] = `summarise_method(...)`."""
    summary: dict[str, dict[str, Any]] = {}
    for dataset in [*datasets, ALL]:
        chosen = [r for r in records if dataset == ALL or r.dataset == dataset]
        summary[dataset] = {m.key: summarise_method([r for r in chosen if r.method == m.key], m.kind) for m in methods}
    return summary


def comparisons(summary: Mapping[str, Mapping[str, Any]], roles: Mapping[str, Mapping[str, Any]]) -> dict:
    """Per framing and dataset: AR / SD / SD-default / SSD decode tok/s, their ratios, exactness, hit rate,
    accepted lengths. Where SD ran at several fixed K (role ``sd_fixed``), "sd" is the best of them on that set
    (``sd_k`` says which)."""
    out: dict[str, dict[str, Any]] = {}
    for framing, role in roles.items():
        out[framing] = {}
        for dataset, by_method in summary.items():
            row: dict[str, Any] = {f"{k}_method": v for k, v in role.items()}
            sweep = [k for k in role.get("sd_fixed") or [] if (by_method.get(k) or {}).get("decode_tok_s")]
            if sweep:
                best = max(sweep, key=lambda k: by_method[k]["decode_tok_s"])
                row["sd_method"], row["sd_k"] = best, _sd_k(best)
                row["sd_tok_s_by_k"] = {str(_sd_k(k)): by_method[k]["decode_tok_s"] for k in sweep}
            for kind in METHOD_KINDS:
                key = row.get("sd_method") if kind == "sd" else role.get(kind)
                s = by_method.get(key) if key else None
                name = kind.replace("-", "_")
                row[f"{name}_tok_s"] = s["decode_tok_s"] if s else None
                row[f"{name}_e2e_tok_s"] = s["e2e_tok_s"] if s else None
                row[f"{name}_identical"] = s["identical_share"] if s else None
                if s and s.get("ssd"):
                    row[f"{name}_hit_rate"] = s["ssd"]["cache_hit_rate"]
                    row[f"{name}_accepted_length"] = s["ssd"]["mean_accepted_length"]
                    row[f"{name}_target_wait_share"] = s["ssd"]["target_wait_share"]
                elif s and s.get("rounds_from_streamer"):
                    row[f"{name}_accepted_length"] = s["rounds_from_streamer"]["mean_accepted_length"]
            ar, sd, ssd = row.get("ar_tok_s"), row.get("sd_tok_s"), row.get("ssd_tok_s")
            row["ssd_over_sd"] = _ratio(ssd, sd) if ssd and sd else None
            row["ssd_over_ar"] = _ratio(ssd, ar) if ssd and ar else None
            row["sd_over_ar"] = _ratio(sd, ar) if sd and ar else None
            sd_default = row.get("sd_default_tok_s")
            row["ssd_over_sd_default"] = _ratio(ssd, sd_default) if ssd and sd_default else None
            out[framing][dataset] = row
    return out


def _sd_k(key: str) -> int | None:
    """The fixed K of an SD method key ``sd-k<K>@<threads>``."""
    head = key.split("@")[0]
    return int(head[4:]) if head.startswith("sd-k") else None


