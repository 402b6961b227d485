"""JSONL files: the writer's sealed segments (typed, scanned lazily) and any other tool's.

Every field is read as text and cast in bulk with polars' NDJSON parser; only a file
polars cannot parse at all falls back to a line-by-line pass that finds the bad lines.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import zlib
from typing import TYPE_CHECKING, Any

import polars as pl

from metric_core.format.schema import MAX_LINE_BYTES, NestedTooDeep, parse_json, spell_float
from metric_core.format.segment import SegmentMeta
from metric_core.offline.read.discover import take_declared
from metric_core.offline.read.report import FileReport, ReadReport, Shutdown
from metric_core.offline.read.validate import POLARS_SCHEMA, TEXT_SCHEMA, TYPED_SCHEMA, accept
from metric_core.offline.storage import RunPath, is_remote, raise_store_failure, source

if TYPE_CHECKING:
    import numpy as np

_TRUNCATED = "half-written last line (the writer was killed mid-write)"
_BINARY_MAGIC = {
    b"\x1f\x8b": "gzip-compressed",
    b"PK": "zip-compressed",
    b"\x28\xb5\x2f\xfd": "zstd-compressed",
    b"BZh": "bzip2-compressed",
    b"PAR1": "a Parquet file",
}


def read_jsonl(
    path: RunPath, sealed: SegmentMeta | None, rep: FileReport, report: ReadReport
) -> pl.LazyFrame | None:
    if (
        sealed is not None
        and sealed.source is not None
        and sealed.nonfinite == 0
        and (sealed.records == 0 or sealed.plausible_times)
        and _blocks_check(path, sealed)
    ):
        return _scan_sealed_jsonl(path, sealed, rep, report)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise_store_failure(path, exc)
        rep.unreadable = str(exc)
        return None
    # A sealed segment, with checksums: it has block lines, or its writer's metadata says it
    # was written with them (a segment cut short before its first block line has none).
    blocks = data.find(_BLOCK_PREFIX) != -1 or _declares_blocks(data, sealed)
    kind = _binary_kind(data)
    if kind is not None and not (kind == "binary" and blocks):  # a NUL a flipped bit made: its block says
        rep.unreadable = f"{kind} data, not JSON lines" + (
            ": decompress it first (e.g. gunzip)" if kind.endswith("compressed") else ""
        )
        return None
    # A writer's segment begins with its metadata, a line of every key: no record, and not
    # held to a record's line limit.
    first = (data.find(b"\n") + 1 or len(data)) if blocks or data.startswith(_SEGMENT_LINE) else 0
    size = len(data) - first
    data = data[:first] + _without_long_lines(data[first:], rep, first=2 if first else 1)
    if blocks:
        # Its writer's metadata, unless damaged: metadata that fails its checksum was said
        # by the scan; a line that is not JSON, or not the writer's metadata, is said here.
        if sealed is None and not (_is_json_object(data[:first]) and data.startswith(_SEGMENT_LINE)):
            rep.skip("line 1, its writer's metadata, is damaged: ignored", 0)
        if sealed is not None and sealed.source is not None:
            rep.source = sealed.source  # its (checked) metadata vouches for it, as a Parquet footer's does
        data = b"\n" + data[first:]  # (line numbers stay the file's)
        damaged, _ = _blocks(data, expected=True)
        data = _without(data, damaged, rep, sealed, size)
        short = sealed is not None and sealed.bytes is not None and size < sealed.bytes
        if (damaged or short) and sealed is not None and sealed.clean_shutdown and sealed.source is not None:
            # its shutdown line may be what was damaged or cut off: the (checked) metadata says it too
            report.shutdowns.append(Shutdown(*sealed.source, sealed.timestamp, sealed.attempt))
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        last = data[cut:]
        if _is_json_object(last):
            data += b"\n"
        else:
            rep.truncated = True
            rep.skip(_TRUNCATED, 1, [data.count(b"\n", 0, cut) + 1])
            data = data[:cut]
    if not blocks and sealed is not None and sealed.records is not None and _cut_short(size, sealed):
        # an older writer's segment (no block lines), cut short: what its metadata says is missing
        missing = sealed.records - _record_lines(data) - rep.truncated
        if missing > 0:
            rep.skip(f"not in the file, though its writer wrote them ({_cut_short(size, sealed)})", missing)
    newlines = data.count(b"\n")

    def line_numbers() -> np.ndarray:
        import numpy as np

        ends = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)
        starts = np.r_[0, ends[:-1] + 1]
        return np.flatnonzero(ends > starts) + 1

    for schema, typed_input in ((TYPED_SCHEMA, True), (TEXT_SCHEMA, False)):
        if typed_input and _LONG_INTEGER_VALUE.search(data):
            continue  # a float64 column would round it: read as text, where it is exact or refused
        try:
            raw = pl.read_ndjson(data, schema=schema)
        except (pl.exceptions.PolarsError, ValueError):
            continue
        # polars skips blank lines; any other difference means a line was lost: fall back.
        if raw.height == newlines or raw.height == len(line_numbers()):
            if raw.height == 0:
                return None
            return accept(raw, line_numbers, rep, report, typed_input=typed_input).lazy()
    raw, numbers = _jsonl_line_by_line(data, rep)
    return accept(raw, lambda: numbers, rep, report).lazy()


# A value written as an integer of 16 digits or more: float64 may not hold it exactly.
_LONG_INTEGER_VALUE = re.compile(rb'"value"\s*:\s*-?\d{16,}\s*[,}]')
# The line after each block of a sealed segment (``segment.BLOCK_EVENT``), as its writer spells it.
_BLOCK_LINE = re.compile(rb'^\{"event": "block", "crc32": (\d{1,10}), "lines": (\d{1,10})\}\n', re.MULTILINE)


def _without_long_lines(data: bytes, rep: FileReport, first: int = 1) -> bytes:
    """``data`` (whose first line is line ``first``) with each line longer than
    ``MAX_LINE_BYTES`` refused before any parse (its bytes gone, its newline kept, so line
    numbers stay): no record is that long, and parsing one could take many times its size
    in memory."""
    import numpy as np

    ends = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)
    starts = np.r_[0, ends + 1]
    lengths = np.r_[ends, len(data)] - starts
    long = np.flatnonzero(lengths > MAX_LINE_BYTES)
    if not len(long):
        return data
    kept, pos = [], 0
    for i in long.tolist():
        start, size = int(starts[i]), int(lengths[i])
        rep.skip(
            f"a line of {size:,} bytes, over the {MAX_LINE_BYTES:,} a record's line may hold", 1, [i + first]
        )
        kept.append(data[pos:start])
        pos = start + size
    kept.append(data[pos:])
    return b"".join(kept)


def _blocks_check(path: RunPath, meta: SegmentMeta) -> bool:
    """Whether a sealed JSONL segment is whole: blocks from its first line's end to its last
    byte, each matching its checksum, as many lines as its writer wrote and the size it
    gave. Then it can be scanned without a check of each line."""
    try:
        if is_remote(path):
            return _whole(path.read_bytes(), meta)
        with open(str(path), "rb") as f:  # mapped, not read into memory: a segment may be large
            if os.fstat(f.fileno()).st_size == 0:
                return False
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _whole(data, meta)
    except OSError as exc:
        raise_store_failure(path, exc)
        return False


def _whole(data: bytes | mmap.mmap, meta: SegmentMeta) -> bool:
    first = data.find(b"\n") + 1
    damaged, lines = _blocks(data)
    written = (meta.records or 0) + (1 if meta.clean_shutdown else 0)  # and the shutdown line
    return bool(lines) and not damaged and lines == written and len(data) - first == meta.bytes


# How the writer begins the line after each block (``segment.BLOCK_EVENT``); a record's line
# cannot hold it, since JSON escapes the quotes and newlines of a string.
_BLOCK_PREFIX = b'\n{"event": "block", "crc32": '
_SEGMENT_LINE = b'{"event": "segment", '


def _blocks(data: bytes | mmap.mmap, *, expected: bool = False) -> tuple[list[tuple[int, int]], int]:
    """The byte ranges of a file of blocks (after its first line, the writer's metadata)
    that fail their checksums: a block whose bytes do not match its line's CRC-32 (with its
    line), several blocks whose lines between them were damaged, and bytes after the last
    block line; and the lines the blocks that match hold. ([], 0) for a file with no block
    line (another tool's, or an older writer's) unless its blocks are ``expected`` (its
    writer's metadata says so: ``_declares_blocks``): then every byte after its first line
    is unverified."""
    start = data.find(b"\n") + 1
    pos, out, lines = start, [], 0
    at = start - 1
    while True:
        if data[pos : pos + len(_SEGMENT_LINE)] == _SEGMENT_LINE:  # another segment's metadata: files joined
            end = data.find(b"\n", pos)
            pos = len(data) if end == -1 else end + 1
            at = pos - 1
        if (at := data.find(_BLOCK_PREFIX, at)) == -1:
            break
        end = data.find(b"\n", at + 1)
        end = len(data) if end == -1 else end + 1
        m = _BLOCK_LINE.match(data, at + 1, end)
        if m is not None:
            if zlib.crc32(memoryview(data)[pos : at + 1]) == int(m[1]):
                lines += int(m[2])
            else:
                out.append((pos, end))
            pos = end
        at = end - 1
    if pos == start:
        return ([(start, len(data))] if expected and start < len(data) else []), 0
    if pos < len(data):
        out.append((pos, len(data)))
    return out, lines


def _declares_blocks(data: bytes, sealed: SegmentMeta | None) -> bool:
    """Whether the writer's metadata on line 1 says the file was sealed in blocks: it
    carries a ``checksum`` (checked, or failed: ``sealed`` is None then). The metadata's
    checksum came with the block lines, so a segment of an older writer has none (its
    ``bytes`` came earlier: sample_logs/ holds such files), while one cut short before its
    first block line has no block line to show."""
    line = data[: data.find(b"\n") + 1]
    checked = b'"checksum": ' in line
    return line.startswith(_SEGMENT_LINE) and checked and (sealed is None or sealed.bytes is not None)


def _record_lines(data: bytes, lo: int = 0, hi: int | None = None) -> int:
    """The lines of ``data[lo:hi]`` that begin as the writer begins a record's."""
    hi = len(data) if hi is None else hi
    return data.count(b'\n{"key":', max(lo - 1, 0), hi) + (lo == 0 and data.startswith(b'{"key":'))


def _without(
    data: bytes, damaged: list[tuple[int, int]], rep: FileReport, meta: SegmentMeta | None, size: int
) -> bytes:
    """``data`` with each ``damaged`` range's bytes but its newlines removed (so that line
    numbers stay those of the file), the records in them counted in ``rep`` as skipped;
    with its writer's (checked) metadata, what it wrote and is not left is counted too
    (blocks cut off or lost). ``size``, the file's bytes after its first line, tells a file
    cut short (fewer than its metadata's ``bytes``): its last lines, which no block line
    follows, are said as unverified, with the records cut off."""
    kept, pos, where = [], 0, []
    for lo, hi in damaged:
        first, lines = data.count(b"\n", 0, lo) + 1, data.count(b"\n", lo, hi)
        touched = lines + (hi == len(data) and not data.endswith(b"\n"))  # a last line cut in two
        where.append(f"{first}" if touched <= 1 else f"{first}-{first + touched - 1}")
        kept += [data[pos:lo], b"\n" * lines]
        pos = hi
    kept.append(data[pos:])
    out = b"".join(kept) if damaged else data
    lost = [_record_lines(data, lo, hi) for lo, hi in damaged]
    missing = 0
    if meta is not None and meta.records is not None:  # a record line may be what was damaged
        missing = max(meta.records - _record_lines(out) - sum(lost), 0)
    short = _cut_short(size, meta)
    cut = bool(short)
    if cut and damaged and damaged[-1][1] == len(data):  # its last block, without its block line
        tail = where.pop()
        said = f"line {tail} is" if "-" not in tail else f"lines {tail} are"
        rep.skip(
            f"{said} not verified (no block line follows), and the rest is missing: {short}",
            lost.pop() + missing,
        )
        missing = 0
    if where:
        one = len(where) == 1 and "-" not in where[0]
        said = f"line {where[0]} fails its" if one else f"lines {', '.join(where)} fail their"
        rep.skip(f"{said} block's checksum (the file is damaged)", sum(lost) + missing)
    elif missing:
        rep.skip(
            f"not in the file, though its writer wrote them ({short or 'cut short, or blocks lost'})", missing
        )
    return out


def _cut_short(size: int, meta: SegmentMeta | None) -> str:
    """What to say of a segment of ``size`` bytes after its first line that its writer's
    metadata says was longer ("" where it was not, or does not say)."""
    written = meta.bytes if meta is not None else None
    if written is None or size >= written:
        return ""
    return f"the file is cut short ({size:,} of the {written:,} bytes its writer wrote after line 1)"


def _scan_sealed_jsonl(
    path: RunPath, meta: SegmentMeta, rep: FileReport, report: ReadReport
) -> pl.LazyFrame | None:
    """A JSONL segment sealed by our writer: typed, finite, every block matching its
    checksum, so it is scanned lazily, streaming, without a validation pass."""
    assert meta.source is not None and meta.records is not None  # checked by read_jsonl
    rep.source = meta.source
    rep.records += meta.records
    take_declared(rep, meta)
    if meta.clean_shutdown:
        report.shutdowns.append(Shutdown(*meta.source, meta.timestamp, meta.attempt))
    if meta.records == 0:
        return None
    return (
        pl.scan_ndjson(source(path), schema=TYPED_SCHEMA)
        .filter(pl.col("key").is_not_null())
        .select(*POLARS_SCHEMA)
    )


def _binary_kind(data: bytes) -> str | None:
    """What a file named .jsonl holds instead of text, if it is not text."""
    for magic, kind in _BINARY_MAGIC.items():
        if data.startswith(magic):
            return kind
    if b"\x00" in data[:4096]:
        first = data[: data.find(b"\n") + 1 or len(data)]
        if (
            first.removeprefix(b"\xef\xbb\xbf").lstrip().startswith(b"{")
            and b"\x00" not in first
            and first.endswith(b"\n")
        ):
            return None  # JSON lines with a NUL in some (a crash's unwritten zeros): those lines are bad
        return "binary"
    return None


def _is_json_object(line: bytes) -> bool:
    try:
        return isinstance(parse_json(line), dict)
    except ValueError:
        return False


def _jsonl_line_by_line(data: bytes, rep: FileReport) -> tuple[pl.DataFrame, np.ndarray]:
    """The fallback for files polars cannot parse: find the bad lines one by one."""
    import numpy as np

    columns: dict[str, list[str | None]] = {name: [] for name in TEXT_SCHEMA}
    numbers = []
    for number, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = parse_json(line)
        except NestedTooDeep:
            rep.skip("JSON nested too deep to be a record", 1, [number])
            continue
        except ValueError:
            rep.skip("not valid JSON", 1, [number])
            continue
        if not isinstance(obj, dict):
            rep.skip("not a JSON object", 1, [number])
            continue
        numbers.append(number)
        for name, col in columns.items():
            col.append(_as_text(obj.get(name)))
    return pl.DataFrame(columns, schema=TEXT_SCHEMA), np.asarray(numbers, dtype=np.int64)


def _as_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):  # Python's json reads NaN and Infinity tokens
        return str(spell_float(value))
    if isinstance(value, (int, str)):
        return str(value)
    return json.dumps(value)
