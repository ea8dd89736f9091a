"""Small model pairs built from configs (no hub): the benchmarks' fixed workloads for host-bound rounds.

Each pair is a random target and a draft made of the target's first layers (same embeddings, norm and LM head).
The target's layers above the draft's are scaled down (their residual-branch outputs), so the draft agrees with
the target most of the time while both models keep their real costs.

* ``small-llama``: a 12-layer, 512-hidden Llama (vocabulary 4096) and its first 2 layers; upper layers scaled by
  0.085, the draft agrees ~80-85% greedily. Forwards of ~5 ms (draft) and ~18 ms (target) on one core.
* ``small-qwen2``: a 16-layer, 384-hidden Qwen2 (vocabulary 8192) and its first 3 layers, scaled by 0.07. The check
  pair: defined once and never tuned on.
"""

from __future__ import annotations

import torch

PAIRS = {
    "small-llama": dict(arch="llama", vocab_size=4096, hidden_size=512, intermediate_size=1376, num_hidden_layers=12,
                        num_attention_heads=8, num_key_value_heads=4, draft_layers=2, upper_scale=0.085, seed=0),
    "small-qwen2": dict(arch="qwen2", vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=16,
                        num_attention_heads=6, num_key_value_heads=2, draft_layers=3, upper_scale=0.07, seed=1),
}


def truncated_draft(target, layers: int):
    """A draft made of the target's first `layers` decoder layers (same embeddings, norm and LM head)."""
    settings = {**target.config.to_dict(), "num_hidden_layers": layers}
    if settings.get("layer_types"):
        settings["layer_types"] = settings["layer_types"][:layers]
    config = type(target.config)(**settings)
    draft = type(target)(config).eval()
    state = {
        k: v for k, v in target.state_dict().items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers
    }
    draft.load_state_dict(state)
    return draft


def scale_upper_layers(target, first: int, scale: float) -> None:
    """Multiply the residual-branch outputs (o_proj, down_proj) of layers >= `first` by `scale`."""
    with torch.no_grad():
        for layer in target.model.layers[first:]:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)


def build_pair(name: str):
    """(target, draft, description) of the named pair."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if name not in PAIRS:
        raise ValueError(f"unknown pair {name!r}; choose from {', '.join(PAIRS)}")
    spec = dict(PAIRS[name])
    arch, draft_layers, scale, seed = spec.pop("arch"), spec.pop("draft_layers"), spec.pop("upper_scale"), spec.pop(
        "seed")
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    torch.manual_seed(seed)
    config = config_cls(**spec, max_position_embeddings=2048, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    target = model_cls(config).eval()
    scale_upper_layers(target, draft_layers, scale)
    draft = truncated_draft(target, draft_layers)
    desc = (f"{name}: {arch} {spec['num_hidden_layers']} layers x {spec['hidden_size']} (vocab {spec['vocab_size']}), "
            f"draft = its first {draft_layers} layers, upper layers scaled by {scale}")
    return target, draft, desc
