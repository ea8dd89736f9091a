"""The per-round lookahead (K = 0..K_max): the policy on synthetic measurements, and losslessness when K changes
between rounds — K = 0 rounds and returns from them — under greedy decoding (every architecture and executor) and
sampling (the exact law, with a negative control)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_model, tiny_pair
from test_greedy_equivalence import _other_arch
from test_sampling_law import (
    ALPHA,
    E2E_VOCAB,
    REJECT,
    SAMPLES,
    TEMPERATURE,
    WARPED,
    exact_law,
    law_pvalues,
    ssd_samples,
)

from hf_ssd import SSDConfig, enable_ssd
from hf_ssd.ema import DecayedMean
from hf_ssd.generation import estimates as estimates_module
from hf_ssd.generation import lookahead as lookahead_module
from hf_ssd.generation import plain_steps as plain_steps_module
from hf_ssd.generation import probing
from hf_ssd.generation import prompt_lookup as prompt_lookup_module
from hf_ssd.generation.candidate_generator import DraftTimings, SaguaroCandidateGenerator
from hf_ssd.generation.costs import CPU_SHAPE, FLAT_SHAPE, GPU_SHAPE
from hf_ssd.generation.estimates import expected_tokens
from hf_ssd.generation.lookahead import LookaheadPolicy

# --- the policy, on synthetic rounds ---------------------------------------------------------------------------


def test_expected_tokens():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([1.0] * 4, 4) == 5.0


def _verdict(verified: int, accepted: int, target_next: int, vocab: int = 8):
    """One row's verification: `accepted` of `verified` drafted tokens [1, 2, 3, ...]; the target's argmax at
    position `verified` is `target_next`."""
    scores = torch.zeros(1, verified + 1, vocab)
    scores[0, verified, target_next] = 5.0
    return SimpleNamespace(verified=verified, accepted=[accepted], scores=scores, runner_up=None)


def _row(length: int):
    spec = SimpleNamespace(tokens=torch.arange(1, length + 1), probs=None, confidence=None, runner_up=None)
    return SimpleNamespace(speculation=spec)


def _drive(policy, rounds: int, accept_all: bool, verify_ms=lambda k: 10.0 * (1 + 0.5 * k), draft_ms=5.0,
           clock=None, contention_ms=0.0):
    """Run `rounds` synthetic rounds: the draft's tokens are [1, 2, ...] (as many as the previous round prepared);
    each verified one is accepted when `accept_all`, none otherwise; times come from `verify_ms(K)` and a draft
    round of `draft_ms` (none while paused); a verification while the draft works takes `contention_ms` more."""
    timings = DraftTimings()
    depth = policy._depth_for_tests if hasattr(policy, "_depth_for_tests") else policy.k_max
    for _ in range(rounds):
        k = policy.choose(depth)
        new_depth = policy.depth(k)  # as in the decoding loop: chosen before this round's verification is scored
        accepted = k if accept_all else 0
        nxt = k + 1 if accept_all else 0  # the token after the accepted ones: the draft's own (s_{k+1}) or not
        policy.observe_verification([_row(depth)], _verdict(k, accepted, nxt))
        drafted = draft_ms if depth else 0.0
        timings = DraftTimings(timings.prepare_calls + int(depth > 0), timings.prepare_seconds + drafted / 1e3)
        verify = verify_ms(k) + (contention_ms if new_depth else 0.0)
        clock[0] += max(verify, drafted) / 1e3
        policy.observe_round(verify / 1e3, timings, hits=1, lookups=1)
        depth = policy._depth_for_tests = new_depth
    return [entry["k"] for entry in policy.trace]


@pytest.fixture
def clock(monkeypatch):
    """A fake clock for the policy's round timing: time advances only as `_drive` says."""
    now = [0.0]
    monkeypatch.setattr(lookahead_module.time, "perf_counter", lambda: now[0])
    return now


def test_policy_speculates_deep_when_the_draft_is_accepted(clock):
    policy = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.7, concurrent=True)
    ks = _drive(policy, 30, accept_all=True, clock=clock)
    assert ks[0] == 4 and ks[-5:] == [4] * 5  # the first round verifies K_max; deep rounds pay here
    assert policy.trace[-1]["why"] == "best" and policy.trace[-1]["acceptance"][0] > 0.95


def test_policy_falls_back_to_plain_steps_pauses_and_returns(clock):
    """A useless draft: verifying costs more than it brings, the policy verifies 0 tokens (plain target steps);
    after two of them the draft pauses (depth 0) but for probes, rarer each time one is rejected; when the probes'
    tokens start to be accepted (the text became predictable), a trial round verifies a whole speculation and the
    policy speculates again — within one probe interval, a chain and the trial."""
    policy = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.7, concurrent=True)
    ks = _drive(policy, 30, accept_all=False, clock=clock)
    assert ks[-10:] == [0] * 10
    assert 0 in policy.verify and policy.trace[-1]["acceptance"][0] < 0.2  # samples only from probes now
    depths = [entry["depth"] for entry in policy.trace]
    probes = [i for i in range(3, len(depths)) if depths[i] == 1]
    assert len(probes) >= 2 and probes[1] - probes[0] > probing.PROBE_EVERY  # paused, probes backing off
    rounds = probing.PROBE_MAX + 2 * (probing.PROBE_CHAIN + 3) + 2
    ks = _drive(policy, rounds, accept_all=True, clock=clock)
    assert any(entry["why"] == "trial" for entry in policy.trace[30:])
    assert 0 not in ks[-4:] and ks[-1] == 4  # back to speculating, deep


def test_policy_explores_an_unmeasured_k_that_might_be_better(clock):
    """Only K_max measured, and a middling acceptance: a K whose predicted speed is within 10 % of the best is
    tried once, so its cost is measured rather than guessed."""
    policy = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.5, concurrent=True)
    _drive(policy, 2, accept_all=True, clock=clock)
    policy.acceptance.reached = [10.0] * 5
    policy.acceptance.passed = [5.0] * 5  # a = 0.5 everywhere
    k = policy.choose(4)
    entry = policy.trace[-1]
    assert entry["why"] == "explore" and k not in {4} and entry["tok_s"][k] >= 0.9 * max(entry["tok_s"].values())


def _measured(policy, times: dict[int, float]) -> None:
    for k, seconds in times.items():
        policy.verify[k] = DecayedMean(0.5)
        policy.verify[k].add(seconds)


def test_cost_curve_from_what_was_measured(clock):
    """An unmeasured K is guessed optimistically, so that it gets tried when it might be best: as cheap as the
    measured K below it (the lower bound of a rising curve), or in proportion to positions from the nearest one
    above; a plain step (K = 0), whose cost on a CPU is of another kind (one position: a matrix-vector product), is
    scaled by the prior shape until it is measured itself. Measured values are kept as measured where they rise with
    K; a deeper K measured cheaper than a shallower one is pooled with it (weighted by the samples each holds), since
    the noise of single timings, not the curve, makes most such dips."""
    policy = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.7, concurrent=True, cost_shape=CPU_SHAPE)
    _measured(policy, {3: 0.030})
    assert policy.verify_seconds(0) == pytest.approx(0.030 / (2.0 + 0.1 * 2))
    assert policy.verify_seconds(1) == pytest.approx(0.030 * 2 / 4)  # below: in proportion to positions
    assert policy.verify_seconds(2) == pytest.approx(0.030 * 3 / 4)
    assert policy.verify_seconds(4) == pytest.approx(0.030)  # above: as cheap as the largest measured below
    _measured(policy, {1: 0.026})
    assert policy.verify_seconds(2) == pytest.approx(0.026)  # between: as cheap as its lower neighbour
    assert policy.verify_seconds(4) == pytest.approx(0.030)
    assert policy.verify_seconds(0) == pytest.approx(0.026 / 2.0)
    _measured(policy, {0: 0.012})
    assert policy.verify_seconds(0) == pytest.approx(0.012) and policy.verify_seconds(3) == pytest.approx(0.030)
    gpu = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.7, concurrent=True, cost_shape=FLAT_SHAPE)
    _measured(gpu, {4: 0.030})
    assert gpu.verify_seconds(0) == pytest.approx(0.030 / (1.02 + 0.02 * 3))
    _measured(gpu, {2: 0.050})  # a non-monotone curve (3 positions slower than 5): pooled, one sample each
    assert gpu.verify_seconds(2) == pytest.approx(0.040) and gpu.verify_seconds(4) == pytest.approx(0.040)
    assert gpu.verify_seconds(3) == pytest.approx(0.040) and gpu.verify_seconds(1) == pytest.approx(0.040 * 2 / 3)
    gpu.verify[4].add(0.030)  # K = 4 now holds 1.5 samples' worth (decay 0.5), K = 2 one: pooled by weight
    assert gpu.verify_seconds(2) == pytest.approx((0.050 + 1.5 * 0.030) / 2.5)
    assert gpu.verify[2].value == pytest.approx(0.050)  # the measurement itself is kept; only the fit pools


def test_a_cheap_step_of_the_cost_curve_is_found(clock):
    """The curve of a 2-core Intel Xeon with AVX-512 (1-3 positions cost about one plain step, 4-5 twice): with only
    K_max timed, the smaller K are tried and the cheap K = 2 is kept; on a curve where every K >= 1 costs twice a
    plain step (a 2-core AMD EPYC), the smaller K are tried once and dropped again."""
    def run(curve):
        policy = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.8, concurrent=True, cost_shape=CPU_SHAPE)
        ks = []
        for _ in range(30):
            k = policy.choose(4)
            ks.append(k)
            policy.depth(k)
            policy.trace[-1]["tokens"] = 1 + k
            for j in range(k):
                policy.acceptance.add(j, 1.0 if j < 2 else 0.5)
            policy.observe_round(curve[k], None, 1, 1)
        return ks
    xeon = run({0: 0.245, 1: 0.25, 2: 0.255, 3: 0.50, 4: 0.51})
    assert {1, 2} <= set(xeon[:12]) and xeon[-10:] == [2] * 10
    epyc = run({0: 0.245, 1: 0.50, 2: 0.52, 3: 0.54, 4: 0.55})
    assert 2 not in epyc[-10:] and 1 not in epyc[-10:]


def _drive_modes(policy, rounds: int, concurrent_ms, serial_ms, plain_ms: float, draft_ms: float, jit_ms: float,
                 clock, acceptance: float = 0.8) -> list[tuple[int, str]]:
    """Synthetic rounds with a cost per kind of round: a concurrent one (K from `concurrent_ms`, the draft's round
    `draft_ms` beside it), a serial one (its verification on every core, `serial_ms`, then `jit_ms` per token
    drafted), a plain step (`plain_ms`); every position is accepted with probability `acceptance` (as a fraction).
    Returns (K, mode) per round."""
    timings, prepared = DraftTimings(), policy.k_max
    out = []
    for _ in range(rounds):
        k = policy.choose(prepared)
        depth = policy.depth(k)
        serial = policy.serial
        out.append((k, policy.trace[-1]["mode"]))
        for j in range(k):
            policy.acceptance.add(j, acceptance)
        verify = (serial_ms(k) if depth == 0 and k else plain_ms if k == 0 and depth == 0 else concurrent_ms(k))
        work = draft_ms if depth else 0.0
        timings = DraftTimings(timings.prepare_calls + int(depth > 0), timings.prepare_seconds + work / 1e3, 0, 0.0,
                               timings.serial_calls + int(serial > 0), timings.serial_seconds + serial * jit_ms / 1e3,
                               timings.serial_tokens + serial)
        clock[0] += (max(verify, work) + serial * jit_ms) / 1e3
        policy.observe_round(verify / 1e3, timings, hits=1, lookups=1)
        prepared = serial if depth == 0 else depth
    return out


def test_serial_rounds_where_the_target_scales_with_cores(clock):
    """Two cores on which the target runs 1.7x faster on both (a 2-core Xeon: 245 ms a plain step on both, 441 ms
    for 3 positions on one, 270 ms on both) and the draft does not (53-58 ms a token): drafting after each
    verification on every core (SD's schedule) beats drafting beside it, and is found within a few rounds; where
    the target does not scale (a 2-core EPYC, memory bound), concurrent rounds stay."""
    xeon = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.8, concurrent=True, cost_shape=CPU_SHAPE, serial=True)
    rounds = _drive_modes(xeon, 30, concurrent_ms=lambda k: 441.0 if k <= 2 else 850.0,
                          serial_ms=lambda k: 270.0 if k <= 2 else 480.0, plain_ms=245.0, draft_ms=270.0,
                          jit_ms=55.0, clock=clock)
    assert rounds[-10:] == [(2, "serial")] * 10 and any(mode == "concurrent" for _, mode in rounds[:5])
    epyc = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.8, concurrent=True, cost_shape=CPU_SHAPE, serial=True)
    rounds = _drive_modes(epyc, 30, concurrent_ms=lambda k: 900.0 + 40 * k, serial_ms=lambda k: 890.0 + 40 * k,
                          plain_ms=445.0, draft_ms=400.0, jit_ms=70.0, clock=clock, acceptance=0.85)
    assert all(mode == "concurrent" for _, mode in rounds[-10:]) and rounds[-1][0] >= 3
    assert sum(mode == "serial" for _, mode in rounds) <= 4  # tried, then dropped
    off = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.8, concurrent=True, cost_shape=CPU_SHAPE, serial=False)
    rounds = _drive_modes(off, 12, concurrent_ms=lambda k: 441.0, serial_ms=lambda k: 270.0, plain_ms=245.0,
                          draft_ms=270.0, jit_ms=55.0, clock=clock)
    assert all(mode != "serial" for _, mode in rounds)  # a draft on its own device: never serial


def test_the_probed_gain_prices_the_concurrent_mode_before_it_is_timed(clock):
    """Nothing timed beside the draft yet, the serial verifications known: a concurrent K costs the serial one below
    it times the gain of every core over the target's own (as probed before the first round, within [1,
    `every_core`]), a plain step the cheapest serial verification; the policy decides from them, not from the prior
    shape. Without a probe the gain is 1 (a bound: the concurrent mode looks as cheap as the serial one)."""
    def policy(probed):
        p = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.8, concurrent=True, cost_shape=CPU_SHAPE,
                            serial=True, every_core=2.0, probed_gain=probed)
        for k, seconds in {1: 0.30, 2: 0.33}.items():
            p.serial_verify[k] = DecayedMean(0.5)
            p.serial_verify[k].add(seconds)
        return p

    probed = policy(1.9)
    assert policy(3.0).probed_gain == 2.0 and policy(0.7).probed_gain == 1.0  # within [1, every_core]
    table, serial = probed.times(), probed.serial_times()
    assert table == {} and probed.verify_seconds(0, table) == pytest.approx(0.30)
    assert probed.round_seconds(0, table, serial) == pytest.approx(0.30)
    assert probed.round_seconds(1, table, serial) == pytest.approx(1.9 * 0.30)
    assert probed.round_seconds(4, table, serial) == pytest.approx(1.9 * 0.33)
    assert probed.core_gain() == pytest.approx(1.9)
    assert policy(None).round_seconds(4, table, serial) == pytest.approx(0.33) and policy(None).core_gain() == 2.0
    deep = policy(1.9)  # only a serial K = 4 known: K = 1 guessed down in proportion to positions, not floored at
    deep.serial_verify.clear()  # the plain step guessed from that very verification
    deep.serial_verify[4] = DecayedMean(0.5)
    deep.serial_verify[4].add(0.60)
    assert deep.serial_verify_seconds(1, {}, deep.serial_times()) == pytest.approx(0.60 * 2 / 5)
    probed.choose(4)
    probed.observe_round(1.0, DraftTimings(), 0, 0)  # the first round (the prefill)
    probed.choose(4)
    assert probed.trace[-1]["why"] != "prior shape" and probed.trace[-1]["mode"] == "serial"


# A forward's cost per count of positions relative to one, as probed on a 2-core Xeon with MKL's fp32 kernels
# (`runtime.layer_probe.cost_curve` on Qwen2.5-Coder 1.5B: 1-3 positions one price, 4-6 twice it, then slowly)
XEON_CURVE = {1: 1.0, 2: 1.0, 3: 1.05, 4: 2.0, 5: 2.05, 8: 2.6, 12: 3.3, 17: 3.3}


def test_a_probed_cost_curve_prices_what_is_not_timed(clock):
    """With the curve probed on the target's layers, an unmeasured K costs the nearest measured one times the probed
    rise (capped by a measured K above it), past K_max and below the smallest measured alike; the optimistic guesses
    (the lower neighbour's cost, in proportion to positions) and the prior shape stand only without a probe. A
    concurrent K with nothing beside the draft timed is priced from the serial ones along the probed rise too (a
    serial K = 2 at 268 ms priced a concurrent K = 4 at 1.9 x 268 ms; it took 892 where a serial K = 4 took 475)."""
    probed = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.7, concurrent=True, cost_shape=CPU_SHAPE,
                             probed_curve=XEON_CURVE)
    prior = probed.prior_positions_cost
    assert probed.positions_cost(1) == 1.0 and probed.positions_cost(4) == 2.0
    assert probed.positions_cost(6) == pytest.approx(2.05 + (2.6 - 2.05) / 3)  # between two probed counts
    assert probed.positions_cost(20) == pytest.approx(3.3 * prior(20) / prior(17))  # past them: the prior's rise
    _measured(probed, {2: 0.26})
    assert probed.verify_seconds(3) == pytest.approx(0.26 * 2.0 / 1.05)  # the step to 4 positions, not 0.26
    assert probed.verify_seconds(1) == pytest.approx(0.26 * 1.0 / 1.05)
    assert probed.verify_seconds(7) == pytest.approx(0.26 * 2.6 / 1.05)  # a deep serial speculation's
    assert probed.verify_seconds(0) == pytest.approx(0.26 / 1.05)
    _measured(probed, {4: 0.45})
    assert probed.verify_seconds(3) == pytest.approx(0.45)  # never above a measured deeper K
    control = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.7, concurrent=True, cost_shape=CPU_SHAPE)
    _measured(control, {2: 0.26})
    assert control.verify_seconds(3) == pytest.approx(0.26) and control.positions_cost(4) == prior(4)

    def beside(curve):
        p = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.8, concurrent=True, cost_shape=CPU_SHAPE,
                            serial=True, every_core=2.0, probed_gain=1.9, probed_curve=curve)
        p.serial_verify[2] = DecayedMean(0.5)
        p.serial_verify[2].add(0.268)
        return p.round_seconds(4, {}, p.serial_times())

    assert beside(XEON_CURVE) == pytest.approx(1.9 * 0.268 * 2.05 / 1.05)
    assert beside(None) == pytest.approx(1.9 * 0.268)


def test_a_probed_step_of_the_cost_curve_is_not_explored(clock):
    """The 2-core Xeon of `test_serial_rounds_where_the_target_scales_with_cores`, its curve probed: the prior-shape
    round verifies two tokens, not K_max, and no round after the first (the prefill's, K_max by design) verifies the
    three or four that cost twice as much (measured in a cold call before the probe: a prior-shape K = 4 at 504-565
    ms and an explored K = 3 at 469-476, where K = 2 took 260-270). Without the probe both are tried."""
    def rounds(curve):
        policy = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.8, concurrent=True, cost_shape=CPU_SHAPE,
                                 serial=True, every_core=2.0, probed_gain=1.9, probed_curve=curve)
        policy.began(0.25)
        out = _drive_modes(policy, 20, concurrent_ms=lambda k: 441.0 if k <= 2 else 850.0,
                           serial_ms=lambda k: 270.0 if k <= 2 else 480.0, plain_ms=245.0, draft_ms=270.0,
                           jit_ms=55.0, clock=clock)
        return out, policy.trace

    probed, trace = rounds(XEON_CURVE)
    assert trace[1]["why"] == "prior shape" and probed[1][0] == 2
    assert all(k <= 2 for k, _ in probed[1:]) and probed[-5:] == [(2, "serial")] * 5
    assert trace[0]["probed_cost_curve"] == XEON_CURVE
    unprobed, _ = rounds(None)
    assert any(k >= 3 for k, _ in unprobed[1:])  # the control: the step is found by trying it


def test_the_first_call_makes_its_prior_shape_round_serially_where_the_probe_says_so(clock):
    """Nothing timed yet (the first round held the prefill): the prior shape's round is made serially where the
    verification on the target's own cores costs more, at the probed gain, than the draft's tokens after one on every
    core (their cost relative to the target's from the two prefills), and its speculation is drafted K_max deep at
    most (past K_max only the prior shape would price its verification); concurrently where the gain is small (a
    2-core EPYC: the second core gains the target 6 %) or unprobed."""
    def second_round(probed):
        policy = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.7, concurrent=True, cost_shape=CPU_SHAPE,
                                 serial=True, every_core=2.0, probed_gain=probed, confidence=True, serial_lookahead=16)
        policy.began(0.25)  # the draft's prefill and first speculation
        policy.choose(4)
        policy.depth(4)
        policy.observe_round(0.86, DraftTimings(), 0, 0)  # the target's prefill
        k = policy.choose(16)
        policy.depth(k)
        return k, policy.trace[-1], policy.serial

    k, entry, serial = second_round(1.9)
    assert entry["why"] == "prior shape" and entry["mode"] == "serial" and k == 4 and 0 < serial <= 4
    for probed in (1.06, None):
        k, entry, serial = second_round(probed)
        assert entry["why"] == "prior shape" and entry["mode"] == "concurrent" and serial == 0


def test_a_later_call_does_not_try_the_concurrent_mode_again_where_the_probe_prices_it_out(clock):
    """A 2-core Xeon (the target 1.8x faster on both cores, the gain probed at 1.9): the first call may try a
    verification beside the draft once; a later call, whose serial costs are remembered (the concurrent K = 4 timed
    once is not: a single timing may be a one-off), does not try it again. Before the probe, the second call fell
    back to the prior shape and tried it again (measured: a plain step beside the draft in 590 ms and a K = 4 in
    1082, where a serial K = 4 takes 607); unpriced (a gain of 1), it looks as cheap as the serial one."""
    costs = dict(concurrent_ms=lambda k: 590.0 if k <= 2 else 1080.0, serial_ms=lambda k: 330.0 if k <= 2 else 600.0,
                 plain_ms=300.0, draft_ms=560.0, jit_ms=55.0, clock=clock, acceptance=0.7)

    def second_call(probed):
        memory = estimates_module.LookaheadMemory()  # what the first call left: serial K = 1..4 timed twice or
        for k, seconds in {1: 0.33, 2: 0.33, 3: 0.60, 4: 0.60}.items():  # more, K = 4 beside the draft once
            for _ in range(estimates_module.REMEMBER_AFTER):
                memory.record(estimates_module.memory_key(("process", 1), 1, serial=True), k, seconds)
        memory.record(estimates_module.memory_key(("process", 1), 1), 4, 1.08)
        policy = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.7, concurrent=True, cost_shape=CPU_SHAPE,
                                 memory=memory, setting=("process", 1), draft_key=3, serial=True, every_core=2.0,
                                 probed_gain=probed)
        return _drive_modes(policy, 12, **costs), [entry["why"] for entry in policy.trace]

    second, whys = second_call(1.9)
    assert all(mode != "concurrent" for _, mode in second[1:]) and "prior shape" not in whys
    assert second[-4:] == [(2, "serial")] * 4
    unpriced, whys = second_call(None)
    assert any(mode == "concurrent" for _, mode in unpriced[1:])  # the control: at a gain of 1, tried again


def test_serial_drafting_costs_a_fixed_part_and_a_step_per_token(clock):
    """A serial speculation's drafting: the forward that feeds the committed tokens brings its first token, each
    further one costs a step. The two are measured apart (a per-token average over short speculations carries the
    fixed part, which made deep ones look dear and stopped drafting early); n tokens cost fixed + (n - 1) steps, and
    the stop rule prices a further token at one step."""
    policy = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.8, concurrent=True, cost_shape=CPU_SHAPE,
                             serial=True, confidence=True)
    policy.choose(4)
    policy.observe_round(0.1, DraftTimings(), 0, 0)  # the first round (the prefill): nothing timed
    five = DraftTimings(serial_calls=1, serial_seconds=0.030 + 4 * 0.010, serial_tokens=5, serial_steps=4,
                        serial_step_seconds=0.040)
    policy.choose(4)
    policy.observe_round(0.1, five, 0, 0)
    assert policy.serial_fixed.value == pytest.approx(0.030) and policy.serial_token.value == pytest.approx(0.010)
    assert policy.serial_drafting_seconds(1) == pytest.approx(0.030)
    assert policy.serial_drafting_seconds(5) == pytest.approx(0.070)
    assert policy.serial_length.value == pytest.approx(5.0)
    one = DraftTimings(serial_calls=2, serial_seconds=five.serial_seconds + 0.040, serial_tokens=6, serial_steps=4,
                       serial_step_seconds=0.040)  # a one-token speculation: its whole time is the fixed part
    policy.choose(4)
    policy.observe_round(0.1, one, 0, 0)
    assert policy.serial_fixed.value == pytest.approx(0.7 * 0.030 + 0.3 * 0.040)
    assert policy.serial_token.value == pytest.approx(0.010)
    policy.serial, policy._rate = 4, 5.0  # a serial round at 5 tokens/s, no cost curve measured: no extra position
    policy.serial_verify.clear()
    assert policy.stop_rule().gain == pytest.approx(5.0 * 0.010)
    untimed = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.8, concurrent=True, serial=True)
    untimed.choose(4)
    untimed.observe_round(0.1, DraftTimings(), 0, 0)
    untimed.choose(4)  # a drafter that does not time its steps: the average per token, for every token
    untimed.observe_round(0.1, DraftTimings(serial_calls=1, serial_seconds=0.060, serial_tokens=3), 0, 0)
    assert untimed.serial_fixed.value is None and untimed.serial_drafting_seconds(4) == pytest.approx(0.080)


def test_a_slow_first_step_does_not_keep_serial_speculations_short(clock):
    """A step is measured only where a speculation runs two tokens or more: a slow first measurement (55 ms, the
    call's first drafts; 37 ms later) would stand while it keeps the speculations one token deep. A further token
    never costs more than the fixed part (a forward of the committed tokens and the first one), measured every
    serial round."""
    policy = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.8, concurrent=True, cost_shape=CPU_SHAPE,
                             serial=True, confidence=True)
    policy.choose(4)
    policy.observe_round(0.1, DraftTimings(), 0, 0)
    slow = DraftTimings(serial_calls=1, serial_seconds=0.060 + 3 * 0.055, serial_tokens=4, serial_steps=3,
                        serial_step_seconds=3 * 0.055)
    policy.choose(4)
    policy.observe_round(0.1, slow, 0, 0)
    assert policy.serial_step() == pytest.approx(0.055)
    timings = slow
    for _ in range(6):  # one-token speculations at 42 ms each: no step measured
        timings = DraftTimings(serial_calls=timings.serial_calls + 1, serial_seconds=timings.serial_seconds + 0.042,
                               serial_tokens=timings.serial_tokens + 1, serial_steps=3,
                               serial_step_seconds=timings.serial_step_seconds)
        policy.choose(4)
        policy.observe_round(0.1, timings, 0, 0)
    assert policy.serial_token.value == pytest.approx(0.055)
    assert policy.serial_step() == pytest.approx(policy.serial_fixed.value) and policy.serial_step() < 0.045
    assert policy.serial_drafting_seconds(3) == pytest.approx(3 * policy.serial_fixed.value)


def test_one_token_speculations_still_sample_the_second_position():
    """A serial speculation's second token is the free sample of a_2 (when the first is accepted); one-token
    speculations never give it. While a_1 x a_2's upper bound makes a second token worth its gain, just-in-time
    drafting runs at least two tokens: two early rejections do not stop it, a_2 rejected round after round does, the
    exploration returns once those samples have decayed, and never happens where a_1 is poor."""
    policy = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.8, concurrent=True, cost_shape=CPU_SHAPE,
                             serial=True, confidence=True)
    policy.serial, policy._rate = 4, 5.0
    policy.serial_token.add(0.04)
    policy.serial_fixed.add(0.05)
    policy.trace.append({"k": 1})
    assert policy.stop_rule().at_least == 2 and policy.trace[-1]["at_least"] == 2
    tracker = policy.acceptance

    def round_(first: float, second: float | None) -> None:
        tracker.decay()
        tracker.add(0, first)
        if second is not None:
            tracker.add(1, second)

    for _ in range(2):  # two early rejections of the second token: still worth exploring
        round_(1.0, 0.0)
    assert tracker.estimates()[1] < 0.2 and policy.stop_rule().at_least == 2
    for _ in range(30):  # rejected round after round: the bound narrows below the gain
        round_(1.0 if _ % 2 else 0.0, 0.0)
    assert policy.stop_rule().at_least == 1
    for _ in range(12):  # one-token rounds since: the samples decay, the second token is tried again
        round_(1.0 if _ % 2 else 0.0, None)
    assert policy.stop_rule().at_least == 2
    for _ in range(40):  # a poor first position: a second token would rarely be reached
        round_(0.0, None)
    assert policy.stop_rule().at_least == 1


def test_a_plain_step_is_tried_when_it_might_win(clock):
    """Measured verifications of several positions cost about the same (a CPU's matrix products), acceptance is
    low: the plain step's optimistic prior makes it worth one try, after which its measured cost decides."""
    policy = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.3, concurrent=True, cost_shape=CPU_SHAPE)
    _measured(policy, {1: 0.90, 3: 0.93, 4: 0.95})
    policy._rounds = 3
    policy.acceptance.reached = [10.0] * 5
    policy.acceptance.passed = [2.0] * 5
    assert policy.choose(4) == 0 and policy.trace[-1]["why"] in {"explore", "best"}


def test_after_a_rejected_first_round_the_prior_shape_decides(clock):
    """The first round's verification holds the prefill, so nothing is timed before the second: its K comes from
    the acceptance seen and the prior cost shape. A useless draft on a CPU (several positions cost about twice
    one) is dropped at once; on a GPU (flat curve) speculating stays cheap enough to keep trying."""
    cpu = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.7, concurrent=True, cost_shape=CPU_SHAPE)
    assert _drive(cpu, 2, accept_all=False, clock=clock) == [4, 0]
    assert cpu.trace[1]["why"] == "prior shape"
    gpu = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.7, concurrent=True, cost_shape=FLAT_SHAPE)
    assert _drive(gpu, 2, accept_all=False, clock=clock)[1] > 0


def test_an_explored_plain_step_pauses_the_draft_so_it_is_timed_once(clock):
    """Speculation was measured, then stops paying: the plain step (unmeasured, its prior optimistic) is tried
    with the draft paused for that round, so one try times it cleanly and it is not explored again."""
    policy = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.7, concurrent=True, cost_shape=CPU_SHAPE)
    cost = dict(verify_ms=lambda k: 10.0 if k == 0 else 24.0, clock=clock, contention_ms=3.0)
    _drive(policy, 4, accept_all=True, **cost)
    assert 0 not in policy.verify
    ks = _drive(policy, 12, accept_all=False, **cost)
    explored = [entry for entry in policy.trace if entry["k"] == 0 and entry["why"] == "explore"]
    assert len(explored) == 1 and explored[0]["depth"] == 0
    assert policy.verify[0].value == pytest.approx(0.010)  # not 13 ms: timed while paused
    assert ks[-6:] == [0] * 6


def test_accepted_probes_lead_to_trials_that_back_off(clock):
    """Probes whose tokens come back accepted are repeated (each once its sample is back, two rounds later: never
    one every other round for good, as a chain reset by the rounds in between once did); a chain of them asks for
    a trial round verifying a whole speculation. While plain steps still win (here speculation costs 20x a plain
    step), probes and trials become rarer: in the long run the draft works in few rounds."""
    policy = LookaheadPolicy(3, adaptive=True, acceptance_prior=0.7, concurrent=True, cost_shape=CPU_SHAPE)
    policy.jump = 20.0  # a prior that lets the plain step be tried
    ks = _drive(policy, 200, accept_all=True, verify_ms=lambda k: 10.0 if k == 0 else 200.0, clock=clock)
    trials = [i for i, entry in enumerate(policy.trace) if entry["why"] == "trial"]
    assert len(trials) >= 3 and all(ks[i] == 3 for i in trials)
    assert all(k == 0 for i, k in enumerate(ks[1:], 1) if i not in trials)  # only trials speculate
    gaps = [b - a for a, b in zip(trials, trials[1:])]
    assert gaps[0] < gaps[-1] and gaps[-1] >= probing.PROBE_MAX
    late = [entry["depth"] for entry in policy.trace[100:]]
    assert sum(d > 0 for d in late) <= 0.2 * len(late)


def test_a_plain_step_is_timed_only_while_the_draft_is_paused(clock):
    """Plain steps while the draft still works (one token deep, slowed by its memory traffic) are not what
    choosing plain decoding costs for long: only paused steps time K = 0, so a useless draft ends paused."""
    policy = LookaheadPolicy(3, adaptive=True, acceptance_prior=0.7, concurrent=True, cost_shape=CPU_SHAPE)
    ks = _drive(policy, 40, accept_all=False, verify_ms=lambda k: 10.0 if k == 0 else 21.0, clock=clock,
                contention_ms=6.0)
    assert policy.verify[0].value == pytest.approx(0.010)  # never the 16 ms of a step beside the draft
    assert ks[-10:] == [0] * 10
    depths = [entry["depth"] for entry in policy.trace]
    assert depths[-10:].count(0) >= 8  # paused, but for the probes


def test_speculation_must_beat_plain_steps_by_a_margin(clock):
    """Near a tie plain decoding wins: the estimates are noisy and a wrong switch costs a round at twice a plain
    step's price."""
    policy = LookaheadPolicy(3, adaptive=True, acceptance_prior=0.5, concurrent=True, cost_shape=CPU_SHAPE)
    _measured(policy, {0: 0.010, 1: 0.02, 2: 0.02, 3: 0.02})
    policy._rounds = 3
    policy.acceptance.reached = [100.0] * 4
    policy.acceptance.passed = [75.0, 40.0, 10.0, 1.0]  # E(3) = 1 + .75 + .3 + .03 = 2.08: 1.04x plain's speed
    speeds = {k: estimates_module.expected_tokens(policy.acceptance.estimates(), k) / policy.round_seconds(k)
              for k in range(4)}
    assert 1.0 < max(speeds.values()) / speeds[0] < lookahead_module.SPECULATE_MARGIN
    assert policy.choose(3) == 0 and policy.trace[-1]["why"] == "best"
    policy.acceptance.passed = [95.0, 85.0, 80.0, 1.0]  # now clearly worth it
    assert policy.choose(3) == 3


def test_returning_from_plain_steps_asks_for_a_larger_gain(clock):
    """Hysteresis: a gain of ~1.1x keeps a speculating policy speculating but does not draw it back from plain
    steps (where its estimates of the deeper positions rest on first-position probes only)."""
    policy = LookaheadPolicy(3, adaptive=True, acceptance_prior=0.5, concurrent=True, cost_shape=CPU_SHAPE)
    _measured(policy, {0: 0.010, 1: 0.02, 2: 0.02, 3: 0.02})
    policy._rounds = 3
    policy.acceptance.reached = [100.0] * 4
    policy.acceptance.passed = [75.0, 50.0, 30.0, 1.0]  # E(3) = 1 + .75 + .38 + .11: 1.12x plain's speed
    speeds = {k: estimates_module.expected_tokens(policy.acceptance.estimates(), k) / policy.round_seconds(k)
              for k in range(4)}
    assert lookahead_module.SPECULATE_MARGIN < max(speeds.values()) / speeds[0] < lookahead_module.RESUME_MARGIN
    assert policy.choose(3) == 3  # speculating (the first decision follows the first round, K_max)
    policy.trace[-1]["k"] = 0  # as if the last round was a plain step
    assert policy.choose(3) == 0


def test_unreached_positions_revert_to_what_the_pair_showed_there():
    """A position not reached for a while (plain steps and probes only sample a_1) shrinks to what this pair has
    shown: the first to the pooled acceptance, a later one to the acceptance at the positions after the first (each
    reached only when the ones before were accepted), not to the configured prior."""
    tracker = estimates_module.AcceptanceTracker(5, prior=0.7)
    for _ in range(20):
        tracker.add(0, 1.0)
        tracker.add(1, 0.0)
    assert tracker.pooled() == pytest.approx((20 + 0.7 * 2) / (40 + 2))
    assert tracker.later() == pytest.approx((0 + tracker.pooled() * 2) / (20 + 2))
    estimates = tracker.estimates()
    assert estimates[3] == estimates[4] == pytest.approx(tracker.later()) and estimates[3] < 0.1
    assert estimates[0] > 0.95 and estimates[1] < 0.05
    for _ in range(30):  # many rounds with nothing past the first position: the recent counts fade
        tracker.decay()
    assert tracker.beyond_first() == pytest.approx(tracker.later(), abs=0.01)


def test_after_a_first_token_the_later_positions_keep_their_own_odds():
    """Bursty acceptance: first positions rejected half the time, later ones nearly always accepted. The later
    positions' estimates stay at their own odds, above the pooled acceptance."""
    tracker = estimates_module.AcceptanceTracker(5, prior=0.7)
    for i in range(40):
        tracker.decay()
        if i % 2:
            tracker.add(0, 0.0)
        else:
            for j in range(4):
                tracker.add(j, 1.0)
            tracker.add(4, 0.0)
    assert tracker.later() == pytest.approx(0.75, abs=0.01)  # 3 of every 4 later positions reached
    assert tracker.pooled() < 0.7 and tracker.estimates()[0] < 0.6
    assert min(tracker.estimates()[1:4]) > 0.9 > 0.2 > tracker.estimates()[4]


def test_a_later_call_remembers_the_cost_curve(clock):
    """Costs timed (twice) in one call on a target serve the next (same executor, threads and rows), scaled by what
    the new call measures: no K remembered is explored again, the second round decides from them rather than the
    prior shape, and the draft's pooled acceptance becomes the next call's prior."""
    memory = estimates_module.LookaheadMemory()
    first = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.7, concurrent=True, memory=memory,
                            setting=("thread", 1), draft_key=7)
    cost = dict(verify_ms=lambda k: 10.0 if k == 0 else 24.0 + k, clock=clock)
    _drive(first, 16, accept_all=False, **cost)
    first.metrics()
    timed = set(memory.times(("thread", 1, 1)))
    assert timed and timed == {k for k, n in memory.samples[("thread", 1, 1)].items() if n >= 2} <= set(first.verify)
    assert memory.acceptance[7] == pytest.approx(first.acceptance.pooled()) and memory.acceptance[7] < 0.3
    second = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.7, concurrent=True, memory=memory,
                             setting=("thread", 1), draft_key=7)
    assert second.acceptance.prior == memory.acceptance[7]
    slower = dict(verify_ms=lambda k: 2 * (10.0 if k == 0 else 24.0 + k), clock=clock)
    _drive(second, 12, accept_all=False, **slower)
    whys = [entry["why"] for entry in second.trace]
    assert whys[1] == "best" and "prior shape" not in whys
    assert not [e for e in second.trace if e["why"] == "explore" and e["k"] in timed]
    assert second.verify_seconds(4) == pytest.approx(2 * first.verify_seconds(4), rel=0.05)  # scaled to this call
    other = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.7, concurrent=True, memory=memory,
                            setting=("process", 1), draft_key=8)
    assert other.verify_seconds(4) is None and other.acceptance.prior == 0.7  # another setting, another draft


def _remembering_policy(remembered: dict[int, float], measured: dict[int, float], acceptance: float):
    """A policy 3 rounds into a call, with `remembered` timed twice by earlier calls (one thread, one row), `measured`
    timed in this call, and per-position acceptance `acceptance` over 10 samples."""
    memory = estimates_module.LookaheadMemory()
    for k, seconds in remembered.items():
        memory.record(("thread", 1, 1), k, seconds)
        memory.record(("thread", 1, 1), k, seconds)
    policy = LookaheadPolicy(4, adaptive=True, acceptance_prior=acceptance, concurrent=True, memory=memory,
                             setting=("thread", 1))
    policy._rounds = 3
    _measured(policy, measured)
    policy.acceptance.reached = [10.0] * 5
    policy.acceptance.passed = [10.0 * acceptance] * 5
    return policy


def test_a_close_remembered_cost_is_timed_again_once_stale(clock):
    """A K timed only in earlier calls (at another context, where the cost curve's steps may lie elsewhere) counts as
    timed when a call starts: not re-timed in each call's first rounds (that spent 16 % of a bench's rounds), but
    timed again once `RETIME_AFTER` rounds old if its remembered speed is within 10 % of the best; then its own
    measurement decides."""
    policy = _remembering_policy({0: 0.25, 1: 0.335, 2: 0.335, 3: 0.51, 4: 0.52}, {4: 0.52}, acceptance=0.95)
    assert policy.choose(4) == 4 and policy.trace[-1]["why"] == "best"  # K = 2 remembered, close: not yet
    policy._rounds = lookahead_module.RETIME_AFTER + 1
    assert policy.choose(4) == 2 and policy.trace[-1]["why"] == "explore"  # remembered long ago, close: timed again
    _measured(policy, {2: 0.26})  # cheaper in this context
    assert policy.choose(4) == 2 and policy.trace[-1]["why"] == "best"


def test_a_close_remembered_plain_step_is_timed_again_at_once(clock):
    """The plain step is the exception: remembered, close to the best, it is timed again in this call's first
    rounds (one noisy plain step kept a useless draft's speculation going)."""
    policy = _remembering_policy({0: 0.30, 1: 0.335, 2: 0.335, 3: 0.51, 4: 0.52}, {1: 0.335}, acceptance=0.2)
    assert policy.choose(4) == 0 and policy.trace[-1]["why"] == "explore"


def test_a_sure_speculation_in_hand_is_verified_before_a_plain_step_is_timed_again(clock):
    """Exploring a plain step drops the speculation in hand: a remembered plain step close to the best at the run's
    average acceptance is not timed again while the hand's tokens, priced by the draft's confidence in them, promise
    far more than that best; with an unsure hand (or none) it is, at once, and where serial rounds are best the next
    speculation is drafted after it."""
    memory = estimates_module.LookaheadMemory()
    for _ in range(2):  # timed twice by earlier calls: remembered
        memory.record(("thread", 1, 1), 0, 0.10)
        for k in range(1, 5):
            memory.record(("thread", 1, 1, "serial"), k, 0.105 + 0.002 * k)

    def policy_with(hand):
        policy = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.3, concurrent=True, memory=memory,
                                 setting=("thread", 1), draft_key=1, serial=True, confidence=True)
        for _ in range(40):  # the pair: sure tokens are taken, unsure ones are not (a quarter of them sure)
            for position in range(4):
                policy.calibration.add(0.99, 1.0, position=position)
                for _ in range(3):
                    policy.calibration.add(0.05, 0.0, position=position)
        policy._rounds = 3
        policy.acceptance.reached = [10.0] * 5
        policy.acceptance.passed = [2.5] * 5
        _measured(policy, {1: 0.21})  # this call's one timing: a verification beside the draft
        policy.serial_verify.setdefault(2, DecayedMean(0.7)).add(0.109)
        policy.serial_token.add(0.01)
        policy.serial_fixed.add(0.01)
        policy.serial_length.add(2.0)
        k = policy.choose(4, confidence=hand)
        return policy, k, policy.trace[-1]

    policy, k, unsure = policy_with([torch.full((4,), 0.05)])
    assert k == 0 and unsure["why"] == "explore", unsure
    # timed as a serial round's verification of nothing: the draft sits it out (the step is on every core), then
    # drafts the next speculation, so the round after it has one to verify
    assert policy._mode == lookahead_module.SERIAL and policy.depth(k) == 0 and policy.serial > 0
    _, k, sure = policy_with([torch.full((4,), 0.99)])
    assert k >= 2 and sure["why"] == "best", sure


def test_a_batch_of_new_size_starts_from_remembered_costs_at_the_nearest_rows(clock):
    """A call at 8 rows after calls at 2 and 4 (a batch sweep, a server's changing load) starts from the 4-row costs
    rescaled by the prior curve rather than exploring every K again; this call's own rows come first, and a
    serial table borrows only serial times."""
    memory = estimates_module.LookaheadMemory()
    for rows, seconds in ((2, 0.30), (4, 0.40)):
        for _ in range(2):
            memory.record(("process", 1, rows), 4, seconds)
            memory.record(("process", 1, rows, "serial"), 4, seconds / 2)
    assert set(memory.by_rows(("process", 1))) == {2, 4} and memory.by_rows(("process", 1), serial=True)[4] == {
        4: pytest.approx(0.20)}
    policy = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.7, concurrent=True, memory=memory,
                             setting=("process", 1), cost_shape=FLAT_SHAPE)
    policy._active_rows = 8
    cost = policy.positions_cost
    assert policy.verify_seconds(4) == pytest.approx(0.40 * cost(40) / cost(20))
    assert policy.serial_times()[4] == pytest.approx(0.20 * cost(40) / cost(20))
    policy._active_rows = 7
    _measured(policy, {4: 0.90})
    policy._active_rows = 6  # nearer to 7 (this call) than to 4 (remembered)
    assert policy.verify_seconds(4) == pytest.approx(0.90 * cost(30) / cost(35))


def test_a_single_timing_is_not_remembered_and_the_lowest_first_one_is():
    """One timing of a K may be a one-off (a process's first forwards, a busy moment): later calls are served a K's
    time once timed twice, the lower of its first two (a one-off only slows a forward down), then a decayed mean."""
    memory = estimates_module.LookaheadMemory()
    setting = ("process", 1, 1)
    memory.record(setting, 2, 0.80)
    assert memory.times(setting) == {}
    memory.record(setting, 2, 0.365)
    assert memory.times(setting) == {2: pytest.approx(0.365)}
    memory.record(setting, 2, 0.465)
    c = estimates_module.COST_DECAY
    assert memory.times(setting)[2] == pytest.approx(c * 0.365 + (1 - c) * 0.465)


def test_constant_schedule_always_verifies_k_max(clock):
    policy = LookaheadPolicy(3, adaptive=False, acceptance_prior=0.7, concurrent=True)
    assert _drive(policy, 8, accept_all=False, clock=clock) == [3] * 8
    assert policy.choose(1) == 1  # but never past what max_length leaves


# --- losslessness when K changes ---------------------------------------------------------------------------------

# (K verified, depth prepared) per round: plain steps one token deep, a pause (depth 0), a resume, every K
SCRIPT = [(0, 1), (1, 3), (3, 3), (0, 1), (0, 0), (0, 0), (0, 1), (1, 3), (2, 2), (2, 3), (0, 0), (0, 3)]
LAW_SCRIPT = [(2, 3), (0, 0), (0, 1), (1, 3)]  # 4 new tokens: partial, a paused plain step, a resume, a return


def _script(monkeypatch, script):
    """The policy verifies and prepares as `script` says, round after round (K capped by what the round can
    verify: what the previous round prepared, what max_length leaves), whatever the timing. A step is (K, depth)
    or (K, 0, serial): the draft sits the verification out, then drafts `serial` tokens just in time."""
    def choose(self, limit):
        k = min(script[len(self.trace) % len(script)][0], limit)
        self._record(k, None, "scripted")
        return k

    def depth(self, k):
        step = script[(len(self.trace) - 1) % len(script)]
        self.trace[-1]["depth"] = step[1]
        self.serial = step[2] if len(step) > 2 else 0
        return self.trace[-1]["depth"]

    monkeypatch.setattr(LookaheadPolicy, "_choose", choose)
    monkeypatch.setattr(LookaheadPolicy, "depth", depth)
    monkeypatch.setattr(LookaheadPolicy, "first_depth", lambda self, rows=1: self.k_max)  # the script's first K


@pytest.fixture
def scripted(monkeypatch):
    _script(monkeypatch, SCRIPT)


# Serial rounds among concurrent ones and plain steps: into them from a plain step, a hit and a backup; out of them
# to a concurrent prepare, to a plain step (rows commit different numbers of tokens in a batch) and to another one.
SERIAL_SCRIPT = [(0, 0, 3), (3, 0, 2), (2, 3), (2, 0, 3), (3, 0, 0), (0, 1), (1, 3), (3, 0, 1), (1, 0, 0), (0, 0, 0),
                 (0, 0, 2), (2, 3)]
# 4 new tokens: a plain step into a serial round (its tokens are the 2nd to 4th), out of it to a plain step (a row
# committed several tokens the draft has not seen), into one again, then a concurrent round
LAW_SERIAL_SCRIPT = [(0, 0, 3), (2, 0, 0), (0, 0, 2), (2, 3)]


@pytest.fixture
def serial_scripted(monkeypatch):
    _script(monkeypatch, SERIAL_SCRIPT)


@pytest.fixture
def law_scripted(monkeypatch):
    _script(monkeypatch, LAW_SCRIPT)


def scripted_ks(rounds: int, k_max: int = 3, script=None) -> list[int]:
    """The K each round verifies under `script` (default SCRIPT): at most what the previous round prepared or, for a
    serial step (K, 0, serial), drafted after its verification."""
    ks, prepared = [], k_max
    for step in itertools.islice(itertools.cycle(script or SCRIPT), rounds):
        ks.append(min(step[0], prepared))
        prepared = step[2] if step[1] == 0 and len(step) > 2 else step[1]
    return ks


def scripted_runs(arch: str, executor: str, seed: int, new_tokens: int, prompt_length: int = 11, **config):
    """(whether the draft is the target itself, metrics) of SSD with the target as its own draft and with an
    unrelated one, each output checked against plain greedy decoding (`config`: more `SSDConfig` fields)."""
    target, random_draft = tiny_pair(arch, seed=seed)
    ids = torch.randint(0, 96, (1, prompt_length), generator=torch.Generator().manual_seed(seed % 7 + 3))
    expected = target.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    for draft in (target, random_draft):
        out = target.generate(ids, assistant_model=draft, max_new_tokens=new_tokens, do_sample=False,
                              ssd_config=SSDConfig(lookahead=3, executor=executor, **config))
        assert torch.equal(out, expected), (arch, executor)
        yield draft is target, target.ssd_metrics


ARCHS = ["llama", "qwen2", "mistral_sliding", "qwen2_hybrid"]


@pytest.mark.parametrize("executor", ["sync", "thread", "stream", "process"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identical_while_k_changes(scripted, arch, executor):
    for itself, m in scripted_runs(arch, executor, seed=60 + ARCHS.index(arch), new_tokens=33):
        assert len(m.lookahead_per_round) == m.batch_rounds and m.generated_tokens == 33
        limits = [decision["limit"] for decision in m.lookahead_decisions]  # what was prepared and max_length leave
        assert m.lookahead_per_round == [min(k, limit) for k, limit in zip(scripted_ks(m.batch_rounds), limits)]
        assert m.lookahead_per_round[:-3] == scripted_ks(m.batch_rounds)[:-3]  # max_length cuts only the last ones
        assert m.rounds_by_source.get("plain", 0) >= 2  # paused plain steps ran (and resumed: K > 0 after them)
        if itself:
            assert m.cache_hits > 0 and m.draft_acceptance_rate == 1.0


@pytest.mark.parametrize("executor", ["sync", "thread", "stream", "process"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identical_through_serial_rounds(serial_scripted, arch, executor):
    """Rounds the draft sits out and then drafts for just in time (on every core), mixed with concurrent rounds and
    plain steps: the output is plain decoding's, and every serial speculation is verified as scripted."""
    for itself, m in scripted_runs(arch, executor, seed=80 + ARCHS.index(arch), new_tokens=37):
        limits = [decision["limit"] for decision in m.lookahead_decisions]
        expected = scripted_ks(m.batch_rounds, script=SERIAL_SCRIPT)
        assert m.lookahead_per_round == [min(k, limit) for k, limit in zip(expected, limits)]
        assert m.rounds_by_source.get("serial", 0) >= 4 and m.generated_tokens == 37
        if itself:
            assert m.draft_acceptance_rate == 1.0 and m.tokens_per_round_by_source["serial"] > 1


# Long pauses between resumes: every paused round after the first of a run takes the bookkeeping-only path
PAUSED_SCRIPT = [(0, 1), (0, 0), (0, 0), (0, 0), (0, 0), (0, 3), (3, 3), (0, 0), (0, 0), (0, 0), (0, 1), (1, 3)]


def _record_paused_states(monkeypatch) -> list[list[tuple]]:
    """The draft's per-row state after every full paused resolve, a list per run (start a run with `.append([])`)."""
    states, full_resolve = [], SaguaroCandidateGenerator._resolve_paused

    def recorded(self, *args, **kwargs):
        out = full_resolve(self, *args, **kwargs)
        states[-1].append((self.glue_start.tolist(), self.t_prev.tolist(), self.unglued.tolist(),
                           [list(c) for c in self.contexts], [s.tokens.tolist() for s in self.speculations]))
        return out

    monkeypatch.setattr(SaguaroCandidateGenerator, "_resolve_paused", recorded)
    return states


def _self_drafted_run(target, ids, states, seed: int, max_new_tokens: int, do_sample: bool) -> torch.Tensor:
    """One recorded run with the target as its own draft (inline, draft backup, constant budget; no prompt lookup,
    which only a plain stretch's steps take): a new list in `states` (`_record_paused_states`), the global seed set,
    the output returned."""
    states.append([])
    torch.manual_seed(seed)
    return target.generate(ids, assistant_model=target, max_new_tokens=max_new_tokens, do_sample=do_sample, top_k=0,
                           ssd_config=SSDConfig(lookahead=3, executor="sync", backup="draft",
                                                fanout_budget_schedule="constant", prompt_lookup="never"))


@pytest.mark.parametrize("do_sample", [False, True])
def test_repeated_paused_rounds_keep_the_drafts_state(monkeypatch, do_sample):
    """A paused round right after one that ran nothing (`_resolve_paused_again`) leaves the draft exactly as the
    full paused resolve does: its state after every paused round, and so every draft on resuming and every sampled
    token under one seed, are the same, and a draft that is the target still has every greedy token accepted.
    (Backup and fan-out budget are fixed: chosen from timings, they could differ between the two runs.)"""
    _script(monkeypatch, PAUSED_SCRIPT)
    target, _ = tiny_pair("llama", seed=71)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(72))
    again, full_resolve = SaguaroCandidateGenerator._resolve_paused_again, SaguaroCandidateGenerator._resolve_paused
    states = _record_paused_states(monkeypatch)

    def the_full_path(self, outcomes):
        self._paused_at = None
        return full_resolve(self, outcomes, 0, list(range(self.rows)))

    outputs, fast_calls = [], []
    for path in (again, the_full_path):
        def counted(self, outcomes, _path=path):
            fast_calls.append(_path is again)
            return _path(self, outcomes)

        monkeypatch.setattr(SaguaroCandidateGenerator, "_resolve_paused_again", counted)
        outputs.append(_self_drafted_run(target, ids, states, 73, 40, do_sample))
        assert target.ssd_metrics.cache_hits > 0
        assert do_sample or target.ssd_metrics.draft_acceptance_rate == 1.0  # (sampling: Saguaro reshapes q)
    assert sum(fast_calls) >= 6 and fast_calls.count(False) == sum(fast_calls)  # each path ran equally often
    assert torch.equal(outputs[0], outputs[1])
    assert states[0] == states[1] and len(states[0]) >= 10
    if not do_sample:
        assert torch.equal(outputs[0], target.generate(ids, max_new_tokens=40, do_sample=False))


def batch_greedy_runs(seed: int, ids_seed: int, new_tokens: int, config: SSDConfig):
    """SSD's metrics on a left-padded batch of 3 rows (pads 0, 4, 2), with the target as its own draft and with an
    unrelated one, each output checked against plain batched greedy decoding."""
    target, draft = tiny_pair("llama", seed=seed)
    ids = torch.randint(1, 96, (3, 9), generator=torch.Generator().manual_seed(ids_seed))
    mask = torch.ones_like(ids)
    mask[1, :4] = mask[2, :2] = 0
    ids = ids * mask
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    for assistant in (target, draft):
        out = target.generate(ids, attention_mask=mask, assistant_model=assistant, max_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0, ssd_config=config)
        assert torch.equal(out, expected)
        yield target.ssd_metrics


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_batch_greedy_identical_through_serial_rounds(serial_scripted, executor):
    """A left-padded batch whose rows accept different numbers of tokens in serial rounds and finish at different
    times."""
    for metrics in batch_greedy_runs(71, 9, 23, SSDConfig(lookahead=3, executor=executor)):
        assert metrics.rounds_by_source.get("serial", 0) >= 4


def test_serial_rounds_run_on_every_core(serial_scripted):
    """A serial round's verification runs on every core, the draft's just-in-time drafting after it on every core or
    on its own threads, whichever `ThreadChoice` measures faster (both are tried first); a concurrent round leaves
    each side its own threads."""
    target, draft = tiny_pair("llama", seed=62)
    ids = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(5))
    target_threads, draft_threads = [], []
    hooks = [target.register_forward_pre_hook(lambda module, args: target_threads.append(torch.get_num_threads())),
             draft.register_forward_pre_hook(lambda module, args: draft_threads.append(
                 (threading.current_thread().name, torch.get_num_threads())))]
    try:
        target.generate(ids, assistant_model=draft, max_new_tokens=25, do_sample=False,
                        ssd_config=SSDConfig(lookahead=3, executor="thread", draft_threads=1, target_threads=1))
    finally:
        for hook in hooks:
            hook.remove()
    decisions = target.ssd_metrics.lookahead_decisions
    every = [r == 0 or d["depth"] == 0 or (d["k"] == 0 and d["depth"] <= 1) for r, d in enumerate(decisions)]
    assert target_threads == [2 if e else 1 for e in every] and any(d["k"] > 0 and d["depth"] == 0 for d in decisions)
    assert {n for _, n in draft_threads} == {1, 2}  # concurrent work on its own thread, serial drafting tries both


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_plain_steps_run_on_every_core(scripted, executor):
    """A plain step while the draft is paused or only probes one token (depth <= 1) runs the target on the draft's
    threads too, as plain decoding would; a speculating round leaves the draft its own."""
    target, draft = tiny_pair("llama", seed=61)
    ids = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(5))
    threads = []
    hook = target.register_forward_pre_hook(lambda module, args: threads.append(torch.get_num_threads()))
    try:
        out = target.generate(ids, assistant_model=draft, max_new_tokens=25, do_sample=False,
                              ssd_config=SSDConfig(lookahead=3, executor=executor, draft_threads=1, target_threads=1))
    finally:
        hook.remove()
    assert torch.equal(out, target.generate(ids, max_new_tokens=25, do_sample=False))
    decisions = target.ssd_metrics.lookahead_decisions
    assert len(threads) == len(decisions)  # one target forward per round, the first with the prefill
    every = [r == 0 or (d["k"] == 0 and d["depth"] <= 1) for r, d in enumerate(decisions)]
    assert threads == [2 if e else 1 for e in every] and 1 in threads and sum(every) >= 3


def test_batch_greedy_identical_while_k_changes(scripted):
    for metrics in batch_greedy_runs(70, 6, 21, SSDConfig(lookahead=3)):
        assert 0 in metrics.lookahead_per_round


@pytest.fixture(scope="module")
def law_models():
    """The sampling-law pair of test_sampling_law: a peaked 1-layer target and an unrelated draft."""
    target = enable_ssd(tiny_model(layers=1, vocab_size=E2E_VOCAB, hidden=16, seed=0, initializer_range=0.3))
    draft = tiny_model(layers=1, vocab_size=E2E_VOCAB, hidden=16, seed=7, initializer_range=0.3)
    return {"target": target, "self": target, "random": draft}


@pytest.mark.parametrize("draft, c, backup, executor, sampling", [
    pytest.param("self", 0.3, "draft", "sync", TEMPERATURE, id="self-C0.3-draft-sync"),
    pytest.param("random", 1.0, "ngram", "thread", WARPED, id="rand-C1-ngram-thread-warped"),
    pytest.param("self", 1.0, "random", "stream", TEMPERATURE, id="self-C1-random-stream"),
])
def test_sampling_law_while_k_changes(law_scripted, law_models, draft, c, backup, executor, sampling):
    """4 new tokens per sample: the scripted rounds verify 2, 0, 1, 3 tokens (as far as the sample goes), so
    samples mix partly verified speculations, plain steps, returns to speculation and whole ones."""
    target = law_models["target"]
    config = SSDConfig(lookahead=3, fanout_budget=4, saguaro_c=c, backup=backup, executor=executor)
    counts, hits, misses = ssd_samples(target, law_models[draft], config, sampling, seed=99)
    pvalues = law_pvalues(exact_law(target, sampling), counts)
    print(f"p-values {pvalues}, hits {hits}, misses {misses}")
    assert min(pvalues.values()) >= ALPHA, pvalues


@pytest.mark.parametrize("executor", ["sync", "process"])
def test_sampling_law_through_serial_rounds(monkeypatch, law_models, executor):
    """4 new tokens per sample through serial rounds (see LAW_SERIAL_SCRIPT): Saguaro-rescaled q (C = 0.3) drafted
    just in time is what verification uses."""
    _script(monkeypatch, LAW_SERIAL_SCRIPT)
    target = law_models["target"]
    config = SSDConfig(lookahead=3, fanout_budget=4, saguaro_c=0.3, backup="draft", executor=executor)
    counts, hits, misses = ssd_samples(target, law_models["random"], config, TEMPERATURE, seed=98)
    pvalues = law_pvalues(exact_law(target, TEMPERATURE), counts)
    print(f"p-values {pvalues}, hits {hits}, misses {misses}")
    assert min(pvalues.values()) >= ALPHA, pvalues


def shift_just_in_time_q(monkeypatch, when):
    """Tokens drafted just in time are handed over with q shifted by one position whenever `when(phase, asked,
    drafted)` holds."""
    from hf_ssd.generation.candidate_generator import SaguaroCandidateGenerator

    original = SaguaroCandidateGenerator._draft_just_in_time

    def shifted(self, missed, length, phase, first=None, stop=None):
        tokens, probs, tops, confidence = original(self, missed, length, phase, first, stop)
        if probs is not None and when(phase, length, tokens.shape[1]):
            probs = torch.cat([probs[:, 1:], probs[:, :1]], dim=1)
        return tokens, probs, tops, confidence

    monkeypatch.setattr(SaguaroCandidateGenerator, "_draft_just_in_time", shifted)


def test_negative_control_serial_q_shifted(monkeypatch, law_models):
    """Power check: serial speculations handed over with q shifted by one position (Saguaro-rescaled, C = 0.3, so
    the positions' q differ) are rejected by the harness."""

    _script(monkeypatch, [(0, 0, 3), (3, 0, 3)])  # the 2nd to 4th tokens come from serial speculations
    shift_just_in_time_q(monkeypatch, lambda phase, length, drafted: phase == "serial")
    target = law_models["target"]
    config = SSDConfig(lookahead=3, fanout_budget=4, saguaro_c=0.3, backup="draft", executor="sync")
    counts, _, _ = ssd_samples(target, law_models["self"], config, TEMPERATURE, seed=98, samples=SAMPLES)
    pvalues = law_pvalues(exact_law(target, TEMPERATURE), counts)
    print(f"negative control p-values {pvalues}")
    assert min(pvalues.values()) < REJECT, pvalues


def test_negative_control_q_shifted_when_k_is_partial(law_models, monkeypatch):
    """Power check: verifying partly verified speculations (2 of 3 tokens, then 3, 2, 2) against q shifted by one
    position (an off-by-one in slicing q to K) is rejected by the same harness."""
    from hf_ssd.generation import target_rows

    _script(monkeypatch, [(2, 3), (3, 3), (2, 3), (2, 3)])
    original = target_rows.accept

    def shifted(tokens, scores, q, generator):
        if q is not None and q.shape[1] >= 1:
            q = torch.cat([q[:, 1:], q[:, :1]], dim=1)
        return original(tokens, scores, q, generator)

    monkeypatch.setattr(target_rows, "accept", shifted)
    target = law_models["target"]
    config = SSDConfig(lookahead=3, fanout_budget=4, saguaro_c=0.3, backup="random", executor="sync")
    counts, _, _ = ssd_samples(target, law_models["self"], config, TEMPERATURE, seed=99, samples=SAMPLES)
    pvalues = law_pvalues(exact_law(target, TEMPERATURE), counts)
    print(f"negative control p-values {pvalues}")
    assert min(pvalues.values()) < REJECT, pvalues


def test_a_cost_not_measured_for_long_is_timed_again(clock):
    """A weak draft (10 % acceptance) beside a packed target (verifying a few positions costs about a plain step):
    the plain step timed early came out slow (420 ms, a loaded moment), so serial rounds verifying one token
    looked better and the plain step was no longer chosen, hence never measured again. A close competitor not
    timed for `RETIME_AFTER` rounds is timed again: its decayed mean moves toward the real 300 ms with each retiming
    and plain steps win from then on."""
    policy = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.05, concurrent=True, cost_shape=FLAT_SHAPE,
                             serial=True)
    common = dict(concurrent_ms=lambda k: 560.0, serial_ms=lambda k: 375.0, draft_ms=450.0, jit_ms=9.0, clock=clock,
                  acceptance=0.10)
    early = _drive_modes(policy, 8, plain_ms=420.0, **common)
    assert any(k == 0 for k, _ in early)  # the plain step was timed (slow)
    later = _drive_modes(policy, 4 * (lookahead_module.RETIME_AFTER + 2), plain_ms=300.0, **common)
    speculating = next(i for i, (k, mode) in enumerate(later) if mode == "serial")
    retimed = next(i for i, (k, _) in enumerate(later) if k == 0 and i > speculating)
    assert retimed - speculating <= lookahead_module.RETIME_AFTER + 2
    assert policy.verify[0].value < 0.35 and all(k == 0 for k, _ in later[-8:])


def test_a_verification_never_costs_less_than_a_plain_step(clock):
    """A useless draft beside a packed target: a 2-position serial verification timed 362 ms against a 385 ms plain
    step (noise: it covers the plain step's position and more, on the same cores), so serial rounds verifying one
    never-accepted token looked faster than plain steps and ran for 20 rounds. Every K >= 1 is floored at the plain
    step's time: plain steps win at once and stay."""
    policy = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.05, concurrent=True, cost_shape=FLAT_SHAPE,
                             serial=True)
    rounds = _drive_modes(policy, 24, concurrent_ms=lambda k: 590.0, serial_ms=lambda k: 362.0, plain_ms=385.0,
                          draft_ms=450.0, jit_ms=12.0, clock=clock, acceptance=0.0)
    assert policy.serial_times()[1] == pytest.approx(policy.times()[0])
    assert all(k == 0 for k, _ in rounds[-16:])


def test_in_a_batch_the_prior_curve_turns_compute_bound(clock):
    """A batch's verification covers rows * (K + 1) positions: past the knee (16 positions for packed CPU kernels,
    256 on a GPU) its cost grows in proportion to positions, so a plain step over the batch's rows is guessed that
    much cheaper than a measured K = 4 verification; one row keeps the flat curve."""
    policy = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.7, concurrent=True, cost_shape=FLAT_SHAPE)
    _measured(policy, {4: 0.69})
    assert policy.verify_seconds(0) == pytest.approx(0.69 / (1.02 + 0.02 * 3))
    batch = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.7, concurrent=True, cost_shape=FLAT_SHAPE)
    batch._active_rows = 8  # 40 positions against 8: (40 / 16) / (1.02 + 0.02 * 6)
    _measured(batch, {4: 0.69})
    assert batch.shape(4) == pytest.approx(2.5 / 1.14)
    assert batch.verify_seconds(0) == pytest.approx(0.69 * 1.14 / 2.5)
    gpu = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.7, concurrent=True, cost_shape=GPU_SHAPE)
    gpu._active_rows = 8
    assert gpu.shape(4) == pytest.approx((1.02 + 0.02 * 38) / (1.02 + 0.02 * 6))


def test_costs_follow_the_active_rows(clock):
    """A batch's rows leave as they finish and a forward's cost moves with the rows it covers: the costs measured at
    8 rows serve 2 rows rescaled by the prior curve over rows x (K + 1) positions (here compute-bound past 16), and
    once 2 rows measure a K themselves the rest follow that ratio; the 8-row table stays for when 8 rows return."""
    policy = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.7, concurrent=True, cost_shape=FLAT_SHAPE)
    policy._active_rows = 8
    _measured(policy, {2: 0.90, 4: 1.60})
    policy._active_rows = 2
    assert policy.verify == {}
    cost = policy.positions_cost
    assert cost(40) == pytest.approx(2.5) and cost(10) == pytest.approx(1.18)
    assert policy.verify_seconds(4) == pytest.approx(1.60 * cost(10) / cost(40))
    assert policy.verify_seconds(2) == pytest.approx(0.90 * cost(6) / cost(24))
    _measured(policy, {4: 0.50})  # 2 rows verifying 5 positions each measured cheaper than rescaled: K = 2 follows
    ratio = 0.50 / (1.60 * cost(10) / cost(40))
    assert policy.verify_seconds(4) == pytest.approx(0.50)
    assert policy.verify_seconds(2) == pytest.approx(0.90 * cost(6) / cost(24) * ratio)
    policy._active_rows = 8
    assert policy.verify_seconds(4) == pytest.approx(1.60)


def test_a_plain_step_is_guessed_from_a_serial_verification(clock):
    """A plain step runs on every core with the draft idle, as a serial verification does, not as a verification
    beside the working draft: its guess is the most optimistic of both (measured: 8 rows' plain step 366 ms, guessed
    686 ms from the concurrent curve, 422 ms from the serial one)."""
    policy = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.7, concurrent=True, cost_shape=FLAT_SHAPE,
                             serial=True)
    policy._active_rows = 8
    _measured(policy, {1: 0.98})
    concurrent_guess = policy.verify_seconds(0)
    assert concurrent_guess == pytest.approx(0.98 / policy.shape(1))
    policy.serial_verify[1] = DecayedMean(0.5)
    policy.serial_verify[1].add(0.48)
    assert policy.verify_seconds(0) == pytest.approx(0.48 / policy.shape(1))


def test_a_step_on_every_core_is_guessed_with_the_cores_it_gains(clock):
    """Until a plain step or a serial verification is timed, a step on every core is guessed from the verifications
    beside the working draft, which ran on the target's share of the cores: at best it speeds up with them
    (`every_core`). Taken as they were, 2 rows on 2 cores guessed a serial K = 2 at 800 ms (measured: 511) and never
    tried it; SSD made 0.81x plain decoding there."""
    def policy_at(every_core: float):
        policy = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.9, concurrent=True, cost_shape=FLAT_SHAPE,
                                 serial=True, every_core=every_core)
        _measured(policy, {1: 0.894, 2: 0.926, 4: 1.50})
        return policy

    shared, alone = policy_at(2.0), policy_at(1.0)
    assert shared.verify_seconds(0) == pytest.approx(alone.verify_seconds(0) / 2)
    table = shared.times()
    assert shared.serial_verify_seconds(2, table, {}) == pytest.approx(
        alone.serial_verify_seconds(2, alone.times(), {}) / 2)
    assert shared.verify_seconds(2) == pytest.approx(0.926)  # a verification beside the draft: as measured
    shared.serial_verify[1] = DecayedMean(0.5)  # once a step on every core is timed, it speaks for itself
    shared.serial_verify[1].add(0.34)
    assert shared.verify_seconds(0) == pytest.approx(min(0.34 * shared.shape(0) / shared.shape(1),
                                                         0.894 / 2 * shared.shape(0) / shared.shape(1)))


def test_a_step_on_every_core_gains_what_was_measured(clock):
    """Where the target's verification has been timed both beside the working draft and on every core (a concurrent
    and a serial round at the same K and rows), the gain the second core brings is the measured ratio, not the bound
    (`every_core`): on a 2-core EPYC with MKL's kernels a concurrent K = 4 took 733 ms and a serial one 692, and the
    bound (2x) guessed a 2-row plain step at 327 ms that took 684. The ratio carries to other rows and to later calls
    (`LookaheadMemory`), and stays within [1, `every_core`]."""
    from hf_ssd.generation.estimates import REMEMBER_AFTER, LookaheadMemory, memory_key

    memory = LookaheadMemory()
    policy = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.9, concurrent=True, cost_shape=CPU_SHAPE,
                             serial=True, every_core=2.0, memory=memory)
    _measured(policy, {4: 0.733})
    assert policy.core_gain() == 2.0  # the bound, until both ways are timed
    assert policy.verify_seconds(0) == pytest.approx(0.733 / 2 * policy.shape(0) / policy.shape(4))
    policy.serial_verify[4] = DecayedMean(0.5)
    policy.serial_verify[4].add(0.692)
    assert policy.core_gain() == pytest.approx(0.733 / 0.692)
    assert policy.verify_seconds(0) == pytest.approx(0.692 * policy.shape(0) / policy.shape(4))
    policy._active_rows = 2  # two rows, only a concurrent K = 3 timed there: guessed at the gain measured at one
    _measured(policy, {3: 0.850})
    assert policy.core_gain() == pytest.approx(0.733 / 0.692)
    assert policy.verify_seconds(0) > 0.850 / 2 * policy.shape(0) / policy.shape(3)
    for key, seconds in ((memory_key((), 1), 0.733), (memory_key((), 1, serial=True), 0.692)):
        for _ in range(REMEMBER_AFTER):
            memory.record(key, 4, seconds)
    later = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.9, concurrent=True, cost_shape=CPU_SHAPE,
                            serial=True, every_core=2.0, memory=memory)
    assert later.core_gain() == pytest.approx(0.733 / 0.692)  # an earlier call's timings, before its own
    slower = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.9, concurrent=True, cost_shape=CPU_SHAPE,
                             serial=True, every_core=2.0)
    _measured(slower, {2: 0.5})
    slower.serial_verify[2] = DecayedMean(0.5)
    slower.serial_verify[2].add(0.6)  # every core slower than beside the draft (noise): no gain, not a loss
    assert slower.core_gain() == 1.0
    slower.serial_verify[2].add(0.1)
    slower.serial_verify[2].add(0.1)
    assert slower.core_gain() == 2.0  # more than the cores: the bound


def test_an_unmeasured_concurrent_verification_costs_the_serial_one_times_the_gain_measured(clock):
    """A verification beside the working draft runs the target on its share of the cores: where the gain of every
    core has been measured (a concurrent and a serial K = 2 on a 2-core Xeon, 487 against 261 ms), an unmeasured
    concurrent K = 4 costs at least the serial K = 4 (468 ms) times that gain, not the concurrent K = 2's 487 ms (it
    took 910 for three tokens). Before any K is timed both ways the floor is the serial time itself (optimistic:
    the first concurrent round is how the gain gets measured); a measured concurrent K stands as measured."""
    policy = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.9, concurrent=True, cost_shape=CPU_SHAPE,
                             serial=True, every_core=2.0)
    for k, seconds in ((2, 0.261), (4, 0.468)):
        policy.serial_verify[k] = DecayedMean(0.5)
        policy.serial_verify[k].add(seconds)
    _measured(policy, {0: 0.222})
    unknown = policy.round_seconds(4, policy.times(), policy.serial_times())
    assert policy.measured_core_gain() is None
    assert 0.468 <= unknown < 0.468 * 2.0  # the serial time, not the bound: the gain is not measured yet
    _measured(policy, {0: 0.222, 2: 0.487})
    gain = policy.measured_core_gain()
    assert gain == pytest.approx(0.487 / 0.261)
    table, serial = policy.times(), policy.serial_times()
    assert policy.verify_seconds(4, table) == pytest.approx(0.487)  # the guess along the concurrent curve alone
    assert policy.round_seconds(4, table, serial) >= 0.468 * gain  # floored by the serial one times the gain
    assert policy.round_seconds(2, table, serial) < 0.487 * 1.1  # a measured K: as measured
    _measured(policy, {0: 0.222, 2: 0.487, 4: 0.700})
    assert policy.round_seconds(4, policy.times(), policy.serial_times()) < 0.468 * gain  # measured: it stands


def test_a_serial_verification_is_never_guessed_below_a_plain_step():
    """A serial round verifies its draft tokens on every core, as a plain step makes one: from a serial K = 4 timed
    at 475 ms, K = 1 guessed in proportion to positions came to 190 ms beside a 242 ms plain step, and a useless
    draft's first call tried it. The guess is floored at the plain step's time; measured ones stand as measured."""
    policy = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.7, concurrent=True, cost_shape=CPU_SHAPE,
                             serial=True)
    _measured(policy, {0: 0.2425})
    policy.serial_verify[4] = DecayedMean(0.5)
    policy.serial_verify[4].add(0.475)
    table, serial = policy.times(), policy.serial_times()
    assert 0.475 * 2 / 5 < 0.2425
    assert policy.serial_verify_seconds(1, table, serial) == pytest.approx(0.2425)
    assert policy.serial_verify_seconds(4, table, serial) == pytest.approx(0.475)


def test_before_any_verification_of_several_positions_a_serial_one_rises_by_the_prior_shape():
    """With only a plain step timed (a useless draft's first call, the first round's K = 4 holding the prefill), a
    serial verification is guessed along the prior shape's rise from K = 1, which costs a plain step's time (so that
    the cheapest serial round is the one tried: 266 ms against a 242 ms plain step with MKL's kernels), not flat:
    priced flat, every serial K looked as cheap as a plain step and the deepest was tried (K = 4: 475 ms for one
    token). Nor from the plain step by the prior's jump: that priced serial K = 1 at twice a plain step, where it
    costs 1.1x on an AMX Xeon, and kept a summarization prompt on plain steps that assisted generation's K = 2 made
    8 % faster."""
    policy = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.7, concurrent=True, cost_shape=CPU_SHAPE,
                             serial=True)
    _measured(policy, {0: 0.2425})
    table = policy.times()
    assert policy.serial_verify_seconds(1, table, {}) == pytest.approx(0.2425)
    assert policy.serial_verify_seconds(4, table, {}) == pytest.approx(0.2425 * policy.shape(4) / policy.shape(1))
    assert policy.serial_verify_seconds(4, table, {}) > policy.serial_verify_seconds(2, table, {}) > 0.2425
    policy._rounds = 1  # past the first round (which holds the prefill)
    policy.acceptance.reached = [1.0] * len(policy.acceptance.reached)
    policy.acceptance.pooled_reached = 4.0
    policy.serial_fixed.add(0.01)  # a useless draft: a tiny model, its just-in-time drafting nearly free
    policy.serial_token.add(0.005)
    k = policy.choose(4)
    assert k <= 1 and policy._wanted <= 1  # at most the cheapest serial round is tried, never K = 4


def test_a_serial_rounds_drafting_is_priced_as_earlier_calls_measured_it():
    """Until this call times a further just-in-time token, a serial round's drafting is priced at the step earlier
    calls with this draft measured (`remembered_step`), the price the stop rule reads too, not at nothing."""
    policy = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.7, concurrent=True, cost_shape=FLAT_SHAPE,
                             serial=True)
    _measured(policy, {0: 0.25})
    table = policy.times()
    unpriced = policy.serial_round_seconds(4, table, {})
    policy.remembered_step = 0.03
    assert policy.serial_round_seconds(4, table, {}) == pytest.approx(unpriced + 4 * 0.03)


def test_a_verification_beside_the_draft_costs_at_least_its_serial_timing(clock):
    """An unmeasured verification beside the working draft is priced no cheaper than the same one timed on every
    core with the draft idle, and, its cost then a bound rather than a guess, is tried only where it might be best. A
    useless draft's first call on 2 cores otherwise tried K = 1 beside the draft after its serial K = 1 (298 ms, the
    plain step 275): one target thread took 527 ms."""
    def policy_at(acceptance: float):
        policy = LookaheadPolicy(4, adaptive=True, acceptance_prior=acceptance, concurrent=True,
                                 cost_shape=FLAT_SHAPE, serial=True)
        _measured(policy, {0: 0.275})
        policy.serial_verify[1] = DecayedMean(0.5)
        policy.serial_verify[1].add(0.298)
        policy.serial_verify[4] = DecayedMean(0.5)
        policy.serial_verify[4].add(0.305)
        policy.serial_token.add(0.04)
        policy.serial_fixed.add(0.05)
        policy._rounds = 3
        policy.acceptance.reached = [10.0] * 5
        policy.acceptance.passed = [10.0 * acceptance] * 5
        return policy

    useless = policy_at(0.02)
    table, serial = useless.times(), useless.serial_times()
    assert useless.verify_seconds(1, table) < 0.298  # the guess alone: as cheap as the plain step
    assert useless.round_seconds(1, table, serial) >= 0.298
    assert useless.round_seconds(1, table) < 0.298  # (without the serial timings: the guess)
    assert useless.choose(4) == 0 and useless.trace[-1]["why"] == "best"
    # a good draft: the verification beside it might still be best (the draft's work hidden), so it is tried
    good = policy_at(0.9)
    assert good.choose(4) >= 1 and good.trace[-1]["why"] == "explore" and good.trace[-1]["mode"] == "concurrent"


def test_a_plain_step_in_a_batch_is_tried_when_it_might_win(clock):
    """In a batch the prior of a plain step is least reliable (there a plain step on every core gains from the
    second core what a verification beside the draft does not): an unmeasured one is tried once when its guess
    comes within half of the best; with one row, only within 10 %."""
    def policy_at(rows):
        policy = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.8, concurrent=True, cost_shape=FLAT_SHAPE)
        policy._active_rows = rows
        _measured(policy, {1: 0.60, 2: 0.62, 3: 0.66, 4: 0.69})
        policy._rounds = 3
        policy.acceptance.reached = [10.0] * 5
        policy.acceptance.passed = [8.0] * 5
        return policy

    batch = policy_at(8)
    assert batch.choose(4, rows=8) == 0 and batch.trace[-1]["why"] == "explore"
    assert 0.5 < batch.trace[-1]["tok_s"][0] / max(batch.trace[-1]["tok_s"].values()) < 0.9
    single = policy_at(1)
    assert single.choose(4, rows=1) != 0


def test_a_costly_probe_comes_more_rarely(clock):
    """A useless draft in a batch: plain steps win, and the paused draft's one-token probes are drafted just in
    time, for every row (8 rows on a 2-core EPYC: ~0.6 of a plain step each). They are spaced so that probing
    costs at most `PROBE_SHARE` of the plain steps' time; a cheap probe (one row of a small draft) keeps the base
    spacing."""
    def probes(jit_ms: float) -> list[int]:
        policy = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.05, concurrent=True, cost_shape=FLAT_SHAPE,
                                 serial=True)
        rounds = _drive_modes(policy, 120, concurrent_ms=lambda k: 900.0, serial_ms=lambda k: 400.0,
                              plain_ms=380.0, draft_ms=450.0, jit_ms=jit_ms, clock=clock, acceptance=0.0)
        assert all(k == 0 for k, _ in rounds[-40:])
        plain = next(i for i, entry in enumerate(policy.trace) if entry["k"] == 0 and entry["why"] == "best")
        return [i for i, entry in enumerate(policy.trace) if entry["k"] == 0 and entry.get("serial") == 1
                and i >= plain + probing.PAUSE_AFTER]  # past the first plain steps' one-token depths

    costly, cheap = probes(230.0), probes(20.0)
    spacing = math.ceil(230.0 / 380.0 / probing.PROBE_SHARE)
    assert spacing > probing.PROBE_EVERY and len(costly) >= 2
    assert all(b - a >= spacing for a, b in zip(costly, costly[1:]))
    assert cheap[1] - cheap[0] < spacing and len(cheap) > len(costly)


# --- plain stretches: plain steps in a row, the policy and the draft told afterwards ------------------------------


def _plain_policy(monkeypatch, probe_cost: float = 0.0):
    """The policy takes plain steps on every round after the first, whatever the timing (as with a useless draft),
    and trials when accepted probes ask for one; the draft's depth, pause, probes and the plain stretches between
    them are the real ones. Every call starts with a speculation; probes are `probe_cost` of a plain step apart."""
    def choose(self, limit):
        if self._rounds == 0:
            self._wanted, self._mode = self.k_max, lookahead_module.CONCURRENT
            self._record(limit, None, "first round")
            return limit
        if self.probing.take_trial() and limit > 0:
            self._wanted = self.k_max
            self._mode = lookahead_module.SERIAL if self.serial_option else lookahead_module.CONCURRENT
            self._record(limit, None, "trial")
            return limit
        self._wanted, self._mode = 0, lookahead_module.PLAIN
        self._record(0, None, "best")
        return 0

    monkeypatch.setattr(LookaheadPolicy, "_choose", choose)
    monkeypatch.setattr(LookaheadPolicy, "first_depth", lambda self, rows=1: self.k_max)
    monkeypatch.setattr(LookaheadPolicy, "_probe_cost", lambda self: probe_cost)


def _stretched(metrics) -> int:
    return sum(entry["why"] == plain_steps_module.PLAIN_STRETCH for entry in metrics.lookahead_decisions)


@pytest.mark.parametrize("prompt_lookup", ["never", "always"])
@pytest.mark.parametrize("executor", ["sync", "thread", "stream", "process"])
@pytest.mark.parametrize("arch", ["llama", "qwen2_hybrid"])
def test_greedy_identical_through_plain_stretches(monkeypatch, arch, executor, prompt_lookup):
    """Plain steps taken in a row between probes (the draft told at once afterwards), for a useless draft and for
    the target as its own draft (its probes are accepted: trials and resumed speculation follow): plain decoding's
    output, one trace entry per round, the stretches no longer than `STRETCH_MAX`. With prompt lookup the steps
    also verify the context's continuation (a tiny model's greedy text soon repeats itself): the draft is told of
    the accepted tokens as plain steps, and resumes from them."""
    _plain_policy(monkeypatch)
    for itself, m in scripted_runs(arch, executor, seed=90, new_tokens=70, prompt_lookup=prompt_lookup):
        assert len(m.lookahead_per_round) == m.batch_rounds and m.generated_tokens == 70
        whys = [entry["why"] for entry in m.lookahead_decisions]
        assert _stretched(m) >= (20 if prompt_lookup == "never" else 10), whys
        looked_up = [entry["lookup"] for entry in m.lookahead_decisions if "lookup" in entry]
        assert m.prompt_lookup_rounds == len(looked_up) and m.prompt_lookup_tokens == sum(looked_up)
        if prompt_lookup == "never":
            assert m.prompt_lookup_rounds == 0
        else:
            assert 0 < m.prompt_lookup_accepted <= m.prompt_lookup_tokens, m
            assert m.tokens_per_round_by_source["lookup"] > 1.0
        runs = [len(list(group)) for why, group in itertools.groupby(whys) if why == plain_steps_module.PLAIN_STRETCH]
        assert max(runs) <= plain_steps_module.STRETCH_MAX
        assert all(entry["depth"] == 0 and entry["k"] == 0 for entry in m.lookahead_decisions
                   if entry["why"] == plain_steps_module.PLAIN_STRETCH)
        if itself:
            assert "trial" in whys and m.draft_acceptance_rate == 1.0


@pytest.mark.parametrize("executor", ["sync", "process"])
def test_batch_greedy_identical_through_plain_stretches(monkeypatch, executor):
    """A left-padded batch through plain stretches, its rows stopping at an EOS token at different steps (a row
    that stops ends the stretch; the others go on without it)."""
    _plain_policy(monkeypatch)
    target, draft = tiny_pair("llama", seed=93)
    ids = torch.randint(1, 96, (3, 9), generator=torch.Generator().manual_seed(94))
    mask = torch.ones_like(ids)
    mask[1, :4] = mask[2, :2] = 0
    ids = ids * mask
    free = target.generate(ids, attention_mask=mask, max_new_tokens=60, do_sample=False, pad_token_id=0)
    eos = int(free[0, 9 + 30])  # row 0 stops at its 31st token at the latest; the others where it comes up
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=60, do_sample=False, pad_token_id=0,
                               eos_token_id=eos)
    lengths = (expected[:, 9:] == eos).int().argmax(dim=1)
    assert len(set(lengths.tolist())) > 1 or not bool((expected[:, 9:] == eos).any(dim=1).all())
    for assistant in (draft, target):
        out = target.generate(ids, attention_mask=mask, assistant_model=assistant, max_new_tokens=60,
                              do_sample=False, pad_token_id=0, eos_token_id=eos,
                              ssd_config=SSDConfig(lookahead=3, executor=executor))
        assert torch.equal(out, expected)
        assert _stretched(target.ssd_metrics) >= 10


@pytest.mark.parametrize("do_sample", [False, True])
def test_a_plain_stretch_leaves_the_draft_as_round_by_round(monkeypatch, do_sample):
    """A plain stretch (the draft told of its steps at once, `sat_out`) leaves the draft exactly as the same plain
    steps taken round by round do: its state after every paused round, the decisions of every round, and every
    token under one seed (sampled ones too) are the same, with the target as its own draft resuming (probes, trials,
    cache hits) between stretches."""
    _plain_policy(monkeypatch)
    STRETCH_MAX = plain_steps_module.STRETCH_MAX  # noqa: N806
    target, _ = tiny_pair("llama", seed=95)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(96))
    states = _record_paused_states(monkeypatch)
    outputs, decisions = [], []
    for stretch in (plain_steps_module.STRETCH_MAX, 0):
        monkeypatch.setattr(plain_steps_module, "STRETCH_MAX", stretch)
        outputs.append(_self_drafted_run(target, ids, states, 97, 80, do_sample))
        m = target.ssd_metrics
        assert (_stretched(m) >= 30) == bool(stretch) and m.cache_hits > 0
        decisions.append([(entry["k"], entry["depth"]) for entry in m.lookahead_decisions])
    assert torch.equal(outputs[0], outputs[1])
    assert decisions[0] == decisions[1]
    # (the last stretch is not told to the draft: every row was done)
    assert states[0] == states[1][:len(states[0])] and 40 <= len(states[0]) >= len(states[1]) - STRETCH_MAX
    if not do_sample:
        assert torch.equal(outputs[0], target.generate(ids, max_new_tokens=80, do_sample=False))


@pytest.mark.parametrize("executor", ["sync", "process"])
def test_sampling_law_through_plain_stretches(monkeypatch, law_models, executor):
    """4 new tokens per sample, the draft paused from the second round (no one-token depths first): the first round
    verifies a speculation, the second is a plain step, the tokens after it come from a plain stretch."""
    _plain_policy(monkeypatch)
    monkeypatch.setattr(probing, "PAUSE_AFTER", 0)
    target = law_models["target"]
    config = SSDConfig(lookahead=3, fanout_budget=4, backup="draft", executor=executor)
    counts, hits, misses = ssd_samples(target, law_models["random"], config, TEMPERATURE, seed=91)
    assert _stretched(target.ssd_metrics) >= 1 or target.ssd_metrics.lookahead_per_round[0] == 3
    pvalues = law_pvalues(exact_law(target, TEMPERATURE), counts)
    print(f"p-values {pvalues}, hits {hits}, misses {misses}")
    assert min(pvalues.values()) >= ALPHA, pvalues


def test_negative_control_a_greedy_plain_step(monkeypatch, law_models):
    """Power check: plain steps that take the target's argmax instead of drawing from its law are rejected."""
    _plain_policy(monkeypatch)
    monkeypatch.setattr(probing, "PAUSE_AFTER", 0)
    from hf_ssd.generation import target_rows

    original = target_rows.accept

    def greedy_plain(tokens, scores, q=None, generator=None):
        return original(tokens, scores, None if tokens.shape[1] == 0 else q, generator)

    monkeypatch.setattr(target_rows, "accept", greedy_plain)
    target = law_models["target"]
    config = SSDConfig(lookahead=3, fanout_budget=4, backup="draft", executor="sync")
    counts, _, _ = ssd_samples(target, law_models["random"], config, TEMPERATURE, seed=92, samples=300)
    assert min(law_pvalues(exact_law(target, TEMPERATURE), counts).values()) < REJECT


# --- prompt lookup: plain steps of a stretch verify the context's own continuation --------------------------------


@pytest.mark.parametrize("arch", ["qwen2", "mistral_sliding", "gpt2", "gemma2", "mixtral", "phi3"])
def test_greedy_identical_through_prompt_lookup(monkeypatch, arch):
    """Plain stretches verifying the context's continuation on every step that finds one (`"always"`), across the
    architectures (sliding windows, absolute positions, soft-capping, experts): plain decoding's output; the
    proposals are accepted and rejected both (a repeated prompt, then the model's own text)."""
    _plain_policy(monkeypatch)
    if arch in ARCHS:
        target, draft = tiny_pair(arch, seed=71)
        vocab = 96
    else:
        torch.manual_seed(71)
        target, vocab = enable_ssd(_other_arch(arch, 2).eval()), 128
        torch.manual_seed(72)
        draft = _other_arch(arch, 1).eval()
    half = torch.randint(0, vocab, (1, 9), generator=torch.Generator().manual_seed(73))
    ids = torch.cat([half, half[:, :5]], dim=1)  # its last tokens occurred before: the first steps find proposals
    expected = target.generate(ids, max_new_tokens=60, do_sample=False)
    for assistant in (draft, target):
        out = target.generate(ids, assistant_model=assistant, max_new_tokens=60, do_sample=False,
                              ssd_config=SSDConfig(lookahead=3, executor="sync", prompt_lookup="always"))
        assert torch.equal(out, expected), (arch, assistant is target)
    m = target.ssd_metrics  # the target as its own draft: its probes are accepted, its speculations too
    assert m.prompt_lookup_rounds > 0 and m.draft_acceptance_rate == 1.0


def test_prompt_lookup_only_for_one_row(monkeypatch):
    """A batch's plain steps verify no proposal (its rows would propose different lengths); one row's do, and a
    prompt_lookup of "never" takes none."""
    _plain_policy(monkeypatch)
    target, draft = tiny_pair("llama", seed=74)
    half = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(75))
    ids = torch.cat([half, half], dim=1)
    for rows, mode in ((2, "always"), (1, "always"), (1, "never")):
        out = target.generate(ids[:rows], attention_mask=torch.ones_like(ids[:rows]), assistant_model=draft,
                              max_new_tokens=40, do_sample=False, pad_token_id=0,
                              ssd_config=SSDConfig(lookahead=3, executor="sync", prompt_lookup=mode))
        assert torch.equal(out, target.generate(ids[:rows], attention_mask=torch.ones_like(ids[:rows]),
                                                max_new_tokens=40, do_sample=False, pad_token_id=0))
        m = target.ssd_metrics
        stretched = [entry for entry in m.lookahead_decisions if entry["why"] == plain_steps_module.PLAIN_STRETCH]
        assert sum(entry["rows"] == rows for entry in stretched) >= 10
        assert all(entry["rows"] == 1 for entry in stretched if "lookup" in entry)  # (a batch down to one row may)
        assert m.prompt_lookup_rounds == sum("lookup" in entry for entry in stretched)
        if rows == 1:
            assert (m.prompt_lookup_rounds > 0) == (mode == "always"), mode


@pytest.mark.parametrize("executor, sampling", [
    pytest.param("sync", TEMPERATURE, id="sync"),
    pytest.param("process", WARPED, id="process-warped"),
])
def test_sampling_law_through_prompt_lookup(monkeypatch, law_models, executor, sampling):
    """4 new tokens per sample after the repeating prompt: the first round verifies a speculation, the later ones
    are plain steps of a stretch verifying the context's continuation (q one-hot: accepted with probability p(x),
    else the token drawn from p without x). Proposals are accepted and rejected both."""
    _plain_policy(monkeypatch)
    monkeypatch.setattr(probing, "PAUSE_AFTER", 0)
    outcomes = []
    original = prompt_lookup_module.PromptLookup.observe

    def counted(self, verified, accepted):
        outcomes.append((verified, accepted))
        return original(self, verified, accepted)

    monkeypatch.setattr(prompt_lookup_module.PromptLookup, "observe", counted)
    target = law_models["target"]
    config = SSDConfig(lookahead=3, fanout_budget=4, backup="draft", executor=executor, prompt_lookup="always")
    counts, _, _ = ssd_samples(target, law_models["random"], config, sampling, seed=93)
    pvalues = law_pvalues(exact_law(target, sampling), counts)
    accepted = sum(a for _, a in outcomes)
    print(f"p-values {pvalues}, lookup rounds {len(outcomes)}, tokens {sum(v for v, _ in outcomes)}, accepted "
          f"{accepted}")
    assert len(outcomes) > 150 and 0 < accepted < sum(v for v, _ in outcomes)
    assert min(pvalues.values()) >= ALPHA, pvalues


def test_negative_control_prompt_lookup_weighed_as_a_draft_guess(monkeypatch, law_models):
    """Power check: proposal tokens verified as if drawn uniformly (q = 1/V: accepted with probability V p(x) instead
    of p(x)) are rejected."""
    _plain_policy(monkeypatch)
    monkeypatch.setattr(probing, "PAUSE_AFTER", 0)
    original = prompt_lookup_module.PromptLookup.speculation

    def uniform(self, tokens, device):
        speculation = original(self, tokens, device)
        return dataclasses.replace(speculation, probs=torch.full_like(speculation.probs, 1.0 / self.vocab_size))

    monkeypatch.setattr(prompt_lookup_module.PromptLookup, "speculation", uniform)
    target = law_models["target"]
    config = SSDConfig(lookahead=3, fanout_budget=4, backup="draft", executor="sync", prompt_lookup="always")
    counts, _, _ = ssd_samples(target, law_models["random"], config, TEMPERATURE, seed=94, samples=400)
    assert min(law_pvalues(exact_law(target, TEMPERATURE), counts).values()) < REJECT


def test_a_call_after_a_useless_draft_starts_with_plain_steps(clock):
    """Once earlier calls found a draft useless (its remembered acceptance and this target's remembered costs), the
    next call drafts nothing first (`first_depth` 0) and its first round is a plain step with the draft paused; a
    draft that was accepted, or one never seen, starts with a full speculation."""
    memory = estimates_module.LookaheadMemory()

    def policy(key):
        return LookaheadPolicy(4, adaptive=True, acceptance_prior=0.7, concurrent=True, memory=memory,
                               draft_key=key, setting=(True, 1))

    first = policy("useless")
    assert first.first_depth() == 4
    _drive(first, 40, accept_all=False, clock=clock, verify_ms=lambda k: 10.0 + 5.0 * k)
    assert first.trace[-1]["k"] == 0
    first.metrics()  # remembers the acceptance
    second = policy("useless")
    assert second.first_depth() == 0
    assert second.choose(0) == 0 and second.trace[-1]["why"] == "first round" and second.depth(0) == 0
    good = policy("good")
    _drive(good, 40, accept_all=True, clock=clock, verify_ms=lambda k: 10.0 + 5.0 * k)
    good.metrics()
    assert policy("good").first_depth() == 4 and policy("unseen").first_depth() == 4


def test_a_call_starts_plain_on_evidence_not_on_a_short_calls_luck(clock):
    """The remembered acceptance a call weighs starting plain at is raised by Hoeffding's width over the positions
    verified behind it in all earlier calls (`optimistic_start`): a short call that verified a few positions and
    rejected them (a bench's warm-up) leaves the next call starting with a speculation; the same acceptance behind
    many verified positions starts it plain. The positions add up over calls."""
    memory = estimates_module.LookaheadMemory()

    def policy():
        return LookaheadPolicy(4, adaptive=True, acceptance_prior=0.7, concurrent=True, memory=memory,
                               draft_key=7, setting=(True, 1))

    for k in range(5):  # this target's costs as earlier calls timed them: a plain step 10 ms, K tokens 10 + 5K
        memory.verify.setdefault((True, 1, 1), {})[k] = (10.0 + 5.0 * k) / 1e3
        memory.samples.setdefault((True, 1, 1), {})[k] = estimates_module.REMEMBER_AFTER

    short = policy()
    for _ in range(3):  # three one-token rejections: acceptance far below the prior, three positions behind it
        short.acceptance.add(0, 0.0)
    short.metrics()
    assert memory.acceptance[7] < 0.5 and memory.acceptance_reached[7] == 3
    assert plain_steps_module.optimistic_start([memory.acceptance[7]], 3)[0] > memory.acceptance[7] + 0.4
    assert policy().first_depth() == 4  # three samples say too little
    long = policy()
    for _ in range(60):
        long.acceptance.add(0, 0.0)
    long.metrics()
    assert memory.acceptance_reached[7] == 63
    assert policy().first_depth() == 0  # sixty more say it


def test_end_to_end_a_useless_draft_is_left_paused_from_the_start():
    """Real timings: after a few calls with a useless draft, a call starts with a plain step and the draft paused,
    and its output is still plain decoding's."""
    target, draft = tiny_pair("llama", seed=98)
    ids = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(99))
    expected = target.generate(ids, max_new_tokens=40, do_sample=False)
    firsts = []
    for _ in range(4):
        out = target.generate(ids, assistant_model=draft, max_new_tokens=40, do_sample=False,
                              ssd_config=SSDConfig(lookahead=3, executor="sync"))
        assert torch.equal(out, expected)
        decisions = target.ssd_metrics.lookahead_decisions
        firsts.append((decisions[0]["k"], decisions[0]["depth"]))
    assert firsts[0] == (3, 3) and firsts[-1] == (0, 0), firsts


def test_a_probes_cost_is_measured_whole_and_remembered():
    """A probe's cost is what rounds with the draft one token deep took beyond rounds with it paused (in plain
    steps); a later call with the same draft and setting spaces its probes by it from the start."""
    memory = estimates_module.LookaheadMemory()

    def policy():
        return LookaheadPolicy(4, adaptive=True, acceptance_prior=0.05, concurrent=True, memory=memory,
                               draft_key=7, setting=(True, 1))

    first = policy()
    assert first._probe_cost() == 0.0  # unknown
    for _ in range(3):
        first.plain_round.add(0.010)
        first.probe_round.add(0.040)
    assert first._probe_cost() == pytest.approx(3.0)
    first.metrics()
    second = policy()
    assert second._probe_cost() == pytest.approx(3.0)
    second.plain_round.add(0.010)
    second.probe_round.add(0.015)
    assert second._probe_cost() == pytest.approx(0.5)  # measured in this call: its own
    other = LookaheadPolicy(4, adaptive=True, acceptance_prior=0.05, concurrent=True, memory=memory, draft_key=8,
                            setting=(True, 1))
    assert other._probe_cost() == 0.0
