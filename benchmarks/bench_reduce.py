"""`metriclog reduce --mode global_reduce` against DuckDB and the seed's Python replay.

Synthetic runs written by metric_core's own writer (RawFileWriter: journal, then sealed
Parquet or JSONL segments of 1M records), 10 keys (two of each reduction):

  run              ranks x rows/rank   steps    output groups
  parquet_2M       32 x 62.5k          1,250    12,500     growth: same run length,
  parquet_20M      32 x 625k           1,250    12,500     more values per step
  parquet_100M     32 x 3.125M         1,250    12,500
  parquet_20M_g    32 x 625k           12,500   125,000    ten times the groups
  jsonl_2M         8 x 250k            1,250    12,500

For each run, side by side and interleaved over --repeats rounds (medians):

  metriclog  `metriclog reduce RUN --mode global_reduce --out OUT.parquet`, a whole process
  duckdb     a Python process running DuckDB (2 threads) on the same files, computing the
             same reduction (each key by its recorded reduction, count) and writing the
             same Parquet, sorted the same way
  replay     the seed's approach: rows replayed through per-key accumulators in pure
             Python, flushed at each step; timed on the first 1M rows and scaled

Wall time and peak RSS come from wait4() on each child. The DuckDB and metriclog
outputs are compared value by value before any figure is printed.

Usage: python benchmarks/bench_reduce.py [--sizes 2M,20M,100M,20M_g,jsonl] [--repeats 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl

KEYS = [f"group{i // 4}/metric_{i}" for i in range(10)]
REDUCTIONS = ["mean", "sum", "max", "min", "std"] * 2
RUNS = {  # name: (format, ranks, rows per rank, steps)
    "2M": ("parquet", 32, 62_500, 1_250),
    "20M": ("parquet", 32, 625_000, 1_250),
    "100M": ("parquet", 32, 3_125_000, 1_250),
    "20M_g": ("parquet", 32, 625_000, 12_500),
    "jsonl": ("jsonl", 8, 250_000, 1_250),
}

DUCKDB_CHILD = """
import sys, duckdb
run, out, fmt = sys.argv[1], sys.argv[2], sys.argv[3]
con = duckdb.connect()
con.execute("SET threads = 2")
columns = ("{'key': 'VARCHAR', 'value': 'DOUBLE', 'reduction': 'VARCHAR', 'step': 'BIGINT', "
           "'timestamp': 'DOUBLE', 'rank': 'BIGINT', 'process': 'VARCHAR'}")
source = (f"read_parquet('{run}/*.parquet')" if fmt == "parquet" else
          f"read_json('{run}/*.jsonl', format='newline_delimited', columns={columns})")
con.execute(f'''
COPY (
  SELECT step, key,
         CASE reduction WHEN 'mean' THEN avg(value) WHEN 'sum' THEN sum(value)
              WHEN 'max' THEN max(value) WHEN 'min' THEN min(value)
              WHEN 'std' THEN stddev_pop(value) END AS value,
         reduction, count(*) AS count
  FROM {source}
  WHERE key IS NOT NULL  -- the writer's segment and shutdown event lines of JSONL segments
  GROUP BY step, key, reduction
  ORDER BY step, key
) TO '{out}' (FORMAT parquet)''')
"""


def compile_sources() -> None:
    """Byte-compile metric_core and cli, as pip does on install: the timed processes then
    do not compile them on every start (they cannot cache bytecode where
    PYTHONDONTWRITEBYTECODE is set)."""
    import compileall

    root = Path(__file__).resolve().parent.parent
    for package in ("metric_core", "cli"):
        compileall.compile_dir(root / package, quiet=1)


def generate(root: Path, name: str) -> Path:
    """Write a synthetic run through metric_core's own writer (journal, then sealed segments),
    so the files are exactly what a training job leaves: Parquet or JSONL with writer metadata."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from metric_core.writer.segments import RawFileWriter

    fmt, ranks, rows, steps = RUNS[name]
    run = root / f"{fmt}_{name}"
    done = run / ".complete"
    if done.exists():
        return run
    if run.exists():
        shutil.rmtree(run)
    run.mkdir(parents=True)
    values_per_key = rows // (steps * len(KEYS))
    per_step = len(KEYS) * values_per_key
    codes = np.repeat(np.arange(len(KEYS), dtype=np.float64), values_per_key)
    table = list(zip(KEYS, REDUCTIONS, strict=True))
    for rank in range(ranks):
        rng = np.random.default_rng(rank)
        writer = RawFileWriter(
            run, process=f"TrainActor_r{rank}", rank=rank, file_format=fmt, seal_interval=float("inf")
        )
        for step in range(steps):
            ts = 1.76e9 + step * 2.0 + np.sort(rng.uniform(0, 1.9, per_step))
            block = np.stack([rng.normal(10.0, 3.0, per_step), codes, ts], axis=1)
            writer.append(step, block.tobytes(), per_step, table)
            if step % 100 == 99:
                writer.seal_ready()
        writer.close(clean_shutdown=True)
    done.touch()
    return run


def timed(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of one child process (``cpu_timed``)."""
    wall, mib, _ = cpu_timed(cmd)
    return wall, mib


def cpu_timed(cmd: list[str]) -> tuple[float, float, float]:
    """Wall seconds, peak RSS (MiB) and CPU seconds (user + system, all threads) of one
    child process.

    GNU time reports the RSS of the program it execs; wait4() on a child forked from
    this (large) process would count pages the child only shared before exec.
    """
    start = time.perf_counter()
    if Path("/usr/bin/time").exists():
        proc = subprocess.run(
            ["/usr/bin/time", "-f", "RSS_KB=%M CPU=%U+%S", *cmd], capture_output=True, text=True
        )
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{cmd[:3]} failed: {proc.stderr}")
        found = proc.stderr.rsplit("RSS_KB=", 1)[1].split()
        user, system = found[1].removeprefix("CPU=").split("+")
        return wall, int(found[0]) / 1024, float(user) + float(system)
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{cmd[:3]} failed: {child.stderr.read().decode() if child.stderr else ''}")
    return wall, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime


def replay_rows_per_second(run: Path, fmt: str, limit: int = 1_000_000) -> float:
    """The seed's approach: every row through per-key accumulators, in Python."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from metric_core.metric import Reduce

    files = sorted(run.glob(f"*.{fmt}"))
    scan = pl.scan_parquet(files) if fmt == "parquet" else pl.scan_ndjson(files, infer_schema_length=None)
    df = scan.filter(pl.col("key").is_not_null()).head(limit).collect()  # not the writer's event lines
    rows = df.select("key", "value", "reduction", "step").rows()
    start = time.perf_counter()
    accumulators: dict = {}
    current = None
    logged = []
    for key, value, reduction, step in rows:
        if step != current:
            logged.extend((current, k, a.get_value()) for k, a in accumulators.items())
            accumulators = {}
            current = step
        acc = accumulators.get(key)
        if acc is None:
            red = Reduce(reduction)
            acc = accumulators[key] = red.accumulator_class(red)
        acc.append(value)
    return len(rows) / (time.perf_counter() - start)


def same_result(a: Path, b: Path) -> None:
    x, y = pl.read_parquet(a), pl.read_parquet(b)
    assert x.height == y.height, (x.height, y.height)
    assert x["key"].to_list() == y["key"].to_list()
    assert x["count"].cast(pl.Int64).to_list() == y["count"].cast(pl.Int64).to_list()
    np.testing.assert_allclose(x["value"].to_numpy(), y["value"].to_numpy(), rtol=1e-6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2M,20M,100M,20M_g,jsonl")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("bench_out"))
    args = parser.parse_args()
    args.dir.mkdir(exist_ok=True)
    compile_sources()
    metriclog = str(Path(sys.executable).with_name("metriclog"))
    rows_out = []
    for name in args.sizes.split(","):
        fmt, ranks, per_rank, _ = RUNS[name]
        run = generate(args.dir, name)
        total = ranks * per_rank
        ours, duck = [], []
        for _ in range(args.repeats):
            ours.append(
                timed(
                    [
                        metriclog,
                        "reduce",
                        str(run),
                        "--mode",
                        "global_reduce",
                        "--out",
                        str(args.dir / f"ours_{name}.parquet"),
                    ]
                )
            )
            duck.append(
                timed(
                    [
                        sys.executable,
                        "-c",
                        DUCKDB_CHILD,
                        str(run),
                        str(args.dir / f"duck_{name}.parquet"),
                        fmt,
                    ]
                )
            )
        same_result(args.dir / f"ours_{name}.parquet", args.dir / f"duck_{name}.parquet")
        replay = replay_rows_per_second(run, fmt)
        o_wall, o_rss = statistics.median(w for w, _ in ours), statistics.median(r for _, r in ours)
        d_wall, d_rss = statistics.median(w for w, _ in duck), statistics.median(r for _, r in duck)
        rows_out.append(
            {
                "run": f"{fmt}_{name}",
                "rows": total,
                "metriclog_s": o_wall,
                "duckdb_s": d_wall,
                "wall_ratio": o_wall / d_wall,
                "metriclog_mib": o_rss,
                "duckdb_mib": d_rss,
                "rss_ratio": o_rss / d_rss,
                "replay_s": total / replay,
                "vs_replay": (total / replay) / o_wall,
            }
        )
        print(json.dumps(rows_out[-1]), file=sys.stderr)
    print(f"repeats: {args.repeats}; medians; wall = whole process; RSS = peak of the process")
    head = (
        f"{'run':<16}{'rows':>12}{'ours s':>9}{'duckdb s':>10}{'wall x':>8}{'ours MiB':>10}{'duck MiB':>10}"
        f"{'RSS x':>7}{'replay s':>10}{'faster':>8}"
    )
    print(head)
    for r in rows_out:
        print(
            f"{r['run']:<16}{r['rows']:>12,}{r['metriclog_s']:>9.2f}{r['duckdb_s']:>10.2f}{r['wall_ratio']:>7.2f}x"
            f"{r['metriclog_mib']:>10.0f}{r['duckdb_mib']:>10.0f}{r['rss_ratio']:>6.2f}x{r['replay_s']:>10.0f}"
            f"{r['vs_replay']:>7.0f}x"
        )
    parquet = [r for r in rows_out if r["run"] in ("parquet_2M", "parquet_20M", "parquet_100M")]
    if len(parquet) > 1:
        print(
            "growth (parquet): "
            + ", ".join(
                f"{r['rows'] / 1e6:.0f}M rows {r['metriclog_s'] / r['rows'] * 1e9:.0f} ns/row "
                f"{r['metriclog_mib']:.0f} MiB"
                for r in parquet
            )
        )


if __name__ == "__main__":
    main()
