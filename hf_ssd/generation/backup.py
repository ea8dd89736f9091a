"""Fast backup speculators used on a cache miss (pure functions); the draft-model backup lives in the drafter.

Each returns K tokens and, when sampling, the distribution q each token was drawn from, so verification stays
exact: n-gram tokens are deterministic (q one-hot), random tokens are uniform (q = 1/V).
"""

from __future__ import annotations

import torch


def ngram_lookup(context: list[int], lookahead: int, ngram_max: int) -> list[int]:
    """Prompt lookup: continue the most recent earlier occurrence of the longest matching suffix n-gram.

    Returns up to `lookahead` tokens (possibly none).
    """
    n_ctx = len(context)
    for n in range(min(ngram_max, n_ctx - 1), 0, -1):
        suffix = context[n_ctx - n :]
        for start in range(n_ctx - n - 1, -1, -1):
            if context[start : start + n] == suffix:
                follow = context[start + n : start + n + lookahead]
                if follow:
                    return follow
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
        probs[: len(found)] = 0.0
        probs[torch.arange(len(found), device=device), tokens[: len(found)]] = 1.0
    return tokens, probs
