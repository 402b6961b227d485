"""The raw record (docs/format.md), its spellings, and the names of the files the writer leaves.

This module is the one definition of the record: its fields and their types (from which
``metric_core.format.records`` builds the Arrow schema and the reader the polars one), the
process name a reader fills in, how JSON lines spell NaN and the infinities, and the
timestamps a reader accepts. It imports nothing but the standard library.

Files of one source (``stem`` is the sanitized process name and the rank, e.g.
``TrainActor_r0.r0``, so two sources that share a process name never share a file):

* ``{stem}.{seq:05d}.journal`` the open segment: an append-only binary journal of
  the collector's buffer (see ``metric_core.format.journal``), readable up to its last
  complete frame after a kill.
* ``{stem}.{seq:05d}.parquet`` or ``.jsonl``: a sealed segment. Its metadata
  (``metric_core.format.segment``) names the journal it supersedes, so a journal left behind
  by a kill between the atomic rename and the unlink is not read twice.
* ``.{name}.{random}.tmp``     work in progress; names starting with "." are not data.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable
from typing import Any

# Every field of a record, in order, with its type; all but ``process`` are required.
FIELDS = {
    "key": "string",
    "value": "float64",
    "reduction": "string",
    "step": "int64",
    "timestamp": "float64",
    "rank": "int64",
    "process": "string",
}
REQUIRED_FIELDS = tuple(name for name in FIELDS if name != "process")
# A record without a process name belongs to the process "rank{rank}".
DEFAULT_PROCESS_PREFIX = "rank"
# JSON has no NaN or infinity: JSON lines spell them as these strings (and a reader also
# takes the bare NaN / Infinity tokens that Python's json module writes).
NONFINITE_SPELLING = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}

# An extra column of the writer's Parquet segments: each record's key_hash(key). Readers
# that know it group on one integer instead of a string; others ignore it (docs/format.md).
KEY_HASH = "key_hash"

DATA_SUFFIXES = (".jsonl", ".parquet", ".journal")
# Timestamps a reader accepts, in Unix epoch seconds: 1970-01-01 to 2286-11-20 (UTC).
# Others (and NaN, infinities) are not a clock's and are skipped as bad records.
TIMESTAMP_RANGE = (0.0, 1e10)
# A key (UTF-8 bytes) the writer takes, and a JSON line a reader parses as a record: a
# record's line is its key plus about 150 bytes, so any line the writer writes is read.
MAX_KEY_BYTES = 64 * 1024
MAX_LINE_BYTES = 1024 * 1024


class NestedTooDeep(ValueError):
    """JSON nested deeper than Python's decoder goes: text that is not JSON this reader takes."""


def parse_json(text: str | bytes) -> Any:
    """``json.loads`` of text a file holds. Python's decoder recurses, so JSON nested some
    thousands deep raises ``RecursionError``, which no reader of bad input expects: here it
    is ``NestedTooDeep``, a ``ValueError`` as any text that is not valid JSON.

    >>> try:
    ...     parse_json(b"[" * 100_000)
    ... except ValueError as exc:
    ...     print(exc)
    JSON nested too deep to decode
    """
    try:
        return json.loads(text)
    except RecursionError:
        raise NestedTooDeep("JSON nested too deep to decode") from None


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
    """The process name a reader fills in when a record has none.

    >>> default_process_name(3)
    'rank3'
    """
    return f"{DEFAULT_PROCESS_PREFIX}{rank}"


def spell_float(value: float) -> float | str:
    """A float as JSON lines hold it: itself when finite, else its spelling.

    >>> spell_float(1.5), spell_float(float("-inf"))
    (1.5, '-Infinity')
    """
    return value if math.isfinite(value) else NONFINITE_SPELLING[repr(value)]
