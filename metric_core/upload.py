"""Replay a reduced run into Weights & Biases, idempotently and resumably.

``plan_upload`` maps a ``ReduceResult`` to W&B runs (SPEC section 6, upload):

* ``global_reduce``: one run named ``name``; a history row per step holding every key
  of the step and ``step``, which ``define_metric`` makes every key's x-axis.
* ``per_rank_reduce``: a run per source, ``{name}_{process}``, in group ``group``; or,
  shared, one run whose keys are ``{key}/{process}``.
* ``per_rank_no_reduce``: a history row per raw record, carrying its own ``step`` and
  its original ``timestamp`` as ``_timestamp``.

W&B's ``_step`` is never passed, so it counts the rows a run received; that count is
what a resumed upload continues from. Run ids are deterministic: a hash of the run's
identity (``run_id`` in run.json, else its sources and their first timestamps, which
survive copying the directory), the mode and the source. A ledger in
``RUN_DIR/.metriclog/uploads.json`` (or the user cache when the run directory is
read-only) records each run's planned rows, rows handed over, and whether it finished.
"""

from __future__ import annotations

import functools
import hashlib
import json
import netrc
import os
import re
import secrets
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import numpy as np

from metric_core.atomic import new_hidden_file, replace_file
from metric_core.errors import MetricLogError
from metric_core.metric import LoggingMode

if TYPE_CHECKING:  # planning needs polars; sending (the ledger, upload_plan) does not
    import polars as pl

    from metric_core.plan import ReducePlan
    from metric_core.reduce import ReduceResult

# W&B's published limits (docs: "Limits & performance").
MAX_METRICS = 10_000
MAX_POINTS_PER_METRIC = 100_000
MAX_LOG_BYTES = 25 * 1024 * 1024
RETRY_DELAYS = (1.0, 2.0, 4.0, 8.0, 16.0)
LEDGER_EVERY_ROWS = 5_000
PROGRESS_EVERY_ROWS = 500  # divides LEDGER_EVERY_ROWS
HISTORY_CHUNK_ROWS = 10_000  # rows turned into Python objects at a time
# A replayed run describes the training run, not the machine replaying it: without these,
# W&B attaches this machine's system metrics, hardware, OS, git state, code and pip
# packages to it. (Collecting them also cost each wandb.init about 50 ms.)
REPLAY_SETTINGS = {
    "x_disable_stats": True,
    "x_disable_meta": True,
    "x_save_requirements": False,
    "disable_git": True,
    "disable_code": True,
    "save_code": False,
}

_SAFE_KEY = re.compile(r"[^A-Za-z0-9_\-./ ]")
_RESERVED = {"step", "window_start", "timestamp"}


class UploadError(MetricLogError):
    """W&B could not be reached or refused the upload; the ledger says what was sent."""


@dataclass
class PlannedRun:
    """One W&B run to write: its identity and its history rows, in order.

    The history is held as numpy columns, not a polars frame: compact, and readable by a
    process that never loads polars (the CLI reduces in a child process while it loads
    wandb). A wide run has the x-axis and a column per key, masked where a key has no
    value at a row; a raw run has columns key (an index into ``keys``), value, the
    bucket and timestamp.
    """

    run_id: str
    name: str
    group: str | None
    source: str | None
    columns: dict[str, np.ndarray]
    x_axis: str | None
    keys: list[str]
    raw: bool = False
    bucket: str = "step"

    @property
    def rows(self) -> int:
        return len(next(iter(self.columns.values()))) if self.columns else 0

    def history(self, start: int = 0) -> Iterator[dict[str, Any]]:
        """The rows to pass to ``run.log``, from row ``start``; missing keys are left out."""
        names = list(self.columns)
        for low in range(start, self.rows, HISTORY_CHUNK_ROWS):
            # masked entries become None; Python floats and ints, as W&B wants
            chunk = [self.columns[n][low : low + HISTORY_CHUNK_ROWS].tolist() for n in names]
            if self.raw:  # one raw record per row
                keys, bucket = self.keys, self.bucket
                for code, value, at, timestamp in zip(*chunk, strict=True):
                    yield {keys[code]: value, bucket: at, "_timestamp": timestamp}
                continue
            for values in zip(*chunk, strict=True):
                yield {n: v for n, v in zip(names, values, strict=True) if v is not None}


def _columns(frame: pl.DataFrame) -> dict[str, np.ndarray]:
    """A frame's columns as numpy arrays, masked where they hold nulls."""
    columns = {}
    for series in frame.iter_columns():
        values = series.to_numpy()
        if series.null_count():
            values = np.ma.MaskedArray(values, mask=series.is_null().to_numpy())
        columns[series.name] = values
    return columns


@dataclass
class UploadPlan:
    """Every run of one upload, plus what the user should know before it starts."""

    runs: list[PlannedRun]
    identity: str = ""  # of the run directory (see run_identity)
    key_mapping: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)


def run_identity(result: ReduceResult) -> str:
    """A stable identity for the run directory: ``run_id`` from run.json, else its sources."""
    given = result.scan.meta.get("run_id")
    if given:
        return str(given)
    firsts = [[process, rank, ts] for (process, rank), ts in sorted(result.scan.first_timestamps().items())]
    return hashlib.sha256(json.dumps(firsts).encode()).hexdigest()


def run_id_for(identity: str, mode: LoggingMode, source: str | None) -> str:
    digest = hashlib.sha256(f"{identity}|{mode.value}|{source or '*'}".encode()).hexdigest()
    return f"ml-{digest[:16]}"


def safe_keys(keys: list[str]) -> dict[str, str]:
    """W&B names for metric keys: characters W&B rejects or mangles replaced, ``_`` prefix
    (reserved for W&B's own keys) and the x-axis names avoided, collisions numbered."""
    mapping: dict[str, str] = {}
    taken: set[str] = set()
    for key in sorted(keys):
        name = _SAFE_KEY.sub("_", key).strip() or "metric"
        if name.startswith("_"):
            name = "m" + name
        if name in _RESERVED:
            name = f"metric/{name}"
        base, n = name, 1
        while name in taken:
            n += 1
            name = f"{base}_{n}"
        taken.add(name)
        mapping[key] = name
    return mapping


def plan_upload(
    result: ReduceResult,
    *,
    name: str,
    group: str | None = None,
    share_run: bool = False,
) -> UploadPlan:
    """Map a reduction to the W&B runs that hold it (nothing is sent)."""
    import polars as pl

    plan: ReducePlan = result.plan
    frame = result.frame
    identity = run_identity(result)
    mapping = safe_keys(frame["key"].unique().to_list())
    frame = frame.with_columns(pl.col("key").replace_strict(mapping))
    group = group or name
    bucket = plan.bucket
    runs: list[PlannedRun] = []
    mode = plan.mode
    if mode is LoggingMode.GLOBAL_REDUCE:
        runs.append(_wide_run(run_id_for(identity, mode, None), name, None, None, frame, bucket))
    elif share_run:
        shared = frame.with_columns(key=pl.format("{}/{}", "key", "process"))
        if mode is LoggingMode.PER_RANK_REDUCE:
            runs.append(_wide_run(run_id_for(identity, mode, None), name, group, None, shared, bucket))
        else:
            runs.append(
                _raw_run(
                    run_id_for(identity, mode, None), name, group, None, shared.sort("timestamp"), bucket
                )
            )
    else:
        for (process,), part in frame.partition_by("process", as_dict=True, maintain_order=True).items():
            run_id = run_id_for(identity, mode, str(process))
            run_name = f"{name}_{process}"
            if mode is LoggingMode.PER_RANK_REDUCE:
                runs.append(_wide_run(run_id, run_name, group, str(process), part, bucket))
            else:
                runs.append(_raw_run(run_id, run_name, group, str(process), part, bucket))
    upload = UploadPlan(
        runs=runs, identity=identity, key_mapping={k: v for k, v in mapping.items() if k != v}
    )
    upload.warnings = _limit_warnings(runs)
    upload.config = _provenance(result)
    return upload


def _wide_run(
    run_id: str, name: str, group: str | None, source: str | None, part: pl.DataFrame, bucket: str
) -> PlannedRun:
    """A history row per bucket, a column per key."""
    wide = part.pivot(on="key", index=bucket, values="value", sort_columns=True).sort(bucket)
    keys = [c for c in wide.columns if c != bucket]
    return PlannedRun(run_id, name, group, source, _columns(wide), bucket, keys, bucket=bucket)


def _raw_run(
    run_id: str, name: str, group: str | None, source: str | None, part: pl.DataFrame, bucket: str
) -> PlannedRun:
    """A history row per raw record."""
    import polars as pl

    keys = sorted(part["key"].unique().to_list())
    frame = part.select(
        pl.col("key").replace_strict({k: i for i, k in enumerate(keys)}, return_dtype=pl.Int32),
        "value",
        bucket,
        "timestamp",
    )
    return PlannedRun(run_id, name, group, source, _columns(frame), None, keys, raw=True, bucket=bucket)


def _limit_warnings(runs: list[PlannedRun]) -> list[str]:
    warnings = []
    distinct = {k for r in runs for k in r.keys}
    if len(distinct) >= MAX_METRICS:
        warnings.append(
            f"{len(distinct):,} distinct metrics: W&B supports fewer than {MAX_METRICS:,} per project; "
            "select keys with --key"
        )
    for r in runs:
        points = int(np.bincount(r.columns["key"]).max(initial=0)) if r.raw else r.rows
        if points and points > MAX_POINTS_PER_METRIC:
            warnings.append(
                f"run {r.name}: up to {points:,} points per metric; W&B shows at most "
                f"{MAX_POINTS_PER_METRIC:,}: bucket with --by time --every 10s (or coarser)"
            )
        widest = 64 * (len(r.keys) + 2)
        if widest > MAX_LOG_BYTES:
            warnings.append(f"run {r.name}: a history row may exceed W&B's 25 MB per log call; use --key")
    return warnings


def _provenance(result: ReduceResult) -> dict[str, Any]:
    plan = result.plan
    config = dict(result.scan.meta.get("config") or {})
    config["metriclog"] = {
        "mode": plan.mode.value,
        "by": plan.by,
        "every": plan.every,
        "reduce": {pattern: stat.name for pattern, stat in plan.overrides},
        "keys": list(plan.keys),
        "ranks": [list(r) for r in plan.ranks],
        "steps": list(plan.steps) if plan.steps else None,
        "source_run_dir": result.scan.run_dir.resolve().name,
        "records": result.scan.report.records,
        "skipped_records": result.scan.report.skipped_records,
    }
    return config


# -- ledger --------------------------------------------------------------------------------


class Ledger:
    """Per W&B run: rows planned, rows handed over, finished; saved atomically."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, dict[str, Any]] = {}
        if path.exists():
            try:
                self.entries = json.loads(path.read_text()).get("runs", {})
            except (OSError, ValueError) as exc:
                raise MetricLogError(
                    f"upload ledger {path} is damaged ({exc}); move it away to start over"
                ) from None

    @classmethod
    def for_run_dir(cls, run_dir: Path, identity: str) -> Ledger:
        """``RUN_DIR/.metriclog/uploads.json``, or the user cache when that is not writable."""
        home = run_dir / ".metriclog"
        try:
            home.mkdir(exist_ok=True)
            _refuse_links(home, home / "wandb", home / "uploads.json")
            with new_hidden_file(home / "write-test") as (_, probe):
                pass
            probe.unlink()
        except OSError:
            cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
            home = cache / "metriclog" / identity[:32]
            home.mkdir(parents=True, exist_ok=True)
        return cls(home / "uploads.json")

    def get(self, run_id: str) -> dict[str, Any] | None:
        return self.entries.get(run_id)

    def update(self, run_id: str, **fields: Any) -> None:
        entry = self.entries.setdefault(run_id, {})
        entry.update(fields, updated=time.time())
        self.save()

    def save(self) -> None:
        replace_file(
            self.path, (json.dumps({"runs": self.entries}, indent=2, sort_keys=True) + "\n").encode()
        )


def _refuse_links(*paths: Path) -> None:
    """metriclog writes under RUN_DIR/.metriclog only through directories it made itself."""
    for path in paths:
        if path.is_symlink():
            raise MetricLogError(
                f"{path} is a symlink (to {os.readlink(path)}): metriclog does not write through "
                "links it did not make; remove it and upload again"
            )


# -- the upload ----------------------------------------------------------------------------


@dataclass
class RunOutcome:
    """What happened to one planned run."""

    run: PlannedRun
    action: str  # "uploaded", "resumed", "skipped", "restarted"
    run_id: str
    rows_sent: int
    message: str = ""
    sync_dir: str | None = None


def has_credentials() -> bool:
    """Whether wandb can authenticate without asking: an API key, token file, or netrc entry."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    base = os.environ.get("WANDB_BASE_URL")
    try:
        hosts = netrc.netrc(os.environ.get("NETRC")).hosts
    except (OSError, netrc.NetrcParseError):
        return False
    if base:
        return urlparse(base).hostname in hosts
    return any("wandb" in host for host in hosts)


def upload_plan(
    plan: UploadPlan,
    ledger: Ledger,
    *,
    project: str,
    entity: str | None = None,
    offline: bool = False,
    force_new: bool = False,
    wandb_dir: Path | None = None,
    init: Callable[..., Any] | None = None,
    progress: Callable[[PlannedRun, int], Callable[[int], None]] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> list[RunOutcome]:
    """Send every planned run; ``init`` is ``wandb.init`` unless a test gives a fake."""
    if init is None:
        import wandb

        init = wandb.init
    return [
        _upload_one(run, plan, ledger, project, entity, offline, force_new, wandb_dir, init, progress, sleep)
        for run in plan.runs
    ]


def _upload_one(
    run: PlannedRun,
    plan: UploadPlan,
    ledger: Ledger,
    project: str,
    entity: str | None,
    offline: bool,
    force_new: bool,
    wandb_dir: Path | None,
    init: Callable[..., Any],
    progress: Callable[[PlannedRun, int], Callable[[int], None]] | None,
    sleep: Callable[[float], None],
) -> RunOutcome:
    entry = ledger.get(run.run_id)
    run_id, resume, start, action, message = run.run_id, None, 0, "uploaded", ""
    if entry and force_new:
        run_id = f"{run.run_id}-{secrets.token_hex(3)}"
        message = f"uploading again under a fresh id {run_id} (--force-new)"
    elif entry and entry.get("finished"):
        return RunOutcome(
            run,
            "skipped",
            run_id,
            entry.get("rows_sent", 0),
            f"already uploaded ({entry.get('rows_sent', 0)} rows, id {run_id}); "
            "skipped. Use --force-new to upload again under fresh ids",
        )
    elif entry and offline:
        run_id = f"{run.run_id}-{secrets.token_hex(3)}"
        action = "restarted"
        message = (
            f"an earlier offline upload of {run.name} was interrupted after "
            f"{entry.get('rows_sent', 0)} of {entry.get('rows_planned', run.rows)} rows; offline runs "
            f"cannot be resumed, so a fresh offline run {run_id} holds all {run.rows} rows"
        )
    elif entry:
        resume, action = "must", "resumed"
    ledger.update(
        run_id,
        name=run.name,
        group=run.group,
        project=project,
        entity=entity,
        rows_planned=run.rows,
        rows_sent=0 if resume is None else entry.get("rows_sent", 0),  # type: ignore[union-attr]
        finished=False,
        offline=offline,
        base_id=run.run_id,
    )
    kwargs = {
        "project": project,
        "entity": entity,
        "id": run_id,
        "name": run.name,
        "group": run.group,
        "config": plan.config,
        "mode": "offline" if offline else "online",
        "reinit": "create_new",
        "dir": str(wandb_dir) if wandb_dir else None,
        "settings": REPLAY_SETTINGS,
    }
    if resume:
        kwargs["resume"] = resume
    wb = _retry(lambda: init(**kwargs), "starting the W&B run", sleep)
    if resume:
        start = int(getattr(wb, "step", 0) or 0)  # rows the server already holds (_step counts them)
        message = f"resuming {run.name} at row {start} of {run.rows}"
    if run.x_axis is not None:
        wb.define_metric(run.x_axis)
        wb.define_metric("*", step_metric=run.x_axis)
    tick = progress(run, start) if progress else (lambda n: None)
    sent = start
    try:
        for row in run.history(start):
            _retry(functools.partial(wb.log, row), "logging to W&B", sleep)
            sent += 1
            if sent % PROGRESS_EVERY_ROWS == 0:
                tick(sent)
                if sent % LEDGER_EVERY_ROWS == 0:
                    ledger.update(run_id, rows_sent=sent)
        tick(sent)
        _retry(wb.finish, "finishing the W&B run", sleep)
    except BaseException:
        ledger.update(run_id, rows_sent=sent)
        raise
    ledger.update(run_id, rows_sent=sent, finished=True)
    return RunOutcome(run, action, run_id, sent, message, getattr(wb, "sync_dir", None) if offline else None)


def _retry(call: Callable[[], Any], what: str, sleep: Callable[[float], None]) -> Any:
    """Retry W&B failures (network, 429, 5xx) with exponential backoff, then give up."""
    for attempt, delay in enumerate((*RETRY_DELAYS, None)):
        try:
            return call()
        except (KeyboardInterrupt, MetricLogError):
            raise
        except Exception as exc:
            if delay is None:
                raise UploadError(f"{what} failed {attempt + 1} times: {exc}") from exc
            print(f"warning: {what} failed ({exc}); retrying in {delay:.0f}s", file=sys.stderr)
            sleep(delay)
    raise AssertionError("unreachable")
