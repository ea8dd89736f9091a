"""The pairs people run: drafts whose vocabulary differs from the target's only by embedding padding (Qwen2.5-7B's
152,064 rows against Qwen2.5-0.5B's 151,936, one tokenizer), in both directions, and mixed dtypes. Accepted when
the tokenizers passed to generate() agree; exact under greedy decoding (every executor) and sampling (the law,
with q = 0 on ids the draft cannot produce); a target token the draft has no row for is fed to it safely."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
from conftest import tiny_model, truncated_copy
from test_sampling_law import ALPHA, NEW_TOKENS, PROMPT, TEMPERATURE, law_pvalues
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from hf_ssd import SSDConfig, enable_ssd


def tokenizer(size: int, offset: int = 0) -> PreTrainedTokenizerFast:
    """A word-level tokenizer of `size` tokens ("t0", "t1", ...; `offset` renumbers them: another vocabulary)."""
    vocab = {f"t{i}": (i + offset) % size for i in range(size)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")))


def pair(target_vocab: int, draft_vocab: int, seed: int = 0):
    target = enable_ssd(tiny_model("qwen2", layers=2, vocab_size=target_vocab, seed=seed))
    return target, truncated_copy(target, draft_vocab), tiny_model("qwen2", layers=1, vocab_size=draft_vocab,
                                                                   seed=seed + 1)


def _kwargs(real_tokens: int, **extra):
    return dict(tokenizer=tokenizer(real_tokens), assistant_tokenizer=tokenizer(real_tokens), **extra)


@pytest.mark.parametrize("target_vocab, draft_vocab", [(112, 96), (96, 112)], ids=["target-padded", "draft-padded"])
@pytest.mark.parametrize("executor", ["sync", "stream", "process"])
def test_greedy_identical_with_padded_vocabularies(target_vocab, draft_vocab, executor):
    target, agreeing, unrelated = pair(target_vocab, draft_vocab)
    ids = torch.randint(1, 90, (2, 8), generator=torch.Generator().manual_seed(1))  # 0 is the pad id
    expected = target.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
    for draft in (agreeing, unrelated):
        out = target.generate(ids, assistant_model=draft, max_new_tokens=24, do_sample=False, pad_token_id=0,
                              ssd_config=SSDConfig(lookahead=3, executor=executor, lookahead_schedule="constant"),
                              **_kwargs(90))
        assert torch.equal(out, expected)
        if draft is agreeing:
            assert target.ssd_metrics.cache_hits > 0


def test_a_target_token_the_draft_has_no_row_for():
    """The target emits a padding id (here it is made likely): the draft is fed a stand-in id, the output stays
    exactly the target's."""
    target, agreeing, _ = pair(112, 96, seed=3)
    with torch.no_grad():
        target.lm_head.weight[100] = target.lm_head.weight[5] * 1.5  # id 100 wins wherever id 5 would
    ids = torch.tensor([[5, 17, 5, 33, 5, 60]])
    expected = target.generate(ids, max_new_tokens=20, do_sample=False)
    assert (expected[0, 6:] >= 96).any()  # the target does emit ids the draft cannot score
    for executor in ("sync", "process"):
        out = target.generate(ids, assistant_model=agreeing, max_new_tokens=20, do_sample=False,
                              ssd_config=SSDConfig(lookahead=3, executor=executor), **_kwargs(90))
        assert torch.equal(out, expected)


def test_padded_vocabularies_need_agreeing_tokenizers():
    target, agreeing, _ = pair(112, 96)
    ids = torch.randint(0, 90, (1, 6), generator=torch.Generator().manual_seed(0))
    run = dict(assistant_model=agreeing, max_new_tokens=4, do_sample=False, ssd_config=SSDConfig())
    with pytest.raises(ValueError, match="112 tokens and the draft 96.*tokenizer= and assistant_tokenizer="):
        target.generate(ids, **run)
    with pytest.raises(ValueError, match="tokenizers differ"):
        target.generate(ids, tokenizer=tokenizer(90), assistant_tokenizer=tokenizer(90, offset=1), **run)
    with pytest.raises(ValueError, match="100 tokens.*the draft scores 96"):
        target.generate(ids, **_kwargs(100), **run)


def _exact_law(model, sampling: dict, vocab: int) -> np.ndarray:
    config = copy.deepcopy(model.generation_config)
    config.update(do_sample=True, **sampling)
    processors = model._get_logits_processor(config)
    law = np.ones(())
    for step in range(NEW_TOKENS):
        ids = torch.tensor([PROMPT + list(p) for p in itertools.product(range(vocab), repeat=step)])
        with torch.no_grad():
            probs = processors(ids, model(ids).logits[:, -1].float()).softmax(-1).double().numpy()
        law = (law.reshape(-1, 1) * probs).reshape([vocab] * (step + 1))
    return law


@pytest.mark.parametrize("draft_dtype", [torch.float32, torch.bfloat16], ids=["fp32-draft", "bf16-draft"])
def test_sampling_law_with_a_padded_target(draft_dtype):
    """Target vocabulary 6 (one padding id that the target still samples), draft 5: q is 0 on id 5, the law is
    exactly the target's; also with a bf16 draft beside the fp32 target."""
    target = enable_ssd(tiny_model(layers=1, vocab_size=6, hidden=16, seed=0, initializer_range=0.3))
    draft = truncated_copy(target, 5).to(draft_dtype)
    config = SSDConfig(lookahead=2, fanout_budget=4, saguaro_c=0.5, backup="draft", executor="sync",
                       lookahead_schedule="constant")
    counts = np.zeros([6] * NEW_TOKENS, dtype=np.int64)
    hits = 0
    torch.manual_seed(99)
    for _ in range(600):
        out = target.generate(torch.tensor([PROMPT]), assistant_model=draft, do_sample=True,
                              max_new_tokens=NEW_TOKENS, ssd_config=config, **TEMPERATURE, **_kwargs(5))
        counts[tuple(out[0, len(PROMPT):].tolist())] += 1
        hits += target.ssd_metrics.cache_hits
    law = _exact_law(target, TEMPERATURE, 6)
    real = (slice(0, 5),) * NEW_TOKENS
    assert 1 - law[real].sum() > 0.05 and counts.sum() > counts[real].sum()  # the padding id is sampled
    pvalues = law_pvalues(law, counts)
    assert min(pvalues.values()) >= ALPHA, pvalues
    assert hits > 0


@pytest.mark.parametrize("target_dtype, draft_dtype", [(torch.float32, torch.bfloat16),
                                                       (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("executor", ["thread", "process"])
def test_mixed_dtypes_greedy(target_dtype, draft_dtype, executor):
    target = enable_ssd(tiny_model("llama", layers=2, seed=4)).to(target_dtype)
    draft = truncated_copy(target, 96, layers=1).to(draft_dtype)
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(2))
    expected = target.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0)
    for assistant in (draft, target):
        out = target.generate(ids, assistant_model=assistant, max_new_tokens=20, do_sample=False, pad_token_id=0,
                              ssd_config=SSDConfig(lookahead=3, executor=executor))
        assert torch.equal(out, expected)
