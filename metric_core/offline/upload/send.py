"""Sending planned runs to W&B, idempotently and resumably, with the ledger.

W&B's ``_step`` is never passed, so it counts the rows a run received; that count is
what a resumed upload continues from.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from metric_core.errors import MetricLogError, PlanError, UploadError, as_keyword, opt, spell_options
from metric_core.offline.upload.ledger import Ledger
from metric_core.offline.upload.restarts import Source, replacing, stale_steps, steps_said
from metric_core.offline.upload.runs import PlannedRun, PlannedRuns

if TYPE_CHECKING:
    from metric_core.offline.samples import SampleTables

RETRY_DELAYS = (1.0, 2.0, 4.0, 8.0, 16.0)
LEDGER_EVERY_ROWS = 5_000
PROGRESS_EVERY_ROWS = 500  # divides LEDGER_EVERY_ROWS
# A replayed run describes the training run, not the machine replaying it: without these,
# W&B attaches this machine's system metrics, hardware, OS, git state, code and pip
# packages to it. (Collecting them also slowed each wandb.init down.)
REPLAY_SETTINGS = {
    "x_disable_stats": True,
    "x_disable_meta": True,
    "x_save_requirements": False,
    "disable_git": True,
    "disable_code": True,
    "save_code": False,
}
# How long wandb.init may take before W&B is called unreachable (wandb's own default is 90 s):
# a plain upload fails within 15 s with what to do (Destination.connect_timeout).
CONNECT_TIMEOUT = 10.0
# upload --follow tries an unreachable W&B again for this long, backing off up to a minute.
FOLLOW_PATIENCE = 1800.0
FOLLOW_BACKOFF_MAX = 60.0


@dataclass
class RunOutcome:
    """What happened to one planned run."""

    run: PlannedRun
    action: str  # "uploaded", "wrote offline", "resumed", "rewound", "skipped", "restarted"
    run_id: str
    rows_sent: int
    message: str = ""
    sync_dir: str | None = None


@dataclass
class UploadEvents:
    """How an upload reports while it works (it never prints); every callback is optional.

    ``message(kind, text)``: ``kind`` is ``"warning"``, ``"note"`` or ``"info"``.
    ``progress(run, rows_done)`` is called as a run starts and returns a function that
    takes the rows handed over so far.
    """

    message: Callable[[str, str], None] = lambda kind, text: None
    # How a message names an option (``MetricLogError.text``): as Python does, by default.
    spelling: Callable[[str], str] = as_keyword
    progress: Callable[[PlannedRun, int], Callable[[int], None]] | None = None
    # An alarm on values (``Follow.alarms``; an ``alerts.Alert``), as the sidecar finds it.
    alert: Callable[[Any], None] = lambda alert: None


@dataclass
class Destination:
    """Where runs go: W&B project and entity, online or offline, and the local wandb dir."""

    project: str
    entity: str | None = None
    offline: bool = False
    wandb_dir: Path | None = None
    connect_timeout: float = CONNECT_TIMEOUT  # seconds wandb.init may take online


# W&B's rules for project, entity and run names, checked before anything is read or sent
# (W&B rejects these with a 4xx that no retry heals).
_FORBIDDEN = set("/\\#?%:")
MAX_NAME = 128


def check_names(**names: str | None) -> None:
    """Raise ``PlanError`` for a name W&B would reject: e.g. ``check_names(project="a/b")``."""
    for option, value in names.items():
        if value is None:
            continue
        if not value.strip():
            raise PlanError(f"must name a W&B {option}", option=option, value=value)
        if len(value) > MAX_NAME:
            raise PlanError(
                f"is too long: W&B takes at most {MAX_NAME} characters", option=option, value=value
            )
        bad = sorted(_FORBIDDEN & set(value)) if option in ("project", "entity") else []
        if bad:
            raise PlanError(f"holds {' '.join(bad)}, which W&B does not allow", option=option, value=value)


def cannot_heal(exc: BaseException) -> bool:
    """W&B errors that a retry does not fix: authentication, permission, a rejected request."""
    try:
        from wandb.errors import AuthenticationError, UsageError
    except ImportError:  # pragma: no cover - wandb is a dependency
        return False
    if isinstance(exc, (AuthenticationError, UsageError)):
        return True
    status = getattr(getattr(exc, "exc", None), "response", None)
    code = getattr(status, "status_code", None) or getattr(exc, "status_code", None)
    return isinstance(code, int) and 400 <= code < 500 and code not in (408, 429)


def send_runs(
    plan: PlannedRuns,
    ledger: Ledger,
    to: Destination,
    *,
    force_new: bool = False,
    events: UploadEvents | None = None,
    init: Callable[..., Any] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    samples: SampleTables | None = None,
) -> list[RunOutcome]:
    """Send every planned run; ``init`` is ``wandb.init`` unless a test gives a fake."""
    if init is None:
        import wandb

        init = wandb.init
    sender = Sender(plan, ledger, to, force_new, events or UploadEvents(), init, sleep, samples)
    sender.leave_open = plan.open
    return [sender.send(run) for run in plan.runs]


def find_entry(ledger: Ledger | None, run: PlannedRun, to: Destination) -> dict[str, Any] | None:
    """The ledger's newest entry for a planned run; one an earlier version wrote under its
    own id counts when it went to the same destination."""
    if ledger is None:
        return None
    entry = ledger.latest(run.run_id)
    if entry is None and run.legacy_id is not None:
        old = ledger.latest(run.legacy_id)
        if old is not None and (old.get("project"), old.get("entity")) == (to.project, to.entity):
            return old
    return entry


def decide(
    run: PlannedRun, entry: dict[str, Any] | None, offline: bool, force_new: bool
) -> tuple[str, str, str | None, str]:
    """What to do with a planned run, given its ledger entry: (action, W&B run id, resume, why).

    ``action`` is "uploaded" (or "wrote offline"), "resumed", "rewound", "restarted" or
    "skipped"; ``resume`` is "must" (continue where the server stopped), "from:ROW" (rewind
    the run to that row) or None.
    """
    fresh = f"{run.run_id}-{secrets.token_hex(3)}"
    first = "wrote offline" if offline else "uploaded"
    if entry is None:
        return first, run.run_id, None, ""
    if force_new:
        return first, fresh, None, f"uploading again under a fresh id {fresh} (--force-new)"
    restarted = entry.get("attempts", run.attempts) != run.attempts  # the job restarted since
    done = "written offline" if entry.get("offline") else "uploaded"
    stale = stale_in(entry, run)
    if stale:  # an attempt it held flushed since, replacing rows it holds: never skipped nor continued
        return _replaced(run, entry, stale, offline, fresh)
    if entry.get("finished") and not restarted:
        sent = entry.get("rows_sent", 0)
        # the command to copy last on its line: nothing of the sentence sticks to the path
        where = f"; sync it with: wandb sync {entry['sync_dir']}" if entry.get("sync_dir") else ""
        return (
            "skipped",
            run.run_id,
            None,
            f"already {done} ({sent} rows, id {entry.get('id', run.run_id)}): skipped (--force-new "
            f"uploads again under fresh ids){where}",
        )
    new = [
        run.first_steps[a]
        for a in run.attempts
        if a not in entry.get("attempts", []) and a in run.first_steps
    ]
    row = run.first_row_from(min(new)) if restarted and new and not offline else None
    if restarted and row is not None:  # online: W&B rewinds the uploaded run to the restart
        return (
            "rewound",
            entry.get("id", run.run_id),
            f"from:{row}",
            f"{run.name}: the job was restarted from step {min(new)} since it was {done}; the W&B run "
            f"is rewound to its row {row} (resume_from) and the restart's history sent from there",
        )
    if entry.get("finished") or (restarted and not offline):
        return (
            "restarted",
            fresh,
            None,
            f"{run.name}: the job was restarted since it was {done} (new attempts of its sources); "
            f"a fresh {'offline ' if offline else ''}run {fresh} holds its whole history, {run.rows} rows "
            + (
                "(W&B cannot rewind an offline run)"
                if offline
                else "(a run of time windows, or of several sources' raw records, is not rewound)"
            ),
        )
    if offline and entry.get("open"):
        return (
            "restarted",
            fresh,
            None,
            f"{run.name} was written offline while its job ran ({entry.get('rows_sent', 0)} rows); offline "
            f"runs cannot be resumed, so a fresh offline run {fresh} holds all "
            + (f"{run.rows} rows" if run.rows else "its rows"),
        )
    if offline:
        planned = entry.get("rows_planned") or 0
        return (
            "restarted",
            fresh,
            None,
            f"an earlier offline write of {run.name} was interrupted after {entry.get('rows_sent', 0)}"
            + (f" of {planned}" if planned else "")
            + f" rows; offline runs cannot be resumed, so a fresh offline run {fresh} holds all "
            + (f"{run.rows} rows" if run.rows else "its rows"),
        )
    return "resumed", entry.get("id", run.run_id), "must", ""


def stale_in(entry: dict[str, Any] | None, run: PlannedRun) -> dict[Source, tuple[int, int | None]]:
    """The rows of the W&B run of ``entry`` that an attempt it held replaced since they
    were sent, by a flush that came after them (per source, its first and last stale
    step); none for an entry written before the ledger kept the attempts sent. A run whose
    sources have new attempts since is a restart of the job, which ``decide`` sends anew
    whatever it replaced."""
    if entry is None or entry.get("attempts", run.attempts) != run.attempts:
        return {}
    return stale_steps(entry.get("attempts_sent"), run.attempt_steps, entry.get("last_step"))


def _replaced(
    run: PlannedRun,
    entry: dict[str, Any],
    stale: dict[Source, tuple[int, int | None]],
    offline: bool,
    fresh: str,
) -> tuple[str, str, str | None, str]:
    """``decide`` for a W&B run holding rows a restart replaced since they were sent: online,
    rewound to the first of them where its rows allow; else a fresh run holding the whole
    new history (as the follow writes one)."""
    first = min(lo for lo, _ in stale.values())
    old = entry.get("id", run.run_id)
    said = (
        f"{run.name}: {replacing({source: lo for source, (lo, _) in stale.items()})}: "
        f"{steps_said(stale, f'the W&B run {old}')} sent before it"
    )
    row = None if offline else run.first_row_from(first)
    if row is not None:
        return (
            "rewound",
            old,
            f"from:{row}",
            f"{said}; it is rewound to its row {row} (resume_from) and the restart's history sent from there",
        )
    where = (
        "its files are removed (if it was synced already, delete it in W&B)"
        if offline
        else "it stays in W&B as it is: delete it there"
    )
    return (
        "restarted",
        fresh,
        None,
        f"{said}; a fresh {'offline ' if offline else ''}run {fresh} holds its whole history, "
        f"{run.rows} rows. The earlier run: {where}",
    )


@dataclass
class Sender:
    """Hands planned runs to W&B: ``send`` a whole run, or ``open``, ``log_rows`` as they
    come (``upload --follow``) and ``close``."""

    plan: PlannedRuns
    ledger: Ledger
    to: Destination
    force_new: bool
    events: UploadEvents
    init: Callable[..., Any]
    sleep: Callable[[float], None]
    samples: SampleTables | None = None  # each step's chosen samples, as tables in its row
    patience: float | None = None  # seconds an unreachable W&B is tried again (upload --follow)
    # Called after a start that timed out, before the next try: wandb's service still holds
    # the run id of a start it gave up on ("run ID ... is in use") until it is torn down.
    after_timeout: Callable[[], None] | None = None
    # The job still writes the run (``PlannedRuns.open``): a run sent whole is left unfinished
    # in the ledger, so a later upload continues it with the rows that settle meanwhile.
    leave_open: bool = False

    def send(self, run: PlannedRun) -> RunOutcome:
        outcome, wb = self.open(run)
        if wb is not None:
            outcome.rows_sent = self._log(wb, run, outcome.run_id, outcome.rows_sent)
        return outcome

    def open(self, run: PlannedRun) -> tuple[RunOutcome, Any]:
        """Start (or resume) the W&B run of ``run`` as its ledger entry says (``decide``):
        what is done, with ``rows_sent`` the rows W&B holds already (where to go on from),
        and the W&B run; None for a run skipped."""
        entry = find_entry(self.ledger, run, self.to)
        action, run_id, resume, message = decide(run, entry, self.to.offline, self.force_new)
        if action == "skipped":
            return RunOutcome(run, action, run_id, (entry or {}).get("rows_sent", 0), message), None
        stale = bool(stale_in(entry, run)) and not self.force_new
        if stale:  # said once, as a warning: the destination held values that were not the run's
            self.events.message("warning", spell_options(message, self.events.spelling))
            message = ""
        start = 0
        self.ledger.update(
            run_id,
            name=run.name,
            group=run.group,
            project=self.to.project,
            entity=self.to.entity,
            rows_planned=run.rows,
            rows_sent=0 if resume is None else entry.get("rows_sent", 0),  # type: ignore[union-attr]
            finished=False,
            open=False,
            offline=self.to.offline,
            base_id=run.run_id,
            attempts=run.attempts,
            attempts_sent=run.attempt_steps,
            last_step=run.last_step(),
        )
        if action == "restarted" and entry is not None and stale:
            self.remove_partial(entry)  # said with the warning
        elif action == "restarted" and entry is not None and not entry.get("finished"):
            message += self.remove_partial(entry)
        wb = self._start(run, run_id, resume)
        sync_dir = getattr(wb, "sync_dir", None) if self.to.offline else None
        if sync_dir:  # so that a kill before the end leaves a ledger that knows what to remove
            self.ledger.update(run_id, sync_dir=str(Path(sync_dir).resolve()))  # said from anywhere
        if resume and resume.startswith("from:"):
            start = int(resume.removeprefix("from:"))
        elif resume:
            start = int(getattr(wb, "step", 0) or 0)  # rows the server already holds (_step counts them)
            message = f"resuming {run.name} at row {start}" + (f" of {run.rows}" if run.rows else "")
        if run.x_axis is not None:
            wb.define_metric(run.x_axis)
            wb.define_metric("*", step_metric=run.x_axis)
        return RunOutcome(run, action, run_id, start, message, str(sync_dir) if sync_dir else None), wb

    def log_rows(self, wb: Any, rows: Iterable[dict[str, Any]], run: PlannedRun | None = None) -> int:
        """Hand ``rows`` (of ``run``) to W&B (retrying what heals); how many were handed over."""
        n = 0
        for row in self._with_samples(rows, run):
            self._retry(functools.partial(wb.log, row), "logging to W&B")
            n += 1
        return n

    def close(self, wb: Any, outcome: RunOutcome, *, finished: bool, **fields: Any) -> None:
        """Finish the W&B run; the ledger says whether it holds everything (``finished``)."""
        try:
            if finished:
                self._final_tables(wb, outcome.run)
            self._retry(wb.finish, "finishing the W&B run")
        finally:
            self.ledger.update(outcome.run_id, rows_sent=outcome.rows_sent, finished=finished, **fields)

    def _start(self, run: PlannedRun, run_id: str, resume: str | None) -> Any:
        """``wandb.init`` of ``run``. A server that does not answer within the connect timeout
        fails at once, or, with ``patience`` (``upload --follow``), is tried again with
        backoff, saying so, for that many seconds."""
        timeout = 0.9 * self.to.connect_timeout
        waited, delay = 0.0, 1.0
        while True:
            began = time.monotonic()
            try:
                return self._retry(
                    lambda: self.init(**self._init_args(run, run_id, resume)), "starting the W&B run", timeout
                )
            except UploadError as exc:
                if self.to.offline or time.monotonic() - began < timeout:
                    raise
                error = self._unreachable(exc)
                waited += time.monotonic() - began
                if self.patience is None or waited >= self.patience:
                    raise error from None
            self.events.message(
                "warning",
                f"{error.text(self.events.spelling)}; trying again in {delay:.0f} s "
                f"(for {(self.patience or 0) / 60:.0f} min in all)",
            )
            if self.after_timeout is not None:
                self.after_timeout()
            self.sleep(delay)
            waited += delay
            delay = min(2 * delay, FOLLOW_BACKOFF_MAX)

    def _unreachable(self, exc: UploadError) -> UploadError:
        host = os.environ.get("WANDB_BASE_URL") or "W&B's default server"
        why = str(exc.__cause__ or exc).split("Consider increasing")[0].strip().splitlines()[0].rstrip(".")
        return UploadError(
            f"could not reach W&B ({host}) within {self.to.connect_timeout:g} s ({why}): check the "
            f"network ("
            + opt("connect_timeout")
            + "SECONDS waits longer), or write offline runs with "
            + opt("offline", flag=True)
            + " and `wandb sync` them later"
        )

    def remove_partial(self, entry: dict[str, Any]) -> str:
        """The files of an interrupted offline run: `wandb sync` would send them beside the redo."""
        partial = Path(entry.get("sync_dir") or "")
        home = self.to.wandb_dir or os.environ.get("WANDB_DIR")
        if not entry.get("sync_dir") or home is None or not partial.is_dir():
            return ""
        if not partial.resolve().is_relative_to(Path(home).resolve()):
            return f" (remove {partial}, the interrupted run's files, before `wandb sync`)"
        shutil.rmtree(partial, ignore_errors=True)
        return f"; the interrupted run's files {partial.name} were removed (`wandb sync` would send them too)"

    def _init_args(self, run: PlannedRun, run_id: str, resume: str | None) -> dict[str, Any]:
        args = {
            "project": self.to.project,
            "entity": self.to.entity,
            "id": run_id,
            "name": run.name,
            "group": run.group,
            "config": self.plan.config,
            "mode": "offline" if self.to.offline else "online",
            "reinit": "create_new",
            "dir": str(self.to.wandb_dir) if self.to.wandb_dir else None,
            "settings": {**REPLAY_SETTINGS, "init_timeout": self.to.connect_timeout},
        }
        if resume and resume.startswith("from:"):  # W&B's rewind: drop the rows from there on
            args["resume_from"] = f"{run_id}?_step={resume.removeprefix('from:')}"
        elif resume:
            args["resume"] = resume
        return args

    def _log(self, wb: Any, run: PlannedRun, run_id: str, start: int) -> int:
        """Hand the rows from ``start`` on to W&B and finish the run; the rows sent."""
        tick = self.events.progress(run, start) if self.events.progress else (lambda n: None)
        sent = start
        try:
            for row in self._with_samples(run.history(start), run):
                self._retry(functools.partial(wb.log, row), "logging to W&B")
                sent += 1
                if sent % PROGRESS_EVERY_ROWS == 0:
                    tick(sent)
                    if sent % LEDGER_EVERY_ROWS == 0:
                        self.ledger.update(run_id, rows_sent=sent)
            tick(sent)
            if not self.leave_open:
                self._final_tables(wb, run)
            self._retry(wb.finish, "finishing the W&B run")
        except BaseException:
            self.ledger.update(run_id, rows_sent=sent)
            raise
        self.ledger.update(run_id, rows_sent=sent, finished=not self.leave_open, open=self.leave_open)
        return sent

    def _final_tables(self, wb: Any, run: PlannedRun) -> None:
        """``--sample-tables incremental``: at a run's end (not while its job still writes it),
        each key's samples once more, whole, as an IMMUTABLE table under the key, in a row of
        their own at the last step that took samples (torchforge's end of a run)."""
        if not self.samples:
            return
        finals = self.samples.finals(run.source)
        if not finals:
            return
        renamed = self.samples.renamed
        row = {self._samples_key(renamed, key, set(run.keys), {}): table for key, table in finals.items()}
        if run.x_axis == "step" and run.source in self.samples.last_step:
            row["step"] = self.samples.last_step[run.source]
        self._retry(functools.partial(wb.log, row), "logging to W&B")

    def _samples_key(self, renamed: set[str], key: str, scalars: set[str], row: dict[str, Any]) -> str:
        """The key samples go under: ``{key}_samples`` when ``key`` is a scalar key too (said
        once; ``renamed`` holds the keys said)."""
        if key in scalars or key in row or key in renamed:
            if key not in renamed:
                renamed.add(key)
                self.events.message(
                    "note",
                    f"samples of '{key}' go as '{key}_samples': '{key}' is also a scalar key",
                )
            key = f"{key}_samples"
        return key

    def _with_samples(
        self, rows: Iterable[dict[str, Any]], run: PlannedRun | None
    ) -> Iterator[dict[str, Any]]:
        """``rows``, the first row of each step also holding that step's sample tables; a
        samples key that is a scalar key of the run too goes as ``{key}_samples``."""
        if not self.samples or run is None:
            yield from rows
            return
        scalars = set(run.keys)
        for row in rows:
            step = row.get("step")
            if isinstance(step, int):
                for key, table in self.samples.tables(run.source, step).items():
                    row[self._samples_key(self.samples.renamed, key, scalars, row)] = table
            yield row

    def _retry(self, call: Callable[[], Any], what: str, timeout: float | None = None) -> Any:
        """Retry W&B failures (network, 429, 5xx) with exponential backoff, then give up; a call
        that failed only after ``timeout`` seconds timed out, and is not retried."""
        for attempt, delay in enumerate((*RETRY_DELAYS, None)):
            began = time.monotonic()
            try:
                return call()
            except (KeyboardInterrupt, MetricLogError):
                raise
            except Exception as exc:
                timed_out = timeout is not None and time.monotonic() - began >= timeout
                if cannot_heal(exc) or timed_out:
                    raise UploadError(f"{what} failed: {exc}") from exc
                if delay is None:
                    raise UploadError(f"{what} failed {attempt + 1} times: {exc}") from exc
                self.events.message("warning", f"{what} failed ({exc}); retrying in {delay:.0f}s")
                self.sleep(delay)
        raise AssertionError("unreachable")
