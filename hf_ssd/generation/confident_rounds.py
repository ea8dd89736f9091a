"""The lookahead policy's use of the draft's confidence (`confidence.py`): this round's K from the speculation in hand,
and where the just-in-time drafting after it stops (`StopRule`), priced on the cost curve K is chosen by.

`ConfidentRounds` is a mixin of `LookaheadPolicy`, like `RoundCosts` and `PlainSteps`: it reads the policy's
estimates and choice (`calibration`, `call_calibration`, `acceptance`, `_confidence`, `_mode`, `_rate`, `serial`,
`trace`, the cost tables) and keeps no state of its own but the calibrated tables last read (`_calibrated`) and
their shift (`_calibration_shift`, for the trace).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .confidence import FIRST, StopRule, call_shift, confident_speed, expected_tokens_per_row, shifted
from .costs import position_costs
from .modes import PLAIN, SERIAL, _best

# Just-in-time drafting runs at least two tokens while the second position's acceptance, taken at its upper bound
# (`AcceptanceTracker.optimistic`), would make a second token pay: one-token speculations never sample a_2 (the free
# sample needs a drafted token beyond the verified ones), so two early rejections at the second position kept every
# later speculation one token deep (translation on the real pair: 8 one-token rounds where SD's K = 4 took 3, 2, 2
# and assisted generation's default 15). The bound narrows as a_2 is sampled: a draft whose second tokens are rejected
# round after round stops being explored, and is tried again once those samples have decayed.

# The first tokens' confidences seen (decayed counts) before their spread prices serial speculation
# (`confident_serial_speed`): a couple of samples say nothing about how often the draft is sure.
MIN_FIRST_SAMPLES = 4.0
SHARE_PRIOR = 8.0  # samples' worth of the pair's share of first-token confidences a call's own counts are shrunk to


class ConfidentRounds:
    """This round's K from its tokens' calibrated acceptance, and the stop rule of its just-in-time drafting (see the
    module docstring)."""

    def _confident(self, best: int, limit: int, within: dict[int, float], margin: float, table: dict[int, float],
                   serial_table: dict[int, float]) -> int:
        """This round's K from the speculation in hand: E(K) from its tokens' calibrated acceptance f(c) (per row,
        averaged over the batch's rows) over the round's time at K in the way chosen; `best` without confidences.
        K = 0 costs what it costs in that way: beside the working draft (no cheaper than verifying one token
        there) in a concurrent round, a plain step followed by the next speculation's drafting in a serial one."""
        acceptance = self._round_acceptance(limit)
        if acceptance is None:
            return best
        expected = expected_tokens_per_row(acceptance).mean(dim=0).tolist()
        speeds = {}
        for k in range(0 if 0 in within else 1, limit + 1):
            seconds = self._seconds_now(k, table, serial_table)
            if seconds is not None and seconds > 0:
                speeds[k] = expected[k] / seconds
                if k == 1:  # the first token with its runner-up beside it, where one would be verified
                    speeds[k] = max(speeds[k], self._with_runner_up(expected[k], seconds))
        if not any(k > 0 for k in speeds):
            return best
        self._confident_speeds = speeds
        return _best(speeds, margin)

    def _sure_hand(self, limit: int, speeds: dict[int, float], margin: float, table: dict[int, float],
                   serial_table: dict[int, float]) -> int:
        """Where plain steps win at the run's average acceptance: the K of a serial round verifying the speculation
        in hand (the next one drafted after it) when its tokens' calibrated acceptance beats a plain step by
        `margin`, the mode then serial; else 0, the mode left plain. The average rests on few samples after a
        switch (one rejected first round took a_1 from 0.49 to 0.16 and a call's next 11 tokens to plain steps,
        where its speculations then had 90 % taken), the hand's confidences speak for these tokens."""
        if 0 not in speeds or limit < 1:
            return 0
        self._mode = SERIAL
        k = self._confident(0, limit, {}, margin, table, serial_table)
        if k > 0 and (self._confident_speeds or {}).get(k, 0.0) >= margin * speeds[0]:
            return k
        self._mode = PLAIN
        return 0

    def confident_serial_speed(self, table: dict[int, float], serial_table: dict[int, float]) -> float | None:
        """Tokens per second of serial rounds drafted under the stop rule and verified as deep as the draft's
        confidence makes worth it (`confident_speed`): what serial speculation makes on text where the draft is
        sure of some tokens and not of others, which the run's average acceptance per position prices as if every
        speculation were as uncertain as the average (on the real pair it chose plain steps for 11-37 tokens of
        qa, rag, summarization and mt_bench answers, where assisted generation's default, drafting while the draft
        is sure, caught runs of 8-14 tokens). None
        for a batch, without a calibration or before the first tokens' confidences and the draft's costs are
        known."""
        calibration = self.calibration
        if calibration is None or self._active_rows != 1 or not self.serial_option:
            return None
        counts = calibration.reached[FIRST]
        total = sum(counts)
        if total < MIN_FIRST_SAMPLES or self.serial_fixed.value is None or (
                self.serial_step() is None and self.remembered_step is None):
            return None
        depth = self.serial_depth
        verify = [self.verify_seconds(0, table)] + [self.serial_verify_seconds(k, table, serial_table)
                                                    for k in range(1, depth + 1)]
        if any(t is None for t in verify):
            return None
        overhead = max(self.overhead.value or 0.0, 0.0)
        drafting = [self.serial_drafting_seconds(n, self.remembered_step) for n in range(1, depth + 1)]
        first, later, after = self.calibrated_tables()
        return confident_speed(self.first_share(), first, after, [t + overhead for t in verify], drafting)

    def first_share(self) -> list[float]:
        """How often a speculation's first token falls in each confidence bin: this call's own counts
        (`call_calibration`) over the pair's share, worth `SHARE_PRIOR` samples. The pair's share alone priced
        serial rounds by how sure the draft was on earlier calls' texts: on an AVX2 EPYC a summarization answer's
        serial rounds were priced at 3.6-3.8 tok/s against a plain step's 2.4 and made 1.8, 39 of their 43
        speculations declined (a plain step, then drafting the next speculation: 220 ms a round thrown away)."""
        counts = self.calibration.reached[FIRST]  # (the pair's counts hold this call's too)
        own = self.call_calibration.reached[FIRST] if self.call_calibration is not None else [0.0] * len(counts)
        total = sum(counts)
        share = [c / total for c in counts] if total > 0 else [0.0] * len(counts)
        prior = SHARE_PRIOR if total > 0 else 0.0  # the pair's share, worth SHARE_PRIOR samples (none: no share)
        weight = sum(own) + prior
        return [(o + prior * p) / weight for o, p in zip(own, share)] if weight > 0 else [0.0] * len(counts)

    def _round_acceptance(self, limit: int) -> torch.Tensor | None:
        """f(c) of the first `limit` tokens of every active row's speculation [rows, limit]; None when the policy does
        not condition on confidence or some row's are unknown (an n-gram or random backup's)."""
        rows = self._confidence
        if self.calibration is None or limit < 1 or not rows:
            return None
        if any(c is None or c.shape[0] < limit for c in rows):
            return None
        confidence = torch.stack([c[:limit] for c in rows]).detach().float().cpu()  # one transfer for the batch
        return self.calibration.acceptance(confidence, self.confidence_tables())

    def confidence_tables(self) -> tuple[list[float], list[float]]:
        """f per confidence bin of a speculation's first token and of the later ones (`calibrated_tables`)."""
        return self.calibrated_tables()[:2]

    def calibrated_tables(self) -> tuple[list[float], list[float], list[float]]:
        """f per confidence bin of a speculation's first token, of the later ones (`ConfidenceCalibration.tables`,
        unmeasured bins at the run's acceptance of the first position and of the ones after it) and of the token
        after one of confidence c (`next_table`), the pair's tables shifted toward this call's own samples
        (`call_shift`). Read up to three times a decision: kept until a calibration or the run's acceptance changes."""
        call = self.call_calibration
        priors = (self.acceptance.estimates()[0], self.acceptance.beyond_first())
        key = (self.calibration, self.calibration.version, call and call.version, priors)
        cached = self._calibrated
        if cached is not None and cached[0][0] is key[0] and cached[0][1:] == key[1:]:
            return cached[1]
        first, later = self.calibration.tables(*priors)
        after = self.calibration.next_table(later)
        delta = call_shift(call, (first, later)) if call is not None else 0.0
        self._calibration_shift = delta
        tables = shifted(first, delta), shifted(later, delta), shifted(after, delta)
        self._calibrated = (key, tables)
        return tables

    def _seconds_now(self, k: int, table: dict[int, float], serial_table: dict[int, float]) -> float | None:
        """R(k) of this round in the way chosen: a serial round's verification on every core, then the next
        speculation drafted (as long as serial rounds have drafted lately), else `round_seconds` (K = 0 as K = 1:
        the target's step beside the draft)."""
        if self._mode != SERIAL:
            return self.round_seconds(max(k, 1), table, serial_table)
        verify = self.verify_seconds(0, table) if k == 0 else self.serial_verify_seconds(k, table, serial_table)
        if verify is None:
            return None
        drafted = self.serial_length.value if self.serial_length.value is not None else self.k_max
        return verify + self.serial_drafting_seconds(drafted) + max(self.overhead.value or 0.0, 0.0)

    def just_in_time(self, room: int | None = None) -> tuple[int, StopRule | None]:
        """(tokens the draft drafts just in time after this verification, where it stops early): a serial round's
        speculation runs up to `k_serial` deep under the stop rule, at most K_max without one (the draft's cost per
        token not measured yet), never past `room`, what the next round can still verify (`Batch.room`: near
        max_new_tokens a sure run drafted 16 tokens for a round that could verify one, 0.6 s thrown away on a
        2-core Xeon); (0, rule) otherwise (the rule then bounds a draft backup on a miss)."""
        stop = self.stop_rule()
        serial = self.serial if stop is not None else min(self.serial, self.k_max)
        if room is not None and serial > room:
            serial = room
            if self.trace:
                self.trace[-1]["serial"] = serial
        return serial, stop

    def stop_rule(self) -> StopRule | None:
        """Where this round's just-in-time drafting (the serial speculation, a draft backup on a miss) stops: once no
        row expects its next token to bring the tokens its time would bring at the speed chosen (`StopRule`: gain =
        that speed x (seconds per drafted token + what verifying it adds, the cost curve's step at its position:
        `position_costs`)), the speed no higher than serial rounds make as deep as the draft's confidence pays
        (`confident_serial_speed`, where priced; the chosen one is the best serial K's at the average acceptance,
        which speculations this rule stops short of never make: on code, on a curve that doubles past two verified
        tokens, K = 16's 10.8 tok/s kept every speculation two tokens deep, 8.1 tok/s, all accepted, where assisted
        generation's default drafted 20 a round and had them all accepted), but not before two tokens while a_2 is
        uncertain enough that a second token might pay (a_1 x a_2's upper bound >= its gain: the module's comment).
        None without a calibration or before the draft's cost per token is known (measured in this call; for a
        serial speculation also as earlier calls with this draft measured it: the call's first serial speculations
        ran K_max deep, three rounds of 4 tokens on code where the next ones ran 16, all accepted): then it drafts
        the full length (K_max in a serial round)."""
        if self.calibration is None or not self._rate:
            return None
        per_token = self.serial_step() if self.serial else self.backup_token.value
        if per_token is None and self.serial:
            per_token = self.remembered_step
        if per_token is None:
            return None
        depth = max(self.serial, self.k_max)
        rate = min(self._rate, self._serial_speed or self._rate)
        extra = tuple(rate * seconds for seconds in position_costs(self._curve(depth), depth - 1))
        gain = rate * per_token
        if self.trace:
            self.trace[-1]["stop_gain"] = [round(gain + e, 3) for e in extra] or round(gain, 3)
        first, later, after = self.calibrated_tables()
        if self.trace:
            self.trace[-1]["stop_tables"] = [[round(f, 3) for f in table] for table in (first, later, after)]
            self.trace[-1]["calibration_shift"] = round(self._calibration_shift, 3)
        runner_up = self.runner_up_table() if self.serial else ()  # (a backup's is verified beside the draft)
        rule = StopRule(tuple(first), gain, tuple(later), 1, extra, tuple(after), runner_up)
        acceptance = self.acceptance
        if len(acceptance.reached) > 1 and acceptance.estimates()[0] * acceptance.optimistic(1) >= rule.gain_after(1):
            rule = replace(rule, at_least=2)
            if self.trace:
                self.trace[-1]["at_least"] = 2
        return rule

    def _curve(self, depth: int) -> dict[int, float]:
        """T_v(k) for k = 1..depth as the policy prices K (`serial_verify_seconds` for this round's just-in-time
        speculation, `verify_seconds` for a backup beside the target): measured where timed, along the prior shape
        past the deepest one timed, so that the stop rule and the choice of K read one curve."""
        table = self.times()
        serial = self.serial_times() if self.serial else None
        curve = {k: (self.serial_verify_seconds(k, table, serial) if self.serial else self.verify_seconds(k, table))
                 for k in range(1, depth + 1)}
        return {k: t for k, t in curve.items() if t is not None}
