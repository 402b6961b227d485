"""Mergeable partial states: each partition reduced on its own, then merged in a fixed order.

This is GLOBAL_REDUCE as the seed runs it live (each rank's state, merged by the
controller), done offline. A partition (one file of the run) is reduced to one row of
state per group, and the rows of all partitions are merged in an order fixed by their
content, so the result does not depend on the thread count, on which partition finished
first, or on the order the files were listed in.

The state of a group in one partition, over its values v (n of them):

  n, raw      count and the plain float sum (kept for groups that overflow or hold NaN)
  shift, dev  shift = raw / n, dev = sum(v - shift), sq = sum((v - shift)**2)
  sq          (near the mean, v - shift is exact, so dev and sq lose almost nothing)
  min, max    NaN-propagating, as numpy's
  first/last  the value with the smallest / largest timestamp (ties: the earlier row,
              then the partition that sorts first)
  values      for median and pNN only: the group's values themselves

Merging re-centres every partition on one shift K per group (the first partition's,
in the merge order): sum(v - K) = dev + n (shift - K) and sum((v - K)**2) = sq +
2 (shift - K) dev + n (shift - K)**2, where shift - K is exact for partitions whose
means are close. Then sum = n K + sum(v - K), mean = K + sum(v - K) / n and the
population variance is (sum((v-K)**2) - sum(v-K)**2 / n) / n: on values of 1e12 + N(0, 1)
in groups of 10^6 values, sum and mean are within about 1e-16 and std within about 1e-13
of an exact computation (``tests/test_exact.py``).

Every computation here is numpy over the partition's columns in row order (``bincount``
and ``ufunc.at`` add in index order), so a partition's state is the same on every run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from metric_core.offline.plan import ReducePlan, Statistic

STATE_COLUMNS = ("n", "raw", "shift", "dev", "sq", "min", "max", "first_ts", "first", "last_ts", "last")
# The families of state each statistic needs (count and the sums are always kept).
_NEEDS = {"min": "min", "max": "max", "first": "first", "last": "last", "std": "sq"}
_DENSE_SLACK = 1 << 16  # a dense group index may be this much (plus 2x rows) larger than the rows


@dataclass
class Partial:
    """One partition's states: ``groups`` (label columns, state columns, one row a group) and,
    for median/pNN groups, their values sorted within each group (``value_group`` is the
    row of ``groups`` each value belongs to)."""

    groups: pl.DataFrame
    value_group: np.ndarray
    values: np.ndarray


def label_columns(plan: ReducePlan) -> list[str]:
    return [*plan.group_columns, "key", "reduction"]


def partition_states(
    df: pl.DataFrame, plan: ReducePlan, statistic_of: Callable[[str, str], str], t0: float | None
) -> Partial:
    """Reduce one partition's records (a collected frame with the plan's input columns).

    ``statistic_of(key, recorded_reduction)`` names the statistic a key gets; the group
    label ``reduction`` is that name, so records of one key with different recorded
    reductions form one group when an override applies, and two groups otherwise.
    ``t0`` anchors ``--by time`` windows.
    """
    n_rows = df.height
    labels = label_columns(plan)
    if n_rows == 0:
        return _empty(plan)
    value = df["value"].to_numpy()
    codes: list[tuple[np.ndarray, int]] = []
    window: np.ndarray | None = None
    for col in plan.group_columns:
        if col == "window_start":
            assert t0 is not None and plan.every is not None
            window = np.floor((df["timestamp"].to_numpy() - t0) / plan.every).astype(np.int64)
            codes.append(_int_codes(window))
        elif df.schema[col].is_integer():
            codes.append(_int_codes(df[col].to_numpy()))
        else:
            codes.append(_dense(_category_codes(df[col])))
    key_codes, n_keys = _dense(_category_codes(df["key"]))
    red_codes, n_reds = _dense(_category_codes(df["reduction"]))
    # The statistic of each (key, reduction) pair present, by one representative row.
    pair = key_codes.astype(np.int64) * n_reds + red_codes
    pair_rep = _representatives(pair, n_keys * n_reds)
    present = np.flatnonzero(pair_rep >= 0)
    keys = df["key"].gather(pair_rep[present]).to_list()
    reds = df["reduction"].gather(pair_rep[present]).to_list()
    chosen = [statistic_of(k, r) for k, r in zip(keys, reds, strict=True)]
    names = sorted(set(chosen))
    stat_of_pair = np.zeros(n_keys * n_reds, dtype=np.int64)
    stat_of_pair[present] = [names.index(c) for c in chosen]
    stat_codes = stat_of_pair[pair]
    codes += [(key_codes, n_keys), (stat_codes, len(names))]
    ids, n_groups = _combine(codes, n_rows)
    rep = _representatives(ids, n_groups)
    count = np.bincount(ids, minlength=n_groups)
    group_stat = stat_codes[rep]
    out = {
        **{col: df[col].gather(rep) for col in plan.group_columns if col != "window_start"},
        "key": df["key"].gather(rep).cast(pl.String),
    }
    if window is not None:
        assert t0 is not None and plan.every is not None
        out["window_start"] = pl.Series(t0 + window[rep] * plan.every)
    out["reduction"] = pl.Series(np.array(names, dtype=object)[group_stat], dtype=pl.String)
    states = _sums(ids, n_groups, value, count, need_sq=_any_needs(names, "sq"))
    stats = [Statistic.parse(name) if _known(name) else None for name in names]
    for family in ("min", "max", "first", "last"):
        wanted = np.array([_NEEDS.get(s.name if s else "") == family for s in stats])
        if wanted.any():
            rows = None if wanted.all() else np.flatnonzero(wanted[stat_codes])
            states.update(_extreme(family, ids, n_groups, value, df, rows))
    quantile = np.array([s is not None and (s.name == "median" or s.quantile is not None) for s in stats])
    value_group = values = np.empty(0)
    if quantile.any():
        rows = np.flatnonzero(quantile[stat_codes])
        order = np.lexsort((value[rows], ids[rows]))
        value_group, values = ids[rows][order], value[rows][order]
    frame = pl.DataFrame(out).with_columns(
        **{name: pl.Series(states.get(name, np.full(n_groups, np.nan))) for name in STATE_COLUMNS[1:]},
        n=pl.Series(count, dtype=pl.Int64),
    )
    return Partial(frame.select(*labels, *STATE_COLUMNS), value_group, values)


def _known(name: str) -> bool:
    try:
        Statistic.parse(name)
    except Exception:
        return False
    return True


def _any_needs(names: Sequence[str], family: str) -> bool:
    return any(_NEEDS.get(name) == family for name in names)


def _empty(plan: ReducePlan) -> Partial:
    schema: dict[str, Any] = {
        col: pl.Float64 if col == "window_start" else pl.Int64 for col in plan.group_columns
    }
    schema.update(process=pl.String, key=pl.String, reduction=pl.String)
    frame = pl.DataFrame(schema={**{c: schema[c] for c in label_columns(plan)}, **_STATE_SCHEMA})
    return Partial(frame, np.empty(0, dtype=np.int64), np.empty(0))


_STATE_SCHEMA = {name: pl.Int64 if name == "n" else pl.Float64 for name in STATE_COLUMNS}


def _category_codes(series: pl.Series) -> np.ndarray:
    """Integer codes of a string column (equal strings, equal codes)."""
    return series.cast(pl.Categorical).to_physical().to_numpy()


def _int_codes(x: np.ndarray) -> tuple[np.ndarray, int]:
    lo = int(x.min())
    span = int(x.max()) - lo + 1
    if span <= 2 * len(x) + _DENSE_SLACK:
        return (x - lo).astype(np.int64), span
    return _dense(x)


def _dense(codes: np.ndarray) -> tuple[np.ndarray, int]:
    """Codes renumbered 0..k-1 (in the order of the original codes)."""
    codes = codes.astype(np.int64, copy=False)
    lo, hi = int(codes.min()), int(codes.max())
    if hi - lo > 4 * len(codes) + _DENSE_SLACK:
        uniq, inverse = np.unique(codes, return_inverse=True)
        return inverse.astype(np.int64), len(uniq)
    shifted = codes - lo
    present = np.bincount(shifted, minlength=hi - lo + 1) > 0
    lookup = np.cumsum(present) - 1
    return lookup[shifted], int(present.sum())


def _combine(codes: list[tuple[np.ndarray, int]], n_rows: int) -> tuple[np.ndarray, int]:
    """One dense group index from several columns' codes (mixed radix, renumbered when sparse)."""
    ids = np.zeros(n_rows, dtype=np.int64)
    span = 1
    for c, k in codes:
        if span * k > 4 * n_rows + _DENSE_SLACK:
            ids, span = _dense(ids)
        ids = ids * k + c
        span *= k
    return _dense(ids) if span > n_rows else _squeeze(ids, span)


def _squeeze(ids: np.ndarray, span: int) -> tuple[np.ndarray, int]:
    present = np.bincount(ids, minlength=span) > 0
    if present.all():
        return ids, span
    return (np.cumsum(present) - 1)[ids], int(present.sum())


def _representatives(ids: np.ndarray, n: int) -> np.ndarray:
    """For each id 0..n-1, the first row holding it (-1 where none does)."""
    first = np.full(n, -1, dtype=np.int64)
    uniq, index = np.unique(ids, return_index=True) if len(ids) < 4 * n else _first_rows(ids, n)
    first[uniq] = index
    return first


def _first_rows(ids: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    first = np.full(n, len(ids), dtype=np.int64)
    np.minimum.at(first, ids, np.arange(len(ids), dtype=np.int64))
    present = np.flatnonzero(first < len(ids))
    return present, first[present]


def _sums(
    ids: np.ndarray, n: int, value: np.ndarray, count: np.ndarray, need_sq: bool
) -> dict[str, np.ndarray]:
    raw = np.bincount(ids, weights=value, minlength=n)
    with np.errstate(invalid="ignore", divide="ignore"):
        shift = raw / np.maximum(count, 1)
    shift = np.where(np.isfinite(shift), shift, 0.0)  # raw keeps what a non-finite value did
    dev_each = value - shift[ids]
    out = {"raw": raw, "shift": shift, "dev": np.bincount(ids, weights=dev_each, minlength=n)}
    if need_sq:
        out["sq"] = np.bincount(ids, weights=dev_each * dev_each, minlength=n)
    return out


def _extreme(
    family: str, ids: np.ndarray, n: int, value: np.ndarray, df: pl.DataFrame, rows: np.ndarray | None
) -> dict[str, np.ndarray]:
    g = ids if rows is None else ids[rows]
    v = value if rows is None else value[rows]
    if family in ("min", "max"):
        out = np.full(n, np.inf if family == "min" else -np.inf)
        with np.errstate(invalid="ignore"):
            (np.minimum if family == "min" else np.maximum).at(out, g, v)
        return {family: out}
    ts = df["timestamp"].to_numpy()
    ts = ts if rows is None else ts[rows]
    best = np.full(n, np.inf if family == "first" else -np.inf)
    (np.minimum if family == "first" else np.maximum).at(best, g, ts)
    candidates = np.flatnonzero(ts == best[g])
    uniq, index = np.unique(g[candidates], return_index=True)
    chosen = np.full(n, np.nan)
    chosen[uniq] = v[candidates[index]]
    return {f"{family}_ts": best, family: chosen}


def merge(partials: Sequence[Partial], plan: ReducePlan) -> tuple[pl.DataFrame, np.ndarray, np.ndarray]:
    """All partitions' states merged, one row a group, sorted by the labels.

    Within a group the partitions' rows are merged in the order of their states (then of
    the partition), which does not depend on how the partitions were produced. Returns the
    merged frame and, for median/pNN groups, (row of the merged frame, value) sorted.
    """
    labels = label_columns(plan)
    frames = [
        p.groups.with_columns(_part=pl.lit(i, pl.Int32), _row=pl.int_range(pl.len(), dtype=pl.Int64))
        for i, p in enumerate(partials)
    ]
    both = pl.concat(frames, how="vertical_relaxed").sort([*labels, "shift", "n", "dev", "sq", "_part"])
    if both.height == 0:
        return both.select(*labels, *STATE_COLUMNS), np.empty(0, dtype=np.int64), np.empty(0)
    new = np.zeros(both.height, dtype=bool)
    new[0] = True
    for col in labels:
        s = both[col]
        new[1:] |= (s.slice(1) != s.slice(0, s.len() - 1)).fill_null(True).to_numpy()
        # nulls never occur in labels (the reader drops such records)
    starts = np.flatnonzero(new)
    group = np.cumsum(new) - 1
    state = {name: both[name].to_numpy() for name in STATE_COLUMNS}
    n_p = state["n"]
    n = np.add.reduceat(n_p, starts)
    raw = np.add.reduceat(state["raw"], starts)
    k = state["shift"][starts][group]
    offset = state["shift"] - k
    dev = np.add.reduceat(state["dev"] + n_p * offset, starts)
    with np.errstate(invalid="ignore"):
        sq = np.add.reduceat(state["sq"] + 2 * offset * state["dev"] + n_p * offset * offset, starts)
    base = state["shift"][starts]
    finite = np.isfinite(raw)
    out: dict[str, np.ndarray] = {
        "n": n,
        "sum": np.where(finite, n * base + dev, raw),
        "mean": np.where(finite, base + dev / n, raw / n),
        "std": np.where(finite, np.sqrt(np.maximum((sq - dev * dev / n) / n, 0.0)), np.nan),
        "min": np.minimum.reduceat(state["min"], starts),
        "max": np.maximum.reduceat(state["max"], starts),
    }
    for family in ("first", "last"):
        out[family] = _pick(state[f"{family}_ts"], state[family], both["_part"].to_numpy(), starts, family)
    merged = (
        both[starts]
        .select(labels)
        .with_columns(
            **{
                name: pl.Series(out[name])
                for name in ("n", "sum", "mean", "std", "min", "max", "first", "last")
            }
        )
    )
    value_group, values = _merged_values(partials, both, group)
    return merged, value_group, values


def _pick(ts: np.ndarray, value: np.ndarray, part: np.ndarray, starts: np.ndarray, family: str) -> np.ndarray:
    """Per group, the value at the smallest (first) or largest (last) timestamp; ties go to
    the earlier partition."""
    group = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(ts)]))
    key = ts if family == "first" else -ts
    order = np.lexsort((part, key, group))
    firsts = np.r_[True, group[order][1:] != group[order][:-1]]
    out = np.full(len(starts), np.nan)
    out[group[order][firsts]] = value[order][firsts]
    return out


def _merged_values(
    partials: Sequence[Partial], both: pl.DataFrame, group: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Every median/pNN value with the merged group it belongs to, sorted by (group, value)."""
    if not any(len(p.values) for p in partials):
        return np.empty(0, dtype=np.int64), np.empty(0)
    part = both["_part"].to_numpy()
    row = both["_row"].to_numpy()
    groups, values = [], []
    for i, p in enumerate(partials):
        if not len(p.values):
            continue
        mine = np.flatnonzero(part == i)
        to_merged = np.empty(p.groups.height, dtype=np.int64)
        to_merged[row[mine]] = group[mine]
        groups.append(to_merged[p.value_group])
        values.append(p.values)
    g, v = np.concatenate(groups), np.concatenate(values)
    order = np.lexsort((v, g))
    return g[order], v[order]


def percentile(value_group: np.ndarray, values: np.ndarray, n_groups: int, q: np.ndarray) -> np.ndarray:
    """numpy's linear percentile of each group's sorted values; q per group (NaN: none).

    A group holding NaN gets NaN (its NaNs sort last)."""
    out = np.full(n_groups, np.nan)
    if not len(values):
        return out
    starts, ends = _bounds(value_group, n_groups)
    has = (ends > starts) & ~np.isnan(q)
    g = np.flatnonzero(has)
    size = ends[g] - starts[g]
    virtual = q[g] * (size - 1)
    lo = np.floor(virtual).astype(np.int64)
    hi = np.minimum(lo + 1, size - 1)
    gamma = virtual - lo
    a, b = values[starts[g] + lo], values[starts[g] + hi]
    diff = b - a
    with np.errstate(invalid="ignore"):
        # numpy's _lerp: from the nearer end, so the result stays within [a, b]
        lerp = np.where(gamma >= 0.5, b - diff * (1 - gamma), a + diff * gamma)
    nan = np.isnan(values[ends[g] - 1])
    out[g] = np.where(nan, np.nan, lerp)
    return out


def median(value_group: np.ndarray, values: np.ndarray, n_groups: int) -> np.ndarray:
    """numpy's median of each group's sorted values: the middle one, or the mean of the two."""
    out = np.full(n_groups, np.nan)
    if not len(values):
        return out
    starts, ends = _bounds(value_group, n_groups)
    g = np.flatnonzero(ends > starts)
    size = ends[g] - starts[g]
    a = values[starts[g] + (size - 1) // 2]
    b = values[starts[g] + size // 2]
    nan = np.isnan(values[ends[g] - 1])
    out[g] = np.where(nan, np.nan, np.where(size % 2 == 1, a, (a + b) / 2))
    return out


def _bounds(value_group: np.ndarray, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Where each group's values start and end in the sorted values."""
    groups = np.arange(n_groups)
    return np.searchsorted(value_group, groups, side="left"), np.searchsorted(
        value_group, groups, side="right"
    )
