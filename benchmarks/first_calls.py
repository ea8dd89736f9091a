"""A user's first calls: plain decoding, transformers' assisted generation and SSD in a fresh interpreter.

`hf-ssd bench` warms every method up before it measures; a user's script does not. This runs, in one fresh process,
the prompts given one after another, each with plain greedy decoding, assisted generation at a fixed K and SSD with
`executor="auto"` (in a rotated order, so a shared machine's drift hits them alike), and prints every call's end-to-end
tokens per second (the whole `generate()` call: prefills, the worker process's start-up or the draft's hand-over
where "auto" pays them) with the executor SSD ran on. Greedy outputs are checked against plain decoding's.

Usage (from the project root, after `hf-ssd models fetch`)::

    .venv/bin/python benchmarks/first_calls.py benchmarks/prompts/translation.jsonl:0 \\
        benchmarks/prompts/qa.jsonl:1 ../shared/data/prompts/mt_bench.jsonl:0 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from hf_ssd.bench.command import load_models  # noqa: E402
from hf_ssd.bench.prompts import encode_prompt, load_prompt_sets  # noqa: E402
from hf_ssd.runtime.pool import POOL  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prompts", nargs="+", help="FILE.jsonl:INDEX, one prompt each, run in this order")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--lookahead", type=int, default=4, help="K of SSD and of assisted generation")
    args = parser.parse_args()
    target, draft, tokenizer, _ = load_models(args.target, args.draft, "auto", "int8")
    config = draft.generation_config
    config.num_assistant_tokens, config.num_assistant_tokens_schedule = args.lookahead, "constant"
    config.assistant_confidence_threshold = 0.0
    methods = {
        "plain": {},
        f"assisted K={args.lookahead}": {"assistant_model": draft},
        "ssd (auto)": {"assistant_model": draft, "ssd_config": {"lookahead": args.lookahead}},
    }
    totals = {name: [0, 0.0] for name in methods}
    print(f"{'call':>4}  {'prompt':<28} " + "  ".join(f"{name:>14}" for name in methods) + "  ssd executor")
    for call, spec in enumerate(args.prompts, 1):
        path, index = spec.rsplit(":", 1)
        ids = encode_prompt(tokenizer, load_prompt_sets([path])[0].prompts[int(index)])
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        names = list(methods)
        shift = (call - 1) % len(names)
        speeds, reference, outputs = {}, None, {}
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            out = target.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, **methods[name])
            seconds = time.perf_counter() - start
            new = out.shape[1] - ids.shape[1]
            totals[name][0] += new
            totals[name][1] += seconds
            speeds[name], outputs[name] = new / seconds, out
        reference = outputs["plain"]
        for name, out in outputs.items():
            if not torch.equal(out, reference):
                raise SystemExit(f"{name} differs from plain greedy decoding on {spec}")
        executor = target.ssd_metrics.executor
        label = f"{os.path.basename(path)}:{index}"
        print(f"{call:>4}  {label:<28} " + "  ".join(f"{speeds[name]:>14.2f}" for name in methods)
              + f"  {executor}" + ("  (a worker is starting)" if POOL.started() and executor != "process" else ""))
    print(f"{'all':>4}  {'':<28} " + "  ".join(f"{n / s:>14.2f}" for n, s in totals.values()) + "  (tok/s, e2e)")
    ssd, plain = (totals["ssd (auto)"][0] / totals["ssd (auto)"][1]), totals["plain"][0] / totals["plain"][1]
    print(f"SSD / plain {ssd / plain:.2f}x")


if __name__ == "__main__":
    main()
