"""The engine (issue 13): wall time against DuckDB and polars' own floor, peak RSS in every
mode from 20M to 100M records, and bit-identical output across runs and thread counts.

Runs (in --dir, made once):

  foreign_20M / foreign_100M   written by another tool (pyarrow): 32 files, 50 keys, each
                               key once per step per file, key/reduction/process
                               dictionary-encoded, no metriclog metadata
  own_20M / own_100M           written by metric_core's writer (benchmarks/bench_reduce.py's
                               parquet_20M and parquet_100M: 10 keys, 50 values a step)
  jsonl                        bench_reduce.py's jsonl run: 8 writer files, 2M records

Peers, each a whole process, interleaved with ours over --repeats rounds (medians):

  duckdb   DuckDB with 2 threads, the same reduction (each key by its recorded reduction,
           count), written to Parquet sorted by step and key
  floor    a bare polars query: scan + group_by(step, key) with the same aggregations,
           sunk to Parquet (what polars does with no checks, no exactness, no report)

Peak RSS is that of the command's process tree (GNU time on the metriclog command; the
engine starts no child). Every mode, inspect and upload's dry run of raw mode are run once per
size for memory.

With --floors, only this: for each speed target, our start and a bare read of the columns
the reduction needs (READ_CHILD), against the peer the target is set against, and what
that leaves a record for reducing.

Usage: python benchmarks/bench_engine.py [--sizes 20M,100M] [--repeats 3] [--dir bench_out]
       [--skip-modes] [--skip-100M-quantiles] [--floors]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_reduce import DUCKDB_CHILD, compile_sources, cpu_timed, generate, timed

KEYS = [f"section{i // 10}/metric_{i}" for i in range(50)]
REDUCTIONS = ["mean", "sum", "max", "min", "std"] * 10

FLOOR_CHILD = """
import sys, polars as pl
run, out, fmt = sys.argv[1], sys.argv[2], sys.argv[3]
scan = pl.scan_parquet(f"{run}/*.parquet") if fmt == "parquet" else pl.scan_ndjson(
    f"{run}/*.jsonl", schema={"key": pl.String, "value": pl.Float64, "reduction": pl.String,
    "step": pl.Int64, "timestamp": pl.Float64, "rank": pl.Int64, "process": pl.String})
v = pl.col("value")
stat = (pl.when(pl.col("reduction") == "mean").then(v.mean()).when(pl.col("reduction") == "sum").then(v.sum())
        .when(pl.col("reduction") == "max").then(v.max()).when(pl.col("reduction") == "min").then(v.min())
        .otherwise(v.std(ddof=0)))
(scan.filter(pl.col("key").is_not_null())
     .group_by("step", "key").agg(pl.col("reduction").first(), v.mean().alias("mean"), v.sum().alias("sum"),
        v.max().alias("max"), v.min().alias("min"), v.std(ddof=0).alias("std"), pl.len().alias("count"))
     .sort("step", "key").sink_parquet(out))
"""


def foreign_run(root: Path, rows: int) -> Path:
    """Parquet written by pyarrow as another tool would: dictionary strings, no metadata."""
    import pyarrow as pa
    import pyarrow.compute
    import pyarrow.parquet as pq

    run = root / f"foreign_{rows // 1_000_000}M"
    done = run / ".complete"
    if done.exists():
        return run
    run.mkdir(parents=True, exist_ok=True)
    files, per_file = 32, rows // 32
    steps = per_file // len(KEYS)
    keys = pa.array(KEYS).dictionary_encode()
    reductions = pa.array(REDUCTIONS).dictionary_encode()
    for f in range(files):
        rng = np.random.default_rng(f)
        index = pa.array(np.tile(np.arange(len(KEYS), dtype=np.int32), steps))
        step = np.repeat(np.arange(steps, dtype=np.int64), len(KEYS))
        table = pa.table(
            {
                "key": pa.DictionaryArray.from_arrays(index, keys.dictionary),
                "value": rng.normal(10.0, 3.0, steps * len(KEYS)),
                "reduction": pa.DictionaryArray.from_arrays(
                    pa.compute.remainder(index, 5), reductions.dictionary
                ),
                "step": step,
                "timestamp": 1.76e9 + step * 2.0 + rng.uniform(0, 1.9, steps * len(KEYS)),
                "rank": np.full(steps * len(KEYS), f, dtype=np.int64),
                "process": pa.array([f"rank{f}"] * (steps * len(KEYS))).dictionary_encode(),
            }
        )
        pq.write_table(table, run / f"part-{f:05d}.parquet", row_group_size=1 << 20)
    done.touch()
    return run


# Our command's fixed start (imports, the scan of the run) and then a bare read of the
# columns a reduction needs, on 2 threads, with nothing done to them: pyarrow for Parquet,
# the engine's own read (polars) for JSONL. What is left of a target for reducing is the
# target's wall time minus this.
READ_CHILD = """
import sys
from concurrent.futures import ThreadPoolExecutor
from cli import tuning
tuning.apply()
import pyarrow.parquet as pq
from metric_core.offline.read import scan_run
run, fmt, columns = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
scan = scan_run(run, defer_checks=True)
def read(fid):
    if fmt == "jsonl":
        return sum(df.height for df in scan.batches(fid, columns, dictionaries=False))
    file = pq.ParquetFile(scan.report.files[fid].path)
    return sum(b.num_rows for b in file.iter_batches(125_000, columns=columns))
with ThreadPoolExecutor(2) as pool:
    print(sum(pool.map(read, scan.file_ids)))
"""


# The engine's partial states alone (numpy), over the first 1M records of a run as the
# engine reads them, on one thread: CPU nanoseconds a record, best of 3.
STATES_CHILD = """
import sys, time
from cli import tuning
tuning.apply()
from metric_core.offline import engine
from metric_core.offline.engine import partials
from metric_core.offline.plan import make_plan
from metric_core.offline.read import scan_run
scan = scan_run(sys.argv[1], defer_checks=True)
plan = make_plan()
kept, statistic_of = engine.tasks.columns_read(plan, scan), engine.filtering.statistic_chooser(plan)
frames, held = [], 0
for fid in scan.file_ids:
    dictionaries = engine.tasks.reads_dictionaries(scan)
    frames += scan.batches(fid, kept, dictionaries=dictionaries, rows=engine.tasks.PARTITION_ROWS)
    held = sum(df.height for df in frames)
    if held >= 1_000_000:
        break
best = float("inf")
for _ in range(3):
    start = time.process_time()
    for df in frames:
        partials.partition_states(df, plan, statistic_of, None)
    best = min(best, time.process_time() - start)
print(best / held * 1e9)
"""


def floors(runs: list[tuple[str, Path, str]], out_dir: Path, repeats: int) -> None:
    """Each run's bare read (READ_CHILD) against its target's wall time, interleaved with
    the peer the target is set against: what is left for the reduction, per record; and
    what the engine's partial states alone cost a record (STATES_CHILD)."""
    targets = {"foreign": ("duckdb", 1.0), "own_100M": ("duckdb", 0.8), "jsonl": ("floor", 1.1)}
    columns = {
        "foreign": "key,reduction,step,value",
        "own": "key_hash,step,value",
        "jsonl": "key,reduction,step,value",
    }
    root = Path(__file__).resolve().parent.parent
    print(f"\nfloors: our start and a bare read of the needed columns (2 threads), medians of {repeats}")
    heads = [("peer", 8), ("peer s", 9), ("target s", 10), ("read s", 9), ("left s", 9)]
    heads += [("left cpu ns/rec", 17), ("states ns/rec", 15)]
    print(f"{'run':<14}" + "".join(f"{h:>{w}}" for h, w in heads))
    for name, run, fmt in runs:
        kind = next((k for k in targets if name.startswith(k)), None)
        if kind is None:
            continue
        peer, factor = targets[kind]
        child = DUCKDB_CHILD if peer == "duckdb" else FLOOR_CHILD
        peer_s, read_s, records = [], [], 0
        for _ in range(repeats):
            peer_s.append(
                timed([sys.executable, "-c", child, str(run), str(out_dir / "floor_peer.parquet"), fmt])[0]
            )
            start = time.perf_counter()
            command = [sys.executable, "-c", READ_CHILD, str(run), fmt, columns[name.split("_")[0]]]
            done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=root)
            read_s.append(time.perf_counter() - start)
            records = int(done.stdout.split()[-1])
        command = [sys.executable, "-c", STATES_CHILD, str(run)]
        states = float(subprocess.run(command, capture_output=True, text=True, check=True, cwd=root).stdout)
        target = factor * statistics.median(peer_s)
        left = target - statistics.median(read_s)
        print(
            f"{name:<14}{peer:>8}{statistics.median(peer_s):>9.2f}{target:>10.2f}"
            f"{statistics.median(read_s):>9.2f}{left:>9.2f}{left * 2 / records * 1e9:>17.1f}{states:>15.1f}"
        )
    print(
        "left s: the target's wall time minus the read; left cpu ns/rec: the CPU time that leaves a"
        " record for reducing, both cores together; states ns/rec: the CPU the engine's numpy partial"
        " states alone take a record (1M records, one thread), before the fold and the output"
    )


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def compare(runs: list[tuple[str, Path, str]], out_dir: Path, repeats: int) -> list[dict]:
    metriclog = str(Path(sys.executable).with_name("metriclog"))
    rows = []
    for name, run, fmt in runs:
        times: dict[str, list[tuple[float, float, float]]] = {"metriclog": [], "duckdb": [], "floor": []}
        outs = {who: out_dir / f"engine_{who}_{name}.parquet" for who in times}
        for _ in range(repeats):
            times["metriclog"].append(
                cpu_timed([metriclog, "reduce", str(run), "--out", str(outs["metriclog"])])
            )
            times["duckdb"].append(
                cpu_timed([sys.executable, "-c", DUCKDB_CHILD, str(run), str(outs["duckdb"]), fmt])
            )
            times["floor"].append(
                cpu_timed([sys.executable, "-c", FLOOR_CHILD, str(run), str(outs["floor"]), fmt])
            )
        med = {
            who: [statistics.median(column) for column in zip(*t, strict=True)] for who, t in times.items()
        }
        rows.append(
            {
                "run": name,
                **{f"{w}_s": m[0] for w, m in med.items()},
                **{f"{w}_mib": m[1] for w, m in med.items()},
                **{f"{w}_cpu": m[2] for w, m in med.items()},
            }
        )
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def modes(run: Path, name: str, out_dir: Path, quantiles: bool) -> list[dict]:
    """Wall and peak RSS of reduce in every mode, inspect, and upload's dry run in every mode."""
    metriclog = str(Path(sys.executable).with_name("metriclog"))
    target = out_dir / f"engine_mode_{name}.parquet"
    out_args = ["--out", str(target)]
    cases = {
        "global_reduce": ["reduce", *out_args],
        "per_rank_reduce": ["reduce", "--mode", "per_rank_reduce", *out_args],
        "by time 10s": ["reduce", "--by", "time", "--every", "10s", *out_args],
        "per_rank_no_reduce": ["reduce", "--mode", "per_rank_no_reduce", *out_args],
    }
    if quantiles:
        cases["*=p99"] = ["reduce", "--reduce", "*=p99", *out_args]
    cases["inspect"] = ["inspect", "--json"]
    for mode in ("global_reduce", "per_rank_reduce", "per_rank_no_reduce"):
        cases[f"upload dry {mode}"] = ["upload", "--project", "bench", "--dry-run", "--mode", mode]
    out = []
    for case, (command, *args) in cases.items():
        wall, rss = timed([metriclog, command, str(run), *args])
        out.append({"run": name, "mode": case, "s": wall, "mib": rss})
        if case == "*=p99":
            out[-1]["off"] = p99_off(run, target)
        print(out[-1], file=sys.stderr, flush=True)
    target.unlink(missing_ok=True)
    return out


def p99_off(run: Path, ours: Path) -> float:
    """The largest relative difference between our p99 of each (step, key) and DuckDB's
    quantile_cont over the same records: 0 where both are NaN, inf where a group is
    missing from one or NaN in one only, the absolute difference where DuckDB's is 0."""
    import duckdb

    con = duckdb.connect()
    con.execute("set enable_progress_bar = false")
    return con.execute(
        f"""
        with peer as (
            select step, key::varchar as key, quantile_cont(value, 0.99) as q
            from read_parquet('{run}/*.parquet') group by all)
        select coalesce(max(case
            when o.value is null or p.q is null then 'inf'::double
            when isnan(o.value) and isnan(p.q) then 0
            when isnan(o.value) or isnan(p.q) then 'inf'::double
            when p.q = 0 then abs(o.value)
            else abs(o.value - p.q) / abs(p.q) end), 0)
        from read_parquet('{ours}') o full join peer p on o.step = p.step and o.key = p.key
        """
    ).fetchone()[0]


def identical(run: Path, out_dir: Path) -> list[str]:
    """Output digests: twice with 2 threads, once with 1."""
    metriclog = str(Path(sys.executable).with_name("metriclog"))
    found = []
    for threads in ("2", "2", "1"):
        target = out_dir / f"engine_same_{threads}.parquet"
        os.environ["POLARS_MAX_THREADS"] = threads
        try:
            timed([metriclog, "reduce", str(run), "--mode", "per_rank_reduce", "--out", str(target)])
        finally:
            del os.environ["POLARS_MAX_THREADS"]
        found.append(digest(target))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="20M,100M")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("bench_out"))
    parser.add_argument("--skip-modes", action="store_true")
    parser.add_argument("--skip-100M-quantiles", action="store_true")
    parser.add_argument("--floors", action="store_true", help="only the floors of the speed targets")
    args = parser.parse_args()
    args.dir.mkdir(exist_ok=True)
    compile_sources()
    sizes = args.sizes.split(",")
    runs = []
    for size in sizes:
        runs.append((f"foreign_{size}", foreign_run(args.dir, int(size.rstrip("M")) * 1_000_000), "parquet"))
        runs.append((f"own_{size}", generate(args.dir, size), "parquet"))
    runs.append(("jsonl_2M", generate(args.dir, "jsonl"), "jsonl"))
    if args.floors:
        floors(runs, args.dir, args.repeats)
        return
    table = compare(runs, args.dir, args.repeats)
    print(f"\nreduce --mode global_reduce: medians of {args.repeats}; whole processes; RSS = peak")
    heads = [("ours s", 8), ("duckdb s", 10), ("x duckdb", 10), ("floor s", 9), ("x floor", 9)]
    cores = len(os.sched_getaffinity(0))
    heads += [
        ("ours MiB", 10),
        ("duck MiB", 10),
        ("ours cpu", 10),
        ("duck cpu", 10),
        ("cpu/cores x duck", 18),
    ]
    print(f"{'run':<14}" + "".join(f"{h:>{w}}" for h, w in heads))
    for r in table:
        ours = r["metriclog_s"]
        print(
            f"{r['run']:<14}{ours:>8.2f}{r['duckdb_s']:>10.2f}{ours / r['duckdb_s']:>9.2f}x"
            f"{r['floor_s']:>9.2f}{ours / r['floor_s']:>8.2f}x"
            f"{r['metriclog_mib']:>10.0f}{r['duckdb_mib']:>10.0f}"
            f"{r['metriclog_cpu']:>10.2f}{r['duckdb_cpu']:>10.2f}"
            f"{r['metriclog_cpu'] / cores / r['duckdb_s']:>17.2f}x"
        )
    print(
        f"cpu: user + system seconds of the whole process; cpu/cores x duck: our CPU spread over the"
        f" {cores} cores without a loss, against DuckDB's wall (the least wall time our work could take)"
    )
    if not args.skip_modes:
        found = []
        for name, run, _ in runs:
            if name.startswith(("foreign", "own")):
                big = name.endswith("100M")
                found += modes(run, name, args.dir, quantiles=not (big and args.skip_100M_quantiles))
        print("\npeak RSS (MiB) and wall (s) by mode, one run each")
        print(f"{'mode':<30}" + "".join(f"{n:>22}" for n, _, _ in runs if n.startswith(("foreign", "own"))))
        for mode in dict.fromkeys(r["mode"] for r in found):
            cells = {r["run"]: r for r in found if r["mode"] == mode}
            line = "".join(
                f"{cells[n]['mib']:>12.0f} MiB {cells[n]['s']:>5.1f}s" if n in cells else f"{'-':>22}"
                for n, _, _ in runs
                if n.startswith(("foreign", "own"))
            )
            print(f"{mode:<30}{line}")
        for r in found:
            if "off" in r:
                verdict = "agrees" if r["off"] <= 1e-12 else "DISAGREES"
                print(
                    f"{r['run']}: *=p99 {verdict} with DuckDB's quantile_cont"
                    f" (max relative difference {r['off']:.1e})"
                )
    same = identical(runs[0][1], args.dir)
    print(f"\nper_rank_reduce output digests (2 threads, 2 threads, 1 thread): {' '.join(same)}")
    print("bit-identical" if len(set(same)) == 1 else "NOT bit-identical")


if __name__ == "__main__":
    main()
