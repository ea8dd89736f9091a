"""The draft worker process's memory allocator: keep freed memory for the next forward instead of returning it.

glibc's malloc serves a request above its mmap threshold (128 KiB at first, raised up to 32 MiB as such blocks are
freed) from fresh pages of the OS, and hands the heap's top back to the OS past its trim threshold (128 KiB): a
forward whose activations are that large faults every page of them in again, each time. A fresh worker process pays
it in full on the draft's prefill (the prompt's activations are megabytes per layer): on a 2-core Xeon the 0.5B int8
draft's prefill of 371 tokens took 590-620 ms in the worker against 435-447 ms in the caller's process, and 1,800-
2,100 ms against 1,860-1,900 for 1,200 tokens; with the thresholds fixed below (`tune_allocator`) 440-470 and 1,620-
1,780 ms. The worker holds one draft and nothing else, so keeping what it freed costs at most its peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD = 32 << 20  # the most glibc allows: blocks up to 32 MiB come from the heap, reused
TRIM_THRESHOLD = 1 << 30  # free memory at the heap's top kept up to 1 GiB


# Where the user configured malloc (the process inherits the caller's environment), their settings stand, as
# `openmp.openmp_wait_env` leaves a chosen OpenMP wait policy alone.
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def tune_allocator() -> bool:
    """Fix glibc malloc's mmap and trim thresholds for this process (see the module docstring). True where they were
    set; False elsewhere (not Linux, another C library, malloc configured in the environment: `USER_SETTINGS`),
    where nothing changes."""
    if not sys.platform.startswith("linux") or any(name in os.environ for name in USER_SETTINGS):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
