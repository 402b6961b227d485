"""MLflow as a destination: each planned run an MLflow run, written with ``MlflowClient``.

* the tracking store: ``tracking_uri``, else ``MLFLOW_TRACKING_URI``, else
  ``sqlite:///mlruns.db`` in the current directory (never MLflow's ``./mlruns`` file store,
  which MLflow refuses by default from 3.17 on); an experiment metriclog creates in a
  SQLite store keeps its artifacts in ``mlartifacts/`` beside the database;
* a run per planned run (global: one; per-rank: one per source, tagged with its process
  and rank), named as the W&B run would be; the run's config as params (nested keys
  joined with ``.``), run.json's facts as tags (``metriclog.*``);
* every value by ``log_batch`` (at most ``MAX_METRICS_PER_BATCH`` metrics a call), at its
  step (``--by time``: its window's number) and a timestamp in integer milliseconds from
  the records (a raw record's own; a window's start; a reduced step's: its run's first
  record time, as a reduced step has no time of its own), so a second upload sends the
  same metrics;
* each step's chosen samples as a JSON artifact ``samples/step_{step}.json``.

The ledger is the run directory's (``Ledger.for_run_dir``). A run the ledger knows
unfinished (a killed upload, or a job that still wrote it) is continued: the MLflow run
is asked which values it holds already (``get_metric_history``), and those are not sent
again, so a step is never there twice. MLflow's SQL store keeps +-inf as
+-1.7976931348623157e308 (the largest double), and a key may hold at most 250 characters.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from metric_core.errors import MissingDependencyError, RequestError, UploadError
from metric_core.offline.mlflow_store import tracking_uri
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

MAX_METRICS_PER_BATCH = 1_000  # MLflow's limit of metrics in one log_batch
MAX_PARAMS_PER_BATCH = 100  # and of params
MAX_KEY = 250  # characters of a metric or param key
MAX_PARAM_VALUE = 6_000  # characters of a param's value
MAX_RUN_NAME = 250  # characters of a run's name (its SQL store's column)
UPLOADED = "uploaded to MLflow"
DBL_MAX = 1.7976931348623157e308  # what MLflow's SQL store keeps for an infinity


@dataclass(frozen=True)
class MLflow(Destination):
    """Where runs go in MLflow: a tracking store (``tracking_uri``; None: ``MLFLOW_TRACKING_URI``,
    else ``sqlite:///mlruns.db`` here) and an experiment (created if there is none: not
    MLflow's ``Default``, whose artifacts go to ``./mlruns``)."""

    tracking_uri: str | None = None
    experiment: str = "metriclog"

    kind = "MLflow"
    slow_client = True  # mlflow takes seconds to import: done while a child reads the run
    longest_name = MAX_RUN_NAME

    def request(self, name: str | None, group: str | None, *, run_name: str) -> dict[str, Any]:
        return {"mlflow": self.tracking_uri, "experiment": self.experiment, "name": name, "group": group}

    def ready(self, events: UploadEvents, dry_run: bool) -> tuple[Destination, bool]:
        """The tracking URI made whole: a SQLite file named relative to here is named absolute,
        so the runs' ids do not depend on where the upload was started."""
        return MLflow(tracking_uri(self.tracking_uri), self.experiment), dry_run

    def load_client(self) -> None:
        try:
            import mlflow  # noqa: F401
            import sqlalchemy  # noqa: F401
        except ImportError:
            raise MissingDependencyError(
                "--to mlflow writes with the MLflow client: pip install 'metriclog[mlflow]'"
            ) from None

    def decide(self, run: PlannedRun, entry: dict[str, Any] | None, force_new: bool) -> Decision:
        fresh = f"{run.run_id}-{secrets.token_hex(3)}"
        if entry is None:
            return Decision(UPLOADED, run.run_id)
        old = entry.get("mlflow_run_id", "")
        if force_new:
            return Decision(UPLOADED, fresh, None, f"uploading again under a fresh id {fresh} (--force-new)")
        if is_done(entry, run):
            return Decision(
                "skipped",
                run.run_id,
                None,
                f"already uploaded to MLflow ({entry.get('rows_sent', 0)} rows, MLflow run {old}): skipped "
                "(--force-new uploads again under fresh ids)",
            )
        stale = stale_in(entry, run)
        if stale:
            return Decision(
                "restarted",
                fresh,
                None,
                f"{run.name}: {replacing({s: lo for s, (lo, _) in stale.items()}, 'MLflow')}: "
                f"{steps_said(stale, f'the MLflow run {old}')} sent before it; a fresh MLflow run holds its "
                "whole history (delete the earlier one in MLflow)",
            )
        if entry.get("attempts", run.attempts) != run.attempts:
            return Decision(
                "restarted",
                fresh,
                None,
                f"{run.name}: the job was restarted since it was uploaded (new attempts of its sources); a "
                f"fresh MLflow run holds its whole history, {run.rows} rows (the earlier one, {old}, stays)",
            )
        return Decision("resumed", entry.get("id", run.run_id), "must")

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
        from mlflow.tracking import MlflowClient

        for name in ("mlflow", "alembic"):  # its store's set-up is not the user's business
            logging.getLogger(name).setLevel(logging.WARNING)

        client = MlflowClient(tracking_uri=self.tracking_uri)
        sender = MLflowSender(planned, ledger, self, force_new, events, samples, live=live)
        for run in planned.runs:  # a key MLflow refuses is said before anything is sent
            for key in run.keys:
                sender.key(key)
        sender.client = client
        sender.experiment_id = _call(lambda: _experiment(client, self), self)
        return sender


@dataclass
class _Run:
    """An MLflow run being written: its id, and what it held before this upload (a run
    continued: its values, as a multiset, found once a key)."""

    run_id: str
    continued: bool
    rows: int = 0  # history rows written (a window's number is its row's)
    held: dict[str, Counter[tuple[int, int, float | str]]] = field(default_factory=dict)


@dataclass
class MLflowSender(Sender):
    """Hands planned runs to MLflow (``Sender``'s verbs, by ``MlflowClient``)."""

    to: MLflow
    client: Any = None
    experiment_id: str = ""
    keys: dict[str, str] = field(default_factory=dict)  # a run key -> its MLflow key

    def entry_fields(self) -> dict[str, Any]:
        return {"mlflow": self.to.tracking_uri, "experiment": self.to.experiment}

    def start(
        self, run: PlannedRun, decision: Decision, entry: dict[str, Any] | None, outcome: RunOutcome
    ) -> Any:
        """A new MLflow run (its params and tags), or the one of this id (the ledger's, or
        found by its tag ``metriclog.upload_id``), continued."""
        existing = (entry or {}).get("mlflow_run_id") if decision.resume else None
        if not existing:  # one made by an upload killed before its ledger said so, or a ledger lost
            existing = self._tagged(decision.run_id)
        if existing:
            outcome.rows_sent = int((entry or {}).get("rows_sent", 0))
            if outcome.rows_sent:
                outcome.message = f"resuming {run.name} (MLflow run {existing}) at row {outcome.rows_sent}"
            return _Run(existing, continued=True, rows=outcome.rows_sent)
        created = _call(
            lambda: self.client.create_run(
                self.experiment_id,
                start_time=_ms(run.started) if run.started is not None else None,
                tags=self._tags(run, decision.run_id),
                run_name=run.name,
            ),
            self.to,
        )
        mlflow_id = created.info.run_id
        self.ledger.update(decision.run_id, mlflow_run_id=mlflow_id)  # a kill from here on continues it
        params = list({p.key: p for p in _params(self.plan.config)}.values())  # a key once a batch
        for i in range(0, len(params), MAX_PARAMS_PER_BATCH):
            _call(
                lambda i=i: self.client.log_batch(mlflow_id, params=params[i : i + MAX_PARAMS_PER_BATCH]),
                self.to,
            )
        return _Run(mlflow_id, continued=False)

    def log_rows(self, handle: _Run, rows: Iterable[dict[str, Any]], run: PlannedRun) -> int:
        from mlflow.entities import Metric

        n = 0
        metrics = []
        for row in rows:
            n += 1
            for step, key, value, ms in self._values(handle, row, run):
                if handle.continued and self._held(handle, key, step, ms, value):
                    continue
                metrics.append(Metric(key, value, ms, step))
            if self.samples and isinstance(row.get("step"), int):
                for key, chosen in self.samples.chosen(run.source, row["step"]).items():
                    name = f"samples/step_{row['step']:09d}/{_file_name(key)}.json"
                    _call(lambda c=chosen, f=name: self.client.log_dict(handle.run_id, c, f), self.to)
        for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            chunk = metrics[i : i + MAX_METRICS_PER_BATCH]
            _call(lambda c=chunk: self.client.log_batch(handle.run_id, metrics=c), self.to)
        self.rows_logged += n  # all or none: a part sent is found again when continued (``_held``)
        return n

    def finish(self, handle: _Run, outcome: RunOutcome, finished: bool) -> dict[str, Any]:
        """A whole run is marked FINISHED; one its job still writes stays RUNNING."""
        if finished:
            _call(lambda: self.client.set_terminated(handle.run_id, "FINISHED"), self.to)
        outcome.message = (
            outcome.message
            or f"{outcome.run.name} is MLflow run {handle.run_id} in experiment '{self.to.experiment}'"
        )
        return {"mlflow_run_id": handle.run_id}

    def _values(
        self, handle: _Run, row: dict[str, Any], run: PlannedRun
    ) -> Iterator[tuple[int, str, float, int]]:
        """A row's values as MLflow metrics: (step, key, value, timestamp in ms)."""
        step, at, values = step_values(row, run, handle.rows)
        handle.rows += 1
        if at is None:  # a reduced step: its run's first record time
            at = run.started
        ms = _ms(at) if at is not None else 0
        for key, value in values.items():
            yield step, self.key(key), value, ms

    def key(self, key: str) -> str:
        """The MLflow key of a run's key; one renamed is said once."""
        name = self.keys.get(key)
        if name is None:
            name = self.keys[key] = mlflow_keys([key])[key]
            if name != key:
                self.events.message(
                    "note", f"key '{key}' goes to MLflow as '{name}' (MLflow refuses the first)"
                )
        return name

    def _held(self, handle: _Run, key: str, step: int, ms: int, value: float) -> bool:
        """Whether the continued MLflow run holds this value already (then it is taken off
        what it holds, so a value recorded twice is sent twice)."""
        held = handle.held.get(key)
        if held is None:
            history = _call(lambda: self.client.get_metric_history(handle.run_id, key), self.to)
            held = handle.held[key] = Counter((m.step, m.timestamp, _stored(m.value)) for m in history)
        at = (step, ms, _stored(value))
        if held[at]:
            held[at] -= 1
            return True
        return False

    def _tagged(self, run_id: str) -> str | None:
        """The MLflow run an upload of this id created already, by its tag, if any."""
        found = _call(
            lambda: self.client.search_runs(
                [self.experiment_id], filter_string=f"tags.`metriclog.upload_id` = '{run_id}'", max_results=1
            ),
            self.to,
        )
        return str(found[0].info.run_id) if found else None

    def _tags(self, run: PlannedRun, run_id: str) -> dict[str, str]:
        tags = {f"metriclog.{k}": _text(v) for k, v in self.plan.meta.items() if k != "config"}
        tags["metriclog.upload_id"] = run_id
        if run.group:
            tags["metriclog.group"] = run.group
        if run.source is not None:
            tags["metriclog.process"] = run.source
        if run.rank is not None:
            tags["metriclog.rank"] = str(run.rank)
        return {k[:MAX_KEY]: v[:MAX_PARAM_VALUE] for k, v in tags.items()}


def mlflow_key(key: str) -> str:
    """The MLflow name of a key: MLflow takes letters, digits, ``_ - . / :`` and spaces, in
    a key that is a plain relative path (no ``//``, no ``.`` or ``..`` part, no leading or
    trailing ``/``): other characters become ``_``, empty parts go, ``.`` and ``..`` parts
    become ``_``."""
    import re

    name = re.sub(r"[^\w\-./: ]", "_", key)
    return "/".join("_" if p in (".", "..") else p for p in name.split("/") if p) or "metric"


def mlflow_keys(keys: list[str]) -> dict[str, str]:
    """``mlflow_key`` of each key; a key longer than MLflow's 250 characters is refused, naming it."""
    out = {}
    for key in keys:
        name = mlflow_key(key)
        if len(name) > MAX_KEY:
            raise RequestError(
                f"the key '{key}' holds {len(name)} characters and MLflow takes at most {MAX_KEY}: upload "
                "the other keys (--key with patterns that leave it out), or to another destination"
            )
        out[key] = name
    return out


def _experiment(client: Any, to: MLflow) -> str:
    """The experiment's id; created when there is none (its artifacts beside a SQLite store)."""
    found = client.get_experiment_by_name(to.experiment)
    if found is not None:
        return str(found.experiment_id)
    location = None
    if to.tracking_uri and to.tracking_uri.startswith("sqlite:///"):
        store = Path(to.tracking_uri.removeprefix("sqlite:///"))
        location = (store.parent / "mlartifacts").as_uri()
    return str(client.create_experiment(to.experiment, artifact_location=location))


def _call(work: Any, to: MLflow) -> Any:
    """An MLflow call; its failure an ``UploadError`` naming the store."""
    from mlflow.exceptions import MlflowException

    try:
        return work()
    except MlflowException as exc:
        raise UploadError(f"MLflow ({to.tracking_uri}) refused: {exc.message}") from exc


def _params(config: dict[str, Any], prefix: str = "") -> list[Any]:
    """The run's config as MLflow params: nested keys joined with ``.``, values as text."""
    from mlflow.entities import Param

    out = []
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.extend(_params(value, f"{name}."))
        else:
            out.append(Param(mlflow_key(name)[:MAX_KEY].rstrip("/"), _text(value)[:MAX_PARAM_VALUE]))
    return out


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def _file_name(key: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in key)


def _ms(seconds: float) -> int:
    return round(float(seconds) * 1000)


def _stored(value: float) -> float | str:
    """A value as MLflow's SQL store gives it back (+-inf as +-DBL_MAX), comparable (NaN: "nan")."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return math.copysign(DBL_MAX, value)
    return value
