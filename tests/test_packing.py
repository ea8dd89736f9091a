"""oneDNN-packed Linear layers: the same model up to rounding, and SSD over a packed target is still exact."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model, tiny_pair

from hf_ssd import SSDConfig
from hf_ssd.packing import (
    PackedLinear,
    pack_linear_layers,
    packed_pad_rows,
    packing_available,
    packing_decision,
    packing_speedup,
    padding_rows,
)
from hf_ssd.precision import apply_precision, count_parameters

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("rows", [1, 3, 5, 9])
def test_packed_linear_matches_linear(rows):
    torch.manual_seed(0)
    for bias in (False, True):
        linear = torch.nn.Linear(48, 80, bias=bias)
        x = torch.randn(2, rows, 48)
        with torch.no_grad():
            expected = linear(x)
            out = PackedLinear(linear)(x)
        assert out.shape == expected.shape
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pad", [4, 6])
def test_padded_rows_run_the_block_and_are_dropped(pad):
    """Fewer rows than `pad_rows` are padded with zero rows and their outputs dropped: the same values as the linear
    layer, the input's shape kept, and each row's output the one it has in a full block, whatever shares its forward
    (one kernel for every count up to the block); counts of `pad_rows` and more are not padded."""
    torch.manual_seed(0)
    for bias in (False, True):
        linear = torch.nn.Linear(64, 96, bias=bias)
        plain, padded = PackedLinear(linear), PackedLinear(linear, pad_rows=pad)
        block = torch.randn(pad, 64)
        with torch.no_grad():
            full = plain(block)
            for rows in range(1, pad + 1):
                out = padded(block[:rows].reshape(1, rows, 64))
                assert out.shape == (1, rows, 96)
                assert torch.equal(out[0], full[:rows]), rows
                torch.testing.assert_close(out[0], linear(block[:rows]), rtol=1e-5, atol=1e-5)
            longer = torch.randn(pad + 3, 64)
            assert torch.equal(padded(longer), plain(longer))
            assert padded(torch.randn(0, 64)).shape == (0, 96)
    assert f"pad_rows={pad}" in repr(padded) and "pad_rows" not in repr(plain)


def test_padding_rows_picks_the_fastest_small_count(monkeypatch):
    """`padding_rows` pads to the row count a pass takes least time at, where it beats one row by 5 %; else 0. Timed
    passes are scripted here (per row count), so the rule is tested, not the machine."""
    from hf_ssd import packing

    layers = [PackedLinear(torch.nn.Linear(32, 32)) for _ in range(2)]
    layers[0].pad_rows = 3
    for seconds, expected in (
        ({1: 10.0, 2: 12.0, 3: 11.0, 4: 9.9, 5: 9.0, 6: 8.0, 7: 11.0, 8: 12.0}, 6),  # a block of 6
        ({1: 10.0, 2: 10.5, 3: 10.2, 4: 9.7, 5: 11.0, 6: 12.0, 7: 13.0, 8: 14.0}, 0),  # 3 % only: no padding
        ({1: 10.0, 2: 11.0, 3: 12.0, 4: 13.0, 5: 14.0, 6: 15.0, 7: 16.0, 8: 17.0}, 0),  # rising: no padding
        ({1: 10.0, 2: 9.0, 3: 9.0, 4: 9.0, 5: 12.0, 6: 12.0, 7: 12.0, 8: 12.0}, 2),  # ties: the fewest rows
    ):
        timed = []

        def scripted(layers_, inputs, table=seconds, timed=timed):
            assert all(layer.pad_rows == 0 for layer in layers_)  # timed unpadded
            timed.append(inputs[0].shape[0])
            return table[inputs[0].shape[0]]

        monkeypatch.setattr(packing, "_pass_seconds", scripted)
        assert padding_rows(layers) == expected
        assert sorted(set(timed)) == list(range(1, packing.PAD_MAX_ROWS + 1))
    assert [layer.pad_rows for layer in layers] == [3, 0]  # restored
    assert padding_rows([]) == 0


def test_pack_linear_layers_pads_as_measured_or_as_told(monkeypatch):
    from hf_ssd import packing

    monkeypatch.setattr(packing, "padding_rows", lambda layers: 5)
    measured = pack_linear_layers(tiny_model("llama"))
    assert {m.pad_rows for m in measured.modules() if isinstance(m, PackedLinear)} == {5}
    assert packed_pad_rows(measured) == 5 and packed_pad_rows(tiny_model("llama")) is None
    assert packed_pad_rows(pack_linear_layers(tiny_model("llama"), pad_rows=0)) == 0
    assert packed_pad_rows(pack_linear_layers(tiny_model("llama"), pad_rows=7)) == 7
    monkeypatch.undo()  # the real probes: packing and its measurements leave the caller's global RNG as it was
    probed, packed = tiny_model("llama"), tiny_model("llama")  # (tiny_model seeds the global RNG itself)
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    packing_speedup(probed, rows=5, repeats=1)
    pack_linear_layers(packed)
    assert torch.equal(torch.rand(3), expected)
    for bad in (-1, 2.5, "6"):
        with pytest.raises(ValueError, match="pad_rows=.* is invalid"):
            pack_linear_layers(tiny_model("llama"), pad_rows=bad)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral_sliding", "qwen2_hybrid"])
def test_packed_model_logits_and_greedy_output(arch):
    model = tiny_model(arch, layers=2, seed=3)
    packed = apply_precision(tiny_model(arch, layers=2, seed=3), "fp32-packed")
    assert all(type(m) is not torch.nn.Linear for m in packed.modules())
    assert sum(isinstance(m, PackedLinear) for m in packed.modules()) == sum(
        type(m) is torch.nn.Linear for m in model.modules())
    input_ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(packed(input_ids).logits, model(input_ids).logits, rtol=1e-4, atol=1e-4)
    expected = model.generate(input_ids, max_new_tokens=20, do_sample=False)
    assert torch.equal(packed.generate(input_ids, max_new_tokens=20, do_sample=False), expected)
    assert count_parameters(packed) == count_parameters(model)


@pytest.mark.parametrize("executor, pad", [("thread", 0), ("process", 0), ("sync", 0), ("thread", 6), ("sync", 4)])
def test_ssd_over_packed_target_is_exact(executor, pad):
    target, draft = tiny_pair("qwen2", seed=5)
    pack_linear_layers(target, pad_rows=pad)
    input_ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    expected = target.generate(input_ids, max_new_tokens=30, do_sample=False, pad_token_id=0)
    out = target.generate(input_ids, assistant_model=draft, max_new_tokens=30, do_sample=False, pad_token_id=0,
                          ssd_config=SSDConfig(lookahead=3, executor=executor))
    assert torch.equal(out, expected) and target.ssd_metrics.executor == executor


def test_packing_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="packs fp32 models on CPU"):
        pack_linear_layers(tiny_model("llama").to(torch.bfloat16))
    packed = pack_linear_layers(tiny_model("llama"))
    layer = next(m for m in packed.modules() if isinstance(m, PackedLinear))
    with pytest.raises(RuntimeError, match="fp32 on CPU"):
        layer(torch.randn(1, layer.in_features, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="for inference"):
        layer(torch.randn(1, layer.in_features, requires_grad=True))
    assert not packing_decision(tiny_model("llama").to(torch.bfloat16), rows=5)[0]


def test_packing_speedup_is_measured_on_the_model():
    ratios = packing_speedup(tiny_model("llama"), rows=5, repeats=3)
    assert set(ratios) == {1, 5} and all(r > 0 for r in ratios.values())


def test_a_packed_target_starts_from_a_flat_cost_prior():
    from hf_ssd.generation.costs import CPU_SHAPE, FLAT_SHAPE, prior_cost_shape

    assert prior_cost_shape(tiny_model("llama")) == CPU_SHAPE
    assert prior_cost_shape(pack_linear_layers(tiny_model("llama"))) == FLAT_SHAPE


def test_the_auto_precision_says_what_it_was_decided_on(monkeypatch):
    """"auto" returns the ratios it measured with its answer, and a readable line names them and the rule; a named
    precision measures nothing. Near the one-row bound the answer flips with the measurement: runs to be compared
    name the precision."""
    from hf_ssd import packing
    from hf_ssd.precision import decide_precision, describe_decision

    model = tiny_model("llama")
    for one_row, expected in ((0.91, "fp32-packed"), (0.89, "fp32")):
        monkeypatch.setattr(packing, "packing_speedup", lambda m, rows, r=one_row, bar=None: {1: r, rows: 1.3})
        precision, ratios = decide_precision(model, "auto", 5)
        assert precision == expected and ratios == {1: one_row, 5: 1.3}
    line = describe_decision(precision, ratios)
    assert line.startswith("fp32, auto:") and "1.30x at 5 rows" in line and "0.89x at 1 row" in line, line
    assert decide_precision(model, "fp32", 5) == ("fp32", {}) and describe_decision("fp32", {}) == "fp32"
    assert describe_decision("fp32-packed", {}, 6) == "fp32-packed; fewer rows padded to 6"
    assert describe_decision(precision, ratios, 0) == line and line.endswith(">= 0.9x at one")
    assert decide_precision(model.to(torch.bfloat16), "auto", 5) == ("fp32", {})  # not packable: nothing measured
    with pytest.raises(ValueError, match="precision='fp16' is invalid"):
        decide_precision(model, "fp16", 5)


def test_a_one_row_ratio_near_the_bar_is_timed_longer(monkeypatch):
    """Where the one-row ratio's first passes land within `NEAR_BAR` of the bar, `SETTLE_REPEATS` more passes are
    timed and the median of all decides; far from the bar, or without one, the first passes decide. Passes are
    scripted here, so the rule is tested, not the machine."""
    from hf_ssd import packing

    monkeypatch.setattr(packing, "padding_rows", lambda layers: 0)
    for first, later, bar, expected in (
        ([0.8, 0.85, 0.88], [1.05] * 6, 0.9, 1.05),  # a noisy start near the bar: the longer run decides
        ([0.8, 0.85, 0.88], [1.05] * 6, None, 0.85),  # no bar: the first passes
        ([0.5, 0.55, 0.6], [1.05] * 6, 0.9, 0.55),  # far below the bar: not timed longer
        ([1.2, 1.25, 1.3], [0.5] * 6, 0.9, 1.25),  # far above it: not timed longer
    ):
        asked = []

        def scripted(layers, packed, rows, repeats, noise, first=first, later=later, asked=asked):
            asked.append((rows, repeats))
            if rows > 1:
                return [2.0] * repeats
            return first if len(asked) == 1 else later

        monkeypatch.setattr(packing, "_pass_ratios", scripted)
        monkeypatch.setattr(packing, "SETTLE_REPEATS", 6)
        ratios = packing_speedup(tiny_model("llama"), rows=5, repeats=3, bar=bar)
        assert ratios == {1: expected, 5: 2.0}, (first, bar, ratios)
        longer = bar is not None and abs(first[1] - bar) < packing.NEAR_BAR
        assert asked == [(1, 3)] + ([(1, 6)] if longer else []) + [(5, 3)], asked
    monkeypatch.setattr(packing, "SETTLE_REPEATS", 27)
    monkeypatch.setattr(packing, "_pass_ratios", lambda layers, packed, rows, repeats, noise:
                        [0.86] * repeats if rows == 1 and repeats == 9 else [1.0] * repeats if rows == 1 else [2.0])
    assert packing_decision(tiny_model("llama"), rows=5) == (True, {1: 1.0, 5: 2.0})  # packing_decision passes the bar


def test_the_probe_reads_the_largest_layers_up_to_its_byte_bound(monkeypatch):
    """The probe passes over the largest Linear layers (the head apart) until they hold `PROBE_BYTES`, so that on a
    real model its weights come from memory as a forward's do; a small model's whole body is read."""
    from hf_ssd import packing

    model = tiny_model("llama")
    head = model.get_output_embeddings()
    body = [m for m in model.modules() if type(m) is torch.nn.Linear and m is not head]
    assert set(packing._largest_linears(model)) == set(body)  # under the bound: all of them
    largest = max(m.weight.numel() for m in body) * 4
    monkeypatch.setattr(packing, "PROBE_BYTES", largest + 1)
    chosen = packing._largest_linears(model)
    sizes = [m.weight.numel() for m in chosen]
    assert len(chosen) == 2 and head not in chosen and sizes == sorted(sizes, reverse=True)
    assert sizes[0] == max(m.weight.numel() for m in body)
