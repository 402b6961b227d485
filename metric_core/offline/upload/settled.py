"""A plain upload of a run whose job still writes it: the settled rows only, runs left open.

``running`` tells, from the journals alone, whether a writer of the run may still write
(its journal has no clean end and its process is not over). Then ``settled_runs`` reads
the run once as the sidecar does (``read.tail.RunTail`` and ``settle.Follower``) and
plans the rows that are complete: a step every holding source flushed, a window every
holding source's records passed. A partial step is never planned. The runs are ``open``:
the upload leaves them unfinished in its ledger, and a later upload continues them
(online, the same W&B run resumed at the next row; offline and for TensorBoard, the run
written again whole), as a later ``--follow`` does.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from metric_core.errors import StrictModeError
from metric_core.format.life import END_KINDS
from metric_core.offline.plan import ReducePlan
from metric_core.offline.storage import RunPath, name_of
from metric_core.offline.upload.restarts import attempt_steps
from metric_core.offline.upload.runs import (
    PlannedRun,
    PlannedRuns,
    limit_warnings,
    request_key,
    run_config,
    run_id_for,
)


def running(root: RunPath, *, follow_symlinks: bool = False) -> bool:
    """Whether a writer of the run may still write to it: one of its journals holds no clean
    end, and the process that writes it is not known to be over (its end recorded, its pid
    gone, its heartbeat stopped). Files of an older writer, which record no life, and runs
    in object storage, read as finished (as every command reads them)."""
    from metric_core.format import journal
    from metric_core.format.life import process_gone
    from metric_core.offline.read import ReadReport
    from metric_core.offline.read.discover import list_data_files

    if not isinstance(root, Path):
        return False
    now = time.time()
    for path in list_data_files(root, ReadReport(run_dir=root), follow_symlinks=follow_symlinks):
        if path.suffix != ".journal":
            continue
        try:
            decoded = journal.decode(path.read_bytes(), records=False)
        except OSError:  # sealed meanwhile: its segment holds its end
            continue
        if decoded.process is None or decoded.shutdown is not None or decoded.version < 4:
            continue
        life = decoded.life  # as the sidecar tells a death (``AttemptState.dead``)
        if (
            not any(e["kind"] in END_KINDS for e in life.ends)
            and not process_gone(life)
            and not life.dead(now)
        ):
            return True
    return False


@dataclass
class SettledRun(PlannedRun):
    """A planned run whose rows were made by one read of the run as the sidecar makes them."""

    held: list[dict[str, Any]] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return len(self.held)

    def history(self, start: int = 0) -> Iterator[dict[str, Any]]:
        for row in self.held[start:]:
            yield dict(row)

    def steps(self) -> set[int]:
        return {row["step"] for row in self.held} if self.bucket == "step" else set()

    def last_step(self) -> int | None:
        return max(self.steps(), default=None)

    def first_row_from(self, step: int) -> int | None:
        if self.bucket != "step" or (self.raw and self.source is None):
            return None
        return sum(1 for row in self.held if row["step"] < step)


def settled_runs(
    root: RunPath,
    plan: ReducePlan,
    *,
    name: str,
    group: str | None,
    share_run: bool,
    request: dict[str, Any],
    follow_symlinks: bool = False,
    strict: bool = False,
) -> PlannedRuns:
    """The runs of ``plan`` holding the rows of ``root`` that are complete now (``open``
    when a source may still write: the job goes on); ``warnings`` say what was skipped."""
    import polars as pl

    from metric_core.offline.read.tail import RunTail, counted, expected_sources
    from metric_core.offline.upload.follow import _identity
    from metric_core.offline.upload.settle import Follower

    assert isinstance(root, Path)  # ``running`` is False for a run in object storage
    tail = RunTail(root, follow_symlinks=follow_symlinks)
    records = tail.poll()
    expected = expected_sources(tail.meta) or 1
    over = (
        bool(tail.sources)
        and counted(tail.sources) >= expected
        and all(s.finished or s.static or s.over is not None for s in tail.sources.values())
    )
    if over:  # every source finished or died since: its records no flush covered are read as they are
        records = pl.concat([records, tail.poll(final=True)], how="vertical")
    if strict and tail.skipped:
        raise StrictModeError(f"{tail.skipped} record(s) skipped: " + "; ".join(tail.notices))
    follower = Follower(plan, share_run=share_run, sources=expected)
    follower.add(records, tail.sources)
    ready = follower.ready(tail.sources, ending=over)
    identity = _identity(tail)
    key = request_key(plan, request, share_run)
    group = group or name
    runs: dict[str | None, SettledRun] = {}
    for part in ready:
        run = runs.get(part.run)
        if run is None:
            process = part.run
            run = runs[process] = SettledRun(
                run_id=run_id_for(identity, key, process),
                name=name if process is None else f"{name}_{process}",
                group=None if process is None else group,
                source=process,
                columns={},
                x_axis=None if follower.raw else plan.bucket,
                keys=[],
                raw=follower.raw,
                bucket=plan.bucket,
            )
            held = [(p, s) for (p, _), s in tail.sources.items() if process in (None, p)]
            run.attempts = sorted({a for _, s in held for a in s.attempts if a})
            run.first_steps = {
                a: st.first_step for _, s in held for a, st in s.attempts.items() if st.first_step is not None
            }
            if plan.attempts == "rewind":
                run.attempt_steps = attempt_steps(tail.sources, process)
        run.held.extend(part.rows)
    for run in runs.values():
        run.keys = sorted({k for row in run.held for k in row if k not in (run.bucket, "_timestamp")})
        run.points = len(run.held)
    planned = PlannedRuns(
        runs=list(runs.values()),
        identity=identity,
        key_mapping={k: v for k, v in follower.mapping.items() if k != v},
        config=run_config(tail.meta, plan, source_run_dir=name_of(root), settled_while_running=not over),
        identity_from="run.json" if tail.meta.get("run_id") else "content",
    )
    planned.open = not over
    planned.warnings = [*tail.notices, *follower.mixed_notices(), *limit_warnings(planned.runs)]
    return planned
