"""What crosses between the target's process and the draft's worker process.

Per round only fixed-size headers go through the pipe (struct-packed integers, no pickling); token ids, outcome
keys and q rows go through buffers both processes map (`RoundBuffers`, shared memory on CPU, CUDA IPC for a CUDA
draft), allocated by the parent once per generation. Pickling happens only off the round loop: a draft handed to a
worker (its weights move to shared memory once and are mapped, not copied), a generation's start, its report,
errors, and the outcomes of the rounds the draft sat out (once before it next works, a few hundred bytes).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from ..cache.speculation_cache import SOURCES
from ..generation.confidence import StopRule

# Requests: header (op, generation, a, b, c, d), some followed by one pickled payload.
LOAD, FORGET, BEGIN, PREPARE, RESOLVE, FINISH, CLOSE, SAT_OUT = range(1, 9)
REQUEST = struct.Struct("<6q")
# Replies: header (status, generation, op, has_payload), then the payload if any.
OK, ERROR, CANCELLED, READY = range(4)
REPLY = struct.Struct("<4q")

BACKUPS = ("draft", "ngram", "random")  # backup codes in a RESOLVE request
# `RoundBuffers.stats`: the drafter's `DraftTimings` (prepare calls, seconds; backup calls, seconds; serial calls,
# seconds, tokens; backup tokens; serial steps, their seconds) and the worker's busy seconds
STATS = 11

# The worker's control block, written by the parent between pipe messages and read by the worker between forwards.
CANCELLED_GENERATION = 0  # the generation whose work must stop
ANNOUNCED = 1  # generation << 32 | round, once that round's outcomes are in `RoundBuffers.outcomes`
CONTROL_SIZE = 2


def announcement(generation: int, round_: int) -> int:
    return (generation << 32) | round_


def shared_control() -> torch.Tensor:
    return torch.full((CONTROL_SIZE,), -1, dtype=torch.long).share_memory_()


@dataclass
class RoundBuffers:
    """One generation's shared buffers, for at most `rows` rows.

    `outcomes` [rows, 3] (accepted, bonus, 1 where the runner-up replaced the first token) and `keep` [rows] (batch
    positions staying) go to the worker; the speculations come back double-buffered by round parity, so the ones
    being verified stay intact while the next ones are written: `tokens` [2, rows, K], `probs` [2, rows, K, V]
    (sampling only), `confidence` [2, rows, K] (the draft's, see `Speculation`; NaN: unknown), `meta` [2, rows, 4]
    (source code, hit, length: a speculation may be shorter than K; the runner-up, -1: none). `stop_rule` holds
    the `StopRule` of the next RESOLVE (`StopRule.to_list`; gain 0: none).
    `stats` holds the drafter's running `DraftTimings` and busy seconds (`STATS`).
    """

    outcomes: torch.Tensor
    keep: torch.Tensor
    tokens: torch.Tensor
    probs: torch.Tensor | None
    confidence: torch.Tensor
    meta: torch.Tensor
    stats: torch.Tensor
    stop_rule: torch.Tensor

    @classmethod
    def allocate(cls, rows: int, lookahead: int, vocab_size: int | None, device: torch.device) -> RoundBuffers:
        """Buffers for `rows` rows; `vocab_size` None: greedy (no q). Token ids and q live on the draft's device."""

        def host(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype).share_memory_()

        def on_device(*shape, dtype):
            tensor = torch.zeros(*shape, dtype=dtype, device=device)
            return tensor.share_memory_() if tensor.device.type == "cpu" else tensor  # CUDA: sent by IPC handle

        return cls(
            outcomes=host(rows, 3), keep=host(rows),
            tokens=on_device(2, rows, lookahead, dtype=torch.long),
            probs=None if vocab_size is None else on_device(2, rows, lookahead, vocab_size, dtype=torch.float32),
            confidence=host(2, rows, lookahead, dtype=torch.float32),
            meta=host(2, rows, 4), stats=host(STATS, dtype=torch.float64),
            stop_rule=host(StopRule.list_size(lookahead), dtype=torch.float64),  # a gain per position
        )

    def fits(self, rows: int, lookahead: int, vocab_size: int | None, device: torch.device) -> bool:
        """Whether these buffers serve a generation of that shape (so they can be reused)."""
        same_probs = (self.probs is None) == (vocab_size is None) and (
            self.probs is None or self.probs.shape[-1] == vocab_size
        )
        return (self.tokens.shape[1] >= rows and self.tokens.shape[2] == lookahead and same_probs
                and self.tokens.device == torch.device(device))


def source_code(source: str) -> int:
    return SOURCES.index(source)


def source_name(code: int) -> str:
    return SOURCES[code]
