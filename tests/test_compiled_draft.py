"""The compiled draft path (`compile_draft=True`): fixed-capacity draft KV with static-shape steps, run through
`torch.compile`. Exactness on a CPU: greedy equality over the architecture matrix and executors, batches whose rows
finish (shapes change), the sampling law; the static cache against the growing one. The suite compiles with the
"aot_eager" backend (dynamo's capture and AOT functionalisation, the part that must hold static shapes, without
inductor's code generation, which takes ~7 s per graph on 2 cores); benchmarks/compile_draft.py measures inductor."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model, tiny_pair
from test_sampling_law import (
    ALPHA,
    TEMPERATURE,
    exact_law,
    law_pvalues,
    models,  # noqa: F401  (the fixture: a 1-layer target and an unrelated draft)
    ssd_samples,
)

from hf_ssd import SSDConfig
from hf_ssd.cache.draft_cache import DraftCache, StaticSlotsLayer
from hf_ssd.cache.tree_attention import causal_visibility

BACKEND = "aot_eager"


def _config(executor: str, **overrides) -> SSDConfig:
    fields = dict(lookahead=3, fanout_budget=6, executor=executor, compile_draft=True, compile_backend=BACKEND,
                  lookahead_schedule="constant")
    fields.update(overrides)
    return SSDConfig(**fields)


@pytest.mark.parametrize("arch, executor", [("llama", "sync"), ("qwen2_hybrid", "process")])
def test_greedy_identical_with_a_compiled_draft(arch, executor):
    target, random_draft = tiny_pair(arch, seed=11)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(5))
    expected = target.generate(ids, max_new_tokens=30, do_sample=False)
    for draft, kind in ((target, "self"), (random_draft, "random")):
        out = target.generate(ids, assistant_model=draft, max_new_tokens=30, do_sample=False,
                              ssd_config=_config(executor, backup="draft"))
        assert torch.equal(out, expected), (arch, executor, kind)
        m = target.ssd_metrics
        assert (m.cache_hits > 0) if kind == "self" else (m.cache_lookups > m.cache_hits)


def test_batch_with_finishing_rows_and_adaptive_lookahead():
    """Rows finish at different rounds (the batch shrinks: new static shapes) and the lookahead changes per round
    (plain steps, pauses, resumes: glue widths other than K+1 run eagerly). (Growth past the first capacity:
    `test_static_slots_match_growing_layers`.)"""
    target, draft = tiny_pair("llama", seed=12, eos_token_id=83)  # rows 0 and 1 stop at tokens 34 and 17
    ids = torch.randint(8, 96, (3, 6), generator=torch.Generator().manual_seed(2))
    expected = target.generate(ids, max_new_tokens=60, do_sample=False, pad_token_id=0)
    finished = [(row[6:] == 83).any().item() for row in expected]
    assert any(finished) and not all(finished)  # rows end at different rounds
    out = target.generate(ids, assistant_model=draft, max_new_tokens=60, do_sample=False, pad_token_id=0,
                          ssd_config=_config("thread", lookahead_schedule="adaptive"))
    assert torch.equal(out, expected)


def test_the_compiled_path_is_taken():
    target, draft = tiny_pair("qwen2", seed=13)
    ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(0))
    calls = []
    original = DraftCache.forward

    def forward(self, *args, **kwargs):
        calls.append((self.capacity is not None, self.compiled is not None))
        return original(self, *args, **kwargs)

    DraftCache.forward = forward
    try:
        target.generate(ids, assistant_model=draft, max_new_tokens=12, do_sample=False,
                        ssd_config=_config("sync"))
    finally:
        DraftCache.forward = original
    assert calls and all(static and compiled for static, compiled in calls)
    assert not [k for k in draft.__dict__ if "compiled" in k]  # nothing attached: the draft still pickles


def test_sampling_law_with_a_compiled_draft(models):  # noqa: F811
    """A self-draft with Saguaro C = 0.3: hits and misses (the just-in-time backup, compiled too) both run."""
    target = models["target"]
    config = _config("sync", lookahead=2, fanout_budget=4, saguaro_c=0.3, backup="draft")
    counts, hits, misses = ssd_samples(target, models["self"], config, TEMPERATURE, seed=77)
    pvalues = law_pvalues(exact_law(target, TEMPERATURE), counts)
    assert min(pvalues.values()) >= ALPHA, pvalues
    assert hits > 0 and misses > 0


def test_static_slots_match_growing_layers():
    """The same forwards (prefill, appends, a compaction, rows leaving, growth past capacity) give the same logits
    through fixed-capacity layers (masks over the whole capacity) as through growing ones."""
    model = tiny_model("llama", layers=2, seed=3)
    caches = [DraftCache(model, rows=2), DraftCache(model, rows=2, capacity=12)]
    gen = torch.Generator().manual_seed(0)
    rows = 2
    for step, width in enumerate([5, 3, 4, 6]):
        tokens = torch.randint(0, 96, (rows, width), generator=gen)
        logits = []
        for cache in caches:
            start = cache.positions.max(dim=1).values + 1 if len(cache) else torch.zeros(rows, dtype=torch.long)
            positions = start[:, None] + torch.arange(width)[None]
            logits.append(cache.forward(tokens, positions, causal_visibility(cache.valid, width)))
        torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)
        if step == 1:  # keep some slots per row (a round's compaction)
            keep = torch.ones(rows, len(caches[0]), dtype=torch.bool)
            keep[0, -2:] = False
            keep[1, -1:] = False
            for cache in caches:
                cache.keep(keep)
        if step == 2:  # row 0 finished
            for cache in caches:
                cache.keep(torch.ones(rows, len(cache), dtype=torch.bool), rows=torch.tensor([1]))
            rows = 1
    static = caches[1]
    assert static.capacity > 12 and all(isinstance(layer, StaticSlotsLayer) for layer in static.kv.layers)
    assert all(layer.keys.shape[-2] == static.capacity for layer in static.kv.layers)


def test_compile_settings_are_checked():
    with pytest.raises(ValueError, match="compile_backend"):
        SSDConfig(compile_draft=True, compile_backend="no-such-backend")
    with pytest.raises(ValueError, match="compile_draft"):
        SSDConfig(compile_draft="yes")
