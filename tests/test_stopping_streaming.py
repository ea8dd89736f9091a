"""SSD stops at exactly plain decoding's token (length, EOS, stop strings, custom criteria) and streams every
emitted token exactly once."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch
from conftest import tiny_pair
from test_pipeline import word_tokenizer
from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer, TextStreamer
from transformers.generation.streamers import BaseStreamer

from hf_ssd import SSDConfig

VOCAB = 96
MAX_NEW = 24


@pytest.fixture(scope="module")
def pair():
    return tiny_pair("llama", seed=0)


@pytest.fixture(scope="module")
def plain(pair):
    """(prompt, plain greedy continuation without any EOS)."""
    target, _ = pair
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(14))
    out = target.generate(ids, max_new_tokens=MAX_NEW, do_sample=False)
    return ids, out[0, ids.shape[1]:].tolist()


def drafts(pair):
    target, random_draft = pair
    return [("self", target), ("random", random_draft)]


def first_new_occurrence(tokens: list[int], start: int) -> int:
    """The index of the first token at or after `start` that does not occur earlier in `tokens`."""
    for i in range(start, len(tokens)):
        if tokens[i] not in tokens[:i]:
            return i
    raise AssertionError("no suitable token in the plain output")


def ssd(target, draft, ids, executor="thread", lookahead=3, schedule="adaptive", **kwargs):
    kwargs.setdefault("max_new_tokens", MAX_NEW)
    config = SSDConfig(lookahead=lookahead, executor=executor, lookahead_schedule=schedule)
    return target.generate(ids, assistant_model=draft, ssd_config=config, do_sample=False, **kwargs)


@pytest.mark.parametrize("executor", ["thread", "sync", "process"])
@pytest.mark.parametrize("lookahead", [2, 3])
def test_max_new_tokens_not_a_multiple_of_round(pair, plain, executor, lookahead):
    target, _ = pair
    ids, tokens = plain
    for name, draft in drafts(pair):
        for new in (1, 2, 5, 7, 10):
            assert new % (lookahead + 1) != 0 or new in (1, 2)
            out = ssd(target, draft, ids, executor, lookahead, max_new_tokens=new)
            assert out[0, ids.shape[1]:].tolist() == tokens[:new], (name, new)
            assert target.ssd_metrics.generated_tokens == new
    # max_length instead of max_new_tokens.
    out = ssd(target, pair[0], ids, executor, lookahead, max_new_tokens=None, max_length=ids.shape[1] + 6)
    assert out[0, ids.shape[1]:].tolist() == tokens[:6]


@pytest.mark.parametrize("executor", ["thread", "sync", "process"])
def test_single_eos_stops_at_same_token(pair, plain, executor):
    target, _ = pair
    ids, tokens = plain
    for at in (first_new_occurrence(tokens, 1), first_new_occurrence(tokens, 6)):
        eos = tokens[at]
        expected = target.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos)
        assert expected[0, ids.shape[1]:].tolist() == tokens[: at + 1]  # EOS occurs: the test is meaningful
        for name, draft in drafts(pair):
            out = ssd(target, draft, ids, executor, eos_token_id=eos)
            assert torch.equal(out, expected), (name, at)
            assert target.ssd_metrics.generated_tokens == at + 1


@pytest.mark.parametrize("executor", ["thread", "sync", "process"])
def test_several_eos_ids_stop_at_first(pair, plain, executor):
    target, _ = pair
    ids, tokens = plain
    early = first_new_occurrence(tokens, 4)
    late = first_new_occurrence(tokens, early + 3)
    absent = next(t for t in range(VOCAB) if t not in tokens)
    eos = [absent, tokens[late], tokens[early]]
    expected = target.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos)
    assert expected[0, ids.shape[1]:].tolist() == tokens[: early + 1]
    for name, draft in drafts(pair):
        out = ssd(target, draft, ids, executor, eos_token_id=eos)
        assert torch.equal(out, expected), name
    # Through the generation config, with return_dict: scores and logits stop where the tokens stop.
    target.generation_config.eos_token_id = eos
    try:
        want = target.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, return_dict_in_generate=True,
                               output_scores=True, output_logits=True)
        for outputs in ({"output_scores": True, "output_logits": True}, {"output_logits": True}):
            for _, draft in drafts(pair):
                out = ssd(target, draft, ids, executor, return_dict_in_generate=True, **outputs)
                assert torch.equal(out.sequences, expected)
                assert len(out.logits) == early + 1 == out.ssd_metrics.generated_tokens
                for got, ref in zip(out.logits, want.logits):
                    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
                if "output_scores" in outputs:
                    assert len(out.scores) == early + 1
                    for got, ref in zip(out.scores, want.scores):
                        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
                else:
                    assert out.scores is None
    finally:
        target.generation_config.eos_token_id = None


@pytest.mark.parametrize("executor", ["thread", "sync", "process"])
def test_stop_strings_stop_at_same_token(pair, plain, executor):
    target, _ = pair
    ids, tokens = plain
    tok = word_tokenizer(extra_words=("abcdef",))  # stop-string matching tokenizes "abcdef" to clean the vocab
    at = first_new_occurrence(tokens, 5)
    stop = tok.convert_ids_to_tokens(tokens[at])
    expected = target.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, stop_strings=stop, tokenizer=tok)
    assert expected.shape[1] - ids.shape[1] <= at + 1 < MAX_NEW  # the stop string fired
    assert expected[0, -1].item() == tokens[at] or stop.endswith(tok.convert_ids_to_tokens(expected[0, -1].item()))
    for name, draft in drafts(pair):
        out = ssd(target, draft, ids, executor, stop_strings=[stop], tokenizer=tok)
        assert torch.equal(out, expected), name
        assert target.ssd_metrics.generated_tokens == expected.shape[1] - ids.shape[1]


class StopOnToken(StoppingCriteria):
    """Stops once `token` is generated; counts its calls."""

    def __init__(self, token: int, prompt_len: int):
        self.token, self.prompt_len, self.calls = token, prompt_len, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        done = (input_ids[:, -1] == self.token) & (input_ids.shape[1] > self.prompt_len)
        return done.to(torch.bool)


@pytest.mark.parametrize("executor", ["thread", "sync", "process"])
def test_custom_stopping_criteria(pair, plain, executor):
    target, _ = pair
    ids, tokens = plain
    at = first_new_occurrence(tokens, 3)
    expected = target.generate(ids, max_new_tokens=MAX_NEW, do_sample=False,
                               stopping_criteria=StoppingCriteriaList([StopOnToken(tokens[at], ids.shape[1])]))
    assert expected[0, ids.shape[1]:].tolist() == tokens[: at + 1]
    for name, draft in drafts(pair):
        criterion = StopOnToken(tokens[at], ids.shape[1])
        out = ssd(target, draft, ids, executor, stopping_criteria=StoppingCriteriaList([criterion]))
        assert torch.equal(out, expected), name
        assert criterion.calls == at + 1  # consulted once per emitted token, like plain decoding


class Recorder(BaseStreamer):
    def __init__(self):
        self.puts: list[list[int]] = []
        self.ends = 0

    def put(self, value):
        assert self.ends == 0, "put() after end()"
        self.puts.append(value.reshape(-1).tolist())

    def end(self):
        self.ends += 1


@pytest.mark.parametrize("executor", ["thread", "sync", "process"])
def test_streamer_receives_each_emitted_token_once(pair, plain, executor):
    target, _ = pair
    ids, tokens = plain
    stop_at = first_new_occurrence(tokens, 6)
    cases = (({}, MAX_NEW), ({"max_new_tokens": 7}, 7), ({"eos_token_id": tokens[stop_at]}, stop_at + 1))
    for (name, draft), schedule, (kwargs, n) in itertools.product(drafts(pair), ("adaptive", "constant"), cases):
        recorder = Recorder()
        out = ssd(target, draft, ids, executor, schedule=schedule, streamer=recorder, **kwargs)
        assert out[0, ids.shape[1]:].tolist() == tokens[:n], (name, schedule, kwargs)
        assert recorder.puts[0] == ids[0].tolist()  # the prompt, once
        streamed = [t for block in recorder.puts[1:] for t in block]
        assert streamed == tokens[:n], (name, schedule, kwargs)
        assert all(block for block in recorder.puts[1:])
        assert recorder.ends == 1
        if name == "self" and schedule == "constant":
            # whole rounds arrive at once: K every round (the adaptive schedule may rightly take plain steps on a
            # tiny pair whose drafting costs what the target's step does, as it did on a loaded machine)
            assert any(len(block) > 1 for block in recorder.puts[1:]), kwargs


def test_text_streamer_prints_the_output(pair, plain, capsys):
    target, random_draft = pair
    ids, tokens = plain
    tok = word_tokenizer()
    target.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, streamer=TextStreamer(tok, skip_prompt=True))
    plain_printed = capsys.readouterr().out
    expected = tok.decode(tokens)
    assert plain_printed.strip() == expected.strip() and expected.strip()
    for draft in (target, random_draft):
        out = ssd(target, draft, ids, streamer=TextStreamer(tok, skip_prompt=True))
        printed = capsys.readouterr().out
        assert printed == plain_printed
        assert tok.decode(out[0, ids.shape[1]:]) == expected


@pytest.mark.parametrize("executor", ["thread", "sync", "process"])
def test_text_iterator_streamer_in_a_thread(pair, plain, executor):
    target, _ = pair
    ids, tokens = plain
    tok = word_tokenizer()
    for _, draft in drafts(pair):
        streamer = TextIteratorStreamer(tok, skip_prompt=True, timeout=60)
        result = {}

        def work(draft=draft, streamer=streamer, result=result):
            try:
                result["out"] = ssd(target, draft, ids, executor, streamer=streamer)
            except BaseException as err:  # surfaced below
                result["error"] = err
                streamer.end()

        worker = threading.Thread(target=work)
        worker.start()
        text = "".join(chunk for chunk in streamer)
        worker.join(timeout=60)
        assert not worker.is_alive()
        assert "error" not in result, result.get("error")
        assert text.strip() == tok.decode(tokens).strip()
        assert tok.decode(result["out"][0, ids.shape[1]:]) == tok.decode(tokens)


@pytest.mark.parametrize("executor", ["thread", "sync", "process"])
def test_min_new_tokens_defers_eos_like_plain(pair, plain, executor):
    """EOS inside the first min_new_tokens is suppressed per position, then stops at its next occurrence."""
    target, _ = pair
    ids, tokens = plain
    eos = next(t for i, t in enumerate(tokens) if 2 <= i and t in tokens[:i])  # occurs twice in the plain output
    first = tokens.index(eos)
    expected = target.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos,
                               min_new_tokens=first + 2)
    new = expected[0, ids.shape[1]:].tolist()
    assert new[first] != eos and new[-1] == eos and len(new) > first + 2  # suppressed, then stopped later
    for name, draft in drafts(pair):
        out = ssd(target, draft, ids, executor, eos_token_id=eos, min_new_tokens=first + 2)
        assert torch.equal(out, expected), name


@pytest.mark.parametrize("overrides", [
    {"use_cache": False},
    {"output_attentions": True, "return_dict_in_generate": True},
    {"ssd_config": {"lookahead": 0}},
    {"batch": 2},
], ids=["use_cache", "attentions", "bad_config", "batch"])
def test_refused_call_ends_the_streamer(pair, plain, overrides):
    """generate() streams the prompt before SSD's checks run; a refusal must still end() the streamer, or a
    TextIteratorStreamer consumer waits forever."""
    target, draft = pair
    ids, _ = plain
    overrides = dict(overrides)
    if overrides.pop("batch", None):
        ids = ids.repeat(2, 1)
    kwargs = {"assistant_model": draft, "ssd_config": SSDConfig(), "max_new_tokens": 5, "do_sample": False}
    kwargs.update(overrides)
    recorder = Recorder()
    with pytest.raises(ValueError):
        target.generate(ids, streamer=recorder, **kwargs)
    assert recorder.ends == (1 if recorder.puts else 0)


class ClientGone(RuntimeError):
    pass


class FailingStreamer(BaseStreamer):
    """A consumer that goes away: `put()` raises from its `fail_from`-th call on (and `end()` too, if asked)."""

    def __init__(self, fail_from: int, end_fails: bool = False):
        self.fail_from, self.end_fails = fail_from, end_fails
        self.calls, self.ends, self.received = 0, 0, []

    def put(self, value):
        self.calls += 1
        if self.calls >= self.fail_from:
            raise ClientGone(f"put #{self.calls}")
        self.received.append(value.tolist())

    def end(self):
        self.ends += 1
        if self.end_fails:
            raise ClientGone("end")


@pytest.mark.parametrize("executor", ["thread", "sync", "process"])
def test_a_failing_put_is_not_retried_and_its_error_surfaces(pair, plain, executor):
    """Once `put()` raised, SSD stops calling it (as plain decoding does), the original error reaches the caller
    (not a retry's, not `end()`'s), `end()` is still called once, and nothing was sent twice."""
    target, draft = pair
    ids, tokens = plain
    for fail_from in (2, 3):
        for end_fails in (False, True):
            streamer = FailingStreamer(fail_from, end_fails)
            with pytest.raises(ClientGone, match=f"^put #{fail_from}$"):
                ssd(target, draft, ids, executor, streamer=streamer)
            assert streamer.calls == fail_from and streamer.ends == 1
            streamed = [t for block in streamer.received[1:] for t in (block if isinstance(block, list) else [block])]
            assert streamed == tokens[: len(streamed)]  # a prefix of the output, each token once


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_empty_prompt_is_refused_before_any_work(pair, executor):
    target, draft = pair
    forwards = []
    hooks = [m.register_forward_hook(lambda *a: forwards.append(1)) for m in (target, draft)]
    try:
        for ids in (torch.zeros(1, 0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.long)):
            with pytest.raises(ValueError, match="at least one token"):
                ssd(target, draft, ids, executor, pad_token_id=0)
        padded = torch.zeros(2, 4, dtype=torch.long)
        with pytest.raises(ValueError, match="padding only"):
            ssd(target, draft, padded, executor, pad_token_id=0,
                attention_mask=torch.tensor([[0, 0, 0, 0], [0, 0, 1, 1]]))
    finally:
        for hook in hooks:
            hook.remove()
    assert forwards == []
