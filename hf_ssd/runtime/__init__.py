"""Where the draft runs: inline, on a thread, on a thread issuing onto a side stream of its device, or in a worker
process.

Everything about threads, processes and devices lives in this package, behind `DraftExecutor`; the round loop only
calls `choose_executor` and `open_executor`.
"""

from .executor import (
    DraftCancelled,
    DraftExecutor,
    DraftRequest,
    DraftWorkerError,
    choose_executor,
    open_executor,
)
from .layer_probe import cost_curve, thread_gain
from .threads import available_cores, split_threads

__all__ = [
    "DraftCancelled",
    "DraftExecutor",
    "DraftRequest",
    "DraftWorkerError",
    "available_cores",
    "choose_executor",
    "close_workers",
    "cost_curve",
    "open_executor",
    "split_threads",
    "thread_gain",
    "start_draft_worker",
]


def start_draft_worker(draft) -> float:
    """Start a draft worker process now, holding `draft` (see `pool.start_draft_worker`); seconds taken."""
    from .pool import start_draft_worker as start

    return start(draft)


def close_workers() -> None:
    """Stop this interpreter's draft worker processes (`executor="process"`); they restart on demand."""
    from .pool import close_workers as close

    close()
