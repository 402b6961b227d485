"""``metriclog``, the command line (installed as the package ``metriclog``)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("metriclog")
except PackageNotFoundError:  # run from a checkout that was not installed
    __version__ = "unknown"
