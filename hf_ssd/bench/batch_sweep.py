"""`hf-ssd bench --batch-sizes 1,2,4,8`: throughput against per-token latency across batch sizes.

Methods, measured side by side on the same prompts in one run:
- `plain`: transformers' batched decoding of b left-padded prompts;
- `assisted`: transformers' assisted generation (batch 1 only: the prompts one after another; one point);
- `ssd-<backup>`: SSD on the batch, with each backup ("auto" decides by Corollary 16 as it goes).
Decode figures exclude the prefill, as the paper's and `hf-ssd bench`'s do: a streamer timestamps every column a
method emits, and everything up to the first emission (prefill, the first round) is left out. Decode throughput
= tokens generated after the first emission (up to each row's EOS) / the seconds after it; per-token latency =
those seconds / the longest row's tokens after it (what a user of one row waits per token). End-to-end
throughput (prefill included) is reported too. Plain and assisted get the SSD draft's and
target's threads together (equal cores). Greedy outputs are compared with plain decoding of the same batch.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

BACKUPS = ("draft", "ngram", "random", "auto")


def left_pad(rows: Sequence, pad_id: int):
    """(ids [b, T], attention mask [b, T]) of 1D token tensors, left-padded with `pad_id`."""
    import torch

    width = max(int(r.shape[0]) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - row.shape[0]:] = row
        mask[i, width - row.shape[0]:] = 1
    return ids, mask


def _new_tokens(sequences, prompt_width: int, eos: set[int]) -> list[list[int]]:
    rows = []
    for row in sequences[:, prompt_width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:cut])
    return rows


class EmissionClock:
    """A streamer that timestamps what `generate()` emits after the prompt. Plain decoding puts one column per
    step; SSD puts each round's columns as one block (`accepts_blocks`); at batch 1 every put is one emission."""

    accepts_blocks = True

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.prompt_seen = False
        self.times: list[float] = []
        self.widths: list[int] = []

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())
        if value.dim() == 2:  # an SSD block [b, n]
            self.widths.append(int(value.shape[-1]))
        else:  # batch 1: [n] tokens; plain decoding at batch > 1: one [b] column
            self.widths.append(int(value.shape[0]) if self.batch == 1 else 1)

    def end(self) -> None:
        pass

    def first_emission(self) -> tuple[float | None, int]:
        """(time of the first emission, columns it delivered per row)."""
        return (self.times[0], self.widths[0]) if self.times else (None, 0)


def _timed(threads: int, fn: Callable[..., Any], *args, **kwargs):
    """(fn(*args, streamer=clock, **kwargs), start, end, clock) with `threads` intra-op threads."""
    import torch

    saved = torch.get_num_threads()
    clock = EmissionClock(int(args[0].shape[0]))
    try:
        torch.set_num_threads(threads)
        gc.collect()
        start = time.perf_counter()
        with torch.no_grad():
            out = fn(*args, streamer=clock, **kwargs)
        return out, start, time.perf_counter(), clock
    finally:
        torch.set_num_threads(saved)


def _figures(rows: list[list[int]], start: float, end: float, clock: EmissionClock) -> dict[str, float]:
    """Decode and end-to-end figures of one call (see the module docstring)."""
    first, columns = clock.first_emission()
    first = end if first is None else first
    tokens = sum(len(r) for r in rows)
    decode_tokens = sum(max(len(r) - columns, 0) for r in rows)
    decode_steps = max(len(r) for r in rows) - columns
    decode_s = max(end - first, 1e-9)
    return {"seconds": end - start, "tokens": tokens, "first_s": first - start, "decode_tokens": decode_tokens,
            "decode_s": decode_s, "decode_steps": decode_steps, "e2e_throughput": tokens / (end - start)}


def batch_sweep(target, draft, tokenizer, prompts: Sequence[str], batch_sizes: Sequence[int], *, lookahead: int,
                budget: int, max_new_tokens: int, draft_threads: int = 1, target_threads: int = 1,
                backups: Sequence[str] = BACKUPS, log: Callable[[str], None] = print,
                lookahead_schedule: str = "adaptive", fanout_budget_schedule: str = "adaptive",
                draft_confidence: bool = True) -> dict[str, Any]:
    """Measure every method at every batch size; returns the JSON-ready results (see the module docstring)."""
    import torch

    from ..config import SSDConfig
    from .prompts import encode_prompt

    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"batch sizes must be >= 1; got {list(batch_sizes)}")
    if len(prompts) < max(batch_sizes):
        raise ValueError(f"--batch-sizes up to {max(batch_sizes)} needs as many prompts; got {len(prompts)}")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = target.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    encoded = [encode_prompt(tokenizer, text)[0] for text in prompts]
    common = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id)
    equal_cores = draft_threads + target_threads
    results: dict[str, Any] = {"batch_sizes": list(batch_sizes), "lookahead": lookahead, "budget": budget,
                               "max_new_tokens": max_new_tokens, "draft_threads": draft_threads,
                               "target_threads": target_threads, "lookahead_schedule": lookahead_schedule,
                               "fanout_budget_schedule": fanout_budget_schedule,
                               "draft_confidence": draft_confidence, "points": []}

    def ssd(backup: str) -> SSDConfig:
        return SSDConfig(lookahead=lookahead, fanout_budget=budget, backup=backup, executor="auto",
                         draft_threads=draft_threads, target_threads=target_threads,
                         lookahead_schedule=lookahead_schedule, fanout_budget_schedule=fanout_budget_schedule,
                         draft_confidence=draft_confidence)

    # warm-up: one short call of each code path; then the draft's worker process where "auto" started one after its
    # call (a draft with short steps, `runtime.local.worker_pays`), so measured calls see what "auto" settles on
    from ..runtime.pool import adopt_started_worker

    ids, mask = left_pad(encoded[:2], pad_id)
    with torch.no_grad():
        target.generate(ids, attention_mask=mask, **{**common, "max_new_tokens": 4})
        target.generate(ids, attention_mask=mask, assistant_model=draft, ssd_config=ssd("draft"),
                        **{**common, "max_new_tokens": 4})
    adopt_started_worker(draft)

    def point(method: str, b: int, figures: dict[str, float], **extra) -> dict:
        entry = {"method": method, "batch_size": b, **figures,
                 "throughput": figures["decode_tokens"] / figures["decode_s"],
                 "latency_ms": 1000 * figures["decode_s"] / max(figures["decode_steps"], 1), **extra}
        results["points"].append(entry)
        log(f"b={b:<2} {method:<12} {entry['throughput']:6.2f} tok/s  {entry['latency_ms']:7.1f} ms/token"
            f"  (e2e {entry['e2e_throughput']:.2f} tok/s)"
            + (f"  identical {extra['identical']:.2f}" if "identical" in extra else "")
            + (f"  hit {extra['hit_rate']:.2f}" if "hit_rate" in extra else ""))
        return entry

    # batch-1 assisted generation: the prompts of the largest batch, one after another
    config = draft.generation_config
    config.num_assistant_tokens, config.num_assistant_tokens_schedule = lookahead, "constant"
    config.assistant_confidence_threshold = 0.0
    totals = {"seconds": 0.0, "tokens": 0, "first_s": 0.0, "decode_tokens": 0, "decode_s": 0.0,
              "decode_steps": 0}
    for row in encoded[: max(batch_sizes)]:
        out, start, end, clock = _timed(equal_cores, target.generate, row[None],
                                        attention_mask=torch.ones_like(row[None]), assistant_model=draft, **common)
        figures = _figures(_new_tokens(out, row.shape[0], eos_ids), start, end, clock)
        for key in totals:
            totals[key] += figures[key]
    totals["e2e_throughput"] = totals["tokens"] / totals["seconds"]
    point("assisted", 1, totals)  # latency: decode seconds over decode steps of the prompts, one after another

    for b in batch_sizes:
        ids, mask = left_pad(encoded[:b], pad_id)
        width = ids.shape[1]
        plain, start, end, clock = _timed(equal_cores, target.generate, ids, attention_mask=mask, **common)
        reference = _new_tokens(plain, width, eos_ids)
        point("plain", b, _figures(reference, start, end, clock))
        for backup in backups:
            out, start, end, clock = _timed(target_threads, target.generate, ids, attention_mask=mask,
                                            assistant_model=draft, ssd_config=ssd(backup), **common)
            rows = _new_tokens(out, width, eos_ids)
            m = target.ssd_metrics
            identical = sum(r == e for r, e in zip(rows, reference)) / b
            longest = max(max(len(r) for r in rows), 1)
            point(f"ssd-{backup}", b, _figures(rows, start, end, clock), identical=identical,
                  hit_rate=m.cache_hit_rate, mean_accepted_length=m.mean_accepted_length,
                  rounds_by_source=m.rounds_by_source, backup_decision=m.backup_decision,
                  peak_target_kv_bytes=m.peak_target_kv_bytes, peak_draft_kv_bytes=m.peak_draft_kv_bytes,
                  kv_bytes_per_token=(m.peak_target_kv_bytes + m.peak_draft_kv_bytes)
                  / (b * (width + longest)),
                  realign_seconds=m.realign_seconds, draft_compact_seconds=m.draft_compact_seconds,
                  verify_seconds=m.verify_seconds, target_wait_seconds=m.target_wait_seconds,
                  decode_verify_seconds=m.verify_seconds - m.first_verify_seconds,
                  decode_wait_seconds=m.target_wait_seconds - m.first_wait_seconds, batch_rounds=m.batch_rounds,
                  mean_fanout_budget=mean_budget(m.fanout_budget_per_round),
                  mean_lookahead=sum(m.lookahead_per_round) / max(len(m.lookahead_per_round), 1),
                  lookahead_decisions=m.lookahead_decisions)
    return results


def mean_budget(budgets: list[int]) -> float | None:
    """The mean fan-out budget over the rounds the draft prepared beside (0: paused rounds, left out)."""
    working = [b for b in budgets if b]
    return sum(working) / len(working) if working else None


def _cell(point: dict[str, Any], key: str, spec: str) -> str:
    return format(point[key], spec) if point.get(key) is not None else ""


def sweep_table(results: dict[str, Any]) -> str:
    """Markdown: one row per (batch size, method) with throughput, latency and ratios to plain / assisted."""
    points = results["points"]
    assisted = next((p for p in points if p["method"] == "assisted"), None)
    plain = {p["batch_size"]: p for p in points if p["method"] == "plain"}
    lines = ["| b | method | decode tok/s | ms/token | × plain | × assisted | e2e tok/s | identical | hit rate "
             "| accepted/round | mean K | mean B | realign+compact % | KV bytes/token |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        base = plain.get(p["batch_size"])
        x_plain = f"{p['throughput'] / base['throughput']:.2f}" if base and p is not base else ""
        x_assisted = f"{p['throughput'] / assisted['throughput']:.2f}" if assisted and p is not assisted else ""
        overhead = ""
        if "realign_seconds" in p:
            overhead = f"{100 * (p['realign_seconds'] + p['draft_compact_seconds']) / p['seconds']:.1f}"
        lines.append(
            f"| {p['batch_size']} | {p['method']} | {p['throughput']:.2f} | {p['latency_ms']:.0f} | {x_plain} | "
            f"{x_assisted} | {p['e2e_throughput']:.2f} | {_cell(p, 'identical', '.2f')} | "
            f"{_cell(p, 'hit_rate', '.2f')} | "
            f"{_cell(p, 'mean_accepted_length', '.2f')} | {_cell(p, 'mean_lookahead', '.2f')} | "
            f"{_cell(p, 'mean_fanout_budget', '.1f')} | {overhead} | {_cell(p, 'kv_bytes_per_token', '.0f')} |")
    return "\n".join(lines)


def plot_pareto(results: dict[str, Any], path: Path) -> Path:
    """Decode throughput (tok/s) against per-token latency (ms/token), one line per method through the batch
    sizes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    methods = list(dict.fromkeys(p["method"] for p in results["points"]))
    for method in methods:
        pts = sorted((p for p in results["points"] if p["method"] == method), key=lambda p: p["batch_size"])
        xs, ys = [p["latency_ms"] for p in pts], [p["throughput"] for p in pts]
        ax.plot(xs, ys, marker="o" if method != "assisted" else "*", markersize=6 if method != "assisted" else 12,
                label=method)
        for p in pts:
            ax.annotate(f"b={p['batch_size']}", (p["latency_ms"], p["throughput"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=7)
    ax.set_xlabel("per-token latency (ms / token, lower is better)")
    ax.set_ylabel("throughput (tokens / s, higher is better)")
    ax.set_title(f"Throughput vs latency, K={results['lookahead']}, B={results['budget']}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_sweep(results: dict[str, Any], out: Path, plots: bool = True) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "batch_sweep.json", out / "batch_sweep.md"]
    paths[0].write_text(json.dumps(results, indent=1, default=str))
    paths[1].write_text("# Batch sweep\n\n" + sweep_table(results) + "\n")
    if plots:
        paths.append(plot_pareto(results, out / "pareto.png"))
    return paths
