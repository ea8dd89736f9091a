"""`SaguaroCandidateGenerator`: the draft side of SSD.

Per round, while the target verifies speculation S = [t_prev, s_1..s_K]:
  1. glue: one draft forward over S appends its KV and yields K+1 logit rows (row j: "j tokens accepted");
  2. fork: row j proposes its top F_j tokens (s_{j+1} excluded) as bonus candidates, Σ F_j = B branches;
  3. tree: K draft forwards, each over all B branches at once on the shared prefix (tree attention);
  4. the branches go into a `SpeculationCache` keyed by (row, k, bonus).
When the outcome (k, bonus) arrives, `resolve` keeps the accepted glue slots and returns the cached
speculation (hit) or asks the backup (miss). Only tokens and q travel to the target, never KV.

It also implements transformers' `CandidateGenerator` interface (`get_candidates` / `update_candidate_strategy`),
so it can serve the stock assisted-decoding loop synchronously.
"""

from __future__ import annotations

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
    """The speculation for the next round and how it was found."""

    speculation: Speculation
    hit: bool
    candidates: int  # branches that had been prepared at the outcome's fork


class SaguaroCandidateGenerator(CandidateGenerator):
    """Draft-side state machine of SSD for one generation (batch 1).

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
        self.context: list[int] = []  # committed tokens, t_prev included (for the n-gram backup)
        self.prefix_len = 0  # draft cache slots holding committed tokens (all but t_prev)
        self.glue_start = 0  # logical position of t_prev
        self.t_prev = 0
        self.speculation: Speculation | None = None  # the one the target is verifying
        self.spec_cache: SpeculationCache | None = None
        self.fanout_in_use: list[int] = []  # the fan-out of the round being prepared
        self.outcome: tuple[int, int] | None = None  # (accepted, bonus), announced once verification is done
        self.skipped_tree_steps = 0
        self._round = 0
        self._base_seed = self.generator.initial_seed()
        self._last_accepted: int | None = None

    # --- sampling ---------------------------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, saguaro_top: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens [N] (and q [N, V] when sampling) from draft logits [N, V]."""
        if not self.do_sample:
            return logits.argmax(dim=-1), None
        probs = draft_probs(logits, self.warpers, saguaro_top, self.config.saguaro_c)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1), probs

    def _saguaro_top(self, kind: str, position: int) -> int:
        """Candidates to down-weight at speculation position `position` (1-based): F_{position-1} plus the draft."""
        return self.schedules[kind][position - 1] + 1

    def _reseed(self, phase: int) -> None:
        """Seed the draft's generator per round and phase, so the draws of a round never depend on how much work
        an earlier round skipped (see `announce`): the same seed gives the same output under every executor."""
        self.generator.manual_seed((self._base_seed + 2 * self._round + phase) % (2**63))

    def announce(self, outcome: tuple[int, int] | None) -> None:
        """Tell a running `prepare` the verified (accepted, bonus); it stops once that outcome is not prepared.

        Called from the decoding loop's thread; a plain attribute write, read by the tree loop between steps.
        """
        self.outcome = outcome

    # --- round protocol ---------------------------------------------------------------------------------------
    def begin(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> Speculation:
        """Prefill the prompt (all but its last token) and draft the first speculation."""
        ids = input_ids[0].to(self.device)
        valid = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else attention_mask[0].to(
            self.device
        ).bool()
        positions = (valid.long().cumsum(0) - 1).clamp_min(0)
        if ids.shape[0] > 1:
            head = ids.shape[0] - 1
            visible = causal_visibility(self.cache.valid, head) & valid[None, :head]
            self.cache.forward(ids[:head], positions[:head], visible, valid=valid[:head], logits_to_keep=1)
        self.context = ids[valid].tolist()
        self.prefix_len = ids.shape[0] - 1
        self.glue_start = int(positions[-1])
        self.t_prev = int(ids[-1])
        self.speculation = self._draft_just_in_time()
        return self.speculation

    def _top(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's top-W tokens per row, W = branches + 1 (enough for any fork after skipping s_{j+1})."""
        return logits.topk(min(self.vocab_size, self.config.branches + 1), dim=-1).indices

    def _draft_just_in_time(self) -> Speculation:
        """The draft model's own speculation from the committed state: K single-token forwards.

        Their KV stays in the cache and their top tokens travel with the speculation, so the next glue forward
        only has to run the last drafted token.
        """
        token = torch.tensor([self.t_prev], device=self.device)
        tokens, probs, tops = [], [], []
        for i in range(self.lookahead):
            self.check()
            visible = causal_visibility(self.cache.valid, 1)
            logits = self.cache.forward(token, torch.tensor([self.glue_start + i], device=self.device), visible)
            tops.append(self._top(logits[-1:]))
            token, q = self._sample(logits[-1:], self._saguaro_top("backup", i + 1))
            tokens.append(token)
            probs.append(q)
        stacked = torch.cat(probs) if self.do_sample else None
        return Speculation(torch.cat(tokens), stacked, "draft", row_top=torch.cat(tops))

    def _backup_speculation(self) -> Speculation:
        if self.backup == "draft":
            return self._draft_just_in_time()
        tokens, probs = backup_speculation(
            self.context, self.lookahead, self.vocab_size, self.generator, self.device,
            self.config.ngram_max if self.backup == "ngram" else None, self.do_sample,
        )
        return Speculation(tokens, probs, self.backup)

    def _glue(self, speculation: Speculation) -> torch.Tensor:
        """Append [t_prev, s_1..s_K] to the draft cache; returns the top-W tokens of its K+1 rows [K+1, W]."""
        k = self.lookahead
        drafted = speculation.tokens.to(self.device)
        if speculation.row_top is not None:  # [t_prev, s_1..s_{K-1}] are cached already: run s_K alone
            position = torch.tensor([self.glue_start + k], device=self.device)
            logits = self.cache.forward(drafted[-1:], position, causal_visibility(self.cache.valid, 1))
            return torch.cat([speculation.row_top.to(self.device), self._top(logits)])
        glue = torch.cat([torch.tensor([self.t_prev], device=self.device), drafted])
        positions = self.glue_start + torch.arange(k + 1, device=self.device)
        return self._top(self.cache.forward(glue, positions, causal_visibility(self.cache.valid, k + 1)))

    def prepare(self, speculation: Speculation) -> None:
        """Glue, fork and tree-decode every branch for the outcomes of verifying `speculation`.

        The tree's KV stays in the cache until `resolve`, which keeps the branch that hits.
        """
        k = self.lookahead
        self.speculation = speculation
        self.spec_cache = None
        self._reseed(0)
        self.check()
        row_top = self._glue(speculation)
        kind = "primary" if speculation.is_primary else "backup"
        self.fanout_in_use = self.schedules[kind]
        fanout = torch.tensor(self.fanout_in_use, device=self.device)
        forks, current = fork_candidates(row_top, speculation.tokens.to(self.device), fanout)
        prepared = set(zip(forks.tolist(), current.tolist()))
        candidates = current
        branches = current.shape[0]

        prefix_valid = self.cache.valid[: self.prefix_len]
        base = self.prefix_len + k + 1
        tokens = torch.empty(branches, k, dtype=torch.long, device=self.device)
        tops = torch.empty(branches, k, row_top.shape[1], dtype=torch.long, device=self.device)
        probs = torch.empty(branches, k, self.vocab_size, device=self.device) if self.do_sample else None
        for step in range(1, k + 1):
            self.check()
            outcome = self.outcome
            if outcome is not None and outcome not in prepared:  # a known miss: the rest of the tree is waste
                self.skipped_tree_steps += k + 1 - step
                return
            visible = tree_step_visibility(prefix_valid, forks, k + 1, step)
            step_logits = self.cache.forward(current, tree_step_positions(self.glue_start, forks, step), visible)
            tops[:, step - 1] = self._top(step_logits)
            current, q = self._sample(step_logits, self._saguaro_top("primary", step))
            tokens[:, step - 1] = current
            if probs is not None:
                probs[:, step - 1] = q
        # Branch b's tree slots hold [candidate, s'_1..s'_{K-1}]: exactly the next glue's first K tokens.
        slots = base + branches * torch.arange(k, device=self.device)[None, :] + torch.arange(
            branches, device=self.device
        )[:, None]
        self.spec_cache = SpeculationCache(torch.zeros_like(forks), forks, candidates, tokens, probs, tops, slots)

    def resolve(self, accepted: int, bonus: int, verified: int) -> Resolution:
        """Commit the outcome of the round and return the next speculation (cache hit or backup).

        On a hit the cache keeps the committed prefix plus the hit branch's tree slots; on a miss it is cropped
        to the committed prefix. Also feeds the fan-out estimator and snapshots the schedules for the next
        round; this runs strictly between two verifications, so every executor sees the same schedules.
        """
        spec = self.speculation
        kind = "primary" if spec.is_primary else "backup"
        self.estimator.record_round(kind, accepted, verified)
        committed = self.prefix_len + accepted + 1
        candidates = self.fanout_in_use[accepted] if self.fanout_in_use else 0
        found = self.spec_cache.lookup(0, accepted, bonus) if self.spec_cache is not None else None
        if candidates:
            self.estimator.record_lookup(candidates, found is not None)
        if found is not None:
            self.cache.keep(torch.cat([torch.arange(committed, device=self.device), found.slots]))
        else:
            self.cache.crop(committed)
        self.context.extend(spec.tokens[:accepted].tolist())
        self.context.append(bonus)
        self.prefix_len = committed
        self.glue_start += accepted + 1
        self.t_prev = bonus
        self.spec_cache = None
        self.fanout_in_use = []
        self.schedules = self.estimator.schedules()
        self._round += 1
        self._reseed(1)
        self.speculation = found if found is not None else self._backup_speculation()
        return Resolution(self.speculation, found is not None, candidates)

    # --- transformers' CandidateGenerator interface (synchronous) ----------------------------------------------
    def get_candidates(self, input_ids: torch.LongTensor, **kwargs):
        """Next speculation appended to `input_ids`, with log q as candidate logits when sampling."""
        if self.speculation is None:
            spec = self.begin(input_ids, None)
        else:
            spec = self.resolve(self._last_accepted, int(input_ids[0, -1]), self.lookahead).speculation
        self.prepare(spec)
        candidate_ids = torch.cat([input_ids, spec.tokens[None].to(input_ids.device)], dim=-1)
        logits = None if spec.probs is None else spec.probs.log()[None]
        return candidate_ids, logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        self._last_accepted = int(num_matches)
