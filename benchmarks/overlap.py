"""Do two Python threads running torch work really overlap on this machine?

SSD's `executor="thread"` runs the draft on a background Python thread (one intra-op thread, set with
`torch.set_num_threads` inside that thread, as `hf_ssd/runtime/local.py` does) while the main thread runs
the target's verification. This script measures how much of that concurrency is real:

- For each workload pair (A = draft-sized, B = target-sized) it calibrates iteration counts so A and B each take
  about `--seconds` alone, then times them serially (A then B on one thread) and concurrently (A and B in two
  Python threads, each with `torch.set_num_threads(1)`, started together from a barrier).
- Overlap efficiency = serial time / concurrent time: 2.0 is perfect overlap, 1.0 is none. The per-side slowdown
  (time under concurrency / time alone) is printed too.
- Workloads: `matmul` (bare linears of the default random pair's shapes: little Python, long kernels) and `model`
  (whole forwards of the default random pair: a 2-layer draft over 8 tree tokens vs the 8-layer target over
  K+1=4 tokens: many small ops, a lot of Python and dispatcher time under the GIL).
- The same pair is also run in two processes (no shared GIL): if processes overlap clearly better than threads,
  the GIL (Python-side work in the forwards) is what limits the thread executor; if both are poor, the cores are.
- It also checks that `torch.set_num_threads` in a worker thread leaves the main thread's
  `torch.get_num_threads()` (OpenMP, per thread) and MKL's thread count alone.

Usage (from the project root)::

    .venv/bin/python benchmarks/overlap.py                     # both workloads, 3 repeats, ~1 s per side
    .venv/bin/python benchmarks/overlap.py --workload model --seconds 2 --repeats 5 --json overlap.json

The machine may be shared: the 1-minute load average is printed before and after; with more runnable
processes than cores no method can overlap well. `OMP_WAIT_POLICY` (printed) matters for >1 intra-op thread.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def spread(rows: list[dict], med: dict, key: str) -> str:
    return f"{med[key]:.2f} [{min(r[key] for r in rows):.2f}–{max(r[key] for r in rows):.2f}]"


def mkl_threads() -> int | None:
    """MKL's max threads as seen from the calling thread (parsed from torch's parallel_info)."""
    match = re.search(r"mkl_get_max_threads\(\) : (\d+)", torch.__config__.parallel_info())
    return int(match.group(1)) if match else None


def check_thread_isolation() -> dict:
    """Set 1 thread in a worker; report what the main thread sees before and after."""
    main_threads = os.cpu_count() or 1
    torch.set_num_threads(main_threads)
    before = {"torch": torch.get_num_threads(), "mkl": mkl_threads()}
    seen = {}

    def worker():
        torch.set_num_threads(1)
        seen["torch"] = torch.get_num_threads()
        seen["mkl"] = mkl_threads()

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    after = {"torch": torch.get_num_threads(), "mkl": mkl_threads()}
    ok = after == before
    return {"main_before": before, "worker": seen, "main_after": after, "main_unchanged": ok}


def workloads(kind: str):
    """(name, draft-like callable, target-like callable) triples."""
    out = []
    if kind in ("matmul", "all"):
        g = torch.Generator().manual_seed(0)
        x_d = torch.randn(8, 512, generator=g)  # 8 tree branches through the draft's MLP + LM head
        x_t = torch.randn(4, 512, generator=g)  # K+1 = 4 verify positions through the target's MLP
        w_up = torch.randn(1376, 512, generator=g)
        w_down = torch.randn(512, 1376, generator=g)
        w_head = torch.randn(4096, 512, generator=g)

        def draft_mm():
            torch.nn.functional.linear(torch.nn.functional.linear(x_d, w_up), w_down)
            torch.nn.functional.linear(x_d, w_head)

        def target_mm():
            for _ in range(4):
                torch.nn.functional.linear(torch.nn.functional.linear(x_t, w_up), w_down)

        out.append(("matmul", draft_mm, target_mm))
    if kind in ("model", "all"):
        from hf_ssd.cli import _random_pair

        target, draft, _ = _random_pair()
        g = torch.Generator().manual_seed(1)
        ids_d = torch.randint(0, 4096, (1, 8), generator=g)
        ids_t = torch.randint(0, 4096, (1, 4), generator=g)

        def draft_fw():
            with torch.no_grad():
                draft(ids_d)

        def target_fw():
            with torch.no_grad():
                target(ids_t)

        out.append(("model", draft_fw, target_fw))
    return out


def run_n(fn, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return time.perf_counter() - start


def calibrate(fn, seconds: float) -> int:
    torch.set_num_threads(1)
    for _ in range(3):
        fn()
    n, elapsed = 1, 0.0
    while elapsed < 0.2:
        n *= 2
        elapsed = run_n(fn, n)
    return max(1, int(n * seconds / elapsed))


def concurrent(fa, na: int, fb, nb: int) -> tuple[float, float, float]:
    """(wall, time of A, time of B) with A and B in two Python threads, one intra-op thread each."""
    barrier = threading.Barrier(3)
    times = {}

    def side(name, fn, n):
        torch.set_num_threads(1)
        fn()
        barrier.wait()
        times[name] = run_n(fn, n)

    threads = [threading.Thread(target=side, args=("a", fa, na)), threading.Thread(target=side, args=("b", fb, nb))]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - start, times["a"], times["b"]


def _process_side(kind: str, side: int, n: int, barrier, results) -> None:
    """Child process: rebuild workload `kind`, run its side `side` n times after the barrier."""
    torch.set_num_threads(1)
    fn = {name: (fa, fb) for name, fa, fb in workloads(kind)}[kind][side]
    fn()
    barrier.wait()
    results[2 * side] = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes on Linux
    results[2 * side + 1] = results[2 * side] + run_n(fn, n)


def concurrent_processes(kind: str, na: int, nb: int, ctx) -> tuple[float, float, float]:
    """(wall, time of A, time of B) with A and B in two processes (no shared GIL), one intra-op thread each."""
    barrier = ctx.Barrier(3)
    results = ctx.Array("d", 4)
    procs = [ctx.Process(target=_process_side, args=(kind, side, n, barrier, results))
             for side, n in ((0, na), (1, nb))]
    for p in procs:
        p.start()
    barrier.wait()
    for p in procs:
        p.join()
    start_a, end_a, start_b, end_b = results[:]
    return max(end_a, end_b) - min(start_a, start_b), end_a - start_a, end_b - start_b


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="all", choices=["all", "matmul", "model"])
    parser.add_argument("--seconds", type=float, default=1.0, help="target duration of each side alone")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-processes", action="store_true",
                        help="skip the two-process comparison (same work in two processes: no shared GIL)")
    parser.add_argument("--json", help="write the figures to this JSON file")
    args = parser.parse_args(argv)

    print(f"# torch {torch.__version__}, {os.cpu_count()} CPUs, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
          f"load average before {os.getloadavg()[0]:.2f}")
    isolation = check_thread_isolation()
    print(f"# set_num_threads(1) in a worker thread: main before {isolation['main_before']}, worker "
          f"{isolation['worker']}, main after {isolation['main_after']} "
          f"-> main unchanged: {isolation['main_unchanged']}")

    results = {"isolation": isolation, "workloads": {}}
    print("\n| workload | A alone s | B alone s | serial s | 2 threads s | overlap, threads (ideal 2.0) "
          "| A / B slowdown, threads | 2 processes s | overlap, processes |")
    print("|---|---|---|---|---|---|---|---|---|")
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    saved = torch.get_num_threads()
    for name, fa, fb in workloads(args.workload):
        na, nb = calibrate(fa, args.seconds), calibrate(fb, args.seconds)
        rows = []
        for _ in range(args.repeats):
            torch.set_num_threads(1)
            ta, tb = run_n(fa, na), run_n(fb, nb)
            wall, ca, cb = concurrent(fa, na, fb, nb)
            row = {"a_alone": ta, "b_alone": tb, "serial": ta + tb, "concurrent": wall, "a_conc": ca,
                   "b_conc": cb, "overlap": (ta + tb) / wall, "a_slowdown": ca / ta, "b_slowdown": cb / tb}
            if not args.no_processes:
                pwall, _, _ = concurrent_processes(name, na, nb, ctx)
                row.update(processes=pwall, overlap_processes=(ta + tb) / pwall)
            rows.append(row)
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}

        procs = (f"{med['processes']:.2f} | {spread(rows, med, 'overlap_processes')}" if "processes" in med
                 else "- | -")
        print(f"| {name} (A {na}×, B {nb}×) | {med['a_alone']:.2f} | {med['b_alone']:.2f} | {med['serial']:.2f} "
              f"| {med['concurrent']:.2f} | {spread(rows, med, 'overlap')} "
              f"| {med['a_slowdown']:.2f} / {med['b_slowdown']:.2f} | {procs} |")
        results["workloads"][name] = {"iterations": [na, nb], "repeats": rows, "median": med}
    torch.set_num_threads(saved)
    print(f"\n# load average after {os.getloadavg()[0]:.2f}. Medians over {args.repeats} repeats [min–max].")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
        print(f"# wrote {args.json}")
    return 0 if isolation["main_unchanged"] else 1


if __name__ == "__main__":
    sys.exit(main())
