"""The draft's confidence in its tokens as a predictor of their acceptance, and where just-in-time drafting stops.

Every drafted token carries the draft's confidence c (its top probability under greedy decoding, q of the token when
sampling: `Speculation.confidence`). How often the target accepts a token of confidence c, f(c), is learnt online per
run and kept for the next calls with the same pair (`ConfidenceCalibration`: decayed counts per confidence bin, each
shrunk to a prior until measured: the run's acceptance, so that a bin without samples behaves as if confidence told
nothing), from every verified token and the free sample one position beyond. It is learnt apart for a speculation's
first token and for the tokens after it (`FIRST`, `LATER`): acceptance comes in runs, so a token whose drafted
predecessors were all accepted is accepted more often than the first one at the same confidence (measured on the real
pair, translation prompts: a_1 0.4-0.6, a_2..a_5 0.6-0.9 given the ones before accepted); one table for both priced
every later token at the first one's odds and stopped drafting one or two tokens deep where SD's fixed K = 4 had its
four accepted. The lookahead policy uses f three times:

* how many of this round's drafted tokens to verify: E(K) = 1 + Σ_{i<=K} Π_{j<=i} f_j(c_j) of the speculation in hand
  (f_1 the first token's table, f_j the later one's; per row, averaged over a batch's rows) instead of the run's
  average acceptance per position; a speculation whose draft hesitated at its second token is verified one token
  deep, one it was sure of all the way through;
* how far the draft drafts just in time (a serial round's speculation, a backup's on a miss): token after token
  while the expected gain of the next one, reach × f_next(c) (reach: the chance every earlier token is accepted;
  f_next(c): how often a token after one of confidence c is accepted, the `NEXT` table, learnt from every later
  token's sample by its predecessor's confidence, since the next token's own confidence is known only once it is
  drafted), is worth its cost (`StopRule`), as transformers' `assistant_confidence_threshold` stops its assistant,
  but with the threshold learnt and priced rather than fixed;
* what serial speculation is worth against plain steps (`confident_speed`): serial rounds draft deep where the first
  token is sure and verify nothing where it is not, so their speed is priced per first-token confidence bin,
  weighted by how often the draft's first tokens fall in it, not at the run's average acceptance.

The pair's calibration is pooled over every call with the same draft, and texts differ: a call on code accepts 99 % of
the tokens after a sure one where the pool, mostly prose, says 89 %, so the stop rule priced every run past the cost
curve's jump as a loss and held code answers two tokens deep, all accepted, where assisted generation's default
drafted 10-20. Each call therefore also counts its own samples (`LookaheadPolicy.call_calibration`) and shifts every
table's log-odds by one amount, the shift that best explains them under a normal prior (`call_shift`, as Platt
scaling fits an intercept): a few samples move the tables little, a call's worth of them moves them to where the
call's own acceptance lies (on a 2-core EPYC the same answers then ran 16 tokens deep from their fourth round).

Which tokens get verified and how many get drafted depend only on the draft's side (its tokens and their
probabilities), never on the target's draws: verification stays exact, whatever is chosen.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import torch

from .estimates import non_decreasing

# Bin edges over [0, 1]: finer near 1, where most of a good draft's tokens fall and acceptance changes fastest.
EDGES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98)
DECAY = 0.98  # per round that brings samples: the pair's calibration moves slowly with the text
PRIOR_WEIGHT = 2.0  # samples' worth of the prior f(c) = c (each bin's midpoint)
FIRST, LATER = 0, 1  # a speculation's first token; a token after drafted ones (reached only when they were accepted)
NEXT = 2  # a token after drafted ones, by the confidence of the token before it (what drafting it is decided on)
SHIFT_SPREAD = 1.0  # the prior's standard deviation of a call's log-odds shift from the pair's calibration
SHIFT_LIMIT = 6.0  # the most a call's samples shift the log-odds either way (two hundred-fold in odds)


def bin_of(confidence: torch.Tensor) -> torch.Tensor:
    """The bin index (0..len(EDGES)) of each confidence."""
    edges = torch.tensor(EDGES, dtype=torch.float32, device=confidence.device)
    return torch.bucketize(confidence.float(), edges, right=True)


def _midpoints() -> list[float]:
    bounds = (0.0, *EDGES, 1.0)
    return [(lo + hi) / 2 for lo, hi in zip(bounds[:-1], bounds[1:])]


class ConfidenceCalibration:
    """f(c): the acceptance of a drafted token given the draft's confidence in it, per bin, for a speculation's first
    token and for the later ones (see the module docstring)."""

    def __init__(self, decay: float = DECAY, prior_weight: float = PRIOR_WEIGHT):
        self.decay, self.prior_weight = decay, prior_weight
        self.prior = _midpoints()
        self.reached = [[0.0] * len(self.prior) for _ in (FIRST, LATER, NEXT)]
        self.passed = [[0.0] * len(self.prior) for _ in (FIRST, LATER, NEXT)]
        self.samples = 0
        self.version = 0  # counts the changes (`add`, `forget`): what reads the tables may cache them between

    def forget(self) -> None:
        """Age every count by one round."""
        self.version += 1
        self.reached = [[self.decay * r for r in counts] for counts in self.reached]
        self.passed = [[self.decay * p for p in counts] for counts in self.passed]

    def add(self, confidence: float, accepted: float, position: int = 0, previous: float | None = None) -> None:
        """One sample: the token at `position` of its speculation (0: the first), of that confidence, was accepted
        (1), rejected (0), or accepted with that probability (a free sample under sampling); `previous`, the
        confidence of the token before it (a later token's), is the sample's bin in the `NEXT` table."""
        kind, b = min(position, LATER), bisect.bisect_right(EDGES, confidence)
        self.reached[kind][b] += 1.0
        self.passed[kind][b] += accepted
        if position > 0 and previous is not None:
            b = bisect.bisect_right(EDGES, previous)
            self.reached[NEXT][b] += 1.0
            self.passed[NEXT][b] += accepted
        self.samples += 1
        self.version += 1

    def add_at(self, confidences: list[float], position: int, accepted: float) -> None:
        """`add` for the token at `position` of a speculation whose tokens had `confidences` (the one before it, if
        any, is its `previous`)."""
        self.add(confidences[position], accepted, position, confidences[position - 1] if position else None)

    def table(self, prior: float | list[float] | None = None, kind: int = FIRST) -> list[float]:
        """f per bin for `kind` (`FIRST` or `LATER`): measured, shrunk to `prior` (one value or one per bin; default:
        each bin's midpoint), and non-decreasing in confidence (a more confident token is never predicted less
        likely accepted: adjacent bins that disagree are pooled)."""
        w, reached, passed = self.prior_weight, self.reached[kind], self.passed[kind]
        if prior is None:
            priors = self.prior
        else:
            priors = list(prior) if isinstance(prior, (list, tuple)) else [prior] * len(self.prior)
        values = [(p + m * w) / (r + w) for p, r, m in zip(passed, reached, priors)]
        weights = [r + w for r in reached]
        return non_decreasing(values, weights)

    def tables(self, first: float | None = None, later: float | None = None) -> tuple[list[float], list[float]]:
        """(f of a first token, f of a later one) per bin, each shrunk to its prior (`table`). A later token's
        prior at a bin is the higher of `later` and the first token's f there: acceptance comes in runs, so a token
        whose predecessors were accepted is taken at least as often as a first one of the same confidence. Later
        tokens are sampled only when the ones before them are accepted, so early in a run their table may rest on
        a couple of rejections; a flat prior at that rate made confidence tell nothing about them and stopped
        every speculation after its first token (translation on the real pair: f_later 0.08 in every bin, where
        assisted generation's confident drafts then ran 15 tokens, all accepted)."""
        first_table = self.table(first, FIRST)
        if later is None:
            return first_table, self.table(None, LATER)
        return first_table, self.table([max(f, later) for f in first_table], LATER)

    def next_table(self, later: list[float]) -> list[float]:
        """f of the token after one of confidence c (a later token's acceptance by its predecessor's confidence, the
        only one known when deciding whether to draft it), per bin, shrunk to `later` (the `LATER` table: as if the
        next token were as sure as this one, which is what the stop rule assumed before measuring it)."""
        return self.table(later, NEXT)

    def acceptance(self, confidence: torch.Tensor, tables: tuple[list[float], list[float]] | None = None
                   ) -> torch.Tensor:
        """f(c) for a tensor of confidences [..., n] (float32, same shape) of speculations' tokens in order: the
        first position by the first token's table, the others by the later one's."""
        first, later = self.tables() if tables is None else tables
        bins = bin_of(confidence)
        f = torch.tensor(later, dtype=torch.float32, device=confidence.device)[bins]
        if f.shape[-1]:
            f[..., 0] = torch.tensor(first, dtype=torch.float32, device=confidence.device)[bins[..., 0]]
        return f


def _logit(p: float) -> float:
    p = min(max(p, 1e-4), 1.0 - 1e-4)
    return math.log(p / (1.0 - p))


def call_shift(call: ConfidenceCalibration, tables: tuple[list[float], list[float]], spread: float = SHIFT_SPREAD,
               steps: int = 20) -> float:
    """δ: how far this call's acceptance departs from the pair's calibration, as one shift of the log-odds of every
    f(c): the maximum a posteriori δ (a normal prior of standard deviation `spread` around 0) under which the call's
    own samples (`call`: its counts per bin of a first token and of a later one; decayed as the pair's are) were
    drawn from sigmoid(logit(f_b) + δ) with f_b the pair's `tables` (first, later) at their bin. Newton's method on
    the concave log posterior; 0 without samples."""
    terms = [(_logit(f), r, call.passed[kind][b]) for kind, table in zip((FIRST, LATER), tables)
             for b, (f, r) in enumerate(zip(table, call.reached[kind])) if r > 0]
    if not terms:
        return 0.0
    delta, precision = 0.0, 1.0 / spread ** 2
    for _ in range(steps):
        slope, curvature = -delta * precision, precision
        for logit, reached, passed in terms:
            p = 1.0 / (1.0 + math.exp(-(logit + delta)))
            slope += passed - reached * p
            curvature += reached * p * (1.0 - p)
        step = slope / curvature
        delta = min(max(delta + step, -SHIFT_LIMIT), SHIFT_LIMIT)
        if abs(step) < 1e-6:
            break
    return delta


def shifted(table: list[float], delta: float) -> list[float]:
    """f per bin with its log-odds shifted by `delta` (`call_shift`); the table itself for δ = 0."""
    if delta == 0.0:
        return list(table)
    return [1.0 / (1.0 + math.exp(-(_logit(f) + delta))) for f in table]


def expected_tokens_per_row(acceptance: torch.Tensor) -> torch.Tensor:
    """E(k) for k = 0..n per row from per-token acceptances [rows, n]: [rows, n + 1], E(0) = 1."""
    reach = torch.cumprod(acceptance.float(), dim=-1)
    return torch.cat([torch.ones_like(reach[:, :1]), 1.0 + reach.cumsum(dim=-1)], dim=-1)


@dataclass(frozen=True)
class StopRule:
    """Where just-in-time drafting stops: after a token, when the rows drafting do not expect the next one to be worth
    drafting, i.e. their mean reach × f_next(c) < the gain of the next token (reach: Π f over the row's tokens so
    far, the first by `table`, the others by `later`; c: the latest token's confidence, f_next(c) the acceptance of a
    token after one of that confidence). `table` and `later` are f per bin of a speculation's first token and of the
    ones after it (`ConfidenceCalibration.tables`; `later` defaults to `table`), `next` f of the token after one of
    confidence c (`ConfidenceCalibration.next_table`; defaults to `later`: the latest token's confidence standing in
    for the next one's). A token's gain is the expected tokens it must bring to pay for itself (the round's speed times
    its cost): `gain` for drafting it, plus `extra[n - 1]` for verifying it as the (n + 1)-th (the cost curve's step
    there; the last one past the end, none when empty); the next token is drafted when some run of further tokens
    pays for itself as a whole (`_worth`: past a jump in the curve, the tokens beyond it share its price).
    `at_least`: the tokens drafted whatever the rule says (2: the second is the free sample of the next position's
    acceptance, see `LookaheadPolicy.stop_rule`). `runner_up`, per bin of the first token's confidence: the tokens
    its runner-up is expected to bring, net of its position's price, if drafting stops at that one token
    (`runner_up.py`; empty: none would be verified): a second token must bring that much more. Plain data: it
    crosses to a worker process as `to_list` / `from_list`."""

    table: tuple[float, ...]
    gain: float
    later: tuple[float, ...] | None = None
    at_least: int = 1
    extra: tuple[float, ...] = ()
    next: tuple[float, ...] | None = None
    runner_up: tuple[float, ...] = ()
    _lookup: torch.Tensor = field(init=False, repr=False, compare=False)  # the three tables as tensors, built once
    _runner_up: torch.Tensor | None = field(init=False, repr=False, compare=False)  # `runner_up` as a tensor

    def __post_init__(self) -> None:
        if self.later is None:
            object.__setattr__(self, "later", self.table)
        if self.next is None:
            object.__setattr__(self, "next", self.later)
        object.__setattr__(self, "_lookup", torch.tensor([self.table, self.later, self.next], dtype=torch.float32))
        object.__setattr__(self, "_runner_up", torch.tensor(self.runner_up, dtype=torch.float32) if self.runner_up
                           else None)

    def keeps_going(self, reach: torch.Tensor, confidence: torch.Tensor, rows: torch.Tensor, drafted: int
                    ) -> tuple[bool, torch.Tensor]:
        """(whether to draft another token, the rows' reach including the latest token) given the reach before it
        [b], the latest token's confidence [b], the rows drafting [b] (bool) and the tokens drafted so far (1: the
        latest is the speculation's first)."""
        lookup = self._lookup.to(confidence.device)
        bins = bin_of(confidence)
        reach = reach * lookup[FIRST if drafted == 1 else LATER][bins]
        forgone = None
        if drafted == 1 and self._runner_up is not None:  # stopping here would verify the runner-up beside it
            forgone = self._runner_up.to(device=reach.device, dtype=reach.dtype)[bins]
        # A second token drafted to sample a_2 is weighed like any other where a runner-up is at stake: where the
        # first token is sure enough for a_2 to matter it pays, where it is not the runner-up does.
        if drafted < self.at_least and forgone is None:
            return True, reach
        return self._worth(reach, lookup[NEXT][bins], rows, drafted, forgone), reach

    def _worth(self, reach: torch.Tensor, f: torch.Tensor, rows: torch.Tensor, drafted: int,
               forgone: torch.Tensor | None = None) -> bool:
        """Whether drafting some h >= 1 more tokens (up to the longest speculation `extra` covers) is expected to pay
        for the rows drafting (`rows`, bool), on average over them: mean(reach × Σ_{i<=h} f^i) >= Σ of their gains
        (a masked mean: no rows drafting, nothing pays; one read-back, the answer's). Every row of a batch waits for
        a drafted token and its verified position, so the gains are per row at the round's speed per row, as K is
        chosen (`ConfidentRounds._confident`): one sure row of eight no longer drafts all eight on. A jump in the cost
        curve followed by flat positions is crossed where the tokens past it pay for it (the real pair on code: 6
        verified positions cost 33 ms more than 5, the next ones 1-13 ms each; priced one token at a time, every
        speculation stopped at 5 tokens where assisted generation's confident drafts ran 21). `forgone` [b]: what
        stopping now would bring besides (a runner-up's worth), which further tokens must bring on top."""
        horizon = max(len(self.extra) - drafted + 1, 1)  # up to the longest speculation `extra` covers
        gains = [self.gain_after(drafted + h) for h in range(horizon)]
        price = torch.tensor(gains, dtype=reach.dtype, device=reach.device).cumsum(0)
        powers = f[:, None] ** torch.arange(1, horizon + 1, dtype=f.dtype, device=f.device)  # [b, h]
        weights = rows.to(reach.dtype)
        gained = reach[:, None] * powers.cumsum(-1)
        if forgone is not None:
            gained = gained - forgone[:, None]
        tokens = (weights[:, None] * gained).sum(0) / weights.sum().clamp(min=1.0)
        return bool((tokens >= price).any())

    def gain_after(self, drafted: int) -> float:
        """The gain the next token must bring after `drafted` tokens (it would be verified as the (drafted + 1)-th)."""
        if not self.extra:
            return self.gain
        return self.gain + self.extra[min(drafted, len(self.extra)) - 1]

    def to_list(self) -> list[float]:
        """[gain, at_least, len(extra), the first token's table, the later tokens', the next token's, the
        runner-up's worth (zeros: none), extra]: `list_size(len(extra))` numbers (a longer buffer's tail is
        ignored)."""
        runner_up = self.runner_up or (0.0,) * (len(EDGES) + 1)
        return [self.gain, float(self.at_least), float(len(self.extra)), *self.table, *self.later, *self.next,
                *runner_up, *self.extra]

    @staticmethod
    def list_size(extra: int) -> int:
        """The length of `to_list` with `extra` per-position gains."""
        return 3 + 4 * (len(EDGES) + 1) + extra

    @classmethod
    def from_list(cls, values) -> StopRule | None:
        """The rule `to_list` wrote (its tail past `list_size` ignored); None for gain 0."""
        values = [float(v) for v in values]
        if not values or values[0] <= 0:
            return None
        bins, extra = len(EDGES) + 1, int(values[2])
        first, later, after, runner_up = (tuple(values[3 + i * bins:3 + (i + 1) * bins]) for i in range(4))
        return cls(first, values[0], later, int(values[1]), tuple(values[3 + 4 * bins:3 + 4 * bins + extra]), after,
                   runner_up if any(runner_up) else ())


def confident_speed(share: list[float], first: list[float], after: list[float], verify: list[float],
                    drafting: list[float], rounds: int = 8) -> float:
    """Tokens per second of serial rounds whose depth follows the draft's confidence: each round drafts its first
    token, then as many more as pay (h = 0 verifies none: a plain step that paid for one drafted token).

    `share[b]`: how often a speculation's first token falls in confidence bin b; `first[b]`: its acceptance there;
    `after[b]`: a later token's after one of that confidence (the chain taken to stay in its bin); `verify[h]`:
    seconds of a round verifying h tokens (h = 0..H, overhead included); `drafting[n - 1]`: seconds to draft n
    tokens (n = 1..H). The best depth per bin and the speed it makes are found together (Dinkelbach's iteration on
    the renewal ratio E[tokens] / E[seconds]: the depth that maximises tokens − speed × seconds at the current speed,
    then the speed those depths make), starting from plain steps' speed."""
    depths = len(verify)
    speed = 1.0 / verify[0]
    for _ in range(rounds):
        tokens = seconds = 0.0
        for p, f1, fn in zip(share, first, after):
            if p <= 0:
                continue
            best = None
            expected, reach = 1.0, f1
            for h in range(depths):
                if h:
                    expected += reach
                    reach *= fn
                spent = verify[h] + drafting[max(h, 1) - 1]
                value = expected - speed * spent
                if best is None or value > best[0]:
                    best = (value, expected, spent)
            tokens += p * best[1]
            seconds += p * best[2]
        new = tokens / seconds
        if abs(new - speed) <= 1e-9 * speed:
            break
        speed = new
    return speed
