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
