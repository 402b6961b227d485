"""MetricCollector: one process's metrics, recorded cheaply, written raw, reduced per step.

Data flow::

    record_metric(key, value)            training thread: one array append, no I/O
        -> MetricCollector._buffer       (value, key code, timestamp) as 3 doubles
        -> MetricCollector._drain()      writer thread every flush_interval, and flush()
            -> RawFileWriter             raw records to segment files (writer.segments)
            -> Backends.stream           PER_RANK_NO_REDUCE live backends (writer.backends)
            -> StepReducer               reduced at flush(step) for PER_RANK_REDUCE
                                         backends and return_state=True (writer.steps)

The hot path builds no object per record beyond a 3-tuple: the key and its reduction
are interned to an integer code once, and the buffer is a flat ``array('d')``. One
``extend`` of a 3-tuple of floats is a single C call under the GIL, so recording from
several threads never tears a record.

Under errors (see ``metric_core.writer.segments`` for the files):

* A ``flush()`` that returns means every record recorded before it is durable.
* A ``flush()`` that cannot make its records durable raises a ``WriteError`` subclass
  (``DiskFullError``, ``RunDirGoneError``) after ending its step as usual; the records
  stay in memory and the next flush writes them. With ``on_flush_error="warn"`` it
  warns (``MetricLogWarning``) and returns instead, so a long job survives a full disk.
* At most ``max_unwritten`` records wait in memory; past that the oldest are dropped,
  the next flush raises (or warns) ``RecordsDroppedError``, and the journal records the
  gap (how many, which steps) for ``inspect``.
* The writer thread survives every error and retries with backoff (at most 8 flush
  intervals, and 30 s, apart); it never raises into the training thread. The next flush
  reports what it hit.
"""

from __future__ import annotations

import array
import asyncio
import atexit
import contextlib
import fnmatch
import operator
import os
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import pyarrow as pa

from metric_core.errors import (
    CollectorClosedError,
    ConfigError,
    NonFiniteError,
    RecordsDroppedError,
    WriteError,
    warn,
)
from metric_core.format import records
from metric_core.format.life import STALL_MIN_S
from metric_core.format.schema import MAX_KEY_BYTES, default_process_name
from metric_core.metric import Metric, Reduce, SampleAccumulator
from metric_core.writer import ends, where
from metric_core.writer.backends import Backends, LoggerBackend
from metric_core.writer.segments import MAX_UNWRITTEN, RawFileWriter
from metric_core.writer.steps import StepReducer

_now = time.time
# While writing fails, the writer thread retries at most this many flush intervals (and
# 30 s) apart, so records are durable soon after the disk has room again.
_MAX_BACKOFF_INTERVALS = 8
_MAX_BACKOFF = 30.0
ON_FLUSH_ERROR = ("raise", "warn")
ON_NONFINITE = ("record", "raise")
# A first flush(k) this far beyond the initial step, without init(step=...): a restart.
_RESTART_JUMP = 100
# Seconds without a returned flush() after which every thread's stack is saved (writer.ends).
HANG_DUMP_AFTER = 300.0
HANG_DUMP_ENV = "METRICLOG_HANG_DUMP_AFTER"


def _hang_dump_after(given: float | None) -> float | None:
    """``hang_dump_after``, unless the environment overrides it; 0 or None: never."""
    raw = os.environ.get(HANG_DUMP_ENV, "").strip()
    if raw:
        try:
            given = float(raw)
        except ValueError:
            raise ConfigError(
                f"environment variable {HANG_DUMP_ENV}={raw!r} is not a number of seconds"
            ) from None
    if given is not None and given < 0:
        raise ConfigError(f"hang_dump_after must be seconds >= 0 (0: never), got {given}")
    return given or None


class MetricCollector:
    """Collects one process's metrics, writes them raw, and reduces them per step.

    Most scripts use the module-level ``init``/``record_metric``/``flush``/``shutdown``,
    which drive the one collector of the process.

    >>> import tempfile
    >>> c = MetricCollector(tempfile.mkdtemp(), rank=1, process_name="TrainActor_r1")
    >>> c.record("loss", 0.5); c.record("loss", 1.5)
    >>> c.flush(0, return_state=True)
    {'loss': {'reduction_type': 'mean', 'sum': 2.0, 'count': 2}}
    >>> c.step
    1
    >>> c.shutdown()
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        rank: int = 0,
        process_name: str | None = None,
        file_format: str = "parquet",
        step: int | None = None,
        backends: dict[str, dict[str, Any] | LoggerBackend] | None = None,
        flush_interval: float = 1.0,
        segment_records: int = 1_000_000,
        seal_interval: float = 600.0,
        fsync: bool = False,
        on_flush_error: str = "raise",
        max_unwritten: int = MAX_UNWRITTEN,
        catch_signals: bool = True,
        hang_dump_after: float | None = HANG_DUMP_AFTER,
        on_nonfinite: str = "record",
        nonfinite_keys: str | list[str] | tuple[str, ...] = "*",
    ) -> None:
        if flush_interval <= 0:
            raise ConfigError(f"flush_interval must be positive seconds, got {flush_interval}")
        if on_flush_error not in ON_FLUSH_ERROR:
            raise ConfigError(
                f"on_flush_error must be one of {', '.join(ON_FLUSH_ERROR)}, got {on_flush_error!r}"
            )
        self.on_flush_error = on_flush_error
        if "://" in os.fspath(run_dir):
            raise ConfigError(
                f"run_dir {os.fspath(run_dir)!r} is a URL: the writer appends to files on a local or network "
                "filesystem, which object storage is not. Write to a local folder and copy it to the bucket "
                "(e.g. aws s3 sync), during or after the job: metriclog reads it there"
            )
        self.run_dir = Path(run_dir)
        self.rank = int(rank)
        self.process_name = process_name or default_process_name(self.rank)
        self.flush_interval = flush_interval
        self._step = 0 if step is None else _step_of(step, "init(step=...)")
        self._step_given = step is not None
        self._flushed = False
        self._writer = RawFileWriter(
            run_dir,
            process=self.process_name,
            rank=self.rank,
            file_format=file_format,
            segment_records=segment_records,
            seal_interval=seal_interval,
            fsync=fsync,
            max_unwritten=max_unwritten,
            flush_interval=flush_interval,
        )
        try:
            self._backends = Backends(backends or {}, self.process_name)
        except BaseException:
            self._writer.close(clean_shutdown=False)  # nothing written yet: frees the source's lock
            raise

        self._buffer = array.array("d")
        self._extend = self._buffer.extend
        if on_nonfinite not in ON_NONFINITE:
            raise ConfigError(f"on_nonfinite must be one of {', '.join(ON_NONFINITE)}, got {on_nonfinite!r}")
        if on_nonfinite == "raise":  # off, the hot path is the array's own extend: no cost
            patterns = (nonfinite_keys,) if isinstance(nonfinite_keys, str) else tuple(nonfinite_keys)
            self._nonfinite_keys = patterns
            self._nonfinite_code: dict[int, bool] = {}
            self._extend = self._extend_checked  # type: ignore[assignment]
        # Samples (Reduce.SAMPLE) since the last drain: (key, timestamp, shallow copy of the dict).
        self._samples: list[tuple[str, float, dict[str, Any]]] = []
        # The step's samples as torchforge accumulates them (SampleAccumulator: its top and
        # bottom by reward, a key each), for PER_RANK_REDUCE backends and flush(return_state).
        self._step_samples: dict[str, SampleAccumulator] = {}
        self._codes: dict[str, tuple[Any, int]] = {}
        self._code_of: dict[tuple[str, Reduce], int] = {}
        self._code_table: list[tuple[str, str]] = []  # code -> (key, reduction)
        self._reductions_seen = 0  # code table entries looked at by _second_reductions
        self._first_reduction: dict[str, str] = {}
        self._said_reductions: set[str] = set()
        self._intern_lock = threading.Lock()

        self._drain_lock = threading.Lock()
        self._steps = StepReducer(self._code_table, rank=self.rank, process=self.process_name)
        self._background_error: Exception | None = None
        self._closed = False
        # Started by itself, for a process that records without init (metric_core.torchforge
        # with METRICLOG_DIR): its end at interpreter exit is the expected one.
        self.adopted = False
        # How the attempt ends, and where it hangs (writer.ends): the stack files it registered.
        self._stack_files: dict[str, Any] = {}
        self._last_flush = time.monotonic()  # when the latest flush() returned (or init)
        self._threads_said: float | None = None  # the silence (its _last_flush) whose threads were said
        self._beat_flush = self._last_flush  # the flush the previous wake saw last
        self._unflushed = False  # records drained to the writer since the latest flush()
        self._hang = ends.HangWatch(self, _hang_dump_after(hang_dump_after))
        # The attempt is on disk before init() returns, so a kill before any write still has
        # a journal to tell it (with its stack files, how it ended).
        self._writer.start()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._background_flush, name=f"metriclog-writer-{self.process_name}", daemon=True
        )
        self._thread.start()
        _open.add(self)
        if catch_signals:
            ends.install(self)

    @property
    def step(self) -> int:
        """The step stamped on records recorded now."""
        return self._step

    # -- hot path ----------------------------------------------------------------------

    def record(self, key: str, value: Any, reduction: Reduce = Reduce.MEAN) -> None:
        """Record one value. O(1), no I/O: the writer thread serializes it later."""
        entry = self._codes.get(key)
        if entry is not None and entry[0] is reduction:
            code = entry[1]
        elif reduction == "sample":
            self.record_sample(key, value)
            return
        else:
            code = self._intern(key, reduction)
        cls = value.__class__
        if (
            cls is float
            or (cls is int and -(2**53) <= value <= 2**53)
            or cls in EXACT_TYPES
            or (cls in WIDE_INTEGERS and -(2**53) <= value <= 2**53)
        ):
            self._extend((value, code, _now()))
        else:  # what the array would take but round (an int past 2**53), or not take
            self._extend((_as_float(key, value), code, _now()))

    def push(self, metric: Metric) -> None:
        """Record a Metric (torchforge's push); its own timestamp is kept."""
        key, value, reduction = metric.key, metric.value, metric.reduction
        at = metric.timestamp if metric.timestamp is not None else _now()
        entry = self._codes.get(key)
        if entry is not None and entry[0] is reduction:
            code = entry[1]
        elif reduction == "sample":
            self.record_sample(key, value, at)
            return
        else:
            code = self._intern(key, reduction)
        cls = value.__class__
        if (
            cls is float
            or (cls is int and -(2**53) <= value <= 2**53)
            or cls in EXACT_TYPES
            or (cls in WIDE_INTEGERS and -(2**53) <= value <= 2**53)
        ):
            self._extend((value, code, at))
        else:
            self._extend((_as_float(key, value), code, at))

    def record_sample(self, key: str, sample: dict[str, Any], timestamp: float | None = None) -> None:
        """Record a whole sample (``Reduce.SAMPLE``): a shallow copy of the dict, and no more
        on this thread; the writer encodes it (``metric_core.format.sample``). Mutating a nested
        field of ``sample`` before the next flush may change what is written."""
        if not isinstance(sample, dict):
            raise TypeError(
                f"metric '{key}': a sample (Reduce.SAMPLE) is a dict of fields, not {type(sample).__name__}"
            )
        _check_key(key)
        self._samples.append((key, timestamp if timestamp is not None else _now(), dict(sample)))

    def _extend_checked(self, record: tuple[Any, int, float]) -> None:
        """The buffer's extend under ``on_nonfinite="raise"``: the record is buffered, then a
        NaN or an infinity of a watched key raises ``NonFiniteError``."""
        self._buffer.extend(record)
        value, code = record[0], record[1]
        if value - value == 0:  # finite (NaN or an infinity minus itself is NaN)
            return
        watched = self._nonfinite_code.get(code)
        key = self._code_table[code][0]
        if watched is None:
            watched = self._nonfinite_code[code] = any(
                fnmatch.fnmatchcase(key, p) for p in self._nonfinite_keys
            )
        if watched:
            raise NonFiniteError(key, float(value), self._step)

    def _intern(self, key: str, reduction: Any) -> int:
        _check_key(key)
        try:
            red = Reduce(reduction)
        except ValueError:
            allowed = ", ".join(r.value for r in Reduce)
            raise ValueError(f"metric '{key}': reduction {reduction!r} is not one of {allowed}") from None
        if red is Reduce.SAMPLE:  # callers take samples to record_sample first
            raise ValueError(f"metric '{key}': a sample is recorded with record_sample")
        with self._intern_lock:
            code = self._code_of.get((key, red))
            if code is None:
                code = len(self._code_table)
                self._code_table.append((key, red.value))
                self._code_of[(key, red)] = code
            self._codes[key] = (reduction, code)
        return code

    # -- writing ---------------------------------------------------------------------

    def _drain(self, flush: int | None = None) -> None:
        """Move everything recorded so far to the writer's queue and the stream backends;
        with ``flush``, then queue the end of ``flush(flush)`` (in the same lock, so the
        writer thread cannot slip records in between).

        No file I/O: ``self._writer.write()`` makes the queue durable.
        """
        with self._drain_lock:
            self._drain_locked(flush)

    def _drain_locked(self, flush: int | None) -> None:
        """``_drain``, its caller holding ``self._drain_lock``."""
        n = len(self._buffer)
        self._unflushed = (self._unflushed or n > 0) and flush is None
        if n:
            chunk = self._buffer[:n]
            del self._buffer[:n]
            self._writer.enqueue(self._step, chunk.tobytes(), n // 3, self._code_table)
            if self._backends.stream:
                rows = np.frombuffer(chunk, dtype=np.float64).reshape(-1, 3)
                self._backends.log_stream(self._record_table(rows).to_batches()[0], self._step)
            self._steps.add(chunk)
        taken = len(self._samples)
        if taken:  # a slice and a del: a sample appended meanwhile stays for the next drain
            samples = self._samples[:taken]
            del self._samples[:taken]
            if flush is None:
                self._unflushed = True
            self._writer.enqueue_samples(self._step, samples)
            self._accumulate_samples(samples)
        if flush is not None:
            self._writer.mark_flush(flush)

    def _accumulate_samples(self, samples: list[tuple[str, float, dict[str, Any]]]) -> None:
        """Drained samples (under the drain lock): into the step's accumulators, as torchforge
        always accumulates them; every one of them to PER_RANK_NO_REDUCE backends, as
        torchforge streams them (a Metric a key, its value the list drained)."""
        accumulators = self._step_samples
        by_key: dict[str, list[dict[str, Any]]] = {}
        for key, _, sample in samples:
            acc = accumulators.get(key)
            if acc is None:
                acc = accumulators[key] = SampleAccumulator(Reduce.SAMPLE)
            acc.append(sample)
            by_key.setdefault(key, []).append(sample)
        if self._backends.stream_samples:
            streamed = [
                Metric(key, rows, Reduce.SAMPLE, step=self._step, rank=self.rank, process=self.process_name)
                for key, rows in by_key.items()
            ]
            self._backends.log_stream_samples(streamed, self._step)

    def _record_table(self, rows: np.ndarray) -> pa.Table:
        return records.build_table(
            codes=rows[:, 1].astype(np.int64),
            values=rows[:, 0],
            timestamps=rows[:, 2],
            steps=np.full(len(rows), self._step, dtype=np.int64),
            key_names=[k for k, _ in self._code_table],
            reductions=[r for _, r in self._code_table],
            rank=self.rank,
            process=self.process_name,
        )

    def _background_flush(self) -> None:
        """Every ``flush_interval``: queue the buffer, write and seal; on errors, back off."""
        failures, retry_at = 0, 0.0
        while not self._stop.wait(self.flush_interval):
            try:
                self._drain()  # always: the queue, not the buffer, enforces the memory bound
                if time.monotonic() < retry_at:
                    continue
                self._beat()
                self._writer.write()
                self._writer.seal_ready()
                self._hang.check(self._last_flush)
                failures = 0
            except Exception as exc:
                self._background_error = exc
                failures += 1
                cap = min(self.flush_interval * _MAX_BACKOFF_INTERVALS, _MAX_BACKOFF)
                backoff = min(self.flush_interval * 2.0 ** min(failures, 16), cap)
                retry_at = time.monotonic() + max(backoff, self.flush_interval)

    def _beat(self) -> None:
        """Queue this wake's heartbeat: where the main thread is, when no ``flush()`` returned
        since the previous wake (a rank that steps faster than its flush interval is not
        looked at: it is where its steps are, and a look costs its thread the GIL), and once
        the source has been silent ``STALL_MIN_S``, every thread (once a silence)."""
        silent_since = self._last_flush
        stepping, self._beat_flush = silent_since != self._beat_flush, silent_since
        if stepping:
            return  # its flush frames say it lives; an H frame would say it is where it was

        threads = None
        if time.monotonic() - silent_since >= STALL_MIN_S and self._threads_said != silent_since:
            self._threads_said = silent_since
            threads = where.all_places()
        self._writer.heartbeat(where.main_place(), threads)

    def _report(self, error: WriteError | None) -> None:
        """Raise (or warn about) what writing hit since the previous flush."""
        for said in self._writer.take_refused():  # samples refused, or fields kept as repr
            warn(said)
        background, self._background_error = self._background_error, None
        # Drops are said once writing works again: then the gap is recorded, and its size known.
        drops = self._writer.take_drops() if error is None else None
        if drops is not None:
            steps = drops["steps"]
            error = RecordsDroppedError(
                f"{drops['records']:,} record(s) of {self.process_name} from steps {steps[0]}-{steps[1]} "
                f"were dropped: writing failed ({drops['reason']}) while more than "
                f"{self._writer.max_unwritten:,} records waited in memory. The gap is recorded "
                "in the run directory (metriclog inspect shows it); writing works again.",
                path=str(self.run_dir),
            )
        if error is not None:
            if self.on_flush_error == "raise":
                raise error
            warn(str(error))
        elif background is not None:
            warn(
                f"writing metrics of {self.process_name} failed in the background ({background}); "
                "it works again and every record since is durable"
            )

    # -- steps -------------------------------------------------------------------------

    def _end_step(
        self, step: int, need_states: bool
    ) -> tuple[list[Metric], list[Metric], dict[str, dict[str, Any]]]:
        """End step ``step`` in memory, no file I/O: in one hold of the drain lock, queue
        every record since the previous flush with the end of ``step`` (they belong to
        ``step``, as the live logger labels them, also those the writer thread wrote
        already: the flush frame relabels them), make the current step ``step + 1``, and
        take the step's reductions and samples. What is recorded after this, by another
        thread or asyncio task while the flush writes, is the next step's, as in
        torchforge, whose flush takes the step's values when it is called; the background
        drain cannot stamp it ``step`` after the step's end."""
        if self._closed:
            raise CollectorClosedError(f"flush() after shutdown() of {self.process_name}")
        with self._drain_lock:
            self._drain_locked(step)
            self._step = step + 1
            if need_states or self._steps.folding:
                metrics, states = self._steps.end(step)
            else:
                self._steps.discard()
                metrics, states = [], {}
            accumulated, self._step_samples = self._step_samples, {}
        samples = []
        for key, acc in accumulated.items():
            samples.append(
                Metric(
                    key, acc.get_value(), Reduce.SAMPLE, step=step, rank=self.rank, process=self.process_name
                )
            )
            if need_states:  # a key recorded as a number too keeps that state under its name
                states[f"{key}_samples" if key in states else key] = acc.get_state()
        return metrics, samples, states

    def _write_flushed(self) -> WriteError | None:
        """Make the queue durable after ``_end_step``; its error, which the step survives
        (the records stay queued)."""
        error = None
        try:
            self._writer.write()
        except WriteError as exc:
            error = exc
        self._last_flush = time.monotonic()
        return error

    def flush(
        self, step: int | None = None, *, return_state: bool = False
    ) -> dict[str, dict[str, Any]] | None:
        """End step ``step`` (default: the current one), as docs/durability.md says.

        Everything recorded since the previous flush is made durable, reduced per key
        for PER_RANK_REDUCE backends under ``step``, and the current step becomes
        ``step + 1``. Every record since the previous flush is stamped ``step`` on disk
        too (records no flush covers keep the step current when they were recorded). With
        ``return_state`` the accumulator states are returned for a global reduction
        (see ``reduce_metrics_states``); a samples key's is its ``SampleAccumulator``'s
        (the step's bottom and top by reward), as torchforge returns it.
        """
        step = self._step if step is None else self._flush_step(step)
        self._first_flush_check(step)
        self._second_reductions()
        metrics, samples, states = self._end_step(step, bool(self._backends.reduce) or return_state)
        error = self._write_flushed()
        if metrics:
            self._backends.log_reduced(metrics, step)
        if samples:
            self._backends.log_samples(samples, step)
        self._report(error)
        return states if return_state else None

    def _flush_step(self, step: Any) -> int:
        """``step`` checked before anything changes (a refused call leaves the source as it
        was): an integer from 0 to 2**63-1, at or above the previous flush's in this attempt."""
        value = _step_of(step, "flush(step)")
        if self._flushed and value < self._step - 1:
            raise ValueError(
                f"flush(step): step {value} is below the previous flush's step {self._step - 1}; steps of "
                "an attempt never go back (a restart from a checkpoint is a new init(..., step=...))"
            )
        return value

    def _second_reductions(self) -> None:
        """Say once per key, at a flush (never in ``record``), that a key was recorded under
        a second reduction: a reader keeps its first reduction's records (docs/reading.md)."""
        table = self._code_table
        for key, reduction in table[self._reductions_seen : len(table)]:
            first = self._first_reduction.setdefault(key, reduction)
            if first != reduction and key not in self._said_reductions:
                self._said_reductions.add(key)
                warn(
                    f"{self.process_name}: key '{key}' was recorded with reduction '{first}', and now "
                    f"with '{reduction}': a reader keeps one reduction a key, that of its first record "
                    f"in the run, and skips the records under another, saying so. Give each reduction its "
                    f"own key, or reduce them all offline with --reduce '{key}=STAT'"
                )
        self._reductions_seen = len(table)

    def _first_flush_check(self, step: int) -> None:
        """A restart that did not give init() its step: say that its first records were labelled late."""
        if not self._flushed and not self._step_given and step - self._step >= _RESTART_JUMP:
            warn(
                f"{self.process_name}: the first flush is flush({step}), but init() was not given a step, "
                f"so this looks like a restart from a checkpoint: the records so far were stamped step "
                f"{self._step} and are labelled {step}, and this attempt replaces the run's earlier "
                f"records of {self.process_name} from step {step} on. Pass init(..., step={step}) when "
                "restarting, to say so"
            )
        self._flushed = True

    async def aflush(
        self, step: int | None = None, *, return_state: bool = False
    ) -> dict[str, dict[str, Any]] | None:
        """``flush`` for asyncio code: the step ends at the call, its file I/O runs in a worker
        thread."""
        step = self._step if step is None else self._flush_step(step)
        self._first_flush_check(step)
        self._second_reductions()
        need = bool(self._backends.reduce) or return_state
        metrics, samples, states = self._end_step(step, need)  # the step ends at the call
        error = await asyncio.to_thread(self._write_flushed)
        if metrics:
            await self._backends.alog_reduced(metrics, step)
        if samples:
            await self._backends.alog_samples(samples, step)
        self._report(error)
        return states if return_state else None

    def shutdown(self) -> None:
        """Flush everything, close the backends and record a clean end of this source.

        When the records cannot be written, raises the flush's ``WriteError`` and stays
        open, so ``shutdown()`` can be called again (with ``on_flush_error="warn"`` it
        warns, and what could not be written is lost).
        """
        if self._closed:
            return
        self._stop.set()
        self._thread.join()
        if (
            self._buffer or self._samples or self._unflushed
        ):  # a last flush labels them; none is a step of its own
            self.flush(self._step)
        failing = sys.exc_info()[1]  # shutdown() in a `finally:` or `except:`: the attempt failed
        if failing is not None and not isinstance(failing, (SystemExit, GeneratorExit)):
            self._writer.end_event({**ends.end_of(failing), "in_shutdown": True, "timestamp": time.time()})
        try:
            self._writer.close(clean_shutdown=True)
        except WriteError as exc:
            if self.on_flush_error == "raise":
                raise
            warn(f"{exc}; they are lost at exit")
            self._writer.release()
        self._closed = True
        ends.uninstall(self)
        self._backends.finish()

    @property
    def closed(self) -> bool:
        """Whether ``shutdown()`` or ``abort()`` ended this collector."""
        return self._closed

    def abort(self) -> None:
        """End without recording a clean shutdown: write and seal what was recorded.

        For a job that knows it failed (an exception handler), so ``inspect`` does not
        call the source finished; metric_core also does this at interpreter exit for a
        collector that was not shut down. Either way the attempt's end is ``exit`` (ended
        without ``shutdown()``). Errors are not raised: the records that could not be
        written stay in the journal or are lost with the process.
        """
        if self._closed:
            return
        self._stop.set()
        self._thread.join(timeout=5)
        self._closed = True
        with contextlib.suppress(Exception):
            self._drain()
            self._writer.end_event(
                {"kind": "exit", "timestamp": time.time(), **({"adopted": True} if self.adopted else {})}
            )
            self._writer.close(clean_shutdown=False)
        self._writer.release()
        ends.uninstall(self)


# Collectors not yet ended: at interpreter exit each is aborted, so what it recorded since its
# last flush is written (and marked as not cleanly ended), whoever created it.
_open: weakref.WeakSet[MetricCollector] = weakref.WeakSet()


@atexit.register
def _abort_open_collectors() -> None:
    for collector in list(_open):
        collector.abort()


# A forked child (a data-loader worker) shares its parent's files: its exit must not end
# (and seal) the parent's attempt.
os.register_at_fork(after_in_child=_open.clear)


def _check_key(key: Any) -> None:
    if not isinstance(key, str) or not key:
        raise TypeError(f"metric key must be a non-empty string, got {key!r}")
    if len(key) > MAX_KEY_BYTES // 4 and len(key.encode()) > MAX_KEY_BYTES:  # a reader would refuse its line
        raise ValueError(
            f"metric key '{key[:40]}...' is {len(key.encode()):,} bytes: a key holds at most "
            f"{MAX_KEY_BYTES:,} bytes (UTF-8)"
        )


STEP_MAX = 2**63 - 1  # a step is an int64 on disk


def _step_of(step: Any, where: str) -> int:
    """A step as an int: an ``int`` or a type with ``__index__`` (numpy integers, 0-d integer
    tensors), not a bool or a float, from 0 to ``STEP_MAX``; else a ``ValueError`` naming it."""
    if isinstance(step, bool) or not hasattr(type(step), "__index__"):
        raise ValueError(
            f"{where}: the step must be an integer (an int, a numpy integer or a 0-d integer tensor), "
            f"not {step!r} of type {type(step).__name__}"
        )
    value = operator.index(step)
    if not 0 <= value <= STEP_MAX:
        raise ValueError(f"{where}: step {value} is out of range: steps run from 0 to 2**63-1")
    return value


def _as_float(key: str, value: Any) -> Any:
    """The slow path of record(): every value but a float, an int float64 holds exactly and
    the ``EXACT_TYPES``. What it returns, the buffer's ``array('d')`` takes as it is; an
    integer past 2**53 in magnitude is refused, never rounded (docs/format.md: exact or refused)."""
    if isinstance(value, _INTEGERS):  # an int past 2**53, numpy's int64 and uint64, IntEnum
        exact = int(value)
        return exact if -(2**53) <= exact <= 2**53 else _refused(key, exact)
    if isinstance(value, _FLOATS):  # float subclasses, numpy's other floats: the array converts them
        return value
    item = getattr(value, "item", None)
    if item is not None:  # 0-d arrays and tensors (numpy's, torch's)
        try:
            inner = item()
        except (ValueError, RuntimeError, TypeError):
            inner = None
        if isinstance(inner, float):
            return inner
        if isinstance(inner, int):
            return inner if -(2**53) <= inner <= 2**53 else _refused(key, inner)
    elif hasattr(type(value), "__index__"):  # another type of integer
        exact = operator.index(value)
        return exact if -(2**53) <= exact <= 2**53 else _refused(key, exact)
    elif hasattr(type(value), "__float__"):  # Decimal, Fraction: a number float64 may round
        try:
            return float(value)
        except (TypeError, ValueError, OverflowError):
            pass
    raise TypeError(
        f"metric '{key}': value {value!r} of type {type(value).__name__} is not a number; "
        "pass a Python number, a bool, a numpy scalar or a 0-d tensor"
    )


# The types of which float64 holds every value exactly: the array takes them as they are.
# Ints past 2**53 (Python's, numpy's int64 and uint64) are checked one by one.
EXACT_TYPES = frozenset(
    {
        bool,
        np.bool_,
        np.float64,
        np.float32,
        np.float16,
        np.int8,
        np.int16,
        np.int32,
        np.uint8,
        np.uint16,
        np.uint32,
    }
)
WIDE_INTEGERS = frozenset({np.int64, np.uint64})  # compared with 2**53 in place: no call
_INTEGERS = (int, np.integer)
_FLOATS = (float, np.floating)


def _refused(key: str, value: int) -> NoReturn:
    """The ValueError of an integer past 2**53 in magnitude: float64 would round it."""
    text = str(value)
    shown = text if len(text) <= 24 else f"{text[:12]}...({len(text)} digits)"
    try:
        rounded = float(value)
    except OverflowError:
        raise ValueError(
            f"metric '{key}': value {shown} is too large for a float64 (at most about 1.8e308)"
        ) from None
    raise ValueError(
        f"metric '{key}': the integer {shown} is past 2**53 in magnitude, where float64 (what a value is "
        f"stored as) no longer holds every integer: it would be read back as {rounded!r}. Record "
        f"float(value) if that rounding is fine, or record it in a smaller unit (thousands, millions)"
    )
