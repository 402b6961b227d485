"""Mergeable partial states: each partition reduced on its own, then folded in a fixed order.

This is GLOBAL_REDUCE as the seed runs it live (each rank's state, merged by the
controller), done offline. A partition (one file of the run) is reduced to one row of
state per group (``partition_states``), and an ``Accumulator`` folds the partitions'
states in the plan's partition order (the files' sorted paths), so the result does not
depend on the thread count, on which partition finished first, or on the order the
files were listed in.

The state of a group in one partition, over its values v (n of them):

  n, raw      the count and the plain float sum (what a group holding inf or NaN gives)
  shift       raw / n, the partition's approximate mean
  dev, sq     sum(v - shift) and sum((v - shift)**2); near the mean, v - shift is exact,
              so these lose almost nothing to rounding
  min, max    NaN-propagating, as numpy's
  first/last  the value with the smallest / largest timestamp, with ``first_at`` /
              ``last_at``, the place in file order of the part it came from (ties: the
              earlier part in file order, then the earlier row)
  values      for median and pNN only: the group's values themselves. Of the fields
              above, only n of such a group is ever read, so a partition whose groups
              are all median/pNN keeps n alone

Folding re-centres every partition on one shift K per group (the first partition's):
sum(v - K) = dev + n (shift - K) and sum((v - K)**2) = sq + 2 (shift - K) dev +
n (shift - K)**2, where shift - K is exact for partitions whose means are close. Then
sum = n K + sum(v - K), mean = K + sum(v - K) / n, and the population variance is
(sum((v - K)**2) - sum(v - K)**2 / n) / n. ``tests/test_exact.py`` holds these against
``fractions`` on values of 1e12 + N(0, 1).

Every computation is numpy over a partition's columns in row order (``bincount`` and
``ufunc.at`` add in index order), so a partition's state is the same on every run.
"""

from __future__ import annotations

import itertools
import math
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from metric_core.errors import PlanError
from metric_core.offline.plan import ReducePlan, Statistic

# The fields of a group's state, and what a field holds where nothing was folded in yet.
FIELDS = (
    "n", "raw", "shift", "dev", "sq", "min", "max",
    "first_ts", "first", "first_at", "last_ts", "last", "last_at",
)  # fmt: skip
_EMPTY = np.array([0, 0, 0, 0, 0, np.inf, -np.inf, np.inf, np.nan, np.inf, -np.inf, np.nan, np.inf])
N, RAW, SHIFT, DEV, SQ, MIN, MAX, FIRST_TS, FIRST, FIRST_AT, LAST_TS, LAST, LAST_AT = range(len(FIELDS))
# A state holds the fields up to first_ts, and first and last only where a statistic needs
# them (7 fields, not 13, for most runs); a partition whose every statistic is median or
# pNN (their values are kept apart) holds the count alone.
UNTIMED = FIRST_TS
COUNTED = RAW
_FAMILIES = ("min", "max", "first", "last")  # what only some statistics need
_DENSE_SLACK = 1 << 16  # a dense index may be this much (plus 4x the rows) larger than the rows


@dataclass
class Partial:
    """One partition's states, one entry a group.

    ``bucket`` is the group's step (or ``--by time`` window number); ``combo`` indexes
    ``combos``, the (process, rank, key, statistic) of the group (process and rank None
    in global_reduce); ``state`` holds the arrays named in the module docstring; for
    median/pNN groups, ``values`` holds their values and ``value_group`` their groups.
    """

    bucket: np.ndarray
    combo: np.ndarray
    combos: list[tuple[Any, ...]]
    state: np.ndarray  # FIELDS x groups
    value_group: np.ndarray
    values: np.ndarray


def is_statistic(name: str) -> bool:
    try:
        Statistic.parse(name)
    except PlanError:
        return False
    return True


def partition_states(
    df: pl.DataFrame,
    plan: ReducePlan,
    statistic_of: Callable[[str, str], str],
    t0: float | None,
    places: Sequence[tuple[int, int]] = (),
) -> Partial:
    """Reduce one partition's records (a collected frame with the plan's input columns).

    ``places`` are the (place in file order, rows) of the parts ``df`` was concatenated
    from, in file order (none: one part, place 0): what breaks ties of first and last.

    ``statistic_of(key, recorded_reduction)`` names the statistic a key gets; it is part
    of the group, so records of one key with different recorded reductions form one group
    when an override applies, and two groups (an error, found after the fold) otherwise.
    ``t0`` anchors ``--by time`` windows.
    """
    rows = df.height
    if rows == 0:
        none = np.empty(0, dtype=np.int64)
        return Partial(none, none, [], np.empty((len(FIELDS), 0)), none, np.empty(0))
    value = df["value"].to_numpy()
    if plan.by == "time":
        assert t0 is not None and plan.every is not None
        bucket = np.floor((df["timestamp"].to_numpy() - t0) / plan.every).astype(np.int64)
    else:
        bucket = df["step"].to_numpy().astype(np.int64, copy=False)
    # A row's label apart from its bucket: its (process, rank,) key and recorded reduction,
    # as one code; each distinct label is then looked at once, in Python.
    per_source = plan.group_columns[0] == "process"
    label_columns = [*(("process", "rank") if per_source else ()), "key", "reduction"]
    pair, n_pairs = _combine([_codes(df[c]) for c in label_columns], rows)
    pair_rows = _representatives(pair, n_pairs)
    present = np.flatnonzero(pair_rows >= 0)
    labels = df.select(label_columns)[pair_rows[present]]
    combos: list[tuple[Any, ...]] = []
    combo_index: dict[tuple[Any, ...], int] = {}
    combo_of_pair = np.zeros(n_pairs, dtype=np.int64)
    for i, row in enumerate(labels.iter_rows()):
        *source, key, recorded = row
        combo_label = (*(source or (None, None)), key, statistic_of(key, str(recorded).lower()))
        combo_of_pair[present[i]] = combo_index.setdefault(combo_label, len(combos))
        if len(combo_index) > len(combos):
            combos.append(combo_label)
    combo = combo_of_pair[pair]
    names = sorted({c[-1] for c in combos})
    stat_of_combo = np.array([names.index(c[-1]) for c in combos], dtype=np.int64)
    ids, n_groups, count, group_bucket, group_combo = _groups(bucket, combo, len(combos))
    stats = [Statistic.parse(name) if is_statistic(name) else None for name in names]
    quantile = np.array([s is not None and (s.name == "median" or s.quantile is not None) for s in stats])
    timed = any(s is not None and s.name in ("first", "last") for s in stats)
    state = _empty_cells(n_groups, COUNTED if quantile.all() else len(FIELDS) if timed else UNTIMED)
    state[N] = count
    stat_codes = stat_of_combo[combo] if len(names) > 1 else None
    if len(state) > COUNTED:
        _sums(state, ids, value, need_sq="std" in names)
    for family in _FAMILIES:
        wanted = np.array([s is not None and s.name == family for s in stats])
        if wanted.any():
            subset = None if stat_codes is None else np.flatnonzero(wanted[stat_codes])
            _extreme(state, family, ids, value, df, subset, places)
    value_group, values = np.empty(0, dtype=np.int64), np.empty(0)
    if quantile.any():
        subset = np.arange(rows) if stat_codes is None else np.flatnonzero(quantile[stat_codes])
        value_group, values = ids[subset], value[subset]
    return Partial(group_bucket, group_combo, combos, state, value_group, values)


def _groups(
    bucket: np.ndarray, combo: np.ndarray, n_combos: int
) -> tuple[np.ndarray, int, np.ndarray, np.ndarray, np.ndarray]:
    """Each row's group (bucket x combo, numbered in bucket order), the number of groups,
    their counts, and each group's bucket and combo."""
    lo, hi = int(bucket.min()), int(bucket.max())
    span = (hi - lo + 1) * n_combos
    if span > 4 * len(bucket) + _DENSE_SLACK:  # sparse buckets: number them first
        uniq, bucket_code = np.unique(bucket, return_inverse=True)
        cell = bucket_code * n_combos + combo
        cells, ids, count = np.unique(cell, return_inverse=True, return_counts=True)
        return ids, len(cells), count, uniq[cells // n_combos], cells % n_combos
    cell = (bucket - lo) * n_combos + combo
    count = np.bincount(cell, minlength=span)
    cells = np.flatnonzero(count)
    if len(cells) == span:
        ids = cell
    else:
        lookup = np.zeros(span, dtype=np.int64)
        lookup[cells] = np.arange(len(cells))
        ids = lookup[cell]
    return ids, len(cells), count[cells], cells // n_combos + lo, cells % n_combos


def _codes(series: pl.Series) -> tuple[np.ndarray, int]:
    """Integer codes 0..k-1 of a column (equal values, equal codes) and k (an upper bound)."""
    if series.dtype.is_integer():
        x = series.to_numpy().astype(np.int64, copy=False)
        lo = int(x.min())
        span = int(x.max()) - lo + 1
        return ((x - lo), span) if span <= 4 * len(x) + _DENSE_SLACK else _dense(x)
    codes = _category_codes(series).astype(np.int64)
    span = int(codes.max()) + 1
    return (codes, span) if span <= 4 * len(codes) + _DENSE_SLACK else _dense(codes)


def _category_codes(series: pl.Series) -> np.ndarray:
    """Integer codes of a string column (equal strings, equal codes)."""
    return series.cast(pl.Categorical).to_physical().to_numpy()


def _dense(codes: np.ndarray) -> tuple[np.ndarray, int]:
    """Codes renumbered 0..k-1, in the order of the original codes."""
    codes = codes.astype(np.int64, copy=False)
    lo, hi = int(codes.min()), int(codes.max())
    if hi - lo > 4 * len(codes) + _DENSE_SLACK:
        uniq, inverse = np.unique(codes, return_inverse=True)
        return inverse.astype(np.int64), len(uniq)
    shifted = codes - lo
    present = np.bincount(shifted, minlength=hi - lo + 1) > 0
    if present.all():
        return shifted, len(present)
    return (np.cumsum(present) - 1)[shifted], int(present.sum())


def _combine(codes: list[tuple[np.ndarray, int]], rows: int) -> tuple[np.ndarray, int]:
    """One index from several columns' codes (mixed radix, renumbered where it grows sparse)
    and its span (an upper bound)."""
    ids = np.zeros(rows, dtype=np.int64)
    span = 1
    for c, k in codes:
        if span * k > 4 * rows + _DENSE_SLACK:
            ids, span = _dense(ids)
        ids = ids * k + c
        span *= k
    return ids, span


def _representatives(ids: np.ndarray, n: int) -> np.ndarray:
    """For each id 0..n-1, a row holding it (-1 where none does). Which row of an id is
    kept does not matter: the callers read only what all rows of an id share."""
    rep = np.full(n, -1, dtype=np.int64)
    rep[ids] = np.arange(len(ids), dtype=np.int64)
    return rep


def _sums(state: np.ndarray, ids: np.ndarray, value: np.ndarray, need_sq: bool) -> None:
    """The sums of the module docstring, into ``state`` (which holds the counts)."""
    n = state.shape[1]
    count = state[N]
    raw = np.bincount(ids, weights=value, minlength=n)
    with np.errstate(invalid="ignore", divide="ignore"):
        shift = raw / count
    shift[~np.isfinite(shift)] = 0.0  # raw keeps what a non-finite value did
    dev_each = value - shift[ids]
    state[RAW], state[SHIFT] = raw, shift
    state[DEV] = np.bincount(ids, weights=dev_each, minlength=n)
    if need_sq:
        state[SQ] = np.bincount(ids, weights=dev_each * dev_each, minlength=n)


def _extreme(
    state: np.ndarray,
    family: str,
    ids: np.ndarray,
    value: np.ndarray,
    df: pl.DataFrame,
    subset: np.ndarray | None,
    places: Sequence[tuple[int, int]],
) -> None:
    g = ids if subset is None else ids[subset]
    v = value if subset is None else value[subset]
    lowest = family in ("min", "first")
    pick = np.minimum if lowest else np.maximum
    if family in ("min", "max"):
        out = state[MIN if lowest else MAX].copy()
        with np.errstate(invalid="ignore"):
            pick.at(out, g, v)
        state[MIN if lowest else MAX] = out
        return
    ts = df["timestamp"].to_numpy()
    ts = ts if subset is None else ts[subset]
    best = state[FIRST_TS if lowest else LAST_TS].copy()
    pick.at(best, g, ts)
    candidates = np.flatnonzero(ts == best[g])
    uniq, index = np.unique(g[candidates], return_index=True)  # the earliest row of each
    state[FIRST_TS if lowest else LAST_TS] = best
    state[FIRST if lowest else LAST, uniq] = v[candidates[index]]
    chosen = candidates[index] if subset is None else subset[candidates[index]]
    at = np.zeros(len(chosen))
    if places:
        place, rows = (np.array(c) for c in zip(*places, strict=True))
        at = place[np.searchsorted(np.cumsum(rows), chosen, side="right")].astype(np.float64)
    state[FIRST_AT if lowest else LAST_AT, uniq] = at


_BLOCK_BITS = 8  # buckets (steps, windows) per block of the accumulator
# median/pNN values held in memory (24 bytes each) before they go to a temporary file
SPILL_VALUES = 1_000_000
# median/pNN values whose groups' quantiles are computed in one query: polars' group_by
# holds about 80 bytes a value; 500K against 1M is 35 MiB less at the peak of *=p99 on
# another tool's 100M records, for 8% of its time (benchmarks/bench_engine.py)
SLICE_VALUES = 500_000


@dataclass
class _Block:
    """The states of 2**_BLOCK_BITS consecutive buckets x ``width`` combos, (cells, FIELDS)."""

    state: np.ndarray
    width: int


@dataclass
class Accumulator:
    """Partitions' states folded in the order they are given, into blocks of buckets.

    Memory grows with the groups (buckets x combos touched) not taken out yet (``take``),
    not with the records; the values of median/pNN groups are held with them (in a
    temporary directory past ``SPILL_VALUES``).
    """

    combos: dict[tuple[Any, ...], int] = field(default_factory=dict)
    blocks: dict[int, _Block] = field(default_factory=dict)
    value_cells: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)
    held_values: int = 0
    spills: list[tuple[Path, int, int]] = field(default_factory=list)  # (file, first, last bucket)
    spent: list[Path] = field(default_factory=list)  # spilled files no later take needs
    spilled: int = 0  # the files written so far (each one's name: its number)
    spill_dir: tempfile.TemporaryDirectory[str] | None = None
    taken: int | None = None  # the buckets below this one were taken out

    def add(self, p: Partial) -> None:
        if not len(p.bucket):
            return
        to_global = np.array([self.combos.setdefault(c, len(self.combos)) for c in p.combos], dtype=np.int64)
        combo = to_global[p.combo]
        width = len(self.combos)
        block_of = p.bucket >> _BLOCK_BITS  # non-decreasing: the groups come in bucket order
        edges = np.flatnonzero(np.diff(block_of)) + 1
        for lo, hi in zip(np.r_[0, edges], np.r_[edges, len(block_of)], strict=True):
            cells = (p.bucket[lo:hi] & ((1 << _BLOCK_BITS) - 1)) * width + combo[lo:hi]
            block = self._block(int(block_of[lo]), width, len(p.state))
            start = int(cells[0])
            if int(cells[-1]) - start + 1 == hi - lo and np.array_equal(
                cells, np.arange(start, start + hi - lo)
            ):
                _fold(block.state[:, start : start + hi - lo], p.state[:, lo:hi])  # a run of cells: in place
            else:
                block.state[:, cells] = _fold(block.state[:, cells], p.state[:, lo:hi])
        if len(p.values):
            self.value_cells.append((p.bucket[p.value_group], combo[p.value_group], p.values))
            self.held_values += len(p.values)
            if self.held_values > SPILL_VALUES:
                self._spill()

    def _spill(self) -> None:
        """The median/pNN values held so far, to a temporary Parquet file sorted by bucket."""
        if self.spill_dir is None:
            self.spill_dir = tempfile.TemporaryDirectory(prefix="metriclog-values-")
        frame = self._held().sort("bucket", maintain_order=True)
        path = Path(self.spill_dir.name) / f"{self.spilled:05d}.parquet"
        self.spilled += 1
        frame.write_parquet(path, row_group_size=1 << 15, statistics=True)
        self.spills.append((path, int(frame["bucket"][0]), int(frame["bucket"][-1])))
        self.value_cells, self.held_values = [], 0

    def _held(self) -> pl.DataFrame:
        if not self.value_cells:
            return pl.DataFrame(schema={"bucket": pl.Int64, "_combo": pl.Int64, "value": pl.Float64})
        bucket, combo, values = (np.concatenate(parts) for parts in zip(*self.value_cells, strict=True))
        return pl.DataFrame({"bucket": bucket, "_combo": combo, "value": values})

    def _value_ranges(self, lo: int | None, hi: int | None) -> list[pl.LazyFrame]:
        """The median/pNN values (with their group: bucket, _combo) of the buckets from
        ``lo`` to below ``hi`` (None: no bound), held or spilled, in slices of whole
        buckets that each hold about ``SLICE_VALUES`` values; values of later buckets stay."""
        for path in self.spent:  # what the slices of the last take read
            path.unlink(missing_ok=True)
        self.spent = []
        if not self.value_cells and not self.spills:  # no median/pNN values: nothing to split
            return [self._held().lazy()]
        held = self._held()
        mine = held
        if hi is not None:
            later = pl.Series(held["bucket"].to_numpy() >= hi)
            mine, rest = held.filter(~later), held.filter(later)
            columns = (rest["bucket"].to_numpy(), rest["_combo"].to_numpy(), rest["value"].to_numpy())
            self.value_cells = [columns] if rest.height else []
        else:
            self.value_cells = []
        self.held_values = held.height - mine.height
        files = [
            path
            for path, first, last in self.spills
            if (lo is None or last >= lo) and (hi is None or first < hi)
        ]
        scan = mine.lazy()
        if files:
            self.spent = [path for path, _, last in self.spills if hi is None or last < hi]
            self.spills = [s for s in self.spills if s[0] not in self.spent]
            scan = pl.concat([pl.scan_parquet(files), scan])
            if lo is not None:
                scan = scan.filter(pl.col("bucket") >= lo)
            if hi is not None:
                scan = scan.filter(pl.col("bucket") < hi)
        per_bucket = scan.group_by("bucket").len().sort("bucket").collect()
        edges, held_n = [], 0
        for bucket, n in per_bucket.iter_rows():
            if held_n and held_n + n > SLICE_VALUES:
                edges.append(bucket)
                held_n = 0
            held_n += n
        slices = []
        for start, stop in itertools.pairwise([None, *edges, None]):
            part = scan
            if start is not None:
                part = part.filter(pl.col("bucket") >= start)
            if stop is not None:
                part = part.filter(pl.col("bucket") < stop)
            slices.append(part)
        return slices

    def close(self) -> None:
        if self.spill_dir is not None:
            self.spill_dir.cleanup()
            self.spill_dir = None

    def _block(self, b: int, width: int, fields: int) -> _Block:
        """Block ``b``, with ``width`` combos and at least ``fields`` fields."""
        block = self.blocks.get(b)
        if block is None:
            block = self.blocks[b] = _Block(_empty_cells(width << _BLOCK_BITS, fields), width)
        elif block.width < width or len(block.state) < fields:
            grown = _empty_cells(width << _BLOCK_BITS, max(fields, len(block.state)))
            old = np.arange(block.width << _BLOCK_BITS)
            grown[: len(block.state), (old // block.width) * width + old % block.width] = block.state
            block.state, block.width = grown, width
        return block

    def cells_below(self, upto: float) -> int:
        """The cells (groups, and room for them) of the blocks that start below bucket ``upto``."""
        return sum(block.width << _BLOCK_BITS for b, block in self.blocks.items() if b << _BLOCK_BITS < upto)

    def cuts(self, upto: float, groups: int) -> list[float]:
        """Where to cut the taking of the buckets below ``upto`` (block edges, then ``upto``)
        so that each take holds at most about ``groups`` groups (cells)."""
        out: list[float] = []
        held = 0
        for b in sorted(self.blocks):
            if b << _BLOCK_BITS >= upto:
                break
            cells = self.blocks[b].width << _BLOCK_BITS
            if held and held + cells > groups:
                out.append(b << _BLOCK_BITS)
                held = 0
            held += cells
        return [*out, upto]

    def take(self, upto: float = math.inf) -> tuple[pl.DataFrame, dict[str, np.ndarray], list[pl.LazyFrame]]:
        """The groups of the buckets below ``upto`` (an integer, or inf: all), taken out: one
        row a group (bucket, _combo, process, rank, key, reduction), the merged statistics
        by name (one value a row), and their median/pNN values (``_value_ranges``), to be
        read before ``close``."""
        hi = None if upto == math.inf else math.floor(upto)
        buckets, combos, parts = [], [], []
        for b in sorted(self.blocks):
            if hi is not None and b << _BLOCK_BITS >= hi:
                break
            block = self.blocks[b]
            cells = np.flatnonzero(block.state[N] > 0)
            if hi is not None and (b + 1) << _BLOCK_BITS > hi:  # the block hi falls in: its first buckets
                cells = cells[cells // block.width < hi - (b << _BLOCK_BITS)]
                parts.append(block.state[:, cells])
                block.state[:, cells] = _EMPTY[: len(block.state), None]
            else:
                parts.append(self.blocks.pop(b).state[:, cells])
            buckets.append((b << _BLOCK_BITS) + cells // block.width)
            combos.append(cells % block.width)
        values = self._value_ranges(self.taken, hi)
        self.taken = hi
        if not parts:
            return pl.DataFrame(), {}, values
        fields = max(UNTIMED, *(len(part) for part in parts))
        s = np.concatenate([_with_fields(part, fields) for part in parts], axis=1)
        bucket, combo = np.concatenate(buckets), np.concatenate(combos)
        labels = list(self.combos)
        process, rank, key, reduction = (list(col) for col in zip(*labels, strict=True))
        table = pl.DataFrame(
            {
                "_combo": range(len(labels)),
                "process": process,
                "rank": rank,
                "key": key,
                "reduction": reduction,
            },
            schema={
                "_combo": pl.Int64,
                "process": pl.String,
                "rank": pl.Int64,
                "key": pl.String,
                "reduction": pl.String,
            },
        )
        frame = pl.DataFrame({"bucket": bucket, "_combo": combo}).join(
            table, on="_combo", how="left", maintain_order="left"
        )
        n, dev, sq, base, raw = s[N], s[DEV], s[SQ], s[SHIFT], s[RAW]
        finite = np.isfinite(raw)
        with np.errstate(invalid="ignore", over="ignore"):  # over: sums no statistic reads
            stats = {
                "count": n.astype(np.int64),
                "sum": np.where(finite, n * base + dev, raw),
                "mean": np.where(finite, base + dev / n, raw / n),
                "std": np.where(finite, np.sqrt(np.maximum((sq - dev * dev / n) / n, 0.0)), np.nan),
                "min": s[MIN],
                "max": s[MAX],
                "first": s[FIRST] if len(s) > FIRST else np.full(len(n), np.nan),
                "last": s[LAST] if len(s) > LAST else np.full(len(n), np.nan),
            }
        return frame, stats, values


def _fold(a: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Accumulated states ``a`` with one partition's states ``p`` of the same groups folded
    in (``a`` has at least ``p``'s fields)."""
    if len(p) == COUNTED:  # median/pNN groups: only their counts are read
        a[N] += p[N]
        return a
    fresh = a[N] == 0
    k = np.where(fresh, p[SHIFT], a[SHIFT])
    n_p, dev_p = p[N], p[DEV]
    a[SHIFT] = k
    a[N] += n_p
    a[RAW] += p[RAW]
    with np.errstate(invalid="ignore", over="ignore"):  # a non-finite group's sums are not used
        offset = p[SHIFT] - k
        a[DEV] += dev_p + n_p * offset
        a[SQ] += p[SQ] + 2 * offset * dev_p + n_p * offset * offset
        np.minimum(a[MIN], p[MIN], out=a[MIN])
        np.maximum(a[MAX], p[MAX], out=a[MAX])
    if len(p) == UNTIMED:
        return a
    earlier = p[FIRST_AT] < a[FIRST_AT]  # ties: the earlier part in file order
    take = (p[FIRST_TS] < a[FIRST_TS]) | ((p[FIRST_TS] == a[FIRST_TS]) & earlier)
    a[FIRST_TS : FIRST_AT + 1, take] = p[FIRST_TS : FIRST_AT + 1, take]
    earlier = p[LAST_AT] < a[LAST_AT]
    take = (p[LAST_TS] > a[LAST_TS]) | ((p[LAST_TS] == a[LAST_TS]) & earlier)
    a[LAST_TS : LAST_AT + 1, take] = p[LAST_TS : LAST_AT + 1, take]
    return a


def _empty_cells(size: int, fields: int = len(FIELDS)) -> np.ndarray:
    cells = np.empty((fields, size))
    cells[:] = _EMPTY[:fields, None]
    return cells


def _with_fields(state: np.ndarray, fields: int) -> np.ndarray:
    """``state`` with ``fields`` fields, those it lacks empty."""
    if len(state) >= fields:
        return state
    return np.concatenate([state, _empty_cells(state.shape[1], fields)[len(state) :]])
