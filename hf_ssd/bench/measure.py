"""The methods under test (AR, SD, SSD), their thread framings, and one timed `generate()` call."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .common import FRAMINGS, METHOD_KINDS, _ratio

# --- methods and framing -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MethodSpec:
    """One measured method: AR / SD / SSD-sync run on `threads` intra-op threads, SSD on draft + target threads."""

    key: str
    kind: str
    threads: int
    draft_threads: int = 0
    target_threads: int = 0
    lookahead: int = 0  # SD's fixed K (0: the bench's K)

    @property
    def executor(self) -> str:
        return {"ssd": "thread", "ssd-sync": "sync"}.get(self.kind, "")

    @property
    def thread_label(self) -> str:
        if self.kind == "ssd":
            return f"draft {self.draft_threads} + target {self.target_threads}"
        return f"{self.threads}"


def build_methods(
    kinds: Iterable[str], framing: str, draft_threads: int = 1, target_threads: int = 1,
    sd_lookaheads: Sequence[int] = (),
) -> tuple[list[MethodSpec], dict[str, dict[str, Any]]]:
    """The methods to run and, per framing, which method key plays AR / SD / SD-default / SSD (/ SSD-sync).

    ``extra-cores``: AR, SD and SSD-sync get the SSD target's thread count; ``equal-cores``: the SSD total
    (draft + target). ``both`` measures each distinct thread count once. With several `sd_lookaheads`, SD runs
    at each fixed K (keys ``sd-k<K>@<threads>``, listed under the role ``sd_fixed``); the comparison takes the
    best of them per prompt set.
    """
    kinds = list(dict.fromkeys(kinds))
    unknown = [k for k in kinds if k not in METHOD_KINDS]
    if unknown or not kinds:
        raise ValueError(f"unknown methods {unknown}; choose from {', '.join(METHOD_KINDS)}")
    if draft_threads < 1 or target_threads < 1:
        raise ValueError("draft and target threads must be >= 1")
    sd_lookaheads = list(dict.fromkeys(sd_lookaheads))
    if any(k < 1 for k in sd_lookaheads):
        raise ValueError(f"SD lookaheads must be >= 1, got {sd_lookaheads}")
    framings = list(FRAMINGS) if framing == "both" else [framing]
    if any(f not in FRAMINGS for f in framings):
        raise ValueError(f"framing must be one of {', '.join(FRAMINGS)} or both, got {framing!r}")
    methods: dict[str, MethodSpec] = {}
    roles: dict[str, dict[str, Any]] = {}
    total = draft_threads + target_threads
    for name in framings:
        baseline = target_threads if name == "extra-cores" else total
        roles[name] = {}
        for kind in METHOD_KINDS:
            if kind not in kinds:
                continue
            if kind == "ssd":
                spec = MethodSpec(f"ssd@{draft_threads}+{target_threads}", kind, total, draft_threads, target_threads)
            elif kind == "sd" and len(sd_lookaheads) > 1:
                sweep = [MethodSpec(f"sd-k{k}@{baseline}", kind, baseline, lookahead=k) for k in sd_lookaheads]
                for spec in sweep:
                    methods.setdefault(spec.key, spec)
                roles[name]["sd_fixed"] = [spec.key for spec in sweep]
                roles[name][kind] = sweep[0].key
                continue
            else:
                k = sd_lookaheads[0] if kind == "sd" and sd_lookaheads else 0
                spec = MethodSpec(f"{kind}@{baseline}", kind, baseline, lookahead=k)
            methods.setdefault(spec.key, spec)
            roles[name][kind] = spec.key
    order = {k: i for i, k in enumerate(METHOD_KINDS)}
    ordered = sorted(methods.values(), key=lambda m: (order[m.kind], m.threads, m.lookahead))
    return ordered, roles


def reference_method(methods: Sequence[MethodSpec], target_threads: int) -> str | None:
    """The AR run outputs are compared with: the one on the SSD target's thread count, else the first AR."""
    ars = [m for m in methods if m.kind == "ar"]
    same = [m for m in ars if m.threads == target_threads]
    chosen = same or ars
    return chosen[0].key if chosen else None


# --- one generate() call -----------------------------------------------------------------------------------------

# The draft generation-config fields the SD method sets for a call (and restores after it).
SD_SCHEDULE = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


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
    sd_lookaheads: tuple[int, ...] = ()  # SD's fixed K values (the comparison takes the best); () = (lookahead,)
    framing: str = "both"
    draft_threads: int = 1
    target_threads: int = 1
    seed: int = 0
    fanout: str = "geometric"
    backup: str = "auto"
    executor: str = "auto"  # the ssd method's; ssd-sync runs inline
    lookahead_schedule: str = "adaptive"
    fanout_budget_schedule: str = "adaptive"
    draft_confidence: bool = True
    max_serial_lookahead: int = 16
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
        self.sd_lookaheads = tuple(self.sd_lookaheads)
        self.h100_settings = tuple(self.h100_settings)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def ssd_config(self, spec: MethodSpec):
        from ..config import SSDConfig

        threads = {}
        if spec.kind == "ssd":
            threads = dict(draft_threads=spec.draft_threads, target_threads=spec.target_threads)
        executor = self.executor if spec.kind == "ssd" else spec.executor
        return SSDConfig(lookahead=self.lookahead, fanout_budget=self.budget, fanout=self.fanout, backup=self.backup,
                         executor=executor, lookahead_schedule=self.lookahead_schedule,
                         fanout_budget_schedule=self.fanout_budget_schedule,
                         draft_confidence=self.draft_confidence, max_serial_lookahead=self.max_serial_lookahead,
                         **threads)


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
    config = draft.generation_config
    saved_schedule = {name: getattr(config, name, None) for name in SD_SCHEDULE}
    if spec.kind == "sd":
        config.num_assistant_tokens = spec.lookahead or settings.lookahead
        config.num_assistant_tokens_schedule = "constant"
        config.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = draft
    elif spec.kind == "sd-default":  # whatever transformers (and the draft's generation config) decide
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
        for name, value in saved_schedule.items():
            setattr(config, name, value)
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


