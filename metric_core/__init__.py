"""metric_core: record metrics in every rank, crash-safely, and reduce them offline.

The package has three floors, and the folders show them:

* the ground floor (``schema``, ``segment``, ``journal``, ``records``, ``metric``,
  ``errors``, ``atomic``): the record, the files' metadata and the journal codec,
  ``Reduce``/``LoggingMode``/``Metric`` and their accumulators; both sides use it;
* ``writer/``: what a training rank imports (the collector, the module-level API,
  segment writing, live backends). It never loads polars, wandb, matplotlib or typer;
* ``offline/``: what ``metriclog`` runs after (or beside) the job: reading a run
  directory, planning and executing reductions, inspecting, plotting, uploading.

The public names below are loaded on first use, so a training process that only calls
``init``/``record_metric`` never imports the offline side, and a command that only
reads runs never imports the writer.

>>> from metric_core import Reduce, record_metric
>>> Reduce.MAX.value
'max'
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The public API, by the module that defines each name: the one list of it.
_EXPORTS = {
    # writer side
    "init": "metric_core.writer.api",
    "record_metric": "metric_core.writer.api",
    "flush": "metric_core.writer.api",
    "aflush": "metric_core.writer.api",
    "shutdown": "metric_core.writer.api",
    "get_collector": "metric_core.writer.api",
    "start_sidecar": "metric_core.writer.sidecar",
    "record_exception": "metric_core.writer.ends",
    "record": "metric_core.writer.ends",
    "MetricCollector": "metric_core.writer.collector",
    "LoggerBackend": "metric_core.writer.backends",
    # ground floor
    "LoggingMode": "metric_core.metric",
    "Metric": "metric_core.metric",
    "Reduce": "metric_core.metric",
    "reduce_metrics_states": "metric_core.metric",
    "MetricLogError": "metric_core.errors",
    "WriteError": "metric_core.errors",
    "DiskFullError": "metric_core.errors",
    "RunDirGoneError": "metric_core.errors",
    "RecordsDroppedError": "metric_core.errors",
    "NonFiniteError": "metric_core.errors",
    "MetricLogWarning": "metric_core.errors",
    # offline side
    "scan_run": "metric_core.offline.read",
    "RunScan": "metric_core.offline.read",
    "ReadReport": "metric_core.offline.read",
    "make_plan": "metric_core.offline.plan",
    "ReducePlan": "metric_core.offline.plan",
    "By": "metric_core.offline.plan",
    "Engine": "metric_core.offline.plan",
    "reduce_run": "metric_core.offline.engine",
    "execute": "metric_core.offline.engine",
    "inspect_run": "metric_core.offline.inspect",
    "InspectReport": "metric_core.offline.inspect",
    "plot_run": "metric_core.offline.plot",
    "upload_run": "metric_core.offline.upload",
    "read_samples": "metric_core.offline.samples",
    "list_keys": "metric_core.offline.keys",
    "write_result": "metric_core.offline.results",
    "select_samples": "metric_core.offline.samples",
    "Follow": "metric_core.offline.upload",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # the same names, for type checkers
    from metric_core.errors import (
        DiskFullError,
        MetricLogError,
        MetricLogWarning,
        NonFiniteError,
        RecordsDroppedError,
        RunDirGoneError,
        WriteError,
    )
    from metric_core.metric import LoggingMode, Metric, Reduce, reduce_metrics_states
    from metric_core.offline.engine import execute, reduce_run
    from metric_core.offline.inspect import InspectReport, inspect_run
    from metric_core.offline.keys import list_keys
    from metric_core.offline.plan import By, Engine, ReducePlan, make_plan
    from metric_core.offline.plot import plot_run
    from metric_core.offline.read import ReadReport, RunScan, scan_run
    from metric_core.offline.results import write_result
    from metric_core.offline.samples import read_samples, select_samples
    from metric_core.offline.upload import Follow, upload_run
    from metric_core.writer.api import aflush, flush, get_collector, init, record_metric, shutdown
    from metric_core.writer.backends import LoggerBackend
    from metric_core.writer.collector import MetricCollector
    from metric_core.writer.ends import record, record_exception
    from metric_core.writer.sidecar import start_sidecar


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'metric_core' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
