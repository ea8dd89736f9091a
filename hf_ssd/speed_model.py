"""Speed model: predicted AR / SD / SSD throughput from measured latencies and acceptance statistics.

Pure Python (no torch). Formulas follow the paper (Kumar, Dao, May, arXiv:2603.03251, §3 and §6):
Theorem 7 (SSD speedup), Corollary 9 (SSD/SD bounds), Corollary 16 (batch), Theorem 17 (backup choice).

Normalisation (used by every closed-form function below)
-------------------------------------------------------
- ``t1``: one autoregressive (AR) target step, 1 token per step; AR throughput = 1 / t1.
- ``t_v``: one target verification of K draft tokens (K+1 positions); ``v = t_v / t1`` (the paper takes v = 1).
- ``T_SD, T_p, T_b``: drafting latency per round (SD's K draft forwards; SSD's primary round; SSD's backup),
  all divided by ``t_v``, i.e. normalised to one verification as in the paper.
- Speedup = (tokens per unit wall time of the method) / (tokens per unit wall time of AR), so every formula
  carries the extra factor ``1 / v``: ``speedup_SD = E_SD / (v · (1 + T_SD))``. With ``v = 1`` it is the paper's.

`predict` works in milliseconds from a `Latencies` table instead, and also models what the closed forms leave
out on a 2-core CPU: draft and target threads slowing each other down (``overlap_efficiency``), a fixed
per-round overhead, and this project's round structure (glue = one draft forward over s_K after a cached or
just-in-time speculation, K+1 tokens after a fast backup; then K tree steps over B branches).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Acceptance = float | Sequence[float]
Table = Mapping[int, float] | Callable[[int], float]

# --- expected tokens per round -----------------------------------------------------------------------------


def _acceptance_at(acceptance: Acceptance, position: int) -> float:
    """Conditional acceptance of draft position `position` (1-based); a sequence repeats its last value."""
    if isinstance(acceptance, (int, float)):
        return float(acceptance)
    if not acceptance:
        raise ValueError("empty acceptance profile")
    return float(acceptance[min(position, len(acceptance)) - 1])


def expected_tokens(acceptance: Acceptance, K: int) -> float:
    """Expected tokens emitted per round (accepted drafts + the bonus) with K draft tokens.

    `acceptance` is either one per-token acceptance a (i.i.d., §4) or a per-position profile a_1, a_2, ...
    of conditional acceptances (P(position i accepted | positions < i accepted), as in
    `SSDMetrics.per_position_acceptance`; the last value repeats): E = 1 + Σ_{j=1..K} Π_{i<=j} a_i.
    """
    if K < 0:
        raise ValueError(f"K must be >= 0, got {K}")
    total, survive = 1.0, 1.0
    for j in range(1, K + 1):
        a = _acceptance_at(acceptance, j)
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"acceptance must lie in [0, 1], got {a}")
        survive *= a
        total += survive
    return total


def expected_tokens_sd(a: float, K: int) -> float:
    """E_SD under i.i.d. acceptance a: (1 − a^(K+1)) / (1 − a), and K+1 at a = 1."""
    if not 0.0 <= a <= 1.0 or K < 0:
        raise ValueError(f"need 0 <= a <= 1 and K >= 0, got a={a}, K={K}")
    return float(K + 1) if a == 1.0 else (1.0 - a ** (K + 1)) / (1.0 - a)


def expected_tokens_hit(acceptance: Acceptance, K: int) -> float:
    """E_hit: tokens per round when the speculation came from the cache (the primary draft).

    Greedy: the tree drafts exactly what the draft would, so E_hit = E_SD. With Saguaro sampling pass the
    (lower) acceptance of the rescaled draft distribution.
    """
    return expected_tokens(acceptance, K)


def expected_tokens_miss(backup: str, acceptance: Acceptance, K: int, backup_acceptance: float = 0.0) -> float:
    """E_miss: tokens per round when the speculation came from the backup.

    ``backup="draft"`` (just-in-time draft model): SD-like, E_miss = E(acceptance, K). A fast backup
    (``"fast"``, ``"ngram"``, ``"random"``): E(backup_acceptance, K); random tokens (a ≈ 1/V) give ≈ 1.
    """
    if backup == "draft":
        return expected_tokens(acceptance, K)
    return expected_tokens(backup_acceptance, K)


def acceptance_for_tokens(E: float, K: int, tol: float = 1e-12) -> float:
    """Inverse of `expected_tokens_sd`: the i.i.d. acceptance a with E_SD(a, K) = E (bisection)."""
    if not 1.0 <= E <= K + 1:
        raise ValueError(f"E must lie in [1, K+1] = [1, {K + 1}], got {E}")
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if expected_tokens_sd(mid, K) < E else (lo, mid)
    return 0.5 * (lo + hi)


# --- closed forms (normalised latencies) -------------------------------------------------------------------


def _check_p(p: float) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"probability must lie in [0, 1], got {p}")


def speedup_sd(E_sd: float, T_sd: float, v: float = 1.0) -> float:
    """SD over AR in wall time: E_SD / (v · (1 + T_SD)).

    T_SD = drafting time per round / t_v; v = t_v / t1 (verification of K+1 tokens vs one AR step).
    """
    return E_sd / (v * (1.0 + T_sd))


def speedup_ssd(p_hit: float, E_hit: float, E_miss: float, T_p: float, T_b: float, v: float = 1.0) -> float:
    """SSD over AR (Theorem 7, times 1/v for wall time):

    [p·E_hit + (1−p)·E_miss] / (v · [p·max(1, T_p) + (1−p)·(1 + T_b)]).
    A hit round lasts the longer of verification and the primary draft round; a miss first waits T_b.
    """
    return speedup_ssd_batch(p_hit, 1, E_hit, E_miss, T_p, T_b, v)


def speedup_ssd_batch(
    p: float, b: int, E_hit: float, E_miss: float, T_p: float, T_b: float, v: float = 1.0
) -> float:
    """SSD over AR at batch b (Corollary 16): the batch proceeds without a stall only if all b rows hit (p^b).

    [p·E_hit + (1−p)·E_miss] / (v · [p^b·max(1, T_p) + (1 − p^b)·(1 + T_b)]); v = t_v / t1 at batch b.
    Reduces to `speedup_ssd` at b = 1.
    """
    _check_p(p)
    if b < 1:
        raise ValueError(f"batch size must be >= 1, got {b}")
    all_hit = p**b
    tokens = p * E_hit + (1.0 - p) * E_miss
    time = all_hit * max(1.0, T_p) + (1.0 - all_hit) * (1.0 + T_b)
    return tokens / (v * time)


def ssd_over_sd_bounds(p_hit: float, E_hit: float, E_sd: float, T_sd: float) -> tuple[float, float]:
    """Corollary 9: (1+T_SD)·(E_hit/E_SD)·p_hit <= SSD/SD <= (1+T_SD)·(E_hit/E_SD).

    Preconditions (derived from Theorem 7): the upper bound needs E_miss <= E_hit; the lower bound needs the
    primary hidden (T_p <= 1) and E_miss >= p_hit·E_hit·T_b (true for a free backup, T_b = 0, and for the
    just-in-time draft whenever T_b = T_SD <= 1 and E_miss = E_hit). v cancels in the ratio.
    """
    _check_p(p_hit)
    upper = (1.0 + T_sd) * E_hit / E_sd
    return p_hit * upper, upper


def critical_batch_size(
    p_hit: float,
    E_hit: float,
    E_sd: float,
    T_p: float,
    T_b: float,
    E_miss_fast: float = 1.0,
    T_b_fast: float = 0.0,
    max_batch: int = 1 << 16,
) -> int | None:
    """Theorem 17: smallest b at which a fast backup beats the just-in-time neural backup (Corollary 16).

    Neural backup: E_miss = E_sd, latency T_b (≈ T_SD). Fast backup: E_miss_fast (≈ 1), T_b_fast (≈ 0).
    Their ratio fast/neural is monotone in b (it grows when T_b >= T_b_fast: a neural miss anywhere stalls the
    whole batch), so every b >= b* also prefers the fast backup and b* is found by bisection (this runs before
    every lookup under `backup="auto"`). Returns None if no b <= max_batch does.
    """
    def fast_wins(b: int) -> bool:
        fast = speedup_ssd_batch(p_hit, b, E_hit, E_miss_fast, T_p, T_b_fast)
        return fast > speedup_ssd_batch(p_hit, b, E_hit, E_sd, T_p, T_b)

    if fast_wins(1):
        return 1
    if not fast_wins(max_batch):
        return None
    lo, hi = 1, max_batch  # the fast backup loses at lo and wins at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fast_wins(mid) else (mid, hi)
    return hi


# --- latencies and statistics ------------------------------------------------------------------------------


def _interpolate(points: Mapping[int, float], x: float) -> float:
    """Piecewise-linear through `points`; linear extrapolation from the two nearest ends; one point: constant."""
    xs = sorted(points)
    if not xs:
        raise ValueError("empty latency table")
    if x in points:
        return float(points[x])  # type: ignore[index]
    if len(xs) == 1:
        return float(points[xs[0]])
    if x < xs[0]:
        lo, hi = xs[0], xs[1]
    elif x > xs[-1]:
        lo, hi = xs[-2], xs[-1]
    else:
        hi = next(k for k in xs if k > x)
        lo = max(k for k in xs if k < x)
    y0, y1 = points[lo], points[hi]
    return float(y0 + (y1 - y0) * (x - lo) / (hi - lo))


def _lookup(table: Table | None, x: int, anchor: tuple[int, float]) -> float:
    """A callable table is called; a dict is interpolated with `anchor` added unless it has that key."""
    if callable(table):
        return float(table(x))
    points = {anchor[0]: anchor[1], **(table or {})}
    return _interpolate(points, x)


@dataclass
class Latencies:
    """Measured (or assumed) latencies in milliseconds, batch 1.

    - target_step_ms: one target forward over 1 token (an AR step; also verification at K = 0).
    - target_verify_ms: target forward over K+1 positions, keyed by K (draft tokens), or a callable K → ms;
      K=0 ↦ target_step_ms is implied. Empty: the paper's idealisation, verify = target_step_ms.
    - draft_step_ms: one single-token draft forward (SD drafting, just-in-time backup, the glue over s_K).
    - draft_forward_ms: draft forward over n tokens, keyed by n (1 ↦ draft_step_ms implied); the glue after a
      fast-backup speculation runs K+1 tokens.
    - draft_tree_ms: one tree step over B branches, keyed by B, or a callable B → ms (1 ↦ draft_step_ms).
    - backup_ms: a fast backup's cost per miss (n-gram / random tokens); the draft backup costs K·draft_step_ms.
    - ar_ms_per_token: measured plain decoding ms/token, if different from target_step_ms (loop overhead).
    - overlap_efficiency: speed of each of two concurrently running workers relative to running alone
      (0.9 for two torch threads on these 2 cores; 1.0 for separate GPUs).
    - round_overhead_ms: fixed per-round cost outside the forwards (Python, hand-offs), SD and SSD alike.
    """

    target_step_ms: float
    draft_step_ms: float
    target_verify_ms: Table = field(default_factory=dict)
    draft_forward_ms: Table = field(default_factory=dict)
    draft_tree_ms: Table = field(default_factory=dict)
    backup_ms: float = 0.0
    ar_ms_per_token: float | None = None
    overlap_efficiency: float = 1.0
    round_overhead_ms: float = 0.0

    def verify(self, K: int) -> float:
        """Target verification of K draft tokens (K+1 positions), ms."""
        return _lookup(self.target_verify_ms, K, (0, self.target_step_ms))

    def draft_forward(self, n: int) -> float:
        """Draft forward over n tokens, ms."""
        return _lookup(self.draft_forward_ms, n, (1, self.draft_step_ms))

    def tree_step(self, branches: int) -> float:
        """One tree-decode step over `branches` branches, ms."""
        return _lookup(self.draft_tree_ms, branches, (1, self.draft_step_ms))

    def ar(self) -> float:
        """AR decoding ms per token."""
        return self.ar_ms_per_token if self.ar_ms_per_token else self.target_step_ms

    def to_dict(self) -> dict[str, Any]:
        def table(t: Table) -> Any:
            return "callable" if callable(t) else {int(k): float(v) for k, v in t.items()}

        return {
            "target_step_ms": self.target_step_ms, "draft_step_ms": self.draft_step_ms,
            "target_verify_ms": table(self.target_verify_ms), "draft_forward_ms": table(self.draft_forward_ms),
            "draft_tree_ms": table(self.draft_tree_ms), "backup_ms": self.backup_ms,
            "ar_ms_per_token": self.ar_ms_per_token, "overlap_efficiency": self.overlap_efficiency,
            "round_overhead_ms": self.round_overhead_ms,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Latencies:
        """Inverse of `to_dict` (JSON keys may be strings)."""
        kwargs = dict(data)
        for key in ("target_verify_ms", "draft_forward_ms", "draft_tree_ms"):
            if key in kwargs:
                kwargs[key] = {int(k): float(v) for k, v in (kwargs[key] or {}).items()}
        return cls(**kwargs)


@dataclass
class Statistics:
    """Acceptance and cache statistics (greedy unless stated).

    - acceptance: i.i.d. per-token acceptance a, or a per-position conditional profile (see `expected_tokens`).
    - p_hit: probability the verification outcome was among the cached ones.
    - e_hit / e_miss: measured mean tokens per round after a hit / a miss (`SSDMetrics.tokens_per_round_*`);
      None: derived from `acceptance` (and `backup_acceptance` for a fast backup).
    - backup_acceptance: acceptance of a fast backup's tokens (0 for random tokens).
    """

    acceptance: Acceptance
    p_hit: float
    e_hit: float | None = None
    e_miss: float | None = None
    backup_acceptance: float = 0.0

    def e_sd(self, K: int) -> float:
        return expected_tokens(self.acceptance, K)

    def e_hit_for(self, K: int) -> float:
        return self.e_hit if self.e_hit else expected_tokens_hit(self.acceptance, K)

    def e_miss_for(self, K: int, backup: str = "draft") -> float:
        if self.e_miss:
            return self.e_miss
        return expected_tokens_miss(backup, self.acceptance, K, self.backup_acceptance)

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, Any]) -> Statistics:
        """From an `SSDMetrics.to_dict()` (or a bench `metrics_median`) mapping."""
        profile = [float(x) for x in metrics.get("per_position_acceptance") or []]
        acceptance: Acceptance = profile or float(metrics.get("draft_acceptance_rate", 0.0))
        return cls(
            acceptance=acceptance,
            p_hit=float(metrics.get("cache_hit_rate", 0.0)),
            e_hit=float(metrics.get("tokens_per_round_hit") or 0.0) or None,
            e_miss=float(metrics.get("tokens_per_round_miss") or 0.0) or None,
        )


# --- the round-time model ----------------------------------------------------------------------------------


def _concurrent(a: float, b: float, efficiency: float) -> float:
    """Wall time of two jobs started together that slow each other to `efficiency` while both run."""
    if not 0.0 < efficiency <= 1.0:
        raise ValueError(f"overlap_efficiency must lie in (0, 1], got {efficiency}")
    short, long = min(a, b), max(a, b)
    return long + short * (1.0 / efficiency - 1.0)


FAST_BACKUPS = ("fast", "ngram", "random")


def predict(
    latencies: Latencies, stats: Statistics, K: int, B: int, backup: str = "draft", label: str = "CPU as measured"
) -> dict[str, Any]:
    """Predicted AR / SD / SSD throughput (tok/s), ratios, and a per-round time breakdown (ms).

    - AR: 1 token per ``latencies.ar()`` ms.
    - SD (transformers' assisted loop): round = K·draft_step + verify(K) + overhead, E_SD tokens.
    - SSD, draft round d = glue + K·tree_step(B) (glue: draft_step after a cached / just-in-time speculation,
      draft_forward(K+1) after a fast backup), running concurrently with verification:
      hit round  = concurrent(verify(K), d) + overhead;
      miss round = backup + concurrent(verify(K), d) + overhead, backup = K·draft_step for ``backup="draft"``
      (the target waits for the just-in-time draft), else ``latencies.backup_ms``;
      concurrent(x, y) = max(x, y) + min(x, y)·(1/overlap_efficiency − 1) (= max on separate devices).
    With overlap_efficiency = 1, no overhead and d <= verify(K) this is Theorem 7 with T_p = d/t_v and
    T_b = backup/t_v (``normalised``: v, T_SD, T_p, T_b and the closed forms). Theorem 7 charges a miss 1 + T_b,
    i.e. assumes the primary round fits; here a miss costs backup + max(verify, d). ``normalised["effective"]``
    folds overlap, overhead and glue into T_SD, T_p, T_b so the closed forms reproduce the prediction exactly;
    Corollary 9's bounds are computed from them, with a flag telling whether its preconditions hold.
    """
    if K < 1 or B < 1:
        raise ValueError(f"need K >= 1 and B >= 1, got K={K}, B={B}")
    if backup not in ("draft", *FAST_BACKUPS):
        raise ValueError(f"backup must be 'draft' or one of {FAST_BACKUPS}, got {backup!r}")
    _check_p(stats.p_hit)
    lat = latencies
    t_ar, t_v, t_d, overhead = lat.ar(), lat.verify(K), lat.draft_step_ms, lat.round_overhead_ms
    eff = lat.overlap_efficiency
    e_sd, e_hit, e_miss = stats.e_sd(K), stats.e_hit_for(K), stats.e_miss_for(K, backup)
    p = stats.p_hit

    sd_draft = K * t_d
    sd_round = sd_draft + t_v + overhead
    tree = K * lat.tree_step(B)
    d_hit = t_d + tree
    if backup == "draft":
        backup_ms, d_miss = K * t_d, d_hit
    else:
        backup_ms, d_miss = lat.backup_ms, lat.draft_forward(K + 1) + tree

    def ssd_round(d: float, before: float) -> dict[str, float]:
        body = _concurrent(t_v, d, eff)
        return {
            "backup": before, "verify": t_v, "draft_round": d, "overlap_penalty": body - max(t_v, d),
            "target_idle": before + max(0.0, d - t_v), "overhead": overhead, "total": before + body + overhead,
        }

    hit, miss = ssd_round(d_hit, 0.0), ssd_round(d_miss, backup_ms)
    ssd_ms = p * hit["total"] + (1.0 - p) * miss["total"]
    ssd_tokens = p * e_hit + (1.0 - p) * e_miss
    ar_tps, sd_tps, ssd_tps = 1e3 / t_ar, 1e3 * e_sd / sd_round, 1e3 * ssd_tokens / ssd_ms
    T_sd, T_p, T_b = sd_draft / t_v, d_hit / t_v, backup_ms / t_v
    v = t_v / t_ar
    # Effective normalised latencies: whole round times (overlap penalty, overhead, glue) folded in, so that
    # Theorem 7 / the SD formula with them reproduce the tok/s above exactly.
    eff_sd, eff_p, eff_b = sd_round / t_v - 1.0, hit["total"] / t_v, miss["total"] / t_v - 1.0
    lower, upper = ssd_over_sd_bounds(p, e_hit, e_sd, eff_sd)
    preconditions = eff_p <= 1.0 + 1e-12 and e_miss <= e_hit and e_miss >= p * e_hit * eff_b
    return {
        "label": label, "K": K, "B": B, "backup": backup,
        "ar_tok_s": ar_tps, "sd_tok_s": sd_tps, "ssd_tok_s": ssd_tps,
        "sd_over_ar": sd_tps / ar_tps, "ssd_over_ar": ssd_tps / ar_tps, "ssd_over_sd": ssd_tps / sd_tps,
        "E_sd": e_sd, "E_hit": e_hit, "E_miss": e_miss, "p_hit": p,
        "normalised": {
            "v": v, "T_sd": T_sd, "T_p": T_p, "T_b": T_b,
            "theorem7_ssd_over_ar": speedup_ssd(p, e_hit, e_miss, T_p, T_b, v),
            "sd_formula_over_ar": speedup_sd(e_sd, T_sd, v),
            "effective": {"T_sd": eff_sd, "T_p": eff_p, "T_b": eff_b},
            "corollary9_ssd_over_sd": [lower, upper],
            "corollary9_preconditions": preconditions,
        },
        "breakdown_ms": {
            "ar_per_token": t_ar,
            "sd_round": {"draft": sd_draft, "verify": t_v, "overhead": overhead, "total": sd_round},
            "ssd_hit_round": hit, "ssd_miss_round": miss, "ssd_mean_round": ssd_ms,
            "ssd_mean_target_wait": p * hit["target_idle"] + (1.0 - p) * miss["target_idle"],
        },
    }


# --- why measurements differ -------------------------------------------------------------------------------


def explain_gap(
    predicted: Mapping[str, Any], measured: float | None, overheads: Mapping[str, Any] | None = None,
    tolerance: float = 0.10,
) -> list[str]:
    """Human-readable reasons why measured SSD tok/s differs from `predict(...)` by more than `tolerance`.

    `overheads` is an `SSDMetrics.to_dict()`-like mapping (rounds, wall/verify/target_wait seconds,
    cache_hit_rate, mean_accepted_length); `measured` defaults to generated_tokens / wall_seconds from it.
    Returns [] when within tolerance (or nothing to compare).
    """
    m = dict(overheads or {})
    if measured is None and m.get("wall_seconds") and m.get("generated_tokens"):
        measured = m["generated_tokens"] / m["wall_seconds"]
    expected = predicted["ssd_tok_s"]
    if not measured or not expected:
        return []
    gap = measured / expected - 1.0
    if abs(gap) <= tolerance:
        return []
    br = predicted["breakdown_ms"]
    round_ms = br["ssd_mean_round"]
    reasons = [
        f"measured {measured:.2f} tok/s is {abs(gap):.0%} {'below' if gap < 0 else 'above'} the predicted "
        f"{expected:.2f} tok/s (predicted round {round_ms:.1f} ms, {predicted['ssd_over_ar']:.2f}x AR)"
    ]
    rounds = m.get("rounds") or 0
    if rounds:
        wall = 1e3 * m.get("wall_seconds", 0.0) / rounds
        verify = 1e3 * m.get("verify_seconds", 0.0) / rounds
        wait = 1e3 * m.get("target_wait_seconds", 0.0) / rounds
        python = wall - verify - wait
        reasons.append(f"measured round {wall:.1f} ms = verify {verify:.1f} + target wait {wait:.1f} "
                       f"+ other {python:.1f} (predicted {round_ms:.1f})")
        t_v = br["ssd_hit_round"]["verify"]
        if verify > 1.1 * t_v:
            reasons.append(f"verification took {verify:.1f} ms/round vs {t_v:.1f} assumed (+{verify / t_v - 1:.0%}): "
                           "the target is slowed by the concurrent draft (core contention) or the context is longer")
        want_wait = br["ssd_mean_target_wait"]
        if wait - want_wait > 0.05 * round_ms:
            reasons.append(f"the target waited {wait:.1f} ms/round for the draft vs {want_wait:.1f} predicted: the "
                           "draft round (glue + K tree steps) does not fit inside verification, or misses cost more")
        overhead = br["ssd_hit_round"]["overhead"]
        if python - overhead > 0.05 * round_ms:
            reasons.append(f"Python/hand-off overhead per round (wall − verify − wait) is {python:.1f} ms "
                           f"({python / wall:.0%} of the round) vs {overhead:.1f} ms assumed")
    hit = m.get("cache_hit_rate")
    if hit is not None and m.get("cache_lookups", 1) and hit < predicted["p_hit"] - 0.02:
        reasons.append(f"hit rate {hit:.2f} is lower than the assumed {predicted['p_hit']:.2f}: more rounds pay "
                       f"the backup ({br['ssd_miss_round']['backup']:.1f} ms each)")
    tokens = m.get("mean_accepted_length")
    want_tokens = predicted["p_hit"] * predicted["E_hit"] + (1 - predicted["p_hit"]) * predicted["E_miss"]
    if tokens and tokens < 0.95 * want_tokens:
        reasons.append(f"{tokens:.2f} tokens per round vs {want_tokens:.2f} assumed: lower acceptance than assumed")
    if len(reasons) == 1 + bool(rounds):
        reasons.append("no measured overhead explains the gap: check machine load, thread settings and warm-up")
    return reasons
