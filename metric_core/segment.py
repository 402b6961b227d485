"""The metadata of a sealed segment: what the writer knows of a file, so a reader need not find out.

The writer stores it as JSON in the Parquet footer (key-value metadata ``metriclog``) or
as the first line of a JSONL segment (``{"event": "segment", ...}``); the reader parses
it back with ``SegmentMeta.parse``. Files without it (other tools', older versions') are
read the slow way with the same results; metadata that is not well formed counts as
none. docs/format.md describes every field.
"""

from __future__ import annotations

import builtins
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from metric_core.schema import TIMESTAMP_RANGE

PARQUET_KEY = "metriclog"
SEGMENT_EVENT = "segment"
SHUTDOWN_EVENT = "shutdown"


@dataclass(frozen=True)
class SegmentMeta:
    """What the writer declares about one sealed segment of one source."""

    supersedes: str  # the journal this file replaces (a reader skips it if both are present)
    records: int
    process: str
    rank: int
    clean_shutdown: bool  # the source shut down cleanly at the end of this segment
    timestamp: float  # of the clean shutdown, else of the sealing
    keys: tuple[tuple[str, str], ...] | None = None  # every (key, reduction) of its records
    steps: tuple[int, int] | None = None  # lowest and highest step
    timestamps: tuple[float, float] | None = None  # earliest and latest record time
    dropped: tuple[dict[str, Any], ...] = ()  # records the writer dropped (see the journal's D frames)
    nonfinite: int | None = None  # JSONL: how many values are NaN or infinite
    bytes: int | None = None  # JSONL: the size of the file after this first line
    first_line_bytes: int | None = field(default=None, compare=False)  # JSONL: set by the reader

    def to_json(self) -> str:
        out = {k: v for k, v in asdict(self).items() if v is not None and k != "first_line_bytes"}
        if not self.dropped:
            del out["dropped"]
        return json.dumps(out)

    def jsonl_line(self) -> builtins.bytes:
        """The first line of a sealed JSONL segment."""
        return (json.dumps({"event": SEGMENT_EVENT, **json.loads(self.to_json())}) + "\n").encode()

    @property
    def plausible_times(self) -> bool:
        """Whether the declared time range lies in ``TIMESTAMP_RANGE`` (a clock's)."""
        if self.timestamps is None:
            return False
        lo, hi = TIMESTAMP_RANGE
        return (
            all(math.isfinite(t) for t in self.timestamps)
            and lo <= self.timestamps[0]
            and self.timestamps[1] < hi
        )

    @classmethod
    def parse(cls, raw: str | builtins.bytes | dict[str, Any]) -> SegmentMeta | None:
        """The metadata from its JSON (or the decoded object), or None when it is not well formed.

        >>> meta = SegmentMeta("a.r0.00000.journal", 2, "a", 0, False, 1.7e9, keys=(("loss", "mean"),))
        >>> SegmentMeta.parse(meta.to_json()) == meta, SegmentMeta.parse('{"records": "x"}')
        (True, None)
        """
        try:
            obj = json.loads(raw) if isinstance(raw, (str, builtins.bytes)) else raw
            return cls(
                supersedes=_typed(obj["supersedes"], str),
                records=_typed(obj["records"], int),
                process=_typed(obj["process"], str),
                rank=_typed(obj["rank"], int),
                clean_shutdown=_typed(obj.get("clean_shutdown", False), bool),
                timestamp=float(_typed(obj.get("timestamp", 0.0), (int, float))),
                keys=_pairs(obj.get("keys")),
                steps=_range(obj.get("steps"), (int,), int),
                timestamps=_range(obj.get("timestamps"), (int, float), float),
                dropped=tuple(d for d in obj.get("dropped") or () if isinstance(d, dict)),
                nonfinite=_optional(obj.get("nonfinite"), int),
                bytes=_optional(obj.get("bytes"), int),
            )
        except (ValueError, TypeError, KeyError, AttributeError):
            return None


def _typed(value: Any, kind: type | tuple[type, ...]) -> Any:
    # bool is an int to isinstance: a count or a rank must not be True
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise TypeError(f"{value!r} is not {kind}")
    return value


def _optional(value: Any, kind: type) -> Any:
    return None if value is None else _typed(value, kind)


def _pairs(value: Any) -> tuple[tuple[str, str], ...] | None:
    if value is None:
        return None
    return tuple((_typed(k, str), _typed(r, str)) for k, r in value)


def _range(value: Any, kinds: tuple[type, ...], cast: type) -> Any:
    if value is None:
        return None
    lo, hi = value
    return (cast(_typed(lo, kinds)), cast(_typed(hi, kinds)))
