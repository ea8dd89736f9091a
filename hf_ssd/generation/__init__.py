"""SSD generation: mixin, candidate generator (draft side), decoding loop (target side), verification."""

from .candidate_generator import SaguaroCandidateGenerator
from .decoding import ssd_decoding
from .mixin import SSDGenerationMixin, enable_ssd
from .outputs import SSDGenerateDecoderOnlyOutput

__all__ = [
    "SaguaroCandidateGenerator",
    "SSDGenerateDecoderOnlyOutput",
    "SSDGenerationMixin",
    "enable_ssd",
    "ssd_decoding",
]
