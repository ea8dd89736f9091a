"""Tree attention over the shared-prefix draft cache equals running every branch on its own."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from hf_ssd import SSDConfig
from hf_ssd.cache.alignment import compact, gather_slots, keep_leading
from hf_ssd.cache.draft_cache import DraftCache
from hf_ssd.cache.speculation_cache import Speculation
from hf_ssd.cache.tree_attention import (
    additive_mask,
    causal_visibility,
    tree_step_positions,
    tree_step_visibility,
)
from hf_ssd.generation.candidate_generator import SaguaroCandidateGenerator


def test_tree_visibility_follows_each_rows_main_path():
    # two rows; row 0: a pad slot then positions 0..4; row 1: positions 0..5 (one slot longer history)
    main_valid = torch.tensor([[False, True, True, True, True, True], [True] * 6])
    main_pos = torch.tensor([[0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5]])
    glue_start = torch.tensor([2, 3])  # t_prev of row 0 sits at position 2, of row 1 at 3
    forks = torch.tensor([[0, 1, 2], [0, 0, 2]])
    vis = tree_step_visibility(main_valid, main_pos, glue_start, forks, step=2)
    assert vis.shape == (2, 3, 6 + 2 * 3)
    assert not vis[0, :, 0].any()  # padding is never visible
    # row 0, fork j sees positions <= 2 + j; row 1, fork j sees positions <= 3 + j
    assert vis[0, :, :6].tolist() == [[False, True, True, True, False, False], [False, True, True, True, True, False],
                                      [False, True, True, True, True, True]]
    assert vis[1, :, :6].tolist() == [[True, True, True, True, False, False], [True, True, True, True, False, False],
                                      [True] * 6]
    own = vis[:, :, 6:]
    assert own[0].tolist() == own[1].tolist() == [[True, False, False] * 2, [False, True, False] * 2,
                                                  [False, False, True] * 2]
    assert tree_step_positions(glue_start, forks, 2).tolist() == [[4, 5, 6], [5, 5, 7]]


def test_causal_visibility_dummy_queries_and_window_mask():
    valid = torch.tensor([[True, False, True]])
    vis = causal_visibility(valid, 2)
    assert vis.tolist() == [[[True, False, True, True, False], [True, False, True, True, True]]]
    # a dummy first query: nothing sees it, it sees only itself
    dummy = causal_visibility(valid, 2, torch.tensor([[False, True]]))
    assert dummy.tolist() == [[[True, False, True, True, False], [True, False, True, False, True]]]
    key_pos = torch.tensor([[0, 0, 1, 2, 3]])
    mask = additive_mask(vis, torch.tensor([[2, 3]]), key_pos, torch.float32, window=2)
    assert mask.shape == (1, 1, 2, 5)
    allowed = (mask[0, 0] == 0).tolist()
    # window 2: position 2 sees positions 1..2, position 3 sees 2..3
    assert allowed == [[False, False, True, True, False], [False, False, False, True, True]]


def test_compact_right_aligns_kept_slots():
    keep = torch.tensor([[True, False, True, True], [False, True, False, False]])
    index, valid = compact(keep)
    assert valid.tolist() == [[True, True, True], [False, False, True]]
    assert index[0].tolist() == [0, 2, 3] and index[1, -1] == 1
    assert keep_leading(torch.tensor([2, 0]), 3).tolist() == [[True, True, False], [False, False, False]]
    kv = torch.arange(2 * 4).reshape(2, 1, 4, 1).float()
    gathered = gather_slots(kv, index, -2)
    assert gathered[0, 0, :, 0].tolist() == [0.0, 2.0, 3.0] and gathered[1, 0, -1, 0] == 5.0


def _reference_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral_sliding", "qwen2_hybrid"])
def test_tree_step_logits_match_independent_branches(arch):
    """Each branch's logits at every tree step equal a plain forward over that branch's own sequence, for two rows
    of different (left-padded) lengths in one batched cache."""
    model = tiny_model(arch, layers=2, seed=3)
    torch.manual_seed(0)
    prefixes = [torch.randint(0, 96, (12,)).tolist(), torch.randint(0, 96, (9,)).tolist()]  # > sliding window 8
    glues = [torch.randint(0, 96, (4,)).tolist() for _ in range(2)]  # t_prev, s1..s3
    forks = torch.tensor([[0, 0, 1, 2, 3, 3], [0, 1, 1, 2, 2, 3]])
    candidates = torch.randint(0, 96, (2, 6))
    width = 12
    ids = torch.zeros(2, width, dtype=torch.long)
    valid = torch.zeros(2, width, dtype=torch.bool)
    for r, prefix in enumerate(prefixes):
        ids[r, width - len(prefix):] = torch.tensor(prefix)
        valid[r, width - len(prefix):] = True
    positions = (valid.long().cumsum(1) - 1).clamp_min(0)
    cache = DraftCache(model, rows=2)
    with torch.no_grad():
        cache.forward(ids, positions, causal_visibility(cache.valid, width, valid), valid=valid)
        glue_start = positions[:, -1] + 1
        glue_pos = glue_start[:, None] + torch.arange(4)
        cache.forward(torch.tensor(glues), glue_pos, causal_visibility(cache.valid, 4))
        main = len(cache)
        current = candidates
        history = [[[] for _ in range(6)] for _ in range(2)]
        for step in range(1, 4):
            vis = tree_step_visibility(cache.valid[:, :main], cache.positions[:, :main], glue_start, forks, step)
            logits = cache.forward(current, tree_step_positions(glue_start, forks, step), vis)
            for r in range(2):
                for b in range(6):
                    history[r][b].append(int(current[r, b]))
                    seq = prefixes[r] + glues[r][: int(forks[r, b]) + 1] + history[r][b]
                    torch.testing.assert_close(logits[r, b], _reference_logits(model, seq), atol=2e-5, rtol=1e-4)
            current = logits.argmax(-1)
        # dropping the tree scratch moves nothing (every row keeps its whole main path); the cache then goes on
        cache.keep(torch.arange(len(cache))[None].expand(2, -1) < main)
        assert len(cache) == main and cache.kv.get_seq_length() == main
        nxt = torch.randint(0, 96, (2, 1))
        logits = cache.forward(nxt, glue_start[:, None] + 4, causal_visibility(cache.valid, 1))
        for r in range(2):
            torch.testing.assert_close(logits[r, 0], _reference_logits(model, prefixes[r] + glues[r] + [int(nxt[r])]),
                                       atol=2e-5, rtol=1e-4)


def test_keep_moves_only_the_tail_and_compacts_holes():
    """`DraftCache.keep` leaves the slots before the first dropped one in place and packs the rest; once holes
    would widen the cache by more than `max_holes` columns it compacts everything; the KV follows the slots."""
    model = tiny_model("llama", layers=1, seed=3)
    cache = DraftCache(model, rows=2)
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(5))
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[1, :3] = False  # row 1: three slots of left padding
    positions = (valid.long().cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        cache.forward(ids, positions, causal_visibility(cache.valid, 10, valid), valid=valid)
    keys = cache.kv.layers[0].keys.clone()
    keep = torch.ones(2, 10, dtype=torch.bool)
    keep[0, 6] = keep[1, 8] = False  # each row drops one slot
    cache.keep(keep)
    assert len(cache) == 9  # slots 0..5 stay; row 0 keeps 7..9, row 1 keeps 6, 7, 9 behind them
    assert cache.positions[0].tolist() == [0, 1, 2, 3, 4, 5, 7, 8, 9]
    assert cache.positions[1, 3:].tolist() == [0, 1, 2, 3, 4, 6] and not cache.valid[1, :3].any()
    torch.testing.assert_close(cache.kv.layers[0].keys[0, :, 6:], keys[0, :, 7:])
    torch.testing.assert_close(cache.kv.layers[0].keys[1, :, 6:8], keys[1, :, 6:8])
    torch.testing.assert_close(cache.kv.layers[0].keys[1, :, 8], keys[1, :, 9])

    holes = DraftCache(model, rows=2)
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[0, :2] = valid[1, :3] = False  # both rows padded: a full compaction could drop 2 columns
    positions = (valid.long().cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        holes.forward(ids, positions, causal_visibility(holes.valid, 10, valid), valid=valid)
    hole_keys = holes.kv.layers[0].keys.clone()
    keep = holes.valid.clone()
    keep[:, 8] = False
    holes.keep(keep, max_holes=2)
    assert len(holes) == 9 and holes.valid.sum(dim=1).tolist() == [7, 6]  # partial: the padding stays
    holes.keep(holes.valid.clone(), max_holes=1)  # nothing dropped, but 2 removable columns > 1
    assert len(holes) == 7 and holes.valid[0].all() and holes.positions[0].tolist() == [0, 1, 2, 3, 4, 5, 7]
    torch.testing.assert_close(holes.kv.layers[0].keys[0, :, :6], hole_keys[0, :, 2:8])
    torch.testing.assert_close(holes.kv.layers[0].keys[0, :, 6], hole_keys[0, :, 9])


def _check_branches(drafter, model, contexts, speculations, verified=None):
    """Every prepared branch of every row is the draft's own greedy continuation of its outcome."""
    k = drafter.lookahead
    verified = k if verified is None else verified
    spec_cache = drafter.spec_cache
    assert spec_cache is not None and len(spec_cache) == len(contexts) * drafter.config.branches
    for row, fork, bonus in spec_cache.keys():
        drafted = speculations[row].tokens.tolist()
        if fork < verified:
            assert bonus != drafted[fork]  # a verified drafted token is never a bonus candidate
        seq = contexts[row] + drafted[:fork] + [bonus]
        expected = []
        for _ in range(k):
            token = int(_reference_logits(model, seq).argmax())
            expected.append(token)
            seq = seq + [token]
        assert spec_cache.lookup(row, fork, bonus).tokens.tolist() == expected, (row, fork, bonus)


def _padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


@pytest.mark.parametrize("arch", ["llama", "mistral_sliding"])
def test_prepared_branches_equal_sequential_greedy_drafts(arch):
    """`prepare` stores, for each row's outcome keys, exactly the draft's own greedy continuation of that outcome:
    for left-padded rows of different lengths, then again after a round where one row hit (its branch's KV kept,
    glue of one token) and the other missed to an n-gram backup (full glue; the rows' glues differ in length)."""
    model = tiny_model(arch, layers=2, seed=4)
    k = 3
    config = SSDConfig(lookahead=k, fanout=[2, 1, 1, 2], backup="ngram")
    drafter = SaguaroCandidateGenerator(model, config, vocab_size=96)
    torch.manual_seed(1)
    contexts = [torch.randint(0, 96, (11,)).tolist(), torch.randint(0, 96, (6,)).tolist()]
    ids, mask = _padded(contexts)
    with torch.no_grad():
        first = drafter.begin(ids, mask)
        # the first speculations are the draft's own greedy continuations
        for context, spec in zip(contexts, first):
            seq = list(context)
            for token in spec.tokens.tolist():
                assert token == int(_reference_logits(model, seq).argmax())
                seq = seq + [token]
        drafter.prepare(speculations=first)
        _check_branches(drafter, model, contexts, first)
        hit_key = next(key for key in drafter.spec_cache.keys() if key[0] == 0)
        outcomes = [(hit_key[1], hit_key[2]), (k, 95)]
        found = drafter.spec_cache.lookup(1, k, 95)
        if found is not None:  # make row 1 miss for sure
            outcomes[1] = (0, int(first[1].tokens[0]))
        resolutions = drafter.resolve(outcomes, verified=k)
        assert resolutions[0].hit and not resolutions[1].hit
        assert resolutions[1].speculation.source == "ngram" and resolutions[1].speculation.row_top is None
        for r, (accepted, bonus) in enumerate(outcomes):
            contexts[r] = contexts[r] + first[r].tokens[:accepted].tolist() + [bonus]
            assert drafter.contexts[r] == contexts[r]
        second = [res.speculation for res in resolutions]
        drafter.prepare(speculations=second)
        _check_branches(drafter, model, contexts, second)


def test_resolve_commits_outcome_and_returns_hit_or_backup():
    model = tiny_model("llama", layers=1, seed=5)
    config = SSDConfig(lookahead=2, fanout=[3, 0, 0], backup="random")
    drafter = SaguaroCandidateGenerator(model, config, vocab_size=96)
    prompt = torch.arange(1, 9)[None]
    with torch.no_grad():
        first = drafter.begin(prompt, None)
        drafter.prepare(speculations=first)
        key = drafter.spec_cache.keys()[0]
        [hit] = drafter.resolve([(0, key[2])], verified=2)
        assert hit.hit and hit.speculation.source == "cache"
        assert dict(drafter.estimator.hits_by_f) == {3: [1, 1]}  # found among the 3 branches of its fork
        assert drafter.contexts[0] == prompt[0].tolist() + [key[2]]
        # committed tokens except the newest, then the hit branch's tree KV: [bonus, s'_1]
        assert len(drafter.cache) == prompt.shape[1] + 2 and bool(drafter.cache.valid.all())
        assert drafter.cache.positions[0, -2:].tolist() == [8, 9]
        drafter.prepare(speculations=[hit.speculation])
        [miss] = drafter.resolve([(2, 95 if key[2] != 95 else 94)], verified=2)
        assert not miss.hit and miss.speculation.source == "random"
        assert dict(drafter.estimator.hits_by_f) == {3: [1, 1]}  # nothing was prepared at k=2: no lookup counted
        assert len(drafter.cache) == prompt.shape[1] + 3  # a random backup leaves no KV behind
        assert isinstance(miss.speculation, Speculation) and miss.speculation.tokens.shape == (2,)


def test_resolve_drops_finished_rows_and_bounds_the_cache():
    model = tiny_model("llama", layers=1, seed=5)
    config = SSDConfig(lookahead=2, fanout_budget=3, backup="draft")
    drafter = SaguaroCandidateGenerator(model, config, vocab_size=96)
    ids, mask = _padded([list(range(1, 9)), list(range(20, 23)), list(range(30, 35))])
    with torch.no_grad():
        specs = drafter.begin(ids, mask)
        for _ in range(4):
            drafter.prepare(speculations=specs)
            outcomes = [(0, 7)] * drafter.rows
            specs = [r.speculation for r in drafter.resolve(outcomes, verified=2)]
        # every row committed 4 tokens: it holds (prompt - 1) + 4 committed slots plus K pre-glued ones; the
        # cache is compacted every round, so at most K slots of holes (dummy queries of hit rows) remain
        assert drafter.cache.valid.sum(dim=1).tolist() == [8 + 4 - 1 + 2, 3 + 4 - 1 + 2, 5 + 4 - 1 + 2]
        assert len(drafter.cache) <= 8 + 4 - 1 + 2 + 2
        drafter.prepare(speculations=specs)
        resolutions = drafter.resolve([(0, 7)] * 3, verified=2, keep_rows=[2])
    assert len(resolutions) == 1 and drafter.rows == 1 and drafter.cache.rows == 1
    assert drafter.contexts[0] == list(range(30, 35)) + [7] * 5
    assert drafter.glue_start.tolist() == [9]
    assert int(drafter.cache.valid.sum()) == 9 + 2 and len(drafter.cache) <= 9 + 2 + 2  # no padding left


def test_tree_stops_once_the_announced_outcome_is_not_prepared():
    model = tiny_model("llama", layers=1, seed=6)
    config = SSDConfig(lookahead=3, fanout=[2, 1, 1, 0])  # nothing prepared for "all three accepted"
    drafter = SaguaroCandidateGenerator(model, config, vocab_size=96)
    with torch.no_grad():
        first = drafter.begin(torch.arange(1, 8)[None], None)
        drafter.announce([(3, 5)])
        drafter.prepare(speculations=first)
        assert drafter.spec_cache is None and drafter.skipped_tree_steps == 3
        [miss] = drafter.resolve([(3, 5)], verified=3)
        assert not miss.hit and dict(drafter.estimator.hits_by_f) == {}  # F_3 = 0: nothing to look up
        drafter.announce([(0, int(miss.speculation.tokens[0]))])  # a rejected draft token is never prepared
        drafter.prepare(speculations=[miss.speculation])
        assert drafter.spec_cache is None and drafter.skipped_tree_steps == 6
        [again] = drafter.resolve([(0, int(miss.speculation.tokens[0]) + 1)], verified=3)
        assert not again.hit and dict(drafter.estimator.hits_by_f) == {2: [0, 1]}  # a miss among F_0 = 2 branches


def test_tree_keeps_going_while_any_row_can_hit():
    model = tiny_model("llama", layers=1, seed=6)
    config = SSDConfig(lookahead=3, fanout=[2, 1, 1, 0])
    drafter = SaguaroCandidateGenerator(model, config, vocab_size=96)
    ids, mask = _padded([list(range(1, 8)), list(range(40, 45))])
    with torch.no_grad():
        first = drafter.begin(ids, mask)
        drafter.prepare(speculations=first)
        key = next(key for key in drafter.spec_cache.keys() if key[0] == 1)
        drafter.announce([(3, 5), key[1:]])  # row 0 cannot hit, row 1 can
        drafter.prepare(speculations=first)
    assert drafter.spec_cache is not None and drafter.skipped_tree_steps == 0


@pytest.mark.parametrize("self_draft", [True, False])
def test_candidate_generator_interface_in_transformers_own_loop(monkeypatch, self_draft):
    """`SaguaroCandidateGenerator` also serves transformers' stock assisted loop (synchronously, greedy exact)."""
    from conftest import tiny_pair

    target, draft = tiny_pair("llama", seed=41)
    draft = target if self_draft else draft
    config = SSDConfig(lookahead=3, fanout_budget=6)
    drafter = SaguaroCandidateGenerator(draft, config, vocab_size=96)
    monkeypatch.setattr(target, "_get_candidate_generator", lambda **kwargs: drafter)
    input_ids = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(3))
    expected = target.generate(input_ids, max_new_tokens=30, do_sample=False)
    out = target.generate(input_ids, assistant_model=draft, max_new_tokens=30, do_sample=False)  # stock loop
    assert torch.equal(out, expected)
    assert drafter.speculations and drafter._round > 0


def test_a_partly_verified_speculation_forks_up_to_what_is_verified():
    """Verifying only the first n of K tokens: outcomes are k = 0..n, and the last fork (all n accepted) keeps the
    drafted s_{n+1} among its bonus candidates — it was not verified, so the target may well pick it (for a draft
    that agrees, it is the likeliest bonus)."""
    model = tiny_model("llama", layers=1, seed=6)
    config = SSDConfig(lookahead=3, fanout_budget=4)
    for verified in (0, 1, 2):
        drafter = SaguaroCandidateGenerator(model, config, vocab_size=96)
        with torch.no_grad():
            [first] = drafter.begin(torch.arange(1, 8)[None], None)
            drafter.prepare(verified)
        keys = drafter.spec_cache.keys()
        assert {fork for _, fork, _ in keys} <= set(range(verified + 1))
        assert len(keys) == 4 and (0, verified, int(first.tokens[verified])) in keys  # s_{n+1}: a candidate
        for _, fork, bonus in keys:
            if fork < verified:
                assert bonus != int(first.tokens[fork])  # a verified, rejected token is never the bonus
        _check_branches(drafter, model, [list(range(1, 8))], [first], verified)
