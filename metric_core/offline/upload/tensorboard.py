"""TensorBoard as a destination: the planned runs as event files, written by tensorboardX.

Each planned run (``plan_runs``: the global run, a run per source, or a shared one)
becomes a folder of ``logdir`` named as the W&B run would be, holding one event file:

* reduced runs: an event per history row, at its step (``--by time``: its window's
  start as the wall time, the window's number as the step);
* ``per_rank_no_reduce``: an event per raw record, at its step and its own wall time.

A file is written under a name TensorBoard does not read (``.metriclog-partial-*``) and
renamed to ``events.out.tfevents.*`` once whole, so a reader never sees half of one;
``upload --follow`` writes the event file under its own name as the rows come (flushed
each poll), so TensorBoard shows the run live. The ledger
(``logdir/.metriclog-tensorboard.json``, in the one format of ``ledger.Ledger``) records
each run written, by the same ids as the W&B upload's (the run, the request, the source)
and the writers' attempts it holds: an upload again writes nothing new; one interrupted
writes its runs again from the start (an event file cannot be continued); a run whose
job restarted since is written again in place of the old file.

TensorBoard keeps a scalar as float32: the values that change in the rounding are
counted, and said.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from metric_core.errors import MissingDependencyError
from metric_core.offline.storage import RunPath
from metric_core.offline.upload.destination import (
    Decision,
    Destination,
    RunOutcome,
    Sender,
    UploadEvents,
    is_done,
    stale_in,
    step_values,
)
from metric_core.offline.upload.ledger import Ledger
from metric_core.offline.upload.restarts import replacing, steps_said
from metric_core.offline.upload.runs import PlannedRun, PlannedRuns

LEDGER = ".metriclog-tensorboard.json"
PARTIAL = ".metriclog-partial-"
WRITTEN = "wrote to TensorBoard"


@dataclass(frozen=True)
class TensorBoard(Destination):
    """Where runs go as TensorBoard event files: ``logdir`` (``tensorboard --logdir``)."""

    logdir: Path

    kind = "TensorBoard"
    takes_samples = False

    def request(self, name: str | None, group: str | None, *, run_name: str) -> dict[str, Any]:
        given = None if name == run_name else name
        return {"tensorboard": str(Path(self.logdir).resolve()), "name": given, "group": group}

    def load_client(self) -> None:
        from metric_core.offline.tensorboardx import import_tensorboardx

        try:
            import_tensorboardx()
        except ImportError:
            raise MissingDependencyError(
                "--to tensorboard writes with tensorboardX: pip install 'metriclog[tensorboard]'"
            ) from None

    def ledger(self, root: RunPath | None, identity: str, *, create: bool = True) -> Ledger | None:
        path = Path(self.logdir) / LEDGER
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
            return Ledger(path)
        return Ledger(path) if path.is_file() else None

    def decide(self, run: PlannedRun, entry: dict[str, Any] | None, force_new: bool) -> Decision:
        logdir = Path(self.logdir)
        if entry is not None and is_done(entry, run) and (logdir / entry["file"]).exists() and not force_new:
            return Decision("skipped", run.run_id, None, f"{run.name}: already written to {logdir}")
        replaced = stale_in(entry, run)
        said = ""
        if replaced and not force_new:  # written again whole, in place of the file that holds them
            said = (
                f"{run.name}: {replacing({s: lo for s, (lo, _) in replaced.items()}, 'TensorBoard')}: "
                f"{steps_said(replaced, str(logdir / run.name))} written before it; its file is written again"
            )
        return Decision(WRITTEN, run.run_id, None, said)

    def left_behind(self) -> str:
        return "its file is written again"

    def sender(
        self,
        planned: PlannedRuns,
        ledger: Ledger,
        *,
        force_new: bool,
        events: UploadEvents,
        samples: Any = None,
        live: bool = False,
    ) -> Sender:
        self.load_client()
        ours = {run.run_id for run in planned.runs}
        for run in planned.runs:
            other = any(
                e.get("name") == run.name and i not in ours and e.get("base_id", i) not in ours
                for i, e in ledger.entries.items()
            )
            if other:  # another mode or filter, written under the same folder name
                events.message(
                    "warning",
                    f"{Path(self.logdir) / run.name} holds a run another upload wrote (another mode or "
                    "other filters): TensorBoard shows both under the same tags; give this upload a --name "
                    "of its own",
                )
        logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)  # a NaN is a value here
        return TensorBoardSender(planned, ledger, self, force_new, events, None, live=live)


@dataclass
class _EventFile:
    """An event file being written: its writer, where it is, and what the rounding changed."""

    writer: Any
    path: Path
    old: str | None  # the file of the run before (written again whole)
    rows: int = 0  # history rows written (a window's number is its row's)
    rounded: int = 0
    worst: float = 0.0
    tags: dict[str, str] = field(default_factory=dict)


@dataclass
class TensorBoardSender(Sender):
    """Writes each planned run as an event file (``Sender``'s verbs, by tensorboardX)."""

    to: TensorBoard

    def start(
        self, run: PlannedRun, decision: Decision, entry: dict[str, Any] | None, outcome: RunOutcome
    ) -> Any:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.record_writer import RecordWriter

        logdir = Path(self.to.logdir)
        folder = logdir / run.name
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob(f"{PARTIAL}*"):  # an interrupted write of this run
            stale.unlink()
        old = (entry or {}).get("file")
        if self.live:  # TensorBoard reads it as it grows; the run's earlier file goes now
            if old:
                (logdir / old).unlink(missing_ok=True)
                old = None
            path = folder / _final_name(run)
            self.ledger.update(decision.run_id, file=str(path.relative_to(logdir)))
        else:
            path = folder / f"{PARTIAL}{secrets.token_hex(6)}"
        writer = RecordWriter(str(path))
        writer.write(Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString())
        return _EventFile(writer, path, old)

    def log_rows(self, handle: _EventFile, rows: Iterable[dict[str, Any]], run: PlannedRun) -> int:
        from tensorboardX import summary
        from tensorboardX.proto.event_pb2 import Event

        n = 0
        for row in rows:
            n += 1
            step, wall, row_values = step_values(row, run, handle.rows)
            handle.rows += 1
            values = []
            for key, value in row_values.items():
                if math.isfinite(value):
                    narrow = float(np.float32(value))
                    if narrow != value:
                        handle.rounded += 1
                        handle.worst = max(
                            handle.worst, abs(narrow - value) / abs(value) if value else math.inf
                        )
                one = summary.scalar(key, value)
                handle.tags[key] = one.value[0].tag
                values.extend(one.value)
            if values:
                event = Event(
                    wall_time=time.time() if wall is None else float(wall),
                    step=step,
                    summary=summary.Summary(value=values),
                )
                handle.writer.write(event.SerializeToString())
        if self.live:
            handle.writer.flush()
        self.rows_logged += n
        return n

    def finish(self, handle: _EventFile, outcome: RunOutcome, finished: bool) -> dict[str, Any]:
        """The file closed and, written whole, renamed to the name TensorBoard reads."""
        try:
            handle.writer.flush()
        finally:
            handle.writer.close()
        logdir = Path(self.to.logdir)
        final = handle.path
        if not self.live:
            final = handle.path.with_name(_final_name(outcome.run))
            os.replace(handle.path, final)
        if handle.old and handle.old != str(final.relative_to(logdir)):  # the run before a restart
            (logdir / handle.old).unlink(missing_ok=True)
        message = ""
        if handle.rounded:
            message = (
                f"{outcome.run.name}: {handle.rounded:,} value(s) changed when rounded to float32, as "
                f"TensorBoard keeps scalars (the largest change: {handle.worst:.1e} of the value)"
            )
        renamed = {k: v for k, v in handle.tags.items() if k != v}
        if renamed:
            message += (". " if message else "") + "; ".join(
                f"'{k}' is the tag '{v}'" for k, v in renamed.items()
            )
        outcome.message = (outcome.message + ". " if outcome.message else "") + message
        return {"file": str(final.relative_to(logdir))}


def _final_name(run: PlannedRun) -> str:
    return f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{run.run_id}"
