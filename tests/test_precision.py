"""CPU precision: an int8 draft leaves SSD's greedy output exactly the fp32 target's."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model, tiny_pair

from hf_ssd import SSDConfig
from hf_ssd.precision import apply_precision, count_parameters


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_int8_draft_keeps_greedy_output_exact(executor):
    target, draft = tiny_pair("qwen2", seed=21)
    quantized = apply_precision(draft, "int8")
    assert type(quantized.lm_head).__module__.startswith("torch.ao.nn.quantized")
    for self_draft in (apply_precision(target, "int8"), quantized):
        torch.manual_seed(0)
        input_ids = torch.randint(0, 96, (1, 9))
        expected = target.generate(input_ids, max_new_tokens=30, do_sample=False)
        out = target.generate(input_ids, assistant_model=self_draft, max_new_tokens=30, do_sample=False,
                              ssd_config=SSDConfig(lookahead=3, executor=executor))
        assert torch.equal(out, expected) and target.ssd_metrics.executor == executor


def test_precision_validation():
    target, _ = tiny_pair("llama")
    assert apply_precision(target, "fp32") is target
    with pytest.raises(ValueError, match="precision='bf16' is invalid"):
        apply_precision(target, "bf16")


def test_parameter_counts_include_quantized_layers():
    model = tiny_model("llama", layers=2, seed=0)
    full = sum(p.numel() for p in model.parameters())
    quantized = apply_precision(tiny_model("llama", layers=2, seed=0), "int8")
    assert sum(p.numel() for p in quantized.parameters()) < full  # what transformers' own count would say
    assert count_parameters(quantized) == count_parameters(model) == full
    tied = tiny_model("qwen2", layers=2, seed=0, tie_word_embeddings=True)
    tied_count = sum(p.numel() for p in tied.parameters())  # the shared matrix once
    assert count_parameters(apply_precision(tied, "int8")) == tied_count

