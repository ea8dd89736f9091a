"""`hf-ssd serve`: transformers' OpenAI-compatible server (`transformers serve`) with SSD on every request.

The app, its routes, request handling and model loading are transformers' own (`transformers.cli.serving`, the
`serving` extra); this package only reaches into them at a few seams, one concept per file:

- `model_manager.py`: the target is pinned (`force_model`), SSD is enabled on it, and the draft is loaded beside it
  and kept for the server's lifetime; fetched short names (`qwen2.5-coder-1.5b`) resolve to their folders.
- `generation.py`: every `model.generate()` the generation managers run gets the pinned draft and an `SSDConfig`
  (the request's, else the server's); the context length is checked before a request queues.
- `chat_completion.py`: `/v1/chat/completions` accepts a per-request `ssd_config` (400 with SSDConfig's message
  when invalid).
- `metrics.py`: `/metrics` in Prometheus' text format, with vLLM's speculative-decoding names.
- `server.py`: the wiring (`SSDServer`), run in the foreground or on a background thread.
- `command.py`: the `hf-ssd serve` command line.

Nothing here is imported by `import hf_ssd`: FastAPI, uvicorn and prometheus_client load only when serving.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "SSDServer": ".server",
    "ServingMetrics": ".metrics",
    "require_serving": ".compat",
}

__all__ = ["SSDServer", "ServingMetrics", "require_serving"]

if TYPE_CHECKING:
    from .compat import require_serving
    from .metrics import ServingMetrics
    from .server import SSDServer


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hf_ssd.serving' has no attribute {name!r}")
