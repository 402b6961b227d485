"""Live Weights & Biases backend, as in torchforge (wandb is imported only here).

* PER_RANK_REDUCE: one W&B run per process, ``{name}_{process}`` (the name defaults to
  the group), in group ``group``; each flush logs the reduced values with ``step`` as the
  x-axis.
* PER_RANK_NO_REDUCE: every raw record, with ``step`` and its own ``_timestamp``,
  from the writer thread (never from the training thread).
* ``per_rank_share_run``: every process logs into one shared run (W&B shared mode)
  under keys ``{key}/{process}``; the run id comes from ``run_id`` in the config or
  from the primary's ``get_metadata_for_secondary_ranks()``.

Samples (``Reduce.SAMPLE``) go as torchforge's PR #486 logs them: each key into one W&B
table in INCREMENTAL mode, logged as ``{key}_table`` (a key ending in ``_table`` as it
is), every log adding the rows since the last; at ``finish`` the rows are logged once more
as one IMMUTABLE table under the key itself, as W&B recommends for incremental tables.
Incremental tables need W&B Server 0.70 or later (wandb.ai has it).

The global reduction is not computed live in the ranks: ``metriclog upload`` computes it
from the raw files (``--follow`` while the job runs). A GLOBAL_REDUCE backend starts its
run only in the GLOBAL role, for a caller that merges states itself and calls
``log_batch``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from metric_core.errors import ConfigError, MissingDependencyError, warn
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


def table_key(key: str) -> str:
    """The key an incremental samples table is logged under: ``{key}_table``, as torchforge
    names it (W&B shows a table by its key's suffix, it says)."""
    return key if key.endswith("_table") else f"{key}_table"


class IncrementalTables:
    """Samples tables in W&B's INCREMENTAL mode, a key each, as torchforge's PR #486 keeps
    them: columns are the sorted fields of a key's first rows; each ``add`` logs the rows
    added since the last log; ``finals`` are the IMMUTABLE copies to log at the end."""

    def __init__(self) -> None:
        self.tables: dict[str, Any] = {}
        self._said: set[str] = set()

    def add(self, key: str, samples: list[dict[str, Any]], fields: Iterable[Any] | None = None) -> Any:
        """``samples`` added to ``key``'s table, made on first use with the sorted ``fields``
        (default: the fields of ``samples``) as its columns; the table, to log."""
        table = self.tables.get(key)
        if table is None:
            names = fields if fields is not None else (name for sample in samples for name in sample)
            columns = sorted({str(name) for name in names})
            table = self.tables[key] = _wandb().Table(
                columns=columns, log_mode="INCREMENTAL", allow_mixed_types=True
            )
        columns = table.columns
        for sample in samples:
            extra = [str(name) for name in sample if str(name) not in columns]
            if extra and key not in self._said:
                self._said.add(key)
                warn(
                    f"samples of '{key}': field(s) {', '.join(sorted(extra))} came after the W&B table's "
                    f"columns were set ({', '.join(columns)}); an incremental table cannot grow columns, so "
                    "W&B does not show them. Every field is on disk: `metriclog samples` lists them"
                )
            table.add_data(*(_cell(sample.get(c)) for c in columns))
        return table

    def finals(self) -> dict[str, Any]:
        """``{key: IMMUTABLE table}``: every row each incremental table took."""
        wandb = _wandb()
        return {
            key: wandb.Table(columns=t.columns, data=t.data, log_mode="IMMUTABLE", allow_mixed_types=True)
            for key, t in self.tables.items()
        }


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
        self._tables = IncrementalTables()
        self._samples_step: int | None = None  # the step samples were last logged at

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
        """Each key's samples added to its incremental table, logged as ``{key}_table`` with the
        step (columns: the sorted fields of its first samples; lists and dicts as JSON text)."""
        if self.run is None:
            return
        row: dict[str, Any] = {}
        for m in samples:
            rows = [m.value] if isinstance(m.value, dict) else list(m.value or ())
            if rows:
                key = self._key(m.key)
                row[table_key(key)] = self._tables.add(key, rows)
        if row:
            row["step"] = step
            self.run.log(row)
            self._samples_step = step

    def log_stream(self, metric: Metric, global_step: int) -> None:
        step = global_step if metric.step is None else metric.step
        self.run.log({self._key(metric.key): metric.value, "step": step, "_timestamp": metric.timestamp})

    def get_metadata_for_secondary_ranks(self) -> dict[str, Any] | None:
        return {"shared_run_id": self.run.id} if self.share and self.run is not None else {}

    async def finish(self) -> None:
        """Log each incremental samples table once more, whole and IMMUTABLE, under its key
        (torchforge's end of a run), then finish the run."""
        if self.run is not None:
            finals = self._tables.finals()
            if finals:
                self.run.log({**finals, "step": self._samples_step})
            self.run.finish()
            self.run = None
