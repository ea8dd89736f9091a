"""The outcome-keyed speculation cache: (row, accepted k, bonus token) -> the next speculation.

Vocabulary (shared with the metrics and the fan-out estimator): looking an outcome up is a **hit** or a **miss**; a
speculation's `source` is `CACHE` after a hit, else the name of the backup that drafted it (`BACKUP_SOURCES`), or
`PLAIN` for the empty speculation of a plain target step while the draft is paused (no lookup), `SERIAL` for one
the draft made just in time after the verification it sat out (SD's schedule: no lookup either), `LOOKUP` for the
context's own continuation a plain step verifies (`generation/prompt_lookup.py`: no draft token, no lookup).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CACHE = "cache"
BACKUP_SOURCES = ("draft", "ngram", "random")
PLAIN = "plain"
SERIAL = "serial"
LOOKUP = "lookup"
SOURCES = (CACHE, *BACKUP_SOURCES, PLAIN, SERIAL, LOOKUP)
NOT_LOOKED_UP = (PLAIN, SERIAL, LOOKUP)  # sources of speculations that were not looked up in the cache


def lookup_kind(source: str) -> str:
    """"hit" for a speculation found in the cache, "miss" for one a backup drafted."""
    return "hit" if source == CACHE else "miss"


@dataclass
class Speculation:
    """K draft tokens for one row, the distributions q they were sampled from, and where they came from.

    `probs` is None under greedy decoding (q is one-hot and verification only compares tokens).
    `source` is `CACHE` for a prepared branch, else the backup's name ("draft", "ngram", "random").
    `row_top` [K, W], when set, holds the top-W draft tokens after [t_prev, s_1..s_j] for j < K, and means the
    draft cache already holds the KV of [t_prev, s_1..s_{K-1}] on the row's main path: the next glue forward
    then only has to run s_K.
    `slots` [K], for a cached branch, are the draft-cache slots (in every row) where the tree wrote that KV.
    `confidence` [K], when set, is the draft's probability of each of its tokens (its top probability under greedy
    decoding, q(s_j) when sampling): what the lookahead policy conditions its acceptance estimates on.
    `runner_up`, when set (a serial speculation of one row), is the draft's likeliest token for the first position
    other than s_1: what a round verifying s_1 alone may verify beside it (`generation/runner_up.py`).
    """

    tokens: torch.Tensor  # [K] long
    probs: torch.Tensor | None  # [K, V] float or None
    source: str
    row_top: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    confidence: torch.Tensor | None = None
    runner_up: int | None = None

    @property
    def from_cache(self) -> bool:
        return self.source == CACHE


@dataclass
class Resolution:
    """The speculation for a row's next round, and whether it was found in the cache (a hit); `looked_up` is
    False after a plain step while the draft was paused (nothing to look up, the next speculation is empty)."""

    speculation: Speculation
    hit: bool
    looked_up: bool = True


def plain_resolutions(rows: int, device: torch.device | str) -> list[Resolution]:
    """Every row's resolution after a plain step the draft sat out: an empty speculation, nothing looked up."""
    empty = torch.zeros(0, dtype=torch.long, device=device)
    return [Resolution(Speculation(empty, None, PLAIN), hit=False, looked_up=False) for _ in range(rows)]


class SpeculationCache:
    """Branches prepared during one verification, addressable by the outcome they anticipate.

    Built from tensors: `rows`, `forks`, `candidates` [N] (row, k, bonus-token key of each branch), `tokens` [N, K],
    `probs` [N, K, V] or None, and optionally `row_top` [N, K, W], `slots` [N, K], `confidence` [N, K] (see
    `Speculation`) and `valid` [N] (branches to index; default all). Keys are moved to the host once, when the cache
    is built (off the target's critical path).
    """

    def __init__(self, rows: torch.Tensor, forks: torch.Tensor, candidates: torch.Tensor, tokens: torch.Tensor,
                 probs: torch.Tensor | None, row_top: torch.Tensor | None = None, slots: torch.Tensor | None = None,
                 valid: torch.Tensor | None = None, confidence: torch.Tensor | None = None):
        keys = torch.stack([rows, forks, candidates], dim=1).tolist()
        usable = [True] * len(keys) if valid is None else valid.tolist()
        self._index = {tuple(key): i for i, (key, ok) in enumerate(zip(keys, usable)) if ok}
        self.tokens, self.probs, self.row_top, self.slots = tokens, probs, row_top, slots
        self.confidence = confidence

    def __len__(self) -> int:
        return len(self._index)

    def keys(self) -> list[tuple[int, int, int]]:
        """The (row, accepted k, bonus) outcomes prepared, in branch order."""
        return list(self._index)

    def lookup(self, row: int, accepted: int, bonus: int) -> Speculation | None:
        """The speculation prepared for this outcome, or None on a miss."""
        i = self._index.get((row, accepted, bonus))
        if i is None:
            return None

        def pick(t):
            return None if t is None else t[i]

        return Speculation(self.tokens[i], pick(self.probs), CACHE, pick(self.row_top), pick(self.slots),
                           pick(self.confidence))
