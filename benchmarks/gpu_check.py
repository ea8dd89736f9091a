"""The one-shot device check: SSD against plain decoding and transformers' assisted generation on one machine.

    python benchmarks/gpu_check.py --out gpu_check/                 # on a GPU: a Llama-3.1-8B-shaped bf16 pair
    python benchmarks/gpu_check.py --device cpu --tiny --out /tmp/x  # the same code path in seconds (CI runs it)

No hub access: the pair is built from configs with random weights. The target is Llama-3.1-8B-shaped; the draft is
the target's embeddings, first layers, final norm and head (copied). Measured on an H200 (2026-12-04), that draft
agrees with nothing in bf16 (accepted length 1.00: random logits are near-flat, so the deeper layers flip every
argmax), which makes this the never-slower check with a useless draft, not a speed-up check; greedy exactness
against AR holds in fp32 only (`--dtype float32`). It runs AR, transformers' assisted generation at each fixed K
(and its default schedule), and SSD under each executor (thread, stream; process for a CPU draft; the stream
executor with the draft compiled and not), at b = 1 and 4, greedy and T = 0.7, inside a time budget (what does not
fit is listed as skipped). Written to --out: gpu_check.json and gpu_check.md with tok/s, ratios to AR and to SD's
best, exactness against AR (greedy), the target's idle fraction and the draft's overlap, the per-round breakdown and
peak memory.

On the workplace's device machine (torch 2.11, transformers 5.17, no network; hf_ssd needs transformers >= 5.23;
its other needs, huggingface_hub 1.33, tokenizers 0.23.2, safetensors 0.8, accelerate 1.15, are there), bring the
transformers wheel along (11 MB):

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: -d .whl transformers==5.24.0
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
        -d .whl regex==2025.11.3  # transformers 5.24 asks for regex >= 2025.10.22
    # device run, carry [".whl"], timeout_s 540:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
        PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out $OUT --budget-s 420
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

import hf_ssd
from hf_ssd import SSDConfig, enable_ssd

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=1024)


def build_pair(device: torch.device, dtype: torch.dtype, tiny: bool, draft_layers: int, seed: int = 0):
    """(target, draft): a random Llama-shaped target and a draft made of its first `draft_layers` layers."""
    shape = dict(TINY if tiny else LLAMA_8B, bos_token_id=None, eos_token_id=None, pad_token_id=0,
                 tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(device):
        target = LlamaForCausalLM._from_config(LlamaConfig(**shape), dtype=dtype).eval()
        draft = LlamaForCausalLM._from_config(LlamaConfig(**dict(shape, num_hidden_layers=draft_layers)),
                                              dtype=dtype).eval()
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        for mine, theirs in zip(draft.model.layers, target.model.layers):
            mine.load_state_dict(theirs.state_dict())
        draft.model.norm.weight.copy_(target.model.norm.weight)
        draft.lm_head.weight.copy_(target.lm_head.weight)
    for model in (target, draft):
        model.generation_config.pad_token_id = 0
        model.generation_config.eos_token_id = None
    return enable_ssd(target), draft


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclasses.dataclass
class Case:
    method: str  # "ar", "sd-k<K>", "sd-default", "ssd-<executor>[-compiled]"
    batch: int
    sampling: bool
    lookahead: int | None = None
    executor: str | None = None
    compiled: bool = False

    @property
    def key(self) -> str:
        return f"{self.method}@b{self.batch}{'-T0.7' if self.sampling else ''}"


def cases(args, device: torch.device) -> list[Case]:
    executors = ["thread", "stream"] + (["process"] if device.type == "cpu" else [])
    compile_modes = [False, True] if "compile_draft" in {f.name for f in dataclasses.fields(SSDConfig)} else [False]
    out = []
    for sampling in (False, True):
        for batch in args.batch_sizes:
            out.append(Case("ar", batch, sampling))
            if batch == 1:  # transformers' assisted generation runs batch 1 only
                out += [Case(f"sd-k{k}", 1, sampling, lookahead=k) for k in args.sd_lookaheads]
                out.append(Case("sd-default", 1, sampling))
            out += [Case(f"ssd-{executor}", batch, sampling, args.lookahead, executor) for executor in executors]
    # The stream executor (auto's choice on a GPU) with the draft compiled comes last: its compile time must not
    # crowd the other runs out of the time budget.
    out += [Case("ssd-stream-compiled", c.batch, c.sampling, args.lookahead, "stream", True)
            for c in out if c.method == "ssd-stream" and True in compile_modes]
    return out


def run_case(case: Case, target, draft, prompts: torch.Tensor, args, device) -> dict:
    ids = prompts[: case.batch]
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=case.sampling, pad_token_id=0,
                  attention_mask=torch.ones_like(ids))
    if case.sampling:
        kwargs.update(temperature=0.7, top_k=0, top_p=1.0)
    config = draft.generation_config
    saved = (config.num_assistant_tokens, config.num_assistant_tokens_schedule)
    if case.method.startswith("sd-k"):
        config.num_assistant_tokens, config.num_assistant_tokens_schedule = case.lookahead, "constant"
        kwargs["assistant_model"] = draft
    elif case.method == "sd-default":
        kwargs["assistant_model"] = draft
    elif case.method.startswith("ssd"):
        fields = dict(lookahead=case.lookahead, executor=case.executor, fanout_budget=args.fanout_budget)
        if case.compiled:
            fields.update(compile_draft=True, compile_backend=args.compile_backend)
        kwargs.update(assistant_model=draft, ssd_config=SSDConfig(**fields))
    try:
        seconds, out, metrics = [], None, None
        for repeat in range(args.repeats + 1):  # the first call warms up (compiles, allocates)
            torch.manual_seed(repeat)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            _sync(device)
            start = time.perf_counter()
            out = target.generate(ids, **kwargs)
            _sync(device)
            if repeat:
                seconds.append(time.perf_counter() - start)
            metrics = getattr(target, "ssd_metrics", None) if case.method.startswith("ssd") else None
    finally:
        config.num_assistant_tokens, config.num_assistant_tokens_schedule = saved
    new = out[:, ids.shape[1]:]
    best = min(seconds)
    result = dict(key=case.key, **dataclasses.asdict(case), seconds=best, new_tokens=int(new.numel()),
                  tok_s=new.numel() / best, tokens=new.tolist())
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if metrics is not None:
        m = metrics.to_dict() if hasattr(metrics, "to_dict") else dict(metrics)
        wall = m.get("wall_seconds") or best
        draft_s = m.get("draft_seconds") or 0.0
        wait = m.get("target_wait_seconds") or 0.0
        result.update(
            hit_rate=m.get("cache_hit_rate"), accepted_length=m.get("mean_accepted_length"),
            target_idle=wait / wall if wall else None,
            overlap=(1 - wait / draft_s) if draft_s else None,
            rounds=m.get("rounds"), target_phase_ms={k: 1e3 * v / max(1, m.get("rounds") or 1)
                                                     for k, v in (m.get("target_phase_seconds") or {}).items()},
            lookahead_per_round=m.get("lookahead_per_round"),
        )
    return result


def exactness(results: list[dict]) -> None:
    """Greedy runs: the fraction of rows whose tokens equal AR's at the same batch size, and the first divergence."""
    reference = {r["batch"]: r["tokens"] for r in results if r["method"] == "ar" and not r["sampling"]}
    for r in results:
        if r["sampling"] or r["batch"] not in reference or r["method"] == "ar":
            continue
        rows = list(zip(r["tokens"], reference[r["batch"]]))
        r["identical_rows"] = sum(a == b for a, b in rows) / len(rows)
        firsts = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in rows]
        diverged = [f for f in firsts if f is not None]
        r["first_divergence"] = min(diverged) if diverged else None


def ratios(results: list[dict]) -> None:
    by = {(r["method"], r["batch"], r["sampling"]): r for r in results}
    for r in results:
        ar = by.get(("ar", r["batch"], r["sampling"]))
        r["vs_ar"] = r["tok_s"] / ar["tok_s"] if ar else None
        sd = [x for (m, b, s), x in by.items() if m.startswith("sd-") and b == 1 and s == r["sampling"]]
        best = max(sd, key=lambda x: x["tok_s"]) if sd else None
        r["vs_sd_best"] = r["tok_s"] / best["tok_s"] if best and r["batch"] == 1 else None
        r["sd_best"] = best["method"] if best and r["batch"] == 1 else None


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        "# hf_ssd device check", "",
        f"- device: {env['device_name']}; torch {env['torch']}, transformers {env['transformers']}, "
        f"hf_ssd {env['hf_ssd']}; {env['dtype']}",
        f"- pair: {report['pair']}",
        f"- {report['settings']['max_new_tokens']} new tokens, prompts of {report['settings']['prompt_tokens']} "
        f"tokens, K = {report['settings']['lookahead']}, B = {report['settings']['fanout_budget']}; best of "
        f"{report['settings']['repeats']} after a warm-up; wall {report['wall_seconds']:.0f} s",
        "",
        "| run | tok/s | ×AR | ×SD best (K) | identical to AR | hit rate | acc. len | target idle | overlap | "
        "peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(value, fmt="{:.2f}"):
        return "–" if value is None else fmt.format(value)

    for r in report["results"]:
        sd = f"{cell(r.get('vs_sd_best'))} ({r['sd_best']})" if r.get("vs_sd_best") is not None else "–"
        lines.append(
            f"| {r['key']} | {r['tok_s']:.1f} | {cell(r.get('vs_ar'))} | {sd} | "
            f"{cell(r.get('identical_rows'), '{:.0%}')} | {cell(r.get('hit_rate'))} | "
            f"{cell(r.get('accepted_length'))} | {cell(r.get('target_idle'), '{:.0%}')} | "
            f"{cell(r.get('overlap'), '{:.0%}')} | {cell(r.get('peak_memory_gib'), '{:.1f}')} |"
        )
    if report["skipped"]:
        lines += ["", f"Skipped (time budget or not supported): {', '.join(report['skipped'])}"]
    for f in report.get("failed", []):
        lines += ["", f"Failed: {f['key']}: {f['error']}"]
    lines += ["", "Per-round target phases of the SSD runs (ms per round):", ""]
    for r in report["results"]:
        if r.get("target_phase_ms"):
            phases = ", ".join(f"{k} {v:.2f}" for k, v in r["target_phase_ms"].items())
            lines.append(f"- {r['key']}: {phases}")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny models (seconds; what the test suite runs)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="the pair's dtype (default: float32 on a CPU, bfloat16 on an accelerator)")
    parser.add_argument("--out", type=Path, default=Path("gpu_check"))
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--prompt-tokens", type=int, default=None)
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    parser.add_argument("--lookahead", "-K", type=int, default=4)
    parser.add_argument("--fanout-budget", "-B", type=int, default=8)
    parser.add_argument("--sd-lookaheads", type=lambda s: [int(x) for x in s.split(",")], default=None)
    parser.add_argument("--draft-layers", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend of the compiled-draft runs (the test suite uses aot_eager)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting new runs after this long")
    args = parser.parse_args(argv)
    args.max_new_tokens = args.max_new_tokens or (16 if args.tiny else 128)
    args.prompt_tokens = args.prompt_tokens or (12 if args.tiny else 128)
    args.sd_lookaheads = args.sd_lookaheads or ([2, 4] if args.tiny else [3, 5, 8])
    args.draft_layers = args.draft_layers or (1 if args.tiny else 2)
    args.repeats = args.repeats or (1 if args.tiny else 2)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else torch.float32 if device.type == "cpu" else torch.bfloat16
    target, draft = build_pair(device, dtype, args.tiny, args.draft_layers)
    vocab = target.config.vocab_size
    prompts = torch.randint(1, vocab, (max(args.batch_sizes), args.prompt_tokens),
                            generator=torch.Generator().manual_seed(0)).to(device)
    results, skipped, failed = [], [], []
    for case in cases(args, device):
        if time.perf_counter() - started > args.budget_s:
            skipped.append(case.key)
            continue
        try:
            results.append(run_case(case, target, draft, prompts, args, device))
        except (NotImplementedError, ValueError) as err:  # e.g. an executor not available here
            skipped.append(f"{case.key} ({err})")
        except Exception as err:  # noqa: BLE001 - one broken run must not cost the others on a short lease
            failed.append(dict(key=case.key, error=repr(err), traceback=traceback.format_exc()))
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(f"{case.key}: {results[-1]['tok_s']:.1f} tok/s" if results and results[-1]["key"] == case.key
              else f"{case.key}: {'failed' if failed and failed[-1]['key'] == case.key else 'skipped'}", flush=True)
        write_report(args, device, dtype, results, skipped, failed, started)  # a run cut short still reports
    report = write_report(args, device, dtype, results, skipped, failed, started)
    print(markdown(report))
    return 1 if failed else 0


def write_report(args, device, dtype, results, skipped, failed, started) -> dict:
    """Ratios and exactness over the runs so far, written to --out as gpu_check.json and gpu_check.md."""
    results = [dict(r) for r in results]
    exactness(results)
    ratios(results)
    report = dict(
        environment=dict(
            device=str(device), torch=torch.__version__, transformers=transformers.__version__,
            device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
            hf_ssd=hf_ssd.__version__, python=sys.version.split()[0], dtype=str(dtype),
        ),
        pair=("tiny Llama (4 layers) / its first layer" if args.tiny else
              f"Llama-3.1-8B-shaped random target / its embeddings + first {args.draft_layers} layers + head"),
        settings=dict(max_new_tokens=args.max_new_tokens, prompt_tokens=args.prompt_tokens, lookahead=args.lookahead,
                      fanout_budget=args.fanout_budget, repeats=args.repeats, batch_sizes=args.batch_sizes,
                      sd_lookaheads=args.sd_lookaheads),
        results=results, skipped=skipped, failed=failed, wall_seconds=time.perf_counter() - started,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    for r in results:
        r.pop("tokens", None)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    (args.out / "gpu_check.md").write_text(markdown(report))
    return report


if __name__ == "__main__":
    sys.exit(main())
