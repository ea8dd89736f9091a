"""`SSDMetrics`: what happened during one SSD `generate()` call."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class SSDMetrics:
    """Statistics of one SSD generation (batch 1). Token counts follow vLLM's conventions.

    `mean_accepted_length` counts accepted draft tokens plus the bonus token per round. `cache_hit_rate` is over
    the rounds that looked a speculation up (every round but the first). Times are wall-clock seconds:
    `target_wait_seconds` is how long the target sat idle waiting for the draft (with `executor="sync"` that is
    all the draft's work). `hits_by_fanout[F]` and `hits_by_position[k]` are `[hits, lookups]` by the number of
    branches prepared at the outcome's fork and by the outcome's accepted length k.
    """

    rounds: int = 0
    generated_tokens: int = 0
    cache_lookups: int = 0
    cache_hits: int = 0
    cache_hit_rate: float = 0.0
    mean_accepted_length: float = 0.0
    draft_acceptance_rate: float = 0.0
    per_position_acceptance: list[float] = field(default_factory=list)
    tokens_per_round_hit: float = 0.0
    tokens_per_round_miss: float = 0.0
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class MetricsRecorder:
    """Accumulates per-round figures and turns them into `SSDMetrics`."""

    def __init__(self, lookahead: int):
        self.lookahead = lookahead
        self.rounds = 0
        self.generated = 0
        self.lookups = 0
        self.by_position = [[0, 0] for _ in range(lookahead + 1)]  # [hits, lookups] per accepted length k
        self.hits = 0
        self.accepted_total = 0
        self.verified_total = 0
        self.emitted_total = 0
        self.reached = [0] * lookahead
        self.passed = [0] * lookahead
        self.emitted_by_source = {"hit": [0, 0], "miss": [0, 0]}
        self.verify_seconds = 0.0
        self.wait_seconds = 0.0

    def record_round(self, primary: bool, accepted: int, verified: int, emitted: int, seconds: float) -> None:
        self.rounds += 1
        self.generated += emitted
        self.accepted_total += accepted
        self.verified_total += verified
        self.emitted_total += accepted + 1
        for i in range(min(verified, accepted + 1)):
            self.reached[i] += 1
            self.passed[i] += int(i < accepted)
        bucket = self.emitted_by_source["hit" if primary else "miss"]
        bucket[0] += accepted + 1
        bucket[1] += 1
        self.verify_seconds += seconds

    def record_lookup(self, hit: bool, accepted: int) -> None:
        self.by_position[accepted][0] += int(hit)
        self.by_position[accepted][1] += 1
        self.lookups += 1
        self.hits += int(hit)

    def finish(self, **extra: Any) -> SSDMetrics:
        def ratio(a: float, b: float) -> float:
            return a / b if b else 0.0

        return SSDMetrics(
            rounds=self.rounds,
            generated_tokens=self.generated,
            cache_lookups=self.lookups,
            cache_hits=self.hits,
            cache_hit_rate=ratio(self.hits, self.lookups),
            hits_by_position=[list(bucket) for bucket in self.by_position],
            mean_accepted_length=ratio(self.emitted_total, self.rounds),
            draft_acceptance_rate=ratio(self.accepted_total, self.verified_total),
            per_position_acceptance=[ratio(p, r) for p, r in zip(self.passed, self.reached)],
            tokens_per_round_hit=ratio(*self.emitted_by_source["hit"]),
            tokens_per_round_miss=ratio(*self.emitted_by_source["miss"]),
            verify_seconds=self.verify_seconds,
            target_wait_seconds=self.wait_seconds,
            lookahead=self.lookahead,
            **extra,
        )
