"""hf_ssd: Speculative Speculative Decoding (the Saguaro algorithm) for Hugging Face transformers.

    from hf_ssd import SSDConfig, enable_ssd
    enable_ssd(target)
    out = target.generate(**inputs, assistant_model=draft, ssd_config=SSDConfig(lookahead=4))

Attributes load lazily, so `hf-ssd` can set process-wide options (OpenMP's wait policy) before torch loads.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "DraftWorkerError": ".runtime",
    "SSDConfig": ".config",
    "SSDMetrics": ".metrics",
    "SSDGenerationMixin": ".generation",
    "SSDGenerateDecoderOnlyOutput": ".generation",
    "SaguaroCandidateGenerator": ".generation",
    "enable_ssd": ".generation",
    "Placement": ".runtime.placement",
    "pack_linear_layers": ".packing",
    "place_models": ".runtime.placement",
    "plan_placement": ".runtime.placement",
}

__all__ = [
    "DraftWorkerError",
    "Placement",
    "SSDConfig",
    "SSDGenerateDecoderOnlyOutput",
    "SSDGenerationMixin",
    "SSDMetrics",
    "SaguaroCandidateGenerator",
    "enable_ssd",
    "pack_linear_layers",
    "place_models",
    "plan_placement",
    "__version__",
]

if TYPE_CHECKING:
    from .config import SSDConfig
    from .generation import SaguaroCandidateGenerator, SSDGenerateDecoderOnlyOutput, SSDGenerationMixin, enable_ssd
    from .metrics import SSDMetrics
    from .packing import pack_linear_layers
    from .runtime import DraftWorkerError
    from .runtime.placement import Placement, place_models, plan_placement


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hf_ssd' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
