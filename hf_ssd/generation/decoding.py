"""The SSD decoding loop (target side), reached through `generate(..., assistant_model=draft, ssd_config=...)`.

A round, in phases: the draft starts preparing the outcomes of the speculations in flight (`prepare`, on its own
thread or process); the target verifies every active row's speculation in one forward (`verify`); each row keeps
its accepted tokens plus the bonus, cut exactly where plain decoding would stop (`emit`); the target's rows are
realigned and finished rows leave (`realign`); the outcomes go to the draft, which answers with each row's next
speculation, a cache hit or a backup's (`hand_off`). While plain steps win and the draft is paused, the loop takes
them in a row (`_plain_stretch`) and tells the draft afterwards. Per-row state lives in `rows.Row`, the target's
layout in `target_rows.TargetBatch`, where the draft runs in `runtime`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from ..compat import pad_token_tensor
from ..config import SSDConfig
from ..metrics import MetricsRecorder
from ..runtime import DraftRequest, choose_executor, cost_curve, open_executor, split_threads, thread_gain
from .backup import AutoBackup
from .budget import FanoutBudget
from .checks import check_processors, check_supported, model_vocab_size
from .costs import prior_cost_shape, probed_positions
from .lookahead import LookaheadMemory, LookaheadPolicy
from .outputs import BatchStreamer, SSDGenerateDecoderOnlyOutput, assemble, steps
from .prompt_lookup import PromptLookup
from .rows import Batch
from .target_rows import TargetBatch, kv_bytes
from .warpers import sampling_warpers

__all__ = ["SSDGenerateDecoderOnlyOutput", "ssd_decoding"]


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
    with _ending(streamer):  # generate() already streamed the prompt: a refusal must release the consumer
        config = SSDConfig.coerce(generation_config.ssd_config)
        check_supported(model, assistant_model, input_ids, generation_config, synced_gpus, model_kwargs)
        check_processors(logits_processor)
        kind = choose_executor(config.executor, assistant_model, model.device)
    do_sample = bool(generation_config.do_sample)
    target_generator = _seeded_generator(input_ids.device) if do_sample else None
    request = _draft_request(config, do_sample, logits_processor, model_vocab_size(model))
    batch = Batch(input_ids, stopping_criteria, generation_config)
    target = TargetBatch(model, input_ids, model_kwargs, logits_processor, generation_config)
    recorder, backups = MetricsRecorder(config.lookahead, config.serial_lookahead), AutoBackup(config.backup)
    lookup = PromptLookup(config.prompt_lookup, config.ngram_max, request.vocab_size, do_sample)
    target_threads = request.target_threads if kind != "sync" else torch.get_num_threads()
    # serial rounds (the draft sits a verification out, then drafts on every core) only pay where the two share cores
    shared_cores = input_ids.device.type == "cpu" and assistant_model.device.type == "cpu"
    every_core = _every_core(request) if shared_cores and kind != "sync" else 1.0
    adaptive = config.lookahead_schedule == "adaptive"
    # what the target gains on every core over its own (the draft sitting a verification out): probed once per target
    # before the first round, so that the concurrent mode is priced before it is tried
    all_threads = request.draft_threads + request.target_threads
    probed = thread_gain(model, request.target_threads, all_threads) if adaptive and every_core > 1 else None
    # how a verification's cost rises with the positions it covers, on the cores a plain step and a serial round run
    # on: probed once per target, so that a K is priced before it is timed (`RoundCosts.positions_cost`)
    step_threads = all_threads if every_core > 1 else target_threads
    curve = cost_curve(model, step_threads, probed_positions(config.lookahead, config.serial_lookahead)) if (
        adaptive and model.device.type == "cpu") else None
    policy = LookaheadPolicy(config.lookahead, adaptive, config.acceptance_prior,
                             concurrent=kind != "sync", cost_shape=prior_cost_shape(model),
                             memory=LookaheadMemory.of(model), setting=(kind != "sync", target_threads),
                             draft_key=id(assistant_model), serial=shared_cores,
                             fanout=FanoutBudget(config.branches, _budget_adaptive(config), config.power_law_prior,
                                                 concurrent=kind != "sync"),
                             confidence=config.draft_confidence, serial_lookahead=config.serial_lookahead,
                             every_core=every_core, prefill_positions=input_ids.numel(),
                             runner_up=config.runner_up, probed_gain=probed,
                             probed_curve=curve)
    phase = recorder.phases
    pad = pad_token_tensor(generation_config)
    start = time.perf_counter()
    with BatchStreamer(streamer, batch.rows, None if pad is None else int(pad)) as stream, open_executor(
        kind, assistant_model, request, config.executor, input_ids.device
    ) as drafter:
        began = time.perf_counter()
        with phase("wait_first"):  # the draft's prefill and first speculations, on every core
            batch.hand(drafter.begin(input_ids, model_kwargs.get("attention_mask"), policy.first_depth()).result())
        policy.began(time.perf_counter() - began)
        while True:
            verified = policy.choose(batch.verifiable(generation_config.max_length, target.max_positions),
                                     rows=len(batch.active),
                                     confidence=[row.speculation.confidence for row in batch.active])
            depth = policy.depth(verified)
            budget = policy.budget(depth, recorder.tokens_per_round("cache"),
                                   recorder.tokens_per_round(backups.choice))
            with phase("wait_prepare"):  # a submission (inline with executor="sync": the whole task)
                preparing = drafter.prepare(verified, depth, budget)  # concurrent with the verification
            # the target runs on every core when the draft sits the verification out (a plain step, a serial round)
            # or only probes one token beside a plain step
            idle = depth == 0 or (verified == 0 and depth == 1)
            runner_up = policy.take_runner_up(verified, depth, lambda: target.runner_up_ready(batch),
                                              batch.active[0].speculation.confidence)
            prefill = target.first
            with recorder.verification():
                verdict = target.verify(batch, verified, target_generator, phase, drafter.target_cores, idle,
                                        runner_up)
            with phase("hand_off"):
                drafter.announce(verdict.accepted, verdict.bonus)
            policy.observe_verification(batch.active, verdict)
            with phase("emit"):
                emitted = batch.emit(verdict, recorder)
                stream.flush()
            keep = batch.retire()
            with phase("realign"):
                target.realign(verdict, emitted, keep)
            if prefill and not target.runner_up_possible():  # known once the cache exists; rows leaving keep it
                policy.runner_up_mode = "never"  # this target's cache or attention cannot take a sibling
            recorder.record_memory(kv_bytes(target.cache))
            if not batch.active:
                policy.observe_round(target.forward_seconds, drafter.timings(), 0, 0)
                break
            with phase("wait_prepare"):
                preparing.result()
            backup = backups.decide(recorder, drafter.timings(), len(batch.active))
            serial, stop = policy.just_in_time(batch.room(generation_config.max_length, target.max_positions))
            with phase("wait_resolve"):
                resolutions = drafter.resolve(verdict.accepted, verdict.bonus, verified, keep, backup, serial,
                                              stop, [i for i, won in enumerate(verdict.runner_up or ()) if won]
                                              ).result()
            for i, resolution in zip(keep, resolutions):
                if resolution.looked_up:
                    recorder.record_lookup(resolution.hit, verdict.accepted[i])
            policy.observe_round(target.forward_seconds, drafter.timings(), sum(r.hit for r in resolutions),
                                 sum(r.looked_up for r in resolutions))
            batch.hand([resolution.speculation for resolution in resolutions])
            if (steps := policy.plain_stretch()) and not _plain_stretch(
                    steps, policy, target, batch, drafter, recorder, stream, target_generator, lookup,
                    generation_config.max_length):
                break
        report = drafter.finish()  # stops a `prepare` still running for rows that have all finished
    metrics = _metrics(recorder, report, drafter, config, batch, backups, time.perf_counter() - start, policy,
                       lookup)
    model.ssd_metrics = metrics
    return _outputs(input_ids, batch, target, generation_config, metrics, pad)


def _plain_stretch(steps, policy, target, batch, drafter, recorder, stream, generator, lookup, max_length) -> bool:
    """Up to `steps` plain steps in a row with the draft paused (`LookaheadPolicy.plain_stretch`): verify nothing but,
    for one row, the context's own continuation where it pays (`prompt_lookup.py`), emit, realign — the round's other
    phases wait until the stretch ends or a row finishes, then the draft commits the steps at once (`sat_out`; a
    step's accepted lookup tokens as plain steps of their own). Each step's forward runs on every core. False when
    every row is done."""
    phase, rounds = recorder.phases, []
    for _ in range(steps):
        policy.plain_step()
        tokens = _lookup(lookup, policy, batch, target, max_length)
        if tokens:  # verified as the row's speculation for this step
            row = batch.active[0]
            held, row.speculation = row.speculation, lookup.speculation(tokens, row.ids.device)
        with recorder.verification():
            verdict = target.verify(batch, len(tokens), generator, phase, drafter.target_cores, draft_idle=True)
        with phase("emit"):
            emitted = batch.emit(verdict, recorder)
            stream.flush()
        if tokens:
            policy.lookup_step(len(tokens), verdict.accepted[0], lookup.acceptance.estimates())
            lookup.observe(len(tokens), verdict.accepted[0])
            row.speculation = held
        keep = batch.retire()
        rounds.extend(([(0, token)], 0, [0]) for token in tokens[:verdict.accepted[0]])
        rounds.append(([(0, bonus) for bonus in verdict.bonus], 0, keep))
        with phase("realign"):
            target.realign(verdict, emitted, keep)
        policy.observe_round(target.forward_seconds, None, 0, 0)
        if len(keep) < len(emitted):
            break
    recorder.record_memory(kv_bytes(target.cache))
    if not batch.active:
        return False
    with phase("wait_resolve"):
        resolutions = drafter.sat_out(rounds).result()
    batch.hand([resolution.speculation for resolution in resolutions])
    return True


def _lookup(lookup, policy, batch, target, max_length) -> list[int]:
    """The prompt lookup tokens this plain step verifies, [] for none (one row only: a batch's rows would propose
    different lengths)."""
    if not lookup.enabled or len(batch.active) != 1:
        return []
    proposal = lookup.propose(lookup.context(batch.active[0]), batch.room(max_length, target.max_positions))
    return proposal[:lookup.choose(proposal, *policy.lookup_costs())] if proposal else []


@contextlib.contextmanager
def _ending(streamer):
    try:
        yield
    except BaseException:
        if streamer is not None:
            streamer.end()
        raise


def _budget_adaptive(config: SSDConfig) -> bool:
    """Whether the fan-out budget is chosen per round (an explicit fan-out list is prepared whole)."""
    return config.fanout_budget_schedule == "adaptive" and not isinstance(config.fanout, list)


def _seeded_generator(device: torch.device) -> torch.Generator:
    """A generator on `device`, seeded from torch's global RNG (so `torch.manual_seed` reproduces a run)."""
    seed = int(torch.randint(0, 2**62, (1,)).item())
    return torch.Generator(device=device).manual_seed(seed)


def _draft_request(config: SSDConfig, do_sample: bool, logits_processor, vocab_size: int) -> DraftRequest:
    draft_threads, target_threads = split_threads(config.draft_threads, config.target_threads)
    seed = int(torch.randint(0, 2**62, (1,)).item())  # drawn after the target's: the same order as ever
    return DraftRequest(config.to_dict(), do_sample, sampling_warpers(logits_processor), vocab_size, seed,
                        draft_threads, target_threads)


def _metrics(recorder, report, drafter, config, batch, backups, wall_seconds, policy, lookup):
    recorder.generated = sum(len(row.generated) for row in batch.rows)
    local_threads = drafter.kind != "sync"
    return recorder.finish(
        **dataclasses.asdict(report),
        **policy.metrics(),
        **lookup.metrics(),
        draft_seconds=drafter.busy_seconds,
        wall_seconds=wall_seconds,
        branches=config.branches,
        backup=config.backup,  # "auto": see backup_decision and rounds_by_source for what ran
        backup_decision=dict(backups.decision),
        batch_size=len(batch.rows),
        executor=drafter.kind,
        draft_threads=drafter.request.draft_threads if local_threads else 0,
        target_threads=drafter.request.target_threads if local_threads else torch.get_num_threads(),
        worker_start_seconds=drafter.start_seconds,
        draft_load_seconds=drafter.load_seconds,
    )


def _outputs(input_ids, batch, target, generation_config, metrics, pad):
    sequences = assemble(input_ids, batch.rows, None if pad is None else int(pad))
    if not generation_config.return_dict_in_generate:
        return sequences
    fields = {f.name for f in dataclasses.fields(SSDGenerateDecoderOnlyOutput)}
    cache_field = "cache" if "cache" in fields else "past_key_values"
    return SSDGenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=steps([row.scores for row in batch.rows]) if batch.want_scores else None,
        logits=steps([row.logits for row in batch.rows]) if batch.want_logits else None,
        ssd_metrics=metrics,
        # At batch > 1 the cache's rows were realigned and finished ones dropped: it does not match `sequences`.
        **{cache_field: target.cache if len(batch.rows) == 1 else None},
    )


def _every_core(request) -> float:
    """The cores of a step on every core (the draft idle: `DraftExecutor.target_cores`) over the target's beside the
    working draft."""
    return (request.draft_threads + request.target_threads) / max(request.target_threads, 1)
