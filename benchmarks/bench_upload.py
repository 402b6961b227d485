"""Rows/s of `metriclog upload --offline` against a plain `wandb.log` loop over the same rows.

A run of 4 sources x 2,000 steps (~56k raw records) is written by metric_core's writer.
For each mode, side by side over --repeats rounds, each of the whole processes below
going first in turn, in W&B offline mode:

  metriclog   `metriclog upload RUN --offline --mode MODE --force-new` (scan, reduce and
              plan in a child process while wandb loads, then wandb.init / log per row /
              finish for each run)
  wandb.log   wandb.init / a plain loop of run.log over the very same rows (unpickled
              from a file: no reading or reducing) / finish, for each run: with W&B's default
              settings (the issue's peer), and with metriclog's REPLAY_SETTINGS (which
              leave out the uploading machine's metadata, system metrics and packages);
              the second isolates metriclog's own replay overhead

rows/s = history rows written / wall time. The ratio is taken within each round (its runs
are back to back, which cancels most of this shared machine's drift); the figure is the
median of the rounds' ratios, printed with their range. Target: metriclog >= 0.9x wandb.log.

Usage: python benchmarks/bench_upload.py [--repeats 9] [--steps 2000] [--modes global_reduce,...]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MODES = ["global_reduce", "per_rank_reduce", "per_rank_no_reduce"]

PLAIN = """
import json, os, pickle, sys, time
runs = pickle.load(open(sys.argv[1], "rb"))
settings = json.loads(sys.argv[3])
import wandb
start = time.perf_counter()
for name, x_axis, rows in runs:
    run = wandb.init(
        project="bench", name=name, dir=sys.argv[2], mode="offline", reinit="create_new", settings=settings
    )
    if x_axis:
        run.define_metric(x_axis)
        run.define_metric("*", step_metric=x_axis)
    for row in rows:
        run.log(row)
    run.finish()
print(time.perf_counter() - start)
"""


def write_run(root: Path, steps: int) -> Path:
    from metric_core import Metric, MetricCollector, Reduce

    run = root / "bench_run"
    for rank, process in enumerate(
        ["TrainActor_r0", "TrainActor_r1", "GeneratorActor_r0", "GeneratorActor_r1"]
    ):
        c = MetricCollector(run, rank=rank % 2, process_name=process, flush_interval=3600)
        for step in range(steps):
            t = 1.76e9 + step * 2.0 + rank * 0.01
            for i, (key, red) in enumerate(
                [
                    ("loss", Reduce.MEAN),
                    ("grad_norm", Reduce.MAX),
                    ("tokens", Reduce.SUM),
                    ("latency_s", Reduce.STD),
                ]
            ):
                for j in range(1 + (i == 3) * 3):
                    c.push(
                        Metric(f"{process[:5].lower()}/{key}", float(step + j), red, t + 0.1 * i + 0.01 * j)
                    )
            c.flush(step)
        c.shutdown()
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    from bench_reduce import compile_sources

    from metric_core import scan_run
    from metric_core.offline.engine import execute
    from metric_core.offline.plan import make_plan
    from metric_core.offline.upload.runs import plan_runs
    from metric_core.offline.upload.send import REPLAY_SETTINGS

    compile_sources()
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off"}
    metriclog = str(Path(sys.executable).with_name("metriclog"))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run = write_run(root, args.steps)
        for mode in args.modes.split(","):
            plan = plan_runs(execute(make_plan(mode=mode), scan_run(run)), name="bench_run")
            rows = sum(r.rows for r in plan.runs)
            dump = root / f"{mode}.pkl"
            pickle.dump([(r.name, r.x_axis, list(r.history())) for r in plan.runs], dump.open("wb"))
            plain = [sys.executable, "-c", PLAIN, str(dump), str(root / "plain")]
            commands = {
                "metriclog": [
                    metriclog,
                    "upload",
                    str(run),
                    "--project",
                    "bench",
                    "--offline",
                    "--force-new",
                    "--mode",
                    mode,
                ],
                "wandb.log": [*plain, "{}"],
                "same settings": [*plain, json.dumps(REPLAY_SETTINGS)],
            }
            times: dict[str, list[float]] = {name: [] for name in commands}
            for i in range(args.repeats):
                names = list(commands)
                for name in names[i % 3 :] + names[: i % 3]:  # each goes first in turn
                    start = time.perf_counter()
                    subprocess.run(commands[name], env=env, check=True, capture_output=True)
                    times[name].append(time.perf_counter() - start)
            # each repeat's three runs are back to back: the ratio within a repeat cancels
            # most of the machine's drift; the median of those ratios is the figure
            ratios = {
                peer: sorted(p / o for p, o in zip(times[peer], times["metriclog"], strict=True))
                for peer in ("wandb.log", "same settings")
            }
            results[mode] = (
                rows,
                len(plan.runs),
                {n: statistics.median(t) for n, t in times.items()},
                ratios,
            )
            print(json.dumps({mode: results[mode]}), file=sys.stderr)
    print(f"W&B offline mode; repeats: {args.repeats}; wall time of whole processes")
    print("rows/s: medians; ratio: the median of the repeats' ratios, then their range")
    print(
        f"{'mode':<20}{'runs':>5}{'rows':>9}{'metriclog rows/s':>18}{'wandb.log rows/s':>18}"
        f"{'ratio':>20}{'same settings':>15}{'ratio':>20}"
    )
    for mode, (rows, runs, median, ratios) in results.items():
        cells = [
            f"{rows / median[peer]:>{width},.0f}"
            + f"{statistics.median(ratios[peer]):>8.2f}x ({ratios[peer][0]:.2f}-{ratios[peer][-1]:.2f})"
            for peer, width in (("wandb.log", 18), ("same settings", 15))
        ]
        print(f"{mode:<20}{runs:>5}{rows:>9,}{rows / median['metriclog']:>18,.0f}" + "".join(cells))
    print("target: ratio >= 0.90x (replay overhead <= 10%)")


if __name__ == "__main__":
    main()
