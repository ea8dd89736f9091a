"""The target's side of a batch: one verification forward for all active rows, per-row processing, acceptance, and
the realignment of ragged rows (tokens, 2D inputs, KV) against a common right edge after every round."""

from __future__ import annotations

import contextlib
import copy
import time

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..cache.alignment import compact, gather_slots, keep_leading
from ..cache.draft_cache import recompile_limits
from ..compat import (
    auto_compiled_forward,
    model_kwargs_cache_key,
    output_cache,
    prepare_attention_mask,
    prepare_position_ids,
    prepare_token_type_ids,
)
from .rows import Batch, Row, Verdict
from .runner_up import NEITHER, RUNNER_UP_WON, drop_position, sibling_inputs, sibling_winner
from .verification import accept, sibling_sampling_verify
from .warpers import split_trailing_warpers, warp

ROW_INPUTS = ("attention_mask", "position_ids", "token_type_ids", "mm_token_type_ids")  # [b, T]: follow the tokens


class TargetBatch:
    """The target's view of the active rows: left-padded ids right-aligned to a common edge (`ids` [b, T]), their
    2D inputs and KV cache (`kwargs`). Invariant between rounds: the cache holds T - 1 positions per row."""

    def __init__(self, model, input_ids: torch.Tensor, model_kwargs: dict, logits_processor, generation_config=None):
        self.model = model
        self.generation_config = generation_config
        self._compiled = None  # the compiled forward of a compileable cache (see `auto_compiled_forward`)
        self._siblings: bool | None = None  # whether a runner-up can be verified as a sibling (`runner_up_possible`)
        self.cache_key = model_kwargs_cache_key(model_kwargs)
        if input_ids.shape[0] > 1:
            # Full layers (sliding windows still apply through the 2D mask); realigned every round.
            model_kwargs[self.cache_key] = DynamicCache()
            if model_kwargs.get("attention_mask") is None:
                model_kwargs["attention_mask"] = torch.ones_like(input_ids)
        cache = model_kwargs[self.cache_key]
        if hasattr(cache, "activate_past_recording"):
            cache.activate_past_recording()
        self.ids = input_ids
        self.kwargs = model_kwargs
        self.logits_processor = logits_processor
        self.first = True
        self.forward_seconds = 0.0  # the last verification forward
        self._outputs = self._extended = None
        text_config = model.config.get_text_config()
        positions = getattr(text_config, "max_position_embeddings", None) or getattr(text_config, "n_positions", None)
        self.max_positions = positions or 1 << 62

    @property
    def cache(self):
        return self.kwargs.get(self.cache_key)

    def runner_up_ready(self, batch: Batch) -> bool:
        """Whether this round could verify the runner-up of its one row's first drafted token beside it
        (`runner_up.py`): one row whose speculation carries one, and `runner_up_possible`."""
        if len(batch.active) != 1:
            return False
        speculation = batch.active[0].speculation
        if speculation is None or speculation.runner_up is None or speculation.tokens.shape[0] == 0:
            return False
        return self.runner_up_possible() and (
            speculation.runner_up < self.model.get_input_embeddings().num_embeddings)

    def runner_up_possible(self) -> bool:
        """Whether this target's rounds can verify a sibling at all: after the prefill, every cache layer a full
        dynamic one (a sliding window's keeps fewer positions than the sibling mask spans; a static or compiled
        cache has no room for a sibling), attention that takes a 4D mask (sdpa, eager), and no per-token input but
        the mask and the positions. Decided once, after the prefill: the cache's type and layers, the attention and
        the inputs do not change while rows leave."""
        if self.first:
            return False
        if self._siblings is None:
            cache = self.cache
            self._siblings = (
                self._compiled is None and isinstance(cache, DynamicCache) and bool(cache.layers)
                and all(type(layer) is DynamicLayer for layer in cache.layers)
                and getattr(self.model.config, "_attn_implementation", None) in ("sdpa", "eager")
                and not any(self.kwargs.get(key) is not None for key in ROW_INPUTS
                            if key not in ("attention_mask", "position_ids")))
        return self._siblings

    def verify(self, batch: Batch, verified: int, generator: torch.Generator | None, phases,
               cores=contextlib.nullcontext, draft_idle: bool = False, runner_up: bool = False) -> Verdict:
        """Score every active row's speculation (its first `verified` tokens) in one forward and accept exactly.

        `generator` is None under greedy decoding; `cores` is entered around the forward when the draft leaves the
        machine to the target: the first forward (the prefill) and every round the draft is paused (`draft_idle`:
        a plain step then runs on every core, as plain decoding would). `runner_up`: verify the one row's first
        drafted token and its runner-up as siblings (the caller asked `runner_up_ready`; `verified` 1)."""
        if runner_up:
            if verified != 1 or len(batch.active) != 1:
                raise RuntimeError("a runner-up is verified beside one drafted token of one row")
            return self._verify_siblings(batch, phases, cores if draft_idle else contextlib.nullcontext, generator)
        device = self.ids.device
        if verified:
            tokens = _arrive(torch.stack([row.speculation.tokens[:verified] for row in batch.active]), device)
        else:  # a plain step
            tokens = self.ids.new_empty(len(batch.active), 0)
        start = time.perf_counter()
        with phases("target_forward"), (cores() if self.first or draft_idle else contextlib.nullcontext()):
            self._outputs, self._extended, raw = self._forward(tokens)
        self.forward_seconds = time.perf_counter() - start
        if self.first and not getattr(output_cache(self._outputs), "is_croppable", True):
            raise ValueError("SSD needs a target cache that can be cropped after verification.")
        with phases("processors"):
            scores = process_rows(self.logits_processor, batch.rows, batch.active, tokens, raw)
        with phases("verify"):
            q = None
            if generator is not None and verified:
                q = _arrive(torch.stack([row.speculation.probs[:verified] for row in batch.active]), scores.device)
            elif generator is not None:  # a plain step: nothing drafted, the token is drawn from p
                q = scores.new_zeros(scores.shape[0], 0, scores.shape[-1])
            accepted, bonus = accept(tokens, scores, q, generator)
            both = torch.stack([accepted, bonus]).tolist()  # the round's one host synchronisation
        return Verdict(verified, tokens, raw, scores, [int(a) for a in both[0]], [int(b) for b in both[1]])

    def _verify_siblings(self, batch: Batch, phases, cores, generator: torch.Generator | None = None) -> Verdict:
        """One forward over [t, s_1, r] (`runner_up.sibling_inputs`), then the verdict of the sibling the target's
        choice took, as if that sibling had been the speculation: the cache keeps its KV slot only, so `realign`
        commits it as a one-token round. Greedy: the target's choice after t, then its choice after the sibling
        (r's position scored only where r won); sampling: `verification.sibling_sampling_verify` against the
        draft's q for s_1, both positions scored before either is drawn."""
        row = batch.active[0]
        first, second = int(row.speculation.tokens[0]), row.speculation.runner_up
        cache, mask = self.cache, self.kwargs.get("attention_mask")
        cached = cache.get_seq_length()
        visible = (torch.ones(cached, dtype=torch.bool, device=self.ids.device) if mask is None
                   else mask[0, :cached].bool())
        positions = self.kwargs.get("position_ids")  # t's, as generate() numbers it; else past the visible ones
        position = int(positions[0, self.ids.shape[1] - 1]) if positions is not None else int(visible.sum())
        ids, positions, attention = sibling_inputs(int(self.ids[0, -1]), first, second, position, visible,
                                                   self.model.dtype)
        start = time.perf_counter()
        with phases("target_forward"), cores():
            outputs = self.model(input_ids=ids, position_ids=positions, attention_mask=attention,
                                 use_cache=True, **{self.cache_key: cache})
        self.forward_seconds = time.perf_counter() - start
        raw = outputs.logits[:, -3:].to(dtype=torch.float32, device=self.ids.device)

        def scored(token: int) -> tuple[torch.Tensor, torch.Tensor]:  # (chain [[token]], the scores after t, token)
            chain = torch.tensor([[token]], device=self.ids.device)
            with phases("processors"):
                return chain, process_rows(self.logits_processor, batch.rows, batch.active, chain,
                                           raw[:, [0, 1 if token == first else 2]])

        chain, scores = scored(first)
        runner_up_scores = None
        if generator is not None:
            _, runner_up_scores = scored(second)
            with phases("verify"):
                p = torch.cat([scores[0], runner_up_scores[0, 1:]]).softmax(-1)
                q = _arrive(row.speculation.probs[0], p.device)
                winner, bonus = sibling_sampling_verify(first, second, q, p, generator)
        else:
            with phases("verify"):
                predicted = scores[0].argmax(dim=-1).tolist()  # the choice after t and after s_1: one read-back
                winner = sibling_winner(predicted[0], first, second)
            if winner == RUNNER_UP_WON:  # the bonus follows r: its position's scores, with r in the prefix
                _, runner_up_scores = scored(second)
                with phases("verify"):
                    predicted = runner_up_scores[0].argmax(dim=-1).tolist()
            bonus = predicted[0 if winner == NEITHER else 1]
        with phases("verify"):
            if winner == RUNNER_UP_WON:
                drop_position(cache, cached + 1)  # s_1's slot: the runner-up's moves into it
                chain, raw, scores = torch.tensor([[second]], device=self.ids.device), raw[:, [0, 2]], runner_up_scores
            else:
                cache.crop(-1)  # the runner-up's slot, the last
                raw = raw[:, :2]
        self._outputs = outputs
        self._extended = extend_row_inputs(copy.copy(self.kwargs), self.ids.shape[1] + 1)
        return Verdict(1, chain, raw, scores, [0 if winner == NEITHER else 1], [bonus],
                       runner_up=[winner == RUNNER_UP_WON])

    def _forward(self, tokens: torch.Tensor):
        """One target forward over the new tokens [bonus, s_1..s_L] of every row ([b, L]).

        Returns (outputs, kwargs extended to T+L, raw logits [b, L+1, V])."""
        length = tokens.shape[1]
        candidate_ids = torch.cat([self.ids, tokens], dim=-1)
        kwargs = extend_row_inputs(copy.copy(self.kwargs), candidate_ids.shape[1])
        next_length = _uncached_length(kwargs, self.ids, candidate_ids) if self.first else length + 1
        inputs = self.model.prepare_inputs_for_generation(
            candidate_ids, next_sequence_length=next_length, is_first_iteration=self.first, **kwargs
        )
        if "logits_to_keep" in inputs:
            inputs["logits_to_keep"] = length + 1
        if self.first or self._compiled is None:
            outputs = self.model(**inputs)  # the prefill (variable width) always eagerly, as generate() does
        else:
            with recompile_limits():  # one graph per verified width
                outputs = self._compiled(**inputs)
        raw = outputs.logits[:, -length - 1 :].to(dtype=torch.float32, device=self.ids.device)
        return outputs, kwargs, raw

    def realign(self, verdict: Verdict, emitted: list[int], keep: list[int]) -> None:
        """Commit what each row emitted: row i (of the rows verified) keeps T + emitted[i] tokens and one KV slot
        fewer; rows not in `keep` leave. When every row stays and emitted the same count this is a plain crop (the
        only path at batch 1); otherwise tokens, 2D inputs and KV go through one gather."""
        cache = output_cache(self._outputs)
        width, verified = self.ids.shape[1], verdict.verified
        kwargs = extend_row_inputs(self._extended, width + verified + 1)  # room for the bonus
        kwargs[self.cache_key] = cache
        new_tokens = verdict.new_tokens()
        if len(keep) == len(emitted) and len(set(emitted)) == 1:
            cache.crop(-(verified + 1 - emitted[0]))
            self.ids = torch.cat([self.ids, new_tokens[:, : emitted[0]]], dim=1)
            for key in ROW_INPUTS:
                if kwargs.get(key) is not None:
                    kwargs[key] = kwargs[key][..., : width + emitted[0]]
        elif keep:
            check_realignable(cache)
            committed = torch.cat([self.ids, new_tokens], dim=1)
            self.ids = realign_rows(cache, kwargs, committed, keep, [width + e for e in emitted])
        self.kwargs = kwargs
        if self.first and self.generation_config is not None and len(keep) == 1 == len(emitted):  # batch 1: its cache
            self._compiled = auto_compiled_forward(self.model, kwargs, self.generation_config)
        self.first = False
        self._outputs = self._extended = None


def _arrive(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The draft's tokens or q on the target's device: a non-blocking copy onto an accelerator (queued on the
    target's stream behind the hand-off's event wait), a plain one onto the CPU (whose reader does not wait)."""
    if tensor.device == device:
        return tensor
    return tensor.to(device, non_blocking=torch.device(device).type not in ("cpu", "meta"))


def _uncached_length(kwargs, input_ids, candidate_ids) -> int | None:
    """A cache passed in by the caller (continuation): the first forward feeds only its uncached tail, as
    generate()'s prefill does."""
    cache = kwargs.get(model_kwargs_cache_key(kwargs) or "cache")
    past = cache.get_seq_length() if cache is not None else 0
    mask = kwargs.get("attention_mask")
    if 0 < past < input_ids.shape[1] and (mask is None or mask.shape[1] == candidate_ids.shape[1]):
        return candidate_ids.shape[1] - past
    return None


def extend_row_inputs(model_kwargs, length: int):
    """Extend the per-row inputs (mask, positions, token types) to `length` columns, as generate() would."""
    kwargs = prepare_attention_mask(model_kwargs, length, False)
    kwargs = prepare_token_type_ids(kwargs, length)
    if kwargs.get("position_ids") is not None:
        kwargs = prepare_position_ids(kwargs, length, False)
    if (mm_types := kwargs.get("mm_token_type_ids")) is not None and mm_types.shape[-1] < length:
        kwargs["mm_token_type_ids"] = torch.cat(
            [mm_types, mm_types.new_zeros(mm_types.shape[0], length - mm_types.shape[-1])], dim=-1
        )
    return kwargs


def process_rows(logits_processor, rows: list[Row], active: list[Row], tokens: torch.Tensor,
                 raw: torch.Tensor) -> torch.Tensor:
    """Processed scores [b, L+1, V]: active row i at position m sees exactly its own prefix plus tokens[i, :m].

    `row.ids` is the row as plain decoding holds it (its prompt as passed, padding included, plus what it has
    generated), so length- and content-dependent processors behave exactly as there. Processors may hold per-row
    state for the original batch (e.g. the repetition penalty's prompt lengths): each call gets a batch of the
    original size (`rows`) with the rows in their original places; rows of equal length share a call. The sampling
    warpers that end the list (`warpers.split_trailing_warpers`) read scores alone: they run once over every row and
    position.
    """
    processors, warpers = split_trailing_warpers(logits_processor)
    if not processors:
        return warp(warpers, raw)  # neither is written to afterwards (warpers return new tensors)
    scores = raw.clone()
    batch = len(rows)
    for m in range(raw.shape[1]):
        groups: dict[int, list[int]] = {}
        for i, row in enumerate(active):
            groups.setdefault(row.ids.shape[0] + m, []).append(i)
        for members in groups.values():
            views = {active[i].index: torch.cat([active[i].ids, tokens[i, :m]]) for i in members}
            filler = views[active[members[0]].index]
            ids = torch.stack([views.get(r, filler) for r in range(batch)])
            originals = [active[i].index for i in members]
            batch_scores = raw[members[0], m].expand(batch, -1).clone()
            batch_scores[originals] = raw[members, m]
            for processor in processors:
                batch_scores = processor(ids, batch_scores)
            scores[members, m] = batch_scores[originals]
    return warp(warpers, scores)


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
            model_kwargs[key] = value if key == "position_ids" else value * valid  # padding: mask 0, type 0
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
