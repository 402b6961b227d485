"""`metriclog inspect` against `metriclog reduce` on the 20M-row benchmark run.

Both as whole processes, interleaved over --repeats rounds (medians). The run is the
parquet_20M run of bench_reduce.py (generated if missing). Target: inspect <= 1.5x reduce.

Usage: python benchmarks/bench_inspect.py [--repeats 3] [--dir bench_out]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_reduce import compile_sources, generate


def wall(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("bench_out"))
    args = parser.parse_args()
    args.dir.mkdir(exist_ok=True)
    compile_sources()
    run = generate(args.dir, "20M")
    metriclog = str(Path(sys.executable).with_name("metriclog"))
    inspect, reduce = [], []
    for _ in range(args.repeats):
        inspect.append(wall([metriclog, "inspect", str(run), "--json"]))
        reduce.append(wall([metriclog, "reduce", str(run), "--out", str(args.dir / "inspect_bench.parquet")]))
    i, r = statistics.median(inspect), statistics.median(reduce)
    print(f"run: {run} (20,000,000 rows); repeats: {args.repeats}; medians; whole processes")
    print(f"metriclog inspect  {i:6.2f} s")
    print(f"metriclog reduce   {r:6.2f} s")
    print(f"inspect / reduce = {i / r:.2f}x (target <= 1.5x)")


if __name__ == "__main__":
    main()
