"""Tiny models built from configs (no hub) shared by the tests."""

from __future__ import annotations

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Before torch loads (it reads this once): OpenMP threads that spin after a multi-threaded step (the target's prefill
# and plain steps on every core) take the core a draft worker process needs; on 2 loaded cores, 2x slower tests.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from hf_ssd import enable_ssd  # noqa: E402
from hf_ssd.generation.estimates import LookaheadMemory  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_lookahead_memory():
    """Each test starts with no costs or acceptance remembered from earlier tests' calls on shared models (a call
    after calls that found a draft useless starts with plain steps: which test ran first would decide the path)."""
    LookaheadMemory._by_model.clear()
    yield

# Tiny models: one intra-op thread per test process is fastest, and pytest-xdist runs one process per core.
torch.set_num_threads(1)

ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    # Every layer slides over 8 positions; prompts + generations in the tests are longer than that.
    "mistral_sliding": (MistralConfig, MistralForCausalLM, {"sliding_window": 8}),
    # Hybrid: a full-attention layer and a sliding-window layer (masks keyed by layer type).
    "qwen2_hybrid": (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": True, "sliding_window": 8,
                                                      "max_window_layers": 1}),
}


def tiny_model(arch: str = "llama", layers: int = 2, vocab_size: int = 96, seed: int = 0, hidden: int = 32,
               eos_token_id: int | None = None, **overrides):
    """A small random causal LM of `arch`, deterministic in `seed`, in eval mode."""
    config_cls, model_cls, extra = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    config = config_cls(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=eos_token_id, bos_token_id=None, pad_token_id=None, **{**extra, **overrides},
    )
    return model_cls(config).eval()


def truncated_copy(model, vocab_size: int | None = None, layers: int | None = None):
    """A draft made of `model`'s first `layers` layers (all when None) with its embedding and head cut (or padded) to
    `vocab_size` rows (unchanged when None): it agrees with `model` often, as a small model of one family does, and on
    every id both have when the layers are all kept. Built of the plain class, not `enable_ssd`'s."""
    config = copy.deepcopy(model.config)
    config.vocab_size = vocab_size or config.vocab_size
    if layers is not None:
        config.num_hidden_layers = layers
    draft = getattr(type(model), "_ssd_base", type(model))(config)
    own = draft.state_dict()
    state = {k: v for k, v in model.state_dict().items() if k in own}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in state and state[name].shape != own[name].shape:
            rows = min(config.vocab_size, state[name].shape[0])
            padded = own[name].clone()
            padded[:rows] = state[name][:rows]
            state[name] = padded
    draft.load_state_dict(state)
    return draft.eval()


def tiny_pair(arch: str = "llama", vocab_size: int = 96, seed: int = 0, **overrides):
    """(target with SSD enabled, an unrelated random 1-layer draft of the same vocabulary)."""
    target = enable_ssd(tiny_model(arch, layers=2, vocab_size=vocab_size, seed=seed, **overrides))
    draft = tiny_model(arch, layers=1, vocab_size=vocab_size, seed=seed + 1000, **overrides)
    return target, draft


@pytest.fixture
def llama_pair():
    return tiny_pair("llama")
