"""The SSD decoding loop (target side), reached through `generate(..., assistant_model=draft, ssd_config=...)`.

Each round: hand the draft the speculations being verified (it glues, forks and tree-decodes in the
background), verify them with one target forward over K+1 positions per row, emit each row's accepted tokens plus
its bonus (cropped exactly where plain decoding would stop), then ask the draft for each outcome's prepared
speculation. Rows accept different numbers of tokens: the target's inputs and KV are realigned against a common
right edge after every round (`cache/alignment.py`), and finished rows leave the batch.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.generation.candidate_generator import (
    _prepare_attention_mask,
    _prepare_position_ids,
    _prepare_token_type_ids,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..cache.alignment import compact, gather_slots, keep_leading
from ..compat import model_kwargs_cache_key, output_cache
from ..config import SSDConfig
from ..metrics import MetricsRecorder, SSDMetrics
from .backup import FAST_BACKUP, choose_backup
from .candidate_generator import SaguaroCandidateGenerator
from .fanout import FanoutEstimator
from .runtime import DraftRuntime, resolve_executor, split_threads
from .verification import greedy_verify, sampling_verify


@dataclasses.dataclass
class SSDGenerateDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus the run's `ssd_metrics`."""

    ssd_metrics: SSDMetrics | None = None


def _vocab_size(model) -> int:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(getattr(head, "out_features", None), int):  # nn.Linear, also dynamically quantized
        return head.out_features
    if isinstance(getattr(head, "weight", None), torch.Tensor):
        return head.weight.shape[0]
    return model.config.get_text_config().vocab_size


# Processors that keep state across calls or assume one new token per call: verification scores K+1 positions
# per round and rolls back, so they would silently change the output law. Every other processor is a function of
# (prefix, scores) and is applied to each verified position with its exact prefix, which keeps SSD lossless.
STATEFUL_PROCESSORS = {
    "UnbatchedClassifierFreeGuidanceLogitsProcessor",
    "ClassifierFreeGuidanceLogitsProcessor",
    "SynthIDTextWatermarkLogitsProcessor",
    "WhisperTimeStampLogitsProcessor",
    "WhisperNoSpeechDetection",
    "AlternatingCodebooksLogitsProcessor",
    "BarkEosPrioritizerLogitsProcessor",
    "DiaClassifierFreeGuidanceLogitsProcessor",
    "DiaEOSChannelFilterLogitsProcessor",
    "DiaEOSDelayPatternLogitsProcessor",
}


def check_processors(logits_processor) -> None:
    """Refuse logits processors whose state would not survive multi-token verification and rollback."""
    for processor in logits_processor or []:
        name = type(processor).__name__
        if name in STATEFUL_PROCESSORS:
            raise ValueError(
                f"SSD cannot use {name}: it keeps state across decoding steps, which speculative verification "
                "(several positions per forward, then rollback) would silently break. Stateless processors "
                "(penalties, bad words, min length, warpers, ...) are supported."
            )


def check_vocabulary(model, assistant_model) -> None:
    """The draft must score the target's vocabulary: SSD exchanges token ids and distributions, never text."""
    target_vocab, draft_vocab = _vocab_size(model), _vocab_size(assistant_model)
    if target_vocab != draft_vocab:
        raise ValueError(
            f"SSD needs the draft to share the target's vocabulary; the target scores {target_vocab} tokens and the "
            f"draft {draft_vocab}."
        )


def check_supported(model, assistant_model, input_ids, generation_config, synced_gpus, model_kwargs) -> None:
    """Refuse what SSD does not support, with a clear error, before any forward pass."""
    if assistant_model is None:
        raise ValueError("SSD needs a draft model: pass `assistant_model=` to generate() along with `ssd_config`.")
    if model.config.is_encoder_decoder or assistant_model.config.is_encoder_decoder:
        raise ValueError("SSD supports decoder-only target and draft models; got an encoder-decoder model.")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and mask.dim() == 2 and bool((mask[:, -1] == 0).any()):
        raise ValueError(
            "SSD needs left-padded batches (every row's last position a real token); got right padding. Set "
            "`tokenizer.padding_side = 'left'`."
        )
    if input_ids.shape[0] > 1:
        check_batchable(input_ids, generation_config, model_kwargs)
    check_vocabulary(model, assistant_model)
    if synced_gpus:
        raise ValueError("SSD does not support `synced_gpus=True`.")
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError(
            "SSD does not return attentions or hidden states; drop `output_attentions` / `output_hidden_states` "
            "(`output_scores` and `output_logits` are supported)."
        )
    if getattr(assistant_model, "_is_stateful", False) or getattr(model, "_is_stateful", False):
        raise ValueError(
            "SSD needs models whose cache can be rolled back; stateful (recurrent) models are not supported."
        )
    attn = getattr(assistant_model.config, "_attn_implementation", None) or ""
    if "flash" in attn or "flex" in attn:
        raise ValueError(
            f"SSD's tree attention needs a custom 4D mask, which '{attn}' does not take; load the draft with "
            "attn_implementation='sdpa' or 'eager'."
        )
    if model_kwargs_cache_key(model_kwargs) is None:
        raise ValueError("SSD needs the target's KV cache: do not pass `use_cache=False`.")
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("SSD needs `input_ids`; `inputs_embeds` prompts are not supported.")


def check_batchable(input_ids, generation_config, model_kwargs) -> None:
    """What batch > 1 additionally needs: a fresh cache, 2D per-row inputs, a pad token and no streamer."""
    rows = input_ids.shape[0]
    cache = model_kwargs.get(model_kwargs_cache_key(model_kwargs) or "cache")
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError(
            f"SSD continues from a passed cache only at batch size 1; got a filled cache with a batch of {rows}."
        )
    for key in ("position_ids", "token_type_ids", "mm_token_type_ids"):
        value = model_kwargs.get(key)
        if value is not None and (value.dim() != 2 or value.shape[0] != rows):
            raise ValueError(
                f"SSD at batch size {rows} needs `{key}` of shape [batch, length]; got {tuple(value.shape)}."
            )
    if generation_config._pad_token_tensor is None:
        raise ValueError(
            f"SSD at batch size {rows} fills finished rows with the pad token: set `pad_token_id` (e.g. to the EOS "
            "token) in generate() or the generation config."
        )


def _seeded_generator(device: torch.device) -> torch.Generator:
    """A generator on `device`, seeded from torch's global RNG (so `torch.manual_seed` reproduces a run)."""
    seed = int(torch.randint(0, 2**62, (1,)).item())
    return torch.Generator(device=device).manual_seed(seed)


def _target_scores(model, input_ids, tokens, model_kwargs, first: bool):
    """One target forward over the new tokens [bonus, s_1..s_L] of every row ([b, L]).

    Returns (outputs, kwargs extended to T+L, raw logits [b, L+1, V]).
    """
    length = tokens.shape[1]
    candidate_ids = torch.cat([input_ids, tokens], dim=-1)
    kwargs = _extend_row_inputs(copy.copy(model_kwargs), candidate_ids.shape[1])
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


def _extend_row_inputs(model_kwargs, length: int):
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


def _process(logits_processor, row_ids: list[torch.Tensor], active: list[int], tokens: torch.Tensor,
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


def _verify(speculations, tokens, scores, generator) -> tuple[list[int], list[int]]:
    """Per row (accepted, bonus) for `tokens` [b, L] against processed target `scores` [b, L+1, V].

    `generator` is None under greedy decoding. This is the round's one host synchronisation.
    """
    if generator is None:
        accepted, bonus = greedy_verify(tokens, scores)
    else:
        length = tokens.shape[1]
        q = torch.stack([s.probs[:length] for s in speculations]).to(scores.device)
        accepted, bonus = sampling_verify(tokens, q, scores.softmax(-1), generator)
    both = torch.stack([accepted, bonus]).tolist()
    return [int(a) for a in both[0]], [int(b) for b in both[1]]


def _emit(row_ids, new_tokens, stopping_criteria, scores_so_far):
    """Append tokens one at a time and stop at the first one any stopping criterion fires on (like plain decoding).

    Returns (row_ids, number emitted, finished).
    """
    extended = torch.cat([row_ids, new_tokens])
    start = row_ids.shape[0]
    for i in range(new_tokens.shape[0]):
        if bool(stopping_criteria(extended[None, : start + i + 1], scores_so_far(i + 1)).any()):
            return extended[: start + i + 1], i + 1, True
    return extended, new_tokens.shape[0], False


ROW_INPUTS = ("attention_mask", "position_ids", "token_type_ids")  # [b, T] inputs that follow the tokens


def _realign_target(cache, model_kwargs, layout_ids, keep_rows, id_lengths):
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


def _kv_bytes(cache) -> int:
    layers = getattr(cache, "layers", [])
    return sum(
        t.numel() * t.element_size()
        for layer in layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
        if isinstance(t, torch.Tensor)
    )


def _check_realignable(cache) -> None:
    for layer in getattr(cache, "layers", [None]):
        if type(layer) is not DynamicLayer:
            raise ValueError(
                "SSD at batch size > 1 realigns the target's KV cache every round and needs a `DynamicCache` with "
                f"full layers; got {type(cache).__name__} with {type(layer).__name__}."
            )


class _BatchStreamer:
    """Feeds a streamer one column per decoding step, like plain decoding: column n goes out once every row has
    its n-th token (finished rows contribute the pad token). A streamer with `accepts_blocks = True` gets each
    emission's columns as one [b, n] block instead (benchmarks timestamp emissions that way)."""

    def __init__(self, streamer, rows: int, pad: int | None):
        self.streamer, self.rows, self.pad, self.sent = streamer, rows, pad, 0

    def flush(self, generated: list[list[int]], finished: list[bool], final: bool = False) -> None:
        if self.streamer is None:
            return
        if self.rows == 1:
            ready = len(generated[0])
        else:
            lengths = [len(g) for g, done in zip(generated, finished) if not done]
            ready = min(lengths) if lengths and not final else max(len(g) for g in generated)
        if ready > self.sent:
            columns = [
                [g[n] if n < len(g) else self.pad for g in generated] for n in range(self.sent, ready)
            ]
            if self.rows == 1:
                self.streamer.put(torch.tensor([c[0] for c in columns]))
            elif getattr(self.streamer, "accepts_blocks", False):
                self.streamer.put(torch.tensor(columns).T)
            else:
                for column in columns:
                    self.streamer.put(torch.tensor(column))
            self.sent = ready


class _AutoBackup:
    """`backup="auto"`: re-decides before every lookup by Corollary 16 from the run's measurements."""

    def __init__(self, enabled: bool, default: str):
        self.enabled = enabled
        self.choice = default
        self.decision: dict = {}
        self.served: dict[str, int] = {}

    def decide(self, recorder: MetricsRecorder, drafter: SaguaroCandidateGenerator, rows: int) -> str:
        if not self.enabled:
            return self.choice
        verify = recorder.verify_seconds / max(recorder.batch_rounds, 1)
        if drafter.backup_calls == 0 or recorder.lookups == 0 or verify <= 0:
            return self.choice  # nothing measured yet: the just-in-time draft (best at batch 1)
        e_hit = recorder.tokens_per_round("cache")
        e_miss = recorder.tokens_per_round("draft")
        t_p = drafter.prepare_seconds / max(drafter.prepare_calls, 1) / verify
        t_b = drafter.backup_seconds / drafter.backup_calls / verify
        p_hit = recorder.hits / recorder.lookups
        fast_tokens = recorder.tokens_per_round(FAST_BACKUP) or 1.0
        if e_hit <= 0:
            e_hit = 1.0
        if e_miss <= 0:
            e_miss = 1.0
        self.choice, critical = choose_backup(p_hit, e_hit, e_miss, t_p, t_b, rows, E_miss_fast=fast_tokens)
        self.decision = {
            "choice": self.choice, "batch_size": rows, "critical_batch_size": critical, "p_hit": p_hit,
            "E_hit": e_hit, "E_miss": e_miss, "E_miss_fast": fast_tokens, "T_p": t_p, "T_b": t_b,
        }
        return self.choice


def ssd_decoding(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    assistant_model=None,
    **model_kwargs,
):
    """Speculative speculative decoding of a (left-padded) batch. Output law per row = the target's alone."""
    try:
        config = SSDConfig.coerce(generation_config.ssd_config)
        check_supported(model, assistant_model, input_ids, generation_config, synced_gpus, model_kwargs)
        executor = resolve_executor(config.executor, assistant_model.device, model.device)
        check_processors(logits_processor)
    except Exception:
        if streamer is not None:  # generate() already streamed the prompt: release a consumer waiting for more
            streamer.end()
        raise
    batch = input_ids.shape[0]
    cache_key = model_kwargs_cache_key(model_kwargs)
    if batch > 1:
        # Full layers (sliding windows still apply through the 2D mask); realigned every round.
        model_kwargs[cache_key] = DynamicCache()
        if model_kwargs.get("attention_mask") is None:
            model_kwargs["attention_mask"] = torch.ones_like(input_ids)
    target_cache = model_kwargs[cache_key]
    if hasattr(target_cache, "activate_past_recording"):
        target_cache.activate_past_recording()

    do_sample = bool(generation_config.do_sample)
    want_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    want_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    pad = generation_config._pad_token_tensor
    pad_id = int(pad) if pad is not None else None
    lookahead = config.lookahead
    vocab_size = _vocab_size(model)
    draft_threads, target_threads = split_threads(config.draft_threads, config.target_threads)
    target_generator = _seeded_generator(input_ids.device) if do_sample else None
    draft_generator = _seeded_generator(assistant_model.device)
    estimator = FanoutEstimator(
        config.fanout, config.fanout_budget, lookahead, vocab_size, config.acceptance_prior,
        config.power_law_prior, config.adaptive,
    )
    recorder = MetricsRecorder(lookahead)
    runtime = DraftRuntime(executor, draft_threads, target_threads, assistant_model.device)
    drafter = SaguaroCandidateGenerator(
        assistant_model, config, do_sample, logits_processor, vocab_size, estimator, draft_generator,
        check=runtime.check,
    )
    auto = _AutoBackup(config.backup == "auto", drafter.backup)

    # Per original row: the row as plain decoding holds it, what it generated, and its scores/logits.
    row_ids = [input_ids[r] for r in range(batch)]
    generated: list[list[int]] = [[] for _ in range(batch)]
    row_scores: list[list[torch.Tensor]] = [[] for _ in range(batch)]
    row_logits: list[list[torch.Tensor]] = [[] for _ in range(batch)]
    done = [False] * batch
    # Plain decoding pads rows that finished only when an EOS criterion is present; otherwise every row goes on
    # until all rows' criteria have fired once (`limit`: that step).
    pads_finished = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
    fired_at: list[int | None] = [None] * batch
    limit: int | None = None
    active = list(range(batch))  # original row of each row still in the batch
    stream = _BatchStreamer(streamer, batch, pad_id)
    layout_ids = input_ids  # the target's left-padded, right-aligned view of the active rows
    start = time.perf_counter()
    first = True
    try:
        with runtime:
            waited = time.perf_counter()
            # The prefills run while the other side waits: each gets every core.
            speculations = runtime.submit(
                runtime.on_all_cores(drafter.begin), input_ids, model_kwargs.get("attention_mask")
            ).result()
            recorder.wait_seconds += time.perf_counter() - waited
            while active:
                waited = time.perf_counter()
                drafter.announce(None)
                preparing = runtime.submit(drafter.prepare, speculations)
                recorder.wait_seconds += time.perf_counter() - waited

                # Verify at most what still fits under max_length in every row (the last position is the bonus).
                longest = max(row_ids[r].shape[0] for r in active)
                verified = max(0, min(lookahead, generation_config.max_length - longest - 1))
                tokens = torch.stack([s.tokens[:verified] for s in speculations]).to(input_ids.device)
                verify_start = time.perf_counter()
                with runtime.all_cores() if first else contextlib.nullcontext():
                    outputs, extended, raw = _target_scores(model, layout_ids, tokens, model_kwargs, first)
                if first and not getattr(output_cache(outputs), "is_croppable", True):
                    raise ValueError("SSD needs a target cache that can be cropped after verification.")
                scores = _process(logits_processor, row_ids, active, tokens, raw)
                accepted, bonus = _verify(speculations, tokens, scores, target_generator)
                drafter.announce(list(zip(accepted, bonus)))
                recorder.record_verify(time.perf_counter() - verify_start)

                emitted = []
                new_columns = torch.cat([tokens, tokens.new_zeros(len(active), 1)], dim=1)  # s_1..s_a, bonus, unused
                new_columns[torch.arange(len(active)), torch.tensor(accepted)] = torch.tensor(bonus)
                for i, r in enumerate(active):
                    new_tokens = new_columns[i, : accepted[i] + 1]
                    if limit is not None:
                        new_tokens = new_tokens[: limit - len(generated[r])]
                    count = new_tokens.shape[0]
                    if fired_at[r] is None:
                        history = tuple(row_scores[r])
                        _, first_stop, fired = _emit(
                            row_ids[r], new_tokens, stopping_criteria,
                            lambda n: history + tuple(scores[i, :n, None]) if want_scores else None,  # noqa: B023
                        )
                        if fired:
                            fired_at[r] = len(generated[r]) + first_stop
                            if pads_finished or batch == 1:
                                count, done[r] = first_stop, True
                    row_ids[r] = torch.cat([row_ids[r], new_tokens[:count]])
                    emitted.append(count)
                    generated[r].extend(new_tokens[:count].tolist())
                    if want_scores:
                        row_scores[r].extend(scores[i, :count, None])
                    if want_logits:
                        row_logits[r].extend(raw[i, :count, None])
                    recorder.record_round(speculations[i].source, accepted[i], verified, count)
                    if limit is not None and len(generated[r]) >= limit:
                        done[r] = True
                if limit is None and not pads_finished and all(f is not None for f in fired_at):
                    # Without an EOS criterion, plain decoding keeps every row going (real tokens) until the last
                    # row's criteria fire: that step is everybody's length.
                    limit = max(fired_at)
                    for r in range(batch):
                        for kept in (generated[r], row_scores[r], row_logits[r]):
                            del kept[limit:]
                        row_ids[r] = row_ids[r][: input_ids.shape[1] + limit]
                        done[r] = done[r] or len(generated[r]) >= limit
                stream.flush(generated, done)

                keep_rows = [i for i, r in enumerate(active) if not done[r]]
                cache = output_cache(outputs)
                model_kwargs = _extend_row_inputs(extended, layout_ids.shape[1] + verified + 1)  # room for the bonus
                model_kwargs[cache_key] = cache
                width = layout_ids.shape[1]
                realign_start = time.perf_counter()
                if len(keep_rows) == len(active) and len(set(emitted)) == 1:
                    # Every row kept the same count: a plain crop (the only path at batch 1).
                    cache.crop(-(verified + 1 - emitted[0]))
                    layout_ids = torch.cat([layout_ids, new_columns[:, : emitted[0]]], dim=1)
                    for key in (*ROW_INPUTS, "mm_token_type_ids"):
                        if model_kwargs.get(key) is not None:
                            model_kwargs[key] = model_kwargs[key][..., : width + emitted[0]]
                elif keep_rows:
                    _check_realignable(cache)
                    lengths = [width + e for e in emitted]
                    committed = torch.cat([layout_ids, new_columns], dim=1)
                    layout_ids = _realign_target(cache, model_kwargs, committed, keep_rows, lengths)
                recorder.realign_seconds += time.perf_counter() - realign_start
                recorder.record_memory(_kv_bytes(cache), drafter.cache.memory_bytes())
                first = False
                active = [active[i] for i in keep_rows]
                if not active:
                    break

                waited = time.perf_counter()
                preparing.result()
                drafter.backup = auto.decide(recorder, drafter, len(active))
                resolutions = runtime.submit(
                    drafter.resolve, list(zip(accepted, bonus)), verified, keep_rows
                ).result()
                recorder.wait_seconds += time.perf_counter() - waited
                for i, resolution in zip(keep_rows, resolutions):
                    recorder.record_lookup(resolution.hit, accepted[i])
                speculations = [res.speculation for res in resolutions]
    finally:
        if streamer is not None:
            stream.flush(generated, done, final=True)
            streamer.end()

    recorder.generated = sum(len(g) for g in generated)
    metrics = recorder.finish(
        draft_seconds=runtime.busy_seconds,
        wall_seconds=time.perf_counter() - start,
        fanout_schedule=drafter.schedules,
        acceptance_estimate={k: estimator.acceptance(k) for k in ("primary", "backup")},
        power_law_estimate=estimator.power(),
        hits_by_fanout={f: list(v) for f, v in sorted(estimator.hits_by_f.items())},
        tree_steps_skipped=drafter.skipped_tree_steps,
        draft_compact_seconds=drafter.compact_seconds,
        branches=config.branches,
        backup=config.backup,  # "auto": see backup_decision and rounds_by_source for what ran
        backup_decision=dict(auto.decision),
        batch_size=batch,
        executor=executor,
        draft_threads=draft_threads if executor == "thread" else 0,
        target_threads=target_threads if executor == "thread" else torch.get_num_threads(),
    )
    model.ssd_metrics = metrics
    sequences = _assemble(input_ids, generated, pad_id)
    if not generation_config.return_dict_in_generate:
        return sequences
    fields = {f.name for f in dataclasses.fields(SSDGenerateDecoderOnlyOutput)}
    cache_field = "cache" if "cache" in fields else "past_key_values"
    return SSDGenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=_steps(row_scores) if want_scores else None,
        logits=_steps(row_logits) if want_logits else None,
        ssd_metrics=metrics,
        **{cache_field: model_kwargs.get(cache_key)},
    )


def _assemble(input_ids: torch.Tensor, generated: list[list[int]], pad_id: int | None) -> torch.Tensor:
    """[b, T + longest]: each row's prompt and generation; rows that finished earlier are padded, as in plain
    decoding."""
    longest = max(len(g) for g in generated)
    fill = pad_id if pad_id is not None else 0
    new = torch.full((input_ids.shape[0], longest), fill, dtype=input_ids.dtype, device=input_ids.device)
    for r, tokens in enumerate(generated):
        new[r, : len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
    return torch.cat([input_ids, new], dim=1)


def _steps(per_row: list[list[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """Per-step [b, V] tensors from per-row lists; a row that had finished holds zeros at later steps."""
    longest = max(len(rows) for rows in per_row)
    template = next(t for rows in per_row for t in rows)
    return tuple(
        torch.cat([rows[n] if n < len(rows) else torch.zeros_like(template) for rows in per_row])
        for n in range(longest)
    )
