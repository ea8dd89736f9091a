"""The pause/probe/trial state between plain steps (`hf_ssd.generation.probing`), driven without a model."""

from __future__ import annotations

import math

import pytest

from hf_ssd.generation.probing import PAUSE_AFTER, PROBE_CHAIN, PROBE_EVERY, PROBE_MAX, PROBE_SHARE, Probing

K_MAX = 4


def _drive(probing: Probing, decisions: int, sample: float | None, probe_cost: float = 0.0,
           quiet: list[int] | None = None) -> list[int]:
    """Depths over `decisions` plain-step decisions; every one-token depth's sample (None: none came back) arrives
    before the decision after next, as a probe's does; a trial is taken as the policy's next round takes it. A probe
    costs `probe_cost` of a plain step. `quiet` collects `quiet_rounds` after each decision."""
    depths, pending = [], {}
    for d in range(decisions):
        if d in pending and pending.pop(d) is not None:
            probing.free_sample(sample)
        probing.decide()
        depth = probing.plain_depth(K_MAX, probe_cost)
        if depth == 1:
            pending[d + 2] = sample
        if depth == K_MAX:
            assert probing.take_trial() and not probing.take_trial()  # asked once
        depths.append(depth)
        if quiet is not None:
            quiet.append(probing.quiet_rounds(probe_cost))
    return depths


def test_the_draft_pauses_after_the_first_plain_steps_and_probes_ever_more_rarely():
    depths = _drive(Probing(), 100, None)
    assert depths[:PAUSE_AFTER] == [1] * PAUSE_AFTER
    probes = [d for d, depth in enumerate(depths) if depth == 1 and d >= PAUSE_AFTER]
    assert K_MAX not in depths  # nothing accepted: no trial
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    # the first probe after PROBE_EVERY plain steps, then each rejected one doubles the interval, up to PROBE_MAX
    assert probes[0] == PROBE_EVERY - 1
    assert gaps == [min(PROBE_EVERY * 2 ** (i + 1), PROBE_MAX) for i in range(len(gaps))], probes


def test_accepted_probes_chain_into_a_trial_and_a_trial_makes_probes_rarer():
    depths = _drive(Probing(), 40, 1.0)
    first_trial = depths.index(K_MAX)
    chained = [d for d, depth in enumerate(depths[:first_trial]) if depth == 1 and d >= PAUSE_AFTER]
    assert len(chained) == PROBE_CHAIN + 1  # the first probe and PROBE_CHAIN more, each right after its sample
    assert all(b - a == 2 for a, b in zip(chained, chained[1:]))
    assert first_trial == chained[-1] + 2
    probing = Probing()
    _drive(probing, first_trial + 1, 1.0)
    assert probing.every == 2 * PROBE_EVERY  # the trial did not bring speculation back: probe more rarely
    second = depths.index(K_MAX, first_trial + 1)
    later = [d for d, depth in enumerate(depths[:second]) if depth == 1 and d > first_trial]
    assert later[0] - first_trial == 2 * PROBE_EVERY
    assert len(later) == PROBE_CHAIN + 2  # and the second trial asked for one more accepted probe


def test_speculating_resets_the_backoff_and_a_timed_plain_step_pauses_at_once():
    probing = Probing()
    _drive(probing, 60, None)
    assert probing.every == PROBE_MAX
    probing.speculating()
    assert probing.every == PROBE_EVERY and probing.plain_run == 0
    probing.timed_plain_step()
    probing.decide()
    assert probing.plain_depth(K_MAX) == 0  # paused: the first plain steps' one-token depth is skipped


def test_probes_that_cost_much_of_a_plain_step_are_spaced_further_apart():
    """Paused probing costs at most PROBE_SHARE of the plain steps' time: a batch's probe (8 rows: ~0.6 of a plain
    step) comes every 20 rounds rather than every 8, backing off from there as before; a cheap one (one row: 0.15)
    keeps the base spacing. Accepted probes still chain at once."""
    costly = 0.6
    spacing = math.ceil(costly / PROBE_SHARE)
    assert spacing > PROBE_EVERY
    depths = _drive(Probing(), 200, None, probe_cost=costly)
    probes = [d for d, depth in enumerate(depths) if depth == 1 and d >= PAUSE_AFTER]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert probes[0] == spacing - 1 and gaps[0] == max(spacing, 2 * PROBE_EVERY)
    assert all(gap >= spacing for gap in gaps) and gaps[-1] == max(spacing, PROBE_MAX)
    assert _drive(Probing(), 100, None, probe_cost=0.15) == _drive(Probing(), 100, None)
    accepted = _drive(Probing(), 60, 1.0, probe_cost=costly)
    first = [d for d, depth in enumerate(accepted) if depth == 1 and d >= PAUSE_AFTER][:2]
    assert first[1] - first[0] <= 2  # chained right after the accepted one


@pytest.mark.parametrize("sample, probe_cost", [(None, 0.0), (None, 0.6), (1.0, 0.0), (0.0, 0.3)])
def test_quiet_rounds_counts_the_paused_decisions_ahead(sample, probe_cost):
    """`quiet_rounds` (how long a plain stretch may run) says, in every state probing passes through, exactly how
    many of the next decisions keep the draft paused — 0 while a probe's sample is pending or a trial is asked."""
    quiets: list[int] = []
    depths = _drive(Probing(), 150, sample, probe_cost, quiet=quiets)
    for d, quiet in enumerate(quiets[:-40]):
        paused = next(i for i, later in enumerate(depths[d + 1:]) if later != 0)
        assert quiet <= paused, (d, depths[d:d + 10])
        if quiet:  # nothing pending: the count is exact
            assert quiet == paused, (d, depths[d:d + 10])
    assert sum(q > 0 for q in quiets) > 50


def test_a_costly_probe_skips_the_first_plain_steps_one_token_depth():
    """Where a probe costs more than probing may spend at the base spacing, the first plain steps' one-token depth
    (which costs what a probe does) is skipped: the draft pauses at once, and a stretch can start there."""
    cheap, costly = PROBE_SHARE * PROBE_EVERY, PROBE_SHARE * PROBE_EVERY * 1.5
    assert _drive(Probing(), PAUSE_AFTER, None, probe_cost=cheap) == [1] * PAUSE_AFTER
    probing = Probing()
    assert _drive(probing, PAUSE_AFTER, None, probe_cost=costly) == [0] * PAUSE_AFTER
    assert probing.quiet_rounds(costly) > 0
    assert Probing().quiet_rounds(costly) > 0 and Probing().quiet_rounds(cheap) == 0
