"""Turning a result frame into a table on stdout or a file."""

from __future__ import annotations

import sys
from pathlib import Path

import polars as pl

from metric_core.errors import MetricLogError
from metric_core.schema import to_jsonl

OUT_SUFFIXES = (".parquet", ".csv", ".jsonl")
MAX_TABLE_ROWS = 40


def write_frame(df: pl.DataFrame, out: Path) -> None:
    """Write by extension; JSONL keeps NaN and infinities as "NaN"/"Infinity" strings."""
    suffix = out.suffix.lower()
    if suffix not in OUT_SUFFIXES:
        raise MetricLogError(f"--out {out}: use a file ending in {', '.join(OUT_SUFFIXES)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".parquet":
        df.write_parquet(out)
    elif suffix == ".csv":
        df.write_csv(out)
    else:
        out.write_bytes(to_jsonl(df))


def print_table(df: pl.DataFrame, *, max_rows: int = MAX_TABLE_ROWS) -> None:
    """A readable table; a long result is cut and the cut is said."""
    shown = df if df.height <= max_rows else df.head(max_rows)
    times = [c for c in ("timestamp", "window_start") if c in shown.columns]
    floats = [c for c, t in shown.schema.items() if t == pl.Float64 and c not in times]
    shown = shown.with_columns(
        *(pl.col(c).map_elements(lambda v: f"{v:.7g}", return_dtype=pl.String) for c in floats),
        *(pl.col(c).map_elements(lambda v: f"{v:.3f}", return_dtype=pl.String) for c in times),
    )
    with pl.Config(
        tbl_rows=max_rows,
        tbl_cols=-1,
        tbl_width_chars=200,
        tbl_hide_dataframe_shape=True,
        tbl_hide_column_data_types=True,
        fmt_str_lengths=60,
    ):
        print(shown)
    if df.height > max_rows:
        print(
            f"... {df.height - max_rows} more row(s) not shown ({df.height} in all); "
            "write them all with --out FILE.parquet|.csv|.jsonl",
            file=sys.stdout,
        )
