"""What SSD hands back: the output object, the assembled sequences and scores, and the streamer feed."""

from __future__ import annotations

import dataclasses
import logging

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..metrics import SSDMetrics

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SSDGenerateDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus the run's `ssd_metrics`."""

    ssd_metrics: SSDMetrics | None = None


class BatchStreamer:
    """Feeds a streamer one column per decoding step, like plain decoding: column n goes out once every row has
    its n-th token (finished rows contribute the pad token). A streamer with `accepts_blocks = True` gets each
    emission's columns as one [b, n] block instead (benchmarks timestamp emissions that way).

    Used as a context manager around the loop: on the way out it flushes what is left and calls `end()`. Tokens
    count as sent before `put()` is called, so none is sent twice; once `put()` has raised (a client gone, Ctrl-C)
    it is not called again, as in plain decoding. While an error unwinds, a failure of the final flush or of
    `end()` is logged, never raised in its place.
    """

    def __init__(self, streamer, rows: list, pad: int | None):
        self.streamer, self.rows, self.pad = streamer, rows, pad
        self.sent = 0
        self.failed = False

    def __enter__(self) -> BatchStreamer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.streamer is None:
            return
        if exc_type is None:
            self.flush(final=True)
            self.streamer.end()
            return
        try:
            self.flush(final=True)
        except Exception:
            logger.warning("hf_ssd: the streamer failed while generation was ending on an error", exc_info=True)
        try:
            self.streamer.end()
        except Exception:
            logger.warning("hf_ssd: streamer.end() failed while generation was ending on an error", exc_info=True)

    def flush(self, final: bool = False) -> None:
        if self.streamer is None or self.failed:
            return
        generated = [row.generated for row in self.rows]
        if len(generated) == 1:
            ready = len(generated[0])
        else:
            lengths = [len(row.generated) for row in self.rows if not row.done]
            ready = min(lengths) if lengths and not final else max(len(g) for g in generated)
        if ready <= self.sent:
            return
        columns = [[g[n] if n < len(g) else self.pad for g in generated] for n in range(self.sent, ready)]
        self.sent = ready
        try:
            if len(generated) == 1:
                self.streamer.put(torch.tensor([c[0] for c in columns]))
            elif getattr(self.streamer, "accepts_blocks", False):
                self.streamer.put(torch.tensor(columns).T)
            else:
                for column in columns:
                    self.streamer.put(torch.tensor(column))
        except BaseException:
            self.failed = True
            raise


def assemble(input_ids: torch.Tensor, rows: list, pad_id: int | None) -> torch.Tensor:
    """[b, T + longest]: each row's prompt and generation; rows that finished earlier are padded, as in plain
    decoding."""
    longest = max(len(row.generated) for row in rows)
    fill = pad_id if pad_id is not None else 0
    new = torch.full((input_ids.shape[0], longest), fill, dtype=input_ids.dtype, device=input_ids.device)
    for row in rows:
        new[row.index, : len(row.generated)] = torch.tensor(row.generated, dtype=input_ids.dtype)
    return torch.cat([input_ids, new], dim=1)


def steps(per_row: list[list[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """Per-step [b, V] tensors from per-row lists; a row that had finished holds zeros at later steps."""
    longest = max(len(rows) for rows in per_row)
    template = next(t for rows in per_row for t in rows)
    return tuple(
        torch.cat([rows[n] if n < len(rows) else torch.zeros_like(template) for rows in per_row])
        for n in range(longest)
    )
