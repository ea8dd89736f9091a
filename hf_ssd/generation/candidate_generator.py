"""`SaguaroCandidateGenerator`: the draft side of SSD.

Per round, while the target verifies speculation S = [t_prev, s_1..s_K] of every batch row:
  1. glue: one draft forward over S appends its KV and yields K+1 logit rows (row j: "j tokens accepted");
  2. fork: glue row j proposes its top F_j tokens (s_{j+1} excluded) as bonus candidates, Σ F_j = B branches;
  3. tree: K draft forwards, each over all B branches of all batch rows at once (shared-prefix tree attention);
  4. the branches go into a `SpeculationCache` keyed by (batch row, k, bonus).
When the outcomes (k_i, bonus_i) arrive, `resolve` keeps each row's accepted glue slots (and its hit branch),
compacts the rows, drops finished ones, and returns per row the cached speculation (hit) or the backup's (miss).
Only tokens and q travel to the target, never KV.

It also implements transformers' `CandidateGenerator` interface (`get_candidates` / `update_candidate_strategy`),
so it can serve the stock assisted-decoding loop synchronously.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from ..cache.alignment import compact
from ..cache.draft_cache import DraftCache
from ..cache.speculation_cache import Speculation, SpeculationCache
from ..cache.tree_attention import causal_visibility, tree_step_positions, tree_step_visibility
from ..config import SSDConfig
from .backup import backup_speculation
from .fanout import FanoutEstimator, fork_candidates
from .saguaro import draft_probs

# Sampling warpers that act on scores alone; the draft applies exactly these (in the target's order) to q.
SAMPLING_WARPERS = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TopHLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
)


@dataclass
class Resolution:
    """The speculation for a row's next round and how it was found."""

    speculation: Speculation
    hit: bool
    candidates: int  # branches that had been prepared at the outcome's fork


class SaguaroCandidateGenerator(CandidateGenerator):
    """Draft-side state machine of SSD for one generation of b rows (b shrinks as rows finish).

    Args:
        draft_model: the draft (assistant) model; must share the target's vocabulary.
        ssd_config: the SSD configuration.
        do_sample: whether the target samples (q matters) or decodes greedily (q is one-hot).
        logits_processor: the target's processors; the sampling warpers among them shape q as well.
        vocab_size: the shared vocabulary size.
        estimator: the fan-out estimator shared with the decoding loop.
        generator: the draft's own random generator (on the draft's device).
        check: called between draft forwards; raises to abandon work (see `DraftRuntime.check`).
    """

    def __init__(
        self,
        draft_model: torch.nn.Module,
        ssd_config: SSDConfig,
        do_sample: bool,
        logits_processor,
        vocab_size: int,
        estimator: FanoutEstimator,
        generator: torch.Generator | None = None,
        check=None,
    ):
        self.model = draft_model
        self.config = ssd_config
        self.lookahead = ssd_config.lookahead
        self.do_sample = do_sample
        self.warpers = [p for p in (logits_processor or []) if isinstance(p, SAMPLING_WARPERS)]
        self.vocab_size = vocab_size
        self.estimator = estimator
        self.device = draft_model.device
        self.generator = generator if generator is not None else torch.Generator(device=self.device)
        self.check = check or (lambda: None)
        self.backup = "draft" if ssd_config.backup == "auto" else ssd_config.backup
        self.cache = DraftCache(draft_model)
        self.schedules = estimator.schedules()
        self.contexts: list[list[int]] = []  # per row: committed tokens, t_prev included (for the n-gram backup)
        self.glue_start = torch.zeros(0, dtype=torch.long, device=self.device)  # [b] logical position of t_prev
        self.t_prev = torch.zeros(0, dtype=torch.long, device=self.device)  # [b]
        self.speculations: list[Speculation] = []  # the ones the target is verifying, one per row
        self.spec_cache: SpeculationCache | None = None
        self.main_len = 0  # draft cache slots before the tree (committed + glue, per row)
        self.fanout_in_use: list[list[int]] = []  # per row: the fan-out of the round being prepared
        self.outcomes: list[tuple[int, int]] | None = None  # per row (accepted, bonus), once verification is done
        self.skipped_tree_steps = 0
        self.backup_seconds = 0.0  # wall time of just-in-time draft backups (T_b for the auto backup)
        self.backup_calls = 0
        self.prepare_seconds = 0.0  # wall time of glue + fork + tree (T_p)
        self.prepare_calls = 0
        self.compact_seconds = 0.0  # wall time of the per-round draft-cache compaction in `resolve`
        self.peak_cache_bytes = 0  # largest draft KV held after a compaction (measured on the draft's own thread)
        self._round = 0
        self._base_seed = self.generator.initial_seed()
        self._last_accepted: int | None = None

    @property
    def rows(self) -> int:
        return len(self.speculations)

    # --- sampling ---------------------------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, saguaro_top: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens [...] (and q [..., V] when sampling) from draft logits [..., V]."""
        if not self.do_sample:
            return logits.argmax(dim=-1), None
        probs = draft_probs(logits.reshape(-1, logits.shape[-1]), self.warpers, saguaro_top, self.config.saguaro_c)
        tokens = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
        return tokens.reshape(logits.shape[:-1]), probs.reshape(logits.shape)

    def _saguaro_top(self, kind: str, position: int) -> int:
        """Candidates to down-weight at speculation position `position` (1-based): F_{position-1} plus the draft."""
        return self.schedules[kind][position - 1] + 1

    def _reseed(self, phase: int) -> None:
        """Seed the draft's generator per round and phase, so the draws of a round never depend on how much work
        an earlier round skipped (see `announce`): the same seed gives the same output under every executor."""
        self.generator.manual_seed((self._base_seed + 2 * self._round + phase) % (2**63))

    def announce(self, outcomes: list[tuple[int, int]] | None) -> None:
        """Tell a running `prepare` each row's verified (accepted, bonus); it stops once no row's outcome is
        prepared. Called from the decoding loop's thread; a plain attribute write, read between tree steps."""
        self.outcomes = outcomes

    # --- round protocol ---------------------------------------------------------------------------------------
    def begin(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[Speculation]:
        """Prefill the left-padded prompts [b, T] (all but their last token) and draft every row's first
        speculation."""
        ids = input_ids.to(self.device)
        rows, width = ids.shape
        valid = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else attention_mask.to(
            self.device
        ).bool()
        positions = (valid.long().cumsum(1) - 1).clamp_min(0)
        self.cache = DraftCache(self.model, rows)
        if width > 1:
            head = width - 1
            visible = causal_visibility(self.cache.valid, head, valid[:, :head])
            self.cache.forward(ids[:, :head], positions[:, :head], visible, valid=valid[:, :head], logits_to_keep=1)
        self.contexts = [ids[r][valid[r]].tolist() for r in range(rows)]
        self.glue_start = positions[:, -1].clone()
        self.t_prev = ids[:, -1].clone()
        self.speculations = [None] * rows
        self._backup_speculations(list(range(rows)), "draft")
        return list(self.speculations)

    def _top(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's top-W tokens, W = branches + 1 (enough for any fork after skipping s_{j+1})."""
        return logits.topk(min(self.vocab_size, self.config.branches + 1), dim=-1).indices

    def _draft_just_in_time(self, missed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The draft model's own speculation for the rows in `missed` [b] (bool): K single-token forwards.

        The other rows ride along as invisible dummies (one forward serves the whole batch). The real rows' KV stays
        in the cache and their top tokens travel with the speculation, so the next glue forward only has to run
        the last drafted token. Returns tokens [b, K], q [b, K, V] or None, row_top [b, K, W].
        """
        token = self.t_prev.clone()
        tokens, probs, tops = [], [], []
        for i in range(self.lookahead):
            self.check()
            visible = causal_visibility(self.cache.valid, 1, missed[:, None])
            logits = self.cache.forward(token[:, None], (self.glue_start + i)[:, None], visible, valid=missed[:, None])
            tops.append(self._top(logits[:, -1]))
            token, q = self._sample(logits[:, -1], self._saguaro_top("backup", i + 1))
            tokens.append(token)
            probs.append(q)
        stacked = torch.stack(probs, dim=1) if self.do_sample else None
        return torch.stack(tokens, dim=1), stacked, torch.stack(tops, dim=1)

    def _backup_speculations(self, rows: list[int], backup: str) -> None:
        """Fill `self.speculations[r]` for the rows that missed, with `backup`."""
        if not rows:
            return
        if backup == "draft":
            started = time.perf_counter()
            missed = torch.zeros(self.rows, dtype=torch.bool, device=self.device)
            missed[rows] = True
            tokens, probs, tops = self._draft_just_in_time(missed)
            for r in rows:
                self.speculations[r] = Speculation(
                    tokens[r], None if probs is None else probs[r], "draft", row_top=tops[r]
                )
            self.backup_seconds += time.perf_counter() - started
            self.backup_calls += 1
            return
        for r in rows:
            tokens, probs = backup_speculation(
                self.contexts[r], self.lookahead, self.vocab_size, self.generator, self.device,
                self.config.ngram_max if backup == "ngram" else None, self.do_sample,
            )
            self.speculations[r] = Speculation(tokens, probs, backup)

    def _glue(self, speculations: list[Speculation]) -> torch.Tensor:
        """Append every row's [t_prev, s_1..s_K] to the draft cache; returns the top-W tokens of its K+1 glue rows
        [b, K+1, W].

        A row whose speculation carries `row_top` has [t_prev, s_1..s_{K-1}] cached already and needs s_K alone;
        when rows differ, those rows' first K glue queries are invisible dummies.
        """
        k = self.lookahead
        drafted = torch.stack([s.tokens for s in speculations]).to(self.device)
        pre_glued = [s.row_top is not None for s in speculations]
        if all(pre_glued):
            visible = causal_visibility(self.cache.valid, 1)
            logits = self.cache.forward(drafted[:, -1:], (self.glue_start + k)[:, None], visible)
            row_top = torch.stack([s.row_top.to(self.device) for s in speculations])
            return torch.cat([row_top, self._top(logits[:, -1:])], dim=1)
        glue = torch.cat([self.t_prev[:, None], drafted], dim=1)
        positions = self.glue_start[:, None] + torch.arange(k + 1, device=self.device)
        real = torch.ones_like(glue, dtype=torch.bool)
        pre = torch.tensor(pre_glued, device=self.device)
        real[pre, :k] = False
        top = self._top(self.cache.forward(glue, positions, causal_visibility(self.cache.valid, k + 1, real), real))
        for r, spec in enumerate(speculations):
            if spec.row_top is not None:
                top[r, :k] = spec.row_top.to(self.device)
        return top

    def prepare(self, speculations: list[Speculation]) -> None:
        """Glue, fork and tree-decode every branch of every row for the outcomes of verifying `speculations`.

        The tree's KV stays in the cache until `resolve`, which keeps each row's hit branch.
        """
        started = time.perf_counter()
        k = self.lookahead
        self.speculations = list(speculations)
        self.spec_cache = None
        self._reseed(0)
        self.check()
        row_top = self._glue(speculations)
        self.main_len = len(self.cache)
        kinds = ["primary" if s.is_primary else "backup" for s in speculations]
        self.fanout_in_use = [self.schedules[kind] for kind in kinds]
        fanout = torch.tensor(self.fanout_in_use, device=self.device)
        drafted = torch.stack([s.tokens for s in speculations]).to(self.device)
        forks, current, usable = fork_candidates(row_top, drafted, fanout)
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
        for step in range(1, k + 1):
            self.check()
            outcomes = self.outcomes
            if outcomes is not None and not any((r, *o) in prepared for r, o in enumerate(outcomes)):
                self.skipped_tree_steps += k + 1 - step  # every row's outcome is a known miss: the rest is waste
                self.prepare_seconds += time.perf_counter() - started
                self.prepare_calls += 1
                return
            visible = tree_step_visibility(main_valid, main_pos, self.glue_start, forks, step)
            step_logits = self.cache.forward(current, tree_step_positions(self.glue_start, forks, step), visible)
            tops[:, :, step - 1] = self._top(step_logits)
            current, q = self._sample(step_logits, self._saguaro_top("primary", step))
            tokens[:, :, step - 1] = current
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
        )
        self.prepare_seconds += time.perf_counter() - started
        self.prepare_calls += 1

    def resolve(
        self, outcomes: list[tuple[int, int]], verified: int, keep_rows: list[int] | None = None
    ) -> list[Resolution]:
        """Commit every row's outcome (accepted, bonus) and return the next speculation of each row in
        `keep_rows` (default: all; finished rows leave the batch): its cache hit, or the backup's.

        The draft cache keeps, per row, the committed prefix plus the hit branch's tree slots, compacted against a
        common right edge. Also feeds the fan-out estimator and snapshots the schedules for the next round; this
        runs strictly between two verifications, so every executor sees the same schedules.
        """
        rows = self.rows
        keep_rows = list(range(rows)) if keep_rows is None else list(keep_rows)
        accepted = torch.tensor([a for a, _ in outcomes], device=self.device)
        keep = self.cache.valid.clone()
        keep[:, self.main_len :] = False
        keep &= self.cache.positions <= (self.glue_start + accepted)[:, None]
        found_by_row, candidates_by_row = [], []
        for r, (acc, bonus) in enumerate(outcomes):
            spec = self.speculations[r]
            self.estimator.record_round("primary" if spec.is_primary else "backup", acc, verified)
            candidates = self.fanout_in_use[r][acc] if self.fanout_in_use else 0
            found = self.spec_cache.lookup(r, acc, bonus) if self.spec_cache is not None else None
            if candidates:
                self.estimator.record_lookup(candidates, found is not None)
            if found is not None:
                keep[r, found.slots] = True
            found_by_row.append(found)
            candidates_by_row.append(candidates)
        compact_start = time.perf_counter()
        selected = torch.tensor(keep_rows, dtype=torch.long, device=self.device)
        index, valid = compact(keep[selected])
        self.cache.keep(index, valid, None if len(keep_rows) == rows else selected)
        self.compact_seconds += time.perf_counter() - compact_start
        self.peak_cache_bytes = max(self.peak_cache_bytes, self.cache.memory_bytes())
        for r in keep_rows:
            acc, bonus = outcomes[r]
            self.contexts[r].extend(self.speculations[r].tokens[:acc].tolist())
            self.contexts[r].append(bonus)
        bonuses = torch.tensor([b for _, b in outcomes], device=self.device)
        self.glue_start = (self.glue_start + accepted + 1)[selected]
        self.t_prev = bonuses[selected]
        self.contexts = [self.contexts[r] for r in keep_rows]
        self.speculations = [found_by_row[r] for r in keep_rows]
        self.spec_cache = None
        self.fanout_in_use = []
        self.schedules = self.estimator.schedules()
        self._round += 1
        self._reseed(1)
        self._backup_speculations([i for i, s in enumerate(self.speculations) if s is None], self.backup)
        return [
            Resolution(self.speculations[i], found_by_row[r] is not None, candidates_by_row[r])
            for i, r in enumerate(keep_rows)
        ]

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
        self.prepare([spec])
        candidate_ids = torch.cat([input_ids, spec.tokens[None].to(input_ids.device)], dim=-1)
        logits = None if spec.probs is None else spec.probs.log()[None]
        return candidate_ids, logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        self._last_accepted = int(num_matches)
