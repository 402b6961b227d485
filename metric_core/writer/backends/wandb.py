"""Live Weights & Biases backend, as in torchforge (wandb is imported only here).

* PER_RANK_REDUCE: one W&B run per process, ``{group}_{process}``, in group ``group``;
  each flush logs the reduced values with ``step`` as the x-axis.
* PER_RANK_NO_REDUCE: every raw record, with ``step`` and its own ``_timestamp``,
  from the writer thread (never from the training thread).
* ``per_rank_share_run``: every process logs into one shared run (W&B shared mode)
  under keys ``{key}/{process}``; the run id comes from ``run_id`` in the config or
  from the primary's ``get_metadata_for_secondary_ranks()``.

The global reduction is never computed live: ``metriclog upload`` computes it from
the raw files.
"""

from __future__ import annotations

from typing import Any

from metric_core.errors import ConfigError, MissingDependencyError
from metric_core.metric import BackendRole, LoggingMode, Metric
from metric_core.writer.backends import LoggerBackend


class WandbBackend(LoggerBackend):
    """Config keys: project, entity, group, name, dir, mode, config, per_rank_share_run, run_id."""

    def __init__(self, logger_backend_config: dict[str, Any]) -> None:
        super().__init__(logger_backend_config)
        self.share = bool(self.logger_backend_config.get("per_rank_share_run", False))
        self.run: Any = None
        self.process_name = "rank0"

    async def init(
        self,
        role: BackendRole,
        primary_logger_metadata: dict[str, Any] | None = None,
        process_name: str | None = None,
    ) -> None:
        try:
            import wandb
        except ImportError as exc:  # pragma: no cover - wandb is a dependency
            raise MissingDependencyError(
                "the wandb backend needs the wandb package: pip install wandb"
            ) from exc
        cfg = self.logger_backend_config
        self.process_name = process_name or self.process_name
        group = cfg.get("group") or cfg.get("name") or "metriclog"
        common: dict[str, Any] = {
            "project": cfg.get("project"),
            "entity": cfg.get("entity"),
            "group": group,
            "dir": cfg.get("dir"),
            "mode": cfg.get("mode"),
            "config": cfg.get("config"),
            "reinit": "create_new",  # several collectors in one process each get their own run
        }
        if self.share:
            run_id = (primary_logger_metadata or {}).get("shared_run_id") or cfg.get("run_id")
            if not run_id:
                raise ConfigError(
                    "wandb backend: per_rank_share_run needs a shared run id; set 'run_id' in "
                    "the wandb backend config (the same on every process)"
                )
            settings = wandb.Settings(
                mode="shared", x_primary=role is BackendRole.GLOBAL, x_label=self.process_name
            )
            self.run = wandb.init(id=run_id, name=cfg.get("name") or group, settings=settings, **common)
        else:
            self.run = wandb.init(name=f"{group}_{self.process_name}", **common)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def _key(self, key: str) -> str:
        return f"{key}/{self.process_name}" if self.share else key

    async def log_batch(self, metrics: list[Metric], global_step: int) -> None:
        if self.logging_mode is not LoggingMode.PER_RANK_REDUCE or not metrics:
            return
        row: dict[str, Any] = {self._key(m.key): m.value for m in metrics}
        row["step"] = global_step
        self.run.log(row)

    def log_stream(self, metric: Metric, global_step: int) -> None:
        step = global_step if metric.step is None else metric.step
        self.run.log({self._key(metric.key): metric.value, "step": step, "_timestamp": metric.timestamp})

    def get_metadata_for_secondary_ranks(self) -> dict[str, Any] | None:
        return {"shared_run_id": self.run.id} if self.share and self.run is not None else None

    async def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
