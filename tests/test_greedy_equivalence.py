"""Greedy SSD output is token-identical to plain greedy decoding, on every path.

Two drafts per architecture: the target itself (hits dominate) and an unrelated random model (misses dominate).
Each case also asserts from the metrics that the path it is meant to exercise actually ran.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model, tiny_pair, truncated_copy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_ssd import SSDConfig, enable_ssd

ARCHS = ["llama", "qwen2", "mistral_sliding", "qwen2_hybrid"]

# (lookahead, fan-out, budget, backup, executor): together they cover every K/fan-out/backup/executor, and every
# backup under each executor.
CASES = [
    (1, "geometric", 4, "draft", "thread"),
    (3, "geometric", 8, "ngram", "sync"),
    (4, "uniform", 10, "random", "thread"),
    (2, [3, 1, 2], 6, "auto", "sync"),
    (5, "geometric", 20, "draft", "sync"),
    (3, "uniform", 1, "ngram", "thread"),
    (2, "geometric", 6, "draft", "process"),
    (4, "geometric", 12, "ngram", "process"),
    (3, [2, 1, 1, 2], 6, "random", "process"),
    (1, "uniform", 3, "auto", "process"),
    (4, [1, 1, 2, 1, 3], 8, "draft", "stream"),
]

_PAIRS = {}


def _pair(arch):
    if arch not in _PAIRS:
        _PAIRS[arch] = tiny_pair(arch, seed=ARCHS.index(arch))
    return _PAIRS[arch]


def _plain(target, input_ids, max_new_tokens, **kwargs):
    return target.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"K{c[0]}-{c[1]}-B{c[2]}-{c[3]}-{c[4]}")
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identical_self_and_random_draft(arch, case):
    lookahead, fanout, budget, backup, executor = case
    target, random_draft = _pair(arch)
    # Every round verifies K here, so each path (hit, miss, backup) runs as configured: on these tiny models the
    # adaptive schedule rightly prefers plain steps (a verification costs ~1 ms, the draft's round several). The
    # adaptive schedule's equality: tests/test_lookahead.py and the batch / API / streaming tests (its default).
    config = SSDConfig(lookahead=lookahead, fanout=fanout, fanout_budget=budget, backup=backup, executor=executor,
                       lookahead_schedule="constant")
    for seed, prompt_len in ((0, 3), (1, 17)):
        torch.manual_seed(100 * seed + lookahead)
        input_ids = torch.randint(0, 96, (1, prompt_len))
        expected = _plain(target, input_ids, 37)
        for draft, kind in ((target, "self"), (random_draft, "random")):
            out = target.generate(input_ids, assistant_model=draft, ssd_config=config, max_new_tokens=37,
                                  do_sample=False)
            assert torch.equal(out, expected), f"{arch} {case} {kind} seed={seed}"
            m = target.ssd_metrics
            assert m.generated_tokens == 37
            if kind == "self":
                assert m.cache_hits > 0, "the hit path did not run"
                # the draft is the target: a cached speculation is accepted whole (but in a last round cut by
                # max_length), which also checks the reused tree / just-in-time KV
                assert m.tokens_per_round_hit >= lookahead + 1 - lookahead / m.cache_hits
            else:
                assert m.cache_lookups - m.cache_hits > 0, "the miss path did not run"


def test_random_draft_hits_also_verify_exactly():
    """An unrelated draft with a wide fan-out hits sometimes: cached speculations that are mostly wrong (a constant
    schedule: the adaptive one leaves a useless draft paused, from the first round of later calls on)."""
    target, draft = _pair("llama")
    hits = 0
    for seed in range(4):
        torch.manual_seed(seed)
        input_ids = torch.randint(0, 96, (1, 9))
        expected = _plain(target, input_ids, 40)
        out = target.generate(input_ids, assistant_model=draft, max_new_tokens=40, do_sample=False,
                              ssd_config=SSDConfig(lookahead=2, fanout=[30, 5, 5], lookahead_schedule="constant"))
        assert torch.equal(out, expected)
        hits += target.ssd_metrics.cache_hits
    assert hits > 0


def test_layer_truncated_draft_mixes_hits_and_misses():
    """A draft that shares the target's first layer agrees partly: both paths within one generation."""
    target = enable_ssd(tiny_model("llama", layers=2, seed=7, hidden=64))
    draft = truncated_copy(target, layers=1)
    torch.manual_seed(3)
    input_ids = torch.randint(0, 96, (1, 12))
    expected = _plain(target, input_ids, 60)
    out = target.generate(input_ids, assistant_model=draft, max_new_tokens=60, do_sample=False,
                          ssd_config=SSDConfig(lookahead=3, fanout_budget=16, lookahead_schedule="constant"))
    assert torch.equal(out, expected)
    m = target.ssd_metrics
    assert m.cache_hits > 0 and m.cache_lookups > m.cache_hits  # every round on the cache path (constant K)


@given(
    lookahead=st.integers(1, 5),
    budget=st.integers(1, 24),
    fanout=st.sampled_from(["geometric", "uniform"]),
    backup=st.sampled_from(["draft", "ngram", "random"]),
    prompt_len=st.integers(1, 20),
    new_tokens=st.integers(1, 30),
    seed=st.integers(0, 10_000),
    self_draft=st.booleans(),
    arch=st.sampled_from(ARCHS),
)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_greedy_identical_property(lookahead, budget, fanout, backup, prompt_len, new_tokens, seed, self_draft, arch):
    target, random_draft = _pair(arch)
    torch.manual_seed(seed)
    input_ids = torch.randint(0, 96, (1, prompt_len))
    config = SSDConfig(lookahead=lookahead, fanout_budget=budget, fanout=fanout, backup=backup, executor="sync")
    out = target.generate(input_ids, assistant_model=target if self_draft else random_draft, ssd_config=config,
                          max_new_tokens=new_tokens, do_sample=False)
    assert torch.equal(out, _plain(target, input_ids, new_tokens))


def _other_arch(name: str, layers: int):
    import transformers as tf

    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
                pad_token_id=None)
    if name == "gpt2":  # absolute position embeddings, fused qkv
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=layers, n_head=4, n_positions=512,
                                                bos_token_id=None, eos_token_id=None))
    config_cls, model_cls, extra = {
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, {"head_dim": 16, "sliding_window": 8}),  # soft-capping
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, {"head_dim": 16, "sliding_window": 8}),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, {"num_local_experts": 4, "num_experts_per_tok": 2}),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, {}),
    }[name]
    return model_cls(config_cls(**base, **extra))


@pytest.mark.parametrize("executor", ["thread", "stream", "process"])
@pytest.mark.parametrize("name", ["gemma2", "gemma3", "gpt2", "mixtral", "phi3"])
def test_greedy_identical_on_other_architectures(name, executor):
    torch.manual_seed(0)
    target = enable_ssd(_other_arch(name, 2).eval())
    torch.manual_seed(1)
    draft = _other_arch(name, 1).eval()
    input_ids = torch.randint(0, 128, (1, 14), generator=torch.Generator().manual_seed(2))
    expected = _plain(target, input_ids, 30)
    for assistant in (target, draft):
        out = target.generate(input_ids, assistant_model=assistant, max_new_tokens=30, do_sample=False,
                              ssd_config=SSDConfig(lookahead=3, executor=executor))
        assert torch.equal(out, expected) and target.ssd_metrics.executor == executor
        if assistant is target:
            assert target.ssd_metrics.cache_hits > 0
