"""Drafts that fail on purpose, importable by a draft worker process (fault tests for `executor="process"`, where a
monkeypatch in the test process cannot reach the draft)."""

from __future__ import annotations

import functools
import os
import signal

from transformers import LlamaForCausalLM


class DraftBoom(RuntimeError):
    pass


class FailingDraft(LlamaForCausalLM):
    """A Llama whose forward raises `DraftBoom` (or `KeyboardInterrupt`, or kills its own process) once it has run
    `fail_after` times; the count lives where the draft runs."""

    fail_after: int = -1
    failure: str = "boom"  # "boom", "interrupt" or "die"

    @functools.wraps(LlamaForCausalLM.forward)  # the same signature (hf_ssd reads the cache argument's name)
    def forward(self, *args, **kwargs):
        calls = self.__dict__.get("calls", 0)
        self.__dict__["calls"] = calls + 1
        if 0 <= self.fail_after <= calls:
            if self.failure == "interrupt":
                raise KeyboardInterrupt
            if self.failure == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            raise DraftBoom(f"draft forward failed after {calls} calls in pid {os.getpid()}")
        return super().forward(*args, **kwargs)


def failing_copy(draft, fail_after: int, failure: str = "boom") -> FailingDraft:
    """A `FailingDraft` with `draft`'s config and weights."""
    model = FailingDraft(draft.config).eval()
    model.load_state_dict(draft.state_dict())
    model.fail_after, model.failure = fail_after, failure
    return model
