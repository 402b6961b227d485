"""Samples as a table: ``step``, ``rank``, ``process``, ``timestamp``, ``key``, then a
column a field, each typed by the values it holds."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import polars as pl

    from metric_core.offline.samples.reading import Sample

FIXED = ("step", "rank", "process", "timestamp", "key")
EXACT_FLOAT_INT = 2**53  # integers past this lose digits as float64: such a mixed field is text


def field_names(samples: list[Sample]) -> list[str]:
    """The union of the samples' fields, in the order first met."""
    names: dict[str, None] = {}
    for s in samples:
        for name in s.fields:
            names.setdefault(str(name), None)
    return list(names)


def column_names(names: list[str]) -> dict[str, str]:
    """Each field's column: its name, or ``sample.{name}`` for one named like a fixed column
    (again prefixed while that is a field's name too)."""
    out = {}
    for name in names:
        column = name
        while column in FIXED or (column != name and column in names):
            column = f"sample.{column}"
        out[name] = column
    return out


def samples_frame(samples: list[Sample]) -> pl.DataFrame:
    """A row a sample: ``step``, ``rank``, ``process``, ``timestamp``, ``key``, then a column a
    field. A field missing from a sample is null; a field of one kind keeps it (integers
    exact, as Int64, or text past 64 bits); ints and floats together are Float64 (text if
    an integer would lose digits); lists and dicts, and any other mix of kinds, are JSON text."""
    import polars as pl

    columns: dict[str, Any] = {
        "step": pl.Series("step", [s.step for s in samples], pl.Int64),
        "rank": pl.Series("rank", [s.rank for s in samples], pl.Int64),
        "process": pl.Series("process", [s.process for s in samples], pl.String),
        "timestamp": pl.Series("timestamp", [s.timestamp for s in samples], pl.Float64),
        "key": pl.Series("key", [s.key for s in samples], pl.String),
    }
    for name, column in column_names(field_names(samples)).items():
        values = [s.fields.get(name) for s in samples]
        columns[column] = _column(column, values)
    return pl.DataFrame(columns)


def _column(name: str, values: list[Any]) -> pl.Series:
    import polars as pl

    kinds = {_kind(v) for v in values if v is not None}
    if kinds == {"bool"}:
        return pl.Series(name, values, pl.Boolean)
    if kinds == {"int"} and all(v is None or -(2**63) <= v < 2**63 for v in values):
        return pl.Series(name, values, pl.Int64)
    if (
        kinds
        and kinds <= {"int", "float"}
        and all(v is None or isinstance(v, float) or abs(v) <= EXACT_FLOAT_INT for v in values)
    ):
        return pl.Series(name, [None if v is None else float(v) for v in values], pl.Float64)
    if kinds == {"str"}:
        return pl.Series(name, values, pl.String)
    # lists, dicts, and fields of mixed kinds: JSON text (a string quoted, so "1" is not 1)
    return pl.Series(
        name, [None if v is None else json.dumps(v, ensure_ascii=False) for v in values], pl.String
    )


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    return "json"
