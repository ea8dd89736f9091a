"""Core speed benchmark: plain greedy vs transformers' assisted generation vs SSD (thread and sync executors).

Everything runs in ONE process on one model pair, greedy (`do_sample=False`), batch 1:

1. plain      - `target.generate(ids, max_new_tokens=N)`
2. assisted   - transformers' own assisted generation with K draft tokens (constant schedule, confidence
                threshold 0 so drafts are never cut short): the SD baseline
3. ssd-thread - `generate(..., ssd_config=SSDConfig(lookahead=K, fanout_budget=B, executor="thread"))`
4. ssd-process - the same with `executor="process"` (the draft in a worker process: no shared GIL)
5. ssd-sync   - the same with `executor="sync"` (draft work inline; no overlap)

Each method is warmed up once, then every repeat runs all methods in a rotated order (interleaved, so slow drift of
a shared machine hits all of them alike). Per repeat and method two timed calls are made with
`time.perf_counter`: one with `max_new_tokens=N` (end-to-end) and one with `max_new_tokens=1` (prefill plus the
first token, and for SD/SSD the draft's own prefill and first speculation). Reported:

- e2e tok/s    = new tokens / time(N)
- decode tok/s = (new tokens - 1) / (time(N) - time(1)), i.e. prefill excluded, as in the SSD paper.

Ratios (SSD/plain, SSD/assisted, thread/sync) are ratios of the decode-tok/s medians. Every greedy output is
compared token by token with plain greedy decoding.

Usage (from the project root)::

    .venv/bin/python benchmarks/bench_core.py                          # random medium Llama + 2-layer draft
    .venv/bin/python benchmarks/bench_core.py --draft self             # the target drafts for itself
    .venv/bin/python benchmarks/bench_core.py --lookahead 3 4 --budget 4 8 16 --repeats 3 --json out.json
    # `hf-ssd models fetch` short names, hub ids or local folders:
    .venv/bin/python benchmarks/bench_core.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --max-new-tokens 8
    .venv/bin/python benchmarks/bench_core.py --upper-scale 0.05       # random pair whose draft agrees ~60%

`--quantize-draft` quantizes the draft only (int8 dynamic; the target stays fp32, so outputs stay exact).
`--threads T` is the total intra-op thread count: plain and assisted use T; SSD-thread gives the draft worker
T//2 (at least 1) and the target the rest (override with --draft-threads/--target-threads); SSD-sync runs
draft and target one after the other on all T threads. The machine is shared: the load average is recorded
before and after, compare figures within one run only.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hf_ssd import SSDConfig, enable_ssd  # noqa: E402
from hf_ssd.bench.critical_path import critical_path, critical_path_table  # noqa: E402
from hf_ssd.bench.predict import measure_latencies, predict_from_runs  # noqa: E402

DEFAULT_PROMPT = (
    "def quicksort(values):\n    \"\"\"Sort a list of numbers with quicksort and return a new list.\"\"\"\n"
)
METRIC_FIELDS = (
    "rounds", "generated_tokens", "cache_lookups", "cache_hits", "cache_hit_rate", "mean_accepted_length",
    "draft_acceptance_rate", "tokens_per_round_hit", "tokens_per_round_miss", "verify_seconds", "draft_seconds",
    "target_wait_seconds", "wall_seconds",
)


# --- models ------------------------------------------------------------------------------------------------------
sys.path.insert(0, str(Path(__file__).resolve().parent))
from pairs import PAIRS, build_pair, scale_upper_layers, truncated_draft  # noqa: E402


def quantized_draft(draft):
    """A copy of `draft` whose decoder-layer linears use int8 dynamic quantization (torch.ao, fbgemm).

    Only the draft is quantized: verification still runs the fp32 target, so greedy output stays identical to
    plain decoding (the draft's own numerics only change acceptance). The LM head stays fp32 because hf_ssd reads
    `lm_head.weight.shape` to check the vocabulary, which a quantized linear does not expose as a tensor.
    """
    import copy
    import warnings

    draft = copy.deepcopy(draft)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        draft.model = torch.ao.quantization.quantize_dynamic(draft.model, {torch.nn.Linear}, dtype=torch.qint8)
    return draft


def resolve(name: str) -> str:
    """A local folder for `hf_ssd.models` short names (e.g. qwen2.5-coder-1.5b) where available; else `name`."""
    try:
        from hf_ssd.models import resolve_model
    except ImportError:
        return name
    return resolve_model(name)


def load_pair(args):
    """(target, draft, tokenizer or None, description)."""
    tokenizer = None
    if args.target:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        target = AutoModelForCausalLM.from_pretrained(resolve(args.target), dtype=torch.float32).eval()
        try:
            tokenizer = AutoTokenizer.from_pretrained(resolve(args.target))
        except Exception as err:  # a bare weights folder: fall back to random prompt ids
            print(f"# no tokenizer for {args.target} ({type(err).__name__}); using random prompt ids")
        desc = args.target
        if args.draft == "self":
            draft = target
        elif args.draft:
            draft = AutoModelForCausalLM.from_pretrained(resolve(args.draft), dtype=torch.float32).eval()
        else:
            draft = truncated_draft(target, args.draft_layers or 2)
    elif args.pair:
        target, draft, desc = build_pair(args.pair)
    else:
        from hf_ssd.cli import _random_pair

        target, draft, _ = _random_pair()
        desc = "random Llama (hf_ssd.cli._random_pair)"
        if args.upper_scale != 1.0:  # the draft holds only layers < 2: untouched by the scaling
            scale_upper_layers(target, 2, args.upper_scale)
            desc += f", layers >= 2 scaled by {args.upper_scale}"
    if not args.target:
        if args.draft == "self":
            draft = target
        elif args.draft:
            from transformers import AutoModelForCausalLM

            draft = AutoModelForCausalLM.from_pretrained(resolve(args.draft), dtype=torch.float32).eval()
        elif args.draft_layers and args.draft_layers != draft.config.num_hidden_layers:
            draft = truncated_draft(target, args.draft_layers)
    if args.quantize_draft:
        draft = quantized_draft(draft)
    if draft is target:
        draft_desc = "self (the target drafts for itself)"
    elif args.draft:
        draft_desc = args.draft
    else:
        draft_desc = f"target's first {draft.config.num_hidden_layers} layers + embeddings + head"
    if args.quantize_draft:
        draft_desc += " (int8 dynamic decoder layers, fp32 head)"
    return enable_ssd(target), draft, tokenizer, f"target: {desc}; draft: {draft_desc}"


def make_prompt(args, target, tokenizer) -> torch.Tensor:
    if tokenizer is not None:
        text = args.prompt
        if args.prompt_file:
            with open(args.prompt_file) as fh:
                text = json.loads(fh.readline())["turns"][0]
        ids = tokenizer(text, return_tensors="pt").input_ids
        return ids[:, -args.prompt_len :]  # the text as is, or its last --prompt-len tokens when longer
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, target.config.vocab_size, (1, args.prompt_len), generator=generator)


def params_m(model) -> float:
    return sum(p.numel() for p in model.parameters()) / 1e6


# --- methods -----------------------------------------------------------------------------------------------------
@dataclass
class Method:
    name: str
    kind: str  # plain | assisted | ssd
    lookahead: int = 0
    budget: int = 0
    executor: str = ""
    threads: str = ""
    schedule: str = "adaptive"
    e2e_s: list[float] = field(default_factory=list)
    first_s: list[float] = field(default_factory=list)
    new_tokens: list[int] = field(default_factory=list)
    identical: list[bool] = field(default_factory=list)
    metrics: list[dict] = field(default_factory=list)

    def e2e_tps(self) -> list[float]:
        return [n / t for n, t in zip(self.new_tokens, self.e2e_s)]

    def decode_tps(self) -> list[float]:
        return [(n - 1) / max(t - f, 1e-9) for n, t, f in zip(self.new_tokens, self.e2e_s, self.first_s)]


class Runner:
    def __init__(self, args, target, draft, input_ids):
        self.args, self.target, self.draft, self.input_ids = args, target, draft, input_ids
        self.draft_threads = args.draft_threads or max(1, args.threads // 2)
        self.target_threads = args.target_threads or max(1, args.threads - self.draft_threads)

    def ssd_config(self, method: Method) -> SSDConfig:
        threads = {}
        if method.executor in ("thread", "process", "auto"):
            threads = dict(draft_threads=self.draft_threads, target_threads=self.target_threads)
        return SSDConfig(
            lookahead=method.lookahead, fanout_budget=method.budget, fanout=self.args.fanout,
            backup=self.args.backup, executor=method.executor, lookahead_schedule=method.schedule, **threads,
        )

    def call(self, method: Method, max_new_tokens: int):
        """One generate() call: (output ids, seconds, metrics dict or None)."""
        torch.set_num_threads(self.args.threads)
        torch.manual_seed(0)
        common = dict(max_new_tokens=max_new_tokens, do_sample=False)
        kwargs = {}
        if method.kind == "assisted":
            gen = self.draft.generation_config
            if method.lookahead:  # a fixed K, never cut short
                gen.num_assistant_tokens = method.lookahead
                gen.num_assistant_tokens_schedule = "constant"
                gen.assistant_confidence_threshold = 0
            else:  # transformers' defaults (20 tokens, cut by the 0.4 confidence threshold)
                gen.num_assistant_tokens = gen.num_assistant_tokens_schedule = None
                gen.assistant_confidence_threshold = None
            kwargs = dict(assistant_model=self.draft)
        elif method.kind == "ssd":
            kwargs = dict(assistant_model=self.draft, ssd_config=self.ssd_config(method))
        gc.collect()
        start = time.perf_counter()
        out = self.target.generate(self.input_ids, **kwargs, **common)
        seconds = time.perf_counter() - start
        metrics = self.target.ssd_metrics.to_dict() if method.kind == "ssd" else None
        if torch.get_num_threads() != self.args.threads:
            raise RuntimeError(f"{method.name} left torch at {torch.get_num_threads()} threads")
        return out, seconds, metrics


def build_methods(args, runner: Runner) -> list[Method]:
    wanted = set(args.methods)
    methods = [Method("plain", "plain", threads=f"{args.threads}")]
    if "assisted-default" in wanted:
        methods.append(Method("assisted default", "assisted", lookahead=0, threads=f"{args.threads}"))
    for k in args.lookahead:
        if "assisted" in wanted:
            methods.append(Method(f"assisted K={k}", "assisted", lookahead=k, threads=f"{args.threads}"))
        for b in args.budget:
            for executor in ("thread", "process", "auto", "sync"):
                if executor not in wanted:
                    continue
                threads = (
                    f"d{runner.draft_threads}+t{runner.target_threads}" if executor != "sync"
                    else f"{args.threads} shared"
                )
                for schedule in args.schedules:
                    suffix = "" if schedule == "adaptive" else f" {schedule}"
                    methods.append(Method(f"ssd-{executor} K={k} B={b}{suffix}", "ssd", k, b, executor, threads,
                                          schedule=schedule))
    return methods


# --- statistics and printing ---------------------------------------------------------------------------------------
def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def spread(values: list[float], fmt: str = "{:.1f}") -> str:
    if not values:
        return "-"
    return f"{fmt.format(med(values))} [{fmt.format(min(values))}–{fmt.format(max(values))}]"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b and b == b and a == a else "-"


def summarise(methods: list[Method]) -> dict:
    by_name = {m.name: m for m in methods}
    plain = med(by_name["plain"].decode_tps())
    rows = []
    for m in methods:
        row = {
            "method": m.name, "kind": m.kind, "lookahead": m.lookahead, "budget": m.budget, "executor": m.executor,
            "threads": m.threads, "new_tokens": m.new_tokens, "e2e_seconds": m.e2e_s, "first_token_seconds": m.first_s,
            "e2e_tok_s": m.e2e_tps(), "decode_tok_s": m.decode_tps(), "identical_to_plain": m.identical,
            "decode_tok_s_median": med(m.decode_tps()), "e2e_tok_s_median": med(m.e2e_tps()),
        }
        decode = row["decode_tok_s_median"]
        row["vs_plain"] = decode / plain if plain else None
        if m.kind == "ssd":
            sd = by_name.get(f"assisted K={m.lookahead}")
            row["vs_assisted"] = decode / med(sd.decode_tps()) if sd else None
            if m.executor != "sync":
                sync = by_name.get(f"ssd-sync K={m.lookahead} B={m.budget}")
                row["thread_vs_sync"] = decode / med(sync.decode_tps()) if sync else None
            row["critical_path"] = critical_path(m.metrics)
            row["metrics"] = m.metrics
            row["metrics_median"] = {
                key: med([float(x[key]) for x in m.metrics]) for key in METRIC_FIELDS if m.metrics
            }
        rows.append(row)
    return {"plain_decode_tok_s": plain, "methods": rows}


def print_tables(summary: dict, methods: list[Method]) -> None:
    by_name = {m.name: m for m in methods}
    plain = summary["plain_decode_tok_s"]
    assisted = [m for m in methods if m.kind == "assisted"]
    best_sd = max(assisted, key=lambda m: med(m.decode_tps()), default=None)
    print("\n### Throughput (greedy, batch 1; median [min–max] over repeats)\n")
    if best_sd is not None:
        print(f"Best SD (transformers' assisted generation): {best_sd.name}, {med(best_sd.decode_tps()):.1f} tok/s.\n")
    print("| method | threads | decode tok/s | e2e tok/s | 1st-token ms | ×plain | ×assisted(K) | ×best SD "
          "| thread/sync | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for m in methods:
        decode = med(m.decode_tps())
        sd = by_name.get(f"assisted K={m.lookahead}") if m.kind == "ssd" else None
        concurrent = m.kind == "ssd" and m.executor != "sync"
        sync = by_name.get(f"ssd-sync K={m.lookahead} B={m.budget}") if concurrent else None
        first_ms = [1e3 * s for s in m.first_s]
        same = "yes" if all(m.identical) else f"NO ({sum(not x for x in m.identical)}/{len(m.identical)} differ)"
        print(
            f"| {m.name} | {m.threads} | {spread(m.decode_tps())} | {spread(m.e2e_tps())} "
            f"| {spread(first_ms, '{:.0f}')} | {ratio(decode, plain)} "
            f"| {ratio(decode, med(sd.decode_tps())) if sd else '-'} "
            f"| {ratio(decode, med(best_sd.decode_tps())) if best_sd and m.kind == 'ssd' else '-'} "
            f"| {ratio(decode, med(sync.decode_tps())) if sync else '-'} | {same} |"
        )
    ssd = [m for m in methods if m.kind == "ssd"]
    if not ssd:
        return
    print("\n### SSD metrics (medians over repeats; seconds are per generate() call of N tokens)\n")
    print("| method | rounds | hit rate | mean acc. len | draft acc. | target wait s | draft s | verify s | wall s "
          "| verify ms/round | draft ms/round | fan-out after hit / miss (final) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row, m in zip(summary["methods"], methods):
        if m.kind != "ssd":
            continue
        x = row["metrics_median"]
        rounds = max(x["rounds"], 1)
        schedule = m.metrics[-1]["fanout_schedule"]
        print(
            f"| {m.name} | {x['rounds']:.0f} | {x['cache_hit_rate']:.2f} | {x['mean_accepted_length']:.2f} "
            f"| {x['draft_acceptance_rate']:.2f} | {x['target_wait_seconds']:.3f} | {x['draft_seconds']:.3f} "
            f"| {x['verify_seconds']:.3f} | {x['wall_seconds']:.3f} | {1e3 * x['verify_seconds'] / rounds:.1f} "
            f"| {1e3 * x['draft_seconds'] / rounds:.1f} | {schedule.get('hit')} / {schedule.get('miss')} |"
        )


def print_critical_paths(args, runner: Runner, methods: list[Method]) -> dict:
    """Per K and B: where an SSD round goes for each executor, and the speed model's prediction from directly
    measured forwards (at the target's thread count) next to the measured decode tok/s."""
    predictions = {}
    for k in args.lookahead:
        for b in args.budget:
            ssd = [m for m in methods if m.kind == "ssd" and m.lookahead == k and m.budget == b and m.metrics]
            if not ssd:
                continue
            print(f"\n### SSD critical path, K={k} B={b} (ms per decode round, pooled over repeats)\n")
            print(critical_path_table({f"{m.executor} {m.schedule}": critical_path(m.metrics) for m in ssd}))
            torch.set_num_threads(runner.target_threads)
            latencies = measure_latencies(runner.target, runner.draft, runner.input_ids, k, b,
                                          threads=runner.target_threads, repeats=5)
            torch.set_num_threads(args.threads)
            print(f"\nSpeed model (forwards measured directly: verify(K) "
                  f"{latencies['target_verify_ms'][str(k)]:.2f} ms, draft step {latencies['draft_step_ms']:.2f} ms, "
                  f"draft round {latencies['draft_round_ms'][str(b)]:.2f} ms; this run's acceptance and hits):\n")
            print("| method | measured decode tok/s | predicted tok/s | measured / predicted |")
            print("|---|---|---|---|")
            pred = None
            for m in ssd:
                if m.executor == "sync":
                    continue
                pred = predict_from_runs(latencies, m.metrics, k, b, m.executor if m.executor != "auto" else "process")
                got = med(m.decode_tps())
                predictions[m.name] = {"measured": got, "predicted": pred["ssd_tok_s"], "prediction": pred}
                print(f"| {m.name} | {got:.1f} | {pred['ssd_tok_s']:.1f} | {got / pred['ssd_tok_s']:.2f} |")
            sd = next((m for m in methods if m.name == f"assisted K={k}"), None)
            if sd is not None and pred is not None:
                got = med(sd.decode_tps())
                want = pred["sd_tok_s"]
                print(f"| {sd.name} | {got:.1f} | {want:.1f} | {got / want:.2f} |")
    return predictions


# --- main --------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", help="hub id or local folder (AutoModelForCausalLM); default: random medium Llama")
    parser.add_argument("--draft", help="hub id or local folder, or 'self' (the target drafts for itself); "
                        "default: the target's first --draft-layers layers")
    parser.add_argument("--pair", choices=sorted(PAIRS), help="a small pair from benchmarks/pairs.py")
    parser.add_argument("--draft-layers", type=int, help="layers of the truncated draft (default: 2, or the pair's)")
    parser.add_argument("--upper-scale", type=float, default=1.0,
                        help="default random pair only: scale the target's layers above the draft's by this factor "
                        "(e.g. 0.05) to raise draft/target agreement; 1.0 = hf_ssd.cli._random_pair unchanged")
    parser.add_argument("--quantize-draft", action="store_true",
                        help="int8 dynamic quantization of the draft's decoder layers (the target stays fp32)")
    parser.add_argument("--prompt-len", type=int, default=32,
                        help="prompt tokens: random ids without a tokenizer; with one, at most this many (the tail)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text (only with a tokenizer)")
    parser.add_argument("--prompt-file", help="JSONL prompt set (first line's turns[0]), only with a tokenizer")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--lookahead", type=int, nargs="+", default=[3], help="K (one or more)")
    parser.add_argument("--budget", type=int, nargs="+", default=[8], help="SSD fan-out budget B (one or more)")
    parser.add_argument("--schedules", nargs="+", default=["adaptive"], choices=["adaptive", "constant"],
                        help="SSD lookahead schedules: adaptive (K chosen per round) and/or constant (always K)")
    parser.add_argument("--fanout", default="geometric", choices=["geometric", "uniform"])
    parser.add_argument("--backup", default="auto", choices=["auto", "draft", "ngram", "random"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="total intra-op threads")
    parser.add_argument("--draft-threads", type=int, help="SSD-thread draft threads (default threads//2)")
    parser.add_argument("--target-threads", type=int, help="SSD-thread target threads (default the rest)")
    parser.add_argument("--methods", nargs="+", default=["assisted", "assisted-default", "thread", "process", "sync"],
                        choices=["assisted", "assisted-default", "thread", "process", "auto", "sync"],
                        help="which methods besides plain to run (assisted: fixed K; assisted-default: transformers' "
                        "own schedule)")
    parser.add_argument("--json", help="write every figure to this JSON file")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()
    target, draft, tokenizer, desc = load_pair(args)
    input_ids = make_prompt(args, target, tokenizer)
    runner = Runner(args, target, draft, input_ids)
    methods = build_methods(args, runner)
    n_new = args.max_new_tokens

    print(f"# {desc}")
    print(f"# target {params_m(target):.1f}M params, draft {params_m(draft):.1f}M params; prompt {input_ids.shape[1]} "
          f"tokens; N={n_new} new tokens; greedy; {args.repeats} repeats")
    print(f"# torch {torch.__version__}, {os.cpu_count()} CPUs; threads: plain/assisted {args.threads}; ssd-thread "
          f"draft {runner.draft_threads} + target {runner.target_threads}; ssd-sync {args.threads} (alternating)")
    omp = os.environ.get("OMP_WAIT_POLICY")
    print(f"# load average before: {load_before[0]:.2f} (1 min); OMP_WAIT_POLICY={omp}")
    if args.threads > 1 and not omp:
        print("# warning: with >1 intra-op thread on a busy machine libgomp's spin-waiting can slow every op down "
              "several-fold; consider OMP_WAIT_POLICY=PASSIVE (or --threads 1)")

    reference = None
    for m in methods:  # warm-up, and the reference output
        out, seconds, _ = runner.call(m, n_new)
        runner.call(m, 1)
        if m.kind == "plain":
            reference = out
        print(f"# warm-up {m.name}: {seconds:.2f}s", file=sys.stderr)
    for rep in range(args.repeats):
        shift = rep % len(methods)
        for m in methods[shift:] + methods[:shift]:
            out, seconds, metrics = runner.call(m, n_new)
            _, first, _ = runner.call(m, 1)
            m.e2e_s.append(seconds)
            m.first_s.append(first)
            m.new_tokens.append(out.shape[1] - input_ids.shape[1])
            m.identical.append(bool(out.shape == reference.shape and torch.equal(out, reference)))
            if metrics is not None:
                m.metrics.append(metrics)
        print(f"# repeat {rep + 1}/{args.repeats} done", file=sys.stderr)

    summary = summarise(methods)
    load_after = os.getloadavg()
    if any(n < n_new for m in methods for n in m.new_tokens):
        print("# note: some runs stopped before N tokens (EOS); tok/s uses the tokens actually generated")
    print_tables(summary, methods)
    summary["predictions"] = print_critical_paths(args, runner, methods)
    print(
        "\nDecode tok/s excludes prefill: (new tokens − 1) / (time(N) − time(1)), both timed per repeat with "
        "perf_counter; time(1) is a separate generate(max_new_tokens=1) call (prefill, the draft's prefill and first "
        "speculation for SD/SSD, the first token). e2e tok/s = new tokens / time(N). Ratios use decode medians. "
        "SSD metrics seconds cover the whole N-token call (first round included)."
    )
    print(f"# load average after: {load_after[0]:.2f} (1 min)")
    if args.json:
        payload = {
            "args": vars(args), "description": desc, "torch": torch.__version__, "python": platform.python_version(),
            "cpus": os.cpu_count(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "load_average_before": load_before, "load_average_after": load_after,
            "prompt_tokens": input_ids.shape[1],
            "threads": {"plain": args.threads, "assisted": args.threads, "ssd_thread_draft": runner.draft_threads,
                        "ssd_thread_target": runner.target_threads, "ssd_sync": args.threads},
            **summary,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2, default=str))
        print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
