"""TensorBoard as a destination: the planned runs as event files, written by tensorboardX.

Each planned run (``plan_runs``: the global run, a run per source, or a shared one)
becomes a folder of ``logdir`` named as the W&B run would be, holding one event file:

* reduced runs: an event per history row, at its step (``--by time``: its window's
  start as the wall time, the window's number as the step);
* ``per_rank_no_reduce``: an event per raw record, at its step and its own wall time.

A file is written under a name TensorBoard does not read (``.metriclog-partial-*``) and
renamed to ``events.out.tfevents.*`` once whole, so a reader never sees half of one. The
ledger (``logdir/.metriclog-tensorboard.json``) records each run written, by the same
ids as the W&B upload's (the run, the request, the source) and the writers' attempts it
holds: an upload again writes nothing new; one interrupted writes its runs again from
the start; a run whose job restarted since is written again in place of the old file.

TensorBoard keeps a scalar as float32: the values that change in the rounding are
counted, and said.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from metric_core.atomic import replace_file
from metric_core.errors import MissingDependencyError
from metric_core.offline.upload.restarts import replacing, steps_said
from metric_core.offline.upload.runs import PlannedRun, PlannedRuns
from metric_core.offline.upload.send import RunOutcome, UploadEvents, stale_in

LEDGER = ".metriclog-tensorboard.json"
PARTIAL = ".metriclog-partial-"
WRITTEN = "wrote to TensorBoard"


@dataclass(frozen=True)
class TensorBoard:
    """Where runs go as TensorBoard event files: ``logdir`` (``tensorboard --logdir``)."""

    logdir: Path

    def request(self, name: str | None, group: str | None) -> dict[str, Any]:
        """What identifies this destination in the runs' ids (as project and entity do for W&B)."""
        return {"tensorboard": str(Path(self.logdir).resolve()), "name": name, "group": group}


def would_be(planned: PlannedRuns, to: TensorBoard, force_new: bool) -> list[RunOutcome]:
    """A dry run: what each run would be (written, or skipped as written already)."""
    ledger = _ledger(Path(to.logdir))
    return [
        RunOutcome(
            run,
            "skipped" if _done(ledger, run, Path(to.logdir)) and not force_new else "written",
            run.run_id,
            0,
        )
        for run in planned.runs
    ]


def write_runs(
    planned: PlannedRuns, to: TensorBoard, *, force_new: bool = False, events: UploadEvents | None = None
) -> list[RunOutcome]:
    """Write every planned run not written yet as an event file under ``to.logdir``."""
    events = events or UploadEvents()
    try:
        from tensorboardX import summary
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.record_writer import RecordWriter
    except ImportError:
        raise MissingDependencyError(
            "--to tensorboard writes with tensorboardX: pip install 'metriclog[tensorboard]'"
        ) from None
    logdir = Path(to.logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    ledger = _ledger(logdir)
    ours = {run.run_id for run in planned.runs}
    for run in planned.runs:
        other = next((e for i, e in ledger.items() if e.get("name") == run.name and i not in ours), None)
        if other is not None:  # another mode or filter, written under the same folder name
            events.message(
                "warning",
                f"{logdir / run.name} holds a run another upload wrote (another mode or other filters): "
                "TensorBoard shows both under the same tags; give this upload a --name of its own",
            )
    logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)  # a NaN is a value here
    outcomes = []
    for run in planned.runs:
        if _done(ledger, run, logdir) and not force_new:
            outcomes.append(
                RunOutcome(
                    run,
                    "skipped",
                    run.run_id,
                    ledger[run.run_id]["rows"],
                    f"{run.name}: already written to {logdir}",
                )
            )
            continue
        replaced = stale_in(ledger.get(run.run_id), run)
        if replaced and not force_new:  # written again whole, in place of the file that holds them
            events.message(
                "warning",
                f"{run.name}: {replacing({s: lo for s, (lo, _) in replaced.items()}, 'TensorBoard')}: "
                f"{steps_said(replaced, str(logdir / run.name))} written before it; its file is written "
                "again",
            )
        folder = logdir / run.name
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob(f"{PARTIAL}*"):  # an interrupted write of this run
            stale.unlink()
        partial = folder / f"{PARTIAL}{secrets.token_hex(6)}"
        writer = RecordWriter(str(partial))
        try:
            writer.write(Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString())
            rows, rounded, worst, tags = _write(run, writer, summary, Event)
            writer.flush()
        finally:
            writer.close()
        final = folder / f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{run.run_id}"
        os.replace(partial, final)
        old = ledger.get(run.run_id, {}).get("file")
        if old and old != str(final.relative_to(logdir)):  # the run before a restart of its job
            (logdir / old).unlink(missing_ok=True)
        ledger[run.run_id] = {
            "name": run.name,
            "file": str(final.relative_to(logdir)),
            "rows": rows,
            "attempts": run.attempts,
            "attempts_sent": run.attempt_steps,  # a later upload tells a restart into its rows
            "last_step": run.last_step(),
            # a run of a job that still writes it: written again whole by the next upload
            "finished": not planned.open,
        }
        replace_file(logdir / LEDGER, (json.dumps({"runs": ledger}, indent=1) + "\n").encode())
        message = ""
        if rounded:
            message = (
                f"{run.name}: {rounded:,} value(s) changed when rounded to float32, as TensorBoard keeps "
                f"scalars (the largest change: {worst:.1e} of the value)"
            )
        renamed = {k: v for k, v in tags.items() if k != v}
        if renamed:
            message += (". " if message else "") + "; ".join(
                f"'{k}' is the tag '{v}'" for k, v in renamed.items()
            )
        outcomes.append(RunOutcome(run, WRITTEN, run.run_id, rows, message))
    return outcomes


def _write(run: PlannedRun, writer: Any, summary: Any, event: Any) -> tuple[int, int, float, dict[str, str]]:
    """Write ``run``'s history; rows written, values rounded to float32, the largest relative
    change, and the tag of each key (tensorboardX cleans some characters)."""
    x = run.bucket
    rows = rounded = 0
    worst = 0.0
    tags: dict[str, str] = {}
    for i, row in enumerate(run.history()):
        wall = row.get("_timestamp")
        if x == "step":
            step = int(row[x])
        else:  # a window: its number is the step, its start the wall time
            step, wall = i, row.get(x, wall)
        values = []
        for key, value in row.items():
            if key in (x, "step", "_timestamp") or value is None:
                continue
            value = float(value)
            if math.isfinite(value):
                narrow = float(np.float32(value))
                if narrow != value:
                    rounded += 1
                    worst = max(worst, abs(narrow - value) / abs(value) if value else math.inf)
            one = summary.scalar(key, value)
            tags[key] = one.value[0].tag
            values.extend(one.value)
        if not values:
            continue
        writer.write(
            event(
                wall_time=time.time() if wall is None else float(wall),
                step=step,
                summary=summary.Summary(value=values),
            ).SerializeToString()
        )
        rows += 1
    return rows, rounded, worst, tags


def _ledger(logdir: Path) -> dict[str, Any]:
    path = logdir / LEDGER
    if not path.exists():
        return {}
    runs: dict[str, Any] = json.loads(path.read_text()).get("runs", {})
    return runs


def _done(ledger: dict[str, Any], run: PlannedRun, logdir: Path) -> bool:
    entry = ledger.get(run.run_id)
    return bool(
        entry
        and entry.get("finished")
        and entry.get("attempts") == run.attempts
        and not stale_in(entry, run)
        and (logdir / entry["file"]).exists()
    )
