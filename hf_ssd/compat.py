"""Where hf_ssd meets transformers' internals: differences between the supported releases (5.23:
`past_key_values`, 5.24+: `cache`) and every private transformers name the package uses, in one place."""

from __future__ import annotations

import inspect
from functools import cache

import torch
from transformers.generation.candidate_generator import (
    _prepare_attention_mask as prepare_attention_mask,
)
from transformers.generation.candidate_generator import (
    _prepare_position_ids as prepare_position_ids,
)
from transformers.generation.candidate_generator import (
    _prepare_token_type_ids as prepare_token_type_ids,
)

__all__ = [
    "attn_implementation",
    "auto_compiled_forward",
    "cache_kwarg",
    "is_stateful",
    "model_kwargs_cache_key",
    "output_cache",
    "pad_token_tensor",
    "prepare_attention_mask",
    "prepare_position_ids",
    "prepare_token_type_ids",
]


def pad_token_tensor(generation_config) -> torch.Tensor | None:
    """The pad token generate() resolved for this call (a tensor), or None."""
    return generation_config._pad_token_tensor


def is_stateful(model) -> bool:
    """Whether the model keeps recurrent state (its cache cannot be rolled back)."""
    return bool(getattr(model, "_is_stateful", False))


def attn_implementation(config) -> str:
    """The attention implementation a model was loaded with ("sdpa", "eager", "flash_attention_2", ...)."""
    return getattr(config, "_attn_implementation", None) or ""


@cache
def _forward_params(cls: type) -> frozenset[str]:
    return frozenset(inspect.signature(cls.forward).parameters)


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name under which `model.forward` takes its KV cache."""
    params = _forward_params(type(model))
    return "cache" if "cache" in params else "past_key_values"


def model_kwargs_cache_key(model_kwargs: dict) -> str | None:
    """The key generate() stored the cache under, if any."""
    for key in ("cache", "past_key_values"):
        if model_kwargs.get(key) is not None:
            return key
    return None


def output_cache(outputs):
    """The cache returned by a forward pass, under either name."""
    cache = getattr(outputs, "cache", None)
    return cache if cache is not None else getattr(outputs, "past_key_values", None)


def auto_compiled_forward(model, model_kwargs: dict, generation_config):
    """The target's compiled forward when transformers' generate() would compile it (a compileable cache such as
    `StaticCache`, on a GPU or with `compile_config._compile_all_devices`, `disable_compile` not set), else None."""
    criteria = getattr(model, "_valid_auto_compile_criteria", None)
    if criteria is None or not criteria(model_kwargs, generation_config):
        return None
    return model.get_compiled_call(generation_config.compile_config)
