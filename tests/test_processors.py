"""Logits processors: stateless ones keep SSD exact, stateful ones are refused before any work."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_pair
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)

from hf_ssd import SSDConfig
from hf_ssd.generation.target_rows import process_rows
from hf_ssd.generation.warpers import split_trailing_warpers


@pytest.mark.parametrize(
    "options",
    [
        {"repetition_penalty": 1.5},
        {"no_repeat_ngram_size": 2},
        {"bad_words_ids": [[5], [7, 8]], "min_new_tokens": 10, "eos_token_id": 3},
        {"sequence_bias": {(4,): -2.0, (11, 12): 3.0}},
    ],
    ids=["repetition", "no-repeat-ngram", "bad-words-min-length", "sequence-bias"],
)
@pytest.mark.parametrize("self_draft", [True, False])
def test_greedy_with_prefix_dependent_processors(options, self_draft):
    target, draft = tiny_pair("llama", seed=11)
    torch.manual_seed(2)
    input_ids = torch.randint(0, 96, (1, 10))
    expected = target.generate(input_ids, max_new_tokens=40, do_sample=False, **options)
    out = target.generate(input_ids, assistant_model=target if self_draft else draft, max_new_tokens=40,
                          do_sample=False, ssd_config=SSDConfig(lookahead=3, fanout_budget=8), **options)
    assert torch.equal(out, expected)


def test_stateful_processor_is_refused_before_any_forward(monkeypatch):
    target, draft = tiny_pair("llama", seed=12)
    calls = []
    original = type(draft).forward
    monkeypatch.setattr(type(draft), "forward", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    guidance = UnbatchedClassifierFreeGuidanceLogitsProcessor(1.5, target)
    with pytest.raises(ValueError, match="UnbatchedClassifierFreeGuidanceLogitsProcessor"):
        target.generate(torch.tensor([[1, 2, 3]]), assistant_model=draft, ssd_config={}, max_new_tokens=5,
                        do_sample=False, logits_processor=LogitsProcessorList([guidance]))
    assert not calls


def test_trailing_warpers_run_once_over_every_position():
    """`process_rows` applies the processors that read token ids per position (each row's own prefix) and the
    sampling warpers that end the list once over every row and position: the same scores, position by position, as
    transformers' `LogitsProcessorList` applied to each row's prefix (rows of unequal lengths, a batch of three of
    which two are active)."""
    penalty = RepetitionPenaltyLogitsProcessor(1.7)
    warpers = [TemperatureLogitsWarper(0.7), TopKLogitsWarper(9), TopPLogitsWarper(0.8), MinPLogitsWarper(0.05)]
    assert split_trailing_warpers([penalty, *warpers]) == ([penalty], warpers)
    assert split_trailing_warpers([warpers[0], penalty, warpers[1]]) == ([warpers[0], penalty], [warpers[1]])
    assert split_trailing_warpers(warpers) == ([], warpers)
    generator = torch.Generator().manual_seed(0)
    vocab, positions = 16, 4
    rows = [SimpleNamespace(ids=torch.randint(0, vocab, (n,), generator=generator), index=i)
            for i, n in enumerate((5, 7, 6))]
    active = [rows[0], rows[2]]
    tokens = torch.randint(0, vocab, (len(active), positions - 1), generator=generator)
    raw = torch.randn(len(active), positions, vocab, generator=generator) * 3
    for processors in ([penalty, *warpers], warpers, [warpers[0], penalty, *warpers[1:]]):
        scores = process_rows(LogitsProcessorList(processors), rows, active, tokens, raw)
        for i, row in enumerate(active):
            for m in range(positions):
                ids = torch.cat([row.ids, tokens[i, :m]])[None]
                expected = LogitsProcessorList(processors)(ids, raw[i, m][None].clone())[0]
                torch.testing.assert_close(scores[i, m], expected, rtol=0, atol=0)
