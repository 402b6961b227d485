"""Peak memory on inputs of a hostile shape (issues 31 and 41): keys, inspect, samples and
the reducing modes, each in its own process, against the 1.5 GiB target.

Inputs (in --dir, made once by pyarrow directly: another tool's files, never metric_core's
writer; the record schema of docs/format.md, 4 ranks, keys of 30-60 characters, a few
values NaN or infinite):

  rows_50M     one Parquet file of 50M records of 4 sources (interleaved), 20 keys,
               625,000 steps; strings dictionary-encoded (pyarrow's default)
  keys_10M     4 Parquet files (one a rank) of 2.5M records, every record its own key
               (10M distinct keys), one step
  keys_10M_dict  one Parquet file of the same 10M records of 4 ranks, its key column an
               Arrow dictionary (polars reads it as Categorical)
  line_200MB   one JSON line of 200 MB (a string value), beside a good record (issue 31)
  own_5M       5M records of metric_core's own writer (4 ranks, 20 keys, 62,500 steps): what
               keys answers from the segments' metadata (--only own_5M)

Each command runs --runs times (medians; peak RSS is the command's own, from the kernel's
accounting of the waited-for child: ``resource.getrusage(RUSAGE_CHILDREN)`` in a fresh
wrapper process per run). A command that fails is shown with its exit status and its last
line of stderr: running out of memory is a result here, not an error of the script. A table
per input puts the commands side by side, with each command's peak and time as a ratio of
``reduce``'s (global_reduce) on the same files.

Usage: python benchmarks/bench_memory.py [--dir bench_out/memory] [--runs 3]
       [--only rows_50M,keys_10M,keys_10M_dict] [--commands keys,inspect,...] [--metriclog PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

LIMIT_MIB = 1536
CAP_MIB = 12 * 1024
COMMANDS = {
    "keys": ["keys", "{run}", "--out", "{out}.parquet"],
    "global_reduce": ["reduce", "{run}", "--out", "{out}.parquet"],
    "per_rank_reduce": ["reduce", "{run}", "--mode", "per_rank_reduce", "--out", "{out}.parquet"],
    "per_rank_no_reduce": ["reduce", "{run}", "--mode", "per_rank_no_reduce", "--out", "{out}.parquet"],
    "inspect": ["inspect", "{run}", "--json"],
    "samples": ["samples", "{run}", "--format", "json"],
}
RANKS = 4
CHUNK = 1_000_000  # records written at a time (a row group each)

# A child that runs one command and reports its peak RSS and wall time: RUSAGE_CHILDREN of a
# process whose only child is the command is that command's own peak.
MEASURE_CHILD = """
import json, resource, subprocess, sys, time
cap = int(sys.argv[1])
def limit():
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
start = time.perf_counter()
proc = subprocess.run(
    sys.argv[2:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=limit
)
wall = time.perf_counter() - start
rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
lines = [line for line in proc.stderr.splitlines() if line.strip()]
note = lines[-1][:60] if lines else ""
print(json.dumps({"wall": wall, "rss": rss, "code": proc.returncode, "note": note}))
"""


def _keys(ids: np.ndarray, tag: str) -> list[str]:
    """A key of 30-60 characters for each id: distinct ids give distinct keys."""
    pad = "abcdefghijklmnopqrstuvwxyz0123456789"
    return [f"{tag}/rollout/reward/sample_{i:010d}/{pad[: int(i * 7919 % 22)]}" for i in ids]


def _table(keys: object, ranks: np.ndarray, steps: np.ndarray, seed: int) -> object:
    import pyarrow as pa

    n = len(ranks)
    rng = np.random.default_rng(seed)
    value = rng.normal(size=n)
    value[::100_003] = np.nan
    value[7::1_000_003] = np.inf
    reductions = pa.DictionaryArray.from_arrays(
        pa.array((np.arange(n) % 20 % 5).astype(np.int32)), pa.array(["mean", "sum", "max", "min", "std"])
    )
    processes = pa.DictionaryArray.from_arrays(
        pa.array(ranks.astype(np.int32)), pa.array([f"TrainActor_r{r}" for r in range(RANKS)])
    )
    return pa.table(
        {
            "key": keys,
            "value": pa.array(value),
            "reduction": reductions.cast(pa.string()),
            "step": pa.array(steps),
            "timestamp": pa.array(1.76e9 + steps * 0.01 + ranks * 0.001),
            "rank": pa.array(ranks),
            "process": processes.cast(pa.string()),
        }
    )


def make(root: Path, name: str) -> Path:
    """The input ``name`` under ``root``, made unless it is there."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    run = root / name
    done = run / ".complete"
    if done.exists():
        return run
    run.mkdir(parents=True, exist_ok=True)
    print(f"making {run} (once)", file=sys.stderr, flush=True)
    if name == "rows_50M":
        names = _keys(np.arange(20), "train")
        per_step = 20 * RANKS
        with pq.ParquetWriter(
            run / "rows.parquet",
            _table(pa.array(["k"]), np.zeros(1, np.int64), np.zeros(1, np.int64), 0).schema,
        ) as w:
            for part in range(50):
                n = CHUNK
                at = np.arange(part * n, (part + 1) * n, dtype=np.int64)
                steps, rest = at // per_step, at % per_step
                ranks = rest // 20
                keys = pa.DictionaryArray.from_arrays(pa.array((rest % 20).astype(np.int32)), pa.array(names))
                w.write_table(_table(keys.cast(pa.string()), ranks, steps, part))
    elif name in ("keys_10M", "keys_10M_dict"):
        per_rank = 10_000_000 // RANKS
        writer = None
        for rank in range(RANKS):
            if name == "keys_10M":
                writer = pq.ParquetWriter(run / f"rank{rank}.parquet", _schema(dictionary=False))
            elif writer is None:
                writer = pq.ParquetWriter(run / "keys.parquet", _schema(dictionary=True))
            for part in range(0, per_rank, CHUNK):
                n = min(CHUNK, per_rank - part)
                ids = np.arange(rank * per_rank + part, rank * per_rank + part + n)
                if name == "keys_10M_dict":  # 4 ranks interleaved in one file: a rank per record
                    ids = ids[np.argsort(ids % RANKS, kind="stable")]  # still distinct
                    ranks = (ids % RANKS).astype(np.int64)
                else:
                    ranks = np.full(n, rank, np.int64)
                keys: object = pa.array(_keys(ids, "eval"))
                if name == "keys_10M_dict":
                    keys = pa.DictionaryArray.from_arrays(pa.array(np.arange(n, dtype=np.int32)), keys)
                writer.write_table(
                    _table(keys, ranks, np.zeros(n, np.int64), int(ids[0])).cast(writer.schema)
                )
            if name == "keys_10M":
                writer.close()
        if name == "keys_10M_dict":
            writer.close()
    elif name == "own_5M":
        _own(run, 5_000_000)
    else:
        with open(run / "big.jsonl", "w") as f:
            f.write('{"key":"k","value":1.0,"reduction":"mean","step":0,"timestamp":1.76e9,"rank":0}\n')
            f.write('{"key":"k","value":"' + "9" * 200_000_000 + '","reduction":"mean","step":1,')
            f.write('"timestamp":1.76e9,"rank":0}\n')
    done.touch()
    return run


def _own(run: Path, records: int) -> None:
    """``records`` of 4 ranks written by metric_core's writer, 20 keys a step a rank."""
    from metric_core import Metric, MetricCollector, Reduce

    names = _keys(np.arange(20), "train")
    reductions = [Reduce.MEAN, Reduce.SUM, Reduce.MAX, Reduce.MIN, Reduce.STD]
    rng = np.random.default_rng(0)
    steps = records // (RANKS * len(names))
    for rank in range(RANKS):
        c = MetricCollector(run, rank=rank, process_name=f"TrainActor_r{rank}")
        values = rng.normal(size=(steps, len(names))).tolist()
        for step in range(steps):
            at = 1.76e9 + step * 0.01 + rank * 0.001
            for i, key in enumerate(names):
                c.push(Metric(key, values[step][i], reductions[i % 5], at))
            c.flush(step)
        c.shutdown()


def _schema(*, dictionary: bool) -> object:
    import pyarrow as pa

    key = pa.dictionary(pa.int32(), pa.string()) if dictionary else pa.string()
    return pa.schema(
        [
            ("key", key),
            ("value", pa.float64()),
            ("reduction", pa.string()),
            ("step", pa.int64()),
            ("timestamp", pa.float64()),
            ("rank", pa.int64()),
            ("process", pa.string()),
        ]
    )


def measure(metriclog: str, run: Path, command: list[str], out: Path) -> dict[str, object]:
    args = [a.format(run=run, out=out) for a in command]
    # An address-space cap well above the target, so a command that would take the machine's
    # memory fails here instead (it shows as a failure with the peak it reached).
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE_CHILD, str(CAP_MIB << 20), metriclog, *args],
        capture_output=True,
        text=True,
        check=True,
    )
    for path in out.parent.glob(out.name + "*"):
        path.unlink()
    found: dict[str, object] = json.loads(proc.stdout)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("bench_out") / "memory")
    parser.add_argument("--only", default="rows_50M,keys_10M,keys_10M_dict")
    parser.add_argument("--commands", default=",".join(COMMANDS))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--metriclog", default=str(Path(sys.executable).with_name("metriclog")))
    args = parser.parse_args()
    unknown = sorted(set(args.commands.split(",")) - set(COMMANDS))
    if unknown:
        parser.error(f"--commands: no command {', '.join(unknown)}; the commands are {', '.join(COMMANDS)}")
    args.dir.mkdir(parents=True, exist_ok=True)
    print(f"{args.metriclog}: peak RSS (MiB) and wall time (s) of each command, medians of {args.runs}")
    print(f"target: at most {LIMIT_MIB} MiB; 'x reduce': the ratio to global_reduce on the same files")
    for name in args.only.split(","):
        run = make(args.dir, name)
        wanted = args.commands.split(",")
        if name == "line_200MB":
            wanted = [c for c in wanted if c in ("inspect", "global_reduce", "keys")]
        rows = {}
        for label in wanted:
            runs = [
                measure(args.metriclog, run, COMMANDS[label], args.dir / f"out-{name}-{label}")
                for _ in range(args.runs)
            ]
            rows[label] = {
                "rss": statistics.median(float(r["rss"]) for r in runs),  # type: ignore[arg-type]
                "rss_range": (min(float(r["rss"]) for r in runs), max(float(r["rss"]) for r in runs)),  # type: ignore[arg-type]
                "wall": statistics.median(float(r["wall"]) for r in runs),  # type: ignore[arg-type]
                "codes": sorted({int(r["code"]) for r in runs}),  # type: ignore[call-overload]
                "note": next((str(r["note"]) for r in runs if r["code"]), ""),
            }
        base = rows.get("global_reduce")
        print(f"\n{name}")
        print(f"  {'command':<17}{'peak MiB':>10}{'(min-max)':>14}{'wall s':>9}{'x reduce':>16}  exit  note")
        for label, r in rows.items():
            ratio = ""
            if base is not None and base["codes"] == [0] and r["codes"] == [0]:
                ratio = f"{r['rss'] / base['rss']:.2f} / {r['wall'] / base['wall']:.2f}"
            lo, hi = r["rss_range"]
            over = "" if r["codes"] == [0] and r["rss"] <= LIMIT_MIB else "  OVER"
            codes = ",".join(map(str, r["codes"]))
            print(
                f"  {label:<17}{r['rss']:>10.0f}{f'({lo:.0f}-{hi:.0f})':>14}{r['wall']:>9.1f}{ratio:>16}"
                f"  {codes:>4}  {r['note']}{over}",
                flush=True,
            )


if __name__ == "__main__":
    main()
