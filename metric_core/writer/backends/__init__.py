"""Logger backends: where a process's metrics go.

torchforge's design leaves open whether ``log_batch`` and ``log_stream`` should both be async or
be unified. The answer here:

* ``log_batch`` stays ``async``. It runs once per step with reduced values and may
  do network I/O (W&B), so asyncio callers can await it without blocking their loop.
* ``log_stream`` stays synchronous, but it is never called on the training thread.
  ``record_metric`` only appends to an in-memory buffer; the collector drains that
  buffer on a writer thread (every ``flush_interval`` seconds, and at each flush) and
  hands the records to PER_RANK_NO_REDUCE backends with ``log_stream_batch``, one
  Arrow record batch per drain. The default ``log_stream_batch`` calls ``log_stream``
  once per record, so a backend that only knows single records still works; the file
  writers override it and write the batch whole.

An async ``log_stream`` would cost a coroutine per record on the hot path, and a
synchronous one on the training thread would put I/O there; the buffered batch
avoids both.
"""

from __future__ import annotations

import asyncio
import threading
from abc import ABC, abstractmethod
from collections.abc import Coroutine
from typing import Any

import pyarrow as pa

from metric_core.errors import ConfigError
from metric_core.metric import BackendRole, LoggingMode, Metric, Reduce


class LoggerBackend(ABC):
    """Abstract logger backend for metric logging, e.g. wandb, console.

    Built from a config dict (``ConsoleBackend({"logging_mode": "per_rank_reduce"})``, as in
    'Metric Logging updates 5/N') or from keywords, as torchforge builds them since #482
    (``WandbBackend(logging_mode=LoggingMode.PER_RANK_REDUCE, project="p", tags=["a"])``).
    ``backend_kwargs`` holds what is neither ``logging_mode`` nor ``per_rank_share_run``.
    """

    def __init__(
        self,
        logger_backend_config: dict[str, Any] | None = None,
        /,
        *,
        logging_mode: LoggingMode | str | None = None,
        per_rank_share_run: bool = False,
        **kwargs: Any,
    ) -> None:
        if logger_backend_config is not None:
            config = dict(logger_backend_config)
        else:
            config = {**kwargs, "per_rank_share_run": per_rank_share_run}
            if logging_mode is not None:
                config["logging_mode"] = logging_mode
        self.logger_backend_config = config
        mode = config.get("logging_mode", LoggingMode.PER_RANK_REDUCE)
        try:
            self.logging_mode = LoggingMode(mode)
        except ValueError:
            allowed = ", ".join(m.value for m in LoggingMode)
            raise ConfigError(
                f"{type(self).__name__}: logging_mode '{mode}' is not one of {allowed}"
            ) from None
        self.per_rank_share_run = bool(config.get("per_rank_share_run", False))
        self.backend_kwargs = {
            k: v for k, v in config.items() if k not in ("logging_mode", "per_rank_share_run")
        }

    @abstractmethod
    async def init(
        self,
        role: BackendRole,
        controller_logger_metadata: dict[str, Any] | None = None,
        process_name: str | None = None,
    ) -> None:
        """Initializes the backend, e.g. wandb.init()."""

    @abstractmethod
    async def log_batch(self, metrics: list[Metric], global_step: int) -> None:
        """Log the reduced metrics of one step."""

    def log_stream(self, metric: Metric, global_step: int) -> None:  # noqa: B027
        """Log one raw metric (PER_RANK_NO_REDUCE). Called from the writer thread."""

    def log_stream_batch(self, batch: pa.RecordBatch, global_step: int) -> None:
        """Log a batch of raw records in the record schema; default: log_stream per row."""
        for row in batch.to_pylist():
            metric = Metric(
                key=row["key"],
                value=row["value"],
                reduction=Reduce(row["reduction"]),
                timestamp=row["timestamp"],
                step=row["step"],
                rank=row["rank"],
                process=row["process"],
            )
            self.log_stream(metric, global_step)

    async def log_samples(self, samples: list[Metric], step: int) -> None:  # noqa: B027
        """Show samples (``Reduce.SAMPLE``), as torchforge hands them over (its PR #486): a
        Metric a key, whose value is a list of sample dicts. A PER_RANK_REDUCE backend gets
        each step's ``SampleAccumulator`` value at the flush (the bottom and top sample by
        reward); a PER_RANK_NO_REDUCE one every sample, as the writer drains them. Every
        sample is on disk whatever a backend shows (``metriclog samples``)."""

    async def finish(self) -> None:  # noqa: B027
        """Release resources; called by shutdown()."""

    def get_metadata_for_secondary_ranks(self) -> dict[str, Any] | None:
        """Sharable state after primary init (e.g. a shared W&B run id)."""
        return {}


def _shows_samples(backend: LoggerBackend) -> bool:
    return type(backend).log_samples is not LoggerBackend.log_samples


def get_logger_backend_class(cls_name: str) -> type[LoggerBackend]:
    """The backend class of a config name (torchforge's factory): ``console`` or ``wandb``."""
    if cls_name == "console":
        from metric_core.writer.backends.console import ConsoleBackend

        return ConsoleBackend
    if cls_name == "wandb":
        from metric_core.writer.backends.wandb import WandbBackend

        return WandbBackend
    raise ValueError(f"Unknown logger backend type: {cls_name} (use console or wandb)")


def make_backend(name: str, config: dict[str, Any] | LoggerBackend) -> LoggerBackend:
    """Build a backend from its config name (``console``, ``wandb``), or take an instance."""
    if isinstance(config, LoggerBackend):
        if config.logging_mode is LoggingMode.GLOBAL_REDUCE:
            raise ConfigError(_global_reduce_message(name))
        return config
    if config.get("logging_mode") in (LoggingMode.GLOBAL_REDUCE, LoggingMode.GLOBAL_REDUCE.value):
        raise ConfigError(_global_reduce_message(name))
    if name in ("jsonl", "parquet"):
        raise ConfigError(
            f"backend '{name}': the raw-stream file writer is always on; choose its format "
            "with metric_core.init(run_dir, file_format=...)."
        )
    try:
        backend_class = get_logger_backend_class(name)
    except ValueError:
        raise ConfigError(f"unknown backend '{name}': use console or wandb") from None
    return backend_class(config)


def _global_reduce_message(name: str) -> str:
    return (
        f"backend '{name}': logging_mode global_reduce is not computed live. Every rank "
        "writes its raw stream to files; compute the global reduction from them with "
        "`metriclog reduce RUN_DIR` (or upload it with `metriclog upload RUN_DIR`). "
        "Use per_rank_reduce or per_rank_no_reduce for a live backend."
    )


class Backends:
    """A collector's live backends, by what they take, and the event loops their calls run on.

    ``stream``: PER_RANK_NO_REDUCE backends, given every drained batch (on the writer
    thread), and every drained sample (``stream_samples``, those that show samples).
    ``reduce``: PER_RANK_REDUCE backends, given each step's reduced metrics, and its
    accumulated samples (``reduce_samples``). Calls made while draining (under the
    collector's drain lock, from the writer thread or a flush) run on a loop of their own,
    so they never meet a flush's calls on the other.
    """

    def __init__(self, configs: dict[str, dict[str, Any] | LoggerBackend], process: str) -> None:
        built = [make_backend(name, cfg) for name, cfg in configs.items()]
        self.stream = [b for b in built if b.logging_mode is LoggingMode.PER_RANK_NO_REDUCE]
        self.reduce = [b for b in built if b.logging_mode is LoggingMode.PER_RANK_REDUCE]
        self.stream_samples = [b for b in self.stream if _shows_samples(b)]
        self.reduce_samples = [b for b in self.reduce if _shows_samples(b)]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_loop: asyncio.AbstractEventLoop | None = None
        self._run(self._init(built, process))

    def log_stream(self, batch: pa.RecordBatch, step: int) -> None:
        for backend in self.stream:
            backend.log_stream_batch(batch, step)

    def log_reduced(self, metrics: list[Metric], step: int) -> None:
        if self.reduce:
            self._run(self.alog_reduced(metrics, step))

    async def alog_reduced(self, metrics: list[Metric], step: int) -> None:
        await asyncio.gather(*(b.log_batch(metrics, step) for b in self.reduce))

    def log_samples(self, samples: list[Metric], step: int) -> None:
        """A step's accumulated samples, to the PER_RANK_REDUCE backends (at its flush)."""
        if self.reduce_samples:
            self._run(self.alog_samples(samples, step))

    async def alog_samples(self, samples: list[Metric], step: int) -> None:
        await asyncio.gather(*(b.log_samples(samples, step) for b in self.reduce_samples))

    def log_stream_samples(self, samples: list[Metric], step: int) -> None:
        """Drained samples, every one, to the PER_RANK_NO_REDUCE backends (while draining)."""
        if self.stream_samples:
            self._run(self._log_stream_samples(samples, step), drain=True)

    async def _log_stream_samples(self, samples: list[Metric], step: int) -> None:
        await asyncio.gather(*(b.log_samples(samples, step) for b in self.stream_samples))

    def finish(self) -> None:
        self._run(self._finish())
        for loop in (self._loop, self._drain_loop):
            if loop is not None:
                loop.close()

    @staticmethod
    async def _init(backends: list[LoggerBackend], process: str) -> None:
        for b in backends:
            await b.init(BackendRole.LOCAL, None, process)

    async def _finish(self) -> None:
        for b in [*self.stream, *self.reduce]:
            await b.finish()

    def _run(self, coro: Coroutine[Any, Any, None], *, drain: bool = False) -> None:
        """Run a backend coroutine to its end from synchronous code (``drain``: on the loop of
        the calls made while draining)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            if drain:
                if self._drain_loop is None:
                    self._drain_loop = asyncio.new_event_loop()
                self._drain_loop.run_until_complete(coro)
                return
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(coro)
            return
        # Called from inside a running event loop: run on a helper thread's loop.
        error: list[BaseException] = []

        def run() -> None:
            try:
                asyncio.run(coro)
            except BaseException as exc:
                error.append(exc)

        helper = threading.Thread(target=run)
        helper.start()
        helper.join()
        if error:
            raise error[0]
