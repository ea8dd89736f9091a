"""The target pinned with SSD enabled, and the draft loaded beside it for the server's lifetime.

transformers' `ModelManager` loads models on demand and unloads idle ones; `hf-ssd serve` pins one target
(`force_model`: preloaded, never unloaded, the only model the server answers for) and loads the draft right after
it, with the same device and dtype, outside the manager's cache (`/v1/models` and `/reset` leave it alone).
"""

from __future__ import annotations

import logging
import threading

from transformers.cli.serving.model_manager import ModelManager
from transformers.cli.serving.utils import split_model_id

from ..generation import enable_ssd
from ..generation.checks import check_vocabulary, model_vocab_size
from ..models import resolve_model
from ..packing import PackedLinear, pack_linear_layers, packed_pad_rows
from ..precision import apply_precision, decide_precision, describe_decision

logger = logging.getLogger(__name__)

SERVED_TARGET_PRECISIONS = ("auto", "fp32", "fp32-packed")  # in place (int8 would replace the cached model)


def tokenizer_of(processor):
    """The tokenizer of a processor (or the tokenizer itself)."""
    return getattr(processor, "tokenizer", processor)


class SSDModelManager(ModelManager):
    """`ModelManager` pinned to `target`, with SSD enabled on it and `draft` loaded beside it.

    Args:
        target: the served model: a local folder, a Hub id in the local cache, or a fetched short name such as
            `qwen2.5-coder-1.5b` (`hf-ssd models list`). Clients name it as given here.
        draft: the draft model, same forms; None serves the target alone (plain decoding, for baselines).
        draft_precision: `"fp32"` or `"int8"` (CPU only; the draft's numerics never change SSD's output).
        target_precision: `"fp32"`, `"fp32-packed"` (oneDNN's packed Linear kernels, in place, CPU fp32 only) or
            `"auto"` (packed where it measures faster here); applied with or without a draft, so a `--no-ssd`
            baseline runs the same target.
        **kwargs: `ModelManager`'s other options (`device`, `dtype`, `trust_remote_code`, ...).
    """

    def __init__(self, target: str, draft: str | None = None, draft_precision: str = "fp32",
                 target_precision: str = "fp32", **kwargs):
        if target_precision not in SERVED_TARGET_PRECISIONS:
            raise ValueError(f"target_precision={target_precision!r} is invalid: expected one of "
                             f"{SERVED_TARGET_PRECISIONS}.")
        self.draft_name = draft
        self.draft_precision = draft_precision
        self.target_precision = target_precision
        self.draft = None
        self._draft_lock = threading.Lock()
        kwargs.pop("force_model", None)
        kwargs.pop("model_timeout", None)
        super().__init__(force_model=target, model_timeout=-1, **kwargs)  # loads the target (and the draft)

    # ---- names -------------------------------------------------------------------------------------------------
    def process_model_name(self, model_id: str) -> str:  # transformers: a staticmethod, called on the instance
        """A fetched short name is its folder in hf_ssd's model cache; the rest as transformers names them."""
        return ModelManager.process_model_name(resolve_model(model_id))

    @property
    def target_key(self) -> str:
        """The name the pinned target is cached under in `loaded_models`."""
        repo, gguf_file = split_model_id(self.force_model)
        name = self.process_model_name(repo)
        return name if gguf_file is None else f"{name}:{gguf_file}"

    # ---- loading -------------------------------------------------------------------------------------------------
    def load_model_and_processor(self, model_id_and_revision: str, *args, **kwargs):
        model, processor = super().load_model_and_processor(model_id_and_revision, *args, **kwargs)
        if self.target_precision != "fp32" and not any(isinstance(m, PackedLinear) for m in model.modules()):
            lookahead = 4  # verifications of K + 1 = 5 positions: SSDConfig's K at most
            precision, speedup = decide_precision(model, self.target_precision, lookahead + 1)
            if precision == "fp32-packed":
                pack_linear_layers(model)  # in place: the cached model is the packed one
            if speedup:  # "auto" decided here: say on what, as the demo and the bench do
                logger.info("target precision: %s", describe_decision(precision, speedup, packed_pad_rows(model)))
        if self.draft_name is not None:
            enable_ssd(model)  # idempotent; again after a `/reset` reloaded the target
            self._ensure_draft(model, processor)
        return model, processor

    def _ensure_draft(self, target, processor) -> None:
        with self._draft_lock:
            if self.draft is not None:
                return
            repo, gguf_file = split_model_id(self.draft_name)
            draft = self._load_model(self.process_model_name(repo), gguf_file=gguf_file)
            draft = apply_precision(draft.eval(), self.draft_precision)
            tokenizer = tokenizer_of(processor)
            draft_tokenizer = tokenizer
            if model_vocab_size(target) != model_vocab_size(draft):  # padding only, if their tokenizers agree
                name = self.process_model_name(repo)
                draft_tokenizer = tokenizer_of(self._load_processor(name, gguf_file=gguf_file))
            check_vocabulary(target, draft, tokenizer, draft_tokenizer)
            self.draft = draft

    @property
    def target(self):
        """The pinned target (loaded again if `/reset` unloaded it)."""
        repo, gguf_file = split_model_id(self.force_model)
        return self.load_model_and_processor(self.process_model_name(repo), gguf_file=gguf_file)[0]

    # ---- listing -------------------------------------------------------------------------------------------------
    def list_models(self, cache_dir: str | None = None) -> list[dict]:
        """`/v1/models`: the pinned target alone, under the name it was given, with the draft it runs with."""
        entry = {
            "id": self.force_model,
            "object": "model",
            "created": 0,
            "owned_by": "local",
            "status": {"value": "loaded" if self.target_key in self.loaded_models else "unloaded"},
        }
        if self.draft_name is not None:
            entry["draft"] = self.draft_name  # not an OpenAI field, like `status`
        return [entry]

    def get_gen_models(self, cache_dir: str | None = None) -> list[dict]:  # transformers 5.23's `/v1/models`
        return self.list_models(cache_dir)
