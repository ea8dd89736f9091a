"""What each round measured, fed to the lookahead policy's estimates: the acceptance samples of a verification (every
verified token, and the free sample one position beyond when everything verified was accepted) into the per-position
acceptance and the confidence calibrations, and the round's times (the target's forward per K, the draft's prepare,
backup and just-in-time drafting, a probe's cost, the loop's overhead) into the cost tables.

`RoundObservations` is a mixin of `LookaheadPolicy`, like `RoundCosts` and `ConfidentRounds`: it writes the policy's
estimates (`acceptance`, `calibration`, `call_calibration`, `probing`, the cost tables, `memory`) and
reads its trace and setting; it keeps no state of its own.
"""

from __future__ import annotations

import time

import torch

from ..ema import DecayedMean
from .estimates import COST_DECAY


class RoundObservations:
    """The policy's observations of each round (see the module docstring)."""

    def observe_verification(self, rows, verdict) -> None:
        """Acceptance samples from this round's verification (see the module docstring). A round without any
        (a plain step while the draft is paused) leaves the estimates as they were."""
        n = verdict.verified
        if self.trace and verdict.accepted:  # tokens per row this round (accepted + the bonus)
            self.trace[-1]["tokens"] = round(1 + sum(verdict.accepted) / len(verdict.accepted), 3)
        if n == 0 and all(row.speculation.tokens.shape[0] == 0 for row in rows):
            return
        self.acceptance.decay()
        calibrations = [c for c in (self.calibration, self.call_calibration) if c is not None]
        for calibration in calibrations:
            calibration.forget()

        def calibrate(confidence: list[float], position: int, accepted: float) -> None:
            for calibration in calibrations:
                calibration.add_at(confidence, position, accepted)

        probs = None
        self.observe_runner_up(rows, verdict)
        for i, row in enumerate(rows):
            # a runner-up that took s_1's place: s_1 itself was rejected
            accepted = 0 if verdict.runner_up is not None and verdict.runner_up[i] else verdict.accepted[i]
            confidence = row.speculation.confidence
            confidence = None if self.calibration is None or confidence is None else confidence.tolist()
            for j in range(accepted):
                self.acceptance.add(j, 1.0)
                if confidence is not None:
                    calibrate(confidence, j, 1.0)
            if accepted < n:
                self.acceptance.add(accepted, 0.0)
                if confidence is not None:
                    calibrate(confidence, accepted, 0.0)
                continue
            spec = row.speculation  # everything verified was accepted: a free sample one position on
            if spec.tokens.shape[0] <= n:
                continue
            token = int(spec.tokens[n])
            scores = verdict.scores[i, n]
            if spec.probs is None:
                sample = float(int(scores.argmax()) == token)
            else:
                if probs is None:
                    probs = verdict.scores[:, n].softmax(-1)
                q = spec.probs[n].to(probs.device, torch.float32)
                sample = float(torch.minimum(probs[i], q).sum())
            self.acceptance.add(n, sample)
            if confidence is not None:
                calibrate(confidence, n, sample)
            if n == 0:
                self.probing.free_sample(sample)

    def observe_round(self, forward_seconds: float, timings, hits: int, lookups: int) -> None:
        """The round's target forward time, the draft's running `DraftTimings` (None: as at the last round, the draft
        sat it out), and the lookups it made."""
        k = self.trace[-1]["k"] if self.trace else self.k_max
        if self.runner_up_fed:  # its forward covered three positions, as a round verifying two tokens does
            k += 1
        if self.trace:  # a plain step verifying a prompt lookup's tokens (draft idle): a serial verification's cost
            k += self.trace[-1].get("lookup", 0)
        wall = time.perf_counter() - self._round_start if self._round_start is not None else None
        first = self._rounds == 0
        self._rounds += 1
        if self.trace:
            self.trace[-1]["forward_ms"] = round(1e3 * forward_seconds, 2)
            if wall is not None:
                self.trace[-1]["round_ms"] = round(1e3 * wall, 2)
        timings = self._timings if timings is None else timings
        previous, self._timings = self._timings, timings
        if first:  # the first verification holds the target's prefill
            self.first_forward = forward_seconds
            return
        paused = self.trace[-1].get("depth", self.k_max) == 0 if self.trace else False
        serial = paused and k > 0  # verified on every core while the draft sat it out
        if k > 0 or paused:  # a plain step is timed while the draft is paused: what choosing it costs for long
            (self.serial_verify if serial else self.verify).setdefault(k, DecayedMean(COST_DECAY)).add(forward_seconds)
            self._timed_at[(serial, k)] = self._rounds
            if self.memory is not None and self.adaptive:
                self.memory.record(self._setting(serial), k, forward_seconds)
        backup_now = serial_now = 0.0
        if previous is not None:
            calls = timings.prepare_calls - previous.prepare_calls
            if calls > 0:
                per_call = (timings.prepare_seconds - previous.prepare_seconds) / calls
                self.draft.add(per_call)
                if self.trace and self.trace[-1].get("depth") == self.k_max and "budget" in self.trace[-1]:
                    self.fanout.observe(self.trace[-1]["budget"], per_call, hits, lookups)
            backups = timings.backup_calls - previous.backup_calls
            backup_now = timings.backup_seconds - previous.backup_seconds
            if backups > 0:
                self.backup.add(backup_now / backups)
            tokens = timings.serial_tokens - previous.serial_tokens
            serial_now = timings.serial_seconds - previous.serial_seconds
            if tokens > 0:
                calls = max(timings.serial_calls - previous.serial_calls, 1)
                steps = timings.serial_steps - previous.serial_steps
                step_seconds = timings.serial_step_seconds - previous.serial_step_seconds
                if steps > 0:  # the marginal token apart from the fixed part (the feed forward, compaction)
                    self.serial_token.add(step_seconds / steps)
                    self.serial_fixed.add((serial_now - step_seconds) / calls)
                elif tokens == calls:  # one token each: the fixed part alone
                    self.serial_fixed.add(serial_now / calls)
                else:  # a drafter that does not time its steps: per token on average
                    self.serial_token.add(serial_now / tokens)
                self.serial_length.add(tokens / calls)
            backup_tokens = timings.backup_tokens - previous.backup_tokens
            if backup_tokens > 0:
                self.backup_token.add(backup_now / backup_tokens)
        if lookups:
            self.hit_rate.add(hits / lookups)
        if wall is not None:
            drafted = (self.trace[-1].get("serial") or self.trace[-1].get("depth")) if self.trace else None
            if k == 0 and drafted in (0, 1):  # what a probe costs (`_probe_cost`)
                (self.probe_round if drafted else self.plain_round).add(wall)
            draft = 0.0 if paused else self.draft_seconds()
            body = max(forward_seconds, draft) if self.concurrent else forward_seconds + draft
            self.overhead.add(wall - body - backup_now - serial_now)
