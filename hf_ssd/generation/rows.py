"""Per-row state of one generation (like nano-vllm's `Sequence`) and the emit phase: what each row keeps of a round,
cut exactly where plain decoding stops.

`Batch.active` lists the rows still decoding in the order the target's and the draft's layouts hold them: a
position in it is the only row index the round uses. `Row.index` is the row's place in the caller's batch (for
processors, outputs and streamers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..cache.speculation_cache import Speculation


@dataclass(eq=False)
class Row:
    """One batch row as plain decoding holds it."""

    index: int  # place in the caller's batch
    ids: torch.Tensor  # [T]: the prompt as passed (padding included) plus what the row generated
    generated: list[int] = field(default_factory=list)
    scores: list[torch.Tensor] = field(default_factory=list)  # per emitted token [1, V] (output_scores)
    logits: list[torch.Tensor] = field(default_factory=list)  # per emitted token [1, V] (output_logits)
    speculation: Speculation | None = None  # the one being verified this round
    fired_at: int | None = None  # generated length at which a stopping criterion first fired
    done: bool = False


@dataclass
class Verdict:
    """One verification of the active rows: per row (position in `Batch.active`) the accepted count and bonus."""

    verified: int  # draft tokens verified per row this round
    tokens: torch.Tensor  # [b, verified] the speculations' tokens
    raw: torch.Tensor  # [b, verified + 1, V] the target's logits
    scores: torch.Tensor  # [b, verified + 1, V] after the logits processors
    accepted: list[int]
    bonus: list[int]
    # per row: whether the draft's runner-up took the place of its first token (`runner_up.py`; then `tokens` holds
    # the runner-up and `accepted` counts it); None when no runner-up was verified
    runner_up: list[bool] | None = None
    _new_tokens: torch.Tensor | None = field(default=None, repr=False)

    def new_tokens(self) -> torch.Tensor:
        """[b, verified + 1]: s_1..s_a, then the bonus at column a (columns after it are unused)."""
        if self._new_tokens is None:
            device, dtype = self.tokens.device, self.tokens.dtype
            bonus = torch.tensor(self.bonus, device=device, dtype=dtype)
            if self.verified == 0:  # a plain step: the bonus is all
                self._new_tokens = bonus[:, None]
            else:
                columns = torch.cat([self.tokens, self.tokens.new_zeros(len(self.accepted), 1)], dim=1)
                rows = torch.arange(len(self.accepted), device=device)
                columns[rows, torch.tensor(self.accepted, device=device)] = bonus
                self._new_tokens = columns
        return self._new_tokens


class Batch:
    """The rows of one generation and plain decoding's stop rules over them."""

    def __init__(self, input_ids: torch.Tensor, stopping_criteria, generation_config):
        self.rows = [Row(r, input_ids[r]) for r in range(input_ids.shape[0])]
        self.active = list(self.rows)
        self.prompt_width = input_ids.shape[1]
        self.stopping_criteria = stopping_criteria
        self.max_new = generation_config.max_length - input_ids.shape[1]
        self.want_scores = bool(generation_config.return_dict_in_generate and generation_config.output_scores)
        self.want_logits = bool(generation_config.return_dict_in_generate and generation_config.output_logits)
        # Plain decoding pads rows that finished only when an EOS criterion is present; otherwise every row goes on
        # until all rows' criteria have fired once (`limit`: that step).
        self.pads_finished = len(self.rows) == 1 or any(hasattr(c, "eos_token_id") for c in stopping_criteria)
        self.limit: int | None = None

    def hand(self, speculations: list[Speculation]) -> None:
        """The speculations the active rows verify next, in `active` order."""
        for row, speculation in zip(self.active, speculations):
            row.speculation = speculation

    def verifiable(self, max_length: int, max_positions: int) -> int:
        """The most draft tokens this round can verify: the speculations' length within `room`."""
        drafted = min(row.speculation.tokens.shape[0] for row in self.active)
        return min(drafted, self.room(max_length, max_positions))

    def room(self, max_length: int, max_positions: int) -> int:
        """The most draft tokens the next round could verify, however many are drafted: what the least advanced row
        can still use under `max_length` (the last position is the bonus; rows further on are capped when they
        emit), never past the position embeddings. Drafting past it is work thrown away."""
        shortest = min(row.ids.shape[0] for row in self.active)
        longest = max(row.ids.shape[0] for row in self.active)
        return max(0, min(max_length - shortest - 1, max_positions - longest - 1))

    def emit(self, verdict: Verdict, recorder) -> list[int]:
        """Append each active row's accepted tokens and bonus, stopping at the first token a stopping criterion
        fires on; returns the count each row kept. Rows that are done stay in `active` until `retire`."""
        new_tokens = verdict.new_tokens()
        emitted = []
        for i, row in enumerate(self.active):
            cap = self.max_new if self.limit is None else min(self.limit, self.max_new)
            tokens = new_tokens[i, : verdict.accepted[i] + 1][: cap - len(row.generated)]
            count = tokens.shape[0]
            if row.fired_at is None:
                fired = self._first_stop(row, tokens, verdict.scores[i])
                if fired is not None:
                    row.fired_at = len(row.generated) + fired
                    if self.pads_finished:
                        count, row.done = fired, True
            row.ids = torch.cat([row.ids, tokens[:count]])
            row.generated.extend(tokens[:count].tolist())
            if self.want_scores:
                row.scores.extend(verdict.scores[i, :count, None])
            if self.want_logits:
                row.logits.extend(verdict.raw[i, :count, None])
            recorder.record_round(row.speculation.source, verdict.accepted[i], verdict.verified, count)
            if len(row.generated) >= cap:  # plain decoding stops every row at max_length
                row.done = True
            emitted.append(count)
        if self.limit is None and not self.pads_finished and all(row.fired_at is not None for row in self.rows):
            self._truncate(max(row.fired_at for row in self.rows))
        return emitted

    def _first_stop(self, row: Row, tokens: torch.Tensor, scores: torch.Tensor) -> int | None:
        """1 + the index of the first of `tokens` any stopping criterion fires on (None: none does), evaluated token
        by token on the row's ids, as plain decoding does."""
        extended = torch.cat([row.ids, tokens])
        start = row.ids.shape[0]
        for n in range(1, tokens.shape[0] + 1):
            so_far = (*row.scores, *scores[:n, None]) if self.want_scores else None
            if bool(self.stopping_criteria(extended[None, : start + n], so_far).any()):
                return n
        return None

    def _truncate(self, limit: int) -> None:
        """Without an EOS criterion plain decoding keeps every row going (real tokens) until the last row's criteria
        fire: that step is everybody's length."""
        self.limit = limit
        for row in self.rows:
            del row.generated[limit:], row.scores[limit:], row.logits[limit:]
            row.ids = row.ids[: self.prompt_width + limit]
            row.done = row.done or len(row.generated) >= limit

    def retire(self) -> list[int]:
        """Drop the rows that are done from `active`; returns the positions (in the old `active`) that stay."""
        keep = [i for i, row in enumerate(self.active) if not row.done]
        self.active = [self.active[i] for i in keep]
        return keep
