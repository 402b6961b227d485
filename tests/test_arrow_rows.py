"""Batches taken as pyarrow read them (``partials.batch_partial``): in global_reduce, a
Parquet batch whose records need no cast, fill or drop goes to the table of groups (on the
compiled path: sums, means, stds, min, max, counts) or gives its groups' values (medians,
pNN) without a polars frame. Whatever a run holds, the result and the read's report
are those of the frames' path, bit for bit: files written by pyarrow (dictionaries) and
by polars (large strings), reductions recorded in capitals, keys recorded with two
reductions, ``--reduce`` patterns that keep a batch's statistics direct or do not, bad rows
(a null value, a NaN timestamp: that batch goes as a frame, its rows counted once), by
step and by time, partitions cut small, one file or several, and the writer's own files.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from metric_core.offline.engine import partials, run_plan, tasks
from metric_core.offline.plan import make_plan
from tests.test_exact import KERNELS, kernel_of
from tests.test_exact_engine import EVERY, RANKS, records, write
from tests.test_grouptable import bits


def _run(tmp_path, seed: int) -> None:
    """A run of another tool's files, with the oddities above drawn by ``seed``."""
    rng = np.random.default_rng(seed)
    df = records(seed=seed, others=seed in (2, 3, 5))  # first, last, median and pNN keys too
    shout = rng.random(df.height) < 0.2  # 'MEAN' beside 'mean': one statistic
    df = df.with_columns(
        reduction=pl.when(pl.Series(shout))
        .then(pl.col("reduction").str.to_uppercase())
        .otherwise(pl.col("reduction"))
    )
    if seed % 2:  # a key recorded with two reductions, in different ranks
        df = df.with_columns(
            reduction=pl.when((pl.col("key") == "ints/sum") & (pl.col("rank") == 0))
            .then(pl.lit("max"))
            .otherwise(pl.col("reduction"))
        )
    for rank in range(RANKS):
        mine = df.filter(pl.col("rank") == rank)
        if rank == 1:  # a null value and a NaN timestamp: rows skipped, counted once
            rows = mine.height
            mine = mine.with_columns(
                value=pl.when(pl.int_range(rows) == rows // 3).then(None).otherwise(pl.col("value")),
                timestamp=pl.when(pl.int_range(rows) == rows // 2)
                .then(float("nan"))
                .otherwise(pl.col("timestamp")),
            )
        write(mine, tmp_path / f"rank{rank}.parquet", with_polars=rank % 2 == 1)


def _reduced(run, **options) -> tuple[pl.DataFrame, str]:
    result = run_plan(run, make_plan(**options))
    frame = result.frame
    return frame.sort([c for c in frame.columns if c != "value"]), result.scan.report.summary()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("seed", range(6))
def test_batches_taken_as_read_give_the_frames_bits_and_report(tmp_path, monkeypatch, seed, kernel):
    _run(tmp_path, seed)
    taken = []
    real = partials.batch_partial

    def counted(*args, **kwargs):
        got = real(*args, **kwargs)
        taken.append(got is not None)
        return got

    rows = [None, 61][seed % 2]  # partitions cut small: several batches a row group
    # every key's statistic direct (seeds 0 and 2), a quantile (4 and 5), or both (1): some
    # batch is taken; or some are first or last (3)
    overrides = [[], ["*/max=p50"], ["*=std"], ["floats*=sum"], ["*=p99"], ["*=median"]][seed]
    for by in ("step", "time"):
        options = dict(
            mode="global_reduce", by=by, reduce=overrides, **({"every": EVERY} if by == "time" else {})
        )
        if rows is not None:
            monkeypatch.setattr(tasks, "PARTITION_ROWS", rows)
        monkeypatch.setattr(partials, "batch_partial", counted)
        taken.clear()
        with kernel_of(kernel):
            fast, fast_report = _reduced(tmp_path, **options)
        if seed in (4, 5) or (seed in (0, 1, 2) and kernel == "compiled"):  # rows: for the C table
            assert any(taken), (by, "no batch was taken as read")
        monkeypatch.setattr(partials, "batch_partial", lambda *args, **kwargs: None)
        with kernel_of(kernel):
            slow, slow_report = _reduced(tmp_path, **options)
        monkeypatch.undo()
        assert fast.drop("value").equals(slow.drop("value")), by
        assert np.array_equal(bits(fast["value"]), bits(slow["value"])), by
        assert fast_report == slow_report, by
        assert "null" in fast_report and "timestamp" in fast_report  # the bad rows were counted


@pytest.mark.parametrize("seed", range(8))
def test_a_clean_batch_is_one_whose_every_record_the_frame_path_keeps(seed):
    """``clean`` (pyarrow's terms) says of a batch what ``RECORD_OK`` (polars', the frame
    path's) says of its records: a null in any field, a NaN, infinite or out-of-range
    timestamp makes a batch not clean; else it is."""
    import pyarrow as pa

    from metric_core.format.schema import TIMESTAMP_RANGE
    from metric_core.offline.read.parquet import clean
    from metric_core.offline.read.validate import RECORD_OK

    rng = np.random.default_rng(seed)
    n = 50
    lo, hi = TIMESTAMP_RANGE
    times = rng.uniform(lo, hi, n)
    columns = {
        "key": pa.array([f"k{i}" for i in rng.integers(0, 5, n)]).dictionary_encode(),
        "value": pa.array(rng.normal(size=n)),
        "reduction": pa.array(["mean"] * n).dictionary_encode(),
        "step": pa.array(rng.integers(0, 9, n)),
        "timestamp": pa.array(times),
        "rank": pa.array(rng.integers(0, 3, n)),
    }
    for name in rng.choice(list(columns), size=rng.integers(0, 3), replace=False).tolist():
        values = columns[name].to_pylist()
        values[int(rng.integers(0, n))] = None
        columns[name] = pa.array(values, columns[name].type)
    if seed % 3 == 0:  # a timestamp no clock's
        bad = times.copy()
        bad[int(rng.integers(0, n))] = [np.nan, np.inf, lo - 1.0, hi][seed // 3 % 4]
        columns["timestamp"] = pa.array(bad, mask=pa.array(columns["timestamp"].is_null()).to_numpy(False))
    batch = pa.record_batch(columns)
    frame = pl.from_arrow(batch)
    assert clean(batch) == frame.select(RECORD_OK).to_series().all(), seed


def test_a_failure_of_the_engine_on_a_batch_is_not_taken_for_the_files(tmp_path, monkeypatch):
    """What the engine raises on a batch taken as read is its own failure, even one of
    polars' kind: it ends the command as the frames' path's would, and is not taken for
    the file's (which would skip the file's records as unreadable and go on)."""
    from metric_core.errors import RunChangedError

    _run(tmp_path, 0)

    def broken(*args, **kwargs):
        raise pl.exceptions.ComputeError("a bug in the engine")

    monkeypatch.setattr(partials, "batch_partial", broken)
    result = run_plan(tmp_path, make_plan(mode="global_reduce"))
    with pytest.raises((pl.exceptions.ComputeError, RunChangedError)):
        _ = result.frame
    assert not any(rep.unreadable for rep in result.scan.report.files), result.scan.report.summary()


def test_batches_of_a_row_group_of_many_keys_give_the_frames_bits(tmp_path, monkeypatch):
    """Row groups of 20,000 distinct keys, read in batches that each use a part of the row
    group's dictionary: the same bits as the frames' path."""
    rng = np.random.default_rng(7)
    for rank in range(2):
        n = 40_000
        keys = rng.integers(0, 20_000, n)
        df = pl.DataFrame(
            {
                "key": [f"key/{k}" for k in keys.tolist()],
                "value": rng.normal(size=n) * 10.0 ** rng.integers(-3, 4, n),
                "reduction": [["mean", "sum", "max", "std", "p90"][k % 5] for k in keys.tolist()],
                "step": np.sort(rng.integers(0, 50, n)),
                "timestamp": 1.7e9 + np.arange(n, dtype=np.float64),
                "rank": np.full(n, rank, dtype=np.int64),
                "process": [f"trainer_{rank}"] * n,
            }
        )
        write(df, tmp_path / f"rank{rank}.parquet")
    monkeypatch.setattr(tasks, "PARTITION_ROWS", 997)
    fast, fast_report = _reduced(tmp_path, mode="global_reduce")
    monkeypatch.setattr(partials, "batch_partial", lambda *args, **kwargs: None)
    slow, slow_report = _reduced(tmp_path, mode="global_reduce")
    assert fast.drop("value").equals(slow.drop("value"))
    assert np.array_equal(bits(fast["value"]), bits(slow["value"]))
    assert fast_report == slow_report
