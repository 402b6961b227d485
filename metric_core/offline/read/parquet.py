"""Parquet files: the writer's sealed segments (trusted, typed) and any other tool's (cast, checked)."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import polars as pl
from polars.exceptions import PanicException

from metric_core.format.schema import DEFAULT_PROCESS_PREFIX, KEY_HASH, REQUIRED_FIELDS, TIMESTAMP_RANGE
from metric_core.format.segment import SegmentMeta
from metric_core.offline.read.discover import take_declared
from metric_core.offline.read.interned import KEY_BUDGET, categorical_keys
from metric_core.offline.read.report import COUNTING, MAX_LINES_KEPT, FileReport, ReadReport, Shutdown, rel
from metric_core.offline.read.validate import (
    BAD_TIME,
    POLARS_SCHEMA,
    RECORD_OK,
    integer,
    number,
    plausible,
    whole,
    with_process,
)
from metric_core.offline.storage import (
    RunPath,
    arrow_source,
    is_remote,
    open_read,
    raise_store_failure,
    size_and_mtime,
    source,
)

_EXACT_TYPES = {name: POLARS_SCHEMA[name] for name in REQUIRED_FIELDS}
T = TypeVar("T")


@dataclass(frozen=True)
class BatchTaken(Generic[T]):
    """What a reader's ``take_batch`` made of a batch of ``records`` records, instead of a frame."""

    records: int
    value: T


class NotTheFile(Exception):
    """A reader's ``take_batch`` failed: its caller's failure, not the file's (the reader
    raises the ``failure`` itself, and does not give the file up)."""

    def __init__(self, failure: Exception) -> None:
        super().__init__(str(failure))
        self.failure = failure


NOT_WHOLE = (
    "not a whole Parquet file: it lacks the footer a Parquet file ends with (cut short, or being written)"
)


def scan_parquet(
    path: RunPath, own: SegmentMeta | None, rep: FileReport, report: ReadReport
) -> tuple[pl.LazyFrame | None, bool, pl.LazyFrame | None]:
    """A lazy typed scan of one file; whether its rows need no check (sealed by our writer
    from typed arrays, so no nulls by construction); for a file whose columns had to be
    cast, the query of its null counts after the casts."""
    try:
        schema, rows = _shape(path, *size_and_mtime(path)) if is_remote(path) else _read_shape(path)
    except (Exception, PanicException) as exc:
        raise_store_failure(path, exc)
        rep.unreadable = f"{type(exc).__name__}: {exc}".splitlines()[0]
        if "must end with PAR1" in rep.unreadable or "at least 12 bytes" in rep.unreadable:
            rep.unreadable = NOT_WHOLE
        return None, True, None
    damage = None
    if own is not None and own.row_groups is not None:  # its pages carry checksums
        rewritten, damage = _footer_against(path, own, schema)
        if rewritten:
            report.notices.append(
                f"{rel(path, report.run_dir)}: its metriclog metadata does not describe it (rewritten "
                "by another tool?): ignored; its records are read and checked as another tool's"
            )
            own = None
    if own is not None and own.source is not None:
        rep.source = own.source
        if own.clean_shutdown:
            report.shutdowns.append(Shutdown(*own.source, own.timestamp, own.attempt))
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
    if damage is not None:
        rep.unreadable = f"the file is damaged: {damage}"
        return None, True, None
    if own is not None and own.row_groups is not None:
        rep.row_groups = own.row_groups
        rep.page_checksums = True
    # sealed by our writer, untouched, with clock timestamps
    ours = own is not None and own.records == rows and own.plausible_times
    if own is not None and ours:
        take_declared(rep, own)
        rep.hashed = exact and rep.keys is not None and schema.get(KEY_HASH) == pl.Int64
    typed = with_process(pl.scan_parquet(source(path)).select(**typed_columns(schema, rep.hashed)))
    rep.records += rows
    if ours:
        return typed, True, None
    rep.single_source = _footer_source(path, "process" in schema)
    rep.reductions = _footer_bounds(path, "reduction")
    # Exact-typed files are checked together, from null counts (read from null bitmaps);
    # others per file after casting. Rows are only counted where a null was found.
    return typed, False, None if exact else typed.select(pl.col(REQUIRED_FIELDS).null_count())


# The writer's columns as Parquet stores them (``metric_core.format.records.DICT_SCHEMA``).
_PHYSICAL = {
    "key": "BYTE_ARRAY",
    "value": "DOUBLE",
    "reduction": "BYTE_ARRAY",
    "step": "INT64",
    "timestamp": "DOUBLE",
    "rank": "INT64",
    "process": "BYTE_ARRAY",
    KEY_HASH: "INT64",
}


def _footer_against(
    path: RunPath, own: SegmentMeta, schema: Mapping[str, pl.DataType]
) -> tuple[bool, str | None]:
    """A checksummed segment's footer (which no page checksum covers) against its writer's
    checked metadata: whether the file was written again by a tool that kept the metadata
    (other columns, or its records cut into other row groups: then the metadata describes
    another file), and else what in the footer differs from what its writer wrote (the
    file is damaged), or None."""
    assert own.row_groups is not None
    try:
        meta = footer(path)
        columns = {
            meta.schema.column(i).name: meta.schema.column(i).physical_type for i in range(meta.num_columns)
        }
        arrow = {f.name: str(f.type) for f in meta.schema.to_arrow_schema()}
        counts = [n for g in range(meta.num_row_groups) if (n := meta.row_group(g).num_rows)]
    except (Exception, PanicException) as exc:
        raise_store_failure(path, exc)
        return False, f"its footer cannot be read ({f'{type(exc).__name__}: {exc}'.splitlines()[0]})"
    declared = [n for n, _, _ in own.row_groups]
    # A damage changes one name at most, and changes the total of the counts it changes.
    renamed = len(columns) == len(_PHYSICAL) and len(columns.keys() - _PHYSICAL.keys()) <= 1
    if not renamed or (counts != declared and sum(counts) == sum(declared)):
        return True, None
    if counts != declared:
        return False, f"its footer's row groups hold {counts} records, its writer wrote {declared}"
    written = {**_EXACT_TYPES, "process": pl.String, KEY_HASH: pl.Int64}
    strings = {"key": "string", "reduction": "string", "process": "string"}
    if (
        columns != _PHYSICAL
        or any(schema.get(n) != t for n, t in written.items())
        or any(arrow.get(n) != t for n, t in strings.items())
    ):
        return False, "its footer's column types are not its writer's"
    return False, None


def _read_shape(path: RunPath) -> tuple[dict[str, pl.DataType], int]:
    """A Parquet file's schema and rows, from its footer."""
    return pl.read_parquet_schema(source(path)), pl.scan_parquet(source(path)).select(
        pl.len()
    ).collect().item()


@functools.lru_cache(maxsize=4096)
def _shape(path: RunPath, size: int, mtime_ns: int) -> tuple[dict[str, pl.DataType], int]:
    """``_read_shape`` of an object, once per version of it (``watch`` polls a bucket)."""
    return _read_shape(path)


def footer(path: RunPath) -> Any:
    """A Parquet file's footer (pyarrow's FileMetaData: schema, row groups, statistics),
    parsed once however often it is asked for (again if the file changed; the last 256
    files' are kept, so a run of more files may parse some twice)."""
    return _footer(path, *size_and_mtime(path))


@functools.lru_cache(maxsize=256)
def _footer(path: RunPath, size: int, mtime_ns: int) -> Any:
    import pyarrow.parquet as pq

    with arrow_source(path) as where:
        return pq.read_metadata(where)


def _footer_source(path: RunPath, has_process: bool) -> tuple[str, int] | None:
    """The one (process, rank) of all of a file's records, when its footer's statistics say
    so (every row group with rank min == max, the same process, no nulls); else None."""
    try:
        meta = footer(path)
        names = meta.schema.names
        found: set[tuple[object, object]] = set()
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            values = []
            for name in ("rank", "process") if has_process else ("rank",):
                stats = group.column(names.index(name)).statistics
                if stats is None or not stats.has_min_max or stats.null_count or stats.min != stats.max:
                    return None
                values.append(stats.min)
            found.add((values[0], values[1] if has_process else None))
    except (Exception, PanicException) as exc:
        raise_store_failure(path, exc)
        return None
    if len(found) != 1:
        return None
    rank, process = found.pop()
    if not isinstance(rank, int) or isinstance(rank, bool):
        return None
    if isinstance(process, bytes):
        process = process.decode()
    return (str(process) if process is not None else f"{DEFAULT_PROCESS_PREFIX}{rank}"), rank


def _footer_bounds(path: RunPath, name: str) -> tuple[str, str] | None:
    """The least and the greatest text of a file's column ``name``, from its footer's
    statistics; None unless every row group has them and all are ASCII (legacy statistics
    order bytes as signed: on ASCII text, every order agrees)."""
    try:
        meta = footer(path)
        column = meta.schema.names.index(name)
        bounds: list[str] = []
        for g in range(meta.num_row_groups):
            stats = meta.row_group(g).column(column).statistics
            if stats is None or not stats.has_min_max:
                return None
            for bound in (stats.min, stats.max):
                text = bound.decode("ascii") if isinstance(bound, bytes) else bound
                if not isinstance(text, str) or not text.isascii():
                    return None
                bounds.append(text)
    except UnicodeDecodeError:
        return None
    except (Exception, PanicException) as exc:
        raise_store_failure(path, exc)
        return None
    return (min(bounds), max(bounds)) if bounds else None


def typed_columns(
    schema: Mapping[str, pl.DataType], hashed: bool, strings: type[pl.DataType] = pl.String
) -> dict[str, pl.Expr]:
    """Each record field of a Parquet file, from its columns as they are typed in the file
    (``strings``: the type key, reduction and process are read as)."""
    exact = all(schema[name] == dtype for name, dtype in _EXACT_TYPES.items())
    process = _text("process", schema).cast(strings) if "process" in schema else pl.lit(None, strings)
    if exact:
        exprs = {name: pl.col(name) for name in REQUIRED_FIELDS}
        exprs.update(key=pl.col("key").cast(strings), reduction=pl.col("reduction").cast(strings))
        return {**exprs, "process": process, **({KEY_HASH: pl.col(KEY_HASH)} if hashed else {})}
    # Lower-cased per record here; the engine, which keeps dictionary codes, does it per code.
    reduction = (
        _text("reduction", schema).cast(pl.String).str.to_lowercase()
        if strings is pl.String
        else _text("reduction", schema)
    )
    return {
        "key": _text("key", schema).cast(strings),
        "value": _parquet_value(schema["value"]),
        "reduction": reduction.cast(strings),
        "step": _parquet_integer("step", schema["step"]),
        "timestamp": _parquet_timestamp(schema["timestamp"]),
        "rank": _parquet_integer("rank", schema["rank"]),
        "process": process,
    }


def _text(name: str, schema: Mapping[str, pl.DataType]) -> pl.Expr:
    """A string field's column as text: bytes (a binary column) where they are UTF-8, else
    null (the record is skipped as its field not valid, never the file failed)."""
    if schema[name] == pl.Binary:
        return pl.col(name).map_batches(_utf8_or_null, return_dtype=pl.String)
    if schema[name] in (pl.String, pl.Categorical):
        return pl.col(name)
    return pl.col(name).cast(pl.String)  # numbers, booleans: their text, as JSON lines read them


def _utf8_or_null(column: pl.Series) -> pl.Series:
    def text(raw: bytes) -> str | None:
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return None

    distinct = column.unique().drop_nulls()  # each distinct value decoded once
    decoded = pl.Series([text(v) for v in distinct.to_list()], dtype=pl.String)
    return column.replace_strict(distinct, decoded, default=None, return_dtype=pl.String)


def categorical_batches(
    path: RunPath,
    columns: list[str],
    hashed: bool,
    row_groups: list[int] | None = None,
    rows: int | None = None,
    *,
    rep: FileReport,
    take_batch: Callable[[Any], T | None] | None = None,
) -> Iterator[tuple[int, pl.DataFrame | BatchTaken[T]]]:
    """``columns`` of the records of one Parquet file (or of its ``row_groups``), read once
    with pyarrow, in frames of at most ``rows`` records (None: one frame), each with the
    number of its first row in the file (from 0), strings kept as
    their dictionary codes (polars Categorical): what the engine groups on, without
    decoding or hashing each string. The same fields and casts as ``scan_parquet``'s frame.
    Each row group is read and checked whole before any of it is handed over, and one that
    fails is skipped and counted in ``rep`` (``checked_groups``); its frames are typed as
    they are asked for.

    ``take_batch``: a batch whose columns are already the record schema's and whose records
    are all good (``clean``) is first offered to it as pyarrow read it (dictionary strings,
    no copy); what it returns (None: it did not take it) is handed over for the frame, with
    the batch's count of records (``BatchTaken``)."""
    import pyarrow.parquet as pq

    meta = footer(path)
    schema = _polars_schema(meta)
    exprs = typed_columns(schema, hashed, strings=pl.Categorical)
    text_key = typed_columns(schema, hashed)["key"]  # for a frame of too many keys: interned
    wanted = [c for c in columns if c in exprs]
    sources, strings = _stored(schema, wanted)
    if not _as_records(schema):
        take_batch = None  # its columns are cast: only a frame has them as records
    with arrow_source(path) as where:  # a remote file, open until the last frame
        file = pq.ParquetFile(where, metadata=meta, read_dictionary=strings, page_checksum_verification=True)
        yield from _frames(file, wanted, exprs, text_key, sources, row_groups, rows, rep, take_batch)


def _stored(schema: Mapping[str, pl.DataType], fields: list[str]) -> tuple[set[str], list[str]]:
    """The columns of a Parquet file (of this schema) that the record ``fields`` are read
    from, and those of them that are strings (read as dictionary codes)."""
    stored = {c for c in fields if c in schema} | ({"rank"} if "process" in fields else set())
    strings = [
        c for c in stored & {"key", "reduction", "process"} if schema[c] in (pl.String, pl.Categorical)
    ]
    return stored, strings


def _frames(
    file: Any,
    wanted: list[str],
    exprs: dict[str, pl.Expr],
    text_key: pl.Expr,
    sources: set[str],
    row_groups: list[int] | None,
    rows: int | None,
    rep: FileReport,
    take_batch: Callable[[Any], T | None] | None,
) -> Iterator[tuple[int, pl.DataFrame | BatchTaken[T]]]:
    """``categorical_batches``' frames, from the open ``file``."""
    groups = list(range(file.num_row_groups) if row_groups is None else row_groups)
    empty = True
    for start, table in checked_parts(file, groups, sorted(sources), rep, rows):
        empty = False
        if take_batch is not None and clean(table):
            try:
                took = take_batch(table)
            except Exception as exc:
                raise NotTheFile(exc) from exc
            if took is not None:
                yield start, BatchTaken(len(table), took)
                continue
        yield start, _typed_frame(table, wanted, exprs, text_key)
    if empty:  # every row group asked for was damaged: a frame of no records, typed as others
        none = file.schema_arrow.empty_table().select(sorted(sources))
        yield 0, _typed_frame(none, wanted, exprs, text_key)


def _as_records(schema: Mapping[str, pl.DataType]) -> bool:
    """Whether a file's columns are read as the records' fields with no cast (``typed_columns``
    keeps them as they are): numbers typed as the record schema's, strings as text or
    dictionaries (Categorical)."""
    strings = (pl.String, pl.Categorical)
    return all(
        schema[name] in strings if dtype == pl.String else schema[name] == dtype
        for name, dtype in _EXACT_TYPES.items()
    ) and ("process" not in schema or schema["process"] in strings)


def clean(table: Any) -> bool:
    """Whether a batch of a Parquet file whose columns have the record schema's types holds
    the records as they are: no null in any column, strings as dictionary codes, each
    timestamp a clock's (``RECORD_OK``: nothing to drop, nothing to cast or to fill)."""
    import numpy as np

    from metric_core.format.records import as_numpy

    for name, column in zip(table.column_names, table.columns, strict=True):
        if column.null_count:
            return False
        if name in ("key", "reduction", "process") and not _text_codes(column.type):
            return False
        if name == "timestamp" and len(column):
            times = as_numpy(column, np.float64)
            lo, hi = TIMESTAMP_RANGE
            if not (lo <= times.min() and times.max() < hi):  # NaN fails both
                return False
    return True


def _text_codes(dtype: Any) -> bool:
    """Whether a pyarrow type is strings as dictionary codes."""
    import pyarrow as pa

    return pa.types.is_dictionary(dtype) and (
        pa.types.is_string(dtype.value_type) or pa.types.is_large_string(dtype.value_type)
    )


def _typed_frame(table: Any, wanted: list[str], exprs: dict[str, pl.Expr], text_key: pl.Expr) -> pl.DataFrame:
    """A table (or record batch) read by pyarrow as the record schema's frame: its keys
    Categorical, unless there are too many (``interned``: then as text, decoded here)."""
    if "key" in wanted:
        import pyarrow as pa

        column = table.column("key")
        chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
        if pa.types.is_dictionary(column.type):
            # a slice of a row group shares its dictionary: past the budget it is not copied
            if sum(len(c.dictionary) for c in chunks) > KEY_BUDGET:
                distinct = None
            else:
                distinct = pl.Series(pa.chunked_array([c.dictionary for c in chunks], column.type.value_type))
        else:
            distinct = pl.Series(pa.chunked_array(chunks, column.type)).unique()
        if distinct is None or not categorical_keys(distinct):
            exprs = {**exprs, "key": text_key}
            if pa.types.is_dictionary(column.type):
                at = table.schema.get_field_index("key")
                table = table.set_column(at, "key", column.cast(column.type.value_type))
    frame = pl.from_arrow(table)
    assert isinstance(frame, pl.DataFrame)
    df = frame.lazy().select(**{c: exprs[c] for c in wanted}).collect()
    if "process" in wanted and df["process"].null_count():  # named for their rank, where unnamed
        default = pl.format(DEFAULT_PROCESS_PREFIX + "{}", pl.col("rank")).cast(pl.Categorical)
        df = df.with_columns(process=pl.coalesce(pl.col("process"), default))
    return df


def checked_groups(
    file: Any, groups: list[int], columns: list[str] | None, rep: FileReport, rows: int | None = None
) -> Iterator[Any]:
    """The ``groups`` of an open Parquet ``file`` (pyarrow, page checksums verified where
    there are some), each read whole (in batches of ``rows``, or one table) and checked
    before any of it is handed over: a row group whose pages fail their checksums, fail to
    decode, or hold other than the records its footer (of a checksummed segment: its
    writer's metadata) declares is skipped, and counted in ``rep`` once. So what a damaged
    file gives does not depend on which threads read what first."""
    for _, part in checked_parts(file, groups, columns, rep, rows):
        yield part


def checked_parts(
    file: Any, groups: list[int], columns: list[str] | None, rep: FileReport, rows: int | None = None
) -> Iterator[tuple[int, Any]]:
    """``checked_groups``' parts, each with the number of its first row in the file (from 0)."""
    sizes = [file.metadata.row_group(g).num_rows for g in range(file.metadata.num_row_groups)]
    starts = [0, *itertools.accumulate(sizes)]
    for g in groups:
        if g in rep.damaged_groups:
            continue
        written = rep.row_groups[g][0] if rep.row_groups is not None else file.metadata.row_group(g).num_rows
        try:
            # Read as one table, then sliced: pyarrow's batches of a row group each carry
            # a dictionary of their own (the row group's, whole, or all read so far), so a
            # row group of a million distinct keys held eight copies of them.
            parts = [file.read_row_group(g, columns=columns)]
            if rows is not None:
                parts = parts[0].to_batches(max_chunksize=rows)
            for part in parts if rep.page_checksums is True else ():  # a dictionary index out of
                part.validate(full=True)  # range, say, that a damaged page header let decode
            found = sum(len(part) for part in parts)
            why = (
                None if found == written else f"{found:,} records decoded where its writer wrote {written:,}"
            )
        except (Exception, PanicException) as exc:  # of a damaged page: OSError, ArrowInvalid, ...
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if why is None:
            start = starts[g]
            for part in parts:
                yield start, part
                start += len(part)
            continue
        with COUNTING:
            if g not in rep.damaged_groups:
                rep.damaged_groups.add(g)
                rep.records -= written
                damaged = "is damaged" if rep.row_groups is not None else "cannot be read"
                rep.skip(f"row group {g} {damaged} ({why})", written)


def check_groups(
    rep: FileReport, fields: list[str] | None = None, row_groups: list[int] | None = None
) -> bool:
    """Whether the ``row_groups`` (None: all) of a Parquet file read whole: each read once
    now and let go, checked as every read of the record ``fields`` (None: of every column)
    checks it (``checked_groups``: the pages of their columns verified where they carry
    checksums, decoded, as many records as declared). One that fails is counted in ``rep``
    once, and every later read skips it. A file that cannot be opened does not read (its
    read says why)."""
    import pyarrow.parquet as pq

    groups: list[int] = []
    try:
        meta = footer(rep.path)
        columns, strings = _stored(_polars_schema(meta), fields) if fields is not None else (None, [])
        with arrow_source(rep.path) as where:
            file = pq.ParquetFile(
                where, metadata=meta, read_dictionary=strings, page_checksum_verification=True
            )
            groups = list(range(file.num_row_groups) if row_groups is None else row_groups)
            for _ in checked_groups(file, groups, None if columns is None else sorted(columns), rep):
                pass  # checked and let go: damage is rare, and a segment may be large
    except (Exception, PanicException) as exc:
        raise_store_failure(rep.path, exc)
        return False
    return not rep.damaged_groups.intersection(groups)


def pages_carry_checksums(path: RunPath) -> bool:
    """Whether a Parquet file's pages carry checksums (its writer's choice, made for every
    page), as the header of its first page says. That header is Thrift's compact protocol:
    the PageHeader's three sizes (fields 1-3, each an i32 whose field byte is 0x15), then
    field 4, ``crc``, when there is one. A header that does not read so counts as carrying
    them: the file is then verified, one more read and never a wrong value. A file that
    cannot be read says so when it is read."""
    try:
        meta = footer(path)
        group = next((g for g in range(meta.num_row_groups) if meta.row_group(g).num_rows), None)
        if group is None or meta.num_columns == 0:
            return False
        chunk = meta.row_group(group).column(0)
        start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
        with open_read(path) as file:
            file.seek(start)
            head = file.read(32)
    except (Exception, PanicException) as exc:
        raise_store_failure(path, exc)
        return False
    at = 0
    for _ in range(3):
        if at >= len(head) or head[at] != 0x15:
            return True
        at += 1
        while at < len(head) and head[at] & 0x80:  # the varint's bytes
            at += 1
        at += 1
    return at >= len(head) or head[at] == 0x15


def verify(rep: FileReport) -> pl.LazyFrame | None:
    """Read every row group of a file whose pages carry checksums to verify it
    (``check_groups``, every column); when one is damaged, the frame of the others (typed
    as ``scan_parquet`` types them), else None: the file's scan stands."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if check_groups(rep):
        return None
    with arrow_source(rep.path) as where:
        file = pq.ParquetFile(where, metadata=footer(rep.path), page_checksum_verification=True)
        tables = list(checked_groups(file, list(range(file.num_row_groups)), None, rep))
    table = pa.concat_tables(tables) if tables else file.schema_arrow.empty_table()
    frame = pl.from_arrow(table)
    assert isinstance(frame, pl.DataFrame)
    return with_process(frame.lazy().select(**typed_columns(frame.schema, rep.hashed)))


def row_group_lows(path: RunPath, column: str = "timestamp") -> list[tuple[float, int]] | None:
    """Each row group's lowest ``column`` value (timestamp or step) and its number of rows,
    from the footer, when the column holds what is read (float epoch seconds; integer
    steps) and every row group has its statistics; else None."""
    physical = ("DOUBLE",) if column == "timestamp" else ("INT32", "INT64")
    try:
        meta = footer(path)
        index = meta.schema.names.index(column)
        out = []
        for g in range(meta.num_row_groups):
            chunk = meta.row_group(g).column(index)
            stats = chunk.statistics
            if chunk.physical_type not in physical or stats is None or not stats.has_min_max:
                return None
            out.append((float(stats.min), meta.row_group(g).num_rows))
    except (Exception, PanicException) as exc:
        raise_store_failure(path, exc)
        return None
    return out


def kept_first_times(path: RunPath) -> list[float] | None:
    """Another tool's file's earliest timestamp of each row group, from its footer, when the
    footer shows that the record holding it is kept if its row group reads (and its time is
    a clock's, which the caller checks): no field's cast can make a null (``casts_keep``),
    every row group has statistics, no record field holds a null. Else None (then only
    reading the records tells)."""
    lows = row_group_lows(path, "timestamp")
    if not lows:
        return None
    try:
        meta = footer(path)
        names = meta.schema.names
        if not casts_keep(_polars_schema(meta)):
            return None
        for g in range(meta.num_row_groups):
            for name in REQUIRED_FIELDS:
                stats = meta.row_group(g).column(names.index(name)).statistics
                if stats is None or not stats.has_null_count or stats.null_count:
                    return None
    except (Exception, PanicException) as exc:
        raise_store_failure(path, exc)
        return None
    return [t for t, _ in lows]


def casts_keep(schema: Mapping[str, pl.DataType]) -> bool:
    """Whether ``typed_columns``' casts keep every value of a file of this schema (make no
    null, so skip no record): strings, numeric values, integer steps and ranks that fit
    int64, numeric times. Other columns are parsed, or may not fit."""
    return (
        all(schema[name] in (pl.String, pl.Categorical) for name in ("key", "reduction"))
        and _numeric(schema["value"])
        and schema["value"] not in _WIDE_INTEGERS
        and all(schema[name].is_integer() and schema[name] != pl.UInt64 for name in ("step", "rank"))
        and _numeric(schema["timestamp"])
    )


_WIDE_INTEGERS = (pl.Int64, pl.UInt64)  # wider than float64's 53-bit mantissa


def _numeric(dtype: pl.DataType) -> bool:
    return dtype.is_numeric() or dtype == pl.Boolean


def _polars_schema(meta: Any) -> pl.Schema:
    """The polars types of a Parquet file's columns (dictionary strings: Categorical), from
    its footer. An empty table made from no batches: ``Schema.empty_table`` imports pandas
    (0.15 s)."""
    import pyarrow as pa

    return pl.DataFrame(pa.Table.from_batches([], meta.schema.to_arrow_schema())).schema


def _parquet_value(dtype: pl.DataType) -> pl.Expr:
    if dtype in _WIDE_INTEGERS:  # exact or refused: an integer float64 cannot hold is null (skipped)
        as_float = pl.col("value").cast(pl.Float64)
        return pl.when(as_float.cast(dtype, strict=False) == pl.col("value")).then(as_float)
    if _numeric(dtype):
        return pl.col("value").cast(pl.Float64)
    return pl.col("value").cast(pl.String).pipe(lambda _: number("value"))


def _parquet_integer(col: str, dtype: pl.DataType) -> pl.Expr:
    """An integer column; a fractional or non-finite float is null (skipped), never truncated."""
    if dtype.is_integer():
        return pl.col(col).cast(pl.Int64, strict=False)
    if dtype.is_float():
        return whole(pl.col(col))
    return pl.col(col).cast(pl.String).pipe(lambda _: integer(col))


def _parquet_timestamp(dtype: pl.DataType) -> pl.Expr:
    if isinstance(dtype, pl.Datetime):
        # From the stored integer in its own unit: converting the unit first overflows (and
        # panics) on a time far out of range, which the range check then skips. Whole seconds
        # plus the fraction: polars divides by a constant as a multiplication by its
        # reciprocal, which is off by an ulp in a third of the times.
        per = {"ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}[dtype.time_unit or "us"]
        ticks = pl.col("timestamp").to_physical()
        return (ticks // per).cast(pl.Float64) + (ticks % per).cast(pl.Float64) / float(per)
    if isinstance(dtype, pl.Date):
        return pl.col("timestamp").to_physical().cast(pl.Float64) * 86_400.0
    if dtype.is_temporal():  # a time of day or a duration: no clock's
        return pl.lit(float("nan"), pl.Float64)
    return pl.col("timestamp").cast(pl.Float64, strict=False)


def run_parquet_checks(
    frames: list[pl.LazyFrame], checks: list[tuple[int, FileReport, pl.LazyFrame | None]]
) -> None:
    """Find foreign Parquet files with bad rows, count those rows by reason and drop them."""
    exact = [(i, rep) for i, rep, check in checks if check is None]
    suspects = []
    for i, rep, check in checks:
        try:
            if check is not None and sum(check.collect(engine="streaming").row(0)):
                suspects.append((i, rep))
        except (pl.exceptions.PolarsError, PanicException):
            suspects.append((i, rep))  # the query of its rows says what fails
    if exact:
        bad_rows = pl.scan_parquet([source(rep.path) for _, rep in exact]).select(
            *[pl.col(f).null_count() for f in REQUIRED_FIELDS],
            (~plausible(pl.col("timestamp"))).sum().alias("bad_timestamps"),
        )
        try:
            if sum(bad_rows.collect(engine="streaming").row(0)):
                suspects += exact
        except (pl.exceptions.PolarsError, PanicException):
            suspects += exact  # one of them cannot be read: each is checked on its own
    for index, rep in suspects:
        skipped = rep.skipped
        try:
            _count_bad_rows(frames[index].with_row_index("_row").filter(~RECORD_OK), rep)
        except (pl.exceptions.PolarsError, PanicException) as exc:
            rep.give_up(exc)
            frames[index] = frames[index].head(0)
            continue
        if rep.skipped > skipped:
            frames[index] = frames[index].filter(RECORD_OK)


def drop_bad_rows(df: pl.DataFrame, rep: FileReport, start: int = 0) -> pl.DataFrame:
    """A foreign file's records read once, in full (``scan_run(..., defer_checks=True)``),
    the first of them its row ``start``: its bad rows counted by reason into ``rep`` (with
    the first rows of each, in a Parquet file) and dropped."""
    ok = df.select(RECORD_OK).to_series()
    if ok.all():
        return df
    bad = df.with_row_index("_row", offset=start).filter(~ok)
    _count_bad_rows(bad.lazy(), rep)
    return df.filter(ok)


def _count_bad_rows(bad: pl.LazyFrame, rep: FileReport) -> None:
    """A file's bad rows (with their row numbers, ``_row``) counted by reason into ``rep``,
    the first rows of each reason kept to be shown (a Parquet file's)."""
    rows = rep.format == "parquet"
    counts = (
        bad.group_by(_PARQUET_REASON.alias("reason"))
        .agg(pl.len(), pl.col("_row").sort().head(MAX_LINES_KEPT))
        .sort("reason")
        .collect(engine="streaming")
    )
    for reason, n, first in counts.iter_rows():
        rep.records -= n
        rep.skip(reason, n, first if rows else None)


def _parquet_reason() -> pl.Expr:
    reason: pl.Expr = pl.when(~plausible(pl.col("timestamp"))).then(pl.lit(BAD_TIME))
    for name in reversed(REQUIRED_FIELDS):
        what = (
            "is null, not numeric, or an integer float64 cannot hold exactly"  # NaN and inf are values
            if name == "value"
            else "is null or not numeric"
            if name == "timestamp"
            else "is null or not an integer in int64's range"
            if name in ("step", "rank")
            else "is null or not valid"
        )
        reason = pl.when(pl.col(name).is_null()).then(pl.lit(f"'{name}' {what}")).otherwise(reason)
    return reason


_PARQUET_REASON = _parquet_reason()
