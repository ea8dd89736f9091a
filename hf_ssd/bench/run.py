"""The benchmark run: the environment it records, the interleaved loop, results on disk."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .aggregate import comparisons, summarise
from .common import DECODE_TIMING, FRAMING_TEXT, METHOD_KINDS, SCHEMA, _spread
from .measure import (
    BenchSettings,
    MethodSpec,
    RunRecord,
    build_methods,
    first_divergence,
    generate_once,
    reference_method,
)
from .predict import h100_predictions, measure_latencies, predictions
from .prompts import PromptSet, encode_prompt
from .report import render_markdown

# --- environment -------------------------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict[str, Any]:
    import torch
    import transformers

    from .. import __version__

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    return {
        "python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
        "transformers": transformers.__version__, "hf_ssd": __version__, "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(), "available_cores": cores, "torch_threads_default": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "hostname": platform.node(),
    }


def model_info(model, name: str | None, precision: str, params: int | None = None) -> dict[str, Any]:
    import torch

    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})
    quantized = any("quantized" in type(m).__module__ for m in model.modules())
    from ..packing import packed_pad_rows
    from ..precision import count_parameters

    counted = params if params is not None else count_parameters(model)
    pad_rows = packed_pad_rows(model)
    return {"name": name, "class": type(model).__name__, "params": counted, "precision": precision,
            **({"pad_rows": pad_rows} if pad_rows is not None else {}),
            "parameter_dtypes": dtypes, "int8_dynamic_linear": quantized, "torch_default_dtype":
            str(torch.get_default_dtype()).replace("torch.", ""), "vocab_size": model.config.vocab_size}


# --- the run -----------------------------------------------------------------------------------------------------


def run_bench(
    target, draft, tokenizer, prompt_sets: Sequence[PromptSet], settings: BenchSettings | None = None,
    out_dir: str | os.PathLike | None = None, progress: bool = True, log: Callable[[str], None] | None = None,
    plots: bool = True, info: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Measure every method on every prompt; write results.json, results.md and the plots to `out_dir` (if given).

    Returns the results dict (the content of results.json). `info` is merged in (models, command line).
    """
    from tqdm.auto import tqdm

    from ..generation import enable_ssd

    settings = settings or BenchSettings()
    log = log or (lambda text: tqdm.write(text, file=sys.stderr))
    target = enable_ssd(target)
    methods, roles = build_methods(settings.methods, settings.framing, settings.draft_threads,
                                   settings.target_threads, settings.sd_lookaheads)
    reference = reference_method(methods, settings.target_threads)
    started = time.time()
    load_before = os.getloadavg()
    encoded: list[tuple[PromptSet, int, Any]] = []
    for prompt_set in prompt_sets:
        for index, text in enumerate(prompt_set.prompts):
            encoded.append((prompt_set, index, encode_prompt(tokenizer, text)))
    if not encoded:
        raise ValueError("no prompts to run")

    # Warm-up: the draft's worker process (measured runs then see the executor "auto" settles on once a worker
    # runs), then every method once, on the first prompt, a few tokens.
    warm_ids = encoded[0][2]
    warm = {}
    from ..runtime.pool import shareable, start_draft_worker

    if settings.executor in ("auto", "process") and draft.device.type == "cpu" and shareable(draft) is None and any(
            m.kind == "ssd" for m in methods):
        warm["draft worker"] = start_draft_worker(draft)
    for spec in methods:
        t0 = time.perf_counter()
        generate_once(target, draft, warm_ids, spec, settings, min(settings.warmup_tokens, settings.max_new_tokens),
                      settings.seed)
        warm[spec.key] = time.perf_counter() - t0
    log(f"warm-up done ({', '.join(f'{k} {v:.1f}s' for k, v in warm.items())})")

    records: list[RunRecord] = []
    references: dict[tuple[str, int], list[int]] = {}
    bar = tqdm(total=settings.repeats * len(encoded) * len(methods), desc="bench", unit="run", disable=not progress,
               dynamic_ncols=True)
    try:
        step = 0
        for repeat in range(settings.repeats):
            for number, (prompt_set, index, ids) in enumerate(encoded):
                seed = settings.seed + number
                shift = step % len(methods)
                step += 1
                order = methods[shift:] + methods[:shift]
                for spec in order:
                    bar.set_postfix_str(f"{prompt_set.name}[{index}] {spec.key}", refresh=False)
                    tokens, seconds, rec, metrics, timing = generate_once(target, draft, ids, spec, settings,
                                                                          settings.max_new_tokens, seed)
                    first_s = rec.times[0] if rec.times else seconds
                    first_tokens = rec.sizes[0] if rec.sizes else len(tokens)
                    if sum(rec.sizes) != len(tokens):
                        log(f"warning: streamer saw {sum(rec.sizes)} tokens, generate returned {len(tokens)}")
                    records.append(RunRecord(
                        dataset=prompt_set.name, prompt_index=index, question_id=prompt_set.ids[index]
                        if index < len(prompt_set.ids) else index, method=spec.key, repeat=repeat, seed=seed,
                        prompt_tokens=int(ids.shape[1]), new_tokens=len(tokens), e2e_s=seconds, first_s=first_s,
                        first_tokens=first_tokens, round_sizes=list(rec.sizes), tokens=tokens, metrics=metrics,
                        timing=timing, load1=os.getloadavg()[0],
                    ))
                    bar.update(1)
                # Exactness against the reference AR output of this prompt (same repeat).
                prompt_records = [r for r in records[-len(methods):]]
                ref = next((r for r in prompt_records if r.method == reference), None)
                if ref is not None:
                    references[(prompt_set.name, index)] = ref.tokens
                    for r in prompt_records:
                        r.first_divergence = first_divergence(r.tokens, ref.tokens)
                        r.identical = r.first_divergence is None
    finally:
        bar.close()

    results: dict[str, Any] = {
        "schema": SCHEMA,
        "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "environment": environment(),
        "settings": asdict(settings),
        "greedy": settings.greedy,
        "exactness_reference": reference,
        "exactness_note": "greedy outputs compared token by token with the reference AR run of the same prompt"
        if settings.greedy else "sampling (temperature > 0): outputs are not expected to match AR; shares are "
        "reported for completeness only",
        "decode_timing": DECODE_TIMING,
        "methods": [{**asdict(m), "executor": m.executor, "thread_label": m.thread_label} for m in methods],
        "framings": {
            name: {**role, "description": FRAMING_TEXT[name].format(
                d=settings.draft_threads, t=settings.target_threads,
                n=settings.draft_threads + settings.target_threads)}
            for name, role in roles.items()
        },
        "datasets": {
            s.name: {"source": s.source, "prompts": len(s.prompts), "question_ids": s.ids,
                     "prompt_tokens": [int(ids.shape[1]) for ps, _, ids in encoded if ps is s]}
            for s in prompt_sets
        },
        "warmup_seconds": warm,
        "runs": [r.to_dict() for r in records],
        **dict(info or {}),
    }
    if settings.latencies:
        try:
            baselines = {m.threads for m in methods if m.kind in ("ar", "sd", "sd-default")}
            adaptive = settings.lookahead_schedule == "adaptive"
            every_core = settings.draft_threads + settings.target_threads  # plain steps and serial rounds
            needed = sorted(baselines | {settings.target_threads} | ({every_core} if adaptive else set()))
            verify_ks = list(range(1, settings.lookahead + 1)) if adaptive else [settings.lookahead]

            def measured_at(ids) -> dict[str, Any]:
                return {str(threads): measure_latencies(
                    target, draft, ids, settings.lookahead, settings.budget, threads, settings.latency_repeats,
                    settings.fanout, tree=threads == settings.target_threads,
                    verify_ks=verify_ks if threads in (settings.target_threads, every_core) else None)
                    for threads in needed}

            log(f"measuring latencies at {', '.join(map(str, needed))} thread(s), at each set's decode context")
            results["latencies_ms"] = measured_at(decode_context(records, encoded, reference))
            results["latencies_by_dataset_ms"] = {
                s.name: measured_at(decode_context(records, encoded, reference, s.name)) for s in prompt_sets}
        except Exception as err:  # a failed side measurement must not lose the run
            results["latencies_error"] = f"{type(err).__name__}: {err}"
            log(f"warning: latency measurement failed: {results['latencies_error']}")
    recompute(results)
    results["load_average"] = {"before": list(load_before), "after": list(os.getloadavg()),
                               "during_runs_1min": _spread([r.load1 for r in records])}
    results["wall_seconds"] = time.time() - started
    if out_dir is not None:
        write_results(results, out_dir, plots=plots, log=log)
    return results


def decode_context(records, encoded, reference: str | None, dataset: str | None = None):
    """Token ids of a context these prompts decoded at: the reference run whose mid-decode length (prompt + half
    its new tokens) is the median of the set's (or of all), its prompt plus that half."""
    import torch

    runs = [r for r in records if (reference is None or r.method == reference) and r.repeat == 0
            and (dataset is None or r.dataset == dataset)]
    if not runs:
        return encoded[0][2]
    runs.sort(key=lambda r: r.prompt_tokens + r.new_tokens // 2)
    run = runs[len(runs) // 2]
    prompt = next(ids for prompt_set, index, ids in encoded
                  if prompt_set.name == run.dataset and index == run.prompt_index)
    half = torch.tensor([run.tokens[: run.new_tokens // 2]], dtype=prompt.dtype)
    return torch.cat([prompt, half], dim=1)


_RUN_FIELDS = ("dataset", "prompt_index", "question_id", "method", "repeat", "seed", "prompt_tokens", "new_tokens",
               "e2e_s", "first_s", "first_tokens", "round_sizes", "tokens", "metrics", "timing", "load1", "identical",
               "first_divergence")


def recompute(results: dict[str, Any]) -> dict[str, Any]:
    """Fill summary, comparisons, predictions and the H100 prediction from the raw runs and latencies in `results`
    (in place; also re-derives an old results.json with the current harness)."""
    known = set(BenchSettings.__dataclass_fields__)
    settings = BenchSettings(**{k: v for k, v in results["settings"].items() if k in known})
    methods = [MethodSpec(m["key"], m["kind"], m["threads"], m.get("draft_threads", 0), m.get("target_threads", 0),
                          m.get("lookahead", 0)) for m in results["methods"]]
    roles = {name: {k: v for k, v in framing.items() if k in METHOD_KINDS or k == "sd_fixed"}
             for name, framing in results["framings"].items()}
    records = [RunRecord(**{k: r.get(k) for k in _RUN_FIELDS}) for r in results["runs"]]
    summary = summarise(records, methods, list(results["datasets"]))
    results["summary"] = summary
    results["comparisons"] = comparisons(summary, roles)
    lats = {int(k): v for k, v in (results.get("latencies_ms") or {}).items()}
    by_dataset = {name: {int(k): v for k, v in per.items()}
                  for name, per in (results.get("latencies_by_dataset_ms") or {}).items()}
    results.pop("predictions", None)
    results.pop("h100_prediction", None)
    if lats:
        try:
            results["predictions"] = predictions(summary, methods, lats, settings, by_dataset)
            results["h100_prediction"] = h100_predictions(summary, methods, settings)
        except Exception as err:  # the measurement itself is what matters
            results["prediction_error"] = f"{type(err).__name__}: {err}"
    return results


def render(out_dir: str | os.PathLike, plots: bool = True) -> dict[str, Any]:
    """Re-derive and rewrite results.md, the PNGs and results.json of an earlier run from its results.json."""
    path = Path(out_dir) / "results.json"
    results = recompute(json.loads(path.read_text()))
    write_results(results, out_dir, plots=plots)
    return results


def write_results(results: dict[str, Any], out_dir: str | os.PathLike, plots: bool = True,
                  log: Callable[[str], None] = print) -> dict[str, Path]:
    """results.json, results.md and (if matplotlib is installed) the PNGs; returns the written paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    if plots:
        try:
            from .plots import write_plots

            pngs = write_plots(results, out)
            results["plots"] = [p.name for p in pngs]
            written.update({p.stem: p for p in pngs})
        except ImportError as err:
            results["plots"] = []
            log(f"warning: no plots ({err}); pip install matplotlib")
    written["md"] = out / "results.md"
    written["md"].write_text(render_markdown(results))
    written["json"] = out / "results.json"
    written["json"].write_text(json.dumps(results, indent=2, default=_json_default))
    return written


def _json_default(value: Any) -> Any:
    if isinstance(value, (set, tuple)):
        return list(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


