"""What SSD hands back: the output object, the assembled sequences and scores, and the streamer feed."""

from __future__ import annotations

import dataclasses

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..metrics import SSDMetrics


@dataclasses.dataclass
class SSDGenerateDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus the run's `ssd_metrics`."""

    ssd_metrics: SSDMetrics | None = None


class BatchStreamer:
    """Feeds a streamer one column per decoding step, like plain decoding: column n goes out once every row has
    its n-th token (finished rows contribute the pad token). A streamer with `accepts_blocks = True` gets each
    emission's columns as one [b, n] block instead (benchmarks timestamp emissions that way)."""

    def __init__(self, streamer, rows: int, pad: int | None):
        self.streamer, self.rows, self.pad, self.sent = streamer, rows, pad, 0

    def flush(self, generated: list[list[int]], finished: list[bool], final: bool = False) -> None:
        if self.streamer is None:
            return
        if self.rows == 1:
            ready = len(generated[0])
        else:
            lengths = [len(g) for g, done in zip(generated, finished) if not done]
            ready = min(lengths) if lengths and not final else max(len(g) for g in generated)
        if ready > self.sent:
            columns = [
                [g[n] if n < len(g) else self.pad for g in generated] for n in range(self.sent, ready)
            ]
            if self.rows == 1:
                self.streamer.put(torch.tensor([c[0] for c in columns]))
            elif getattr(self.streamer, "accepts_blocks", False):
                self.streamer.put(torch.tensor(columns).T)
            else:
                for column in columns:
                    self.streamer.put(torch.tensor(column))
            self.sent = ready


def assemble(input_ids: torch.Tensor, generated: list[list[int]], pad_id: int | None) -> torch.Tensor:
    """[b, T + longest]: each row's prompt and generation; rows that finished earlier are padded, as in plain
    decoding."""
    longest = max(len(g) for g in generated)
    fill = pad_id if pad_id is not None else 0
    new = torch.full((input_ids.shape[0], longest), fill, dtype=input_ids.dtype, device=input_ids.device)
    for r, tokens in enumerate(generated):
        new[r, : len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
    return torch.cat([input_ids, new], dim=1)


def steps(per_row: list[list[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """Per-step [b, V] tensors from per-row lists; a row that had finished holds zeros at later steps."""
    longest = max(len(rows) for rows in per_row)
    template = next(t for rows in per_row for t in rows)
    return tuple(
        torch.cat([rows[n] if n < len(rows) else torch.zeros_like(template) for rows in per_row])
        for n in range(longest)
    )
