"""A plan's filters applied to records (``--ranks``, ``--steps``: ``plan_filtered``; ``--key``:
``key_matching``), the statistic a key takes (``statistic_chooser``: ``--reduce`` patterns),
and the error of a result the filters left empty (``nothing_kept``). What each filter
matched is ``offline.filters``'s."""

from __future__ import annotations

from collections.abc import Callable

import polars as pl

from metric_core.errors import NoDataError, PlanError
from metric_core.offline import filters
from metric_core.offline.plan import ReducePlan, key_matcher
from metric_core.offline.read import RunScan, all_skipped


def plan_filtered(plan: ReducePlan, frame: pl.LazyFrame, columns: list[str] | None = None) -> pl.LazyFrame:
    """``columns`` (the plan's input columns by default) with the plan's rank and step
    filters applied (``--key`` is applied per file: ``key_matching``)."""
    lf = frame.select(plan.input_columns if columns is None else columns)
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


def key_matching(df: pl.DataFrame, match: Callable[[str], bool] | None) -> pl.DataFrame:
    """The records whose key a ``--key`` pattern matches (each distinct key tested once)."""
    if match is None or df.height == 0:
        return df
    keys = [k for k in df["key"].unique().cast(pl.String) if match(k)]
    return df.filter(pl.col("key").cast(pl.String).is_in(keys))


def statistic_chooser(plan: ReducePlan) -> Callable[[str, str], str]:
    """The statistic of a key: the last ``--reduce`` pattern that matches it, or its recorded reduction."""
    overrides = [(key_matcher([pattern]), stat.name) for pattern, stat in plan.overrides]

    def statistic_of(key: str, recorded: str) -> str:
        chosen = [name for match, name in overrides if match(key)]
        return chosen[-1] if chosen else recorded

    return statistic_of


def nothing_kept(plan: ReducePlan, scan: RunScan, unmatched: list[PlanError]) -> NoDataError:
    """The error of a result without a record: every record was skipped (another tool's
    files, checked as they were read), or the filters left none."""
    if scan.report.records == 0:
        return all_skipped(scan.report)
    return filters.nothing_left(str(scan.run_dir), plan, unmatched)
