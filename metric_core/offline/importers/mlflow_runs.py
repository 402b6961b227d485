"""MLflow runs, by tracking URI and experiment or run id: ``MlflowClient.get_metric_history``
per key, every value with its step and time (milliseconds, as MLflow keeps it). Each run
is a source named for the run, rank 0 (or its ``rank`` tag, an integer); the params of a
single run become the config. MLflow's SQL store keeps +-inf as +-1.7976931348623157e308
(float64's largest): they come back as those numbers, not as infinities.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from metric_core.errors import MissingDependencyError, SourceError
from metric_core.offline.importers.source import Importer, Item, Stream, Warn
from metric_core.offline.mlflow_store import tracking_uri as store_uri


class MlflowImporter(Importer):
    kind = "mlflow"

    def __init__(
        self, warn: Warn, tracking_uri: str | None, experiment: str | None, run_id: str | None
    ) -> None:
        super().__init__(warn)
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise MissingDependencyError(
                "importing MLflow runs needs the MLflow client: pip install 'metriclog[mlflow]'"
            ) from None
        if (experiment is None) == (run_id is None):
            raise SourceError("importing from MLflow takes --experiment NAME or --run-id ID (one of them)")
        self.uri = store_uri(tracking_uri)
        self.client = MlflowClient(tracking_uri=self.uri)
        try:
            if run_id is not None:
                self.runs = [self.client.get_run(run_id)]
                self.name = self.runs[0].info.run_name or run_id
                self.config = dict(self.runs[0].data.params)
            else:
                found = self.client.get_experiment_by_name(str(experiment))
                if found is None:
                    raise SourceError(f"{self.uri}: no MLflow experiment named '{experiment}'")
                self.runs = self.client.search_runs(
                    [found.experiment_id], order_by=["attributes.start_time ASC"]
                )
                self.name = str(experiment)
        except SourceError:
            raise
        except Exception as exc:  # MlflowException: a run that does not exist, a store it cannot open
            raise SourceError(f"{self.uri}: {str(exc).splitlines()[0]}") from None
        if not self.runs:
            raise SourceError(f"{self.uri}: the experiment '{experiment}' holds no run")

    def identity(self) -> dict[str, Any]:
        return {"kind": self.kind, "runs": sorted(r.info.run_id for r in self.runs)}

    def streams(self) -> Iterator[Stream]:
        names = [r.info.run_name or r.info.run_id for r in self.runs]
        for run, name in zip(self.runs, names, strict=True):
            process = name if names.count(name) == 1 else f"{name}-{run.info.run_id}"
            rank = run.data.tags.get("rank", "0")
            yield Stream(process, int(rank) if rank.isdigit() else 0, self._items(run))

    def _items(self, run: Any) -> Iterator[Item]:
        for key in sorted(run.data.metrics):
            for m in self.client.get_metric_history(run.info.run_id, key):
                yield (int(m.step), key, float(m.value), m.timestamp / 1000)
