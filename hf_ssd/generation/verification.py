"""Exact verification of a speculation against the target (pure tensor functions, batched over rows).

Shapes: `draft_tokens` [b, L], `draft_probs` q [b, L, V], target scores / probs p [b, L+1, V].
Both return `(accepted [b], bonus [b])`: the number of accepted draft tokens and the token that follows them.
`sibling_sampling_verify` verifies one row's first drafted token and a second candidate for the same position.
"""

from __future__ import annotations

import torch

FIRST_WON, RUNNER_UP_WON, NEITHER = 0, 1, -1  # `sibling_sampling_verify`'s (and `runner_up.sibling_winner`'s) verdicts


def greedy_verify(draft_tokens: torch.Tensor, target_scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept the longest prefix that matches the target's argmax; the bonus is the argmax after it."""
    predicted = target_scores.argmax(dim=-1)  # [b, L+1]
    length = draft_tokens.shape[1]
    matches = (predicted[:, :length] == draft_tokens).to(torch.long).cumprod(dim=-1)
    accepted = matches.sum(dim=-1)
    bonus = predicted.gather(1, accepted[:, None]).squeeze(1)
    return accepted, bonus


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(p - q, 0)); falls back to p on rows where the residual has no mass."""
    residual = (p - q).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(p.dtype).tiny), p)


def sampling_verify(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al., Alg. 1), exact for any proposal q the tokens were drawn from.

    Token i is accepted with probability min(1, p_i(s_i) / q_i(s_i)); at the first rejection the bonus is drawn
    from the residual max(p_i - q_i, 0); if all L are accepted it is drawn from p_{L+1}.
    """
    b, length = draft_tokens.shape
    p = target_probs.float()
    q = draft_probs.float().to(p.device)
    tokens = draft_tokens.to(p.device)
    p_tok = p[:, :length].gather(-1, tokens[..., None]).squeeze(-1)
    q_tok = q.gather(-1, tokens[..., None]).squeeze(-1)
    u = torch.rand((b, length), generator=generator, device=p.device)
    accepted = (u * q_tok < p_tok).to(torch.long).cumprod(dim=-1).sum(dim=-1)
    # The row after the accepted prefix; position L has no draft, i.e. q = 0 there and the residual is p.
    q_full = torch.cat([q, torch.zeros_like(p[:, :1])], dim=1)
    index = accepted[:, None, None].expand(b, 1, p.shape[-1])
    dist = residual_distribution(p.gather(1, index).squeeze(1), q_full.gather(1, index).squeeze(1))
    bonus = torch.multinomial(dist, 1, generator=generator).squeeze(1)
    return accepted, bonus


def accept(
    draft_tokens: torch.Tensor,
    target_scores: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One round's verification: greedy when `draft_probs` is None, else speculative sampling against the target's
    processed `target_scores` (p = softmax). Nothing drafted (a plain step): the target's own choice, as plain
    decoding makes it."""
    if draft_tokens.shape[1] == 0:
        scores = target_scores[:, 0]
        if draft_probs is None:
            bonus = scores.argmax(dim=-1)
        else:
            bonus = torch.multinomial(scores.softmax(-1).float(), 1, generator=generator).squeeze(1)
        return torch.zeros_like(bonus), bonus
    if draft_probs is None:
        return greedy_verify(draft_tokens, target_scores)
    return sampling_verify(draft_tokens, draft_probs, target_scores.softmax(-1), generator)


def sibling_sampling_verify(first: int, runner_up: int, q: torch.Tensor, p: torch.Tensor,
                            generator: torch.Generator | None = None) -> tuple[int, int]:
    """Speculative sampling over two candidates for one position (recursive rejection, as multi-draft speculative
    sampling does): `first` was drawn from `q` [V]; `runner_up` is any token other than `first` fixed before the
    target's law is known (the draft's second choice). `p` [3, V]: the target's law after t, after `first` and after
    `runner_up`. `first` is accepted with probability min(1, p_0(first) / q(first)); else `runner_up` is weighed as a
    proposal that is certain (q = one-hot) against the residual r = normalize(max(p_0 - q, 0)), accepted with
    probability r(runner_up); else the token is drawn from r without `runner_up`. Each stage draws exactly from
    what remains of p_0, so the token after t follows p_0 and the bonus after the accepted one follows its row of p.
    Returns (which was accepted: `FIRST_WON`, `RUNNER_UP_WON`, or `NEITHER` and then the token drawn after t),
    bonus)."""
    p = p.float()
    q = q.float().to(p.device)
    u = torch.rand(2, generator=generator, device=p.device)
    if bool(u[0] * q[first] < p[0, first]):
        return FIRST_WON, int(torch.multinomial(p[1], 1, generator=generator))
    residual = residual_distribution(p[0], q)
    if bool(u[1] < residual[runner_up]):
        return RUNNER_UP_WON, int(torch.multinomial(p[2], 1, generator=generator))
    certain = torch.zeros_like(residual)
    certain[runner_up] = 1.0
    return NEITHER, int(torch.multinomial(residual_distribution(residual, certain), 1, generator=generator))
