"""Records checked and typed: text columns cast to the record schema, bad rows found and named.

Every format's reader ends here: a row with a required field missing or of the wrong
kind, or a timestamp that is not a clock's (``TIMESTAMP_RANGE``), is skipped and
counted with its reason; a record without a process gets ``rank{rank}``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import polars as pl

from metric_core.format.schema import DEFAULT_PROCESS_PREFIX, FIELDS, REQUIRED_FIELDS, TIMESTAMP_RANGE
from metric_core.format.segment import BLOCK_EVENT, SEGMENT_EVENT, SHUTDOWN_EVENT
from metric_core.offline.read.report import MAX_LINES_KEPT, FileReport, ReadReport, Shutdown

if TYPE_CHECKING:
    import numpy as np

_POLARS_TYPES = {"string": pl.String(), "float64": pl.Float64(), "int64": pl.Int64()}
POLARS_SCHEMA: dict[str, pl.DataType] = {name: _POLARS_TYPES[kind] for name, kind in FIELDS.items()}
TEXT_SCHEMA = {name: pl.String() for name in (*POLARS_SCHEMA, "event")}
TYPED_SCHEMA = {**POLARS_SCHEMA, "event": pl.String()}
FrameT = TypeVar("FrameT", pl.DataFrame, pl.LazyFrame)


# Exact or refused: an integer token float64 does not hold exactly is no value.
INEXACT = "is an integer float64 cannot hold exactly"
_WHOLE = r"^[+-]?\d+$"


def number(col: str) -> pl.Expr:
    """A number from text; an integer float64 cannot hold exactly is null (refused, never
    rounded), checked to 38 digits (beyond, an integer token is taken as a float64 wrote it)."""
    text = pl.col(col)
    lowered = text.str.to_lowercase()
    as_float = text.cast(pl.Float64, strict=False)
    return (
        pl.when(lowered == "true")
        .then(pl.lit(1.0))
        .when(lowered == "false")
        .then(pl.lit(0.0))
        .when(_inexact_integer(text, as_float))
        .then(pl.lit(None, pl.Float64))
        .otherwise(as_float)
    )


def _inexact_integer(text: pl.Expr, as_float: pl.Expr) -> pl.Expr:
    digits = (
        text.str.strip_chars()
        .str.strip_prefix("+")
        .str.replace(r"^(-?)0+(\d)", "${1}${2}")
        .str.replace(r"^-0$", "0")
    )
    back = as_float.cast(pl.Int128, strict=False).cast(pl.String)
    return text.str.strip_chars().str.contains(_WHOLE) & (back != digits).fill_null(False)


def integer(col: str) -> pl.Expr:
    """An int64 from text: an integer, or a whole number written as a float (``5.0``); one
    outside int64 is null (refused), never clamped to its end."""
    return pl.coalesce(
        pl.col(col).cast(pl.Int64, strict=False), whole(pl.col(col).cast(pl.Float64, strict=False))
    )


def whole(x: pl.Expr) -> pl.Expr:
    """A float that is a whole number inside int64 as an int64; else null. The ends are
    open: a number just outside int64 (-2**63 - 1) is -2**63 as a float64."""
    inside = x.is_finite() & (x == x.floor()) & (x > -(2.0**63)) & (x < 2.0**63)
    return pl.when(inside).then(x.cast(pl.Int64, strict=False))


OUTSIDE_INT64 = "is outside int64 (an integer from -2**63 to 2**63-1)"


def _typed_from_text(df: pl.DataFrame) -> pl.DataFrame:
    """Cast a frame of text columns to the record schema; bad cells become null."""
    return df.select(
        key=pl.when(pl.col("key") != "").then(pl.col("key")),
        value=number("value"),
        reduction=pl.col("reduction").str.to_lowercase(),
        step=integer("step"),
        timestamp=pl.col("timestamp").cast(pl.Float64, strict=False),
        rank=integer("rank"),
        process=pl.col("process"),
    )


def _skip_reason(raw: pl.DataFrame, typed: pl.DataFrame) -> pl.Series:
    """Why each row of ``typed`` with a null required field is bad ('' when it is fine)."""
    reason = pl.when(~pl.lit(typed["timestamp"]).pipe(plausible)).then(pl.lit(BAD_TIME)).otherwise(pl.lit(""))
    for name in reversed(REQUIRED_FIELDS):
        missing = raw[name].is_null()
        invalid = typed[name].is_null() & ~missing
        what = "is not a number" if name in ("value", "timestamp") else "is not valid"
        if name in ("step", "rank"):
            what = "is not an integer"
        inexact = (
            invalid & raw[name].str.strip_chars().str.contains(_WHOLE).fill_null(False)
            if name == "value" and raw[name].dtype == pl.String
            else pl.Series([False] * len(raw))
        )
        outside = pl.Series([False] * len(raw))
        if name in ("step", "rank") and raw[name].dtype == pl.String:  # a whole number, but too large
            as_float = raw[name].cast(pl.Float64, strict=False)
            outside = invalid & (as_float.is_finite() & (as_float == as_float.floor())).fill_null(False)
        reason = (
            pl.when(pl.lit(missing))
            .then(pl.lit(f"'{name}' is missing or null"))  # a JSON line's null reads as missing
            .when(pl.lit(inexact))
            .then(pl.lit(f"'{name}' {INEXACT}"))
            .when(pl.lit(outside))
            .then(pl.lit(f"'{name}' {OUTSIDE_INT64}"))
            .when(pl.lit(invalid))
            .then(pl.lit(f"'{name}' {what}"))
            .otherwise(reason)
        )
    return pl.select(reason.alias("reason")).to_series()


def plausible(ts: pl.Expr) -> pl.Expr:
    lo, hi = TIMESTAMP_RANGE
    return ts.is_not_nan() & (ts >= lo) & (ts < hi)


BAD_TIME = "'timestamp' is not Unix epoch seconds from 1970 to 2286"
RECORD_OK = pl.all_horizontal(
    *[pl.col(f).is_not_null() for f in REQUIRED_FIELDS], plausible(pl.col("timestamp"))
)


def with_process(typed: FrameT) -> FrameT:
    """Records without a process name get ``rank{rank}`` (``schema.default_process_name``)."""
    default = pl.format(DEFAULT_PROCESS_PREFIX + "{}", pl.col("rank"))
    return typed.with_columns(process=pl.coalesce(pl.col("process"), default))


def accept(
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
        # The writer's own lines; a record may carry an extra field named "event" (docs/format.md).
        events = raw["event"].is_in([SEGMENT_EVENT, SHUTDOWN_EVENT, BLOCK_EVENT]) & raw["key"].is_null()
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
                        Shutdown(row["process"], rank, float(ts) if ts is not None else None, rep.attempt)
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
    ok = typed.select(RECORD_OK).to_series()
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
    return with_process(typed)


def _to_int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
