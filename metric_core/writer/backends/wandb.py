"""Live Weights & Biases backend, as in torchforge (wandb is imported only here).

* PER_RANK_REDUCE: one W&B run per process, ``{name}_{process}`` (the name defaults to
  the group), in group ``group``; each flush logs the reduced values with ``step`` as the
  x-axis.
* PER_RANK_NO_REDUCE: every raw record, with ``step`` and its own ``_timestamp``,
  from the writer thread (never from the training thread).
* ``per_rank_share_run``: every process logs into one shared run (W&B shared mode)
  under keys ``{key}/{process}``; the run id comes from ``run_id`` in the config or
  from the primary's ``get_metadata_for_secondary_ranks()``.

The global reduction is not computed live in the ranks: ``metriclog upload`` computes it
from the raw files (``--follow`` while the job runs). A GLOBAL_REDUCE backend starts its
run only in the GLOBAL role, for a caller that merges states itself and calls
``log_batch``.
"""

from __future__ import annotations

import logging
from typing import Any

from metric_core.errors import ConfigError, MissingDependencyError
from metric_core.format.sample import number_of, to_json
from metric_core.metric import BackendRole, LoggingMode, Metric
from metric_core.writer.backends import LoggerBackend

logger = logging.getLogger(__name__)


def samples_table(samples: list[dict[str, Any]]) -> Any:
    """A ``wandb.Table`` of ``samples``: a column per field (their union, in the order first
    met), a row each."""
    columns = list(dict.fromkeys(str(name) for sample in samples for name in sample))
    table = _wandb().Table(columns=columns)
    for sample in samples:
        table.add_data(*(_cell(sample.get(c)) for c in columns))
    return table


def _cell(value: Any) -> Any:
    if isinstance(value, (list, dict)):
        return to_json(value)
    inner = number_of(value)
    return value if inner is None else inner


def _wandb() -> Any:
    try:
        import wandb
    except ImportError as exc:  # pragma: no cover - wandb is a dependency
        raise MissingDependencyError("the wandb backend needs the wandb package: pip install wandb") from exc
    return wandb


class WandbBackend(LoggerBackend):
    """A W&B run per process (or one shared run). Config: ``logging_mode``,
    ``per_rank_share_run``, ``run_id`` (the shared run's id), and any argument of
    ``wandb.init`` (project, entity, group, name, tags, notes, dir, mode, config, ...),
    which reaches ``wandb.init`` as given, as in torchforge."""

    def __init__(self, logger_backend_config: dict[str, Any] | None = None, /, **kwargs: Any) -> None:
        super().__init__(logger_backend_config, **kwargs)
        self.share = self.per_rank_share_run
        self.run: Any = None
        self.process_name = "rank0"

    @property
    def project(self) -> str | None:
        return self.backend_kwargs.get("project")

    @property
    def group(self) -> str:
        """The W&B group of the runs: ``group``, else ``name``, else ``metriclog``."""
        return self.backend_kwargs.get("group") or self.backend_kwargs.get("name") or "metriclog"

    async def init(
        self,
        role: BackendRole,
        controller_logger_metadata: dict[str, Any] | None = None,
        process_name: str | None = None,
    ) -> None:
        """torchforge's roles: a GLOBAL_REDUCE backend starts its run in the GLOBAL role only
        (in a LOCAL one it does nothing, and says so); per-rank runs start in the LOCAL role,
        named ``{name}_{process}``; a shared run's primary starts it in the GLOBAL role."""
        self.process_name = process_name or self.process_name
        kwargs = dict(self.backend_kwargs)
        run_name = kwargs.pop("name", None) or kwargs.get("group")
        if self.logging_mode is LoggingMode.GLOBAL_REDUCE:
            if role is not BackendRole.GLOBAL:
                logger.warning("WandbBackend: skipped init for GLOBAL_REDUCE mode and %s role", role)
                return
            await self._init_global(run_name)
        elif role is BackendRole.GLOBAL and self.share:
            await self._init_shared_global(run_name)
        elif role is BackendRole.LOCAL:
            name = f"{run_name}_{self.process_name}" if run_name else self.process_name
            if self.share:
                shared_id = (controller_logger_metadata or {}).get("shared_run_id") or kwargs.get("run_id")
                if not shared_id:
                    raise ConfigError(
                        "wandb backend: per_rank_share_run needs a shared run id; set 'run_id' in "
                        "the wandb backend config (the same on every process)"
                    )
                await self._init_shared_local(name, shared_id, self.process_name)
            else:
                await self._init_per_rank(name)
        if self.run is not None:
            self.run.define_metric("step")
            self.run.define_metric("*", step_metric="step")

    async def _init_global(self, run_name: str | None) -> None:
        self.run = self._wandb_init(run_name)

    async def _init_per_rank(self, run_name: str) -> None:
        self.run = self._wandb_init(run_name)

    async def _init_shared_global(self, run_name: str | None) -> None:
        wandb = _wandb()
        settings = wandb.Settings(mode="shared", x_primary=True, x_label="controller_primary")
        self.run = self._wandb_init(run_name, id=self.backend_kwargs.get("run_id"), settings=settings)

    async def _init_shared_local(self, run_name: str, shared_id: str, process_name: str) -> None:
        wandb = _wandb()
        settings = wandb.Settings(mode="shared", x_primary=False, x_label=process_name)
        shared_name = self.backend_kwargs.get("name") or self.backend_kwargs.get("group") or run_name
        self.run = self._wandb_init(shared_name, id=shared_id, settings=settings)

    def _wandb_init(self, name: str | None, **more: Any) -> Any:
        """``wandb.init`` with every setting of the config, the group defaulting to the name."""
        wandb = _wandb()
        kwargs = {k: v for k, v in self.backend_kwargs.items() if k not in ("name", "run_id")}
        kwargs["group"] = self.group
        kwargs.setdefault("reinit", "create_new")  # several collectors in one process: a run each
        try:
            return wandb.init(name=name, **kwargs, **more)
        except TypeError as exc:
            if "unexpected keyword argument" not in str(exc):
                raise
            raise ConfigError(f"wandb backend config: {exc} (the config's keys go to wandb.init)") from None

    def _key(self, key: str) -> str:
        return f"{key}/{self.process_name}" if self.share else key

    async def log_batch(self, metrics: list[Metric], global_step: int) -> None:
        if self.run is None or not metrics:
            return
        row: dict[str, Any] = {self._key(m.key): m.value for m in metrics}
        row["step"] = global_step
        self.run.log(row)

    async def log_samples(self, samples: list[Metric], step: int) -> None:
        """Each key's chosen samples as a ``wandb.Table`` (columns: the union of their fields;
        lists and dicts as JSON text), logged with the step."""
        if self.run is None:
            return
        row: dict[str, Any] = {self._key(m.key): samples_table(m.value) for m in samples if m.value}
        if row:
            row["step"] = step
            self.run.log(row)

    def log_stream(self, metric: Metric, global_step: int) -> None:
        step = global_step if metric.step is None else metric.step
        self.run.log({self._key(metric.key): metric.value, "step": step, "_timestamp": metric.timestamp})

    def get_metadata_for_secondary_ranks(self) -> dict[str, Any] | None:
        return {"shared_run_id": self.run.id} if self.share and self.run is not None else {}

    async def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
