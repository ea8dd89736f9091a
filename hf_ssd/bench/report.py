"""The Markdown report."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .common import ALL

# --- Markdown ----------------------------------------------------------------------------------------------------


def _fmt(value: Any, spec: str = ".2f", missing: str = "–") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return missing
    return format(value, spec)


def _pct(value: Any) -> str:
    return _fmt(None if value is None else 100 * value, ".0f") + ("%" if value is not None else "")


def comparison_table(results: Mapping[str, Any], framing: str) -> str:
    """The per-dataset Markdown table of one framing."""
    rows = results["comparisons"][framing]
    greedy = results.get("greedy", True)
    any_row = next(iter(rows.values()))
    has_sync = any_row.get("ssd-sync_method") is not None
    has_default = any_row.get("sd-default_method") is not None
    swept = "sd_k" in any_row
    head = ["dataset", "AR tok/s", "SD best fixed K tok/s (K)" if swept else "SD tok/s", "SSD tok/s", "SSD/SD",
            "SSD/AR", "SD/AR", "identical SD / SSD", "SSD hit rate", "acc. len SD / SSD", "SSD target wait"]
    if has_sync:
        head.insert(4, "SSD-sync tok/s")
    if has_default:
        head[3:3] = ["SD default tok/s"]
        head.insert(head.index("SSD/AR"), "SSD/SD default")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for dataset, row in rows.items():
        same = (f"{_pct(row.get('sd_identical'))} / {_pct(row.get('ssd_identical'))}" if greedy
                else "n/a (sampling)")
        sd = _fmt(row.get("sd_tok_s")) + (f" ({row['sd_k']})" if row.get("sd_k") else "")
        cells = [f"**{dataset}**" if dataset == ALL else dataset, _fmt(row.get("ar_tok_s")), sd,
                 _fmt(row.get("ssd_tok_s")), _fmt(row.get("ssd_over_sd"), ".2f") + "×" * bool(row.get("ssd_over_sd")),
                 _fmt(row.get("ssd_over_ar")) + "×" * bool(row.get("ssd_over_ar")),
                 _fmt(row.get("sd_over_ar")) + "×" * bool(row.get("sd_over_ar")), same,
                 _fmt(row.get("ssd_hit_rate")),
                 f"{_fmt(row.get('sd_accepted_length'))} / {_fmt(row.get('ssd_accepted_length'))}",
                 _pct(row.get("ssd_target_wait_share"))]
        if has_sync:
            cells.insert(4, _fmt(row.get("ssd_sync_tok_s")))
        if has_default:
            cells[3:3] = [_fmt(row.get("sd_default_tok_s"))]
            cells.insert(head.index("SSD/SD default"), _fmt(row.get("ssd_over_sd_default")) + "×" * bool(
                row.get("ssd_over_sd_default")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def method_table(results: Mapping[str, Any]) -> str:
    """Every method on all datasets: totals with spread, ms/token, exactness."""
    summary = results["summary"][ALL]
    repeats = results["settings"]["repeats"]
    spread_name = "repeats" if repeats > 1 else "prompts"
    lines = [f"| method | threads | decode tok/s [min–max over {spread_name}] | e2e tok/s | decode ms/token "
             "| 1st emission s (mean) | identical | first divergence (min) | acc. len | hit rate |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    labels = {m["key"]: m["thread_label"] for m in results["methods"]}
    for key, s in summary.items():
        spread = s["decode_tok_s_repeat_spread"] if repeats > 1 else s["decode_tok_s_prompt_spread"]
        acc = (s.get("ssd") or {}).get("mean_accepted_length") or (s.get("rounds_from_streamer") or {}).get(
            "mean_accepted_length")
        same = _pct(s["identical_share"]) if results.get("greedy", True) else "n/a"
        lines.append(
            f"| {key} | {labels.get(key, '')} | {_fmt(s['decode_tok_s'])} "
            f"[{_fmt(spread['min'])}–{_fmt(spread['max'])}] | {_fmt(s['e2e_tok_s'])} "
            f"| {_fmt(s['decode_ms_per_token'], '.0f')} "
            f"| {_fmt(s['first_emission_seconds_mean'])} | {same} "
            f"| {_fmt(s['first_divergence_min'], 'd') if results.get('greedy', True) else 'n/a'} "
            f"| {_fmt(acc)} | {_fmt((s.get('ssd') or {}).get('cache_hit_rate'))} |"
        )
    return "\n".join(lines)


def prompt_table(results: Mapping[str, Any]) -> str:
    """Per prompt (first repeat): decode tok/s of every method, and SSD's exactness / hit rate."""
    keys = [m["key"] for m in results["methods"]]
    ssd_key = next((m["key"] for m in results["methods"] if m["kind"] == "ssd"), None)
    lines = ["| dataset | # | prompt tok | new tok | " + " | ".join(keys) + " | SSD identical (diverges at) "
             "| SSD hit rate |", "|" + "---|" * (len(keys) + 6)]
    runs = [r for r in results["runs"] if r["repeat"] == 0]
    prompts = list(dict.fromkeys((r["dataset"], r["prompt_index"]) for r in runs))
    for dataset, index in prompts:
        mine = {r["method"]: r for r in runs if r["dataset"] == dataset and r["prompt_index"] == index}
        ref = mine.get(results.get("exactness_reference")) or next(iter(mine.values()))
        ssd = mine.get(ssd_key) if ssd_key else None
        same = "–"
        if ssd is not None and results.get("greedy", True):
            same = "yes" if ssd["identical"] else f"no ({ssd['first_divergence']})"
        hit = (ssd or {}).get("metrics") or {}
        lines.append(f"| {dataset} | {index} | {ref['prompt_tokens']} | {ref['new_tokens']} | "
                     + " | ".join(_fmt(mine[k]["decode_tok_s"]) if k in mine else "–" for k in keys)
                     + f" | {same} | {_fmt(hit.get('cache_hit_rate'))} |")
    return "\n".join(lines)


def window_table(results: Mapping[str, Any]) -> str:
    """Per-round time after the first emission (all datasets), from forward hooks on target and draft."""
    lines = ["| method | rounds | tokens / round | round ms | target forward ms | draft ms (forwards) | other ms "
             "| SSD target wait ms |", "|---|---|---|---|---|---|---|---|"]
    for key, s in results["summary"][ALL].items():
        w = s.get("decode_window")
        if not w:
            continue
        ssd = s.get("ssd_decode_window")
        wait = 1e3 * ssd["target_wait_seconds"] / ssd["rounds"] if ssd and ssd["rounds"] else None
        # SSD drafts concurrently: its "other" is the round minus the target's forward and its wait for the draft.
        other = w["round_ms"] - w["target_forward_ms"] - wait if wait is not None else w["other_ms"]
        lines.append(f"| {key} | {w['rounds']} | {_fmt(w['tokens_per_round'])} | {_fmt(w['round_ms'], '.1f')} "
                     f"| {_fmt(w['target_forward_ms'], '.1f')} | {_fmt(w['draft_ms'], '.1f')} "
                     f"({_fmt(w['draft_forwards_per_round'], '.1f')}) | {_fmt(other, '.1f')} "
                     f"| {_fmt(wait, '.1f')} |")
    lines.append("\nSD: round = target forward + draft + other (serial). SSD: the draft runs concurrently on its own "
                 "thread or process (its forwards from the hooks or, in a worker process, from its metrics); round = "
                 "target forward + target wait + other. AR: one target forward per token.")
    return "\n".join(lines)


def critical_path_lines(results: Mapping[str, Any]) -> list[str]:
    """Per side, where an SSD decode round goes (all datasets), from the runs' `SSDMetrics`."""
    from .critical_path import critical_path_table

    paths = {key: s.get("critical_path") for key, s in results["summary"][ALL].items() if s.get("critical_path")}
    table = critical_path_table({f"{key} ({', '.join(p['executor'])})": p for key, p in paths.items()})
    budgets = [f"{key}: " + ", ".join(f"B={b} {n}" for b, n in by.items())
               for key, s in results["summary"][ALL].items()
               if (by := (s.get("ssd") or {}).get("rounds_by_fanout_budget"))]
    lines = [table, "", "ms per decode round (first round, with the prefills, left out). Target phases add up to "
             "the round; the draft's forwards and its own Python run concurrently with them."] if table else []
    if budgets:
        lines += ["", "Rounds by the fan-out budget the draft prepared beside them: " + "; ".join(budgets) + "."]
    return lines


def gap_lines(results: Mapping[str, Any]) -> list[str]:
    """`explain_gap` (SSD) and the SD / AR equivalents, wherever measured and predicted differ by more than 10%."""
    return [f"- {dataset} {row['method']}: " + "; ".join(row["gap"])
            for dataset, p in (results.get("predictions") or {}).items() for row in p["rows"] if row["gap"]]


def prediction_table(results: Mapping[str, Any]) -> str:
    preds = results.get("predictions") or {}
    if not preds:
        return ""
    lines = ["| dataset | method | predicted tok/s | measured tok/s | measured / predicted |", "|---|---|---|---|---|"]
    for dataset, p in preds.items():
        for row in p["rows"]:
            lines.append(f"| {dataset} | {row['method']} | {_fmt(row['predicted_tok_s'])} "
                         f"| {_fmt(row['measured_tok_s'])} | {_fmt(row['measured_over_predicted'])} |")
    return "\n".join(lines)


def latency_lines(results: Mapping[str, Any]) -> list[str]:
    lines = []
    for threads, lat in (results.get("latencies_ms") or {}).items():
        parts = [f"target 1 tok {lat['target_step_ms']:.1f}",
                 *(f"target {int(k) + 1} tok {v:.1f}" for k, v in lat["target_verify_ms"].items())]
        if "draft_step_ms" in lat:
            parts += [f"draft 1 tok {lat['draft_step_ms']:.1f}",
                      *(f"draft {k} tok {v:.1f}" for k, v in lat["draft_forward_ms"].items()),
                      *(f"draft round (glue + K tree steps, B={k}) {v:.1f}"
                        for k, v in (lat.get("draft_round_ms") or {}).items()),
                      *(f"tree step B={k} {v:.1f}" for k, v in (lat.get("draft_tree_ms") or {}).items())]
        lines.append(f"- {threads} thread(s), context {lat['context_tokens']} tokens: " + ", ".join(parts) + " ms")
    return lines


def h100_lines(results: Mapping[str, Any]) -> list[str]:
    lines = []
    for name, pred in (results.get("h100_prediction") or {}).items():
        pub = pred.get("published", {})
        lines.append(f"- PREDICTION, {pred['label']}: AR {pred['ar_tok_s']:.1f}, SD {pred['sd_tok_s']:.1f}, "
                     f"SSD {pred['ssd_tok_s']:.1f} tok/s (SSD/SD {pred['ssd_over_sd']:.2f}×, SSD/AR "
                     f"{pred['ssd_over_ar']:.2f}×); published measurements for reference: AR {pub.get('ar_tok_s')}, "
                     f"SD {pub.get('sd_tok_s')}, SSD {pub.get('ssd_tok_s')} [{name}]")
    return lines


def render_markdown(results: Mapping[str, Any]) -> str:
    """results.md: configuration, one table per framing, every method, per prompt, predicted vs measured."""
    s = results["settings"]
    env = results["environment"]
    models = results.get("models", {})
    load = results.get("load_average", {})
    during = load.get("during_runs_1min") or {}
    mode = "greedy" if results.get("greedy", True) else f"sampling, temperature {s['temperature']}"
    out = [
        "# hf-ssd bench",
        "",
        f"- created {results['created']}; wall {results.get('wall_seconds', 0):.0f} s",
        f"- target: {_model_text(models.get('target'))}; draft: {_model_text(models.get('draft'))}",
        f"- {mode}; K={s['lookahead']} ({s.get('lookahead_schedule', 'adaptive')}), B={s['budget']} "
        f"({s['fanout']} fan-out, {s.get('fanout_budget_schedule', 'constant')} budget, backup {s['backup']}"
        f"{'' if s.get('draft_confidence', False) else ', no draft confidence'}"
        f"{', serial speculations up to ' + str(s['max_serial_lookahead']) if 'max_serial_lookahead' in s else ''}); "
        f"max_new_tokens={s['max_new_tokens']}; repeats={s['repeats']}; seed {s['seed']}",
        "- prompts: " + ", ".join(f"{k} ({v['prompts']}, {v['source']})" for k, v in results["datasets"].items()),
        f"- {env['cpu_model']}, {env['available_cores']} cores; torch {env['torch']}, transformers "
        f"{env['transformers']}, hf_ssd {env['hf_ssd']}; OMP_WAIT_POLICY={env['omp_wait_policy']}, "
        f"GOMP_SPINCOUNT={env.get('gomp_spincount')}",
        f"- load average (1 min) before {_fmt((load.get('before') or [None])[0])}, after "
        f"{_fmt((load.get('after') or [None])[0])}, during runs {_fmt(during.get('min'))}–{_fmt(during.get('max'))} "
        "(shared machine: compare within this run only)",
        f"- timing: {results['decode_timing']}",
        f"- exactness: {results['exactness_note']} (reference {results['exactness_reference']})",
        "",
    ]
    for framing, info in results["framings"].items():
        out += [f"## {framing}: {info['description']}", "", comparison_table(results, framing), ""]
    out += ["## Every method (all datasets)", "", method_table(results), "",
            "## Where the time goes: per round after the first emission (forward hooks)", "", window_table(results),
            "", "## SSD's critical path, per side", "", *critical_path_lines(results), "",
            "## Per prompt (decode tok/s, first repeat)", "", prompt_table(results), ""]
    table = prediction_table(results)
    if table:
        out += ["## Predicted (speed model) vs measured decode tok/s", "",
                "Measured latencies (ms, medians of direct forwards):", "", *latency_lines(results), "", table, ""]
        gaps = gap_lines(results)
        if gaps:
            out += ["Where measured and predicted differ by more than 10%:", "", *gaps]
        out.append("")
    h100 = h100_lines(results)
    if h100:
        out += ["## H100 (PREDICTION, not a measurement)", "", *h100, ""]
    if results.get("latencies_error"):
        out += [f"Latency measurement failed: {results['latencies_error']}", ""]
    if results.get("plots"):
        out += ["## Plots", "", *[f"![{p}]({p})" for p in results["plots"]], ""]
    return "\n".join(out)


def _model_text(info: Mapping[str, Any] | None) -> str:
    if not info:
        return "?"
    from ..precision import describe_decision

    speedup = info.get("packing_speedup") or {}  # where "auto" decided it: on what
    precision = describe_decision(info.get("precision"), {int(r): v for r, v in speedup.items()}, info.get("pad_rows"))
    return f"{info.get('name')} ({info.get('params', 0) / 1e6:.0f}M params, {precision})"


