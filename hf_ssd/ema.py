"""A decayed mean: the running estimate every measured time in hf_ssd keeps (the lookahead policy's costs, the
thread choice's seconds per unit of work). Apart from both packages that use it, so neither reaches into the other."""

from __future__ import annotations


class DecayedMean:
    """An exponentially decayed mean of the samples added; `weight` is how many samples' worth it holds
    (1 + decay + decay^2 + ...), None as `value` until the first sample."""

    def __init__(self, decay: float):
        self.decay, self.value, self.weight = decay, None, 0.0

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.decay * self.value + (1 - self.decay) * x
        self.weight = self.decay * self.weight + 1.0
