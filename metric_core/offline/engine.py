"""The three logging modes, computed offline from a run's raw records.

A ``ReducePlan`` (``metric_core.offline.plan``) says what to compute and knows nothing about
how. ``execute`` cuts the run's files into partitions (``partitions``: fixed by the files,
not by the machine), reads each once on a pool of threads, reduces it to partial states
(``metric_core.offline.partials``) and folds those in partition order, so the output is
the same bits whatever the thread count. Memory grows with the number of output groups
(and with the values of median/pNN keys), not with the records. Another engine can run
the same plan over the same partitions (docs/modes.md, "How results are computed").

Statistics follow numpy over all raw values of a group: ``mean`` is sum/count over
every value (not a mean of rank means), ``std`` is the population std (ddof=0), ``pNN``
is numpy's default (linear) percentile, and a group holding a NaN gives NaN for every
statistic but ``count``, ``first`` and ``last``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice
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
from metric_core.offline.read import OnProgress, OnRead, RunScan, changed_files_said, scan_run
from metric_core.offline.read.parquet import read_categorical, row_group_times
from metric_core.offline.timeorder import Part, in_time_order
from metric_core.schema import REQUIRED_FIELDS

T = TypeVar("T")


@dataclass
class ReduceResult:
    """A reduction and the scan it came from (for the health report).

    A per_rank_no_reduce result is a stream of frames, one source at a time, read when
    ``batches()`` is iterated (so writing it holds one source's records, not the run's);
    ``frame`` gathers them into one frame.
    """

    plan: ReducePlan
    scan: RunScan
    table: pl.DataFrame | None = None
    stream: Callable[[], Iterator[pl.DataFrame]] | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def frame(self) -> pl.DataFrame:
        if self.table is None:
            self.table = pl.concat(list(self.batches()))
        return self.table

    def batches(self) -> Iterator[pl.DataFrame]:
        if self.stream is None:
            yield self.frame
        else:
            yield from self.stream()


def _filtered(plan: ReducePlan, frame: pl.LazyFrame) -> pl.LazyFrame:
    """The plan's rank and step filters (``--key`` is applied per file: ``_matching``)."""
    lf = frame.select(plan.input_columns)
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


@changed_files_said
def execute(plan: ReducePlan, scan: RunScan, *, on_progress: OnProgress | None = None) -> ReduceResult:
    """Run ``plan`` over a scanned run; raise MetricLogError when it cannot be served.

    A reducing mode runs as partial states (``metric_core.offline.partials``): one per
    file, computed on a pool of threads and merged in a fixed order, so the output is the
    same bits whatever the thread count or the order the files were listed in.
    """
    sources = _single_sources(scan) if plan.mode is not LoggingMode.GLOBAL_REDUCE else None
    if plan.by == "time" or plan.mode is LoggingMode.PER_RANK_NO_REDUCE or sources is not None:
        # --by time windows start at the first record kept, a query over every file first;
        # a stream of sources is read after the report was handed over.
        scan.check_all()
    if plan.mode is LoggingMode.PER_RANK_NO_REDUCE:
        return _raw(plan, scan, on_progress)
    match = key_matcher(plan.keys) if plan.keys else None
    t0 = _first_time(plan, scan) if plan.by == "time" else None
    statistic_of = _statistic_chooser(plan)
    dictionaries = _dictionary_read(scan)
    # What is reduced together: the whole run, or (per_rank_reduce, every file of one
    # source) each source on its own, emitted in order, so memory holds one source's groups.
    units = [list(scan.parts)] if sources is None else [fids for _, fids in sorted(sources.items())]
    work = [(u, part) for u, fids in enumerate(units) for part in partitions(scan, fids)]
    sizes = [sum(scan.report.files[fid].size for fid in part) for _, part in work]

    def reduce_part(part: list[int]) -> partials.Partial:
        df = _matching(pl.concat([_read_part(plan, scan, fid, dictionaries) for fid in part]), match)
        return partials.partition_states(df, plan, statistic_of, t0)

    def stream() -> Iterator[pl.DataFrame]:
        recorded: dict[str, str] = {}  # each key's statistic in the sources emitted so far
        acc, unit = partials.Accumulator(), 0
        states = _in_order(reduce_part, [part for _, part in work], sizes, on_progress)
        try:
            for (u, _), state in zip(work, states, strict=True):
                if u != unit:
                    yield from _finished(plan, scan, acc, t0, recorded)
                    acc.close()
                    acc, unit = partials.Accumulator(), u
                acc.add(state)
            yield from _finished(plan, scan, acc, t0, recorded)
        finally:
            acc.close()
        if not recorded:
            raise NoDataError(str(scan.run_dir), "no record matches the filters")

    if sources is not None:
        return ReduceResult(plan, scan, stream=stream)
    return ReduceResult(plan, scan, table=pl.concat(list(stream())))


def _finished(
    plan: ReducePlan, scan: RunScan, acc: partials.Accumulator, t0: float | None, recorded: dict[str, str]
) -> Iterator[pl.DataFrame]:
    """The result of the partitions folded into ``acc`` (nothing if they held no record)."""
    merged, stats = acc.result()
    if merged.height == 0:
        return
    _check_reductions(plan, scan, merged, recorded)
    value = _values(merged, stats, acc)
    if plan.by == "time":
        bucket = pl.lit(t0) + pl.col("bucket").cast(pl.Float64) * float(plan.every or 0)
    else:
        bucket = pl.col("bucket")
    out = merged.with_columns(
        bucket.alias(plan.bucket), value=pl.Series(value), count=pl.Series(stats["count"])
    )
    yield out.select(plan.output_columns).sort(plan.sort_columns)


def _single_sources(scan: RunScan) -> dict[tuple[str, int], list[int]] | None:
    """Each source's files, when every file holds one source (the writer's, or another
    tool's whose footer says so); else None."""
    out: dict[tuple[str, int], list[int]] = {}
    for fid in scan.parts:
        rep = scan.report.files[fid]
        source = rep.source or rep.single_source
        if source is None:
            return None
        out.setdefault(source, []).append(fid)
    return out


def _read_part(
    plan: ReducePlan, scan: RunScan, fid: int, dictionaries: bool, row_groups: list[int] | None = None
) -> pl.DataFrame:
    """One file's records the plan needs (or those of its ``row_groups``), read once (a file
    not checked yet is checked whole), strings as polars Categorical. With ``dictionaries``,
    Parquet is read by pyarrow with its strings kept as dictionary codes, never decoded
    (``read_categorical``)."""
    rep = scan.report.files[fid]
    wanted = {*plan.input_columns, *(REQUIRED_FIELDS if fid in scan.unchecked else ())}
    if rep.keys is None or any(r in ("first", "last") for _, r in rep.keys):
        wanted.add("timestamp")  # a statistic of the recorded reductions may need it
    columns = sorted(wanted)
    if rep.format == "parquet" and dictionaries:
        df = read_categorical(rep.path, columns, rep.hashed, row_groups)
        if rep.replaced_from is not None:
            df = df.filter(pl.col("step") < rep.replaced_from)
    else:
        assert row_groups is None, "row groups are read through the dictionaries"
        strings = [c for c in ("key", "reduction", "process") if c in columns]
        df = scan.parts[fid].select(columns).with_columns(pl.col(strings).cast(pl.Categorical)).collect()
    return _filtered(plan, scan.checked(fid, df).lazy()).collect()


# From about this many Parquet records on, reading them with pyarrow's dictionaries beats
# decoding every string with polars by more than pyarrow's import (0.1 s) costs.
DICTIONARY_READ_RECORDS = 2_000_000


def _dictionary_read(scan: RunScan) -> bool:
    return sum(f.records for f in scan.report.files if f.format == "parquet") >= DICTIONARY_READ_RECORDS


PARTITION_ROWS = 1_000_000


def partitions(
    scan: RunScan, fids: Sequence[int] | None = None, rows: int = PARTITION_ROWS
) -> list[list[int]]:
    """The run's files (ids, in path order; or ``fids``) in consecutive groups of about
    ``rows`` records: what one task reduces. It depends on the files alone, never on the
    thread count."""
    out: list[list[int]] = []
    held = 0
    for fid in scan.parts if fids is None else fids:
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


def _check_reductions(
    plan: ReducePlan, scan: RunScan, merged: pl.DataFrame, recorded: dict[str, str]
) -> None:
    """A key recorded with two reductions (and no override) is an error, as is a reduction
    that is not a statistic; ``recorded`` holds each key's statistic in earlier results."""
    per_key = merged.group_by("key").agg(pl.col("reduction").unique().sort()).sort("key")
    for key, reductions in per_key.iter_rows():
        if len(reductions) > 1 or recorded.setdefault(key, reductions[0]) != reductions[0]:
            found = sorted({*reductions, recorded.get(key, reductions[0])})
            origins = _reduction_origins(plan, scan, key)
            raise MixedReductionError(key, origins if len(origins) > 1 else {r: [] for r in found})
    unknown = {key: r[0] for key, r in per_key.iter_rows() if not partials.is_statistic(r[0])}
    if unknown:
        raise UnknownReductionError(unknown)


def _values(merged: pl.DataFrame, stats: dict[str, np.ndarray], acc: partials.Accumulator) -> np.ndarray:
    """Each group's value: the statistic its reduction names, from the merged states.

    median and pNN sort each group's values (polars' linear quantile, numpy's to an ulp);
    a group holding NaN gets NaN, as in numpy."""
    value = np.full(merged.height, np.nan)
    for name in merged["reduction"].unique().sort():
        stat = Statistic.parse(name)
        rows = (merged["reduction"] == name).to_numpy()
        if stat.name != "median" and stat.quantile is None:
            value[rows] = stats[stat.name][rows]
            continue
        q = 0.5 if stat.quantile is None else stat.quantile  # median: 0.5
        combos = merged.filter(rows)["_combo"].unique().implode()
        found = pl.concat(
            [
                part.filter(pl.col("_combo").is_in(combos))
                .group_by("bucket", "_combo")
                .agg(
                    q=pl.when(pl.col("value").is_nan().any())
                    .then(float("nan"))
                    .otherwise(pl.col("value").quantile(q, interpolation="linear"))
                )
                .collect()
                for part in acc.value_ranges()
            ]
        )
        picked = merged.select("bucket", "_combo").join(
            found, on=["bucket", "_combo"], how="left", maintain_order="left"
        )
        value[rows] = picked["q"].to_numpy()[rows]
    return value


def _raw(plan: ReducePlan, scan: RunScan, on_progress: OnProgress | None) -> ReduceResult:
    """per_rank_no_reduce: every record kept, one source at a time, in time order.

    A file of one source (the writer's) is read when its source's turn comes; files that
    hold several sources (or do not say) are read first and held, to be split by source."""
    warnings: list[str] = []
    if plan.overrides:
        warnings.append("--reduce has no effect with --mode per_rank_no_reduce: raw values are kept")
    t0 = _first_time(plan, scan) if plan.by == "time" else None
    match = key_matcher(plan.keys) if plan.keys else None
    dictionaries = _dictionary_read(scan)
    by_source: dict[tuple[str, int], list[int]] = {}
    mixed: list[int] = []
    for fid in scan.parts:
        rep = scan.report.files[fid]
        source = rep.source or rep.single_source
        (by_source.setdefault(source, []) if source is not None else mixed).append(fid)
    sizes = {fid: scan.report.files[fid].size for fid in scan.parts}
    total = sum(sizes.values())

    def read(fid: int, groups: list[int] | None = None) -> pl.DataFrame:
        return _matching(_read_part(plan, scan, fid, dictionaries, groups), match)

    def stream() -> Iterator[pl.DataFrame]:
        done = 0
        held = pl.concat([read(fid) for fid in mixed]) if mixed else None
        if held is not None:
            done += sum(sizes[fid] for fid in mixed)
        sources = set(by_source)
        if held is not None:
            sources |= set(held.select("process", "rank").unique().iter_rows())
        produced = False
        for i, (process, rank) in enumerate(sorted(sources)):
            fids = by_source.get((process, rank), [])
            if held is None:
                batches = in_time_order(_time_parts(scan, fids, dictionaries), read, RAW_BATCH_ROWS)
            else:  # its held rows may fall anywhere in its time: all of it at once
                mine = held.filter((pl.col("process") == process) & (pl.col("rank") == rank))
                whole = pl.concat([*(read(fid) for fid in fids), mine])
                batches = iter([whole.sort("timestamp", maintain_order=True)])  # ties: file order
            for batch in batches:
                if batch.height == 0:  # a filter left none of the source's records
                    continue
                if t0 is not None:
                    window = np.floor((batch["timestamp"].to_numpy() - t0) / float(plan.every or 0))
                    batch = batch.with_columns(window_start=pl.Series(t0 + window * float(plan.every or 0)))
                produced = True
                yield batch.select(plan.output_columns).with_columns(pl.col(pl.Categorical).cast(pl.String))
            done += sum(sizes[fid] for fid in fids)
            if on_progress is not None:
                on_progress(i + 1, len(sources), done, total)
        if not produced:
            raise NoDataError(str(scan.run_dir), "no record matches the filters")

    return ReduceResult(plan, scan, stream=stream, warnings=warnings)


# per_rank_no_reduce hands over a source's records in frames of about this many.
RAW_BATCH_ROWS = 250_000


def _time_parts(scan: RunScan, fids: list[int], row_groups: bool) -> list[Part]:
    """One source's files as parts with their earliest time (``timeorder``): Parquet row
    groups by their footer's statistics when read through the dictionaries (``row_groups``),
    else whole files by their declared range; a file that declares none may hold any time."""
    out: list[Part] = []
    for fid in fids:
        rep = scan.report.files[fid]
        groups = row_group_times(rep.path) if row_groups and rep.format == "parquet" else None
        if groups is not None:
            out += [Part(fid, (g,), lo, rows) for g, (lo, rows) in enumerate(groups)]
        elif rep.timestamps is not None:
            out.append(Part(fid, None, rep.timestamps[0], rep.records))
        else:
            out.append(Part(fid, None, -math.inf, rep.records))
    return out


def _matching(df: pl.DataFrame, match: Callable[[str], bool] | None) -> pl.DataFrame:
    """The records whose key a ``--key`` pattern matches (each distinct key tested once)."""
    if match is None or df.height == 0:
        return df
    keys = [k for k in df["key"].unique().cast(pl.String) if match(k)]
    return df.filter(pl.col("key").cast(pl.String).is_in(keys))


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
    on_progress: OnProgress | None = None,
) -> ReduceResult:
    """Read ``run_dir`` and execute ``plan`` over it; the result keeps the read's health report.

    ``on_read`` gets the health report once the run is read, ``on_progress`` the progress
    of the read. Raises ``StrictModeError`` when ``strict`` and the reader skipped anything.

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
        result = execute(plan, scan, on_progress=on_progress)
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
