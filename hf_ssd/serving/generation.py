"""The hook: every `generate()` transformers' generation manager runs becomes an SSD generation.

transformers serve runs each model's generations on one persistent inference thread (`GenerateManager`, one per
model, a FIFO queue): concurrent requests wait their turn, so SSD generations never overlap and each gets the draft
to itself. `SSDGenerateManager` keeps that machinery and hands it `SSDTarget`, the target as seen through the one
call it makes, `model.generate(**kwargs)`: the call gains `assistant_model=<the pinned draft>` and an `SSDConfig`
(the request's, set by the chat handler, else the server's), and its statistics go to `/metrics`.

Cancellation is transformers': when a streaming client goes away, the response's generator is closed and it
cancels the request's streamer; the next `put()` from inside `generate()` raises, which unwinds the SSD loop
through the draft executor's context manager (its draft thread is joined; a worker process is told to stop and
stays for the next request). A request still queued is dropped when its turn comes, before any forward.
"""

from __future__ import annotations

import torch
from transformers.cli.serving.utils import GenerateManager, GenerationState, _GenerationCancelled
from transformers.generation.streamers import BaseStreamer

from ..config import SSDConfig
from ..generation.checks import model_vocab_size
from .metrics import ServingMetrics
from .model_manager import SSDModelManager, tokenizer_of

# Set on a request's GenerationConfig by the chat handler when the client named max_tokens (read, then removed).
MAX_TOKENS_REQUESTED = "_hf_ssd_max_tokens_requested"


def max_positions(model) -> int | None:
    """The longest sequence the model's position embeddings cover, or None if its config does not say."""
    config = model.config.get_text_config()
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def http_error(status: int, message: str) -> Exception:
    from fastapi import HTTPException

    return HTTPException(status_code=status, detail=message)


class SSDTarget:
    """The target as the generation manager uses it: `generate()` runs SSD with the pinned draft; every other
    attribute is the target's own."""

    def __init__(self, model, manager: SSDGenerateManager):
        self._model = model
        self._manager = manager

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def generate(self, *args, **kwargs):
        model, manager = self._model, self._manager
        if manager.ssd_config is not None:
            draft = manager.model_manager.draft
            config = kwargs.get("generation_config")
            if config is None:
                kwargs.setdefault("ssd_config", manager.ssd_config)
            elif getattr(config, "ssd_config", None) is None:  # the request's own copy (the handler built it)
                config.ssd_config = manager.ssd_config
            kwargs["assistant_model"] = draft
            if model_vocab_size(model) != model_vocab_size(draft) and kwargs.get("tokenizer") is not None:
                kwargs.setdefault("assistant_tokenizer", tokenizer_of(kwargs["tokenizer"]))  # padded vocabularies
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        prompt = input_ids.shape[-1] if isinstance(input_ids, torch.Tensor) else 0
        before = getattr(model, "ssd_metrics", None)
        streamer = kwargs.get("streamer")
        if streamer is not None:
            kwargs["streamer"] = streamer = EndAfterMetrics(streamer)
        try:
            try:
                output = model.generate(*args, **kwargs)
            except _GenerationCancelled:
                manager.metrics.observe("cancelled")
                raise
            except BaseException:
                manager.metrics.observe("error")
                raise
            sequences = output if isinstance(output, torch.Tensor) else output.sequences
            ssd = getattr(model, "ssd_metrics", None)
            new = sequences.shape[-1] - prompt
            manager.metrics.observe("finished", prompt, new, ssd if ssd is not before else None)
        finally:
            if streamer is not None:
                streamer.release()
        return output


class EndAfterMetrics(BaseStreamer):
    """A streamer whose `end()` waits until the generation's statistics are on `/metrics`: a client that reads
    `/metrics` once its stream has ended finds its request counted (`generate()` ends the stream before it returns,
    so the stream would otherwise close before the counters move)."""

    def __init__(self, streamer):
        self._streamer = streamer
        self._ended = False

    def put(self, value) -> None:
        self._streamer.put(value)

    def end(self) -> None:
        self._ended = True

    def release(self) -> None:
        """Pass on an `end()` held back (once)."""
        if self._ended:
            self._ended = False
            self._streamer.end()

    def __getattr__(self, name: str):
        return getattr(self._streamer, name)


class SSDGenerateManager(GenerateManager):
    """transformers' sequential generation manager (one inference thread per model), running SSD.

    Args:
        model_manager: where the pinned draft is.
        ssd_config: the server's SSD configuration (None: plain decoding, the `--no-ssd` baseline).
        metrics: the server's `/metrics`.
    """

    def __init__(self, model_manager: SSDModelManager, ssd_config: SSDConfig | None, metrics: ServingMetrics):
        super().__init__()
        self.model_manager = model_manager
        self.ssd_config = ssd_config
        self.metrics = metrics

    def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
        self.fit_context(model, inputs, gen_config)
        return super().generate_streaming(SSDTarget(model, self), processor, inputs, gen_config,
                                          request_id=request_id, response_parser=response_parser)

    async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
        self.fit_context(model, inputs, gen_config)
        try:
            return await super().generate_non_streaming(SSDTarget(model, self), processor, inputs, gen_config,
                                                        request_id=request_id)
        except ValueError as error:  # generate() refused the request (SSD's checks, generation options): 400
            raise http_error(400, str(error)) from error

    @staticmethod
    def fit_context(model, inputs, gen_config) -> None:
        """Refuse a request that does not fit the model's context (as vLLM words it), before it queues; without an
        explicit max_tokens, the completion is cut to what fits."""
        requested = bool(gen_config.__dict__.pop(MAX_TOKENS_REQUESTED, False))
        limit = max_positions(model)
        input_ids = inputs.get("input_ids")
        if limit is None or not isinstance(input_ids, torch.Tensor):
            return
        prompt = input_ids.shape[-1]
        if prompt >= limit:
            raise http_error(400, f"This model's maximum context length is {limit} tokens. However, your messages "
                                  f"resulted in {prompt} tokens. Please reduce the length of the messages.")
        wanted = gen_config.max_new_tokens
        if wanted is None or prompt + wanted <= limit:
            return
        if requested:
            raise http_error(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                  f"{prompt + wanted} tokens ({prompt} in the messages, {wanted} in the completion). "
                                  "Please reduce the length of the messages or completion.")
        gen_config.max_new_tokens = limit - prompt


class SSDGenerationState(GenerationState):
    """transformers' generation state with `SSDGenerateManager`s (continuous batching off: it bypasses
    `generate()`, where SSD lives)."""

    def __init__(self, model_manager: SSDModelManager, ssd_config: SSDConfig | None, metrics: ServingMetrics):
        super().__init__(continuous_batching=False)
        self.model_manager = model_manager
        self.ssd_config = ssd_config
        self.metrics = metrics
        self._ssd_managers: dict[str, SSDGenerateManager] = {}

    def get_manager(self, model_id: str, use_cb: bool = False) -> SSDGenerateManager:
        if model_id not in self._ssd_managers:
            self._ssd_managers[model_id] = SSDGenerateManager(self.model_manager, self.ssd_config, self.metrics)
        return self._ssd_managers[model_id]
