"""A plan run over a run's files: ``run_plan`` (scan, then ``execute``), ``execute`` (the
tasks computed and folded, or raw mode), ``reduce_run`` (both, from a directory), and the
``ReduceResult`` they give: a stream of frames."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from metric_core.errors import PlanError, StrictModeError, UnmatchedError
from metric_core.metric import LoggingMode
from metric_core.offline import filters
from metric_core.offline.engine import finish, grouptable, tasks
from metric_core.offline.engine.accumulator import Accumulator
from metric_core.offline.engine.filtering import nothing_kept, plan_filtered
from metric_core.offline.engine.finish import finished_frames
from metric_core.offline.engine.pool import on_threads
from metric_core.offline.engine.raw import raw_mode
from metric_core.offline.engine.reductions import KeyReductions, first_reductions
from metric_core.offline.engine.shape import source_by_source
from metric_core.offline.engine.tasks import (
    TaskWork,
    columns_read,
    cut,
    first_time,
    reads_dictionaries,
    single_sources,
)
from metric_core.offline.plan import By, Engine, ReducePlan, counts_back, last_steps, make_plan
from metric_core.offline.read import OnProgress, OnRead, RunScan, explain_read_errors, scan_run
from metric_core.offline.read.report import MixedKey


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


def reduce_run(
    run_dir: str | os.PathLike[str],
    *,
    engine: Engine | str = Engine.LOCAL,
    ray_address: str | None = None,
    **options: Any,
) -> pl.DataFrame:
    """Reduce a run directory in one of the three logging modes; a polars DataFrame.

    ``options`` are those of ``make_plan``: mode, by, every, reduce, keys, ranks, steps;
    ``engine`` is ``"local"`` or ``"ray"`` (the same bits, see ``execute``). Returns the
    whole result (``run_plan`` streams it). Raises ``PlanError`` for an option it does not
    take or cannot parse, ``NoDataError`` when no record is left, and what ``run_plan``
    raises.

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
    engine: Engine | str = Engine.LOCAL,
    ray_address: str | None = None,
) -> ReduceResult:
    """Read ``run_dir`` and execute ``plan`` over it; the result keeps the read's health report.

    The result is a stream, read when iterated (``frame`` reads it whole). ``on_read`` gets
    the health report once the run is read (when the stream ends, or the plan fails),
    ``on_progress`` the progress of the read. Raises ``StrictModeError`` when ``strict``
    and the reader skipped anything, before reading the records; with ``strict``, a filter
    or ``reduce`` pattern that matched no record (``result.unmatched``, a warning
    otherwise) raises ``UnmatchedError`` as the stream ends. Raises ``NoDataError`` for a
    run without a readable record (or none the filters keep), and, as the stream is read,
    ``RunChangedError`` when a file changes under it or ``StorageError`` when the store
    fails.

    >>> result = run_plan("sample_logs/rl_run", make_plan(mode="per_rank_reduce", keys=["policy/reward"]))
    >>> result.frame.select("process", "step", "count").head(2).rows()
    [('GeneratorActor_r0', 0, 8), ('GeneratorActor_r0', 1, 8)]
    >>> result.scan.report.skipped_records  # the killed generator's last, half-written frame
    25
    """
    # Another tool's files are checked as the engine reads them (one pass), so the report
    # is whole once the plan ran; it is handed over even when the plan fails.
    scan = scan_run(run_dir, follow_symlinks=follow_symlinks, attempts=plan.attempts, defer_checks=True)
    # fail before anything is written; notices (a restart rewound, a copy read once) are not skips
    if strict and scan.full_report.has_skips:
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


@explain_read_errors
def execute(
    plan: ReducePlan,
    scan: RunScan,
    *,
    on_progress: OnProgress | None = None,
    engine: Engine | str = Engine.LOCAL,
    ray_address: str | None = None,
) -> ReduceResult:
    """Run ``plan`` over a scanned run; raise MetricLogError when it cannot be served.

    A reducing mode runs as partial states (``metric_core.offline.engine.partials``): the run's
    files (or their Parquet row groups) are cut into tasks in the order of their first
    step (``tasks.tasks``), each task's states are computed on a pool of threads and folded,
    and the groups no task still to come can touch are handed over as a frame and dropped.
    The states fold in any order to the same bits (``partials``), so the output is the same
    whatever the thread count, the files' names or how the records are split among them,
    and memory holds the groups of the steps in flight.
    The result is a stream, read when it is iterated.

    ``engine="ray"`` computes the tasks' states as Ray tasks (``engine.ray_pool``, on
    the cluster at ``ray_address``, ``RAY_ADDRESS``, or a local one) and folds them here:
    the same bits. Raw mode has nothing to reduce and is read here.
    """
    engine = Engine.of(engine)
    if counts_back(plan.steps):  # --steps -5: the last 5 steps of the sources kept
        plan = dataclasses.replace(plan, steps=last_steps(plan.steps, _last_step(plan, scan)))  # type: ignore[arg-type]
    if plan.mode is LoggingMode.PER_RANK_NO_REDUCE:
        raw, unmatched_raw = raw_mode(plan, scan, on_progress)
        return ReduceResult(plan, scan, stream=raw, unmatched=unmatched_raw)
    sources = single_sources(scan) if plan.mode is not LoggingMode.GLOBAL_REDUCE else None
    t0 = first_time(plan, scan) if plan.by is By.TIME else None
    dictionaries = reads_dictionaries(scan)
    kept = columns_read(plan, scan)
    seen, unmatched = filters.Seen.wanted_by(plan), list[PlanError]()
    # What is reduced together: the whole run, or (per_rank_reduce, every file of one
    # source) each source on its own, emitted in order.
    units = [scan.file_ids] if sources is None else [fids for _, fids in sorted(sources.items())]
    work = [(u, task) for u, fids in enumerate(units) for task in cut(plan, scan, fids, t0, dictionaries)]

    # global_reduce's groups take records of every source, each file's in partitions of their
    # own: those records go straight into the accumulator's table of groups (``grouptable``).
    # One file (its sources' records side by side) is reduced as well by its partitions' states.
    direct = plan.mode is LoggingMode.GLOBAL_REDUCE and len(scan.file_ids) > 1 and grouptable.available()
    reduce_task = TaskWork(plan, scan, dictionaries, kept, t0, tasks.PARTITION_ROWS, direct)
    if engine is Engine.RAY:
        from metric_core.offline.engine.ray_pool import on_ray

        # a task's counts of bad rows could not reach this process's report: counted first
        reduce_task.scan = scan.for_other_processes()
        states_of = functools.partial(on_ray, reduce_task, seen=seen, address=ray_address)
    else:
        states_of = functools.partial(on_threads, functools.partial(reduce_task, seen=seen))

    @explain_read_errors
    def stream() -> Iterator[pl.DataFrame]:
        # each key's: decided, or in the frames so far
        recorded = KeyReductions(first_reductions(plan, scan), spills=True)
        for key, reduction in recorded.decided.items():
            scan.report.mixed.setdefault(key, MixedKey(key, reduction))
        produced = False
        acc = Accumulator()
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
                if upto == math.inf or acc.cells_below(upto) >= finish.TAKEN_GROUPS // 2:  # a frame's worth
                    last = i + 1 == len(work)
                    for frame in finished_frames(
                        plan, scan, acc, t0, recorded, upto, scan.report.mixed, last
                    ):
                        produced = produced or frame.height > 0
                        yield frame
                if upto == math.inf:
                    acc.close()
                    acc = Accumulator()
        finally:
            states.close()  # stops the pool's threads, whatever ended the stream
            acc.close()
            recorded.close()
        unmatched[:] = filters.unmatched(plan, seen)
        if not produced:
            raise nothing_kept(plan, scan, unmatched)

    if plan.mode is LoggingMode.PER_RANK_REDUCE and sources is None:  # several sources a file
        return ReduceResult(plan, scan, stream=lambda: source_by_source(stream()), unmatched=unmatched)
    return ReduceResult(plan, scan, stream=stream, unmatched=unmatched)


def _last_step(plan: ReducePlan, scan: RunScan) -> int:
    """The highest step of the sources ``plan`` keeps (its ranks), -1 for none: declared by
    the writer's files, found by one query over the others (no file is read for it twice)."""
    last, rest = -1, []
    for fid in scan.file_ids:
        rep = scan.report.files[fid]
        if (
            scan.trusted(fid)
            and rep.source is not None
            and rep.steps is not None
            and rep.replaced_from is None
        ):
            if not plan.ranks or any(lo <= rep.source[1] <= hi for lo, hi in plan.ranks):
                last = max(last, rep.steps[1])
        else:
            rest.append(scan.file_frame(fid))
    if rest:
        ranks_only = dataclasses.replace(plan, steps=None)
        lf = plan_filtered(ranks_only, pl.concat(rest, how="vertical"), ["rank", "step"])
        found = lf.select(pl.col("step").max()).collect().item()
        last = last if found is None else max(last, int(found))
    return last
