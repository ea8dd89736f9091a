"""Differences between the supported transformers releases (5.23: `past_key_values`, 5.24+: `cache`)."""

from __future__ import annotations

import inspect
from functools import cache

import torch


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
