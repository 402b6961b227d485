"""``upload_run``: a run directory, reduced by a plan, replayed into a destination.

``runs`` maps a reduction to the destination's runs; a ``Destination`` (``destination``:
W&B in ``send``, TensorBoard in ``tensorboard``, MLflow in ``mlflow``) hands them over
with a ``ledger`` (idempotent: a finished run is skipped; resumable: an interrupted run
continues where the destination stopped). ``upload_run`` ties them together and never
prints: it reports through ``UploadEvents`` callbacks, which the command line turns into
lines.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from metric_core.atomic import scratch_directory
from metric_core.errors import (
    Message,
    MetricLogError,
    MissingDependencyError,
    NotLoggedInError,
    PlanError,
    RequestError,
    opt,
    spell_options,
)
from metric_core.offline.plan import By, Engine, ReducePlan
from metric_core.offline.samples import SampleChoice, SampleTables
from metric_core.offline.storage import RunPath, is_remote, missing_run, name_of, run_path
from metric_core.offline.upload import overlap
from metric_core.offline.upload.destination import (
    Destination,
    RunOutcome,
    UploadEvents,
    find_entry,
    send_runs,
)
from metric_core.offline.upload.ledger import Ledger, only_upload
from metric_core.offline.upload.mlflow import MLflow
from metric_core.offline.upload.runs import PlannedRun, PlannedRuns, plan_runs, request_key, spills
from metric_core.offline.upload.send import WandB
from metric_core.offline.upload.settled import running, settled_runs
from metric_core.offline.upload.tensorboard import TensorBoard

if TYPE_CHECKING:
    from metric_core.offline.read import OnProgress
    from metric_core.offline.upload.follow import FollowState

__all__ = [
    "Destination",
    "Follow",
    "MLflow",
    "PlannedRun",
    "RunOutcome",
    "RunUpload",
    "TensorBoard",
    "UploadEvents",
    "UploadResult",
    "WandB",
    "upload_run",
    "upload_runs",
]


@dataclass
class Follow:
    """How ``upload_run`` follows a run that is being written: a look every ``interval``
    seconds; the end when every source finished, or ``until_idle`` seconds passed without
    a new record, or ``stop`` is set, or every source finished or died and no new attempt
    began within ``restart_grace`` seconds; ``sources``: how many sources to wait for
    before a global step is complete (default: run.json's world_size). A live source
    holds the global steps however long it is silent, unless ``let_go_after``."""

    interval: float = 2.0
    until_idle: float | None = None
    sources: int | None = None
    stop: threading.Event | None = None
    let_go_after: float | None = None  # a live source silent this long stops holding the global steps
    restart_grace: float = 60.0  # every source finished or died: how long a restart is waited for
    wait: bool = False  # a run directory not there yet is waited for (else: an error at once)
    alarms: Any = None  # alarms on values (``alerts.Alarms``), said through ``UploadEvents.alert``


@dataclass
class UploadResult:
    """The runs planned, and what happened to each (in a dry run: what would happen)."""

    plan: PlannedRuns
    outcomes: list[RunOutcome] = field(default_factory=list)
    dry_run: bool = False  # asked for, or WANDB_MODE=disabled
    followed: FollowState | None = None  # with ``follow``: how following went

    @property
    def sync_dirs(self) -> list[str]:
        """Offline runs written, for ``wandb sync``."""
        return [o.sync_dir for o in self.outcomes if o.sync_dir]


def upload_run(
    run_dir: str | os.PathLike[str],
    plan: ReducePlan,
    to: Destination,
    *,
    name: str | None = None,
    group: str | None = None,
    share_run: bool = False,
    dry_run: bool = False,
    force_new: bool = False,
    strict: bool = False,
    follow_symlinks: bool = False,
    events: UploadEvents | None = None,
    on_progress: OnProgress | None = None,
    follow: Follow | None = None,
    engine: Engine | str = Engine.LOCAL,
    ray_address: str | None = None,
    samples: SampleChoice | None = None,
) -> UploadResult:
    """Reduce ``run_dir`` by ``plan`` and upload it to ``to`` (with ``dry_run``, only plan it).

    ``to`` is a ``Destination``: ``WandB``, ``TensorBoard`` or ``MLflow`` (docs/destinations.md).
    ``name`` defaults to the run directory's name, ``group`` to ``name``; ``share_run``
    puts every source of a per-rank mode in one run; ``on_progress`` follows the run's read
    (in the reading child, when there is one). With ``follow``, the run is uploaded as it
    is written, until its job ends (``Follow``, ``offline.upload.follow``). ``engine`` and
    ``ray_address`` say where the reduction runs (``engine.execute``: the same bits).
    ``samples`` says which samples (``Reduce.SAMPLE``) go with each step's row (default
    ``SampleChoice()``: top and bottom 2 by reward, else 4 at random).
    Raises ``NotLoggedInError`` for an online W&B upload without credentials,
    ``StrictModeError`` when ``strict`` and records were skipped, ``UploadError`` when the
    destination fails for good.

    >>> from metric_core import make_plan
    >>> result = upload_run("sample_logs/rl_run", make_plan(), WandB("demo"), dry_run=True)
    >>> [(r.name, r.rows) for r in result.plan.runs]
    [('rl_run', 300)]
    """
    events = events or UploadEvents()
    to.check(name=name, group=group)
    root = run_path(run_dir)
    _check_follow(root, plan, follow, engine)
    _check_together(plan, share_run)
    missing = None if follow is not None and follow.wait else missing_run(root)
    if missing is not None:  # after the usage errors, before credentials and the destination: a mistyped path
        raise missing
    to, dry_run = to.ready(events, dry_run)
    request = to.request(name, group, run_name=name_of(root))
    read: dict[str, Any] = {
        "name": name or name_of(root), "group": group, "share_run": share_run, "request": request,
        "follow_symlinks": follow_symlinks, "strict": strict,
    }  # fmt: skip
    if follow is not None:
        from metric_core.offline.upload.follow import follow_upload

        assert isinstance(root, Path)
        planned, state = follow_upload(
            root, plan, to, dry_run=dry_run, force_new=force_new, events=events, follow=follow,
            samples=samples or SampleChoice(), **read,
        )  # fmt: skip
        if not dry_run and not to.takes_samples:  # said as a plain upload says them
            _said_samples(
                root,
                planned,
                _sample_tables(root, plan, samples or SampleChoice(), share_run, events),
                to,
                events,
            )
        return UploadResult(planned, state.outcomes, dry_run=dry_run, followed=state)
    with contextlib.ExitStack() as held:  # left in turn: the reading child stopped, then the columns removed
        # the runs' columns: made here, in the process that removes them however the upload
        # ends, whichever process plans the runs (``overlap``)
        spill = (
            held.enter_context(scratch_directory("metriclog-upload-")) if spills(plan, share_run) else None
        )
        prepare: Callable[[], PlannedRuns] = functools.partial(
            _prepare, root, plan, on_progress=on_progress, engine=engine, ray_address=ray_address,
            spill_dir=spill, **read,
        )  # fmt: skip
        settled = functools.partial(settled_runs, root, plan, **read)
        live = running(root, follow_symlinks=follow_symlinks)
        if live:  # the job still writes: its settled rows
            prepare = settled
        if not dry_run and to.slow_client:  # its client is imported while a child reads and reduces the run
            prepare = held.enter_context(overlap.started(prepare))
        if not dry_run:
            to.load_client()
        planned = _started_meanwhile(_received(prepare, events), live, root, settled, follow_symlinks, events)
        from metric_core.offline.read import fetch_numpy_api  # once polars may load here

        fetch_numpy_api()  # where a child read the run, this process has not fetched it yet
        try:
            report_planned(planned, events)
            if dry_run:
                ledger = to.ledger(root, planned.identity, create=False)
                would = [(r, to.decide(r, find_entry(ledger, r, to), force_new)) for r in planned.runs]
                outcomes = [RunOutcome(r, d.action, d.run_id, 0, d.message) for r, d in would]
                return UploadResult(planned, outcomes, dry_run=True)
            ledger = to.ledger(root, planned.identity)
            assert ledger is not None
            with only_upload(ledger.path.parent, request_key(plan, request, share_run), root):
                ledger = Ledger(ledger.path)  # as the upload that held the lock before left it
                tables = _sample_tables(root, plan, samples or SampleChoice(), share_run, events)
                sent = tables if to.takes_samples else None
                outcomes = send_runs(planned, ledger, to, force_new=force_new, events=events, samples=sent)
                if planned.open:
                    events.message("note", _still_written(events))
                _said_samples(root, planned, tables, to, events)
                return UploadResult(planned, outcomes)
        finally:
            planned.close()


@dataclass
class RunUpload:
    """One run of ``upload_runs``: its directory, and its ``UploadResult`` or the error that
    stopped its upload (``error``: a ``MetricLogError`` or an ``OSError``)."""

    run_dir: str
    result: UploadResult | None = None
    error: BaseException | None = None


def upload_runs(
    runs: Sequence[str | os.PathLike[str]],
    plan: ReducePlan,
    to: Destination,
    *,
    name: str | None = None,
    follow: Follow | None = None,
    on_start: Callable[[str, int], None] | None = None,
    on_done: Callable[[RunUpload], None] | None = None,
    **options: Any,
) -> list[RunUpload]:
    """``upload_run`` of each run of ``runs`` (globs and ``@FILE`` expanded as ``compare``
    expands them), each under its own identity, as if uploaded alone: an upload of runs A
    and B after one of A alone adds nothing to A. A run that fails is kept with its error
    and the others go on; an error that would fail every run alike (a usage error, no
    credentials, a missing client) is raised at once. ``name`` and ``follow`` take one run
    only (a ``PlanError`` with several). ``on_start(run_dir, runs)`` is called before each
    run (``runs``: how many there are), ``on_done`` after. ``options``: ``upload_run``'s.

    >>> from metric_core import make_plan
    >>> done = upload_runs(["sample_logs/rl_run"], make_plan(), WandB("demo"), dry_run=True)
    >>> [(u.run_dir, u.result.plan.runs[0].rows) for u in done]
    [('sample_logs/rl_run', 300)]
    """
    from metric_core.offline.compare import expand_runs

    dirs = expand_runs(runs)
    if len(dirs) > 1 and name is not None:
        raise PlanError(
            f"names one run, and {len(dirs)} were given: each run takes its directory's name",
            option="name",
            value=name,
        )
    if len(dirs) > 1 and follow is not None:
        raise PlanError(
            f"follows one run while its job writes it, and {len(dirs)} were given: start one "
            "upload --follow a run",
            option="follow",
            value=True,
        )
    done: list[RunUpload] = []
    for run_dir in dirs:
        if on_start is not None:
            on_start(run_dir, len(dirs))
        try:
            one = RunUpload(run_dir, upload_run(run_dir, plan, to, name=name, follow=follow, **options))
        except (PlanError, NotLoggedInError, MissingDependencyError):
            raise
        except (MetricLogError, OSError) as exc:
            one = RunUpload(run_dir, error=exc)
        done.append(one)
        if on_done is not None:
            on_done(one)
    return done


def _check_follow(root: RunPath, plan: ReducePlan, follow: Follow | None, engine: Engine | str) -> None:
    """What ``follow`` cannot go with: a usage error, before anything is read."""
    if follow is None:
        return
    if is_remote(root):
        raise RequestError(
            f"{root}: "
            + opt("follow", flag=True)
            + " reads a run while its writers append to it, on a local or "
            "network filesystem; object storage holds whole objects only. Upload it without "
            + opt("follow", flag=True)
            + " (watch follows a run in a bucket)"
        )
    if Engine.of(engine) is not Engine.LOCAL:
        raise PlanError(
            "reduces each poll's new records here; " + opt("engine") + "ray applies to a whole upload only",
            option="follow",
        )
    from metric_core.offline.plan import counts_back

    if counts_back(plan.steps):
        raise PlanError(
            "counts back from the run's last step, which a run still being written does not have yet: "
            "give steps from the start",
            option="steps",
            value=":".join("" if v is None else str(v) for v in plan.steps),  # type: ignore[union-attr]
        )


def _said_samples(
    root: RunPath, planned: PlannedRuns, tables: SampleTables | None, to: Destination, events: UploadEvents
) -> None:
    """Samples that did not go are said, never dropped silently: all of them, to a
    destination that holds scalars only; else the steps with no row to go with."""
    if tables is not None and not to.takes_samples:
        steps = len({step for _, step in tables.by_step})
        events.message(
            "note",
            f"{steps} step(s) hold samples (Reduce.SAMPLE): the {to.kind} files hold scalars only, so "
            f"they are not written there; `metriclog samples {root}` lists them",
        )
        return
    rowless = _rowless_samples(planned, tables)
    if rowless:
        events.message(
            "note",
            spell_options(
                f"{rowless} step(s) of samples have no row to go with (no scalar at that step, or "
                + opt("by")
                + "time): they are not uploaded; `metriclog samples` lists them",
                events.spelling,
            ),
        )


def _started_meanwhile(
    planned: PlannedRuns,
    live: bool,
    root: RunPath,
    settled: Callable[[], PlannedRuns],
    follow_symlinks: bool,
    events: UploadEvents,
) -> PlannedRuns:
    """``planned`` read whole, as of a job that was over; but a writer that began while it
    was read (a rank restarted from a checkpoint meanwhile) may have had records read that
    its first flush then replaces or moves: the run is read again as a running job's."""
    if live or not running(root, follow_symlinks=follow_symlinks):
        return planned
    planned.close()
    return _received(settled, events)


def _still_written(events: UploadEvents) -> str:
    """Said after an upload of a run whose job still writes it (``settled``)."""
    return spell_options(
        "the job still writes this run (a source has neither shut down nor died): its complete steps "
        "went, and the runs stay open; upload again to add the rest once it ran further or ended (or "
        "follow it with " + opt("follow", flag=True) + ")",
        events.spelling,
    )


def _sample_tables(
    root: RunPath, plan: ReducePlan, choice: SampleChoice, share_run: bool, events: UploadEvents
) -> SampleTables | None:
    """The run's samples to send with the rows, or None when there are none (or none asked)."""
    if not choice.enabled:
        return None
    tables = SampleTables(root, plan, choice, share_run=share_run)
    return tables if tables else None


def _rowless_samples(planned: PlannedRuns, tables: SampleTables | None) -> int:
    """Steps with samples that no row of their run holds, whichever upload sent the row (a
    run skipped or resumed holds the rows an earlier upload sent); while the job still
    writes the run, a step past a run's last row is not counted: its row may come."""
    if tables is None:
        return 0
    steps = {run.source: run.steps() for run in planned.runs}
    last = {source: max(held, default=-1) for source, held in steps.items()}
    return sum(
        1
        for source, step in tables.by_step
        if step not in steps.get(source, set()) and not (planned.open and step > last.get(source, -1))
    )


def _check_together(plan: ReducePlan, share_run: bool) -> None:
    """Options that would be ignored in this mode: a usage error, before anything is read."""
    from metric_core.metric import LoggingMode

    if share_run and plan.mode is LoggingMode.GLOBAL_REDUCE:
        raise PlanError(
            "shares one W&B run among the sources of a per-rank mode; " + opt("mode") + "'global_reduce' "
            "makes one run already",
            option="share_run",
            value=True,
        )
    if plan.by is By.TIME and plan.mode is LoggingMode.PER_RANK_NO_REDUCE:
        raise PlanError(
            "groups reduced values into windows; " + opt("mode") + "'per_rank_no_reduce' uploads every raw "
            "record at its step (its timestamp is in each row)",
            option="by",
            value="time",
        )


def _prepare(
    root: RunPath,
    plan: ReducePlan,
    *,
    strict: bool,
    follow_symlinks: bool,
    on_progress: OnProgress | None,
    engine: Engine | str,
    ray_address: str | None,
    **mapping: object,
) -> PlannedRuns:
    """Read and reduce the run, and map it to W&B runs (in the reading child, see overlap)."""
    from metric_core.offline.engine import run_plan
    from metric_core.offline.read import explain_read_errors

    read: list[str] = []
    try:
        result = run_plan(
            str(root),
            plan,
            strict=strict,
            follow_symlinks=follow_symlinks,
            on_read=lambda r: read.append(r.summary(spelling=None)),  # spelled by the caller
            on_progress=on_progress,
            engine=engine,
            ray_address=ray_address,
        )
        planned = explain_read_errors(plan_runs)(result, **mapping)
    except MetricLogError as exc:
        exc.read_summary = Message.joined("", read)  # said before the error, by the parent
        raise
    planned.read_summary = Message.joined("", read)
    return planned


def _received(work: Callable[[], PlannedRuns], events: UploadEvents) -> PlannedRuns:
    try:
        return work()
    except MetricLogError as exc:
        if exc.read_summary:
            events.message("warning", spell_options(exc.read_summary, events.spelling))
        raise


def report_planned(planned: PlannedRuns, events: UploadEvents) -> PlannedRuns:
    """What the user should know before anything is sent: skips, renamed keys, W&B's limits."""
    if planned.read_summary:
        events.message("warning", spell_options(planned.read_summary, events.spelling))
    if planned.identity_from == "content":
        events.message(
            "note",
            "no run.json gives a run_id (files another tool wrote?): the upload ids derive from the run's "
            "content (its sources and their first record times)",
        )
    for original, safe in planned.key_mapping.items():
        events.message("note", f"key '{original}' is uploaded as '{safe}' (W&B would reject or mangle it)")
    for warning in planned.warnings:
        events.message("warning", spell_options(warning, events.spelling))
    for note in planned.unmatched:
        events.message("warning", note.text(events.spelling))
    return planned
