"""Shared fixtures: runs written by the real writer, and raw values for ground truth."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from metric_core import Metric, MetricCollector, Reduce

BASE_TIME = 1_760_000_000.0
# A key recorded with each reduction (the live-path tests' data).
ONE_KEY_PER_REDUCTION = (
    ("m", Reduce.MEAN),
    ("s", Reduce.SUM),
    ("x", Reduce.MAX),
    ("n", Reduce.MIN),
    ("d", Reduce.STD),
)

os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(autouse=True)
def _no_global_collector():
    """Every test starts and ends without a module-level collector."""
    import metric_core

    yield
    metric_core.shutdown()


def write_collector_run(
    run_dir: Path,
    sources: list[tuple[str, int]],
    *,
    steps: int = 20,
    file_format: str = "parquet",
    seed: int = 0,
    shutdown: bool | None = True,
    segment_records: int = 1_000_000,
    first_step: int = 0,
) -> list[dict]:
    """Write a run with one MetricCollector per source; return every raw record written.

    ``shutdown``: True ends cleanly, False uncleanly (sealed, no end marker), None not at
    all (the last segment stays a journal, as after a kill).

    Each source records keys with several values per step, some keys only on some steps,
    with known timestamps (about one step per second, sources slightly apart).
    """
    rng = np.random.default_rng(seed)
    truth: list[dict] = []
    for process, rank in sources:
        c = MetricCollector(
            run_dir,
            rank=rank,
            process_name=process,
            file_format=file_format,
            segment_records=segment_records,
            step=first_step,
        )
        for step in range(first_step, first_step + steps):
            for key, red, n in (
                ("trainer/loss", Reduce.MEAN, 3),
                ("trainer/grad_norm", Reduce.MAX, 2),
                ("policy/tokens", Reduce.SUM, 4),
                ("policy/latency_s", Reduce.STD, 5),
            ):
                if key == "policy/tokens" and step % 3 == rank % 3:
                    continue  # missing on some steps
                for _ in range(n):
                    value = float(rng.normal(1e8 if red is Reduce.STD else 0.0, 1.0))
                    ts = BASE_TIME + step * 1.0 + float(rng.uniform(0.0, 0.9)) + rank * 0.01
                    c.push(Metric(key, value, red, ts))
                    truth.append(
                        {
                            "process": process,
                            "rank": rank,
                            "step": step,
                            "key": key,
                            "value": value,
                            "reduction": red.value,
                            "timestamp": ts,
                        }
                    )
            c.flush(step)
        if shutdown:
            c.shutdown()
        elif shutdown is False:
            c._close_unclean()
        else:
            abandon(c)
    return truth


def abandon(c: MetricCollector) -> None:
    """Leave a collector as a SIGKILL would after its last flush: its journal open, unsealed."""
    c._stop.set()
    c._thread.join(timeout=5)
    c._closed = True
    os.close(c._writer._fd)
