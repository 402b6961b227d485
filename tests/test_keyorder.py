"""keyorder: keys ranked a bounded range at a time, the same order as one stable sort."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from metric_core.offline import keyorder


@pytest.mark.parametrize("range_keys", [1, 3, 50, 1 << 20])
def test_key_ranks_are_a_stable_sorts_ranks_whatever_the_range_size(monkeypatch, range_keys):
    monkeypatch.setattr(keyorder, "RANGE_KEYS", range_keys)
    rng = np.random.default_rng(11)
    ids = rng.integers(0, 200, 1_000)  # many ties, kept in their first order
    keys = [f"{'Z' if i % 5 == 0 else 'a'}/{'ü' * int(i % 3)}{int(i) * 37 % 211}" for i in ids]
    keys[::97] = ["same"] * len(keys[::97])
    truth = np.empty(len(keys), dtype=np.int64)
    # numpy's stable sort of the UTF-8 bytes: polars orders strings by their bytes
    order = np.argsort(np.array([k.encode() for k in keys], dtype=object), kind="stable")
    truth[order] = np.arange(len(keys))
    got = keyorder.key_ranks(pl.Series(keys))
    assert got.tolist() == truth.tolist()


def test_ranges_cut_at_boundaries_hold_every_key_before_the_next_ranges(monkeypatch):
    monkeypatch.setattr(keyorder, "RANGE_KEYS", 500)
    keys = pl.Series([f"k{i:05d}" for i in np.random.default_rng(2).permutation(5_000)])
    bounds = keyorder.boundaries(keyorder.sample_of(keys, len(keys)), len(keys))
    which = keyorder.range_of(keys, bounds)
    assert len(bounds) >= 8 and bounds.is_sorted() and bounds.n_unique() == len(bounds)
    by_range = (
        pl.DataFrame({"key": keys, "r": which})
        .group_by("r")
        .agg(lo=pl.col("key").min(), hi=pl.col("key").max(), n=pl.len())
        .sort("r")
    )
    assert (by_range["hi"][:-1] < by_range["lo"][1:]).all()
    assert by_range["n"].max() <= 2 * 500
