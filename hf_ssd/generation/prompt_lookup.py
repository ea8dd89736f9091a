"""Prompt lookup in plain steps: a plain step verifies the context's own continuation beside its one token.

While plain steps win (the draft is of no use here, or costs more than it brings) the target still runs one forward
per token, and on many machines a forward over a few positions costs what one does (MKL's fp32 kernels on a 2-core
Xeon: 1 to 3 positions take one price, 4 to 6 twice it; a GPU's step is launch-bound). Those positions are free to
fill with tokens that cost no draft forward: where the text repeats itself (a retrieved passage quoted, a summary
copying its source, code reusing its names) the latest earlier occurrence of the context's last n tokens is often
followed by what comes next (`backup.ngram_lookup`, n from `ngram_max` down to `NGRAM_MIN`). Measured on the real
pair's greedy answers (18 answers, the nine prompt sets, teacher-forced): a 2- or 3-gram continuation was proposed
at 11-94 % of the positions (translation's answers: none) and was the target's token at 33-97 % of those (rag 0.72,
summarization 0.79, humaneval 0.97; alpaca 0.56, qa 0.33).

How many of a proposal's tokens a plain step verifies is chosen for the most expected tokens per second
(`lookup_tokens`): the acceptance of each proposal position, measured in this call (`AcceptanceTracker`, the
policy's estimator, shrunk to `PRIOR`), against the measured cost of verifying m tokens with the draft idle (the
serial rounds' cost curve; an unmeasured m is guessed as cheap as the largest measured one below it, so it gets
tried once and then its measurement decides). A proposal passed over `EXPLORE_AFTER` times in a row is verified
anyway (one token), so that text turning repetitive brings the lookup back.

Exact: a proposal is a function of the committed tokens alone, so it is verified as any speculation is — greedy by
the target's argmax; sampling with q one-hot (accepted with probability p(x), else the bonus drawn from p without x).
The draft, paused, is told of the accepted tokens as plain steps (`decoding._plain_stretch`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..cache.speculation_cache import LOOKUP, Speculation
from .backup import certain_probs, ngram_lookup
from .estimates import AcceptanceTracker, expected_tokens

NGRAM_MIN = 2  # with 1-grams too, proposals were right at 17-95 % (qa 0.25, alpaca 0.25); 2-3-grams: 33-97 %
MAX_TOKENS = 4  # proposal tokens a plain step verifies at most
PRIOR = 0.5
EXPLORE_AFTER = 16


def lookup_tokens(acceptance: list[float], available: int, plain_seconds: float | None,
                  verify_seconds: Callable[[int], float | None]) -> int:
    """The m in 0..`available` with the most expected tokens per second, E(m) / T_v(m) (m = 0: the plain step
    alone, `plain_seconds`); 0 while the plain step is untimed. Ties go to fewer tokens."""
    if not plain_seconds or available <= 0:
        return 0
    best, best_speed = 0, 1.0 / plain_seconds
    for m in range(1, available + 1):
        seconds = verify_seconds(m)
        if seconds and (speed := expected_tokens(acceptance, m) / seconds) > best_speed * (1 + 1e-9):
            best, best_speed = m, speed
    return best


class PromptLookup:
    """The proposals of one call's plain steps and the acceptance measured on them (see the module docstring)."""

    def __init__(self, mode: str, ngram_max: int, vocab_size: int, do_sample: bool):
        self.mode, self.ngram_max, self.vocab_size, self.do_sample = mode, ngram_max, vocab_size, do_sample
        self.acceptance = AcceptanceTracker(MAX_TOKENS, PRIOR)
        self.passed_over = 0
        self.rounds = self.verified = self.accepted = 0
        self._prompts: dict[int, list[int]] = {}  # row index -> its prompt on the host (`context`)

    @property
    def enabled(self) -> bool:
        return self.mode != "never" and self.ngram_max >= NGRAM_MIN

    def context(self, row) -> list[int]:
        """The row's committed tokens on the host: its prompt read back from the device once per call, then what it
        generated (`Row.generated`, kept on the host by emit). A plain step looks up without reading the device."""
        if row.index not in self._prompts:
            self._prompts[row.index] = row.ids[: row.ids.shape[0] - len(row.generated)].tolist()
        return self._prompts[row.index] + row.generated

    def propose(self, ids: torch.Tensor | list[int], room: int) -> list[int]:
        """The continuation of the committed tokens `ids` [T], at most `room` and `MAX_TOKENS` tokens (none found:
        [])."""
        count = min(room, MAX_TOKENS)
        if not self.enabled or count <= 0:
            return []
        return ngram_lookup(ids, count, self.ngram_max, NGRAM_MIN)

    def choose(self, proposal: list[int], plain_seconds: float | None,
               verify_seconds: Callable[[int], float | None]) -> int:
        """How many of `proposal`'s tokens the plain step verifies (`lookup_tokens`; all with mode "always")."""
        if not proposal:
            return 0
        if self.mode == "always":
            return len(proposal)
        m = lookup_tokens(self.acceptance.estimates(), len(proposal), plain_seconds, verify_seconds)
        if m == 0:
            self.passed_over += 1
            if self.passed_over >= EXPLORE_AFTER:
                m = 1
        if m:
            self.passed_over = 0
        return m

    def speculation(self, tokens: list[int], device) -> Speculation:
        """The proposal's tokens as a speculation to verify: q one-hot when sampling (they are certain), None
        under greedy decoding."""
        ids = torch.tensor(tokens, dtype=torch.long, device=device)
        return Speculation(ids, certain_probs(ids, self.vocab_size) if self.do_sample else None, LOOKUP)

    def observe(self, verified: int, accepted: int) -> None:
        """A plain step verified `verified` proposal tokens and accepted the first `accepted`."""
        self.acceptance.decay()
        for position in range(min(verified, accepted + 1)):
            self.acceptance.add(position, float(position < accepted))
        self.rounds += 1
        self.verified += verified
        self.accepted += accepted

    def metrics(self) -> dict:
        return {"prompt_lookup_rounds": self.rounds, "prompt_lookup_tokens": self.verified,
                "prompt_lookup_accepted": self.accepted}

