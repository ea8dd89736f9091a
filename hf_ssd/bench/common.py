"""Constants shared by the benchmark modules."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

SCHEMA = "hf-ssd-bench/1"
DATASETS = ("mt_bench", "gsm8k", "alpaca", "humaneval")
HUMANEVAL_PACKAGE = "humaneval-pkg"
# The EAGLE HumanEval subset (shared/data/prompts/humaneval.jsonl) words its prompts like this.
HUMANEVAL_INSTRUCTION = "Complete the code I provided.\n"
METHOD_KINDS = ("ar", "sd", "sd-default", "ssd", "ssd-sync")
FRAMINGS = ("extra-cores", "equal-cores")
ALL = "all"
DECODE_TIMING = (
    "decode tok/s excludes prefill by the time to the first emission, both taken in the same generate() call by "
    "a streamer: (new tokens - tokens of the first emission) / (end - time of the first emission); the first "
    "emission is the first token for AR and the whole first round for SD/SSD (prefills + one speculation, "
    "accepted + bonus). e2e tok/s = new tokens / whole call. Totals = total tokens / total time."
)
FRAMING_TEXT = {
    "extra-cores": "draft gets extra cores: SSD (draft {d} + target {t} threads) vs AR and SD with {t} thread(s)",
    "equal-cores": "equal total cores: SSD (draft {d} + target {t} threads) vs AR and SD with {n} threads",
}


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _spread(values: Sequence[float]) -> dict[str, float | None]:
    values = [v for v in values if v is not None]
    if not values:
        return {"min": None, "max": None, "stdev": None, "n": 0}
    return {"min": min(values), "max": max(values), "stdev": statistics.stdev(values) if len(values) > 1 else None,
            "n": len(values)}
