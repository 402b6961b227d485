"""The raw record (SPEC section 2) and the names of the files the writer leaves.

Files of one source (``stem`` is the sanitized process name and the rank, e.g.
``TrainActor_r0.r0``, so two sources that share a process name never share a file):

* ``{stem}.{seq:05d}.journal`` the open segment: an append-only binary journal of
  the collector's buffer (see ``metric_core.journal``), readable up to its last
  complete frame after a kill.
* ``{stem}.{seq:05d}.parquet`` or ``.jsonl``: a sealed segment. It names the journal
  it supersedes (Parquet key-value metadata ``metriclog``, or a first JSONL line
  ``{"event": "segment", "supersedes": ...}``), so a journal left behind by a kill
  between the atomic rename and the unlink is not read twice.
* ``.{name}.{random}.tmp``     work in progress; names starting with "." are not data.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
from collections.abc import Iterable

import polars as pl

REQUIRED_FIELDS = ("key", "value", "reduction", "step", "timestamp", "rank")

POLARS_SCHEMA: dict[str, pl.DataType] = {
    "key": pl.String(),
    "value": pl.Float64(),
    "reduction": pl.String(),
    "step": pl.Int64(),
    "timestamp": pl.Float64(),
    "rank": pl.Int64(),
    "process": pl.String(),
}

# An extra column of the writer's Parquet segments: each record's key_hash(key). Readers
# that know it group on one integer instead of a string; others ignore it (SPEC 2).
KEY_HASH = "key_hash"

DATA_SUFFIXES = (".jsonl", ".parquet", ".journal")
PARQUET_META_KEY = "metriclog"
SHUTDOWN_EVENT = "shutdown"
SEGMENT_EVENT = "segment"
# Timestamps a reader accepts, in Unix epoch seconds: 1970-01-01 to 2286-11-20 (UTC).
# Others (and NaN, infinities) are not a clock's and are skipped as bad records.
TIMESTAMP_RANGE = (0.0, 1e10)

_UNSAFE = re.compile(r"[^A-Za-z0-9_.=+-]")


_MAX_STEM = 100  # with the rank, sequence number and suffixes, far below any NAME_MAX


def file_stem(process: str) -> str:
    """A file-name-safe stem for a process name; a long one is cut and keeps a hash of the whole.

    >>> file_stem("TrainActor_r0"), len(file_stem("x" * 300))
    ('TrainActor_r0', 100)
    """
    stem = _UNSAFE.sub("_", process).strip(".") or "process"
    if len(stem) > _MAX_STEM:
        digest = hashlib.blake2b(process.encode(), digest_size=6).hexdigest()
        stem = f"{stem[: _MAX_STEM - 13]}-{digest}"
    return stem


def segment_stem(process: str, rank: int) -> str:
    """The common start of a source's segment file names.

    >>> segment_stem("TrainActor_r0", 0)
    'TrainActor_r0.r0'
    """
    return f"{file_stem(process)}.r{rank}"


def key_hash(key: str) -> int:
    """A key's 64-bit identity: the same in every process, on every machine.

    >>> key_hash("loss") == key_hash("loss") != key_hash("lr")
    True
    """
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little", signed=True)


def keys_by_hash(keys: Iterable[str], mask: int = -1) -> dict[int, str] | None:
    """``key_hash(key) & mask`` -> key, or None when two keys share one (or there are none)."""
    keys = set(keys)
    table = {key_hash(key) & mask: key for key in keys}
    return table if keys and len(table) == len(keys) else None


def default_process_name(rank: int) -> str:
    """The process name a reader fills in when a record has none."""
    return f"rank{rank}"


def to_jsonl(df: pl.DataFrame) -> bytes:
    """JSONL of a frame, rows in order, vectorized unless a float is NaN or infinite.

    JSON has no NaN or infinity and polars writes them as null, so a frame holding one is
    written row by row with those floats as "NaN", "Infinity" or "-Infinity", which the
    reader parses back exactly.
    """
    floats = [c for c, t in df.schema.items() if t == pl.Float64]
    finite = pl.all_horizontal(
        [pl.col(c).is_finite() | pl.col(c).is_null() for c in floats] or [pl.lit(True)]
    )
    if df.height == 0 or df.select(finite.all()).item():
        buf = io.BytesIO()
        df.write_ndjson(buf)
        return buf.getvalue()
    lines = []
    for row in df.iter_rows(named=True):
        for c in floats:
            v = row[c]
            if v is not None and not math.isfinite(v):
                row[c] = "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
        lines.append(json.dumps(row, separators=(",", ":")))
    return ("\n".join(lines) + "\n").encode()
