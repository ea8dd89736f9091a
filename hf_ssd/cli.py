"""The `hf-ssd` command: `hf-ssd demo` runs SSD next to plain decoding and prints what happened."""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

COMMANDS: dict[str, tuple[str, callable, callable]] = {}


def command(name: str, help: str, arguments=None):
    """Register `fn(args) -> exit code` as subcommand `name`; `arguments(parser)` declares its options."""

    def wrap(fn):
        COMMANDS[name] = (help, fn, arguments or (lambda parser: None))
        return fn

    return wrap


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="target model: hub id, local folder or a fetched short name such as "
                        "qwen2.5-coder-1.5b (see `hf-ssd models`); default: a random Llama")
    parser.add_argument("--draft", help="draft model, same forms (e.g. qwen2.5-coder-0.5b); default: with --target, "
                        "the target itself, else the random Llama's first two layers")
    parser.add_argument("--prompt", default="Write a Python function that checks whether a number is prime.",
                        help="prompt text (needs a tokenizer; chat models get their chat template)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--lookahead", type=int, default=None)
    parser.add_argument("--budget", type=int, default=None)
    parser.add_argument("--executor", default="auto", choices=["auto", "process", "thread", "sync"])
    parser.add_argument("--draft-precision", default="int8", choices=["fp32", "int8"],
                        help="CPU precision of the draft; int8 keeps the output exact (default: int8)")
    parser.add_argument("--target-precision", default="auto", choices=["auto", "fp32", "fp32-packed", "int8"],
                        help="CPU precision of the target: fp32-packed is fp32 through oneDNN's packed kernels "
                        "(verifying K+1 tokens costs about one); int8 is faster but not batch-invariant; auto: "
                        "fp32-packed where it measures faster on this machine, else fp32 (default: auto)")
    parser.add_argument("--batch-size", type=int, default=1,
                        help="decode this many prompts together (the prompt plus built-in coding prompts), "
                        "left-padded: plain batched decoding against SSD on the batch (default 1)")
    parser.add_argument("--json", action="store_true", help="print the SSD metrics as JSON")


# Extra prompts for `hf-ssd demo --batch-size N`: short coding tasks of different lengths.
BATCH_PROMPTS = (
    "Write a Python function that reverses a linked list.",
    "Implement binary search over a sorted list in Python and explain the loop invariant.",
    "Write a Python class for a stack with push, pop and peek.",
    "Write a function that returns the n-th Fibonacci number iteratively.",
    "Parse a CSV line with quoted fields in Python without the csv module.",
    "Write a Python function that merges two sorted lists.",
    "Count the words in a string and return the five most common ones.",
)


def _encode(tokenizer, prompt: str):
    """Token ids [n] of one prompt: the chat template with a generation prompt when the tokenizer has one."""
    if tokenizer.chat_template:
        messages = [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True).input_ids[0]
    return tokenizer(prompt, return_tensors="pt").input_ids[0]


def _demo_inputs(tokenizer, prompt: str, batch_size: int, vocab_size: int) -> dict:
    """`generate()` inputs for the demo: one prompt, or a left-padded batch of `batch_size` prompts."""
    import torch

    from .bench.batch_sweep import left_pad

    if tokenizer is None:
        generator = torch.Generator().manual_seed(1)
        rows = [torch.randint(0, vocab_size, (16 - 3 * (i % 4),), generator=generator) for i in range(batch_size)]
        pad_id = 0
    else:
        prompts = [prompt, *BATCH_PROMPTS][:batch_size]
        prompts += [BATCH_PROMPTS[i % len(BATCH_PROMPTS)] for i in range(batch_size - len(prompts))]
        rows = [_encode(tokenizer, text) for text in prompts]
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if batch_size == 1:
        return {"input_ids": rows[0][None]}
    input_ids, attention_mask = left_pad(rows, pad_id)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "pad_token_id": pad_id}


def _random_pair():
    """A random medium Llama and a draft made of its first two layers (same embeddings and head)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=2048, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    target = LlamaForCausalLM(config).eval()
    draft_config = LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 2})
    draft = LlamaForCausalLM(draft_config).eval()
    state = {k: v for k, v in target.state_dict().items() if not k.startswith("model.layers.")
             or int(k.split(".")[2]) < 2}
    draft.load_state_dict(state)
    return target, draft, None


def _load_pair(args):
    if not args.target:
        return _random_pair()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .models import resolve_model

    target_path = resolve_model(args.target)
    target = AutoModelForCausalLM.from_pretrained(target_path).eval()
    draft = AutoModelForCausalLM.from_pretrained(resolve_model(args.draft or args.target)).eval()
    return target, draft, AutoTokenizer.from_pretrained(target_path)


class _TokenBar:
    """A tqdm bar over one generate() call, fed by its streamer at batch 1 (transformers streams batch 1 only);
    at batch > 1 the bar completes when the call returns."""

    def __init__(self, desc: str, total: int, rows: int):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total * rows, desc=desc, unit="tok", leave=False, file=sys.stderr)
        self.rows, self._prompt = rows, True

    def streamer(self):
        return self if self.rows == 1 else None

    def put(self, value) -> None:  # transformers' streamer protocol: the prompt first, then each emission
        if self._prompt:
            self._prompt = False
            return
        self.bar.update(int(value.numel()))

    def end(self) -> None:
        self._prompt = True  # the next generate() call (assisted decoding runs rows one by one) streams its prompt

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.bar.update(self.bar.total - self.bar.n)
        self.bar.close()


class _QuietAssistantConfig:
    """Drop transformers' notice about its own assistant call (it passes a generation_config together with
    generation arguments to the draft's generate(), inside assisted generation): nothing the demo can change."""

    def filter(self, record) -> bool:
        return "Passing `generation_config` together with" not in record.getMessage()


@command("demo", "run SSD next to plain greedy decoding and check the output is identical", _demo_arguments)
def demo(args) -> int:
    import torch

    from . import SSDConfig, enable_ssd
    from .packing import packed_pad_rows
    from .precision import apply_precision, count_parameters, decide_precision, describe_decision

    target, draft, tokenizer = _load_pair(args)
    args.target_precision, speedup = decide_precision(target, args.target_precision,
                                                      (args.lookahead or SSDConfig().lookahead) + 1)
    if draft is target and args.draft_precision != args.target_precision:
        draft = copy.deepcopy(target)
    target = enable_ssd(apply_precision(target, args.target_precision))
    draft = apply_precision(draft, args.draft_precision)
    if args.batch_size < 1:
        raise SystemExit(f"--batch-size must be >= 1; got {args.batch_size}")
    inputs = _demo_inputs(tokenizer, args.prompt, args.batch_size, target.config.vocab_size)
    input_ids = inputs["input_ids"]
    defaults = SSDConfig()
    config = SSDConfig(
        lookahead=args.lookahead or defaults.lookahead, fanout_budget=args.budget or defaults.fanout_budget,
        executor=args.executor,
    )
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=False, **{k: v for k, v in inputs.items()
                                                                         if k != "input_ids"})
    import logging

    from tqdm.auto import tqdm

    logging.getLogger("transformers.generation.utils").addFilter(_QuietAssistantConfig())
    rows = input_ids.shape[0]
    with _TokenBar("warm-up", 4, rows) as bar:
        target.generate(input_ids, streamer=bar.streamer(), **{**common, "max_new_tokens": 4})
    worker_s = None
    if config.executor == "process" and draft.device.type == "cpu":  # ("auto" starts one where it pays, itself)
        from .runtime import start_draft_worker
        from .runtime.pool import shareable

        if shareable(draft) is None:  # the draft's worker process, started once
            with tqdm(total=1, desc="starting the draft's worker process", leave=False, file=sys.stderr) as bar:
                worker_s = start_draft_worker(draft)
                bar.update(1)
    with _TokenBar("plain greedy", args.max_new_tokens, rows) as bar:
        start = time.perf_counter()
        plain = target.generate(input_ids, streamer=bar.streamer(), **common)
        plain_s = time.perf_counter() - start
    draft.generation_config.num_assistant_tokens = config.lookahead
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    # transformers' assisted generation runs batch size 1: the rows one after another
    mask = inputs.get("attention_mask")
    with _TokenBar(f"transformers assisted (K={config.lookahead})", args.max_new_tokens, rows) as bar:
        start = time.perf_counter()
        assisted = [target.generate(row[None] if mask is None else row[mask[i].bool()][None], assistant_model=draft,
                                    max_new_tokens=args.max_new_tokens, do_sample=False, streamer=bar)
                    for i, row in enumerate(input_ids)]
        assisted_s = time.perf_counter() - start
    with _TokenBar("SSD", args.max_new_tokens, rows) as bar:
        start = time.perf_counter()
        ssd = target.generate(input_ids, assistant_model=draft, ssd_config=config, streamer=bar.streamer(), **common)
        ssd_s = time.perf_counter() - start
    metrics = target.ssd_metrics
    width = input_ids.shape[1]
    eos = target.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])

    def new_tokens(rows) -> int:  # up to each row's EOS
        return sum(next((i + 1 for i, t in enumerate(r) if t in eos), len(r)) for r in rows)

    prompt_lengths = [width] * len(input_ids) if mask is None else mask.sum(dim=1).tolist()
    plain_new = new_tokens(plain[:, width:].tolist())
    assisted_new = new_tokens([a[0, n:].tolist() for a, n in zip(assisted, prompt_lengths)])
    ssd_new = new_tokens(ssd[:, width:].tolist())
    rows_alike = sum(torch.equal(p, s) for p, s in zip(plain, ssd))
    assisted_alike = torch.equal(assisted[0], plain) if args.batch_size == 1 else None
    print(f"target: {type(target).__name__} {count_parameters(target) / 1e6:.1f}M params "
          f"({describe_decision(args.target_precision, speedup, packed_pad_rows(target))}); "
          f"draft: {count_parameters(draft) / 1e6:.1f}M params ({args.draft_precision}); batch size {args.batch_size}")
    print(f"config: {config.to_json_string()}; SSD ran on executor {metrics.executor!r}"
          + (f" (its worker process started in {worker_s:.1f}s, once per interpreter)" if worker_s else ""))
    batch_note = " (batched)" if args.batch_size > 1 else ""
    print(f"plain greedy{batch_note:<17}: {plain_new / plain_s:8.2f} tok/s")
    print(f"transformers assisted (K={config.lookahead})   : {assisted_new / assisted_s:8.2f} tok/s  "
          f"({plain_s / assisted_s * assisted_new / max(plain_new, 1):.2f}x plain"
          + (", rows one after another)" if args.batch_size > 1 else ")"))
    print(f"SSD{batch_note:<26}: {ssd_new / ssd_s:8.2f} tok/s  "
          f"({ssd_new / ssd_s / (plain_new / plain_s):.2f}x plain, "
          f"{ssd_new / ssd_s / (assisted_new / assisted_s):.2f}x assisted)")
    print(f"SSD identical to plain greedy: {rows_alike}/{args.batch_size} rows"
          + (f"; assisted identical: {bool(assisted_alike)}" if assisted_alike is not None else ""))
    print(f"rounds {metrics.rounds}, cache hit rate {metrics.cache_hit_rate:.2f}, "
          f"mean accepted length {metrics.mean_accepted_length:.2f}, target waited {metrics.target_wait_seconds:.2f}s"
          + (f", auto backup: {metrics.backup_decision.get('choice', 'draft')}" if metrics.backup == "auto" else ""))
    if tokenizer is not None:
        print("---\n" + tokenizer.decode(ssd[0, width:], skip_special_tokens=True))
    if args.json:
        print(json.dumps(metrics.to_dict(), indent=2))
    return 0 if rows_alike == args.batch_size else 1


def _models_arguments(parser: argparse.ArgumentParser) -> None:
    from .models import CACHE_ENV

    sub = parser.add_subparsers(dest="models_command", required=True)
    fetch_parser = sub.add_parser("fetch", help="download, verify and convert the Qwen2.5-Coder target/draft pair")
    fetch_parser.add_argument("--which", choices=["target", "draft", "both"], default="both")
    fetch_parser.add_argument("--cache-dir", help=f"where converted models go (default: ${CACHE_ENV} or "
                                                  "~/.cache/hf_ssd/models)")
    fetch_parser.add_argument("--keep-gguf", action="store_true",
                              help="keep the joined GGUF in <cache>/gguf (a later fetch reuses it)")
    fetch_parser.add_argument("--force", action="store_true", help="convert again even if the folder exists")
    list_parser = sub.add_parser("list", help="show what is in the model cache")
    list_parser.add_argument("--cache-dir")
    list_parser.add_argument("--json", action="store_true")


@command("models", "fetch the Qwen2.5-Coder target/draft pair into the local cache (`fetch`), or `list` it",
         _models_arguments)
def models(args) -> int:
    from .models import ModelsError, cache_root, fetch, human_bytes, list_models

    try:
        if args.models_command == "fetch":
            roles = ["target", "draft"] if args.which == "both" else [args.which]
            for role in roles:
                folder = fetch(role, args.cache_dir, keep_gguf=args.keep_gguf, force=args.force)
                print(f"{role}: {folder}")
            return 0
        entries = list_models(args.cache_dir)
        if args.json:
            print(json.dumps(entries, indent=2))
            return 0
        root = cache_root(args.cache_dir)
        print(f"model cache: {root}")
        for entry in entries:
            state = f"{human_bytes(entry['bytes'])} {entry['dtype']}" if entry["fetched"] else "not fetched"
            print(f"  {entry['name']:<22} {entry['role'] or '-':<7} {state:<20} {entry['path']}")
        for kept in sorted((root / "gguf").glob("*.gguf")):
            print(f"  kept GGUF: {kept} ({human_bytes(kept.stat().st_size)})")
        return 0
    except ModelsError as error:
        print(f"hf-ssd models: error: {error}", file=sys.stderr)
        return 1


def _predict_arguments(parser: argparse.ArgumentParser) -> None:
    from .predict_cli import add_arguments

    add_arguments(parser)


@command("predict", "speed model: predicted SD/SSD speedups from latencies and statistics (CPU and H100)",
         _predict_arguments)
def predict(args) -> int:
    from .predict_cli import run_command

    return run_command(args)


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    from .bench import add_arguments

    add_arguments(parser)


@command("bench", "benchmark AR vs transformers' assisted generation (SD) vs SSD on prompt sets; writes JSON, "
         "Markdown and plots", _bench_arguments)
def bench(args) -> int:
    from .bench import run_command

    return run_command(args)


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    from .serving.command import add_arguments

    add_arguments(parser)


@command("serve", "an OpenAI-compatible server (transformers serve's) running SSD on every request, with "
         "Prometheus /metrics", _serve_arguments)
def serve(args) -> int:
    from .serving.command import run_command

    return run_command(args)


def main(argv: list[str] | None = None) -> int:
    # OpenMP threads spin only briefly for work (neither steal the other side's core nor sleep after every parallel
    # region, see hf_ssd.openmp.SPIN_COUNT); set before torch loads.
    from .openmp import openmp_wait_env

    os.environ.update(openmp_wait_env())
    parser = argparse.ArgumentParser(prog="hf-ssd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, _, add_arguments) in COMMANDS.items():
        add_arguments(sub.add_parser(name, help=help_text))
    args = parser.parse_args(argv)
    return COMMANDS[args.command][1](args)


if __name__ == "__main__":
    sys.exit(main())
