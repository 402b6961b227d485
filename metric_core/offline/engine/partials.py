"""Mergeable partial states: each partition reduced on its own, then folded.

This is GLOBAL_REDUCE as the seed runs it live (each rank's state, merged by the
controller), done offline. A partition (a piece of about 125,000 records of one task: a
file, or a row group of one, see ``engine.tasks.tasks``) is reduced to one row of state
per group (``partition_states``), and an ``Accumulator`` (``engine.accumulator``) folds
the partitions' states with ``fold``.

The state of a group in one partition, over its values v (n of them):

  n           the count
  exact       for a group whose statistic is sum, mean or std: its exact sum (and, for
              std, its exact sum of squares) as integers (``engine.exact.ExactState``),
              one state for all the partition's groups (None where none needs it).
              Adding two is adding integers, so a sum, mean or std is the correctly
              rounded value of the exact one, whatever the order of the folds
  min, max    NaN-propagating, as numpy's
  first/last  the value of the record first / last in the order of (timestamp, step,
              source, the value's bits), with that record's timestamp, step and source
              (``first_ts``, ``first_step``, ``first_process``, ``first_rank``, the same
              for last; step, process and rank as int64 bits): ties of timestamps are
              broken by content, never by where a record was stored. The source's
              process is held as a digest of its name (``_process_digests``)
  values      for median and pNN only: the group's values themselves. Of the fields
              above, only n of such a group is ever read, so a partition whose groups
              are all median/pNN keeps n alone

Every field is a function of the set of records folded in, not of their order: counts
and exact sums add integers, min and max pick one value (a tie of -0.0 and 0.0 goes to
-0.0 for min, 0.0 for max), first and last one record by content. So the result is the
same bits however the records are split into files, row groups, partitions, threads or
Ray tasks, whatever the files' names and the order of their rows.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl

from metric_core.errors import MetricLogError, PlanError
from metric_core.format.schema import key_hash
from metric_core.offline import filters
from metric_core.offline.plan import By, ReducePlan, Statistic

if TYPE_CHECKING:  # imported where used: the engine package imports this module
    from metric_core.offline.engine.exact import ExactState

# The fields of a group's state, and what a field holds where nothing was folded in yet.
FIELDS = (
    "n", "min", "max",
    "first_ts", "first", "first_step", "first_process", "first_rank",
    "last_ts", "last", "last_step", "last_process", "last_rank",
)  # fmt: skip
_EMPTY = np.array([0, np.inf, -np.inf, np.inf, np.nan, 0, 0, 0, -np.inf, np.nan, 0, 0, 0])
N, MIN, MAX = range(3)
FIRST_TS, FIRST, FIRST_STEP, FIRST_PROCESS, FIRST_RANK = range(3, 8)
LAST_TS, LAST, LAST_STEP, LAST_PROCESS, LAST_RANK = range(8, 13)
_ORDER = ("step", "process", "rank")  # what breaks a tie of timestamps, after them the value's bits
# A state holds the fields a partition's statistics need: the count alone for sum, mean,
# std (their sums are exact, apart), median and pNN (their values are kept apart), up to
# max where min or max is among them (3), first and last only where a statistic needs them.
UNTIMED = FIRST_TS
COUNTED = MIN
_EXACT = ("sum", "mean", "std")  # the statistics of the exact sums
_FAMILIES = ("min", "max", "first", "last")  # what only some statistics need
_DENSE_SLACK = 1 << 16  # a dense index may be this much (plus 4x the rows) larger than the rows


KEEP_SUMS, KEEP_SQUARES, KEEP_COUNT = 0, 1, 2  # what the table keeps of a combo's records (``Rows``)


@dataclass
class Rows:
    """Records handed over as they are, for the accumulator to add straight into their
    groups (``engine.grouptable``): each one's ``bucket``, ``combo`` (a row of the
    partition's labels) and ``value``; ``squares``, for each combo, what its groups keep of
    its records: KEEP_SUMS (count, min, max, exact sum), KEEP_SQUARES (and the exact sum of
    squares: std) or KEEP_COUNT (the count alone: a median's or pNN's, whose values are
    kept apart)."""

    bucket: np.ndarray
    combo: np.ndarray
    value: np.ndarray
    squares: np.ndarray

    def __len__(self) -> int:
        return len(self.value)


@dataclass
class Partial:
    """One partition's states, one entry a group.

    ``bucket`` is the group's step (or ``--by time`` window number); ``combo`` indexes
    the rows of ``labels``: the (process, rank,) key and statistic (column ``reduction``)
    of the group (global_reduce has no process and rank); ``state`` holds the arrays named
    in the module docstring; for median/pNN groups, ``values`` holds their values and
    ``value_group`` their groups.
    """

    bucket: np.ndarray
    combo: np.ndarray
    labels: pl.DataFrame
    state: np.ndarray  # FIELDS x groups
    value_group: np.ndarray
    values: np.ndarray
    exact: ExactState | None = None
    rows: Rows | None = None  # records of the groups no state was made for (compiled path)
    names: tuple[tuple[Any, ...], ...] | None = None  # the rows of labels, where made from Python values
    # ``value_group`` holds rows of ``rows``, not groups: a median's or pNN's records handed
    # over as rows too (their groups counted in the accumulator's table), their values kept
    values_by_row: bool = False


# The statistics whose records may be handed over as they are (``Rows``): what they read of
# a group is its count, min, max and exact sums, which the accumulator's table keeps.
DIRECT = ("sum", "mean", "std", "min", "max", "count")


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
    direct: bool = False,
) -> Partial:
    """Reduce one partition's records (a collected frame with the plan's input columns,
    and the step, process and rank where a first or last may be wanted: what breaks ties
    of timestamps, ``engine.tasks.columns_read``).

    ``statistic_of(key, recorded_reduction)`` names the statistic a key gets; it is part
    of the group, so records of one key with different recorded reductions form one group
    when an override applies, and two groups (an error, found after the fold) otherwise.
    ``t0`` anchors ``--by time`` windows. With ``direct``, the records of groups whose
    statistic is one of DIRECT are handed over as they are (``Partial.rows``), for the
    accumulator's table (``engine.grouptable``), and get no state here.
    """
    rows = df.height
    if rows == 0:
        none = np.empty(0, dtype=np.int64)
        return Partial(none, none, pl.DataFrame(), np.empty((len(FIELDS), 0)), none, np.empty(0))
    value = df["value"].to_numpy()
    if plan.by is By.TIME:
        assert t0 is not None and plan.every is not None
        bucket = np.floor((df["timestamp"].to_numpy() - t0) / plan.every).astype(np.int64)
    else:
        bucket = df["step"].to_numpy().astype(np.int64, copy=False)
    # A row's label apart from its bucket: its (process, rank,) key and recorded reduction,
    # as one code; each distinct label is then looked at once, in Python.
    per_source = plan.group_columns[0] == "process"
    source_columns = ["process", "rank"] if per_source else []
    label_columns = [*source_columns, "key", "reduction"]
    pair, n_pairs = _combine([_codes(df[c]) for c in label_columns], rows)
    pair_rows = _representatives(pair, n_pairs)
    present = np.flatnonzero(pair_rows >= 0)
    pairs = df.select(label_columns)[pair_rows[present]].with_columns(
        pl.col(pl.Categorical).cast(pl.String), *([pl.col("rank").cast(pl.Int64)] if per_source else [])
    )
    chosen = [
        statistic_of(key, str(recorded).lower())
        for key, recorded in zip(pairs["key"].to_list(), pairs["reduction"].to_list(), strict=True)
    ]
    # Pairs whose statistic is the same (a --reduce pattern, or MEAN beside mean) are one
    # combo; combos are numbered in the order their first pair comes.
    numbered = pairs.select(*source_columns, "key", reduction=pl.Series(chosen, dtype=pl.String))
    grouped = numbered.with_row_index("_pair").group_by(numbered.columns, maintain_order=True).agg("_pair")
    labels = grouped.drop("_pair")
    combo_of_pair = np.zeros(n_pairs, dtype=np.int64)
    members = grouped["_pair"]
    combo_of_pair[present[members.explode().to_numpy()]] = np.repeat(
        np.arange(labels.height), members.list.len().to_numpy()
    )
    combo = combo_of_pair[pair]
    names = sorted(set(chosen))
    stat_of_combo = labels["reduction"].replace_strict(names, list(range(len(names))), return_dtype=pl.Int64)
    stat_of_combo = stat_of_combo.to_numpy()
    stats = [Statistic.parse(name) if is_statistic(name) else None for name in names]
    rows_out = None
    if direct:
        handed = np.array([kind_of(name) == DIRECT_KIND for name in names])
        if handed.any():
            std = np.array([s is not None and s.name == "std" for s in stats])
            squares = std[stat_of_combo].astype(np.uint8)
            if handed.all():
                return Partial(*_no_groups(labels), rows=Rows(bucket, combo, value, squares))
            mine = handed[stat_of_combo[combo]]
            rows_out = Rows(bucket[mine], combo[mine], value[mine], squares)
            rest = np.flatnonzero(~mine)
            bucket, combo, value = bucket[rest], combo[rest], value[rest]
            df = df[rest]
            rows = len(rest)
    ids, n_groups, count, group_bucket, group_combo = _groups(bucket, combo, labels.height)
    quantile = np.array([kind_of(name) == VALUES_KIND for name in names])
    timed = any(s is not None and s.name in ("first", "last") for s in stats)
    if timed and not {"timestamp", "step", "process", "rank"} <= set(df.columns):
        raise MetricLogError(
            "a record's reduction is first or last where the footer statistics of its Parquet file "
            "bound the reduction column away from both: the file's statistics are wrong (rewrite it "
            "with a current Parquet writer, or give the key a statistic with --reduce)"
        )
    spread = any(s is not None and s.name in ("min", "max") for s in stats)
    fields = len(FIELDS) if timed else UNTIMED if spread else COUNTED
    state = empty_cells(n_groups, fields)
    state[N] = count
    stat_codes = stat_of_combo[combo] if len(names) > 1 else None
    summed = np.array([s is not None and s.name in _EXACT for s in stats])
    exact = None
    if summed.any():
        from metric_core.offline.engine import exact as exact_sums

        subset = None if stat_codes is None else np.flatnonzero(summed[stat_codes])
        exact = exact_sums.accumulate(
            ids if subset is None else ids[subset],
            value if subset is None else value[subset],
            n_groups,
            squares="std" in names,
        )
    for family in _FAMILIES:
        wanted = np.array([s is not None and s.name == family for s in stats])
        if wanted.any():
            subset = None if stat_codes is None else np.flatnonzero(wanted[stat_codes])
            _extreme(state, family, ids, value, df, subset)
    value_group, values = np.empty(0, dtype=np.int64), np.empty(0)
    if quantile.any():
        subset = np.arange(rows) if stat_codes is None else np.flatnonzero(quantile[stat_codes])
        value_group, values = ids[subset], value[subset]
    return Partial(group_bucket, group_combo, labels, state, value_group, values, exact, rows_out)


def batch_partial(
    batch: Any,
    plan: ReducePlan,
    statistic_of: Callable[[str, str], str],
    t0: float | None,
    seen: filters.Seen,
    direct: bool,
) -> Partial | None:
    """``partition_states`` of a batch of records as pyarrow read it from a Parquet file
    (``RunScan.offered``: the record schema's types, no null, strings as dictionary arrays),
    in global_reduce, with no polars frame made: the records of groups whose statistic is
    one of DIRECT handed over as rows (where ``direct``), those of medians and pNN as their
    groups' counts and values. The same labels, buckets, groups (by their labels) and values
    as ``partition_states`` gives the batch's frame, so the same bits (a median's states may
    hold fewer fields than the frame's: none that it reads). None where a group's
    statistic is another (first, last; or one the frame's path names as not a statistic),
    or where the batch's key strings are split among dictionaries: the caller makes the
    frame. The batch's keys are noted in ``seen`` (no filter drops any: the caller takes
    batches only without ``--ranks``, ``--steps`` or ``--key``)."""
    from metric_core.format.records import as_numpy, int64_array  # pyarrow: the batch's reader has it

    assert plan.group_columns[0] != "process", "global_reduce's batches only (tasks.takes_batches)"
    rows = len(batch)
    if not rows:
        return None
    codes, dictionaries = [], []
    for name in ("key", "reduction"):
        column = batch.column(name)
        if hasattr(column, "num_chunks"):  # a table's column
            if column.num_chunks != 1:
                return None
            column = column.chunk(0)
        codes.append(as_numpy(column.indices, np.int64))
        dictionaries.append(column.dictionary)
    width = max(len(dictionaries[1]), 1)
    pair = codes[0] * width + codes[1]
    if len(dictionaries[0]) * width <= 4 * rows + 1024:
        present = np.flatnonzero(np.bincount(pair, minlength=len(dictionaries[0]) * width))
    else:  # a dictionary of many keys (a slice of a row group's uses some): found by sorting
        present = np.unique(pair)
    if len(present) > NAMED_LABELS:  # labels looked at one by one here: the frame's path is faster
        return None
    try:  # only the strings the batch uses, decoded once each
        used_keys = np.unique(present // width)
        names = dictionaries[0].take(int64_array(used_keys)).to_pylist()  # (numpy indices load pandas)
        keys = dict(zip(used_keys.tolist(), names, strict=True))
        recorded = [name.lower() for name in dictionaries[1].to_pylist()]
    except (UnicodeDecodeError, ValueError):  # bytes that are not text: the frame's path says so
        return None
    combo_of: dict[tuple[str, str], int] = {}
    chosen = np.empty(len(present), dtype=np.int64)
    kinds = set()
    for i, p in enumerate(present.tolist()):
        key = keys[p // width]
        statistic = statistic_of(key, recorded[p % width])
        kinds.add(kind_of(statistic))
        if None in kinds or (not direct and DIRECT_KIND in kinds):
            return None
        chosen[i] = combo_of.setdefault((key, statistic), len(combo_of))
    if seen.keys is not None:
        seen.add(None, {key for key, _ in combo_of})
    if len(present) and present[-1] < 4 * rows + 1024:
        combo_of_pair = np.zeros(present[-1] + 1, dtype=np.int64)
        combo_of_pair[present] = chosen
        combo = combo_of_pair[pair]
    else:
        combo = chosen[np.searchsorted(present, pair)]
    if plan.by is By.TIME:
        assert t0 is not None and plan.every is not None
        times = as_numpy(batch.column("timestamp"), np.float64)
        bucket = np.floor((times - t0) / plan.every).astype(np.int64)
    else:
        bucket = as_numpy(batch.column("step"), np.int64)
    labels = pl.DataFrame(
        {"key": [key for key, _ in combo_of], "reduction": [stat for _, stat in combo_of]},
        schema={"key": pl.String, "reduction": pl.String},
    )
    value = as_numpy(batch.column("value"), np.float64)
    named = tuple(combo_of)
    if direct:  # every record into the accumulator's table, which counts every group
        squares = np.array([_kept(stat) for _, stat in combo_of], dtype=np.uint8)
        rows_out = Rows(bucket, combo, value, squares)
        if VALUES_KIND not in kinds:
            return Partial(*_no_groups(labels), rows=rows_out, names=named)
        # medians' and pNN's values kept too, each with its row (so its group)
        if kinds == {VALUES_KIND}:
            at = np.arange(rows)
        else:
            at = np.flatnonzero(np.array([kind_of(stat) == VALUES_KIND for _, stat in combo_of])[combo])
        no_groups = _no_groups(labels)[:4]
        return Partial(*no_groups, at, value[at], rows=rows_out, names=named, values_by_row=True)
    # medians' and pNN's alone (the table's path is not taken): their groups' counts
    ids, n_groups, count, group_bucket, group_combo = _groups(bucket, combo, labels.height)
    state = empty_cells(n_groups, COUNTED)
    state[N] = count
    return Partial(group_bucket, group_combo, labels, state, ids, value, names=named)


DIRECT_KIND, VALUES_KIND = "direct", "values"


@functools.cache
def kind_of(statistic: str) -> str | None:
    """What becomes of a statistic's records: DIRECT_KIND (one of DIRECT: they may go to
    the accumulator's table as rows), VALUES_KIND (median and pNN: their values are kept),
    or None (first, last, or not a statistic: states of their own, or an error)."""
    if not is_statistic(statistic):
        return None
    parsed = Statistic.parse(statistic)
    if parsed.name in DIRECT:
        return DIRECT_KIND
    if parsed.name == "median" or parsed.quantile is not None:
        return VALUES_KIND
    return None


@functools.cache
def _kept(statistic: str) -> int:
    """What the accumulator's table keeps of a statistic's records (``Rows.squares``)."""
    if kind_of(statistic) == VALUES_KIND:
        return KEEP_COUNT
    return KEEP_SQUARES if Statistic.parse(statistic).name == "std" else KEEP_SUMS


NAMED_LABELS = 4096  # a batch's labels taken as read, at most (they are Python values: ``Partial.names``)


def _no_groups(
    labels: pl.DataFrame,
) -> tuple[np.ndarray, np.ndarray, pl.DataFrame, np.ndarray, np.ndarray, np.ndarray]:
    """A Partial's fields (up to its values) where no group has a state."""
    none = np.empty(0, dtype=np.int64)
    return none, none, labels, np.empty((COUNTED, 0)), none, np.empty(0)


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
    """Integer codes of a string column (equal strings, equal codes): its Categorical codes,
    or those of categories of its own (freed with it: ``read.interned``)."""
    if series.dtype != pl.Categorical:
        series = series.cast(pl.Categorical(pl.Categories.random()))
    return series.to_physical().to_numpy()


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
    if span > 4 * rows + _DENSE_SLACK:  # the last column's codes made it sparse
        ids, span = _dense(ids)
    return ids, span


def _representatives(ids: np.ndarray, n: int) -> np.ndarray:
    """For each id 0..n-1, a row holding it (-1 where none does). Which row of an id is
    kept does not matter: the callers read only what all rows of an id share."""
    rep = np.full(n, -1, dtype=np.int64)
    rep[ids] = np.arange(len(ids), dtype=np.int64)
    return rep


def _extreme(
    state: np.ndarray,
    family: str,
    ids: np.ndarray,
    value: np.ndarray,
    df: pl.DataFrame,
    subset: np.ndarray | None,
) -> None:
    g = ids if subset is None else ids[subset]
    v = value if subset is None else value[subset]
    lowest = family in ("min", "first")
    if family in ("min", "max"):
        out = state[MIN if lowest else MAX].copy()
        with np.errstate(invalid="ignore"):
            (np.minimum if lowest else np.maximum).at(out, g, v)
        zero = v == 0  # which zero ufunc.at kept depends on the rows' order: decide by content
        if zero.any():
            wanted = np.zeros(len(out), dtype=bool)  # a -0.0 for min, a 0.0 for max
            wanted[g[zero & (np.signbit(v) == lowest)]] = True
            at = out == 0
            out[at] = np.where(wanted[at] == lowest, -0.0, 0.0)
        state[MIN if lowest else MAX] = out
        return
    ts = df["timestamp"].to_numpy()
    ts = ts if subset is None else ts[subset]
    best = state[FIRST_TS if lowest else LAST_TS].copy()
    (np.minimum if lowest else np.maximum).at(best, g, ts)
    candidates = np.flatnonzero(ts == best[g])
    rows = candidates if subset is None else subset[candidates]
    order = [g[candidates], *_tie_columns(df, rows), v[candidates].view(np.int64)]
    ranked = np.lexsort(order[::-1])  # by group, then step, source and the value's bits
    group = g[candidates][ranked]
    ends = np.r_[group[1:] != group[:-1], True] if not lowest else np.r_[True, group[1:] != group[:-1]]
    chosen = candidates[ranked[ends]]  # each group's first (or last) in that order
    uniq = g[chosen]
    at = FIRST_TS if lowest else LAST_TS
    state[at] = best
    state[at + 1, uniq] = v[chosen]
    rows = chosen if subset is None else subset[chosen]
    for field, column in enumerate(_tie_columns(df, rows), start=at + 2):
        state[field, uniq] = column.view(np.float64)


def _tie_columns(df: pl.DataFrame, rows: np.ndarray) -> list[np.ndarray]:
    """The step, the process's digest and the rank of ``rows`` (int64; 0 where ``df`` has
    no such column: then every record of the run lacks it)."""
    out = []
    for name in _ORDER:
        if name not in df.columns:
            out.append(np.zeros(len(rows), dtype=np.int64))
        elif name == "process":
            out.append(_process_digests(df["process"][rows]))
        else:
            out.append(df[name].fill_null(0).cast(pl.Int64).to_numpy()[rows])
    return out


def _process_digests(process: pl.Series) -> np.ndarray:
    """Each process name as an int64 digest of its text (``schema.key_hash``): an order of sources
    every partition and every machine agrees on (null: 0). Each distinct name is
    digested once."""
    names = process.cast(pl.String)
    distinct = names.unique()
    digests = [0 if name is None else key_hash(name) for name in distinct.to_list()]
    lookup = pl.DataFrame({"name": distinct, "digest": pl.Series(digests, dtype=pl.Int64)})
    return (
        names.to_frame("name")
        .join(lookup, on="name", how="left", nulls_equal=True, maintain_order="left")["digest"]
        .to_numpy()
    )


def statistic(
    s: np.ndarray, exact: ExactState | None, name: str, where: np.ndarray | None = None
) -> np.ndarray:
    """Statistic ``name`` (not median or pNN: those need the values) of merged states ``s``
    and their exact sums ``exact`` (sum, mean and std read them), one value a group.
    ``where``: a mask of the groups wanted; the others' values are then unspecified (sum,
    mean and std finish only those)."""
    if name == "count":
        return s[N].astype(np.int64)
    if name in _EXACT:
        if exact is None:  # no group of these states is one of theirs
            return np.full(s.shape[1], np.nan)
        return getattr(exact, name)(where)  # type: ignore[no-any-return]
    if name in ("min", "max"):
        out = with_fields(s, UNTIMED)[MIN if name == "min" else MAX].copy()
        out[np.isnan(out)] = np.nan  # one NaN whichever a group met first
        return out
    if name in ("first", "last"):
        at = FIRST if name == "first" else LAST
        return s[at] if len(s) > at else np.full(s.shape[1], np.nan)
    return np.full(s.shape[1], np.nan)  # median, pNN: from their values


def fold(a: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Accumulated states ``a`` with one partition's states ``p`` of the same groups folded
    in (``a`` has at least ``p``'s fields). Their exact sums are added apart (``add_exact``)."""
    a[N] += p[N]
    if len(p) == COUNTED:
        return a
    for at, pick in ((MIN, np.minimum), (MAX, np.maximum)):
        zeros = (a[at] == 0) & (p[at] == 0)  # -0.0 and 0.0: min's -0.0, max's 0.0, in any order
        signs = np.signbit(a[at]) | np.signbit(p[at]) if at == MIN else np.signbit(a[at]) & np.signbit(p[at])
        with np.errstate(invalid="ignore"):
            pick(a[at], p[at], out=a[at])
        a[at, zeros] = np.where(signs[zeros], -0.0, 0.0)
    if len(p) == UNTIMED:
        return a
    for at, later in ((FIRST_TS, False), (LAST_TS, True)):
        mine, theirs = _order_key(a, at), _order_key(p, at)
        take = _before(mine, theirs) if later else _before(theirs, mine)
        a[at : at + 5, take] = p[at : at + 5, take]
    return a


def _order_key(s: np.ndarray, at: int) -> list[np.ndarray]:
    """The (timestamp, step, process, rank, value's bits) of a first (``at``: FIRST_TS) or
    last (LAST_TS) held in states ``s``."""
    ints = [np.ascontiguousarray(s[at + k]).view(np.int64) for k in (2, 3, 4)]
    return [s[at], *ints, np.ascontiguousarray(s[at + 1]).view(np.int64)]


def _before(x: list[np.ndarray], y: list[np.ndarray]) -> np.ndarray:
    """Where ``x`` comes before ``y`` in the lexicographic order of their columns."""
    less = np.zeros(len(x[0]), dtype=bool)
    equal = np.ones(len(x[0]), dtype=bool)
    for a, b in zip(x, y, strict=True):
        less |= equal & (a < b)
        equal &= a == b
    return less


def add_exact(parts: Sequence[tuple[ExactState | None, np.ndarray]], n_groups: int) -> ExactState | None:
    """Exact sums added into ``n_groups`` groups: group j of each part's state goes to group
    ``mapping[j]`` (``engine.exact.combine``; a part without a state adds nothing). None
    where no part has one. Integers add exactly: the order of the parts does not matter."""
    from metric_core.offline.engine import exact as exact_sums

    held = [(state, mapping) for state, mapping in parts if state is not None]
    if not held:
        return None
    if len(held) == 1 and len(held[0][0]) == n_groups and _identity(held[0][1]):
        return held[0][0]
    return exact_sums.combine([e for e, _ in held], [m for _, m in held], n_groups)


def concat_exact(parts: Sequence[tuple[ExactState | None, int]]) -> ExactState | None:
    """The exact sums of parts' groups, one part's after another's (each part: its state,
    or None, and how many groups it has); None where no part has one. A part without sums
    or without squares holds zeros, as ``add_exact`` counts it."""
    from metric_core.offline.engine import exact as exact_sums

    if all(e is None for e, _ in parts):
        return None
    squares = any(e is not None and e.squares is not None for e, _ in parts)
    states = []
    for e, n in parts:
        if e is None:
            e = exact_sums.ExactState.empty(n, squares=squares)
        elif squares and e.squares is None:
            e = dataclasses.replace(e, squares=exact_sums.Digits.zeros(n))
        states.append(e)
    return exact_sums.concat(states)


def take_exact(exact: ExactState | None, groups: np.ndarray) -> ExactState | None:
    """The exact sums of ``groups`` (indices, in that order), or None."""
    return None if exact is None else exact.take(groups)


def _identity(mapping: np.ndarray) -> bool:
    return bool(len(mapping) == 0 or (mapping[0] == 0 and (np.diff(mapping) == 1).all()))


def empty_cells(size: int, fields: int = len(FIELDS)) -> np.ndarray:
    cells = np.empty((fields, size))
    cells[:] = _EMPTY[:fields, None]
    return cells


def with_fields(state: np.ndarray, fields: int) -> np.ndarray:
    """``state`` with ``fields`` fields, those it lacks empty."""
    if len(state) >= fields:
        return state
    return np.concatenate([state, empty_cells(state.shape[1], fields)[len(state) :]])
