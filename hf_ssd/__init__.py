"""hf_ssd: Speculative Speculative Decoding (the Saguaro algorithm) for Hugging Face transformers.

    from hf_ssd import SSDConfig, enable_ssd
    enable_ssd(target)
    out = target.generate(**inputs, assistant_model=draft, ssd_config=SSDConfig(lookahead=4))
"""

from .config import SSDConfig
from .generation import SaguaroCandidateGenerator, SSDGenerateDecoderOnlyOutput, SSDGenerationMixin, enable_ssd
from .metrics import SSDMetrics

__version__ = "0.1.0"

__all__ = [
    "SSDConfig",
    "SSDGenerationMixin",
    "SSDGenerateDecoderOnlyOutput",
    "SSDMetrics",
    "SaguaroCandidateGenerator",
    "enable_ssd",
    "__version__",
]
