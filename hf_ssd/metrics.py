"""`SSDMetrics`: what happened during one SSD `generate()` call, and the recorders that collect it.

Vocabulary used throughout: a round's lookup in the speculation cache is a **hit** or a **miss**; a speculation's
**source** is `"cache"` (a hit) or the backup that drafted it (`"draft"`, `"ngram"`, `"random"`). The fan-out
schedule and the acceptance estimate are keyed by whether the speculation verified was a hit or a miss
(the paper's F^p and F^b).
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from .cache.speculation_cache import LOOKUP, NOT_LOOKED_UP


class PhaseTimer:
    """Wall-clock seconds and calls per named phase: `with timer("verify"): ...` or `timer.add(name, seconds)`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds
        self.calls[name] += 1

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def totals(self) -> dict[str, float]:
        return dict(self.seconds)


@dataclass
class SSDMetrics:
    """Statistics of one SSD generation. Token counts follow vLLM's conventions.

    `rounds` counts row-rounds (one per row per verification; equal to verifications at batch 1), `batch_rounds`
    the verifications. `mean_accepted_length` counts accepted draft tokens plus the bonus token per row-round.
    `cache_hit_rate` is over the row-rounds that looked a speculation up (every one but each row's first).
    `tokens_per_round_by_source` splits tokens per row-round by where the speculation came from ("cache" = hit,
    else the backup, "plain" for plain steps, "serial" for speculations drafted just in time after a verification
    the draft sat out). `backup_decision` holds the last `backup="auto"` decision and its inputs (Corollary 16:
    p_hit, E_hit, E_miss, T_p, T_b in units of one verification, the critical batch size, the batch size, the
    choice). `peak_target_kv_bytes` / `peak_draft_kv_bytes` are the largest KV sizes seen after a round;
    `realign_seconds` / `draft_compact_seconds` the time spent realigning the target's rows (crop or gather) and
    compacting the draft cache. `first_verify_seconds` (the first verification, with the target's prefill) and
    `first_wait_seconds` (the wait for the draft's prefill and first speculation) are included in `verify_seconds`
    and `target_wait_seconds`. Times are wall-clock seconds: `target_wait_seconds` is how long the target sat idle
    waiting for the draft (with `executor="sync"` that is all the draft's work). `hits_by_fanout[F]` and
    `hits_by_position[k]` are `[hits, lookups]` by the number of branches prepared at the outcome's fork and by the
    outcome's accepted length k. `per_position_acceptance` / `accepted_per_position` cover positions 1..K and,
    past K, as deep as serial speculations were verified (`SSDConfig.max_serial_lookahead`).

    The critical path, per side (seconds summed over the call; divide by `batch_rounds` for a round):
    `target_phase_seconds` — `target_forward` (the verification forwards), `processors` (logits processors),
    `verify` (acceptance and its read-back to the host), `emit` (stop rules, scores, streamer), `realign`,
    `hand_off` (submitting draft work and announcing outcomes), `wait_prepare` / `wait_resolve` (idle, waiting for
    the draft), `wait_first` (the draft's prefill and first speculation); `draft_phase_seconds` — `glue_forward`,
    `tree_forward`, `backup_forward` (the draft model's calls), `prepare`, `resolve` and `begin` (whole tasks, so
    task minus forwards is the draft's own Python: masks, fork, cache bookkeeping, compaction). `worker_start_seconds`
    is the process executor's start-up paid by this call (0 when its worker was already running) and
    `draft_load_seconds` the time to hand it the draft (0 when it already held it).

    `drafts`, `draft_tokens` and `accepted_tokens` are the exact counts behind the rates, as vLLM counts them: the
    row-rounds that verified at least one draft token, the draft tokens verified, and those accepted;
    `accepted_per_position[i]` is how often the draft token at position i was accepted (so `draft_acceptance_rate`
    is `accepted_tokens / draft_tokens` and `mean_accepted_length` is `(accepted_tokens + rounds) / rounds`).

    `lookahead_per_round` is how many draft tokens each verification verified (`lookahead_schedule="adaptive"`
    chooses it every round; 0 is a plain target step); `lookahead_decisions` says why, round by round: the
    acceptance estimates per draft position, the predicted tokens per second of every K considered, the target's
    verification time per K and the draft's round time they came from, whether K was the best, an exploration
    of an unmeasured K, from the prior cost shape (before any verification was timed) or fixed, or a "sure hand"
    (plain steps best at the average acceptance, the speculation in hand verified for its tokens' confidences),
    the most the round could verify (`limit`), how deep the draft prepared next (`depth`: 0 = paused), the active
    rows the round covered (`rows`), its target forward (`forward_ms`) and its whole time (`round_ms`); where
    just-in-time drafting had a stop rule, the gain each further token had to bring (`stop_gain`), the calibrated
    acceptance per confidence bin of a speculation's first and later tokens and of the token after one of that
    confidence (`stop_tables`: the pair's, pooled over calls, with their log-odds shifted by `calibration_shift`
    toward this call's own acceptance) and `at_least` when a second token was drafted to sample a_2; where serial
    rounds are possible, `core_gain`: how many times faster a verification on every core was measured than one
    beside the working draft (what an untimed plain step is guessed from); in the first decision, where the target
    runs on the CPU, `probed_cost_curve`: its forward's cost per count of positions relative to one, probed before
    the first round (what an untimed K is priced by); for a single row with serial
    rounds possible, `confident_serial_tok_s`: their speed as deep as the draft's confidence makes worth it, what the
    serial mode was weighed at against plain steps when it beat the average acceptance's serial speeds; the speeds
    per K of the speculation in hand priced by its tokens' confidences in the way chosen (`confident_tok_s`), or, where
    a sure hand was weighed and plain steps still won, priced as the serial round that lost (`sure_hand_tok_s`).
    `fanout_budget_per_round` is how many branches per row the draft prepared beside each verification
    (`fanout_budget_schedule="adaptive"` chooses it every round; 0 while paused); the decisions record it
    (`budget`) and, where it was decided, the predicted tokens per second of each budget considered
    (`budget_tok_s`).

    `runner_up_rounds` counts the rounds that verified the draft's runner-up for the first token beside it
    (`SSDConfig.runner_up`; the decisions record its rate then, `runner_up`), `runner_up_accepted` those whose
    runner-up was the target's choice (counted as an accepted draft token: the round emitted it and the bonus after
    it).

    `prompt_lookup_rounds` counts the plain steps that verified the context's own continuation beside their token
    (`SSDConfig.prompt_lookup`; the decisions record how many tokens, `lookup`, and their measured acceptance,
    `lookup_acceptance`), `prompt_lookup_tokens` the tokens they verified, `prompt_lookup_accepted` those accepted.
    They are no draft tokens: the draft's acceptance and `mean_accepted_length` count such a step as a round that
    verified none; `tokens_per_round_by_source["lookup"]` is what those steps emitted per step.
    """

    rounds: int = 0
    batch_rounds: int = 0
    batch_size: int = 1
    generated_tokens: int = 0
    cache_lookups: int = 0
    cache_hits: int = 0
    cache_hit_rate: float = 0.0
    mean_accepted_length: float = 0.0
    draft_acceptance_rate: float = 0.0
    per_position_acceptance: list[float] = field(default_factory=list)
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    tokens_per_round_hit: float = 0.0
    tokens_per_round_miss: float = 0.0
    tokens_per_round_by_source: dict[str, float] = field(default_factory=dict)
    rounds_by_source: dict[str, int] = field(default_factory=dict)
    backup_decision: dict[str, Any] = field(default_factory=dict)
    peak_target_kv_bytes: int = 0
    peak_draft_kv_bytes: int = 0
    realign_seconds: float = 0.0
    first_verify_seconds: float = 0.0
    first_wait_seconds: float = 0.0
    draft_compact_seconds: float = 0.0
    verify_seconds: float = 0.0
    draft_seconds: float = 0.0
    target_wait_seconds: float = 0.0
    wall_seconds: float = 0.0
    fanout_schedule: dict[str, list[int]] = field(default_factory=dict)
    acceptance_estimate: dict[str, float] = field(default_factory=dict)
    power_law_estimate: float = 0.0
    hits_by_fanout: dict[int, list[int]] = field(default_factory=dict)
    hits_by_position: list[list[int]] = field(default_factory=list)
    tree_steps_skipped: int = 0
    lookahead: int = 0
    branches: int = 0
    backup: str = ""
    executor: str = ""
    draft_threads: int = 0
    target_threads: int = 0
    target_phase_seconds: dict[str, float] = field(default_factory=dict)
    draft_phase_seconds: dict[str, float] = field(default_factory=dict)
    worker_start_seconds: float = 0.0
    draft_load_seconds: float = 0.0
    lookahead_per_round: list[int] = field(default_factory=list)
    lookahead_decisions: list[dict[str, Any]] = field(default_factory=list)
    fanout_budget_per_round: list[int] = field(default_factory=list)
    runner_up_rounds: int = 0
    runner_up_accepted: int = 0
    prompt_lookup_rounds: int = 0
    prompt_lookup_tokens: int = 0
    prompt_lookup_accepted: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class MetricsRecorder:
    """Accumulates per-round figures and turns them into `SSDMetrics`."""

    def __init__(self, lookahead: int, deepest: int = 0):
        self.lookahead = lookahead
        deepest = max(lookahead, deepest)  # the longest speculation a round may verify (a serial one's)
        self.phases = PhaseTimer()  # the target side's critical path (see `SSDMetrics.target_phase_seconds`)
        self.rounds = 0
        self.generated = 0
        self.lookups = 0
        self.by_position = [[0, 0] for _ in range(deepest + 1)]  # [hits, lookups] per accepted length k
        self.hits = 0
        self.accepted_total = 0
        self.verified_total = 0
        self.emitted_total = 0
        self.drafts = 0  # row-rounds that verified at least one draft token
        self.reached = [0] * deepest
        self.passed = [0] * deepest
        self.by_source: dict[str, list[int]] = {}
        self.batch_rounds = 0
        self.peak_target = 0
        self.verify_seconds = 0.0
        self.first_verify_seconds = 0.0  # the first verification, which includes the target's prefill

    @contextmanager
    def verification(self):
        """Times one verification of the whole batch (forward, processors, acceptance); the first one also holds the
        target's prefill."""
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            if self.batch_rounds == 0:
                self.first_verify_seconds = seconds
            self.batch_rounds += 1
            self.verify_seconds += seconds

    @property
    def wait_seconds(self) -> float:
        """How long the target sat idle waiting for the draft."""
        return sum(v for k, v in self.phases.seconds.items() if k.startswith("wait_"))

    @property
    def first_wait_seconds(self) -> float:
        return self.phases.seconds.get("wait_first", 0.0)

    def decode_verify_seconds(self) -> float:
        """Mean seconds of one verification after the first (the prefill's), or of the first if it is the only one."""
        if self.batch_rounds > 1:
            return (self.verify_seconds - self.first_verify_seconds) / (self.batch_rounds - 1)
        return self.verify_seconds

    def record_memory(self, target_bytes: int) -> None:
        self.peak_target = max(self.peak_target, target_bytes)

    def tokens_per_round(self, *sources: str) -> float:
        """Mean tokens (accepted + bonus) per row-round whose speculation came from one of `sources`; 0 if none."""
        total = sum(self.by_source.get(s, (0, 0))[0] for s in sources)
        count = sum(self.by_source.get(s, (0, 0))[1] for s in sources)
        return total / count if count else 0.0

    def record_round(self, source: str, accepted: int, verified: int, emitted: int) -> None:
        """One row's round; `source` is where its speculation came from ("cache", the backup's name, or "lookup":
        a plain step's prompt lookup, kept out of the draft's acceptance)."""
        self.rounds += 1
        self.generated += emitted
        per_source = self.by_source.setdefault(source, [0, 0])
        per_source[0] += accepted + 1
        per_source[1] += 1
        if source == LOOKUP:  # no draft token: a round that verified none (mean_accepted_length's identity holds)
            self.emitted_total += 1
            return
        self.emitted_total += accepted + 1
        self.accepted_total += accepted
        self.verified_total += verified
        self.drafts += int(verified > 0)
        for i in range(min(verified, accepted + 1)):
            self.reached[i] += 1
            self.passed[i] += int(i < accepted)

    def record_lookup(self, hit: bool, accepted: int) -> None:
        self.by_position[accepted][0] += int(hit)
        self.by_position[accepted][1] += 1
        self.lookups += 1
        self.hits += int(hit)

    def finish(self, **extra: Any) -> SSDMetrics:
        def ratio(a: float, b: float) -> float:
            return a / b if b else 0.0

        # K positions, and past them as deep as serial speculations were verified
        reached = max([self.lookahead] + [i + 1 for i, r in enumerate(self.reached) if r])
        lookups = max([self.lookahead + 1] + [i + 1 for i, b in enumerate(self.by_position) if b[1]])

        return SSDMetrics(
            rounds=self.rounds,
            batch_rounds=self.batch_rounds,
            generated_tokens=self.generated,
            cache_lookups=self.lookups,
            cache_hits=self.hits,
            cache_hit_rate=ratio(self.hits, self.lookups),
            hits_by_position=[list(bucket) for bucket in self.by_position[:lookups]],
            mean_accepted_length=ratio(self.emitted_total, self.rounds),
            draft_acceptance_rate=ratio(self.accepted_total, self.verified_total),
            per_position_acceptance=[ratio(p, r) for p, r in zip(self.passed[:reached], self.reached)],
            drafts=self.drafts,
            draft_tokens=self.verified_total,
            accepted_tokens=self.accepted_total,
            accepted_per_position=list(self.passed[:reached]),
            tokens_per_round_hit=self.tokens_per_round("cache"),
            tokens_per_round_miss=self.tokens_per_round(
                *(k for k in self.by_source if k not in ("cache", *NOT_LOOKED_UP))),
            tokens_per_round_by_source={k: ratio(*v) for k, v in sorted(self.by_source.items())},
            rounds_by_source={k: v[1] for k, v in sorted(self.by_source.items())},
            peak_target_kv_bytes=self.peak_target,
            realign_seconds=self.phases.seconds.get("realign", 0.0),
            first_verify_seconds=self.first_verify_seconds,
            first_wait_seconds=self.first_wait_seconds,
            verify_seconds=self.verify_seconds,
            target_wait_seconds=self.wait_seconds,
            target_phase_seconds=self.phases.totals(),
            lookahead=self.lookahead,
            **extra,
        )
