"""Peak memory on inputs of a hostile shape (issue 31): reduce in every mode and inspect,
each in its own process, against the 1.5 GiB target.

Inputs (in --dir, made once, by pyarrow: another tool's files):

  keys_10M     one Parquet file of 10M records, each of its own key (one step, one source)
  rows_50M     one Parquet file of 50M records of one source (10 keys, 5M steps)
  line_200MB   one JSON line of 200 MB (a string value), beside a good record

Peak RSS is the command's (GNU time's maximum resident set). The target is on what a
command holds beyond the result itself: "result" is the size of the output file's rows
as one polars frame (what any tool holding the result would hold; none for inspect), and
"beyond" is the peak minus it. A command that fails is shown with its exit status and its
last line of stderr: running out of memory is a result here, not an error of the script.

Usage: python benchmarks/bench_memory.py [--dir bench_out/memory] [--only keys_10M,rows_50M,line_200MB]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

LIMIT_MIB = 1536
CAP_MIB = 12 * 1024
COMMANDS = {
    "global_reduce": ["reduce", "{run}", "--out", "{out}.parquet"],
    "per_rank_reduce": ["reduce", "{run}", "--mode", "per_rank_reduce", "--out", "{out}.parquet"],
    "per_rank_no_reduce": ["reduce", "{run}", "--mode", "per_rank_no_reduce", "--out", "{out}.parquet"],
    "p99": ["reduce", "{run}", "--reduce", "*=p99", "--out", "{out}.parquet"],
    "inspect": ["inspect", "{run}", "--json"],
}


def _table(keys: np.ndarray, steps: np.ndarray) -> object:
    import pyarrow as pa

    n = len(keys)
    rng = np.random.default_rng(0)
    return pa.table(
        {
            "key": pa.array(keys),
            "value": pa.array(rng.normal(size=n)),
            "reduction": pa.array(["mean"] * 1).take(pa.array(np.zeros(n, dtype=np.int32))),
            "step": pa.array(steps),
            "timestamp": pa.array(1.76e9 + steps.astype(np.float64) * 0.01),
            "rank": pa.array(np.zeros(n, dtype=np.int64)),
        }
    )


def make(root: Path, name: str) -> Path:
    import pyarrow.parquet as pq

    run = root / name
    done = run / ".complete"
    if done.exists():
        return run
    run.mkdir(parents=True, exist_ok=True)
    if name == "keys_10M":
        n = 10_000_000
        keys = np.char.add("key/", np.arange(n).astype("U8"))
        pq.write_table(_table(keys, np.zeros(n, dtype=np.int64)), run / "keys.parquet")
    elif name == "rows_50M":
        with pq.ParquetWriter(
            run / "rows.parquet", _table(np.array(["k0"]), np.zeros(1, np.int64)).schema
        ) as w:
            for part in range(50):  # 1M records a part
                steps = np.repeat(np.arange(part * 100_000, (part + 1) * 100_000, dtype=np.int64), 10)
                keys = np.tile(np.array([f"k{i}" for i in range(10)]), 100_000)
                w.write_table(_table(keys, steps))
    else:
        with open(run / "big.jsonl", "w") as f:
            f.write('{"key":"k","value":1.0,"reduction":"mean","step":0,"timestamp":1.76e9,"rank":0}\n')
            f.write('{"key":"k","value":"' + "9" * 200_000_000 + '","reduction":"mean","step":1,')
            f.write('"timestamp":1.76e9,"rank":0}\n')
    done.touch()
    return run


def measure(run: Path, command: list[str], out: Path) -> tuple[float, float, float, int, str]:
    metriclog = str(Path(sys.executable).with_name("metriclog"))
    args = [a.format(run=run, out=out) for a in command]
    start = time.perf_counter()
    # An address-space cap well above the target, so a command that would take the machine's
    # memory fails here instead (it shows as a failure with the peak it reached).
    cap = f'ulimit -v {CAP_MIB * 1024}; exec /usr/bin/time -f RSS_KB=%M "$@"'
    proc = subprocess.run(["bash", "-c", cap, "bash", metriclog, *args], capture_output=True, text=True)
    wall = time.perf_counter() - start
    rss = int(proc.stderr.rsplit("RSS_KB=", 1)[1].split()[0]) / 1024
    last = [line for line in proc.stderr.splitlines() if line and not line.startswith("RSS_KB=")]
    result = 0.0
    for path in out.parent.glob(out.name + "*"):
        if proc.returncode == 0:
            import polars as pl

            result = pl.read_parquet(path).estimated_size() / 2**20
        path.unlink()
    return wall, rss, result, proc.returncode, (last[-1][:60] if last else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("bench_out") / "memory")
    parser.add_argument("--only", default="keys_10M,rows_50M,line_200MB")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    print(f"peak RSS of each command; the target: at most {LIMIT_MIB} MiB beyond the result")
    print(f"{'input':<12}{'command':<20}{'wall s':>8}{'peak MiB':>10}{'result':>8}{'beyond':>8}  exit  note")
    for name in args.only.split(","):
        run = make(args.dir, name)
        commands = {"inspect": COMMANDS["inspect"], "global_reduce": COMMANDS["global_reduce"]}
        if name != "line_200MB":
            commands = COMMANDS
        for label, command in commands.items():
            wall, rss, result, code, note = measure(run, command, args.dir / f"out-{name}-{label}")
            verdict = "" if code == 0 and rss - result <= LIMIT_MIB else "  OVER"
            print(
                f"{name:<12}{label:<20}{wall:>8.1f}{rss:>10.0f}{result:>8.0f}{max(rss - result, 0):>8.0f}"
                f"  {code:>4}  {note}{verdict}",
                flush=True,
            )


if __name__ == "__main__":
    main()
