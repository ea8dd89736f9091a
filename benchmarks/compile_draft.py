"""Does compiling the draft cut its per-step time? The draft's two step kinds (glue: K+1 tokens per row; tree: B
branches per row) over a fixed-capacity KV at a given context, eager against `torch.compile`.

    python benchmarks/compile_draft.py                       # Qwen2.5-0.5B-shaped fp32 draft, random weights, CPU
    python benchmarks/compile_draft.py --device cuda --dtype bfloat16 --mode reduce-overhead

Prints one line per (step, mode): median ms per step, and the compile time of the first call.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from hf_ssd.cache.draft_cache import DraftCache, compiled_call
from hf_ssd.cache.tree_attention import causal_visibility

QWEN_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=2048)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_times(model, device, width: int, context: int, compiled, repeats: int) -> tuple[float, float]:
    """(median seconds of a `width`-token step at `context`, seconds of the first call)."""
    cache = DraftCache(model, rows=1, capacity=context + width * (repeats + 2) + 64, compiled=compiled,
                       compiled_widths=frozenset({width}))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (1, context), generator=gen).to(device)
    cache.forward(prompt, torch.arange(context, device=device)[None], causal_visibility(cache.valid, context))
    times = []
    for i in range(repeats + 1):
        tokens = torch.randint(0, model.config.vocab_size, (1, width), generator=gen).to(device)
        start_pos = context + i * width
        positions = start_pos + torch.arange(width, device=device)[None]
        _sync(device)
        start = time.perf_counter()
        cache.forward(tokens, positions, causal_visibility(cache.valid, width))
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]), times[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (the draft's share in SSD)")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--lookahead", "-K", type=int, default=4)
    parser.add_argument("--branches", "-B", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--mode", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM._from_config(Qwen2Config(**(TINY if args.tiny else QWEN_05B)),
                                              dtype=getattr(torch, args.dtype)).eval()
    compiled = compiled_call(model, args.backend, args.mode)
    print(f"draft: {'tiny' if args.tiny else 'Qwen2.5-0.5B-shaped'} {args.dtype} on {device}, {args.threads} "
          f"thread(s), context {args.context}, torch {torch.__version__}, backend {args.backend} mode {args.mode}")
    with torch.no_grad():
        for name, width in (("glue (K+1)", args.lookahead + 1), ("tree (B)", args.branches), ("backup (1)", 1)):
            eager, _ = step_times(model, device, width, args.context, None, args.repeats)
            fast, first = step_times(model, device, width, args.context, compiled, args.repeats)
            print(f"{name:12s} eager {1e3 * eager:8.2f} ms   compiled {1e3 * fast:8.2f} ms   "
                  f"ratio {eager / fast:5.2f}x   (first compiled call {first:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
