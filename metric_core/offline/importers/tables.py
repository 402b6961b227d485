"""CSV, JSON lines and Parquet exports with named columns, read with polars.

Long form: ``key_col`` names the metric and ``value_col`` its value, a row each. Wide
form (no ``key_col``): every numeric column but the step and time columns is a key. The
step column must hold integers; the time column (epoch seconds) is optional: without one,
every record takes the file's modification time. The file is one source, named for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from metric_core.errors import SourceError
from metric_core.offline.importers.source import PAST_FLOAT64, Importer, Stream, Warn, file_identity


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
        rows = self._long(self._read())  # read and checked before anything is written
        yield Stream(self.name, 0, rows.iter_rows())

    def _read(self) -> Any:
        import polars as pl

        suffix = self.path.suffix.lower()
        try:
            if suffix == ".csv":
                return pl.read_csv(self.path, infer_schema_length=None)
            if suffix == ".parquet":
                return pl.read_parquet(self.path)
            return pl.read_ndjson(self.path, infer_schema_length=None)
        except (pl.exceptions.PolarsError, OSError) as exc:
            raise SourceError(
                f"{self.path}: not readable as {suffix[1:]}: {str(exc).splitlines()[0]}"
            ) from None

    def _long(self, frame: Any) -> Any:
        """The records as a frame of step, key, value, time."""
        import polars as pl

        step, at = str(self.columns["step"]), self.columns["time"]
        for name in (step, at, self.columns["key"], self.columns["value"]):
            if name is not None and name not in frame.columns:
                raise SourceError(
                    f"{self.path}: no column '{name}' (its columns: {', '.join(frame.columns[:20])}); "
                    "name the columns with --step-col, --time-col, --key-col and --value-col"
                )
        if not frame[step].dtype.is_integer():
            exact = frame[step].cast(pl.Int64, strict=False)
            bad = frame[step].is_not_null() & (exact.is_null() | (exact.cast(pl.Float64) != frame[step]))
            if bad.any():
                line = int(bad.arg_max() or 0)
                raise SourceError(
                    f"{self.path}: row {line + 1:,}: the step column '{step}' holds {frame[step][line]!r}, "
                    "not an integer: name the step column with --step-col"
                )
            frame = frame.with_columns(exact.alias(step))
        times = frame[at].cast(pl.Float64) if at is not None else pl.repeat(
            self.path.stat().st_mtime, frame.height, eager=True, dtype=pl.Float64
        )  # fmt: skip
        frame = frame.with_columns(times.alias("__time"))
        key, value = self.columns["key"], self.columns["value"]
        if key is not None and value is not None:
            long = frame.select(
                pl.col(step).alias("step"),
                pl.col(key).cast(pl.String).alias("key"),
                pl.col(value).cast(pl.Float64, strict=False).alias("value"),
                pl.col("__time").alias("time"),
            )
        else:
            long = self._wide(frame, step, at)
        empty = long.filter(pl.any_horizontal(pl.all().is_null())).height - self.skipped[PAST_FLOAT64]
        if empty:
            self.skipped["empty cells (a row without that key, or no step, time or number)"] += empty
        return long.drop_nulls()

    def _wide(self, frame: Any, step: str, at: str | None) -> Any:
        """Wide form: every numeric or boolean column but step and time is a key."""
        import polars as pl

        keys = [
            c for c, t in frame.schema.items()
            if c not in (step, at, "__time") and (t.is_numeric() or t == pl.Boolean)
        ]  # fmt: skip
        left = [c for c in frame.columns if c not in (*keys, step, at, "__time")]
        if left:
            self.skipped[f"values of columns that are no numbers ({', '.join(left[:5])})"] += (
                frame.height * len(left)
            )
        if not keys:
            raise SourceError(f"{self.path}: no numeric column to import besides '{step}'")
        for c in [c for c in keys if frame[c].dtype.is_integer()]:  # past 2**53: refused, never rounded
            big = int((frame[c].abs() > 1 << 53).sum())
            if big:
                self.skipped[PAST_FLOAT64] += big
                frame = frame.with_columns(pl.when(pl.col(c).abs() <= 1 << 53).then(pl.col(c)).alias(c))
        frame = frame.with_columns(pl.col(keys).cast(pl.Float64))
        return frame.unpivot(keys, index=[step, "__time"], variable_name="key", value_name="value").select(
            pl.col(step).alias("step"), "key", "value", pl.col("__time").alias("time")
        )
