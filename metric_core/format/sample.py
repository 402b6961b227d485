"""Samples: whole dicts recorded with ``Reduce.SAMPLE`` (a rollout's prompt, response, reward).

A sample is kept as JSON, as the caller gave it: str, int (exact, any size), float
(NaN and infinities as JSON's ``NaN``/``Infinity``), bool, None, lists of those and
nested dicts. numpy scalars and 0-d tensors become the numbers they hold; anything else
is kept as its ``repr``, and the writer says so once per key. The writer encodes on its
own thread; the caller's thread only copies the dict (shallowly).

Samples sit in files of their own, never among the records (docs/format.md): the journal's
``P`` frames while a segment is open, then ``samples/{stem}.{seq}.samples.parquet`` (or
``.jsonl``) once it is sealed.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

from metric_core.format.schema import MAX_LINE_BYTES

# A sealed JSONL line holds a sample and its step, rank, process, timestamp and key: the
# reader refuses lines over MAX_LINE_BYTES, so the writer refuses samples that would make one.
LINE_ROOM = 1024
SUFFIXES = (".samples.parquet", ".samples.jsonl")
DIRECTORY = "samples"
PARQUET_KEY = b"metriclog.samples"  # the sealed Parquet file's metadata (JSON), as SegmentMeta's
SEGMENT_EVENT = "samples_segment"  # the first line of a sealed JSONL file
BLOCK_SAMPLES = 1000  # the samples of one block of a sealed JSONL file (one CRC each)


class Refused(ValueError):
    """A sample that cannot be kept (too large, or not a dict)."""


def encode(key: str, sample: dict[str, Any], unusual: list[str]) -> str:
    """``sample`` as JSON text; the names of the fields kept as their ``repr`` are appended
    to ``unusual``. Raises ``Refused`` for a sample a reader could not take.

    >>> import numpy as np
    >>> encode("rollout", {"reward": np.float32(0.5), "ids": [1, 2**70], "meta": {"t": None}}, [])
    '{"reward": 0.5, "ids": [1, 1180591620717411303424], "meta": {"t": null}}'
    >>> found = []; encode("rollout", {"when": object}, found); found
    '{"when": "<class \\'object\\'>"}'
    ['when']
    """

    def default(value: Any) -> Any:
        inner = number_of(value)
        if inner is not None:
            return inner
        unusual.append(_field_of(sample, value))
        return repr(value)

    try:
        text = json.dumps(sample, default=default, ensure_ascii=False)
    except (TypeError, ValueError) as exc:  # a key that is not a string, a cycle
        raise Refused(
            f"sample of '{key}' cannot be kept as JSON ({exc}); give a dict of plain values"
        ) from None
    size = len(text.encode()) + len(key.encode()) + LINE_ROOM
    if size > MAX_LINE_BYTES:
        raise Refused(
            f"sample of '{key}' is {size - LINE_ROOM:,} bytes as JSON: a sample holds at most "
            f"{MAX_LINE_BYTES - LINE_ROOM:,} bytes, so that a reader takes its line. Keep large "
            "fields (token ids, logits) in files of your own and record their paths"
        )
    return text


def number_of(value: Any) -> Any:
    """The plain value a numpy scalar or a 0-d array or tensor holds; None for anything else."""
    item = getattr(value, "item", None)
    if item is None or getattr(value, "ndim", 0) != 0:
        return None
    try:
        inner = item()
    except (TypeError, ValueError, RuntimeError):
        return None
    return inner if isinstance(inner, (bool, int, float, str)) else None


def to_json(value: Any) -> str:
    """``value`` as JSON text for display: numbers as numbers, anything else unusual as its repr."""

    def default(v: Any) -> Any:
        inner = number_of(v)
        return repr(v) if inner is None else inner

    return json.dumps(value, default=default, ensure_ascii=False)


def _field_of(sample: dict[str, Any], value: Any) -> str:
    for name, field in sample.items():
        if field is value:
            return str(name)
    return "?"  # inside a list or a nested dict


def meta_checksum(meta: dict[str, Any]) -> int:
    """The CRC-32 of a samples file's metadata (its fields but ``checksum`` and a JSONL first
    line's ``event``, keys sorted): a footer or a first line that no page or block checksum covers."""
    body = {k: v for k, v in meta.items() if k not in ("checksum", "event")}
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


def is_samples_file(name: str) -> bool:
    return name.endswith(SUFFIXES)
