"""While plain steps win: when the draft pauses, and how its one-token probes bring speculation back.

On plain steps (K = 0) the draft prepares one token deep twice (enough for the free sample of a_1: the target's
distribution at the bonus position is known, it drew the bonus from it), then pauses: on a CPU its memory traffic
slows the target's plain step by ~20 %. While paused it drafts a one-token probe every `PROBE_EVERY` rounds, and
again at once after an accepted one, up to `PROBE_CHAIN` more; when that many came back accepted in a row, the next
round is a trial: the draft prepares K_max deep and the round verifies them, so the deeper positions, which probes
cannot reach, are measured too. Each time probing ends without speculation winning (a rejected probe, a trial),
probes become twice as rare (up to every `PROBE_MAX` rounds) and a trial asks for one more accepted probe;
speculating resets both. A probe's sample arrives two decisions later (its speculation is verified in the next
round, after that round's depth was chosen); only that sample moves the chain. Probes are also spaced so that they
cost at most `PROBE_SHARE` of the plain steps' time, given what a probe costs against a plain step: a batch's probe
drafts for every row (measured, 8 rows on a 2-core EPYC: 150-340 ms on top of a 380 ms plain step, 6 % of the plain
steps' time at one probe every 8 rounds; one row: 50 ms against 330); where a probe costs more than that budget
allows at the base spacing, the first plain steps' one-token depth is skipped too. Between probes the loop takes the
plain steps in a row without deciding each (a plain stretch): `quiet_rounds` says how many.

Plain state, advanced once per depth decision (`LookaheadPolicy.depth`); nothing here looks at a model.
"""

from __future__ import annotations

import math

PAUSE_AFTER = 2  # plain steps chosen in a row before the draft pauses
PROBE_EVERY = 8  # while paused, a probe (one drafted token, scored for free) every so many rounds at first,
PROBE_MAX = 32  # then, each time probing ends without speculation paying, twice as rarely (up to this)
PROBE_CHAIN = 2  # more probes right after accepted ones (each slows its round: the draft works beside it)
PROBE_SHARE = 0.03  # the most of the plain steps' time that paused probing may cost (spacing probes further apart)


class Probing:
    """The pause/probe/trial state between plain steps (see the module docstring)."""

    def __init__(self) -> None:
        self.plain_run = 0  # plain steps chosen in a row
        self.every = PROBE_EVERY  # rounds between probes now (backs off while probing finds nothing)
        self.trial = False  # accepted probes ask for one whole speculation next round
        self._free_sample: float | None = None  # a_1's sample from the last plain step, if any
        self._chain = 0  # probes in a row after accepted ones
        self._since = 0  # rounds since the last probe
        self._decisions = 0  # depth decisions so far
        self._due: set[int] = set()  # the decisions at which probes' samples are due
        self._verdict: float | None = None  # this decision's due probe sample (None: none due)

    def free_sample(self, sample: float) -> None:
        """a_1's free sample from a round that verified nothing (or everything it verified was accepted at K = 0)."""
        self._free_sample = sample

    def decide(self) -> None:
        """Start a depth decision: take the last free sample, and see whether a probe's is due now."""
        sample, self._free_sample = self._free_sample, None
        decision, self._decisions = self._decisions, self._decisions + 1
        due = decision in self._due
        self._due.discard(decision)
        self._verdict = (0.0 if sample is None else sample) if due else None  # no sample: as a rejected one

    def speculating(self) -> None:
        """Speculation was chosen: probing starts afresh the next time plain steps win."""
        self.plain_run, self._chain, self.every, self._since = 0, 0, PROBE_EVERY, 0

    def timed_plain_step(self) -> None:
        """A plain step tried for its cost: the draft pauses at once (its time beside a working draft is not what
        it costs)."""
        self.plain_run = PAUSE_AFTER

    def quiet_rounds(self, probe_cost: float = 0.0) -> int:
        """How many of the next plain steps `plain_depth` will keep the draft paused through, given `probe_cost` as
        there: no probe's sample pending, no trial asked, no probe due (a plain stretch: `LookaheadPolicy`)."""
        if self.trial or self._due or (self.plain_run < PAUSE_AFTER and not _costly(probe_cost)):
            return 0
        return max(0, max(self.every, math.ceil(probe_cost / PROBE_SHARE)) - self._since - 1)

    def take_trial(self) -> bool:
        """Whether this round is the trial accepted probes asked for (asked once)."""
        trial, self.trial = self.trial, False
        return trial

    def plain_depth(self, k_max: int, probe_cost: float = 0.0) -> int:
        """How deep the draft prepares beside a plain step: K_max for a trial, 1 on the first plain steps (unless a
        probe is costly: `_costly`) and for a probe, else 0 (paused). `probe_cost`: what a probe adds to its round,
        as a fraction of a plain step (0: unknown), which spaces paused probes at least `probe_cost / PROBE_SHARE`
        rounds apart."""
        self.plain_run += 1
        self._since += 1
        chained = False
        if self._verdict is not None:
            if self._verdict < 0.5:  # probing ends here and plain steps still win: probe more rarely
                self._chain, self.every = 0, min(2 * self.every, PROBE_MAX)
            elif self._chain < PROBE_CHAIN + (self.every // PROBE_EVERY).bit_length() - 1:
                self._chain, chained = self._chain + 1, True
            else:  # accepted again and again: verify a whole speculation next round (twice as rare if not)
                self._chain, self.trial = 0, True
                self.every = min(2 * self.every, PROBE_MAX)
        if self.trial:
            self._since = 0
            return k_max
        if self.plain_run <= PAUSE_AFTER and not _costly(probe_cost):
            return 1
        if chained or self._since >= max(self.every, math.ceil(probe_cost / PROBE_SHARE)):
            self._since = 0
            self._due.add(self._decisions + 1)  # two decisions after this one (`decide` counted this one)
            return 1
        return 0


def _costly(probe_cost: float) -> bool:
    """Whether a probe costs more than probing may at the base spacing (`PROBE_SHARE` of `PROBE_EVERY` plain steps):
    then the first plain steps' one-token depth, which costs what a probe does, is skipped and the draft pauses at
    once (a tiny pair's probe cost ~2.4 plain steps; a batch of 8 rows' ~0.6; one row of the real pair's ~0.15)."""
    return probe_cost > PROBE_SHARE * PROBE_EVERY
