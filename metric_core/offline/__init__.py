"""The offline side: what ``metriclog`` runs over a run directory.

Data flow: ``read`` (a run directory -> one lazy frame in the record schema, plus a
health report) -> ``plan`` (what to compute) -> ``engine`` (computes a plan) -> the
command's output, ``inspect`` (per-source health and a verdict), ``plot``, or
``upload`` (W&B runs planned from a reduction, then sent with a ledger).
"""
