"""Sealing a closed journal: its records as a checksummed Parquet or JSONL segment and its
samples as a samples file, each published by rename before the journal is unlinked."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from metric_core.atomic import new_hidden_file, publish
from metric_core.format import journal, records
from metric_core.format import sample as sample_codec
from metric_core.format.schema import KEY_HASH
from metric_core.format.segment import BLOCK_EVENT, PARQUET_KEY, SHUTDOWN_EVENT, SegmentMeta

if TYPE_CHECKING:
    from metric_core.writer.segments import RawFileWriter

# Dictionary-encode only where values repeat: hashing every float would cost more than it saves.
_DICT_COLUMNS = ["key", "reduction", "process", "step", "rank", KEY_HASH]
# Min/max of the values themselves help no reader; those of steps and timestamps let
# DuckDB or polars skip row groups.
_STATS_COLUMNS = ["key", "reduction", "process", "step", "rank", "timestamp"]
# Readers stream a row group at a time; DuckDB's default size, so they hold little at once.
ROW_GROUP_RECORDS = 122_880


def seal_journal(path: Path, writer: RawFileWriter) -> None:
    """Seal ``path``, a closed journal of ``writer``'s source: its samples file first (when it
    holds samples), then its segment, then the journal is unlinked. An ``OSError`` leaves the
    journal, which is read as it is until a later call seals it."""
    decoded = journal.decode(path.read_bytes())
    table = decoded.table if decoded.table is not None else records.empty_decoded()
    final = path.with_suffix("." + writer.file_format)
    clean_shutdown = decoded.shutdown is not None
    meta = SegmentMeta(
        supersedes=path.name,
        records=table.num_rows,
        process=writer.process,
        rank=writer.rank,
        clean_shutdown=clean_shutdown,
        timestamp=decoded.shutdown if decoded.shutdown is not None else time.time(),
        # Each key's reduction, the step and time ranges: a reader knows them without a pass.
        keys=tuple(decoded.pairs),
        steps=_bounds(table, "step"),
        timestamps=_bounds(table, "timestamp"),
        key_stats=_key_stats(table),
        dropped=tuple(decoded.dropped),
        attempt=writer.attempt,
        attempt_started=writer.attempt_started,
        attempt_first_step=decoded.attempt.get("attempt_first_step", decoded.first_flush),
        life=decoded.life,
    )
    if decoded.samples:  # first: the journal is unlinked only once both files are in place
        _seal_samples(path, decoded, clean_shutdown, writer)
    with new_hidden_file(final) as (f, tmp):
        if writer.file_format == "parquet":
            # Every page carries a CRC-32 the reader verifies; the footer, outside them, is
            # checked against the metadata's own checksum and row-group counts.
            meta = dataclasses.replace(meta, row_groups=_row_groups(table, writer.block_records))
            with pq.ParquetWriter(
                f,
                table.schema,
                store_schema=False,
                compression="snappy",
                use_dictionary=_DICT_COLUMNS,
                write_statistics=_STATS_COLUMNS,
                write_page_checksum=True,
            ) as w:
                w.write_table(table, row_group_size=writer.block_records)
                w.add_key_value_metadata({PARQUET_KEY: meta.to_json()})
        else:
            blocks: list[Any] = list(records.jsonl_blocks(table.drop_columns(KEY_HASH), writer.block_records))
            if clean_shutdown:
                end = {"event": SHUTDOWN_EVENT, "process": writer.process, "rank": writer.rank}
                blocks.append(((json.dumps({**end, "timestamp": decoded.shutdown}) + "\n").encode(), 1))
            body = [part for block, lines in blocks for part in (block, _block_line(block, lines))]
            finite = pc.sum(pc.is_finite(table["value"])).as_py() if table.num_rows else 0
            # A reader then parses values as plain numbers once each block checks.
            size = sum(len(b) if isinstance(b, bytes) else b.size for b in body)
            meta = dataclasses.replace(meta, nonfinite=table.num_rows - finite, bytes=size)
            f.write(meta.jsonl_line())
            for chunk in body:
                f.write(chunk)
        f.flush()
        if writer.fsync:
            os.fsync(f.fileno())
    publish(tmp, final)
    path.unlink()


def _seal_samples(path: Path, decoded: journal.Decoded, clean_shutdown: bool, writer: RawFileWriter) -> None:
    """``samples/{journal stem}.samples.{format}``: the journal's samples, in the order
    recorded, with what a reader needs to resolve attempts; checksummed as segments are."""
    folder = writer.run_dir / sample_codec.DIRECTORY
    if folder.is_symlink():
        raise OSError(
            errno.ELOOP, "a symlink where metriclog keeps samples: not written through", str(folder)
        )
    folder.mkdir(exist_ok=True)
    final = folder / f"{path.stem}.samples.{writer.file_format}"
    meta = {
        "supersedes": path.name,
        "samples": len(decoded.samples),
        "process": writer.process,
        "rank": writer.rank,
        "attempt": writer.attempt,
        "attempt_started": writer.attempt_started,
        "attempt_first_step": decoded.attempt.get("attempt_first_step", decoded.first_flush),
        "clean_shutdown": clean_shutdown,
    }
    meta["checksum"] = sample_codec.meta_checksum(meta)
    texts = [json.dumps(s, ensure_ascii=False) for _, _, _, s in decoded.samples]
    with new_hidden_file(final) as (f, tmp):
        if writer.file_format == "parquet":
            table = pa.table(
                {
                    "step": pa.array([s[0] for s in decoded.samples], pa.int64()),
                    "rank": pa.array([writer.rank] * len(texts), pa.int64()),
                    "process": pa.array([writer.process] * len(texts), pa.string()),
                    "timestamp": pa.array([s[2] for s in decoded.samples], pa.float64()),
                    "key": pa.array([s[1] for s in decoded.samples], pa.string()),
                    "sample": pa.array(texts, pa.string()),
                }
            )
            with pq.ParquetWriter(f, table.schema, compression="zstd", write_page_checksum=True) as w:
                w.write_table(table)
                w.add_key_value_metadata({sample_codec.PARQUET_KEY: json.dumps(meta)})
        else:
            f.write((json.dumps({"event": sample_codec.SEGMENT_EVENT, **meta}) + "\n").encode())
            lines = [
                (
                    f'{{"step": {step}, "rank": {writer.rank}, "process": {json.dumps(writer.process)}, '
                    f'"timestamp": {at!r}, "key": {json.dumps(key)}, "sample": {text}}}\n'
                ).encode()
                for (step, key, at, _), text in zip(decoded.samples, texts, strict=True)
            ]
            for lo in range(0, len(lines), sample_codec.BLOCK_SAMPLES):
                block = b"".join(lines[lo : lo + sample_codec.BLOCK_SAMPLES])
                f.write(block)
                f.write(_block_line(block, len(lines[lo : lo + sample_codec.BLOCK_SAMPLES])))
        f.flush()
        if writer.fsync:
            os.fsync(f.fileno())
    publish(tmp, final)


def _row_groups(table: pa.Table, size: int) -> tuple[tuple[int, int, float], ...]:
    """Each row group's records, lowest step and earliest time, as ``write_table`` cuts them."""
    out = []
    for start in range(0, table.num_rows, size):
        part = table.slice(start, size)
        out.append((part.num_rows, pc.min(part["step"]).as_py(), pc.min(part["timestamp"]).as_py()))
    return tuple(out)


def _block_line(block: bytes | pa.Buffer, lines: int) -> bytes:
    """The line that follows a block of a sealed JSONL segment: its CRC-32 and its lines."""
    return (json.dumps({"event": BLOCK_EVENT, "crc32": zlib.crc32(block), "lines": lines}) + "\n").encode()


def _key_stats(table: pa.Table) -> tuple[Any, ...]:
    """Each (key, reduction) of the records with their count, first and last step and time,
    and how many values are NaN or infinite: ``metriclog keys`` answers from these. numpy
    over dictionary codes (pyarrow's group_by starts threads, which an interpreter that is
    exiting, where a collector left open is sealed, refuses)."""
    if table.num_rows == 0:
        return ()
    keys, key_names = _codes(table["key"])
    reductions, reduction_names = _codes(table["reduction"])
    width = max(len(reduction_names), 1)
    pairs, group = _numbered(keys * width + reductions, max(len(key_names), 1) * width)
    # a stable sort of at most 2**16 groups' numbers sorts them as uint16: numpy's radix sort
    order = np.argsort(group.astype(np.uint16) if len(pairs) <= 1 << 16 else group, kind="stable")
    starts = np.flatnonzero(np.r_[True, np.diff(group[order]) != 0])
    step = records.as_numpy(table["step"], np.int64)[order]
    at = records.as_numpy(table["timestamp"], np.float64)[order]
    bad = ~np.isfinite(records.as_numpy(table["value"], np.float64))
    found = zip(
        (key_names[p // max(len(reduction_names), 1)] for p in pairs),
        (reduction_names[p % max(len(reduction_names), 1)] for p in pairs),
        np.bincount(group).tolist(),
        np.minimum.reduceat(step, starts).tolist(),
        np.maximum.reduceat(step, starts).tolist(),
        np.minimum.reduceat(at, starts).tolist(),
        np.maximum.reduceat(at, starts).tolist(),
        np.bincount(group, weights=bad).astype(np.int64).tolist(),
        strict=True,
    )
    return tuple(sorted(found))


def _numbered(ids: np.ndarray, span: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct ``ids`` (each below ``span``), sorted, and each one's place among them:
    ``np.unique(ids, return_inverse=True)``, without its sort where ``span`` is small."""
    if span > 1 << 16:
        return np.unique(ids, return_inverse=True)
    distinct = np.flatnonzero(np.bincount(ids, minlength=span))
    place = np.zeros(span, dtype=np.int64)
    place[distinct] = np.arange(len(distinct))
    return distinct, place[ids]


def _codes(column: pa.ChunkedArray) -> tuple[np.ndarray, list[str]]:
    """A string column as codes into its distinct strings."""
    array = column.combine_chunks()
    if not pa.types.is_dictionary(array.type):
        array = pc.dictionary_encode(array)
    return records.as_numpy(array.indices, np.int64), array.dictionary.to_pylist()


def _bounds(table: pa.Table, column: str) -> Any:
    if table.num_rows == 0:
        return None
    bounds = pc.min_max(table[column]).as_py()
    return (bounds["min"], bounds["max"])
