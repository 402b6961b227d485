"""The journal: the cheap, append-only binary tail of a source's open segment.

``flush()`` must make records durable without serializing them one by one on the
training thread, so the open segment is a journal of the collector's own buffer.
Format 6 (``MLJ6``; ``MLJ5``, the same without W frames, ``MLJ4``, without P frames,
``MLJ3``, whose F frames carry no time and which has no H and E frames, ``MLJ2``, the same
without F frames, and ``MLJ1`` are still read)::

    header   b"MLJ6" u32:len u32:crc JSON{"format": 6, "process", "rank", "created",
                                           "attempt", "attempt_started", "attempt_first_step",
                                           "host", "pid", "pidns", "flush_interval", "restart"}
    frames   u8:type u32:len u32:crc payload
             type K: JSON [[code, key, reduction], ...]     key codes used from here on
             type R: i64:step, then (f64 value, f64 code, f64 timestamp) per record
             type D: JSON {"records", "steps", "timestamps", "reason"}   records the
                     writer had to drop (its backlog was full while writing failed)
             type S: JSON {"timestamp"}                     the source shut down cleanly
             type F: i64:step f64:time   flush(step), ended at ``time``: the records
                     since the previous F frame (of this journal) belong to ``step``,
                     whatever step they were stamped with (the writer thread may write
                     them before the flush)
             type H: f64:time    a heartbeat: the writer was alive at ``time``, its main
                     thread where the last W frame said (written at a wake of the writer
                     thread, once a flush interval, with no flush since the previous)
             type W: JSON {"at", "where": [own, inner], "threads": {name: [own, inner]}}
                     a heartbeat that says where the main thread is (``writer.where``:
                     the caller's innermost frame and the innermost frame), written
                     instead of an H frame when the place changed; ``threads`` (every
                     other thread's place) once the rank has been silent ``STALL_MIN_S``
             type E: JSON {"kind", "timestamp", ...}   how the attempt ended, or
                     something it lived through (``metric_core.format.life``)
             type P: i64:step, then JSON [[key, timestamp, sample], ...]: samples
                     (``Reduce.SAMPLE``), relabelled by F frames as records are

``crc`` is the CRC-32 (``zlib.crc32``) of the frame's type and length bytes and its
payload (of the header's JSON for the header). All integers are little-endian.

A frame is written with one ``write`` of an unbuffered file, so after ``flush()``
returns it is in the kernel and survives a SIGKILL. A failed write (a full disk) is
cut back to the last whole frame by the writer before anything else is appended, so
only the end of a journal can hold an incomplete frame: a kill mid-write. A frame
whose checksum fails ends the readable part: nothing after it is returned, and the
reader says how many bytes it left. Sealing turns a journal into a Parquet or JSONL
segment.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from metric_core.format.life import Life, is_event
from metric_core.format.records import build_table, int64_array
from metric_core.format.schema import KEY_HASH, key_hash, parse_json

MAGIC = b"MLJ6"  # 6: W frames (where); 5: P frames (samples); 4: F frames carry their time, H and E
FORMAT = 6
_MAGIC_V5 = b"MLJ5"
_MAGIC_V4 = b"MLJ4"
_MAGIC_V3 = b"MLJ3"
_MAGIC_V2 = b"MLJ2"
_MAGIC_V1 = b"MLJ1"
SUFFIX = ".journal"
_LEN = struct.Struct("<I")
_HEAD = struct.Struct("<II")  # header: len, crc
_FRAME = struct.Struct("<cII")  # frame: type, len, crc
_FRAME_V1 = struct.Struct("<cI")
_STEP = struct.Struct("<q")
_TIME = struct.Struct("<d")
_FLUSH = struct.Struct("<qd")
_RECORD_BYTES = 24

KEYS, RECORDS, DROPPED, SHUTDOWN, FLUSH = b"K", b"R", b"D", b"S", b"F"
HEARTBEAT, EVENT, SAMPLES, WHERE = b"H", b"E", b"P", b"W"


def header(process: str, rank: int, created: float, attempt: dict[str, Any] | None = None) -> bytes:
    """The header; ``attempt`` is the writer's {"attempt", "attempt_started", "attempt_first_step"}
    and its life's {"host", "pid", "pidns", "flush_interval", "restart"}."""
    fields = {"format": FORMAT, "process": process, "rank": rank, "created": created, **(attempt or {})}
    body = json.dumps(fields).encode()
    return MAGIC + _HEAD.pack(len(body), zlib.crc32(body)) + body


def _frame(kind: bytes, *parts: bytes) -> bytes:
    length = sum(len(p) for p in parts)
    crc = zlib.crc32(kind + _LEN.pack(length))
    for part in parts:
        crc = zlib.crc32(part, crc)
    return b"".join((_FRAME.pack(kind, length, crc), *parts))


def key_frame(defs: list[tuple[int, str, str]]) -> bytes:
    return _frame(KEYS, json.dumps(defs).encode())


def record_frame(step: int, rows: bytes) -> bytes:
    return _frame(RECORDS, _STEP.pack(step), rows)


def flush_frame(step: int, at: float) -> bytes:
    return _frame(FLUSH, _FLUSH.pack(step, at))


def sample_frame(step: int, samples: bytes) -> bytes:
    """A ``P`` frame: ``samples`` is the JSON list ``[[key, timestamp, sample], ...]``."""
    return _frame(SAMPLES, _STEP.pack(step), samples)


def heartbeat_frame(at: float) -> bytes:
    return _frame(HEARTBEAT, _TIME.pack(at))


def where_frame(at: float, where: tuple[str, str], threads: dict[str, tuple[str, str]] | None) -> bytes:
    body: dict[str, Any] = {"at": at, "where": list(where)}
    if threads:
        body["threads"] = {name: list(place) for name, place in threads.items()}
    return _frame(WHERE, json.dumps(body).encode())


def event_frame(kind: bytes, body: dict[str, Any]) -> bytes:
    """A ``D`` (dropped records), ``S`` (clean shutdown) or ``E`` (an end event) frame."""
    return _frame(kind, json.dumps(body, default=str).encode())


@dataclass
class Decoded:
    """A journal's records as arrays, plus what was wrong with the file."""

    process: str | None = None
    rank: int | None = None
    table: pa.Table | None = None
    truncated_records: int = 0
    truncated: bool = False  # ends inside a frame: the writer stopped mid-write
    unknown_codes: int = 0
    problems: list[str] = field(default_factory=list)  # damage: bad checksum, bad header, ...
    pairs: list[tuple[str, str]] = field(default_factory=list)  # (key, reduction) present
    dropped: list[dict[str, Any]] = field(default_factory=list)  # the writer's D frames
    shutdown: float | None = None  # the timestamp of a clean shutdown (an S frame)
    valid_bytes: int = 0  # the length of the readable part
    attempt: dict[str, Any] = field(default_factory=dict)  # the header's attempt fields
    first_flush: int | None = None  # the step of the first F frame
    # For a reader that follows the journal as it grows (``decode(..., after=)``): the key
    # table, and where the records whose step is final end: after the last F or S frame
    # (the records after it may still be relabelled by the next F frame).
    codes: dict[int, tuple[str, str]] = field(default_factory=dict)
    settled_bytes: int = 0  # in the file, from its start
    settled_records: int = 0  # of ``table``'s rows, the first this many
    last_flush: int | None = None  # the step of the last F frame
    version: int = FORMAT  # from format 3 on, F frames label steps: before, every step is final
    life: Life = field(default_factory=Life)  # the header's host, pid, ...; flush times, heartbeats, ends
    # Samples (P frames): (step, key, timestamp, sample), in the order recorded, steps final
    # as the records' are.
    samples: list[tuple[int, str, float, Any]] = field(default_factory=list)


def decode(data: bytes, after: Decoded | None = None, *, records: bool = True) -> Decoded:
    """Decode a journal up to its last whole, intact frame; what is wrong is reported, not raised.

    With ``after`` (an earlier decode of the same file), ``data`` is the file from
    ``after.settled_bytes`` on: only what follows is decoded, with the header and key
    table ``after`` read, so a reader that follows a growing journal reads each byte about
    once. Positions and ``settled_bytes`` count from the file's start either way. Without
    ``records``, record frames are checked but not decoded (a reader of samples only).
    """
    if after is None:
        return _decode(data, records)
    out = dataclasses.replace(
        after,
        table=None,
        codes=dict(after.codes),
        problems=[],
        dropped=[],
        truncated=False,
        truncated_records=0,
        unknown_codes=0,
        pairs=[],
        samples=[],
        settled_records=0,
        life=after.life.copy(),
    )
    out.valid_bytes = after.settled_bytes
    _frames(data, 0, after.settled_bytes, out, v1=after.version == 1)
    return out


def _decode(data: bytes, records: bool = True) -> Decoded:
    out = Decoded()
    if not data:
        return out  # created, nothing written yet (or a failed first write, cut back)
    magic = data[:4]
    if magic not in (MAGIC, _MAGIC_V5, _MAGIC_V4, _MAGIC_V3, _MAGIC_V2, _MAGIC_V1):
        if len(data) < 4 and MAGIC.startswith(data):
            out.truncated = True  # killed while writing the header
        elif magic[:3] == MAGIC[:3]:
            out.problems.append(
                f"journal format {magic.decode(errors='replace')!r} is newer than this metriclog "
                "reads: upgrade metriclog"
            )
        else:
            out.problems.append("not a metriclog journal (bad magic)")
        return out
    v1 = magic == _MAGIC_V1
    out.version = {MAGIC: 6, _MAGIC_V5: 5, _MAGIC_V4: 4, _MAGIC_V3: 3, _MAGIC_V2: 2, _MAGIC_V1: 1}[magic]
    head_size = 8 if v1 else 4 + _HEAD.size
    if len(data) < head_size:
        out.truncated = True
        return out
    if v1:
        (hlen,) = _LEN.unpack_from(data, 4)
    else:
        hlen, hcrc = _HEAD.unpack_from(data, 4)
    body = data[head_size : head_size + hlen]
    if len(body) < hlen:
        out.truncated = True
        return out
    if not v1 and zlib.crc32(body) != hcrc:
        out.problems.append("journal header fails its checksum (the file is damaged)")
        return out
    try:
        head: dict[str, Any] = parse_json(body)
        out.process = str(head["process"])
        out.rank = int(head["rank"])
        out.attempt = {k: head[k] for k in ("attempt", "attempt_started", "attempt_first_step") if k in head}
        fields = ("host", "pid", "pidns", "flush_interval", "restart")
        out.life = Life.parse({k: head[k] for k in fields if k in head}) or Life()
        out.life.seen(float(head.get("created", math.nan)))
    except (ValueError, KeyError, TypeError):
        out.problems.append("journal header is not valid")
        return out
    out.valid_bytes = out.settled_bytes = head_size + hlen
    _frames(data, head_size + hlen, 0, out, v1=v1, records=records)
    return out


def _frames(data: bytes, pos: int, base: int, out: Decoded, *, v1: bool, records: bool = True) -> None:
    """Decode the frames of ``data`` from ``pos`` into ``out`` (``base``: where ``data``
    starts in the file), up to the last whole, intact frame."""
    keys = out.codes
    blocks: list[memoryview] = []
    steps: list[int] = []
    counts: list[int] = []
    total = 0  # sum(counts), kept as they come (summed at each F frame, it was O(frames^2))
    covered = 0  # record frames before this index are labelled by an F frame already
    sample_frames: list[tuple[int, list[Any]]] = []  # (step, [[key, timestamp, sample], ...])
    samples_covered = 0
    view = memoryview(data)
    frame = _FRAME_V1 if v1 else _FRAME
    while pos < len(data):
        if pos + frame.size > len(data):
            out.truncated = True
            break
        if v1:
            kind, length = frame.unpack_from(data, pos)
        else:
            kind, length, crc = frame.unpack_from(data, pos)
        start, end = pos + frame.size, pos + frame.size + length
        if end > len(data):
            out.truncated = True
            if kind == RECORDS:  # the records its whole header says it held (if it reads as one)
                held, odd = divmod(length - 8, _RECORD_BYTES)
                out.truncated_records = (
                    held if length >= 8 and not odd else max(0, (len(data) - start - 8) // _RECORD_BYTES)
                )
            break
        payload = view[start:end]
        if not v1 and zlib.crc32(payload, zlib.crc32(data[pos : pos + 5])) != crc:
            out.problems.append(
                f"frame at byte {base + pos} fails its checksum (the file is damaged); "
                f"its {len(data) - pos} byte(s) to the end are not read"
            )
            break
        try:
            if kind == KEYS:
                for code, key, reduction in parse_json(payload.tobytes()):
                    keys[int(code)] = (str(key), str(reduction))
            elif kind == RECORDS:
                if length < 8 or (length - 8) % _RECORD_BYTES:
                    raise ValueError(f"record frame of {length} bytes")
                if records:
                    steps.append(_STEP.unpack_from(data, start)[0])
                    counts.append((length - 8) // _RECORD_BYTES)
                    total += counts[-1]
                    blocks.append(view[start + 8 : end])
            elif kind == DROPPED:
                out.dropped.append(parse_json(payload.tobytes()))
            elif kind == FLUSH:
                if length == _FLUSH.size:
                    flushed, at = _FLUSH.unpack_from(data, start)
                    out.life.flushed(flushed, at)
                elif length == _STEP.size:  # format 3: no time
                    (flushed,) = _STEP.unpack_from(data, start)
                else:
                    raise ValueError(f"flush frame of {length} bytes")
                steps[covered:] = [flushed] * (len(steps) - covered)
                covered = len(steps)
                for i in range(samples_covered, len(sample_frames)):
                    sample_frames[i] = (flushed, sample_frames[i][1])
                samples_covered = len(sample_frames)
                out.last_flush = flushed
                if out.first_flush is None:
                    out.first_flush = flushed
            elif kind == SHUTDOWN:
                out.shutdown = float(parse_json(payload.tobytes())["timestamp"])
                out.life.seen(out.shutdown)
                covered = len(steps)  # no F frame relabels anything after a clean end
                samples_covered = len(sample_frames)
            elif kind == SAMPLES:
                if length < 8:
                    raise ValueError(f"sample frame of {length} bytes")
                listed = parse_json(payload[8:].tobytes())
                if not isinstance(listed, list) or not all(
                    isinstance(r, list) and len(r) == 3 for r in listed
                ):
                    raise ValueError("sample frame without [key, timestamp, sample] rows")
                sample_frames.append((_STEP.unpack_from(data, start)[0], listed))
            elif kind == HEARTBEAT:
                if length != _TIME.size:
                    raise ValueError(f"heartbeat frame of {length} bytes")
                out.life.beat(_TIME.unpack_from(data, start)[0])
            elif kind == WHERE:
                body = parse_json(payload.tobytes())
                where = body["where"]
                if not (
                    isinstance(where, list) and len(where) == 2 and all(isinstance(w, str) for w in where)
                ):
                    raise ValueError("where frame without [own, inner]")
                threads = body.get("threads")
                out.life.beat(float(body["at"]), (where[0], where[1]), _threads(threads))
            elif kind == EVENT:
                event = parse_json(payload.tobytes())
                if not is_event(event):
                    raise ValueError("event frame without a kind and a time")
                if event not in out.life.ends:  # a follower decodes the unsettled tail again
                    out.life.ends.append(event)
                out.life.seen(float(event.get("timestamp", math.nan)))
            else:
                raise ValueError(f"unknown frame type {kind!r}")
        except (ValueError, TypeError, KeyError) as exc:
            out.problems.append(f"frame at byte {base + pos} is not valid ({exc}); the rest is not read")
            break
        pos = end
        out.valid_bytes = base + pos
        if kind in (FLUSH, SHUTDOWN) or out.version < 3:
            out.settled_bytes = out.valid_bytes
            out.settled_records = total
    for step, listed in sample_frames:
        out.samples.extend((step, str(key), float(at), sample) for key, at, sample in listed)
    if blocks:
        rows = np.frombuffer(b"".join(blocks), dtype=np.float64).reshape(-1, 3)
        if len(rows):
            out.life.seen(float(rows[:, 2].max()))
        step_col = np.repeat(np.asarray(steps, dtype=np.int64), counts)
        out.table = _to_table(rows, step_col, keys, out)


def _threads(raw: Any) -> dict[str, tuple[str, str]] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError("where frame's threads are not an object")
    return {str(name): (str(p[0]), str(p[1])) for name, p in raw.items()}


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
    return table.append_column(KEY_HASH, int64_array(hashes[codes] if len(hashes) else np.zeros(0, np.int64)))
