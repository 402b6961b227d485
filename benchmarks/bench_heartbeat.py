"""What saying where the rank is costs (issue 43): the writer thread's look at the main
thread at each heartbeat, and what a training step pays for it.

  per heartbeat   the writer thread's work at one wake beyond the plain heartbeat it wrote
                  before: ``where.main_place()`` (``sys._current_frames()`` and a walk to
                  the caller's own frame) with the main thread 40 frames deep in a library,
                  and the W frame built; and ``where.all_places()`` (every thread, once a
                  silence) with 8 threads. Medians of --reps calls, timed in a thread
                  beside a busy main thread, as the writer thread is.
  per step        a job's steps (20 keys recorded and ``flush(step)`` a step, flush_interval
                  0.01 s: a hundred heartbeats a second, a hundred times the default, so the
                  cost shows above noise) with the places said, against the same job with
                  the writer told no place (``where.main_place`` returning None: the H frames
                  of before). Two jobs: fast steps (--steps of them, no work: every wake sees
                  a flush, so no look is taken), and slow steps (--slow-steps of about 30 ms
                  of Python work each: the writer looks at the main thread at every wake
                  within a step, taking the GIL from it). Each variant in its own process,
                  side by side, --runs times; the medians' difference per step, and per look.

Usage: python benchmarks/bench_heartbeat.py [--reps 20000] [--steps 20000] [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time

JOB = """
import sys, tempfile, time
import metric_core
from metric_core.writer import where
if sys.argv[1] == "off":
    where.main_place = lambda: None
steps, work = int(sys.argv[2]), int(sys.argv[3])

def compute(n):  # a step's work in Python, holding the GIL as a training step's Python does
    total = 0
    for i in range(n):
        total += i * i
    return total

with tempfile.TemporaryDirectory() as run:
    metric_core.init(run, process_name="r0", rank=0, flush_interval=0.01, hang_dump_after=0)
    keys = [f"train/key_{i}" for i in range(20)]
    start = time.perf_counter()
    for step in range(steps):
        compute(work)
        for k in keys:
            metric_core.record_metric(k, step * 0.5)
        metric_core.flush(step)
    took = time.perf_counter() - start
    metric_core.shutdown()
print(took)
"""


def _deep(n: int, then) -> None:
    """A main thread ``n`` frames deep in library code: json's encoder, called recursively."""
    import json

    class Deep:
        pass

    def default(_):
        then()
        return

    nested: object = Deep()
    for _ in range(n):
        nested = [nested]
    json.dumps(nested, default=default)


def per_heartbeat(reps: int) -> None:
    from metric_core.format import journal
    from metric_core.writer import where

    ready, done = threading.Event(), threading.Event()
    idle = [threading.Thread(target=done.wait, daemon=True) for _ in range(7)]
    for t in idle:
        t.start()
    timings: dict[str, list[float]] = {"main_place + W frame": [], "all_places (8 threads)": []}

    def measure() -> None:
        ready.wait()
        for _ in range(reps):
            t0 = time.perf_counter_ns()
            place = where.main_place()
            assert place is not None
            journal.where_frame(time.time(), place, None)
            t1 = time.perf_counter_ns()
            where.all_places()
            t2 = time.perf_counter_ns()
            timings["main_place + W frame"].append(t1 - t0)
            timings["all_places (8 threads)"].append(t2 - t1)
        done.set()

    probe = threading.Thread(target=measure)
    probe.start()

    def spin() -> None:
        ready.set()
        while not done.is_set():
            sum(range(200))

    _deep(40, spin)
    probe.join()
    for name, ns in timings.items():
        print(f"  {name:<26} {statistics.median(ns) / 1000:8.1f} us a call (median of {reps})")


def per_step(steps: int, runs: int, work: int = 0) -> None:
    took: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(runs):
        for variant in ("on", "off"):
            argv = [sys.executable, "-c", JOB, variant, str(steps), str(work)]
            out = subprocess.run(argv, capture_output=True, text=True, check=True)
            took[variant].append(float(out.stdout.strip()))
    on, off = statistics.median(took["on"]), statistics.median(took["off"])
    beats = max(off * 100 if work else 0.0, 1.0)  # looks: a wake each 10 ms within slow steps
    print(
        f"  places said    {on / steps * 1e6:8.2f} us a step  "
        f"(median of {runs}: {on:.2f} s for {steps} steps)"
    )
    print(f"  no place (H)   {off / steps * 1e6:8.2f} us a step  ({off:.2f} s)")
    per_look = f", {(on - off) / beats * 1e6:.1f} us a look" if work else " (no look taken)"
    print(f"  difference     {(on - off) / steps * 1e6:8.2f} us a step{per_look}; ratio {on / off:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=20000)
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--slow-steps", type=int, default=300)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print("per heartbeat (the writer thread's work):")
    per_heartbeat(args.reps)
    print("per step of a job of fast steps (20 keys a step, flush every step, heartbeats every 10 ms):")
    per_step(args.steps, args.runs)
    print("per step of a job of slow steps (about 30 ms of Python work each, the same otherwise):")
    per_step(args.slow_steps, args.runs, work=1_000_000)


if __name__ == "__main__":
    main()
