"""Two installs of metriclog side by side: the same commands on the same runs, interleaved.

For a change that should not change speed (a restructure), run the install before it and
the install after it over the same files, round after round (medians of --repeats), and
print each command's wall time, CPU seconds and peak RSS, and the ratio after/before.
The outputs of the two are compared too: the same rows, and the values to the bit (or,
with --close, to a relative 1e-12, for a change that moved the last bits on purpose).

Make the "before" install from a commit of the repository:

  git worktree add /tmp/before COMMIT && python3 -m venv /tmp/before/.venv
  /tmp/before/.venv/bin/pip install -e /tmp/before

Usage: python benchmarks/bench_versions.py --before /tmp/before/.venv/bin/metriclog
       --runs RUN[,RUN...] [--after .venv/bin/metriclog] [--repeats 5] [--close]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_reduce import cpu_timed

COMMANDS = {  # name: arguments after the run directory
    "reduce global_reduce": ["reduce", "--mode", "global_reduce"],
    "reduce per_rank_reduce": ["reduce", "--mode", "per_rank_reduce"],
    "reduce per_rank_no_reduce": ["reduce", "--mode", "per_rank_no_reduce"],
    "reduce *=p99": ["reduce", "--reduce", "*=p99"],
    "reduce --by time": ["reduce", "--by", "time", "--every", "30s"],
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--before", required=True, help="the metriclog command of the install before")
    parser.add_argument("--after", default=str(Path(sys.executable).with_name("metriclog")))
    parser.add_argument("--runs", required=True, help="run directories, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--commands", default=",".join(COMMANDS), help="of: " + ", ".join(COMMANDS))
    parser.add_argument("--close", action="store_true", help="values equal to a relative 1e-12, not the bit")
    args = parser.parse_args()
    installs = {"before": args.before, "after": args.after}
    print(f"{'run':<24} {'command':<28} {'before s':>9} {'after s':>9} {'ratio':>6} "
          f"{'CPU before':>10} {'CPU after':>10} {'RSS before':>10} {'RSS after':>10}  output")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-versions-") as tmp:
        for run in args.runs.split(","):
            for name in args.commands.split(","):
                figures: dict[str, list[tuple[float, float, float]]] = {"before": [], "after": []}
                outs = {which: Path(tmp) / f"{which}.parquet" for which in installs}
                for _ in range(args.repeats):
                    for which, command in installs.items():  # interleaved: the machine's noise is shared
                        outs[which].unlink(missing_ok=True)
                        cmd = [
                            command,
                            COMMANDS[name][0],
                            run,
                            *COMMANDS[name][1:],
                            "--out",
                            str(outs[which]),
                        ]
                        figures[which].append(cpu_timed(cmd))
                wall = {w: statistics.median(f[0] for f in figures[w]) for w in installs}
                rss = {w: statistics.median(f[1] for f in figures[w]) for w in installs}
                cpu = {w: statistics.median(f[2] for f in figures[w]) for w in installs}
                same = compare(outs["before"], outs["after"], args.close)
                print(
                    f"{Path(run).name:<24} {name:<28} {wall['before']:>9.2f} {wall['after']:>9.2f} "
                    f"{wall['after'] / wall['before']:>6.2f} {cpu['before']:>10.2f} {cpu['after']:>10.2f} "
                    f"{rss['before']:>9.0f}M {rss['after']:>9.0f}M  {same}",
                    flush=True,
                )


def compare(before: Path, after: Path, close: bool) -> str:
    a, b = pl.read_parquet(before), pl.read_parquet(after)
    if a.columns != b.columns or a.height != b.height:
        return f"DIFFERENT shape: {a.shape} vs {b.shape}"
    keys = [c for c in a.columns if c != "value"]
    if not a.select(keys).equals(b.select(keys)):
        return "DIFFERENT rows"
    va, vb = a["value"].to_numpy(), b["value"].to_numpy()
    if va.tobytes() == vb.tobytes():
        return "same bits"
    differ = int((va.view(np.int64) != vb.view(np.int64)).sum())
    if close and np.allclose(va, vb, rtol=1e-12, atol=0.0, equal_nan=True):
        return f"{differ:,} value(s) differ in their last bits (within 1e-12)"
    return f"DIFFERENT: {differ:,} value(s)"


if __name__ == "__main__":
    main()
