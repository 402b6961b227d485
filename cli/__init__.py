"""``metriclog``, the command line (installed as the package ``metriclog``); its entry
point is ``start.main``. Imports nothing: it loads before a stop is caught."""

from __future__ import annotations


def __getattr__(name: str) -> str:
    if name == "__version__":  # importlib.metadata costs a start-up; only --version needs it
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("metriclog")
        except PackageNotFoundError:  # run from a checkout that was not installed
            return "unknown"
    raise AttributeError(f"module 'metriclog' has no attribute '{name}'")
