"""Fan-out: how many bonus-token candidates to prepare for each accepted length k (Theorem 12).

Pure functions on numbers plus `FanoutEstimator`, which fits the acceptance rate `a` and the hit-rate power
law exponent `r` online from the run's own statistics.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch


def round_preserving_sum(weights: list[float], total: int) -> list[int]:
    """Round non-negative `weights` to ints summing to `total` (largest remainder method)."""
    s = sum(weights)
    if s <= 0:
        raise ValueError("round_preserving_sum needs a positive weight.")
    exact = [w * total / s for w in weights]
    floors = [math.floor(x) for x in exact]
    rest = total - sum(floors)
    order = sorted(range(len(exact)), key=lambda i: (exact[i] - floors[i], exact[i]), reverse=True)
    for i in order[:rest]:
        floors[i] += 1
    return floors


def outcome_probabilities(acceptance: float, lookahead: int) -> list[float]:
    """P(k accepted) for k = 0..K under i.i.d. acceptance `a`: a^k (1-a) for k < K, a^K for k = K."""
    a = acceptance
    return [a**k * (1 - a) for k in range(lookahead)] + [a**lookahead]


def geometric_weights(acceptance: float, power: float, lookahead: int) -> list[float]:
    """Unnormalised optimal fan-out F_k ∝ P(k)^(1/(1+r)) (Theorem 12)."""
    a = min(max(acceptance, 1e-3), 1 - 1e-3)
    return [p ** (1.0 / (1.0 + power)) for p in outcome_probabilities(a, lookahead)]


def geometric_fanout(acceptance: float, power: float, lookahead: int, budget: int) -> list[int]:
    """Integer geometric fan-out over k = 0..K summing to `budget`."""
    return round_preserving_sum(geometric_weights(acceptance, power, lookahead), budget)


def uniform_fanout(lookahead: int, budget: int) -> list[int]:
    """`budget` branches spread evenly over k = 0..K (earlier positions get the remainder)."""
    base, rest = divmod(budget, lookahead + 1)
    return [base + (1 if k < rest else 0) for k in range(lookahead + 1)]


def cap_fanout(fanout: list[int], vocab_size: int) -> list[int]:
    """At most V-1 candidates per fork (the drafted token is excluded), at most V for the last one."""
    last = len(fanout) - 1
    return [min(f, vocab_size if k == last else vocab_size - 1) for k, f in enumerate(fanout)]


def fit_acceptance(accepted: int, trials: int, prior: float, prior_weight: float = 4.0) -> float:
    """Per-token acceptance `a` = accepted / tried positions, shrunk towards `prior`."""
    return (accepted + prior * prior_weight) / (trials + prior_weight)


def weighted_line_fit(xs: list[float], ys: list[float], ws: list[float]) -> tuple[float, float] | None:
    """(slope, intercept) of the weighted least-squares line through (x, y); None when x does not vary."""
    if len(xs) < 2:
        return None
    w = sum(ws)
    mx = sum(wi * x for wi, x in zip(ws, xs)) / w
    my = sum(wi * y for wi, y in zip(ws, ys)) / w
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(ws, xs))
    if sxx <= 1e-12:
        return None
    slope = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(ws, xs, ys)) / sxx
    return slope, my - slope * mx


def fit_power_law(hits_by_f: dict[int, list[int]], prior: float, min_count: int = 4) -> float:
    """Fit `r` in miss(F) ≈ m·F^(-r) by weighted least squares of log miss rate on log F.

    `hits_by_f[F] = [hits, lookups]`. Buckets with fewer than `min_count` lookups are ignored; with fewer than
    two usable buckets the prior is returned. The result is clamped to [0.2, 4].
    """
    xs, ys, ws = [], [], []
    for f, (hits, n) in hits_by_f.items():
        if f >= 1 and n >= min_count:
            miss = (n - hits + 0.5) / (n + 1.0)  # smoothed, never 0
            xs.append(math.log(f))
            ys.append(math.log(miss))
            ws.append(float(n))
    line = weighted_line_fit(xs, ys, ws)
    return prior if line is None else min(max(-line[0], 0.2), 4.0)


KINDS = ("hit", "miss")  # the speculation being verified came from the cache (a hit) or from a backup (a miss)


class FanoutEstimator:
    """Keeps the fan-out schedules F^p (after verifying a speculation that was a cache hit) and F^b (after one a
    backup drafted on a miss), keyed "hit" and "miss".

    The drafter records each round's acceptance and lookups in `resolve` and reads `schedules()` there, strictly
    between two verifications, so the same seed gives the same drafts under every executor.
    """

    def __init__(self, fanout, budget: int, lookahead: int, vocab_size: int, a_prior: float, r_prior: float,
                 adaptive: bool = True):
        self.fanout, self.budget, self.lookahead, self.vocab_size = fanout, budget, lookahead, vocab_size
        self.a_prior, self.r_prior, self.adaptive = a_prior, r_prior, adaptive
        # acceptance counts per kind of speculation: [accepted tokens, tried positions]
        self.accept = {kind: [0, 0] for kind in KINDS}
        self.hits_by_f: dict[int, list[int]] = defaultdict(lambda: [0, 0])

    @classmethod
    def from_config(cls, config, vocab_size: int) -> FanoutEstimator:
        """The estimator an `SSDConfig` describes, for a vocabulary of `vocab_size` tokens."""
        return cls(config.fanout, config.branches, config.lookahead, vocab_size, config.acceptance_prior,
                   config.power_law_prior, config.adaptive)

    def acceptance(self, kind: str) -> float:
        accepted, trials = self.accept[kind]
        return fit_acceptance(accepted, trials, self.a_prior) if self.adaptive else self.a_prior

    def power(self) -> float:
        return fit_power_law(self.hits_by_f, self.r_prior) if self.adaptive else self.r_prior

    def schedule(self, kind: str, verified: int | None = None, budget: int | None = None) -> list[int]:
        """The fan-out over k = 0..n for the round after verifying `verified` = n (default K) tokens of a speculation
        of `kind` ("hit" or "miss"), `budget` branches in all (default B; an explicit fan-out keeps its own). An
        explicit fan-out shorter-verified folds its tail into the last fork."""
        n = self.lookahead if verified is None else verified
        budget = self.budget if budget is None else max(1, min(budget, self.budget))
        if isinstance(self.fanout, list):
            out = list(self.fanout[:n]) + [sum(self.fanout[n:])]
        elif self.fanout == "uniform":
            out = uniform_fanout(n, budget)
        else:
            out = geometric_fanout(self.acceptance(kind), self.power(), n, budget)
        return cap_fanout(out, self.vocab_size)

    def schedules(self) -> dict[str, list[int]]:
        return {kind: self.schedule(kind) for kind in KINDS}

    def record_round(self, kind: str, accepted: int, verified: int) -> None:
        """One verification: `accepted` of `verified` draft tokens were accepted."""
        stats = self.accept[kind]
        stats[0] += accepted
        stats[1] += accepted + (1 if accepted < verified else 0)

    def record_lookup(self, candidates: int, hit: bool) -> None:
        """One cache lookup at a fork that had `candidates` prepared branches."""
        bucket = self.hits_by_f[candidates]
        bucket[0] += int(hit)
        bucket[1] += 1


def fork_candidates(
    row_top: torch.Tensor, drafted: torch.Tensor, fanout: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fill each row's fan-out with bonus candidates: fork j takes the first F_j tokens of its ranking.

    `row_top` [b, K+1, W] ranks the draft's tokens after [t_prev, s_1..s_j]; for j < K the drafted s_{j+1}
    ([b, K]) is skipped (a rejected token is never the bonus). `fanout` [b, K+1] is each row's schedule; every
    row's schedule has the same total B. Returns (forks [b, B], candidates [b, B], valid [b, B]); a branch is
    invalid only when the vocabulary is too small to fill its fork (W <= F_j).
    """
    rows, width = row_top.shape[0], row_top.shape[-1]
    totals = fanout.sum(dim=1)
    if rows and bool((totals != totals[0]).any()):
        raise ValueError(f"every row's fan-out must have the same total; got {totals.tolist()}.")
    excluded = torch.zeros_like(row_top, dtype=torch.bool)
    excluded[:, :-1] = row_top[:, :-1] == drafted[:, : row_top.shape[1] - 1, None]
    order = (excluded.long() * width + torch.arange(width, device=row_top.device)).argsort(dim=-1)
    ranked, ranked_excluded = row_top.gather(-1, order), excluded.gather(-1, order)
    forks = torch.stack([
        torch.repeat_interleave(torch.arange(fanout.shape[1], device=row_top.device), f) for f in fanout
    ]) if rows else fanout.new_zeros(0, 0)
    start = torch.cumsum(fanout, dim=1) - fanout  # first branch of each fork
    rank = torch.arange(forks.shape[1], device=row_top.device)[None, :] - start.gather(1, forks)
    clamped = rank.clamp(max=width - 1)
    row_index = torch.arange(rows, device=row_top.device)[:, None]
    candidates = ranked[row_index, forks, clamped]
    valid = ~ranked_excluded[row_index, forks, clamped] & (rank < width)
    return forks, candidates, valid
