"""The compiled path's table (``engine.grouptable``): records added straight into their
groups give the states a partition's records give, bit for bit.

Against ``exact.accumulate`` (itself checked against ``fractions`` in test_exact.py) and
numpy's min and max, over values that rounding and signs trip on, added in pieces across
calls and drained in two parts; then whole reductions with the table against the
states' path, where the table folds its groups in with the others part way (it grew past
its bound) and where it stops taking records (a record a group).
"""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from metric_core.offline.engine import accumulator, exact, grouptable, reduce_run, tasks
from metric_core.offline.engine.partials import Rows
from tests.test_exact import COMPILED, NOT_BUILT
from tests.test_exact_engine import EVERY, FAMILIES, RANKS, _family, records, write

pytestmark = pytest.mark.skipif(COMPILED is None, reason=NOT_BUILT)

COMBOS = 7
SQUARES = (np.arange(COMBOS) % 2).astype(np.uint8)  # the odd combos keep squares (std)


def bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float64).view(np.int64)


def extreme(values: np.ndarray, lowest: bool) -> float:
    """A group's min (or max) as the engine defines it: NaN if any; a tie of zeros goes to
    -0.0 for min, 0.0 for max, whatever their order."""
    if np.isnan(values).any():
        return math.nan
    best = values.min() if lowest else values.max()
    if best == 0:
        zeros = values[values == 0]
        return -0.0 if (np.signbit(zeros).any() if lowest else np.signbit(zeros).all()) else 0.0
    return float(best)


@pytest.mark.parametrize("seed", range(12))
def test_the_table_holds_what_accumulate_and_numpy_give(seed):
    rng = np.random.default_rng(seed)
    family = FAMILIES[seed % len(FAMILIES)]
    n = int(rng.integers(1, 4000))
    value = _family(rng, family, n)
    value[rng.random(n) < 0.05] = rng.choice([0.0, -0.0, 5e-324, -1.0, 3.0], 1)[0]
    bucket = rng.integers(-3, 40, n)
    combo = rng.integers(0, COMBOS, n)
    table = grouptable.GroupTable()
    cuts = sorted(rng.integers(0, n, 4).tolist())
    for lo, hi in zip([0, *cuts], [*cuts, n], strict=True):  # across calls
        table.add(Rows(bucket[lo:hi], combo[lo:hi], value[lo:hi], SQUARES), np.arange(COMBOS))
    upto = int(rng.integers(-3, 41))
    first, rest = table.drain(upto), table.drain(math.inf)
    assert len(table) == 0
    assert (first[0] < upto).all() and (rest[0] >= upto).all()

    cell = bucket * COMBOS + combo  # buckets are small: a cell a group, in bucket order
    cells, group = np.unique(cell - bucket.min() * COMBOS, return_inverse=True)
    got_cells = np.concatenate([first[0] * COMBOS + first[1], rest[0] * COMBOS + rest[1]])
    got_cells -= bucket.min() * COMBOS
    assert np.array_equal(got_cells, cells)  # every group once, in the order of bucket then combo
    got_state = np.concatenate([first[2], rest[2]], axis=1)
    parts = [
        e if e.squares is not None else exact.ExactState(
            e.count, e.nan, e.pos_inf, e.neg_inf, e.sum_digits, exact.Digits.zeros(len(e))
        )
        for e in (first[3], rest[3])
    ]  # fmt: skip
    got = exact.concat(parts)
    want = exact.accumulate(group, value, len(cells), squares=True)
    assert np.array_equal(got.count, want.count) and np.array_equal(got_state[0], want.count)
    assert np.array_equal(got.nan, want.nan) and np.array_equal(got.pos_inf, want.pos_inf)
    assert np.array_equal(got.neg_inf, want.neg_inf)
    assert got.sum_digits.equals(want.sum_digits)
    for name in ("sum", "mean"):
        assert np.array_equal(bits(getattr(got, name)()), bits(getattr(want, name)())), name
    std = SQUARES[cells % COMBOS].astype(bool)
    assert std.any()
    assert np.array_equal(bits(got.std()[std]), bits(want.std()[std]))
    for row, lowest in ((1, True), (2, False)):
        expected = [extreme(value[group == g], lowest) for g in range(len(cells))]
        assert np.array_equal(bits(got_state[row]), bits(expected)) or all(
            (math.isnan(a) and math.isnan(b)) or bits(a) == bits(b)
            for a, b in zip(got_state[row], expected, strict=True)
        )


@pytest.mark.parametrize("seed", range(4))
def test_a_combo_kept_as_a_count_alone_is_counted_and_adds_nothing_else(seed):
    """A median's or pNN's records (KEEP_COUNT: their values are kept apart) count in their
    groups and add no min, max, non-finite count or exact sum; the other combos' groups,
    added in the same calls, are those of their records alone."""
    from metric_core.offline.engine.partials import KEEP_COUNT

    rng = np.random.default_rng(seed)
    n = 3000
    value = _family(rng, FAMILIES[seed % len(FAMILIES)], n)
    value[rng.random(n) < 0.05] = rng.choice([math.nan, math.inf, -math.inf], 1)[0]
    bucket, combo = rng.integers(0, 30, n), rng.integers(0, COMBOS, n)
    kept = SQUARES.copy()
    kept[::3] = KEEP_COUNT  # combos 0, 3 and 6
    table = grouptable.GroupTable()
    for lo, hi in ((0, 1000), (1000, n)):
        table.add(Rows(bucket[lo:hi], combo[lo:hi], value[lo:hi], kept), np.arange(COMBOS))
    got_bucket, got_combo, state, sums = table.drain(math.inf)
    counted = kept[got_combo] == KEEP_COUNT
    assert counted.any() and not counted.all()
    cell = bucket * COMBOS + combo
    want_count = np.bincount(cell, minlength=30 * COMBOS)[got_bucket * COMBOS + got_combo]
    assert np.array_equal(state[0], want_count) and np.array_equal(sums.count, want_count)
    assert (sums.nan[counted] == 0).all() and (sums.pos_inf[counted] == 0).all()
    assert (sums.neg_inf[counted] == 0).all() and (sums.sum()[counted] == 0).all()
    assert not np.isfinite(state[1:, counted]).any()  # no min or max met
    others = kept[combo] != KEEP_COUNT
    cells, group = np.unique(cell[others], return_inverse=True)
    want = exact.accumulate(group, value[others], len(cells), squares=False)
    mine = sums.take(np.flatnonzero(~counted))
    assert np.array_equal((got_bucket * COMBOS + got_combo)[~counted], cells)
    assert np.array_equal(mine.nan, want.nan) and mine.sum_digits.equals(want.sum_digits)
    assert np.array_equal(bits(mine.mean()), bits(want.mean()))


def test_a_table_of_counts_alone_drains_as_a_partitions_counts_of_medians_do():
    """Where every combo added keeps its count alone, the groups drain as the states'
    path gives a median's or pNN's groups: their counts, no min or max, no exact sums (so
    the accumulator holds 8 bytes a group for them, not the table's fields); once another
    combo came, every group drains whole."""
    from metric_core.offline.engine.partials import COUNTED, KEEP_COUNT, KEEP_SUMS

    one = np.arange(1)
    table = grouptable.GroupTable()
    table.add(Rows(np.array([1, 1, 2]), np.zeros(3, np.int64), np.array([0.5, 1.5, 2.0]), [KEEP_COUNT]), one)
    bucket, _, state, sums = table.drain(math.inf)
    assert bucket.tolist() == [1, 2] and state.shape == (COUNTED, 2) and state[0].tolist() == [2, 1]
    assert sums is None
    kinds = np.array([KEEP_COUNT, KEEP_SUMS], np.uint8)
    table.add(Rows(np.array([1, 1]), np.array([0, 1]), np.array([0.5, 1.5]), kinds), np.arange(2))
    _, combo, state, sums = table.drain(math.inf)
    assert combo.tolist() == [0, 1] and state[0].tolist() == [1, 1] and sums is not None
    assert sums.sum().tolist() == [0.0, 1.5]


@pytest.mark.parametrize(
    ("span", "combos"),
    [(40, 7), (70_000, 50), (1 << 40, 1 << 20), (1 << 62, 1 << 30), (-(1 << 62), 3)],
    ids=["small", "past-16-bits", "past-32-bits", "wide", "wide-negative"],
)
@pytest.mark.parametrize("come", ["shuffled", "in-order", "in-order-but-one", "buckets-in-order"])
def test_the_drain_hands_groups_over_in_the_order_of_bucket_then_combo(span, combos, come):
    """The drain's order, over buckets and combos far apart, whether the records came in
    that order (the groups made in it: no sort needed), in it but for one, in the order of
    their buckets alone, or shuffled:
    bucket then combo, as numpy's unique orders them, every group once, its count right."""
    rng = np.random.default_rng(abs(span) % 1000 + combos)
    n = 20_000
    bucket = rng.integers(min(0, span), max(0, span), n, dtype=np.int64, endpoint=True)
    bucket[:3] = [min(0, span), max(0, span), 0]  # the span's ends, whatever the draw
    local = rng.integers(0, 64, n, dtype=np.int64)  # a partition's combos, numbered up to combos
    number = rng.choice(combos, min(64, combos), replace=False).astype(np.int64)
    local %= len(number)
    combo = number[local]
    if come != "shuffled":
        order = np.lexsort((rng.random(n) if come == "buckets-in-order" else combo, bucket))
        if come == "in-order-but-one":
            order = np.r_[order[1:], order[:1]]  # the first group made last
        bucket, local, combo = bucket[order], local[order], combo[order]
    table = grouptable.GroupTable()
    value = rng.normal(size=n)
    table.add(Rows(bucket, local, value, np.zeros(len(number), np.uint8)), number)
    got_bucket, got_combo, state, _ = table.drain(math.inf)
    cells, counts = np.unique(np.stack([bucket, combo]), axis=1, return_counts=True)  # by bucket, then combo
    assert np.array_equal(got_bucket, cells[0]) and np.array_equal(got_combo, cells[1])
    assert np.array_equal(state[0], counts)


def test_a_group_drained_and_met_again_is_added_to_where_it_went():
    table = grouptable.GroupTable()
    one = np.arange(1)
    table.add(Rows(np.array([5, 9]), np.array([0, 0]), np.array([0.1, 0.2]), SQUARES[:1]), one)
    bucket, _, state, held = table.drain(6)
    assert bucket.tolist() == [5] and len(table) == 1
    table.add(Rows(np.array([5, 9]), np.array([0, 0]), np.array([0.7, 0.3]), SQUARES[:1]), one)
    bucket, _, state, later = table.drain(math.inf)
    assert bucket.tolist() == [5, 9] and state[0].tolist() == [1, 2]
    assert later.sum().tolist() == [0.7, 0.5] and held.sum().tolist() == [0.1]


def _reduced(run, mode: str, by: str) -> pl.DataFrame:
    options = {"every": EVERY} if by == "time" else {}
    frame = reduce_run(run, mode=mode, by=by, **options)
    return frame.sort([c for c in frame.columns if c != "value"])


@pytest.mark.parametrize("bound", ["spills", "stops"])
def test_a_reduction_through_the_table_is_the_states_bits(tmp_path, monkeypatch, bound):
    """Whole reductions (every statistic, so partitions mix rows and states), through the
    table and through the states alone: the same frames, bit for bit. The table is made to
    fold its groups in part way (``spills``: more groups than its bound, several records
    each) or to stop taking records (``stops``: about one record a group)."""
    df = records(seed=5, others=True)
    for rank in range(RANKS):
        write(df.filter(pl.col("rank") == rank), tmp_path / f"rank{rank}.parquet", with_polars=rank % 2 == 1)
    seen = []
    real = accumulator.Accumulator._drain

    def drain(self, upto):
        seen.append((len(self.table) if self.table is not None else 0, self.tables))
        return real(self, upto)

    def bounded():
        monkeypatch.setattr(tasks, "PARTITION_ROWS", 97)
        monkeypatch.setattr(accumulator, "TABLE_GROUPS", 40)
        # "stops": a table of fewer than 4 records a group (2 here) stops taking them
        monkeypatch.setattr(accumulator, "TABLE_RECORDS", 4 if bound == "stops" else 1)
        monkeypatch.setattr(accumulator.Accumulator, "_drain", drain)

    for mode in ("global_reduce", "per_rank_reduce"):
        for by in ("step", "time"):
            bounded()
            with_table = _reduced(tmp_path, mode, by)
            monkeypatch.setattr(grouptable, "available", lambda: False)
            states = _reduced(tmp_path, mode, by)
            monkeypatch.undo()
            assert with_table.drop("value").equals(states.drop("value")), (mode, by)
            assert np.array_equal(bits(with_table["value"]), bits(states["value"])), (mode, by)
    assert any(held > 40 for held, _ in seen)  # the table grew past its bound and was folded in
    if bound == "stops":
        assert any(not takes for _, takes in seen)  # ... and stopped taking records
    else:
        assert all(takes for _, takes in seen)


def test_a_label_the_numbers_do_not_cover_is_refused_and_nothing_is_added():
    table = grouptable.GroupTable()
    with pytest.raises(ValueError, match="label 1 of row 1 is not one of the 1 given"):
        table.add(Rows(np.array([5, 9]), np.array([0, 1]), np.array([0.1, 0.2]), SQUARES[:1]), np.arange(1))
    assert len(table) == 0
