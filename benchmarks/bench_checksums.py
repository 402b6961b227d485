"""What verifying checksums costs the reader (issue 31): the same files, read by metric_core
now and by metric_core at a git revision before checksums (--baseline), side by side.

Runs (in --dir, made once, by the writer of today: page checksums and JSONL block lines):

  parquet_20M   benchmarks/bench_reduce.py's 20M-record run (32 sources, 10 keys)
  jsonl_2M      bench_reduce.py's JSONL run (8 sources, 2M records)

Each command runs in its own process, the two versions interleaved over --repeats rounds
(medians, and the median of each round's ratio): the reduction of every mode read to the
end (``run_plan(...).batches()``, nothing written), and ``inspect_run``. The baseline reads
the same files without verifying anything (it knows no checksum), so the ratio is what
verification costs. The writer's side is measured by ``bench_record.py --baseline REV``.
Any other revision compares the reader then and now the same way (e.g. ``--baseline
be33adb``: before the engine's accumulator held groups sparsely, for many keys).

Usage: python benchmarks/bench_checksums.py [--baseline b9938ca] [--repeats 5] [--dir bench_out]
                                           [--commands global_reduce,inspect] [--runs parquet_20M]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_record import export_baseline
from bench_reduce import compile_sources, generate

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ["global_reduce", "per_rank_reduce", "per_rank_no_reduce", "inspect"]

CHILD = textwrap.dedent(
    """
    import json, sys, time
    run, command = sys.argv[1], sys.argv[2]
    start = time.perf_counter()
    if command == "inspect":
        from metric_core.offline.inspect import inspect_run
        inspect_run(run)
        rows = 0
    else:
        from metric_core.offline.engine import make_plan, run_plan
        rows = sum(f.height for f in run_plan(run, make_plan(mode=command)).batches())
    print(json.dumps({"wall": time.perf_counter() - start, "rows": rows}))
    """
)


def measure(run: Path, command: str, code: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(run), command], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="b9938ca", metavar="REV", help="metric_core before checksums")
    parser.add_argument("--commands", default=",".join(COMMANDS), help="of: " + ", ".join(COMMANDS))
    parser.add_argument("--runs", default="parquet_20M,jsonl_2M")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path("bench_out") / "checksums")
    args = parser.parse_args()
    compile_sources()
    args.dir.mkdir(parents=True, exist_ok=True)
    made = {"parquet_20M": "20M", "jsonl_2M": "jsonl"}
    runs = {name: generate(args.dir, made[name]) for name in args.runs.split(",")}
    scratch = Path(tempfile.mkdtemp(prefix="metriclog-baseline-"))
    atexit.register(shutil.rmtree, scratch, True)
    baseline = export_baseline(args.baseline, scratch)
    print(f"reading the same files: now against {args.baseline}; {args.repeats} interleaved rounds, medians")
    print(f"{'run':<13}{'command':<20}{'now s':>8}{'before s':>10}{'ratio':>8}{'paired':>8}  rows")
    for name, run in runs.items():
        for command in args.commands.split(","):
            now, before, pairs = [], [], []
            for _ in range(args.repeats):
                a, b = measure(run, command, ROOT), measure(run, command, baseline)
                if a["rows"] != b["rows"]:
                    raise SystemExit(f"{name} {command}: {a['rows']} rows now, {b['rows']} before")
                now.append(a["wall"])
                before.append(b["wall"])
                pairs.append(a["wall"] / b["wall"])
            n, b = statistics.median(now), statistics.median(before)
            print(
                f"{name:<13}{command:<20}{n:>8.2f}{b:>10.2f}{n / b:>7.3f}x{statistics.median(pairs):>7.3f}x"
                f"  {a['rows']:,}"
            )
    print("target: <= 1.05x")


if __name__ == "__main__":
    main()
