"""A target with a `StaticCache` (`cache_implementation="static"`) and a compiled verification forward, on a CPU:
the forward is compiled as transformers' generate() would compile it (`compile_config`; on a CPU only with
`_compile_all_devices`), one graph per verified width; exactness under greedy decoding and, for a seed, the same
sampled tokens as the dynamic-cache path (whose law tests/test_sampling_law.py checks)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_pair
from transformers import CompileConfig

from hf_ssd import SSDConfig
from hf_ssd.generation import target_rows


def _compile_config() -> CompileConfig:
    config = CompileConfig(backend="aot_eager", fullgraph=False)
    config._compile_all_devices = True  # transformers compiles on GPUs only unless told
    return config


@pytest.fixture
def compiled_forwards(monkeypatch):
    """Records, per verification forward, whether it ran through the compiled call."""
    seen = []
    original = target_rows.TargetBatch._forward

    def forward(self, tokens):
        seen.append(self._compiled is not None and not self.first)
        return original(self, tokens)

    monkeypatch.setattr(target_rows.TargetBatch, "_forward", forward)
    return seen


@pytest.mark.parametrize("schedule", ["constant", "adaptive"])
@pytest.mark.parametrize("arch, executor", [("llama", "sync"), ("qwen2", "stream")])
def test_static_cache_target_with_a_compiled_forward(arch, executor, schedule, compiled_forwards):
    target, draft = tiny_pair(arch, seed=21)
    ids = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(6))
    expected = target.generate(ids, max_new_tokens=24, do_sample=False)
    for assistant in (target, draft):
        compiled_forwards.clear()
        out = target.generate(ids, assistant_model=assistant, max_new_tokens=24, do_sample=False,
                              cache_implementation="static", compile_config=_compile_config(),
                              ssd_config=SSDConfig(lookahead=3, executor=executor, lookahead_schedule=schedule))
        assert torch.equal(out, expected)
        assert compiled_forwards[0] is False and all(compiled_forwards[1:]) and len(compiled_forwards) > 2


def test_sampling_with_a_static_cache_matches_the_dynamic_cache_for_a_seed():
    target, draft = tiny_pair("llama", seed=22)
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(1))
    config = SSDConfig(lookahead=3, saguaro_c=0.5, backup="draft", lookahead_schedule="constant",
                       fanout_budget_schedule="constant", executor="sync")
    outputs = []
    for static in (False, True):
        torch.manual_seed(5)
        extra = dict(cache_implementation="static", compile_config=_compile_config()) if static else {}
        outputs.append(target.generate(ids, assistant_model=draft, max_new_tokens=24, do_sample=True,
                                       ssd_config=config, **extra))
    assert torch.equal(outputs[0], outputs[1])


def test_no_compile_without_a_compileable_cache_or_when_disabled(compiled_forwards):
    target, draft = tiny_pair("llama", seed=23)
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(2))
    for extra in ({}, dict(cache_implementation="static", compile_config=_compile_config(), disable_compile=True),
                  dict(cache_implementation="static")):  # a CPU: transformers does not auto-compile here
        compiled_forwards.clear()
        target.generate(ids, assistant_model=draft, max_new_tokens=8, do_sample=False,
                        ssd_config=SSDConfig(executor="sync"), **extra)
        assert not any(compiled_forwards), extra


def test_a_static_cache_at_batch_2_is_replaced_by_a_realignable_one():
    """Ragged rows are realigned every round, which needs full dynamic layers: the batch runs on those, exactly."""
    target, draft = tiny_pair("llama", seed=24)
    ids = torch.randint(1, 96, (2, 6), generator=torch.Generator().manual_seed(3))
    expected = target.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    out = target.generate(ids, assistant_model=draft, max_new_tokens=12, do_sample=False, pad_token_id=0,
                          cache_implementation="static", ssd_config=SSDConfig(executor="sync"))
    assert torch.equal(out, expected)


def test_a_static_cache_that_cannot_be_cropped_is_refused_before_any_work():
    target, draft = tiny_pair("mistral_sliding", seed=25)
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(4))
    forwards = []
    hook = target.register_forward_hook(lambda *args: forwards.append(1))
    try:
        with pytest.raises(ValueError, match="cannot be cropped.*StaticSlidingWindowLayer"):
            target.generate(ids, assistant_model=draft, max_new_tokens=8, do_sample=False,
                            cache_implementation="static", ssd_config=SSDConfig(executor="sync"))
    finally:
        hook.remove()
    assert forwards == []

