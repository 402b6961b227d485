"""W&B as a destination (``destination.Destination``): idempotent and resumable.

W&B's ``_step`` is never passed, so it counts the rows a run received; that count is
what a resumed upload continues from.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from metric_core.credentials import has_credentials
from metric_core.errors import MetricLogError, NotLoggedInError, PlanError, UploadError, opt, spell_options
from metric_core.offline.upload.destination import (
    Decision,
    Destination,
    RunOutcome,
    Sender,
    UploadEvents,
    check_names,
    find_entry,
    send_runs,
    stale_in,
)
from metric_core.offline.upload.ledger import Ledger
from metric_core.offline.upload.restarts import Source, replacing, steps_said
from metric_core.offline.upload.runs import PlannedRun, PlannedRuns

if TYPE_CHECKING:
    from metric_core.offline.samples import SampleTables

__all__ = ["RunOutcome", "UploadEvents", "WandB", "WandBSender", "find_entry", "send_runs"]

RETRY_DELAYS = (1.0, 2.0, 4.0, 8.0, 16.0)
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
# a plain upload fails within 15 s with what to do (WandB.connect_timeout).
CONNECT_TIMEOUT = 10.0
# upload --follow tries an unreachable W&B again for this long, backing off up to a minute.
FOLLOW_PATIENCE = 1800.0
FOLLOW_BACKOFF_MAX = 60.0
# W&B's rules for project, entity and run names, checked before anything is read or sent
# (W&B rejects these with a 4xx that no retry heals).
_FORBIDDEN = set("/\\#?%:")
MAX_NAME = 128


@dataclass
class WandB(Destination):
    """Where runs go in W&B: project and entity, online or offline, and the local wandb dir."""

    project: str
    entity: str | None = None
    offline: bool = False
    wandb_dir: Path | None = None
    connect_timeout: float = CONNECT_TIMEOUT  # seconds wandb.init may take online
    init: Callable[..., Any] | None = None  # wandb.init, unless a test gives a fake
    sleep: Callable[[float], None] = time.sleep  # between retries (a test's records them)

    kind = "W&B"
    slow_client = True

    def check(self, *, name: str | None, group: str | None) -> None:
        check_wandb_names(project=self.project, entity=self.entity, group=group, name=name)

    def request(self, name: str | None, group: str | None, *, run_name: str) -> dict[str, Any]:
        return {"entity": self.entity, "project": self.project, "name": name, "group": group}

    def ready(self, events: UploadEvents, dry_run: bool) -> tuple[Destination, bool]:
        to: WandB = self
        mode = os.environ.get("WANDB_MODE", "").strip().lower()
        if mode in ("offline", "dryrun") and not self.offline:
            events.message(
                "note",
                spell_options(
                    f"WANDB_MODE={mode} is set: writing offline runs, as "
                    + opt("offline", flag=True)
                    + " does",
                    events.spelling,
                ),
            )
            to = dataclasses.replace(self, offline=True)
        if mode == "disabled" and not dry_run:
            events.message("note", "WANDB_MODE=disabled is set: nothing is uploaded, as in a dry run")
            dry_run = True
        if not dry_run and not to.offline and not has_credentials():
            raise NotLoggedInError()
        return to, dry_run

    def load_client(self) -> None:
        import wandb  # noqa: F401

    def owns(self, entry: dict[str, Any]) -> bool:
        return (entry.get("project"), entry.get("entity")) == (self.project, self.entity)

    def decide(self, run: PlannedRun, entry: dict[str, Any] | None, force_new: bool) -> Decision:
        return Decision(*decide(run, entry, self.offline, force_new))

    def left_behind(self) -> str:
        return "its files are removed" if self.offline else "it is left unfinished in W&B; delete it there"

    def sender(
        self,
        planned: PlannedRuns,
        ledger: Ledger,
        *,
        force_new: bool,
        events: UploadEvents,
        samples: SampleTables | None = None,
        live: bool = False,
    ) -> Sender:
        to = self
        if to.wandb_dir is None and not os.environ.get("WANDB_DIR"):
            to = dataclasses.replace(to, wandb_dir=ledger.path.parent)
        if live:  # a sidecar outlasts a network outage
            return WandBSender(
                planned, ledger, to, force_new, events, samples, live=True, patience=FOLLOW_PATIENCE,
                after_timeout=None if self.init is not None else _wandb_teardown,
            )  # fmt: skip
        return WandBSender(planned, ledger, to, force_new, events, samples)


def _wandb_teardown() -> None:
    import wandb

    wandb.teardown()


def check_wandb_names(**names: str | None) -> None:
    """Raise ``PlanError`` for a name W&B would reject: e.g. ``check_wandb_names(project="a/b")``."""
    check_names("W&B", MAX_NAME, **names)
    for option in ("project", "entity"):
        value = names.get(option)
        bad = sorted(_FORBIDDEN & set(value)) if value is not None else []
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
class WandBSender(Sender):
    """Hands planned runs to W&B (``Sender``'s verbs, by ``wandb.init``, ``log`` and ``finish``)."""

    to: WandB
    patience: float | None = None  # seconds an unreachable W&B is tried again (upload --follow)
    # Called after a start that timed out, before the next try: wandb's service still holds
    # the run id of a start it gave up on ("run ID ... is in use") until it is torn down.
    after_timeout: Callable[[], None] | None = None

    @property
    def init(self) -> Callable[..., Any]:
        if self.to.init is not None:
            return self.to.init
        import wandb

        return wandb.init

    def sleep(self, seconds: float) -> None:
        self.to.sleep(seconds)

    def entry_fields(self) -> dict[str, Any]:
        return {"project": self.to.project, "entity": self.to.entity, "offline": self.to.offline}

    def start(
        self, run: PlannedRun, decision: Decision, entry: dict[str, Any] | None, outcome: RunOutcome
    ) -> Any:
        """``wandb.init`` of the W&B run, as ``decide`` said: new, resumed where the server
        stopped, or rewound; the files of an offline run it replaces removed."""
        run_id, resume = decision.run_id, decision.resume
        if decision.action == "restarted" and entry is not None:
            if stale_in(entry, run) and not self.force_new:
                self.remove_partial(entry)  # said with the warning
            elif not entry.get("finished"):
                outcome.message += self.remove_partial(entry)
        wb = self._start(run, run_id, resume)
        sync_dir = getattr(wb, "sync_dir", None) if self.to.offline else None
        if sync_dir:  # so that a kill before the end leaves a ledger that knows what to remove
            outcome.sync_dir = str(Path(sync_dir).resolve())  # said from anywhere
            self.ledger.update(run_id, sync_dir=outcome.sync_dir)
        if resume and resume.startswith("from:"):
            outcome.rows_sent = int(resume.removeprefix("from:"))
        elif resume:
            outcome.rows_sent = int(getattr(wb, "step", 0) or 0)  # rows the server holds (_step counts them)
            outcome.message = f"resuming {run.name} at row {outcome.rows_sent}" + (
                f" of {run.rows}" if run.rows else ""
            )
        if run.x_axis is not None:
            wb.define_metric(run.x_axis)
            wb.define_metric("*", step_metric=run.x_axis)
        return wb

    def log_rows(self, wb: Any, rows: Iterable[dict[str, Any]], run: PlannedRun) -> int:
        """Hand ``rows`` (of ``run``) to W&B (retrying what heals); how many were handed over."""
        n = 0
        for row in self._with_samples(rows, run):
            self._retry(functools.partial(wb.log, row), "logging to W&B")
            n += 1
            self.rows_logged += 1
        return n

    def finish(self, wb: Any, outcome: RunOutcome, finished: bool) -> dict[str, Any]:
        """Finish the W&B run; a whole one gets its final tables first."""
        if finished:
            self._final_tables(wb, outcome.run)
        self._retry(wb.finish, "finishing the W&B run")
        return {}

    def discard(self, outcome: RunOutcome) -> None:
        if outcome.sync_dir:  # offline: `wandb sync` must not send the replaced rows
            self.remove_partial({"sync_dir": outcome.sync_dir})

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
        args: dict[str, Any] = {
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
        if self.plan.tags:
            args["tags"] = self.plan.tags
        if resume and resume.startswith("from:"):  # W&B's rewind: drop the rows from there on
            args["resume_from"] = f"{run_id}?_step={resume.removeprefix('from:')}"
        elif resume:
            args["resume"] = resume
        return args

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
