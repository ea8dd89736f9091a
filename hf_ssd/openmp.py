"""OpenMP's wait between parallel regions, set in the environment before a process loads torch (libgomp reads it
once, at load). Outside `runtime` because importing that package loads torch; the `hf-ssd` command and the draft
worker processes use it."""

from __future__ import annotations

import os

# How long an OpenMP thread spins for more work after a parallel region before it sleeps (libgomp's GOMP_SPINCOUNT,
# in spin iterations). libgomp's default (300,000 when OMP_WAIT_POLICY is unset) keeps
# a finished side's threads spinning on the core the other side needs; PASSIVE (0) puts them to sleep after every
# region, so each of the hundreds of regions in a forward waits for its threads to wake: a 2-thread decode step of
# the 0.5B int8 draft took 59 ms instead of 36, the 1.5B target's 283 instead of 254. A short spin keeps both.
SPIN_COUNT = "20000"


def openmp_wait_env(environ=None) -> dict[str, str]:
    """What to add to `environ` (default: this process's) before a process loads torch so its OpenMP threads spin
    briefly after each parallel region (`SPIN_COUNT`): nothing where the caller chose a policy or a spin count."""
    environ = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return {}
    return {"GOMP_SPINCOUNT": SPIN_COUNT}
