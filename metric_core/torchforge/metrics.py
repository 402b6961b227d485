"""torchforge's ``forge.observability.metrics``, over metric_core: one process per rank, no monarch.

The names and their behaviour are torchforge's, so a torchforge user changes one import
line. What is not the same, and why, is in docs/compat.md. Underneath, every value is
written to the run directory by metric_core's collector, as ``metric_core.record_metric``
writes it.

``record_metric`` here differs from ``metric_core.record_metric`` as torchforge's does:

* before ``init_backends`` it warns once and drops the value, unless ``METRICLOG_DIR``
  is set: then the process starts recording there by itself (``MetricCollector.push``);
* ``FORGE_DISABLE_METRICS=true`` makes it a no-op;
* it builds a ``Metric`` and looks up the per-rank ``MetricCollector`` at every call,
  which costs more than ``metric_core.record_metric`` (docs/compat.md has the figures).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

from metric_core.errors import ConfigError, MetricLogError
from metric_core.metric import (
    BackendRole,
    LoggingMode,
    MaxAccumulator,
    MeanAccumulator,
    Metric,
    MetricAccumulator,
    MinAccumulator,
    Reduce,
    SampleAccumulator,
    StdAccumulator,
    SumAccumulator,
    reduce_metrics_states,
)
from metric_core.torchforge.env import FORGE_DISABLE_METRICS, METRICLOG_DIR, METRICLOG_PROCESS
from metric_core.writer import api
from metric_core.writer import collector as writer_collector
from metric_core.writer.backends import LoggerBackend, get_logger_backend_class
from metric_core.writer.backends.console import ConsoleBackend
from metric_core.writer.backends.wandb import WandbBackend
from metric_core.writer.sidecar import CONSOLE_WAIT_S, end_console, start_console

__all__ = [
    "BackendRole",
    "ConsoleBackend",
    "LoggerBackend",
    "LoggingMode",
    "MaxAccumulator",
    "MeanAccumulator",
    "Metric",
    "MetricAccumulator",
    "MetricCollector",
    "MinAccumulator",
    "Reduce",
    "SampleAccumulator",
    "StdAccumulator",
    "SumAccumulator",
    "WandbBackend",
    "context",
    "current_rank",
    "get_logger_backend_class",
    "get_proc_name_with_rank",
    "record_episode_sample",
    "record_metric",
    "reduce_metrics_states",
]

logger = logging.getLogger(__name__)

# Where launchers put a process's rank, first found wins: torchrun, SLURM, Open MPI, MPICH.
RANK_VARIABLES = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "LOCAL_RANK")


def _env_rank() -> int:
    for name in RANK_VARIABLES:
        raw = os.environ.get(name, "").strip()
        if raw:
            try:
                return int(raw)
            except ValueError:
                raise ConfigError(f"environment variable {name}={raw!r} is not an integer rank") from None
    return 0


_rank: SimpleNamespace | None = None  # read once per process (forgotten in a forked child)


def current_rank() -> SimpleNamespace:
    """This process's rank as monarch's ``current_rank()`` gives it (``.rank``), from the
    launcher's environment (``RANK``, ``SLURM_PROCID``, ...; 0 when none is set)."""
    global _rank
    if _rank is None:
        _rank = SimpleNamespace(rank=_env_rank())
    return _rank


process_name: str | None = None  # given to get_or_create_metric_logger, once it was called


def default_process_name() -> str:
    """The name given to ``get_or_create_metric_logger``, else ``METRICLOG_PROCESS``, else the
    running script's name (``train`` for train.py)."""
    if process_name:
        return process_name
    given = METRICLOG_PROCESS.get_value()
    if given:
        return str(given)
    script = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] not in ("", "-c", "-m") else ""
    return script or "main"


def context() -> SimpleNamespace:
    """monarch's ``context()`` as far as torchforge reads it: ``actor_instance.actor_id.actor_name``."""
    actor_id = SimpleNamespace(actor_name=default_process_name())
    return SimpleNamespace(actor_instance=SimpleNamespace(actor_id=actor_id))


def _disabled() -> bool:
    """``FORGE_DISABLE_METRICS`` is ``true``, read at every call as torchforge reads it.

    ``os.getenv`` costs 0.8 us (it encodes the name and decodes the value); the environment's
    own dict of encoded names answers the common case, an unset variable, in 0.05 us.
    """
    if _environ_data is not None and _disable_key not in _environ_data:
        return False
    return bool(FORGE_DISABLE_METRICS.get_value())


# CPython's os.environ keeps its variables in ``_data`` under encoded names.
_environ_data: dict[Any, Any] | None = getattr(os.environ, "_data", None)
_encodekey = getattr(os.environ, "encodekey", None)
_disable_key = _encodekey(FORGE_DISABLE_METRICS.name) if _encodekey is not None else None
if _disable_key is None:
    _environ_data = None


def record_metric(key: str, value: Any, reduction: Reduce = Reduce.MEAN) -> None:
    """Record ``value`` under ``key`` with torchforge's semantics (see the module's text).

    Cheap, but not as cheap as ``metric_core.record_metric``: a ``Metric`` and a
    collector lookup per call.
    """
    if _disabled():
        return
    metric = Metric(key=key, value=value, reduction=reduction)
    collector = MetricCollector()
    collector.push(metric)


def record_episode_sample(table_name: str, episode: Any) -> None:
    """Record one episode as a sample (``Reduce.SAMPLE``) under ``table_name``, as torchforge's
    PR #486 does: ``episode.to_dict(exclude=["ref_logprobs", "completion"])`` (the tensors
    and the completion object are left out), then ``record_metric``. Every sample is kept
    in the run directory (``metriclog samples``); a PER_RANK_REDUCE backend shows the step's
    bottom and top by ``reward`` (``SampleAccumulator``), a PER_RANK_NO_REDUCE one each.
    """
    sample = episode.to_dict(exclude=["ref_logprobs", "completion"])
    record_metric(table_name, sample, Reduce.SAMPLE)


class MetricCollector:
    """torchforge's per-rank singleton: ``MetricCollector()`` is the same object in a rank.

    ``init_backends`` starts metric_core's collector of this process (in ``METRICLOG_DIR``)
    with the per-rank backends of the config; a ``global_reduce`` wandb backend starts the
    sidecar (``metriclog upload --follow``) on rank 0, which uploads the global reduction
    computed from every rank's files, and a ``global_reduce`` console backend a child on rank
    0 that prints it there, step by step (``metric_core.offline.console``; docs/live.md).
    ``push`` records, ``flush`` ends a step, ``shutdown`` ends cleanly.
    """

    _instances: ClassVar[dict[int, MetricCollector]] = {}
    _singleton_rank: int

    def __new__(cls) -> MetricCollector:
        rank = current_rank().rank
        inst = cls._instances.get(rank)
        if inst is None:
            inst = super().__new__(cls)
            inst._singleton_rank = rank
            cls._instances[rank] = inst
        return inst

    def __init__(self) -> None:
        if hasattr(self, "_is_initialized"):
            return
        self.rank = current_rank().rank
        self.global_step = 0
        self.proc_name_with_rank: str | None = None
        self._is_initialized = False
        self._collector: writer_collector.MetricCollector | None = None
        self._adopt_tried = False
        self._warned = False
        self._console: tuple[subprocess.Popen[bytes], float] | None = None  # rank 0's printer, its wait

    async def init_backends(
        self,
        metadata_per_controller_backend: dict[str, dict[str, Any]] | None,
        config: dict[str, Any],
        global_step: int = 0,
        process_name: str | None = None,
    ) -> None:
        """Start recording this rank into ``METRICLOG_DIR`` with the config's backends.

        ``config`` maps backend names to their configs, each with a ``logging_mode``
        (a ``LoggingMode`` or its value). ``global_step`` is the step to resume from.
        """
        if self._is_initialized:
            logger.debug("%s: MetricCollector already initialized", self.proc_name_with_rank)
            return
        if self._collector is not None:
            if not self._collector.adopted:
                raise ConfigError(
                    "metric_core.init() already started this process's collector: give the backends to it, "
                    "or call init_backends without metric_core.init()"
                )
            # Values recorded before init_backends started a source by themselves: it ends here,
            # cleanly, and this process goes on under the name and backends asked for.
            api.shutdown()
            self._collector = None
        process = process_name or default_process_name()
        local: dict[str, dict[str, Any] | LoggerBackend] = {}
        sidecar = None
        console_wait = None
        for name, backend_config in config.items():
            backend_class = get_logger_backend_class(name)  # an unknown name fails, as in torchforge
            mode = _mode_of(name, backend_config)
            if mode is LoggingMode.GLOBAL_REDUCE:
                if name == "wandb" and self.rank == 0:
                    sidecar = sidecar_options(backend_config)
                elif name == "console" and self.rank == 0:
                    console_wait = _console_wait(backend_config)
                continue
            local[name] = backend_class(**{**backend_config, "logging_mode": mode})
        self._start(process, local, global_step, sidecar, adopted=False)
        self.global_step = global_step
        if console_wait is not None and self._collector is not None:
            # A child prints each global step on this rank's console, computed from the files.
            try:
                interval = self._collector.flush_interval
                child = start_console(run_dir(), flush_interval=interval, from_step=global_step)
            except BaseException:
                api.shutdown()
                self._collector = None
                self._is_initialized = False
                raise
            self._console = (child, console_wait)

    def _start(
        self,
        process: str,
        backends: dict[str, dict[str, Any] | LoggerBackend],
        step: int,
        sidecar: dict[str, Any] | None,
        *,
        adopted: bool,
    ) -> None:
        # The source is named as torchforge names a rank, "trainer_r0": its W&B runs and prints too.
        self.proc_name_with_rank = f"{process}_r{self.rank}"
        self._collector = api.init(
            run_dir(),
            rank=self.rank,
            process_name=self.proc_name_with_rank,
            step=step,
            backends=backends,
            sidecar=sidecar,
        )
        self._collector.adopted = adopted
        self._is_initialized = not adopted

    def push(self, metric: Metric) -> None:
        """Record a ``Metric``; before ``init_backends``, see ``record_metric``."""
        collector = self._collector
        if collector is None:
            collector = self._adopt()
            if collector is None:
                return
        if not isinstance(metric, Metric):
            raise TypeError(f"Expected {Metric} object, got {metric} of type {type(metric)}")
        collector.push(metric)

    def _adopt(self) -> writer_collector.MetricCollector | None:
        """The collector a process gets without ``init_backends``: the one ``metric_core.init``
        started in it, or one of its own in ``METRICLOG_DIR`` (not in a process another started,
        which would take its parent's name); else None, said once. A forked child's copy of
        its parent's collector is not in ``_open``: it writes nothing."""
        if api._active is not None and not api._active.closed and api._active in writer_collector._open:
            self._collector = api._active
            return self._collector
        if _forked[0] or multiprocessing.parent_process() is not None:
            self._warn_once(
                f"this process (pid {os.getpid()}) was started by another process of rank {self.rank}, e.g. "
                "as a data-loader worker: it records nothing, so as not to take its parent's name. To record "
                "in it, call metric_core.init(run_dir, process_name=...) in it with a name of its own"
            )
            return None
        if not self._adopt_tried and METRICLOG_DIR.get_value():
            self._adopt_tried = True
            try:
                self._start(default_process_name(), {}, 0, None, adopted=True)
            except MetricLogError as exc:
                self._warn_once(
                    f"recording into METRICLOG_DIR failed, and this process records nothing: {exc}"
                )
                return None
            return self._collector
        self._warn_once(
            f"Skipping metric collection for {get_proc_name_with_rank()}. Metric logging backends "
            "(e.g. wandb) were not initialized. This happens when you try to use `record_metric` before "
            "calling `init_backends`. To record every value, set METRICLOG_DIR to a run directory, or "
            "call in your main file:\n"
            "`mlogger = await get_or_create_metric_logger(process_name='Controller')`\n"
            "`await mlogger.init_backends.call_one(logging_config)`\nor set env variable "
            "`FORGE_DISABLE_METRICS=True`"
        )
        return None

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            logger.warning(message)

    async def flush(self, global_step: int, return_state: bool = False) -> dict[str, dict[str, Any]]:
        """End step ``global_step``: its records are made durable and reduced for the
        per-rank backends; with ``return_state``, its accumulator states are returned."""
        if self._collector is None:
            logger.warning(
                "Cannot flush collected metrics for %s. MetricCollector.flush() called before "
                "init_backends().\nPlease call in your main file:\n"
                "`mlogger = await get_or_create_metric_logger(process_name='Controller')`\n"
                "`await mlogger.init_backends.call_one(logging_config)`\nbefore calling `flush`",
                get_proc_name_with_rank(),
            )
            return {}
        states = await self._collector.aflush(global_step, return_state=return_state)
        self.global_step = global_step + 1
        return states or {}

    async def shutdown(self) -> None:
        """Flush, close the backends, wait for the sidecar, and mark the rank finished."""
        if self._collector is None:
            return
        if self._collector is api._active:
            api.shutdown()
        else:
            self._collector.shutdown()
        self._collector = None
        self._is_initialized = False
        if self._console is not None:  # its last steps are printed before this returns, or said
            child, wait = self._console
            self._console = None
            await asyncio.to_thread(end_console, child, wait)


# A forked child shares its parent's source: it must not record under its name.
_forked = [False]


def _after_fork_in_child() -> None:
    global _rank
    _forked[0] = True
    _rank = None
    for inst in MetricCollector._instances.values():
        inst._collector = None
        inst._is_initialized = False
        inst._warned = False
        inst._console = None  # the parent's printer, not this process's to wait for


os.register_at_fork(after_in_child=_after_fork_in_child)


def _mode_of(name: str, config: dict[str, Any]) -> LoggingMode:
    mode = config.get("logging_mode")
    try:
        return LoggingMode(mode)
    except ValueError:
        allowed = ", ".join(m.value for m in LoggingMode)
        raise ValueError(
            f"backend '{name}': logging_mode {mode!r} is not one of {allowed} "
            f"({mode!r} is not a valid LoggingMode)"
        ) from None


# Where a launcher puts the id of its job, first found wins: every rank of a job reads the same
# one. torchrun's static rendezvous without --rdzv-id (--master-port given, or several nodes)
# sets "none", which names no job; on one node without a port, torchrun makes a fresh id.
LAUNCHER_IDS = (("TORCHELASTIC_RUN_ID", "torchrun"), ("SLURM_JOB_ID", "slurm"))
DEFAULT_RUNS = "metriclog_runs"  # in the working directory, when METRICLOG_DIR is not set

_default_dir: str | None = None  # chosen once in a process (kept by a forked child)


def _console_wait(config: dict[str, Any]) -> float:
    """How long rank 0's shutdown waits for the printer's last steps: the config's ``wait``
    (seconds; torchforge's ConsoleBackend takes any setting), else ``CONSOLE_WAIT_S``."""
    wait = config.get("wait", CONSOLE_WAIT_S)
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not wait >= 0:
        raise ValueError(f"backend 'console': wait={wait!r} must be seconds, a number of 0 or more")
    return float(wait)


def run_dir() -> str:
    """The run directory every rank writes to: ``METRICLOG_DIR``, else one named from the launcher.

    Without ``METRICLOG_DIR``, the directory is ``./metriclog_runs/torchrun-{TORCHELASTIC_RUN_ID}``
    or ``./metriclog_runs/slurm-{SLURM_JOB_ID}``, which every rank of the job names alike
    (rank 0 says which, once); under torchrun with ``TORCHELASTIC_RUN_ID=none`` on one node,
    it is named from the torchrun agent every worker is a child of
    (``torchrun-{its start}-pid{its pid}``).
    With none of them, each process writes to a directory of its own named from the time
    and its pid (``./metriclog_runs/20261206-191502-pid4242``), and says which.
    """
    path = METRICLOG_DIR.get_value()
    if path:
        return str(path)
    global _default_dir
    if _default_dir is None:
        _default_dir = _default_run_dir()
    return _default_dir


def _default_run_dir() -> str:
    rank = current_rank().rank
    named = _launcher_name()
    if named is not None:
        name, origin = named
        path = os.path.abspath(os.path.join(DEFAULT_RUNS, name))
        if rank == 0:
            logger.warning(
                "METRICLOG_DIR is not set: every rank of this job writes to %s (named from %s); "
                "set METRICLOG_DIR to choose the run directory",
                path,
                origin,
            )
        return path
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = os.path.abspath(os.path.join(DEFAULT_RUNS, f"{stamp}-pid{os.getpid()}"))
    logger.warning(
        "METRICLOG_DIR is not set and no launcher names this job (no TORCHELASTIC_RUN_ID or SLURM_JOB_ID): "
        "rank %d writes to %s (a directory of its own); set METRICLOG_DIR, the same in every rank, "
        "for one run directory of the job",
        rank,
        path,
    )
    return path


def _launcher_name() -> tuple[str, str] | None:
    """The run directory's name from the launcher, and what it was named from; None when
    nothing names the job the same in every rank."""
    for variable, launcher in LAUNCHER_IDS:
        job = os.environ.get(variable, "").strip()
        if job and job != "none":
            return f"{launcher}-{_safe_name(job)}", f"{variable}={job}"
    env = os.environ
    if env.get("TORCHELASTIC_RUN_ID") == "none" and env.get("LOCAL_WORLD_SIZE") == env.get("WORLD_SIZE"):
        # torchrun's static rendezvous without --rdzv-id, on one node: every worker is a child
        # of the same agent.
        agent = os.getppid()
        started = _start_time(agent)
        if started is not None:
            stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(started))
            origin = f"the torchrun agent, pid {agent}, as TORCHELASTIC_RUN_ID=none"
            return f"torchrun-{stamp}-pid{agent}", origin
    return None


def _start_time(pid: int) -> float | None:
    """When process ``pid`` started, in seconds since the epoch (Linux's /proc); None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # from field 3 on: the name may hold spaces
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime, in ticks
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _safe_name(job: str) -> str:
    """A launcher's job id as a directory name: what is not a letter, a digit, ``.``, ``_`` or ``-``
    becomes ``_``."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", job)[:120]


def sidecar_options(wandb_config: dict[str, Any]) -> dict[str, Any] | None:
    """The sidecar (``metriclog upload --follow``) options of a global_reduce wandb config.

    W&B's ``mode`` ``offline`` uploads offline; ``disabled`` starts no sidecar;
    ``sample_tables`` (``incremental``: torchforge's incremental samples tables) goes to
    the upload. Settings the upload does not take are said once, by name.
    """
    kwargs = {k: v for k, v in wandb_config.items() if k not in ("logging_mode", "per_rank_share_run")}
    mode = kwargs.pop("mode", None)
    if mode == "disabled":
        return None
    options: dict[str, Any] = {"mode": "global_reduce", "offline": mode == "offline"}
    for name in ("project", "entity", "name", "group", "sample_tables"):
        if kwargs.get(name) is not None:
            options[name] = kwargs.pop(name)
    options.setdefault("project", "uncategorized")  # wandb.init's own default
    if kwargs:
        logger.warning(
            "wandb (global_reduce): the global run is uploaded by `metriclog upload --follow`, which does "
            "not pass %s to wandb.init (its files go to WANDB_DIR, else METRICLOG_DIR/.metriclog/wandb)",
            ", ".join(sorted(kwargs)),
        )
    return options


# torchforge's metrics takes it from utils, as here; utils reads context() and current_rank(),
# defined above, so it is imported once they are.
from metric_core.torchforge.utils import get_proc_name_with_rank  # noqa: E402
