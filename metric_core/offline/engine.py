"""The three logging modes, computed offline from a run's raw records.

A ``ReducePlan`` (``metric_core.offline.plan``) says what to compute and knows nothing about
how; ``execute`` turns a plan into one lazy polars query and runs it
on the streaming engine, reading only the columns the mode needs. Memory grows with
the number of output groups (and, for median/pNN, with the values of one group), not
with the number of raw records. Another engine can run the same plan.

Statistics follow numpy over all raw values of a group: ``mean`` is sum/count over
every value (not a mean of rank means), ``std`` is the population std (ddof=0), ``pNN``
is numpy's default (linear) percentile, and a group holding a NaN gives NaN for every
statistic but ``count``, ``first`` and ``last``.
"""

from __future__ import annotations

import dataclasses
import os
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import polars as pl

from metric_core.errors import (
    MixedReductionError,
    NoDataError,
    StrictModeError,
    UnknownReductionError,
)
from metric_core.metric import LoggingMode
from metric_core.offline import partials
from metric_core.offline.plan import ReducePlan, Statistic, key_matcher, make_plan
from metric_core.offline.read import OnRead, RunScan, changed_files_said, scan_run
from metric_core.offline.read.parquet import read_categorical
from metric_core.schema import REQUIRED_FIELDS

T = TypeVar("T")


@dataclass
class ReduceResult:
    """A reduction and the scan it came from (for the health report)."""

    frame: pl.DataFrame
    plan: ReducePlan
    scan: RunScan
    warnings: list[str] = field(default_factory=list)


# Called after each partition with (partitions done, partitions, bytes done, bytes).
OnProgress = Callable[[int, int, int, int], None]


def _filtered(plan: ReducePlan, frame: pl.LazyFrame, keys: Sequence[str] | None = None) -> pl.LazyFrame:
    """The plan's rank and step filters (and ``keys``, the run's keys ``--key`` selects)."""
    lf = frame.select(plan.input_columns)
    if keys is not None:
        lf = lf.filter(pl.col("key").is_in(list(keys)))
    if plan.ranks:
        rank = pl.col("rank")
        cond = pl.lit(False)
        for lo, hi in plan.ranks:
            cond = cond | rank.is_between(lo, hi)
        lf = lf.filter(cond)
    if plan.steps is not None:
        start, stop = plan.steps
        if start is not None:
            lf = lf.filter(pl.col("step") >= start)
        if stop is not None:
            lf = lf.filter(pl.col("step") < stop)
    return lf


def _selected_keys(plan: ReducePlan, frame: pl.LazyFrame) -> list[str] | None:
    if not plan.keys:
        return None
    match = key_matcher(plan.keys)
    found = frame.select(pl.col("key").unique()).collect(engine="streaming")["key"]
    return sorted(key for key in found if match(key))


@changed_files_said
def execute(plan: ReducePlan, scan: RunScan, *, on_progress: OnProgress | None = None) -> ReduceResult:
    """Run ``plan`` over a scanned run; raise MetricLogError when it cannot be served.

    A reducing mode runs as partial states (``metric_core.offline.partials``): one per
    file, computed on a pool of threads and merged in a fixed order, so the output is the
    same bits whatever the thread count or the order the files were listed in.
    """
    if plan.mode is LoggingMode.PER_RANK_NO_REDUCE:
        scan.check_all()
        return _raw(plan, scan)
    match = key_matcher(plan.keys) if plan.keys else None
    t0 = None
    if plan.by == "time":
        scan.check_all()  # the windows start at the first record kept: a query over all files first
        t0 = _first_time(plan, scan)
    statistic_of = _statistic_chooser(plan)
    parts = partitions(scan)
    sizes = [sum(_size(scan.report.files[fid].path) for fid in part) for part in parts]

    parquet = sum(f.records for f in scan.report.files if f.format == "parquet")
    dictionaries = parquet >= DICTIONARY_READ_RECORDS

    def reduce_part(part: list[int]) -> partials.Partial:
        df = pl.concat([_read_part(plan, scan, fid, dictionaries) for fid in part])
        if match is not None and df.height:
            keys = df["key"].unique()
            df = df.filter(pl.col("key").is_in([k for k in keys if match(k)]))
        return partials.partition_states(df, plan, statistic_of, t0)

    acc = partials.Accumulator()
    for state in _in_order(reduce_part, parts, sizes, on_progress):
        acc.add(state)
    merged, stats, row_of = acc.result()
    if merged.height == 0:
        raise NoDataError(str(scan.run_dir), "no record matches the filters")
    _check_reductions(plan, scan, merged)
    value = _values(merged, stats, acc.group_values(row_of))
    if plan.by == "time":
        bucket = pl.lit(t0) + pl.col("bucket").cast(pl.Float64) * float(plan.every or 0)
    else:
        bucket = pl.col("bucket")
    out = merged.with_columns(
        bucket.alias(plan.bucket), value=pl.Series(value), count=pl.Series(stats["count"])
    )
    return ReduceResult(frame=out.select(plan.output_columns).sort(plan.sort_columns), plan=plan, scan=scan)


def _read_part(plan: ReducePlan, scan: RunScan, fid: int, dictionaries: bool) -> pl.DataFrame:
    """One file's records the plan needs, read once (a file not checked yet is checked whole),
    strings as polars Categorical. With ``dictionaries``, Parquet is read by pyarrow with
    its strings kept as dictionary codes, never decoded (``read_categorical``)."""
    rep = scan.report.files[fid]
    columns = sorted({*plan.input_columns, *(REQUIRED_FIELDS if fid in scan.unchecked else ())})
    if rep.format == "parquet" and dictionaries:
        df = read_categorical(rep.path, columns, rep.hashed)
        if rep.replaced_from is not None:
            df = df.filter(pl.col("step") < rep.replaced_from)
    else:
        strings = [c for c in ("key", "reduction", "process") if c in columns]
        df = scan.parts[fid].select(columns).with_columns(pl.col(strings).cast(pl.Categorical)).collect()
    return _filtered(plan, scan.checked(fid, df).lazy()).collect()


# From about this many Parquet records on, reading them with pyarrow's dictionaries beats
# decoding every string with polars by more than pyarrow's import (0.1 s) costs.
DICTIONARY_READ_RECORDS = 2_000_000


PARTITION_ROWS = 1_000_000


def partitions(scan: RunScan, rows: int = PARTITION_ROWS) -> list[list[int]]:
    """The run's files (ids, in path order) in consecutive groups of about ``rows`` records:
    what one task reduces. It depends on the files alone, never on the thread count."""
    out: list[list[int]] = []
    held = 0
    for fid in scan.parts:
        records = scan.report.files[fid].records
        if not out or (held and held + records > rows):
            out.append([])
            held = 0
        out[-1].append(fid)
        held += records
    return out


def _in_order(
    work: Callable[[T], partials.Partial], items: list[T], sizes: list[int], on_progress: OnProgress | None
) -> Iterator[partials.Partial]:
    """``work`` over ``items`` on a pool of threads, yielded in the items' order;
    no more tasks than threads are in flight, so memory stays bounded."""
    threads = max(1, min(len(items), pl.thread_pool_size()))
    done_bytes, total = 0, sum(sizes)
    with ThreadPoolExecutor(threads) as pool:
        pending: deque[Future[partials.Partial]] = deque()
        upcoming = iter(items)
        for item in islice(upcoming, threads):
            pending.append(pool.submit(work, item))
        for i in range(len(items)):
            result = pending.popleft().result()
            for item in islice(upcoming, 1):
                pending.append(pool.submit(work, item))
            done_bytes += sizes[i]
            if on_progress is not None:
                on_progress(i + 1, len(items), done_bytes, total)
            yield result


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _statistic_chooser(plan: ReducePlan) -> Callable[[str, str], str]:
    """The statistic of a key: the last ``--reduce`` pattern that matches it, or its recorded reduction."""
    overrides = [(key_matcher([pattern]), stat.name) for pattern, stat in plan.overrides]

    def statistic_of(key: str, recorded: str) -> str:
        chosen = [name for match, name in overrides if match(key)]
        return chosen[-1] if chosen else recorded

    return statistic_of


def _first_time(plan: ReducePlan, scan: RunScan) -> float:
    """The earliest timestamp among the records the filters keep: where ``--by time`` windows start."""
    lf = _filtered(dataclasses.replace(plan, mode=LoggingMode.PER_RANK_REDUCE), scan.frame)
    per_key = lf.group_by("key").agg(pl.col("timestamp").min()).collect(engine="streaming")
    if plan.keys:
        match = key_matcher(plan.keys)
        per_key = per_key.filter(pl.col("key").map_elements(match, return_dtype=pl.Boolean))
    t0 = per_key["timestamp"].min()
    if t0 is None:
        raise NoDataError(str(scan.run_dir), "no record matches the filters")
    return float(t0)  # type: ignore[arg-type]


def _check_reductions(plan: ReducePlan, scan: RunScan, merged: pl.DataFrame) -> None:
    """A key recorded with two reductions (and no override) is an error, as is a reduction
    that is not a statistic."""
    per_key = merged.group_by("key").agg(pl.col("reduction").unique().sort()).sort("key")
    for key, reductions in per_key.iter_rows():
        if len(reductions) > 1:
            origins = _reduction_origins(plan, scan, key)
            raise MixedReductionError(key, origins if len(origins) > 1 else {r: [] for r in reductions})
    unknown = {key: r[0] for key, r in per_key.iter_rows() if not partials.is_statistic(r[0])}
    if unknown:
        raise UnknownReductionError(unknown)


def _values(
    merged: pl.DataFrame, stats: dict[str, np.ndarray], grouped: tuple[np.ndarray, np.ndarray]
) -> np.ndarray:
    """Each group's value: the statistic its reduction names, from the merged states."""
    value = np.full(merged.height, np.nan)
    for name in merged["reduction"].unique().sort():
        stat = Statistic.parse(name)
        rows = (merged["reduction"] == name).to_numpy()
        if stat.name == "median":
            value[rows] = partials.median(*grouped, merged.height)[rows]
        elif stat.quantile is not None:
            q = np.where(rows, stat.quantile, np.nan)
            value[rows] = partials.percentile(*grouped, merged.height, q)[rows]
        else:
            value[rows] = stats[stat.name][rows]
    return value


def _raw(plan: ReducePlan, scan: RunScan) -> ReduceResult:
    warnings: list[str] = []
    if plan.overrides:
        warnings.append("--reduce has no effect with --mode per_rank_no_reduce: raw values are kept")
    keys = _selected_keys(plan, scan.frame)
    lf = _filtered(plan, scan.frame, keys)
    if plan.by == "time":
        t0 = _first_time(plan, scan)
        every = float(plan.every or 0)
        lf = lf.with_columns(window_start=pl.lit(t0) + ((pl.col("timestamp") - t0) / every).floor() * every)
    out = lf.select(plan.output_columns).sort(plan.sort_columns).collect(engine="streaming")
    if out.height == 0:
        raise NoDataError(str(scan.run_dir), "no record matches the filters")
    return ReduceResult(frame=out, plan=plan, scan=scan, warnings=warnings)


def _reduction_origins(plan: ReducePlan, scan: RunScan, key: str) -> dict[str, list[str]]:
    scan.check_all()
    with_sources = dataclasses.replace(plan, mode=LoggingMode.PER_RANK_REDUCE)
    rows = (
        _filtered(with_sources, scan.frame)
        .filter(pl.col("key") == key)
        .select("reduction", "process", "rank")
        .unique()
        .collect()
        .sort("reduction", "process", "rank")
    )
    origins: dict[str, list[str]] = {}
    for reduction, process, rank in rows.iter_rows():
        origins.setdefault(reduction, []).append(f"{process} (rank {rank})")
    return origins


def reduce_run(run_dir: str | os.PathLike[str], **options: Any) -> pl.DataFrame:
    """Reduce a run directory in one of the three logging modes; a polars DataFrame.

    ``options`` are those of ``make_plan``: mode, by, every, reduce, keys, ranks, steps.

    >>> df = reduce_run("sample_logs/rl_run", keys=["trainer/loss"], steps="0:2")
    >>> df.columns
    ['step', 'key', 'value', 'reduction', 'count']
    >>> df["count"].to_list()
    [8, 8]
    """
    return run_plan(run_dir, make_plan(**options)).frame


def run_plan(
    run_dir: str | os.PathLike[str],
    plan: ReducePlan,
    *,
    strict: bool = False,
    follow_symlinks: bool = False,
    on_read: OnRead | None = None,
) -> ReduceResult:
    """Read ``run_dir`` and execute ``plan`` over it; the result keeps the read's health report.

    ``on_read`` gets the health report once the run is read. Raises ``StrictModeError``
    when ``strict`` and the reader skipped anything.

    >>> result = run_plan("sample_logs/rl_run", make_plan(mode="per_rank_reduce", keys=["policy/reward"]))
    >>> result.frame.select("process", "step", "count").head(2).rows()
    [('GeneratorActor_r0', 0, 8), ('GeneratorActor_r0', 1, 8)]
    >>> result.scan.report.skipped_records  # the killed generator's last, half-written frame
    21
    """
    # Another tool's files are checked as the engine reads them (one pass), so the report
    # is whole once the plan ran; it is handed over even when the plan fails.
    scan = scan_run(run_dir, follow_symlinks=follow_symlinks, attempts=plan.attempts, defer_checks=True)
    try:
        result = execute(plan, scan)
    finally:
        if on_read is not None:
            on_read(scan.report)
    if strict and scan.report.has_skips:  # notices (a restart rewound, a copy read once) are not skips
        raise StrictModeError(scan.report.summary())
    return result


def pivot_wide(frame: pl.DataFrame, plan: ReducePlan) -> pl.DataFrame:
    """One row per step (per source), one column per key, keys in sorted order."""
    index = plan.group_columns
    wide = frame.pivot(on="key", index=index, values="value", sort_columns=True)
    return wide.sort(index)
