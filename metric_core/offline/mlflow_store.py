"""Which MLflow tracking store a command uses: the one given (``--tracking-uri``), else
``MLFLOW_TRACKING_URI``, else ``sqlite:///mlruns.db`` in the current directory (never
MLflow's ``./mlruns`` file store, which MLflow 3.17 and later refuse without
``MLFLOW_ALLOW_FILE_STORE=true``). ``upload --to mlflow`` writes there, ``import`` reads."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_STORE = "mlruns.db"  # in the current directory, as sqlite:///mlruns.db


def tracking_uri(given: str | None) -> str:
    """The store's URI, a SQLite file named relative to here named absolute (so what
    identifies a store does not depend on where the command was started).

    >>> tracking_uri("sqlite:////tmp/x.db"), tracking_uri("http://mlflow:5000")
    ('sqlite:////tmp/x.db', 'http://mlflow:5000')
    """
    uri = given or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{DEFAULT_STORE}"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = "sqlite:///" + str(Path(uri.removeprefix("sqlite:///")).resolve())
    return uri
