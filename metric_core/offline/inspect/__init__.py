"""What happened in a crashed or hung run: per-source health and a verdict (docs/commands.md).

Status of a source:

* ``finished``: its writer recorded a clean ``shutdown()``.
* ``stopped_early``: no clean shutdown, and it went quiet long before the others. "Long"
  is measured against the source's own cadence: its lag (the newest record of any source
  minus its own newest) must exceed both 10 times its typical gap between steps (the
  median time from one step's last record to the next one's) and twice the longest gap
  it ever took on its own (an evaluation pause, a checkpoint). A source that steps every
  2 s is late after 20 s of silence; one that steps every 10 min is not late after 30 min.
* ``unfinished``: no clean shutdown, but among the last to write: the whole job died
  together, or is still running.

The run is **still running** when a source that has not finished is still within its
quiet threshold of the wall clock (the stop rule above, with "now" for the newest record).

Stragglers are sources slower than the rest of their role (the process name without
its ``_rN`` suffix) by a sustained margin: their median step time (over at least
MIN_STEP_TIMES steps) is at least STRAGGLER_RATIO times the median of the other sources'
median step times. One late step, jitter, or a source that started late but keeps pace
is not a straggler.

Modules: ``aggregates`` (each source's steps and keys, a file at a time), ``health``
(statuses, stalls, who stopped first, stragglers), ``report`` (``InspectReport`` and
its JSON) and ``verdict`` (its plain words).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import polars as pl

from metric_core.offline.inspect import story
from metric_core.offline.inspect.aggregates import EARLIER, aggregate
from metric_core.offline.inspect.health import (
    MIN_STEP_TIMES,
    OWN_GAP_FACTOR,
    QUIET_FACTOR,
    STALL_MIN_S,
    STRAGGLER_RATIO,
    cadence_of,
    file_health,
    find_stopped_early,
    find_stragglers,
    live_where,
    source_status,
    stall_threshold,
    state_of,
)
from metric_core.offline.inspect.report import FirstToStop, InspectReport, NonFinite, SourceHealth, Straggler
from metric_core.offline.inspect.verdict import never_wrote
from metric_core.offline.read import OnProgress, OnRead, RunScan, explain_read_errors, scan_run
from metric_core.offline.samples import read_samples
from metric_core.offline.storage import newest_listed

__all__ = [
    "MIN_STEP_TIMES",
    "OWN_GAP_FACTOR",
    "QUIET_FACTOR",
    "STALL_MIN_S",
    "STRAGGLER_RATIO",
    "FirstToStop",
    "InspectReport",
    "NonFinite",
    "SourceHealth",
    "Straggler",
    "inspect_run",
    "never_wrote",
    "stall_threshold",
]


@explain_read_errors
def inspect_run(
    run: RunScan | str | os.PathLike[str],
    *,
    follow_symlinks: bool = False,
    attempts: str = "rewind",
    on_read: OnRead | None = None,
    on_progress: OnProgress | None = None,
    now: float | None = None,
    cache: dict[Any, Any] | None = None,
    pause_after: float | None = None,
    stall_after: float | None = None,
) -> InspectReport:
    """Per-source health and what stopped first, for a run directory (or a scan of one);
    ``on_progress`` is called after each file is read; ``now`` (by default the wall clock,
    or for a run in object storage its newest object's time) is what "still running" and a
    stall are judged against; ``pause_after`` is the silence that makes a pause (default:
    max(10 s, 10 step times) per source), ``stall_after`` the silence that makes a live
    source stalled (default: max(10 s, 10 step times, twice its longest pause)). ``cache``
    (a dict kept between calls, as ``watch_run`` does) keeps each file's aggregates while
    the file is unchanged, so a call reads only the files written since the last.

    Returns an ``InspectReport`` (``to_json()`` gives docs/commands.md's object). Raises
    ``NoDataError`` for a run without a readable record, ``RunChangedError`` when a file
    changes while it is read.

    >>> report = inspect_run("sample_logs/rl_run")
    >>> report.first_to_stop.process, report.first_to_stop.last_step
    ('GeneratorActor_r1', 179)
    >>> [s.status for s in report.sources]
    ['finished', 'stopped_early', 'finished', 'finished']
    """
    if isinstance(run, RunScan):
        scan = run
    else:
        earlier = cache.get(EARLIER) if cache is not None else None
        scan = scan_run(
            run, follow_symlinks=follow_symlinks, attempts=attempts, defer_checks=True, earlier=earlier
        )
    try:  # another tool's files are checked as they are aggregated: the report is whole after
        steps, per_key, keys = aggregate(scan, on_progress, cache)
    finally:
        if on_read is not None:
            on_read(scan.report)
    nonfinite = per_key.filter(pl.col("nonfinite") > 0).select(
        "process",
        "rank",
        "key",
        first_step=pl.col("first_bad_step"),
        first_timestamp=pl.col("first_bad_timestamp"),
        count=pl.col("nonfinite"),
    )
    newest = max(s.last_timestamp for s in steps.values())
    clean = scan.report.clean_shutdowns()
    cadence = cadence_of(steps)
    sources = []
    if now is None:  # a copy in a bucket trails its job: judged at the time of its newest object
        now = time.time() if isinstance(scan.run_dir, Path) else newest_listed(scan.run_dir)
    failure, together, stacks = story.tell(scan.report, scan.run_dir, now)
    live = False
    # A source whose attempt put its journal on disk (``init()`` writes the header) and
    # recorded nothing (it died first, or has not stepped yet): a source all the same.
    unrecorded = {(a.process, a.rank) for a in scan.report.attempts} - set(steps)
    for source in sorted([*steps, *unrecorded]):
        its = steps.get(source)
        typical, longest, _ = cadence.get(source, (None, None, 0))
        tried = [a for a in scan.report.attempts if (a.process, a.rank) == source]
        ended_well = source in clean or (bool(tried) and tried[-1].ended_well)
        first_step: int | None
        last_step: int | None
        if its is not None:
            first_step, last_step, first_at, last_at = (
                its.first_step,
                its.last_step,
                its.first_timestamp,
                its.last_timestamp,
            )
            files, status = its.files, source_status(ended_well, newest - last_at, typical, longest)
        else:  # its silence counts from its start
            started = [a.started for a in tried if a.started is not None and math.isfinite(a.started)]
            first_step = last_step = None
            first_at = last_at = max(started, default=newest)
            files = [i for i, f in enumerate(scan.report.files) if f.source == source]
            status = "finished" if ended_well else "unfinished"
        sources.append(
            SourceHealth(
                process=source[0],
                rank=source[1],
                **file_health(scan, files),
                records=its.records if its is not None else 0,
                keys=keys.get(source, 0),
                first_step=first_step,
                last_step=last_step,
                first_timestamp=first_at,
                last_timestamp=last_at,
                lag_s=newest - last_at,
                cadence_s=typical,
                clean_shutdown=ended_well,
                status=status,
                attempts=tried,
            )
        )
        health = sources[-1]
        health.silent_s = silent = now - last_at
        health.end = health.attempts[-1].end if health.attempts else None
        if health.end == "running":
            health.no_heartbeat = tried[-1].no_heartbeat
            life = scan.report.lives.get((source[0], source[1], tried[-1].attempt))
            health.where = live_where(life, health.no_heartbeat)
        quiet = source_status(False, silent, typical, longest) == "stopped_early"
        over = bool(tried) and tried[-1].failed
        health.stall_after_s = stall_after or stall_threshold(typical, longest)
        health.stalled = (  # alive: its heartbeat goes on (files that record none are judged by lag)
            health.end == "running" and typical is not None and not over and silent > health.stall_after_s
        )
        health.state = state_of(health, quiet)
        # Still running: its heartbeat goes on (a hang is running too), or, for a writer that
        # records none, it wrote within its quiet threshold of the wall clock.
        if health.end == "running" or (health.end is None and health.state == "running"):
            live = True
    # Only sources that stopped early are named as stopping first: sources that stopped
    # together, or are still writing, differ by noise.
    stopped = find_stopped_early(per_key, sources)
    paused = story.pauses(scan.report, stacks, {s: c[0] for s, c in cadence.items()}, now, pause_after)
    world_size = scan.meta.get("world_size")
    present = {rank for _, rank in [*steps, *unrecorded]}  # a rank that recorded nothing wrote its journal
    missing = sorted(set(range(int(world_size))) - present) if isinstance(world_size, int) else []
    return InspectReport(
        run_dir=str(scan.run_dir),
        name=scan.name,
        world_size=world_size if isinstance(world_size, int) else None,
        missing_ranks=missing,
        sources=sources,
        first_to_stop=stopped[0] if stopped else None,
        nonfinite=[
            NonFinite(**row)
            for row in nonfinite.sort("first_timestamp", "process", "rank", "key").iter_rows(named=True)
        ],
        stragglers=find_stragglers(steps, cadence),
        skipped_records=scan.report.skipped_records,
        unreadable_files=[str(f.path) for f in scan.report.unreadable_files],
        still_running=live,
        checked_at=now,
        stopped_early=stopped,
        first_failure=failure,
        together=together,
        pauses=paused,
        samples=read_samples(scan.run_dir, known=scan.report.attempts).keys(),
    )
