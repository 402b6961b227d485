"""The module-level API a training script uses: one MetricCollector per process.

``init`` starts it, ``record_metric``/``flush``/``shutdown`` drive it. ``record_metric``
is ``MetricCollector.record`` inlined over module globals that ``init`` binds: attribute
lookups and a method call would be a third of its cost.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from pathlib import Path
from typing import Any

from metric_core import run_json
from metric_core.atomic import create_file
from metric_core.errors import ConfigError, NotInitializedError, warn
from metric_core.metric import Reduce
from metric_core.writer import collector as collector_module
from metric_core.writer.backends import LoggerBackend
from metric_core.writer.collector import (
    EXACT_TYPES,
    HANG_DUMP_AFTER,
    WIDE_INTEGERS,
    MetricCollector,
    _as_float,
    _now,
)
from metric_core.writer.segments import MAX_UNWRITTEN

_active: MetricCollector | None = None
# What the last shutdown() ended ("TrainActor_r0 (rank 0) in runs/exp1"), until the next
# init(): a call after it is told so, not that init() was never called.
_ended: str | None = None
# The child started by init(sidecar=), how long shutdown() waits for it, and its log.
_sidecar: tuple[subprocess.Popen[bytes], float, Path] | None = None
WAIT_S = 120.0  # how long shutdown() waits for the sidecar, unless sidecar={"wait": ...}


def init(
    run_dir: str | os.PathLike[str],
    *,
    rank: int | None = None,
    process_name: str | None = None,
    file_format: str = "parquet",
    step: int | None = None,
    backends: dict[str, dict[str, Any] | LoggerBackend] | None = None,
    flush_interval: float = 1.0,
    world_size: int | None = None,
    config: dict[str, Any] | None = None,
    segment_records: int = 1_000_000,
    fsync: bool = False,
    on_flush_error: str = "raise",
    max_unwritten: int = MAX_UNWRITTEN,
    sidecar: dict[str, Any] | None = None,
    catch_signals: bool = True,
    hang_dump_after: float | None = HANG_DUMP_AFTER,
    on_nonfinite: str = "record",
    nonfinite_keys: str | list[str] | tuple[str, ...] = "*",
) -> MetricCollector:
    """Start recording this process's metrics into ``run_dir``.

    ``rank`` defaults to the ``RANK`` environment variable (0 if unset), ``world_size``
    to ``WORLD_SIZE``. Rank 0 writes ``run.json`` (name, world_size, config) unless it
    exists. ``backends`` maps ``console`` or ``wandb`` to their configs, each with a
    ``logging_mode``; the raw-stream files are always written.

    Every ``init()`` starts a new attempt of its source (process name and rank). A job
    restarted from a checkpoint into the same run directory is one: from the step of its
    first ``flush(step)`` on, it replaces the records of the source's earlier attempts
    when the run is read (``--attempts all`` keeps them). Pass ``step`` (the step to
    resume from) when restarting; without it, the records before the first flush are
    stamped with that first flush's step all the same, and a first flush far beyond 0
    warns.

    ``sidecar`` starts ``metriclog upload RUN_DIR --follow`` as a child process of this
    one, with ``upload_run``'s options (``{"project": "rl", "mode": "global_reduce"}``):
    the run reaches W&B while it trains, from one process of the job (give it on one
    rank only). ``shutdown()`` waits for it to hand over the last rows (``"wait"``
    seconds at most, 120 by default). See docs/live.md.

    ``on_flush_error`` says what a ``flush()`` does when its records cannot be made
    durable (a full disk, a deleted run directory): ``"raise"`` a ``WriteError``, or
    ``"warn"`` and go on; either way they stay in memory (at most ``max_unwritten``
    records) and are written when writing works again.

    ``catch_signals`` (on by default) records how the attempt ends: a clean ``shutdown()``,
    an uncaught exception, a SIGTERM/SIGINT/SIGHUP (with every thread's stack at that
    moment) or a fatal signal, or an exit without ``shutdown()``; the process then ends
    exactly as it would have (docs/durability.md). ``hang_dump_after`` seconds without a
    returned ``flush()`` (300 by default, ``METRICLOG_HANG_DUMP_AFTER`` overrides, 0:
    never) save every thread's stack into ``stacks/`` once per stall, so ``inspect``
    tells where a hung rank is stuck.

    ``on_nonfinite="raise"`` stops the job at the first NaN or infinity of a key that
    ``nonfinite_keys`` matches (shell-style patterns, as ``--key`` takes them; all keys by
    default): ``record_metric`` records the value, then raises ``NonFiniteError``. Off
    (``"record"``, the default) it costs nothing.

    >>> import metric_core, tempfile
    >>> _ = metric_core.init(tempfile.mkdtemp(), rank=0, process_name="trainer")
    >>> metric_core.record_metric("loss", 0.5, metric_core.Reduce.MEAN)
    >>> metric_core.flush(0)
    >>> metric_core.shutdown()
    """
    if _active is not None and not _active.closed and _active in collector_module._open:  # not a fork's copy
        raise ConfigError(
            f"metric_core.init() was already called in this process (for {_active.run_dir}); "
            "call metric_core.shutdown() before initializing again"
        )
    if rank is None:
        rank = _env_int("RANK", 0) or 0
    if world_size is None:
        world_size = _env_int("WORLD_SIZE", None)
    collector = MetricCollector(
        run_dir,
        rank=rank,
        process_name=process_name,
        file_format=file_format,
        step=step,
        backends=backends,
        flush_interval=flush_interval,
        segment_records=segment_records,
        fsync=fsync,
        on_flush_error=on_flush_error,
        max_unwritten=max_unwritten,
        catch_signals=catch_signals,
        hang_dump_after=hang_dump_after,
        on_nonfinite=on_nonfinite,
        nonfinite_keys=nonfinite_keys,
    )
    if rank == 0:
        _write_run_json(Path(run_dir), world_size=world_size, config=config)
    _bind(collector)
    if sidecar is not None:
        global _sidecar
        from metric_core.writer.sidecar import start_sidecar

        try:
            child = start_sidecar(run_dir, **sidecar)
            _sidecar = (
                child,
                float(sidecar.get("wait", WAIT_S)),
                Path(run_dir) / ".metriclog" / "sidecar.log",
            )
        except BaseException:
            shutdown()
            raise
    return collector


def record_metric(key: str, value: Any, reduction: Reduce = Reduce.MEAN) -> None:
    """Record one value of ``key`` in the current step. Cheap enough for any loop.

    ``value`` may be a Python number, a bool, a numpy scalar or a 0-d tensor; with
    ``Reduce.SAMPLE``, a dict of fields kept whole (``MetricCollector.record_sample``).
    Returns nothing: the value is written by the collector's thread. Raises
    ``NotInitializedError`` before ``init`` (or after ``shutdown``), and ``ValueError`` or ``TypeError`` for a
    value that is no number (or a sample that is no dict, or too large), naming the key.
    An integer past 2**53 in magnitude (a Python int, a numpy integer, a 0-d integer
    tensor) is a ``ValueError`` too: float64, what a value is stored as, would round it;
    record ``float(value)`` if that rounding is fine.

    >>> import metric_core, tempfile
    >>> _ = metric_core.init(tempfile.mkdtemp(), process_name="trainer")
    >>> record_metric("trainer/loss", 0.31, Reduce.MEAN)
    >>> metric_core.flush(0); metric_core.shutdown()
    """
    # MetricCollector.record, inlined over module globals that init() binds: attribute
    # lookups and a method call would be a third of this function's cost.
    entry = _key_codes.get(key)
    if entry is not None and entry[0] is reduction:
        code = entry[1]
    elif reduction == "sample":
        _sample(key, value)
        return
    else:
        code = _intern(key, reduction)
    # float64 holds every int up to 2**53 exactly, and every value of EXACT_TYPES: the array
    # takes those as they are; _as_float checks the rest (exact or refused, docs/format.md).
    cls = value.__class__
    if (
        cls is float
        or (cls is int and -(2**53) <= value <= 2**53)
        or cls in EXACT_TYPES
        or (cls in WIDE_INTEGERS and -(2**53) <= value <= 2**53)
    ):
        _extend((value, code, _now()))
    else:
        _extend((_as_float(key, value), code, _now()))


def _not_initialized(*_: Any) -> Any:
    raise NotInitializedError("record_metric()", ended=_ended)


_key_codes: dict[str, tuple[Any, int]] = {}
_intern: Any = _not_initialized
_extend: Any = _not_initialized
_sample: Any = _not_initialized


def _bind(collector: MetricCollector | None) -> None:
    global _active, _key_codes, _intern, _extend, _sample, _ended
    _active = collector
    if collector is not None:
        _ended = None
    if collector is None:
        _key_codes, _intern, _extend, _sample = {}, _not_initialized, _not_initialized, _not_initialized
    else:
        _key_codes, _intern, _extend = collector._codes, collector._intern, collector._extend
        _sample = collector.record_sample


def flush(step: int | None = None, *, return_state: bool = False) -> Any:
    """End step ``step`` of this process's collector (see ``MetricCollector.flush``).

    Returns the step's accumulator states ({key: state}) with ``return_state``, for
    ``reduce_metrics_states``; else None. Once it returns, every record up to the step is
    durable. Raises ``NotInitializedError`` before ``init`` or after ``shutdown``; ``ValueError`` for a step
    below the previous flush's; ``WriteError`` (``DiskFullError``, ``RunDirGoneError``)
    when the records could not be made durable and ``init(on_flush_error="raise")``, the
    default (they stay in memory for the next flush).
    """
    if _active is None:
        raise NotInitializedError("flush()", ended=_ended)
    return _active.flush(step, return_state=return_state)


async def aflush(step: int | None = None, *, return_state: bool = False) -> Any:
    """``flush`` without blocking the running event loop: the same result and errors."""
    if _active is None:
        raise NotInitializedError("aflush()", ended=_ended)
    return await _active.aflush(step, return_state=return_state)


def shutdown() -> None:
    """Flush, close backends and mark this source as cleanly finished; wait for the
    sidecar ``init(sidecar=...)`` started (a warning, not an error, if it failed or is
    still uploading). Does nothing before ``init``. Raises what ``flush`` raises."""
    global _sidecar, _ended
    if _active is not None:
        _active.shutdown()
        _ended = f"{_active.process_name} (rank {_active.rank}) in {_active.run_dir}"
        _bind(None)
    if _sidecar is not None:
        child, wait, log = _sidecar
        _sidecar = None
        try:
            code = child.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            warn(
                f"the metriclog sidecar (pid {child.pid}) is still uploading after {wait:.0f} s; it goes "
                f"on without this process (its log: {log})"
            )
            return
        if code != 0:
            warn(f"the metriclog sidecar ended with exit code {code}; what it said is in {log}")


def get_collector() -> MetricCollector:
    """The collector started by ``init``; ``NotInitializedError`` before it."""
    if _active is None:
        raise NotInitializedError("get_collector()", ended=_ended)
    return _active


def _env_int(name: str, default: int | None) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None


def _write_run_json(run_dir: Path, *, world_size: int | None, config: dict[str, Any] | None) -> None:
    """Create run.json unless it exists: the first rank-0 process of any role wins."""
    path = run_dir / run_json.NAME
    if path.exists():
        return
    meta: dict[str, Any] = {
        "name": run_dir.resolve().name,
        "run_id": secrets.token_hex(16),  # the run's identity: uploads derive their ids from it
        "world_size": world_size,
        "created": time.time(),
    }
    if config is not None:
        meta["config"] = config
    try:
        create_file(path, run_json.encode(meta))
    except OSError as exc:  # metadata only: the records are what must not be lost
        warn(
            f"could not write {path} ({exc.strerror or exc}): the run's name, world_size and config "
            "are not recorded"
        )
