"""The SSD decoding loop (target side), reached through `generate(..., assistant_model=draft, ssd_config=...)`.

Each round: hand the draft the speculation being verified (it glues, forks and tree-decodes in the
background), verify it with one target forward over K+1 positions, emit the accepted tokens plus the bonus
(cropped exactly where plain decoding would stop), then ask the draft for the outcome's prepared speculation.
"""

from __future__ import annotations

import copy
import dataclasses
import time

import torch
from transformers.generation.candidate_generator import (
    _prepare_attention_mask,
    _prepare_position_ids,
    _prepare_token_type_ids,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..compat import model_kwargs_cache_key, output_cache
from ..config import SSDConfig
from ..metrics import MetricsRecorder, SSDMetrics
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
    if input_ids.shape[0] != 1:
        raise ValueError(f"SSD currently supports batch size 1; got a batch of {input_ids.shape[0]} sequences.")
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


def _seeded_generator(device: torch.device) -> torch.Generator:
    """A generator on `device`, seeded from torch's global RNG (so `torch.manual_seed` reproduces a run)."""
    seed = int(torch.randint(0, 2**62, (1,)).item())
    return torch.Generator(device=device).manual_seed(seed)


def _target_scores(model, input_ids, tokens, model_kwargs, logits_processor, first: bool):
    """One target forward over the new tokens [bonus, s_1..s_L]; returns (outputs, raw [1,L+1,V], processed)."""
    length = tokens.shape[0]
    candidate_ids = torch.cat([input_ids, tokens[None]], dim=-1)
    kwargs = copy.copy(model_kwargs)
    kwargs = _prepare_attention_mask(kwargs, candidate_ids.shape[1], False)
    kwargs = _prepare_token_type_ids(kwargs, candidate_ids.shape[1])
    if (position_ids := kwargs.get("position_ids")) is not None and length > 0:
        kwargs = _prepare_position_ids(kwargs, length + position_ids.shape[-1], False)
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
    scores = raw.clone()
    cur_len = input_ids.shape[1]
    for i in range(length + 1):
        scores[:, i] = logits_processor(candidate_ids[:, : cur_len + i], scores[:, i])
    return outputs, raw, scores


def _verify(speculation, tokens, scores, generator) -> tuple[int, int]:
    """(accepted, bonus) for the first `len(tokens)` tokens of `speculation` against processed target `scores`.

    `generator` is None under greedy decoding. This is the round's one host synchronisation.
    """
    if generator is None:
        accepted, bonus = greedy_verify(tokens[None], scores)
    else:
        q = speculation.probs[: tokens.shape[0]].to(scores.device)
        accepted, bonus = sampling_verify(tokens[None], q[None], scores.softmax(-1), generator)
    accepted, bonus = torch.stack([accepted[0], bonus[0]]).tolist()
    return int(accepted), int(bonus)


def _emit(input_ids, new_tokens, stopping_criteria, scores_so_far):
    """Append tokens one at a time and stop at the first one any stopping criterion fires on (like plain decoding).

    Returns (input_ids, number emitted, finished).
    """
    extended = torch.cat([input_ids, new_tokens[None]], dim=-1)
    start = input_ids.shape[1]
    for i in range(new_tokens.shape[0]):
        if bool(stopping_criteria(extended[:, : start + i + 1], scores_so_far(i + 1)).any()):
            return extended[:, : start + i + 1], i + 1, True
    return extended, new_tokens.shape[0], False


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
    """Speculative speculative decoding at batch size 1. Output law = the target's alone."""
    try:
        config = SSDConfig.coerce(generation_config.ssd_config)
        check_supported(model, assistant_model, input_ids, generation_config, synced_gpus, model_kwargs)
        executor = resolve_executor(config.executor, assistant_model.device, model.device)
        check_processors(logits_processor)
    except Exception:
        if streamer is not None:  # generate() already streamed the prompt: release a consumer waiting for more
            streamer.end()
        raise
    cache_key = model_kwargs_cache_key(model_kwargs)
    target_cache = model_kwargs[cache_key]
    if hasattr(target_cache, "activate_past_recording"):
        target_cache.activate_past_recording()

    do_sample = bool(generation_config.do_sample)
    want_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    want_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    all_scores, all_logits = [], []
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
    start = time.perf_counter()
    first = True
    finished = False
    try:
        with runtime:
            waited = time.perf_counter()
            speculation = runtime.submit(drafter.begin, input_ids, model_kwargs.get("attention_mask")).result()
            recorder.wait_seconds += time.perf_counter() - waited
            while not finished:
                waited = time.perf_counter()
                drafter.announce(None)
                preparing = runtime.submit(drafter.prepare, speculation)
                recorder.wait_seconds += time.perf_counter() - waited

                # Verify at most what still fits under max_length (the last position is the bonus).
                verified = max(0, min(lookahead, generation_config.max_length - input_ids.shape[1] - 1))
                tokens = speculation.tokens[:verified].to(input_ids.device)
                verify_start = time.perf_counter()
                outputs, raw, scores = _target_scores(model, input_ids, tokens, model_kwargs, logits_processor, first)
                if first and not getattr(output_cache(outputs), "is_croppable", True):
                    raise ValueError("SSD needs a target cache that can be cropped after verification.")
                accepted, bonus = _verify(speculation, tokens, scores, target_generator)
                drafter.announce((accepted, bonus))
                new_tokens = torch.cat([tokens[:accepted], tokens.new_tensor([bonus])])

                round_scores = [scores[:, i] for i in range(accepted + 1)] if want_scores else []
                history = tuple(all_scores)
                input_ids, emitted, finished = _emit(
                    input_ids, new_tokens, stopping_criteria,
                    lambda n: history + tuple(round_scores[:n]) if want_scores else None,  # noqa: B023
                )
                all_scores.extend(round_scores[:emitted])
                if want_logits:
                    all_logits.extend(raw[:, i] for i in range(emitted))
                if streamer is not None:
                    streamer.put(new_tokens[:emitted].cpu())

                # The target cache keeps len(input_ids) - 1 positions (the newest token is fed next round).
                output_cache(outputs).crop(-(verified + 1 - emitted))
                model_kwargs = model._update_model_kwargs_for_generation(
                    outputs, model_kwargs, is_encoder_decoder=False, num_new_tokens=emitted
                )
                if cache_key != "cache" and "cache" in model_kwargs:  # 5.23 names it past_key_values
                    model_kwargs[cache_key] = model_kwargs.pop("cache")
                recorder.record_round(
                    speculation.is_primary, accepted, verified, emitted, time.perf_counter() - verify_start
                )
                first = False
                if finished:
                    break

                waited = time.perf_counter()
                preparing.result()
                resolution = runtime.submit(drafter.resolve, accepted, bonus, verified).result()
                recorder.wait_seconds += time.perf_counter() - waited
                recorder.record_lookup(resolution.hit, accepted)
                speculation = resolution.speculation
    finally:
        if streamer is not None:
            streamer.end()

    metrics = recorder.finish(
        draft_seconds=runtime.busy_seconds,
        wall_seconds=time.perf_counter() - start,
        fanout_schedule=drafter.schedules,
        acceptance_estimate={k: estimator.acceptance(k) for k in ("primary", "backup")},
        power_law_estimate=estimator.power(),
        hits_by_fanout={f: list(v) for f, v in sorted(estimator.hits_by_f.items())},
        tree_steps_skipped=drafter.skipped_tree_steps,
        branches=config.branches,
        backup=drafter.backup,
        executor=executor,
        draft_threads=draft_threads if executor == "thread" else 0,
        target_threads=target_threads if executor == "thread" else torch.get_num_threads(),
    )
    model.ssd_metrics = metrics
    if not generation_config.return_dict_in_generate:
        return input_ids
    fields = {f.name for f in dataclasses.fields(SSDGenerateDecoderOnlyOutput)}
    cache_field = "cache" if "cache" in fields else "past_key_values"
    return SSDGenerateDecoderOnlyOutput(
        sequences=input_ids,
        scores=tuple(all_scores) if want_scores else None,
        logits=tuple(all_logits) if want_logits else None,
        ssd_metrics=metrics,
        **{cache_field: model_kwargs.get(cache_key)},
    )
