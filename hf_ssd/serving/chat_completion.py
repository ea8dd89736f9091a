"""`/v1/chat/completions` with a per-request `ssd_config`.

transformers' chat handler refuses fields its request schema does not list (422) and builds each request's
`GenerationConfig`; this subclass adds `ssd_config` to the schema (the OpenAI client sends it with
`extra_body={"ssd_config": {...}}`) and puts the request's configuration on that `GenerationConfig`: the
server's, with the request's fields over it, validated by `SSDConfig` (400 with its message when invalid).
"""

from __future__ import annotations

from typing import Any

from transformers.cli.serving.chat_completion import (
    ChatCompletionHandler,
    TransformersCompletionCreateParamsStreaming,
)

from ..config import SSDConfig
from .generation import MAX_TOKENS_REQUESTED, http_error


class SSDCompletionCreateParams(TransformersCompletionCreateParamsStreaming, total=False):
    ssd_config: dict


class SSDChatCompletionHandler(ChatCompletionHandler):
    """transformers' chat completions handler, taking `ssd_config` per request.

    Args:
        ssd_config: the server's configuration (None: the server decodes without SSD and refuses `ssd_config`).
        *args, **kwargs: `ChatCompletionHandler`'s.
    """

    _valid_params_class = SSDCompletionCreateParams

    def __init__(self, *args, ssd_config: SSDConfig | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.ssd_config = ssd_config

    def request_ssd_config(self, body: dict) -> SSDConfig | None:
        """The request's SSD configuration: the server's, with the request's `ssd_config` fields over it."""
        overrides: Any = body.get("ssd_config")
        if overrides is None:
            return self.ssd_config
        if self.ssd_config is None:
            raise http_error(400, "`ssd_config` was given, but this server decodes without SSD (--no-ssd).")
        if not isinstance(overrides, dict):
            kind = type(overrides).__name__
            raise http_error(400, f"`ssd_config` must be an object of SSDConfig fields; got {kind}.")
        try:
            return SSDConfig.from_dict({**self.ssd_config.to_dict(), **overrides})
        except ValueError as error:
            raise http_error(400, str(error)) from error

    def _build_generation_config(self, body: dict, model_generation_config, use_cb: bool = False):
        ssd_config = self.request_ssd_config(body)  # first: a bad ssd_config is the client's error, 400
        generation_config = super()._build_generation_config(body, model_generation_config, use_cb=use_cb)
        generation_config.ssd_config = ssd_config
        requested = body.get("max_completion_tokens") is not None or body.get("max_tokens") is not None
        setattr(generation_config, MAX_TOKENS_REQUESTED, requested)
        return generation_config
