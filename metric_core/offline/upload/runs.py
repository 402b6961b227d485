"""From a reduction to the W&B runs that hold it (docs/commands.md); nothing is sent here.

* ``global_reduce``: one run named ``name``; a history row per step holding every key
  of the step and ``step``, which ``define_metric`` makes every key's x-axis.
* ``per_rank_reduce``: a run per source, ``{name}_{process}``, in group ``group``; or,
  shared, one run whose keys are ``{key}/{process}``.
* ``per_rank_no_reduce``: a history row per raw record, carrying its own ``step`` and
  its original ``timestamp`` as ``_timestamp``.

Run ids are deterministic: a hash of the run's identity (``run_id`` in run.json, else
its sources and their first timestamps, which survive copying the directory), the mode
and the source.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from metric_core.atomic import hold_stops, new_scratch_directory
from metric_core.errors import DamagedRunJsonError, PlanError, opt
from metric_core.metric import LoggingMode
from metric_core.offline.plan import ReducePlan, one_rank_a_process
from metric_core.offline.storage import name_of
from metric_core.offline.upload.restarts import AttemptStep

if TYPE_CHECKING:  # a plan is built with polars; it is read (and sent) without it
    import polars as pl

    from metric_core.offline.engine import ReduceResult

# W&B's published limits (docs: "Limits & performance").
MAX_METRICS = 10_000
MAX_POINTS_PER_METRIC = 100_000
MAX_LOG_BYTES = 25 * 1024 * 1024
HISTORY_CHUNK_ROWS = 10_000  # rows turned into Python objects at a time

_SAFE_KEY = re.compile(r"[^A-Za-z0-9_\-./ ]")
_RESERVED = {"step", "window_start", "timestamp"}


@dataclass
class PlannedRun:
    """One W&B run to write: its identity and its history rows, in order.

    The history is held as numpy columns, not a polars frame: compact, and readable by a
    process that never loads polars (``upload_run`` reduces in a child process while it
    loads wandb). A wide run has the x-axis and a column per key, masked where a key has no
    value at a row; a raw run has columns key (a code: an index into ``code_keys``, or
    ``keys``), value, the bucket and timestamp, kept in files (``ColumnFile``) when planned
    from a stream.
    """

    run_id: str
    name: str
    group: str | None
    source: str | None
    columns: Mapping[str, np.ndarray | ColumnFile]
    x_axis: str | None
    keys: list[str]
    raw: bool = False
    bucket: str = "step"
    attempts: list[str] = field(default_factory=list)  # the writers' attempts whose records it holds
    legacy_id: str | None = None  # its id as metriclog 0.1 made it (run, mode, source only)
    first_steps: dict[str, int] = field(default_factory=dict)  # attempt -> its first step
    # Each source's attempts in start order, with the step of their first flush (None: not
    # yet), when restarts are rewound: what a later upload compares (``restarts``).
    attempt_steps: list[AttemptStep] = field(default_factory=list)
    points: int = 0  # the most points of one key
    code_keys: list[str] | None = None  # a run's key of each code, when not ``keys``' order
    # A reduced run planned from a stream keeps its values long (key code, value, bucket
    # per group, in bucket order): the bucket of each history row and where its values end.
    row_buckets: ColumnFile | None = None
    row_ends: ColumnFile | None = None
    rank: int | None = None  # the rank of a run of one source
    # Its sources' earliest record time: the time of its reduced rows, where a destination
    # needs one (MLflow; a reduced step has no time of its own), the same in every upload.
    started: float | None = None

    def first_row_from(self, step: int) -> int | None:
        """How many history rows come before ``step``: where a rewind to a restart at ``step``
        starts. None where rows before it are not a prefix: windows of time, or raw records
        of several sources ordered by time."""
        if self.bucket != "step" or (self.raw and self.source is None):
            return None
        steps = self.columns["step"] if self.row_buckets is None else self.row_buckets
        return sum(int((steps[i : i + SCAN_ROWS] < step).sum()) for i in range(0, self.rows, SCAN_ROWS))

    def last_step(self) -> int | None:
        """The highest step its rows hold (None: no row, or a run of time windows)."""
        if self.bucket != "step" or not self.rows:
            return None
        steps = self.columns["step"] if self.row_buckets is None else self.row_buckets
        return max(int(steps[i : i + SCAN_ROWS].max()) for i in range(0, len(steps), SCAN_ROWS))

    def steps(self) -> set[int]:
        """The steps its rows hold (empty for a run of time windows)."""
        if self.bucket != "step":
            return set()
        steps = self.columns["step"] if self.row_buckets is None else self.row_buckets
        return {int(s) for i in range(0, len(steps), SCAN_ROWS) for s in np.unique(steps[i : i + SCAN_ROWS])}

    @property
    def rows(self) -> int:
        if self.row_ends is not None:
            return len(self.row_ends)
        return len(next(iter(self.columns.values()))) if self.columns else 0

    def history(self, start: int = 0) -> Iterator[dict[str, Any]]:
        """The rows to pass to ``run.log``, from row ``start``; missing keys are left out."""
        if self.row_ends is not None:
            yield from self._long_history(start)
            return
        names = list(self.columns)
        for low in range(start, self.rows, HISTORY_CHUNK_ROWS):
            # masked entries become None; Python floats and ints, as W&B wants
            chunk = [self.columns[n][low : low + HISTORY_CHUNK_ROWS].tolist() for n in names]
            if self.raw:  # one raw record per row
                keys, bucket = self.code_keys or self.keys, self.bucket
                for code, value, at, timestamp in zip(*chunk, strict=True):
                    yield {keys[code]: value, bucket: at, "_timestamp": timestamp}
                continue
            for values in zip(*chunk, strict=True):
                yield {n: v for n, v in zip(names, values, strict=True) if v is not None}

    def _long_history(self, start: int) -> Iterator[dict[str, Any]]:
        """A reduced run kept long: one row per bucket, gathered from its groups' values."""
        assert self.row_ends is not None
        keys, bucket = self.code_keys or self.keys, self.bucket
        low = int(self.row_ends[start - 1 : start][0]) if start else 0
        row: dict[str, Any] = {}
        at = None
        for i in range(low, len(self.columns["key"]), HISTORY_CHUNK_ROWS):
            chunk = [self.columns[n][i : i + HISTORY_CHUNK_ROWS].tolist() for n in ("key", "value", bucket)]
            for code, value, b in zip(*chunk, strict=True):
                if b != at:
                    if row:
                        yield row
                    row, at = {bucket: b}, b
                row[keys[code]] = value
        if row:
            yield row


class ColumnFile:
    """A column of a planned run kept in a file (raw runs: their records may not fit in
    memory), read a slice at a time: ``len`` and ``[a:b]`` as for a numpy array."""

    def __init__(self, path: str, dtype: str) -> None:
        self.path, self.dtype, self.length = path, dtype, 0

    def append(self, values: np.ndarray) -> None:
        with open(self.path, "ab") as f:
            np.ascontiguousarray(values, dtype=self.dtype).tofile(f)
        self.length += len(values)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, where: slice) -> np.ndarray:
        start, stop, _ = where.indices(self.length)
        size = np.dtype(self.dtype).itemsize
        count = max(0, stop - start)
        return np.fromfile(self.path, dtype=self.dtype, count=count, offset=start * size)


SCAN_ROWS = 1_000_000  # rows of a column file read at a time


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
class PlannedRuns:
    """Every run of one upload, plus what the user should know before it starts."""

    runs: list[PlannedRun]
    identity: str = ""  # of the run directory (see run_identity)
    spill_dir: str | None = None  # where raw runs' columns are kept (``close`` removes it)
    key_mapping: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # W&B's limits the runs come near
    unmatched: list[PlanError] = field(default_factory=list)  # filters that matched no record
    config: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)  # run.json's facts
    read_summary: str = ""  # what the reader skipped
    identity_from: str = "run.json"  # or "content": no run_id in run.json (another tool's files)
    # Planned while the job still wrote the run (``settled``): its complete rows only; the
    # runs stay unfinished in the ledger, for a later upload to continue.
    open: bool = False
    tags: list[str] = field(default_factory=list)  # W&B's tags of the runs (a comparison's sources)

    def close(self) -> None:
        """Remove the files raw runs' histories are kept in (``history`` ends with them)."""
        if self.spill_dir is not None:
            shutil.rmtree(self.spill_dir, ignore_errors=True)
            self.spill_dir = None

    def __enter__(self) -> PlannedRuns:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_identity(result: ReduceResult) -> str:
    """A stable identity for the run directory: ``run_id`` from run.json, else its sources;
    a ``DamagedRunJsonError`` when run.json is damaged (never another identity)."""
    if result.scan.report.run_json_damaged:
        raise DamagedRunJsonError(str(result.scan.run_dir / "run.json"), result.scan.report.run_json_damaged)
    given = result.scan.meta.get("run_id")
    if given:
        return str(given)
    firsts = [[process, rank, ts] for (process, rank), ts in sorted(result.scan.first_timestamps().items())]
    return hashlib.sha256(json.dumps(firsts).encode()).hexdigest()


def request_key(plan: ReducePlan, request: dict[str, Any], share_run: bool) -> str:
    """What makes two uploads of one run the same: the destination, the names given, and
    everything that shapes the data."""
    # entity, project, and the name and group the user gave (None: defaults)
    shape = {**request, **plan.as_dict(), "share_run": share_run}
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()


def run_id_for(identity: str, request: str, source: str | None) -> str:
    digest = hashlib.sha256(f"{identity}|{request}|{source or '*'}".encode()).hexdigest()
    return f"ml-{digest[:16]}"


def safe_keys(keys: list[str], taken: set[str] | None = None) -> dict[str, str]:
    """W&B names for metric keys: characters W&B rejects or mangles replaced, ``_`` prefix
    (reserved for W&B's own keys) and the x-axis names avoided, collisions numbered (also
    with the names in ``taken``, given to keys seen before)."""
    mapping: dict[str, str] = {}
    taken = set(taken or ())
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


def spills(plan: ReducePlan, share_run: bool) -> bool:
    """Whether the runs of ``plan`` keep their rows in files (``plan_runs``): all but
    ``share_run``'s one run (which takes the per-rank modes only), held in memory."""
    return not share_run or plan.mode is LoggingMode.GLOBAL_REDUCE


def plan_runs(
    result: ReduceResult,
    *,
    name: str,
    group: str | None = None,
    share_run: bool = False,
    request: dict[str, Any] | None = None,
    spill_dir: str | None = None,
) -> PlannedRuns:
    """Map a reduction to the W&B runs that hold it (nothing is sent).

    ``request`` (the destination and the names the user gave) enters the run ids with
    everything of the plan that shapes the data: another project, another window or
    filter is another upload, under its own ids.

    Runs keep their rows in files of a temporary directory, written as the reduction
    streams them (but ``share_run``'s, held in memory): close the plan (or use it in a
    ``with``) to remove them. ``spill_dir``: that directory, made by the caller, who removes
    it however the plan ends (an upload whose plan is made in another process), else one
    made here.
    """
    plan: ReducePlan = result.plan
    identity = run_identity(result)
    key = request_key(plan, request or {}, share_run)
    group = group or name
    bucket = plan.bucket
    mode = plan.mode
    if spills(plan, share_run):
        made = spill_dir is None
        if spill_dir is None:  # the plan's own, which ``close`` removes
            let_go = hold_stops()
            spill_dir = new_scratch_directory("metriclog-upload-", let_go)
        try:
            if made:
                let_go()
            runs, mapping = _streamed_runs(result, spill_dir, identity, key, name, group, bucket)
        except BaseException:
            if made:
                shutil.rmtree(spill_dir, ignore_errors=True)
            raise
    else:
        runs, mapping = _shared_run(result.frame, identity, key, name, group, bucket, mode)
    # runs uploaded before ids held the plan's shape (early 0.1 ledgers) are found under those ids
    default_shape = plan.as_dict() == ReducePlan(mode=mode).as_dict()
    for run in runs:
        if default_shape:  # what earlier versions uploaded is recognized, not sent twice
            legacy = f"{identity}|{mode.value}|{run.source or '*'}"
            run.legacy_id = f"ml-{hashlib.sha256(legacy.encode()).hexdigest()[:16]}"
    firsts = result.scan.first_timestamps()
    for run in runs:
        mine = {at: t for at, t in firsts.items() if run.source in (None, at[0])}
        run.started = min(mine.values(), default=None)
        if run.source is not None and len(mine) == 1:
            run.rank = next(iter(mine))[1]
    for run in runs:  # a restart of one source changes only the runs that hold its records
        held = [a for a in result.scan.report.attempts if a.records and run.source in (None, a.process)]
        run.attempts = sorted(a.attempt for a in held)
        run.first_steps = {a.attempt: a.first_step for a in held if a.first_step is not None}
        if plan.attempts == "rewind":  # in start order, each source's (as ``resolve`` lists them)
            sources = {(a.process, a.rank) for a in held}
            steps: dict[tuple[str, int, str], int | None] = {}
            for a in result.scan.report.attempts:
                if (a.process, a.rank) in sources:
                    steps.setdefault((a.process, a.rank, a.attempt), a.first_step)
            run.attempt_steps = [(*at, first) for at, first in steps.items()]
    planned = PlannedRuns(
        runs=runs,
        identity=identity,
        spill_dir=spill_dir,
        key_mapping={k: v for k, v in mapping.items() if k != v},
        identity_from="run.json" if result.scan.meta.get("run_id") else "content",
    )
    planned.warnings = limit_warnings(runs)
    planned.unmatched = result.unmatched
    planned.config = _provenance(result)
    planned.meta = dict(result.scan.meta)
    return planned


def _shared_run(
    frame: pl.DataFrame, identity: str, key: str, name: str, group: str, bucket: str, mode: LoggingMode
) -> tuple[list[PlannedRun], dict[str, str]]:
    """``--per-rank-share-run``'s one run, held in memory: it orders every source's rows
    together, keys suffixed with their process (the other runs are planned from the
    stream: ``_streamed_runs``)."""
    import polars as pl

    one_rank_a_process(frame.select("process", "rank").unique().iter_rows())
    mapping = safe_keys(frame["key"].unique().to_list())
    shared = frame.with_columns(key=pl.format("{}/{}", pl.col("key").replace_strict(mapping), "process"))
    run_id = run_id_for(identity, key, None)
    if mode is LoggingMode.PER_RANK_REDUCE:
        return [wide_run(run_id, name, group, None, shared, bucket)], mapping
    return [_raw_run(run_id, name, group, None, shared.sort("timestamp"), bucket)], mapping


def wide_run(
    run_id: str, name: str, group: str | None, source: str | None, part: pl.DataFrame, bucket: str
) -> PlannedRun:
    """A history row per bucket, a column per key."""
    wide = part.pivot(on="key", index=bucket, values="value", sort_columns=True).sort(bucket)
    keys = [c for c in wide.columns if c != bucket]
    return PlannedRun(
        run_id, name, group, source, _columns(wide), bucket, keys, bucket=bucket, points=wide.height
    )


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
    points = int(np.bincount(frame["key"].to_numpy()).max(initial=0))
    return PlannedRun(
        run_id, name, group, source, _columns(frame), None, keys, raw=True, bucket=bucket, points=points
    )


def _streamed_runs(
    result: ReduceResult, spill_dir: str, identity: str, key: str, name: str, group: str, bucket: str
) -> tuple[list[PlannedRun], dict[str, str]]:
    """The runs (one, or one per source) from the reduction's stream: each run's columns go
    to files in ``spill_dir`` as they come, so memory holds one frame, not the run.

    A raw run keeps a record per history row. A reduced run keeps each group's key code,
    value and bucket, in bucket order (the stream hands over whole buckets, in order, for
    each source), and the bucket and end of each history row."""
    import polars as pl

    raw = result.plan.mode is LoggingMode.PER_RANK_NO_REDUCE
    per_source = result.plan.mode is not LoggingMode.GLOBAL_REDUCE
    runs: dict[str | None, PlannedRun] = {}
    seen: dict[str | None, dict[str, int]] = {}  # each run's keys, by code in order of appearance
    counts: dict[str | None, np.ndarray] = {}  # a raw run's points of each key code
    ends: dict[str | None, int] = {}
    sources: set[tuple[str, int]] = set()
    bucket_type = "float64" if bucket == "window_start" else "int64"
    for whole in result.batches():
        parts = whole.partition_by("process", maintain_order=True) if per_source else [whole]
        for batch in parts:
            process = str(batch["process"][0]) if per_source else None
            if process is not None:
                sources.update((process, rank) for rank in batch["rank"].unique().to_list())
                one_rank_a_process(sources)
            run = runs.get(process)
            if run is None:
                stem = os.path.join(spill_dir, str(len(runs)))
                files = {
                    "key": ColumnFile(f"{stem}.key", "int32"),
                    "value": ColumnFile(f"{stem}.value", "float64"),
                    bucket: ColumnFile(f"{stem}.{bucket}", bucket_type),
                }
                if raw:
                    files["timestamp"] = ColumnFile(f"{stem}.timestamp", "float64")
                run = runs[process] = PlannedRun(
                    run_id_for(identity, key, process),
                    name if process is None else f"{name}_{process}",
                    None if process is None else group,
                    process,
                    files,
                    None if raw else bucket,
                    [],
                    raw=raw,
                    bucket=bucket,
                )
                if not raw:
                    run.row_buckets = ColumnFile(f"{stem}.rows", bucket_type)
                    run.row_ends = ColumnFile(f"{stem}.ends", "int64")
                seen[process], counts[process], ends[process] = {}, np.zeros(0, np.int64), 0
            codes = seen[process]
            for k in batch["key"].unique(maintain_order=True).to_list():
                codes.setdefault(k, len(codes))
            code = batch["key"].replace_strict(codes, return_dtype=pl.Int32).to_numpy()
            run.columns["key"].append(code)  # type: ignore[union-attr]
            for column in ("value", bucket, *(("timestamp",) if raw else ())):
                run.columns[column].append(batch[column].to_numpy())  # type: ignore[union-attr]
            if raw:
                found = np.bincount(code, minlength=len(codes))
                found[: len(counts[process])] += counts[process]
                counts[process] = found
                continue
            at = batch[bucket].to_numpy()
            starts = np.flatnonzero(np.r_[True, at[1:] != at[:-1]])
            assert run.row_buckets is not None and run.row_ends is not None
            run.row_buckets.append(at[starts])
            run.row_ends.append(ends[process] + np.r_[starts[1:], len(at)])
            ends[process] += len(at)
    mapping = safe_keys(sorted({k for codes in seen.values() for k in codes}))
    for process, run in runs.items():
        run.code_keys = [mapping[k] for k in seen[process]]
        run.keys = sorted(run.code_keys)
        run.points = int(counts[process].max(initial=0)) if raw else run.rows
    return list(runs.values()), mapping


def limit_warnings(runs: list[PlannedRun]) -> list[str]:
    warnings: list[str] = []
    distinct = {k for r in runs for k in r.keys}
    if len(distinct) >= MAX_METRICS:
        warnings.append(
            f"{len(distinct):,} distinct metrics: W&B supports fewer than {MAX_METRICS:,} per project; "
            f"select keys with " + opt("keys")
        )
    for r in runs:
        points = r.points
        if points and points > MAX_POINTS_PER_METRIC:
            warnings.append(
                f"run {r.name}: up to {points:,} points per metric; W&B shows at most "
                f"{MAX_POINTS_PER_METRIC:,}: bucket with "
                + opt("by")
                + "'time' "
                + opt("every")
                + "'10s' (or coarser)"
            )
        widest = 64 * (len(r.keys) + 2)
        if widest > MAX_LOG_BYTES:
            warnings.append(
                f"run {r.name}: a history row may exceed W&B's 25 MB per log call; use " + opt("keys")
            )
    return warnings


def run_config(meta: dict[str, Any], plan: ReducePlan, **facts: Any) -> dict[str, Any]:
    """A W&B run's config: run.json's, plus what metriclog computed (``facts``: more of it)."""
    config = dict(meta.get("config") or {})
    shape = plan.as_dict()
    shape["reduce"] = dict(shape["reduce"])  # a W&B config shows a mapping of pattern to statistic
    config["metriclog"] = {**shape, **facts}
    return config


def _provenance(result: ReduceResult) -> dict[str, Any]:
    return run_config(
        result.scan.meta,
        result.plan,
        source_run_dir=name_of(result.scan.run_dir),
        records=result.scan.report.records,
        skipped_records=result.scan.report.skipped_records,
    )
