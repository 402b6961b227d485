"""SIGKILL a writing process at random moments; nothing a returned flush covered is lost.

The child records value i for i = 0, 1, 2, ... and reports on stdout: "F i" after a
flush returned (records < i are covered), "R i t" when records < i were recorded by
time t. Segments are tiny, so kills land during sealing and rotation too.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from metric_core import scan_run

FLUSH_INTERVAL = 0.1

CHILD = """
import sys, time
import metric_core
run_dir, fmt = sys.argv[1], sys.argv[2]
metric_core.init(run_dir, rank=0, process_name="worker", file_format=fmt,
                 segment_records=700, flush_interval=%(interval)r)
print("READY", flush=True)
i, step = 0, 0
while True:
    for _ in range(97 + step %% 89):
        metric_core.record_metric("k%%d" %% (i %% 5), float(i))
        i += 1
    if step %% 3 == 0:
        metric_core.flush(step)
        print("F", i, time.time(), flush=True)
    else:
        print("R", i, time.time(), flush=True)
    step += 1
    if step %% 7 == 0:
        time.sleep(0.003)
""" % {"interval": FLUSH_INTERVAL}


def kill_at_random(run_dir: Path, fmt: str, delay: float) -> tuple[int, int]:
    """Run the child, SIGKILL it after ``delay`` seconds; return (flushed, old_enough)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(run_dir), fmt], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "READY"
    time.sleep(delay)
    os.kill(proc.pid, signal.SIGKILL)
    killed_at = time.time()
    out = proc.stdout.read()
    proc.wait()
    flushed, old_enough = 0, 0
    for line in out.splitlines():
        parts = line.split()
        if len(parts) != 3:
            continue  # a line cut by the kill
        kind, count, when = parts[0], int(parts[1]), float(parts[2])
        if kind == "F":
            flushed = max(flushed, count)
        # The writer thread runs every FLUSH_INTERVAL; allow it generous scheduling slack.
        if when < killed_at - FLUSH_INTERVAL - 0.4:
            old_enough = max(old_enough, count)
    return flushed, old_enough


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_sigkill_at_random_moments_loses_and_duplicates_nothing(tmp_path, fmt):
    rng = random.Random(1234 if fmt == "parquet" else 4321)
    for attempt in range(10):
        run_dir = tmp_path / f"kill{attempt}"
        flushed, old_enough = kill_at_random(run_dir, fmt, delay=rng.uniform(0.05, 1.2))
        scan = scan_run(run_dir)
        assert not scan.report.unreadable_files, scan.report.summary()
        values = np.sort(scan.frame.collect()["value"].to_numpy())
        context = f"attempt {attempt}: {len(values)} read, flushed {flushed}, old enough {old_enough}"
        # Exactly once, and a prefix: the only records lost are the newest ones.
        np.testing.assert_array_equal(values, np.arange(len(values), dtype=float), err_msg=context)
        assert len(values) >= flushed, context
        assert len(values) >= old_enough, context


def test_a_kill_between_rename_and_unlink_does_not_duplicate(tmp_path):
    """Simulate the one window the seal leaves: sealed file renamed, journal not yet removed."""
    from metric_core import MetricCollector

    c = MetricCollector(tmp_path, rank=0, process_name="w", segment_records=10)
    for i in range(25):
        c.record("k", float(i))
    c.flush(0)
    journals = sorted(tmp_path.glob("*.journal"))
    saved = {p: p.read_bytes() for p in journals}
    c.shutdown()  # seals them
    for path, data in saved.items():  # put the superseded journals back
        path.write_bytes(data)
    scan = scan_run(tmp_path)
    values = sorted(scan.frame.collect()["value"].to_list())
    assert values == [float(i) for i in range(25)]
    superseded = [f for f in scan.report.files if f.superseded_by]
    assert {f.path for f in superseded} == set(saved)
