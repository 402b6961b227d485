"""``metriclog compare``: several runs (seeds, a sweep) reduced with one plan, then statistics
across the runs per (group, step or window, key), exactly.

Each run is reduced as ``reduce`` reduces it (``run_plan``): one value per (step, key), or
per (source, step, key) in ``per_rank_reduce``, where sources are matched across runs by
their process name. With ``--by time`` a window is placed by its start's offset from its
run's first record (``window_offset``, seconds), so runs started at different times line
up. Runs may be grouped by a value of their run.json (``group_by="config.lr"``).

Across the runs of a group that have a (step, key), for the values ``x_1 .. x_n`` of those
runs (``count`` = n):

* ``mean``: the exact mean, correctly rounded (the engine's exact sums, ``engine.exact``);
* ``std``: the population standard deviation (divided by n), correctly rounded; 0.0 for
  one run; ``std_sample``: the sample one (divided by n - 1), correctly rounded, null for
  one run; ``stderr``: ``std_sample / sqrt(n)``, the correctly rounded root of the exact
  ``var_sample / n``, null for one run;
* ``min``, ``max``; ``median``: the middle value, or the correctly rounded mean of the two
  middle ones;
* a NaN in any run's value makes every statistic of that cell NaN but ``count``; an
  infinity gives what numpy gives (``mean`` and ``median`` may be infinite, the spreads NaN).

Every statistic is a function of the set of values, computed in integers where it rounds,
and the runs are taken in the order of their labels: the output is the same bits whatever
the order the runs are given in.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from metric_core.errors import PlanError, RequestError, opt
from metric_core.metric import LoggingMode
from metric_core.offline.plan import By, Engine, ReducePlan, make_plan, one_rank_a_process

if TYPE_CHECKING:
    import polars as pl

    from metric_core.offline.read import OnProgress, OnRead

ACROSS = ("mean", "std", "std_sample", "stderr", "min", "max", "median", "count")
GLOB_CHARACTERS = "*?["


@dataclass(frozen=True)
class ReducedRun:
    """One run reduced with a plan: its label, directory, run.json and reduction
    (``[process,] step|window_offset, key, value, reduction``)."""

    label: str
    run_dir: str
    meta: dict[str, Any]
    frame: pl.DataFrame
    unmatched: list[PlanError] = field(default_factory=list)


@dataclass
class CompareResult:
    """``compare_runs``' answer: a row per (group, [process,] step or window, key) in
    ``frame``; ``runs`` (label, run directory, group value) in label order; ``notes`` to
    tell the user (rows that fewer runs hold, filters that matched nothing)."""

    frame: pl.DataFrame
    plan: ReducePlan
    across: tuple[str, ...]
    group_column: str | None
    runs: list[tuple[str, str, Any]]
    notes: list[str] = field(default_factory=list)
    run_ids: list[str] = field(
        default_factory=list
    )  # each run's run.json run_id (else its path), as ``runs``
    common: bool = False  # only the rows every run of the group holds

    @property
    def index(self) -> list[str]:
        """The columns that say which row it is."""
        group = [self.group_column] if self.group_column else []
        process = ["process"] if self.plan.mode is LoggingMode.PER_RANK_REDUCE else []
        return [*group, *process, bucket_column(self.plan)]

    def wide(self) -> pl.DataFrame:
        """A row per (group, [process,] step or window), a column per key (``KEY``, with one
        statistic) or per key and statistic (``KEY:STAT``), keys in sorted order."""
        stats = list(self.across)
        keys = sorted(self.frame["key"].unique().to_list())
        wide = self.frame.pivot(on="key", index=self.index, values=stats, separator="\0")
        if len(stats) > 1:
            wide = wide.rename({f"{s}\0{k}": f"{k}:{s}" for s in stats for k in keys})
        columns = [k if len(stats) == 1 else f"{k}:{s}" for k in keys for s in stats]
        return wide.select(*self.index, *columns).sort(self.index, nulls_last=True)


def compare_runs(
    runs: Sequence[str | os.PathLike[str]],
    plan: ReducePlan | None = None,
    *,
    across: Sequence[str] = ACROSS,
    group_by: str | None = None,
    keep_missing: bool = False,
    labels: Sequence[str] | None = None,
    common: bool = False,
    strict: bool = False,
    follow_symlinks: bool = False,
    on_read: OnRead | None = None,
    on_progress: OnProgress | None = None,
    engine: Engine | str = Engine.LOCAL,
    ray_address: str | None = None,
    **options: Any,
) -> CompareResult:
    """Reduce each run with one plan, then compute ``across`` statistics over the runs per
    (group, [process,] step or window, key) (module docstring).

    ``runs``: run directories; a glob is expanded, ``@FILE`` reads one a line. ``plan``, or
    ``make_plan``'s ``options`` (mode, by, every, reduce, keys, ranks, steps, attempts).
    ``group_by``: a dotted key of run.json (``config.lr``): a group per exact value, its
    column named so; a run without it raises ``RequestError``, unless ``keep_missing``
    (those runs form a group of their own, its value null). ``labels`` name the runs (one
    each, in the order given, after expansion; default: the run directory's name).
    ``common``: only the rows every run of the group holds. The other options are
    ``run_plan``'s. Raises ``PlanError`` for a bad request, ``RequestError`` for runs that
    cannot be compared (two labels alike, reductions that differ for one key).

    >>> r = compare_runs(["sample_logs/rl_run"], keys=["trainer/loss"], steps="0:2", across=["mean", "count"])
    >>> r.frame.columns, r.frame["count"].to_list()
    (['step', 'key', 'reduction', 'mean', 'count'], [1, 1])
    """
    import polars as pl

    plan = plan_of(plan, options)
    across = parse_across(across)
    if keep_missing and group_by is None:
        raise PlanError("works only with " + opt("group_by") + "KEY", option="keep_missing", value=True)
    reduced = reduce_runs(
        runs, plan, labels=labels, strict=strict, follow_symlinks=follow_symlinks, on_read=on_read,
        on_progress=on_progress, engine=engine, ray_address=ray_address,
    )  # fmt: skip
    rows, groups, order = group_rows(reduced, group_by, keep_missing)
    process = ["process"] if plan.mode is LoggingMode.PER_RANK_REDUCE else []
    frame = across_runs(rows, ["group", *process, bucket_column(plan), "key"], across)
    sizes = pl.Series([list(groups.values()).count(g) for g in order])
    short = frame["count"] < sizes.gather(frame["group"])
    notes: list[str] = [n.template or str(n) for run in reduced for n in run.unmatched]
    if common:
        frame = frame.filter(~short)
    elif short.any():
        notes.append(
            f"{int(short.sum())} of {frame.height} rows are held by fewer than all the runs of their group "
            "(count says how many); " + opt("common", flag=True) + " keeps only the rows every run holds"
        )
    named = [group_by] if group_by is not None else []
    if group_by is not None:
        frame = frame.with_columns(pl.Series(group_by, order, strict=False).gather(frame["group"]))
    frame = frame.select(*named, *process, bucket_column(plan), "key", "reduction", *across)
    described = [(run.label, run.run_dir, groups[run.label]) for run in reduced]
    ids = [source_id(run.meta, run.run_dir) for run in reduced]
    return CompareResult(frame, plan, across, group_by, described, list(dict.fromkeys(notes)), ids, common)


def across_runs(rows: pl.DataFrame, cells: list[str], across: Sequence[str]) -> pl.DataFrame:
    """The ``across`` statistics of ``rows`` (a ``value`` and a ``reduction`` a row, a row
    a run) per cell ``cells``, a row a cell, sorted; ``count`` always (the runs in it)."""
    import numpy as np
    import polars as pl

    from metric_core.offline.engine import exact

    # a cell's values together and in order (NaN last, -0.0 before 0.0 as the engine orders
    # them, whatever the runs' labels): min, max and median are read off them
    negative = (1.0 / pl.col("value")) < 0  # the sign, -0.0's included
    rows = rows.sort([*cells, "value", negative], descending=[False] * (len(cells) + 1) + [True])
    cell = rows.select(pl.struct(cells).rle_id()).to_series().to_numpy().astype(np.int64)
    starts = np.flatnonzero(np.r_[True, cell[1:] != cell[:-1]]) if len(cell) else np.zeros(0, np.int64)
    n_cells = len(starts)
    values = rows["value"].to_numpy()
    count = np.diff(np.r_[starts, rows.height])
    state = exact.accumulate(cell, values, n_cells)
    nan = np.bincount(cell, np.isnan(values), n_cells) > 0
    out = rows[starts].select(*cells, "reduction")
    stats: dict[str, Any] = {"count": pl.Series("count", count, pl.Int64)}
    if "mean" in across:
        stats["mean"] = state.mean()
    if "std" in across:
        stats["std"] = state.std()
    if "min" in across:
        stats["min"] = np.where(nan, np.nan, values[starts])
    if "max" in across:
        stats["max"] = values[starts + count - 1]
    if "median" in across:
        stats["median"] = _median(values, starts, count, nan)
    if "std_sample" in across or "stderr" in across:
        sample, stderr = _sample_spreads(state, count)
        stats.update(std_sample=sample, stderr=stderr)
    return out.with_columns(
        pl.Series(name, stats[name], pl.Int64 if name == "count" else pl.Float64)
        for name in dict.fromkeys(("count", *across))
    )


def group_rows(
    reduced: list[ReducedRun], group_by: str | None, keep_missing: bool = False
) -> tuple[pl.DataFrame, dict[str, Any], list[Any]]:
    """The runs' rows in one frame, in label order (the same bits whatever order the runs
    came in), each with its group's index in ``group``; each run's group value (by label);
    the groups' values in order (a run without ``group_by``: ``RequestError``, or with
    ``keep_missing`` a group of its own, last). ``RequestError`` when a key is reduced with
    different statistics in different runs."""
    import polars as pl

    groups = _group_values(reduced, group_by, keep_missing)
    order = sorted(set(groups.values()), key=_group_order)
    index = {g: i for i, g in enumerate(order)}
    parts = [run.frame.with_columns(group=pl.lit(index[groups[run.label]], pl.Int64)) for run in reduced]
    return _one_reduction_a_key(pl.concat(parts), reduced), groups, order


def reduce_runs(
    runs: Sequence[str | os.PathLike[str]],
    plan: ReducePlan,
    *,
    labels: Sequence[str] | None = None,
    strict: bool = False,
    follow_symlinks: bool = False,
    on_read: OnRead | None = None,
    on_progress: OnProgress | None = None,
    engine: Engine | str = Engine.LOCAL,
    ray_address: str | None = None,
) -> list[ReducedRun]:
    """Each run of ``runs`` (globs and ``@FILE`` expanded, ``expand_runs``) reduced with
    ``plan``, in the order of their labels; ``RequestError`` for two runs of one label."""
    import polars as pl

    from metric_core.offline.engine import run_plan
    from metric_core.offline.storage import name_of, run_path

    if plan.mode is LoggingMode.PER_RANK_NO_REDUCE:
        raise PlanError(
            "keeps every raw record, which runs have no common rows of: choose global_reduce or "
            "per_rank_reduce",
            option="mode",
            value=plan.mode.value,
        )
    dirs = expand_runs(runs)
    if labels is not None and len(labels) != len(dirs):
        raise PlanError(
            f"names {len(labels)} run(s), and {len(dirs)} were given ({', '.join(dirs)}): give one label "
            "a run, in the order of the runs (--label a --label b ...)",
            option="label",
            value=", ".join(labels),
        )
    named = list(labels) if labels is not None else [name_of(run_path(d)) for d in dirs]
    seen: dict[str, str] = {}
    for label, run_dir in zip(named, dirs, strict=True):
        if label in seen:
            raise RequestError(
                f"runs {seen[label]} and {run_dir} are both labelled {label!r}: name each run with "
                + opt("label")
                + "NAME (one a run, in their order)"
            )
        seen[label] = run_dir
    out = []
    for label, run_dir in sorted(zip(named, dirs, strict=True)):
        result = run_plan(
            run_dir, plan, strict=strict, follow_symlinks=follow_symlinks, on_read=on_read,
            on_progress=on_progress, engine=engine, ray_address=ray_address,
        )  # fmt: skip
        frame = result.frame
        if plan.mode is LoggingMode.PER_RANK_REDUCE:  # its sources are matched across runs by process
            try:
                one_rank_a_process(frame.select("process", "rank").unique().sort("rank").iter_rows())
            except RequestError as exc:
                raise RequestError(f"run {run_dir}: " + (exc.template or str(exc))) from None
        if plan.by is By.TIME:  # each run's windows from its own first record (its first window)
            every = float(plan.every or 0)
            start = frame["window_start"].min()
            bucket = ((pl.col("window_start") - start) / every).round(0) * every
            frame = frame.with_columns(bucket.alias(bucket_column(plan)))
        columns = [*(["process"] if plan.mode is LoggingMode.PER_RANK_REDUCE else []), bucket_column(plan)]
        frame = frame.select(*columns, "key", "value", "reduction")
        out.append(ReducedRun(label, run_dir, dict(result.scan.meta), frame, list(result.unmatched)))
    return out


def expand_runs(runs: Iterable[str | os.PathLike[str]]) -> list[str]:
    """Run directories from arguments: a glob (``runs/seed*``) becomes the directories it
    matches, in sorted order; ``@FILE`` the lines of FILE, a run each (blank lines and lines
    starting with ``#`` left out). ``RequestError`` for a glob that matches nothing or an
    unreadable FILE; ``PlanError`` for no run at all."""
    out: list[str] = []
    for run in runs:
        text = os.fspath(run)
        if text.startswith("@"):
            try:
                with open(text[1:], encoding="utf-8") as f:
                    lines = [line.strip() for line in f]
            except OSError as exc:
                raise RequestError(f"{text}: cannot read the list of runs ({exc.strerror or exc})") from None
            out += expand_runs(line for line in lines if line and not line.startswith("#"))
        elif "://" not in text and any(c in text for c in GLOB_CHARACTERS):
            matched = sorted(p for p in glob.glob(text) if os.path.isdir(p))
            if not matched:
                raise RequestError(f"{text}: no run directory matches this pattern")
            out += matched
        else:
            out.append(text)
    if not out:
        raise PlanError("give at least one run directory")
    return out


def parse_across(across: str | Sequence[str]) -> tuple[str, ...]:
    """``"mean,std"`` (or a list of names, each may hold commas) as a tuple of statistics of
    ACROSS, in the order given; ``PlanError`` naming an unknown one."""
    items = [across] if isinstance(across, str) else list(across)
    names = [n.strip().lower() for item in items for n in item.split(",") if n.strip()]
    for name in names:
        if name not in ACROSS:
            raise PlanError(
                f"names '{name}': use some of {', '.join(ACROSS)}", option="across", value=",".join(items)
            )
    if not names:
        raise PlanError(f"names no statistic: use some of {', '.join(ACROSS)}", option="across", value="")
    return tuple(dict.fromkeys(names))


def bucket_column(plan: ReducePlan) -> str:
    """``step``, or with ``--by time`` ``window_offset``: seconds from the run's first record."""
    return "window_offset" if plan.by is By.TIME else "step"


def source_id(meta: dict[str, Any], run_dir: str) -> str:
    """A run's id among compared runs: run.json's ``run_id``, else its directory's absolute path."""
    given = meta.get("run_id")
    return str(given) if given else (run_dir if "://" in run_dir else os.path.abspath(run_dir))


def config_value(meta: dict[str, Any], dotted: str) -> Any:
    """The value at ``dotted`` (``config.lr``) in run.json's fields; KeyError when absent."""
    node: Any = meta
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(dotted)
        node = node[part]
    return node


# --- helpers -------------------------------------------------------------------------


def plan_of(plan: ReducePlan | None, options: dict[str, Any]) -> ReducePlan:
    """``plan``, or the plan ``make_plan`` makes of ``options`` (not both)."""
    if plan is not None and options:
        raise PlanError(f"give a plan or its options ({', '.join(options)}), not both")
    return plan if plan is not None else make_plan(**options)


def _group_values(reduced: list[ReducedRun], group_by: str | None, keep_missing: bool) -> dict[str, Any]:
    """Each run's group: its value at ``group_by`` (JSON text for a list or an object), or
    None (one group of all runs; with ``keep_missing``, the runs without the key)."""
    out: dict[str, Any] = {}
    for run in reduced:
        if group_by is None:
            out[run.label] = None
            continue
        try:
            value = config_value(run.meta, group_by)
        except KeyError:
            if keep_missing:
                out[run.label] = None
                continue
            config = run.meta.get("config")
            has = (
                f"; its config has {', '.join(sorted(config))}" if isinstance(config, dict) and config else ""
            )
            raise RequestError(
                f"run {run.run_dir} ({run.label}) has no {group_by!r} in its run.json{has}: name a key every "
                "run has (dotted, e.g. config.lr), or "
                + opt("keep_missing", flag=True)
                + " to put such runs in a group of their own"
            ) from None
        out[run.label] = json.dumps(value, sort_keys=True) if isinstance(value, (list, dict)) else value
    numbers = [v for v in out.values() if v is not None]
    if numbers and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers):
        if not all(isinstance(v, int) for v in numbers):  # 1 and 1.0 are one group
            out = {k: None if v is None else float(v) for k, v in out.items()}
    elif numbers and not all(isinstance(v, type(numbers[0])) for v in numbers):  # mixed kinds: as text
        out = {k: None if v is None else v if isinstance(v, str) else json.dumps(v) for k, v in out.items()}
    return out


def _group_order(value: Any) -> tuple[bool, Any]:
    return (value is None, value if value is not None else 0)


def _one_reduction_a_key(rows: pl.DataFrame, reduced: list[ReducedRun]) -> pl.DataFrame:
    """``rows``, when every run reduced each key with one statistic; else ``RequestError``
    naming the key, its statistics and a run of each."""
    import polars as pl

    mixed = rows.group_by("key").agg(pl.col("reduction").n_unique().alias("n")).filter(pl.col("n") > 1)
    if mixed.height:
        key = sorted(mixed["key"].to_list())[0]
        said = []
        for run in reduced:
            found = run.frame.filter(pl.col("key") == key)["reduction"].unique().to_list()
            said += [f"{r} in {run.label}" for r in found]
        raise RequestError(
            f"key {key!r} is reduced with different statistics in the runs ({', '.join(said)}): the values "
            "cannot be compared; choose one with " + opt("reduce") + f"'{key}=STAT'"
        )
    return rows


def _median(values: Any, starts: Any, count: Any, nan: Any) -> Any:
    """Each cell's median from its sorted values: the middle one, or the two middle ones'
    exact mean, correctly rounded (``engine.exact``)."""
    import numpy as np

    from metric_core.offline.engine import exact

    low = values[starts + (count - 1) // 2]
    high = values[starts + count // 2]
    pairs = exact.accumulate(
        np.repeat(np.arange(len(starts)), 2), np.column_stack([low, high]).ravel(), len(starts), squares=False
    )
    return np.where(nan, np.nan, np.where(count % 2 == 1, low, pairs.mean()))


def _sample_spreads(state: Any, count: Any) -> tuple[list[float | None], list[float | None]]:
    """The sample std (var = D / (n (n - 1)), D = n Q - S**2 from the exact sums) and the
    standard error (sqrt(var / n)) of each cell, correctly rounded; None for one run, NaN
    where a value is not finite."""
    import math

    from metric_core.offline.engine import exact

    sums, squares = state.sum_digits.to_ints(), state.squares.to_ints()
    finite = (state.nan + state.pos_inf + state.neg_inf) == 0
    unit = -exact.SQUARE_BASE  # S**2 and Q are in units of 2**SQUARE_BASE
    sample: list[float | None] = []
    stderr: list[float | None] = []
    for s, q, n, ok in zip(sums, squares, count.tolist(), finite.tolist(), strict=True):
        if n < 2:
            sample.append(None)
            stderr.append(None)
        elif not ok:
            sample.append(math.nan)
            stderr.append(math.nan)
        else:
            d = n * q - s * s
            sample.append(exact.sqrt_ratio(d, (n * (n - 1)) << unit))
            stderr.append(exact.sqrt_ratio(d, (n * n * (n - 1)) << unit))
    return sample, stderr
