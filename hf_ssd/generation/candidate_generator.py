"""`SaguaroCandidateGenerator`: the draft side of SSD.

Per round, while the target verifies speculation S = [t_prev, s_1..s_K] of every batch row:
  1. glue: one draft forward over S appends its KV and yields K+1 logit rows (row j: "j tokens accepted");
  2. fork: glue row j proposes its top F_j tokens (s_{j+1} excluded) as bonus candidates, Σ F_j = B branches;
  3. tree: K draft forwards, each over all B branches of all batch rows at once (shared-prefix tree attention);
  4. the branches go into a `SpeculationCache` keyed by (batch row, k, bonus).
When the outcomes (k_i, bonus_i) arrive, `resolve` keeps each row's accepted glue slots (and its hit branch),
compacts the rows, drops finished ones, and returns per row the cached speculation (hit) or the backup's (miss).
Only tokens and q travel to the target, never KV. The draft's one-token-per-forward drafting (a serial round's
speculation, the draft backup's) is `just_in_time.py`; resolving after rounds the draft sat out (plain steps,
serial rounds) is `paused.py`.

It also implements transformers' `CandidateGenerator` interface (`get_candidates` / `update_candidate_strategy`),
so it can serve the stock assisted-decoding loop synchronously.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from ..cache.draft_cache import DraftCache, compiled_call, default_compile
from ..cache.speculation_cache import Resolution, Speculation, SpeculationCache, lookup_kind, plain_resolutions
from ..cache.tree_attention import causal_visibility, tree_step_positions, tree_step_visibility
from ..config import SSDConfig
from ..metrics import PhaseTimer
from .checks import model_vocab_size
from .confidence import StopRule
from .fanout import FanoutEstimator, fork_candidates
from .just_in_time import JustInTimeDrafting
from .paused import PausedDrafting
from .saguaro import draft_probs
from .warpers import sampling_warpers


@dataclass
class DraftTimings:
    """Running totals of the draft's work that `backup="auto"` decides from (T_p and T_b)."""

    prepare_calls: int = 0
    prepare_seconds: float = 0.0  # glue + fork + tree
    backup_calls: int = 0
    backup_seconds: float = 0.0  # just-in-time draft backups
    serial_calls: int = 0
    serial_seconds: float = 0.0  # speculations drafted after a verification the draft sat out (see `resolve`)
    serial_tokens: int = 0  # tokens those drafted per row
    backup_tokens: int = 0  # tokens the just-in-time draft backups drafted per row
    # of `serial_seconds`: the single-token forwards after the first token (which comes with the forward that feeds
    # the committed tokens): what one more token costs, apart from the fixed cost of a serial speculation
    serial_steps: int = 0
    serial_step_seconds: float = 0.0
    fastest_prepare: float = float("inf")  # seconds of the quickest prepare (a call's first pays cold starts)


@dataclass
class DraftReport:
    """What the drafter tells the metrics once a generation ends. Plain data: it may cross processes."""

    fanout_schedule: dict[str, list[int]]
    acceptance_estimate: dict[str, float]
    power_law_estimate: float
    hits_by_fanout: dict[int, list[int]]
    tree_steps_skipped: int
    draft_compact_seconds: float
    peak_draft_kv_bytes: int
    draft_phase_seconds: dict[str, float] = field(default_factory=dict)


class SaguaroCandidateGenerator(PausedDrafting, JustInTimeDrafting, CandidateGenerator):
    """Draft-side state machine of SSD for one generation of b rows (b shrinks as rows finish).

    Args:
        draft_model: the draft (assistant) model; must share the target's vocabulary.
        ssd_config: the SSD configuration (K, fan-out, Saguaro C, backup).
        do_sample: whether the target samples (q matters) or decodes greedily (q is one-hot).
        logits_processor: the target's processors; the sampling warpers among them shape q as well.
        vocab_size: the shared vocabulary size (default: the draft's).
        seed: seeds the draft's random generator (default: drawn from torch's global generator).
        check: called between draft forwards; raises to abandon the task (the executor's cancellation).
        announced: returns the verification outcomes of the round being prepared once the target knows them, else
            None; read between tree steps (default: what `announce` was last given).
    """

    def __init__(
        self,
        draft_model: torch.nn.Module,
        ssd_config: SSDConfig,
        do_sample: bool = False,
        logits_processor=None,
        vocab_size: int | None = None,
        seed: int | None = None,
        check=None,
        announced=None,
    ):
        self.model = draft_model
        self.config = ssd_config
        self.lookahead = ssd_config.lookahead
        self.do_sample = do_sample
        self.warpers = sampling_warpers(logits_processor)
        self.draft_vocab_size = model_vocab_size(draft_model)  # may differ from the target's by padding only
        self.vocab_size = vocab_size or self.draft_vocab_size
        self.estimator = FanoutEstimator.from_config(ssd_config, self.vocab_size)
        self.device = draft_model.device
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        # the lookahead policy conditions on the draft's confidence only with the adaptive schedule (greedy decoding
        # pays a softmax over the vocabulary per drafted token for it)
        self.track_confidence = ssd_config.tracks_confidence
        self.check = check or (lambda: None)
        self._announced = announced
        self.backup = "draft" if ssd_config.backup == "auto" else ssd_config.backup
        self.clock = PhaseTimer()  # the draft side's critical path (see `SSDMetrics.draft_phase_seconds`)
        self.timings = DraftTimings()
        self.cache = DraftCache(draft_model, timer=self.clock)
        self.schedules = self.estimator.schedules()
        self.contexts: list[list[int]] = []  # per row: committed tokens, t_prev included (for the n-gram backup)
        self.glue_start = torch.zeros(0, dtype=torch.long, device=self.device)  # [b] logical position of t_prev
        # [b, m]: tokens committed while the draft was paused (depth 0), not in the cache yet (they come before t_prev)
        self.unglued = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self.t_prev = torch.zeros(0, dtype=torch.long, device=self.device)  # [b]
        self.speculations: list[Speculation] = []  # the ones the target is verifying, one per row
        self.spec_cache: SpeculationCache | None = None
        self.main_len = 0  # draft cache slots before the tree (committed + glue, per row)
        self.fanout_in_use: list[list[int]] = []  # per row: the fan-out of the round being prepared
        self.outcomes: list[tuple[int, int]] | None = None  # per row (accepted, bonus), once verification is done
        self.depth = self.lookahead  # the length of the speculations being prepared
        self.skipped_tree_steps = 0
        self.peak_cache_bytes = 0  # largest draft KV held after a compaction (measured where the draft runs)
        self._round = 0
        self._base_seed = seed
        self._last_accepted: int | None = None

    @property
    def rows(self) -> int:
        return len(self.speculations)

    # --- sampling ---------------------------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, saguaro_top: int
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Tokens [...], q [..., V] when sampling (else None) and the draft's confidence in each token [...] (its top
        probability under greedy decoding, q of the token when sampling; None when not tracked) from draft logits
        [..., V]."""
        if not self.do_sample:
            top = logits.max(dim=-1)
            if not self.track_confidence:
                return top.indices, None, None
            confidence = (top.values.float() - logits.float().logsumexp(dim=-1)).exp()
            return top.indices, None, confidence
        probs = draft_probs(logits.reshape(-1, logits.shape[-1]), self.warpers, saguaro_top, self.config.saguaro_c)
        tokens = torch.multinomial(probs, 1, generator=self.generator)
        shape = logits.shape[:-1]
        confidence = probs.gather(-1, tokens).reshape(shape) if self.track_confidence else None
        return tokens.squeeze(-1).reshape(shape), probs.reshape(logits.shape), confidence

    def _saguaro_top(self, kind: str, position: int) -> int:
        """Candidates to down-weight at speculation position `position` (1-based): F_{position-1} plus the draft,
        where F is the schedule that will follow the speculation's verification (`kind`: "hit" for a tree branch,
        "miss" for a backup's); past K (a serial speculation running deeper) the last fork's."""
        schedule = self.schedules[kind]
        return schedule[min(position, len(schedule)) - 1] + 1

    def _reseed(self, phase: int) -> None:
        """Seed the draft's generator per round and phase, so the draws of a round never depend on how much work
        an earlier round skipped (see `announce`): the same seed gives the same output under every executor."""
        self.generator.manual_seed((self._base_seed + 2 * self._round + phase) % (2**63))

    def announce(self, outcomes: list[tuple[int, int]] | None) -> None:
        """Tell a running `prepare` each row's verified (accepted, bonus); it stops once no row's outcome is
        prepared. May be called from another thread: a plain attribute write, read between tree steps."""
        self.outcomes = outcomes

    def announced_outcomes(self) -> list[tuple[int, int]] | None:
        return self._announced() if self._announced is not None else self.outcomes

    def report(self) -> DraftReport:
        """The figures of this generation the metrics keep."""
        return DraftReport(
            fanout_schedule={kind: list(f) for kind, f in self.schedules.items()},
            acceptance_estimate={kind: self.estimator.acceptance(kind) for kind in self.schedules},
            power_law_estimate=self.estimator.power(),
            hits_by_fanout={f: list(v) for f, v in sorted(self.estimator.hits_by_f.items())},
            tree_steps_skipped=self.skipped_tree_steps,
            draft_compact_seconds=self.clock.seconds.get("compact", 0.0),
            peak_draft_kv_bytes=self.peak_cache_bytes,
            draft_phase_seconds=self.clock.totals(),
        )

    # --- round protocol ---------------------------------------------------------------------------------------
    def begin(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
              depth: int | None = None) -> list[Speculation]:
        """Prefill the left-padded prompts [b, T] (all but their last token) and draft every row's first
        speculation, `depth` tokens (default K); at depth 0 none: the first round is a plain step, the draft paused
        (`prepare`)."""
        with self.clock("begin"):
            return self._begin(input_ids, attention_mask, self.lookahead if depth is None else depth)

    def _begin(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, depth: int) -> list[Speculation]:
        ids = input_ids.to(self.device)
        rows, width = ids.shape
        valid = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else attention_mask.to(
            self.device
        ).bool()
        positions = (valid.long().cumsum(1) - 1).clamp_min(0)
        self.cache = self._new_cache(rows, width)
        if width > 1:
            head = width - 1
            visible = causal_visibility(self.cache.valid, head, valid[:, :head])
            self.cache.forward(ids[:, :head], positions[:, :head], visible, valid=valid[:, :head], logits_to_keep=1,
                               phase="prefill")
        self.contexts = [ids[r][valid[r]].tolist() for r in range(rows)]
        self.glue_start = positions[:, -1].clone()
        self.t_prev = ids[:, -1].clone()
        self.unglued = ids.new_zeros(rows, 0)
        if depth == 0:
            self.speculations = [resolution.speculation for resolution in plain_resolutions(rows, self.device)]
            return list(self.speculations)
        self.speculations = [None] * rows
        self._backup_speculations(list(range(rows)), "draft", min(depth, self.lookahead), phase="prefill")
        return list(self.speculations)

    def _new_cache(self, rows: int, width: int) -> DraftCache:
        """The draft's KV for `rows` prompts of `width` slots: growing layers, or with `compile_draft` fixed-capacity
        ones (room for the prompt, a round's glue and tree and 256 more tokens before it grows) whose steps of the
        widths a round uses — 1 (backup, pre-glued), 2 (a probe's glue), K+1 (glue) and B (tree) — run compiled."""
        vocab = dict(vocab_size=self.vocab_size, model_vocab_size=self.draft_vocab_size)
        if not self.config.compile_draft:
            return DraftCache(self.model, rows, timer=self.clock, **vocab)
        k, branches = self.lookahead, self.config.branches
        capacity = -(-(width + (k + 1) + k * branches + 256) // 256) * 256
        backend, mode = self.config.compile_backend, default_compile(self.device)[1]
        return DraftCache(self.model, rows, timer=self.clock, capacity=capacity,
                          compiled=compiled_call(self.model, backend, mode if backend == "inductor" else None),
                          compiled_widths=frozenset({1, 2, k + 1, branches}), **vocab)

    def _top(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's top-W tokens, W = branches + 1 (enough for any fork after skipping s_{j+1})."""
        return logits.topk(min(self.vocab_size, self.config.branches + 1), dim=-1).indices

    def _glue(self, speculations: list[Speculation]) -> torch.Tensor:
        """Append every row's [t_prev, s_1..s_n] to the draft cache (every row's speculation has n tokens); returns
        the top-W tokens of its n+1 glue rows [b, n+1, W].

        A row whose speculation carries `row_top` has [t_prev, s_1..s_{n-1}] cached already and needs s_n alone;
        when rows differ, those rows' first n glue queries are invisible dummies.
        """
        drafted = torch.stack([s.tokens for s in speculations]).to(self.device)
        k = drafted.shape[1]
        pre_glued = [s.row_top is not None for s in speculations]
        if self.unglued.shape[1]:  # after a pause: the tokens committed meanwhile go first, in the same forward
            caught_up = self.unglued.shape[1]
            glue = torch.cat([self.unglued, self.t_prev[:, None], drafted], dim=1)
            positions = self.glue_start[:, None] + torch.arange(-caught_up, k + 1, device=self.device)
            logits = self.cache.forward(glue, positions, causal_visibility(self.cache.valid, glue.shape[1]),
                                        logits_to_keep=k + 1, phase="glue")
            self.unglued = self.unglued[:, :0]
            return self._top(logits)
        if all(pre_glued):
            visible = causal_visibility(self.cache.valid, 1)
            logits = self.cache.forward(drafted[:, -1:], (self.glue_start + k)[:, None], visible, phase="glue")
            row_top = torch.stack([s.row_top.to(self.device) for s in speculations])
            return torch.cat([row_top, self._top(logits[:, -1:])], dim=1)
        glue = torch.cat([self.t_prev[:, None], drafted], dim=1)
        positions = self.glue_start[:, None] + torch.arange(k + 1, device=self.device)
        real = torch.ones_like(glue, dtype=torch.bool)
        pre = torch.tensor(pre_glued, device=self.device)
        real[pre, :k] = False
        top = self._top(self.cache.forward(glue, positions, causal_visibility(self.cache.valid, k + 1, real), real,
                                           phase="glue"))
        for r, spec in enumerate(speculations):
            if spec.row_top is not None:
                top[r, :k] = spec.row_top.to(self.device)
        return top

    def prepare(self, verified: int | None = None, depth: int | None = None,
                speculations: list[Speculation] | None = None, budget: int | None = None) -> None:
        """Glue, fork and tree-decode every branch of every row for the outcomes of verifying the first `verified`
        tokens (default: all) of `speculations` (default: the ones `begin` / `resolve` handed out last, which is
        what the target verifies), each branch `depth` tokens deep (default K: the next speculations' length),
        `budget` branches per row (default B, at most B: the round's fan-out budget, see `FanoutBudget`).
        `depth` 0 pauses the draft: no forward at all, the next speculations are empty (the target takes plain
        steps) and the tokens committed meanwhile are glued when a later `prepare` resumes.

        Outcomes are k = 0..verified accepted tokens plus a bonus: forks j < verified skip the drafted s_{j+1} (it
        would have been accepted), the last fork does not (s_{verified+1} was not verified). The tree's KV stays in
        the cache until `resolve`, which keeps each row's hit branch.
        """
        speculations = self.speculations if speculations is None else list(speculations)
        length = speculations[0].tokens.shape[0] if speculations else 0
        depth = self.lookahead if depth is None else max(0, min(depth, self.lookahead))
        with self.clock("prepare"):
            if depth == 0:  # paused: the target takes a plain step; nothing to glue or draft until resumed
                self.speculations, self.spec_cache, self.fanout_in_use, self.depth = speculations, None, [], 0
                return
            self._prepare(speculations, length if verified is None else verified, depth, budget)

    def _prepare(self, speculations: list[Speculation], verified: int, depth: int, budget: int | None) -> None:
        started = time.perf_counter()
        k = self.depth = depth
        self.speculations = speculations
        self.spec_cache = None
        self._reseed(0)
        self.check()
        row_top = self._glue(speculations)
        self.main_len = len(self.cache)
        self.fanout_in_use = [self.estimator.schedule(lookup_kind(s.source), verified, budget)
                               for s in speculations]
        fanout = torch.tensor(self.fanout_in_use, device=self.device)
        drafted = torch.stack([s.tokens for s in speculations]).to(self.device)
        forks, current, usable = fork_candidates(row_top[:, : verified + 1], drafted[:, :verified], fanout)
        rows, branches = current.shape
        row_ids = torch.arange(rows, device=self.device)[:, None].expand(rows, branches)
        prepared = {
            key for key, ok in zip(
                zip(row_ids.flatten().tolist(), forks.flatten().tolist(), current.flatten().tolist()),
                usable.flatten().tolist(),
            ) if ok
        }
        candidates = current
        main_valid = self.cache.valid[:, : self.main_len]
        main_pos = self.cache.positions[:, : self.main_len]
        tokens = torch.empty(rows, branches, k, dtype=torch.long, device=self.device)
        tops = torch.empty(rows, branches, k, row_top.shape[-1], dtype=torch.long, device=self.device)
        probs = torch.empty(rows, branches, k, self.vocab_size, device=self.device) if self.do_sample else None
        confidence = torch.empty(rows, branches, k, device=self.device) if self.track_confidence else None
        try:
            for step in range(1, k + 1):
                self.check()
                outcomes = self.announced_outcomes()
                if outcomes is not None and not any((r, *o) in prepared for r, o in enumerate(outcomes)):
                    self.skipped_tree_steps += k + 1 - step  # every row's outcome is a known miss: the rest is waste
                    return
                visible = tree_step_visibility(main_valid, main_pos, self.glue_start, forks, step)
                step_logits = self.cache.forward(current, tree_step_positions(self.glue_start, forks, step), visible,
                                                 phase="tree")
                tops[:, :, step - 1] = self._top(step_logits)
                current, q, sure = self._sample(step_logits, self._saguaro_top("hit", step))
                tokens[:, :, step - 1] = current
                if confidence is not None:
                    confidence[:, :, step - 1] = sure
                if probs is not None:
                    probs[:, :, step - 1] = q
            # Branch β's tree slots hold [candidate, s'_1..s'_{K-1}]: exactly the next glue's first K tokens.
            slots = self.main_len + branches * torch.arange(k, device=self.device)[None, :] + torch.arange(
                branches, device=self.device
            )[:, None]
            flat = rows * branches
            self.spec_cache = SpeculationCache(
                row_ids.reshape(flat), forks.reshape(flat), candidates.reshape(flat), tokens.reshape(flat, k),
                None if probs is None else probs.reshape(flat, k, -1), tops.reshape(flat, k, -1),
                slots.repeat(rows, 1), usable.reshape(flat),
                None if confidence is None else confidence.reshape(flat, k),
            )
        finally:
            seconds = time.perf_counter() - started
            self.timings.prepare_seconds += seconds
            self.timings.prepare_calls += 1
            self.timings.fastest_prepare = min(self.timings.fastest_prepare, seconds)

    def _commit(self, outcomes, accepted: torch.Tensor, keep_rows: list[int], selected: torch.Tensor) -> None:
        """Each kept row's committed path grows by its accepted tokens of the speculation just verified and its
        bonus (`contexts`); `glue_start` and `t_prev` move past them; rows not in `keep_rows` leave."""
        for r in keep_rows:
            acc, bonus = outcomes[r]
            self.contexts[r].extend(self.speculations[r].tokens[:acc].tolist())
            self.contexts[r].append(bonus)
        bonuses = torch.tensor([b for _, b in outcomes], device=self.device)
        self.glue_start = (self.glue_start + accepted + 1)[selected]
        self.t_prev = bonuses[selected]
        self.contexts = [self.contexts[r] for r in keep_rows]

    def resolve(
        self, outcomes: list[tuple[int, int]], verified: int, keep_rows: list[int] | None = None,
        backup: str | None = None, serial: int = 0, stop: StopRule | None = None, runner_up: list[int] = (),
    ) -> list[Resolution]:
        """Commit every row's outcome (accepted, bonus) and return the next speculation of each row in
        `keep_rows` (default: all; finished rows leave the batch): its cache hit, or on a miss the backup's
        (`backup`, default `self.backup`). After a verification the draft sat out (a `prepare` of depth 0) there
        is nothing to look up: the next speculation is empty (a plain step follows) or, with `serial` > 0, that
        many tokens the draft drafts now, just in time, as SD would (`SERIAL`). Drafting just in time (a serial
        speculation, the draft backup's) stops early where `stop` says (None: never; see `StopRule`). The rows in
        `runner_up` accepted the draft's runner-up in place of their first drafted token (`Speculation.runner_up`):
        only after a verification the draft sat out (`generation/runner_up.py`).

        The draft cache keeps, per row, the committed prefix plus the hit branch's tree slots; only the slots this
        round wrote move. Also feeds the fan-out estimator and snapshots the schedules for the next round; this
        runs strictly between two verifications, so every executor sees the same schedules.
        """
        with self.clock("resolve"):
            return self._resolve(outcomes, verified, keep_rows, backup or self.backup, serial, stop, runner_up)

    def _resolve(self, outcomes, verified, keep_rows, backup, serial=0, stop=None, runner_up=()) -> list[Resolution]:
        rows = self.rows
        keep_rows = list(range(rows)) if keep_rows is None else list(keep_rows)
        if self.depth == 0:
            return self._resolve_paused(outcomes, verified, keep_rows, serial, stop, runner_up)
        if runner_up:
            raise RuntimeError("a runner-up is verified only in rounds the draft sat out (its prepared outcomes "
                               "follow the first drafted token)")
        accepted = torch.tensor([a for a, _ in outcomes], device=self.device)
        keep = self.cache.valid.clone()
        keep[:, self.main_len :] = False
        keep &= self.cache.positions <= (self.glue_start + accepted)[:, None]
        found_by_row = []
        for r, (acc, bonus) in enumerate(outcomes):
            self.estimator.record_round(lookup_kind(self.speculations[r].source), acc, verified)
            candidates = self.fanout_in_use[r][acc] if self.fanout_in_use else 0
            found = self.spec_cache.lookup(r, acc, bonus) if self.spec_cache is not None else None
            if candidates:
                self.estimator.record_lookup(candidates, found is not None)
            if found is not None:
                keep[r, found.slots] = True
            found_by_row.append(found)
        selected = torch.tensor(keep_rows, dtype=torch.long, device=self.device)
        with self.clock("compact"):
            self.cache.keep(keep, None if len(keep_rows) == rows else selected, max_holes=self.lookahead)
        self.peak_cache_bytes = max(self.peak_cache_bytes, self.cache.memory_bytes())
        self._commit(outcomes, accepted, keep_rows, selected)
        self.unglued = self.unglued[selected]
        self.speculations = [found_by_row[r] for r in keep_rows]
        self.spec_cache = None
        self.fanout_in_use = []
        self.schedules = self.estimator.schedules()
        self._round += 1
        self._reseed(1)
        missed = [i for i, s in enumerate(self.speculations) if s is None]
        # a batch's speculations have one length: a backup stops early only when no row hit (hits run the full depth)
        self._backup_speculations(missed, backup, self.depth,
                                  stop=stop if len(missed) == len(self.speculations) else None)
        return [Resolution(self.speculations[i], found_by_row[r] is not None) for i, r in enumerate(keep_rows)]

    # --- transformers' CandidateGenerator interface (synchronous, batch 1) --------------------------------------
    def get_candidates(self, input_ids: torch.LongTensor, **kwargs):
        """Next speculation appended to `input_ids`, with log q as candidate logits when sampling."""
        if input_ids.shape[0] != 1:
            raise ValueError(f"transformers' assisted loop runs batch size 1; got {input_ids.shape[0]} rows.")
        if not self.speculations:
            spec = self.begin(input_ids, None)[0]
        else:
            outcome = [(self._last_accepted, int(input_ids[0, -1]))]
            spec = self.resolve(outcome, self.lookahead)[0].speculation
        self.prepare(self.lookahead)
        candidate_ids = torch.cat([input_ids, spec.tokens[None].to(input_ids.device)], dim=-1)
        logits = None if spec.probs is None else spec.probs.log()[None]
        return candidate_ids, logits

    @property
    def num_drafting_tokens(self) -> int:
        """Tokens drafted per iteration at most (transformers >= 5.25 sizes the target cache's rollback by it)."""
        return self.lookahead

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        self._last_accepted = int(num_matches)
