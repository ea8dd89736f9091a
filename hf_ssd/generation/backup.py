"""Backups on a cache miss: the fast speculators (pure functions; the draft-model backup lives in the drafter) and
the choice between them for `backup="auto"` (Corollary 16).

Each fast backup returns K tokens and, when sampling, the distribution q each token was drawn from, so
verification stays exact: n-gram tokens are deterministic (q one-hot), random tokens are uniform (q = 1/V).
"""

from __future__ import annotations

import torch


def ngram_lookup(context: list[int] | torch.Tensor, lookahead: int, ngram_max: int, ngram_min: int = 1) -> list[int]:
    """Prompt lookup: continue the most recent earlier occurrence of the longest matching suffix n-gram
    (`ngram_min` <= n <= `ngram_max`).

    Returns up to `lookahead` tokens (possibly none). One tensor comparison per n over the whole context.
    """
    ctx = torch.as_tensor(context, dtype=torch.long)
    n_ctx = ctx.shape[0]
    for n in range(min(ngram_max, n_ctx - 1), max(ngram_min, 1) - 1, -1):
        # every earlier window of n tokens (the suffix itself, starting at n_ctx - n, excluded)
        windows = ctx[: n_ctx - 1].unfold(0, n, 1)
        starts = (windows == ctx[n_ctx - n :]).all(dim=1).nonzero()
        if starts.numel():
            start = int(starts[-1]) + n
            return ctx[start : start + lookahead].tolist()
    return []


def random_tokens(count: int, vocab_size: int, generator: torch.Generator, device) -> torch.Tensor:
    """`count` tokens drawn uniformly from the vocabulary."""
    return torch.randint(vocab_size, (count,), generator=generator, device=device)


def backup_speculation(
    context: list[int],
    lookahead: int,
    vocab_size: int,
    generator: torch.Generator,
    device,
    ngram_max: int | None,
    with_probs: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """K tokens from n-gram lookup (when `ngram_max`) filled up with uniform random tokens, and their q."""
    found = ngram_lookup(context, lookahead, ngram_max) if ngram_max else []
    fill = random_tokens(lookahead - len(found), vocab_size, generator, device)
    tokens = torch.cat([torch.tensor(found, dtype=torch.long, device=device), fill])
    if not with_probs:
        return tokens, None
    probs = torch.full((lookahead, vocab_size), 1.0 / vocab_size, device=device)
    if found:
        probs[: len(found)] = certain_probs(tokens[: len(found)], vocab_size)
    return tokens, probs


def certain_probs(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """q [len, V] of tokens proposed with certainty (n-gram lookup): one-hot at each token."""
    probs = torch.zeros(tokens.shape[0], vocab_size, device=tokens.device)
    probs[torch.arange(tokens.shape[0], device=tokens.device), tokens] = 1.0
    return probs


FAST_BACKUP = "ngram"  # the fast backup "auto" switches to: free to compute, and better than random tokens


def choose_backup(
    p_hit: float,
    E_hit: float,
    E_miss: float,
    T_p: float,
    T_b: float,
    batch_size: int,
    E_miss_fast: float = 1.0,
) -> tuple[str, int | None]:
    """`backup="auto"`: the just-in-time draft ("draft") or the fast backup, by Corollary 16 (Theorem 17).

    Inputs are the run's own measurements: per-row hit rate `p_hit`, tokens per row-round after a hit `E_hit` and
    after a draft backup `E_miss`, and the primary speculator's and the draft backup's latencies `T_p`, `T_b` in
    units of one verification. The fast backup costs ~0 and yields `E_miss_fast` tokens. Returns the choice and
    the critical batch size b* from which the fast backup wins (None: it never does).
    """
    from ..speed_model import critical_batch_size

    p = min(max(p_hit, 0.0), 1.0)
    critical = critical_batch_size(p, E_hit, E_miss, T_p, T_b, E_miss_fast=E_miss_fast, T_b_fast=0.0, max_batch=4096)
    return (FAST_BACKUP if critical is not None and batch_size >= critical else "draft"), critical


class AutoBackup:
    """The backup for the next lookup: the configured one, or for `backup="auto"` a decision by Corollary 16 before
    every lookup from the run's measurements (a `MetricsRecorder` and the drafter's `DraftTimings`), for the current
    number of rows."""

    def __init__(self, backup: str):
        self.enabled = backup == "auto"
        self.choice = "draft" if self.enabled else backup  # until something is measured: the just-in-time draft
        self.decision: dict = {}
        self.by_batch_size: dict[int, str] = {}  # the last choice made at each number of active rows

    def decide(self, recorder, timings, rows: int) -> str:
        if not self.enabled:
            return self.choice
        verify = recorder.decode_verify_seconds()  # the first verification also holds the prefill
        if timings.backup_calls == 0 or recorder.lookups == 0 or verify <= 0:
            return self.choice  # nothing measured yet: the just-in-time draft (best at batch 1)
        e_hit = recorder.tokens_per_round("cache")
        e_miss = recorder.tokens_per_round("draft")
        t_p = timings.prepare_seconds / max(timings.prepare_calls, 1) / verify
        t_b = timings.backup_seconds / timings.backup_calls / verify
        p_hit = recorder.hits / recorder.lookups
        fast_tokens = recorder.tokens_per_round(FAST_BACKUP) or 1.0
        if e_hit <= 0:
            e_hit = 1.0
        if e_miss <= 0:
            e_miss = 1.0
        self.choice, critical = choose_backup(p_hit, e_hit, e_miss, t_p, t_b, rows, E_miss_fast=fast_tokens)
        self.by_batch_size[rows] = self.choice
        self.decision = {
            "choice": self.choice, "batch_size": rows, "critical_batch_size": critical, "p_hit": p_hit,
            "E_hit": e_hit, "E_miss": e_miss, "E_miss_fast": fast_tokens, "T_p": t_p, "T_b": t_b,
            "choice_by_batch_size": dict(sorted(self.by_batch_size.items(), reverse=True)),
        }
        return self.choice
