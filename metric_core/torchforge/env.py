"""The environment variables of ``metric_core.torchforge``, as torchforge's ``forge.env`` names them.

* ``FORGE_DISABLE_METRICS=true``: ``record_metric`` does nothing, and
  ``get_or_create_metric_logger``'s ``init_backends`` starts nothing; ``Tracer`` and
  ``trace`` time nothing.
* ``DISABLE_PERF_METRICS=true``: ``Tracer`` and ``trace`` (``perf_tracker``) time nothing
  and record nothing; ``record_metric`` still records.
* ``METRIC_TIMER_USES_GPU``: ``true`` makes every ``Tracer`` time with CUDA events (where
  CUDA is available), ``false`` with the CPU clock, whatever its ``timer`` says; unset,
  each ``Tracer`` follows its ``timer``.
* ``METRICLOG_DIR``: the run directory. With it set, a process that records without
  ``init_backends`` starts recording there by itself (docs/compat.md).
* ``METRICLOG_PROCESS``: the process name of such a process (default: its script's name).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass
class EnvVar:
    """An environment variable, its default and what it does (torchforge's ``EnvVar``)."""

    name: str
    default: Any
    description: str

    def get_value(self) -> Any:
        """The variable's value converted to the default's type, or the default when unset.

        >>> EnvVar("METRICLOG_DOCTEST_UNSET", False, "").get_value()
        False
        """
        value = os.environ.get(self.name)
        if value is None:
            return self.default
        if isinstance(self.default, bool):
            return value.lower() in ("true", "1", "yes")
        return type(self.default)(value) if self.default is not None else value


FORGE_DISABLE_METRICS = EnvVar(
    name="FORGE_DISABLE_METRICS",
    default=False,
    description="Makes record_metric a no-op and init_backends start nothing",
)

DISABLE_PERF_METRICS = EnvVar(
    name="DISABLE_PERF_METRICS",
    default=False,
    description="Makes Tracer and trace (metric_core.torchforge.perf_tracker) time and record nothing",
)

# None, not False: unset means "each Tracer's own timer", which neither boolean says.
METRIC_TIMER_USES_GPU = EnvVar(
    name="METRIC_TIMER_USES_GPU",
    default=None,
    description=(
        "Makes every Tracer time with CUDA events if true, with the CPU clock if false; "
        "unset, each Tracer follows its timer parameter"
    ),
)

METRICLOG_DIR = EnvVar(
    name="METRICLOG_DIR",
    default=None,
    description="The run directory; a process that records without init_backends starts recording there",
)

METRICLOG_PROCESS = EnvVar(
    name="METRICLOG_PROCESS",
    default=None,
    description="The process name of a process that starts recording by itself (default: its script's name)",
)
