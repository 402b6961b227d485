"""run.json: the run's metadata, as rank 0 writes it and a reader checks it (docs/format.md).

Its ``checksum`` is the CRC-32 (``zlib.crc32``) of its other fields as
``json.dumps(fields, sort_keys=True)`` spells them: computed from the parsed fields, not
the file's bytes, so a file pretty-printed again or with its keys reordered still matches,
while any changed name, number or character does not. ``run_id`` is the identity uploads
derive their ids from: a flipped bit there must never pass for another run.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

NAME = "run.json"
# Beside records and no run.json: an import (metriclog import) stopped before its end; its run id
IMPORTING = ".metriclog-import"
CHECKSUM = "checksum"


def checksum(meta: dict[str, Any]) -> int:
    """The CRC-32 of ``meta``'s fields but ``checksum``, as JSON with sorted keys.

    >>> a = checksum({"name": "exp1", "run_id": "ab"})
    >>> a == checksum({"run_id": "ab", "name": "exp1", "checksum": 7}), a == checksum({"name": "exp2"})
    (True, False)
    """
    fields = {k: v for k, v in meta.items() if k != CHECKSUM}
    return zlib.crc32(json.dumps(fields, sort_keys=True).encode())


def encode(meta: dict[str, Any]) -> bytes:
    """run.json's text: ``meta`` (a value JSON has no type for given as its ``str``), then
    its ``checksum``, computed from the fields as a reader parses them back."""
    fields = json.loads(json.dumps(meta, default=str))  # what a reader gets: str keys, lists
    fields.pop(CHECKSUM, None)
    return (json.dumps({**fields, CHECKSUM: checksum(fields)}, indent=2) + "\n").encode()


def verified(meta: dict[str, Any]) -> bool | None:
    """Whether parsed run.json fields match their ``checksum``; None when there is none (a
    run.json written before it, or by another tool: read as it is)."""
    if CHECKSUM not in meta:
        return None
    declared = meta[CHECKSUM]
    return type(declared) is int and declared == checksum(meta)
