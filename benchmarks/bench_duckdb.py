"""Issue 42's speed target: four reduce commands against DuckDB, on the compiled path and
on the pure numpy one (METRICLOG_PURE=1), on another tool's 20M records.

The run is bench_engine.py's foreign_20M (``foreign_run``, made once in --dir): 32 files
written by pyarrow, 50 keys, each key once a step a file, 12,500 steps: 625,000 groups of
(step, key), 20M of (process, rank, step, key). The commands, each a whole process:

  global       reduce --mode global_reduce        DuckDB: GROUP BY step, key
  per_rank     reduce --mode per_rank_reduce      DuckDB: GROUP BY process, rank, step, key
  time         reduce --by time --every E         DuckDB: GROUP BY floor((timestamp - t0) / E), key
  p99          reduce --reduce '*=p99'            DuckDB: quantile_cont(value, 0.99) by step, key

DuckDB runs with 2 threads (``SET threads = 2``) on the same Parquet files, each key by its
recorded reduction (avg, sum, min, max, stddev_pop; CASE on the reduction, as
bench_reduce.py's DUCKDB_CHILD), with count(*), sorted as metriclog's output is and
written to Parquet. t0 (the run's first timestamp, which metriclog finds itself) is given
to DuckDB as a constant. The default window, --every 10s, cuts the run's 25,000 seconds
into 2,500 windows (125,000 groups of window and key).

Each round runs every command on every side one after another (interleaved), --repeats
rounds; the table shows the medians of wall and CPU (user + system of the process) and
the ratio of wall times to DuckDB's. Then whether the compiled and the pure path wrote the
same bits.

--floors: the engine's phases alone, in a child process on one thread (the compiled path,
and the pure one): read (the columns a reduction needs, a partition at a time), states
(``partials.partition_states``: labels, groups, min/max and the exact accumulation), of
which exact (``exact.accumulate`` on the same rows), merge (every partition's exact state
into the run's (step, key) groups: ``exact.combine`` at once), sum, mean and std (each of
every group from its exact state: the finish), fold (the accumulator's own fold of the
states) and take (the accumulator's take: every group's statistic): CPU and wall per
record (per group for sum, mean, std and take), against DuckDB's wall time for the global
command per record. Then each command's own path (global, time, p99: ``path_floors``), its
phases one after another in one process (read, add, finish, write) and two floors of its wall time on
2 cores against DuckDB's: this design's (the imports, then read and add sharing the cores,
then finish and write) and an ideal one (only Python, numpy and pyarrow's imports before
the first read, every phase's CPU spread evenly on both cores).

Usage: python benchmarks/bench_duckdb.py [--dir /work/bench-data/exactwire] [--repeats 3]
       [--every 10s] [--commands global,per_rank,time,p99] [--paths compiled,pure]
       [--floors] [--floor-files 32]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import foreign_run
from bench_reduce import compile_sources, cpu_timed

ROOT = Path(__file__).resolve().parent.parent
CASE = """CASE reduction WHEN 'mean' THEN avg(value) WHEN 'sum' THEN sum(value)
              WHEN 'max' THEN max(value) WHEN 'min' THEN min(value)
              WHEN 'std' THEN stddev_pop(value) END"""
QUERIES = {
    "global": f"SELECT step, key, {CASE} AS value, count(*) AS count FROM src "
    "GROUP BY step, key, reduction ORDER BY step, key",
    "per_rank": f"SELECT process, rank, step, key, {CASE} AS value, count(*) AS count FROM src "
    "GROUP BY process, rank, step, key, reduction ORDER BY process, rank, step, key",
    "time": f"SELECT floor((timestamp - {{t0}}) / {{every}}) AS time_window, key, {CASE} AS value, "
    "count(*) AS count FROM src GROUP BY time_window, key, reduction ORDER BY time_window, key",
    "p99": "SELECT step, key, quantile_cont(value, 0.99) AS value, count(*) AS count FROM src "
    "GROUP BY step, key ORDER BY step, key",
}
DUCKDB_CHILD = """
import sys, duckdb
run, out, query = sys.argv[1], sys.argv[2], sys.argv[3]
con = duckdb.connect()
con.execute("SET threads = 2")
con.execute("SET enable_progress_bar = false")
con.execute(f"CREATE VIEW src AS SELECT * FROM read_parquet('{run}/*.parquet')")
con.execute(f"COPY ({query}) TO '{out}' (FORMAT parquet)")
"""


def seconds(every: str) -> float:
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    for unit in sorted(units, key=len, reverse=True):
        if every.endswith(unit):
            return float(every[: -len(unit)]) * units[unit]
    return float(every)


def first_time(run: Path) -> float:
    import pyarrow.parquet as pq

    lows = []
    for file in sorted(run.glob("*.parquet")):
        meta = pq.ParquetFile(file).metadata
        column = meta.schema.names.index("timestamp")
        lows += [meta.row_group(g).column(column).statistics.min for g in range(meta.num_row_groups)]
    return min(lows)


def commands(run: Path, every: str) -> dict[str, tuple[list[str], str]]:
    """Each command's metriclog arguments and DuckDB query."""
    t0 = first_time(run)
    return {
        "global": (["--mode", "global_reduce"], QUERIES["global"]),
        "per_rank": (["--mode", "per_rank_reduce"], QUERIES["per_rank"]),
        "time": (
            ["--by", "time", "--every", every],
            QUERIES["time"].format(t0=repr(t0), every=seconds(every)),
        ),
        "p99": (["--reduce", "*=p99"], QUERIES["p99"]),
    }


def compare(run: Path, out: Path, repeats: int, every: str, names: list[str], paths: list[str]) -> None:
    metriclog = str(Path(sys.executable).with_name("metriclog"))
    cases = commands(run, every)
    sides = ["duckdb", *paths]
    times: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for r in range(repeats):
        for name in names:
            args, query = cases[name]
            for side in sides:
                target = out / f"duckdb42_{name}_{side}.parquet"
                if side == "duckdb":
                    cmd = [sys.executable, "-c", DUCKDB_CHILD, str(run), str(target), query]
                    env = None
                else:
                    cmd = [metriclog, "reduce", str(run), *args, "--out", str(target)]
                    env = {**os.environ, "METRICLOG_PURE": "1" if side == "pure" else ""}
                wall, _, cpu = timed_env(cmd, env)
                times.setdefault((name, side), []).append((wall, cpu))
                print(f"round {r + 1} {name:<9}{side:<9}{wall:8.2f} s wall {cpu:8.2f} s CPU", file=sys.stderr)
    print(f"\n{run.name}: medians of {repeats}, whole processes, DuckDB on 2 threads; --every {every}")
    heads = [("duckdb s", 10), ("cpu", 7)]
    for side in paths:
        heads += [(f"{side} s", 12), ("cpu", 7), ("x duckdb", 10)]
    print(f"{'command':<10}" + "".join(f"{h:>{w}}" for h, w in heads))
    for name in names:
        duck = [statistics.median(c) for c in zip(*times[(name, "duckdb")], strict=True)]
        line = f"{name:<10}{duck[0]:>10.2f}{duck[1]:>7.2f}"
        for side in paths:
            ours = [statistics.median(c) for c in zip(*times[(name, side)], strict=True)]
            line += f"{ours[0]:>12.2f}{ours[1]:>7.2f}{ours[0] / duck[0]:>9.2f}x"
        print(line)
    if {"compiled", "pure"} <= set(paths):
        for name in names:
            print(f"{name}: compiled and pure {same_bits(out, name)}")


def timed_env(cmd: list[str], env: dict[str, str] | None) -> tuple[float, float, float]:
    saved = dict(os.environ)
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        return cpu_timed(cmd)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def same_bits(out: Path, name: str) -> str:
    import polars as pl

    a = pl.read_parquet(out / f"duckdb42_{name}_compiled.parquet")
    b = pl.read_parquet(out / f"duckdb42_{name}_pure.parquet")
    if a.columns != b.columns or a.height != b.height:
        return "DIFFER in shape"
    va, vb = a["value"].to_numpy().view(np.int64), b["value"].to_numpy().view(np.int64)
    differ = int((va != vb).sum())
    rest = a.drop("value").equals(b.drop("value"))
    return "wrote the same bits" if not differ and rest else f"DIFFER ({differ} values)"


# The engine's phases alone, on one thread: the first FILES files of the run, each read a
# partition at a time as the engine reads it. Prints one line a phase: name, wall s, CPU s.
FLOORS_CHILD = """
import sys, time
from cli import tuning
tuning.apply()
import numpy as np
import polars as pl
from metric_core.offline import engine
from metric_core.offline.engine import exact, partials
from metric_core.offline.engine.accumulator import Accumulator
from metric_core.offline.plan import make_plan
from metric_core.offline.read import scan_run

run, files = sys.argv[1], int(sys.argv[2])
scan = scan_run(run, defer_checks=True)
plan = make_plan()
kept, statistic_of = engine.tasks.columns_read(plan, scan), engine.filtering.statistic_chooser(plan)

def timed(name, count, f):
    wall, cpu = time.perf_counter(), time.process_time()
    out = f()
    print(name, time.perf_counter() - wall, time.process_time() - cpu, count, flush=True)
    return out

# the accumulator's fold of parts (timed as fold_name), then its take (take_name)
def folded(fold_name, take_name, parts, count):
    acc = Accumulator()
    def fold():
        for p in parts:
            acc.add(p)
    timed(fold_name, count, fold)
    wall, cpu = time.perf_counter(), time.process_time()
    taken = acc.take()
    print(take_name, time.perf_counter() - wall, time.process_time() - cpu, len(taken.bucket), flush=True)
    acc.close()

def read():
    frames = []
    for fid in scan.file_ids[:files]:
        frames += scan.batches(fid, kept, dictionaries=engine.tasks.reads_dictionaries(scan),
                               rows=engine.tasks.PARTITION_ROWS)
    return frames

n_read = sum(df.height for df in read())  # once untimed: the files in the page cache, as for every other side

# The engine's own path: batches taken as pyarrow read them (rows for the C table on the
# compiled path), then added (into the table, or folded on the pure path), then taken out.
import functools
from metric_core.offline import filters
from metric_core.offline.engine import grouptable

offer = functools.partial(partials.batch_partial, plan=plan, statistic_of=statistic_of, t0=None,
                          seen=filters.Seen.wanted_by(plan), direct=grouptable.available())

def as_read():
    out = []
    for fid in scan.file_ids[:files]:
        for got in scan.offered(fid, kept, offer, rows=engine.tasks.PARTITION_ROWS):
            out.append(got if isinstance(got, partials.Partial)
                       else partials.partition_states(got, plan, statistic_of, None, grouptable.available()))
    return out

folded("added", "drained", timed("as-read", n_read, as_read), n_read)

frames = timed("read", n_read, read)
records = sum(df.height for df in frames)
parts = timed(
    "states", records, lambda: [partials.partition_states(df, plan, statistic_of, None) for df in frames]
)
# the exact accumulation alone, of the rows of sum, mean and std keys as the engine's, in
# each partition's own groups (numbered here, untimed)
keys = {}
rows = []
for df in frames:
    df = df.filter(pl.col("reduction").cast(pl.String).is_in(["sum", "mean", "std"]))
    uniq, code = np.unique(df["key"].cast(pl.String).to_numpy(), return_inverse=True)
    for k in uniq.tolist():
        keys.setdefault(k, len(keys))
    gid = df["step"].to_numpy() * 1024 + np.array([keys[k] for k in uniq.tolist()], dtype=np.int64)[code]
    mine, local = np.unique(gid, return_inverse=True)
    rows.append((mine, local, df["value"].to_numpy(), len(mine)))
summed = sum(len(v) for _, _, v, _ in rows)
states = timed("exact", summed, lambda: [exact.accumulate(l, v, n) for _, l, v, n in rows])
everyone = np.unique(np.concatenate([m for m, _, _, _ in rows]))
maps = [np.searchsorted(everyone, m) for m, _, _, _ in rows]
merged = timed("merge", summed, lambda: exact.combine(states, maps, len(everyone)))
for stat in ("sum", "mean", "std"):
    timed(stat, len(everyone), getattr(merged, stat))
folded("fold", "take", parts, records)

"""
# Each command's own path, its phases one after another in one process (the compiled path;
# pyarrow's and polars' own threads work as they do in a command):
# read (the columns it needs, taken as pyarrow reads them: rows for the C table), add (into
# the accumulator), finish (every group out, rounded, as result frames), write (the frames
# to Parquet). Prints one line a phase: name, wall s, CPU s (every thread of the process).
PATH_CHILD = """
import math, sys, tempfile, time
from pathlib import Path
from cli import tuning
tuning.apply()
from metric_core.offline import engine, filters
from metric_core.offline.engine import grouptable, partials
from metric_core.offline.engine.accumulator import Accumulator
from metric_core.offline.engine.finish import finished_frames
from metric_core.offline.engine.reductions import KeyReductions, first_reductions
from metric_core.offline.plan import By, make_plan
from metric_core.offline.read import scan_run
from metric_core.offline.results import write_result

run, options = sys.argv[1], dict(a.split("=", 1) for a in sys.argv[2:])
scan = scan_run(run, defer_checks=True)
plan = make_plan(**options)
t0 = engine.tasks.first_time(plan, scan) if plan.by is By.TIME else None
kept, statistic_of = engine.tasks.columns_read(plan, scan), engine.filtering.statistic_chooser(plan)
dictionaries = engine.tasks.reads_dictionaries(scan)
direct = grouptable.available()

def offer(batch):
    return partials.batch_partial(batch, plan, statistic_of, t0, filters.Seen.wanted_by(plan), direct)

def timed(name, f):
    wall, cpu = time.perf_counter(), time.process_time()
    out = f()
    print(name, time.perf_counter() - wall, time.process_time() - cpu, flush=True)
    return out

def read():
    out = []
    for fid in scan.file_ids:
        rows = engine.tasks.PARTITION_ROWS
        for got in scan.offered(fid, kept, offer, dictionaries=dictionaries, rows=rows):
            out.append(got if isinstance(got, partials.Partial)
                       else partials.partition_states(got, plan, statistic_of, t0, direct))
    return out

read()  # once untimed: the files in the page cache, as for every other side
parts = timed("read", read)
acc = Accumulator()
timed("add", lambda: [acc.add(p) for p in parts])
del parts
recorded = KeyReductions(first_reductions(plan, scan), spills=True)
frames = timed("finish", lambda: list(finished_frames(plan, scan, acc, t0, recorded, math.inf, {}, True)))
with tempfile.TemporaryDirectory() as scratch:
    timed("write", lambda: write_result(frames, Path(scratch) / "out.parquet", derived="reduce"))
acc.close()
recorded.close()
"""
# What reading needs before a record is read, at least: Python, numpy and pyarrow's reader.
READ_START_CHILD = "import numpy, pyarrow.parquet"
# The options of each command's plan (make_plan's), for PATH_CHILD
PLANS = {
    "global": [],
    "time": ["by=time", "every={every}"],
    "p99": ["reduce=*=p99"],
}


def path_floors(run: Path, out: Path, repeats: int, every: str) -> None:
    """Each command's phases one after another (PATH_CHILD), and two floors of its wall time
    on this machine's 2 cores, against DuckDB's wall time for it, side by side (medians of
    --repeats):

    - the design's: the start (the engine's imports, before the footers are read), then
      read and add sharing the two cores (their CPU / 2), then finish and write (after the
      last record, on one thread, as the engine runs them);
    - an ideal one: only Python, numpy and pyarrow's imports before the first read, and
      every phase's CPU spread evenly on both cores, with nothing lost to waiting."""
    cases = commands(run, every)
    rows = []
    for name, options in PLANS.items():
        duck, phases, start, read_start = [], {}, [], []
        for _ in range(repeats):
            target = out / f"duckdb42_floor_{name}.parquet"
            query = cases[name][1]
            duck.append(cpu_timed([sys.executable, "-c", DUCKDB_CHILD, str(run), str(target), query])[0])
            done = subprocess.run(
                [sys.executable, "-c", PATH_CHILD, str(run), *(o.format(every=every) for o in options)],
                capture_output=True, text=True, check=True, cwd=ROOT,
                env={**os.environ, "METRICLOG_PURE": ""},
            )  # fmt: skip
            for line in done.stdout.splitlines():
                phase, wall, cpu = line.split()
                phases.setdefault(phase, []).append((float(wall), float(cpu)))
            start.append(cpu_timed([sys.executable, "-c", START_CHILD])[0])
            read_start.append(cpu_timed([sys.executable, "-c", READ_START_CHILD])[0])
        cpu = {k: statistics.median(c for _, c in v) for k, v in phases.items()}
        wall = {k: statistics.median(w for w, _ in v) for k, v in phases.items()}
        duck_s, start_s, read_start_s = map(statistics.median, (duck, start, read_start))
        design = start_s + (cpu["read"] + cpu["add"]) / 2 + wall["finish"] + wall["write"]
        ideal = read_start_s + sum(cpu.values()) / 2
        rows.append((name, duck_s, start_s, read_start_s, cpu, wall, design, ideal))
    print(f"\nfloors of each command (compiled), medians of {repeats}; its phases one after another")
    heads = ["command", "duckdb s", "start", "read cpu", "add cpu", "finish", "(cpu)", "write", "(cpu)"]
    heads += ["design", "x duckdb", "ideal", "x duckdb"]
    print(f"{heads[0]:<9}" + "".join(f"{h:>9}" for h in heads[1:]))
    for name, duck_s, start_s, _, cpu, wall, design, ideal in rows:
        cells = [duck_s, start_s, cpu["read"], cpu["add"], wall["finish"], cpu["finish"]]
        cells += [wall["write"], cpu["write"], design]
        line = f"{name:<9}" + "".join(f"{c:>9.2f}" for c in cells)
        print(line + f"{design / duck_s:>8.2f}x{ideal:>9.2f}{ideal / duck_s:>8.2f}x")
    print(
        "seconds; start: a reduce process's wall before it reads (Python, the engine's imports, pyarrow's"
        " reader); read, add: CPU; finish, write: wall (their CPU beside it: pyarrow's and polars' own"
        " threads count); design: start + (read + add) / 2 + finish + write; ideal: Python, numpy and"
        f" pyarrow's imports alone ({statistics.median(r[3] for r in rows):.2f} s) + every phase's CPU / 2"
    )


# What a reduce process spends before it reads a record: Python, and the imports of the
# command line, the engine and pyarrow's Parquet reader.
START_CHILD = "import metriclog.main, metric_core.offline.engine.run, pyarrow.parquet"


def floors(run: Path, out: Path, repeats: int, paths: list[str], files: int) -> None:
    """Each phase's wall and CPU a record (a group for sum, mean, std and take), against DuckDB's
    wall a record for the whole global command (medians of --repeats)."""
    cases = commands(run, "10s")
    duck = []
    found: dict[str, dict[str, list[tuple[float, float, int]]]] = {p: {} for p in paths}
    for _ in range(repeats):
        target = out / "duckdb42_floor.parquet"
        command = [sys.executable, "-c", DUCKDB_CHILD, str(run), str(target), cases["global"][1]]
        duck.append(cpu_timed(command)[0])
        for side in paths:
            env = {**os.environ, "METRICLOG_PURE": "1" if side == "pure" else "", "POLARS_MAX_THREADS": "1"}
            done = subprocess.run(
                [sys.executable, "-c", FLOORS_CHILD, str(run), str(files)],
                capture_output=True, text=True, check=True, cwd=ROOT, env=env,
            )  # fmt: skip
            for line in done.stdout.splitlines():
                name, wall, cpu, count = line.split()
                found[side].setdefault(name, []).append((float(wall), float(cpu), int(count)))
            wall, _, cpu = cpu_timed([sys.executable, "-c", START_CHILD])
            found[side].setdefault("start", []).append((wall, cpu, 1))
    records = 20_000_000
    duck_s = statistics.median(duck)
    print(f"\nfloors: phases alone on one thread ({files} of 32 files), medians of {repeats}")
    print(
        f"DuckDB's global_reduce, 2 threads, whole process: {duck_s:.2f} s"
        f" = {duck_s / records * 1e9:.1f} ns a record"
    )
    print(f"{'path':<10}{'phase':<8}{'wall s':>9}{'cpu s':>9}{'wall ns':>10}{'cpu ns':>9}  per")
    for side in paths:
        for name, runs in found[side].items():
            wall = statistics.median(w for w, _, _ in runs)
            cpu = statistics.median(c for _, c, _ in runs)
            count = runs[0][2]
            per = (
                "group"
                if name in ("sum", "mean", "std", "take", "drained")
                else "process"
                if name == "start"
                else "record"
            )
            each = (wall / count * 1e9, cpu / count * 1e9) if per != "process" else (math.nan, math.nan)
            line = f"{side:<10}{name:<8}{wall:>9.2f}{cpu:>9.2f}{each[0]:>10.1f}{each[1]:>9.1f}"
            print(f"{line}  {per} ({count:,})")
    print(
        "read: the columns a reduction needs, a partition at a time; states: the engine's partition states"
        " (exact: of which the exact accumulation alone); merge: the partitions' exact states into the run's"
        " groups at once; sum, mean, std: each of every group; fold and take: the accumulator's own."
        " The engine's path as it runs: as-read: batches read and taken as pyarrow read them"
        " (rows for the C table where compiled); added: into the table (or folded); drained: every"
        " group out and rounded. start: a process's Python and imports, before a record is read"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/work/bench-data/exactwire"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--every", default="10s")
    parser.add_argument("--commands", default="global,per_rank,time,p99")
    parser.add_argument("--paths", default="compiled,pure")
    parser.add_argument("--floors", action="store_true", help="only the phases alone")
    parser.add_argument("--floor-files", type=int, default=32)
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    compile_sources()
    run = foreign_run(args.dir, 20_000_000)
    paths = args.paths.split(",")
    if args.floors:
        floors(run, args.dir, args.repeats, paths, args.floor_files)
        path_floors(run, args.dir, args.repeats, args.every)
        return
    compare(run, args.dir, args.repeats, args.every, args.commands.split(","), paths)


if __name__ == "__main__":
    main()
