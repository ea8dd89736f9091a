"""`SSDGenerationMixin` and `enable_ssd`: route `generate(..., ssd_config=...)` to the SSD loop.

Without `ssd_config`, generate() is exactly transformers' own.
"""

from __future__ import annotations

import copy
import inspect
import threading

import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerationMixin

from ..config import SSDConfig
from .checks import check_prompt, check_vocabulary
from .decoding import ssd_decoding

_GENERATE_SIGNATURE = inspect.signature(GenerationMixin.generate)
_SSD_CLASSES: dict[type, type] = {}
_LOCKS_GUARD = threading.Lock()


def _ensure_ssd_attribute(generation_config: GenerationConfig) -> None:
    if not hasattr(generation_config, "ssd_config"):
        generation_config.ssd_config = None


def _model_lock(model) -> threading.RLock:
    with _LOCKS_GUARD:
        lock = model.__dict__.get("_ssd_lock")
        if lock is None:
            lock = threading.RLock()
            model.__dict__["_ssd_lock"] = lock
        return lock


def _check_request(model, assistant_model, extra: dict, merged: GenerationConfig) -> None:
    """Refuse SSD requests that cannot work, before generate() does any work."""
    if assistant_model is None:
        raise ValueError("`ssd_config` needs a draft model: pass `assistant_model=` to generate().")
    num_beams = extra.get("num_beams", merged.num_beams) or 1
    if num_beams > 1:
        raise ValueError(f"SSD supports greedy decoding and sampling, not beam search (num_beams={num_beams}).")
    for name in ("prompt_lookup_num_tokens", "assistant_early_exit"):
        if extra.get(name, getattr(merged, name, None)) is not None:
            raise ValueError(f"`{name}` selects another candidate generator; it cannot be combined with SSD.")
    # Before transformers' own check, whose message points to universal assisted decoding (not SSD's).
    check_vocabulary(model, assistant_model, extra.get("tokenizer"), extra.get("assistant_tokenizer"))


class SSDGenerationMixin:
    """Mix into a `PreTrainedModel` (before it in the bases) to accept `ssd_config=` in `generate()`.

    After an SSD generation, `model.ssd_metrics` holds its `SSDMetrics`.
    """

    ssd_metrics = None

    def generate(self, *args, **kwargs):
        _ensure_ssd_attribute(self.generation_config)
        bound = _GENERATE_SIGNATURE.bind_partial(self, *args, **kwargs).arguments
        extra = bound.get("kwargs", {})
        generation_config = bound.get("generation_config")
        if generation_config is not None and not hasattr(generation_config, "ssd_config"):
            generation_config = copy.deepcopy(generation_config)  # never mutate the caller's object
            _ensure_ssd_attribute(generation_config)
            if "generation_config" in kwargs:
                kwargs["generation_config"] = generation_config
            else:
                args = (args[0], generation_config, *args[2:])
        merged = generation_config or self.generation_config
        requested = extra["ssd_config"] if "ssd_config" in extra else getattr(merged, "ssd_config", None)
        if requested is None:
            return super().generate(*args, **kwargs)
        ssd_config = SSDConfig.coerce(requested)
        if "ssd_config" in kwargs:
            kwargs["ssd_config"] = ssd_config
        _check_request(self, bound.get("assistant_model"), extra, merged)
        check_prompt(bound.get("inputs", extra.get("input_ids")), extra.get("attention_mask"))
        with _model_lock(self):
            return super().generate(*args, **kwargs)

    def __reduce_ex__(self, protocol):
        # `enable_ssd`'s class carries the original's name, so pickle (and deepcopy, and handing the model to a
        # worker process) would look up the original class by name and refuse: rebuild the subclass on load instead.
        reduced = super().__reduce_ex__(protocol)
        base = type(self).__dict__.get("_ssd_base")
        if base is None or not isinstance(reduced, tuple):
            return reduced
        return (_new_ssd_model, (base,), *reduced[2:])

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_ssd_lock", None)  # a lock does not pickle; a new one is made on first use
        return state

    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        # transformers' assisted path refuses num_return_sequences > 1; SSD decodes the expanded rows as a batch.
        if getattr(generation_config, "ssd_config", None) is not None and generation_config.num_return_sequences > 1:
            generation_config = copy.copy(generation_config)
            generation_config.num_return_sequences = 1
        return super()._validate_generation_mode(generation_mode, generation_config, generation_mode_kwargs)

    def _assisted_decoding(
        self,
        input_ids,
        logits_processor,
        stopping_criteria,
        generation_config,
        synced_gpus=False,
        streamer=None,
        inputs_tensor=None,
        assistant_model=None,
        assistant_tokenizer=None,
        tokenizer=None,
        **model_kwargs,
    ):
        if getattr(generation_config, "ssd_config", None) is None:
            return super()._assisted_decoding(
                input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=synced_gpus,
                streamer=streamer, inputs_tensor=inputs_tensor, assistant_model=assistant_model,
                assistant_tokenizer=assistant_tokenizer, tokenizer=tokenizer, **model_kwargs,
            )
        return ssd_decoding(
            self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=synced_gpus,
            streamer=streamer, assistant_model=assistant_model, **model_kwargs,
        )


def ssd_class(cls: type) -> type:
    """The cached subclass of `cls` with `SSDGenerationMixin` mixed in, under the same class name."""
    if issubclass(cls, SSDGenerationMixin):
        return cls
    with _LOCKS_GUARD:
        if cls not in _SSD_CLASSES:
            namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "_ssd_base": cls}
            _SSD_CLASSES[cls] = type(cls.__name__, (SSDGenerationMixin, cls), namespace)
        return _SSD_CLASSES[cls]


def _new_ssd_model(base: type):
    """An empty instance of `ssd_class(base)` (unpickling; the state follows)."""
    cls = ssd_class(base)
    return cls.__new__(cls)


def enable_ssd(model: torch.nn.Module) -> torch.nn.Module:
    """Let a loaded causal LM take `ssd_config=` in `generate()` (and in pipelines). Idempotent; returns `model`."""
    if not isinstance(model, GenerationMixin):
        raise ValueError(f"enable_ssd needs a transformers model with generate(); got {type(model).__name__}.")
    model.__class__ = ssd_class(type(model))
    _ensure_ssd_attribute(model.generation_config)
    return model
