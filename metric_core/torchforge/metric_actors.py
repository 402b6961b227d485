"""torchforge's ``forge.observability.metric_actors`` for one process per rank, without monarch.

In torchforge a controller spawns a ``GlobalLoggingActor`` and a fetcher per process
mesh, and ``flush`` gathers every rank's states. Here every rank runs the same script
(torchrun, SLURM): each calls ``get_or_create_metric_logger`` and drives its own rank,
and the global reduction is computed from the files every rank writes, live by the
sidecar on rank 0 and offline by ``metriclog reduce``/``upload``. The endpoints are
awaited as torchforge's are, ``await mlogger.flush.call_one(step)``, or directly,
``await mlogger.flush(step)``.
"""

from __future__ import annotations

import logging
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

    ``process_name`` names this process's source in the run (default: ``METRICLOG_PROCESS``
    or the script's name). ``proc_mesh`` is monarch's: here each process of a job calls
    this function itself, so a mesh given is ignored, with a warning.

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
    """
    global _global_logger
    if proc_mesh is not None:
        logger.warning(
            "get_or_create_metric_logger(proc_mesh=...): metric_core.torchforge runs in each process of the "
            "job; call it in each process instead (the mesh is ignored)"
        )
    if _global_logger is None:
        _global_logger = GlobalLoggingActor()
    if not FORGE_DISABLE_METRICS.get_value():
        name = _global_logger.fetchers.setdefault("local", process_name or default_process_name())
        metrics.process_name = name  # what context() and get_proc_name_with_rank() say from now on
    return _global_logger


class GlobalLoggingActor:
    """The metric logger of this process: ``init_backends``, ``flush``, ``shutdown``.

    Configs are torchforge's: ``{"wandb": {"logging_mode": "global_reduce", "project":
    "p"}, "console": {"logging_mode": "per_rank_reduce"}}``.
    """

    def __init__(self) -> None:
        self.fetchers: dict[str, str] = {}  # "local" -> this process's name, once registered
        self.config: dict[str, Any] | None = None

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
        return {**config, "logging_mode": mode, "per_rank_share_run": share_run}

    @endpoint
    async def init_backends(self, config: dict[str, Any], global_step: int = 0) -> None:
        """Start recording this process into ``METRICLOG_DIR`` with ``config``'s backends
        (none with ``FORGE_DISABLE_METRICS=true``); ``global_step``: the step to resume from."""
        self.config = {}
        if FORGE_DISABLE_METRICS.get_value():
            return
        for backend_name, backend_config in config.items():
            self.config[backend_name] = self._validate_backend_config(backend_name, backend_config)
        await MetricCollector().init_backends(
            None, self.config, global_step, process_name=self.fetchers.get("local")
        )

    @endpoint
    async def flush(self, global_step: int, return_state: bool = False) -> dict[str, dict[str, Any]] | None:
        """End step ``global_step`` of this process; with ``return_state``, its accumulator
        states (``reduce_metrics_states`` merges those of several processes)."""
        if self.config is None:
            logger.warning(
                "Cannot flush collected metrics. GlobalLoggingActor.flush() called before init_backends()."
                " No backends will be flushed. Please call in your main file:\n"
                "`mlogger = await get_or_create_metric_logger(process_name='Controller')`\n"
                "`await mlogger.init_backends.call_one(logging_config)`\n"
            )
            return None
        if not self.fetchers:  # FORGE_DISABLE_METRICS: nothing was set up, nothing to flush
            return None
        states = await MetricCollector().flush(global_step, return_state=return_state)
        return states if return_state else None

    @endpoint
    async def shutdown(self) -> None:
        """End this process's recording cleanly (and wait for the sidecar, on rank 0)."""
        await MetricCollector().shutdown()

    @endpoint
    async def has_fetcher(self, proc_id: str | None) -> bool:
        return proc_id in self.fetchers
