"""Results written to files: a reduction (or any frame in a result's shape) by the file's
suffix, marked as a result metriclog wrote, so that no reader takes it for data.

A Parquet result carries the mark in its metadata (``segment.DERIVED_KEY``); a JSON-lines
result gets a hidden marker file beside it (``segment.derived_marker``), written before
the result appears. The reader names a marked file and never reads it (it reads no CSV
or JSON file at all).
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from metric_core.errors import PlanError
from metric_core.format.segment import DERIVED_KEY, derived_marker

if TYPE_CHECKING:
    import polars as pl

RESULT_SUFFIXES = (".parquet", ".csv", ".json", ".jsonl")


def write_result(
    frames: pl.DataFrame | Iterable[pl.DataFrame], out: str | os.PathLike[str], *, derived: str
) -> int:
    """Write ``frames`` (a frame, or frames of one schema: a list, or a stream written as
    they come, two frames in memory at a time) to ``out`` by its suffix (``RESULT_SUFFIXES``), marked
    as a result of ``derived`` (the command or call that made it, e.g. ``"reduce"``); the
    number of rows written.

    ``out`` may be an object storage URL: the file is written locally and stored whole.
    It appears whole or not at all (written under a hidden name, then renamed); JSON and
    JSON lines keep NaN and the infinities as docs/format.md spells them. Raises
    ``PlanError`` for another suffix, ``ValueError`` for no frame at all, ``OSError`` when
    it cannot be written.
    """
    import polars as pl

    from metric_core.offline.storage import run_path, written_at

    target = run_path(out)
    suffix = target.suffix.lower()
    if suffix not in RESULT_SUFFIXES:
        raise PlanError(
            f"must name a file ending in {', '.join(RESULT_SUFFIXES)}", option="out", value=str(out)
        )
    stream = iter([frames]) if isinstance(frames, pl.DataFrame) else iter(frames)
    first = next(stream, None)
    if first is None:
        raise ValueError(f"write_result({out!s}): no frame to write (a result has at least its columns)")
    second = next(stream, None)  # a stream of one frame is written as a frame
    rest = stream if second is None else itertools.chain([second], stream)
    with written_at(target) as local:
        local.parent.mkdir(parents=True, exist_ok=True)
        partial = local.with_name(f".{local.name}.partial")
        try:
            rows = _write(first, rest, second is None, partial, suffix, derived)
            if suffix == ".jsonl":  # marked before it appears: no reader takes it for data
                from metric_core.atomic import replace_file

                replace_file(derived_marker(local), (json.dumps({DERIVED_KEY: derived}) + "\n").encode())
            os.replace(partial, local)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
    return rows


def is_inside(path: str | os.PathLike[str], run_dir: str | os.PathLike[str]) -> bool:
    """Whether ``path`` lies in the run directory ``run_dir`` (a result written there is
    marked, and metriclog does not read it; another tool reading the directory may)."""
    from metric_core.offline.storage import run_path

    target, root = run_path(path), run_path(run_dir)
    if isinstance(target, Path) and isinstance(root, Path):  # local (see storage.is_remote)
        return target.resolve().is_relative_to(root.resolve())
    return str(target).startswith(str(root).rstrip("/") + "/")  # object storage


def _write(
    first: pl.DataFrame, rest: Iterator[pl.DataFrame], whole: bool, out: Path, suffix: str, derived: str
) -> int:
    rows = 0
    if whole and suffix == ".parquet":  # one frame: polars writes it, without pyarrow
        first.write_parquet(out, metadata={DERIVED_KEY: derived})
        return first.height
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        with pq.ParquetWriter(out, first.to_arrow().schema.with_metadata({DERIVED_KEY: derived})) as writer:
            return _written_behind(writer, itertools.chain([first], rest))
    with open(out, "wb") as f:
        if suffix == ".json":
            f.write(b"[")
        for frame in itertools.chain([first], rest):
            if suffix == ".csv":
                frame.write_csv(f, include_header=frame is first)
            elif frame.height:
                from metric_core.format.records import to_jsonl  # pyarrow: only for JSON

                lines: Any = to_jsonl(frame.to_arrow())
                if suffix == ".json":
                    lines = (b",\n" if rows else b"") + lines.rstrip(b"\n").replace(b"\n", b",\n")
                f.write(lines)
            rows += frame.height
        if suffix == ".json":
            f.write(b"]\n")
    return rows


def _written_behind(writer: Any, frames: Iterator[pl.DataFrame]) -> int:
    """``frames`` written by a Parquet ``writer`` on a thread of their own, one frame behind
    the one being made: pyarrow's encoding (strings, statistics: most of a large result's
    writing) lets go of the GIL, so it runs beside the engine's work on the next frame.
    Frames are written in order; a failure of either side stops both and is raised here,
    only once the writing thread is done with the file (the caller then closes it). The
    rows written."""
    from concurrent.futures import Future, ThreadPoolExecutor, wait

    rows = 0
    pending: Future[None] | None = None
    pool = ThreadPoolExecutor(1, thread_name_prefix="metriclog-write")
    try:
        for frame in frames:
            table = frame.to_arrow()
            if pending is not None:
                pending.result()  # at most one frame in the writing
            pending = pool.submit(writer.write_table, table)
            rows += frame.height
        if pending is not None:
            pending.result()
    finally:
        # Whatever ends the writing (a failure, a second Ctrl-C), the file is the writer's
        # alone again before anyone closes it.
        while pending is not None and not pending.done():
            try:
                wait([pending])
            except BaseException:  # a stop while a frame is written waits for it
                continue
        pool.shutdown(wait=False)
    return rows
