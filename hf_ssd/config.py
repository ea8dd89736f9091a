"""`SSDConfig`: the JSON-friendly knobs of speculative speculative decoding."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

FANOUT_KINDS = ("geometric", "uniform")
LOOKAHEAD_SCHEDULES = ("adaptive", "constant")
FANOUT_BUDGET_SCHEDULES = ("adaptive", "constant")
BACKUPS = ("auto", "draft", "ngram", "random")
EXECUTORS = ("auto", "thread", "process", "sync", "stream")
RUNNER_UPS = ("auto", "always", "never")
PROMPT_LOOKUPS = ("auto", "always", "never")


def _fail(name: str, value: Any, allowed: str) -> None:
    raise ValueError(f"SSDConfig.{name}={value!r} is invalid: {allowed}.")


def _check_int(name: str, value: Any, low: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        _fail(name, value, f"expected an int >= {low}" + (" or None" if allow_none else ""))


@dataclass
class SSDConfig:
    """Configuration of speculative speculative decoding (the Saguaro algorithm).

    Pass it to `generate(..., assistant_model=draft, ssd_config=SSDConfig(...))` or as a plain dict.

    Args:
        lookahead: K, the number of draft tokens per speculation (>= 1): the most a round verifies.
        lookahead_schedule: how many of them each round verifies: `"adaptive"` (0..K, chosen every round for the
            most expected tokens per second from the run's own acceptance and measured costs; 0 is a plain target
            step) or `"constant"` (always K; like transformers' `num_assistant_tokens_schedule`).
        draft_confidence: with the adaptive schedule, condition each round on the draft's confidence in the tokens at
            hand: verify as many of this speculation's tokens as its confidences (calibrated online against what the
            target accepted) say pay, and stop drafting just in time (serial rounds, the draft backup) where the
            next token is not expected to repay its cost, as transformers' `assistant_confidence_threshold` does
            with a fixed threshold. False: the run's average acceptance per position decides.
        max_serial_lookahead: how deep a speculation drafted just in time (a serial round: the draft sits the
            verification out, then drafts on every core, as SD does) may run while the draft stays confident (at
            least K; only with `draft_confidence` and the adaptive schedule, whose stop rule ends it where the next
            token no longer repays its cost, as transformers' `num_assistant_tokens` = 20 bounds its confident
            drafts). Speculations prepared beside the verification stay K deep, and so do a batch's while more
            than one of its rows is active (the batch returns when its last row is done).
        fanout: which verification outcomes to prepare: `"geometric"` (Theorem 12, adapted online),
            `"uniform"`, or an explicit list of K+1 non-negative ints (branches per accepted length 0..K).
        fanout_budget: B, the most branches prepared per row and round (>= 1).
        fanout_budget_schedule: how many of them each round prepares: `"adaptive"` (B, B/2, ..., 1, chosen every
            round for the most expected tokens per second from the draft's measured round time and hit rate per
            budget: fewer only where the draft's round outlasts the verification) or `"constant"` (always B).
            An explicit `fanout` list is always prepared whole.
        saguaro_c: C in (0, 1]; the draft's top candidates are down-weighted by C when sampling so that the
            bonus token lands in the cache (1.0 disables Saguaro sampling; only matters when sampling).
        backup: the speculator used on a cache miss: `"draft"` (the draft model, just in time), `"ngram"`
            (prompt lookup in the context, random fill), `"random"` (uniform tokens) or `"auto"`.
        executor: where the draft runs: `"process"` (a persistent worker process sharing the draft's weights,
            concurrent with verification, no shared GIL), `"thread"` (a background thread), `"sync"` (inline, for
            debugging and ablations), or `"auto"` (a worker process once one is running, a thread until then;
            inline on one core; `"stream"` for a draft on a GPU); `"stream"`: a background thread issuing the draft's
            work on a side stream of its device, hand-offs by events (on a CPU it runs as `"thread"` does).
        draft_threads: intra-op CPU threads for the draft worker (None: half the cores).
        target_threads: intra-op CPU threads for the target while SSD runs (None: the remaining cores); its prefill
            and plain steps while the draft is paused or probing run on the draft's threads too.
        acceptance_prior: the per-token acceptance `a` used for the fan-out before statistics exist.
        power_law_prior: the hit-rate power-law exponent `r` used before statistics exist.
        adaptive: re-estimate `a` and `r` online from the run's own statistics.
        ngram_max: the longest n-gram the `"ngram"` backup matches.
        runner_up: whether a round verifying one drafted token also verifies the draft's second choice for that
            position beside it, in the same forward (one row, a serial round: the draft sat the verification out;
            under sampling the two are weighed by recursive rejection, exactly): `"auto"` where its measured chance
            of being the target's choice pays for the extra position on the measured cost curve (free where
            verifying three positions costs what two do), `"always"` in every such round (for ablations and tests),
            `"never"`.
        prompt_lookup: whether a plain step (taken while the draft is paused, one row) also verifies the context's
            own continuation beside its token: the tokens that followed the latest earlier occurrence of the last
            2 to `ngram_max` tokens (prompt lookup). Exact under greedy decoding and sampling. `"auto"` where their
            measured acceptance pays for the positions on the measured cost curve (free where verifying a few
            positions costs what one does), `"always"` whenever a continuation is found (for ablations and tests),
            `"never"`.
        compile_draft: run the draft's steps (glue, tree, just-in-time backup) compiled over a fixed-capacity KV
            cache, so each step's shapes are static: with `torch.compile` (on a GPU in "reduce-overhead" mode, i.e.
            captured once into CUDA graphs and replayed without launch overhead). The first calls compile.
        compile_backend: the `torch.compile` backend for `compile_draft` ("inductor"; "aot_eager" or "eager" to
            debug the static-shape path without code generation).
    """

    lookahead: int = 3
    lookahead_schedule: str = "adaptive"
    draft_confidence: bool = True
    max_serial_lookahead: int = 16
    fanout: str | list[int] = "geometric"
    fanout_budget: int = 8
    fanout_budget_schedule: str = "adaptive"
    saguaro_c: float = 1.0
    backup: str = "auto"
    executor: str = "auto"
    draft_threads: int | None = None
    target_threads: int | None = None
    acceptance_prior: float = 0.7
    power_law_prior: float = 1.0
    adaptive: bool = True
    ngram_max: int = 3
    runner_up: str = "auto"
    prompt_lookup: str = "auto"
    compile_draft: bool = False
    compile_backend: str = "inductor"
    _extra: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self._extra:
            raise ValueError(
                f"SSDConfig got unknown fields {sorted(self._extra)}; allowed: {sorted(self.field_names())}."
            )
        self.validate()

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]

    def validate(self) -> None:
        """Raise `ValueError` naming the first invalid field, its value and the allowed range."""
        _check_int("lookahead", self.lookahead, 1)
        _check_int("fanout_budget", self.fanout_budget, 1)
        if self.lookahead_schedule not in LOOKAHEAD_SCHEDULES:
            _fail("lookahead_schedule", self.lookahead_schedule, f"expected one of {LOOKAHEAD_SCHEDULES}")
        if not isinstance(self.draft_confidence, bool):
            _fail("draft_confidence", self.draft_confidence, "expected a bool")
        _check_int("max_serial_lookahead", self.max_serial_lookahead, 1)
        if self.fanout_budget_schedule not in FANOUT_BUDGET_SCHEDULES:
            _fail("fanout_budget_schedule", self.fanout_budget_schedule, f"expected one of {FANOUT_BUDGET_SCHEDULES}")
        if isinstance(self.fanout, (list, tuple)):
            if len(self.fanout) != self.lookahead + 1 or any(
                isinstance(f, bool) or not isinstance(f, int) or f < 0 for f in self.fanout
            ):
                _fail(
                    "fanout",
                    self.fanout,
                    f"an explicit fan-out must be a list of lookahead+1={self.lookahead + 1} ints >= 0",
                )
            if sum(self.fanout) < 1:
                _fail("fanout", self.fanout, "an explicit fan-out must prepare at least one branch")
            self.fanout = [int(f) for f in self.fanout]
        elif self.fanout not in FANOUT_KINDS:
            _fail("fanout", self.fanout, f"expected one of {FANOUT_KINDS} or a list of lookahead+1 ints")
        if isinstance(self.saguaro_c, bool) or not isinstance(self.saguaro_c, (int, float)) or not (
            0.0 < float(self.saguaro_c) <= 1.0
        ):
            _fail("saguaro_c", self.saguaro_c, "expected a float in (0, 1]")
        self.saguaro_c = float(self.saguaro_c)
        if self.backup not in BACKUPS:
            _fail("backup", self.backup, f"expected one of {BACKUPS}")
        if self.executor not in EXECUTORS:
            _fail("executor", self.executor, f"expected one of {EXECUTORS}")
        _check_int("draft_threads", self.draft_threads, 1, allow_none=True)
        _check_int("target_threads", self.target_threads, 1, allow_none=True)
        if not isinstance(self.acceptance_prior, (int, float)) or not (0.0 < self.acceptance_prior < 1.0):
            _fail("acceptance_prior", self.acceptance_prior, "expected a float in (0, 1)")
        if not isinstance(self.power_law_prior, (int, float)) or not (0.0 < self.power_law_prior <= 10.0):
            _fail("power_law_prior", self.power_law_prior, "expected a float in (0, 10]")
        if not isinstance(self.adaptive, bool):
            _fail("adaptive", self.adaptive, "expected a bool")
        _check_int("ngram_max", self.ngram_max, 1)
        if self.runner_up not in RUNNER_UPS:
            _fail("runner_up", self.runner_up, f"expected one of {RUNNER_UPS}")
        if self.prompt_lookup not in PROMPT_LOOKUPS:
            _fail("prompt_lookup", self.prompt_lookup, f"expected one of {PROMPT_LOOKUPS}")
        if not isinstance(self.compile_draft, bool):
            _fail("compile_draft", self.compile_draft, "expected a bool")
        if not isinstance(self.compile_backend, str) or not self.compile_backend:
            _fail("compile_backend", self.compile_backend, "expected a torch.compile backend name, e.g. 'inductor'")
        if self.compile_draft:
            import torch

            if self.compile_backend not in torch.compiler.list_backends(exclude_tags=()):
                _fail("compile_backend", self.compile_backend,
                      f"expected one of {sorted(torch.compiler.list_backends(exclude_tags=()))}")

    @property
    def branches(self) -> int:
        """Total branches per round: the budget, or the sum of an explicit fan-out."""
        return sum(self.fanout) if isinstance(self.fanout, list) else self.fanout_budget

    @property
    def tracks_confidence(self) -> bool:
        """Whether the draft's confidence conditions the rounds: `draft_confidence` with the adaptive schedule."""
        return self.draft_confidence and self.lookahead_schedule == "adaptive"

    @property
    def serial_lookahead(self) -> int:
        """The most tokens a serial (just-in-time) speculation holds: `max_serial_lookahead` where the draft's
        confidence bounds it (`tracks_confidence`), else K."""
        return max(self.lookahead, self.max_serial_lookahead) if self.tracks_confidence else self.lookahead

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (round-trips through `from_dict`)."""
        return {name: getattr(self, name) for name in self.field_names()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SSDConfig:
        """Build from a dict; unknown keys raise `ValueError` listing the allowed ones."""
        if not isinstance(data, dict):
            raise ValueError(f"SSDConfig.from_dict expects a dict, got {type(data).__name__}.")
        known = {k: v for k, v in data.items() if k in cls.field_names()}
        extra = {k: v for k, v in data.items() if k not in known}
        return cls(**known, _extra=extra)

    @classmethod
    def coerce(cls, value: SSDConfig | dict[str, Any]) -> SSDConfig:
        """Accept an `SSDConfig` or a plain dict; anything else is a `ValueError`."""
        if isinstance(value, cls):
            value.validate()
            return value
        if isinstance(value, dict):
            return cls.from_dict(value)
        raise ValueError(f"ssd_config must be an SSDConfig or a dict, got {type(value).__name__}.")

    def to_json_string(self) -> str:
        import json

        return json.dumps(self.to_dict(), sort_keys=True)
