"""The draft worker's allocator settings (`runtime.allocator`): freed activations are reused, not faulted in again."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

from hf_ssd.runtime import allocator, worker

# Six 8 MiB blocks allocated with malloc, touched and freed, ten times over (a forward's activations, round after
# round); the minor page faults of the last ten rounds. Run in a child: the settings last for the process.
SCRIPT = """
import ctypes, ctypes.util, resource, sys
from hf_ssd.runtime.allocator import tune_allocator
tuned = tune_allocator() if sys.argv[1] == "1" else False
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
def blocks():
    held = [libc.malloc(8 << 20) for _ in range(6)]
    for block in held:
        ctypes.memset(block, 1, 8 << 20)
    for block in held:
        libc.free(block)
for _ in range(3):
    blocks()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    blocks()
print(int(tuned), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(tuned: bool, env: dict | None = None) -> tuple[int, int]:
    env = {k: v for k, v in os.environ.items() if k not in allocator.USER_SETTINGS} | (env or {})
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(int(tuned))], capture_output=True, text=True, check=True,
                         env=env)
    applied, faults = out.stdout.split()
    return int(applied), int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_tuned_allocator_reuses_freed_blocks_instead_of_faulting_them_in():
    applied, faults = _faults(True)
    assert applied == 1
    assert faults == 0
    _, untuned = _faults(False)  # the control: glibc's defaults give the pages back and fault them in again
    assert untuned > 1000


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_malloc_settings_in_the_environment_stand():
    applied, _ = _faults(True, {"MALLOC_TRIM_THRESHOLD_": str(128 << 10)})
    assert applied == 0


def test_the_worker_tunes_its_allocator_first(monkeypatch):
    calls = []
    monkeypatch.setattr(worker, "tune_allocator", lambda: calls.append("tuned") or True)
    monkeypatch.setattr(worker.signal, "signal", lambda *a: calls.append("signal"))
    monkeypatch.setattr(worker.torch, "set_num_threads", lambda n: calls.append(("threads", n)))  # not this process's

    class Closed:
        def send_bytes(self, data):
            calls.append("ready")

        def recv_bytes(self):
            raise EOFError

        def close(self):
            calls.append("closed")

    with warnings.catch_warnings():  # main() adds a filter for its process
        worker.main(Closed(), None, 1)
    assert calls[:2] == ["signal", "tuned"] and calls[-1] == "closed"
