"""`hf-ssd serve`: transformers serve's OpenAI-compatible server with SSD on every request, driven by the real
`openai` client against a server on 127.0.0.1 with tiny models (started once for the module)."""

from __future__ import annotations

import multiprocessing
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from conftest import truncated_copy
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_ssd import SSDConfig
from hf_ssd.cli import main
from hf_ssd.runtime.pool import POOL, worker_pids
from hf_ssd.serving import SSDServer

VOCAB = 96
CONTEXT = 2048  # the tiny models' max_position_embeddings: the server's context limit
MAX_TOKENS = 12
SERVER_CONFIG = SSDConfig(lookahead=3, fanout_budget=4, executor="thread")


def word_tokenizer() -> PreTrainedTokenizerFast:
    """One word per id ("<unk>", "w1" .. "w95"), no special tokens: equal text means equal tokens."""
    words = ["<unk>"] + [f"w{i}" for i in range(1, VOCAB)]
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
    return tokenizer


def prompt(i: int, length: int = 6) -> str:
    generator = torch.Generator().manual_seed(100 + i)
    return " ".join(f"w{int(t)}" for t in torch.randint(1, VOCAB, (length,), generator=generator))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A 2-layer target and a draft made of its first layer (same embeddings and head), saved with the tokenizer."""
    root = tmp_path_factory.mktemp("serve")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    target = LlamaForCausalLM(config).eval()
    draft = truncated_copy(target, layers=1)
    tokenizer = word_tokenizer()
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return str(root / "target"), str(root / "draft")


@pytest.fixture(scope="module")
def plain(folders):
    """`plain(text, max_tokens)`: the target alone (transformers' generate, greedy), decoded as the server does."""
    model = AutoModelForCausalLM.from_pretrained(folders[0]).eval()
    tokenizer = word_tokenizer()

    def answer(text: str, max_tokens: int = MAX_TOKENS, **options) -> str:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, **options)
        return tokenizer.decode(out[0, ids.shape[1]:])

    return answer


@pytest.fixture(scope="module")
def server(folders):
    server = SSDServer(folders[0], folders[1], SERVER_CONFIG, host="127.0.0.1", port=0, device="cpu",
                       log_level="error").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def chat(client, model: str, text: str, max_tokens: int = MAX_TOKENS, **kwargs):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                          max_tokens=max_tokens, temperature=0, **kwargs)


def streamed(client, model: str, text: str, max_tokens: int = MAX_TOKENS, **kwargs) -> tuple[str, list]:
    """The streamed answer's text and its final chunk."""
    chunks = list(chat(client, model, text, max_tokens, stream=True, **kwargs))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1]


def scrape(server) -> dict[tuple, float]:
    """`/metrics` as {(sample name, label items without model_name): value}."""
    text = urllib.request.urlopen(server.url.removesuffix("/v1") + "/metrics", timeout=30).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.labels.pop("model_name") == server.metrics.model_name
            samples[(sample.name, *sorted(sample.labels.items()))] = sample.value
    return samples


def draft_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("hf-ssd-draft")]


def test_models_lists_the_pinned_target(server, client, folders):
    listed = client.models.list().data
    assert [m.id for m in listed] == [folders[0]]
    assert listed[0].model_extra["draft"] == folders[1]
    assert listed[0].model_extra["status"] == {"value": "loaded"}


def test_answers_are_the_targets_own(server, client, folders, plain):
    for i in range(2):
        expected = plain(prompt(i))
        answer = chat(client, folders[0], prompt(i))
        assert answer.choices[0].message.content == expected
        assert answer.choices[0].finish_reason == "length"
        assert answer.usage.completion_tokens == MAX_TOKENS and answer.usage.prompt_tokens == 6
        text, last = streamed(client, folders[0], prompt(i))
        assert text == expected
        assert last.choices[0].finish_reason == "length" and last.usage.completion_tokens == MAX_TOKENS
    assert server.model_manager.target.ssd_metrics.executor == "thread"  # SSD ran, on the server's executor


def test_generation_options_reach_ssd(server, client, folders, plain):
    """frequency_penalty and logit_bias become transformers' logits processors; SSD applies them at every verified
    position, as plain decoding does at every step."""
    text = prompt(6)
    options = {"frequency_penalty": 0.8, "logit_bias": {"7": 4.0, "11": -3.0}}
    expected = plain(text, 16, repetition_penalty=1.8, sequence_bias={(7,): 4.0, (11,): -3.0})
    assert expected != plain(text, 16)  # the options change the answer
    assert chat(client, folders[0], text, 16, **options).choices[0].message.content == expected
    assert streamed(client, folders[0], text, 16, **options)[0] == expected


def test_metrics_count_what_ssd_reports(server, client, folders):
    before = scrape(server)
    chat(client, folders[0], prompt(3), max_tokens=16)
    after = scrape(server)
    ssd = server.model_manager.target.ssd_metrics
    assert ssd.generated_tokens == 16
    assert ssd.accepted_tokens == sum(ssd.accepted_per_position)
    assert ssd.draft_acceptance_rate == pytest.approx(ssd.accepted_tokens / ssd.draft_tokens)
    assert ssd.mean_accepted_length == pytest.approx((ssd.accepted_tokens + ssd.rounds) / ssd.rounds)
    assert ssd.drafts <= ssd.rounds and ssd.draft_tokens <= ssd.drafts * SERVER_CONFIG.lookahead

    def delta(*key):
        return after[key] - before.get(key, 0.0)

    assert delta("vllm:spec_decode_num_drafts_total") == ssd.drafts > 0
    assert delta("vllm:spec_decode_num_draft_tokens_total") == ssd.draft_tokens
    assert delta("vllm:spec_decode_num_accepted_tokens_total") == ssd.accepted_tokens > 0
    for position, accepted in enumerate(ssd.accepted_per_position):
        assert delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", ("position", str(position))) == accepted
    assert delta("vllm:generation_tokens_total") == 16 and delta("vllm:prompt_tokens_total") == 6
    assert delta("hf_ssd:requests_total", ("outcome", "finished")) == 1
    assert delta("hf_ssd:rounds_total") == ssd.rounds
    assert delta("hf_ssd:cache_lookups_total") == ssd.cache_lookups > 0
    assert delta("hf_ssd:cache_hits_total") == ssd.cache_hits
    assert delta("hf_ssd:target_wait_seconds_total") == pytest.approx(ssd.target_wait_seconds)
    assert delta("hf_ssd:ssd_seconds_total") == pytest.approx(ssd.wall_seconds)
    assert after[("hf_ssd:cache_hit_rate",)] == pytest.approx(
        after[("hf_ssd:cache_hits_total",)] / after[("hf_ssd:cache_lookups_total",)])


def test_per_request_ssd_config(server, client, folders, plain):
    before = scrape(server)
    text, _ = streamed(client, folders[0], prompt(4), extra_body={
        "ssd_config": {"lookahead": 1, "lookahead_schedule": "constant"}})
    after = scrape(server)
    assert text == plain(prompt(4))
    assert server.model_manager.target.ssd_metrics.lookahead == 1
    # One draft token per round: drafts and draft tokens grow alike, and only position 0 accepts.
    drafts = after[("vllm:spec_decode_num_drafts_total",)] - before[("vllm:spec_decode_num_drafts_total",)]
    tokens = after[("vllm:spec_decode_num_draft_tokens_total",)] - before[("vllm:spec_decode_num_draft_tokens_total",)]
    assert drafts == tokens > 0
    for position in ("1", "2"):
        key = ("vllm:spec_decode_num_accepted_tokens_per_pos_total", ("position", position))
        assert after[key] == before[key]


def test_a_stream_ends_only_once_its_request_is_on_metrics(server, client, folders, monkeypatch):
    """`generate()` ends the stream before it returns; the server holds that end back until the request's statistics
    are counted, so a client reading `/metrics` right after its stream finds them (CI once read them before)."""
    observe = server.metrics.observe

    def slow_observe(*args, **kwargs):
        time.sleep(0.5)
        observe(*args, **kwargs)

    monkeypatch.setattr(server.metrics, "observe", slow_observe)
    before = scrape(server)
    streamed(client, folders[0], prompt(5), max_tokens=8)
    after = scrape(server)
    key = ("hf_ssd:requests_total", ("outcome", "finished"))
    assert after[key] == before.get(key, 0.0) + 1
    assert after[("vllm:generation_tokens_total",)] == before.get(("vllm:generation_tokens_total",), 0.0) + 8


def test_concurrent_streams_are_all_answered_in_full(server, client, folders, plain):
    texts = [prompt(10 + i, length=3 + i % 5) for i in range(16)]
    expected = [plain(text, 16) for text in texts]
    assert len(set(expected)) == 16  # distinct answers: a mixed-up stream could not go unnoticed
    before = scrape(server)
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda text: streamed(client, folders[0], text, 16), texts))
    after = scrape(server)
    for (text, last), want in zip(answers, expected):
        assert text == want
        assert last.choices[0].finish_reason == "length" and last.usage.completion_tokens == 16
    finished = ("hf_ssd:requests_total", ("outcome", "finished"))
    assert after[finished] - before[finished] == 16


def test_disconnect_cancels_the_generation(server, client, folders, plain):
    assert draft_threads() == []
    before = scrape(server)
    stream = chat(client, folders[0], prompt(30), max_tokens=CONTEXT - 100, stream=True)
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received == 3:
            break
    assert draft_threads(), "the draft should be running while the answer streams"
    stream.close()  # the client goes away mid-answer
    deadline = time.monotonic() + 30
    cancelled = ("hf_ssd:requests_total", ("outcome", "cancelled"))
    while time.monotonic() < deadline and (draft_threads() or scrape(server)[cancelled] == before[cancelled]):
        time.sleep(0.05)
    after = scrape(server)
    assert after[cancelled] - before[cancelled] == 1
    assert draft_threads() == []  # the draft executor was closed, its thread joined
    finished = ("hf_ssd:requests_total", ("outcome", "finished"))
    assert after[finished] == before[finished]  # stopped, not run to its 1948 tokens
    assert chat(client, folders[0], prompt(31)).choices[0].message.content == plain(prompt(31))  # still serving


def test_disconnect_stops_the_draft_worker_process(server, client, folders, plain):
    """With the process executor the draft runs in a persistent worker: a client gone mid-stream leaves it idle
    (no process more, none less) and the next request runs on it."""
    process = {"ssd_config": {"executor": "process"}}
    assert chat(client, folders[0], prompt(40), extra_body=process).choices[0].message.content == plain(prompt(40))
    assert server.model_manager.target.ssd_metrics.executor == "process"
    baseline, children = worker_pids(), {p.pid for p in multiprocessing.active_children()}
    assert baseline and not POOL._busy
    cancelled = ("hf_ssd:requests_total", ("outcome", "cancelled"))
    before = scrape(server)[cancelled]
    stream = chat(client, folders[0], prompt(41), max_tokens=CONTEXT - 100, stream=True, extra_body=process)
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received == 3:
            break
    assert POOL._busy, "the worker should be drafting while the answer streams"
    stream.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (POOL._busy or scrape(server)[cancelled] == before):
        time.sleep(0.05)
    assert scrape(server)[cancelled] == before + 1 and not POOL._busy
    assert worker_pids() == baseline and {p.pid for p in multiprocessing.active_children()} == children
    assert chat(client, folders[0], prompt(42), extra_body=process).choices[0].message.content == plain(prompt(42))
    metrics = server.model_manager.target.ssd_metrics
    assert metrics.executor == "process" and metrics.worker_start_seconds == 0.0  # the same worker, idle again
    assert worker_pids() == baseline


@pytest.mark.parametrize("stream", [False, True])
def test_bad_requests_get_400_with_a_message(server, client, folders, stream):
    def refused(message: str, text: str = prompt(5), model: str = folders[0], **kwargs):
        with pytest.raises(openai.BadRequestError) as error:
            chat(client, model, text, stream=stream, **kwargs)
        assert error.value.status_code == 400
        assert message in str(error.value)

    refused("Server is pinned to", model="some/other-model")
    refused("SSDConfig.lookahead=0 is invalid: expected an int >= 1",
            extra_body={"ssd_config": {"lookahead": 0}})
    refused("SSDConfig.executor='gpu' is invalid", extra_body={"ssd_config": {"executor": "gpu"}})
    refused("SSDConfig got unknown fields ['speed']", extra_body={"ssd_config": {"speed": 2}})
    refused("`ssd_config` must be an object", extra_body={"ssd_config": [3]})
    long_prompt = " ".join(["w7"] * CONTEXT)
    refused(f"maximum context length is {CONTEXT} tokens. However, your messages resulted in {CONTEXT} tokens",
            text=long_prompt)
    refused(f"you requested {CONTEXT + 50} tokens (100 in the messages, {CONTEXT - 50} in the completion)",
            text=" ".join(["w7"] * 100), max_tokens=CONTEXT - 50)


def test_serve_command_line(folders, monkeypatch, capsys):
    with pytest.raises(SystemExit) as done:
        main(["serve", "--help"])
    assert done.value.code == 0
    assert "--lookahead VALUE" in capsys.readouterr().out

    def never(*args, **kwargs):
        raise AssertionError("a bad command line must fail before any model loads")

    monkeypatch.setattr("hf_ssd.serving.server.SSDServer.__init__", never)
    monkeypatch.setenv("HF_SSD_CACHE", str(folders[0]))  # a cache without the fetched pair
    target, draft = folders
    for argv, message in [
        (["--draft", draft, "--lookahead", "0"], "SSDConfig.lookahead=0 is invalid: expected an int >= 1"),
        (["--draft", draft, "--fanout", "[1,2]"], "SSDConfig.fanout=[1, 2] is invalid"),
        (["--draft", draft, "--executor", "gpu"], "SSDConfig.executor='gpu' is invalid"),
        ([], "--draft is required"),
        (["--no-ssd", "--draft", draft], "--no-ssd serves the target alone"),
        (["--no-ssd", "--lookahead", "2"], "SSD options were given with --no-ssd"),
        (["--draft", draft, "--port", "70000"], "--port must be in 0..65535"),
        (["--draft", draft, "--dtype", "float33"], "--dtype must be auto or a torch dtype"),
        (["--draft", "qwen2.5-coder-0.5b"], "hf-ssd models fetch --which draft"),
    ]:
        assert main(["serve", "--target", target, *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv


def test_an_unknown_serving_layout_fails_clearly(monkeypatch):
    from transformers.cli.serving.utils import GenerationState

    from hf_ssd.serving import compat

    compat.require_serving()  # this transformers has every seam
    monkeypatch.delattr(GenerationState, "get_manager")
    with pytest.raises(compat.ServingUnavailable, match=r"transformers 5\.23 and 5\.24; transformers .* lacks: "
                       r"transformers\.cli\.serving\.utils\.GenerationState\.get_manager"):
        compat.require_serving()
    monkeypatch.setattr(compat.importlib.util, "find_spec", lambda name: None if name == "fastapi" else object())
    with pytest.raises(compat.ServingUnavailable, match=r"needs fastapi: pip install 'hf-ssd\[serving\]'"):
        compat.require_serving()


def test_the_served_target_can_run_packed(folders, plain):
    from hf_ssd.packing import PackedLinear, packing_available
    from hf_ssd.serving.model_manager import SSDModelManager

    with pytest.raises(ValueError, match="target_precision='int8' is invalid"):
        SSDModelManager(folders[0], folders[1], target_precision="int8", device="cpu")
    if not packing_available():
        pytest.skip("this torch build has no oneDNN")
    manager = SSDModelManager(folders[0], folders[1], target_precision="fp32-packed", device="cpu")
    target = manager.target
    assert any(isinstance(m, PackedLinear) for m in target.modules())
    assert manager.target is target  # packed once, in place: the cached model
    tokenizer = word_tokenizer()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt(7)}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    out = target.generate(ids, assistant_model=manager.draft, max_new_tokens=MAX_TOKENS, do_sample=False,
                          ssd_config=SERVER_CONFIG)
    assert tokenizer.decode(out[0, ids.shape[1]:]) == plain(prompt(7))
