"""Tree attention over the shared-prefix draft cache equals running every branch on its own."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from hf_ssd import SSDConfig
from hf_ssd.cache.draft_cache import DraftCache
from hf_ssd.cache.speculation_cache import Speculation
from hf_ssd.cache.tree_attention import (
    additive_mask,
    causal_visibility,
    fork_visibility,
    tree_step_positions,
    tree_step_visibility,
)
from hf_ssd.generation.candidate_generator import SaguaroCandidateGenerator
from hf_ssd.generation.fanout import FanoutEstimator


def test_fork_and_tree_visibility_patterns():
    forks = torch.tensor([0, 2, 3])
    assert fork_visibility(forks, 4).tolist() == [
        [True, False, False, False],
        [True, True, True, False],
        [True, True, True, True],
    ]
    prefix_valid = torch.tensor([False, True])
    vis = tree_step_visibility(prefix_valid, forks, glue_len=4, step=2)
    assert vis.shape == (3, 2 + 4 + 2 * 3)
    assert not vis[:, 0].any() and vis[:, 1].all()  # padding never visible, prefix always
    own = vis[:, 6:]
    assert own.tolist() == [[True, False, False] * 2, [False, True, False] * 2, [False, False, True] * 2]
    assert tree_step_positions(10, forks, 2).tolist() == [12, 14, 15]


def test_causal_visibility_and_window_mask():
    valid = torch.tensor([True, False, True])
    vis = causal_visibility(valid, 2)
    assert vis.tolist() == [[True, False, True, True, False], [True, False, True, True, True]]
    key_pos = torch.tensor([0, 0, 1, 2, 3])
    mask = additive_mask(vis, torch.tensor([2, 3]), key_pos, torch.float32, window=2)
    allowed = (mask[0, 0] == 0).tolist()
    # window 2: position 2 sees positions 1..2, position 3 sees 2..3
    assert allowed == [[False, False, True, True, False], [False, False, False, True, True]]


def _reference_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral_sliding", "qwen2_hybrid"])
def test_tree_step_logits_match_independent_branches(arch):
    """Each branch's logits at every tree step equal a plain forward over that branch's own sequence."""
    model = tiny_model(arch, layers=2, seed=3)
    torch.manual_seed(0)
    prefix = torch.randint(0, 96, (12,)).tolist()  # longer than the sliding window (8)
    glue = torch.randint(0, 96, (4,)).tolist()  # t_prev, s1..s3
    forks = torch.tensor([0, 0, 1, 2, 3, 3])
    candidates = torch.randint(0, 96, (6,))
    cache = DraftCache(model)
    with torch.no_grad():
        n = len(prefix)
        cache.forward(torch.tensor(prefix), torch.arange(n), causal_visibility(cache.valid, n))
        cache.forward(torch.tensor(glue), n + torch.arange(4), causal_visibility(cache.valid, 4))
        current = candidates
        history = [[] for _ in range(6)]
        for step in range(1, 4):
            vis = tree_step_visibility(cache.valid[:n], forks, 4, step)
            logits = cache.forward(current, tree_step_positions(n, forks, step), vis)
            for b in range(6):
                history[b].append(int(current[b]))
                seq = prefix + glue[: int(forks[b]) + 1] + history[b]
                torch.testing.assert_close(logits[b], _reference_logits(model, seq), atol=2e-5, rtol=1e-4)
            current = logits.argmax(-1)
    cache.crop(n + 4)
    assert len(cache) == n + 4 and cache.kv.get_seq_length() == n + 4


@pytest.mark.parametrize("arch", ["llama", "mistral_sliding"])
def test_prepared_branches_equal_sequential_greedy_drafts(arch):
    """`prepare` stores, for each outcome key, exactly the draft's own greedy continuation of that outcome."""
    model = tiny_model(arch, layers=2, seed=4)
    k = 3
    config = SSDConfig(lookahead=k, fanout=[2, 1, 1, 2])
    estimator = FanoutEstimator(config.fanout, config.branches, k, 96, 0.7, 1.0)
    drafter = SaguaroCandidateGenerator(model, config, False, [], 96, estimator)
    torch.manual_seed(1)
    prompt = torch.randint(0, 96, (1, 11))
    with torch.no_grad():
        first = drafter.begin(prompt, None)
        drafter.prepare(first)
    spec_cache = drafter.spec_cache
    assert len(spec_cache) == 6
    context = prompt[0].tolist()
    drafted = first.tokens.tolist()
    for (row, fork, bonus), index in spec_cache._index.items():
        assert row == 0
        if fork < k:
            assert bonus != drafted[fork]  # the drafted token itself is never a bonus candidate
        seq = context + drafted[:fork] + [bonus]
        expected = []
        for _ in range(k):
            token = int(_reference_logits(model, seq).argmax())
            expected.append(token)
            seq = seq + [token]
        assert spec_cache.tokens[index].tolist() == expected
    # the first speculation is the draft's own greedy continuation too
    seq = context
    for token in drafted:
        assert token == int(_reference_logits(model, seq).argmax())
        seq = seq + [token]


def test_resolve_commits_outcome_and_returns_hit_or_backup():
    model = tiny_model("llama", layers=1, seed=5)
    config = SSDConfig(lookahead=2, fanout=[3, 0, 0], backup="random")
    estimator = FanoutEstimator(config.fanout, config.branches, 2, 96, 0.7, 1.0)
    drafter = SaguaroCandidateGenerator(model, config, False, [], 96, estimator)
    prompt = torch.arange(1, 9)[None]
    with torch.no_grad():
        first = drafter.begin(prompt, None)
        drafter.prepare(first)
        key = next(iter(drafter.spec_cache._index))
        hit = drafter.resolve(accepted=0, bonus=key[2], verified=2)
        assert hit.hit and hit.candidates == 3 and hit.speculation.source == "cache"
        assert drafter.context == prompt[0].tolist() + [key[2]]
        # committed tokens except the newest, then the hit branch's tree KV: [bonus, s'_1]
        assert len(drafter.cache) == prompt.shape[1] + 2
        assert drafter.cache.positions[-2:].tolist() == [8, 9]
        drafter.prepare(hit.speculation)
        miss = drafter.resolve(accepted=2, bonus=95 if key[2] != 95 else 94, verified=2)
        assert not miss.hit and miss.candidates == 0 and miss.speculation.source == "random"
        assert len(drafter.cache) == prompt.shape[1] + 3  # a random backup leaves no KV behind
        assert isinstance(miss.speculation, Speculation) and miss.speculation.tokens.shape == (2,)


def test_tree_stops_once_the_announced_outcome_is_not_prepared():
    model = tiny_model("llama", layers=1, seed=6)
    config = SSDConfig(lookahead=3, fanout=[2, 1, 1, 0])  # nothing prepared for "all three accepted"
    estimator = FanoutEstimator(config.fanout, config.branches, 3, 96, 0.7, 1.0)
    drafter = SaguaroCandidateGenerator(model, config, False, [], 96, estimator)
    with torch.no_grad():
        first = drafter.begin(torch.arange(1, 8)[None], None)
        drafter.announce((3, 5))
        drafter.prepare(first)
        assert drafter.spec_cache is None and drafter.skipped_tree_steps == 3
        miss = drafter.resolve(accepted=3, bonus=5, verified=3)
        assert not miss.hit and miss.candidates == 0
        drafter.announce((0, int(miss.speculation.tokens[0])))  # a rejected draft token is never prepared
        drafter.prepare(miss.speculation)
        assert drafter.spec_cache is None and drafter.skipped_tree_steps == 6
        again = drafter.resolve(accepted=0, bonus=int(miss.speculation.tokens[0]) + 1, verified=3)
        assert not again.hit and again.candidates == 2


@pytest.mark.parametrize("self_draft", [True, False])
def test_candidate_generator_interface_in_transformers_own_loop(monkeypatch, self_draft):
    """`SaguaroCandidateGenerator` also serves transformers' stock assisted loop (synchronously, greedy exact)."""
    from conftest import tiny_pair

    target, draft = tiny_pair("llama", seed=41)
    draft = target if self_draft else draft
    config = SSDConfig(lookahead=3, fanout_budget=6)
    estimator = FanoutEstimator(config.fanout, config.branches, 3, 96, 0.7, 1.0)
    drafter = SaguaroCandidateGenerator(draft, config, False, [], 96, estimator)
    monkeypatch.setattr(target, "_get_candidate_generator", lambda **kwargs: drafter)
    input_ids = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(3))
    expected = target.generate(input_ids, max_new_tokens=30, do_sample=False)
    out = target.generate(input_ids, assistant_model=draft, max_new_tokens=30, do_sample=False)  # stock loop
    assert torch.equal(out, expected)
    assert drafter.speculation is not None and drafter._round > 0
