"""Where SSD's plain rounds lose time against plain decoding on a device: AR against SSD per executor with a draft
that agrees with nothing, so the policy settles on plain steps (K = 0) and SSD should cost what AR does.

    python benchmarks/gpu_plain_rounds.py --out plain_rounds/                 # on a GPU: the Llama-3.1-8B-shaped pair
    python benchmarks/gpu_plain_rounds.py --device cpu --tiny --out /tmp/x    # the same code path in seconds

The pair is gpu_check's (random weights; its draft, the target's first layers, agrees with nothing in bf16).
Written to --out: plain_rounds.json (tok/s, ratio to AR, the share of plain rounds, the per-round phases and the
median host time of a one-position target forward, per batch size and executor) and profile.txt (cProfile of
one short SSD generation on the inline executor: the draft's start and the first rounds, everything on one thread,
by own time and by hf_ssd's cumulative time). On one H200 (2026-12-04) this found the draft-thread hand-offs of
paused rounds (now inline), then measured plain stretches (0.56-0.59x AR at batch 1 before, 0.64-1.01x after), and
left open why SSD's one-position target forwards sometimes spend far more host time than AR's (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check  # noqa: E402  (the pair)

from hf_ssd import SSDConfig  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    parser.add_argument("--executors", default="thread,stream")
    parser.add_argument("--out", type=Path, default=Path("plain_rounds"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    target, draft = gpu_check.build_pair(device, dtype, args.tiny, 1 if args.tiny else 2)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    vocab, width = target.config.vocab_size, 12 if args.tiny else 128
    args.out.mkdir(parents=True, exist_ok=True)
    forwards: list[tuple[int, float]] = []
    forward = type(target).forward

    def timed(self, *a, **k):  # host time of each target forward (one position: a plain step)
        start = time.perf_counter()
        out = forward(self, *a, **k)
        if self is target and k.get("input_ids") is not None:
            forwards.append((k["input_ids"].shape[1], time.perf_counter() - start))
        return out

    def generate(ids, new_tokens, kwargs):
        return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                               pad_token_id=0, **kwargs)

    def ssd(executor):
        return dict(assistant_model=draft, ssd_config=SSDConfig(lookahead=4, executor=executor))

    type(target).forward = timed
    try:
        ids = torch.randint(1, vocab, (1, width), generator=torch.Generator().manual_seed(0)).to(device)
        generate(ids, 8, ssd("sync"))
        sync()
        profile = cProfile.Profile()
        profile.enable()
        generate(ids, 8, ssd("sync"))
        sync()
        profile.disable()
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats("tottime").print_stats(35)
        stats.sort_stats("cumtime").print_stats("hf_ssd", 45)
        (args.out / "profile.txt").write_text(text.getvalue())
        results = []
        for batch in args.batch_sizes:
            ids = torch.randint(1, vocab, (batch, width), generator=torch.Generator().manual_seed(batch)).to(device)
            for name in ["ar"] + [f"ssd-{e}" for e in args.executors.split(",")]:
                kwargs = {} if name == "ar" else ssd(name.removeprefix("ssd-"))
                generate(ids, args.new_tokens, kwargs)  # warm-up
                seconds = []
                for _ in range(2):
                    forwards.clear()
                    sync()
                    start = time.perf_counter()
                    generate(ids, args.new_tokens, kwargs)
                    sync()
                    seconds.append(time.perf_counter() - start)
                plain = [s for n, s in forwards if n == 1]
                row = dict(name=name, batch=batch, tok_s=args.new_tokens * batch / min(seconds),
                           plain_forward_ms=1e3 * statistics.median(plain) if plain else None)
                if name != "ar":
                    m = target.ssd_metrics.to_dict()
                    k = m["lookahead_per_round"]
                    row.update(plain_round_share=sum(x == 0 for x in k) / len(k),
                               phases_ms={p: 1e3 * v / m["rounds"] for p, v in m["target_phase_seconds"].items()})
                ar = next(r for r in results + [row] if r["name"] == "ar" and r["batch"] == batch)
                row["vs_ar"] = row["tok_s"] / ar["tok_s"]
                results.append(row)
                print(f"b={batch} {name}: {row['tok_s']:.1f} tok/s, x{row['vs_ar']:.3f} AR, plain forward "
                      f"{row['plain_forward_ms'] or 0:.2f} ms", flush=True)
                (args.out / "plain_rounds.json").write_text(json.dumps(results, indent=1))
    finally:
        type(target).forward = forward
    return 0


if __name__ == "__main__":
    sys.exit(main())
