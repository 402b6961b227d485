"""Finishing: the groups folded below a bucket taken out of the accumulator as result
frames, each group's value computed from its merged states (median and pNN to numpy's bit)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import polars as pl

from metric_core.offline import partials
from metric_core.offline.accumulator import Accumulator
from metric_core.offline.engine.reading import statistic_chooser
from metric_core.offline.engine.reductions import KeyReductions, kept_reductions
from metric_core.offline.plan import By, ReducePlan, Statistic
from metric_core.offline.read import RunScan
from metric_core.offline.read.report import MixedKey

# The groups of one frame of a result, at most (in whole blocks of steps)
TAKEN_GROUPS = 1 << 17


def finished_frames(
    plan: ReducePlan,
    scan: RunScan | None,
    acc: Accumulator,
    t0: float | None,
    recorded: KeyReductions,
    upto: float,
    mixed: dict[str, MixedKey],
    last: bool = False,
) -> Iterator[pl.DataFrame]:
    """The result of the groups folded into ``acc`` below bucket ``upto`` (``take``), in
    frames of about TAKEN_GROUPS groups; ``recorded`` and ``mixed`` as ``kept_reductions``
    (``last``: no frame of the stream follows these)."""
    if plan.by is By.TIME:
        bucket = pl.lit(t0) + pl.col("bucket").cast(pl.Float64) * float(plan.every or 0)
    else:
        bucket = pl.col("bucket")
    cuts = acc.cuts(upto, TAKEN_GROUPS)
    for i, cut in enumerate(cuts):
        merged, stats, values = acc.take(cut)
        if merged.height == 0:
            continue
        remember = not last or i + 1 < len(cuts)
        kept = kept_reductions(scan, merged, recorded, stats["count"], mixed, remember)
        value = group_values(merged, stats, values)
        out = merged.with_columns(
            bucket.alias(plan.bucket), value=pl.Series(value), count=pl.Series(stats["count"])
        )
        if kept is not None:
            out = out.filter(pl.Series(kept))
        out = out.select(plan.output_columns).with_columns(pl.col(pl.Categorical).cast(pl.String))
        del merged, stats, values, value, kept  # not held while the frame is written
        yield out.sort(plan.sort_columns)


def reduce_records(
    plan: ReducePlan,
    records: pl.DataFrame,
    t0: float | None,
    recorded: KeyReductions,
    mixed: dict[str, MixedKey] | None = None,
) -> pl.DataFrame:
    """The reduction of ``records`` (in the record schema, every record of each group they
    touch), computed as ``execute`` computes it: one partition's states, taken whole.
    ``t0`` anchors ``--by time`` windows; ``recorded`` holds each key's statistic in earlier
    results (a key met under another reduction keeps it, and the records under the other
    are skipped and counted in ``mixed``). For a caller that sees a run a part at a time
    (``upload --follow``)."""
    acc = Accumulator()
    try:
        acc.add(partials.partition_states(records, plan, statistic_chooser(plan), t0))
        frames = list(
            finished_frames(plan, None, acc, t0, recorded, math.inf, {} if mixed is None else mixed)
        )
    finally:
        acc.close()
    return pl.concat(frames) if frames else pl.DataFrame()


def group_values(
    merged: pl.DataFrame, stats: dict[str, np.ndarray], values: list[pl.LazyFrame]
) -> np.ndarray:
    """Each group's value: the statistic its reduction names, from the merged states.

    median and pNN take the one or two order statistics they need from each group's
    sorted values (polars), then combine them as numpy does (``_as_numpy``): the same bits
    as ``np.median`` and ``np.percentile``. A group holding NaN gets NaN, as in numpy."""
    value = np.full(merged.height, np.nan)
    for name in merged["reduction"].unique().sort():
        stat = Statistic.parse(name)
        rows = (merged["reduction"] == name).to_numpy()
        if stat.name != "median" and stat.quantile is None:
            value[rows] = stats[stat.name][rows]
            continue
        at, code, buckets = _group_places(merged, rows)
        # values of other statistics' groups are there too: these groups' combos
        combos = None
        if merged["reduction"].n_unique() > 1:
            combos = pl.Series(np.unique(code & 0xFFFFFFFF)).implode()
        n = pl.len().cast(pl.Int64)
        if stat.quantile is None:  # median: the middle value, or the two middle ones
            lo, hi = (n - 1) // 2, n // 2
        else:  # numpy's linear method: between floor((n - 1) q) and the next one
            lo = ((n - 1).cast(pl.Float64) * stat.quantile).floor().cast(pl.Int64)
            hi = pl.min_horizontal(lo + 1, n - 1)
        between = pl.col("value").sort().slice(lo, hi - lo + 1)  # one sort for both
        order = {k: np.full(merged.height, np.nan) for k in ("n", "lo", "hi", "nan")}
        for part in values:  # a slice of groups at a time, each put at its row of merged
            if combos is not None:
                part = part.filter(pl.col("_combo").is_in(combos))
            nan = pl.col("value").is_nan().any()
            found = part.group_by("bucket", "_combo").agg(n=n, between=between, nan=nan).collect()
            bucket = found["bucket"].to_numpy()
            rank = np.minimum(np.searchsorted(buckets, bucket), len(buckets) - 1)
            mine = (rank << 32) | found["_combo"].to_numpy()
            place = np.minimum(np.searchsorted(code, mine), len(code) - 1)
            # a group of this statistic (not one of another's combo, nor of a bucket it has not)
            known = (code[place] == mine) & (buckets[rank] == bucket)
            row = at[place[known]]
            order["n"][row] = found["n"].to_numpy()[known]
            order["nan"][row] = found["nan"].to_numpy()[known]
            order["lo"][row] = found["between"].list.first().to_numpy()[known]
            order["hi"][row] = found["between"].list.last().to_numpy()[known]
        value[rows] = _as_numpy(order, stat.quantile)[rows]
    return value


def _group_places(merged: pl.DataFrame, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The groups of ``merged`` where ``rows``, for finding them by (bucket, _combo) without
    a join: their rows ``at``, in the order of ``code`` (the rank of their bucket among
    ``buckets``, then their combo), and ``buckets``."""
    at = np.flatnonzero(rows)
    bucket, combo = merged["bucket"].to_numpy()[at], merged["_combo"].to_numpy()[at]
    buckets = np.unique(bucket)
    code = (np.searchsorted(buckets, bucket) << 32) | combo
    del bucket, combo
    if len(code) > 1 and not (code[1:] > code[:-1]).all():  # a take hands them over in this order
        order = np.argsort(code)
        at, code = at[order], code[order]
    return at, code, buckets


def _as_numpy(order: dict[str, np.ndarray], q: float | None) -> np.ndarray:
    """A median (q None) or a linear percentile from each group's count ``n`` and its order
    statistics ``lo`` and ``hi``, computed as numpy 2's ``median`` and ``percentile`` do, to
    the bit (NaN where the group holds NaN: ``nan``)."""
    n, lo, hi = order["n"], order["lo"], order["hi"]
    with np.errstate(invalid="ignore", over="ignore"):
        if q is None:  # np.median: the mean of the middle one or two (its sum starts at 0.0)
            out = np.where(n % 2 == 1, lo + 0.0, (lo + 0.0 + hi) / 2)
        else:  # np.percentile's virtual index, weight and _lerp
            virtual = (n - 1) * q
            gamma = virtual - np.where(virtual >= n - 1, -1.0, np.floor(virtual))
            diff = hi - lo
            out = lo + diff * gamma
            np.subtract(hi, diff * (1 - gamma), out=out, where=gamma >= 0.5)
    out[order["nan"] == 1] = np.nan
    return out
