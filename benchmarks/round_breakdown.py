"""Where does an SSD round spend its time, per side? The critical path from `SSDMetrics`, executor by executor.

Runs SSD on a small pair (benchmarks/pairs.py) once per executor (after a warm-up) and prints, per decode round,
the target side's phases (forward, processors, acceptance and read-back, emit, realign, hand-off, waits) and the
draft side's (glue and tree forwards, its own Python, compaction, backup forwards, idle), next to the speed model's
prediction from directly measured forwards. Nothing is patched: the figures are the ones every SSD call records.

Usage (from the project root)::

    .venv/bin/python benchmarks/round_breakdown.py                                   # small-llama, K=3, B=8
    .venv/bin/python benchmarks/round_breakdown.py --pair small-qwen2 -K 4 --executors thread process
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, Path(__file__).resolve().parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from pairs import PAIRS, build_pair  # noqa: E402

from hf_ssd import SSDConfig, enable_ssd  # noqa: E402
from hf_ssd.bench.critical_path import critical_path, critical_path_table  # noqa: E402
from hf_ssd.bench.predict import measure_latencies, predict_from_runs  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="small-llama", choices=sorted(PAIRS))
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--lookahead", "-K", type=int, default=3)
    parser.add_argument("--budget", "-B", type=int, default=8)
    parser.add_argument("--backup", default="draft", choices=["auto", "draft", "ngram", "random"])
    parser.add_argument("--executors", nargs="+", default=["sync", "thread", "process"],
                        choices=["sync", "thread", "process"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of each side")
    args = parser.parse_args(argv)

    target, draft, desc = build_pair(args.pair)
    enable_ssd(target)
    ids = torch.randint(0, target.config.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(1))
    torch.set_num_threads(args.threads)
    paths, predictions, measured = {}, {}, {}
    latencies = measure_latencies(target, draft, ids, args.lookahead, args.budget, threads=args.threads, repeats=5)
    for executor in args.executors:
        config = SSDConfig(lookahead=args.lookahead, fanout_budget=args.budget, executor=executor, backup=args.backup,
                           draft_threads=args.threads, target_threads=args.threads)
        common = dict(assistant_model=draft, ssd_config=config, max_new_tokens=args.max_new_tokens, do_sample=False)
        target.generate(ids, **common)  # warm-up (and the process executor's worker start-up)
        runs = []
        for _ in range(args.repeats):
            target.generate(ids, **common)
            runs.append(target.ssd_metrics.to_dict())
        path = critical_path(runs)
        paths[executor] = path
        measured[executor] = 1e3 * path["tokens_per_round"] / path["round_ms"]
        if executor != "sync":
            predictions[executor] = predict_from_runs(latencies, runs, args.lookahead, args.budget, executor)
    print(f"# {desc}; K={args.lookahead} B={args.budget} backup={args.backup}; {args.max_new_tokens} new tokens, "
          f"{args.repeats} runs per executor; {args.threads} thread(s) per side; torch {torch.__version__}")
    print(f"# forwards measured directly (ms): target step {latencies['target_step_ms']:.2f}, verify(K) "
          f"{latencies['target_verify_ms'][str(args.lookahead)]:.2f}, draft step {latencies['draft_step_ms']:.2f}, "
          f"draft round {latencies['draft_round_ms'][str(args.budget)]:.2f}\n")
    print("## Critical path (ms per decode round)\n")
    print(critical_path_table(paths))
    print("\n## Measured vs the speed model (decode tok/s)\n")
    print("| executor | measured | predicted SSD | measured / predicted | predicted round ms (hit) | predicted SD |")
    print("|---|---|---|---|---|---|")
    for executor in args.executors:
        pred = predictions.get(executor)
        if pred is None:
            print(f"| {executor} | {measured[executor]:.1f} | – | – | – | – |")
            continue
        print(f"| {executor} | {measured[executor]:.1f} | {pred['ssd_tok_s']:.1f} | "
              f"{measured[executor] / pred['ssd_tok_s']:.2f} | {pred['breakdown_ms']['ssd_hit_round']['total']:.1f} "
              f"| {pred['sd_tok_s']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
