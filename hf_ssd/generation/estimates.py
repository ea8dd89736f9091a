"""What the lookahead policy estimates from a run and remembers across runs: acceptance per draft position
(`AcceptanceTracker`), verification times per K and each draft's pooled acceptance per target (`LookaheadMemory`),
E(K), the tokens a round verifying K draft tokens yields (`expected_tokens`), and the
weighted non-decreasing fit both the confidence calibration and the verification cost curve use (`non_decreasing`)."""

from __future__ import annotations

import weakref

DECAY = 0.85  # per round that brings samples: half the weight of a sample after ~4 of them
REMEMBER_AFTER = 2  # timings of a K before `LookaheadMemory` serves its time to later calls
COST_DECAY = 0.7  # for times (the context grows: recent rounds weigh most)
# Width of `AcceptanceTracker.optimistic`: Hoeffding's bound at 75 % (ln 4 / 2) over a position's decayed samples.
OPTIMISM = 0.69


def expected_tokens(acceptance: list[float], k: int) -> float:
    """E(k) = 1 + Σ_{i<=k} Π_{j<=i} a_j: tokens per round verifying k draft tokens (the bonus included)."""
    total, reach = 1.0, 1.0
    for a in acceptance[:k]:
        reach *= a
        total += reach
    return total


def non_decreasing(values: list[float], weights: list[float]) -> list[float]:
    """The weighted least-squares non-decreasing fit of `values` (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return [v for v, _, n in blocks for _ in range(n)]


class AcceptanceTracker:
    """Per draft position j = 1..K_max+1: decayed counts of (reached, accepted). The first position's estimate shrinks
    to the run's pooled acceptance (every sample at every position, no forgetting), itself shrunk to `prior`; the later
    positions' to the run's acceptance at the positions after the first (`later`, no forgetting), itself shrunk to the
    pooled acceptance. Acceptance comes in runs: a position after the first is reached only when the ones before were
    accepted, and is accepted more often than the first (the real pair on translation prompts: a_1 0.4-0.6,
    a_2..a_5 0.6-0.9). A position not reached for a while (deep ones, while plain steps or one-token speculations
    only measure a_1) reverts to what this pair has shown at such positions, not to a fixed guess nor to the first
    position's odds."""

    def __init__(self, positions: int, prior: float, prior_weight: float = 1.0, pooled_weight: float = 2.0):
        self.reached = [0.0] * positions
        self.passed = [0.0] * positions
        self.prior, self.prior_weight, self.pooled_weight = prior, prior_weight, pooled_weight
        self.pooled_reached = self.pooled_passed = 0.0
        self.later_reached = self.later_passed = 0.0  # the positions after the first, no forgetting

    def decay(self) -> None:
        self.reached = [DECAY * r for r in self.reached]
        self.passed = [DECAY * p for p in self.passed]

    def add(self, position: int, accepted: float) -> None:
        """`accepted` is 0/1 (a verified token) or a probability (a free sample under sampling)."""
        if position < len(self.reached):
            self.reached[position] += 1.0
            self.passed[position] += accepted
            self.pooled_reached += 1.0
            self.pooled_passed += accepted
            if position > 0:
                self.later_reached += 1.0
                self.later_passed += accepted

    def pooled(self) -> float:
        w = self.pooled_weight
        return (self.pooled_passed + self.prior * w) / (self.pooled_reached + w)

    def later(self) -> float:
        """The run's acceptance at the positions after the first, shrunk to `pooled`."""
        w = self.pooled_weight
        return (self.later_passed + self.pooled() * w) / (self.later_reached + w)

    def beyond_first(self) -> float:
        """The recent acceptance of the positions after the first: their decayed counts pooled, shrunk to `later`."""
        w = self.prior_weight
        return (sum(self.passed[1:]) + self.later() * w) / (sum(self.reached[1:]) + w)

    def estimates(self) -> list[float]:
        w, first, later = self.prior_weight, self.pooled(), self.later()
        return [(p + (first if j == 0 else later) * w) / (r + w)
                for j, (p, r) in enumerate(zip(self.passed, self.reached))]

    def optimistic(self, position: int) -> float:
        """An upper bound of the position's acceptance: its estimate plus Hoeffding's width over its decayed samples
        (`OPTIMISM`). Wide while the position is rarely reached (two rejections measured early, then decayed, say
        little), narrow once sampled round after round."""
        width = (OPTIMISM / (self.reached[position] + self.prior_weight)) ** 0.5
        return min(1.0, self.estimates()[position] + width)


def memory_key(setting: tuple, rows: int, serial: bool = False) -> tuple:
    """`LookaheadMemory`'s key for verification times: the policy's setting (executor, target threads), the count of
    active rows, and "serial" for verifications the draft sat out. `LookaheadMemory.by_rows` reads keys back by
    this layout, so it lives here, beside the memory."""
    return (*setting, rows, *(("serial",) if serial else ()))


class LookaheadMemory:
    """What one target has shown across `generate()` calls, so a call does not relearn it: the verification time per K
    for each setting (concurrent draft or not, target threads, active rows), each draft's pooled acceptance, what its
    probes cost, what a further token of its just-in-time drafting costs and what its prepare beside a verification
    costs. A new call scales the remembered times by what it has measured itself (context and machine load move them
    all), and does not explore a K already timed (a K >= 1 is timed again once `RETIME_AFTER` rounds stale, a close
    plain step at once: `LookaheadPolicy._choose`). A time is served to later calls once timed twice
    (`REMEMBER_AFTER`): a single timing may be a one-off (a process's first forwards, a busy moment), and a remembered
    cost far above the best is never timed again (measured: one serial verification of 3 positions at 800 ms in a
    bench's 8-token warm-up, against 365 ms when timed later, kept every later call's serial speculations one token
    deep on translation). Kept beside the target model (weakly: it goes with the model)."""

    _by_model: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self):
        self.verify: dict[tuple, dict[int, float]] = {}
        self.samples: dict[tuple, dict[int, int]] = {}  # timings behind each remembered time
        self.acceptance: dict[int, float] = {}  # draft key -> its pooled acceptance against this target
        self.acceptance_reached: dict[int, float] = {}  # draft key -> positions verified behind it, over all calls
        self.calibration: dict[int, object] = {}  # draft key -> its `ConfidenceCalibration` against this target
        self.probe_cost: dict[tuple, float] = {}  # (draft key, setting) -> a probe's cost in plain steps
        self.serial_step: dict[tuple, float] = {}  # (draft key, setting) -> seconds per further just-in-time token
        self.draft_round: dict[tuple, float] = {}  # (draft key, setting) -> seconds of a prepare beside a verification
        self.runner_ups: dict[int, object] = {}  # draft key -> its `RunnerUpCalibration` against this target

    @classmethod
    def of(cls, model) -> LookaheadMemory:
        try:
            return cls._by_model.setdefault(model, cls())
        except TypeError:  # not weakly referable: nothing is remembered
            return cls()

    def times(self, setting: tuple) -> dict[int, float]:
        """The remembered verification time per K of `setting`, for the K timed at least `REMEMBER_AFTER` times."""
        counts = self.samples.get(setting, {})
        return {k: t for k, t in self.verify.get(setting, {}).items() if counts.get(k, 0) >= REMEMBER_AFTER}

    def by_rows(self, setting: tuple, serial: bool = False) -> dict[int, dict[int, float]]:
        """`times` per count of active rows of `setting` (the policy's setting without its rows: `memory_key`)."""
        n = len(setting)
        return {key[n]: self.times(key) for key in self.verify
                if len(key) > n and memory_key(setting, key[n], serial) == key}

    def record(self, setting: tuple, k: int, seconds: float) -> None:
        times, counts = self.verify.setdefault(setting, {}), self.samples.setdefault(setting, {})
        counts[k] = counts.get(k, 0) + 1
        if counts[k] <= REMEMBER_AFTER:  # the lowest of the first timings (a one-off only ever slows one down)
            times[k] = min(times.get(k, seconds), seconds)
        else:
            times[k] = COST_DECAY * times[k] + (1 - COST_DECAY) * seconds
