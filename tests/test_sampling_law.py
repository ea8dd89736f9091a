"""Statistical tests: under sampling, SSD's output law is exactly the target's (Leviathan et al.'s rule; the paper's
Definition 14 for Saguaro sampling).

Two levels, every comparison a Pearson chi-square test at a fixed seed (bins expected below 5 pooled):
- pure parts: `sampling_verify` on 20 000 rows at once against closed-form laws, with plain, Saguaro-rescaled,
  one-hot (n-gram) and uniform (random backup) q; `residual_distribution` edge cases;
- end to end: `generate()` with SSD on a 5-token vocabulary, 4 new tokens (625 continuations), against the target's
  exact law from enumerating every prefix and applying transformers' own warpers to the target's logits.
A correct law must give p >= ALPHA. Negative controls (a deliberately wrong q, fed at both levels) must give
p < REJECT, which shows the tests have the power to see the errors they are meant to catch.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools

import numpy as np
import pytest
import torch
from conftest import tiny_model, tiny_pair
from scipy import stats
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper

from hf_ssd import SSDConfig, enable_ssd
from hf_ssd.cache.speculation_cache import SpeculationCache
from hf_ssd.generation.candidate_generator import SaguaroCandidateGenerator
from hf_ssd.generation.saguaro import draft_probs
from hf_ssd.generation.verification import residual_distribution, sampling_verify

ALPHA = 1e-5  # a correct law passes every test at p >= ALPHA (seeds are fixed; observed p-values are >> ALPHA)
REJECT = 1e-8  # a negative control must be rejected at least this strongly
ROWS = 20_000  # rows per vectorised `sampling_verify` call
VOCAB = 6  # unit tests
E2E_VOCAB, NEW_TOKENS = 5, 4  # end to end: 625 continuations; round 2 can verify a cached branch's 2 tokens
PROMPT = [0, 1, 2, 0, 1]  # repeats, so the n-gram backup finds matches
# Samples per end-to-end configuration (one generate() each, ~5-15 ms on 2 cores). A configuration passes when all
# nine tests (joint, first three tokens, 4 marginals, 3 adjacent pairs) give p >= ALPHA. Power at this size: with
# probability >= 0.9 the joint test (20-27 bins after pooling) rejects a law whose chi-square distance
# sum (P' - P)^2 / P to the target's exceeds ~0.11 (noncentrality 600 * 0.11 = 66), a 5-bin marginal test one
# beyond ~0.07 (any TV >= 0.13). The end-to-end negative controls below are rejected decisively: Saguaro tokens
# verified with the vanilla q (TV ~0.15) at min p 1e-11..1e-24 over six seeds, a hit-path q misalignment at
# 1e-14..1e-41 with half the samples. Smaller law errors are the unit tests' job (20 000 rows: a first-token TV of
# 0.057 is rejected at p ~ 1e-35 or below). All six configurations at 5 000 samples each: smallest of the nine
# p-values 7.7e-4..0.23 per configuration; the lowest ones, rerun at 15 000-20 000 samples, came out >= 0.03.
SAMPLES = 600


def chisquare_pvalue(probs, counts, min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value of `counts` against the law `probs`; bins expected below `min_expected` are pooled.

    A count on a zero-probability outcome is a certain rejection (p = 0): the sampler left the law's support.
    """
    probs = np.asarray(probs, dtype=np.float64).ravel()
    counts = np.asarray(counts, dtype=np.float64).ravel()
    if counts[probs <= 0].sum() > 0:
        return 0.0
    order = np.argsort(probs, kind="stable")
    expected = probs[order] / probs.sum() * counts.sum()
    observed = counts[order]
    small = expected < min_expected
    exp_bins, obs_bins = list(expected[~small]), list(observed[~small])
    pooled_exp, pooled_obs = expected[small].sum(), observed[small].sum()
    if pooled_exp > 0:
        if pooled_exp >= min_expected or not exp_bins:
            exp_bins.insert(0, pooled_exp)
            obs_bins.insert(0, pooled_obs)
        else:  # too small on its own: merge into the smallest kept bin
            exp_bins[0] += pooled_exp
            obs_bins[0] += pooled_obs
    if len(exp_bins) < 2:
        return 1.0
    return float(stats.chisquare(obs_bins, exp_bins).pvalue)


# --- pure parts: closed-form laws ----------------------------------------------------------------------------------


def outcome_law(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Exact P(accepted = k, bonus = x) [L+1, V] for fixed per-position p [L+1, V] and q [L, V].

    Position i accepts with β_i = Σ min(p_i, q_i); rejection at k and bonus x has mass max(p_k(x) - q_k(x), 0)
    (the residual's normaliser is exactly 1 - β_k); after L acceptances the bonus is drawn from p_L.
    """
    length = q.shape[0]
    law = np.zeros_like(p)
    reach = 1.0
    for k in range(length):
        law[k] = reach * np.maximum(p[k] - q[k], 0.0)
        reach *= np.minimum(p[k], q[k]).sum()
    law[length] = reach * p[length]
    return law


def product_law(p: np.ndarray) -> np.ndarray:
    """The law of L+1 independent tokens drawn from p_0, ..., p_L: an array of shape [V] * (L+1)."""
    law = np.ones(())
    for row in p:
        law = np.multiply.outer(law, row)
    return law


def verify_rows(p, q_sampled, q_verified, seed: int, rows: int = ROWS):
    """Draw ROWS speculations from `q_sampled` (position-wise), verify them with `q_verified` against p.

    Returns (tokens [rows, L], accepted [rows], bonus [rows], generator).
    """
    generator = torch.Generator().manual_seed(seed)
    length, vocab = q_sampled.shape
    if length:
        tokens = torch.multinomial(q_sampled, rows, replacement=True, generator=generator).T
    else:
        tokens = torch.empty(rows, 0, dtype=torch.long)
    accepted, bonus = sampling_verify(
        tokens, q_verified.expand(rows, length, vocab), p.expand(rows, length + 1, vocab), generator
    )
    return tokens, accepted, bonus, generator


def completed(tokens, accepted, bonus, p, generator) -> torch.Tensor:
    """Emitted tokens followed by the target continuing alone: must be distributed as p_0 x ... x p_L."""
    rows, length = tokens.shape
    fresh = torch.multinomial(p, rows, replacement=True, generator=generator).T  # [rows, L+1]
    padded = torch.cat([tokens, torch.zeros(rows, 1, dtype=torch.long)], dim=1)
    position = torch.arange(length + 1)[None]
    return torch.where(
        position < accepted[:, None], padded, torch.where(position == accepted[:, None], bonus[:, None], fresh)
    )


def verification_pvalues(p, q_sampled, q_verified, seed: int) -> dict[str, float]:
    """Chi-square p-values of the joint (accepted, bonus), the first emitted token, and the completed sequence."""
    tokens, accepted, bonus, generator = verify_rows(p, q_sampled, q_verified, seed)
    length, vocab = q_sampled.shape[0], p.shape[-1]
    p_np, q_np = p.double().numpy(), q_sampled.double().numpy()
    outcome = torch.bincount(accepted * vocab + bonus, minlength=(length + 1) * vocab)
    first = torch.where(accepted > 0, tokens[:, 0], bonus) if length else bonus
    sequence = completed(tokens, accepted, bonus, p, generator)
    flat = (sequence * vocab ** torch.arange(length, -1, -1)).sum(dim=1)
    return {
        "outcome": chisquare_pvalue(outcome_law(p_np, q_np), outcome.numpy()),
        "first": chisquare_pvalue(p_np[0], torch.bincount(first, minlength=vocab).numpy()),
        "sequence": chisquare_pvalue(product_law(p_np), torch.bincount(flat, minlength=vocab ** (length + 1)).numpy()),
    }


def random_dist(rows: int, vocab: int, seed: int, zeros: int = 0, scale: float = 1.5) -> torch.Tensor:
    """Random distributions [rows, vocab] (softmax of scaled Gaussians), `zeros` random entries per row set to 0."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator) * scale
    if zeros:
        cut = torch.rand(rows, vocab, generator=generator).argsort(dim=-1)[:, :zeros]
        logits.scatter_(1, cut, float("-inf"))
    return logits.softmax(dim=-1)


def _scenario(name: str, length: int = 2, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """(p [L+1, V], q [L, V]) for a named verification scenario."""
    p = random_dist(length + 1, vocab, seed=1)
    if name == "generic":
        return p, random_dist(length, vocab, seed=2)
    if name == "sparse":  # target top-k and draft top-k cut different tokens: q > 0 where p = 0 and vice versa
        return random_dist(length + 1, vocab, seed=3, zeros=2), random_dist(length, vocab, seed=4, zeros=2)
    if name == "q_equals_p":  # every draft token accepted
        return p, p[:length].clone()
    if name == "one_hot":  # n-gram backup: deterministic tokens, q one-hot
        return p, torch.eye(vocab)[torch.arange(length) % vocab]
    if name == "uniform":  # random backup
        return p, torch.full((length, vocab), 1.0 / vocab)
    if name == "empty":  # nothing left to verify (last round): the bonus alone, from p_0
        return random_dist(1, vocab, seed=5), torch.empty(0, vocab)
    if name == "long":
        return random_dist(5, vocab, seed=6), random_dist(4, vocab, seed=7)
    raise ValueError(name)


@pytest.mark.parametrize("name", ["generic", "sparse", "q_equals_p", "one_hot", "uniform", "empty"])
def test_sampling_verify_law(name):
    """First emitted token ~ p_0; (accepted, bonus) has its closed-form law; emitted + continuation ~ Π p_i."""
    p, q = _scenario(name)
    pvalues = verification_pvalues(p, q, q, seed=11)
    assert min(pvalues.values()) >= ALPHA, pvalues


def test_sampling_verify_law_long_speculation():
    """Four draft tokens: (accepted, bonus) and the first emitted token (6^5 sequences are too many bins)."""
    p, q = _scenario("long")
    pvalues = verification_pvalues(p, q, q, seed=12)
    assert pvalues["outcome"] >= ALPHA and pvalues["first"] >= ALPHA, pvalues


def _saguaro_q(top: int, c: float, length: int = 2) -> torch.Tensor:
    """Saguaro-rescaled draft q after temperature and top-k warpers (as the drafter builds it)."""
    logits = torch.randn(length, VOCAB, generator=torch.Generator().manual_seed(8)) * 2.0
    warpers = [TemperatureLogitsWarper(0.7), TopKLogitsWarper(5)]
    return draft_probs(logits, warpers, top, c)


@pytest.mark.parametrize("top, c", [(2, 1.0), (2, 0.3), (3, 0.05), (4, 0.2)])
def test_sampling_verify_law_with_saguaro_q(top, c):
    """Tokens drawn from σ_{F,C} and verified with that same q: the law is p's, whatever C and F."""
    p = random_dist(3, VOCAB, seed=1)
    q = _saguaro_q(top, c)
    pvalues = verification_pvalues(p, q, q, seed=13)
    assert min(pvalues.values()) >= ALPHA, pvalues


@pytest.mark.parametrize(
    "wrong",
    ["vanilla_q_for_saguaro_tokens", "saguaro_c_off_by_0.1", "q_without_temperature", "uniform_q_for_draft_tokens",
     "always_accept"],
)
def test_negative_control_wrong_q_is_rejected(wrong):
    """Power check: verifying with a q the tokens were NOT drawn from must fail the same tests decisively.

    The subtlest case (C = 0.4 in verification, 0.3 in sampling) moves the first token's law by TV 0.057 and is
    rejected at p ~ 1e-35 or below.
    """
    p = random_dist(3, VOCAB, seed=1)
    q_draft = random_dist(2, VOCAB, seed=2)
    if wrong == "vanilla_q_for_saguaro_tokens":  # Saguaro's pitfall: rescaled sampling, vanilla q in verification
        q_sampled, q_verified = _saguaro_q(2, 0.3), _saguaro_q(2, 1.0)
    elif wrong == "saguaro_c_off_by_0.1":
        q_sampled, q_verified = _saguaro_q(2, 0.3), _saguaro_q(2, 0.4)
    elif wrong == "q_without_temperature":  # q reported before the temperature warper the tokens were drawn with
        logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(8)) * 2.0
        q_sampled = draft_probs(logits, [TemperatureLogitsWarper(0.7), TopKLogitsWarper(5)], 2, 0.3)
        q_verified = draft_probs(logits, [TopKLogitsWarper(5)], 2, 0.3)
    elif wrong == "uniform_q_for_draft_tokens":  # treating draft tokens as if they were the random backup's
        q_sampled, q_verified = q_draft, torch.full_like(q_draft, 1.0 / VOCAB)
    else:  # q := p on the drafted tokens, i.e. every draft token accepted
        q_sampled, q_verified = q_draft, p[:2].clone()
    pvalues = verification_pvalues(p, q_sampled, q_verified, seed=14)
    assert max(pvalues.values()) < REJECT, pvalues


def test_acceptance_at_the_support_edges():
    """A token the target gives zero mass is always rejected and never the bonus; min(1, p/q) otherwise."""
    p = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    tokens, accepted, bonus, _ = verify_rows(p, q, q, seed=15, rows=1000)
    assert accepted.eq(0).all() and bonus.ne(0).all()
    q_sure = torch.tensor([[0.0, 1.0, 0.0]])  # one-hot q: accepted with probability p(1) / q(1) = 0.5
    _, accepted, _, _ = verify_rows(p, q_sure, q_sure, seed=16, rows=ROWS)
    assert chisquare_pvalue([0.5, 0.5], torch.bincount(accepted, minlength=2).numpy()) >= ALPHA
    p_sure = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])  # p(s) >= q(s): accepted with certainty
    _, accepted, _, _ = verify_rows(p_sure, q_sure, q_sure, seed=17, rows=1000)
    assert accepted.eq(1).all()


# --- residual_distribution -----------------------------------------------------------------------------------------


def test_residual_decomposition_recovers_p():
    """min(p, q) + (1 - β) r = p for every row (the lemma behind exactness), for random and sparse p, q."""
    for zeros in (0, 3):
        p = random_dist(500, 8, seed=20, zeros=zeros).double()
        q = random_dist(500, 8, seed=21, zeros=zeros).double()
        r = residual_distribution(p, q)
        beta = torch.minimum(p, q).sum(-1, keepdim=True)
        assert torch.allclose(torch.minimum(p, q) + (1 - beta) * r, p, atol=1e-12)
        assert torch.allclose(r.sum(-1), torch.ones(500, dtype=torch.float64))
        assert (r >= 0).all() and (r[q >= p] == 0).all()


def test_residual_edge_cases():
    """q = 0 gives p; q = p falls back to p (no NaN); rows of a batch are independent; any leading shape."""
    p = torch.tensor([[0.2, 0.3, 0.5, 0.0], [0.0, 0.0, 1.0, 0.0]])
    assert torch.equal(residual_distribution(p, torch.zeros_like(p)), p)
    assert torch.equal(residual_distribution(p, p), p)
    q = torch.tensor([[0.2, 0.3, 0.5, 0.0], [0.5, 0.0, 0.25, 0.25]])  # row 0: no residual mass; row 1: some
    r = residual_distribution(p, q)
    assert torch.equal(r[0], p[0]) and torch.allclose(r[1], torch.tensor([0.0, 0.0, 1.0, 0.0]))
    one_hot = torch.tensor([[0.0, 1.0, 0.0, 0.0]])  # p one-hot on the draft's token: fall back to p
    assert torch.equal(residual_distribution(one_hot, one_hot), one_hot)
    batched = random_dist(12, 5, seed=22).reshape(3, 4, 5)
    other = random_dist(12, 5, seed=23).reshape(3, 4, 5)
    assert torch.allclose(residual_distribution(batched, other).reshape(12, 5),
                          residual_distribution(batched.reshape(12, 5), other.reshape(12, 5)))
    assert not residual_distribution(p.half(), q.half()).isnan().any()


# --- end to end: generate() against the target's exact law ---------------------------------------------------------


@pytest.fixture(scope="module")
def models():
    """A 1-layer target (SSD enabled) and an unrelated draft; init range 0.3 gives peaked, different laws."""
    target = enable_ssd(tiny_model(layers=1, vocab_size=E2E_VOCAB, hidden=16, seed=0, initializer_range=0.3))
    draft = tiny_model(layers=1, vocab_size=E2E_VOCAB, hidden=16, seed=7, initializer_range=0.3)
    return {"target": target, "self": target, "random": draft}


_EXACT: dict[tuple, np.ndarray] = {}


def exact_law(model, sampling: dict, prompt: tuple[int, ...] = tuple(PROMPT)) -> np.ndarray:
    """P(continuation) for every continuation of `prompt`, shape [V] * NEW_TOKENS, by enumerating prefixes.

    Uses the target's own logits processors (transformers' `_get_logits_processor`, as `generate` does).
    """
    key = (id(model), tuple(sorted(sampling.items())), tuple(prompt))
    if key not in _EXACT:
        config = copy.deepcopy(model.generation_config)
        config.update(do_sample=True, **sampling)
        processors = model._get_logits_processor(config)
        law = np.ones(())
        for step in range(NEW_TOKENS):
            ids = torch.tensor([list(prompt) + list(p) for p in itertools.product(range(E2E_VOCAB), repeat=step)])
            with torch.no_grad():
                probs = processors(ids, model(ids).logits[:, -1].float()).softmax(-1).double().numpy()
            law = (law.reshape(-1, 1) * probs).reshape([E2E_VOCAB] * (step + 1))
        _EXACT[key] = law
    return _EXACT[key]


def ssd_samples(target, draft, config: SSDConfig, sampling: dict, seed: int, samples: int = SAMPLES,
                generated: int = NEW_TOKENS):
    """Counts [V] * NEW_TOKENS of SSD continuations and (cache hits, cache misses) summed over the samples. With
    `generated` > NEW_TOKENS each call generates that many and the first NEW_TOKENS are counted (their law is the
    same): drafting stops where the next round can verify no more (`Batch.room`), so a longer call leaves a
    just-in-time speculation room to stop early of its own accord."""
    counts = np.zeros([E2E_VOCAB] * NEW_TOKENS, dtype=np.int64)
    hits = misses = 0
    input_ids = torch.tensor([PROMPT])
    torch.manual_seed(seed)
    for _ in range(samples):
        out = target.generate(
            input_ids, assistant_model=draft, ssd_config=config, do_sample=True, max_new_tokens=generated,
            **sampling,
        )
        continuation = out[0, len(PROMPT):].tolist()
        assert len(continuation) == generated
        continuation = continuation[:NEW_TOKENS]
        counts[tuple(continuation)] += 1
        metrics = target.ssd_metrics
        hits += metrics.cache_hits
        misses += metrics.cache_lookups - metrics.cache_hits
    return counts, hits, misses


def ssd_law_pvalues(target, draft, config: SSDConfig, sampling: dict, seed: int, samples: int = SAMPLES
                    ) -> dict[str, float]:
    """`law_pvalues` of SSD's samples (`ssd_samples`) against the target's exact law, printed with the cache's hits
    and misses."""
    counts, hits, misses = ssd_samples(target, draft, config, sampling, seed, samples)
    pvalues = law_pvalues(exact_law(target, sampling), counts)
    print(f"p-values {pvalues}, hits {hits}, misses {misses}")
    return pvalues


def law_pvalues(law: np.ndarray, counts: np.ndarray) -> dict[str, float]:
    """Chi-square p-values of the joint law, of the first three tokens, of each position and each adjacent pair."""
    everything = tuple(range(NEW_TOKENS))
    groups = {"joint": everything, "first3": (0, 1, 2)}
    groups.update({f"token{i}": (i,) for i in everything})
    groups.update({f"pair{i}{i + 1}": (i, i + 1) for i in everything[:-1]})
    pvalues = {}
    for name, kept in groups.items():
        axes = tuple(a for a in everything if a not in kept)
        pvalues[name] = chisquare_pvalue(law.sum(axis=axes), counts.sum(axis=axes))
    return pvalues


TEMPERATURE = {"temperature": 1.0}
# Path tests and negative controls (which corrupt one path): a constant schedule keeps every round on the path (an
# adaptive one takes plain steps where the tiny models make them faster, diluting it). The adaptive schedule's
# law: test_ssd_sampling_law_under_the_adaptive_schedule below and tests/test_lookahead.py (scripted K).
CONTROL_SCHEDULE = "constant"
WARPED = {"temperature": 0.8, "top_k": 4, "top_p": 0.9, "min_p": 0.05}

# (draft, lookahead, budget, C, backup, executor, sampling). Each backup, executor and C in {1, < 1} appears with
# both drafts; the self-draft makes cache hits dominate, the unrelated draft misses. The strong Saguaro rescaling
# (C = 0.05) of the second config makes a self-draft reject often, so its rounds verify whole cached branches.
E2E_CONFIGS = [
    pytest.param("self", 1, 4, 1.0, "draft", "sync", TEMPERATURE, id="self-C1-draft-sync"),
    pytest.param("self", 2, 4, 0.05, "ngram", "thread", TEMPERATURE, id="self-C0.05-ngram-thread"),
    pytest.param("self", 1, 2, 0.3, "random", "sync", {"temperature": 0.9, "top_p": 0.9},
                 id="self-C0.3-random-sync-topp"),
    pytest.param("random", 2, 4, 1.0, "random", "thread", TEMPERATURE, id="rand-C1-random-thread"),
    pytest.param("random", 2, 4, 0.3, "draft", "thread", TEMPERATURE, id="rand-C0.3-draft-thread"),
    pytest.param("random", 3, 6, 0.5, "ngram", "sync", WARPED, id="rand-C0.5-ngram-sync-warped"),
    pytest.param("self", 2, 4, 0.05, "draft", "process", TEMPERATURE, id="self-C0.05-draft-process"),
    pytest.param("random", 2, 4, 0.5, "random", "process", WARPED, id="rand-C0.5-random-process-warped"),
    pytest.param("self", 2, 4, 0.3, "ngram", "stream", TEMPERATURE, id="self-C0.3-ngram-stream"),
    # a processor that reads token ids before the warpers: per position, then the warpers over every position
    pytest.param("random", 2, 4, 0.5, "draft", "thread", {**WARPED, "repetition_penalty": 1.5},
                 id="rand-C0.5-draft-thread-penalty"),
]


@pytest.mark.parametrize("draft, executor", [("self", "sync"), ("random", "process"), ("random", "stream")])
def test_ssd_sampling_law_under_the_adaptive_schedule(models, draft, executor):
    """The default schedule, unscripted: K chosen from the run's own timings (plain steps, pauses and returns
    included where it decides so); the law is the target's."""
    config = SSDConfig(lookahead=3, fanout_budget=4, saguaro_c=0.5, backup="ngram", executor=executor)
    assert config.lookahead_schedule == "adaptive"
    counts, hits, misses = ssd_samples(models["target"], models[draft], config, TEMPERATURE, seed=77,
                                       samples=SAMPLES // 2)
    pvalues = law_pvalues(exact_law(models["target"], TEMPERATURE), counts)
    print(f"adaptive p-values {pvalues}, hits {hits}, misses {misses}")
    assert min(pvalues.values()) >= ALPHA, pvalues


@pytest.mark.parametrize("draft, lookahead, budget, c, backup, executor, sampling", E2E_CONFIGS)
def test_ssd_sampling_law_matches_target(models, draft, lookahead, budget, c, backup, executor, sampling):
    """SSD continuations follow the target's exact law; the hit and the miss path both ran."""
    target = models["target"]
    config = SSDConfig(lookahead=lookahead, fanout_budget=budget, saguaro_c=c, backup=backup, executor=executor,
                       lookahead_schedule=CONTROL_SCHEDULE)  # every round on the hit / miss paths
    counts, hits, misses = ssd_samples(target, models[draft], config, sampling, seed=2024)
    pvalues = law_pvalues(exact_law(target, sampling), counts)
    print(f"p-values {pvalues}, hits {hits}, misses {misses}")
    assert min(pvalues.values()) >= ALPHA, pvalues
    assert hits > 0 and misses > 0, (hits, misses)
    assert (hits > misses) if draft == "self" else (misses > hits), (hits, misses)


def test_negative_control_saguaro_q_mismatch_is_rejected(models, monkeypatch):
    """Power check of the end-to-end harness: sample the draft from σ_{F,C} but hand verification the vanilla q."""
    original = SaguaroCandidateGenerator._sample

    def sample_with_vanilla_q(self, logits, saguaro_top):
        tokens, _, confidence = original(self, logits, saguaro_top)
        return tokens, draft_probs(logits, self.warpers, 0, 1.0), confidence

    monkeypatch.setattr(SaguaroCandidateGenerator, "_sample", sample_with_vanilla_q)
    target = models["target"]
    config = SSDConfig(lookahead=2, fanout_budget=4, saguaro_c=0.3, backup="random", executor="sync",
                       lookahead_schedule=CONTROL_SCHEDULE)
    counts, _, _ = ssd_samples(target, models["random"], config, TEMPERATURE, seed=2024)
    pvalues = law_pvalues(exact_law(target, TEMPERATURE), counts)
    print(f"negative control p-values {pvalues}")
    assert min(pvalues.values()) < REJECT, pvalues


def swap_cached_q(monkeypatch) -> None:
    """Corrupt the hit path alone: every cached branch's q reaches verification with its steps swapped."""
    lookup = SpeculationCache.lookup

    def lookup_swapped(self, row, accepted, bonus):
        found = lookup(self, row, accepted, bonus)
        return None if found is None else dataclasses.replace(found, probs=found.probs.flip(0))

    monkeypatch.setattr(SpeculationCache, "lookup", lookup_swapped)


def test_negative_control_hit_path_q_misaligned_is_rejected(models, monkeypatch):
    """Power check of the hit path alone: hand verification a cached branch's q with its two steps swapped.

    Rejected with half the samples (min p-values 1e-14..1e-41 over six seeds).
    """
    swap_cached_q(monkeypatch)
    target = models["target"]
    config = SSDConfig(lookahead=2, fanout_budget=4, saguaro_c=0.05, backup="ngram", executor="sync",
                       lookahead_schedule=CONTROL_SCHEDULE)
    counts, hits, _ = ssd_samples(target, target, config, TEMPERATURE, seed=2024, samples=SAMPLES // 2)
    pvalues = law_pvalues(exact_law(target, TEMPERATURE), counts)
    print(f"hit-path negative control p-values {pvalues}, hits {hits}")
    assert hits > 0 and min(pvalues.values()) < REJECT, pvalues


@pytest.mark.parametrize("part", ["hit", "miss"])
def test_negative_control_q_corrupted_at_the_process_boundary(models, monkeypatch, part):
    """Power check of the process executor's transport: speculations read back from the worker's shared buffers
    with their q corrupted (a hit's two steps swapped; a miss's one-hot n-gram q made uniform) are rejected."""
    from hf_ssd.runtime.process import ProcessExecutor

    read = ProcessExecutor._speculations

    def corrupted(self, slot, count):
        out = read(self, slot, count)
        for resolution in out:
            spec = resolution.speculation
            if part == "hit" and spec.source == "cache":
                spec.probs = spec.probs.flip(0).clone()
            elif part == "miss" and spec.source != "cache":
                spec.probs = torch.full_like(spec.probs, 1.0 / spec.probs.shape[-1])
        return out

    monkeypatch.setattr(ProcessExecutor, "_speculations", corrupted)
    target = models["target"]
    if part == "hit":
        config = SSDConfig(lookahead=2, fanout_budget=4, saguaro_c=0.05, backup="ngram", executor="process",
                           lookahead_schedule=CONTROL_SCHEDULE)
        draft = target
    else:
        config = SSDConfig(lookahead=2, fanout_budget=4, backup="ngram", executor="process",
                           lookahead_schedule=CONTROL_SCHEDULE)
        draft = models["random"]
    counts, hits, misses = ssd_samples(target, draft, config, TEMPERATURE, seed=2024, samples=SAMPLES // 2)
    pvalues = law_pvalues(exact_law(target, TEMPERATURE), counts)
    print(f"process {part}-path negative control p-values {pvalues}, hits {hits}, misses {misses}")
    assert min(pvalues.values()) < REJECT, pvalues


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("backup", ["draft", "ngram"])
def test_sampling_is_reproducible_and_executor_independent(backup, rows):
    """The same seed gives the same sampled tokens under every executor (per-round draft seeds), for a fixed
    backup and constant lookahead and fan-out budget schedules. (`backup="auto"` and the adaptive schedules decide
    from measured latencies, so which backup runs, how many tokens a round verifies and how many branches the draft
    samples may vary between runs.)"""
    target, draft = tiny_pair("llama", seed=31)
    input_ids = torch.randint(0, 96, (rows, 6), generator=torch.Generator().manual_seed(0))
    outputs = []
    for executor in ("thread", "sync", "process", "stream", "thread"):
        torch.manual_seed(123)
        config = SSDConfig(lookahead=3, saguaro_c=0.5, executor=executor, backup=backup,
                           lookahead_schedule="constant", fanout_budget_schedule="constant")
        outputs.append(target.generate(input_ids, assistant_model=draft, do_sample=True, max_new_tokens=30,
                                       ssd_config=config, pad_token_id=0))
    assert all(torch.equal(outputs[0], out) for out in outputs[1:])
