"""Streams and events of the draft's device behind one small adapter, so the stream executor's code path is the same
on a GPU and on a CPU (where it runs in CI).

On an accelerator (CUDA, XPU, ...) the draft issues its work on a dedicated side stream; a hand-off in either
direction is an event recorded on the producer's stream that the consumer's stream waits on (a device-side wait:
the host does not block, no device-wide `synchronize()`); a tensor that crosses streams is marked with
`record_stream`, so the caching allocator does not reuse its memory while the other stream may still read it. On a
CPU there are no asynchronous streams: work is done when the call that issued it returns, so events are complete
once recorded and waits are no-ops — but every hand-off still goes through the same calls, in the same order.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch


class HostEvent:
    """A CPU stand-in for a device event: work issued on a CPU is complete when its call returns."""

    def __init__(self):
        self.recorded = False

    def record(self, stream=None) -> None:
        self.recorded = True

    def query(self) -> bool:
        return self.recorded

    def synchronize(self) -> None:
        pass


class DeviceStreams:
    """The draft device's side stream, and event hand-offs between it and the streams of other devices."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.asynchronous = self.device.type not in ("cpu", "meta")
        self._module = torch.get_device_module(self.device) if self.asynchronous else None
        self.side = self._module.Stream(device=self.device) if self.asynchronous else None

    def event(self):
        return self._module.Event() if self.asynchronous else HostEvent()

    def mark(self, device: torch.device | str | None = None):
        """An event recorded now on the current stream of `device` (default: the draft's): the producer's side of a
        hand-off."""
        device = torch.device(device) if device is not None else self.device
        if device.type in ("cpu", "meta"):
            event = HostEvent()
            event.record()
            return event
        module = torch.get_device_module(device)
        event = module.Event()
        event.record(module.current_stream(device))
        return event

    @contextlib.contextmanager
    def on_side(self, after=None):
        """Issue the block's work on the side stream, after the event `after` (the inputs' producer)."""
        if not self.asynchronous:
            yield
            return
        if after is not None and not isinstance(after, HostEvent):
            self.side.wait_event(after)
        with self._module.stream(self.side):
            yield

    def done(self):
        """An event recorded on the side stream: everything issued there so far."""
        event = self.event()
        event.record(self.side) if self.asynchronous else event.record()
        return event

    def consume(self, event, value, device: torch.device | str | None = None):
        """Make the current streams of the draft's device and of `device` (where `value` will be used) wait on
        `event`, and mark `value`'s tensors as used by their device's current stream; returns `value`. (A copy to
        another GPU runs behind the current streams of both devices.)"""
        if isinstance(event, HostEvent):
            return value
        devices = {self.device} | ({torch.device(device)} if device is not None else set())
        for dev in devices:
            if dev.type not in ("cpu", "meta"):
                torch.get_device_module(dev).current_stream(dev).wait_event(event)
        for tensor in tensors(value):
            if tensor.device.type not in ("cpu", "meta"):
                tensor.record_stream(torch.get_device_module(tensor.device).current_stream(tensor.device))
        return value

    def idle(self) -> None:
        """Wait until the side stream has run everything issued on it (that stream only)."""
        if self.asynchronous:
            self.side.synchronize()


def tensors(value):
    """Every tensor in `value` (tensors, lists, tuples, dicts and dataclasses of them)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from tensors(getattr(value, field.name))
