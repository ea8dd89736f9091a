"""The target's layers probed before the first round: what more threads gain it, how its cost rises with positions."""

from __future__ import annotations

import time

import torch
from conftest import tiny_model

from hf_ssd.runtime import layer_probe
from hf_ssd.runtime.threads import torch_threads


def test_thread_gain_is_probed_once_per_model_on_one_middle_block(monkeypatch):
    """What more threads gain the target, known before the first round: measured on the linear layers of one middle
    block (the output embedding left out), once per model and thread counts; 1 where no more threads are given, None
    where the model has no linear layer or the probe fails."""
    model = tiny_model("llama", layers=4)
    layers = layer_probe._probe_layers(model)
    middle = model.model.layers[2]
    assert layers and all(any(layer is m for m in middle.modules()) for layer in layers)
    assert model.get_output_embeddings() not in layers
    calls = []
    real = layer_probe._probe_gain
    monkeypatch.setattr(layer_probe, "_probe_gain", lambda *a: calls.append(a) or real(*a))
    state = torch.random.get_rng_state()
    gain = layer_probe.thread_gain(model, 1, 2)
    assert gain is not None and gain > 0
    assert torch.equal(torch.random.get_rng_state(), state)  # a seeded generate() samples as it would without it
    assert layer_probe.thread_gain(model, 1, 2) == gain and len(calls) == 1  # probed once
    layer_probe.thread_gain(model, 1, 2, rows=5)
    assert len(calls) == 2  # another shape: probed again
    assert layer_probe.thread_gain(model, 2, 2) == 1.0 and len(calls) == 2
    assert layer_probe.thread_gain(torch.nn.Sequential(torch.nn.ReLU()), 1, 2) is None


def test_thread_gain_restores_the_thread_count_and_survives_a_failing_layer():
    class Odd(torch.nn.Module):  # looks linear, wants other inputs
        in_features, out_features = 4, 4

        def forward(self, x, other):
            return x

    with torch_threads(3):
        assert layer_probe.thread_gain(torch.nn.Sequential(Odd()), 1, 2) is None
        assert torch.get_num_threads() == 3
        assert layer_probe.thread_gain(torch.nn.Sequential(torch.nn.Linear(8, 8)), 1, 2) > 0
        assert torch.get_num_threads() == 3


class Stepped(torch.nn.Module):
    """Looks linear; its forward takes 20 ms over up to 3 positions, 40 ms over more (the step of MKL's kernels on a
    2-core Xeon), `cheaper` ms over 12 or more where given (kernels that turn cheaper past some count). Sleeps long
    enough that a loaded machine's scheduling delays (a few ms) do not blur the step."""

    in_features, out_features = 4, 4

    def __init__(self, cheaper: float | None = None):
        super().__init__()
        self.cheaper = cheaper

    def forward(self, x):
        n = x.shape[-2]
        time.sleep((self.cheaper if self.cheaper and n >= 12 else 20.0 if n <= 3 else 40.0) / 1e3)
        return x


def test_the_cost_curve_is_probed_once_per_model_and_positions_on_one_middle_block(monkeypatch):
    """A forward's cost over n positions relative to one, timed on one middle block's linear layers: its steps read
    as they are, never below 1 nor falling with more positions; probed once per model, threads and positions, from
    a generator of its own; None where nothing can be probed."""
    model = torch.nn.Sequential(Stepped())
    calls = []
    real = layer_probe._probe_curve
    monkeypatch.setattr(layer_probe, "_probe_curve", lambda *a: calls.append(a) or real(*a))
    state = torch.random.get_rng_state()
    with torch_threads(3):
        curve = layer_probe.cost_curve(model, 1, (2, 3, 4, 5, 8))
        assert torch.get_num_threads() == 3
    assert torch.equal(torch.random.get_rng_state(), state)
    assert sorted(curve) == [1, 2, 3, 4, 5, 8] and curve[1] == 1.0  # one position is always probed
    assert all(1.0 <= curve[n] < 1.5 for n in (2, 3)) and all(1.6 < curve[n] < 2.5 for n in (4, 5, 8))
    assert all(curve[a] <= curve[b] for a, b in zip(sorted(curve), sorted(curve)[1:]))
    assert layer_probe.cost_curve(model, 1, (2, 3, 4, 5, 8)) is curve and len(calls) == 1
    layer_probe.cost_curve(model, 2, (2, 3, 4, 5, 8))
    assert len(calls) == 2  # other threads: probed again
    falling = layer_probe.cost_curve(torch.nn.Sequential(Stepped(cheaper=5.0)), 1, (4, 12))
    assert falling[12] == falling[4] > 1.6  # cheaper kernels past 12 positions read as the count before them
    assert layer_probe.cost_curve(torch.nn.Sequential(torch.nn.ReLU()), 1, (2, 3)) is None


def test_the_probed_cost_curve_reaches_the_first_decision():
    """An adaptive generate() on the CPU probes the target's curve at every count up to K_max + 1 and, ~1.5x apart,
    up to the deepest serial speculation's, and records it with the first decision."""
    from conftest import tiny_pair

    from hf_ssd import SSDConfig, enable_ssd

    target, draft = tiny_pair("llama")
    enable_ssd(target)
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft, max_new_tokens=6,
                    do_sample=False, ssd_config=SSDConfig(lookahead=3, max_serial_lookahead=8))
    first = target.ssd_metrics.lookahead_decisions[0]
    assert sorted(first["probed_cost_curve"]) == [1, 2, 3, 4, 6, 9] and first["probed_cost_curve"][1] == 1.0
