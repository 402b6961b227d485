"""--engine ray against --engine local on one machine (issue 16): Ray's overhead.

The same `metriclog reduce RUN --out result.parquet` (global_reduce, and per_rank_reduce
with p99), each a whole process, --repeats rounds interleaved, medians; the two engines'
output files are compared byte for byte. Runs (in --dir, made once): another tool's
Parquet (bench_engine.py's foreign_20M: 32 files, 50 keys, 20M rows), and the writer's own
(bench_reduce.py's parquet_20M).

`--engine ray` starts a local Ray (2 CPUs here) inside each command: its start-up is
part of the figure, and printed apart (a bare `ray.init()` + `ray.shutdown()`). Also
printed: the task count and the records a task holds, what a projection to more nodes
starts from.

`--footprint` prints instead what one task costs a worker (CPU seconds, memory), from
its first 16 tasks run one after another in a fresh process.

Usage: python benchmarks/bench_ray.py [--repeats 3] [--dir bench_out] [--sizes 20M] [--footprint]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_engine import foreign_run
from bench_reduce import generate, timed

METRICLOG = str(Path(sys.executable).with_name("metriclog"))
STARTUP = "import ray, time; t = time.perf_counter(); ray.init(include_dashboard=False); ray.shutdown()"


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tasks_of(run: Path) -> tuple[int, float]:
    from metric_core import make_plan, scan_run
    from metric_core.offline import engine

    scan = scan_run(run, defer_checks=True)
    dictionaries = engine.tasks.reads_dictionaries(scan)
    found = engine.tasks.cut(make_plan(), scan, scan.file_ids, None, dictionaries)
    return len(found), scan.report.records / max(1, len(found))


# One task after another in a fresh process, as a Ray worker runs them: CPU seconds a task
# (all threads) and what the process grew by, what a projection to N nodes starts from.
TASK_CHILD = """
import resource, sys, time
from metric_core import make_plan, scan_run
from metric_core.offline import engine
from metric_core.offline import filters
plan = make_plan(mode=sys.argv[2], reduce=sys.argv[3:])
scan = scan_run(sys.argv[1])
scan = scan.for_other_processes()
dictionaries = engine.tasks.reads_dictionaries(scan)
found = engine.tasks.cut(plan, scan, scan.file_ids, None, dictionaries)[:16]
kept = engine.tasks.columns_read(plan, scan)
work = engine.tasks.TaskWork(plan, scan, dictionaries, kept, None, engine.tasks.PARTITION_ROWS)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
cpu = time.process_time()
records = sum(t.size for t in found)
for task in found:
    for _ in work(task, filters.Seen.wanted_by(plan)):
        pass
spent = time.process_time() - cpu
grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
print(len(found), spent / len(found), grown, base / 1024)
"""


# What the driver itself spends per task with --engine ray (its own CPU: submitting,
# receiving and folding the partial states), the part that does not spread over nodes.
DRIVER_CHILD = """
import sys, time, ray
from metric_core import reduce_run
ray.init(include_dashboard=False, log_to_driver=False)
reduce_run(sys.argv[1], engine="ray", mode=sys.argv[2], reduce=sys.argv[3:])  # warm the workers
cpu, wall = time.process_time(), time.perf_counter()
reduce_run(sys.argv[1], engine="ray", mode=sys.argv[2], reduce=sys.argv[3:])
print(time.process_time() - cpu, time.perf_counter() - wall)
"""


def task_footprint(run: Path, mode: str, extra: list[str]) -> str:
    """CPU seconds per task and the growth of a worker's peak RSS over its first 16 tasks."""
    reduce = extra[1:] if extra else []
    args = [str(run), mode, *reduce]

    def child(code: str) -> list[str]:
        return subprocess.run(
            [sys.executable, "-c", code, *args], capture_output=True, text=True, check=True
        ).stdout.split()

    count, per_task, grown, base = child(TASK_CHILD)
    driver = child(DRIVER_CHILD)
    driver_cpu, driver_wall = (float(x) for x in driver[-2:])
    return (
        f"a task: {float(per_task):.3f} CPU s; a worker's peak RSS {float(base):.0f} MiB "
        f"(run read) + {float(grown):.0f} MiB over {count} tasks; with --engine ray the driver's own "
        f"CPU {driver_cpu:.2f} s of {driver_wall:.2f} s wall"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="bench_out")
    parser.add_argument("--sizes", default="20M")
    parser.add_argument("--footprint", action="store_true", help="only a task's CPU time and memory")
    args = parser.parse_args()
    root = Path(args.dir)
    root.mkdir(exist_ok=True)
    runs = []
    for size in args.sizes.split(","):
        rows = int(size.rstrip("M")) * 1_000_000
        runs.append((f"foreign_{size}", foreign_run(root, rows)))
        if size in ("20M", "100M"):
            runs.append((f"own_{size}", generate(root, size)))
    if args.footprint:
        for name, run in runs:
            for mode, extra in (("global_reduce", []), ("per_rank_reduce", ["--reduce", "*=p99"])):
                count, per_task = tasks_of(run)
                said = task_footprint(run, mode, extra)
                print(f"{name:<14} {mode:<16} {count} tasks of {per_task:,.0f} records; {said}")
        return
    startup = statistics.median(timed([sys.executable, "-c", STARTUP])[0] for _ in range(args.repeats))
    print(f"a local Ray's start and stop alone: {startup:.2f} s (median of {args.repeats})")
    head = f"{'run':<14} {'mode':<16} {'tasks':>6} {'rec/task':>9} {'local s':>8} {'ray s':>7}"
    print(f"{head} {'ray/local':>10} same")
    for name, run in runs:
        count, per_task = tasks_of(run)
        for mode, extra in (("global_reduce", []), ("per_rank_reduce", ["--reduce", "*=p99"])):
            walls: dict[str, list[float]] = {"local": [], "ray": []}
            outs = {}
            for _ in range(args.repeats):
                for engine in ("local", "ray"):
                    out = root / f"ray-bench-{engine}.parquet"
                    cmd = [METRICLOG, "reduce", str(run), "--mode", mode, *extra, "--engine", engine]
                    start = time.perf_counter()
                    timed([*cmd, "--out", str(out)])
                    walls[engine].append(time.perf_counter() - start)
                    outs[engine] = digest(out)
            local, ray = statistics.median(walls["local"]), statistics.median(walls["ray"])
            same = "yes" if outs["local"] == outs["ray"] else "NO"
            print(
                f"{name:<14} {mode:<16} {count:>6} {per_task:>9,.0f} {local:>8.2f} {ray:>7.2f} "
                f"{ray / local:>9.2f}x {same}"
            )


if __name__ == "__main__":
    main()
