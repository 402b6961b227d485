"""torchforge's observability API over metric_core: change one import line.

``from forge.observability import record_metric, Reduce, get_or_create_metric_logger``
becomes ``from metric_core.torchforge import ...``; ``forge.observability.metrics``,
``.metric_actors``, ``.perf_tracker`` and ``.utils`` are ``metric_core.torchforge.metrics``,
``.metric_actors``, ``.perf_tracker`` and ``.utils``. Every value is also written to the
run directory (``METRICLOG_DIR``, else one named from the launcher's job id), so
``metriclog`` can reduce, upload, inspect and plot it later. docs/compat.md says what
differs from torchforge, and why.
"""

from metric_core.torchforge import metrics
from metric_core.torchforge.metric_actors import (
    GlobalLoggingActor,
    LocalFetcherActor,
    get_or_create_metric_logger,
)
from metric_core.torchforge.metrics import *  # noqa: F403 - forge.observability's names, as it exports them
from metric_core.torchforge.perf_tracker import Tracer, trace

__all__ = ["GlobalLoggingActor", "LocalFetcherActor", "Tracer", "get_or_create_metric_logger", "trace"]
__all__ += metrics.__all__
