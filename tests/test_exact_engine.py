"""The engine's sums, means and stds are exact, and its results the same bits however the
records are split.

Another tool's records (Parquet written with pyarrow and polars, not metriclog's writer)
of values that rounding trips on: integer counts, decimal fractions, values on a 1e12
offset, 1e-9 scales, subnormals, values near 1e300 and past the range's half, mixed
signs and cancellation, -0.0, NaN and infinities. Every sum, mean and std of every group
of ``global_reduce`` and ``per_rank_reduce``, by step and by time, is checked bit for bit
against ``fractions``: the exact sum, the exact sum over the count, and the square root
of the exact population variance (``tests.test_exact.root``: ``math.isqrt``, then settled
on the midpoints), each correctly rounded. Then the same records split into 1, 3 and 7
files a rank, with other names and their rows shuffled, reduced on 1 and 2 threads, in
partitions of other sizes: every value of every mode has the same bits, min, max, first,
last and the percentiles too (first and last ties broken by content). Both tests run on
the compiled path and the pure numpy one (``METRICLOG_PURE``), which give the same bits.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from metric_core.offline.engine import reduce_run
from tests.test_exact import COMPILED, kernel_of, root, rounded

ROOT = Path(__file__).resolve().parent.parent
BASE_TIME = 1_700_000_000.0
RANKS = 4
STEPS = 6
PER_STEP = 2  # records of one key a rank a step
EVERY = 2.5  # --by time windows: two or three steps each
STATS = ("sum", "mean", "std")


def _family(rng: np.random.Generator, name: str, n: int) -> np.ndarray:
    sign = rng.choice([-1.0, 1.0], n)
    if name == "counts":
        return rng.integers(0, 5000, n).astype(np.float64)
    if name == "fractions":  # 0.1 .. 0.9: none is what it says
        return rng.integers(1, 10, n) / 10
    if name == "offset":
        return 1e12 + rng.normal(0.0, 1.0, n)
    if name == "nano":
        return rng.normal(0.0, 1.0, n) * 1e-9
    if name == "subnormal":
        return rng.integers(1, 1 << 20, n) * 5e-324 * sign
    if name == "huge":
        return rng.uniform(0.5, 1.7, n) * 1e300 * sign
    if name == "edge":  # sums past the range round to +-inf; squares far past it
        return rng.choice([1.7e308, -1.7e308, 1e308, 8.9e307], n)
    if name == "cancel":
        return rng.choice([1e16, -1e16, 1.0, -1.0, 3.14, 2.0**-60], n)
    if name == "zeros":
        return rng.choice([-0.0, -0.0, -0.0, 0.0], n)
    if name == "nonfinite":
        v = rng.normal(5.0, 2.0, n)  # step 0 a NaN, 1 +inf, 2 -inf, 3 both, the others none
        v[[0, 2, 4, 6, 7]] = [np.nan, np.inf, -np.inf, np.inf, -np.inf]
        return v
    raise AssertionError(name)


FAMILIES = (
    "counts", "fractions", "offset", "nano", "subnormal", "huge", "edge", "cancel", "zeros", "nonfinite",
)  # fmt: skip
OTHERS = ("min", "max", "first", "last", "median", "p99")  # only in the split test


def records(seed: int, others: bool = False) -> pl.DataFrame:
    """Every record of the run: key ``family/stat``, its stat as its reduction. Records of
    a step share its timestamp (ties for first and last everywhere)."""
    rng = np.random.default_rng(seed)
    stats = STATS + (OTHERS if others else ())
    frames = []
    for rank in range(RANKS):
        for family in FAMILIES:
            for stat in stats:
                n = STEPS * PER_STEP
                step = np.repeat(np.arange(STEPS, dtype=np.int64), PER_STEP)
                frames.append(
                    pl.DataFrame(
                        {
                            "key": [f"{family}/{stat}"] * n,
                            "value": _family(rng, family, n),
                            "reduction": [stat] * n,
                            "step": step,
                            "timestamp": BASE_TIME + step.astype(np.float64),
                            "rank": np.full(n, rank, dtype=np.int64),
                            "process": [f"host-{'ab'[rank // 2]}"] * n,
                        }
                    )
                )
    return pl.concat(frames)


def write(df: pl.DataFrame, path: Path, *, with_polars: bool = False) -> None:
    """Parquet as another tool writes it (strings dictionary-encoded)."""
    if with_polars:
        df.with_columns(pl.col("key", "reduction", "process").cast(pl.Categorical)).write_parquet(path)
        return
    table = df.to_arrow()
    for name in ("key", "reduction", "process"):
        at = table.column_names.index(name)
        table = table.set_column(at, name, pc_dictionary(table[name]))
    pq.write_table(table, path)


def pc_dictionary(column: pa.ChunkedArray) -> pa.ChunkedArray:
    return column.cast(pa.string()).dictionary_encode()


# --- the oracle ------------------------------------------------------------------------


def expected(values: list[float], stat: str) -> float:
    """sum, mean or population std of ``values``, from ``fractions``, correctly rounded."""
    if any(math.isnan(v) for v in values) or (math.inf in values and -math.inf in values):
        return math.nan
    if math.inf in values or -math.inf in values:
        return math.nan if stat == "std" else (math.inf if math.inf in values else -math.inf)
    exact = [Fraction(v) for v in values]
    n = len(exact)
    total = sum(exact, Fraction(0))
    if stat == "sum":
        return rounded(total)
    if stat == "mean":
        return rounded(total / n)
    return root(sum(((x - total / n) ** 2 for x in exact), Fraction(0)) / n)


def truth(df: pl.DataFrame, mode: str, by: str) -> dict[tuple, tuple[float, int]]:
    """Each group's expected (value, count): groups of (process, rank,) bucket and key."""
    t0 = df["timestamp"].min()
    out: dict[tuple, list[float]] = {}
    for key, value, step, ts, rank, process in df.select(
        "key", "value", "step", "timestamp", "rank", "process"
    ).iter_rows():
        bucket = t0 + math.floor((ts - t0) / EVERY) * EVERY if by == "time" else step
        source = (process, rank) if mode == "per_rank_reduce" else ()
        out.setdefault((*source, bucket, key), []).append(value)
    return {g: (expected(v, g[-1].split("/")[1]), len(v)) for g, v in out.items()}


def bits(x: float) -> int:
    return int(np.float64(x).view(np.int64))


def same_bits(got: float, want: float) -> bool:
    return (math.isnan(got) and math.isnan(want)) or bits(got) == bits(want)


@pytest.mark.parametrize("kernel", ["compiled", "numpy"])
@pytest.mark.parametrize("by", ["step", "time"])
@pytest.mark.parametrize("mode", ["global_reduce", "per_rank_reduce"])
def test_every_sum_mean_and_std_is_the_correctly_rounded_exact_value(tmp_path, mode, by, kernel):
    df = records(seed=11)
    for rank in range(RANKS):  # one file a rank, half of them written by polars
        write(df.filter(pl.col("rank") == rank), tmp_path / f"rank{rank}.parquet", with_polars=rank % 2 == 1)
    options = {"every": EVERY} if by == "time" else {}
    with kernel_of(kernel):
        got = reduce_run(tmp_path, mode=mode, by=by, **options)
    want = truth(df, mode, by)
    bucket = "window_start" if by == "time" else "step"
    source = ["process", "rank"] if mode == "per_rank_reduce" else []
    rows = got.select(*source, bucket, "key", "value", "count").iter_rows()
    found = {tuple(r[:-2]): (r[-2], r[-1]) for r in rows}
    assert set(found) == set(want)
    wrong = [
        (g, found[g][0], want[g][0])
        for g in sorted(want, key=str)
        if not same_bits(found[g][0], want[g][0]) or found[g][1] != want[g][1]
    ]
    assert not wrong, f"{len(wrong)} of {len(want)} groups not the correctly rounded value: {wrong[:8]}"
    # each family's groups are all there and the hard cases are hit (not vacuous)
    assert any(math.isinf(v) for g, (v, _) in want.items() if g[-1] == "edge/sum")
    assert any(v == 0 and g[-1] == "zeros/sum" for g, (v, _) in want.items())
    assert any(math.isnan(v) for g, (v, _) in want.items() if g[-1] == "nonfinite/mean")
    assert any(math.isfinite(v) for g, (v, _) in want.items() if g[-1] == "nonfinite/std")


def test_an_integer_sum_is_that_integer(tmp_path):
    """Token counts of one step, three a rank in four files (the float states gave
    31425.999999999996)."""
    counts = [
        [2210.0, 2521.0, 335.0],
        [5080.0, 2864.0, 8151.0],
        [2990.0, 898.0, 644.0],
        [4067.0, 327.0, 1339.0],
    ]
    for rank, mine in enumerate(counts):
        n = len(mine)
        write(
            pl.DataFrame(
                {
                    "key": ["tokens"] * n,
                    "value": mine,
                    "reduction": ["sum"] * n,
                    "step": [0] * n,
                    "timestamp": [BASE_TIME] * n,
                    "rank": [rank] * n,
                    "process": ["p"] * n,
                }
            ),
            tmp_path / f"rank{rank}.parquet",
        )
    got = reduce_run(tmp_path)["value"].to_list()
    assert got == [float(sum(int(v) for mine in counts for v in mine))] == [31426.0]


# --- the same bits however the records are split ---------------------------------------

_REDUCE = (
    """
import json, sys
import polars as pl
from metric_core.offline.engine import exact, tasks, reduce_run
tasks.PARTITION_ROWS = int(sys.argv[2])
out = {}
for mode in ("global_reduce", "per_rank_reduce"):
    for by in ("step", "time"):
        options = {"every": %r} if by == "time" else {}
        frame = reduce_run(sys.argv[1], mode=mode, by=by, **options)
        columns = [c for c in frame.columns if c != "value"]
        frame = frame.sort(columns)
        bits = frame["value"].cast(pl.Float64).to_numpy().view("int64").tolist()
        out[f"{mode} {by}"] = [list(map(str, r)) for r in frame.select(columns).iter_rows()], bits
print(json.dumps({"threads": pl.thread_pool_size(), "path": exact.path(), "results": out}))
"""
    % EVERY
)


def reduced(run: Path, threads: int, partition_rows: int, pure: bool) -> dict:
    """Every mode's result of ``run`` (value bits), in a process of ``threads`` threads, on
    the pure numpy path or (where it was built) the compiled one."""
    env = {**os.environ, "POLARS_MAX_THREADS": str(threads), "METRICLOG_PURE": "1" if pure else ""}
    done = subprocess.run(
        [sys.executable, "-c", _REDUCE, str(run), str(partition_rows)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["threads"] == threads
    assert out["path"] == ("pure numpy" if pure or COMPILED is None else "compiled")
    return out["results"]


def split(df: pl.DataFrame, into: int, run: Path, seed: int) -> None:
    """Each rank's records shuffled and cut into ``into`` files of random names."""
    rng = np.random.default_rng(seed)
    run.mkdir()
    for rank in range(RANKS):
        mine = df.filter(pl.col("rank") == rank)
        mine = mine[rng.permutation(mine.height)]
        cuts = np.sort(rng.choice(np.arange(1, mine.height), into - 1, replace=False)) if into > 1 else []
        for part in np.split(np.arange(mine.height), cuts):
            name = f"{rng.integers(1 << 40):x}.parquet"
            write(mine[part], run / name, with_polars=bool(rng.integers(2)))


def test_the_same_records_split_renamed_and_shuffled_give_the_same_bits_on_any_threads(tmp_path):
    df = records(seed=23, others=True)
    # (files a rank, threads, records a partition, the pure numpy path)
    layouts = [(1, 1, 1_000_000, False), (3, 2, 37, True), (7, 1, 53, False), (7, 2, 1_000_000, True)]
    results = []
    for i, (into, threads, partition_rows, pure) in enumerate(layouts):
        run = tmp_path / f"run{i}"
        split(df, into, run, seed=i)
        results.append(reduced(run, threads, partition_rows, pure))
    first = results[0]
    assert len(first) == 4 and all(len(groups) > 100 for groups, _ in first.values())
    for layout, other in zip(layouts[1:], results[1:], strict=True):
        for name, (groups, value_bits) in first.items():
            assert other[name][0] == groups, (layout, name)
            moved = [g for g, a, b in zip(groups, value_bits, other[name][1], strict=True) if a != b]
            assert not moved, f"{layout} {name}: {len(moved)} values changed bits, e.g. {moved[:5]}"
