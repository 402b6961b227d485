"""A run read from object storage against the same run on local disk (issue 16).

The same `metriclog` command on `s3://bench/RUN` (moto's S3 server, started here on
localhost, a Python process: slower per request than a real store, no network between)
and on the local copy: `reduce --out` (global_reduce, and per_rank_reduce with p99) and
`inspect --json` (what the first poll of `watch` reads), and what a later poll of an
unchanged run costs. Each a whole process, --repeats rounds
interleaved, medians; the output files compared byte for byte; the requests each command
made, counted from the server's log. Runs (in --dir, made once): another tool's Parquet
(bench_engine.py's foreign_20M: 32 files, 20M rows) and the writer's (bench_reduce.py's
parquet_20M).

Usage: python benchmarks/bench_storage.py [--repeats 3] [--dir bench_out]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_engine import foreign_run
from bench_reduce import generate, timed

from tests.s3_server import KEYS, s3_server

METRICLOG = str(Path(sys.executable).with_name("metriclog"))
P99 = ["--mode", "per_rank_reduce", "--reduce", "*=p99"]
COMMANDS = {  # label: the command's words after RUN ({out}: a file of this round)
    "reduce global_reduce": ["reduce", "--out", "{out}.parquet"],
    "reduce per_rank p99": ["reduce", *P99, "--out", "{out}.parquet"],
    "inspect --json": ["inspect", "--json"],
}


def requests_during(log, action) -> Counter[str]:
    """Call ``action``; the server's requests meanwhile, by HTTP method."""
    log.seek(0, os.SEEK_END)
    start = log.tell()
    action()
    log.flush()
    log.seek(start)
    plain = (re.sub(r"\x1b\[[0-9;]*m", "", line) for line in log)  # the server colours some lines
    return Counter(line.split('"')[1].split()[0] for line in plain if line.count('"') >= 2)


def said(requests: Counter[str]) -> str:
    return f"{sum(requests.values()):>9} ({' '.join(f'{k} {v}' for k, v in sorted(requests.items()))})"


def poll_cost(url: str, log) -> str:
    """What each poll of `watch` asks of the store once the run is known: the second of
    two `inspect` readings sharing watch's cache, the run unchanged in between."""
    from metric_core.offline.inspect import inspect_run

    cache: dict = {}
    inspect_run(url, cache=cache)
    began = time.perf_counter()
    made = requests_during(log, lambda: inspect_run(url, cache=cache))
    return f"{time.perf_counter() - began:.2f} s, requests {said(made)}"


def measure(name: str, run: Path, words: list[str], tmp: str, log, repeats: int) -> str:
    walls: dict[str, list[float]] = {"local": [], "s3": []}
    outs: dict[str, str] = {}
    requests: Counter[str] = Counter()
    for _ in range(repeats):
        for where, location in (("local", str(run)), ("s3", f"s3://bench/{name}")):
            out = Path(tmp) / where
            command = [METRICLOG, words[0], location, *(w.format(out=out) for w in words[1:])]
            start = time.perf_counter()
            if where == "s3":
                requests += requests_during(log, lambda command=command: timed(command))
            else:
                timed(command)
            walls[where].append(time.perf_counter() - start)
            if "--out" in words:
                outs[where] = hashlib.sha256(Path(f"{out}.parquet").read_bytes()).hexdigest()
    local, s3 = statistics.median(walls["local"]), statistics.median(walls["s3"])
    same = ("yes" if outs["local"] == outs["s3"] else "NO") if outs else "-"
    per_run = Counter({k: v // repeats for k, v in requests.items()})
    return f"{local:>8.2f} {s3:>7.2f} {s3 / local:>8.2f}x {same:>4} {said(per_run)}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="bench_out")
    args = parser.parse_args()
    root = Path(args.dir)
    root.mkdir(exist_ok=True)
    runs = {"foreign_20M": foreign_run(root, 20_000_000), "own_20M": generate(root, "20M")}
    with (
        tempfile.TemporaryDirectory() as tmp,
        open(Path(tmp) / "server.log", "w+") as log,
        s3_server(log=log) as endpoint,
    ):
        os.environ.update(KEYS, AWS_ENDPOINT_URL=endpoint)
        import boto3

        client = boto3.client("s3")
        client.create_bucket(Bucket="bench")
        for name, run in runs.items():
            for path in sorted(run.glob("*")):
                if path.is_file() and not path.name.startswith("."):
                    client.upload_file(str(path), "bench", f"{name}/{path.name}")
        print(f"moto's S3 server on localhost against local disk; medians of {args.repeats}")
        print(f"{'run':<12} {'command':<22} {'local s':>8} {'s3 s':>7} {'s3/local':>9} same {'requests':>9}")
        for name, run in runs.items():
            size = sum(p.stat().st_size for p in run.glob("*.parquet")) / 2**20
            files = len(list(run.glob("*.parquet")))
            print(f"{name}: {files} Parquet files, {size:.0f} MiB")
            for label, words in COMMANDS.items():
                print(f"{name:<12} {label:<22} {measure(name, run, words, tmp, log, args.repeats)}")
            print(f"{name:<12} a watch poll, unchanged: {poll_cost(f's3://bench/{name}', log)}")


if __name__ == "__main__":
    main()
