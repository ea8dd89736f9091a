"""The stream executor on a CPU: its hand-off protocol (events recorded and waited in order, inputs before work,
results after it), when "auto" chooses it, and that it runs SSD exactly. (Greedy equality, the sampling law and
faults are covered with the other executors in their modules; GPU concurrency by benchmarks/gpu_check.py.)"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_pair

from hf_ssd import SSDConfig
from hf_ssd.runtime import choose_executor
from hf_ssd.runtime import stream as stream_module
from hf_ssd.runtime.streams import DeviceStreams, HostEvent, tensors


class LoggingStreams(DeviceStreams):
    """CPU streams that log each hand-off call, with the thread it ran on."""

    log: list = []

    def _note(self, what, event=None):
        LoggingStreams.log.append((what, threading.current_thread().name, id(event) if event is not None else None))

    def mark(self, device=None):
        event = super().mark(device)
        self._note("mark", event)
        return event

    def on_side(self, after=None):
        self._note("side", after)
        return super().on_side(after)

    def done(self):
        event = super().done()
        self._note("done", event)
        return event

    def consume(self, event, value, device=None):
        self._note("consume", event)
        return super().consume(event, value, device)


def test_hand_offs_are_events_in_order(monkeypatch):
    """Per task: an event marks the submitter's stream at submission (the inputs), the draft thread's work waits
    on it, records its own event when done, and the consumer waits on that event before it gets the result."""
    LoggingStreams.log = []
    monkeypatch.setattr(stream_module, "DeviceStreams", LoggingStreams)
    target, draft = tiny_pair("llama", seed=3)
    ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(1))
    out = target.generate(ids, assistant_model=draft, max_new_tokens=12, do_sample=False,
                          ssd_config=SSDConfig(lookahead=3, executor="stream"))
    assert target.ssd_metrics.executor == "stream"
    expected = target.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, expected)
    log = LoggingStreams.log
    marks = [i for i, entry in enumerate(log) if entry[0] == "mark"]
    assert len(marks) >= 3  # begin, then prepare and resolve per round
    for n, start in enumerate(marks[:-1]):  # the last, a `prepare` for rows that all finished, is cancelled
        task = log[start: marks[n + 1]]
        kinds = [entry[0] for entry in task]
        assert kinds[:1] == ["mark"] and "side" in kinds and "done" in kinds
        side, done = kinds.index("side"), kinds.index("done")
        assert side < done
        assert task[side][2] == task[0][2]  # the work waited on the submission's event
        assert not task[0][1].startswith("hf-ssd-draft")  # marked by the submitter
        # issued on the draft's thread, or inline by the submitter (a paused round's bookkeeping), never both
        assert task[side][1] == task[done][1]
        assert task[side][1].startswith("hf-ssd-draft") or task[side][1] == task[0][1]
        if "consume" in kinds:  # the consumer waits on the event the task recorded
            consume = kinds.index("consume")
            assert consume > done and task[consume][2] == task[done][2]
            assert not task[consume][1].startswith("hf-ssd-draft")


def test_cpu_streams_are_host_events():
    streams = DeviceStreams("cpu")
    assert not streams.asynchronous and streams.side is None
    event = streams.mark()
    assert isinstance(event, HostEvent) and event.query()
    with streams.on_side(after=event):
        x = torch.ones(3) * 2
    done = streams.done()
    assert done.query()
    assert streams.consume(done, x) is x
    streams.idle()


def test_tensors_are_found_in_results():
    spec = SimpleNamespace()  # not a dataclass: not walked
    value = [(torch.zeros(1), {"a": torch.ones(2)}), spec, None]
    found = list(tensors(value))
    assert len(found) == 2 and found[1].shape == (2,)


def test_auto_chooses_the_stream_executor_for_a_draft_on_an_accelerator():
    assert choose_executor("auto", SimpleNamespace(device=torch.device("cuda", 1)), torch.device("cuda", 0)) == \
        "stream"
    assert choose_executor("auto", SimpleNamespace(device=torch.device("cuda", 0)), torch.device("cuda", 0)) == \
        "stream"
    assert choose_executor("stream", SimpleNamespace(device=torch.device("cpu")), torch.device("cpu")) == "stream"


@pytest.mark.parametrize("do_sample", [False, True])
def test_stream_matches_thread_for_a_seed(do_sample):
    """Same draft calls in the same order: the stream executor's tokens equal the thread executor's for a seed."""
    target, draft = tiny_pair("qwen2", seed=5)
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(4))
    outputs = []
    for executor in ("thread", "stream"):
        torch.manual_seed(9)
        config = SSDConfig(lookahead=3, executor=executor, backup="draft", lookahead_schedule="constant",
                           fanout_budget_schedule="constant")
        outputs.append(target.generate(ids, assistant_model=draft, max_new_tokens=16, do_sample=do_sample,
                                       pad_token_id=0, ssd_config=config))
    assert torch.equal(outputs[0], outputs[1])
