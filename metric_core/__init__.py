"""metric_core: record metrics in every rank, crash-safely, and reduce them offline.

>>> import metric_core
>>> from metric_core import Reduce, record_metric
"""

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
from metric_core.errors import MetricLogError
from metric_core.metric import LoggingMode, Metric, Reduce, reduce_metrics_states
from metric_core.reader import ReadReport, RunScan, scan_run

__all__ = [
    "LoggerBackend",
    "LoggingMode",
    "Metric",
    "MetricCollector",
    "MetricLogError",
    "ReadReport",
    "Reduce",
    "RunScan",
    "aflush",
    "flush",
    "get_collector",
    "init",
    "record_metric",
    "reduce_metrics_states",
    "scan_run",
    "shutdown",
]
