"""Plots of `hf-ssd bench` results (matplotlib, Agg backend): speedups, hit rate vs fan-out, accepted lengths, K
per round.

Each function takes the results dict that `hf_ssd.bench.run_bench` returns (the content of results.json) and
writes one PNG. matplotlib is a development extra, imported only here.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ALL = "all"


def _ssd_key(results: Mapping[str, Any]) -> str | None:
    return next((m["key"] for m in results["methods"] if m["kind"] == "ssd"), None) or next(
        (m["key"] for m in results["methods"] if m["kind"] == "ssd-sync"), None)


def plot_speedups(results: Mapping[str, Any], path: Path) -> Path:
    """Bars per dataset: SSD/AR, SD/AR and SSD/SD decode-throughput ratios, one panel per framing."""
    framings = list(results["comparisons"])
    fig, axes = plt.subplots(1, len(framings), figsize=(6.5 * len(framings), 4.2), squeeze=False)
    series = (("ssd_over_ar", "SSD / AR", "tab:green"), ("sd_over_ar", "SD / AR", "tab:blue"),
              ("ssd_over_sd", "SSD / SD", "tab:orange"))
    for ax, framing in zip(axes[0], framings):
        rows = results["comparisons"][framing]
        names = list(rows)
        width = 0.8 / len(series)
        for i, (key, label, color) in enumerate(series):
            values = [rows[n].get(key) or 0.0 for n in names]
            xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(names))]
            bars = ax.bar(xs, values, width, label=label, color=color)
            for bar, v in zip(bars, values):
                if v:
                    ax.annotate(f"{v:.2f}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom",
                                fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(names)), names, rotation=20)
        ax.set_ylabel("decode throughput ratio (×)")
        ax.set_title(f"{framing}\n{results['framings'][framing]['description']}", fontsize=8)
        ax.legend(fontsize=8)
    mode = "greedy" if results.get("greedy", True) else f"T={results['settings']['temperature']}"
    s = results["settings"]
    fig.suptitle(f"Speedup by dataset ({mode}, K={s['lookahead']}, B={s['budget']}, "
                 f"{s['max_new_tokens']} new tokens, prefill excluded)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_hits_by_position(results: Mapping[str, Any], key: str | None, ax) -> None:
    """Hit rate by the verified outcome's accepted length k (which fork the bonus token had to be found at)."""
    for dataset, by_method in results["summary"].items():
        ssd = (by_method.get(key) or {}).get("ssd") if key else None
        buckets = (ssd or {}).get("hits_by_position") or []
        points = [(k, h / n, n) for k, (h, n) in enumerate(buckets) if n > 0]
        if not points:
            continue
        style = dict(color="black", marker="s", linewidth=1.6) if dataset == ALL else dict(marker="o", alpha=0.7)
        ax.plot([k for k, _, _ in points], [r for _, r, _ in points], label=dataset, **style)
        if dataset == ALL:
            for k, r, n in points:
                ax.annotate(f"n={n}", (k, r), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("k: accepted draft tokens of the verified outcome")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_ylabel("cache hit rate")
    ax.set_ylim(0, 1.05)
    ax.set_title("Hit rate by fork position (SSDMetrics.hits_by_position)", fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def plot_hit_rate(results: Mapping[str, Any], path: Path) -> Path:
    """Miss rate 1 − hits/lookups against the fan-out F at the fork, log-log, per dataset, with the power-law fit."""
    key = _ssd_key(results)
    fig, (ax, by_k) = plt.subplots(1, 2, figsize=(11.5, 4.6), gridspec_kw={"width_ratios": [1.3, 1]})
    _plot_hits_by_position(results, key, by_k)
    plotted = False
    for dataset, by_method in results["summary"].items():
        ssd = (by_method.get(key) or {}).get("ssd") if key else None
        if not ssd:
            continue
        points = sorted((int(f), h, n) for f, (h, n) in ssd["hits_by_fanout"].items() if int(f) >= 1 and n > 0)
        if not points:
            continue
        fs = [f for f, _, _ in points]
        miss = [max(1 - h / n, 0.5 / n) for _, h, n in points]  # a bucket with no miss is drawn at half a miss
        style = dict(color="black", marker="s", linewidth=1.6) if dataset == ALL else dict(marker="o", alpha=0.7)
        fit = ssd.get("power_law_fit")
        label = dataset + (f" (r={fit['r']:.2f})" if fit else "")
        line = ax.plot(fs, miss, linestyle="none" if dataset != ALL else ":", label=label, **style)[0]
        for f, m, (_, _, n) in zip(fs, miss, points):
            if dataset == ALL:
                ax.annotate(f"n={n}", (f, m), fontsize=6, xytext=(3, 3), textcoords="offset points")
        if fit:
            grid = [min(fs) * (max(fs) / min(fs)) ** (i / 20) for i in range(21)] if max(fs) > min(fs) else fs
            ax.plot(grid, [fit["m"] * g ** (-fit["r"]) for g in grid], color=line.get_color(), linewidth=0.9)
        plotted = True
    if not plotted:
        ax.text(0.5, 0.5, "no cache lookups with F >= 1", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel("F: bonus candidates prepared at the verified fork (SSDMetrics.hits_by_fanout)")
    ax.set_ylabel("miss rate 1 − p_hit(F)")
    ax.set_title("Cache miss rate vs fan-out (paper: 1 − p_hit(F) = F^(−r), a line on log-log)\n"
                 "points: pooled over prompts; lines: lookup-weighted power-law fits", fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_accepted_lengths(results: Mapping[str, Any], path: Path) -> Path:
    """Histogram of per-round emitted tokens (accepted + bonus) for SD and SSD, all datasets pooled."""
    summary = results["summary"][ALL]
    K = results["settings"]["lookahead"]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    chosen = [(k, s) for k, s in summary.items() if s["kind"] != "ar" and (s.get("rounds_from_streamer") or {})
              .get("rounds")]
    width = 0.8 / max(len(chosen), 1)
    for i, (key, s) in enumerate(chosen):
        rounds = s["rounds_from_streamer"]
        hist = {int(n): c for n, c in rounds["histogram"].items()}
        total = sum(hist.values())
        xs = list(range(1, K + 2))
        share = [hist.get(x, 0) / total for x in xs]
        offset = (i - (len(chosen) - 1) / 2) * width
        ax.bar([x + offset for x in xs], share, width,
               label=f"{key}: mean {rounds['mean_accepted_length']:.2f} over {total} rounds")
    ax.set_xticks(range(1, K + 2))
    ax.set_xlabel(f"tokens emitted per round (accepted drafts + bonus; K={K})")
    ax.set_ylabel("share of rounds")
    ax.set_title("Accepted length per round, measured per round by a generate() streamer\n"
                 "(each generation's last round left out: max_new_tokens/EOS may cut it)", fontsize=8)
    if chosen:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no SD/SSD rounds", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_lookahead(results: Mapping[str, Any], path: Path, per_dataset: int = 1) -> Path:
    """K verified per round over the generation (the adaptive lookahead), for the first prompt(s) of each set."""
    key = _ssd_key(results)
    runs = [r for r in results["runs"] if r["method"] == key and r["repeat"] == 0 and r.get("metrics")
            and r["metrics"].get("lookahead_per_round") and r["prompt_index"] < per_dataset]
    K = results["settings"]["lookahead"]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for i, run in enumerate(runs):
        ks = run["metrics"]["lookahead_per_round"]
        ax.step(range(1, len(ks) + 1), [k + 0.06 * (i - len(runs) / 2) for k in ks], where="mid",
                label=f"{run['dataset']} #{run['prompt_index']}: mean K {sum(ks) / len(ks):.2f}")
    ax.set_yticks(range(K + 1))
    ax.set_xlabel("round")
    ax.set_ylabel("draft tokens verified (K)")
    ax.set_title(f"{key}: K chosen every round (0 = a plain target step; lines offset slightly to stay visible)",
                 fontsize=8)
    if runs:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(results: Mapping[str, Any], out_dir: str | Path) -> list[Path]:
    """speedup_by_dataset.png, hit_rate_vs_fanout.png, accepted_length_hist.png, lookahead_per_round.png in
    `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [plot_speedups(results, out / "speedup_by_dataset.png")]
    if _ssd_key(results):
        written.append(plot_hit_rate(results, out / "hit_rate_vs_fanout.png"))
    written.append(plot_accepted_lengths(results, out / "accepted_length_hist.png"))
    if _ssd_key(results):
        written.append(plot_lookahead(results, out / "lookahead_per_round.png"))
    return written


__all__ = ["plot_accepted_lengths", "plot_hit_rate", "plot_lookahead", "plot_speedups", "write_plots"]
