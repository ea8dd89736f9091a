"""The public API of SSD inside `generate()` at batch size 1: config, enable_ssd, outputs, metrics, errors.

Greedy SSD must return exactly plain greedy's tokens (and, when asked, the same scores and logits); everything
SSD cannot do must be refused with a clear `ValueError` before any work, and leave the model usable.
"""

from __future__ import annotations

import copy
import json
import re
import threading

import pytest
import torch
from conftest import tiny_model, tiny_pair
from transformers import GenerationConfig, LlamaForCausalLM
from transformers.generation.utils import GenerateDecoderOnlyOutput

from hf_ssd import SSDConfig, SSDGenerateDecoderOnlyOutput, SSDGenerationMixin, SSDMetrics, enable_ssd
from hf_ssd.compat import cache_kwarg, output_cache
from hf_ssd.generation import mixin

VOCAB = 96
METRIC_KEYS = {
    "rounds", "cache_hits", "cache_hit_rate", "mean_accepted_length", "draft_acceptance_rate",
    "per_position_acceptance", "tokens_per_round_hit", "tokens_per_round_miss", "verify_seconds",
    "draft_seconds", "target_wait_seconds", "fanout_schedule",
}


@pytest.fixture(scope="module")
def pair():
    return tiny_pair("llama")


def prompt(length: int = 8, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def greedy(model, input_ids, max_new_tokens=20, **kwargs):
    return model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)


def no_draft_threads() -> bool:
    return not any(t.name.startswith("hf-ssd-draft") for t in threading.enumerate())


# --- SSDConfig ------------------------------------------------------------------------------------------------

INVALID_FIELDS = [
    ("lookahead", 0, ">= 1"),
    ("lookahead", 2.5, ">= 1"),
    ("lookahead", True, ">= 1"),
    ("fanout", "exponential", "geometric"),
    ("fanout", [1, 1], "lookahead+1"),
    ("fanout", [1, -1, 1, 1], "lookahead+1"),
    ("fanout", [0, 0, 0, 0], "at least one branch"),
    ("fanout_budget", 0, ">= 1"),
    ("saguaro_c", 0.0, "(0, 1]"),
    ("saguaro_c", 1.5, "(0, 1]"),
    ("backup", "oracle", "ngram"),
    ("executor", "cuda", "process"),
    ("draft_threads", 0, ">= 1 or None"),
    ("target_threads", -2, ">= 1 or None"),
    ("acceptance_prior", 1.0, "(0, 1)"),
    ("acceptance_prior", 0.0, "(0, 1)"),
    ("power_law_prior", 0.0, "(0, 10]"),
    ("power_law_prior", 11.0, "(0, 10]"),
    ("adaptive", "yes", "bool"),
    ("lookahead_schedule", "heuristic", "adaptive"),
    ("fanout_budget_schedule", "heuristic", "adaptive"),
    ("draft_confidence", "yes", "bool"),
    ("ngram_max", 0, ">= 1"),
]


@pytest.mark.parametrize("name,value,allowed", INVALID_FIELDS, ids=lambda x: repr(x))
def test_config_rejects_invalid_field(name, value, allowed):
    with pytest.raises(ValueError) as info:
        SSDConfig(**{name: value})
    message = str(info.value)
    assert f"SSDConfig.{name}=" in message
    assert allowed in message
    # The same through a dict (the form generation configs carry).
    with pytest.raises(ValueError, match=f"SSDConfig.{name}="):
        SSDConfig.from_dict({name: value})


def test_config_round_trip_and_unknown_keys():
    config = SSDConfig(lookahead=2, fanout=[2, 1, 1], fanout_budget=5, saguaro_c=0.5, backup="ngram",
                       executor="sync", draft_threads=1, target_threads=1, acceptance_prior=0.5,
                       power_law_prior=2.0, adaptive=False, ngram_max=2, draft_confidence=False)
    data = config.to_dict()
    assert set(data) == set(SSDConfig.field_names())
    assert json.loads(json.dumps(data)) == data  # JSON-friendly
    assert json.loads(config.to_json_string()) == data
    assert SSDConfig.from_dict(data) == config
    assert SSDConfig.from_dict(SSDConfig().to_dict()) == SSDConfig()
    assert SSDConfig.coerce(data) == config
    assert SSDConfig.coerce(config) is config
    assert config.branches == 4 and SSDConfig(fanout_budget=7).branches == 7
    with pytest.raises(ValueError, match=r"unknown fields \['lookahed'\].*lookahead"):
        SSDConfig.from_dict({"lookahed": 2})
    with pytest.raises(ValueError, match="SSDConfig or a dict"):
        SSDConfig.coerce(3)


def test_generate_accepts_dict_and_rejects_unknown_keys(pair):
    target, draft = pair
    ids = prompt()
    expected = greedy(target, ids)
    out = greedy(target, ids, assistant_model=draft, ssd_config={"lookahead": 2, "executor": "sync"})
    assert torch.equal(out, expected)
    assert target.ssd_metrics.lookahead == 2 and target.ssd_metrics.executor == "sync"
    with pytest.raises(ValueError, match="lookahed"):
        greedy(target, ids, assistant_model=draft, ssd_config={"lookahed": 2})
    with pytest.raises(ValueError, match=r"SSDConfig.lookahead=0"):
        greedy(target, ids, assistant_model=draft, ssd_config={"lookahead": 0})


# --- enable_ssd and the mixin ---------------------------------------------------------------------------------


def test_enable_ssd_idempotent_keeps_identity():
    model = tiny_model("llama")
    returned = enable_ssd(model)
    assert returned is model
    cls = type(model)
    assert cls.__name__ == "LlamaForCausalLM"
    assert isinstance(model, LlamaForCausalLM) and isinstance(model, SSDGenerationMixin)
    assert hasattr(model.generation_config, "ssd_config") and model.generation_config.ssd_config is None
    assert enable_ssd(model) is model and type(model) is cls  # idempotent
    other = enable_ssd(tiny_model("llama", seed=3))
    assert type(other) is cls  # the dynamic subclass is cached
    with pytest.raises(ValueError, match="enable_ssd"):
        enable_ssd(torch.nn.Linear(2, 2))


def test_generate_without_ssd_config_is_stock():
    """Plain greedy, sampling and stock assisted generation are untouched by enable_ssd."""
    stock = tiny_model("llama", seed=5)
    enabled = enable_ssd(tiny_model("llama", seed=5))
    draft = tiny_model("llama", layers=1, seed=6)
    draft.generation_config.assistant_confidence_threshold = 0.0
    ids = prompt(seed=2)
    assert torch.equal(greedy(enabled, ids), greedy(stock, ids))
    torch.manual_seed(7)
    sampled_stock = stock.generate(ids, max_new_tokens=12, do_sample=True, top_k=20)
    torch.manual_seed(7)
    sampled_enabled = enabled.generate(ids, max_new_tokens=12, do_sample=True, top_k=20)
    assert torch.equal(sampled_enabled, sampled_stock)

    stock_assisted = greedy(stock, ids, assistant_model=draft, return_dict_in_generate=True, output_scores=True)
    assisted = greedy(enabled, ids, assistant_model=draft, return_dict_in_generate=True, output_scores=True)
    assert type(assisted) is type(stock_assisted) is GenerateDecoderOnlyOutput  # not the SSD output
    assert torch.equal(assisted.sequences, stock_assisted.sequences)
    assert torch.equal(assisted.sequences, greedy(stock, ids))
    assert len(assisted.scores) == len(stock_assisted.scores)
    assert enabled.ssd_metrics is None  # SSD never ran


def test_generate_without_ssd_config_never_enters_ssd(pair, monkeypatch):
    target, draft = pair
    calls = []
    monkeypatch.setattr(mixin, "ssd_decoding", lambda *a, **k: calls.append(1))
    ids = prompt()
    greedy(target, ids)
    greedy(target, ids, assistant_model=draft)
    assert calls == []


def test_subclass_with_mixin():
    class SSDLlama(SSDGenerationMixin, LlamaForCausalLM):
        pass

    source = tiny_model("llama", seed=4)
    model = SSDLlama(source.config).eval()
    model.load_state_dict(source.state_dict())
    draft = tiny_model("llama", layers=1, seed=9)
    ids = prompt(seed=3)
    expected = greedy(source, ids)
    assert torch.equal(greedy(model, ids), expected)
    for executor in ("thread", "sync", "process"):
        out = greedy(model, ids, assistant_model=draft, ssd_config=SSDConfig(executor=executor))
        assert torch.equal(out, expected)
        assert isinstance(model.ssd_metrics, SSDMetrics) and model.ssd_metrics.generated_tokens == 20
    assert hasattr(model.generation_config, "ssd_config")


def test_save_and_load_pretrained(pair, tmp_path):
    target, draft = pair
    ids = prompt()
    expected = greedy(target, ids)
    target.save_pretrained(tmp_path / "plain")
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "plain").eval()
    assert type(loaded) is LlamaForCausalLM
    assert torch.equal(greedy(loaded, ids), expected)
    enable_ssd(loaded)
    assert torch.equal(greedy(loaded, ids, assistant_model=draft, ssd_config=SSDConfig()), expected)

    # The SSD class itself loads too, and a default ssd_config saved in the generation config comes back as a
    # dict that generate() uses when no ssd_config is passed.
    model = enable_ssd(tiny_model("llama"))
    model.generation_config.ssd_config = SSDConfig(lookahead=2, executor="sync")
    model.generation_config._from_model_config = False  # as for a hub model with its own generation config
    model.save_pretrained(tmp_path / "ssd")
    saved = json.loads((tmp_path / "ssd" / "generation_config.json").read_text())
    assert saved["ssd_config"]["lookahead"] == 2
    reloaded = type(model).from_pretrained(tmp_path / "ssd").eval()
    assert type(reloaded).__name__ == "LlamaForCausalLM" and isinstance(reloaded, SSDGenerationMixin)
    assert reloaded.generation_config.ssd_config == SSDConfig(lookahead=2, executor="sync").to_dict()
    reloaded.ssd_metrics = None
    out = greedy(reloaded, ids, assistant_model=draft)
    assert torch.equal(out, expected)
    assert reloaded.ssd_metrics is not None and reloaded.ssd_metrics.lookahead == 2
    # The stock class loads the same files (ssd_config stays a plain attribute of its generation config).
    stock = LlamaForCausalLM.from_pretrained(tmp_path / "ssd").eval()
    assert not isinstance(stock, SSDGenerationMixin)
    assert torch.equal(greedy(stock, ids), expected)
    # An explicit ssd_config=None turns the saved default off.
    reloaded.ssd_metrics = None
    assert torch.equal(greedy(reloaded, ids, assistant_model=draft, ssd_config=None), expected)
    assert reloaded.ssd_metrics is None


def test_explicit_generation_config(pair):
    target, draft = pair
    ids = prompt()
    expected = greedy(target, ids, max_new_tokens=15)
    plain_config = GenerationConfig(max_new_tokens=15, do_sample=False)
    before = copy.deepcopy(plain_config.to_dict())
    out = target.generate(ids, generation_config=plain_config, assistant_model=draft, ssd_config=SSDConfig())
    assert torch.equal(out, expected)
    assert plain_config.to_dict() == before  # the caller's object is not modified
    out = target.generate(ids, plain_config, assistant_model=draft, ssd_config={"executor": "sync"})  # positional
    assert torch.equal(out, expected)
    with_ssd = GenerationConfig(max_new_tokens=15, do_sample=False, ssd_config={"lookahead": 4})
    target.ssd_metrics = None
    out = target.generate(ids, generation_config=with_ssd, assistant_model=draft)
    assert torch.equal(out, expected)
    assert target.ssd_metrics.lookahead == 4
    # Without ssd_config anywhere, an explicit GenerationConfig is plain generation.
    assert torch.equal(target.generate(ids, generation_config=plain_config), expected)


# --- outputs and metrics --------------------------------------------------------------------------------------


def check_metrics(metrics: SSDMetrics, new_tokens: int, lookahead: int) -> None:
    assert isinstance(metrics, SSDMetrics)
    data = metrics.to_dict()
    assert METRIC_KEYS <= set(data)
    assert json.loads(json.dumps(data, default=str)) is not None
    assert metrics.generated_tokens == new_tokens
    assert metrics.lookahead == lookahead
    assert 1 <= metrics.rounds <= new_tokens
    # plain steps while the draft is paused (with or without a prompt lookup's tokens), and serial speculations
    # (drafted after a verification the draft sat out), were not looked up
    unlooked = sum(metrics.rounds_by_source.get(source, 0) for source in ("plain", "lookup", "serial"))
    assert metrics.cache_lookups == metrics.rounds - 1 - unlooked  # every other round but the first looks one up
    assert len(metrics.hits_by_position) == metrics.lookahead + 1
    assert [sum(col) for col in zip(*metrics.hits_by_position)] == [metrics.cache_hits, metrics.cache_lookups]
    assert 0 <= metrics.cache_hits <= metrics.cache_lookups
    assert 0.0 <= metrics.cache_hit_rate <= 1.0
    if metrics.cache_lookups:
        assert metrics.cache_hit_rate == pytest.approx(metrics.cache_hits / metrics.cache_lookups)
    assert 1.0 <= metrics.mean_accepted_length <= lookahead + 1
    assert 0.0 <= metrics.draft_acceptance_rate <= 1.0
    assert len(metrics.per_position_acceptance) == lookahead
    assert all(0.0 <= p <= 1.0 for p in metrics.per_position_acceptance)
    assert 0.0 <= metrics.tokens_per_round_hit <= lookahead + 1
    assert 0.0 <= metrics.tokens_per_round_miss <= lookahead + 1
    assert metrics.verify_seconds > 0 and metrics.draft_seconds > 0 and metrics.target_wait_seconds >= 0
    assert metrics.wall_seconds >= metrics.verify_seconds
    assert set(metrics.fanout_schedule) == {"hit", "miss"} == set(metrics.acceptance_estimate)
    assert all(len(f) == lookahead + 1 for f in metrics.fanout_schedule.values())


@pytest.mark.parametrize("executor", ["thread", "sync", "process"])
def test_return_dict_scores_logits_and_metrics(pair, executor):
    target, random_draft = pair
    ids = prompt(seed=4)
    new = 13
    plain = greedy(target, ids, new, return_dict_in_generate=True, output_scores=True, output_logits=True)
    assert len(plain.scores) == new
    for draft, kind in ((target, "self"), (random_draft, "random")):
        config = SSDConfig(lookahead=3, executor=executor, lookahead_schedule="constant")  # every round looks up
        out = greedy(target, ids, new, assistant_model=draft, ssd_config=config, return_dict_in_generate=True,
                     output_scores=True, output_logits=True)
        assert isinstance(out, SSDGenerateDecoderOnlyOutput)
        assert torch.equal(out.sequences, plain.sequences)
        assert len(out.scores) == len(out.logits) == new
        for got, want in zip(out.scores, plain.scores):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for got, want in zip(out.logits, plain.logits):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert out.ssd_metrics is target.ssd_metrics
        check_metrics(out.ssd_metrics, new, 3)
        assert out.ssd_metrics.executor == executor
        if kind == "self":  # the target drafting for itself: everything accepted, hits dominate
            assert out.ssd_metrics.draft_acceptance_rate == 1.0
            assert out.ssd_metrics.cache_hit_rate > 0.5
        else:
            assert out.ssd_metrics.cache_hit_rate < 0.5

    # Without output_scores / output_logits the tuples are absent, the metrics still there.
    out = greedy(target, ids, new, assistant_model=random_draft, ssd_config={"executor": executor},
                 return_dict_in_generate=True)
    assert out.scores is None and out.logits is None
    assert torch.equal(out.sequences, plain.sequences)
    check_metrics(out.ssd_metrics, new, 3)


@pytest.mark.parametrize("executor", ["thread", "sync", "process"])
def test_left_padding_and_attention_mask(pair, executor):
    target, random_draft = pair
    ids = prompt(seed=5)
    pad = 0
    padded = torch.cat([torch.full((1, 4), pad), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones_like(ids)], dim=1)
    expected = greedy(target, padded, 18, attention_mask=mask, pad_token_id=pad)
    # The mask matters (else this test would not test it): without it the padded prompt continues differently.
    unmasked = greedy(target, padded, 18, pad_token_id=pad, attention_mask=torch.ones_like(mask))
    assert not torch.equal(unmasked, expected)
    for draft in (target, random_draft):
        out = greedy(target, padded, 18, attention_mask=mask, pad_token_id=pad, assistant_model=draft,
                     ssd_config={"executor": executor})
        assert torch.equal(out, expected)
        out = greedy(target, padded, 18, attention_mask=torch.ones_like(mask), pad_token_id=pad,
                     assistant_model=draft, ssd_config={"executor": executor})
        assert torch.equal(out, unmasked)


def test_shortest_prompts(pair):
    """A one-token prompt (nothing for the draft to prefill), also as the only unmasked token of a padded one."""
    target, random_draft = pair
    one = prompt(length=1, seed=8)
    padded, mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), one], 1), torch.tensor([[0, 0, 0, 1]])
    for ids, kwargs in ((one, {}), (padded, {"attention_mask": mask, "pad_token_id": 0})):
        expected = greedy(target, ids, 15, **kwargs)
        for draft in (target, random_draft):
            for executor in ("thread", "sync", "process"):
                out = greedy(target, ids, 15, assistant_model=draft, ssd_config={"executor": executor}, **kwargs)
                assert torch.equal(out, expected)


def test_repeated_calls_are_independent(pair):
    target, random_draft = pair
    ids = prompt(seed=6)
    expected = greedy(target, ids, 17)
    # "auto" decides from measured latencies, which vary; so would a plain step's prompt lookup, which emits several
    # tokens in a round where timing made the policy take plain stretches
    config = SSDConfig(lookahead=2, backup="draft", prompt_lookup="never")
    first = greedy(target, ids, 17, assistant_model=random_draft, ssd_config=config)
    metrics = target.ssd_metrics
    second = greedy(target, ids, 17, assistant_model=random_draft, ssd_config=config)
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert target.ssd_metrics is not metrics
    assert target.ssd_metrics.rounds == metrics.rounds  # no state carried over between calls
    assert target.ssd_metrics.cache_hits == metrics.cache_hits
    # A call that fails does not break the next one.
    with pytest.raises(ValueError):
        greedy(target, ids.repeat(2, 1), 17, assistant_model=random_draft, ssd_config=config)
    assert torch.equal(greedy(target, ids, 17, assistant_model=random_draft, ssd_config=config), expected)
    assert torch.equal(greedy(target, ids, 17), expected)


# --- refusals -------------------------------------------------------------------------------------------------


def test_refusals_before_any_work(pair):
    target, draft = pair
    ids = prompt()
    expected = greedy(target, ids)
    threads_before = torch.get_num_threads()
    forwards = []
    odd_vocab = tiny_model("llama", layers=1, vocab_size=VOCAB + 8)
    hooks = [m.register_forward_pre_hook(lambda *_: forwards.append(1)) for m in (target, draft, odd_vocab)]
    cases = [
        (dict(input_ids=ids.repeat(2, 1)), "pad_token_id"),
        (dict(input_ids=ids.repeat(2, 1), pad_token_id=0,
              attention_mask=torch.ones_like(ids.repeat(2, 1)).index_fill_(1, torch.tensor([ids.shape[1] - 1]), 0)),
         "left-padded"),
        (dict(num_return_sequences=2), "num_return_sequences"),
        (dict(num_beams=2), "beam search"),
        (dict(assistant_model=odd_vocab), "share the target.s vocabulary.*96 tokens and the draft 104"),
        (dict(assistant_model=None), "assistant_model"),
        (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions"),
        (dict(output_hidden_states=True, return_dict_in_generate=True), "output_hidden_states"),
        (dict(use_cache=False), "use_cache=False"),
        (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
    ]
    for overrides, message in cases:
        kwargs = dict(input_ids=ids, assistant_model=draft, ssd_config=SSDConfig(), max_new_tokens=8,
                      do_sample=False)
        kwargs.update(overrides)
        with pytest.raises(ValueError, match=message):
            target.generate(**kwargs)
        assert forwards == [], f"{overrides} ran a forward pass before refusing"
        assert no_draft_threads()
        assert torch.get_num_threads() == threads_before
    for hook in hooks:
        hook.remove()
    assert torch.equal(greedy(target, ids, assistant_model=draft, ssd_config=SSDConfig()), expected)


@pytest.mark.parametrize("executor", ["thread", "sync", "process"])
def test_continue_from_returned_cache(pair, executor):
    """Multi-turn use: generate, then continue from the returned cache (the target's cache holds all but the
    newest token). SSD must give plain greedy's continuation, with and without SSD in the first call."""
    target, random_draft = pair
    key = cache_kwarg(target)  # "cache" from transformers 5.24 on, "past_key_values" before
    ids = prompt(seed=7)
    full = greedy(target, ids, 24)
    first_plain = greedy(target, ids, 10, return_dict_in_generate=True)
    assert output_cache(first_plain).get_seq_length() == first_plain.sequences.shape[1] - 1
    for draft in (target, random_draft):
        config = SSDConfig(executor=executor)
        first = greedy(target, ids, 10, assistant_model=draft, ssd_config=config, return_dict_in_generate=True)
        assert torch.equal(first.sequences, first_plain.sequences)
        assert output_cache(first).get_seq_length() == output_cache(first_plain).get_seq_length()
        for source in (first, first_plain):
            out = greedy(target, source.sequences, 14, assistant_model=draft, ssd_config=config,
                         **{key: copy.deepcopy(output_cache(source))})
            assert torch.equal(out, full)
        # A cache prefilled by a plain forward over part of the prompt works the same.
        with torch.no_grad():
            cache = output_cache(target(ids[:, :5], use_cache=True))
        out = greedy(target, ids, 24, assistant_model=draft, ssd_config=config, **{key: cache})
        assert torch.equal(out, full)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_cli_demo_runs_and_checks_identity(capsys, batch_size):
    """`hf-ssd demo` (random pair, no downloads) exits 0 only when SSD matched plain greedy on every row."""
    import logging

    from hf_ssd.cli import main

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("transformers").addHandler(handler)
    try:
        assert main(["demo", "--max-new-tokens", "8", "--batch-size", str(batch_size), "--executor", "sync"]) == 0
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    captured = capsys.readouterr()
    out = captured.out
    assert f"SSD identical to plain greedy: {batch_size}/{batch_size} rows" in out and "tok/s" in out
    # the target's precision "auto" resolves on this machine: fp32, or fp32 through oneDNN's packed kernels, and the
    # demo says on what it decided
    decided = re.search(r"params \((fp32|fp32-packed), auto: the packed kernel [0-9.]+x at [0-9]+ rows, "
                        r"[0-9.]+x at 1 row ", out)
    assert decided and "params (int8)" in out, out
    assert "10.0M params (int8)" in out  # the int8 draft's quantized layers are counted
    assert not [r.getMessage() for r in records if r.levelno >= logging.WARNING]  # no third-party warnings
    assert all(f"{step}:" in captured.err for step in ("plain greedy", "SSD"))  # a progress bar per step


def test_an_ssd_enabled_model_pickles_and_deepcopies(pair):
    """enable_ssd's class carries the original's name; pickling (also to hand the model to a draft worker
    process) rebuilds it instead of finding the original, and the per-model lock is not pickled."""
    import copy
    import pickle

    target, draft = pair
    ids = prompt(seed=12)
    expected = greedy(target, ids)
    greedy(target, ids, assistant_model=draft, ssd_config={"executor": "sync"})  # the model now holds its lock
    for clone in (pickle.loads(pickle.dumps(target)), copy.deepcopy(target)):
        assert type(clone) is type(target) and isinstance(clone, SSDGenerationMixin)
        assert torch.equal(greedy(clone, ids), expected)
        assert torch.equal(greedy(clone, ids, assistant_model=draft, ssd_config={"executor": "sync"}), expected)
