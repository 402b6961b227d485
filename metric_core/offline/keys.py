"""What a run holds, key by key: ``list_keys`` (``metriclog keys``).

One pass over the records (no file keeps per-key counts): every key with the reduction
its records are kept under, how many records, from how many sources, its first and last
step and time, and how many of its values are NaN or infinite.
"""

from __future__ import annotations

import os

import polars as pl

from metric_core.offline.read import OnRead, scan_run


def list_keys(
    run: str | os.PathLike[str],
    *,
    follow_symlinks: bool = False,
    attempts: str = "rewind",
    on_read: OnRead | None = None,
) -> pl.DataFrame:
    """A row a key: ``key``, ``reductions``, ``records``, ``sources``, ``first_step``,
    ``last_step``, ``first_time``, ``last_time`` (epoch seconds), ``nonfinite``, as a
    polars DataFrame sorted by key. Reads every record once (the counts of non-finite
    values need them). Raises ``NoDataError`` for a run without a readable record.

    >>> list_keys("sample_logs/rl_run").select("key", "reductions", "records", "sources").row(0)
    ('policy/latency_s', 'mean', 3840, 2)
    """
    scan = scan_run(run, follow_symlinks=follow_symlinks, attempts=attempts)
    try:
        keys = (
            scan.frame.group_by("key")
            .agg(
                reductions=pl.col("reduction").unique().sort().str.join(","),
                records=pl.len(),
                sources=pl.struct("process", "rank").n_unique(),
                first_step=pl.col("step").min(),
                last_step=pl.col("step").max(),
                first_time=pl.col("timestamp").min(),
                last_time=pl.col("timestamp").max(),
                nonfinite=(~pl.col("value").is_finite()).sum(),
            )
            .sort("key")
            .collect(engine="streaming")
        )
    finally:
        if on_read is not None:
            on_read(scan.report)
    return keys
