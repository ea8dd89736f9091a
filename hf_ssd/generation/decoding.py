"""The SSD decoding loop (target side), reached through `generate(..., assistant_model=draft, ssd_config=...)`.

Each round: hand the draft the speculations being verified (it glues, forks and tree-decodes in the
background), verify them with one target forward over K+1 positions per row, emit each row's accepted tokens plus
its bonus (cropped exactly where plain decoding would stop), then ask the draft for each outcome's prepared
speculation. Rows accept different numbers of tokens: the target's inputs and KV are realigned against a common
right edge after every round (`cache/alignment.py`), and finished rows leave the batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch
from transformers import DynamicCache

from ..compat import model_kwargs_cache_key, output_cache
from ..config import SSDConfig
from ..metrics import MetricsRecorder
from .backup import AutoBackup
from .candidate_generator import SaguaroCandidateGenerator
from .checks import check_processors, check_supported, model_vocab_size
from .fanout import FanoutEstimator
from .outputs import BatchStreamer, SSDGenerateDecoderOnlyOutput, assemble, steps
from .runtime import DraftRuntime, resolve_executor, split_threads
from .target_rows import (
    ROW_INPUTS,
    check_realignable,
    extend_row_inputs,
    kv_bytes,
    process_rows,
    realign_rows,
    target_scores,
)
from .verification import greedy_verify, sampling_verify

__all__ = ["SSDGenerateDecoderOnlyOutput", "ssd_decoding"]


def _seeded_generator(device: torch.device) -> torch.Generator:
    """A generator on `device`, seeded from torch's global RNG (so `torch.manual_seed` reproduces a run)."""
    seed = int(torch.randint(0, 2**62, (1,)).item())
    return torch.Generator(device=device).manual_seed(seed)


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
    vocab_size = model_vocab_size(model)
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
    auto = AutoBackup(config.backup == "auto", drafter.backup)

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
    max_new = generation_config.max_length - input_ids.shape[1]
    text_config = model.config.get_text_config()
    max_positions = getattr(text_config, "max_position_embeddings", None) or getattr(text_config, "n_positions", None)
    max_positions = max_positions or 1 << 62
    active = list(range(batch))  # original row of each row still in the batch
    stream = BatchStreamer(streamer, batch, pad_id)
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
            recorder.first_wait_seconds = time.perf_counter() - waited
            recorder.wait_seconds += recorder.first_wait_seconds
            while active:
                waited = time.perf_counter()
                drafter.announce(None)
                preparing = runtime.submit(drafter.prepare, speculations)
                recorder.wait_seconds += time.perf_counter() - waited

                # Verify what the least advanced row can still use under max_length (the last position is the bonus);
                # rows further on are capped when they emit. Never past the target's position embeddings.
                shortest = min(row_ids[r].shape[0] for r in active)
                longest = max(row_ids[r].shape[0] for r in active)
                verified = max(0, min(lookahead, generation_config.max_length - shortest - 1,
                                      max_positions - longest - 1))
                tokens = torch.stack([s.tokens[:verified] for s in speculations]).to(input_ids.device)
                verify_start = time.perf_counter()
                with runtime.all_cores() if first else contextlib.nullcontext():
                    outputs, extended, raw = target_scores(model, layout_ids, tokens, model_kwargs, first)
                if first and not getattr(output_cache(outputs), "is_croppable", True):
                    raise ValueError("SSD needs a target cache that can be cropped after verification.")
                scores = process_rows(logits_processor, row_ids, active, tokens, raw)
                accepted, bonus = _verify(speculations, tokens, scores, target_generator)
                drafter.announce(list(zip(accepted, bonus)))
                recorder.record_verify(time.perf_counter() - verify_start)

                emitted = []
                new_columns = torch.cat([tokens, tokens.new_zeros(len(active), 1)], dim=1)  # s_1..s_a, bonus, unused
                device = tokens.device
                new_columns[torch.arange(len(active), device=device), torch.tensor(accepted, device=device)] = (
                    torch.tensor(bonus, device=device, dtype=tokens.dtype)
                )
                for i, r in enumerate(active):
                    cap = max_new if limit is None else min(limit, max_new)
                    new_tokens = new_columns[i, : accepted[i] + 1][: cap - len(generated[r])]
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
                    if len(generated[r]) >= cap:  # plain decoding stops every row at max_length
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
                model_kwargs = extend_row_inputs(extended, layout_ids.shape[1] + verified + 1)  # room for the bonus
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
                    check_realignable(cache)
                    lengths = [width + e for e in emitted]
                    committed = torch.cat([layout_ids, new_columns], dim=1)
                    layout_ids = realign_rows(cache, model_kwargs, committed, keep_rows, lengths)
                recorder.realign_seconds += time.perf_counter() - realign_start
                recorder.record_memory(kv_bytes(cache))
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
        peak_draft_kv_bytes=drafter.peak_cache_bytes,
        branches=config.branches,
        backup=config.backup,  # "auto": see backup_decision and rounds_by_source for what ran
        backup_decision=dict(auto.decision),
        batch_size=batch,
        executor=executor,
        draft_threads=draft_threads if executor == "thread" else 0,
        target_threads=target_threads if executor == "thread" else torch.get_num_threads(),
    )
    model.ssd_metrics = metrics
    sequences = assemble(input_ids, generated, pad_id)
    if not generation_config.return_dict_in_generate:
        return sequences
    fields = {f.name for f in dataclasses.fields(SSDGenerateDecoderOnlyOutput)}
    cache_field = "cache" if "cache" in fields else "past_key_values"
    return SSDGenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=steps(row_scores) if want_scores else None,
        logits=steps(row_logits) if want_logits else None,
        ssd_metrics=metrics,
        # At batch > 1 the cache's rows were realigned and finished ones dropped: it does not match `sequences`.
        **{cache_field: model_kwargs.get(cache_key) if batch == 1 else None},
    )


