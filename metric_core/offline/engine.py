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
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import polars as pl

from metric_core.errors import (
    MixedReductionError,
    NoDataError,
    PlanError,
    StrictModeError,
    UnknownReductionError,
)
from metric_core.metric import LoggingMode
from metric_core.offline import partials
from metric_core.offline.plan import ReducePlan, Statistic, key_matcher, make_plan
from metric_core.offline.read import OnRead, RunScan, changed_files_said, scan_run

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
        return _raw(plan, scan)
    match = key_matcher(plan.keys) if plan.keys else None
    t0 = None
    if plan.by == "time":
        t0 = _first_time(plan, scan)
    statistic_of = _statistic_chooser(plan)
    parts = list(scan.parts.items())
    sizes = [_size(scan.report.files[fid].path) for fid, _ in parts]

    def reduce_part(item: tuple[int, pl.LazyFrame]) -> partials.Partial:
        df = _filtered(plan, item[1]).collect()
        if match is not None and df.height:
            keys = df["key"].unique()
            df = df.filter(pl.col("key").is_in([k for k in keys if match(k)]))
        return partials.partition_states(df, plan, statistic_of, t0)

    states = _run_in_order(reduce_part, parts, sizes, on_progress)
    merged, value_group, values = partials.merge(states, plan)
    if merged.height == 0:
        raise NoDataError(str(scan.run_dir), "no record matches the filters")
    _check_reductions(plan, scan, merged)
    out = _finish(merged, value_group, values)
    return ReduceResult(frame=out.select(plan.output_columns).sort(plan.sort_columns), plan=plan, scan=scan)


def _run_in_order(
    work: Callable[[T], partials.Partial], items: list[T], sizes: list[int], on_progress: OnProgress | None
) -> list[partials.Partial]:
    """``work`` over ``items`` on a pool of threads; the results in the items' order."""
    threads = max(1, min(len(items), pl.thread_pool_size()))
    done_bytes, total = 0, sum(sizes)
    out: list[partials.Partial] = []
    with ThreadPoolExecutor(threads) as pool:
        for i, result in enumerate(pool.map(work, items)):
            out.append(result)
            done_bytes += sizes[i]
            if on_progress is not None:
                on_progress(i + 1, len(items), done_bytes, total)
    return out


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
    unknown = {key: r[0] for key, r in per_key.iter_rows() if not _is_statistic(r[0])}
    if unknown:
        raise UnknownReductionError(unknown)


def _is_statistic(name: str) -> bool:
    try:
        Statistic.parse(name)
    except PlanError:
        return False
    return True


def _finish(merged: pl.DataFrame, value_group: np.ndarray, values: np.ndarray) -> pl.DataFrame:
    """Each group's value: the statistic its reduction names, from the merged states."""
    names = merged["reduction"].to_numpy()
    value = np.full(merged.height, np.nan)
    quantiles = np.full(merged.height, np.nan)
    medians = np.zeros(merged.height, dtype=bool)
    for name in np.unique(names):
        stat = Statistic.parse(name)
        rows = names == name
        if stat.name == "count":
            value[rows] = merged["n"].to_numpy()[rows]
        elif stat.name == "median":
            medians |= rows
        elif stat.quantile is not None:
            quantiles[rows] = stat.quantile
        else:
            value[rows] = merged[stat.name].to_numpy()[rows]
    if medians.any():
        value[medians] = partials.median(value_group, values, merged.height)[medians]
    if not np.isnan(quantiles).all():
        picked = ~np.isnan(quantiles)
        value[picked] = partials.percentile(value_group, values, merged.height, quantiles)[picked]
    return merged.with_columns(value=pl.Series(value), count=pl.col("n"))


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
    scan = scan_run(run_dir, follow_symlinks=follow_symlinks, attempts=plan.attempts)
    if on_read is not None:
        on_read(scan.report)
    if strict and scan.report.has_skips:  # notices (a restart rewound, a copy read once) are not skips
        raise StrictModeError(scan.report.summary())
    return execute(plan, scan)


def pivot_wide(frame: pl.DataFrame, plan: ReducePlan) -> pl.DataFrame:
    """One row per step (per source), one column per key, keys in sorted order."""
    index = plan.group_columns
    wide = frame.pivot(on="key", index=index, values="value", sort_columns=True)
    return wide.sort(index)
