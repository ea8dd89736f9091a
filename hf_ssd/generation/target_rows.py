"""The target's side of a batch: one verification forward for all rows, per-row processing, and the realignment of
ragged rows (tokens, 2D inputs, KV) against a common right edge after every round."""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import DynamicLayer
from transformers.generation.candidate_generator import (
    _prepare_attention_mask,
    _prepare_position_ids,
    _prepare_token_type_ids,
)

from ..cache.alignment import compact, gather_slots, keep_leading
from ..compat import model_kwargs_cache_key


def target_scores(model, input_ids, tokens, model_kwargs, first: bool):
    """One target forward over the new tokens [bonus, s_1..s_L] of every row ([b, L]).

    Returns (outputs, kwargs extended to T+L, raw logits [b, L+1, V]).
    """
    length = tokens.shape[1]
    candidate_ids = torch.cat([input_ids, tokens], dim=-1)
    kwargs = extend_row_inputs(copy.copy(model_kwargs), candidate_ids.shape[1])
    next_length = None if first else length + 1
    if first:  # a cache passed in by the caller (continuation): feed only its uncached tail, as generate()'s prefill
        cache = kwargs.get(model_kwargs_cache_key(kwargs) or "cache")
        past = cache.get_seq_length() if cache is not None else 0
        mask = kwargs.get("attention_mask")
        if 0 < past < input_ids.shape[1] and (mask is None or mask.shape[1] == candidate_ids.shape[1]):
            next_length = candidate_ids.shape[1] - past
    inputs = model.prepare_inputs_for_generation(
        candidate_ids, next_sequence_length=next_length, is_first_iteration=first, **kwargs
    )
    if "logits_to_keep" in inputs:
        inputs["logits_to_keep"] = length + 1
    outputs = model(**inputs)
    raw = outputs.logits[:, -length - 1 :].to(dtype=torch.float32, device=input_ids.device)
    return outputs, kwargs, raw


def extend_row_inputs(model_kwargs, length: int):
    """Extend the per-row inputs (mask, positions, token types) to `length` columns, as generate() would."""
    kwargs = _prepare_attention_mask(model_kwargs, length, False)
    kwargs = _prepare_token_type_ids(kwargs, length)
    if kwargs.get("position_ids") is not None:
        kwargs = _prepare_position_ids(kwargs, length, False)
    if (mm_types := kwargs.get("mm_token_type_ids")) is not None and mm_types.shape[-1] < length:
        kwargs["mm_token_type_ids"] = torch.cat(
            [mm_types, mm_types.new_zeros(mm_types.shape[0], length - mm_types.shape[-1])], dim=-1
        )
    return kwargs


def process_rows(logits_processor, row_ids: list[torch.Tensor], active: list[int], tokens: torch.Tensor,
             raw: torch.Tensor) -> torch.Tensor:
    """Processed scores [b, L+1, V]: row i at position m sees exactly its own prefix plus tokens[i, :m].

    `row_ids[r]` is original row r as plain decoding holds it (its prompt as passed, padding included, plus what it
    has generated), so length- and content-dependent processors behave exactly as there. Processors may hold
    per-row state for the original batch (e.g. the repetition penalty's prompt lengths): each call gets a batch
    of the original size with the rows in their original places; rows of equal length share a call.
    """
    scores = raw.clone()
    if not logits_processor:
        return scores
    batch = len(row_ids)
    for m in range(raw.shape[1]):
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(active):
            groups.setdefault(row_ids[r].shape[0] + m, []).append(i)
        for members in groups.values():
            views = {active[i]: torch.cat([row_ids[active[i]], tokens[i, :m]]) for i in members}
            filler = views[active[members[0]]]
            ids = torch.stack([views.get(r, filler) for r in range(batch)])
            originals = [active[i] for i in members]
            batch_scores = raw[members[0], m].expand(batch, -1).clone()
            batch_scores[originals] = raw[members, m]
            scores[members, m] = logits_processor(ids, batch_scores)[originals]
    return scores


ROW_INPUTS = ("attention_mask", "position_ids", "token_type_ids")  # [b, T] inputs that follow the tokens


def realign_rows(cache, model_kwargs, layout_ids, keep_rows, id_lengths):
    """Drop finished rows and right-align every row's kept tokens, inputs and KV (ragged acceptance).

    Row r keeps its first `id_lengths[r]` tokens of `layout_ids` (and one KV slot fewer: its newest token is fed
    next round). Returns the new layout ids.
    """
    selected = torch.tensor(keep_rows, dtype=torch.long, device=layout_ids.device)
    lengths = torch.tensor([id_lengths[r] for r in keep_rows], device=layout_ids.device)
    index, valid = compact(keep_leading(lengths, layout_ids.shape[1]))
    layout_ids = gather_slots(layout_ids[selected], index, 1)
    for key in ROW_INPUTS:
        value = model_kwargs.get(key)
        if value is not None:
            value = gather_slots(value[selected], index, 1)
            model_kwargs[key] = value * valid if key == "attention_mask" else value
    kv_lengths = lengths - 1
    kv_index, _ = compact(keep_leading(kv_lengths, cache.get_seq_length()))
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or not layer.keys.numel():
            continue
        keys, values = layer.keys[selected], layer.values[selected]
        layer.keys, layer.values = gather_slots(keys, kv_index, -2), gather_slots(values, kv_index, -2)
    return layout_ids


def kv_bytes(cache) -> int:
    layers = getattr(cache, "layers", [])
    return sum(
        t.numel() * t.element_size()
        for layer in layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
        if isinstance(t, torch.Tensor)
    )


def check_realignable(cache) -> None:
    for layer in getattr(cache, "layers", [None]):
        if type(layer) is not DynamicLayer:
            raise ValueError(
                "SSD at batch size > 1 realigns the target's KV cache every round and needs a `DynamicCache` with "
                f"full layers; got {type(cache).__name__} with {type(layer).__name__}."
            )
