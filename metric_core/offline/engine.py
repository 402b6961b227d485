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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from metric_core.errors import (
    MixedReductionError,
    NoDataError,
    PlanError,
    RunChangedError,
    StrictModeError,
    UnknownReductionError,
)
from metric_core.metric import LoggingMode
from metric_core.offline.plan import ReducePlan, Statistic, key_matcher, make_plan
from metric_core.offline.read import OnRead, RunScan, changed_files_said, scan_run
from metric_core.schema import KEY_HASH, key_hash, keys_by_hash


@dataclass
class ReduceResult:
    """A reduction and the scan it came from (for the health report)."""

    frame: pl.DataFrame
    plan: ReducePlan
    scan: RunScan
    warnings: list[str] = field(default_factory=list)
    # What the groups were found by: "key" (the key strings), or "key_hash" (the writer's
    # key hashes fused with the step into one integer: global_reduce by step, see _fused_keys).
    grouped_on: str = "key"


def _filtered(
    plan: ReducePlan, frame: pl.LazyFrame, keys: Sequence[str] | None, hashed: bool = False
) -> pl.LazyFrame:
    """The plan's filters; ``keys`` are the run's keys that ``--key`` selects (None: all).
    ``hashed``: every record has its key_hash, which is selected and filtered on."""
    lf = frame.select(*plan.input_columns, *([KEY_HASH] if hashed else []))
    if keys is not None:
        lf = lf.filter(_key_in(keys, hashed))
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


def _key_in(keys: Sequence[str], hashed: bool) -> pl.Expr:
    if hashed:  # an integer per record instead of a string
        return pl.col(KEY_HASH).is_in([key_hash(key) for key in keys])
    return pl.col("key").is_in(list(keys))


def _selected_keys(plan: ReducePlan, recorded: pl.DataFrame) -> list[str] | None:
    if not plan.keys:
        return None
    match = key_matcher(plan.keys)
    return [key for key in recorded["key"].unique().sort() if match(key)]


@changed_files_said
def execute(plan: ReducePlan, scan: RunScan) -> ReduceResult:
    """Run ``plan`` over a scanned run; raise MetricLogError when it cannot be served."""
    recorded = scan.key_reductions()
    keys = _selected_keys(plan, recorded)
    if keys is not None:
        recorded = recorded.filter(pl.col("key").is_in(keys))
    fused = _fused_keys(plan, scan, recorded["key"].unique())
    lf = _filtered(plan, scan.frame, keys, scan.hashed)
    warnings: list[str] = []
    if plan.by == "time":
        t0 = lf.select(pl.col("timestamp").min()).collect().item()
        if t0 is None:
            raise NoDataError(str(scan.run_dir), "no record matches the filters")
        every = float(plan.every or 0)
        lf = lf.with_columns(window_start=pl.lit(t0) + ((pl.col("timestamp") - t0) / every).floor() * every)
    if plan.mode is LoggingMode.PER_RANK_NO_REDUCE:
        if plan.overrides:
            warnings.append("--reduce has no effect with --mode per_rank_no_reduce: raw values are kept")
        out = lf.select(plan.output_columns).sort(plan.sort_columns).collect(engine="streaming")
    else:
        out = _aggregate(plan, lf, _key_statistics(plan, scan, recorded, keys), fused, scan.hashed)
    if out.height == 0:
        raise NoDataError(str(scan.run_dir), "no record matches the filters")
    grouped_on = (
        "key_hash" if fused is not None and plan.mode is not LoggingMode.PER_RANK_NO_REDUCE else "key"
    )
    return ReduceResult(frame=out, plan=plan, scan=scan, warnings=warnings, grouped_on=grouped_on)


_STEP_BITS = 24  # steps below 2**24 fit in the low bits of a key hash that has them cleared
_STEP_MASK = (1 << _STEP_BITS) - 1


def _fused_keys(plan: ReducePlan, scan: RunScan, keys: Iterable[str]) -> dict[int, str] | None:
    """For global_reduce by step: each key by its hash with the low bits cleared, when
    (hash | step) identifies a (step, key) group, so grouping is on one integer column.

    That needs every file to carry the writer's key_hash column, steps in [0, 2**24),
    and no two keys of the run sharing the 40 bits kept (else None: group on strings).
    """
    if plan.mode is not LoggingMode.GLOBAL_REDUCE or plan.by != "step" or not scan.hashed:
        return None
    steps = scan.step_range
    if steps is None or steps[0] < 0 or steps[1] > _STEP_MASK:
        return None
    return keys_by_hash(keys, ~_STEP_MASK)


def _key_statistics(
    plan: ReducePlan, scan: RunScan, recorded: pl.DataFrame, keys: Sequence[str] | None
) -> dict[str, str]:
    """Each key's statistic: the last ``--reduce`` pattern that matches it, or its recorded
    reduction. A key recorded with several is checked against the filtered records."""
    overrides = [(key_matcher([pattern]), stat.name) for pattern, stat in plan.overrides]
    out: dict[str, str] = {}
    for key, reductions in recorded.group_by("key").agg("reduction").sort("key").iter_rows():
        chosen = [name for match, name in overrides if match(key)]
        if chosen:
            out[key] = chosen[-1]
            continue
        if len(reductions) > 1:
            origins = _reduction_origins(plan, scan, key, keys)
            if len(origins) > 1:
                raise MixedReductionError(key, origins)
            reductions = list(origins)
        if reductions:
            out[key] = reductions[0]
    return out


def _aggregations(stat: Statistic, mask: pl.Expr | None) -> dict[str, pl.Expr]:
    """The group aggregations a statistic is computed from (named so they are shared).

    min/max propagate NaN as numpy does, and so do sum and std. Quantiles hold a
    group's values; ``mask`` restricts them to the keys that need them.
    """
    v = pl.col("value")
    name = stat.name
    if name in ("mean", "sum"):
        return {"_sum": v.sum()}
    if name in ("max", "min"):
        return {f"_{name}": v.nan_max() if name == "max" else v.nan_min()}
    if name == "std":
        return {"_std": v.std(ddof=0)}
    if name in ("first", "last"):
        return {f"_{name}": v.min_by("timestamp") if name == "first" else v.max_by("timestamp")}
    if name == "count":
        return {}
    values = v if mask is None else v.filter(mask)
    q = 0.5 if name == "median" else stat.quantile or 0.0
    return {f"_{name}": values.quantile(q, interpolation="linear"), "_nan": v.is_nan().sum()}


def _final(stat: Statistic) -> pl.Expr:
    """A statistic from its group aggregations (see ``_aggregations``)."""
    name = stat.name
    if name == "mean":
        return pl.col("_sum") / pl.col("count")
    if name == "sum":
        return pl.col("_sum")
    if name == "count":
        return pl.col("count").cast(pl.Float64)
    if name == "median" or stat.quantile is not None:
        return pl.when(pl.col("_nan") > 0).then(float("nan")).otherwise(pl.col(f"_{name}"))
    return pl.col(f"_{name}")


def _aggregate(
    plan: ReducePlan,
    lf: pl.LazyFrame,
    statistics: dict[str, str],
    fused: dict[int, str] | None,
    hashed: bool,
) -> pl.DataFrame:
    # One streaming group-by computes the aggregations every statistic in use is built
    # from; each row then takes its key's statistic.
    by_name: dict[str, list[str]] = {}
    for key, name in statistics.items():
        by_name.setdefault(name, []).append(key)
    known: dict[str, Statistic] = {}
    aggs: dict[str, pl.Expr] = {"count": pl.len().cast(pl.Int64)}
    for name, keys in by_name.items():
        try:
            known[name] = stat = Statistic.parse(name)
        except PlanError:
            continue
        mask = None if len(by_name) == 1 else _key_in(keys, hashed)
        aggs.update(_aggregations(stat, mask))
    aggs = {name: expr.cast(pl.Float64) if name != "count" else expr for name, expr in aggs.items()}
    if fused is None:
        grouped = lf.group_by([*plan.group_columns, "key"]).agg(**aggs).collect(engine="streaming")
    else:
        group = (pl.col(KEY_HASH) & ~_STEP_MASK) | pl.col("step")
        hashes = pl.DataFrame({"_hash": list(fused), "key": list(fused.values())})
        grouped = (
            lf.group_by(group.alias("_group"))
            .agg(**aggs)
            .collect(engine="streaming")
            .with_columns(step=pl.col("_group") & _STEP_MASK, _hash=pl.col("_group") & ~_STEP_MASK)
            .join(hashes, on="_hash", how="left")
        )
    table = pl.DataFrame(
        {"key": list(statistics), "reduction": list(statistics.values())},
        schema={"key": pl.String, "reduction": pl.String},
    )
    grouped = grouped.join(table, on="key", how="left")
    undeclared = grouped.filter(pl.col("reduction").is_null())
    if undeclared.height:  # only a sealed segment changed after its writer sealed it gets here
        raise RunChangedError(
            f"key '{undeclared['key'][0]}' is in the records but not in the key list of their "
            "segments' metadata: a sealed file was rewritten with its metadata kept; "
            "rewrite it without the 'metriclog' metadata, or restore the original"
        )
    unknown = grouped.filter(~pl.col("reduction").is_in(list(known))).sort("key")
    if unknown.height:
        raise UnknownReductionError(dict(unknown.select("key", "reduction").unique().sort("key").iter_rows()))
    value = pl.lit(None, pl.Float64)
    for name, stat in known.items():
        value = pl.when(pl.col("reduction") == name).then(_final(stat)).otherwise(value)
    return grouped.with_columns(value=value).select(plan.output_columns).sort(plan.sort_columns)


def _reduction_origins(
    plan: ReducePlan, scan: RunScan, key: str, keys: Sequence[str] | None
) -> dict[str, list[str]]:
    with_sources = dataclasses.replace(plan, mode=LoggingMode.PER_RANK_REDUCE)
    rows = (
        _filtered(with_sources, scan.frame, keys, scan.hashed)
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
