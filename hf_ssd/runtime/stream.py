"""The stream executor: the draft's work issued from one background thread onto a side stream of its device.

The thread lets the draft's host work (its kernel launches) overlap the target's; the side stream lets its device
work overlap the target's on a shared GPU (on its own GPU it keeps the default stream free for copies). Hand-offs
are events (`streams.py`): a task's inputs are ready when the side stream has waited on an event recorded on the
submitter's stream at submission; its results are ready when the consumer's stream has waited on the event the
task recorded when it finished issuing. The only host synchronisation of a round is the target's read-back of its
verification outcome; nothing calls a device-wide `synchronize()`. On a CPU the same calls run with host events, so
CI exercises this path's ordering, cancellation and faults.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from .executor import DraftRequest
from .local import LocalExecutor
from .streams import DeviceStreams


class HandOff:
    """A pending result of a draft task; `result()` makes the consumer's stream wait on the task's event first."""

    def __init__(self, future: Future, streams: DeviceStreams, consumer: torch.device):
        self._future, self._streams, self._consumer = future, streams, consumer

    def result(self, timeout: float | None = None):
        value, event = self._future.result(timeout)
        return self._streams.consume(event, value, self._consumer)

    def done(self) -> bool:
        return self._future.done()


class StreamExecutor(LocalExecutor):
    """`LocalExecutor` on a thread whose tasks issue their work on the draft device's side stream."""

    def __init__(self, draft_model: torch.nn.Module, request: DraftRequest, target_device: torch.device):
        super().__init__("thread", draft_model, request)
        self.kind = "stream"
        self.target_device = torch.device(target_device)
        self.streams = DeviceStreams(self.draft_device)

    def _settle(self) -> None:  # hand-offs are events, see `HandOff`
        pass

    def _submit(self, fn, *args, inline: bool = False, settle: bool = True) -> HandOff:
        ready = self.streams.mark(self.target_device)  # the inputs, as the caller has issued them so far
        return HandOff(super()._submit(self._on_side, fn, ready, args, inline=inline, settle=settle), self.streams,
                       self.target_device)

    def _on_side(self, fn, ready, args):
        with self.streams.on_side(after=ready):
            value = fn(*args)
            return value, self.streams.done()

    def close(self) -> None:
        """Stop work in flight, join the thread, and wait until the side stream has run what was issued on it."""
        try:
            super().close()
        finally:
            self.streams.idle()
