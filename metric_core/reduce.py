"""The three logging modes, computed offline from a run's raw records.

A ``ReducePlan`` says what to compute (mode, grouping, statistics per key, filters) and
knows nothing about how; ``execute`` turns a plan into one lazy polars query and runs it
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
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from metric_core.errors import MetricLogError, MixedReductionError, NoDataError
from metric_core.metric import LoggingMode
from metric_core.reader import RunScan, scan_run

BASIC_STATS = ("mean", "sum", "max", "min", "std")
OFFLINE_STATS = ("count", "median", "first", "last")
_PERCENTILE = re.compile(r"^p(\d{1,2}(?:\.\d+)?|100)$")


class PlanError(MetricLogError):
    """A request that cannot be turned into a plan (bad statistic, pattern, range)."""


@dataclass(frozen=True)
class Statistic:
    """One statistic of SPEC section 3: a name, and for ``pNN`` its quantile in [0, 1]."""

    name: str
    quantile: float | None = None

    @classmethod
    def parse(cls, text: str) -> Statistic:
        """``mean``, ``sum``, ``max``, ``min``, ``std``, ``count``, ``median``, ``first``,
        ``last`` or ``pNN`` (``p99``, ``p99.9``).

        >>> Statistic.parse("p99.9").quantile
        0.999
        """
        name = text.strip().lower()
        if name in BASIC_STATS or name in OFFLINE_STATS:
            return cls(name)
        match = _PERCENTILE.match(name)
        if match:
            q = float(match.group(1))
            if q <= 100:
                return cls(name, round(q / 100, 12))
        allowed = ", ".join((*BASIC_STATS, *OFFLINE_STATS, "pNN (e.g. p99, p99.9)"))
        raise PlanError(f"unknown statistic '{text}': use one of {allowed}")


@dataclass(frozen=True)
class ReducePlan:
    """What to compute; see ``execute`` for how.

    ``overrides`` are (glob, statistic) pairs; for a key matched by several, the last
    one given wins. ``ranks`` are inclusive ranges; ``steps`` is a half-open
    [start, stop) range, either end open when None.
    """

    mode: LoggingMode = LoggingMode.GLOBAL_REDUCE
    by: str = "step"
    every: float | None = None
    overrides: tuple[tuple[str, Statistic], ...] = ()
    keys: tuple[str, ...] = ()
    ranks: tuple[tuple[int, int], ...] = ()
    steps: tuple[int | None, int | None] | None = None

    def __post_init__(self) -> None:
        if self.by not in ("step", "time"):
            raise PlanError(f"--by must be step or time, not '{self.by}'")
        if self.by == "time" and (self.every is None or self.every <= 0):
            raise PlanError("--by time needs a window length, e.g. --every 10s")
        if self.by == "step" and self.every is not None:
            raise PlanError("--every sets the window of --by time; add --by time")

    @property
    def bucket(self) -> str:
        return "window_start" if self.by == "time" else "step"

    @property
    def group_columns(self) -> list[str]:
        if self.mode is LoggingMode.PER_RANK_REDUCE:
            return ["process", "rank", self.bucket]
        return [self.bucket]

    @property
    def output_columns(self) -> list[str]:
        if self.mode is LoggingMode.PER_RANK_NO_REDUCE:
            return ["process", "rank", self.bucket, "timestamp", "key", "value", "reduction"]
        return [*self.group_columns, "key", "value", "reduction", "count"]

    @property
    def sort_columns(self) -> list[str]:
        if self.mode is LoggingMode.PER_RANK_NO_REDUCE:
            return ["process", "rank", "timestamp"]
        return [*self.group_columns, "key"]

    @property
    def input_columns(self) -> list[str]:
        cols = {"key", "value", "reduction", "rank"}
        if self.mode is not LoggingMode.GLOBAL_REDUCE:
            cols |= {"process", "timestamp", "step"}
        cols.add("timestamp" if self.by == "time" else "step")
        if any(s.name in ("first", "last") for _, s in self.overrides) or self.by == "time":
            cols.add("timestamp")
        if self.steps is not None:
            cols.add("step")
        return sorted(cols)


@dataclass
class ReduceResult:
    """A reduction and the scan it came from (for the health report)."""

    frame: pl.DataFrame
    plan: ReducePlan
    scan: RunScan
    warnings: list[str] = field(default_factory=list)


def glob_to_regex(pattern: str) -> str:
    """A shell-style glob as an anchored regex for polars (``*``, ``?``, ``[...]``, ``[!...]``).

    >>> glob_to_regex("trainer/*")
    '^trainer/.*$'
    """
    out, i = ["^"], 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "*":
            out.append(".*")
        elif ch == "?":
            out.append(".")
        elif ch == "[":
            end = pattern.find("]", i + 2 if pattern[i + 1 : i + 2] in ("!", "]") else i + 1)
            if end == -1:
                out.append(re.escape(ch))
            else:
                body = pattern[i + 1 : end]
                if body.startswith("!"):
                    body = "^" + body[1:]
                out.append("[" + body.replace("\\", "\\\\") + "]")
                i = end
        else:
            out.append(re.escape(ch))
        i += 1
    out.append("$")
    return "".join(out)


def _matches(patterns: Iterable[str]) -> pl.Expr:
    regex = "|".join(f"(?:{glob_to_regex(p)})" for p in patterns)
    return pl.col("key").str.contains(regex)


def _statistic_expr(stat: Statistic) -> pl.Expr:
    """The aggregation of one statistic over a group's ``value`` (NaN is handled later)."""
    v = pl.col("value")
    exprs = {
        "mean": v.mean(),
        "sum": v.sum(),
        "max": v.max(),
        "min": v.min(),
        "std": v.std(ddof=0),
        "count": pl.len().cast(pl.Float64),
        "median": v.median(),
        "first": v.min_by("timestamp"),
        "last": v.max_by("timestamp"),
    }
    expr = exprs.get(stat.name)
    if expr is None:
        expr = v.quantile(stat.quantile or 0.0, interpolation="linear")
    return expr.cast(pl.Float64)


def _filtered(plan: ReducePlan, frame: pl.LazyFrame) -> pl.LazyFrame:
    lf = frame.select(plan.input_columns)
    if plan.keys:
        lf = lf.filter(_matches(plan.keys))
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


def _effective_statistic(plan: ReducePlan) -> pl.Expr:
    """Per record: the statistic its key is reduced with (an override, or as recorded)."""
    stat = pl.col("reduction")
    for pattern, statistic in plan.overrides:  # later overrides take precedence
        stat = pl.when(_matches([pattern])).then(pl.lit(statistic.name)).otherwise(stat)
    return stat


def execute(plan: ReducePlan, scan: RunScan) -> ReduceResult:
    """Run ``plan`` over a scanned run; raise MetricLogError when it cannot be served."""
    lf = _filtered(plan, scan.frame)
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
        out = _aggregate(plan, lf, scan)
    if out.height == 0:
        raise NoDataError(str(scan.run_dir), "no record matches the filters")
    return ReduceResult(frame=out, plan=plan, scan=scan, warnings=warnings)


def _aggregate(plan: ReducePlan, lf: pl.LazyFrame, scan: RunScan) -> pl.DataFrame:
    # One column per statistic that some key needs, all computed in one streaming pass
    # with polars' native group-by aggregations; each row then picks its own.
    stats = {Statistic.parse(s) for s in BASIC_STATS} | {s for _, s in plan.overrides}
    names = sorted(s.name for s in stats)
    grouped = (
        lf.with_columns(statistic=_effective_statistic(plan))
        .group_by([*plan.group_columns, "key", "statistic"])
        .agg(
            *(_statistic_expr(s).alias(f"_{s.name}") for s in stats),
            _nan=pl.col("value").is_nan().sum(),
            count=pl.len().cast(pl.Int64),
        )
        .collect(engine="streaming")
    )
    _check_statistics(plan, grouped, scan)
    value = pl.lit(None, pl.Float64)
    for name in names:
        value = pl.when(pl.col("statistic") == name).then(pl.col(f"_{name}")).otherwise(value)
    # numpy semantics: a NaN in the group makes every statistic NaN but count, first, last.
    keeps_nan_out = pl.col("statistic").is_in(["count", "first", "last"])
    value = pl.when((pl.col("_nan") > 0) & ~keeps_nan_out).then(pl.lit(float("nan"))).otherwise(value)
    return (
        grouped.with_columns(value=value)
        .rename({"statistic": "reduction"})
        .select(plan.output_columns)
        .sort(plan.sort_columns)
    )


def _check_statistics(plan: ReducePlan, grouped: pl.DataFrame, scan: RunScan) -> None:
    per_key = grouped.group_by("key").agg(pl.col("statistic").unique().sort())
    mixed = per_key.filter(pl.col("statistic").list.len() > 1).sort("key")
    if mixed.height:
        key = mixed["key"][0]
        raise MixedReductionError(key, _reduction_origins(plan, scan, key))
    known = {*BASIC_STATS, *OFFLINE_STATS}
    unknown = grouped.filter(
        ~pl.col("statistic").is_in(list(known)) & ~pl.col("statistic").str.contains(_PERCENTILE.pattern)
    )
    if unknown.height:
        key, stat = unknown.row(0, named=True)["key"], unknown.row(0, named=True)["statistic"]
        raise PlanError(
            f"key '{key}' is recorded with reduction '{stat}', which metriclog does not know; "
            f"choose one with --reduce '{key}=STAT'"
        )


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


def parse_ranks(text: str) -> tuple[tuple[int, int], ...]:
    """``0,2-5`` -> ((0, 0), (2, 5))."""
    ranges = []
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise PlanError(f"--ranks '{text}': '{part}' is not a rank or a range like 2-5")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise PlanError(f"--ranks '{text}': range '{part}' runs backwards")
        ranges.append((lo, hi))
    return tuple(ranges)


def parse_steps(text: str) -> tuple[int | None, int | None]:
    """``100:200`` -> (100, 200), the steps 100 to 199; ``100:`` and ``:200`` leave an end open."""
    m = re.fullmatch(r"\s*(-?\d+)?\s*:\s*(-?\d+)?\s*", text)
    if not m or ":" not in text:
        raise PlanError(f"--steps '{text}' is not START:STOP, e.g. 100:200 (steps 100 to 199)")
    start = int(m.group(1)) if m.group(1) else None
    stop = int(m.group(2)) if m.group(2) else None
    if start is not None and stop is not None and stop <= start:
        raise PlanError(f"--steps '{text}': STOP must be greater than START")
    return start, stop


_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """``10s``, ``500ms``, ``2m``, ``1.5h`` or plain seconds -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|min|m|h|d)?\s*", text)
    if not m:
        raise PlanError(f"--every '{text}' is not a duration like 10s, 500ms, 5m or 1h")
    seconds = float(m.group(1)) * _UNITS[m.group(2) or "s"]
    if seconds <= 0:
        raise PlanError(f"--every '{text}' must be longer than zero")
    return seconds


def parse_overrides(items: Sequence[str]) -> tuple[tuple[str, Statistic], ...]:
    """``['trainer/*=p99', 'loss=median']`` -> ((glob, Statistic), ...)."""
    out = []
    for item in items:
        pattern, sep, stat = item.rpartition("=")
        if not sep or not pattern:
            raise PlanError(f"--reduce '{item}' is not PATTERN=STAT, e.g. 'trainer/*=p99'")
        out.append((pattern, Statistic.parse(stat)))
    return tuple(out)


def reduce_run(run_dir: str | os.PathLike[str], **options: Any) -> pl.DataFrame:
    """Reduce a run directory in one of the three logging modes; a polars DataFrame.

    ``options`` are those of ``make_plan``: mode, by, every, reduce, keys, ranks, steps.

    >>> df = reduce_run("sample_logs/rl_run", mode="global_reduce", keys=["trainer/*"])  # doctest: +SKIP
    >>> df.columns  # doctest: +SKIP
    ['step', 'key', 'value', 'reduction', 'count']
    """
    return execute(make_plan(**options), scan_run(run_dir)).frame


def make_plan(
    *,
    mode: LoggingMode | str = LoggingMode.GLOBAL_REDUCE,
    by: str = "step",
    every: float | str | None = None,
    reduce: Sequence[str] | dict[str, str] = (),
    keys: Sequence[str] = (),
    ranks: str | Sequence[tuple[int, int]] = (),
    steps: str | tuple[int | None, int | None] | None = None,
) -> ReducePlan:
    """Build a plan from command-line style options (strings are parsed)."""
    try:
        mode = LoggingMode(mode)
    except ValueError:
        allowed = ", ".join(m.value for m in LoggingMode)
        raise PlanError(f"--mode '{mode}' is not one of {allowed}") from None
    items = [f"{k}={v}" for k, v in reduce.items()] if isinstance(reduce, dict) else list(reduce)
    return ReducePlan(
        mode=mode,
        by=by,
        every=parse_duration(every) if isinstance(every, str) else every,
        overrides=parse_overrides(items),
        keys=tuple(keys),
        ranks=parse_ranks(ranks) if isinstance(ranks, str) else tuple(ranks),
        steps=parse_steps(steps) if isinstance(steps, str) else steps,
    )


def pivot_wide(frame: pl.DataFrame, plan: ReducePlan) -> pl.DataFrame:
    """One row per step (per source), one column per key, keys in sorted order."""
    index = plan.group_columns
    wide = frame.pivot(on="key", index=index, values="value", sort_columns=True)
    return wide.sort(index)
