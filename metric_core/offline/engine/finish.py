"""Finishing: the groups folded below a bucket taken out of the accumulator as result
frames, each group's value computed from its merged states (median and pNN to numpy's bit)."""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import polars as pl

from metric_core.offline.engine import partials
from metric_core.offline.engine.accumulator import Accumulator, Taken
from metric_core.offline.engine.filtering import statistic_chooser
from metric_core.offline.engine.reductions import KeyReductions, kept_reductions
from metric_core.offline.keyorder import key_ranks
from metric_core.offline.plan import By, ReducePlan, Statistic
from metric_core.offline.read import RunScan
from metric_core.offline.read.report import MixedKey

# The groups of one take of the accumulator, at most (in whole blocks of steps)
TAKEN_GROUPS = 1 << 17
# The rows of one result frame, at most: a take is handed over in frames cut where a step
# (of a source) ends, and inside a step only when the step alone has more groups (a frame of
# --wide is whole steps: such a step has more keys than --wide takes)
FRAME_GROUPS = 1 << 17


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
    if acc.aside is not None:  # millions of groups: set aside on disk, read back a slice of keys at a time
        for part, final in acc.slices(upto):
            yield from finished_frames(plan, scan, part, t0, recorded, math.inf, mixed, last and final)
        return
    if plan.by is By.TIME:
        bucket = pl.lit(t0) + pl.col("bucket").cast(pl.Float64) * float(plan.every or 0)
    else:
        bucket = pl.col("bucket")
    cuts = acc.cuts(upto, TAKEN_GROUPS)
    for i, cut in enumerate(cuts):
        taken = acc.take(cut)
        if not len(taken.bucket):
            continue
        remember = not last or i + 1 < len(cuts)
        # Which groups are kept is decided per combo (a key's reduction is its combos'), on
        # the labels of the combos met once each, not on a row of labels a group.
        combos, first, group_combo = _combos(taken.combo)
        labels = taken.labels if len(combos) == taken.labels.height else taken.labels[combos]
        per_combo = pl.DataFrame({"bucket": taken.bucket[first]}).hstack(labels)  # its first bucket
        combo_count = np.bincount(group_combo, weights=taken.count, minlength=len(combos)).astype(np.int64)
        kept = kept_reductions(scan, per_combo, recorded, combo_count, mixed, remember)
        groups = pl.DataFrame(
            {"bucket": taken.bucket, "_combo": taken.combo, "reduction": labels["reduction"][group_combo]}
        )
        value = group_values(groups, taken.value, taken.values)
        del groups, first
        rows = np.arange(len(value)) if kept is None else np.flatnonzero(kept[group_combo])
        yield from _sorted_frames(plan, bucket, labels, taken, rows, group_combo, value)


def _sorted_frames(
    plan: ReducePlan,
    bucket: pl.Expr,
    labels: pl.DataFrame,
    taken: Taken,
    rows: np.ndarray,
    group_combo: np.ndarray,
    value: np.ndarray,
) -> Iterator[pl.DataFrame]:
    """The groups ``rows`` of ``taken`` (``labels``: their combos', ``group_combo`` each
    group's row of it) as result frames in the order of ``plan.sort_columns``, of about
    FRAME_GROUPS rows each, cut where a (source and) bucket ends while one is that small:
    never the whole result gathered and sorted as one frame."""
    per_source = "process" in labels.columns and "process" in plan.sort_columns
    key_rank = key_ranks(labels["key"])  # a range of keys at a time: a sort of all is large
    combo = group_combo[rows]
    group_bucket = taken.bucket[rows]
    columns = [key_rank[combo], group_bucket]
    source_of = None
    if per_source:  # each combo's source, ranked in the order of (process, rank)
        source_of = _source_ranks(labels.select("process", "rank"))
        columns.append(source_of[combo])
    if not _in_order(columns):
        rows = rows[np.lexsort(columns)]
    del columns, combo
    # where a (source and) bucket starts, in the sorted rows
    group_bucket = taken.bucket[rows]
    starts = np.r_[True, group_bucket[1:] != group_bucket[:-1]]
    if source_of is not None:
        source = source_of[group_combo[rows]]
        starts[1:] |= source[1:] != source[:-1]
        del source
    del group_bucket
    edges = _edges(np.flatnonzero(starts), len(rows), FRAME_GROUPS)
    del starts
    for lo, hi in itertools.pairwise(edges):
        at = rows[lo:hi]
        part = pl.DataFrame({"bucket": taken.bucket[at]}).hstack(labels[group_combo[at]])
        out = part.with_columns(
            bucket.alias(plan.bucket), value=pl.Series(value[at]), count=pl.Series(taken.count[at])
        )
        yield out.select(plan.output_columns).with_columns(pl.col(pl.Categorical).cast(pl.String))


def _in_order(columns: list[np.ndarray]) -> bool:
    """Whether the rows are already in the order ``np.lexsort(columns)`` gives (the last
    column first): a take is in the order of bucket then combo, often that of the keys."""
    later = np.zeros(max(len(columns[0]) - 1, 0), dtype=bool)  # a row past the one before it
    tied = np.ones_like(later)
    for c in reversed(columns):
        later |= tied & (c[1:] > c[:-1])
        tied &= c[1:] == c[:-1]
        if not (later | tied).all():
            return False
    return True


def _source_ranks(sources: pl.DataFrame) -> np.ndarray:
    """Each row's source (process Categorical, rank) as its place among the distinct ones in
    the order of (process, rank): told apart on the process's code and the rank as one
    integer (a join of millions of rows on them held several copies of its columns), by a
    join only where a process is null or the ranks span more than 2**31."""
    process, rank = sources["process"], sources["rank"]
    lo, hi = rank.min(), rank.max()
    if process.null_count() or rank.null_count() or lo is None or int(hi) - int(lo) >= 1 << 31:  # type: ignore[arg-type]
        ranked = sources.unique().sort(pl.col("process").cast(pl.String), "rank").with_row_index("_source")
        joined = sources.join(
            ranked, on=["process", "rank"], how="left", nulls_equal=True, maintain_order="left"
        )
        return joined["_source"].to_numpy().astype(np.int64)
    pair = (process.to_physical().to_numpy().astype(np.int64) << 31) | (rank.to_numpy() - int(lo))  # type: ignore[arg-type]
    distinct, first, inverse = np.unique(pair, return_index=True, return_inverse=True)
    del pair
    ranked = sources[first].with_row_index("_distinct").sort(pl.col("process").cast(pl.String), "rank")
    place = np.empty(len(distinct), dtype=np.int64)
    place[ranked["_distinct"].to_numpy()] = np.arange(len(distinct))
    return place[inverse]


def _combos(combo: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``np.unique(combo, return_index=True, return_inverse=True)``, without its sorts
    where each combo is there once, in order (a take of one step)."""
    if len(combo) < 2 or (combo[1:] > combo[:-1]).all():
        at = np.arange(len(combo))
        return combo, at, at
    top = int(combo.max())
    if top >= max(len(combo), 1 << 16):  # combos numbered far apart: sorted
        return np.unique(combo, return_index=True, return_inverse=True)
    present = np.zeros(top + 1, dtype=bool)  # else counted in place of a sort
    present[combo] = True
    distinct = np.flatnonzero(present)
    first = np.full(top + 1, len(combo))
    np.minimum.at(first, combo, np.arange(len(combo)))
    return distinct, first[distinct], (np.cumsum(present) - 1)[combo]


def _edges(starts: np.ndarray, n: int, size: int) -> list[int]:
    """Where to cut ``n`` sorted rows into pieces of about ``size``: at a run's start
    (``starts``), or inside a run longer than ``size``."""
    edges = [0]
    while n - edges[-1] > size:
        target = edges[-1] + size
        k = int(np.searchsorted(starts, target, side="right")) - 1
        cut = int(starts[k]) if k >= 0 and starts[k] > edges[-1] else target
        edges.append(cut)
    return [*edges, n]


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


def group_values(merged: pl.DataFrame, plain: np.ndarray, values: list[pl.LazyFrame]) -> np.ndarray:
    """Each group's value: the statistic its reduction names, from the merged states
    (``plain``, already there but for median and pNN; merged: bucket, _combo, reduction).

    median and pNN take the one or two order statistics they need from each group's
    values (``_order_statistics``), then combine them as numpy does (``_as_numpy``): the
    same bits as ``np.median`` and ``np.percentile``. A group holding NaN gets NaN, as in
    numpy."""
    value = plain
    for name in merged["reduction"].unique().sort():
        stat = Statistic.parse(name)
        if stat.name != "median" and stat.quantile is None:
            continue
        rows = (merged["reduction"] == name).to_numpy()
        at, code, buckets = _group_places(merged, rows)
        # values of other statistics' groups are there too: these groups' combos
        combos = None
        if merged["reduction"].n_unique() > 1:
            combos = pl.Series(np.unique(code & 0xFFFFFFFF)).implode()
        order = {k: np.full(merged.height, np.nan) for k in ("n", "lo", "hi", "nan", "below", "rank")}
        parts = values if combos is None else [part.filter(pl.col("_combo").is_in(combos)) for part in values]
        for found in _each_order_statistics(parts, stat.quantile):  # each put at its row of merged
            bucket = found["bucket"]
            rank = np.minimum(np.searchsorted(buckets, bucket), len(buckets) - 1)
            mine = (rank << 32) | found["_combo"]
            place = np.minimum(np.searchsorted(code, mine), len(code) - 1)
            # a group of this statistic (not one of another's combo, nor of a bucket it has not)
            known = (code[place] == mine) & (buckets[rank] == bucket)
            row = at[place[known]]
            for k in order:
                order[k][row] = found[k][known]
        _signed_zeros(order, stat.quantile)
        value[rows] = _as_numpy(order, stat.quantile)[rows]
    return value


# Slices of median/pNN values whose order statistics are found at once (each holds about
# SLICE_VALUES values, 100 bytes each while it is read and selected in)
ORDER_THREADS = 2


def _each_order_statistics(parts: list[pl.LazyFrame], q: float | None) -> Iterator[dict[str, np.ndarray]]:
    """``_order_statistics`` of each slice of values, in order: by the extension, on up to
    ORDER_THREADS threads (it releases the GIL, as polars' reading of a spilled slice does),
    each started once a slice's result is read, so that at most that many slices' values
    are held at once, however many cores there are."""
    from metric_core.offline.engine import exact

    threads = min(len(parts), pl.thread_pool_size(), ORDER_THREADS)
    if exact._native is None or threads < 2:  # polars' sort is on its own threads already
        yield from (_order_statistics(part, q) for part in parts)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="metriclog-order") as pool:
        ahead = collections.deque(pool.submit(_order_statistics, part, q) for part in parts[:threads])
        for part in parts[threads:]:
            found = ahead.popleft().result()
            ahead.append(pool.submit(_order_statistics, part, q))
            yield found
        while ahead:
            yield ahead.popleft().result()


_FOUND = ("bucket", "_combo", "n", "lo", "hi", "nan", "below", "rank")  # what _order_statistics gives
_PART_TYPES = (("bucket", np.int64), ("_combo", np.int64), ("value", np.float64))  # what it reads


def _order_statistics(part: pl.LazyFrame, q: float | None) -> dict[str, np.ndarray]:
    """Each group (bucket, _combo) of the values ``part`` holds: its count ``n``; ``lo``
    and ``hi``, its values of ranks ``rank`` and the next one its statistic needs in the
    ascending order (a median, q None: ranks (n - 1) // 2 and n // 2; pNN: floor((n - 1) q)
    and the next, at most n - 1); whether it holds NaN (``nan``); and ``below``: its values
    below 0.0, -0.0 counted. By the extension (a selection a group) where it is built, else
    by a sort of each group's values in polars: the same values (a zero's sign aside,
    which ``_signed_zeros`` gives from ``below``)."""
    from metric_core.offline.engine import exact

    if exact._native is not None:
        frame = part.collect()
        columns = [np.ascontiguousarray(frame[c].to_numpy(), dtype=t) for c, t in _PART_TYPES]
        del frame
        out = [np.empty(len(columns[2]), dtype=np.float64 if k in ("lo", "hi") else np.int64) for k in _FOUND]
        groups = exact._native.order_stats(*columns, -1.0 if q is None else q, *out)
        del columns
        return {k: a[:groups].copy() for k, a in zip(_FOUND, out, strict=True)}  # not a value's room
    n = pl.len().cast(pl.Int64)
    if q is None:  # median: the middle value, or the two middle ones
        lo, hi = (n - 1) // 2, n // 2
    else:  # numpy's linear method: between floor((n - 1) q) and the next one
        lo = ((n - 1).cast(pl.Float64) * q).floor().cast(pl.Int64)
        hi = pl.min_horizontal(lo + 1, n - 1)
    between = pl.col("value").sort().slice(lo, hi - lo + 1)  # one sort for both
    # a sort leaves -0.0 and 0.0 in the order the rows came: these zeros' signs are those
    # of the order where -0.0 comes first (the values below 0.0 counted)
    negative = (pl.col("value") < 0) | ((pl.col("value") == 0) & (1.0 / pl.col("value") < 0))
    found = (
        part.group_by("bucket", "_combo")
        .agg(n=n, between=between, nan=pl.col("value").is_nan().any(), below=negative.sum(), rank=lo)
        .with_columns(lo=pl.col("between").list.first(), hi=pl.col("between").list.last())
        .collect()
    )
    return {k: found[k].to_numpy() for k in _FOUND}


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


def _signed_zeros(order: dict[str, np.ndarray], q: float | None) -> None:
    """The order statistics ``lo`` and ``hi`` that are zeros given the sign they have where
    -0.0 sorts before 0.0: -0.0 if their rank is below the count of values below 0.0
    (``below``, -0.0 counted), else 0.0. So a median or pNN does not depend on which zero
    came first."""
    n, lo_rank = order["n"], order["rank"]
    hi_rank = n // 2 if q is None else np.minimum(lo_rank + 1, n - 1)
    for at, rank in (("lo", lo_rank), ("hi", hi_rank)):
        zero = order[at] == 0
        order[at][zero] = np.where(rank[zero] < order["below"][zero], -0.0, 0.0)


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
