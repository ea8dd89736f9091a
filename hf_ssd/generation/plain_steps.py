"""The lookahead policy's plain steps: starting a call plain where earlier calls found the draft useless
(`first_depth`), plain stretches (plain steps in a row between probes, decided once), what a probe costs
(`_probe_cost`, which spaces probes: `probing.py`) and where a probe's drafting runs (`_drafted_after`).

A mixin of `LookaheadPolicy`: it reads the policy's estimates, costs (`RoundCosts`), trace, mode and probing state.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .estimates import OPTIMISM, expected_tokens
from .modes import PLAIN, RESUME_MARGIN, _margin

# A plain stretch (`LookaheadPolicy.plain_stretch`): plain steps taken in a row, the policy and the draft told once
# after them. Where a target step costs a few milliseconds (small models, a GPU with its launch overhead) the round
# loop's own work is a large part of a plain step: a stretch leaves plain decoding's work alone.
PLAIN_STRETCH = "plain stretch"
STRETCH_MAX = 16  # plain steps at most before the estimates are weighed again (the plain step's cost moves)


def optimistic_start(acceptance: list[float], reached: float) -> list[float]:
    """The remembered acceptance a call weighs starting plain at: raised by Hoeffding's width (`OPTIMISM`) over the
    positions verified behind it in all earlier calls. A call starts plain on evidence, not on a short call's
    luck: a bench's 8-token warm-up on a translation prompt (about 12 positions verified, acceptance 0.38) started the
    next call on the same prompt with nine plain steps, where its first position was accepted at 0.79."""
    width = (OPTIMISM / (reached + 1.0)) ** 0.5
    return [min(1.0, a + width) for a in acceptance]


class PlainSteps:
    """`LookaheadPolicy`'s plain steps (see the module docstring)."""

    def first_depth(self, rows: int = 1) -> int:
        """How deep the draft drafts the first speculations of `rows` rows (`begin`): K_max, or 0 when earlier calls
        with this draft left it no use here — by its remembered acceptance and this target's remembered costs,
        plain steps beat every way of speculating by the margin a return from plain steps asks (`_margin`), even at
        an optimistic acceptance (`optimistic_start`). The call then starts as the last one went on: plain steps,
        the draft paused (it only prefills), probes looking for text it predicts."""
        self._active_rows = rows
        memory = self.memory
        if not self.adaptive or memory is None or self.draft_key not in memory.acceptance:
            return self.k_max
        acceptance = optimistic_start(self.acceptance.estimates(), memory.acceptance_reached.get(self.draft_key, 0.0))
        table, serial_table = self.times(), self.serial_times() if self.serial_option else {}
        speeds = {k: expected_tokens(acceptance, k) / seconds for k in range(self.k_max + 1)
                  if (seconds := self.round_seconds(k, table, serial_table))}
        serial_speeds = {k: expected_tokens(acceptance, k) / seconds for k in range(1, self.k_max + 1)
                         if self.serial_option and (seconds := self.serial_round_seconds(k, table, serial_table))}
        best = max([v for k, v in speeds.items() if k] + list(serial_speeds.values()), default=None)
        if 0 not in speeds or best is None or best >= _margin(RESUME_MARGIN, acceptance, speeds, serial_speeds) * (
                speeds[0]):
            return self.k_max
        self._starts_plain = True
        self.probing.timed_plain_step()  # paused from the first round on
        return 0

    def plain_stretch(self) -> int:
        """How many rounds after this one the loop may take as plain steps without deciding each (a plain stretch):
        this round was a plain step chosen on the estimates with the draft paused, and until the next probe no
        acceptance sample can arrive to move them, only the plain step's own cost. At most `STRETCH_MAX`, so that
        the costs are weighed again as the context grows; 0 otherwise."""
        if not self.adaptive or not self.trace or self.serial or self._mode != PLAIN:
            return 0
        last = self.trace[-1]
        if last["k"] != 0 or last.get("depth") != 0 or self._why != "best":
            return 0
        return min(self.probing.quiet_rounds(self._plain_probe_cost), STRETCH_MAX)

    def plain_step(self) -> None:
        """Start a round of a plain stretch: recorded as chosen, the probing state advanced as `depth` would (it
        keeps the draft paused: `plain_stretch` counted the rounds it does)."""
        self._round_start = time.perf_counter()
        self._why = PLAIN_STRETCH
        self.probing.decide()
        self.probing.plain_depth(self.k_max, self._plain_probe_cost)
        self.trace.append({"k": 0, "why": PLAIN_STRETCH, "wanted": 0, "mode": PLAIN, "rows": self._active_rows,
                           "depth": 0, "tokens": 1.0})

    def lookup_costs(self) -> tuple[float | None, Callable[[int], float | None]]:
        """What a plain step of a stretch weighs its prompt lookup by (`PromptLookup.choose`): the plain step's time
        (the draft paused), and T_v(m) of m proposal tokens verified with the draft idle, as a serial round's m draft
        tokens are (`serial_verify_seconds`: measured, else guessed as cheap as the largest measured below)."""
        table, serial = self.times(), self.serial_times()
        return self.verify_seconds(0, table), lambda m: self.serial_verify_seconds(m, table, serial)

    def lookup_step(self, tokens: int, accepted: int, acceptance: list[float]) -> None:
        """This plain step verified `tokens` proposal tokens beside its own, at the measured `acceptance` per
        position, and accepted `accepted`: recorded in its decision (the step's tokens; its forward is then timed as
        a verification of that many tokens, `observe_round`)."""
        if self.trace:
            self.trace[-1].update(lookup=tokens, lookup_acceptance=[round(a, 3) for a in acceptance[:tokens]],
                                  tokens=1.0 + accepted)

    def _probe_cost(self) -> float:
        """What a probe adds to its round, as a fraction of a plain step (`Probing` spaces probes by it): what rounds
        with the draft drafting one token (beside the plain step, inline or just in time after it) took beyond
        rounds with the draft paused — the whole cost, messages to a worker process and the glue of the tokens
        committed meanwhile included; until measured in this call, as earlier calls with this draft measured it,
        else a just-in-time probe's drafting as measured. 0 while unknown."""
        plain, probe = self.plain_round.value, self.probe_round.value
        if plain and probe is not None:
            return max(probe - plain, 0.0) / plain
        remembered = self.memory.probe_cost.get((self.draft_key, self.setting)) if self.memory is not None else None
        if remembered is not None:  # as earlier calls with this draft measured it
            return remembered
        if self.serial_option and self.serial_fixed.value is not None:
            plain = self.verify_seconds(0)
            return self.serial_drafting_seconds(1) / plain if plain else 0.0
        return 0.0

    def _drafted_after(self, depth: int) -> int:
        """With serial rounds available, the draft's work for a probe or a trial is done after the verification, on
        every core (cheaper than beside it): depth 0 now, `serial` tokens drafted just in time."""
        if depth and self.serial_option:
            self.serial = depth
            return 0
        return depth
