"""The run's samples files listed, and each read: a sealed Parquet or JSONL samples file
(checksums verified, damaged parts left out and said), or the samples of a journal."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metric_core.errors import NoDataError
from metric_core.format import journal
from metric_core.format import sample as sample_codec
from metric_core.format.schema import parse_json
from metric_core.offline.read.report import FileReport, ReadReport, rel
from metric_core.offline.storage import RunPath, arrow_source, listing, not_a_directory, open_read

_BLOCK_PREFIX = b'{"event": "block", '


@dataclass
class SamplesPart:
    """The samples of one file, and the attempt they belong to."""

    process: str
    rank: int
    attempt: str
    started: float
    first_step: int | None
    seq: str
    rows: list[tuple[int, str, float, Any]]  # (step, key, timestamp, sample)


def samples_files_and_journals(root: RunPath, report: ReadReport) -> list[RunPath]:
    """The run's sealed samples files and journals, in every folder but hidden ones, listed as
    the records' files are (``read.discover.walk_run``): what is not read goes in ``report``."""
    if not isinstance(root, Path):
        unnamed: list[tuple[str, str]] = []
        found: list[RunPath] = [
            p
            for p in listing(root, unnamed)
            if _ours(p.name) and not any(part.startswith(".") for part in rel(p, root).split("/"))
        ]
        report.skipped_paths += [(url, why) for url, why in unnamed if _ours(url.rstrip("/"))]
        return found
    if not root.is_dir():
        raise NoDataError(str(root), not_a_directory(root))
    from metric_core.offline.read.discover import walk_run  # loads polars: upload forks first

    return list(walk_run(root, report, follow_symlinks=False, wanted=_ours))


def _ours(name: str) -> bool:
    return sample_codec.is_samples_file(name) or name.endswith(journal.SUFFIX)


def read_samples_file(path: RunPath, rep: FileReport) -> SamplesPart | None:
    """A sealed samples file's samples; None when it cannot be read (said in ``rep``)."""
    try:
        if path.name.endswith(".parquet"):
            meta, rows = _sealed_parquet(path)
        else:
            meta, rows = _sealed_jsonl(path, rep)
        if sample_codec.meta_checksum(meta) != meta.get("checksum"):
            raise ValueError("its metadata fails its checksum (the file is damaged)")
    except Exception as exc:  # a damaged file is said and left out, whatever the reader hit
        rep.skipped, rep.skip_reasons = 0, {}  # what it said of its blocks: none of them is read
        rep.unreadable = f"{_gist(exc)}; its samples are left out"
        return None
    rep.records = len(rows)
    return SamplesPart(
        str(meta["process"]),
        int(meta["rank"]),
        str(meta.get("attempt") or ""),
        float(meta.get("attempt_started") or 0.0),
        meta.get("attempt_first_step"),
        str(meta["supersedes"]),
        rows,
    )


def _sealed_parquet(path: RunPath) -> tuple[dict[str, Any], list[tuple[int, str, float, Any]]]:
    import pyarrow.parquet as pq

    # Read by arrow's own file (never a Python file object, whose buffers arrow's threads
    # would release at the interpreter's exit), on this thread.
    with arrow_source(path) as source:
        pf = pq.ParquetFile(source, page_checksum_verification=True)
        kv = pf.metadata.metadata or {}
        if sample_codec.PARQUET_KEY not in kv:
            raise ValueError("not a samples file of metriclog (no metriclog.samples metadata)")
        meta = parse_json(kv[sample_codec.PARQUET_KEY])
        table = pf.read(columns=["step", "rank", "process", "key", "timestamp", "sample"], use_threads=False)
    if set(table.column("process").unique().to_pylist()) - {meta.get("process")} or set(
        table.column("rank").unique().to_pylist()
    ) - {meta.get("rank")}:
        raise ValueError("its rows name another source than its metadata")
    cols = [table.column(c).to_pylist() for c in ("step", "key", "timestamp", "sample")]
    rows = [(s, k, t, parse_json(x)) for s, k, t, x in zip(*cols, strict=True)]
    if len(rows) != meta.get("samples"):
        raise ValueError(f"{len(rows)} samples where its metadata says {meta.get('samples')}")
    return meta, rows


def _sealed_jsonl(path: RunPath, rep: FileReport) -> tuple[dict[str, Any], list[tuple[int, str, float, Any]]]:
    """A sealed JSONL samples file: its metadata line, then blocks of lines, each followed by
    a line with the block's CRC-32. A block that fails it is left out, and said."""
    with open_read(path) as f:
        data = f.read()
    first = data.find(b"\n") + 1
    meta = parse_json(data[:first])
    if meta.get("event") != sample_codec.SEGMENT_EVENT:
        raise ValueError("not a samples file of metriclog (no samples_segment line)")
    rows: list[tuple[int, str, float, Any]] = []
    pos, block_start = first, first
    while pos < len(data):
        end = data.find(b"\n", pos)
        end = len(data) if end < 0 else end + 1
        line = data[pos:end]
        if line.startswith(_BLOCK_PREFIX):
            check = parse_json(line)
            block = data[block_start:pos]
            if zlib.crc32(block) == check["crc32"]:
                for text in block.splitlines():
                    one = parse_json(text)
                    if (one["process"], one["rank"]) != (meta.get("process"), meta.get("rank")):
                        raise ValueError("its lines name another source than its metadata")
                    rows.append((_step(one["step"]), str(one["key"]), float(one["timestamp"]), one["sample"]))
            else:
                rep.skip(
                    f"a block at byte {block_start} fails its checksum (the file is damaged)", check["lines"]
                )
            block_start = end
        pos = end
    if block_start < len(data):
        rep.skip(f"{len(data) - block_start} byte(s) at its end are not in a checked block", 0)
    missing = int(meta.get("samples", 0)) - len(rows) - rep.skipped
    if missing > 0:
        rep.skip(
            f"missing from the file, whose metadata declares {meta['samples']} (cut or damaged)", missing
        )
    return meta, rows


def _gist(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def read_journal_samples(path: RunPath, rep: FileReport, report: ReadReport) -> SamplesPart | None:
    """A journal's samples up to its first damaged frame (said in ``rep``, as the records'
    reader says it), None when it holds none; ``FileNotFoundError`` when it was sealed since
    it was listed."""
    try:
        with open_read(path) as f:
            decoded = journal.decode(f.read(), records=False)
    except FileNotFoundError:
        raise  # sealed since it was listed: the caller lists the run again
    except OSError as exc:
        rep.unreadable = f"{exc.strerror or exc}; its samples are left out"
        return None
    from metric_core.offline.read.journal import take_damage  # loads polars, as above

    take_damage(decoded, rep, 0, report)  # what follows a damaged frame is not read: samples too
    if not decoded.samples or decoded.process is None or decoded.rank is None:
        return None
    rep.records = len(decoded.samples)
    attempt = decoded.attempt
    return SamplesPart(
        decoded.process,
        decoded.rank,
        str(attempt.get("attempt") or ""),
        float(attempt.get("attempt_started") or 0.0),
        attempt.get("attempt_first_step", decoded.first_flush),
        path.name,
        list(decoded.samples),
    )


def _step(value: Any) -> int:
    """A sample's step: an integer inside int64 (a step is an int64 in every file), else a ValueError."""
    if type(value) is not int or not -(2**63) <= value < 2**63:
        raise ValueError(f"a sample's step {value!r} is not an integer inside int64")
    return value
