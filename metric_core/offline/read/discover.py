"""Finding a run's files: the listing (symlinks, loops, a journal sealed meanwhile),
run.json, and the writer's metadata of each sealed segment."""

from __future__ import annotations

import errno
import functools
import json
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metric_core import run_json
from metric_core.format.sample import is_samples_file
from metric_core.format.schema import DATA_SUFFIXES, parse_json
from metric_core.format.segment import (
    DERIVED_KEY,
    PARQUET_KEY,
    SEGMENT_EVENT,
    Damaged,
    SegmentMeta,
    derived_marker,
)
from metric_core.offline.read.report import FileReport, ReadReport, rel
from metric_core.offline.storage import RunPath, listing, open_read, raise_store_failure, run_path, source

_MAX_SEGMENT_LINE = 1 << 26  # the writer's first line lists every key of the segment
# run.json values past these are not a run's: ignored and said.
MAX_WORLD_SIZE = 1 << 20


def list_data_files(root: RunPath, report: ReadReport, *, follow_symlinks: bool) -> list[Any]:
    """The data files, listed twice: a directory listing is no snapshot, so a journal sealed
    while it is listed can be missing from it under both its names. The second listing holds
    the sealed segment of every journal that vanished during the first.

    A run in object storage is listed once (no object is renamed there: a run is copied to
    a bucket, not written in it)."""
    if not isinstance(root, Path):
        found: list[Any] = []
        unnamed: list[tuple[str, str]] = []
        for path in listing(root, unnamed):
            parts = rel(path, root).split("/")
            if any(part.startswith(".") for part in parts):
                continue
            if is_record_file(parts[-1]):
                found.append(path)
            elif parts[-1] == "run.json" and len(parts) > 1:
                _another_run(path, root, report)
        report.skipped_paths += [(url, why) for url, why in unnamed if is_record_file(url.rstrip("/"))]
        return found
    first = set(walk_run(root, ReadReport(run_dir=root), follow_symlinks=follow_symlinks))
    second = set(walk_run(root, report, follow_symlinks=follow_symlinks))
    vanished = {p for p in first - second if p.suffix == ".journal"}
    return sorted(second | vanished)


def is_record_file(name: str) -> bool:
    """A file name of records (a segment, a journal, another tool's file), not of samples."""
    return name.endswith(DATA_SUFFIXES) and not is_samples_file(name)


def walk_run(
    root: Path, report: ReadReport, *, follow_symlinks: bool, wanted: Callable[[str], bool] = is_record_file
) -> Iterator[Path]:
    """Every file below ``root`` whose name is ``wanted`` (records' by default), each real
    file once, never a hidden one; what is not read goes in ``report``, with why: a symlink
    out of the run (unless ``follow_symlinks``), a loop of symlinks or one to nothing, a
    FIFO. A journal that vanished as it was listed (sealed meanwhile) is listed all the same."""
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
                real = _resolved(path)
                why = "inside" if real is not None and inside(real) else "outside"
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
                    f"{rel(path, root)} is {rel(seen[(st.st_dev, st.st_ino)], root)} again: read once"
                )
                continue
            seen[(st.st_dev, st.st_ino)] = path
            kept.append(d)
        dirnames[:] = kept
        for name in sorted(filenames):
            if name == "run.json" and here != root:
                _another_run(here / name, root, report)
            if name.startswith(".") or not wanted(name):
                continue
            path = here / name
            try:
                st = path.stat()  # through its symlinks: a loop or a dangling one fails here
                real = _resolved(path) if path.is_symlink() else path
                if real is None or (not follow_symlinks and real is not path and not inside(real)):
                    report.skipped_paths.append((path, _link_not_read(path, real)))
                    continue
            except OSError as exc:
                if isinstance(exc, FileNotFoundError) and not path.is_symlink():
                    if name.endswith(".journal"):
                        yield path  # sealed meanwhile: read from its sealed segment
                    continue
                report.skipped_paths.append((path, _not_read(path, exc)))
                continue
            if not stat.S_ISREG(st.st_mode):  # opening a FIFO would block; a device is no file
                report.skipped_paths.append((path, "not a regular file (a FIFO, socket or device): not read"))
                continue
            first = seen.get((st.st_dev, st.st_ino))
            if first is not None:
                report.notices.append(f"{rel(path, root)} is the same file as {rel(first, root)}: read once")
                continue
            seen[(st.st_dev, st.st_ino)] = path
            yield path


def _resolved(path: Path) -> Path | None:
    """``path`` with its symlinks resolved; None when they lead nowhere (a loop: Python up to
    3.12 raises RuntimeError for one, later ones OSError)."""
    try:
        return path.resolve(strict=True)
    except (OSError, RuntimeError):
        return None


def _link_not_read(path: Path, real: Path | None) -> str:
    """Why a symlink that ``stat`` follows is not read: it leads out of the run directory."""
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    if real is None:  # it resolved for stat, not now: changed meanwhile
        return f"symlink to {target}, which could not be resolved: not read"
    return f"symlink to {target}, outside the run directory: not read (--follow-symlinks reads it)"


def _not_read(path: Path, exc: OSError) -> str:
    """Why a path listed is not read: a symlink loop, a symlink to nothing, or the error."""
    try:
        target = os.readlink(path)
    except OSError:
        return f"not read ({exc.strerror or exc})"
    if exc.errno == errno.ELOOP:
        return f"symlink to {target}, a loop of symlinks that never reaches a file: not read"
    if isinstance(exc, FileNotFoundError):
        return f"symlink to {target}, which does not exist: not read"
    return f"symlink to {target}: not read ({exc.strerror or exc})"


def _another_run(run_json: Any, root: RunPath, report: ReadReport) -> None:
    """A run.json below the run directory: another run's, whose files are read with it."""
    inner = rel(run_json.parent, root)
    report.notices.append(
        f"{inner}/run.json: {inner} looks like a run of its own, read here as part of this one; "
        f"to read it alone, name it (e.g. {run_json.parent})"
    )


def read_run_json(root: RunPath, report: ReadReport) -> dict[str, Any]:
    """run.json's fields, each checked; a broken file or field is reported and left out.

    A run.json that is damaged (not JSON, or not matching its ``checksum``) is ignored,
    said, and named in ``report.run_json_damaged``: upload refuses it, since its run_id
    is the run's identity. One without a checksum (older, or another tool's) is read as is.
    """
    path = root / run_json.NAME
    if isinstance(path, Path) and path.is_symlink():
        try:
            path.stat()
        except OSError as exc:  # a loop, or a link to nothing
            report.notices.append(f"run.json: {_not_read(path, exc)}; its metadata is ignored")
            return {}
    if not path.exists():
        if isinstance(root, Path) and (root / run_json.IMPORTING).is_file():
            report.notices.append(
                f"an import into this directory stopped before its end ({run_json.IMPORTING}, no run.json): "
                "its records are partial; run the same `metriclog import` again to finish it"
            )
        return {}
    if isinstance(path, Path) and not path.is_file():  # a FIFO would block the read
        report.notices.append("run.json: not a regular file; its metadata is ignored")
        return {}
    try:
        meta = parse_json(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise_store_failure(path, exc)
        report.run_json_damaged = f"not valid JSON ({exc})"
        report.notices.append(f"run.json: not valid JSON ({exc}); its metadata is ignored: fix or remove it")
        return {}
    if not isinstance(meta, dict):
        report.run_json_damaged = f"not a JSON object ({type(meta).__name__})"
        report.notices.append(
            f'run.json: must hold a JSON object, e.g. {{"world_size": 8}}, not {type(meta).__name__}; ignored'
        )
        return {}
    verified = run_json.verified(meta)
    if verified is False:
        report.run_json_damaged = (
            "its fields do not match its checksum (damaged, or edited after it was written)"
        )
        report.notices.append(
            "run.json: its fields do not match its checksum (the file is damaged, or was edited after "
            "metriclog wrote it): its metadata is ignored; upload refuses the run until it is fixed"
        )
        return {}
    meta.pop(run_json.CHECKSUM, None)
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


def run_json_notices(run: str | os.PathLike[str]) -> list[str]:
    """What ``read_run_json`` says of a run's run.json, for a command that reads no records
    (``samples``) and warns of a damaged one all the same."""
    root = run_path(run)
    report = ReadReport(run_dir=root)
    read_run_json(root, report)
    return report.notices


@dataclass(frozen=True)
class Derived:
    """A file metriclog wrote as a result (``reduce --out``), marked as such: not data."""

    command: str


def _parquet_meta(path: RunPath) -> SegmentMeta | Derived | Damaged | None:
    import polars as pl  # here: a listing (``upload``'s, before it forks its reader) loads none
    from polars.exceptions import PanicException

    try:
        kv = pl.read_parquet_metadata(source(path))
    except (Exception, PanicException) as exc:
        raise_store_failure(path, exc)
        return None
    if DERIVED_KEY in kv:
        return Derived(kv[DERIVED_KEY])
    raw = kv.get(PARQUET_KEY)
    if raw is None:
        return None
    # Only metriclog's writer sets this key: text under it that is not its metadata (a
    # flipped brace or quote) was changed after it was sealed, like text failing its checksum
    meta = SegmentMeta.parse(raw)
    return Damaged("its metriclog metadata is not valid JSON") if meta is None else meta


def _jsonl_segment_meta(path: RunPath) -> SegmentMeta | Damaged | None:
    """The writer's first line of a sealed JSONL segment, if this file has one."""
    try:
        with open_read(path) as f:
            first = f.readline(_MAX_SEGMENT_LINE)
        obj = parse_json(first)
    except (OSError, ValueError) as exc:
        raise_store_failure(path, exc)
        return None
    if not (isinstance(obj, dict) and obj.get("event") == SEGMENT_EVENT):
        return None
    return SegmentMeta.parse(obj)


def writer_meta(path: RunPath) -> SegmentMeta | Derived | Damaged | None:
    """What metriclog recorded about a file: a sealed segment's metadata, or that it is a result."""
    if path.suffix == ".parquet":
        return _parquet_meta(path)
    if path.suffix == ".jsonl":
        marker = derived_marker(path)  # type: ignore[arg-type]  # a UPath too
        if marker.is_file():
            try:
                return Derived(str(parse_json(marker.read_bytes())[DERIVED_KEY]))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise_store_failure(path, exc)
                return Derived("reduce --out")
        return _jsonl_segment_meta(path)
    return None


@functools.lru_cache(maxsize=4096)
def listed_writer_meta(path: RunPath, size: int, mtime_ns: int) -> SegmentMeta | Derived | Damaged | None:
    """``writer_meta`` of an object as listed (bytes, mtime): read once per version of it,
    so that polling a run in object storage (``watch``) does not fetch every footer again."""
    return writer_meta(path)


def take_attempt(rep: FileReport, meta: SegmentMeta | None) -> None:
    """Which attempt of its source a sealed segment's writer declared, and what it lived."""
    if meta is not None and meta.attempt is not None:
        rep.attempt, rep.attempt_started = meta.attempt, meta.attempt_started
        rep.attempt_first_step = meta.attempt_first_step
        rep.life = meta.life


def take_declared(rep: FileReport, meta: SegmentMeta) -> None:
    """What a sealed segment's writer declared in its metadata."""
    rep.keys = None if meta.keys is None else list(meta.keys)
    rep.steps, rep.timestamps = meta.steps, meta.timestamps
    rep.dropped = list(meta.dropped)
    stats = meta.key_stats
    # only what adds up to the file: else its records are read (a declared key without them)
    if stats is not None and sum(s[2] for s in stats) == meta.records:
        rep.key_stats = stats


def copies(metas: dict[Path, SegmentMeta | None]) -> dict[Path, Path]:
    """Sealed segments found twice (the same source's same segment, e.g. a copy in a
    subfolder): each copy -> the one read, the shallowest (the writer writes at the top)."""
    first: dict[tuple[str | None, int | None, str | None, str], Path] = {}
    out = {}
    for path, meta in sorted(
        metas.items(), key=lambda item: (len(item[0].parts), item[0])
    ):  # shallowest first
        if meta is None:
            continue
        identity = (meta.process, meta.rank, meta.attempt, meta.supersedes)
        if identity in first:
            out[path] = first[identity]
        else:
            first[identity] = path
    return out


def superseded_tails(metas: dict[Path, SegmentMeta | Damaged | None]) -> dict[Path, str]:
    """Journals that a sealed segment already holds (a kill between rename and unlink)."""
    present = set(metas)
    out = {}
    for path, meta in metas.items():
        if meta is not None and meta.supersedes is not None:
            tail = path.parent / meta.supersedes
            if tail in present:
                out[tail] = path.name
    return out
