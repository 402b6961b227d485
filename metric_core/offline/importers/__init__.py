"""``metriclog import``: runs other tools logged (TensorBoard, W&B offline, MLflow, CSV /
JSON lines / Parquet exports), written into a run directory in the record schema, so every
command reads them. The code is in ``run`` (the entry point), ``write`` (through the
writer's own segments), ``framing`` (checksummed record framings) and one module per source.
"""

from metric_core.offline.importers.run import ImportResult, import_source

__all__ = ["ImportResult", "import_source"]
