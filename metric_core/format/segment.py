"""The metadata of a sealed segment: what the writer knows of a file, so a reader need not find out.

The writer stores it as JSON in the Parquet footer (key-value metadata ``metriclog``) or
as the first line of a JSONL segment (``{"event": "segment", ...}``); the reader parses
it back with ``SegmentMeta.parse``. Files without it (other tools', older versions') are
read the slow way with the same results; metadata that is not well formed counts as
none. The writer ends it with a CRC-32 of the rest (``checksum``): metadata that fails it
is damaged (``Damaged``), and the reader ignores it. docs/format.md describes every field.
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import math
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from metric_core.format.life import Life
from metric_core.format.schema import TIMESTAMP_RANGE, parse_json

PARQUET_KEY = "metriclog"
# A key's entry of ``key_stats``: key, reduction, records, first step, last step, first
# time, last time, non-finite values.
KeyStats = tuple[str, str, int, int, int, float, float, int]
SEGMENT_EVENT = "segment"
SHUTDOWN_EVENT = "shutdown"
# What marks a file metriclog wrote as a result (``reduce --out``), not as data: a Parquet
# key-value entry, or for JSON lines (which have no place for metadata that other readers
# skip) a hidden file beside it, ``.{name}.metriclog``, holding the same entry. Its value
# names the command; no time, host or path, so the same result is the same file.
DERIVED_KEY = "metriclog_derived"
# A sealed JSONL segment's data lines come in blocks, each followed by a line
# ``{"event": "block", "crc32": C, "lines": N}``: the CRC-32 of the block's bytes and its
# number of lines (docs/format.md).
BLOCK_EVENT = "block"


def derived_marker(path: Path) -> Path:
    """The hidden file that marks a JSON-lines file as a result metriclog wrote."""
    return path.with_name(f".{path.name}.metriclog")


@dataclass(frozen=True)
class SegmentMeta:
    """What the writer declares about one sealed segment of one source.

    Only ``supersedes`` is required of metadata a reader parses: a field that is missing
    or malformed is None (and named in ``ignored``), so a damaged field never makes the
    reader forget which journal the file replaces.
    """

    supersedes: str  # the journal this file replaces (a reader skips it if both are present)
    records: int | None
    process: str | None
    rank: int | None
    clean_shutdown: bool = False  # the source shut down cleanly at the end of this segment
    timestamp: float | None = None  # of the clean shutdown, else of the sealing
    keys: tuple[tuple[str, str], ...] | None = None  # every (key, reduction) of its records
    steps: tuple[int, int] | None = None  # lowest and highest step
    timestamps: tuple[float, float] | None = None  # earliest and latest record time
    dropped: tuple[dict[str, Any], ...] = ()  # records the writer dropped (see the journal's D frames)
    nonfinite: int | None = None  # JSONL: how many values are NaN or infinite
    bytes: int | None = None  # JSONL: the size of the file after this first line
    attempt: str | None = None  # the writer's attempt id: one per init() of the source
    attempt_started: float | None = None  # when that attempt started
    attempt_first_step: int | None = None  # the step of its first flush(step), once there was one
    life: Life | None = None  # where it ran, its flush times, pauses and end events (``format.life``)
    # Parquet: each row group's records, lowest step and earliest time, in order (what the
    # footer says too, but outside any checksum)
    row_groups: tuple[tuple[int, int, float], ...] | None = None
    # Each (key, reduction) of its records with what ``metriclog keys`` lists of it: records,
    # first and last step, first and last time, how many values are NaN or infinite
    key_stats: tuple[KeyStats, ...] | None = None
    # Set by a reader, never written: the fields it found malformed.
    ignored: tuple[str, ...] = field(default=(), compare=False)

    def _fields(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if v is not None and k != "ignored"}
        if self.life is not None:
            out["life"] = self.life.to_dict()
        if not self.dropped:
            del out["dropped"]
        return out

    def to_json(self) -> str:
        return _signed(self._fields())

    def jsonl_line(self) -> builtins.bytes:
        """The first line of a sealed JSONL segment."""
        return (_signed({"event": SEGMENT_EVENT, **self._fields()}) + "\n").encode()

    @property
    def source(self) -> tuple[str, int] | None:
        """The one source of every record in the file, when declared."""
        return None if self.process is None or self.rank is None else (self.process, self.rank)

    @property
    def plausible_times(self) -> bool:
        """Whether the declared time range lies in ``TIMESTAMP_RANGE`` (a clock's)."""
        if self.timestamps is None:
            return False
        lo, hi = TIMESTAMP_RANGE
        first, last = self.timestamps
        return math.isfinite(first) and math.isfinite(last) and lo <= first and last < hi

    @classmethod
    def parse(cls, raw: str | builtins.bytes | dict[str, Any]) -> SegmentMeta | Damaged | None:
        """The metadata from its JSON (or the decoded object); None without a ``supersedes``;
        ``Damaged`` when it carries a checksum that its text fails.

        >>> meta = SegmentMeta("a.r0.00000.journal", 2, "a", 0, keys=(("loss", "mean"),))
        >>> SegmentMeta.parse(meta.to_json()) == meta
        True
        >>> SegmentMeta.parse('{"supersedes": "a.journal", "records": "x", "rank": 0}').ignored
        ('records', 'process')
        """
        try:
            obj = parse_json(raw) if isinstance(raw, (str, builtins.bytes)) else raw
        except ValueError:
            return None
        if not isinstance(obj, dict):
            return None
        if "checksum" in obj and not _checks(obj):
            supersedes = obj.get("supersedes")
            return Damaged(
                "its metriclog metadata fails its checksum",
                supersedes if isinstance(supersedes, str) else None,
            )
        if not isinstance(obj.get("supersedes"), str):
            return None
        ignored: list[str] = []

        def field_of(name: str, read: Any, default: Any = None) -> Any:
            if obj.get(name) is None:
                if name in ("records", "process", "rank"):
                    ignored.append(name)
                return default
            try:
                return read(obj[name])
            except (ValueError, TypeError, KeyError, AttributeError):
                ignored.append(name)
                return default

        meta = cls(
            supersedes=obj["supersedes"],
            records=field_of("records", lambda v: _typed(v, int)),
            process=field_of("process", lambda v: _typed(v, str)),
            rank=field_of("rank", lambda v: _typed(v, int)),
            clean_shutdown=field_of("clean_shutdown", lambda v: _typed(v, bool), False),
            timestamp=field_of("timestamp", lambda v: float(_typed(v, (int, float)))),
            keys=field_of("keys", _pairs),
            steps=field_of("steps", lambda v: _range(v, (int,), int)),
            timestamps=field_of("timestamps", lambda v: _range(v, (int, float), float)),
            dropped=field_of("dropped", _drops, ()),
            nonfinite=field_of("nonfinite", lambda v: _typed(v, int)),
            bytes=field_of("bytes", lambda v: _typed(v, int)),
            attempt=field_of("attempt", lambda v: _typed(v, str)),
            attempt_started=field_of("attempt_started", lambda v: float(_typed(v, (int, float)))),
            attempt_first_step=field_of("attempt_first_step", lambda v: _typed(v, int)),
            life=field_of("life", _life),
            row_groups=field_of("row_groups", _row_groups),
            key_stats=field_of("key_stats", _key_stats),
        )
        return dataclasses.replace(meta, ignored=tuple(ignored)) if ignored else meta


@dataclass(frozen=True)
class Damaged:
    """Writer metadata that fails its own checksum: the file was changed after it was sealed.

    Its ``supersedes`` is still honoured: reading a journal twice would count its records
    twice, while a damaged name rarely names another journal that exists."""

    reason: str
    supersedes: str | None = None


def _signed(fields: dict[str, Any]) -> str:
    """``fields`` as JSON, ending in ``"checksum"``: the CRC-32 of their JSON without it."""
    return json.dumps({**fields, "checksum": zlib.crc32(json.dumps(fields).encode())})


def _checks(obj: dict[str, Any]) -> bool:
    """Whether decoded metadata matches its ``checksum`` (JSON of the writer's, which
    ``json`` spells the same when it decodes and encodes it again)."""
    fields = {k: v for k, v in obj.items() if k != "checksum"}
    try:
        return zlib.crc32(json.dumps(fields).encode()) == obj["checksum"]
    except (ValueError, TypeError, RecursionError):
        return False


def _typed(value: Any, kind: type | tuple[type, ...]) -> Any:
    # bool is an int to isinstance: a count or a rank must not be True
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise TypeError(f"{value!r} is not {kind}")
    return value


def _life(value: Any) -> Life:
    life = Life.parse(value)
    if life is None:
        raise ValueError("not a life")
    return life


def _row_groups(value: Any) -> tuple[tuple[int, int, float], ...]:
    return tuple((_typed(n, int), _typed(s, int), float(_typed(t, (int, float)))) for n, s, t in value)


def _key_stats(value: Any) -> tuple[KeyStats, ...]:
    out = []
    for key, reduction, records, first_step, last_step, first_time, last_time, nonfinite in value:
        out.append(
            (
                _typed(key, str),
                _typed(reduction, str),
                _typed(records, int),
                _typed(first_step, int),
                _typed(last_step, int),
                float(_typed(first_time, (int, float))),
                float(_typed(last_time, (int, float))),
                _typed(nonfinite, int),
            )
        )
    return tuple(out)


def _pairs(value: Any) -> tuple[tuple[str, str], ...]:
    return tuple((_typed(k, str), _typed(r, str)) for k, r in value)


def _drops(value: Any) -> tuple[dict[str, Any], ...]:
    return tuple(d for d in value if isinstance(d, dict) and type(d.get("records")) is int)


def _range(value: Any, kinds: tuple[type, ...], cast: type) -> Any:
    lo, hi = value
    return (cast(_typed(lo, kinds)), cast(_typed(hi, kinds)))
