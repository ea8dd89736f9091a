"""SSD through `pipeline("text-generation", ...)`: `ssd_config` at construction or call time, greedy-identical."""

from __future__ import annotations

import pytest
from conftest import tiny_pair
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, pipeline

from hf_ssd import SSDConfig, SSDMetrics

VOCAB = 96
TEXTS = ["w5 w7 w9 w11 w13", "w40 w2 w77 w31 w31 w8 w60 w19 w3"]


def word_tokenizer(vocab_size: int = VOCAB, extra_words: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """A file-less word-level tokenizer whose ids match the tiny models' vocabulary: "w<id>", and `extra_words`
    on the last ids."""
    words = [f"w{i}" for i in range(2, vocab_size - len(extra_words))] + list(extra_words)
    vocab = {"<unk>": 0, "<pad>": 1, **{word: i for i, word in enumerate(words, start=2)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>")


@pytest.fixture(scope="module")
def setup():
    target, draft = tiny_pair("llama", seed=2)
    tok = word_tokenizer()
    assert len(tok) == target.config.vocab_size
    plain = pipeline("text-generation", model=target, tokenizer=tok)
    expected = {text: plain(text, do_sample=False, max_new_tokens=14, return_tensors=True) for text in TEXTS}
    expected_text = {text: plain(text, do_sample=False, max_new_tokens=14) for text in TEXTS}
    assert target.ssd_metrics is None
    return target, draft, tok, expected, expected_text


def run(pipe, target, text, **kwargs):
    target.ssd_metrics = None
    out = pipe(text, do_sample=False, max_new_tokens=14, **kwargs)
    assert isinstance(target.ssd_metrics, SSDMetrics), "SSD did not run"
    assert target.ssd_metrics.generated_tokens == 14
    return out


@pytest.mark.parametrize("executor", ["thread", "sync", "process"])
def test_pipeline_ssd_config_at_construction(setup, executor):
    target, draft, tok, expected, expected_text = setup
    config = SSDConfig(lookahead=3, executor=executor)
    pipe = pipeline("text-generation", model=target, tokenizer=tok, assistant_model=draft, ssd_config=config)
    for text in TEXTS:
        assert run(pipe, target, text, return_tensors=True) == expected[text]
        assert run(pipe, target, text) == expected_text[text]
        assert target.ssd_metrics.executor == executor


def test_pipeline_ssd_config_at_call_time(setup):
    target, draft, tok, expected, expected_text = setup
    pipe = pipeline("text-generation", model=target, tokenizer=tok, assistant_model=draft)
    for text in TEXTS:
        for cfg in (SSDConfig(lookahead=2), {"lookahead": 4, "executor": "sync"}):
            out = run(pipe, target, text, ssd_config=cfg)
            assert out == expected_text[text]
            assert target.ssd_metrics.lookahead == (cfg.lookahead if isinstance(cfg, SSDConfig) else 4)
    # Self-draft through the pipeline: hits dominate, same text.
    pipe = pipeline("text-generation", model=target, tokenizer=tok, assistant_model=target)
    out = run(pipe, target, TEXTS[1], ssd_config=SSDConfig(), return_tensors=True)
    assert out == expected[TEXTS[1]]
    assert target.ssd_metrics.cache_hits > 0 and target.ssd_metrics.draft_acceptance_rate == 1.0


def test_pipeline_without_ssd_config_is_plain(setup):
    target, draft, tok, expected, expected_text = setup
    pipe = pipeline("text-generation", model=target, tokenizer=tok, assistant_model=draft)
    target.ssd_metrics = None
    out = pipe(TEXTS[0], do_sample=False, max_new_tokens=14)
    assert out == expected_text[TEXTS[0]]
    assert target.ssd_metrics is None  # stock assisted generation, not SSD


def test_pipeline_stop_on_eos_matches_plain(setup):
    target, draft, tok, expected, _ = setup
    text = TEXTS[1]
    new_ids = expected[text][0]["generated_token_ids"][len(tok(text)["input_ids"]):]
    eos = new_ids[5]
    assert eos not in new_ids[:5]
    plain = pipeline("text-generation", model=target, tokenizer=tok)(
        text, do_sample=False, max_new_tokens=14, eos_token_id=eos, return_tensors=True
    )
    assert plain[0]["generated_token_ids"][-1] == eos and len(plain[0]["generated_token_ids"]) < len(
        expected[text][0]["generated_token_ids"]
    )
    pipe = pipeline("text-generation", model=target, tokenizer=tok, assistant_model=draft)
    target.ssd_metrics = None
    out = pipe(text, ssd_config={"lookahead": 4}, do_sample=False, max_new_tokens=14, eos_token_id=eos,
               return_tensors=True)
    assert out == plain
    assert target.ssd_metrics.generated_tokens == 6
