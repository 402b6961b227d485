"""Where a data command's rows go: a file by its suffix, or stdout as a table, CSV or JSON."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from .messages import say
from .tables import MAX_TABLE_ROWS, print_frames

if TYPE_CHECKING:
    import polars as pl


def emit(
    frames: pl.DataFrame | Iterator[pl.DataFrame],
    *,
    form: str | None,
    out: str | None,
    limit: int | None,
    tail: int | None,
    derived: str,
    run_dir: str | None,
    table: Callable[..., None] = print_frames,
) -> None:
    """A data command's rows: to ``out`` (a file, by its suffix; ``-``: stdout), else to
    stdout in ``form``: ``table`` by default on a terminal, ``csv`` into a pipe. Only the
    ``limit`` first or ``tail`` last rows, in every form; notes go to stderr."""
    stream = _chosen(iter([frames]) if not isinstance(frames, Iterator) else frames, limit, tail)
    if out is not None and out != "-":
        write_frames(stream, out, derived=derived, run_dir=run_dir)
        return
    if form is None:
        form = "table" if out is None and sys.stdout.isatty() else "csv"
    if form == "table":
        table(stream, max_rows=limit or tail or MAX_TABLE_ROWS)
        return
    write_stdout(stream, form)


def _chosen(frames: Iterator[pl.DataFrame], limit: int | None, tail: int | None) -> Iterator[pl.DataFrame]:
    if limit is not None:
        left = limit
        for i, frame in enumerate(frames):
            if left <= 0 and i:
                break
            yield frame.head(left)  # the first frame always, if empty: its columns
            left -= min(left, frame.height)
        return
    if tail is not None:
        import polars as pl

        kept: list[pl.DataFrame] = []
        held = 0
        for frame in frames:  # the last ``tail`` rows, never more held than that and a frame
            kept.append(frame)
            held += frame.height
            while len(kept) > 1 and held - kept[0].height >= tail:
                held -= kept.pop(0).height
        if kept:
            yield pl.concat(kept, how="vertical_relaxed").tail(tail)  # --tail 0: the columns alone
        return
    yield from frames


def write_stdout(frames: Iterator[pl.DataFrame], form: str) -> None:
    """Rows as CSV, a JSON array or JSON lines on stdout, every one, uncut; NaN and the
    infinities as docs/format.md spells them (CSV: NaN, inf, -inf; JSON: "NaN", "Infinity")."""
    from metric_core.format.records import to_jsonl

    out = sys.stdout.buffer
    first = True
    if form == "json":
        out.write(b"[")
    for frame in frames:
        if form == "csv":
            out.write(frame.write_csv(include_header=first).encode())
        elif frame.height:
            lines = to_jsonl(frame.to_arrow())
            if form == "json":
                body = lines.rstrip(b"\n").replace(b"\n", b",\n")
                out.write((b"" if first else b",\n") + body)
            else:
                out.write(lines)
        first = first and (form != "csv" and frame.height == 0)
    if form == "json":
        out.write(b"]\n")
    out.flush()


def write_frames(
    frames: pl.DataFrame | Iterator[pl.DataFrame],
    out: str | Path,
    *,
    derived: str,
    run_dir: str | None = None,
) -> None:
    """A result written to ``out`` (``offline.results.write_result``), and said; a warning
    first when ``out`` is inside the run directory ``run_dir``."""
    from metric_core.offline.results import is_inside, write_result

    if run_dir is not None and is_inside(out, run_dir):
        say(
            "warning",
            f"--out {out} is inside the run directory {run_dir}: metriclog marks it as a result and "
            "does not read it as data, but other tools reading the directory may",
        )
    rows = write_result(frames, out, derived=derived)
    say("info", f"wrote {rows} row(s) to {out}")
