"""Where does one SSD round spend its time? Per-phase timers around hf_ssd's hot loop (no edits to hf_ssd).

Wraps, at run time, the drafter's phases (begin / prepare: glue forward, fork, tree steps / resolve: lookup and the
just-in-time backup), `DraftCache.forward` (mask building vs the model call vs bookkeeping), the target side
(`_target_scores`: the target forward vs input preparation and logits processors; greedy verification; `_emit`;
cache update) and the executor's submit/result hand-offs, then runs one SSD generation and prints per-round means.
With `--executor sync` and one thread every phase runs serially, so the figures add up to the wall time.

Usage (from the project root)::

    .venv/bin/python benchmarks/round_breakdown.py                         # random pair, K=3, B=8, sync
    .venv/bin/python benchmarks/round_breakdown.py --draft self --lookahead 4 --budget 16 --executor thread
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import hf_ssd.cache.draft_cache as draft_cache_mod  # noqa: E402
import hf_ssd.generation.candidate_generator as cg_mod  # noqa: E402
import hf_ssd.generation.decoding as decoding_mod  # noqa: E402
from hf_ssd import SSDConfig, enable_ssd  # noqa: E402

TIMES: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
LOCK = threading.Lock()
TLS = threading.local()


def add(name: str, seconds: float) -> None:
    with LOCK:
        TIMES[name][0] += 1
        TIMES[name][1] += seconds


def timed(name_fn, fn):
    """Wrap `fn`; `name_fn()` (evaluated at call time) or a fixed string names the timer."""

    def wrapper(*args, **kwargs):
        name = name_fn() if callable(name_fn) else name_fn
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            add(name, time.perf_counter() - start)

    return wrapper


def phase_wrapper(phase: str, fn):
    def wrapper(*args, **kwargs):
        previous = getattr(TLS, "phase", None)
        TLS.phase, TLS.index = phase, 0
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            add(f"draft.{phase} (total)", time.perf_counter() - start)
            TLS.phase = previous

    return wrapper


def instrument(target, draft) -> None:
    gen = cg_mod.SaguaroCandidateGenerator
    gen.begin = phase_wrapper("begin", gen.begin)
    gen.prepare = phase_wrapper("prepare", gen.prepare)
    gen.resolve = phase_wrapper("resolve", gen.resolve)
    gen._draft_just_in_time = timed("draft.resolve.jit_backup (total)", gen._draft_just_in_time)
    cg_mod.SpeculationCache = type("TimedSpecCache", (cg_mod.SpeculationCache,), {
        "__init__": timed("draft.prepare.spec_cache_build", cg_mod.SpeculationCache.__init__)})
    for name in ("causal_visibility", "tree_step_visibility", "tree_step_positions"):
        setattr(cg_mod, name, timed(f"draft.visibility ({name})", getattr(cg_mod, name)))
    if hasattr(cg_mod, "fork_candidates"):  # absent in older hf_ssd versions
        cg_mod.fork_candidates = timed("draft.prepare.fork_candidates", cg_mod.fork_candidates)
    if hasattr(gen, "_top"):
        gen._top = timed("draft.top_w (topk per forward)", gen._top)
    if hasattr(draft_cache_mod.DraftCache, "keep"):
        draft_cache_mod.DraftCache.keep = timed("draft.resolve.keep_branch_kv", draft_cache_mod.DraftCache.keep)
    draft_cache_mod.additive_mask = timed("draft.forward.additive_mask", draft_cache_mod.additive_mask)

    original_forward = draft_cache_mod.DraftCache.forward

    def cache_forward(self, *args, **kwargs):
        phase = getattr(TLS, "phase", None) or "other"
        if phase == "prepare":
            label = "glue" if TLS.index == 0 else "tree_step"
        elif phase == "resolve":
            label = "jit_step"
        else:
            label = "forward"
        TLS.index = getattr(TLS, "index", 0) + 1
        TLS.in_draft = True
        start = time.perf_counter()
        try:
            return original_forward(self, *args, **kwargs)
        finally:
            TLS.in_draft = False
            add(f"draft.{phase}.{label} (DraftCache.forward)", time.perf_counter() - start)

    draft_cache_mod.DraftCache.forward = cache_forward

    def model_forward(module, label):
        inner = module.forward

        def wrapper(*args, **kwargs):
            name = "draft.forward.model_call" if getattr(TLS, "in_draft", False) else f"{label}.model_forward"
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                add(name, time.perf_counter() - start)

        module.forward = wrapper

    model_forward(target, "target")
    if draft is not target:
        model_forward(draft, "target(?)")
    decoding_mod._target_scores = timed("target._target_scores (total)", decoding_mod._target_scores)
    decoding_mod.greedy_verify = timed("target.greedy_verify", decoding_mod.greedy_verify)
    decoding_mod._emit = timed("target._emit", decoding_mod._emit)
    target._update_model_kwargs_for_generation = timed(
        "target._update_model_kwargs", target._update_model_kwargs_for_generation
    )

    runtime = decoding_mod.DraftRuntime
    original_submit = runtime.submit

    def submit(self, fn, *args):
        start = time.perf_counter()
        future = original_submit(self, fn, *args)
        add("main.submit", time.perf_counter() - start)
        original_result = future.result

        def result(timeout=None):
            start = time.perf_counter()
            try:
                return original_result(timeout)
            finally:
                add(f"main.result({getattr(fn, '__name__', '?')}) wait", time.perf_counter() - start)

        future.result = result
        return future

    runtime.submit = submit


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", help="'self' (the target drafts for itself); default: the random pair's draft")
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--upper-scale", type=float, default=1.0,
                        help="scale the target's layers above the draft's (see bench_core.py --upper-scale)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--lookahead", type=int, default=3)
    parser.add_argument("--budget", type=int, default=8)
    parser.add_argument("--executor", default="sync", choices=["sync", "thread"])
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (sync: shared; thread: each)")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_core import scale_upper_layers, truncated_draft

    from hf_ssd.cli import _random_pair

    target, draft, _ = _random_pair()
    if args.upper_scale != 1.0:
        scale_upper_layers(target, args.draft_layers, args.upper_scale)
    if args.draft == "self":
        draft = target
    elif args.draft_layers != draft.config.num_hidden_layers:
        draft = truncated_draft(target, args.draft_layers)
    enable_ssd(target)
    ids = torch.randint(0, target.config.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(1))
    torch.set_num_threads(args.threads)
    config = SSDConfig(lookahead=args.lookahead, fanout_budget=args.budget, executor=args.executor,
                       draft_threads=args.threads, target_threads=args.threads)
    common = dict(assistant_model=draft, ssd_config=config, max_new_tokens=args.max_new_tokens, do_sample=False)
    target.generate(ids, **common)  # warm-up, uninstrumented
    instrument(target, draft)
    start = time.perf_counter()
    target.generate(ids, **common)
    wall = time.perf_counter() - start
    metrics = target.ssd_metrics
    rounds = metrics.rounds
    import hf_ssd

    print(f"# hf_ssd from {Path(hf_ssd.__file__).parent}")
    print(f"# draft={'self' if draft is target else f'{draft.config.num_hidden_layers} layers'} K={args.lookahead} "
          f"B={args.budget} executor={args.executor} threads={args.threads}: {rounds} rounds, "
          f"hit rate {metrics.cache_hit_rate:.2f}, mean accepted length {metrics.mean_accepted_length:.2f}, "
          f"wall {wall * 1e3:.0f} ms ({args.max_new_tokens / wall:.1f} tok/s), "
          f"metrics draft {metrics.draft_seconds * 1e3:.0f} ms, verify {metrics.verify_seconds * 1e3:.0f} ms, "
          f"target wait {metrics.target_wait_seconds * 1e3:.0f} ms")
    print("\n| timer | calls | total ms | ms/round | ms/call |")
    print("|---|---|---|---|---|")
    for name in sorted(TIMES):
        calls, total = TIMES[name]
        print(f"| {name} | {calls} | {total * 1e3:.1f} | {total * 1e3 / rounds:.2f} | {total * 1e3 / calls:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
