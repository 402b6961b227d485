"""The raw-stream file writer: every record of one process, crash-safely, on local disk.

A source writes numbered segments, ``{stem}.{seq:05d}.*`` (see ``metric_core.schema``):

1. The open segment is a journal (``.journal``, see ``metric_core.journal``): each
   flush appends the collector's raw buffer with one ``write`` to an unbuffered file,
   so a returned ``flush()`` survives a SIGKILL and costs no per-record work.
2. When the journal holds ``segment_records`` records, is ``seal_interval`` seconds
   old, or the source shuts down, the writer thread seals it: decodes it, writes a
   hidden temporary Parquet (or JSONL) file, renames it into place atomically, and
   only then unlinks the journal. The sealed file names the journal it supersedes
   (Parquet footer metadata, or a first JSONL line ``{"event": "segment", ...}``), so
   a journal left behind by a kill between rename and unlink is never read twice.

A kill at any instant therefore leaves readable sealed segments plus at most one
journal per source, whose last frame may be short (reported, and not covered by any
returned flush). ``shutdown()`` seals everything and records a clean end in the last
segment.
"""

from __future__ import annotations

import collections
import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from metric_core import journal
from metric_core.backends import LoggerBackend
from metric_core.errors import ConfigError
from metric_core.metric import BackendRole, Metric
from metric_core.schema import (
    KEY_HASH,
    PARQUET_META_KEY,
    SEGMENT_EVENT,
    SHUTDOWN_EVENT,
    file_stem,
    to_jsonl,
)

FILE_FORMATS = ("parquet", "jsonl")
# Dictionary-encode only where values repeat: hashing every float would cost more than it saves.
_DICT_COLUMNS = ["key", "reduction", "process", "step", "rank", KEY_HASH]
# Min/max of the values themselves help no reader; those of steps and timestamps let
# DuckDB or polars skip row groups.
_STATS_COLUMNS = ["key", "reduction", "process", "step", "rank", "timestamp"]
# Readers stream a row group at a time; DuckDB's default size, so they hold little at once.
_ROW_GROUP_RECORDS = 122_880


class RawFileWriter(LoggerBackend):
    """Writes one process's raw records (PER_RANK_NO_REDUCE) to segment files.

    The collector calls ``append`` with its coded buffer; used on its own, the writer
    takes Arrow batches in the record schema through ``log_stream_batch``.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        process: str,
        rank: int,
        file_format: str = "parquet",
        segment_records: int = 1_000_000,
        seal_interval: float = 600.0,
        fsync: bool = False,
    ) -> None:
        super().__init__({"logging_mode": "per_rank_no_reduce"})
        if file_format not in FILE_FORMATS:
            raise ConfigError(
                f"file_format '{file_format}' is not supported: use one of {', '.join(FILE_FORMATS)}"
            )
        if segment_records < 1:
            raise ConfigError(f"segment_records must be at least 1, got {segment_records}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.process = process
        self.rank = rank
        self.file_format = file_format
        self.segment_records = segment_records
        self.seal_interval = seal_interval
        self.fsync = fsync
        self.stem = file_stem(process)
        self._seq = self._first_free_seq()
        self._file: BinaryIO | None = None
        self._path: Path | None = None
        self._opened_at = 0.0
        self._rows = 0
        self._defs_written = 0
        self._to_seal: collections.deque[Path] = collections.deque()
        self._seal_lock = threading.Lock()
        self._own_codes: dict[tuple[str, str], int] = {}
        self._own_table: list[tuple[str, str]] = []
        journal.warm_up()

    # -- LoggerBackend -----------------------------------------------------------------

    async def init(
        self,
        role: BackendRole,
        primary_logger_metadata: dict[str, Any] | None = None,
        process_name: str | None = None,
    ) -> None:
        """Nothing to do: files are opened on the first write."""

    async def log_batch(self, metrics: list[Metric], global_step: int) -> None:
        """The file writer keeps raw records only; reduced values are never written."""

    def log_stream(self, metric: Metric, global_step: int) -> None:
        step = global_step if metric.step is None else metric.step
        code = self._own_code(metric.key, str(metric.reduction))
        rows = np.array([[float(metric.value), code, metric.timestamp]], dtype=np.float64)
        self.append(step, rows.tobytes(), 1, self._own_table)

    def log_stream_batch(self, batch: pa.RecordBatch, global_step: int) -> None:
        """Append a batch in the record schema (its own step column is kept)."""
        df = pl.from_arrow(batch)
        assert isinstance(df, pl.DataFrame)
        pairs = df.select("key", "reduction").unique().iter_rows()
        for key, reduction in pairs:
            self._own_code(key, reduction)
        lookup = pl.DataFrame(
            {
                "key": [k for k, _ in self._own_table],
                "reduction": [r for _, r in self._own_table],
                "code": np.arange(len(self._own_table), dtype=np.float64),
            }
        )
        coded = df.join(lookup, on=["key", "reduction"], how="left", maintain_order="left")
        for (step,), part in coded.group_by("step", maintain_order=True):
            rows = part.select("value", "code", "timestamp").to_numpy().astype(np.float64)
            self.append(int(step), rows.tobytes(), len(rows), self._own_table)  # type: ignore[arg-type]

    def _own_code(self, key: str, reduction: str) -> int:
        code = self._own_codes.get((key, reduction))
        if code is None:
            code = self._own_codes[(key, reduction)] = len(self._own_table)
            self._own_table.append((key, reduction))
        return code

    async def finish(self) -> None:
        self.close(clean_shutdown=True)

    # -- journal -----------------------------------------------------------------------

    def append(self, step: int, rows: bytes, count: int, code_table: list[tuple[str, str]]) -> None:
        """Append ``count`` records, 3 float64 each (value, key code, timestamp), under ``step``.

        ``code_table[code]`` is (key, reduction). Durable against SIGKILL on return.
        """
        if count == 0:
            return
        if self._file is None:
            self._open_journal()
        frames = b""
        if len(code_table) > self._defs_written:
            defs = [(i, k, r) for i, (k, r) in enumerate(code_table) if i >= self._defs_written]
            frames = journal.key_frame(defs)
            self._defs_written = len(code_table)
        _write_all(self._file, frames + journal.record_frame(step, rows))
        if self.fsync:
            os.fsync(self._file.fileno())  # type: ignore[union-attr]
        self._rows += count
        if self._rows >= self.segment_records or time.time() - self._opened_at >= self.seal_interval:
            self._close_journal()

    def seal_ready(self) -> None:
        """Seal every closed journal (the writer thread calls this outside the drain lock)."""
        with self._seal_lock:
            while self._to_seal:
                self._seal(self._to_seal[0], clean_shutdown=False)
                self._to_seal.popleft()

    def close(self, *, clean_shutdown: bool) -> None:
        """Seal everything; with ``clean_shutdown`` record that the source ended cleanly."""
        if self._file is not None:
            self._close_journal()
        with self._seal_lock:
            if clean_shutdown and not self._to_seal:
                self._open_journal()  # an empty last segment that carries the marker
                self._close_journal()
            while self._to_seal:
                last = len(self._to_seal) == 1
                self._seal(self._to_seal[0], clean_shutdown=clean_shutdown and last)
                self._to_seal.popleft()

    def _first_free_seq(self) -> int:
        pattern = re.compile(rf"^{re.escape(self.stem)}\.(\d{{5,}})\.[a-z]+$")
        seqs = [int(m.group(1)) for p in self.run_dir.iterdir() if (m := pattern.match(p.name))]
        return max(seqs, default=-1) + 1

    def _open_journal(self) -> None:
        while True:
            path = self.run_dir / f"{self.stem}.{self._seq:05d}{journal.SUFFIX}"
            sealed = path.with_suffix("." + self.file_format)
            if sealed.exists():
                self._seq += 1
                continue
            try:
                # Unbuffered: every write reaches the kernel. Exclusive: a second process
                # with the same name never appends to this file.
                self._file = open(path, "xb", buffering=0)  # noqa: SIM115
            except FileExistsError:
                self._seq += 1
                continue
            break
        self._path = path
        self._rows = 0
        self._defs_written = 0
        self._opened_at = time.time()
        _write_all(self._file, journal.header(self.process, self.rank, self._opened_at))

    def _close_journal(self) -> None:
        assert self._file is not None and self._path is not None
        self._file.close()
        self._file = None
        self._to_seal.append(self._path)
        self._seq += 1

    def _seal(self, path: Path, *, clean_shutdown: bool) -> None:
        decoded = journal.decode(path.read_bytes())
        table = decoded.table if decoded.table is not None else journal.DECODED_SCHEMA.empty_table()
        final = path.with_suffix("." + self.file_format)
        tmp = path.with_name(f".{final.name}.tmp")
        now = time.time()
        meta = {
            "supersedes": path.name,
            "records": table.num_rows,
            "process": self.process,
            "rank": self.rank,
            "clean_shutdown": clean_shutdown,
            "timestamp": now,
            # Each key's reduction, the step and time ranges: a reader knows them without a pass.
            "keys": [list(pair) for pair in decoded.pairs],
            "steps": _bounds(table, "step"),
            "timestamps": _bounds(table, "timestamp"),
        }
        if self.file_format == "jsonl":  # a reader may then parse values as plain numbers
            meta["nonfinite"] = (
                table.num_rows - pc.sum(pc.is_finite(table["value"])).as_py() if table.num_rows else 0
            )
        if self.file_format == "parquet":
            with pq.ParquetWriter(
                tmp,
                table.schema,
                store_schema=False,
                compression="snappy",
                use_dictionary=_DICT_COLUMNS,
                write_statistics=_STATS_COLUMNS,
            ) as w:
                w.write_table(table, row_group_size=_ROW_GROUP_RECORDS)
                w.add_key_value_metadata({PARQUET_META_KEY: json.dumps(meta)})
        else:
            frame = pl.from_arrow(table.drop_columns(KEY_HASH))  # JSONL readers parse every field
            assert isinstance(frame, pl.DataFrame)
            body = to_jsonl(frame.with_columns(pl.col(pl.Categorical).cast(pl.String)))
            if clean_shutdown:
                end = {"process": self.process, "rank": self.rank, "timestamp": now}
                body += _event_line(SHUTDOWN_EVENT, end)
            meta["bytes"] = len(body)  # after the first line: a reader checks the size, not each line
            with open(tmp, "wb") as f:
                f.write(_event_line(SEGMENT_EVENT, meta))
                f.write(body)
        if self.fsync:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, final)
        path.unlink()


def _bounds(table: pa.Table, column: str) -> list[Any] | None:
    if table.num_rows == 0:
        return None
    bounds = pc.min_max(table[column]).as_py()
    return [bounds["min"], bounds["max"]]


def _event_line(event: str, meta: dict[str, Any]) -> bytes:
    return (json.dumps({"event": event, **meta}) + "\n").encode()


def _write_all(f: BinaryIO | None, data: bytes) -> None:
    assert f is not None
    view = memoryview(data)
    while view:
        written = f.write(view)
        view = view[written or 0 :]
