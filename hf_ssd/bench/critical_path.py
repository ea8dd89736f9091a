"""Where an SSD round's time goes, per side, from `SSDMetrics` (`target_phase_seconds`, `draft_phase_seconds`).

Figures are milliseconds per decode round: the first round (the prefills: the target's first forward, the draft's
prefill and first speculation) is left out, so rows describe the steady state. On the target side the phases add up
to the round; on the draft side what the tasks spent outside the model calls is the draft's own Python (masks, fork,
cache bookkeeping), and the rest of the round the draft sat idle.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

TARGET_ROWS = (
    ("target_forward", "target forward (verification)"),
    ("processors", "logits processors"),
    ("verify", "acceptance + read-back"),
    ("emit", "emit (stop rules, streamer)"),
    ("realign", "realign / crop"),
    ("hand_off", "hand-off (announce outcomes)"),
    ("wait_prepare", "wait for prepare (incl. submit)"),
    ("wait_resolve", "wait for resolve (lookup, backup)"),
)
DRAFT_ROWS = (
    ("glue_forward", "glue forward"),
    ("tree_forward", "tree forwards"),
    ("prepare_python", "prepare: masks, fork, bookkeeping"),
    ("backup_forward", "backup forwards (just-in-time draft)"),
    ("serial_forward", "serial forwards (drafted after a verification it sat out)"),
    ("compact", "resolve: KV compaction"),
    ("resolve_python", "resolve: lookup, commit, fast backups"),
    ("idle", "idle"),
)


def critical_path(metrics: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Per-decode-round milliseconds per phase, pooled over SSD runs (`SSDMetrics.to_dict()` each)."""
    runs = [m for m in metrics if m.get("target_phase_seconds") and m.get("batch_rounds", 0) > 1]
    if not runs:
        return None
    rounds = sum(m["batch_rounds"] - 1 for m in runs)

    def total(side: str, name: str) -> float:
        return sum(m[side].get(name, 0.0) for m in runs)

    first_verify = sum(m["first_verify_seconds"] for m in runs)
    target = {name: total("target_phase_seconds", name) for name, _ in TARGET_ROWS}
    # the first verification holds the target's prefill: it leaves the forward with most of its cost
    target["target_forward"] = max(target["target_forward"] - first_verify, 0.0)
    wall = sum(m["wall_seconds"] - m["first_verify_seconds"] - m["first_wait_seconds"] for m in runs)
    target["other"] = max(wall - sum(target.values()), 0.0)
    draft_total = {name: total("draft_phase_seconds", name) for name in (
        "glue_forward", "tree_forward", "backup_forward", "serial_forward", "compact", "prepare", "resolve")}
    draft = {
        "glue_forward": draft_total["glue_forward"],
        "tree_forward": draft_total["tree_forward"],
        "prepare_python": max(draft_total["prepare"] - draft_total["glue_forward"] - draft_total["tree_forward"], 0.0),
        "backup_forward": draft_total["backup_forward"],
        "serial_forward": draft_total["serial_forward"],
        "compact": draft_total["compact"],
        "resolve_python": max(draft_total["resolve"] - draft_total["backup_forward"] - draft_total["serial_forward"]
                              - draft_total["compact"], 0.0),
    }
    draft["idle"] = max(wall - sum(draft.values()), 0.0)
    per_round = 1e3 / rounds
    return {
        "rounds": rounds,
        "round_ms": wall * per_round,
        "tokens_per_round": sum(m["generated_tokens"] for m in runs) / sum(m["batch_rounds"] for m in runs),
        "target_ms": {k: v * per_round for k, v in target.items()},
        "draft_ms": {k: v * per_round for k, v in draft.items()},
        "executor": sorted({m.get("executor", "") for m in runs}),
    }


def critical_path_table(paths: Mapping[str, Mapping[str, Any] | None]) -> str:
    """Markdown: one column per labelled `critical_path` result, one row per phase (ms per decode round)."""
    paths = {label: p for label, p in paths.items() if p}
    if not paths:
        return ""
    labels = list(paths)
    lines = ["| side | phase | " + " | ".join(labels) + " |", "|---|---|" + "---|" * len(labels)]

    def row(side: str, title: str, values) -> None:
        lines.append(f"| {side} | {title} | " + " | ".join(values) + " |")

    for key, title in TARGET_ROWS:
        row("target", title, (f"{paths[label]['target_ms'][key]:.2f}" for label in labels))
    row("target", "other (loop, metrics)", (f"{paths[label]['target_ms']['other']:.2f}" for label in labels))
    row("", "**round**", (f"**{paths[label]['round_ms']:.2f}**" for label in labels))
    for key, title in DRAFT_ROWS:
        row("draft", title, (f"{paths[label]['draft_ms'][key]:.2f}" for label in labels))
    row("", "tokens per round", (f"{paths[label]['tokens_per_round']:.2f}" for label in labels))
    return "\n".join(lines)
