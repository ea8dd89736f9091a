"""The draft's confidence in its tokens as a predictor of their acceptance, and where just-in-time drafting stops.

Every drafted token carries the draft's confidence c (its top probability under greedy decoding, q of the token when
sampling: `Speculation.confidence`). How often the target accepts a token of confidence c, f(c), is learnt online per
run and kept for the next calls with the same pair (`ConfidenceCalibration`: decayed counts per confidence bin, each
shrunk to a prior until measured: the run's pooled acceptance, so that a bin without samples behaves as if confidence
told nothing), from every verified token and the free sample one position beyond. The lookahead policy uses f twice:

* how many of this round's drafted tokens to verify: E(K) = 1 + Σ_{i<=K} Π_{j<=i} f(c_j) of the speculation in hand
  (per row, averaged over a batch's rows) instead of the run's average acceptance per position; a speculation whose
  draft hesitated at its second token is verified one token deep, one it was sure of all the way through;
* how far the draft drafts just in time (a serial round's speculation, a backup's on a miss): token after token
  while the expected gain of the next one, reach × f(c) (reach: the chance every earlier token is accepted), is
  worth its cost (`StopRule`), as transformers' `assistant_confidence_threshold` stops its assistant, but with the
  threshold learnt and priced rather than fixed.

Which tokens get verified and how many get drafted depend only on the draft's side (its tokens and their
probabilities), never on the target's draws: verification stays exact, whatever is chosen.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from .estimates import non_decreasing

# Bin edges over [0, 1]: finer near 1, where most of a good draft's tokens fall and acceptance changes fastest.
EDGES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98)
DECAY = 0.98  # per round that brings samples: the pair's calibration moves slowly with the text
PRIOR_WEIGHT = 2.0  # samples' worth of the prior f(c) = c (each bin's midpoint)


def bin_of(confidence: torch.Tensor) -> torch.Tensor:
    """The bin index (0..len(EDGES)) of each confidence."""
    edges = torch.tensor(EDGES, dtype=torch.float32, device=confidence.device)
    return torch.bucketize(confidence.float(), edges, right=True)


def _midpoints() -> list[float]:
    bounds = (0.0, *EDGES, 1.0)
    return [(lo + hi) / 2 for lo, hi in zip(bounds[:-1], bounds[1:])]


class ConfidenceCalibration:
    """f(c): the acceptance of a drafted token given the draft's confidence in it, per bin (see the module
    docstring)."""

    def __init__(self, decay: float = DECAY, prior_weight: float = PRIOR_WEIGHT):
        self.decay, self.prior_weight = decay, prior_weight
        self.prior = _midpoints()
        self.reached = [0.0] * len(self.prior)
        self.passed = [0.0] * len(self.prior)
        self.samples = 0

    def forget(self) -> None:
        """Age every count by one round."""
        self.reached = [self.decay * r for r in self.reached]
        self.passed = [self.decay * p for p in self.passed]

    def add(self, confidence: float, accepted: float) -> None:
        """One sample: a token of that confidence was accepted (1), rejected (0), or accepted with that
        probability (a free sample under sampling)."""
        b = bisect.bisect_right(EDGES, confidence)
        self.reached[b] += 1.0
        self.passed[b] += accepted
        self.samples += 1

    def table(self, prior: float | None = None) -> list[float]:
        """f per bin: measured, shrunk to `prior` (default: each bin's midpoint), and non-decreasing in confidence (a
        more confident token is never predicted less likely accepted: adjacent bins that disagree are pooled)."""
        w = self.prior_weight
        priors = self.prior if prior is None else [prior] * len(self.prior)
        values = [(p + m * w) / (r + w) for p, r, m in zip(self.passed, self.reached, priors)]
        weights = [r + w for r in self.reached]
        return non_decreasing(values, weights)

    def acceptance(self, confidence: torch.Tensor, table: list[float] | None = None) -> torch.Tensor:
        """f(c) for a tensor of confidences (float32, same shape)."""
        table = self.table() if table is None else table
        lookup = torch.tensor(table, dtype=torch.float32, device=confidence.device)
        return lookup[bin_of(confidence)]


def expected_tokens_per_row(acceptance: torch.Tensor) -> torch.Tensor:
    """E(k) for k = 0..n per row from per-token acceptances [rows, n]: [rows, n + 1], E(0) = 1."""
    reach = torch.cumprod(acceptance.float(), dim=-1)
    return torch.cat([torch.ones_like(reach[:, :1]), 1.0 + reach.cumsum(dim=-1)], dim=-1)


@dataclass(frozen=True)
class StopRule:
    """Where just-in-time drafting stops: after a token, when no row expects the next one to be worth drafting,
    i.e. reach × f(c) < `gain` for every row (reach: Π f over the row's tokens so far, c: the latest token's
    confidence, standing in for the next one's). `table` is f per bin (`ConfidenceCalibration.table`); `gain` the
    expected tokens a drafted token must bring to pay for itself (the round's speed times its cost). Plain data: it
    crosses to a worker process as `to_list` / `from_list`."""

    table: tuple[float, ...]
    gain: float
    _lookup: torch.Tensor = field(init=False, repr=False, compare=False)  # `table` as a tensor, built once

    def __post_init__(self) -> None:
        object.__setattr__(self, "_lookup", torch.tensor(self.table, dtype=torch.float32))

    def keeps_going(self, reach: torch.Tensor, confidence: torch.Tensor, rows: torch.Tensor
                    ) -> tuple[bool, torch.Tensor]:
        """(whether to draft another token, the rows' reach including the latest token) given the reach before it
        [b], the latest token's confidence [b] and the rows drafting [b] (bool)."""
        f = self._lookup.to(confidence.device)[bin_of(confidence)]
        reach = reach * f
        worth = (reach * f >= self.gain) & rows
        return bool(worth.any()), reach

    def to_list(self) -> list[float]:
        return [self.gain, *self.table]

    @classmethod
    def from_list(cls, values) -> StopRule | None:
        values = [float(v) for v in values]
        if not values or values[0] <= 0:
            return None
        return cls(tuple(values[1:]), values[0])
