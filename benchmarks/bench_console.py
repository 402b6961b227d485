"""The global steps on rank 0's console (a torchforge `console` backend in `global_reduce`
mode): how long after the last rank's flush of a step its block is printed.

A job of N torchforge rank processes (`metric_core.torchforge`), each recording 20 keys at
--steps-per-s steps a second for --seconds, `flush_interval` 1 s (the default). Each rank
notes when each `flush(step)` returned; this script reads rank 0's stderr as it comes and
notes when each step's `=== [global_reduce] - METRICS STEP k ===` line arrived.

  lag    per step: the arrival of its block minus the latest return of a rank's flush of
         it, in seconds and in flush intervals. Median, p99 and max over the steps.
         Target: every step within one flush interval.
  cpu    the printer's CPU (user + system) per 1,000 records, read from /proc before it ends.

Usage: python benchmarks/bench_console.py [--ranks 2,4,8] [--seconds 15] [--steps-per-s 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KEYS = 20

RANK = """
import asyncio, json, os, sys, time
from metric_core.torchforge import Reduce, get_or_create_metric_logger, record_metric
c = json.loads(sys.argv[1])
rank = int(os.environ["RANK"])

async def main():
    mlogger = await get_or_create_metric_logger(process_name="trainer")
    await mlogger.init_backends.call_one({"console": {"logging_mode": "global_reduce"}})
    while not os.path.exists(c["go"]):
        time.sleep(0.01)
    flushed, period = [], 1.0 / c["rate"]
    begin = time.monotonic()
    for step in range(int(c["seconds"] * c["rate"])):
        for k in range(c["keys"]):
            record_metric(f"key{k}", float(step + k + rank), Reduce.MEAN)
        await mlogger.flush.call_one(step)
        flushed.append(time.time())
        time.sleep(max(0.0, begin + (step + 1) * period - time.monotonic()))
    with open(f"{c['out']}/flushed-{rank}.json", "w") as f:
        json.dump(flushed, f)
    await mlogger.shutdown.call_one()

asyncio.run(main())
"""


def job(ranks: int, seconds: float, rate: float) -> tuple[list[float], float | None, int]:
    """Each step's lag, the printer's CPU seconds (None: not read), and the records."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        go = out / "go"
        config = {"seconds": seconds, "rate": rate, "keys": KEYS, "out": tmp, "go": str(go)}
        env = {
            **os.environ,
            "METRICLOG_DIR": str(out / "run"),
            "WORLD_SIZE": str(ranks),
            "PYTHONPATH": str(REPO),
        }
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", RANK, json.dumps(config)],
                env={**env, "RANK": str(r)},
                stderr=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                text=True,
                cwd=tmp,
            )
            for r in range(ranks)
        ]
        arrived: dict[int, float] = {}
        cpu: list[float] = []

        def read() -> None:
            assert procs[0].stderr is not None
            for line in procs[0].stderr:
                if "- METRICS STEP " in line:
                    arrived[int(line.split("- METRICS STEP ")[1].split()[0])] = time.time()
                    now = printer_cpu(procs[0].pid)
                    cpu[:] = [now] if now is not None else cpu

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        time.sleep(3.0)  # the printer imports polars; the ranks wait at "go" meanwhile
        go.touch()
        for p in procs:
            p.wait(timeout=seconds * 10 + 300)
        reader.join(timeout=60)
        lags = []
        flushed = [json.loads((out / f"flushed-{r}.json").read_text()) for r in range(ranks)]
        for step in range(len(flushed[0])):
            last = max(f[step] for f in flushed)
            if step in arrived:
                lags.append(arrived[step] - last)
        return lags, (cpu[0] if cpu else None), ranks * len(flushed[0]) * KEYS


def printer_cpu(rank0: int) -> float | None:
    """The CPU seconds of rank 0's printer child (from /proc), while it runs."""
    try:
        children = Path(f"/proc/{rank0}/task/{rank0}/children").read_text().split()
        for pid in children:
            if "metric_core.offline.console" in Path(f"/proc/{pid}/cmdline").read_text():
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return None
    return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", default="2,4,8")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--steps-per-s", type=float, default=10.0)
    args = parser.parse_args()
    print(
        f"{'ranks':>5} {'steps':>6} {'median lag':>11} {'p99 lag':>9} {'max lag':>9} {'printed':>8} "
        f"{'cpu/1k rec':>11}"
    )
    for ranks in [int(r) for r in args.ranks.split(",")]:
        lags, cpu, records = job(ranks, args.seconds, args.steps_per_s)
        steps = int(args.seconds * args.steps_per_s)
        ordered = sorted(lags)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan")
        per_k = f"{cpu / records * 1000 * 1000:.1f} ms" if cpu is not None else "?"
        print(
            f"{ranks:>5} {steps:>6} {statistics.median(lags) if lags else float('nan'):>9.3f} s "
            f"{p99:>7.3f} s {max(lags, default=float('nan')):>7.3f} s {len(lags):>8} {per_k:>11}"
        )
    print(
        "lag: from the last rank's flush(step) returning to the step's block on rank 0's console; "
        "flush interval 1 s (the target: every step within it)"
    )


if __name__ == "__main__":
    main()
