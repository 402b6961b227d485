"""Attempts: a source restarted from a checkpoint into the same run directory.

Every ``init()`` of a source is an attempt (a random id, a start time, and the step of
its first ``flush(step)``, in the journal header and the sealed segments' metadata). A
job that dies and is restarted from its checkpoint at step ``j`` writes the steps from
``j`` on again. The default reading is W&B's "rewind": for each source, an attempt
replaces the records of its earlier attempts from its own first step on; an attempt
that never flushed a step replaces nothing. What was replaced is said. ``"all"`` keeps
every attempt's records; an attempt id keeps only that attempt of its source.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import polars as pl
from polars.exceptions import PanicException

from metric_core.errors import PlanError, opt
from metric_core.format.life import Life
from metric_core.offline.read.report import ReadReport

REWIND, ALL = "rewind", "all"
LEGACY = "legacy"  # the attempt of files written before attempts were recorded


FAILED_ENDS = ("exception", "signal", "exit", "died")


@dataclass
class Attempt:
    """One attempt of one source, as read."""

    process: str
    rank: int
    attempt: str
    started: float | None
    first_step: int | None  # of its first flush; None if it never flushed
    records: int = 0  # records read and kept
    replaced: int = 0  # its records a later attempt replaced (or another --attempts chose)
    replaced_steps: tuple[int, int] | None = None
    replaced_by: str | None = None  # the attempt that replaced them
    restarted_at: int | None = None  # that attempt's first step
    # How it ended (``offline.inspect.story`` tells it; docs/commands.md): "shutdown", "exception",
    # "signal", "exit", "died" or "running", and the details of that end.
    number: int | None = None  # 1, 2, ...: from the launcher's restart count where it set one
    end: str | None = None
    exception: dict[str, Any] | None = None  # {"type", "message", "where"}
    signal: str | None = None
    ended_at: float | None = None  # the end's time, or its last sign of life
    last_step: int | None = None  # the last step it flushed
    where: str | None = None  # where its main thread was when it ended (an exception's, a signal's stacks)
    stacks: list[str] = field(default_factory=list)  # its stack dumps, relative to the run directory
    thread_exceptions: list[dict[str, Any]] = field(default_factory=list)
    host: str | None = None
    pid: int | None = None
    # It started recording by itself (metric_core.torchforge with METRICLOG_DIR) and has no
    # shutdown() to call: its exit at the interpreter's end is how it was meant to end.
    adopted: bool = False
    # Running (its process is still there) but its heartbeat stopped: stuck in native code
    # that holds the GIL, or stopped (SIGSTOP, a debugger).
    no_heartbeat: bool = False

    @property
    def failed(self) -> bool:
        """It ended in a failure: an exception, a signal, a death, or an exit without
        ``shutdown()`` (but not the exit of an attempt that started by itself)."""
        return self.end in FAILED_ENDS and not (self.end == "exit" and self.adopted)

    @property
    def ended_well(self) -> bool:
        """It shut down cleanly, or started by itself and exited."""
        return self.end == "shutdown" or (self.end == "exit" and self.adopted)


def resolve(
    report: ReadReport, frames: dict[int, pl.LazyFrame], how: str = REWIND
) -> dict[int, pl.LazyFrame]:
    """Apply ``how`` to the frames of the files (file id -> frame); record it in ``report``."""
    by_source: dict[tuple[str, int], dict[str, Attempt]] = {}
    files: dict[tuple[tuple[str, int], str], list[int]] = {}
    lives: dict[tuple[str, int, str], list[Life]] = {}
    for fid, rep in enumerate(report.files):
        if rep.source is None or (fid not in frames and rep.life is None):
            continue  # another tool's file of several sources: no attempts
        # Files of metriclog before attempts existed: one attempt, older than every other.
        attempt = rep.attempt or LEGACY
        attempts = by_source.setdefault(rep.source, {})
        a = attempts.get(attempt)
        if a is None:
            started = rep.attempt_started if rep.attempt else -math.inf
            a = attempts[attempt] = Attempt(*rep.source, attempt, started, None)
        if rep.attempt_first_step is not None:
            a.first_step = (
                rep.attempt_first_step if a.first_step is None else min(a.first_step, rep.attempt_first_step)
            )
        if rep.life is not None:
            lives.setdefault((*rep.source, attempt), []).append(rep.life)
        if fid in frames:
            files.setdefault((rep.source, attempt), []).append(fid)
    report.lives = {key: Life.merged(found) for key, found in lives.items()}
    chosen = None if how in (REWIND, ALL) else _chosen(by_source, how)
    out = dict(frames)
    for source, attempts in sorted(by_source.items()):
        if set(attempts) == {LEGACY}:
            continue  # a source written before attempts existed, once: nothing to resolve
        ordered = sorted(attempts.values(), key=lambda a: (a.started is None, a.started or 0.0, a.attempt))
        for i, a in enumerate(ordered):
            cutoff: int | None = None
            if chosen is not None and source == (chosen.process, chosen.rank):
                if a is not chosen:
                    cutoff = -(2**63)  # not the chosen attempt of its source: every record goes
            elif how != ALL:  # rewind (also every other source when one attempt is chosen)
                later = [(b.first_step, b.attempt) for b in ordered[i + 1 :] if b.first_step is not None]
                if later:
                    cutoff, a.replaced_by = min(later)
                    a.restarted_at = cutoff
            for fid in files.get((source, a.attempt), []):
                if cutoff is not None:
                    out[fid] = _replace(report, fid, out[fid], cutoff, a)
                a.records += report.files[fid].records
            report.attempts.append(a)
            if a.replaced and a.replaced_steps is not None:
                report.notices.append(_described(a))
    return out


def _described(a: Attempt) -> str:
    lo, hi = a.replaced_steps or (None, None)
    why = (
        f"replaced by attempt {a.replaced_by}, which restarted at step {a.restarted_at}"
        if a.replaced_by is not None
        else "not of the attempt " + opt("attempts") + "chose"
    )
    return (
        f"{a.process} (rank {a.rank}): {a.replaced} record(s) of steps {lo}-{hi} of attempt {a.attempt} "
        f"(started {_when(a.started)}) " + why + "; " + opt("attempts") + "'all' keeps them"
    )


def _replace(report: ReadReport, fid: int, frame: pl.LazyFrame, cutoff: int, a: Attempt) -> pl.LazyFrame:
    gone = pl.col("step") >= cutoff
    try:
        n, lo, hi = (
            frame.filter(gone)
            .select(pl.len(), pl.col("step").min().alias("lo"), pl.col("step").max().alias("hi"))
            .collect()
            .row(0)
        )
    except (pl.exceptions.PolarsError, PanicException):  # a file that cannot be read: said when it is
        n, lo, hi = 0, None, None
    report.files[fid].replaced_from = cutoff
    if n:
        report.files[fid].records -= n
        a.replaced += n
        old = a.replaced_steps
        a.replaced_steps = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))
    return frame.filter(~gone)


def _chosen(by_source: dict[tuple[str, int], dict[str, Attempt]], wanted: str) -> Attempt:
    """The one attempt whose id starts with ``wanted``."""
    known = [a for attempts in by_source.values() for a in attempts.values()]
    matches = [a for a in known if a.attempt.startswith(wanted)]
    if len(matches) == 1:
        return matches[0]
    listed = ", ".join(sorted(f"{a.attempt} ({a.process}, rank {a.rank})" for a in known)) or "none recorded"
    why = "names no attempt of this run" if not matches else "is the start of more than one attempt"
    raise PlanError(f"{why}; its attempts: {listed}", option="attempts", value=wanted)


def _when(ts: float | None) -> str:
    return (
        "at an unknown time"
        if ts is None or not math.isfinite(ts)
        else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
    )
