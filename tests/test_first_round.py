"""The first round, whose verification holds the target's prefill: where the prompt is long (compute-bound, and the
draft's own prefill took `PREFILL_ALONE_AFTER` or more) it is made on every core with the draft sitting it out, the
next speculation drafted just in time (a serial round); otherwise the draft prepares beside it. Covered here: the
decision and its negative controls, and losslessness of a serial first round (greedy across architectures and
executors, a left-padded batch, the sampling law with Saguaro C < 1 and its negative control)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_pair
from test_lookahead import ARCHS, _script, batch_greedy_runs, law_models, scripted_runs, shift_just_in_time_q  # noqa: F401  (law_models: a fixture)
from test_sampling_law import ALPHA, REJECT, TEMPERATURE, ssd_law_pvalues

from hf_ssd import SSDConfig
from hf_ssd.generation import estimates as estimates_module
from hf_ssd.generation import lookahead as lookahead_module
from hf_ssd.generation.confidence import ConfidenceCalibration
from hf_ssd.generation.costs import CPU_SHAPE, GPU_SHAPE
from hf_ssd.generation.lookahead import LookaheadPolicy
from hf_ssd.generation.modes import CONCURRENT, SERIAL


def _first_round(positions: int, began: float, **kwargs) -> tuple[str, int, int]:
    """(mode, depth, tokens drafted just in time) of the first round of a policy on 2 shared CPU cores."""
    options = {"concurrent": True, "cost_shape": CPU_SHAPE, "serial": True} | kwargs
    policy = LookaheadPolicy(4, True, 0.8, prefill_positions=positions, **options)
    policy.began(began)
    k = policy.choose(4)
    depth = policy.depth(k)
    assert k == 4 and policy.trace[0]["why"] == "first round"  # the speculation begin prepared is verified whole
    return policy._mode, depth, policy.serial


def test_a_long_prefill_is_verified_on_every_core():
    assert _first_round(52, 0.3) == (SERIAL, 0, 4)  # the draft sits it out, then drafts K_max just in time
    assert _first_round(2 * 9, 0.3) == (SERIAL, 0, 4)  # a batch of 2 rows of 9 tokens: 18 positions, past the knee


def test_a_first_serial_speculation_stops_where_earlier_calls_priced_its_tokens():
    """After a serial first round the next speculation is drafted under the stop rule, priced at the costs earlier
    calls with this draft timed (`LookaheadMemory`): unsure tokens stop it early, sure ones run past K_max. With
    nothing remembered there is no price: K_max tokens."""
    memory = estimates_module.LookaheadMemory()
    setting = ("thread", 1)
    for _ in range(2):
        memory.record((*setting, 1), 0, 0.20)
        for k in range(1, 17):
            memory.record((*setting, 1, "serial"), k, 0.21 + 0.01 * k)
    memory.serial_step[(7, setting)] = 0.03

    def first_speculation(sure: bool):
        policy = LookaheadPolicy(4, True, 0.8, concurrent=True, cost_shape=CPU_SHAPE, serial=True, confidence=True,
                                 memory=memory, setting=setting, draft_key=7, prefill_positions=52,
                                 serial_lookahead=16)
        policy.began(0.3)
        policy.depth(policy.choose(4))
        serial, stop = policy.just_in_time()
        assert policy._mode == SERIAL and serial == 16 and stop is not None
        confidence = torch.tensor([0.99 if sure else 0.05])
        tokens, reach = 1, torch.ones(1)
        while tokens < serial:
            going, reach = stop.keeps_going(reach, confidence, torch.ones(1, dtype=torch.bool), tokens)
            if not going:
                break
            tokens += 1
        return tokens

    for _ in range(40):  # the pair: sure tokens are taken, unsure ones are not
        for position in range(4):
            memory.calibration.setdefault(7, ConfidenceCalibration()).add(0.99, 1.0, position=position)
            memory.calibration[7].add(0.05, 0.0, position=position)
    assert first_speculation(sure=False) <= 2
    assert first_speculation(sure=True) > 4
    assert _first_round(52, 0.3) == (SERIAL, 0, 4)  # nothing remembered: K_max, no stop rule


@pytest.mark.parametrize("positions, began, options", [
    pytest.param(15, 0.3, {}, id="short-prompt"),  # below the knee: memory-bound, the cores gain little
    pytest.param(52, 0.05, {}, id="quick-prefill"),  # milliseconds: either way differs by less than the overhead
    pytest.param(52, 0.3, {"serial": False}, id="own-device"),  # the draft on its own device: never serial
    pytest.param(52, 0.3, {"concurrent": False}, id="sync-executor"),
    pytest.param(52, 0.3, {"cost_shape": GPU_SHAPE}, id="gpu-knee"),  # compute-bound from 256 positions only
    pytest.param(52, 0.3, {"adaptive": False}, id="constant-schedule"),
])
def test_otherwise_the_draft_prepares_beside_the_first_verification(positions, began, options):
    options = {"concurrent": True, "cost_shape": CPU_SHAPE, "serial": True} | options
    adaptive = options.pop("adaptive", True)
    policy = LookaheadPolicy(4, adaptive, 0.8, prefill_positions=positions, **options)
    policy.began(began)
    k = policy.choose(4)
    assert k == 4 and policy._mode != SERIAL and policy.depth(k) == 4 and policy.serial == 0
    if options["concurrent"]:
        assert policy._mode == CONCURRENT


@pytest.fixture
def prefill_alone(monkeypatch):
    """Every first round is serial where serial rounds are an option (the tiny models' prefills take milliseconds)."""
    monkeypatch.setattr(lookahead_module, "PREFILL_ALONE_AFTER", 0.0)


@pytest.mark.parametrize("executor", ["thread", "stream", "process"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identical_after_a_serial_first_round(prefill_alone, arch, executor):
    """The real policy, its first round serial: plain decoding's output, with the draft as itself (every token
    accepted) and unrelated."""
    for itself, m in scripted_runs(arch, executor, seed=120 + ARCHS.index(arch), new_tokens=29, prompt_length=21):
        first = m.lookahead_decisions[0]
        assert first["mode"] == SERIAL and first["depth"] == 0 and first["serial"] > 0, first
        if itself:
            assert m.draft_acceptance_rate == 1.0


def test_a_short_prompt_keeps_a_concurrent_first_round(prefill_alone):
    """Negative control of the fixture: below the knee the first round stays concurrent."""
    target, draft = tiny_pair("llama", seed=131)
    ids = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(7))
    target.generate(ids, assistant_model=draft, max_new_tokens=8, do_sample=False,
                    ssd_config=SSDConfig(lookahead=3, executor="thread"))
    assert target.ssd_metrics.lookahead_decisions[0]["mode"] == CONCURRENT


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_batch_greedy_identical_after_a_serial_first_round(prefill_alone, executor):
    """A left-padded batch (rows x prompt length past the knee) whose first round is serial."""
    for metrics in batch_greedy_runs(72, 9, 23, SSDConfig(lookahead=3, executor=executor)):
        assert metrics.lookahead_decisions[0]["mode"] == SERIAL


# 4 new tokens: a serial first round verifying the 3 tokens begin prepared, then 2 drafted just in time, a
# concurrent round, a plain step
LAW_FIRST_SERIAL_SCRIPT = [(3, 0, 2), (2, 3), (0, 0)]


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_sampling_law_after_a_serial_first_round(monkeypatch, law_models, executor):  # noqa: F811
    """Saguaro-rescaled q (C = 0.3) of begin's speculation, verified with the draft sitting the round out, and of
    the one drafted just in time after it: the target's law."""
    _script(monkeypatch, LAW_FIRST_SERIAL_SCRIPT)
    target = law_models["target"]
    config = SSDConfig(lookahead=3, fanout_budget=4, saguaro_c=0.3, backup="draft", executor=executor)
    pvalues = ssd_law_pvalues(target, law_models["random"], config, TEMPERATURE, seed=121)
    assert min(pvalues.values()) >= ALPHA, pvalues


def test_negative_control_first_serial_q_shifted(monkeypatch, law_models):  # noqa: F811
    """Power check: begin's speculation, verified whole in a serial first round, and the one drafted just in time
    after it handed over with q shifted by one position are rejected by the same harness."""
    _script(monkeypatch, [(3, 0, 3), (3, 0, 3)])
    shift_just_in_time_q(monkeypatch, lambda phase, length, drafted: phase in ("prefill", "serial"))
    target = law_models["target"]
    config = SSDConfig(lookahead=3, fanout_budget=4, saguaro_c=0.3, backup="draft", executor="thread")
    pvalues = ssd_law_pvalues(target, law_models["self"], config, TEMPERATURE, seed=122)
    assert min(pvalues.values()) < REJECT, pvalues
