"""The three logging modes, computed offline from a run's raw records.

A ``ReducePlan`` (``metric_core.offline.plan``) says what to compute and knows nothing about
how. ``execute`` cuts the run's files into tasks (``tasks``: files, or their row groups,
in the order of the first step or window each may hold; fixed by the files, not by the
machine), reads each once on a pool of threads as partitions of about PARTITION_ROWS
records, reduces each to partial states (``metric_core.offline.partials``) and folds
those in that fixed order, so the output is the same bits whatever the thread count.
Memory grows with the number of output groups (and with the values of median/pNN keys),
not with the records. Another engine can run the same plan over the same tasks
(docs/modes.md, "How results are computed").

Statistics follow numpy over all raw values of a group: ``mean`` is sum/count over
every value (not a mean of rank means), ``std`` is the population std (ddof=0), ``pNN``
is numpy's default (linear) percentile, and a group holding a NaN gives NaN for every
statistic but ``count``, ``first`` and ``last``.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import difflib
import functools
import inspect
import math
import os
import queue
import tempfile
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import polars as pl
from polars.exceptions import PanicException

from metric_core.errors import (
    NoDataError,
    PlanError,
    RequestError,
    StrictModeError,
    UnknownReductionError,
    UnmatchedError,
    opt,
)
from metric_core.metric import LoggingMode
from metric_core.offline import filters, partials
from metric_core.offline.plan import ReducePlan, Statistic, counts_back, key_matcher, last_steps, make_plan
from metric_core.offline.read import OnProgress, OnRead, RunScan, all_skipped, changed_files_said, scan_run
from metric_core.offline.read.parquet import kept_first_time, row_group_lows
from metric_core.offline.read.report import MixedKey
from metric_core.offline.timeorder import Part, in_time_order

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class ReduceResult:
    """A reduction and the scan it came from (for the health report).

    The result is a stream of frames (in output order: one source after another in the
    per-rank modes, steps in order within), read when ``batches()`` is iterated, so writing
    it holds a few frames, not the result; ``frame`` gathers them into one frame.
    """

    plan: ReducePlan
    scan: RunScan
    stream: Callable[[], Iterator[pl.DataFrame]]
    # The filters and --reduce patterns that matched no record: known once the stream ended.
    unmatched: list[PlanError] = field(default_factory=list)
    table: pl.DataFrame | None = None  # the frames gathered, once ``frame`` read them

    @property
    def frame(self) -> pl.DataFrame:
        if self.table is None:
            self.table = pl.concat(list(self.stream()))
        return self.table

    def batches(self) -> Iterator[pl.DataFrame]:
        if self.table is not None:
            yield self.table
        else:
            yield from self.stream()


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


def _last_step(plan: ReducePlan, scan: RunScan) -> int:
    """The highest step of the sources ``plan`` keeps (its ranks), -1 for none."""
    ranks_only = dataclasses.replace(plan, steps=None)
    found = plan_filtered(ranks_only, scan.frame, ["rank", "step"]).select(pl.col("step").max()).collect()
    last = found.item()
    return -1 if last is None else int(last)


@changed_files_said
def execute(
    plan: ReducePlan,
    scan: RunScan,
    *,
    on_progress: OnProgress | None = None,
    engine: str = "local",
    ray_address: str | None = None,
) -> ReduceResult:
    """Run ``plan`` over a scanned run; raise MetricLogError when it cannot be served.

    A reducing mode runs as partial states (``metric_core.offline.partials``): the run's
    files (or their Parquet row groups) are cut into tasks in the order of their first
    step (``tasks``), each task's states are computed on a pool of threads and folded in
    that fixed order, and the groups no task still to come can touch are handed over as
    a frame and dropped. So the output is the same bits whatever the thread count or the
    order the files were listed in, and memory holds the groups of the steps in flight.
    The result is a stream, read when it is iterated.

    ``engine="ray"`` computes the tasks' states as Ray tasks (``offline.ray_engine``, on
    the cluster at ``ray_address``, ``RAY_ADDRESS``, or a local one) and folds them here in
    the same order: the same bits. Raw mode has nothing to reduce and is read here.
    """
    if engine not in ENGINES:
        raise PlanError(f"is not one of {', '.join(ENGINES)}", option="engine", value=engine)
    if counts_back(plan.steps):  # --steps -5: the last 5 steps of the sources kept
        plan = dataclasses.replace(plan, steps=last_steps(plan.steps, _last_step(plan, scan)))  # type: ignore[arg-type]
    if plan.mode is LoggingMode.PER_RANK_NO_REDUCE:
        return _raw(plan, scan, on_progress)
    sources = _single_sources(scan) if plan.mode is not LoggingMode.GLOBAL_REDUCE else None
    t0 = _first_time(plan, scan) if plan.by == "time" else None
    dictionaries = _dictionary_read(scan)
    kept = _columns_read(plan, scan)
    seen, unmatched = filters.Seen.wanted_by(plan), list[PlanError]()
    # What is reduced together: the whole run, or (per_rank_reduce, every file of one
    # source) each source on its own, emitted in order.
    units = [list(scan.parts)] if sources is None else [fids for _, fids in sorted(sources.items())]
    work = [(u, task) for u, fids in enumerate(units) for task in tasks(plan, scan, fids, t0, dictionaries)]

    reduce_task = TaskWork(plan, scan, dictionaries, kept, t0, PARTITION_ROWS)
    if engine == "ray":
        from metric_core.offline.ray_engine import in_order

        scan.check_all()  # a task's counts of bad rows could not reach this process's report
        states_of = functools.partial(in_order, reduce_task, seen=seen, address=ray_address)
    else:
        states_of = functools.partial(_in_order, functools.partial(reduce_task, seen=seen))

    @changed_files_said
    def stream() -> Iterator[pl.DataFrame]:
        recorded = KeyReductions(first_reductions(plan, scan))  # each key's: decided, or in the frames so far
        for key, reduction in recorded.decided.items():
            scan.report.mixed.setdefault(key, MixedKey(key, reduction))
        produced = False
        acc = partials.Accumulator()
        states = states_of([task for _, task in work], [t.size for _, t in work], on_progress)
        try:
            for i, state in states:
                if state is not None:  # a partition of task i
                    acc.add(state)
                    continue
                # Task i is done: every task still to come of its unit starts at the next one's
                # first bucket.
                u = work[i][0]
                upto = work[i + 1][1].lo if i + 1 < len(work) and work[i + 1][0] == u else math.inf
                if upto == math.inf or acc.cells_below(upto) >= TAKEN_GROUPS // 2:  # a frame's worth
                    last = i + 1 == len(work)
                    for frame in _finished(plan, scan, acc, t0, recorded, upto, scan.report.mixed, last):
                        produced = produced or frame.height > 0
                        yield frame
                if upto == math.inf:
                    acc.close()
                    acc = partials.Accumulator()
        finally:
            states.close()  # stops the pool's threads, whatever ended the stream
            acc.close()
        unmatched[:] = filters.unmatched(plan, seen)
        if not produced:
            raise _nothing_kept(plan, scan, unmatched)

    if plan.mode is LoggingMode.PER_RANK_REDUCE and sources is None:  # several sources a file
        return ReduceResult(plan, scan, stream=lambda: _source_by_source(stream()), unmatched=unmatched)
    return ReduceResult(plan, scan, stream=stream, unmatched=unmatched)


ENGINES = ("local", "ray")


@dataclass
class TaskWork:
    """What reduces one task's records, wherever it runs (a thread here, or a Ray worker:
    it pickles; the filters and the statistic chooser are made from the plan where it runs).

    Called with a task, it yields the task's records as partitions of about PARTITION_ROWS
    (cut where the reads' frames end, which the files fix), each reduced as soon as it is
    read; ``seen`` gathers the ranks and keys read."""

    plan: ReducePlan
    scan: RunScan
    dictionaries: bool
    kept: list[str]
    t0: float | None
    rows: int  # a partition's records (PARTITION_ROWS, as this process has it)

    def __call__(self, task: Task, seen: filters.Seen) -> Iterator[partials.Partial]:
        plan = self.plan
        match = key_matcher(plan.keys) if plan.keys else None
        statistic_of = _statistic_chooser(plan)
        rows = self.rows
        pieces: list[pl.DataFrame] = []
        places: list[tuple[int, int]] = []
        held = 0
        for fid, groups, at in task.reads:
            batches = _read_batches(plan, self.scan, fid, self.dictionaries, self.kept, groups, rows, seen)
            for frame in batches:
                for start in range(0, frame.height, rows):  # a whole file read at once, too
                    pieces.append(key_matching(frame.slice(start, rows), match))
                    places.append((at, pieces[-1].height))
                    held += pieces[-1].height
                    if held >= rows:
                        yield partials.partition_states(
                            pl.concat(pieces, how="vertical_relaxed"), plan, statistic_of, self.t0, places
                        )
                        pieces, places, held = [], [], 0
        if held:
            yield partials.partition_states(
                pl.concat(pieces, how="vertical_relaxed"), plan, statistic_of, self.t0, places
            )


def _finished(
    plan: ReducePlan,
    scan: RunScan | None,
    acc: partials.Accumulator,
    t0: float | None,
    recorded: KeyReductions,
    upto: float,
    mixed: dict[str, MixedKey],
    last: bool = False,
) -> Iterator[pl.DataFrame]:
    """The result of the groups folded into ``acc`` below bucket ``upto`` (``take``), in
    frames of about TAKEN_GROUPS groups; ``recorded`` and ``mixed`` as ``_kept_reductions``
    (``last``: no frame of the stream follows these)."""
    if plan.by == "time":
        bucket = pl.lit(t0) + pl.col("bucket").cast(pl.Float64) * float(plan.every or 0)
    else:
        bucket = pl.col("bucket")
    cuts = acc.cuts(upto, TAKEN_GROUPS)
    for i, cut in enumerate(cuts):
        merged, stats, values = acc.take(cut)
        if merged.height == 0:
            continue
        remember = not last or i + 1 < len(cuts)
        kept = _kept_reductions(scan, merged, recorded, stats["count"], mixed, remember)
        value = _values(merged, stats, values)
        out = merged.with_columns(
            bucket.alias(plan.bucket), value=pl.Series(value), count=pl.Series(stats["count"])
        )
        if kept is not None:
            out = out.filter(pl.Series(kept))
        out = out.select(plan.output_columns).with_columns(pl.col(pl.Categorical).cast(pl.String))
        del merged, stats, values, value, kept  # not held while the frame is written
        yield out.sort(plan.sort_columns)


# The groups of one frame of a result, at most (in whole blocks of steps)
TAKEN_GROUPS = 1 << 17


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
    acc = partials.Accumulator()
    try:
        acc.add(partials.partition_states(records, plan, _statistic_chooser(plan), t0))
        frames = list(_finished(plan, None, acc, t0, recorded, math.inf, {} if mixed is None else mixed))
    finally:
        acc.close()
    return pl.concat(frames) if frames else pl.DataFrame()


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


def _read_batches(
    plan: ReducePlan,
    scan: RunScan,
    fid: int,
    dictionaries: bool,
    kept: list[str],
    row_groups: list[int] | None,
    rows: int | None,
    seen: filters.Seen,
) -> Iterator[pl.DataFrame]:
    """One file's ``kept`` columns (``_columns_read``; or those of its ``row_groups``) as
    ``RunScan.batches`` reads them, the plan's rank and step filters applied. The ranks and
    keys read are noted in ``seen`` before the filters drop any."""
    for df in scan.batches(fid, kept, dictionaries=dictionaries, row_groups=row_groups, rows=rows):
        seen.add(
            df["rank"].unique() if seen.ranks is not None else None,
            df["key"].unique().cast(pl.String) if seen.keys is not None else None,
        )
        yield plan_filtered(plan, df.lazy(), kept).collect()


def _read_part(
    plan: ReducePlan,
    scan: RunScan,
    fid: int,
    dictionaries: bool,
    kept: list[str],
    seen: filters.Seen,
    row_groups: list[int] | None = None,
) -> pl.DataFrame:
    """``_read_batches`` as one frame."""
    return pl.concat(
        list(_read_batches(plan, scan, fid, dictionaries, kept, row_groups, RAW_BATCH_ROWS, seen)),
        how="vertical_relaxed",  # keys as Categorical or, past read.interned's budget, text
    )


def _columns_read(plan: ReducePlan, scan: RunScan) -> list[str]:
    """The plan's input columns, and the timestamp wherever a file's recorded reductions
    may be first or last (so every file of a run gives the same columns)."""
    first_last = any(
        rep.keys is None or any(r in ("first", "last") for _, r in rep.keys) for rep in scan.report.files
    )
    return sorted({*plan.input_columns, *(("timestamp",) if first_last else ())})


# From about this many Parquet records on, reading them with pyarrow's dictionaries beats
# decoding every string with polars by more than pyarrow's import (0.1 s) costs.
DICTIONARY_READ_RECORDS = 2_000_000


def _dictionary_read(scan: RunScan) -> bool:
    return sum(f.records for f in scan.report.files if f.format == "parquet") >= DICTIONARY_READ_RECORDS


# Records a partition holds (its states are made and folded as one): 125K against 250K
# is 5% less at the peak of 100M records of another tool's, for no speed.
PARTITION_ROWS = 125_000


@dataclass(frozen=True)
class Task:
    """What one thread reduces: ``reads`` (file id, row groups or None for the whole file,
    place in file order of the first of them), in file order; ``lo``, the first bucket
    they may hold; ``size``, their bytes (what progress counts)."""

    reads: list[tuple[int, list[int] | None, int]]
    lo: float
    size: int


def tasks(
    plan: ReducePlan,
    scan: RunScan,
    fids: Sequence[int],
    t0: float | None,
    row_groups: bool,
    rows: int | None = None,
) -> list[Task]:
    """The files ``fids`` (in path order) cut into tasks of about ``rows`` records, in the
    order of the first bucket (step, or ``--by time`` window) each may hold.

    A part is a Parquet row group when the files are read through the dictionaries
    (``row_groups``) and its footer has the statistics, else a whole file with the range
    its writer declared (or none: it may hold any bucket, and goes first). Tasks depend on
    the files alone, never on the thread count, and are folded in this order.
    """
    rows = PARTITION_ROWS if rows is None else rows
    column = "timestamp" if plan.by == "time" else "step"
    parts = _parts(scan, fids, row_groups, column)
    if plan.by == "time":
        assert t0 is not None and plan.every is not None
        every = float(plan.every)
        parts = [
            dataclasses.replace(p, lo=math.floor((p.lo - t0) / every) if p.lo > -math.inf else p.lo)
            for p in parts
        ]
    order = sorted(range(len(parts)), key=lambda i: (parts[i].lo, i))
    chunks: list[list[int]] = []
    held = 0
    for i in order:
        if not chunks or (held and held + parts[i].rows > rows):
            chunks.append([])
            held = 0
        chunks[-1].append(i)
        held += parts[i].rows
    out = []
    for chunk in chunks:
        reads: list[tuple[int, list[int] | None, int]] = []
        size = 0
        for i in sorted(chunk):
            p, rep = parts[i], scan.report.files[parts[i].fid]
            size += rep.size * p.rows // max(rep.records, 1) if p.groups is not None else rep.size
            last = reads[-1] if reads else None
            if last is not None and p.groups is not None and last[0] == p.fid and last[1] is not None:
                last[1].extend(p.groups)  # the next row groups of the same file: one read
            else:
                reads.append((p.fid, None if p.groups is None else list(p.groups), i))
        out.append(Task(reads, parts[chunk[0]].lo, size))
    return out


# Partitions a task may have reduced and not yet handed over: what lets the next task
# work while this one's are folded, and what bounds the memory that takes.
HANDED_AHEAD = 1
# Tasks in flight (started and not yet read to the end) per pool thread: a thread that is
# done with its task starts a later one while an earlier task is still being read.
IN_FLIGHT_PER_THREAD = 2


class _Stopped(Exception):
    """The reader of ``_in_order`` went away: a task's thread stops."""


def _in_order(
    work: Callable[[T], Iterator[R]], items: list[T], sizes: list[int], on_progress: OnProgress | None
) -> Generator[tuple[int, R | None], None, None]:
    """``work(item)``'s outputs for every item, computed on a pool of threads and yielded
    in the items' order as (the item's index, an output), then (the index, None) once the
    item is done. At most IN_FLIGHT_PER_THREAD items a thread are in flight, and none runs
    more than HANDED_AHEAD outputs ahead of the reader, so memory stays bounded."""
    threads = max(1, min(len(items), pl.thread_pool_size()))
    stop = threading.Event()
    handed: list[queue.SimpleQueue[tuple[str, Any]]] = [queue.SimpleQueue() for _ in items]
    room = [threading.Semaphore(HANDED_AHEAD) for _ in items]  # outputs item i may hand over

    def run(i: int) -> None:
        def put(kind: str, what: Any) -> None:
            while kind == "out" and not room[i].acquire(timeout=0.05):
                if stop.is_set():
                    raise _Stopped
            handed[i].put((kind, what))  # the end of an item never waits: its thread moves on

        if stop.is_set():  # queued before the reader went away
            return
        try:
            for out in work(items[i]):
                put("out", out)
            put("done", None)
        except _Stopped:
            return
        except BaseException as exc:  # handed to the reader, raised there
            put("error", exc)

    # Daemon threads: a stream left half read (kept alive by a traceback, say) never stops
    # the interpreter from exiting; at exit they are stopped and waited for (``_stop_pools``).
    todo: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    pool = [threading.Thread(target=_serve, args=(todo, run), daemon=True) for _ in range(threads)]
    live = (stop, todo, pool)
    _live_pools.append(live)
    for thread in pool:
        thread.start()
    done_bytes, total = 0, sum(sizes)
    upcoming = iter(range(len(items)))
    try:
        for j in islice(upcoming, threads * IN_FLIGHT_PER_THREAD):
            todo.put(j)
        for i in range(len(items)):
            while (got := handed[i].get())[0] == "out":
                room[i].release()
                yield i, got[1]
            if got[0] == "error":
                raise got[1]
            for j in islice(upcoming, 1):
                todo.put(j)
            done_bytes += sizes[i]
            if on_progress is not None:
                on_progress(i + 1, len(items), done_bytes, total)
            yield i, None
    finally:
        stop.set()
        for _ in pool:
            todo.put(None)
        with contextlib.suppress(ValueError):
            _live_pools.remove(live)


# The pools of the streams not finished yet. At exit, before the interpreter tears down,
# each is stopped and its threads waited for (a moment): a thread left inside pyarrow's
# C++ while the process exits makes it abort ("terminate called without an active
# exception") instead of exiting with its status.
_live_pools: list[tuple[threading.Event, queue.SimpleQueue[int | None], list[threading.Thread]]] = []


@atexit.register
def _stop_pools() -> None:
    for stop, todo, pool in list(_live_pools):
        stop.set()
        for _ in pool:
            todo.put(None)
    deadline = time.monotonic() + 10.0
    for _, _, pool in list(_live_pools):
        for thread in pool:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


def _serve(todo: queue.SimpleQueue[int | None], run: Callable[[int], None]) -> None:
    """A pool thread: ``run`` each item index handed to it, until None."""
    while (i := todo.get()) is not None:
        run(i)


def _nothing_kept(plan: ReducePlan, scan: RunScan, unmatched: list[PlanError]) -> NoDataError:
    """The error of a result without a record: every record was skipped (another tool's
    files, checked as they were read), or the filters left none."""
    if scan.report.records == 0:
        return all_skipped(scan.report)
    return filters.nothing_left(str(scan.run_dir), plan, unmatched)


def _source_by_source(frames: Iterator[pl.DataFrame]) -> Iterator[pl.DataFrame]:
    """per_rank_reduce frames of several sources each (a run whose files hold several
    sources is reduced as one, step range after step range), a source at a time, in the
    output's order: each source's rows wait in files of a temporary directory ($TMPDIR,
    removed when done) until the last frame is read, so memory holds a frame."""
    with tempfile.TemporaryDirectory(prefix="metriclog-sources-") as tmp:
        files: dict[tuple[str, int], list[Path]] = {}
        for n, frame in enumerate(frames):
            for k, (source, part) in enumerate(frame.partition_by("process", "rank", as_dict=True).items()):
                path = Path(tmp) / f"{n:06d}-{k:06d}.parquet"
                part.write_parquet(path)
                files.setdefault(source, []).append(path)
        for source in sorted(files):
            for path in files[source]:
                yield pl.read_parquet(path)
                path.unlink()


def _statistic_chooser(plan: ReducePlan) -> Callable[[str, str], str]:
    """The statistic of a key: the last ``--reduce`` pattern that matches it, or its recorded reduction."""
    overrides = [(key_matcher([pattern]), stat.name) for pattern, stat in plan.overrides]

    def statistic_of(key: str, recorded: str) -> str:
        chosen = [name for match, name in overrides if match(key)]
        return chosen[-1] if chosen else recorded

    return statistic_of


def _first_time(plan: ReducePlan, scan: RunScan) -> float:
    """The earliest timestamp among the records the filters keep: where ``--by time`` windows
    start. What the files declare tells it when it is exact (``_declared_first_time``);
    else a query over every file (another tool's files checked first, in a read of their
    own) finds it."""
    declared = _declared_first_time(plan, scan)
    if declared is not None:
        return declared
    scan.check_all()
    lf = plan_filtered(dataclasses.replace(plan, mode=LoggingMode.PER_RANK_REDUCE), scan.frame)
    every_key = lf.group_by("key").agg(pl.col("timestamp").min()).collect(engine="streaming")
    per_key = every_key
    if plan.keys:
        match = key_matcher(plan.keys)
        per_key = per_key.filter(pl.col("key").map_elements(match, return_dtype=pl.Boolean))
    t0 = per_key["timestamp"].min()
    if t0 is None:  # named as the engine names them, with the keys of the records kept
        # what the keys matched (the ranks are not looked at in this query)
        seen = dataclasses.replace(filters.Seen.wanted_by(plan), ranks=None) if plan.keys else filters.Seen()
        seen.add(None, every_key["key"].to_list())
        raise _nothing_kept(plan, scan, filters.unmatched(plan, seen))
    return float(t0)  # type: ignore[arg-type]


def _declared_first_time(plan: ReducePlan, scan: RunScan) -> float | None:
    """The earliest timestamp of the records kept, from what the run's files declare
    without a read of their records: the writer's time range of each of its segments,
    another tool's Parquet footer where it shows that record is kept (``kept_first_time``).
    With ``--ranks``, of the files of the ranks kept, where every file holds one source.
    None when a key or step filter or a restart's rewind drops records, or a file declares
    nothing exact."""
    if plan.keys or plan.steps is not None:
        return None
    fids = list(scan.parts)
    if plan.ranks:
        sources = _single_sources(scan)
        if sources is None:
            return None
        kept = [ids for (_, rank), ids in sources.items() if any(lo <= rank <= hi for lo, hi in plan.ranks)]
        fids = [fid for ids in kept for fid in ids]
    lows = []
    for fid in fids:
        rep = scan.report.files[fid]
        if rep.replaced_from is not None:
            return None
        if fid not in scan.unchecked and rep.timestamps is not None:  # the writer's, trusted
            lows.append(rep.timestamps[0])
        elif rep.format == "parquet" and fid in scan.pending:  # another tool's, not checked yet
            low = kept_first_time(rep.path)
            if low is None:
                return None
            lows.append(low)
        else:
            return None
    return min(lows, default=None)


@dataclass
class KeyReductions:
    """Each key's reduction as far as a stream has read: ``decided`` for a key met under
    more than one (its first record's), and ``met`` (a frame of key, reduction) for the
    keys met under one in earlier frames: a run of millions of keys holds them as columns,
    not as a Python object each."""

    decided: dict[str, str] = field(default_factory=dict)
    met: pl.DataFrame = field(
        default_factory=lambda: pl.DataFrame(schema={"key": pl.String, "reduction": pl.String})
    )


def _kept_reductions(
    scan: RunScan | None,
    merged: pl.DataFrame,
    recorded: KeyReductions,
    counts: np.ndarray,
    mixed: dict[str, MixedKey],
    remember: bool = True,
) -> np.ndarray | None:
    """Which groups of ``merged`` to keep: a key recorded under more than one reduction
    (and no ``--reduce`` pattern for it) keeps the reduction of its first record, and its
    groups under another are dropped, their records (``counts``) counted in ``mixed``.
    ``recorded`` holds each key's reduction: decided before (``first_reductions``), or met
    in earlier frames; this frame's keys are added to it (``remember``: a frame follows).
    None: keep every group. A reduction that is not a statistic is an error."""
    reductions = merged["reduction"].unique()
    if len(reductions) == 1 and not recorded.decided and not recorded.met.height:  # no key's to group
        if not partials.is_statistic(reductions[0]):
            raise UnknownReductionError(dict.fromkeys(merged["key"].unique().sort().to_list(), reductions[0]))
        if remember:
            recorded.met = merged.select(pl.col("key").unique(), reduction=pl.lit(reductions[0], pl.String))
        return None
    per_key = (
        merged.group_by("key")
        .agg(reductions=pl.col("reduction").n_unique(), reduction=pl.col("reduction").cast(pl.String).min())
        .join(recorded.met.rename({"reduction": "prior"}), on="key", how="left")
    )
    # Met with two at once, and never before: the first record decides.
    fresh_mixed = (
        (pl.col("reductions") > 1) & pl.col("prior").is_null() & ~pl.col("key").is_in(list(recorded.decided))
    )
    for key in per_key.filter(fresh_mixed)["key"].sort().to_list():
        recorded.decided[key] = _first_reduction(scan, key, merged)
        mixed.setdefault(key, MixedKey(key, recorded.decided[key]))
    if len(recorded.decided):
        first = pl.DataFrame(
            {"key": list(recorded.decided), "first": list(recorded.decided.values())},
            schema={"key": pl.String, "first": pl.String},
        )
        per_key = per_key.join(first, on="key", how="left").with_columns(prior=pl.coalesce("first", "prior"))
    fresh = per_key.filter(pl.col("prior").is_null()).select("key", "reduction")
    if fresh.height and remember:
        recorded.met = pl.concat([recorded.met, fresh])
    per_key = per_key.with_columns(prior=pl.coalesce("prior", "reduction"))  # each key's reduction
    unknown = [r for r in per_key["prior"].unique().to_list() if not partials.is_statistic(r)]
    if unknown:
        bad = per_key.filter(pl.col("prior").is_in(unknown)).sort("key")
        raise UnknownReductionError(dict(zip(bad["key"].to_list(), bad["prior"].to_list(), strict=True)))
    other = per_key.filter((pl.col("reductions") > 1) | (pl.col("reduction") != pl.col("prior")))
    if not other.height:
        return None
    prior = merged.select("key").join(
        other.select("key", "prior"), on="key", how="left", maintain_order="left"
    )
    keep = (prior["prior"].is_null() | (prior["prior"] == merged["reduction"].cast(pl.String))).to_numpy()
    kept_of = dict(zip(other["key"].to_list(), other["prior"].to_list(), strict=True))
    dropped = merged.with_columns(count=pl.Series(counts)).filter(pl.Series(~keep))
    for key, reduction, n in dropped.group_by("key", "reduction").agg(pl.col("count").sum()).iter_rows():
        entry = mixed.setdefault(key, MixedKey(key, kept_of[key], first_record=False))
        entry.skipped[reduction] = entry.skipped.get(reduction, 0) + int(n)
    if "process" in dropped.columns:  # a per-rank mode: who recorded them
        who = dropped.select("key", "process", "rank").unique().drop_nulls()
        for key, process, rank in who.iter_rows():
            mixed[key].sources.add(f"{process} (rank {rank})")
    return keep


def _first_reduction(scan: RunScan | None, key: str, merged: pl.DataFrame) -> str:
    """The reduction of a key's first record over the whole run (``_first_records``: a
    query of its own, made only for a key met with two reductions that no file declared);
    without the run, of its first group in ``merged``."""
    if scan is not None:
        found = _first_records(scan, {key}, list(scan.parts))
        if key in found:
            return found[key]
    first = merged.filter(pl.col("key") == key).sort(merged.columns[0], "reduction").row(0, named=True)
    return str(first["reduction"])


def _firsts(records: pl.LazyFrame) -> pl.LazyFrame:
    return (
        records.sort("key", "timestamp", "step", "rank", "reduction", nulls_last=True)
        .group_by("key", maintain_order=True)
        .first()
    )


def first_reductions(plan: ReducePlan, scan: RunScan) -> dict[str, str]:
    """Each key that the files declare under more than one reduction, and that no
    ``--reduce`` pattern reduces, with the reduction of its first record
    (``_first_records``): decided before any result is handed over, so every mode and
    filter keeps the same one. Read from the files that declare the key."""
    declared: dict[str, set[str]] = {}
    holders: dict[str, list[int]] = {}
    for fid in scan.parts:
        for key, reduction in scan.report.files[fid].keys or ():
            declared.setdefault(key, set()).add(reduction.lower())
            holders.setdefault(key, []).append(fid)
    overrides = [key_matcher([pattern]) for pattern, _ in plan.overrides]
    mixed = {k for k, found in declared.items() if len(found) > 1 and not any(m(k) for m in overrides)}
    if not mixed:
        return {}
    return _first_records(scan, mixed, sorted({fid for k in mixed for fid in holders[k]}))


def _first_records(scan: RunScan, keys: set[str], fids: list[int]) -> dict[str, str]:
    """The reduction of the first record of each of ``keys`` in ``fids``: by time, then
    step, then rank (records of one time: the lowest rank's), then reduction name. (A file
    that cannot be read is left out here; its reading says so.)"""
    scan.verify(fids)
    parts = [
        scan.parts[fid]
        .filter(pl.col("key").is_in(list(keys)))
        .select("key", "reduction", "timestamp", "step", "rank")
        for fid in fids
    ]
    if not parts:
        return {}
    readable = []
    for part in parts:  # each file's first records, on its own
        try:
            readable.append(_firsts(part).collect())
        except (pl.exceptions.PolarsError, PanicException):
            continue
    if not readable:
        return {}
    firsts = _firsts(pl.concat(readable).lazy()).collect()
    return dict(zip(firsts["key"].to_list(), firsts["reduction"].to_list(), strict=True))


def _values(merged: pl.DataFrame, stats: dict[str, np.ndarray], values: list[pl.LazyFrame]) -> np.ndarray:
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


def _raw(plan: ReducePlan, scan: RunScan, on_progress: OnProgress | None) -> ReduceResult:
    """per_rank_no_reduce: every record kept, one source at a time, in time order.

    A file of one source (the writer's) is read when its source's turn comes; files that
    hold several sources (or do not say) are read first and held, to be split by source."""
    t0 = _first_time(plan, scan) if plan.by == "time" else None
    match = key_matcher(plan.keys) if plan.keys else None
    dictionaries = _dictionary_read(scan)
    kept = _columns_read(plan, scan)
    seen, unmatched = filters.Seen.wanted_by(plan), list[PlanError]()
    by_source: dict[tuple[str, int], list[int]] = {}
    mixed: list[int] = []
    for fid in scan.parts:
        rep = scan.report.files[fid]
        source = rep.source or rep.single_source
        (by_source.setdefault(source, []) if source is not None else mixed).append(fid)
    sizes = {fid: scan.report.files[fid].size for fid in scan.parts}
    total = sum(sizes.values())

    def read(fid: int, groups: list[int] | None = None) -> pl.DataFrame:
        return key_matching(_read_part(plan, scan, fid, dictionaries, kept, seen, groups), match)

    @changed_files_said
    def stream() -> Iterator[pl.DataFrame]:
        done = 0
        held = pl.concat([read(fid) for fid in mixed], how="vertical_relaxed") if mixed else None
        if held is not None:
            done += sum(sizes[fid] for fid in mixed)
        sources = set(by_source)
        if held is not None:
            sources |= set(held.select("process", "rank").unique().iter_rows())
        produced = False
        for i, (process, rank) in enumerate(sorted(sources)):
            fids = by_source.get((process, rank), [])
            if held is None:
                batches = in_time_order(_parts(scan, fids, dictionaries), read, RAW_BATCH_ROWS)
            else:  # its held rows may fall anywhere in its time: all of it at once
                mine = held.filter((pl.col("process") == process) & (pl.col("rank") == rank))
                whole = pl.concat([*(read(fid) for fid in fids), mine], how="vertical_relaxed")
                batches = iter([whole.sort("timestamp", maintain_order=True)])  # ties: file order
            for batch in batches:
                if batch.height == 0:  # a filter left none of the source's records
                    continue
                if t0 is not None:
                    window = np.floor((batch["timestamp"].to_numpy() - t0) / float(plan.every or 0))
                    batch = batch.with_columns(window_start=pl.Series(t0 + window * float(plan.every or 0)))
                produced = True
                out = _lower_reductions(batch.select(plan.output_columns))
                for start in range(0, out.height, RAW_BATCH_ROWS):  # a part read whole may be large
                    piece = out.slice(start, RAW_BATCH_ROWS)
                    yield piece.with_columns(pl.col(pl.Categorical).cast(pl.String))
            done += sum(sizes[fid] for fid in fids)
            if on_progress is not None:
                on_progress(i + 1, len(sources), done, total)
        unmatched[:] = filters.unmatched(plan, seen)
        if not produced:
            raise _nothing_kept(plan, scan, unmatched)

    return ReduceResult(plan, scan, stream=stream, unmatched=unmatched)


def _lower_reductions(df: pl.DataFrame) -> pl.DataFrame:
    """Reductions in lower case, as every mode reads them (another tool may write ``MEAN``),
    looking at each distinct one once."""
    if "reduction" not in df.columns:
        return df
    distinct = [r for r in df["reduction"].unique().cast(pl.String).to_list() if r is not None]
    changed = {r: r.lower() for r in distinct if r != r.lower()}
    if not changed:
        return df
    return df.with_columns(pl.col("reduction").cast(pl.String).replace(changed).cast(df["reduction"].dtype))


# per_rank_no_reduce hands over a source's records in frames of at most this many: the
# peak memory of the raw output's writer grows with it (benchmarks/bench_memory.py).
RAW_BATCH_ROWS = 100_000


def _parts(scan: RunScan, fids: Sequence[int], row_groups: bool, column: str = "timestamp") -> list[Part]:
    """Files as parts with the lowest value of ``column`` (timestamp or step) they may hold
    (``timeorder``): Parquet row groups by their footer's statistics when read through the
    dictionaries (``row_groups``; a checksummed segment's from its checked metadata, since
    no checksum covers the footer), else whole files by their writer's declared range; a
    file that declares none may hold any value (-inf)."""
    out: list[Part] = []
    for fid in fids:
        rep = scan.report.files[fid]
        groups = None
        if row_groups and rep.row_groups is not None:
            groups = [(float(t) if column == "timestamp" else s, n) for n, s, t in rep.row_groups]
        elif row_groups and rep.format == "parquet":
            groups = row_group_lows(rep.path, column)
        declared = rep.timestamps if column == "timestamp" else rep.steps
        if groups is not None:
            out += [Part(fid, (g,), lo, rows) for g, (lo, rows) in enumerate(groups)]
        elif declared is not None:
            out.append(Part(fid, None, declared[0], rep.records))
        else:
            out.append(Part(fid, None, -math.inf, rep.records))
    return out


def key_matching(df: pl.DataFrame, match: Callable[[str], bool] | None) -> pl.DataFrame:
    """The records whose key a ``--key`` pattern matches (each distinct key tested once)."""
    if match is None or df.height == 0:
        return df
    keys = [k for k in df["key"].unique().cast(pl.String) if match(k)]
    return df.filter(pl.col("key").cast(pl.String).is_in(keys))


def reduce_run(
    run_dir: str | os.PathLike[str], *, engine: str = "local", ray_address: str | None = None, **options: Any
) -> pl.DataFrame:
    """Reduce a run directory in one of the three logging modes; a polars DataFrame.

    ``options`` are those of ``make_plan``: mode, by, every, reduce, keys, ranks, steps;
    ``engine`` is ``"local"`` or ``"ray"`` (the same bits, see ``execute``).

    >>> df = reduce_run("sample_logs/rl_run", keys=["trainer/loss"], steps="0:2")
    >>> df.columns
    ['step', 'key', 'value', 'reduction', 'count']
    >>> df["count"].to_list()
    [8, 8]
    """
    known = list(inspect.signature(make_plan).parameters)
    for name in options:
        if name not in known:
            near = difflib.get_close_matches(name, known, 1)
            hint = f"did you mean '{near[0]}'? " if near else ""
            raise PlanError(f"reduce_run() takes no option '{name}': {hint}it takes {', '.join(known)}")
    return run_plan(run_dir, make_plan(**options), engine=engine, ray_address=ray_address).frame


def run_plan(
    run_dir: str | os.PathLike[str],
    plan: ReducePlan,
    *,
    strict: bool = False,
    follow_symlinks: bool = False,
    on_read: OnRead | None = None,
    on_progress: OnProgress | None = None,
    engine: str = "local",
    ray_address: str | None = None,
) -> ReduceResult:
    """Read ``run_dir`` and execute ``plan`` over it; the result keeps the read's health report.

    The result is a stream, read when iterated (``frame`` reads it whole). ``on_read`` gets
    the health report once the run is read (when the stream ends, or the plan fails),
    ``on_progress`` the progress of the read. Raises ``StrictModeError`` when ``strict``
    and the reader skipped anything, before reading the records; with ``strict``, a filter
    or ``reduce`` pattern that matched no record (``result.unmatched``, a warning
    otherwise) raises ``UnmatchedError`` as the stream ends.

    >>> result = run_plan("sample_logs/rl_run", make_plan(mode="per_rank_reduce", keys=["policy/reward"]))
    >>> result.frame.select("process", "step", "count").head(2).rows()
    [('GeneratorActor_r0', 0, 8), ('GeneratorActor_r0', 1, 8)]
    >>> result.scan.report.skipped_records  # the killed generator's last, half-written frame
    21
    """
    # Another tool's files are checked as the engine reads them (one pass), so the report
    # is whole once the plan ran; it is handed over even when the plan fails.
    scan = scan_run(run_dir, follow_symlinks=follow_symlinks, attempts=plan.attempts, defer_checks=True)
    if strict:  # fail before anything is written
        scan.check_all()
        if scan.report.has_skips:  # notices (a restart rewound, a copy read once) are not skips
            if on_read is not None:
                on_read(scan.report)
            raise StrictModeError(scan.report.summary())
    try:
        result = execute(plan, scan, on_progress=on_progress, engine=engine, ray_address=ray_address)
    except BaseException:
        if on_read is not None:
            on_read(scan.report)
        raise
    stream = result.stream

    def reported() -> Iterator[pl.DataFrame]:
        try:
            yield from stream()
            if strict and result.unmatched:  # before the last frame is taken as the end
                raise UnmatchedError(result.unmatched)
            if strict and any(m.skipped for m in scan.report.mixed.values()):  # under a second reduction
                raise StrictModeError(scan.report.summary())
        finally:
            if on_read is not None:
                on_read(scan.report)

    return dataclasses.replace(result, stream=reported)


# The keys --wide makes columns of, at most: a row of more is no table anyone reads, and
# each pivoted frame holds a column per key.
MAX_WIDE_KEYS = 10_000


def pivot_wide(frames: Iterable[pl.DataFrame], plan: ReducePlan) -> Iterator[pl.DataFrame]:
    """One row per step (per source), one column per key, keys in sorted order, as frames.

    Each frame of a result holds whole steps (of one source), so each is pivoted on its
    own. A key absent from some frames is a null column there, and which keys there are
    is known only at the end: the pivoted frames wait in a temporary directory ($TMPDIR,
    removed when done) until then, so memory holds a frame, not the result."""
    index = plan.group_columns
    with tempfile.TemporaryDirectory(prefix="metriclog-wide-") as tmp:
        keys: set[str] = set()
        files = []
        for i, frame in enumerate(frames):
            keys.update(frame["key"].unique().to_list())
            if len(keys) > MAX_WIDE_KEYS:  # before a pivot would make its columns
                raise RequestError(
                    f"{opt('wide', flag=True)} makes a column of each key, and the result has more "
                    f"than {MAX_WIDE_KEYS:,} keys: choose some with {opt('keys')}PATTERN, or leave it "
                    "out (a row a key)"
                )
            wide = frame.pivot(on="key", index=index, values="value")
            files.append(Path(tmp) / f"{i:06d}.parquet")
            wide.write_parquet(files[-1])
        for path in files:
            part = pl.read_parquet(path)
            missing = [pl.lit(None, pl.Float64).alias(k) for k in sorted(keys) if k not in part.columns]
            yield part.with_columns(missing).select(*index, *sorted(keys)).sort(index)
            path.unlink()
