"""Read a run directory into one polars LazyFrame in the record schema, with a health report.

Every file of SPEC section 2 is read (recursively: ``*.jsonl``, ``*.parquet`` and the
writer's ``*.journal`` tails; names starting with "." are not data). Bad input is
survived and reported, never silently dropped:

* a JSONL line that is not JSON, lacks a required field, or holds a value that is not
  a number is skipped and reported with its line number;
* a half-written last JSONL line (a crash mid-write) is skipped and reported as such;
* a Parquet file that cannot be read is skipped and named;
* a journal cut short by a kill is read up to its last complete frame, and one whose
  frame fails its checksum up to the frame before it (both said);
* a record whose timestamp is not finite or lies outside 1970-2286 (``TIMESTAMP_RANGE``:
  not Unix epoch seconds) is skipped and counted;
* a file that is compressed or binary under a ``.jsonl`` name, or a Parquet file whose
  columns have types no record can hold (a struct ``value``), is skipped and named;
* a directory that cannot be listed, a broken ``run.json`` and values out of bounds in
  it are reported, and the rest is read;
* a symlink is followed only inside the run directory (unless ``follow_symlinks``),
  and a file reached twice (links, loops) is read once; both are said.

The happy path is vectorized: JSONL goes through polars' NDJSON parser with every
field read as text and cast in bulk, Parquet is scanned lazily. Only a JSONL file that
polars cannot parse at all falls back to a line-by-line pass that finds the bad lines.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

import polars as pl

from metric_core.errors import NoDataError
from metric_core.schema import (
    DATA_SUFFIXES,
    KEY_HASH,
    PARQUET_META_KEY,
    POLARS_SCHEMA,
    REQUIRED_FIELDS,
    SEGMENT_EVENT,
    SHUTDOWN_EVENT,
    TIMESTAMP_RANGE,
)

MAX_LINES_KEPT = 1000
_MAX_SEGMENT_LINE = 1 << 26  # the writer's first line lists every key of the segment
_TEXT_SCHEMA = {name: pl.String() for name in (*POLARS_SCHEMA, "event")}
_TYPED_SCHEMA = {**POLARS_SCHEMA, "event": pl.String()}
_TRUNCATED = "half-written last line (the writer was killed mid-write)"
# run.json values past these are not a run's: ignored and said.
MAX_WORLD_SIZE = 1 << 20
_BINARY_MAGIC = {
    b"\x1f\x8b": "gzip-compressed",
    b"PK": "zip-compressed",
    b"\x28\xb5\x2f\xfd": "zstd-compressed",
    b"BZh": "bzip2-compressed",
    b"PAR1": "a Parquet file",
}


@dataclass
class FileReport:
    """What reading one file gave."""

    path: Path
    format: str
    records: int = 0
    skipped: int = 0
    skipped_lines: list[tuple[int, str]] = field(default_factory=list)
    skip_reasons: dict[str, int] = field(default_factory=dict)
    truncated: bool = False
    unreadable: str | None = None
    # What its writer declared: the (key, reduction) pairs of its records (a superset),
    # their step and time ranges; ``hashed`` when its frame carries the key_hash column.
    keys: list[tuple[str, str]] | None = None
    steps: tuple[int, int] | None = None
    timestamps: tuple[float, float] | None = None
    hashed: bool = False
    superseded_by: str | None = None
    source: tuple[str, int] | None = None  # set when the writer's metadata vouches for one source
    # What the writer could not write and dropped (its D frames): {"records", "steps", ...}.
    dropped: list[dict[str, Any]] = field(default_factory=list)

    @property
    def dropped_records(self) -> int:
        return sum(int(d.get("records", 0)) for d in self.dropped)

    def skip(self, reason: str, count: int = 1, lines: list[int] | None = None) -> None:
        self.skipped += count
        self.skip_reasons[reason] = self.skip_reasons.get(reason, 0) + count
        for line in lines or []:
            if len(self.skipped_lines) < MAX_LINES_KEPT:
                self.skipped_lines.append((line, reason))


@dataclass
class Shutdown:
    """A clean end recorded by a writer's shutdown()."""

    process: str
    rank: int
    timestamp: float | None


@dataclass
class ReadReport:
    """The health of a run directory: per file, what was read and what was skipped."""

    run_dir: Path
    files: list[FileReport] = field(default_factory=list)
    shutdowns: list[Shutdown] = field(default_factory=list)
    skipped_paths: list[tuple[Path, str]] = field(default_factory=list)  # (path, why), not read
    notices: list[str] = field(default_factory=list)  # read anyway: run.json problems, duplicates

    @property
    def skipped_records(self) -> int:
        return sum(f.skipped for f in self.files)

    @property
    def unreadable_files(self) -> list[FileReport]:
        return [f for f in self.files if f.unreadable is not None]

    @property
    def records(self) -> int:
        return sum(f.records for f in self.files)

    @property
    def has_skips(self) -> bool:
        return self.skipped_records > 0 or bool(self.unreadable_files) or bool(self.skipped_paths)

    @property
    def dropped_records(self) -> int:
        """Records the writers recorded but could not write (counted in the files, see inspect)."""
        return sum(f.dropped_records for f in self.files)

    def clean_shutdowns(self) -> set[tuple[str, int]]:
        return {(s.process, s.rank) for s in self.shutdowns}

    def summary(self, max_files: int = 8, max_lines: int = 3) -> str:
        """A short multi-line summary of every skip, for stderr; '' when nothing was skipped."""
        bad = [f for f in self.files if f.skipped or f.unreadable or f.skip_reasons]
        gaps = [f for f in self.files if f.dropped]
        if not (bad or gaps or self.skipped_paths or self.notices):
            return ""
        not_read = f", {len(self.skipped_paths)} path(s) not read" if self.skipped_paths else ""
        head = (
            f"skipped {self.skipped_records} record(s) and "
            f"{len(self.unreadable_files)} unreadable file(s){not_read} in {self.run_dir}:"
        )
        out = [head]
        for path, why in self.skipped_paths[:max_files]:
            out.append(f"  {_rel(path, self.run_dir)}: {why}")
        if len(self.skipped_paths) > max_files:
            out.append(f"  ... and {len(self.skipped_paths) - max_files} more path(s) not read")
        out.extend(f"  {notice}" for notice in self.notices)
        for f in gaps:
            for d in f.dropped:
                steps = d.get("steps") or ["?", "?"]
                out.append(
                    f"  {_rel(f.path, self.run_dir)}: its writer dropped {d.get('records')} record(s) of "
                    f"steps {steps[0]}-{steps[1]} that it could not write ({d.get('reason', 'write failed')})"
                )
        for f in bad[:max_files]:
            name = _rel(f.path, self.run_dir)
            if f.unreadable is not None:
                out.append(f"  {name}: unreadable, skipped ({f.unreadable})")
                continue
            if f.skipped_lines:
                detail = "; ".join(f"line {line}: {reason}" for line, reason in f.skipped_lines[:max_lines])
                if f.skipped > max_lines:
                    detail += f" (+{f.skipped - max_lines} more)"
            else:
                detail = "; ".join(
                    f"{n} x {reason}" if n > 1 else reason for reason, n in f.skip_reasons.items()
                )
            out.append(f"  {name}: {f.skipped} record(s) skipped: {detail}")
        if len(bad) > max_files:
            out.append(f"  ... and {len(bad) - max_files} more file(s)")
        return "\n".join(out)


@dataclass
class RunScan:
    """A run directory read lazily: ``frame`` in the record schema plus ``file_id``."""

    run_dir: Path
    frame: pl.LazyFrame
    report: ReadReport
    meta: dict[str, Any]
    parts: dict[int, pl.LazyFrame] = field(default_factory=dict)  # file_id -> that file's frame

    @property
    def name(self) -> str:
        return str(self.meta.get("name") or self.run_dir.resolve().name)

    @property
    def hashed(self) -> bool:
        """Whether every record carries its writer's key_hash (see ``metric_core.schema``)."""
        return all(self.report.files[fid].hashed for fid in self.parts)

    @property
    def step_range(self) -> tuple[int, int] | None:
        """The lowest and highest step, when every file declared its own."""
        ranges = [self.report.files[fid].steps for fid in self.parts]
        if not ranges or any(r is None for r in ranges):
            return None
        return min(r[0] for r in ranges if r), max(r[1] for r in ranges if r)

    def first_timestamps(self) -> dict[tuple[str, int], float]:
        """Each source's earliest record time: declared by the writer, or read from the rest."""
        first: dict[tuple[str, int], float] = {}
        rest = []
        for fid, frame in self.parts.items():
            rep = self.report.files[fid]
            if rep.source is not None and rep.timestamps is not None:
                first[rep.source] = min(first.get(rep.source, math.inf), rep.timestamps[0])
            else:
                rest.append(frame)
        if rest:
            found = pl.concat(rest).group_by("process", "rank").agg(pl.col("timestamp").min())
            for process, rank, ts in found.collect(engine="streaming").iter_rows():
                first[(process, rank)] = min(first.get((process, rank), math.inf), ts)
        return first

    def key_reductions(self) -> pl.DataFrame:
        """Every distinct (key, reduction) of the run: from what the writer declared in each
        sealed segment's metadata, and by reading only the files that declare nothing."""
        declared = {pair for rep in self.report.files if rep.keys is not None for pair in rep.keys}
        undeclared = [frame for fid, frame in self.parts.items() if self.report.files[fid].keys is None]
        found = pl.DataFrame(sorted(declared), schema=["key", "reduction"], orient="row").cast(pl.String)
        if undeclared:
            read = pl.concat(undeclared).select("key", "reduction").unique().collect(engine="streaming")
            found = pl.concat([found, read]).unique()
        return found.sort("key", "reduction")


def scan_run(run_dir: str | os.PathLike[str], *, follow_symlinks: bool = False) -> RunScan:
    """Read every metric file below ``run_dir`` into one LazyFrame and a health report.

    ``run_dir`` itself may be a symlink; below it, symlinks that lead out of it are
    skipped (and said) unless ``follow_symlinks``. Raises NoDataError when the
    directory has no readable record.

    >>> scan = scan_run("sample_logs/rl_run")  # doctest: +SKIP
    >>> scan.frame.select(pl.len()).collect().item()  # doctest: +SKIP
    """
    root = Path(run_dir)
    if not root.is_dir():
        raise NoDataError(str(root), "it is not a directory")
    report = ReadReport(run_dir=root)
    meta = _read_run_json(root, report)
    paths = _list_data_files(root, report, follow_symlinks=follow_symlinks)
    metas = {p: _writer_meta(p) for p in paths}  # each footer or first line read once
    superseded = _superseded_tails(metas)
    frames: list[pl.LazyFrame] = []
    checks: list[tuple[int, FileReport, pl.LazyFrame | None]] = []
    file_ids: list[int] = []
    for path in paths:
        suffix = path.suffix
        rep = FileReport(path=path, format=suffix.lstrip("."))
        report.files.append(rep)
        if path in superseded:
            rep.superseded_by = superseded[path]
            continue
        check: pl.LazyFrame | None = None
        trusted = True
        if suffix == ".parquet":
            frame, trusted, check = _scan_parquet(path, metas[path], rep, report)
        elif suffix == ".journal":
            frame = _read_journal(path, rep, report)
        else:
            frame = _read_jsonl(path, metas[path], rep, report)
        if frame is not None:
            if not trusted:
                checks.append((len(frames), rep, check))
            if not rep.hashed:
                frame = frame.with_columns(pl.lit(None, pl.Int64).alias(KEY_HASH))
            frames.append(frame.with_columns(file_id=pl.lit(len(report.files) - 1, pl.Int32)))
            file_ids.append(len(report.files) - 1)
    _run_parquet_checks(frames, checks)
    if not frames or report.records == 0:
        why = "no *.jsonl or *.parquet file was found" if not paths else "every record was skipped"
        extra = report.summary()
        raise NoDataError(str(root), why + (f"\n{extra}" if extra else ""))
    return RunScan(
        run_dir=root,
        frame=pl.concat(frames, how="vertical"),
        report=report,
        meta=meta,
        parts=dict(zip(file_ids, frames, strict=True)),
    )


# -- discovery -----------------------------------------------------------------------------


def _list_data_files(root: Path, report: ReadReport, *, follow_symlinks: bool) -> list[Path]:
    """The data files, listed twice: a directory listing is no snapshot, so a journal sealed
    while it is listed can be missing from it under both its names. The second listing holds
    the sealed segment of every journal that vanished during the first."""
    first = set(_data_files(root, ReadReport(run_dir=root), follow_symlinks=follow_symlinks))
    second = set(_data_files(root, report, follow_symlinks=follow_symlinks))
    vanished = {p for p in first - second if p.suffix == ".journal"}
    return sorted(second | vanished)


def _data_files(root: Path, report: ReadReport, *, follow_symlinks: bool) -> Iterator[Path]:
    """Every data file below ``root``, each real file once; what is not read goes in ``report``."""
    real_root = root.resolve()
    top = root.stat()
    seen: dict[tuple[int, int], Path] = {(top.st_dev, top.st_ino): root}

    def unlisted(exc: OSError) -> None:
        where = Path(exc.filename) if exc.filename else root
        report.skipped_paths.append((where, f"directory not read ({exc.strerror or exc})"))

    def inside(path: Path) -> bool:
        return path == real_root or real_root in path.parents

    for dirpath, dirnames, filenames in os.walk(root, onerror=unlisted, followlinks=follow_symlinks):
        here = Path(dirpath)
        kept = []
        for d in sorted(dirnames):
            if d.startswith("."):
                continue
            path = here / d
            if path.is_symlink() and not follow_symlinks:
                why = "inside" if inside(path.resolve()) else "outside"
                report.skipped_paths.append(
                    (
                        path,
                        f"symlink to a directory {why} the run directory, not followed "
                        f"(--follow-symlinks follows it)",
                    )
                )
                continue
            try:
                st = path.stat()
            except OSError as exc:
                unlisted(exc)
                continue
            if (st.st_dev, st.st_ino) in seen:  # a loop, or a directory linked twice
                report.notices.append(
                    f"{_rel(path, root)} is {_rel(seen[(st.st_dev, st.st_ino)], root)} again: read once"
                )
                continue
            seen[(st.st_dev, st.st_ino)] = path
            kept.append(d)
        dirnames[:] = kept
        for name in sorted(filenames):
            if name.startswith(".") or not name.endswith(DATA_SUFFIXES):
                continue
            path = here / name
            try:
                if path.is_symlink() and not follow_symlinks and not inside(path.resolve()):
                    report.skipped_paths.append(
                        (
                            path,
                            f"symlink to {os.readlink(path)}, outside the run directory: not read "
                            "(--follow-symlinks reads it)",
                        )
                    )
                    continue
                st = path.stat()
            except FileNotFoundError:
                if name.endswith(".journal"):
                    yield path  # sealed meanwhile: read from its sealed segment
                continue
            except OSError as exc:
                report.skipped_paths.append((path, f"not read ({exc.strerror or exc})"))
                continue
            first = seen.get((st.st_dev, st.st_ino))
            if first is not None:
                report.notices.append(
                    f"{_rel(path, root)} is the same file as {_rel(first, root)}: read once"
                )
                continue
            seen[(st.st_dev, st.st_ino)] = path
            yield path


def _read_run_json(root: Path, report: ReadReport) -> dict[str, Any]:
    """run.json's fields, each checked; a broken file or field is reported and left out."""
    path = root / "run.json"
    if not path.exists():
        return {}
    try:
        meta = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        report.notices.append(f"run.json: not valid JSON ({exc}); its metadata is ignored: fix or remove it")
        return {}
    if not isinstance(meta, dict):
        report.notices.append(
            f'run.json: must hold a JSON object, e.g. {{"world_size": 8}}, not {type(meta).__name__}; ignored'
        )
        return {}
    checks = {
        "world_size": lambda v: type(v) is int and 1 <= v <= MAX_WORLD_SIZE,
        "name": lambda v: isinstance(v, str) and 0 < len(v) <= 1024,
        "config": lambda v: isinstance(v, dict),
    }
    wanted = {
        "world_size": f"an integer from 1 to {MAX_WORLD_SIZE:,}",
        "name": "a non-empty string",
        "config": "a JSON object",
    }
    for key, ok in checks.items():
        if meta.get(key) is not None and not ok(meta[key]):
            shown = json.dumps(meta[key])
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            report.notices.append(f"run.json: '{key}' must be {wanted[key]}, not {shown}; ignored")
            del meta[key]
    return meta


def _parquet_meta(path: Path) -> dict[str, Any] | None:
    try:
        kv = pl.read_parquet_metadata(path)
    except Exception:
        return None
    raw = kv.get(PARQUET_META_KEY)
    if raw is None:
        return None
    try:
        meta = json.loads(raw)
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None


def _jsonl_segment_meta(path: Path) -> dict[str, Any] | None:
    """The writer's first line of a sealed JSONL segment, if this file has one."""
    try:
        with open(path, "rb") as f:
            first = f.readline(_MAX_SEGMENT_LINE)
        meta = json.loads(first)
    except (OSError, ValueError):
        return None
    if not (isinstance(meta, dict) and meta.get("event") == SEGMENT_EVENT):
        return None
    meta["_first_line_bytes"] = len(first)
    return meta


def _writer_meta(path: Path) -> dict[str, Any] | None:
    """What our writer recorded about a sealed segment, if it is one."""
    if path.suffix == ".parquet":
        return _parquet_meta(path)
    if path.suffix == ".jsonl":
        return _jsonl_segment_meta(path)
    return None


def _declared_keys(meta: dict[str, Any]) -> list[tuple[str, str]] | None:
    """The (key, reduction) pairs a sealed segment's writer listed, if well formed."""
    keys = meta.get("keys")
    if not isinstance(keys, list):
        return None
    pairs = []
    for item in keys:
        if not (isinstance(item, list) and len(item) == 2 and all(isinstance(x, str) for x in item)):
            return None
        pairs.append((item[0], item[1]))
    return pairs


def _take_declared(rep: FileReport, meta: dict[str, Any]) -> None:
    """What a sealed segment's writer declared in its metadata, where well formed."""
    rep.keys = _declared_keys(meta)
    steps, times = meta.get("steps"), meta.get("timestamps")
    if isinstance(steps, list) and len(steps) == 2 and all(type(x) is int for x in steps):
        rep.steps = (steps[0], steps[1])
    if isinstance(times, list) and len(times) == 2 and all(type(x) in (int, float) for x in times):
        rep.timestamps = (float(times[0]), float(times[1]))
    dropped = meta.get("dropped")
    if isinstance(dropped, list):
        rep.dropped = [d for d in dropped if isinstance(d, dict) and type(d.get("records")) is int]


def _superseded_tails(metas: dict[Path, dict[str, Any] | None]) -> dict[Path, str]:
    """Journals that a sealed segment already holds (a kill between rename and unlink)."""
    present = set(metas)
    out = {}
    for path, meta in metas.items():
        if meta and isinstance(meta.get("supersedes"), str):
            tail = path.parent / meta["supersedes"]
            if tail in present:
                out[tail] = path.name
    return out


# -- conversion from text columns ----------------------------------------------------------


def _number(col: str) -> pl.Expr:
    text = pl.col(col)
    lowered = text.str.to_lowercase()
    return (
        pl.when(lowered == "true")
        .then(pl.lit(1.0))
        .when(lowered == "false")
        .then(pl.lit(0.0))
        .otherwise(text.cast(pl.Float64, strict=False))
    )


def _integer(col: str) -> pl.Expr:
    as_float = pl.col(col).cast(pl.Float64, strict=False)
    integral = pl.when(as_float.is_finite() & (as_float == as_float.floor())).then(
        as_float.cast(pl.Int64, strict=False)
    )
    return pl.coalesce(pl.col(col).cast(pl.Int64, strict=False), integral)


def _typed_from_text(df: pl.DataFrame) -> pl.DataFrame:
    """Cast a frame of text columns to the record schema; bad cells become null."""
    return df.select(
        key=pl.when(pl.col("key") != "").then(pl.col("key")),
        value=_number("value"),
        reduction=pl.col("reduction").str.to_lowercase(),
        step=_integer("step"),
        timestamp=pl.col("timestamp").cast(pl.Float64, strict=False),
        rank=_integer("rank"),
        process=pl.col("process"),
    )


def _skip_reason(raw: pl.DataFrame, typed: pl.DataFrame) -> pl.Series:
    """Why each row of ``typed`` with a null required field is bad ('' when it is fine)."""
    reason = (
        pl.when(~pl.lit(typed["timestamp"]).pipe(_plausible)).then(pl.lit(_BAD_TIME)).otherwise(pl.lit(""))
    )
    for name in reversed(REQUIRED_FIELDS):
        missing = raw[name].is_null()
        invalid = typed[name].is_null() & ~missing
        what = "is not a number" if name in ("value", "timestamp") else "is not valid"
        if name in ("step", "rank"):
            what = "is not an integer"
        reason = (
            pl.when(pl.lit(missing))
            .then(pl.lit(f"missing '{name}'"))
            .when(pl.lit(invalid))
            .then(pl.lit(f"'{name}' {what}"))
            .otherwise(reason)
        )
    return pl.select(reason.alias("reason")).to_series()


def _plausible(ts: pl.Expr) -> pl.Expr:
    lo, hi = TIMESTAMP_RANGE
    return ts.is_not_nan() & (ts >= lo) & (ts < hi)


def _plausible_times(bounds: Any) -> bool:
    """Whether a writer's declared [min, max] timestamps lie in TIMESTAMP_RANGE."""
    lo, hi = TIMESTAMP_RANGE
    return (
        isinstance(bounds, list)
        and len(bounds) == 2
        and all(type(x) in (int, float) and math.isfinite(x) for x in bounds)
        and lo <= bounds[0]
        and bounds[1] < hi
    )


_BAD_TIME = "'timestamp' is not Unix epoch seconds from 1970 to 2286"
_RECORD_OK = pl.all_horizontal(
    *[pl.col(f).is_not_null() for f in REQUIRED_FIELDS], _plausible(pl.col("timestamp"))
)


def _finish(typed: pl.DataFrame) -> pl.DataFrame:
    return typed.with_columns(process=pl.coalesce(pl.col("process"), pl.format("rank{}", pl.col("rank"))))


def _accept(
    raw: pl.DataFrame,
    line_numbers: Callable[[], np.ndarray],
    rep: FileReport,
    report: ReadReport,
    *,
    typed_input: bool = False,
) -> pl.DataFrame:
    """Split a parsed frame into writer events, bad rows (reported) and good typed rows.

    ``raw`` holds text columns, or already typed ones when ``typed_input``; line numbers
    are only computed when a row has to be reported.
    """
    keep = None
    if "event" in raw.columns:
        # The writer's own lines; a record may carry an extra field named "event" (SPEC 2).
        events = raw["event"].is_in([SEGMENT_EVENT, SHUTDOWN_EVENT]) & raw["key"].is_null()
        if events.any():
            for row in raw.filter(raw["event"] == SEGMENT_EVENT).iter_rows(named=True):
                rank = _to_int(row.get("rank"))
                if row.get("process") is not None and rank is not None:
                    rep.source = (row["process"], rank)
            for row in raw.filter(raw["event"] == SHUTDOWN_EVENT).iter_rows(named=True):
                rank = _to_int(row.get("rank"))
                if row.get("process") is not None and rank is not None:
                    ts = row.get("timestamp")
                    report.shutdowns.append(
                        Shutdown(row["process"], rank, float(ts) if ts is not None else None)
                    )
            keep = ~events
            raw = raw.filter(keep)
    if typed_input:
        typed = raw.select(
            key=pl.when(pl.col("key") != "").then(pl.col("key")),
            value=pl.col("value"),
            reduction=pl.col("reduction").str.to_lowercase(),
            step=pl.col("step"),
            timestamp=pl.col("timestamp"),
            rank=pl.col("rank"),
            process=pl.col("process"),
        )
    else:
        typed = _typed_from_text(raw)
    ok = typed.select(_RECORD_OK).to_series()
    if not ok.all():
        numbers = line_numbers()
        if keep is not None:
            numbers = numbers[keep.to_numpy()]
        reasons = _skip_reason(raw, typed).filter(~ok)
        bad_lines = numbers[~ok.to_numpy()]
        for reason in reasons.unique(maintain_order=True):
            mask = (reasons == reason).to_numpy()
            rep.skip(reason, int(mask.sum()), bad_lines[mask][:MAX_LINES_KEPT].tolist())
        typed = typed.filter(ok)
    rep.records += typed.height
    return _finish(typed)


def _to_int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


# -- JSONL -------------------------------------------------------------------------------


def _read_jsonl(
    path: Path, sealed: dict[str, Any] | None, rep: FileReport, report: ReadReport
) -> pl.LazyFrame | None:
    if (
        sealed is not None
        and sealed.get("nonfinite") == 0
        and (sealed.get("records") == 0 or _plausible_times(sealed.get("timestamps")))
        and _intact(path, sealed)
    ):
        return _scan_sealed_jsonl(path, sealed, rep, report)
    try:
        data = path.read_bytes()
    except OSError as exc:
        rep.unreadable = str(exc)
        return None
    kind = _binary_kind(data)
    if kind is not None:
        rep.unreadable = f"{kind} data, not JSON lines" + (
            ": decompress it first (e.g. gunzip)" if kind.endswith("compressed") else ""
        )
        return None
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        last = data[cut:]
        if _is_json_object(last):
            data += b"\n"
        else:
            rep.truncated = True
            rep.skip(_TRUNCATED, 1, [data.count(b"\n", 0, cut) + 1])
            data = data[:cut]
    newlines = data.count(b"\n")

    def line_numbers() -> np.ndarray:
        import numpy as np

        ends = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)
        starts = np.r_[0, ends[:-1] + 1]
        return np.flatnonzero(ends > starts) + 1

    for schema, typed_input in ((_TYPED_SCHEMA, True), (_TEXT_SCHEMA, False)):
        try:
            raw = pl.read_ndjson(data, schema=schema)
        except (pl.exceptions.PolarsError, ValueError):
            continue
        # polars skips blank lines; any other difference means a line was lost: fall back.
        if raw.height == newlines or raw.height == len(line_numbers()):
            if raw.height == 0:
                return None
            return _accept(raw, line_numbers, rep, report, typed_input=typed_input).lazy()
    raw, numbers = _jsonl_line_by_line(data, rep)
    return _accept(raw, lambda: numbers, rep, report).lazy()


def _intact(path: Path, meta: dict[str, Any]) -> bool:
    """Whether a sealed JSONL segment still has the size its writer gave it, ending in a newline."""
    body = meta.get("bytes")
    if not isinstance(body, int) or not isinstance(meta.get("records"), int):
        return False
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(size - 1)
            last = f.read(1)
    except OSError:
        return False
    return size == meta["_first_line_bytes"] + body and last == b"\n"


def _scan_sealed_jsonl(
    path: Path, meta: dict[str, Any], rep: FileReport, report: ReadReport
) -> pl.LazyFrame | None:
    """A JSONL segment sealed by our writer: typed, finite, whole (it was renamed into place
    complete), so it is scanned lazily, streaming, without a validation pass."""
    rep.source = (str(meta["process"]), int(meta["rank"]))
    rep.records += meta["records"]
    _take_declared(rep, meta)
    if meta.get("clean_shutdown"):
        report.shutdowns.append(Shutdown(rep.source[0], rep.source[1], meta.get("timestamp")))
    if meta["records"] == 0:
        return None
    return (
        pl.scan_ndjson(path, schema=_TYPED_SCHEMA).filter(pl.col("key").is_not_null()).select(*POLARS_SCHEMA)
    )


def _binary_kind(data: bytes) -> str | None:
    """What a file named .jsonl holds instead of text, if it is not text."""
    for magic, kind in _BINARY_MAGIC.items():
        if data.startswith(magic):
            return kind
    if b"\x00" in data[:4096]:
        return "binary"
    return None


def _is_json_object(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def _jsonl_line_by_line(data: bytes, rep: FileReport) -> tuple[pl.DataFrame, np.ndarray]:
    """The fallback for files polars cannot parse: find the bad lines one by one."""
    import numpy as np

    columns: dict[str, list[str | None]] = {name: [] for name in _TEXT_SCHEMA}
    numbers = []
    for number, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            rep.skip("not valid JSON", 1, [number])
            continue
        if not isinstance(obj, dict):
            rep.skip("not a JSON object", 1, [number])
            continue
        numbers.append(number)
        for name, col in columns.items():
            col.append(_as_text(obj.get(name)))
    return pl.DataFrame(columns, schema=_TEXT_SCHEMA), np.asarray(numbers, dtype=np.int64)


def _as_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, str)):
        return str(value)
    return json.dumps(value)


# -- Parquet and Arrow -----------------------------------------------------------------------


_EXACT_TYPES = {
    "key": pl.String,
    "value": pl.Float64,
    "reduction": pl.String,
    "step": pl.Int64,
    "timestamp": pl.Float64,
    "rank": pl.Int64,
}


def _scan_parquet(
    path: Path, own: dict[str, Any] | None, rep: FileReport, report: ReadReport
) -> tuple[pl.LazyFrame | None, bool, pl.LazyFrame | None]:
    """A lazy typed scan of one file; whether its rows need no check (sealed by our writer
    from typed arrays, so no nulls by construction); for a file whose columns had to be
    cast, the query of its null counts after the casts."""
    try:
        schema = pl.read_parquet_schema(path)
        rows = pl.scan_parquet(path).select(pl.len()).collect().item()
    except Exception as exc:
        rep.unreadable = f"{type(exc).__name__}: {exc}".splitlines()[0]
        return None, True, None
    if own and "process" in own and "rank" in own:
        rep.source = (str(own["process"]), int(own["rank"]))
    if own and own.get("clean_shutdown") and "process" in own and "rank" in own:
        report.shutdowns.append(Shutdown(str(own["process"]), int(own["rank"]), own.get("timestamp")))
    missing = [f for f in REQUIRED_FIELDS if f not in schema]
    if missing:
        rep.skip(f"lacks column(s) {', '.join(missing)}", rows)
        return None, True, None
    nested = [
        f"'{f}' is {schema[f]}"
        for f in (*REQUIRED_FIELDS, "process")
        if f in schema and schema[f].is_nested()
    ]
    if nested:
        rep.unreadable = f"column {', '.join(nested)}: a record field must be a number or a string"
        return None, True, None
    if rows == 0:
        return None, True, None
    exact = all(schema[name] == dtype for name, dtype in _EXACT_TYPES.items())
    ours = (  # sealed by our writer, untouched, with clock timestamps
        own is not None and own.get("records") == rows and _plausible_times(own.get("timestamps"))
    )
    if ours:
        assert own is not None
        _take_declared(rep, own)
        rep.hashed = exact and rep.keys is not None and schema.get(KEY_HASH) == pl.Int64
    scan = pl.scan_parquet(path)
    if exact:
        typed = scan.select(
            *REQUIRED_FIELDS,
            process=pl.col("process").cast(pl.String) if "process" in schema else pl.lit(None, pl.String),
            **({KEY_HASH: pl.col(KEY_HASH)} if rep.hashed else {}),
        )
    else:
        typed = scan.select(
            key=pl.col("key").cast(pl.String),
            value=_parquet_value(schema["value"]),
            reduction=pl.col("reduction").cast(pl.String).str.to_lowercase(),
            step=_parquet_integer("step", schema["step"]),
            timestamp=_parquet_timestamp(schema["timestamp"]),
            rank=_parquet_integer("rank", schema["rank"]),
            process=pl.col("process").cast(pl.String) if "process" in schema else pl.lit(None, pl.String),
        )
    typed = typed.with_columns(process=pl.coalesce(pl.col("process"), pl.format("rank{}", pl.col("rank"))))
    rep.records += rows
    if ours:
        return typed, True, None
    # Exact-typed files are checked together, from null counts (read from null bitmaps);
    # others per file after casting. Rows are only counted where a null was found.
    return typed, False, None if exact else typed.select(pl.col(REQUIRED_FIELDS).null_count())


def _parquet_value(dtype: pl.DataType) -> pl.Expr:
    if dtype.is_numeric() or dtype == pl.Boolean:
        return pl.col("value").cast(pl.Float64)
    return pl.col("value").cast(pl.String).pipe(lambda _: _number("value"))


def _parquet_integer(col: str, dtype: pl.DataType) -> pl.Expr:
    """An integer column; a fractional or non-finite float is null (skipped), never truncated."""
    if dtype.is_integer():
        return pl.col(col).cast(pl.Int64, strict=False)
    if dtype.is_float():
        x = pl.col(col)
        return pl.when(x.is_finite() & (x == x.floor())).then(x.cast(pl.Int64, strict=False))
    return pl.col(col).cast(pl.String).pipe(lambda _: _integer(col))


def _parquet_timestamp(dtype: pl.DataType) -> pl.Expr:
    if dtype.is_temporal():
        return pl.col("timestamp").cast(pl.Datetime("us")).dt.epoch("us").cast(pl.Float64) / 1e6
    return pl.col("timestamp").cast(pl.Float64, strict=False)


def _run_parquet_checks(
    frames: list[pl.LazyFrame], checks: list[tuple[int, FileReport, pl.LazyFrame | None]]
) -> None:
    """Find foreign Parquet files with bad rows, count those rows by reason and drop them."""
    exact = [(i, rep) for i, rep, check in checks if check is None]
    suspects = [
        (i, rep)
        for i, rep, check in checks
        if check is not None and sum(check.collect(engine="streaming").row(0))
    ]
    if exact:
        bad_rows = pl.scan_parquet([rep.path for _, rep in exact]).select(
            *[pl.col(f).null_count() for f in REQUIRED_FIELDS],
            (~_plausible(pl.col("timestamp"))).sum().alias("bad_timestamps"),
        )
        if sum(bad_rows.collect(engine="streaming").row(0)):
            suspects += exact
    for index, rep in suspects:
        try:
            counts = (
                frames[index]
                .filter(~_RECORD_OK)
                .group_by(_PARQUET_REASON.alias("reason"))
                .len()
                .sort("reason")
                .collect(engine="streaming")
            )
        except pl.exceptions.PolarsError as exc:
            rep.unreadable = f"{type(exc).__name__}: {exc}".splitlines()[0]
            rep.records = 0
            frames[index] = frames[index].head(0)
            continue
        for reason, n in counts.iter_rows():
            rep.records -= n
            rep.skip(reason, n)
        if counts.height:
            frames[index] = frames[index].filter(_RECORD_OK)


def _parquet_reason() -> pl.Expr:
    reason: pl.Expr = pl.when(~_plausible(pl.col("timestamp"))).then(pl.lit(_BAD_TIME))
    for name in reversed(REQUIRED_FIELDS):
        what = (
            "a number"
            if name in ("value", "timestamp")
            else "an integer"
            if name in ("step", "rank")
            else "valid"
        )
        reason = (
            pl.when(pl.col(name).is_null()).then(pl.lit(f"'{name}' is null or not {what}")).otherwise(reason)
        )
    return reason


_PARQUET_REASON = _parquet_reason()


def _read_journal(path: Path, rep: FileReport, report: ReadReport) -> pl.LazyFrame | None:
    from metric_core import journal  # pyarrow: only for runs that hold a journal

    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return _read_sealed_replacement(path, rep, report)
    except OSError as exc:
        rep.unreadable = str(exc)
        return None
    decoded = journal.decode(data)
    if decoded.problems and decoded.table is None:
        rep.unreadable = "; ".join(decoded.problems)
        return None
    if decoded.process is not None and decoded.rank is not None:
        rep.source = (decoded.process, decoded.rank)
        if decoded.shutdown is not None:
            report.shutdowns.append(Shutdown(decoded.process, decoded.rank, decoded.shutdown))
    rep.dropped = decoded.dropped
    for problem in decoded.problems:
        rep.skip(problem, 0)
    if decoded.truncated:
        rep.truncated = True
        rep.skip(
            "unfinished write at the end (the writer was killed mid-write, or is writing now)",
            decoded.truncated_records,
        )
    if decoded.unknown_codes:
        rep.skip("key code without a key definition", decoded.unknown_codes)
    if decoded.table is None or decoded.table.num_rows == 0:
        return None
    df = pl.from_arrow(decoded.table)
    assert isinstance(df, pl.DataFrame)
    ok = df.select(_plausible(pl.col("timestamp"))).to_series()
    if not ok.all():
        rep.skip(_BAD_TIME, int((~ok).sum()))
        df = df.filter(ok)
        if df.height == 0:
            return None
    rep.records += df.height
    rep.keys, rep.hashed = decoded.pairs, True
    rep.steps = (int(df["step"].min()), int(df["step"].max()))  # type: ignore[arg-type]
    rep.timestamps = (float(df["timestamp"].min()), float(df["timestamp"].max()))  # type: ignore[arg-type]
    return df.lazy().cast(POLARS_SCHEMA)  # type: ignore[arg-type]


def _read_sealed_replacement(path: Path, rep: FileReport, report: ReadReport) -> pl.LazyFrame | None:
    """A journal that vanished after it was listed: its writer sealed it meanwhile, so read
    the sealed segment that names it (which the listing, made before, did not hold)."""
    for suffix in (".parquet", ".jsonl"):
        sealed = path.with_suffix(suffix)
        meta = _writer_meta(sealed)
        if meta is not None and meta.get("supersedes") == path.name:
            rep.path, rep.format = sealed, suffix.lstrip(".")
            if suffix == ".parquet":
                frame, trusted, _ = _scan_parquet(sealed, meta, rep, report)
                return frame if trusted else None
            return _read_jsonl(sealed, meta, rep, report)
    rep.unreadable = "deleted while it was being read, and no sealed segment replaces it"
    return None


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)
