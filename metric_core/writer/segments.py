"""The raw-stream file writer: every record of one process, crash-safely, on local disk.

A source writes numbered segments, ``{stem}.r{rank}.{seq:05d}.*`` (see ``metric_core.format.schema``):

1. The open segment is a journal (``.journal``, see ``metric_core.format.journal``): each
   flush appends the collector's raw buffer with one ``write`` to an unbuffered file,
   so a returned ``flush()`` survives a SIGKILL and costs no per-record work.
2. When the journal holds ``segment_records`` records, is ``seal_interval`` seconds
   old, or the source shuts down, the writer thread seals it (``writer.seal``): decodes
   it, writes a hidden temporary Parquet (or JSONL) file, renames it into place
   atomically, and only then unlinks the journal. The sealed file names the journal it supersedes
   (Parquet footer metadata, or a first JSONL line ``{"event": "segment", ...}``), so
   a journal left behind by a kill between rename and unlink is never read twice.

When a write fails (a full disk, a deleted directory), nothing is lost that can be
kept: the records wait in a backlog in memory (at most ``max_unwritten``; past it the
oldest are dropped, and a ``D`` frame records how many once writing works again), the
journal is cut back to its last whole frame (or, if even that fails, left as it is and
a new segment started), and nothing is counted as written before the write returned.
A failed seal leaves the journal, which is read as it is, and is tried again later.

A kill at any instant therefore leaves readable sealed segments plus at most one
journal per source, whose last frame may be short (reported, and not covered by any
returned flush). ``shutdown()`` records a clean end (an ``S`` frame) and seals everything.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import os
import re
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from metric_core.atomic import create_exclusive
from metric_core.errors import ConfigError, DiskFullError, RunDirGoneError, WriteError, warn
from metric_core.format import journal, records
from metric_core.format import sample as sample_codec
from metric_core.format.life import pid_namespace, restart_count
from metric_core.format.schema import segment_stem
from metric_core.metric import BackendRole, Metric
from metric_core.writer.backends import LoggerBackend
from metric_core.writer.lock import SourceLock
from metric_core.writer.seal import ROW_GROUP_RECORDS, seal_journal

FILE_FORMATS = ("parquet", "jsonl")
# Records kept in memory while writing fails (24 bytes each: about 100 MB); past it the
# oldest are dropped and counted.
MAX_UNWRITTEN = 4_000_000
# A journal this large is sealed at the next flush whatever it holds (samples are large).
JOURNAL_BYTES = 256 << 20


class RawFileWriter(LoggerBackend):
    """Writes one process's raw records (PER_RANK_NO_REDUCE) to segment files.

    The collector calls ``enqueue`` with its coded buffer and ``write`` to make it durable;
    used on its own, the writer takes Arrow batches in the record schema through
    ``log_stream_batch``.
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
        max_unwritten: int = MAX_UNWRITTEN,
        flush_interval: float | None = None,
        block_records: int | None = None,
    ) -> None:
        super().__init__({"logging_mode": "per_rank_no_reduce"})
        if file_format not in FILE_FORMATS:
            raise ConfigError(
                f"file_format '{file_format}' is not supported: use one of {', '.join(FILE_FORMATS)}"
            )
        if segment_records < 1:
            raise ConfigError(f"segment_records must be at least 1, got {segment_records}")
        if max_unwritten < 1:
            raise ConfigError(f"max_unwritten must be at least 1 record, got {max_unwritten}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.process = process
        self.rank = rank
        self.file_format = file_format
        self.segment_records = segment_records
        self.seal_interval = seal_interval
        self.fsync = fsync
        self.max_unwritten = max_unwritten
        # the records of each unit a checksum covers: a Parquet row group, a JSONL block
        self.block_records = block_records or (
            ROW_GROUP_RECORDS if file_format == "parquet" else records.JSONL_BATCH_ROWS
        )
        self.stem = segment_stem(process, rank)
        # This writer is one attempt of its source: a job restarted from a checkpoint writes
        # a new attempt, which replaces the earlier ones' records from its first step on.
        self.attempt = secrets.token_hex(8)
        self.attempt_started = time.time()
        self.host = socket.gethostname()
        self.flush_interval = flush_interval
        self.restart = restart_count()
        self.pidns = pid_namespace()
        self.first_step: int | None = None  # the step of its first flush(step)
        self._flushed = False
        self._lock = SourceLock(self.run_dir, self.stem, process, rank)
        self._lock.acquire()
        try:
            self._seq = self._first_free_seq()
        except BaseException:
            self._lock.release()
            raise
        self._fd: int | None = None
        self._path: Path | None = None
        self._offset = 0  # bytes of whole frames in the open journal: nothing after is trusted
        self._opened_at = 0.0
        self._rows = 0
        self._defs_written = 0
        self._code_table: list[tuple[str, str]] = []
        # (step, rows, count, at) to write; rows None: a flush(step) that ended at ``at`` and
        # labels what came before; rows _Samples: samples (a P frame)
        self._backlog: collections.deque[tuple[int, bytes | _Samples | None, int, float]] = (
            collections.deque()
        )
        self._backlog_rows = 0
        self._dropped: dict[str, Any] | None = None  # dropped, not yet recorded in a journal
        self._new_drops: dict[str, Any] | None = None  # dropped, not yet told to the caller
        self._last_error = "writing failed"
        self._shutdown_at: float | None = None
        self._events: list[dict[str, Any]] = []  # end events to write (E frames)
        self._said_samples: list[str] = []  # refused samples, fields kept as repr: for the caller
        self._repr_keys: set[str] = set()
        self._heartbeat_due = False
        # The place the next heartbeat says, and the one this journal said last (a W frame).
        self._beat: tuple[tuple[str, str] | None, dict[str, tuple[str, str]] | None] = (None, None)
        self._where_written: tuple[str, str] | None = None
        self._header_due = False  # start(): the journal and its header, nothing else queued
        self._written_at = 0.0  # when a frame was last written (time.time())
        self._closed = False
        self._write_lock = threading.Lock()
        self._to_seal: collections.deque[Path] = collections.deque()
        self._seal_lock = threading.Lock()
        self._own_codes: dict[tuple[str, str], int] = {}
        self._own_table: list[tuple[str, str]] = []

    # -- LoggerBackend -----------------------------------------------------------------

    async def init(
        self,
        role: BackendRole,
        controller_logger_metadata: dict[str, Any] | None = None,
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
        key = batch.column("key").cast(pa.string()).dictionary_encode()
        red = batch.column("reduction").cast(pa.string()).dictionary_encode()
        keys, reds = key.dictionary.to_pylist(), red.dictionary.to_pylist()
        pairs = records.as_numpy(key.indices, np.int64) * len(reds) + records.as_numpy(red.indices, np.int64)
        present, where = np.unique(pairs, return_inverse=True)
        own = [self._own_code(keys[p // len(reds)], reds[p % len(reds)]) for p in present.tolist()]
        codes = np.asarray(own, dtype=np.float64)[where]
        values = records.as_numpy(batch.column("value"), np.float64)
        times = records.as_numpy(batch.column("timestamp"), np.float64)
        steps = records.as_numpy(batch.column("step"), np.int64)
        starts: list[int] = (
            np.flatnonzero(np.r_[True, steps[1:] != steps[:-1]]).tolist() if len(steps) else []
        )
        for lo, hi in zip(starts, [*starts[1:], len(steps)], strict=True):  # runs of one step, in order
            rows = np.column_stack([values[lo:hi], codes[lo:hi], times[lo:hi]])
            self.enqueue(int(steps[lo]), rows.tobytes(), hi - lo, self._own_table)
        self.write()

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
        """``enqueue`` then ``write``: durable against SIGKILL on return."""
        self.enqueue(step, rows, count, code_table)
        self.write()

    def enqueue(self, step: int, rows: bytes, count: int, code_table: list[tuple[str, str]]) -> None:
        """Queue ``count`` records, 3 float64 each (value, key code, timestamp), under ``step``.

        ``code_table[code]`` is (key, reduction). No I/O: ``write`` makes them durable.
        """
        with self._write_lock:
            self._code_table = code_table
            if count:
                self._backlog.append((step, rows, count, 0.0))
                self._backlog_rows += count
            while self._backlog_rows > self.max_unwritten:
                # Drop the oldest records, never a flush marker: it labels records written
                # before it, which would otherwise take the next marker's step.
                oldest = next((i for i, e in enumerate(self._backlog) if e[1] is not None), None)
                if oldest is None or oldest == len(self._backlog) - 1:
                    break  # keep the newest records
                step, dropped, n, _ = self._backlog[oldest]
                del self._backlog[oldest]
                self._drop(step, dropped, n)  # type: ignore[arg-type]

    def enqueue_samples(self, step: int, samples: list[tuple[str, float, dict[str, Any]]]) -> None:
        """Queue samples (key, timestamp, dict) under ``step``; ``write`` encodes and writes them."""
        with self._write_lock:
            # Counted with the records: toward max_unwritten, and toward a segment's size.
            self._backlog.append((step, _Samples(samples), len(samples), 0.0))
            self._backlog_rows += len(samples)

    def take_refused(self) -> list[str]:
        """What was said about samples since the last call: refused ones, fields kept as repr."""
        with self._write_lock:
            said, self._said_samples = self._said_samples, []
        return said

    def mark_flush(self, step: int) -> None:
        """Queue the end of ``flush(step)``: the records queued since the previous one belong to
        ``step``. Every flush is kept, with its time, also one that labels nothing: when steps
        ended is what tells a pause from a slow step."""
        with self._write_lock:
            if self.first_step is None:
                self.first_step = step
            self._flushed = True
            self._backlog.append((step, None, 0, time.time()))

    def end_event(self, event: dict[str, Any]) -> None:
        """Write an end event (an ``E`` frame, ``metric_core.format.life``) after what is queued, now."""
        with self._write_lock:
            self._events.append(event)
        self.write()

    def start(self) -> None:
        """Put the attempt on disk now: the journal, with its header (attempt, host, pid).
        Without it an attempt ended before the writer thread's first write (a SIGTERM right
        after ``init()``) would leave only its stack files, and no reader would know it. A
        write that fails here is kept for the next one, which retries and reports it."""
        with self._write_lock:
            self._header_due = True
        with contextlib.suppress(WriteError):
            self.write()

    def heartbeat(
        self, where: tuple[str, str] | None = None, threads: dict[str, tuple[str, str]] | None = None
    ) -> None:
        """Queue a sign of life for the next write: a ``W`` frame where the main thread's place
        changed since this journal last said it (or ``threads`` are given), else an ``H`` frame."""
        with self._write_lock:
            if self._closed:
                return
            self._beat = (where, threads)
            self._heartbeat_due = True

    def take_drops(self) -> dict[str, Any] | None:
        """What was dropped since the last call: {"records", "steps", "timestamps", "reason"}."""
        with self._write_lock:
            drops, self._new_drops = self._new_drops, None
        return drops

    def write(self) -> None:
        """Make everything queued durable, or raise a ``WriteError`` and keep it queued."""
        with self._write_lock:
            queued = self._backlog or self._dropped or self._events or self._heartbeat_due or self._header_due
            if not queued and self._shutdown_at is None:
                return
            if self._fd is None:
                self._open_journal()
            assert self._fd is not None and self._path is not None
            parts = []
            if self._offset == 0:
                parts.append(journal.header(self.process, self.rank, self._opened_at, self._attempt_fields()))
            if self._dropped is not None:
                parts.append(journal.event_frame(journal.DROPPED, self._dropped))
            defined = len(self._code_table)  # the training thread may intern more meanwhile
            if defined > self._defs_written:
                new = self._code_table[self._defs_written : defined]
                parts.append(
                    journal.key_frame([(self._defs_written + i, *pair) for i, pair in enumerate(new)])
                )
            parts.extend(self._frame(step, rows, at) for step, rows, _, at in self._backlog)
            parts.extend(journal.event_frame(journal.EVENT, event) for event in self._events)
            said = None
            if self._offset == 0:
                self._where_written = None  # a new journal says its place again
            if self._heartbeat_due:
                where, threads = self._beat
                if where is not None and (where != self._where_written or threads):
                    said = where
                    parts.append(journal.where_frame(time.time(), where, threads))
                else:
                    parts.append(journal.heartbeat_frame(time.time()))
            at_flush = bool(self._backlog) and self._backlog[-1][1] is None
            if self._shutdown_at is not None:
                parts.append(journal.event_frame(journal.SHUTDOWN, {"timestamp": self._shutdown_at}))
            data = b"".join(parts)
            try:
                if os.fstat(self._fd).st_nlink == 0:
                    self._abandon_journal(seal=False)
                    raise FileNotFoundError(errno.ENOENT, "the open segment was deleted", str(self._path))
                _write_all(self._fd, data)
                if self.fsync:
                    os.fsync(self._fd)
            except OSError as exc:
                self._cut_back()
                raise self._error(exc) from exc
            self._offset += len(data)
            self._defs_written = defined
            self._rows += self._backlog_rows
            self._backlog.clear()
            self._backlog_rows = 0
            self._dropped = None
            self._shutdown_at = None
            self._events.clear()
            self._heartbeat_due = False
            if said is not None:
                self._where_written = said
            self._header_due = False
            self._written_at = time.time()
            # A segment ends at a flush, so a flush frame never has to relabel records sealed
            # into an earlier segment (unless flushes stay away for twice a segment's records).
            # A writer that is never flushed (used on its own) rotates as soon as a segment is full.
            # (A journal of heartbeats alone never rotates: it would seal empty segments.)
            full = (
                self._rows >= self.segment_records
                or self._offset >= JOURNAL_BYTES
                or (self._rows > 0 and time.time() - self._opened_at >= self.seal_interval)
            )
            if (full and (at_flush or not self._flushed)) or self._rows >= 2 * self.segment_records:
                self._close_journal()

    def _frame(self, step: int, rows: bytes | _Samples | None, at: float) -> bytes:
        if rows is None:
            return journal.flush_frame(step, at)
        if isinstance(rows, bytes):
            return journal.record_frame(step, rows)
        if rows.encoded is None:  # once: a write that fails is tried again with the same bytes
            rows.encoded = self._encode_samples(rows.samples)
        return journal.sample_frame(step, rows.encoded)

    def _encode_samples(self, samples: list[tuple[str, float, dict[str, Any]]]) -> bytes:
        """The JSON of a P frame; refused samples, and fields kept as their repr (once a key),
        are said to the caller at the next flush (``take_refused``)."""
        encoded = []
        for key, at, sample in samples:
            unusual: list[str] = []
            try:
                text = sample_codec.encode(key, sample, unusual)
            except sample_codec.Refused as exc:
                self._said_samples.append(f"{self.process}: {exc}; it was not recorded")
                continue
            if unusual and key not in self._repr_keys:
                self._repr_keys.add(key)
                self._said_samples.append(
                    f"{self.process}: sample field(s) {', '.join(sorted(set(unusual)))} of '{key}' are not "
                    "str, number, bool, None, list or dict: kept as their repr (said once a key)"
                )
            encoded.append(f"[{json.dumps(key)}, {at!r}, {text}]")
        return ("[" + ", ".join(encoded) + "]").encode()

    def seal_ready(self) -> None:
        """Seal every closed journal (the writer thread calls this outside the drain lock)."""
        with self._seal_lock:
            while self._to_seal:
                path = self._to_seal[0]
                try:
                    seal_journal(path, self)
                except FileNotFoundError as exc:
                    self._to_seal.popleft()  # deleted under us: nothing left to seal
                    raise self._error(exc) from exc
                except OSError as exc:
                    raise self._error(exc) from exc  # kept: the journal is read as it is meanwhile
                self._to_seal.popleft()

    def close(self, *, clean_shutdown: bool) -> None:
        """Write what is queued and seal everything; with ``clean_shutdown`` record a clean end.

        Raises ``WriteError`` (records kept, the writer still open) when the records cannot
        be written. A journal that cannot be sealed is left as it is (it is read as it is)
        and a ``MetricLogWarning`` says so.
        """
        if self._closed:
            return
        if clean_shutdown and self._shutdown_at is None:
            self._shutdown_at = time.time()
        self.write()
        with self._write_lock:
            if self._fd is not None:
                self._close_journal()
            self._closed = True
        try:
            self.seal_ready()
        except WriteError as exc:
            warn(f"{exc}; the unsealed journal(s) hold every record and are read as they are")
        finally:
            self._lock.release()

    def release(self) -> None:
        """Give up the source's lock (after ``close``, or when what is queued cannot be written)."""
        self._lock.release()

    # -- inside the write lock ---------------------------------------------------------

    def _drop(self, step: int, rows: bytes | _Samples, count: int) -> None:
        self._backlog_rows -= count
        if isinstance(rows, _Samples):
            times = np.array([at for _, at, _ in rows.samples])
        else:
            times = np.frombuffer(rows, dtype=np.float64)[2::3]
        drop = {
            "records": count,
            "steps": [step, step],
            "timestamps": [float(times.min()), float(times.max())],
            "reason": self._last_error,
        }
        self._dropped = _merge_drops(self._dropped, drop)
        self._new_drops = _merge_drops(self._new_drops, drop)

    def _attempt_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "attempt": self.attempt,
            "attempt_started": self.attempt_started,
            "host": self.host,
            "pid": os.getpid(),
            "pidns": self.pidns,
            "flush_interval": self.flush_interval,
            "restart": self.restart,
        }
        if self.first_step is not None:
            fields["attempt_first_step"] = self.first_step
        return fields

    def _first_free_seq(self) -> int:
        pattern = re.compile(rf"^{re.escape(self.stem)}\.(\d{{5,}})\.[a-z]+$")
        seqs = [int(m.group(1)) for p in self.run_dir.iterdir() if (m := pattern.match(p.name))]
        return max(seqs, default=-1) + 1

    def _open_journal(self) -> None:
        while True:
            path = self.run_dir / f"{self.stem}.{self._seq:05d}{journal.SUFFIX}"
            sealed = path.with_suffix("." + self.file_format)
            try:
                if sealed.exists():
                    self._seq += 1
                    continue
                # Unbuffered writes straight to the kernel. Exclusive: a second process with
                # the same name never appends to this file, and a planted symlink is refused.
                self._fd = create_exclusive(path)
            except FileExistsError:
                self._seq += 1
                continue
            except OSError as exc:
                raise self._error(exc) from exc
            break
        self._path = path
        self._offset = 0
        self._rows = 0
        self._defs_written = 0
        self._opened_at = time.time()

    def _cut_back(self) -> None:
        """After a failed write: truncate to the last whole frame, or leave the journal for good."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, self._offset)
            os.lseek(self._fd, self._offset, os.SEEK_SET)
        except OSError:
            # The tail may hold part of a frame: append nothing after it, start a new segment.
            self._abandon_journal(seal=True)

    def _abandon_journal(self, *, seal: bool) -> None:
        assert self._fd is not None and self._path is not None
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._fd = None
        if seal and self._offset:
            self._to_seal.append(self._path)
        elif seal:
            with contextlib.suppress(OSError):
                self._path.unlink()
        self._seq += 1

    def _close_journal(self) -> None:
        assert self._fd is not None and self._path is not None
        os.close(self._fd)
        self._fd = None
        self._to_seal.append(self._path)
        self._seq += 1

    def _error(self, exc: OSError) -> WriteError:
        """The WriteError subclass for an OSError, with what to do and what was kept."""
        where = exc.filename or self._path or self.run_dir
        kept = f"{self._backlog_rows:,} record(s) are kept in memory for the next flush"
        if self._backlog_rows >= self.max_unwritten:
            kept += f" (at most {self.max_unwritten:,}: older ones are dropped and counted)"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            self._last_error = "disk full"
            return DiskFullError(
                f"disk full while writing {where} ({exc.strerror}): {kept}; free space on the "
                f"file system of {self.run_dir}",
                path=str(where),
                kept=self._backlog_rows,
            )
        if exc.errno in (errno.ENOENT, errno.ESTALE) or not self.run_dir.is_dir():
            self._last_error = "run directory deleted"
            return RunDirGoneError(
                f"{where} was deleted while {self.process} was writing to it "
                f"(was the run directory {self.run_dir} removed?): {kept}; recreate the "
                "directory to resume writing",
                path=str(where),
                kept=self._backlog_rows,
            )
        self._last_error = exc.strerror or type(exc).__name__
        return WriteError(
            f"could not write {where}: {exc.strerror or exc}: {kept}",
            path=str(where),
            kept=self._backlog_rows,
        )


class _Samples:
    """Samples queued for a P frame, and its bytes once encoded."""

    __slots__ = ("encoded", "samples")

    def __init__(self, samples: list[tuple[str, float, dict[str, Any]]]) -> None:
        self.samples = samples
        self.encoded: bytes | None = None


def _merge_drops(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    if old is None:
        return new
    return {
        "records": old["records"] + new["records"],
        "steps": [min(old["steps"][0], new["steps"][0]), max(old["steps"][1], new["steps"][1])],
        "timestamps": [
            min(old["timestamps"][0], new["timestamps"][0]),
            max(old["timestamps"][1], new["timestamps"][1]),
        ],
        "reason": new["reason"],
    }


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
