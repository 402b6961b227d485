"""CSV, JSON lines and Parquet exports with named columns, read with polars a batch at a time.

Long form: ``key_col`` names the metric and ``value_col`` its value, a row each. Wide
form (no ``key_col``): every numeric column but the step and time columns is a key. The
step column must hold integers; the time column (epoch seconds) is optional: without one,
every record takes the file's modification time. The file is one source, named for it.

The file is scanned (``polars.scan_*``), never read whole: its columns and types first
(a CSV's from every row, counted in a streaming pass: ``_csv_types``), then the step
column checked, then the rows a batch at a time (``collect_batches``), so an export of
any size imports in bounded memory.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from metric_core.atomic import scratch_directory
from metric_core.errors import SourceError
from metric_core.offline.importers.source import PAST_FLOAT64, Importer, Item, Stream, Warn, file_identity

BATCH_ROWS = 65_536  # rows of the file at a time (the writer's batch)
NOT_NUMBERS = "cells of text that are no numbers, in columns of numbers"


class TableImporter(Importer):
    kind = "table"

    def __init__(
        self,
        warn: Warn,
        path: Path,
        *,
        step_col: str = "step",
        time_col: str | None = None,
        key_col: str | None = None,
        value_col: str | None = None,
    ) -> None:
        super().__init__(warn)
        self.path = path
        self.name = path.stem
        self.columns = {"step": step_col, "time": time_col, "key": key_col, "value": value_col}
        # Wide form: text columns holding numbers ("NaN" where the others are floats, a cell
        # of text among numbers): keys, their cells that are no numbers counted and left out.
        self.texted: list[str] = []
        if (key_col is None) != (value_col is None):
            raise SourceError("long form takes both --key-col and --value-col (wide form: neither)")

    def identity(self) -> dict[str, Any]:
        found: dict[str, Any] = {
            "kind": self.kind,
            "file": file_identity(self.path, self.path.parent),
            "columns": self.columns,
        }
        if self.columns["time"] is None:  # the records' time is the file's
            found["mtime"] = self.path.stat().st_mtime
        return found

    def streams(self) -> Iterator[Stream]:
        with contextlib.ExitStack() as held:  # a scratch copy, if one is made, until the records are taken
            frame = self._scan(held)
            self._check(frame)  # the columns and the steps, before anything is written
            yield Stream(self.name, 0, self._records(frame))

    def _scan(self, held: contextlib.ExitStack) -> Any:
        """The file as a ``LazyFrame`` whose schema is known (read here: a file polars
        cannot parse is refused before anything is written). JSON lines polars' parser
        refuses (Python's ``json`` writes NaN and the infinities bare) are read from a
        copy in a scratch folder (``_json_text``), held open by ``held``."""
        import polars as pl

        suffix = self.path.suffix.lower()
        with _readable(self.path):
            if suffix == ".csv":
                frame = pl.scan_csv(self.path, schema=_csv_types(self.path))
            elif suffix == ".parquet":
                frame = pl.scan_parquet(self.path)
            else:
                try:
                    frame = pl.scan_ndjson(self.path, infer_schema_length=None)
                    frame.collect_schema()  # its schema from every line: one pass, done once
                    return frame
                except pl.exceptions.PolarsError:
                    folder = held.enter_context(scratch_directory("metriclog-import-"))
                    frame = pl.scan_ndjson(_json_text(self.path, Path(folder)), infer_schema_length=None)
            frame.collect_schema()
        return frame

    def _check(self, frame: Any) -> None:
        """Every named column there, a key to import, and every step an integer (the first
        row that is not one is named)."""
        import polars as pl

        schema = frame.collect_schema()
        step, at = str(self.columns["step"]), self.columns["time"]
        for name in (step, at, self.columns["key"], self.columns["value"]):
            if name is not None and name not in schema:
                raise SourceError(
                    f"{self.path}: no column '{name}' (its columns: {', '.join(list(schema)[:20])}); "
                    "name the columns with --step-col, --time-col, --key-col and --value-col"
                )
        if self.columns["key"] is None and {"key", "value", "reduction"} <= set(schema):
            raise SourceError(
                f"{self.path}: holds metriclog's record columns (key, value, reduction), a record a row: "
                "import it in long form with --key-col key --value-col value"
                + (" --time-col timestamp" if "timestamp" in schema else "")
                + " (as one source)"
            )
        if self.columns["key"] is None:
            text = [c for c in self._others(schema) if schema[c] == pl.String]
            with _readable(self.path):
                self.texted = _numbers_in_text(frame, text)
        if self.columns["key"] is None and not self._keys(schema):
            raise SourceError(f"{self.path}: no numeric column to import besides '{step}'")
        if schema[step].is_integer():
            return
        column = pl.col(step)
        exact = column.cast(pl.Int64, strict=False)
        bad = column.is_not_null() & (exact.is_null() | (exact.cast(pl.Float64) != column))
        with _readable(self.path):
            first = frame.select(step).with_row_index("row").filter(bad).head(1).collect(engine="streaming")
        if first.height:
            line, value = first.row(0)
            raise SourceError(
                f"{self.path}: row {line + 1:,}: the step column '{step}' holds {value!r}, "
                "not an integer: name the step column with --step-col"
            )

    def _others(self, schema: Any) -> list[str]:
        """The columns but step and time."""
        return [c for c in schema if c not in (self.columns["step"], self.columns["time"], "__time")]

    def _keys(self, schema: Any) -> list[str]:
        """Wide form: every numeric or boolean column but step and time is a key, and every
        text column that holds a number (``texted``)."""
        import polars as pl

        return [
            c
            for c in self._others(schema)
            if schema[c].is_numeric() or schema[c] == pl.Boolean or c in self.texted
        ]

    def _records(self, frame: Any) -> Iterator[Item]:
        with _readable(self.path):
            for batch in frame.collect_batches(chunk_size=BATCH_ROWS):
                yield from self._long(batch).iter_rows()

    def _long(self, frame: Any) -> Any:
        """A batch's records as a frame of step, key, value, time."""
        import polars as pl

        step, at = str(self.columns["step"]), self.columns["time"]
        if not frame[step].dtype.is_integer():  # checked: each is an integer, or empty
            frame = frame.with_columns(pl.col(step).cast(pl.Int64, strict=False))
        times = frame[at].cast(pl.Float64) if at is not None else pl.repeat(
            self.path.stat().st_mtime, frame.height, eager=True, dtype=pl.Float64
        )  # fmt: skip
        frame = frame.with_columns(times.alias("__time"))
        key, value = self.columns["key"], self.columns["value"]
        before = self.skipped[PAST_FLOAT64] + self.skipped[NOT_NUMBERS]
        if key is not None and value is not None:
            left = [c for c in frame.columns if c not in (step, at, key, value, "__time")]
            if left:  # said, as the wide form says the columns it does not take
                taken = "the long form takes --key-col and --value-col"
                self.skipped[f"values of other columns ({', '.join(left[:5])}): {taken}"] += (
                    frame.height * len(left)
                )
            long = frame.select(
                pl.col(step).alias("step"),
                pl.col(key).cast(pl.String).alias("key"),
                pl.col(value).cast(pl.Float64, strict=False).alias("value"),
                pl.col("__time").alias("time"),
            )
        else:
            long = self._wide(frame, step, at)
        empty = long.filter(pl.any_horizontal(pl.all().is_null())).height - (
            self.skipped[PAST_FLOAT64] + self.skipped[NOT_NUMBERS] - before
        )
        if empty:
            self.skipped["empty cells (a row without that key, or no step, time or number)"] += empty
        return long.drop_nulls()

    def _wide(self, frame: Any, step: str, at: str | None) -> Any:
        """Wide form: a batch unpivoted, a record per key and row."""
        import polars as pl

        keys = self._keys(frame.schema)
        left = [c for c in frame.columns if c not in (*keys, step, at, "__time")]
        if left:
            self.skipped[f"values of columns that are no numbers ({', '.join(left[:5])})"] += (
                frame.height * len(left)
            )
        texted = [c for c in keys if c in self.texted]
        if texted:  # a cell of text that is no number: left out, and counted
            numbers = {c: pl.col(c).cast(pl.Float64, strict=False) for c in texted}
            bad = frame.select(
                pl.sum_horizontal((pl.col(c).is_not_null() & numbers[c].is_null()).sum() for c in texted)
            )
            if bad.item():
                self.skipped[NOT_NUMBERS] += bad.item()
            frame = frame.with_columns(**numbers)
        for c in [c for c in keys if frame[c].dtype in (pl.Int64, pl.UInt64)]:  # (a narrower one always is)
            held = pl.col(c).is_between(-(1 << 53), 1 << 53)  # past 2**53: refused, never rounded
            big = frame.select((~held).sum()).item()
            if big:
                self.skipped[PAST_FLOAT64] += big
                frame = frame.with_columns(pl.when(held).then(pl.col(c)).alias(c))
        frame = frame.with_columns(pl.col(keys).cast(pl.Float64))
        long = frame.select(step, "__time", *keys)  # a column named key or value is no name of polars'
        return long.unpivot(keys, index=[step, "__time"], variable_name="__key", value_name="__value").select(
            pl.col(step).alias("step"), pl.col("__key").alias("key"), pl.col("__value").alias("value"),
            pl.col("__time").alias("time"),
        )  # fmt: skip


def _json_text(path: Path, folder: Path) -> Path:
    """A copy in ``folder`` of a JSON-lines file that polars' parser refuses, a line at a
    time: each line parsed by Python's ``json`` (which reads NaN, Infinity and -Infinity
    bare, as it writes them) and written again with those numbers as text ("NaN"), which
    the wide form reads as numbers. A line that is no JSON is refused, naming it."""
    import json

    def spelled(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
        if isinstance(value, dict):
            return {k: spelled(v) for k, v in value.items()}
        if isinstance(value, list):
            return [spelled(v) for v in value]
        return value

    copy = folder / path.name
    with path.open("rb") as lines, copy.open("w") as out:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip(b"\r\n"))
            except ValueError as exc:
                where = f", column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
                said = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
                raise SourceError(
                    f"{path}: line {number:,}{where} is not JSON ({said}): fix or remove it"
                ) from None
            out.write(json.dumps(spelled(row)) + "\n")
    return copy


def _numbers_in_text(frame: Any, columns: list[str]) -> list[str]:
    """Those of the text ``columns`` most of whose cells read as numbers ("1.5", "NaN",
    "inf"), in one streaming pass: a column of labels with a number here and there stays
    text."""
    import polars as pl

    if not columns:
        return []
    numbers = [pl.col(c).cast(pl.Float64, strict=False).is_not_null().sum().alias(f"{c}\0n") for c in columns]
    cells = [pl.col(c).is_not_null().sum().alias(f"{c}\0c") for c in columns]
    row = frame.select(*numbers, *cells).collect(engine="streaming").row(0)
    return [c for i, c in enumerate(columns) if 2 * row[i] > row[len(columns) + i]]


def _csv_types(path: Path) -> dict[str, Any]:
    """Each CSV column's type from every row, as polars infers them (Int64 where every value
    is an integer, else Float64 where every one is a number, else Boolean where every one is
    true or false, else String; a column with no value: String), counted in one streaming
    pass: polars' own inference over every row holds the whole file in memory."""
    import polars as pl

    strings = pl.scan_csv(path, infer_schema=False)
    names = strings.collect_schema().names()
    tests = {
        pl.Int64: lambda c: c.cast(pl.Int64, strict=False).is_not_null(),
        pl.Float64: lambda c: c.cast(pl.Float64, strict=False).is_not_null(),
        pl.Boolean: lambda c: c.str.to_lowercase().is_in(["true", "false"]),
    }
    counts = (
        strings.select(
            *[pl.col(n).is_not_null().sum().alias(f"{i}") for i, n in enumerate(names)],
            *[
                (pl.col(n).is_not_null() & ~test(pl.col(n))).sum().alias(f"{i} {t}")
                for i, n in enumerate(names)
                for t, test in tests.items()
            ],
        )
        .collect(engine="streaming")
        .row(0, named=True)
    )
    return {
        n: next((t for t in tests if counts[f"{i}"] and not counts[f"{i} {t}"]), pl.String)
        for i, n in enumerate(names)
    }


@contextlib.contextmanager
def _readable(path: Path) -> Iterator[None]:
    """polars' and the file system's errors as a ``SourceError`` naming the file."""
    import polars as pl

    try:
        yield
    except (pl.exceptions.PolarsError, OSError) as exc:
        raise SourceError(
            f"{path}: not readable as {path.suffix.lower()[1:]}: {str(exc).splitlines()[0]}"
        ) from None
