"""`hf-ssd predict`: the speed model's predictions from latencies and statistics given on the command line."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from .speed_model import FAST_BACKUPS, Latencies, Statistics, explain_gap, predict
from .speed_settings import CPU_QWEN_INT8, H100_PUBLISHED, predict_h100


def _parse_table(text: str) -> dict[int, float]:
    """'4:238,8:317' → {4: 238.0, 8: 317.0}."""
    table = {}
    for item in text.split(","):
        key, _, value = item.partition(":")
        if not value:
            raise argparse.ArgumentTypeError(f"expected KEY:MS pairs like 4:238,8:317, got {text!r}")
        table[int(key)] = float(value)
    return table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `hf-ssd predict`."""
    lat = parser.add_argument_group("latencies (ms; default: speed_settings.CPU_QWEN_INT8, measured on a 2-core CPU)")
    lat.add_argument("--target-step-ms", type=float, help="one AR target forward (1 token)")
    lat.add_argument("--target-verify-ms", type=_parse_table, help="verification by K draft tokens, e.g. 4:238,8:317")
    lat.add_argument("--draft-step-ms", type=float, help="one single-token draft forward")
    lat.add_argument("--draft-forward-ms", type=_parse_table, help="draft forward by token count, e.g. 5:116")
    lat.add_argument("--draft-tree-ms", type=_parse_table, help="tree step by branches, e.g. 8:110,16:165,24:237")
    lat.add_argument("--backup-ms", type=float, help="fast backup cost per miss")
    lat.add_argument("--ar-ms", type=float, help="measured plain decoding ms/token (default: target step)")
    lat.add_argument("--overlap-efficiency", type=float, help="concurrent draft/target efficiency (CPU ~0.9)")
    lat.add_argument("--overhead-ms", type=float, help="per-round overhead outside the forwards")
    st = parser.add_argument_group("statistics")
    st.add_argument("--acceptance", type=float, nargs="+",
                    help="per-token acceptance, or a per-position conditional profile (default 0.85 0.69)")
    st.add_argument("--p-hit", type=float, help="cache hit rate (default 0.86)")
    st.add_argument("--e-hit", type=float, help="measured tokens per round after a hit")
    st.add_argument("--e-miss", type=float, help="measured tokens per round after a miss")
    st.add_argument("--backup-acceptance", type=float, help="acceptance of a fast backup's tokens")
    parser.add_argument("--lookahead", "-K", type=int, help="K (default 1, or the JSON's lookahead)")
    parser.add_argument("--budget", "-B", type=int, help="fan-out budget / tree branches (default 8)")
    parser.add_argument("--backup", choices=["draft", *FAST_BACKUPS], help="backup on a miss (default draft)")
    parser.add_argument("--from-json", help="SSDMetrics dict, bench_core.py results, or {'latencies','statistics'}")
    parser.add_argument("--method", help="with bench_core.py results: the SSD method row (default: first ssd-thread)")
    parser.add_argument("--measured-tok-s", type=float, help="measured SSD tok/s, to explain the gap")
    parser.add_argument("--h100", default="llama-70b", choices=[*H100_PUBLISHED, "none"],
                        help="H100 setting for the labelled prediction")
    parser.add_argument("--json", action="store_true", help="print the predictions as JSON")


def _from_json(path: str, method: str | None) -> dict[str, Any]:
    """Latencies / statistics / K / B / measured figures found in a JSON file."""
    data = json.loads(Path(path).read_text())
    found: dict[str, Any] = {}
    if "methods" in data:  # benchmarks/bench_core.py output
        rows = [r for r in data["methods"] if r.get("kind") == "ssd" and (method is None or r["method"] == method)]
        if method is None:
            rows.sort(key=lambda r: r.get("executor") != "thread")
        if not rows:
            raise SystemExit(f"{path}: no SSD method row{f' named {method!r}' if method else ''}")
        row = rows[0]
        metrics = dict(row.get("metrics_median") or {})
        if row.get("metrics"):
            metrics["per_position_acceptance"] = row["metrics"][-1].get("per_position_acceptance")
            metrics.setdefault("lookahead", row["metrics"][-1].get("lookahead"))
        metrics.setdefault("lookahead", row.get("lookahead"))
        found.update(K=row.get("lookahead"), B=row.get("budget"), measured=row.get("decode_tok_s_median"))
        plain = data.get("plain_decode_tok_s")
        if plain:
            found["ar_ms"] = 1e3 / plain
        found["metrics"] = metrics
    elif "latencies" in data or "statistics" in data:
        if "latencies" in data:
            found["latencies"] = Latencies.from_dict(data["latencies"])
        if "statistics" in data:
            found["statistics"] = Statistics(**data["statistics"])
        found.update(K=data.get("K"), B=data.get("B"), backup=data.get("backup"))
    else:  # SSDMetrics.to_dict()
        found["metrics"] = data
        found.update(K=data.get("lookahead"), B=data.get("branches"), backup=data.get("backup"))
    metrics = found.get("metrics")
    if metrics:
        found["statistics"] = Statistics.from_metrics(metrics)
        if metrics.get("rounds") and metrics.get("verify_seconds"):
            found["verify_ms"] = 1e3 * metrics["verify_seconds"] / metrics["rounds"]
    return found


def _print_prediction(result: Mapping[str, Any]) -> None:
    K, B = result["K"], result["B"]
    br = result["breakdown_ms"]
    n = result["normalised"]
    print(f"{result['label']}  (K={K}, B={B}, backup={result['backup']})")
    print(f"  E_SD {result['E_sd']:.2f}, E_hit {result['E_hit']:.2f}, E_miss {result['E_miss']:.2f}, "
          f"p_hit {result['p_hit']:.2f}; v {n['v']:.3f}, T_SD {n['T_sd']:.3f}, T_p {n['T_p']:.3f}, T_b {n['T_b']:.3f}")
    print(f"  {'method':<16}{'tok/s':>10}{'x AR':>8}{'round ms':>11}")
    print(f"  {'AR':<16}{result['ar_tok_s']:>10.2f}{1.0:>8.2f}{br['ar_per_token']:>11.1f}")
    print(f"  {f'SD (K={K})':<16}{result['sd_tok_s']:>10.2f}{result['sd_over_ar']:>8.2f}"
          f"{br['sd_round']['total']:>11.1f}")
    print(f"  {f'SSD (K={K},B={B})':<16}{result['ssd_tok_s']:>10.2f}{result['ssd_over_ar']:>8.2f}"
          f"{br['ssd_mean_round']:>11.1f}")
    lo, hi = n["corollary9_ssd_over_sd"]
    note = "" if n["corollary9_preconditions"] else "; preconditions not met: the primary round (with overlap " \
        "penalty and overhead) outlasts verification, or E_miss is out of range"
    print(f"  SSD/SD {result['ssd_over_sd']:.2f} (Corollary 9 bounds [{lo:.2f}, {hi:.2f}]{note})")
    for name in ("ssd_hit_round", "ssd_miss_round"):
        r = br[name]
        print(f"  {name.replace('_', ' ')}: {r['total']:.1f} ms = backup {r['backup']:.1f} + max(verify "
              f"{r['verify']:.1f}, draft {r['draft_round']:.1f}) + overlap {r['overlap_penalty']:.1f} "
              f"+ overhead {r['overhead']:.1f}")
    if "published" in result:
        pub = result["published"]
        print(f"  published (measured by the paper, for comparison): AR {pub['ar_tok_s']}, SD {pub['sd_tok_s']}, "
              f"SSD {pub['ssd_tok_s']} tok/s")


def run_command(args: argparse.Namespace) -> int:
    """`hf-ssd predict`: print CPU (as measured) and H100 (predicted) speedups."""
    found = _from_json(args.from_json, args.method) if args.from_json else {}
    lat = found.get("latencies") or CPU_QWEN_INT8
    default_latencies = "latencies" not in found and args.target_step_ms is None and args.draft_step_ms is None
    K = args.lookahead or found.get("K") or 1
    B = args.budget or found.get("B") or 8
    backup = args.backup or found.get("backup") or "draft"
    if backup not in ("draft", *FAST_BACKUPS):
        backup = "draft"
    updates: dict[str, Any] = {}
    for key, value in (
        ("target_step_ms", args.target_step_ms), ("draft_step_ms", args.draft_step_ms),
        ("draft_forward_ms", args.draft_forward_ms), ("draft_tree_ms", args.draft_tree_ms),
        ("backup_ms", args.backup_ms),
        ("ar_ms_per_token", args.ar_ms or (None if default_latencies else found.get("ar_ms"))),
        ("overlap_efficiency", args.overlap_efficiency), ("round_overhead_ms", args.overhead_ms),
    ):
        if value is not None:
            updates[key] = value
    verify = dict(args.target_verify_ms or {})
    if "verify_ms" in found and K not in verify and not default_latencies:
        verify[K] = found["verify_ms"]
    if verify:
        updates["target_verify_ms"] = {**(lat.target_verify_ms if isinstance(lat.target_verify_ms, Mapping) else {}),
                                       **verify}
    lat = replace(lat, **updates)
    stats = found.get("statistics") or Statistics(acceptance=[0.85, 0.69], p_hit=0.86)
    stat_updates = {k: v for k, v in (
        ("acceptance", list(args.acceptance) if args.acceptance else None), ("p_hit", args.p_hit),
        ("e_hit", args.e_hit), ("e_miss", args.e_miss), ("backup_acceptance", args.backup_acceptance),
    ) if v is not None}
    stats = replace(stats, **stat_updates)
    cpu = predict(lat, stats, K, B, backup, label="CPU, as measured (latencies given)" if not default_latencies
                  else "CPU, int8 Qwen2.5-Coder latencies measured on a 2-core CPU")
    # Measured figures from a JSON only mean something against latencies of the same model pair.
    measured = args.measured_tok_s or (None if default_latencies else found.get("measured"))
    reasons = explain_gap(cpu, measured, None if default_latencies else found.get("metrics"))
    h100 = None if args.h100 == "none" else predict_h100(stats, K, B, args.h100, backup)
    if args.json:
        print(json.dumps({"cpu": cpu, "h100_prediction": h100, "gap": reasons,
                          "latencies": lat.to_dict(), "statistics": vars(stats)}, indent=2, default=list))
        return 0
    acc = stats.acceptance
    acc_text = f"{acc:.3f}" if isinstance(acc, (int, float)) else "[" + ", ".join(f"{x:.3f}" for x in acc) + "]"
    print(f"statistics: acceptance {acc_text}, p_hit {stats.p_hit:.3f}")
    if default_latencies and found:
        print("note: latencies are the int8 Qwen pair's, measured on 2 CPU cores (the JSON's timings are not used and "
              "no gap is explained); pass --target-step-ms, --draft-step-ms, --target-verify-ms, --draft-tree-ms")
    _print_prediction(cpu)
    if reasons:
        print("measured vs predicted:")
        for reason in reasons:
            print(f"  - {reason}")
    if h100 is not None:
        print()
        _print_prediction(h100)
        print("  (a prediction: these statistics with latencies assumed from the paper's AR figure; see "
              "hf_ssd.speed_settings.h100_latencies)")
    return 0
