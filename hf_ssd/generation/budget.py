"""The fan-out budget: how many branches per row the draft prepares in a round, B_r in {B, B/2, B/4, ..., 1}.

More branches catch more verification outcomes (a miss falls to the backup: its time and, for the fast backups,
fewer accepted tokens) but cost the draft more: each of the K tree steps runs over B_r branches of every row. While
the draft's round fits inside the verification it overlaps, the full budget is free and kept; when it does not (a
batch of rows on a CPU core, a slow draft) the round waits for the draft, and a smaller budget may pay. Each round
takes the budget with the most expected tokens per second,

    rate(B_r) = (h E_hit + (1 - h) E_miss) / (max(T_v, T_d(B_r)) + (1 - h) T_b + overhead),  h = hit rate at B_r,

(T_v + T_d when the draft runs inline), from what the run measured: the draft's round T_d per budget, the hit rate
per budget, tokens per round after a hit and after a miss, the backup's time T_b. An unmeasured budget is guessed
from the measured ones (a fixed part and a part per branch; from a single measurement optimistically, in proportion
to branches) so that it gets tried once when it might win, one step (a halving or doubling) from the budget in use
at a time; an unmeasured hit rate follows the power law of the fan-out (miss ∝ B^-r, `SSDConfig.power_law_prior`)
from the nearest measured budget. Leaving the budget in use asks for `SWITCH_MARGIN` more.
"""

from __future__ import annotations

SWITCH_MARGIN = 1.03
DECAY = 0.7  # recent rounds weigh most (the context grows; the text changes)


def budget_options(branches: int) -> list[int]:
    """B, B/2, B/4, ..., 1 (largest first)."""
    return sorted({max(1, branches >> i) for i in range(max(branches, 1).bit_length())}, reverse=True)


class FanoutBudget:
    """Chooses each round's fan-out budget (see the module docstring) and records what it measured per budget."""

    def __init__(self, branches: int, adaptive: bool, power: float, concurrent: bool):
        self.branches, self.adaptive, self.power, self.concurrent = branches, adaptive, power, concurrent
        self.options = budget_options(branches) if adaptive else [branches]
        self.current = branches
        self.draft: dict[int, float] = {}  # budget -> seconds of a full-depth prepare (decayed mean)
        self.misses: dict[int, list[float]] = {}  # budget -> decayed [misses, lookups]

    # --- estimates ---------------------------------------------------------------------------------------------
    def draft_seconds(self, budget: int) -> float | None:
        """T_d(budget): measured; else on the line (a fixed part plus a part per branch) through the two nearest
        measured budgets; with one measured, in proportion to branches below it and as cheap as it above (both
        optimistic)."""
        if budget in self.draft:
            return self.draft[budget]
        if not self.draft:
            return None
        nearest = sorted(self.draft, key=lambda b: abs(b - budget))[:2]
        if len(nearest) == 2:
            (b0, b1), (t0, t1) = nearest, (self.draft[nearest[0]], self.draft[nearest[1]])
            return max(t0 + (t1 - t0) * (budget - b0) / (b1 - b0), 0.0)
        measured = nearest[0]
        return self.draft[measured] * min(budget / measured, 1.0)

    def miss_rate(self, budget: int, fallback: float) -> float:
        """1 - h(budget): measured (at least two lookups' weight), else by the power law from the nearest measured
        budget, else `fallback` (the run's hit-rate estimate) by the power law from the budget in use."""
        measured = {b: m / n for b, (m, n) in self.misses.items() if n >= 2.0}
        if budget in measured:
            return measured[budget]
        if measured:
            ref = min(measured, key=lambda b: abs(b - budget))
            base = measured[ref]
        else:
            ref, base = self.current, fallback
        return min(1.0, base * (budget / ref) ** (-self.power))

    def rate(self, budget: int, verify: float, backup: float, overhead: float, e_hit: float, e_miss: float,
             miss_fallback: float) -> float | None:
        draft = self.draft_seconds(budget)
        if draft is None:
            return None
        miss = self.miss_rate(budget, miss_fallback)
        body = max(verify, draft) if self.concurrent else verify + draft
        seconds = body + miss * backup + max(overhead, 0.0)
        return ((1 - miss) * e_hit + miss * e_miss) / seconds if seconds > 0 else None

    # --- the decision ------------------------------------------------------------------------------------------
    def choose(self, verify: float | None, backup: float, overhead: float, e_hit: float, e_miss: float,
               miss_fallback: float) -> tuple[int, dict[int, float]]:
        """The budget for this round's prepare and the rates that decided (empty while nothing is measured)."""
        if len(self.options) == 1 or verify is None:
            return self.current, {}
        rates = {}
        at = self.options.index(self.current)
        for i, budget in enumerate(self.options):
            if budget not in self.draft and abs(i - at) > 1:  # unmeasured: only one step from the budget in use
                continue
            value = self.rate(budget, verify, backup, overhead, e_hit, e_miss, miss_fallback)
            if value is not None:
                rates[budget] = value
        if self.current in rates:
            best = max(rates, key=lambda b: (rates[b], b))
            if rates[best] > SWITCH_MARGIN * rates[self.current]:
                self.current = best
        return self.current, rates

    # --- what a round measured -----------------------------------------------------------------------------------
    def observe(self, budget: int, prepare_seconds: float | None, hits: int, lookups: int) -> None:
        """A round prepared at `budget`: its full-depth prepare time (None: not comparable, e.g. a one-token probe)
        and the lookups it served."""
        if prepare_seconds is not None:
            old = self.draft.get(budget)
            self.draft[budget] = prepare_seconds if old is None else DECAY * old + (1 - DECAY) * prepare_seconds
        if lookups:
            for stats in self.misses.values():
                stats[0] *= DECAY
                stats[1] *= DECAY
            stats = self.misses.setdefault(budget, [0.0, 0.0])
            stats[0] += lookups - hits
            stats[1] += lookups
