"""Tables that fit the terminal: a result's rows, samples, a report's rows."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .messages import display_width, echo_prose, say

if TYPE_CHECKING:
    import polars as pl

MAX_TABLE_ROWS = 40


def print_frames(frames: pl.DataFrame | Iterator[pl.DataFrame], *, max_rows: int = MAX_TABLE_ROWS) -> None:
    """``print_table`` of a frame or a stream of frames: the first rows, and how many there were."""
    import polars as pl

    if isinstance(frames, pl.DataFrame):
        frames = iter([frames])
    head: list[pl.DataFrame] = []
    kept = total = 0
    for frame in frames:
        total += frame.height
        if kept < max_rows:
            head.append(frame.head(max_rows - kept))
            kept += head[-1].height
    print_table(
        pl.concat(head),
        max_rows=max_rows,
        total=total,
        drop_first=RESULT_DROPPED_FIRST,
        keep=RESULT_KEPT,
        cut=("key", "process"),
    )


def print_samples(frames: Iterator[pl.DataFrame], max_rows: int = MAX_TABLE_ROWS) -> None:
    """Samples as a table (long text cut to fit)."""
    import polars as pl

    frame = pl.concat(list(frames), how="vertical_relaxed")
    if frame.height == 0:
        say("info", "no samples (recorded with Reduce.SAMPLE) match")
        return
    text = [c for c, t in frame.schema.items() if t == pl.String]
    print_table(frame, max_rows=max_rows, cut=text, drop_first=("timestamp",), keep=("step", "key"))


# What a narrow terminal loses first of a result's columns (then columns from the right,
# such as --wide's keys): never what says which row it is, the key, or its value.
RESULT_DROPPED_FIRST = ("count", "reduction", "rank", "timestamp")
RESULT_KEPT = ("process", "step", "window_start", "key", "value")


def print_table(
    df: pl.DataFrame,
    *,
    max_rows: int = MAX_TABLE_ROWS,
    total: int | None = None,
    drop_first: Sequence[str] = (),
    keep: Sequence[str] = (),
    cut: Sequence[str] = (),
    whole: str = "--out FILE.csv",
    notes: Callable[[str], None] | None = None,
) -> None:
    """A readable table that fits the terminal (``COLUMNS``, else the width of the terminal
    stdout is; into a pipe or a file with ``COLUMNS`` unset, the table is whole).

    Times (``timestamp``, ``window_start``) print as local ISO 8601, floats with 7
    significant digits, missing values as blanks. A long result (``total`` rows, when ``df``
    holds only its first ones) is cut after ``max_rows``. A table too wide loses columns,
    ``drop_first`` first, then from the right, never the first one nor those in ``keep``;
    then the long values of the ``cut`` columns (text, never a number) are shortened with
    "…", to MIN_CUT characters at least. Every cut is said, with where to find it whole
    (``whole``); a table that still does not fit is printed as it is.
    """
    import polars as pl

    total = df.height if total is None else total
    shown = _readable(df.head(max_rows))
    width = _terminal_width()
    fixed = {*shown.columns[:1], *keep}
    order = [c for c in drop_first if c in shown.columns and c not in fixed]
    order += [c for c in reversed(shown.columns) if c not in order and c not in fixed]
    text = _rendered(shown)
    left_out: list[str] = []
    while display_width(text) > width and order:
        left_out.append(order.pop(0))
        shown = shown.drop(left_out[-1])
        text = _rendered(shown)
    texts = [c for c in cut if c in shown.columns]
    shortened = False
    while display_width(text) > width and texts:
        longest = max(n or 0 for n in shown.select(pl.col(texts).str.len_chars().max()).row(0))
        target = max(MIN_CUT, longest - (display_width(text) - width))
        if target >= longest:
            break
        shown = shown.with_columns(_shortened(pl.col(texts), target))
        shortened = True
        text = _rendered(shown)
    print(text)
    # A data command's notes go to stderr, so stdout holds the table alone; a report (inspect)
    # keeps them beside its table (``notes``).
    note = notes or (lambda line: say("note", line))
    if left_out:
        hidden = [c for c in df.columns if c in left_out]  # in the table's order
        named = ", ".join(hidden) if len(hidden) <= 8 else f"{len(hidden)} columns"
        note(f"columns not shown, for the terminal's width ({width}): {named}; {whole} has them all")
    if shortened:
        note(f"long values are cut (…) for the terminal's width ({width}); {whole} has them whole")
    if total > max_rows:
        note(f"... {total - max_rows} more row(s) not shown ({total} in all); {whole} has them all")


# The fewest characters a value is cut to (with its "…") for a narrow terminal.
MIN_CUT = 8


def _terminal_width() -> int:
    if "COLUMNS" in os.environ or sys.stdout.isatty():
        return shutil.get_terminal_size().columns
    return sys.maxsize


def _readable(df: pl.DataFrame) -> pl.DataFrame:
    """Every column as the text printed: local ISO times, 7-digit floats, blanks for nulls."""
    import polars as pl

    from metric_core.clock import local_time

    def time(v: float | None) -> str | None:
        return None if v is None else local_time(v, millis=True)

    out = []
    for name, dtype in df.schema.items():
        col = pl.col(name)
        if (name in ("timestamp", "window_start") or name.endswith("_time")) and dtype == pl.Float64:
            col = col.map_elements(time, return_dtype=pl.String)
        elif dtype == pl.Float64:
            col = col.map_elements(lambda v: f"{v:.7g}", return_dtype=pl.String)
        out.append(col.cast(pl.String).fill_null(""))
    return df.select(out)


def _rendered(df: pl.DataFrame) -> str:
    import polars as pl

    with pl.Config(
        tbl_rows=-1,
        tbl_cols=-1,
        tbl_width_chars=65_000,  # columns are chosen to fit, never squeezed by polars
        tbl_hide_dataframe_shape=True,
        tbl_hide_column_data_types=True,
        fmt_str_lengths=65_000,
    ):
        return str(df)


def _shortened(col: pl.Expr, chars: int) -> pl.Expr:
    """Values longer than ``chars`` cut in the middle, so both ends stay: names differ at
    their end as often as at their start (``GeneratorActor_r0`` -> ``Gene…_r0``)."""
    import polars as pl

    head, tail = (chars - 1) - (chars - 1) // 2, (chars - 1) // 2
    return (
        pl.when(col.str.len_chars() > chars)
        .then(col.str.slice(0, head) + "…" + col.str.tail(tail))
        .otherwise(col)
    )


def print_rows(rows: list[dict[str, Any]], *, max_rows: int = MAX_TABLE_ROWS, **fit: Any) -> None:
    """``print_table`` of a report's rows of plain values (``fit``: its ``drop_first`` and
    ``whole``); a report's notes stay beside its table, on stdout."""
    import polars as pl

    print_table(pl.DataFrame(rows), max_rows=max_rows, notes=echo_prose, **fit)
