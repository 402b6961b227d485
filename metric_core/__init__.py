"""metric_core: record metrics in every rank, crash-safely, and reduce them offline.

>>> from metric_core import Reduce, record_metric

Names are loaded on first use, so a command that only reads runs never imports the
writer (and a training process never imports the reader's or wandb's dependencies).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LoggerBackend": "metric_core.backends",
    "MetricCollector": "metric_core.collector",
    "aflush": "metric_core.collector",
    "flush": "metric_core.collector",
    "get_collector": "metric_core.collector",
    "init": "metric_core.collector",
    "record_metric": "metric_core.collector",
    "shutdown": "metric_core.collector",
    "MetricLogError": "metric_core.errors",
    "DiskFullError": "metric_core.errors",
    "MetricLogWarning": "metric_core.errors",
    "RecordsDroppedError": "metric_core.errors",
    "RunDirGoneError": "metric_core.errors",
    "WriteError": "metric_core.errors",
    "LoggingMode": "metric_core.metric",
    "Metric": "metric_core.metric",
    "Reduce": "metric_core.metric",
    "reduce_metrics_states": "metric_core.metric",
    "ReadReport": "metric_core.reader",
    "RunScan": "metric_core.reader",
    "scan_run": "metric_core.reader",
    "reduce_run": "metric_core.reduce",
}

__all__ = [
    "DiskFullError",
    "LoggerBackend",
    "LoggingMode",
    "Metric",
    "MetricCollector",
    "MetricLogError",
    "MetricLogWarning",
    "ReadReport",
    "RecordsDroppedError",
    "Reduce",
    "RunDirGoneError",
    "RunScan",
    "WriteError",
    "aflush",
    "flush",
    "get_collector",
    "init",
    "record_metric",
    "reduce_metrics_states",
    "reduce_run",
    "scan_run",
    "shutdown",
]

if TYPE_CHECKING:
    from metric_core.backends import LoggerBackend
    from metric_core.collector import (
        MetricCollector,
        aflush,
        flush,
        get_collector,
        init,
        record_metric,
        shutdown,
    )
    from metric_core.errors import (
        DiskFullError,
        MetricLogError,
        MetricLogWarning,
        RecordsDroppedError,
        RunDirGoneError,
        WriteError,
    )
    from metric_core.metric import LoggingMode, Metric, Reduce, reduce_metrics_states
    from metric_core.reader import ReadReport, RunScan, scan_run
    from metric_core.reduce import reduce_run


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'metric_core' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
