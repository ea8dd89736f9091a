"""Caches of SSD: the outcome-keyed speculation cache and the draft's shared-prefix tree-attention KV cache."""

from .draft_cache import DraftCache
from .speculation_cache import Speculation, SpeculationCache

__all__ = ["DraftCache", "Speculation", "SpeculationCache"]
