"""``metriclog compare``'s cost over reducing the runs, against polars' float statistics.

Data: --runs runs (each one source, --steps steps of --keys keys, one value a step and
key: what each run's reduction holds), written by the writer into a temporary directory.

Each round, side by side (medians of --repeats rounds, wall seconds):

  reduce       ``reduce_run`` of every run, one after another (what compare reads first)
  compare      ``compare_runs`` over them, every statistic (the reductions included)
  across       ``across_runs`` alone over the runs' reductions: every statistic, exact
  across_fast  the same without std_sample and stderr (the statistics finished in Python
               integers, a cell at a time)
  polars       polars' group_by over the same rows: mean, std (ddof 0 and 1), min, max,
               median, count in float64 (not correctly rounded; the peer)

Usage: python benchmarks/bench_compare.py [--runs 8] [--steps 2000] [--keys 20] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl

from metric_core import Metric, MetricCollector, Reduce
from metric_core.offline.compare import ACROSS, across_runs, compare_runs, group_rows, reduce_runs
from metric_core.offline.engine import reduce_run
from metric_core.offline.plan import make_plan


def write(root: Path, runs: int, steps: int, keys: int) -> list[Path]:
    rng = np.random.default_rng(0)
    out = []
    for r in range(runs):
        run = root / f"seed{r}"
        c = MetricCollector(run, rank=0, process_name="trainer")
        for step in range(steps):
            for k, value in enumerate(rng.normal(1.0, 0.1, keys).tolist()):
                c.push(Metric(f"k{k:03d}", value, Reduce.MEAN, 1_760_000_000.0 + step))
            c.flush(step)
        c.shutdown()
        out.append(run)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--keys", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = write(Path(tmp), args.runs, args.steps, args.keys)
        rows, _, _ = group_rows(reduce_runs(runs, make_plan()), None)
        cells = ["group", "step", "key"]
        fast = [s for s in ACROSS if s not in ("std_sample", "stderr")]
        v = pl.col("value")
        ways = {
            "reduce": lambda: [reduce_run(r) for r in runs],
            "compare": lambda: compare_runs(runs),
            "across": lambda: across_runs(rows, cells, ACROSS),
            "across_fast": lambda: across_runs(rows, cells, fast),
            "polars": lambda: rows.group_by(cells).agg(
                v.mean(),
                v.std(ddof=0).alias("std"),
                v.std(ddof=1).alias("std_sample"),
                v.min().alias("min"),
                v.max().alias("max"),
                v.median().alias("median"),
                pl.len(),
            ),
        }
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.repeats):
            for name, way in ways.items():
                t0 = time.perf_counter()
                way()
                times[name].append(time.perf_counter() - t0)
    n_cells = args.steps * args.keys
    print(
        f"{args.runs} runs x {args.steps} steps x {args.keys} keys ({n_cells:,} cells), "
        f"medians of {args.repeats}"
    )
    med = {name: statistics.median(t) for name, t in times.items()}
    for name, t in med.items():
        print(
            f"  {name:12s} {t:8.3f} s  {t / med['polars']:7.1f} x polars  {1e6 * t / n_cells:8.2f} us a cell"
        )
    print(f"  compare over reduce alone: {med['compare'] / med['reduce']:.2f} x")


if __name__ == "__main__":
    main()
