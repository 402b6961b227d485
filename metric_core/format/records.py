"""Records in memory: Arrow tables in the record schema, and their JSON lines.

The writer builds tables from its coded buffer (``build_table``) and seals them into
Parquet or JSONL; the command line writes its results as JSON lines with the same
``to_jsonl``. Arrays are built from numpy buffers directly: ``pa.array`` imports pandas
when it is installed, which a training rank should not pay for.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from metric_core.format.schema import FIELDS, KEY_HASH, NONFINITE_SPELLING

ARROW_SCHEMA = pa.schema([(name, pa.type_for_alias(kind)) for name, kind in FIELDS.items()])
# The writer's tables: string columns dictionary-encoded (Parquet writes them as they are;
# Parquet readers see plain strings), which saves materializing a string per record.
DICT_SCHEMA = pa.schema(
    [
        pa.field(f.name, pa.dictionary(pa.int32(), pa.string())) if pa.types.is_string(f.type) else f
        for f in ARROW_SCHEMA
    ]
)
# Small batches: their intermediate arrays stay in cache and their memory is reused, where
# large ones cost page faults for fresh memory on every segment (benchmarks/bench_record.py).
JSONL_BATCH_ROWS = 16_384


def _numeric(values: np.ndarray, dtype: pa.DataType, np_dtype: type) -> pa.Array:
    data: np.ndarray = np.ascontiguousarray(values, dtype=np_dtype)
    return pa.Array.from_buffers(dtype, len(data), [None, pa.py_buffer(data)])


def float64_array(values: np.ndarray) -> pa.Array:
    return _numeric(values, pa.float64(), np.float64)


def int64_array(values: np.ndarray) -> pa.Array:
    return _numeric(values, pa.int64(), np.int64)


def as_numpy(array: pa.Array | pa.ChunkedArray, dtype: type) -> np.ndarray:
    """The values of a primitive array without nulls as numpy, cast to ``dtype`` first if needed
    (pyarrow's own ``to_numpy`` loads pandas when it is installed)."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    array = array.cast(pa.from_numpy_dtype(dtype))
    if array.null_count:
        raise ValueError("a column of the record schema holds nulls")
    return np.frombuffer(array.buffers()[1], dtype=dtype)[array.offset : array.offset + len(array)]


def string_array(strings: list[str]) -> pa.Array:
    """A string array of a few distinct values (a dictionary), without ``pa.array``."""
    encoded = [s.encode() for s in strings]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int32)
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    data = b"".join(encoded)
    return pa.Array.from_buffers(
        pa.string(), len(encoded), [None, pa.py_buffer(offsets), pa.py_buffer(data or b"\0")]
    )


def _dictionary(codes: np.ndarray, idx: pa.Array, names: list[str]) -> pa.DictionaryArray:
    """``names[code]`` for each code, as a dictionary array whose dictionary holds each name
    once: Parquet writers store a dictionary with repeated values plainly, every string
    spelled out (reductions repeat across keys)."""
    distinct = list(dict.fromkeys(names))
    if len(distinct) == len(names):
        return pa.DictionaryArray.from_arrays(idx, string_array(names))
    place = {name: i for i, name in enumerate(distinct)}
    remap = np.array([place[name] for name in names], dtype=np.int32)
    unique_idx = _numeric(remap[np.asarray(codes, dtype=np.int64)], pa.int32(), np.int32)
    return pa.DictionaryArray.from_arrays(unique_idx, string_array(distinct))


def build_table(
    *,
    codes: np.ndarray,
    values: np.ndarray,
    timestamps: np.ndarray,
    steps: np.ndarray,
    key_names: list[str],
    reductions: list[str],
    rank: int,
    process: str,
) -> pa.Table:
    """Records in the raw-record schema from coded arrays, vectorized.

    ``key_names[code]`` and ``reductions[code]`` are the key and reduction of a code.
    """
    idx = _numeric(codes, pa.int32(), np.int32)
    n = len(idx)
    return pa.Table.from_arrays(
        [
            _dictionary(codes, idx, key_names),
            float64_array(values),
            _dictionary(codes, idx, reductions),
            int64_array(steps),
            float64_array(timestamps),
            int64_array(np.full(n, rank, dtype=np.int64)),
            pa.DictionaryArray.from_arrays(
                _numeric(np.zeros(n, dtype=np.int32), pa.int32(), np.int32), string_array([process])
            ),
        ],
        schema=DICT_SCHEMA,
    )


def empty_decoded() -> pa.Table:
    """A table of no records, as ``journal.decode`` returns them: the record, then its key's hash."""
    none = np.zeros(0)
    table = build_table(
        codes=none, values=none, timestamps=none, steps=none, key_names=[], reductions=[], rank=0, process=""
    )
    return table.append_column(KEY_HASH, int64_array(none))


def to_jsonl(table: pa.Table) -> bytes:
    r"""JSON lines of a table, a line per row in order, built column by column (no row loop).

    Strings, integers, floats, booleans and nulls are written; a float keeps every bit
    (the shortest text that reads back to it) and a non-finite one is spelled as
    ``schema.NONFINITE_SPELLING`` says.

    >>> t = pa.table({"key": ["a", 'b"'], "value": [0.1, float("nan")], "step": [1, None]})
    >>> to_jsonl(t).decode().splitlines()
    ['{"key":"a","value":0.1,"step":1}', '{"key":"b\\"","value":"NaN","step":null}']
    """
    return b"".join(jsonl_chunks(table))


def jsonl_chunks(table: pa.Table) -> Iterator[pa.Buffer]:
    """``to_jsonl`` in pieces, to write one after the other without joining them."""
    for chunk, _ in jsonl_blocks(table):
        yield chunk


def jsonl_blocks(table: pa.Table, rows: int = JSONL_BATCH_ROWS) -> Iterator[tuple[pa.Buffer, int]]:
    """``to_jsonl`` in pieces of at most ``rows`` lines, each with its number of lines."""
    import pyarrow.compute as pc  # ~40 ms to import: not paid by what reads JSON lines alone

    for batch in table.to_batches(max_chunksize=rows):  # string offsets are 32-bit
        parts: list[pa.Array | str] = []
        for i, (name, column) in enumerate(zip(batch.schema.names, batch.columns, strict=True)):
            prefix = ("{" if i == 0 else ",") + json.dumps(name) + ":"
            if pa.types.is_dictionary(column.type) and not column.null_count:
                # few distinct strings: the separator and name go into the dictionary
                parts.append(pc.take(_quoted(column.dictionary, prefix), column.indices))
            else:
                parts += [prefix, _json_values(column)]
        parts.append("}\n")
        merged: list[pa.Array | pa.Scalar] = []  # adjacent texts joined: fewer, longer parts
        for part in parts:
            if isinstance(part, str) and merged and isinstance(merged[-1], str):
                merged[-1] += part
            else:
                merged.append(part)
        lines = pc.binary_join_element_wise(
            *(_text(p) if isinstance(p, str) else p for p in merged), _text("")
        )
        # The lines end in newlines, so the array's character data is the file's text.
        offsets = np.frombuffer(lines.buffers()[1], dtype=np.int32)[
            lines.offset : lines.offset + len(lines) + 1
        ]
        yield lines.buffers()[2].slice(int(offsets[0]), int(offsets[-1] - offsets[0])), batch.num_rows


def _quoted(values: pa.Array, prefix: str = "") -> pa.Array:
    """``prefix`` and each value as JSON, for the few distinct values of a dictionary."""
    return string_array([prefix + json.dumps(v) for v in values.to_pylist()])


def _json_values(column: pa.Array) -> pa.Array:
    """Each value as JSON text."""
    import pyarrow.compute as pc

    kind = column.type
    if pa.types.is_dictionary(kind):
        column = column.cast(kind.value_type)
        kind = column.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        encoded = column.dictionary_encode()
        text = pc.take(_quoted(encoded.dictionary), encoded.indices)
    elif pa.types.is_floating(kind):
        column = column.cast(pa.float64())
        text = pc.cast(column, pa.string())
        # Keep floats floats ("1" -> "1.0"), and spell NaN and infinities: each pass only when
        # a value needs it, checked on the numbers, which is cheap.
        if pc.any(pc.equal(pc.floor(column), column)).as_py():
            whole = pc.match_substring_regex(text, r"^-?[0-9]+$")
            text = pc.if_else(whole, pc.binary_join_element_wise(text, _text(".0"), _text("")), text)
        if not pc.all(pc.is_finite(column)).as_py():
            for arrow, spelled in NONFINITE_SPELLING.items():  # Arrow writes nan, inf, -inf
                text = pc.if_else(pc.equal(text, _text(arrow)), _text(json.dumps(spelled)), text)
    elif pa.types.is_boolean(kind):
        text = pc.if_else(column, _text("true"), _text("false"))
    elif pa.types.is_integer(kind):
        text = pc.cast(column, pa.string())
    elif pa.types.is_null(kind):
        text = pa.nulls(len(column), pa.string())
    else:
        raise TypeError(f"column of type {kind} has no JSON lines form")
    return pc.fill_null(text, _text("null")) if text.null_count else text


def _text(s: str) -> pa.Scalar:
    """A string scalar (a bare Python str would go through ``pa.scalar``, which loads pandas)."""
    return string_array([s])[0]
