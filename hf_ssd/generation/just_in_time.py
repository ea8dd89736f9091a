"""The draft's own drafting just in time, one token per forward for the rows that need it: a serial round's
speculation (drafted after the verification, when its outcome is known), the draft backup's on a cache miss, and
feeding the committed tokens the draft cache lacks before either. Token by token it may stop early where the rows
drafting do not expect their next token to pay, on average (`StopRule`).

A mixin of `SaguaroCandidateGenerator`: it reads the generator's draft cache (`cache`), per-row state (`t_prev`,
`glue_start`, `contexts`, `speculations`), sampling (`_sample`, `_saguaro_top`, `_top`) and timings."""

from __future__ import annotations

import time

import torch

from ..cache.speculation_cache import Speculation
from ..cache.tree_attention import causal_visibility
from .backup import backup_speculation
from .confidence import StopRule


class JustInTimeDrafting:
    """Drafting one token per forward for some rows, the others riding along as invisible dummies (see the module
    docstring)."""

    def _draft_just_in_time(self, missed: torch.Tensor, length: int, phase: str, first: torch.Tensor | None = None,
                            stop: StopRule | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """The draft model's own speculation of up to `length` tokens for the rows in `missed` [b] (bool): that many
        single-token forwards (one fewer when `first` [b, V] holds the logits after t_prev, already fed), fewer where
        `stop` says the rows drafting do not expect their next token to pay (at least one token; see `StopRule`).

        The other rows ride along as invisible dummies (one forward serves the whole batch). The real rows' KV stays
        in the cache and their top tokens travel with the speculation, so the next glue forward only has to run
        the last drafted token. Returns tokens [b, n], q [b, n, V] or None, row_top [b, n, W], confidence [b, n] (or
        None when not tracked).
        """
        token = self.t_prev.clone()
        tokens, probs, tops, confidences = [], [], [], []
        reach = torch.ones(missed.shape[0], device=self.device)
        for i in range(length):
            self.check()
            if i == 0 and first is not None:
                logits = first[:, None]
            else:
                visible = causal_visibility(self.cache.valid, 1, missed[:, None])
                logits = self.cache.forward(token[:, None], (self.glue_start + i)[:, None], visible,
                                            valid=missed[:, None], phase=phase)
            tops.append(self._top(logits[:, -1]))
            token, q, confidence = self._sample(logits[:, -1], self._saguaro_top("miss", i + 1))
            tokens.append(token)
            probs.append(q)
            confidences.append(confidence)
            if stop is not None and confidence is not None and i + 1 < length:
                going, reach = stop.keeps_going(reach, confidence, missed, i + 1)
                if not going:
                    break
        stacked = torch.stack(probs, dim=1) if self.do_sample else None
        confidence = torch.stack(confidences, dim=1) if confidences[0] is not None else None
        return torch.stack(tokens, dim=1), stacked, torch.stack(tops, dim=1), confidence

    def _backup_speculations(self, rows: list[int], backup: str, length: int, phase: str = "backup",
                             stop: StopRule | None = None) -> None:
        """Fill `self.speculations[r]` for the rows that missed, with `length` tokens of `backup` (its forwards
        timed as `phase`; the draft's may stop early, see `_draft_just_in_time`)."""
        if not rows:
            return
        if backup == "draft":
            started = time.perf_counter()
            missed = torch.zeros(self.rows, dtype=torch.bool, device=self.device)
            missed[rows] = True
            tokens, probs, tops, confidence = self._draft_just_in_time(missed, length, phase, stop=stop)
            for r in rows:
                self.speculations[r] = Speculation(
                    tokens[r], None if probs is None else probs[r], "draft", row_top=tops[r],
                    confidence=None if confidence is None else confidence[r],
                )
            self.timings.backup_seconds += time.perf_counter() - started
            self.timings.backup_calls += 1
            self.timings.backup_tokens += tokens.shape[1]
            return
        for r in rows:
            tokens, probs = backup_speculation(
                self.contexts[r], length, self.vocab_size, self.generator, self.device,
                self.config.ngram_max if backup == "ngram" else None, self.do_sample,
            )
            self.speculations[r] = Speculation(tokens, probs, backup)

    def _uncached(self, through_t_prev: bool) -> list[list[int]]:
        """Per row, the committed tokens the draft cache lacks (it holds a prefix of the committed path), up to the
        one before t_prev, or up to t_prev itself."""
        valid = self.cache.valid
        held = torch.where(valid, self.cache.positions + 1, torch.zeros_like(self.cache.positions))
        held = held.amax(dim=1).tolist() if held.shape[1] else [0] * len(self.contexts)
        end = (self.glue_start + int(through_t_prev)).tolist()
        return [context[h:e] for context, h, e in zip(self.contexts, held, end)]

    def _feed(self, missing: list[list[int]], through_t_prev: bool, phase: str) -> torch.Tensor | None:
        """Append every row's `missing` tokens (ending just before t_prev, or with it) in one forward, rows with
        fewer as invisible dummies first; returns the logits after each row's last one [b, V] (None if nothing
        was missing)."""
        width = max(len(m) for m in missing)
        if width == 0:
            return None
        self.check()
        rows = len(missing)
        tokens = torch.zeros(rows, width, dtype=torch.long, device=self.device)
        real = torch.zeros(rows, width, dtype=torch.bool, device=self.device)
        last = self.glue_start if through_t_prev else self.glue_start - 1  # the last column's position, per row
        first_position = last - (width - 1)
        for r, m in enumerate(missing):
            if m:
                tokens[r, width - len(m):] = torch.tensor(m, device=self.device)
                real[r, width - len(m):] = True
        positions = first_position[:, None] + torch.arange(width, device=self.device)
        positions = torch.where(real, positions, last[:, None])  # a dummy sits at its row's last position
        visible = causal_visibility(self.cache.valid, width, real)
        logits = self.cache.forward(tokens, positions, visible, valid=real, logits_to_keep=1, phase=phase)
        return logits[:, -1]
