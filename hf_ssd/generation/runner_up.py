"""The draft's runner-up for a speculation's first token, verified beside it in the same forward (one row).

Where verifying one more position costs next to nothing (MKL's fp32 kernels on a 2-core Xeon: 1 to 3 positions take
one price, 4 to 6 twice it), a serial round that verifies one drafted token s_1 has a spare position. It goes to the
draft's second choice r for that same position: the target's forward takes [t, s_1, r] with r a sibling of s_1
(the same position, attending to the committed tokens only; `sibling_inputs`). The target's choice x after t decides:
x = s_1 takes s_1 and the bonus after it, x = r takes r and the bonus after r, else x alone — two tokens where a
rejected s_1 gives one. Where the draft hesitates between two tokens (a word's inflection, a synonym) the runner-up is
often the target's choice (measured on the real pair, 18 answers teacher-forced: the first choice matched the target
at 69 % of the positions, the second at 11 %, i.e. at 36 % of those the first missed; per answer 18-100 %).

Greedy: the emitted tokens are the target's argmax at every position, as plain decoding's, whichever sibling won.
Sampling: r is the draft's likeliest token but the s_1 it drew, weighed after s_1 by recursive rejection against
the residual (`verification.sibling_sampling_verify`), so the token after t follows the target's law. One row only:
a batch's rows would keep different sibling slots in their caches.

How often the runner-up wins is learnt per confidence bin of s_1 (`RunnerUpCalibration`) from every verified first
token: the target's choice after t is known whenever s_1 is verified, whether a runner-up was fed or not, so the rate
is measured before the first sibling is ever verified.
"""

from __future__ import annotations

import bisect

import torch

from .confidence import EDGES
from .modes import SERIAL
from .verification import FIRST_WON, NEITHER, RUNNER_UP_WON

DECAY = 0.98  # per round that brings a sample, as the confidence calibration's
PRIOR_WEIGHT = 2.0  # samples' worth of the pooled rate each bin is shrunk to


def sibling_inputs(last: int, first: int, runner_up: int, position: int, visible: torch.Tensor, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids [1, 3], position_ids [1, 3], a 4D additive mask [1, 1, 3, P + 3]) for one forward over [t, s_1, r]
    after P cached positions: t at `position`, s_1 and r both at `position` + 1, each seeing the cached positions
    `visible` [P] (bool: False for padding) and t, r not seeing s_1."""
    device = visible.device
    cached = visible.shape[0]
    allowed = torch.zeros(3, cached + 3, dtype=torch.bool, device=device)
    allowed[:, :cached] = visible
    allowed[:, cached] = True  # t
    allowed[1, cached + 1] = True  # s_1 sees itself
    allowed[2, cached + 2] = True  # r sees itself, not s_1
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    ids = torch.tensor([[last, first, runner_up]], device=device)
    positions = torch.tensor([[position, position + 1, position + 1]], device=device)
    return ids, positions, mask[None, None]


def sibling_winner(choice: int, first: int, runner_up: int) -> int:
    """Which sibling the target's choice `choice` after t takes: `FIRST_WON`, `RUNNER_UP_WON` or `NEITHER`."""
    if choice == first:
        return FIRST_WON
    return RUNNER_UP_WON if choice == runner_up else NEITHER


def drop_position(cache, index: int) -> None:
    """Remove cached position `index` from every layer of a dynamic cache (the sibling that lost, when it is not the
    last one written)."""
    for layer in cache.layers:
        layer.keys = torch.cat([layer.keys[..., :index, :], layer.keys[..., index + 1:, :]], dim=-2)
        layer.values = torch.cat([layer.values[..., :index, :], layer.values[..., index + 1:, :]], dim=-2)


class RunnerUpCalibration:
    """How often the draft's runner-up for a first token of confidence c is the target's choice: decayed counts per
    confidence bin (`confidence.EDGES`), each bin shrunk to the pooled rate until measured."""

    def __init__(self) -> None:
        bins = len(EDGES) + 1
        self.chances = [0.0] * bins
        self.wins = [0.0] * bins

    def add(self, confidence: float, won: bool) -> None:
        """One verified first token of `confidence` whose runner-up was (`won`) or was not the target's choice."""
        self.chances = [c * DECAY for c in self.chances]
        self.wins = [w * DECAY for w in self.wins]
        b = bisect.bisect_right(EDGES, confidence)  # `confidence.bin_of`'s bins, for one float
        self.chances[b] += 1.0
        self.wins[b] += float(won)

    def table(self) -> list[float]:
        """The runner-up's rate per bin: (wins + PRIOR_WEIGHT x pooled) / (chances + PRIOR_WEIGHT); 0 before any
        sample (a runner-up is not priced until it has been seen to win)."""
        total = sum(self.chances)
        pooled = sum(self.wins) / total if total > 0 else 0.0
        return [(w + PRIOR_WEIGHT * pooled) / (c + PRIOR_WEIGHT) for c, w in zip(self.chances, self.wins)]

    def rate(self, confidence: float) -> float:
        """The runner-up's rate at one first token's `confidence`."""
        return self.table()[bisect.bisect_right(EDGES, confidence)]


class RunnerUpRounds:
    """The lookahead policy's side of runner-ups: whether this round verifies one, what it is worth to the stop rule,
    and the rate learnt from every verified first token. A mixin of `LookaheadPolicy`: it reads the policy's cost
    tables (`times`, `serial_times`, `serial_verify_seconds`), speed (`_rate`), trace, mode and `_exploring`, and keeps
    `runner_ups` (a `RunnerUpCalibration`, per target and draft across calls), `runner_up_mode` and the count of
    runner-ups that won (`runner_up_wins`); a round that verifies one says so in its trace entry (`runner_up`)."""

    @property
    def runner_up_fed(self) -> bool:
        """Whether this round verifies a runner-up."""
        return bool(self.trace) and "runner_up" in self.trace[-1]

    @property
    def runner_up_rounds(self) -> int:
        """The rounds of this call that verified a runner-up."""
        return sum("runner_up" in entry for entry in self.trace)

    def _runner_up_single(self) -> bool:
        """Whether a runner-up could be verified at all this round: not "never", one active row."""
        return self.runner_up_mode != "never" and self._active_rows == 1

    def runner_up_step(self) -> float | None:
        """Seconds a runner-up adds to a serial round verifying one token: the cost curve's step from two verified
        positions to three (the policy's curve: measured where timed, pooled non-decreasing)."""
        table, serial = self.times(), self.serial_times()
        one, two = self.serial_verify_seconds(1, table, serial), self.serial_verify_seconds(2, table, serial)
        return None if one is None or two is None else max(two - one, 0.0)

    def runner_up_table(self) -> tuple[float, ...]:
        """Per confidence bin of the first token: the tokens a runner-up is expected to bring beside it, net of what
        its position costs at the round's speed (the stop rule's; 0 where it does not pay); empty where none would
        be verified or none pays."""
        step = self.runner_up_step() if self._runner_up_single() and self._rate else None
        if step is None:
            return ()
        price = self._rate * step
        worth = tuple(max(rate - price, 0.0) for rate in self.runner_ups.table())
        return worth if any(worth) else ()

    def runner_up_worth(self, confidence: float) -> float:
        """`runner_up_table` at one first token's `confidence` (0 where none would be verified)."""
        table = self.runner_up_table()
        return table[bisect.bisect_right(EDGES, confidence)] if table else 0.0

    def _with_runner_up(self, expected: float, seconds: float) -> float:
        """Tokens per second of a serial round verifying its one row's first token with the runner-up beside it,
        given the round's `expected` tokens and `seconds` without it (0 where none would be verified)."""
        hand = self._confidence
        if not self._runner_up_single() or self._mode != SERIAL or not hand or hand[0] is None or not len(hand[0]):
            return 0.0
        step = self.runner_up_step()
        if step is None:
            return 0.0
        return (expected + self.runner_ups.rate(float(hand[0][0]))) / (seconds + step)

    def take_runner_up(self, verified: int, depth: int, ready, confidence: torch.Tensor | None) -> bool:
        """Whether this round verifies the runner-up of its one drafted token beside it: a round verifying one token
        of a speculation drafted just in time, the draft sitting it out (its prepared outcomes would follow s_1),
        not a round exploring K = 1, the target `ready` (a callable, asked last: one row, a cache and attention that
        take a sibling, `TargetBatch.runner_up_ready`), and — under "auto" — the runner-up's rate at s_1's confidence
        worth the position."""
        if self.runner_up_mode == "never" or verified != 1 or depth != 0 or self._exploring or not ready():
            return False  # (a round exploring K = 1 times it: with a runner-up its forward is timed as K = 2's, and
            # K = 1 stayed untimed and explored round after round, 20 rounds of one alpaca answer)
        if self.runner_up_mode == "always":
            take = True
        else:
            take = confidence is not None and self.runner_up_worth(float(confidence[0])) > 0.0
        if take and self.trace:  # (the record of the round: `runner_up_fed`, `runner_up_rounds`)
            self.trace[-1]["runner_up"] = round(self.runner_ups.rate(float(confidence[0])), 3) if (
                confidence is not None) else True
        return take

    def observe_runner_up(self, rows, verdict) -> None:
        """One sample per row whose first drafted token was verified and which carried a runner-up: whether the
        runner-up was the target's choice after t (it won; or s_1 was rejected for it). Under sampling, "s_1 was
        rejected and the residual's draw was r" has the probability with which r beside s_1 would have won."""
        if verdict.verified == 0:
            return
        for i, row in enumerate(rows):
            speculation = row.speculation
            if speculation is None or speculation.runner_up is None or speculation.confidence is None:
                continue
            if verdict.runner_up is not None and verdict.runner_up[i]:
                won = True
                self.runner_up_wins += 1
            else:
                won = verdict.accepted[i] == 0 and verdict.bonus[i] == speculation.runner_up
            self.runner_ups.add(float(speculation.confidence[0]), won)
