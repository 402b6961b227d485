"""torchforge's ``forge.observability.metric_actors`` for one process per rank, without monarch.

In torchforge a controller spawns a ``GlobalLoggingActor``, a ``LocalFetcherActor`` is
spawned on each process mesh and registered with it, and ``flush`` gathers every rank's
states through the fetchers. Here every rank runs the same script (torchrun, SLURM): each
calls ``get_or_create_metric_logger``, which gives it a ``GlobalLoggingActor`` of its own
with one ``LocalFetcherActor`` registered, the bridge to this process's
``MetricCollector``; the global reduction is computed from the files every rank writes,
live by the sidecar on rank 0 and offline by ``metriclog reduce``/``upload``. The
endpoints are awaited as torchforge's are, ``await mlogger.flush.call_one(step)``, or
directly, ``await mlogger.flush(step)``.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

from metric_core.metric import LoggingMode
from metric_core.torchforge import metrics
from metric_core.torchforge.env import FORGE_DISABLE_METRICS
from metric_core.torchforge.metrics import MetricCollector, _mode_of, default_process_name

logger = logging.getLogger(__name__)

_global_logger: GlobalLoggingActor | None = None


class _Endpoint:
    """An async method that also answers monarch's ``call_one`` and ``call``."""

    def __init__(self, method: Callable[..., Coroutine[Any, Any, Any]]) -> None:
        self.method = method
        self.__doc__ = method.__doc__

    def __get__(self, owner: Any, owner_type: Any = None) -> Any:
        return self if owner is None else _BoundEndpoint(self.method, owner)


class _BoundEndpoint:
    __slots__ = ("method", "owner")

    def __init__(self, method: Callable[..., Coroutine[Any, Any, Any]], owner: Any) -> None:
        self.method = method
        self.owner = owner

    def __call__(self, *args: Any, **kwargs: Any) -> Coroutine[Any, Any, Any]:
        return self.method(self.owner, *args, **kwargs)

    call_one = __call__
    call = __call__


endpoint = _Endpoint


async def get_or_create_metric_logger(
    proc_mesh: Any = None, process_name: str | None = None
) -> GlobalLoggingActor:
    """This process's metric logger (one per process), as torchforge's function returns it.

    The first call makes the logger and registers this process's ``LocalFetcherActor``
    with it (not with ``FORGE_DISABLE_METRICS=true``); later calls return the same logger.
    ``process_name`` names this process's source in the run (default: ``METRICLOG_PROCESS``
    or the script's name); the first name given stays. ``proc_mesh`` is monarch's: here
    each process of a job calls this function itself, so a mesh given is ignored, with a
    warning.

    >>> import asyncio, os, tempfile
    >>> os.environ["METRICLOG_DIR"] = tempfile.mkdtemp()
    >>> async def main():
    ...     mlogger = await get_or_create_metric_logger(process_name="trainer")
    ...     await mlogger.init_backends.call_one({"console": {"logging_mode": "per_rank_reduce"}})
    ...     record_metric("loss", 0.5)
    ...     await mlogger.flush.call_one(0)
    ...     await mlogger.shutdown.call_one()
    >>> from metric_core.torchforge import record_metric
    >>> asyncio.run(main())
    [trainer_r0] step 0: loss=0.5
    >>> del os.environ["METRICLOG_DIR"]

    Raises:
        ValueError: this process's fetcher was deregistered from the logger (torchforge's
            "Inconsistent logging state").
    """
    global _global_logger
    if proc_mesh is not None:
        logger.warning(
            "get_or_create_metric_logger(proc_mesh=...): metric_core.torchforge runs in each process of the "
            "job; call it in each process instead (the mesh is ignored)"
        )
    if _global_logger is None:
        _global_logger = GlobalLoggingActor()
    global_logger = _global_logger
    own = global_logger._own_fetcher
    if own is not None and not await global_logger.has_fetcher(own):
        raise ValueError(
            f"Inconsistent logging state for this process: it has a LocalFetcherActor ({own}), but the "
            "global logger has no registration of it (deregister_fetcher removed it). Register it again with "
            "`await mlogger.register_fetcher.call_one(fetcher, proc_id)`."
        )
    if own is None and not FORGE_DISABLE_METRICS.get_value():
        name = process_name or default_process_name()
        metrics.process_name = name  # what context() and get_proc_name_with_rank() say from now on
        # torchforge keeps the fetcher's id on the ProcMesh (``proc._uid``); this process is the mesh
        own = global_logger._own_fetcher = str(uuid.uuid4())
        await global_logger.register_fetcher(LocalFetcherActor(global_logger, name), own)
    return global_logger


class LocalFetcherActor:
    """The bridge from the logger to this process's ``MetricCollector`` (torchforge's is spawned
    once per process mesh and runs on each of its ranks; here a process is one rank).

    ``flush``, ``init_backends`` and ``shutdown`` are those of ``MetricCollector()``, this
    process's per-rank collector.
    """

    def __init__(
        self, global_logger: GlobalLoggingActor | None = None, process_name: str | None = None
    ) -> None:
        self.global_logger = global_logger
        self.process_name = process_name

    @endpoint
    async def flush(self, global_step: int, return_state: bool = False) -> dict[str, dict[str, Any]]:
        """End step ``global_step`` in this process; with ``return_state``, the accumulator
        states (``{key: state}``), else ``{}``; ``{}`` before ``init_backends`` (with a warning)."""
        return await MetricCollector().flush(global_step, return_state=return_state)

    @endpoint
    async def init_backends(
        self,
        metadata_per_controller_backend: dict[str, dict[str, Any]] | None,
        config: dict[str, Any],
        global_step: int = 0,
    ) -> None:
        """Start this process's ``MetricCollector`` with ``config``'s backends (see
        ``MetricCollector.init_backends``), named ``process_name``; a no-op once started.
        ``metadata_per_controller_backend`` (a controller's shared run ids) has no use here."""
        await MetricCollector().init_backends(
            metadata_per_controller_backend, config, global_step, process_name=self.process_name
        )

    @endpoint
    async def shutdown(self) -> None:
        """End this process's recording cleanly."""
        await MetricCollector().shutdown()


class GlobalLoggingActor:
    """The metric logger of this process: ``init_backends``, ``flush``, ``shutdown``, and the
    registry of fetchers (``register_fetcher``, ``deregister_fetcher``, ``has_fetcher``,
    ``get_fetcher_count``).

    Configs are torchforge's: ``{"wandb": {"logging_mode": "global_reduce", "project":
    "p"}, "console": {"logging_mode": "per_rank_reduce"}}``.

    In torchforge this actor lives in the controller and each registered fetcher stands for
    a process mesh. Here it lives in each process, and a fetcher stands for this process:
    ``get_or_create_metric_logger`` registers one. ``init_backends`` starts this process's
    recording through the registered fetchers (with none, it only keeps the config, as
    torchforge's starts no rank); a fetcher registered later is started with the config
    at once, as in torchforge. Every fetcher of a process reaches the same per-rank
    ``MetricCollector``, so ``flush`` and ``shutdown`` reach it once, whatever the count;
    ``flush`` does nothing while no fetcher is registered, as in torchforge.
    """

    def __init__(self) -> None:
        self.fetchers: dict[str, LocalFetcherActor] = {}
        self.config: dict[str, Any] | None = None
        self.global_step = 0  # init_backends' global_step, which a later fetcher starts from
        self.metadata_per_controller_backend: dict[str, dict[str, Any]] = {}
        self._own_fetcher: str | None = None  # the id of the fetcher get_or_create_metric_logger registered

    @staticmethod
    def _validate_backend_config(backend_name: str, config: dict[str, Any]) -> dict[str, Any]:
        if "logging_mode" not in config:
            raise ValueError(
                f"logging_mode is required for backend '{backend_name}' but was not provided. "
                f"Please specify a logging_mode in your config: one of "
                f"{', '.join(mode.value for mode in LoggingMode)}."
            )
        mode = _mode_of(backend_name, config)
        share_run = bool(config.get("per_rank_share_run", False))
        if mode is LoggingMode.GLOBAL_REDUCE and share_run:
            logger.warning(
                "%s: per_rank_share_run=True is ignored in global_reduce mode. Setting it to False.",
                backend_name,
            )
            share_run = False
        if backend_name == "wandb" and mode is LoggingMode.PER_RANK_REDUCE and share_run:
            logger.warning(  # torchforge's words
                "WandB: Using 'per_rank_reduce' with 'per_rank_share_run=True' is not recommended. "
                "This configuration can lead to confusing metrics where reduced values from multiple ranks "
                "are written to the same run/step, displaying only one of them. Consider either:\n"
                "  1. Set 'per_rank_share_run=False' to create separate runs per rank, OR\n"
                "  2. Use 'per_rank_no_reduce' for real-time streaming to a shared run"
            )
        return {**config, "logging_mode": mode, "per_rank_share_run": share_run}

    @endpoint
    async def init_backends(self, config: dict[str, Any], global_step: int = 0) -> None:
        """Start recording this process into the run directory (``METRICLOG_DIR``, else one
        named from the launcher: docs/compat.md) with ``config``'s backends, through the
        registered fetchers (none with ``FORGE_DISABLE_METRICS=true``); ``global_step``: the
        step to resume from."""
        self.config = {}
        if FORGE_DISABLE_METRICS.get_value():
            return
        for backend_name, backend_config in config.items():
            self.config[backend_name] = self._validate_backend_config(backend_name, backend_config)
        self.global_step = global_step
        for fetcher in list(self.fetchers.values()):
            await fetcher.init_backends(self.metadata_per_controller_backend, self.config, global_step)

    @endpoint
    async def register_fetcher(self, fetcher: LocalFetcherActor, proc_id: str) -> None:
        """Register ``fetcher`` under ``proc_id`` (torchforge: one per process mesh; here
        ``get_or_create_metric_logger`` registers this process's). After ``init_backends``,
        it is started with the config at once."""
        self.fetchers[proc_id] = fetcher
        if self.config:
            logger.debug("Initializing new LocalFetcherActor for proc_id=%s", proc_id)
            await fetcher.init_backends(self.metadata_per_controller_backend, self.config, self.global_step)

    @endpoint
    async def deregister_fetcher(self, proc_id: str) -> None:
        """Forget the fetcher ``proc_id`` (a warning if there is none). Its process's recording
        goes on until ``shutdown``; with no fetcher left, ``flush`` does nothing."""
        if proc_id not in self.fetchers:
            logger.warning(
                "Fetcher %s not registered in GlobalLoggingActor. Cannot deregister. Available fetchers: %s",
                proc_id,
                list(self.fetchers),
            )
            return
        del self.fetchers[proc_id]

    @endpoint
    async def flush(self, global_step: int, return_state: bool = False) -> dict[str, dict[str, Any]] | None:
        """End step ``global_step`` of this process; with ``return_state``, its accumulator
        states (``reduce_metrics_states`` merges those of several processes). Nothing while no
        fetcher is registered (``FORGE_DISABLE_METRICS``, or all deregistered)."""
        if not self.fetchers:
            return None
        if self.config is None:
            logger.warning(
                "Cannot flush collected metrics. GlobalLoggingActor.flush() called before init_backends()."
                " No backends will be flushed. Please call in your main file:\n"
                "`mlogger = await get_or_create_metric_logger(process_name='Controller')`\n"
                "`await mlogger.init_backends.call_one(logging_config)`\n"
            )
            return None
        fetcher = next(iter(self.fetchers.values()))  # all of them reach this process's one collector
        states = await fetcher.flush(global_step, return_state=return_state)
        return states if return_state else None

    @endpoint
    async def shutdown(self) -> None:
        """End this process's recording cleanly (and wait for the sidecar, on rank 0)."""
        await MetricCollector().shutdown()

    @endpoint
    async def has_fetcher(self, proc_id: str | None) -> bool:
        """Whether a fetcher is registered under ``proc_id``."""
        return proc_id in self.fetchers

    @endpoint
    async def get_fetcher_count(self) -> int:
        """How many fetchers are registered: 1 in a process that called
        ``get_or_create_metric_logger`` (0 with ``FORGE_DISABLE_METRICS=true``), plus those
        registered by hand."""
        return len(self.fetchers)
