"""Prompt lookup in plain steps (`generation/prompt_lookup.py`): the proposal, the choice of how many of its tokens a
plain step verifies, and the config. Losslessness end to end (greedy across architectures and executors, the
sampling law with a negative control): tests/test_lookahead.py, beside the plain stretches that take it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_ssd import SSDConfig
from hf_ssd.generation.backup import ngram_lookup
from hf_ssd.generation.prompt_lookup import EXPLORE_AFTER, MAX_TOKENS, NGRAM_MIN, PromptLookup, lookup_tokens


def test_the_latest_occurrence_of_the_longest_suffix_is_continued():
    context = [7, 1, 2, 3, 9, 4, 1, 2, 5, 6, 2, 3, 8, 1, 2, 3]
    # the 3-gram [1, 2, 3] last occurred at index 1 (the 2-gram [2, 3] later, at 10, is shorter)
    assert ngram_lookup(context, 3, 3, 2) == [9, 4, 1]
    assert ngram_lookup(context[:-1], 2, 3, 2) == [5, 6]  # [1, 2]: its latest earlier occurrence, at 6
    assert ngram_lookup([5, 1, 2, 7, 3, 1], 3, 3, 2) == []  # only a 1-gram matches
    assert ngram_lookup([5, 1, 2, 7, 3, 1], 3, 3, 1) == [2, 7, 3]
    assert ngram_lookup([4, 4], 3, 3, 2) == []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 5))
def test_a_proposal_is_what_followed_an_earlier_occurrence_of_the_suffix(context, count):
    found = ngram_lookup(context, count, 3, NGRAM_MIN)
    n_ctx = len(context)
    earlier = {n: [s for s in range(n_ctx - n) if context[s:s + n] == context[n_ctx - n:]]
               for n in range(NGRAM_MIN, min(3, n_ctx - 1) + 1)}
    if not any(earlier.values()):
        assert found == []
        return
    n = max(n for n, starts in earlier.items() if starts)
    start = max(earlier[n]) + n
    assert found == context[start:start + count] and 1 <= len(found) <= count


def test_lookup_tokens_fills_free_positions_and_pays_for_dear_ones():
    step = {1: 1.0, 2: 1.0, 3: 2.0, 4: 2.0}.get  # MKL's fp32 steps: 1 to 3 positions one price
    linear = {1: 1.35, 2: 1.7, 3: 2.05, 4: 2.4}.get  # each position a third of a plain step
    assert lookup_tokens([0.1] * 4, 4, 1.0, step) == 2  # free positions are filled, dear ones are not
    assert lookup_tokens([0.6] * 4, 4, 1.0, step) == 2
    assert lookup_tokens([0.95] * 4, 4, 1.0, step) == 2  # E(4) = 4.52 over 2 steps loses to E(2) = 2.85 over 1
    assert lookup_tokens([0.95] * 4, 4, 1.0, {1: 1.0, 2: 1.0, 3: 1.5, 4: 1.5}.get) == 4  # ... wins over 1.5
    assert lookup_tokens([0.2] * 4, 4, 1.0, linear) == 0
    assert lookup_tokens([0.9] * 4, 4, 1.0, linear) == 4
    assert lookup_tokens([0.9] * 4, 2, 1.0, linear) == 2  # never past what is proposed
    assert lookup_tokens([0.9] * 4, 4, None, step) == 0  # the plain step untimed: nothing to weigh against
    assert lookup_tokens([0.9] * 4, 4, 1.0, lambda m: None) == 0


def test_the_lookup_learns_its_acceptance_and_explores_when_passed_over():
    lookup = PromptLookup("auto", 3, 11, do_sample=False)
    linear = {1: 1.35, 2: 1.7, 3: 2.05, 4: 2.4}.get
    assert lookup.choose([1, 2, 3], 1.0, linear) == 1  # the prior (0.5) pays for a third of a step, not more
    for _ in range(6):
        lookup.observe(3, 3)
    assert lookup.choose([1, 2, 3], 1.0, linear) == 3
    for _ in range(12):
        lookup.observe(1, 0)
    passes = [lookup.choose([1, 2, 3], 1.0, linear) for _ in range(EXPLORE_AFTER)]
    assert passes == [0] * (EXPLORE_AFTER - 1) + [1]  # one token verified after EXPLORE_AFTER passes
    assert lookup.choose([], 1.0, linear) == 0
    assert PromptLookup("always", 3, 11, False).choose([1, 2], None, linear) == 2
    assert lookup.metrics() == {"prompt_lookup_rounds": 18, "prompt_lookup_tokens": 30, "prompt_lookup_accepted": 18}


def test_proposals_as_speculations():
    lookup = PromptLookup("auto", 3, 7, do_sample=True)
    ids = torch.tensor([3, 4, 5, 1, 3, 4, 5, 1, 3, 4])
    assert lookup.propose(ids, room=9) == [5, 1, 3, 4][:MAX_TOKENS]
    assert lookup.propose(ids, room=1) == [5]
    assert lookup.propose(ids, room=0) == []
    speculation = lookup.speculation([5, 1], "cpu")
    assert speculation.source == "lookup" and speculation.tokens.tolist() == [5, 1]
    assert torch.equal(speculation.probs, torch.eye(7)[[5, 1]])  # q one-hot: the tokens are certain
    assert PromptLookup("auto", 3, 7, do_sample=False).speculation([5], "cpu").probs is None
    assert PromptLookup("never", 3, 7, False).propose(ids, 9) == []
    assert PromptLookup("auto", 1, 7, False).propose(ids, 9) == []  # ngram_max below NGRAM_MIN: no lookup


def test_config_checks_prompt_lookup():
    assert SSDConfig().prompt_lookup == "auto"
    with pytest.raises(ValueError, match="prompt_lookup.*'auto', 'always', 'never'"):
        SSDConfig(prompt_lookup="sometimes")
