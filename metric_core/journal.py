"""The journal: the cheap, append-only binary tail of a source's open segment.

``flush()`` must make records durable without serializing them one by one on the
training thread, so the open segment is a journal of the collector's own buffer:

    header   b"MLJ1" u32:len JSON{"process", "rank", "created"}
    frames   u8:type u32:len payload
             type K: JSON [[code, key, reduction], ...]     key codes used from here on
             type R: i64:step, then (f64 value, f64 code, f64 timestamp) per record

A frame is written with one ``write`` of an unbuffered file, so after ``flush()``
returns it is in the kernel and survives a SIGKILL. A kill mid-write leaves a short
last frame, which ``decode`` reports and ignores: its records were not covered by a
returned flush. Sealing turns a journal into a Parquet or JSONL segment.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from metric_core.schema import KEY_HASH, key_hash

ARROW_SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("value", pa.float64()),
        ("reduction", pa.string()),
        ("step", pa.int64()),
        ("timestamp", pa.float64()),
        ("rank", pa.int64()),
        ("process", pa.string()),
    ]
)

MAGIC = b"MLJ1"
SUFFIX = ".journal"
_LEN = struct.Struct("<I")
_FRAME = struct.Struct("<cI")
_STEP = struct.Struct("<q")


def header(process: str, rank: int, created: float) -> bytes:
    body = json.dumps({"process": process, "rank": rank, "created": created}).encode()
    return MAGIC + _LEN.pack(len(body)) + body


def key_frame(defs: list[tuple[int, str, str]]) -> bytes:
    body = json.dumps(defs).encode()
    return _FRAME.pack(b"K", len(body)) + body


def record_frame(step: int, rows: bytes) -> bytes:
    return _FRAME.pack(b"R", len(rows) + 8) + _STEP.pack(step) + rows


@dataclass
class Decoded:
    """A journal's records as arrays, plus what was wrong with the file."""

    process: str | None = None
    rank: int | None = None
    table: pa.Table | None = None
    truncated_records: int = 0
    truncated: bool = False
    unknown_codes: int = 0
    problems: list[str] = field(default_factory=list)
    pairs: list[tuple[str, str]] = field(default_factory=list)  # (key, reduction) present


def decode(data: bytes) -> Decoded:
    """Decode a journal; a short last frame is reported, not raised."""
    out = Decoded()
    if len(data) < 8 or not data.startswith(MAGIC):
        if MAGIC.startswith(data[:4]) and len(data) < 8:
            out.truncated = True  # killed while writing the header
            return out
        out.problems.append("not a metriclog journal (bad magic)")
        return out
    (hlen,) = _LEN.unpack_from(data, 4)
    if 8 + hlen > len(data):
        out.truncated = True
        return out
    try:
        head: dict[str, Any] = json.loads(data[8 : 8 + hlen])
        out.process = str(head["process"])
        out.rank = int(head["rank"])
    except (ValueError, KeyError, TypeError):
        out.problems.append("journal header is not valid")
        return out
    keys: dict[int, tuple[str, str]] = {}
    blocks: list[memoryview] = []
    steps: list[int] = []
    counts: list[int] = []
    view = memoryview(data)
    pos = 8 + hlen
    while pos < len(data):
        if pos + _FRAME.size > len(data):
            out.truncated = True
            break
        kind, length = _FRAME.unpack_from(data, pos)
        start, end = pos + _FRAME.size, pos + _FRAME.size + length
        if end > len(data):
            out.truncated = True
            if kind == b"R":
                out.truncated_records = max(0, (len(data) - start - 8) // 24)
            break
        if kind == b"K":
            for code, key, reduction in json.loads(data[start:end]):
                keys[int(code)] = (key, reduction)
        elif kind == b"R":
            steps.append(_STEP.unpack_from(data, start)[0])
            counts.append((length - 8) // 24)
            blocks.append(view[start + 8 : start + 8 + counts[-1] * 24])
        else:
            out.problems.append(f"unknown frame type {kind!r} at byte {pos}; the rest is ignored")
            break
        pos = end
    if blocks:
        rows = np.frombuffer(b"".join(blocks), dtype=np.float64).reshape(-1, 3)
        step_col = np.repeat(np.asarray(steps, dtype=np.int64), counts)
        out.table = _to_table(rows, step_col, keys, out)
    return out


def _to_table(
    rows: np.ndarray, steps: np.ndarray, keys: dict[int, tuple[str, str]], out: Decoded
) -> pa.Table:
    codes = rows[:, 1].astype(np.int32)
    table_size = max(keys, default=-1) + 1
    names = [keys.get(i, (None, None)) for i in range(table_size)]
    defined = np.array([n[0] is not None for n in names] + [False])
    lo, hi = (int(codes.min()), int(codes.max())) if len(codes) else (0, 0)
    if lo < 0 or hi >= table_size or not defined[lo : hi + 1].all():
        # Only a damaged journal gets here: drop records whose key was never defined.
        known = defined[np.where((codes >= 0) & (codes < table_size), codes, table_size)]
        out.unknown_codes = int((~known).sum())
        rows, steps, codes = rows[known], steps[known], codes[known]
    present = np.flatnonzero(np.bincount(codes, minlength=table_size))
    out.pairs = [(names[i][0] or "", names[i][1] or "") for i in present]
    key_names = [n[0] or "" for n in names]
    table = build_table(
        codes=codes,
        values=rows[:, 0],
        timestamps=rows[:, 2],
        steps=steps,
        key_names=key_names,
        reductions=[n[1] or "" for n in names],
        rank=out.rank or 0,
        process=out.process or "",
    )
    hashes = np.array([key_hash(k) for k in key_names], dtype=np.int64)
    return table.append_column(KEY_HASH, pa.array(hashes[codes] if len(hashes) else np.zeros(0, np.int64)))


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

    The string columns stay dictionary-encoded (Parquet writes them as they are;
    Parquet readers see plain strings), which saves materializing a string per record.
    """
    idx = pa.array(codes.astype(np.int32, copy=False))
    n = len(idx)
    return pa.Table.from_arrays(
        [
            pa.DictionaryArray.from_arrays(idx, pa.array(key_names, pa.string())),
            pa.array(np.ascontiguousarray(values)),
            pa.DictionaryArray.from_arrays(idx, pa.array(reductions, pa.string())),
            pa.array(np.ascontiguousarray(steps, dtype=np.int64)),
            pa.array(np.ascontiguousarray(timestamps)),
            pa.array(np.full(n, rank, dtype=np.int64)),
            pa.DictionaryArray.from_arrays(
                pa.array(np.zeros(n, dtype=np.int32)), pa.array([process], pa.string())
            ),
        ],
        schema=DICT_SCHEMA,
    )


DICT_SCHEMA = pa.schema(
    [
        pa.field(f.name, pa.dictionary(pa.int32(), pa.string())) if pa.types.is_string(f.type) else f
        for f in ARROW_SCHEMA
    ]
)


# What ``decode`` returns and the writer seals into Parquet: the record, then its key's hash.
DECODED_SCHEMA = DICT_SCHEMA.append(pa.field(KEY_HASH, pa.int64()))


def warm_up() -> None:
    """Run the conversions once, so pyarrow's lazy imports happen at init, not mid-run."""
    build_table(
        codes=np.zeros(1, dtype=np.int64),
        values=np.zeros(1),
        timestamps=np.zeros(1),
        steps=np.zeros(1, dtype=np.int64),
        key_names=["k"],
        reductions=["mean"],
        rank=0,
        process="p",
    )
