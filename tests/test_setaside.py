"""Millions of groups in one step are set aside on disk and read back a slice of keys at a
time (``engine.setaside``): the same bits as when every group is held, and each
statistic the exact one.

The thresholds are lowered so that a few hundred groups (the records of
``tests.test_exact_engine``: every family of hard values, 4 ranks, 6 steps) are set aside
many times over, in batches of a few groups, and read back in slices that cut steps
between keys. Sums, means and stds are checked bit for bit against ``fractions``; every
value (min, max, first, last too) against the same reduction with nothing set aside.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from metric_core.offline.engine import accumulator, reduce_run, setaside, tasks
from tests.test_exact_engine import EVERY, RANKS, records, same_bits, truth, write

SMALL = {"SET_ASIDE_GROUPS": 40, "BATCH_ROWS": 8, "SLICE_GROUPS": 30}


@pytest.fixture
def run(tmp_path):
    df = records(seed=23, others=True)  # min, max, first, last too (median and pNN apart: below)
    df = df.filter(~pl.col("reduction").is_in(["median", "p99"]))
    for rank in range(RANKS):
        write(df.filter(pl.col("rank") == rank), tmp_path / f"rank{rank}.parquet", with_polars=rank % 2 == 1)
    return tmp_path, df


def _set_aside(monkeypatch) -> dict[str, int]:
    """Lower the thresholds; count the runs written and the most groups an accumulator held."""
    monkeypatch.setattr(accumulator, "SET_ASIDE_GROUPS", SMALL["SET_ASIDE_GROUPS"])
    monkeypatch.setattr(setaside, "BATCH_ROWS", SMALL["BATCH_ROWS"])
    monkeypatch.setattr(setaside, "SLICE_GROUPS", SMALL["SLICE_GROUPS"])
    monkeypatch.setattr(tasks, "PARTITION_ROWS", 97)
    seen = {"runs": 0, "held": 0}
    write_run, fold = setaside.SetAside.write, accumulator.Accumulator._fold

    def counted(self, *args):
        seen["runs"] += 1
        return write_run(self, *args)

    def watched(self, p):
        fold(self, p)
        seen["held"] = max(seen["held"], self._groups_held())

    monkeypatch.setattr(setaside.SetAside, "write", counted)
    monkeypatch.setattr(accumulator.Accumulator, "_fold", watched)
    return seen


def _bits(df: pl.DataFrame) -> pl.DataFrame:
    return df.with_columns(pl.Series("value", df["value"].to_numpy().view(np.int64)))


@pytest.mark.parametrize("by", ["step", "time"])
@pytest.mark.parametrize("mode", ["global_reduce", "per_rank_reduce"])
def test_groups_set_aside_give_the_same_bits_and_the_exact_values(run, monkeypatch, mode, by):
    path, df = run
    options = {"every": EVERY} if by == "time" else {}
    held = reduce_run(path, mode=mode, by=by, **options)
    seen = _set_aside(monkeypatch)
    got = reduce_run(path, mode=mode, by=by, **options)
    assert seen["runs"] >= 5, "the groups were not set aside: the test would show nothing"
    # a partition's groups (97 records at most) over the threshold, never more
    assert seen["held"] <= SMALL["SET_ASIDE_GROUPS"] + 97, seen
    assert got.columns == held.columns
    assert _bits(got).equals(_bits(held)), "set aside, the result is not the same bits"
    # and the sums, means and stds are the exact ones, correctly rounded
    want = truth(df.filter(pl.col("key").str.split("/").list.last().is_in(["sum", "mean", "std"])), mode, by)
    bucket = "window_start" if by == "time" else "step"
    source = ["process", "rank"] if mode == "per_rank_reduce" else []
    rows = got.select(*source, bucket, "key", "value", "count").iter_rows()
    found = {tuple(r[:-2]): (r[-2], r[-1]) for r in rows}
    wrong = [g for g in want if not same_bits(found[g][0], want[g][0]) or found[g][1] != want[g][1]]
    assert not wrong, wrong[:8]
    assert len(want) > 2 * SMALL["SET_ASIDE_GROUPS"]


def test_a_median_after_groups_were_set_aside_reads_them_back(tmp_path, monkeypatch):
    """A percentile's values are told by the labels held in memory: once one comes, the
    groups set aside are folded back and held (the same bits)."""
    n = 600
    rng = np.random.default_rng(5)
    keys = [f"k/{i:04d}" for i in range(n)]
    frames = [
        pl.DataFrame(
            {
                "key": keys,
                "value": rng.normal(size=n),
                "reduction": ["mean"] * n,
                "step": np.zeros(n, np.int64),
                "timestamp": np.full(n, 1.7e9),
                "rank": np.full(n, 0, np.int64),
                "process": ["p0"] * n,
            }
        ),
        pl.DataFrame(
            {
                "key": ["z/p50"] * 9,
                "value": rng.normal(size=9),
                "reduction": ["median"] * 9,
                "step": np.zeros(9, np.int64),
                "timestamp": np.full(9, 1.7e9 + 1),
                "rank": np.full(9, 0, np.int64),
                "process": ["p0"] * 9,
            }
        ),
    ]
    pl.concat(frames).write_parquet(tmp_path / "r.parquet")
    held = reduce_run(tmp_path)
    seen = _set_aside(monkeypatch)
    got = reduce_run(tmp_path)
    assert seen["runs"] >= 1
    assert _bits(got).equals(_bits(held))
    median = got.filter(pl.col("key") == "z/p50")["value"].item()
    assert median == np.median(frames[1]["value"].to_numpy())


def test_groups_set_aside_across_many_takes_each_keep_their_own_file(tmp_path, monkeypatch):
    """Steps finished while the run is read are taken (a few groups a take) while later
    groups are set aside: a run read back and removed by one take, and one written after
    it, never share a file (the second was named after the count of runs left, and the
    first's removal took it: FileNotFoundError). The same bits as with every group held."""
    from metric_core.offline.engine import finish

    rng = np.random.default_rng(5)
    for rank in range(3):
        rows = [
            (f"k{k}", s)
            for s in range(400)
            for k in range(6)
            for _ in range(1 + (s + k + rank) % 2)  # a group of one record or of two
        ]
        step = np.array([s for _, s in rows])
        pl.DataFrame(
            {
                "key": [k for k, _ in rows],
                "value": rng.normal(size=len(rows)),
                "reduction": ["mean"] * len(rows),
                "step": step,
                "timestamp": 1.76e9 + step,
                "rank": np.full(len(rows), rank),
            }
        ).write_parquet(tmp_path / f"r{rank}.parquet", row_group_size=500)
    held = reduce_run(tmp_path)
    monkeypatch.setattr(accumulator, "SET_ASIDE_GROUPS", 20)
    monkeypatch.setattr(finish, "TAKEN_GROUPS", 64)
    monkeypatch.setattr(tasks, "PARTITION_ROWS", 300)
    monkeypatch.setattr(tasks, "DICTIONARY_READ_RECORDS", 0)
    written = setaside.SetAside.write
    runs = []

    def counted(self, *args):
        runs.append(self)
        return written(self, *args)

    monkeypatch.setattr(setaside.SetAside, "write", counted)
    got = reduce_run(tmp_path)
    assert len(runs) > 20
    assert _bits(got).equals(_bits(held))
