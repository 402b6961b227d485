"""The plain-words verdict of an ``InspectReport``: every source that is not healthy, then
what the run as a whole looks like."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from metric_core.clock import duration, local_time
from metric_core.errors import opt
from metric_core.offline.inspect import story

if TYPE_CHECKING:
    from metric_core.offline.inspect.report import InspectReport


def verdict_lines(report: InspectReport) -> list[str]:
    """Every source that is not healthy, the most important first: ranks that never wrote,
    sources that stopped early, records lost, sources that ended without shutdown() while
    others finished, restarts, non-finite values, stragglers; then what the run as a whole
    looks like (still running, stopped together, finished)."""
    lines = story.story_lines(
        report.first_failure, [a for s in report.sources for a in s.attempts], report.pauses
    )
    if report.missing_ranks and report.world_size is not None:
        said = never_wrote(report.missing_ranks, report.world_size)
        lines.append(f"{said[0].upper()}{said[1:]}.")
    for i, stop in enumerate(report.stopped_early):
        kind = "stopped first" if i == 0 and len(report.stopped_early) > 1 else "stopped early"
        lines.append(
            f"{stop.process} (rank {stop.rank}) {kind}: last record at step {stop.last_step}, "
            f"{local_time(stop.last_timestamp)}, {duration(stop.lag_s)} before the newest record of the run."
        )
        lines.append("  its last values: " + ", ".join(f"{k}={_fmt(v)}" for k, v in stop.last_values.items()))
    for src in report.sources:
        if src.dropped:
            lines.append(
                f"{src.process} (rank {src.rank}) recorded {src.dropped} record(s) that its writer "
                "could not write (its disk was full or its directory gone for too long): they are missing."
            )
    finished = [s for s in report.sources if s.status == "finished"]
    if finished and not report.still_running:
        for src in report.sources:
            if src.status == "unfinished" and src.end is None:  # an end recorded is in the story
                lines.append(
                    f"{src.process} (rank {src.rank}) ended without shutdown() while {len(finished)} "
                    f"source(s) finished cleanly: last record at step {src.last_step}, "
                    f"{local_time(src.last_timestamp)}."
                )
    for src in report.sources:
        for a in src.attempts:
            if a.replaced and a.replaced_steps is not None and a.replaced_by is not None:
                lo, hi = a.replaced_steps
                lines.append(
                    f"{src.process} (rank {src.rank}) was restarted at step {a.restarted_at}: "
                    f"{a.replaced} record(s) of steps {lo}-{hi} of its attempt {a.attempt} were replaced "
                    f"by attempt {a.replaced_by} (" + opt("attempts") + "'all' keeps them)."
                )
    for item in report.nonfinite:
        lines.append(
            f"Non-finite values in {item.key} on {item.process} (rank {item.rank}) from step "
            f"{item.first_step} ({local_time(item.first_timestamp)}), {item.count} in all."
        )
    for s in report.stragglers:
        lines.append(
            f"Straggler: {s.process} (rank {s.rank}) takes {duration(s.step_time_s)} a step, "
            f"{s.step_time_s / s.role_step_time_s:.2f}x the {duration(s.role_step_time_s)} of the rest "
            f"of its role; at step {s.at_step} it was {duration(s.worst_lag_s)} behind the fastest."
        )
    lines += _overall(report, problems=bool(lines))
    if report.skipped_records or report.unreadable_files:
        lines.append(
            f"{report.skipped_records} record(s) and {len(report.unreadable_files)} file(s) "
            "could not be read (see the warning above)."
        )
    return lines


def never_wrote(ranks: Sequence[int], world_size: int) -> str:
    """The ranks of ``world_size`` that left no record, as ``inspect``, ``watch`` and
    ``upload --follow`` say them.

    >>> never_wrote([2], 3)
    'rank 2 of world_size 3 never wrote a record'
    >>> never_wrote([1, 3], 4)
    'ranks 1, 3 of world_size 4 never wrote a record'
    """
    which = "rank" if len(ranks) == 1 else "ranks"
    return f"{which} {', '.join(map(str, ranks))} of world_size {world_size} never wrote a record"


def _overall(report: InspectReport, problems: bool) -> list[str]:
    """What the run as a whole looks like."""
    statuses = {s.status for s in report.sources}
    newest = max(s.last_timestamp for s in report.sources)
    if report.still_running:
        steps = [s.cadence_s for s in report.sources if s.cadence_s]
        ends = dict.fromkeys([duration(min(steps)), duration(max(steps))]) if steps else {}
        pace = f"; its sources step every {' to '.join(ends)}" if ends else ""
        live = [s for s in report.sources if s.end == "running"]
        if live and all(s.stalled for s in live):
            return [
                f"The run is still running but hung: its writers are alive, and no source took a step for "
                f"{duration(report.checked_at - newest)} (since {local_time(newest)}){pace}."
            ]
        return [
            f"The run looks still running: its newest record is {duration(report.checked_at - newest)} "
            f"old ({local_time(newest)}){pace}."
        ]
    if statuses == {"finished"}:
        if report.first_failure is not None:
            return ["The newest attempt of every source recorded a clean shutdown."]
        return (
            ["Every source recorded a clean shutdown."]
            if problems
            else ["Every source finished cleanly; no non-finite values."]
        )
    unfinished = [s for s in report.sources if s.status == "unfinished"]
    if not report.stopped_early and len(unfinished) == len(report.sources) and report.first_failure is None:
        # When they ended, where their writers recorded it; else their last records.
        ended = [
            s.attempts[-1].ended_at if s.attempts and s.attempts[-1].ended_at else s.last_timestamp
            for s in unfinished
        ]
        spread = max(ended) - min(ended)
        if all(s.end is None for s in unfinished):  # files that record no end (another tool's)
            how, why = "", "their files record no end: how they ended is not known"
        else:
            how, why = " without shutdown()", "the whole job was stopped, or crashed together"
        return [
            f"No source stopped before the others: all {len(unfinished)} ended{how} within "
            f"{duration(spread)} of each other, the last at {local_time(max(ended))} ({why})."
        ]
    return []


def _fmt(v: float | str) -> str:
    return v if isinstance(v, str) else f"{v:.6g}"
