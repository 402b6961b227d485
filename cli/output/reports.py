"""What upload and import report: the runs sent (or a dry run's table), what was imported."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from metric_core.errors import MetricLogError

from ..options import as_flag
from .messages import echo_prose, message_line, os_error_text, say
from .progress import rows_progress
from .tables import print_rows

if TYPE_CHECKING:
    from metric_core.offline.importers import ImportResult
    from metric_core.offline.upload import RunUpload, UploadEvents, UploadResult


def print_upload(result: UploadResult) -> int:
    """A dry run's table of runs, or what happened to each run; the exit code (130: a
    follow stopped by Ctrl-C)."""
    followed = result.followed
    if followed is not None and followed.ended == "stopped":
        for o in result.outcomes:
            if o.action != "skipped":
                say("info", f"stopped following {o.run.name} ({o.run_id}) after {o.rows_sent} rows")
        say("info", "the same upload command with --follow continues where this one stopped")
        return 130
    if followed is not None and not result.outcomes:
        say("warning", "no record came before the end: nothing was uploaded")
    if followed is not None and followed.ended == "over":
        died = "; ".join(f"{p} (rank {r}): {why}" for (p, r), why in sorted(followed.dead.items()))
        if followed.missing:
            say(
                "info",
                f"ended: every source that wrote finished or died{f' ({died})' if died else ''}, and "
                f"{followed.missing}: no restart and no new source came within --restart-grace; the runs "
                "hold every record written",
            )
        else:
            say(
                "info",
                f"ended: every source finished or died, and no restart came within --restart-grace ({died}); "
                "the runs hold every record written",
            )
    if followed is not None and followed.ended == "idle" and not followed.all_finished:
        unfinished = sorted(
            f"{p} (rank {r})" for (p, r), s in followed.sources.items() if not (s.finished or s.static)
        )
        why = [f"{', '.join(unfinished)} did not shut down"] if unfinished else []
        if followed.missing:
            why.append(followed.missing)
        elif followed.expected > len(followed.sources):  # their count is not known: no run.json
            why.append("no run.json says how many sources the job has")
        say(
            "info",
            f"ended after --until-idle, but {'; '.join(why)}: the runs hold everything written so far and "
            "stay open in the ledger; the same command continues them if the job goes on",
        )
    if result.dry_run:
        from metric_core.offline.upload import destination

        print_rows(
            [
                {
                    "name": o.run.name,
                    "would be": destination.would_be(o.action),
                    "rows": o.run.rows,
                    "keys": len(o.run.keys),
                    "group": o.run.group or "",
                    "id": o.run_id,
                }
                for o in result.outcomes
            ],
            max_rows=100_000,  # every run
            drop_first=("id", "group", "keys", "rows"),
            keep=("would be",),
            cut=("name", "group"),
            whole="a wider terminal (COLUMNS=200)",
        )
        for o in result.outcomes:
            echo_prose(f"keys of {o.run.name}: {', '.join(o.run.keys)}")
            if o.message:
                say("info", o.message)
        say("info", "dry run: nothing was uploaded")
        return 0
    for o in result.outcomes:
        if o.message:
            say("info", o.message)
        if o.action != "skipped":
            say("info", f"{o.action} {o.run.name} ({o.run_id}): {o.rows_sent} rows, {len(o.run.keys)} keys")
    if result.sync_dirs and followed is not None and followed.ended == "idle" and not followed.all_finished:
        say("info", "the offline runs stay open: `wandb sync` them once the same command has finished them")
    elif result.sync_dirs:
        say("info", "offline runs written; upload them with:\n  wandb sync " + " ".join(result.sync_dirs))
    return 0


class RunsReport:
    """What upload says of each run (with several, a line naming it first) and, with several,
    how many went; ``code``: the worst exit code of the runs (1: a run failed)."""

    def __init__(self) -> None:
        self.codes: dict[str, int] = {}
        self.runs = 0

    def callbacks(self) -> dict[str, Any]:
        """``upload_runs``' ``on_start`` and ``on_done``."""
        return {"on_start": self.start, "on_done": self.done}

    def start(self, run_dir: str, runs: int) -> None:
        self.runs = runs
        if runs > 1:
            say("info", f"run {len(self.codes) + 1} of {runs}: {run_dir}")

    def done(self, one: RunUpload) -> None:
        if one.result is not None:
            self.codes[one.run_dir] = print_upload(one.result)
            return
        error = one.error
        text = error.text(as_flag) if isinstance(error, MetricLogError) else os_error_text(error)
        say("Error", f"{one.run_dir}: {text}" if self.runs > 1 else text)
        self.codes[one.run_dir] = 1

    @property
    def code(self) -> int:
        failed = [run for run, code in self.codes.items() if code == 1]
        if self.runs > 1:
            went = "went" if not failed else f"went; {len(failed)} failed ({', '.join(failed)}), said above"
            say("info", f"{len(self.codes) - len(failed)} of {self.runs} runs {went}")
        return max(self.codes.values(), default=0)


@contextmanager
def upload_events(alert: Callable[[Any], None] | None = None) -> Iterator[UploadEvents]:
    """Messages on stderr and, when it is a terminal, a progress bar per W&B run (rows, rows/s, ETA);
    each alarm (``--alert``) handed to ``alert``.

    The bars start with the first run sent: a live display runs a thread, and upload reads
    the run in a forked child only while this process has no other thread.
    """
    from metric_core.offline.upload import UploadEvents

    alerting = {} if alert is None else {"alert": alert}
    if not sys.stderr.isatty():
        yield UploadEvents(message=say, spelling=as_flag, **alerting)
        return
    bars: list[Any] = []

    def message(kind: str, text: str) -> None:
        if bars:
            bars[0].console.print(message_line(kind, text), markup=False, highlight=False)
        else:
            say(kind, text)

    def start(run: Any, done: int) -> Callable[[int], None]:
        if not bars:
            bars.append(rows_progress())
            bars[0].start()
        task = bars[0].add_task(run.name, total=run.rows, completed=done)
        return lambda n: bars[0].update(task, completed=n)

    try:
        yield UploadEvents(message=message, progress=start, spelling=as_flag, **alerting)
    finally:
        if bars:
            bars[0].stop()


def print_import(result: ImportResult) -> None:
    """What ``metriclog import`` wrote, or that it was there already; what it skipped."""
    if not result.added:
        say("info", f"{result.run_dir} holds this import already (run_id {result.run_id}): nothing added")
        return
    for reason, count in sorted(result.skipped.items()):
        say("warning", f"not imported: {count:,} {reason}")
    for process, rank, records, samples in result.sources:
        said = f", {samples:,} samples" if samples else ""
        say("info", f"{process} (rank {rank}): {records:,} records{said}")
    say(
        "info",
        f"imported the {result.kind} run '{result.name}' into {result.run_dir} (run_id {result.run_id})",
    )
