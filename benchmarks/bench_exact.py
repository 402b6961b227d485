"""The exact kernel (``metric_core.offline.engine.exact``) against the float states it replaced.

Data: --rows values (normal(10, 3), as bench_engine.py's foreign run) in --groups groups,
laid out as 32 files would hold them (each file every group in order, rows-a-group / 32
rows of each), cut in partitions of --partition rows, each numbering its own groups (as
``partials.partition_states`` does; that numbering is not timed).

Each stage, medians of --repeats rounds, every way side by side in each round:

  accumulate   rows to states: the exact state (sums only, and with squares), on the
               compiled path (``_exact.c``) and on the pure numpy one, against float64
               bincounts, the sum alone (one bincount) and the engine's state before
               it (``float_state`` here, the engine's until 2026-12-06: raw, shift, dev and
               sq, three bincounts), and against
               DuckDB's GROUP BY over the same arrays in memory (an Arrow table, no
               file): sum alone, and sum, avg and stddev_pop, on 1 thread and on 2
               -- in one call over every row, and a call a partition
  merge        every partition's state into the groups' numbering: ``combine`` at once
               and ``merge`` one partition after another (the accumulator's fold),
               against the float states' fold (``float_fold``, mapped the same way)
  finish       sum, mean and std of every group: exact against ``float_statistic``

Figures are nanoseconds a row (a group, for finish), of wall time and of the process's CPU
time (on a loaded machine the CPU time moves less), and ratios: ``x float`` is the time
over the float state's (``float_state``, or the float fold and finish), ``x duckdb``
over DuckDB's 1-thread GROUP BY sum (the accumulate stages in one call). The compiled
path runs on one thread.

Usage: python benchmarks/bench_exact.py [--rows 20000000] [--groups 62500]
                                        [--partition 125000] [--repeats 5]
(METRICLOG_PURE=1 leaves the compiled path out.)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import duckdb
import numpy as np
import pyarrow as pa

from metric_core.offline.engine import exact

# The float states the engine folded before its sums were exact (2026-12-06): count, raw
# sum, shift (raw / n), dev = sum(v - shift), sq = sum((v - shift)**2), re-centred on fold.
N, RAW, SHIFT, DEV, SQ = range(5)


def data(
    rows: int, groups: int, partition: int
) -> tuple[np.ndarray, np.ndarray, list[tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    per_file = rows // 32
    each = max(1, per_file // groups)
    file_groups = np.repeat(np.arange(groups), each)[:per_file]
    g = np.tile(file_groups, 32)
    v = np.random.default_rng(0).normal(10.0, 3.0, len(g))
    parts = []
    for start in range(0, len(g), partition):
        pg = g[start : start + partition]
        mine, local = np.unique(pg, return_inverse=True)
        parts.append((mine, local.astype(np.int64), v[start : start + partition]))
    return g, v, parts


def float_state(local: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    state = np.zeros((5, n))
    count = state[N] = np.bincount(local, minlength=n)
    raw = np.bincount(local, weights=values, minlength=n)
    with np.errstate(invalid="ignore", divide="ignore"):
        shift = raw / count
    shift[~np.isfinite(shift)] = 0.0
    dev_each = values - shift[local]
    state[RAW], state[SHIFT] = raw, shift
    state[DEV] = np.bincount(local, weights=dev_each, minlength=n)
    state[SQ] = np.bincount(local, weights=dev_each * dev_each, minlength=n)
    return state


def float_fold(a: np.ndarray, p: np.ndarray) -> np.ndarray:
    k = np.where(a[N] == 0, p[SHIFT], a[SHIFT])
    offset = p[SHIFT] - k
    a[SHIFT] = k
    a[N] += p[N]
    a[RAW] += p[RAW]
    a[SQ] += p[SQ] + 2 * offset * p[DEV] + p[N] * offset * offset
    a[DEV] += p[DEV] + p[N] * offset
    return a


def float_statistic(s: np.ndarray, name: str) -> np.ndarray:
    n, dev, base, raw = s[N], s[DEV], s[SHIFT], s[RAW]
    with np.errstate(invalid="ignore", divide="ignore"):
        if name == "sum":
            return np.where(np.isfinite(raw), n * base + dev, raw)
        if name == "mean":
            return np.where(np.isfinite(raw), base + dev / n, raw / n)
        var = np.maximum((s[SQ] - dev * dev / n) / n, 0.0)
        return np.where(np.isfinite(raw), np.sqrt(var), np.nan)


def duckdb_group_by(g: np.ndarray, v: np.ndarray, threads: int, select: str) -> Callable[[], object]:
    """DuckDB's GROUP BY g over the arrays as an in-memory Arrow table, the result fetched."""
    con = duckdb.connect()
    con.execute(f"SET threads = {threads}")
    con.register("rows", pa.table({"g": g, "v": v}))
    query = f"SELECT g, {select} FROM rows GROUP BY g"
    return lambda: con.execute(query).fetchnumpy()


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall seconds, and the process's CPU seconds (every thread's: DuckDB's 2 threads count
    twice), of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000_000)
    parser.add_argument("--groups", type=int, default=62_500)
    parser.add_argument("--partition", type=int, default=125_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    g, v, parts = data(args.rows, args.groups, args.partition)
    n_groups, rows = args.groups, len(g)
    print(f"{rows:,} rows, {n_groups:,} groups, {len(parts)} partitions of {args.partition:,} rows")

    exact_parts = [exact.accumulate(local, vals, len(mine)) for mine, local, vals in parts]
    float_parts = [float_state(local, vals, len(mine)) for mine, local, vals in parts]
    whole = exact.combine(exact_parts, [mine for mine, _, _ in parts], n_groups)
    folded = np.zeros((5, n_groups))
    for (mine, _, _), p in zip(parts, float_parts, strict=True):
        folded[:, mine] = float_fold(folded[:, mine], p)

    def fold_exact() -> None:
        acc = exact.ExactState.empty(n_groups)
        for (mine, _, _), p in zip(parts, exact_parts, strict=True):
            acc = exact.merge(acc, p, mine)

    def fold_float() -> None:
        acc = np.zeros((5, n_groups))
        for (mine, _, _), p in zip(parts, float_parts, strict=True):
            acc[:, mine] = float_fold(acc[:, mine], p)

    def each_part(fn: Callable[[np.ndarray, np.ndarray, int], object]) -> Callable[[], object]:
        return lambda: [fn(local, vals, len(mine)) for mine, local, vals in parts]

    def float_sum(local: np.ndarray, vals: np.ndarray, n: int) -> np.ndarray:
        return np.bincount(local, weights=vals, minlength=n)

    native = exact._native
    if native is None:
        print("the compiled path is not in use (not built, or METRICLOG_PURE): its rows are left out")

    def on(path: str, fn: Callable[..., object]) -> Callable[..., object]:
        def run(*args: object, **kwargs: object) -> object:
            exact._native = native if path == "compiled" else None
            try:
                return fn(*args, **kwargs)
            finally:
                exact._native = native

        return run

    def exact_sums(local: np.ndarray, vals: np.ndarray, n: int) -> exact.ExactState:
        return exact.accumulate(local, vals, n, squares=False)

    paths = ["numpy"] if native is None else ["compiled", "numpy"]
    full = "sum(v), avg(v), stddev_pop(v)"
    peers: dict[str, tuple[int, Callable[[], object]]] = {
        "accumulate, one call: duckdb GROUP BY sum, 1 thread": (rows, duckdb_group_by(g, v, 1, "sum(v)")),
        "accumulate, one call: duckdb GROUP BY sum, 2 threads": (rows, duckdb_group_by(g, v, 2, "sum(v)")),
        "accumulate, one call: duckdb GROUP BY sum+avg+stddev_pop, 1 thread": (
            rows, duckdb_group_by(g, v, 1, full),
        ),
        "accumulate, one call: duckdb GROUP BY sum+avg+stddev_pop, 2 threads": (
            rows, duckdb_group_by(g, v, 2, full),
        ),
    }  # fmt: skip
    one_call: dict[str, tuple[int, Callable[[], object]]] = {}
    per_part: dict[str, tuple[int, Callable[[], object]]] = {}
    for path in paths:
        for what, fn in (("sums only", on(path, exact_sums)), ("with squares", on(path, exact.accumulate))):
            one_call[f"accumulate, one call: exact {path}, {what}"] = (rows, lambda f=fn: f(g, v, n_groups))
            per_part[f"accumulate, a call a partition: exact {path}, {what}"] = (rows, each_part(fn))

    stages: dict[str, tuple[int, Callable[[], object]]] = {
        "accumulate, one call: float sum (1 bincount)": (rows, lambda: float_sum(g, v, n_groups)),
        "accumulate, one call: float state (float_state)": (rows, lambda: float_state(g, v, n_groups)),
        **one_call,
        **peers,
        "accumulate, a call a partition: float sum (1 bincount)": (rows, each_part(float_sum)),
        "accumulate, a call a partition: float state (float_state)": (rows, each_part(float_state)),
        **per_part,
        "merge, a partition after another: float (float_fold)": (rows, fold_float),
        "merge, a partition after another: exact (merge)": (rows, fold_exact),
        "merge, all at once: exact (combine)": (
            rows, lambda: exact.combine(exact_parts, [mine for mine, _, _ in parts], n_groups),
        ),
        "finish sum+mean+std: float (float_statistic)": (
            n_groups, lambda: [float_statistic(folded, name) for name in ("sum", "mean", "std")],
        ),
        "finish sum+mean+std: exact": (n_groups, lambda: (whole.sum(), whole.mean(), whole.std())),
    }  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in stages}
    for _ in range(args.repeats):
        for name, (_, fn) in stages.items():
            times[name].append(timed(fn))
    medians = {name: statistics.median(w for w, _ in t) for name, t in times.items()}
    cpu = {name: statistics.median(c for _, c in t) for name, t in times.items()}
    duck = "accumulate, one call: duckdb GROUP BY sum, 1 thread"
    print(
        f"{'stage':72s} {'median s':>8s} {'ns a row':>8s} {'cpu ns':>8s} {'x float':>7s} "
        f"{'x duckdb':>8s} {'cpu x duckdb':>12s}"
    )
    for name, (count, _) in stages.items():
        kind, way = name.split(": ")
        base = next((medians[f"{kind}: {w}"] for w in (
            "float state (float_state)", "float (float_fold)", "float (float_statistic)",
        ) if f"{kind}: {w}" in medians), None)  # fmt: skip
        ratio = f"{medians[name] / base:7.2f}" if base and "float" not in way else ""
        one = kind == "accumulate, one call"
        versus = f"{medians[name] / medians[duck]:8.2f}" if one else ""
        cpu_versus = f"{cpu[name] / cpu[duck]:12.2f}" if one else ""
        per, cpu_per = medians[name] / count * 1e9, cpu[name] / count * 1e9
        unit = "(a group)" if kind.startswith("finish") else ""
        print(
            f"{name:72s} {medians[name]:8.3f} {per:8.1f} {cpu_per:8.1f} {ratio:>7s} "
            f"{versus:>8s} {cpu_versus:>12s} {unit}"
        )
    exact_sum, float_sum = whole.sum(), float_statistic(folded, "sum")
    differ = int((exact_sum != float_sum).sum())
    print(f"groups whose float-state sum differs from the correctly rounded one: {differ:,}")


if __name__ == "__main__":
    main()
