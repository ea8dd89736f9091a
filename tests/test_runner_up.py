"""The draft's runner-up verified beside its first drafted token (`SSDConfig.runner_up`, `generation/runner_up.py`):
the sibling forward's logits and cache, which sibling wins, the learnt rate, the stop rule's and the policy's use of
it, and losslessness through runner-up rounds (greedy, across executors and architectures, with scores, processors and
padding; sampling: the two-candidate rejection's law, alone and end to end, with negative controls); never in a batch
of rows or on caches that cannot hold a sibling."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_model, truncated_copy
from test_greedy_equivalence import _other_arch
from test_lookahead import _script
from test_sampling_law import (
    ALPHA,
    E2E_VOCAB,
    REJECT,
    TEMPERATURE,
    WARPED,
    chisquare_pvalue,
    exact_law,
    law_pvalues,
    ssd_samples,
)
from test_serial_depth import _serial_policy
from transformers import DynamicCache

from hf_ssd import SSDConfig, enable_ssd
from hf_ssd.generation import target_rows, verification
from hf_ssd.generation.confidence import EDGES, StopRule
from hf_ssd.generation.runner_up import (
    FIRST_WON,
    NEITHER,
    RUNNER_UP_WON,
    RunnerUpCalibration,
    drop_position,
    sibling_inputs,
    sibling_winner,
)

BINS = len(EDGES) + 1


def _forward(model, ids, cache=None, **kwargs):
    return model(input_ids=ids, cache=cache, use_cache=cache is not None, **kwargs).logits[0]


@pytest.mark.parametrize("pad", [0, 3])
def test_sibling_forward_scores_each_sibling_as_its_own_chain(pad):
    model = tiny_model("llama", layers=2, seed=4)
    prompt = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompt)
    mask[0, :pad] = 0
    t, first, runner_up = int(prompt[0, -1]), 5, 7
    with torch.no_grad():
        cache = DynamicCache()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        _forward(model, prompt[:, :-1], cache, attention_mask=mask[:, :-1], position_ids=positions[:, :-1])
        ids, pos, attention = sibling_inputs(t, first, runner_up, int(positions[0, -1]), mask[0, :-1].bool(),
                                             torch.float32)
        tree = _forward(model, ids, cache, position_ids=pos, attention_mask=attention)
        assert cache.get_seq_length() == 12  # 9 cached, then t and both siblings
        for sibling, row in ((first, 1), (runner_up, 2)):
            chain = torch.cat([prompt, torch.tensor([[sibling]])], dim=1)
            chain_mask = torch.cat([mask, torch.ones(1, 1, dtype=mask.dtype)], dim=1)
            full = _forward(model, chain, attention_mask=chain_mask,
                            position_ids=(chain_mask.cumsum(-1) - 1).clamp(min=0))
            torch.testing.assert_close(tree[0], full[-2], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(tree[row], full[-1], atol=1e-5, rtol=1e-4)


def test_dropping_the_first_sibling_leaves_the_runner_ups_chain_in_the_cache():
    model = tiny_model("qwen2", layers=2, seed=5)
    prompt = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = DynamicCache()
        _forward(model, prompt[:, :-1], cache)
        ids, pos, attention = sibling_inputs(int(prompt[0, -1]), 11, 13, 7, torch.ones(7, dtype=torch.bool),
                                             torch.float32)
        _forward(model, ids, cache, position_ids=pos, attention_mask=attention)
        drop_position(cache, 8)  # s_1's slot
        chain = DynamicCache()
        _forward(model, torch.cat([prompt, torch.tensor([[13]])], dim=1), chain)
        # the next token after the runner-up sees the same keys either way
        after = _forward(model, torch.tensor([[3]]), cache)
        expected = _forward(model, torch.tensor([[3]]), chain)
    for mine, theirs in zip(cache.layers, chain.layers):
        torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(mine.values, theirs.values, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(after, expected, atol=1e-5, rtol=1e-4)


def test_the_targets_choice_decides_the_sibling():
    assert sibling_winner(4, 4, 9) == FIRST_WON
    assert sibling_winner(9, 4, 9) == RUNNER_UP_WON
    assert sibling_winner(2, 4, 9) == NEITHER


def test_the_rate_is_learnt_per_confidence_bin_and_shrunk_to_the_pooled_one():
    rates = RunnerUpCalibration()
    assert rates.table() == [0.0] * BINS  # nothing priced before a runner-up has been seen to win
    for _ in range(20):
        rates.add(0.35, True)
        rates.add(0.95, False)
    table = rates.table()
    assert rates.rate(0.35) > 0.85 and rates.rate(0.95) < 0.1
    pooled = sum(rates.wins) / sum(rates.chances)
    assert table[0] == pytest.approx(pooled)  # an unmeasured bin: the pooled rate
    assert all(0.0 <= r <= 1.0 for r in table)


def test_the_stop_rule_weighs_the_runner_up_it_would_give_up():
    """After one token the rule drafts a second only where it is expected to bring more than the runner-up that
    stopping would verify, net of its own price; with no runner-up at stake it drafts on, as before (and the second
    token that samples a_2 is drafted whatever the rule says only then)."""
    table, sure = (0.8,) * BINS, torch.tensor([0.5])
    one_row, reach = torch.tensor([True]), torch.ones(1)
    plain = StopRule(table, 0.1)
    assert plain.keeps_going(reach, sure, one_row, 1)[0]  # 0.8 x 0.8 = 0.64 >= 0.1
    assert StopRule(table, 0.1, runner_up=(0.5,) * BINS).keeps_going(reach, sure, one_row, 1)[0]  # 0.14 >= 0.1
    worth_more = StopRule(table, 0.1, runner_up=(0.6,) * BINS)
    assert not worth_more.keeps_going(reach, sure, one_row, 1)[0]  # 0.04 < 0.1: stop, verify s_1 and r
    assert not StopRule(table, 0.1, at_least=2, runner_up=(0.6,) * BINS).keeps_going(reach, sure, one_row, 1)[0]
    assert StopRule(table, 0.1, at_least=2).keeps_going(reach, sure, one_row, 1)[0]
    assert worth_more.keeps_going(reach * 0.8, sure, one_row, 2)[0]  # past the first token it plays no part
    # it crosses to a worker process with the rule
    assert StopRule.from_list(worth_more.to_list()) == worth_more
    assert StopRule.from_list(plain.to_list()).runner_up == ()
    assert len(worth_more.to_list()) == StopRule.list_size(0)


def test_the_policy_verifies_a_runner_up_where_its_rate_pays_for_the_position():
    policy = _serial_policy(serial_lookahead=10)
    policy.choose(1, confidence=[torch.tensor([0.3])])
    hand = torch.tensor([0.3])
    assert not policy.take_runner_up(1, 0, lambda: True, hand)  # never seen to win: not priced
    for _ in range(10):
        policy.runner_ups.add(0.3, True)
    assert policy.runner_up_step() == pytest.approx(0.002)  # the curve's step from 2 positions to 3
    assert policy.take_runner_up(1, 0, lambda: True, hand) and policy.trace[-1]["runner_up"] > 0.5
    assert policy.runner_up_table()[2] > 0.5 and policy.runner_up_rounds == 1
    assert not policy.take_runner_up(2, 0, lambda: True, hand)  # only beside one verified token
    assert not policy.take_runner_up(1, 3, lambda: True, hand)  # not where the draft prepares beside the verification
    assert not policy.take_runner_up(1, 0, lambda: False, hand)  # not where the target cannot take it
    policy._exploring = True  # not in a round that times K = 1: its forward would be timed as K = 2's
    assert not policy.take_runner_up(1, 0, lambda: True, hand)
    policy._exploring = False
    policy.runner_up_mode = "never"
    assert not policy.take_runner_up(1, 0, lambda: True, hand) and policy.runner_up_table() == ()
    for _ in range(60):
        policy.runner_ups.add(0.3, False)
    policy.runner_up_mode = "auto"
    assert not policy.take_runner_up(1, 0, lambda: True, hand)  # a runner-up that stopped winning
    policy.runner_up_mode = "always"
    assert policy.take_runner_up(1, 0, lambda: True, hand)


def test_config_checks_runner_up():
    assert SSDConfig().runner_up == "auto"
    with pytest.raises(ValueError, match="runner_up"):
        SSDConfig(runner_up="sometimes")


# Serial rounds verifying one token with its runner-up: after a one-token speculation and after a two-token one
# (the draft's KV past t_prev dropped when r wins), into a concurrent round, a plain step (a process executor holds
# the outcome back with the rounds the draft sat out), and K = 2 rounds between them.
RUNNER_UP_SCRIPT = [(0, 0, 1), (1, 0, 2), (1, 0, 1), (1, 0, 2), (2, 0, 1), (1, 3), (1, 0, 0), (0, 0, 1), (1, 0, 1),
                    (1, 0, 3)]
CAPABLE = ["llama", "qwen2", "gpt2", "phi3", "mixtral"]
SLIDING = ["mistral_sliding", "qwen2_hybrid", "gemma2"]


def _models(arch: str):
    if arch in ("gpt2", "phi3", "mixtral", "gemma2"):
        torch.manual_seed(3)
        target, vocab = enable_ssd(_other_arch(arch, 3).eval()), 128
    else:
        target, vocab = enable_ssd(tiny_model(arch, layers=3, seed=3)), 96
    return target, truncated_copy(target, layers=1), vocab  # agrees often, and its second choice sometimes


@pytest.mark.parametrize("executor", ["sync", "thread", "process", "stream"])
@pytest.mark.parametrize("arch", CAPABLE + SLIDING)
def test_greedy_identical_through_runner_up_rounds(monkeypatch, arch, executor):
    _script(monkeypatch, RUNNER_UP_SCRIPT)
    target, draft, vocab = _models(arch)
    rounds = wins = 0
    for seed in range(3):
        ids = torch.randint(0, vocab, (1, 11), generator=torch.Generator().manual_seed(seed))
        expected = target.generate(ids, max_new_tokens=40, do_sample=False)
        out = target.generate(ids, assistant_model=draft, max_new_tokens=40, do_sample=False,
                              ssd_config=SSDConfig(lookahead=3, executor=executor, runner_up="always"))
        assert torch.equal(out, expected), seed
        rounds += target.ssd_metrics.runner_up_rounds
        wins += target.ssd_metrics.runner_up_accepted
    if arch in SLIDING:  # a sliding window's cache keeps fewer positions than the sibling mask spans
        assert rounds == 0
    else:
        assert rounds > 0 and 0 < wins < rounds, (rounds, wins)


def test_scores_processors_and_padding_through_runner_up_rounds(monkeypatch):
    _script(monkeypatch, RUNNER_UP_SCRIPT)
    target, draft, _ = _models("llama")
    ids = torch.randint(1, 96, (1, 12), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row of one
    ids = ids * mask
    kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, repetition_penalty=1.3,
                  no_repeat_ngram_size=3, return_dict_in_generate=True, output_scores=True, output_logits=True,
                  pad_token_id=0)
    expected = target.generate(ids, **kwargs)
    out = target.generate(ids, assistant_model=draft, ssd_config=SSDConfig(lookahead=3, runner_up="always"), **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    assert target.ssd_metrics.runner_up_rounds > 0 and target.ssd_metrics.runner_up_accepted > 0
    for mine, theirs in zip(out.scores, expected.scores):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    for mine, theirs in zip(out.logits, expected.logits):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ["batch", "static cache", "never"])
def test_no_runner_up_where_it_does_not_apply(monkeypatch, case):
    """A batch of rows (each would keep a different sibling slot: only its last row, once the others are done, takes
    one), a static cache (no room for a sibling) and runner_up="never" take none; greedy outputs stay identical."""
    _script(monkeypatch, RUNNER_UP_SCRIPT)
    target, draft, _ = _models("llama")
    rows = 2 if case == "batch" else 1
    ids = torch.randint(0, 96, (rows, 11), generator=torch.Generator().manual_seed(6))
    kwargs = dict(max_new_tokens=30, do_sample=False, pad_token_id=0)
    if case == "static cache":
        kwargs["cache_implementation"] = "static"
    mode = "never" if case == "never" else "always"
    out = target.generate(ids, assistant_model=draft, ssd_config=SSDConfig(lookahead=3, runner_up=mode), **kwargs)
    metrics = target.ssd_metrics
    taken = [entry["rows"] for entry in metrics.lookahead_decisions if "runner_up" in entry]
    assert len(taken) == metrics.runner_up_rounds
    if case == "batch":  # the rows accept different counts: one finishes first, and the last goes on alone
        assert set(taken) <= {1} and metrics.batch_rounds < metrics.rounds
    else:
        assert metrics.runner_up_rounds == 0
    assert torch.equal(out, target.generate(ids, **kwargs))


# --- sampling ------------------------------------------------------------------------------------------------------

LAW_V = 6


def _two_candidate_counts(seed: int, samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(counts [V, V + 1] of (the token after t, the bonus after it or V where none is drawn), the law of those) for
    s_1 ~ q and the runner-up the likeliest other token of q, through `sibling_sampling_verify`."""
    generator = torch.Generator().manual_seed(seed)
    draw = torch.Generator().manual_seed(seed + 1)
    q = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
    p = torch.tensor([[0.10, 0.05, 0.30, 0.25, 0.20, 0.10],  # after t
                      [0.50, 0.10, 0.10, 0.10, 0.10, 0.10],  # after any first candidate
                      [0.05, 0.05, 0.05, 0.05, 0.20, 0.60]])  # after any runner-up
    order = q.argsort(descending=True).tolist()
    counts = np.zeros((LAW_V, LAW_V + 1), dtype=np.int64)
    for _ in range(samples):
        first = int(torch.multinomial(q, 1, generator=draw))
        runner_up = next(t for t in order if t != first)
        winner, token = verification.sibling_sampling_verify(first, runner_up, q, p, generator)
        if winner == NEITHER:  # the token after t, no bonus
            counts[token, LAW_V] += 1
        else:  # the candidate taken, the bonus after it
            counts[first if winner == FIRST_WON else runner_up, token] += 1
    return counts, p.numpy()


def test_two_candidate_rejection_draws_the_targets_law():
    """`sibling_sampling_verify`: the token after t follows p_0 whichever candidate the draft drew and whichever
    runner-up it named; a bonus after the first candidate follows p_1, after the runner-up p_2."""
    counts, p = _two_candidate_counts(seed=5, samples=40000)
    assert chisquare_pvalue(p[0], counts.sum(axis=1)) >= ALPHA
    # q's likeliest token 0 is drawn as s_1 or named the runner-up (then s_1 is drawn elsewhere): its bonus is a
    # mixture; any other token taken as a candidate was s_1, or the runner-up 1 where s_1 was 0
    for token in range(2, LAW_V):
        bonuses = counts[token, :LAW_V]
        assert bonuses.sum() > 200 and chisquare_pvalue(p[1], bonuses) >= ALPHA, token
    assert counts[:, :LAW_V].sum() < counts.sum()  # some draws took neither candidate


def test_negative_control_two_candidate_rejection_against_p_instead_of_the_residual(monkeypatch):
    """Power check: weighing the runner-up against p_0 instead of the residual after s_1's rejection (the classic
    error of resampling from p) is rejected."""
    monkeypatch.setattr(verification, "residual_distribution", lambda p, q: p)
    counts, p = _two_candidate_counts(seed=6, samples=40000)
    assert chisquare_pvalue(p[0], counts.sum(axis=1)) < REJECT


@pytest.fixture(scope="module")
def law_models():
    """The sampling-law pair of test_sampling_law: a peaked 1-layer target and an unrelated draft."""
    target = enable_ssd(tiny_model(layers=1, vocab_size=E2E_VOCAB, hidden=16, seed=0, initializer_range=0.3))
    draft = tiny_model(layers=1, vocab_size=E2E_VOCAB, hidden=16, seed=7, initializer_range=0.3)
    return {"target": target, "self": target, "random": draft}


# Sampling, 4 new tokens: a plain step drafting one token just in time, then serial rounds verifying one token with
# its runner-up beside it (after a one-token and a two-token speculation).
LAW_RUNNER_UP_SCRIPT = [(0, 0, 1), (1, 0, 1), (1, 0, 2), (1, 0, 1)]


@pytest.mark.parametrize("executor, sampling", [
    pytest.param("sync", TEMPERATURE, id="sync"),
    pytest.param("process", WARPED, id="process-warped"),
])
def test_sampling_law_through_runner_up_rounds(monkeypatch, law_models, executor, sampling):
    """The unrelated draft (a self-draft's s_1 is always accepted: its q is p): its runner-up wins some rounds."""
    _script(monkeypatch, LAW_RUNNER_UP_SCRIPT)
    target = law_models["target"]
    config = SSDConfig(lookahead=3, fanout_budget=4, backup="draft", executor=executor, runner_up="always")
    rounds = []
    original = target_rows.TargetBatch._verify_siblings

    def counted(self, *args, **kwargs):
        verdict = original(self, *args, **kwargs)
        rounds.append(verdict.runner_up[0])
        return verdict

    monkeypatch.setattr(target_rows.TargetBatch, "_verify_siblings", counted)
    counts, _, _ = ssd_samples(target, law_models["random"], config, sampling, seed=97)
    pvalues = law_pvalues(exact_law(target, sampling), counts)
    print(f"p-values {pvalues}, runner-up rounds {len(rounds)}, won {sum(rounds)}")
    assert len(rounds) > 300 and 0 < sum(rounds) < len(rounds)
    assert min(pvalues.values()) >= ALPHA, pvalues


def test_negative_control_runner_up_always_taken_when_the_first_is_rejected(monkeypatch, law_models):
    """Power check: a sibling verification that takes the runner-up whenever s_1 is rejected is rejected."""
    _script(monkeypatch, LAW_RUNNER_UP_SCRIPT)

    def biased(first, runner_up, q, p, generator=None):
        winner, token = verification.sibling_sampling_verify(first, runner_up, q, p, generator)
        if winner == NEITHER:
            return RUNNER_UP_WON, int(torch.multinomial(p[2].float(), 1, generator=generator))
        return winner, token

    monkeypatch.setattr(target_rows, "sibling_sampling_verify", biased)
    target = law_models["target"]
    config = SSDConfig(lookahead=3, fanout_budget=4, backup="draft", executor="sync", runner_up="always")
    counts, _, _ = ssd_samples(target, law_models["random"], config, TEMPERATURE, seed=96)
    assert min(law_pvalues(exact_law(target, TEMPERATURE), counts).values()) < REJECT
