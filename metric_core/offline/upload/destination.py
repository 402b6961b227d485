"""The destination contract: what W&B, TensorBoard and MLflow each implement, so that
``upload_run`` and ``upload --follow`` are written once, against it (as dvclive's ``Data``
gives every output kind the same verbs).

A ``Destination`` says where runs go: the ids it enters (``request``), the names it
refuses (``check``), the ledger of what it holds already (``ledger``), and what to do
with a planned run given its ledger entry (``decide``). Its ``sender`` hands runs over:

* ``open(run)``: open the destination's run for a planned run, or resume it, as its
  ledger entry says; the rows it holds already (where to go on from), or None: skipped;
* ``log_rows(handle, rows, run)``: a step's rows (each row's samples go with it:
  ``log_samples``);
* ``close(handle, outcome, finished=...)``: the run is whole (``finished``) or stays open
  for a later upload to continue.

``Sender.send`` (a whole run, for a plain upload) is written once here, from these verbs.
The ledger (``ledger.Ledger``) is one format for every destination: per run id, the rows
handed over, whether it finished, and the writers' attempts its rows hold.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from metric_core.errors import PlanError, as_keyword
from metric_core.offline.upload.ledger import Ledger
from metric_core.offline.upload.restarts import Source, stale_steps
from metric_core.offline.upload.runs import PlannedRun, PlannedRuns

if TYPE_CHECKING:
    from metric_core.offline.samples import SampleTables
    from metric_core.offline.storage import RunPath

LEDGER_EVERY_ROWS = 5_000
PROGRESS_EVERY_ROWS = 500  # divides LEDGER_EVERY_ROWS


@dataclass
class RunOutcome:
    """What happened to one planned run."""

    run: PlannedRun
    action: str  # "uploaded", "wrote offline", "resumed", "rewound", "skipped", "restarted", ...
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


def would_be(action: str) -> str:
    """An action (a past tense: "uploaded", "wrote offline") as a dry run says it after
    "would be": "written offline", "written to TensorBoard"."""
    return "written" + action.removeprefix("wrote") if action.startswith("wrote ") else action


@dataclass
class Decision:
    """What to do with a planned run: ``action``, the id it goes under, how to resume
    (None: from its start; "must": where the destination stopped; "from:ROW": rewound to
    that row), and why (said)."""

    action: str
    run_id: str
    resume: str | None = None
    message: str = ""


class Destination:
    """Where runs go. Subclasses: ``send.WandB``, ``tensorboard.TensorBoard``, ``mlflow.MLflow``."""

    kind: ClassVar[str] = ""  # its name in messages: "W&B", "TensorBoard", "MLflow"
    takes_samples: ClassVar[bool] = True  # False: samples are said, not sent
    # Its client takes a while to import: it is imported while a child reads the run (``overlap``).
    slow_client: ClassVar[bool] = False

    # The most characters of a run or group name it takes (None: no rule of its own).
    longest_name: ClassVar[int | None] = None

    def check(self, *, name: str | None, group: str | None) -> None:
        """Raise ``PlanError`` for a name the destination would refuse, before anything is read."""
        check_names(self.kind, self.longest_name, group=group, name=name)

    def request(self, name: str | None, group: str | None, *, run_name: str) -> dict[str, Any]:
        """What identifies this destination in the runs' ids, with the names the user gave
        (None: the defaults; ``run_name`` is the run directory's)."""
        raise NotImplementedError

    def ready(self, events: UploadEvents, dry_run: bool) -> tuple[Destination, bool]:
        """This destination as the environment sets it, and whether the upload is a dry run;
        raises when it cannot be reached (no credentials)."""
        return self, dry_run

    def load_client(self) -> None:
        """Import the destination's client (a missing one: ``MissingDependencyError``)."""

    def ledger(self, root: RunPath | None, identity: str, *, create: bool = True) -> Ledger | None:
        """The ledger of what this destination holds of the run (``create=False``: None when
        there is none, and nothing is made); ``root`` None: of no run directory (a comparison
        of runs), the user cache's."""
        if root is None:
            return Ledger.in_cache(identity, create=create)
        if create:
            return Ledger.for_run_dir(root, identity)
        return Ledger.existing(root, identity)

    def owns(self, entry: dict[str, Any]) -> bool:
        """Whether a ledger entry an earlier version wrote under its own id went here."""
        return False

    def decide(self, run: PlannedRun, entry: dict[str, Any] | None, force_new: bool) -> Decision:
        """What to do with ``run`` given its ledger entry (``find_entry``)."""
        raise NotImplementedError

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
        """What hands ``planned``'s runs over (``live``: as the job writes them, ``--follow``)."""
        raise NotImplementedError

    def left_behind(self) -> str:
        """Said of a run a follow gives up for a fresh one (a restart replaced its rows)."""
        return f"it is left unfinished in {self.kind}; delete it there"


def find_entry(ledger: Ledger | None, run: PlannedRun, to: Destination) -> dict[str, Any] | None:
    """The ledger's newest entry for a planned run; one an earlier version wrote under its
    own id counts when it went to the same destination."""
    if ledger is None:
        return None
    entry = ledger.latest(run.run_id)
    if entry is None and run.legacy_id is not None:
        old = ledger.latest(run.legacy_id)
        if old is not None and to.owns(old):
            return old
    return entry


def stale_in(entry: dict[str, Any] | None, run: PlannedRun) -> dict[Source, tuple[int, int | None]]:
    """The rows of the destination's run of ``entry`` that an attempt it held replaced
    since they were sent, by a flush that came after them (per source, its first and last
    stale step); none for an entry written before the ledger kept the attempts sent. A run
    whose sources have new attempts since is a restart of the job, which ``decide`` sends
    anew whatever it replaced."""
    if entry is None or entry.get("attempts", run.attempts) != run.attempts:
        return {}
    return stale_steps(entry.get("attempts_sent"), run.attempt_steps, entry.get("last_step"))


def is_done(entry: dict[str, Any] | None, run: PlannedRun) -> bool:
    """The entry holds the whole run as planned now: finished, the same attempts, none replaced."""
    return bool(
        entry
        and entry.get("finished")
        and entry.get("attempts", run.attempts) == run.attempts
        and not stale_in(entry, run)
    )


@dataclass
class Sender:
    """Hands planned runs to a destination: ``send`` a whole run, or ``open``, ``log_rows``
    as they come (``upload --follow``) and ``close``. Subclasses implement ``start``,
    ``log_rows`` and ``finish``."""

    plan: PlannedRuns
    ledger: Ledger
    to: Destination
    force_new: bool
    events: UploadEvents
    samples: SampleTables | None = None  # each step's chosen samples, sent with its row
    live: bool = False  # ``upload --follow``: rows come as the job writes them
    rows_logged: int = 0  # rows ``log_rows`` handed over (so far, when it fails part-way)

    def send(self, run: PlannedRun) -> RunOutcome:
        """The whole of ``run``, from where the destination stopped; the ledger kept as it goes."""
        outcome, handle = self.open(run)
        if handle is None:
            return outcome
        tick = self.events.progress(run, outcome.rows_sent) if self.events.progress else (lambda n: None)
        rows = run.history(outcome.rows_sent)
        saved = outcome.rows_sent
        before = self.rows_logged - outcome.rows_sent
        try:
            while chunk := list(itertools.islice(rows, PROGRESS_EVERY_ROWS)):
                self.log_rows(handle, chunk, run)
                outcome.rows_sent = self.rows_logged - before
                tick(outcome.rows_sent)
                if outcome.rows_sent - saved >= LEDGER_EVERY_ROWS:
                    self.ledger.update(outcome.run_id, rows_sent=outcome.rows_sent)
                    saved = outcome.rows_sent
            tick(outcome.rows_sent)
        except BaseException:
            outcome.rows_sent = self.rows_logged - before  # the rows handed over before it failed
            self.ledger.update(outcome.run_id, rows_sent=outcome.rows_sent)
            raise
        # The job still writes the run (``PlannedRuns.open``): it is left unfinished in the
        # ledger, so a later upload continues it with the rows that settle meanwhile.
        self.close(handle, outcome, finished=not self.plan.open, open=self.plan.open)
        return outcome

    def open(self, run: PlannedRun) -> tuple[RunOutcome, Any]:
        """Open (or resume) the destination's run of ``run`` as its ledger entry says
        (``decide``): what is done, with ``rows_sent`` the rows it holds already (where to
        go on from), and a handle to log to; None for a run skipped."""
        entry = find_entry(self.ledger, run, self.to)
        decision = self.to.decide(run, entry, self.force_new)
        if decision.action == "skipped":
            rows = (entry or {}).get("rows_sent", 0)
            return RunOutcome(run, "skipped", decision.run_id, rows, decision.message), None
        if stale_in(entry, run) and not self.force_new:  # the destination held values not the run's
            self.events.message("warning", decision.message)
            decision.message = ""
        self.ledger.update(
            decision.run_id,
            name=run.name,
            group=run.group,
            rows_planned=run.rows,
            rows_sent=0 if decision.resume is None else (entry or {}).get("rows_sent", 0),
            finished=False,
            open=False,
            base_id=run.run_id,
            **self.held(run),
            **self.entry_fields(),
        )
        outcome = RunOutcome(run, decision.action, decision.run_id, 0, decision.message)
        handle = self.start(run, decision, entry, outcome)
        return outcome, handle

    def held(self, run: PlannedRun) -> dict[str, Any]:
        """What the ledger keeps of the records a run's rows hold, for a later upload to
        tell a restart into them (``restarts``)."""
        return {"attempts": run.attempts, "attempts_sent": run.attempt_steps, "last_step": run.last_step()}

    def entry_fields(self) -> dict[str, Any]:
        """What the ledger keeps of the destination with each run (W&B: project, entity)."""
        return {}

    def start(
        self, run: PlannedRun, decision: Decision, entry: dict[str, Any] | None, outcome: RunOutcome
    ) -> Any:
        """Open the destination's run; set ``outcome.rows_sent`` to the rows it holds already."""
        raise NotImplementedError

    def log_rows(self, handle: Any, rows: Iterable[dict[str, Any]], run: PlannedRun) -> int:
        """Hand ``rows`` of ``run`` over, each step's samples with its row; how many were
        (each counted in ``rows_logged`` once it went)."""
        raise NotImplementedError

    def close(self, handle: Any, outcome: RunOutcome, *, finished: bool, **fields: Any) -> None:
        """End the destination's run; the ledger says whether it holds everything (``finished``)."""
        more: dict[str, Any] = {}
        try:
            more = self.finish(handle, outcome, finished)
        finally:
            self.ledger.update(
                outcome.run_id, rows_sent=outcome.rows_sent, finished=finished, **fields, **more
            )

    def finish(self, handle: Any, outcome: RunOutcome, finished: bool) -> dict[str, Any]:
        """End the destination's run; what more the ledger keeps of it."""
        raise NotImplementedError

    def discard(self, outcome: RunOutcome) -> None:
        """A run a follow gave up for a fresh one: remove what of it must not be sent later."""


def step_values(
    row: dict[str, Any], run: PlannedRun, index: int
) -> tuple[int, float | None, dict[str, float]]:
    """A history row as a destination with an integer step takes it (TensorBoard, MLflow):
    its step, its time (a raw record's own; None for a reduced step, which has none) and
    its values. A window of time (``--by time``) is at its number, ``index`` (its row's),
    and its start."""
    values = {
        k: float(v) for k, v in row.items() if k not in (run.bucket, "step", "_timestamp") and v is not None
    }
    if run.bucket == "step":
        return int(row["step"]), row.get("_timestamp"), values
    return index, row.get(run.bucket), values


def send_runs(
    planned: PlannedRuns,
    ledger: Ledger,
    to: Destination,
    *,
    force_new: bool = False,
    events: UploadEvents | None = None,
    samples: SampleTables | None = None,
) -> list[RunOutcome]:
    """Send every planned run to ``to``, as its ledger entry says (skipped, resumed, ...)."""
    sender = to.sender(planned, ledger, force_new=force_new, events=events or UploadEvents(), samples=samples)
    return [sender.send(run) for run in planned.runs]


def check_names(kind: str, longest: int | None, **names: str | None) -> None:
    """Raise ``PlanError`` for a name ``kind`` would refuse: blank, or of more than
    ``longest`` characters. E.g. ``check_names("W&B", 128, group=" ")``."""
    for option, value in names.items():
        if value is None:
            continue
        if not value.strip():
            noun = "run" if option == "name" else option
            raise PlanError(f"is blank: {kind} needs a {noun} name", option=option, value=value)
        if longest is not None and len(value) > longest:
            raise PlanError(
                f"is too long: {kind} takes at most {longest} characters", option=option, value=value
            )
