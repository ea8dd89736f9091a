"""Resolving after a verification the draft sat out (a plain step, or a serial round's verification): commit what
each row accepted, keep the committed tokens the draft cache lacks to be glued on resuming, and, for a serial round,
draft the next speculation just in time. A paused round right after one that ran nothing is bookkeeping alone; the
rounds of a plain stretch arrive together (`sat_out`).

A mixin of `SaguaroCandidateGenerator`: it reads and advances the generator's draft cache (`cache`), per-row state
(`t_prev`, `glue_start`, `unglued`, `contexts`, `speculations`), the fan-out estimates and timings, and drafts with
`JustInTimeDrafting`; commits outcomes with the generator's `_commit`."""

from __future__ import annotations

import time

import torch

from ..cache.speculation_cache import SERIAL, Resolution, Speculation, lookup_kind, plain_resolutions
from .confidence import StopRule


class PausedDrafting:
    """The draft's side of rounds it sat out (see the module docstring)."""

    # (cache, version) after a paused resolve that ran nothing: the next one, if nothing ran in between, is pure
    # bookkeeping (`_resolve_paused_again`)
    _paused_at: tuple | None = None

    def _resolve_paused(self, outcomes, verified: int, keep_rows, serial: int = 0, stop: StopRule | None = None,
                        runner_up=()) -> list[Resolution]:
        """After a verification the draft sat out: commit each row's accepted tokens and bonus. The cache keeps
        what it holds of the committed path (positions up to t_prev + accepted); the committed tokens it lacks
        wait, before the new t_prev, to be glued on resuming (`unglued`), or are fed now when rows lack different
        numbers of them (a batch after a serial round). With `serial` > 0 the draft then drafts that many tokens
        per row just in time, feeding what the cache lacks, t_prev included, in its first forward. A row in
        `runner_up` accepted the runner-up in place of its first drafted token: the cache drops what it holds past
        t_prev (drafted after s_1) and the runner-up is fed with the other committed tokens it lacks."""
        if (serial == 0 and verified == 0 and keep_rows == list(range(self.rows))
                and self._paused_at == (self.cache, self.cache.version)):
            return self._resolve_paused_again(outcomes)
        started = time.perf_counter()
        for r in runner_up:
            self.speculations[r] = _with_runner_up(self.speculations[r])
        selected = torch.tensor(keep_rows, dtype=torch.long, device=self.device)
        held = [0 if r in runner_up else a for r, (a, _) in enumerate(outcomes)]  # none past t_prev after a runner-up
        accepted = torch.tensor([a for a, _ in outcomes], dtype=torch.long, device=self.device)
        keep = self.cache.valid & (self.cache.positions <= (self.glue_start + torch.tensor(held, device=self.device)
                                                            )[:, None])
        with self.clock("compact"):
            self.cache.keep(keep, None if len(keep_rows) == self.rows else selected, max_holes=self.lookahead)
        for r, acc in enumerate(held):
            if verified:  # a serial speculation's acceptance feeds the fan-out's estimate as a backup's does
                self.estimator.record_round(lookup_kind(self.speculations[r].source), acc, verified)
        self._commit(outcomes, accepted, keep_rows, selected)
        self.spec_cache = None
        self.schedules = self.estimator.schedules()
        self._round += 1
        self._reseed(1)
        missing = self._uncached(through_t_prev=serial > 0)
        if serial == 0 and len({len(m) for m in missing}) == 1:  # one plain step after another: nothing to run
            self.unglued = torch.tensor(missing, dtype=torch.long, device=self.device).reshape(len(missing), -1)
            self._paused_at = (self.cache, self.cache.version)
            return self._plain(len(keep_rows))
        self.unglued = self.unglued.new_zeros(len(keep_rows), 0)
        first = self._feed(missing, through_t_prev=serial > 0, phase="serial" if serial else "glue")
        if serial == 0:
            return self._plain(len(keep_rows))
        every = torch.ones(len(keep_rows), dtype=torch.bool, device=self.device)
        fed = time.perf_counter()
        tokens, probs, tops, confidence = self._draft_just_in_time(every, serial, "serial", first=first,
                                                                   stop=stop)
        if first is not None and tokens.shape[1] > 1:  # the steps: one forward per token after the first
            self.timings.serial_steps += tokens.shape[1] - 1
            self.timings.serial_step_seconds += time.perf_counter() - fed
        one_row = len(keep_rows) == 1  # where a runner-up may be verified
        self.speculations = [Speculation(tokens[i], None if probs is None else probs[i], SERIAL, row_top=tops[i],
                                         confidence=None if confidence is None else confidence[i],
                                         runner_up=_runner_up(tokens[i], tops[i]) if one_row else None)
                             for i in range(len(keep_rows))]
        self.timings.serial_calls += 1
        self.timings.serial_tokens += tokens.shape[1]
        self.timings.serial_seconds += time.perf_counter() - started
        return [Resolution(spec, hit=False, looked_up=False) for spec in self.speculations]

    def sat_out(self, rounds: list[tuple]) -> list[Resolution]:
        """Commit rounds the draft sat out, each (outcomes as (accepted, bonus) per row, verified, keep_rows[, the
        rows that took the runner-up]): the
        same calls, state and random streams as a `prepare` of depth 0 and a `resolve` per round, one by one."""
        resolutions: list[Resolution] = []
        for outcomes, verified, keep_rows, *runner_up in rounds:
            self.prepare(verified, 0)
            resolutions = self.resolve(outcomes, verified, keep_rows, runner_up=runner_up[0] if runner_up else ())
        return resolutions

    def _resolve_paused_again(self, outcomes) -> list[Resolution]:
        """`_resolve_paused` for a plain step right after one that ran nothing, every row kept: the cache is as that
        one left it (nothing to drop), nothing was verified (no estimate moves, so the fan-out schedules stand), and
        the one committed token the cache newly lacks per row is the old t_prev. The same state, without the
        per-round tensor work and host reads (a tiny pair's plain round spent 0.7 ms here, a quarter of AR's step).
        """
        bonuses = [bonus for _, bonus in outcomes]
        for context, bonus in zip(self.contexts, bonuses):
            context.append(bonus)
        self.unglued = torch.cat([self.unglued, self.t_prev[:, None]], dim=1)
        self.glue_start = self.glue_start + 1
        self.t_prev = torch.tensor(bonuses, dtype=torch.long, device=self.device)
        self.spec_cache = None
        self._round += 1
        self._reseed(1)
        return self._plain(len(bonuses))

    def _plain(self, rows: int) -> list[Resolution]:
        """The next round is a plain step for every row: empty speculations, handed out as such."""
        resolutions = plain_resolutions(rows, self.device)
        self.speculations = [resolution.speculation for resolution in resolutions]
        return resolutions


def _with_runner_up(speculation: Speculation) -> Speculation:
    """`speculation` as the row accepted it: the runner-up in place of its drafted tokens (the top tokens after
    t_prev, which the next glue would reuse, belong to a speculation that starts there: none are kept)."""
    token = torch.tensor([speculation.runner_up], dtype=speculation.tokens.dtype, device=speculation.tokens.device)
    return Speculation(token, None, speculation.source)


def _runner_up(tokens: torch.Tensor, tops: torch.Tensor) -> int | None:
    """The draft's best token for the first position other than the one it drafted there (greedy: its second
    choice; sampling: its likeliest token but the one drawn), from the top tokens after t_prev; None when it has
    none."""
    for token in tops[0].tolist():
        if token != int(tokens[0]):
            return token
    return None
