"""`SSDServer`: transformers serve's app, handlers and model manager, wired for SSD, plus `/metrics`.

The wiring mirrors `transformers.cli.serve.Serve.__init__`, with the SSD pieces in place of three of its parts
(the model manager, the generation state, the chat handler) and without continuous batching (it does not go
through `generate()`, where SSD lives). Every other route is transformers' own: `/v1/completions` and
`/v1/responses` run SSD too, with the server's configuration.
"""

from __future__ import annotations

import asyncio
import threading
import time

from ..config import SSDConfig
from .compat import require_serving


def openai_errors(app) -> None:
    """Refusals (`HTTPException`s: transformers' and ours) in OpenAI's error shape, so OpenAI clients show the
    message (`{"error": {"message": ...}}`); `detail` stays, as transformers serve answers."""
    from fastapi import HTTPException
    from fastapi.responses import JSONResponse

    @app.exception_handler(HTTPException)
    async def _openai_error(_request, exc: HTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        error = {"message": str(exc.detail), "type": kind, "param": None, "code": exc.status_code}
        return JSONResponse({"error": error, "detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)


class SSDServer:
    """An OpenAI-compatible server running SSD on every request.

    Args:
        target: the served model (local folder, cached Hub id, or fetched short name); clients name it so.
        draft: the draft model, same forms; None serves the target alone (plain decoding: the baseline).
        ssd_config: the server's `SSDConfig` (requests may override fields); ignored without a draft.
        host, port: where to listen; port 0 picks a free one (see `port` once started).
        device, dtype: as `transformers serve`'s (`"auto"`, `"cpu"`, `"cuda:0"`; `"auto"`, `"float32"`, ...).
        draft_precision: `"fp32"` or `"int8"` (dynamic int8, CPU only; never changes the output).
        target_precision: `"fp32"`, `"fp32-packed"` or `"auto"` (see `SSDModelManager`).
        start_draft_worker: start the draft's worker process before serving when the executor would use one
            (`"auto"` or `"process"`, a CPU draft), so no request pays its start-up.
        enable_cors, log_level: as `transformers serve`'s.
    """

    def __init__(self, target: str, draft: str | None, ssd_config: SSDConfig | None = None, *,
                 host: str = "localhost", port: int = 8000, device: str = "auto", dtype: str = "auto",
                 draft_precision: str = "fp32", target_precision: str = "fp32", start_draft_worker: bool = True,
                 enable_cors: bool = False,
                 log_level: str = "warning"):
        require_serving()
        from transformers.cli.serving.completion import CompletionHandler
        from transformers.cli.serving.response import ResponseHandler
        from transformers.cli.serving.server import build_server
        from transformers.cli.serving.systemone import SystemOneHandler
        from transformers.cli.serving.transcription import TranscriptionHandler
        from transformers.utils import logging

        from .chat_completion import SSDChatCompletionHandler
        from .generation import SSDGenerationState
        from .metrics import ServingMetrics
        from .model_manager import SSDModelManager

        logging.get_logger("transformers").setLevel(logging.log_levels[log_level.lower()])
        self.ssd_config = (ssd_config or SSDConfig()) if draft is not None else None
        self.host, self.log_level = host, log_level
        self._port = port
        self.metrics = ServingMetrics(target, speculative=self.ssd_config is not None,
                                      lookahead=self.ssd_config.lookahead if self.ssd_config else 0)
        self.model_manager = SSDModelManager(target, draft, draft_precision=draft_precision,
                                             target_precision=target_precision, device=device,
                                             dtype=dtype)
        if self.ssd_config is not None and start_draft_worker:
            self._start_draft_worker()
        self.generation_state = SSDGenerationState(self.model_manager, self.ssd_config, self.metrics)
        state = {"model_manager": self.model_manager, "generation_state": self.generation_state}
        self.chat_handler = SSDChatCompletionHandler(**state, ssd_config=self.ssd_config)
        self.app = build_server(
            self.model_manager,
            self.chat_handler,
            completion_handler=CompletionHandler(**state),
            response_handler=ResponseHandler(**state),
            transcription_handler=TranscriptionHandler(self.model_manager, self.generation_state),
            systemone_handler=SystemOneHandler(**state),
            generation_state=self.generation_state,
            enable_cors=enable_cors,
        )
        self.metrics.install(self.app)
        openai_errors(self.app)
        self._server = None
        self._thread: threading.Thread | None = None

    def _start_draft_worker(self) -> None:
        from ..runtime import start_draft_worker
        from ..runtime.pool import shareable

        draft = self.model_manager.draft
        if self.ssd_config.executor in ("auto", "process") and draft.device.type == "cpu" and shareable(draft) is None:
            start_draft_worker(draft)

    # ---- running -----------------------------------------------------------------------------------------------
    def _uvicorn(self):
        import uvicorn

        config = uvicorn.Config(self.app, host=self.host, port=self._port, log_level=self.log_level.lower())
        self._server = uvicorn.Server(config)
        return self._server

    @property
    def port(self) -> int:
        """The port listened on (the one picked, with port 0), once started."""
        if self._server is not None and self._server.started and self._server.servers:
            return self._server.servers[0].sockets[0].getsockname()[1]
        return self._port

    @property
    def url(self) -> str:
        """The base URL an OpenAI client takes (`.../v1`)."""
        return f"http://{self.host}:{self.port}/v1"

    def run(self) -> None:
        """Serve in the foreground until interrupted (Ctrl-C)."""
        self._uvicorn().run()

    def start(self, timeout: float = 60.0) -> SSDServer:
        """Serve on a background thread; returns once the server accepts connections."""
        server = self._uvicorn()
        self._thread = threading.Thread(target=lambda: asyncio.run(server.serve()), name="hf-ssd-serve",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.host}:{self._port}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop a server started with `start()` (requests in flight finish or are dropped) and free the models."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.model_manager.shutdown()
        self.model_manager.draft = None
