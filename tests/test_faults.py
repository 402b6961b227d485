"""The writer under faults: a real file system that runs full, failing and half writes,
a deleted run directory, concurrent starts. A returned flush is read back exactly once,
a raised one is read back or counted as dropped, and nothing is read that was not written.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import metric_core
from metric_core import MetricCollector, scan_run
from metric_core.errors import (
    DiskFullError,
    MetricLogWarning,
    RecordsDroppedError,
    RunDirGoneError,
    WriteError,
)

FORMATS = ["parquet", "jsonl"]


@contextlib.contextmanager
def small_disk(path: Path, size: str = "16m"):
    """A real tmpfs of ``size`` mounted at ``path`` (root only)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(disk: Path) -> Path:
    """Fill the file system of ``disk`` to the last byte; the filler's path."""
    filler = disk / ".filler"
    with open(filler, "wb", buffering=0) as f:
        for size in (1 << 16, 1):
            with contextlib.suppress(OSError):
                while f.write(b"\0" * size):
                    pass
    return filler


def values_read(run_dir: Path) -> np.ndarray:
    scan = scan_run(run_dir)
    return scan.frame.select("value").collect()["value"].to_numpy(), scan


class Ledger:
    """What the test recorded, what flushes acknowledged, and what flushes refused."""

    def __init__(self) -> None:
        self.next = 0
        self.acknowledged: set[int] = set()
        self.refused: set[int] = set()
        self.since_flush: list[int] = []

    def record(self, n: int) -> None:
        for _ in range(n):
            metric_core.record_metric(f"k{self.next % 5}", float(self.next))
            self.since_flush.append(self.next)
            self.next += 1

    def flush(self, step: int) -> BaseException | None:
        try:
            metric_core.flush(step)
        except WriteError as exc:
            self.refused.update(self.since_flush)
            self.since_flush = []
            return exc
        self.acknowledged.update(self.since_flush)
        self.acknowledged.update(self.refused)  # a returned flush covers every earlier record
        self.refused.clear()
        self.since_flush = []
        return None

    def check(self, run_dir: Path, *, dropped_allowed: bool) -> None:
        values, scan = values_read(run_dir)
        got = values.astype(np.int64)
        assert np.array_equal(values, got), "a value that was never recorded"
        assert len(set(got.tolist())) == len(got), "a record read twice"
        assert set(got.tolist()) <= set(range(self.next)), "a value that was never recorded"
        missing = self.acknowledged - set(got.tolist())
        assert not missing, f"{len(missing)} acknowledged record(s) lost, e.g. {sorted(missing)[:5]}"
        lost = set(range(self.next)) - set(got.tolist())
        assert len(lost) == scan.report.dropped_records, "every record not read back is counted as dropped"
        if not dropped_allowed:
            assert not lost


@pytest.mark.parametrize("file_format", FORMATS)
def test_a_full_disk_loses_nothing_acknowledged_and_reads_back_no_garbage(tmp_path, file_format):
    with small_disk(tmp_path / "disk") as disk:
        run_dir = disk / "run"
        metric_core.init(
            run_dir, process_name="w", file_format=file_format, segment_records=3000, flush_interval=0.05
        )
        ledger = Ledger()
        errors = []
        step = 0
        for cycle in range(4):
            for _ in range(5):  # healthy steps
                ledger.record(1000)
                assert ledger.flush(step) is None
                step += 1
            filler = fill(disk)
            for _ in range(6):  # every flush now fails, and says why
                ledger.record(1000)
                errors.append(ledger.flush(step))
                step += 1
            filler.unlink()
            time.sleep(0.02 * cycle)  # the writer thread may or may not have retried meanwhile
        ledger.record(1000)
        assert ledger.flush(step) is None
        metric_core.shutdown()
        assert all(isinstance(e, DiskFullError) for e in errors[:5]), errors[:5]
        assert "disk full while writing" in str(errors[0]) and "kept in memory" in str(errors[0])
        ledger.check(run_dir, dropped_allowed=False)
        scan = scan_run(run_dir)
        assert scan.report.clean_shutdowns() == {("w", 0)}
        assert not scan.report.has_skips, scan.report.summary()


@pytest.mark.parametrize("file_format", FORMATS)
def test_past_the_memory_bound_records_are_dropped_counted_and_shown(tmp_path, file_format):
    with small_disk(tmp_path / "disk") as disk:
        run_dir = disk / "run"
        metric_core.init(
            run_dir, process_name="w", file_format=file_format, flush_interval=60, max_unwritten=2500
        )
        ledger = Ledger()
        ledger.record(100)
        assert ledger.flush(0) is None
        filler = fill(disk)
        for step in range(1, 6):
            ledger.record(1000)
            assert isinstance(ledger.flush(step), DiskFullError)
        filler.unlink()
        with pytest.raises(RecordsDroppedError, match=r"3,000 record\(s\) of w from steps 1-3 were dropped"):
            metric_core.flush(6)
        ledger.acknowledged.update(ledger.refused | set(ledger.since_flush))
        ledger.acknowledged -= set(range(100, 3100))  # the three oldest waiting steps
        ledger.refused.clear()
        metric_core.shutdown()
        ledger.check(run_dir, dropped_allowed=True)
        from metric_core.offline.inspect import inspect_run

        report = inspect_run(scan_run(run_dir))
        assert report.sources[0].dropped == 3000
        assert any(
            "recorded 3000 record(s) that its writer could not write" in line for line in report.verdict()
        )


def test_with_on_flush_error_warn_a_job_survives_a_full_disk(tmp_path):
    with small_disk(tmp_path / "disk") as disk:
        run_dir = disk / "run"
        metric_core.init(run_dir, process_name="w", on_flush_error="warn", flush_interval=60)
        ledger = Ledger()
        filler = fill(disk)
        ledger.record(500)
        with pytest.warns(MetricLogWarning, match="disk full while writing") as caught:
            metric_core.flush(0)
        assert caught[0].filename == __file__  # the warning points at the caller's line
        filler.unlink()
        ledger.record(500)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            metric_core.flush(1)
        metric_core.shutdown()
        values, _ = values_read(run_dir)
        assert sorted(values.astype(int).tolist()) == list(range(1000))


def test_a_full_disk_during_the_journal_header_leaves_a_readable_run(tmp_path):
    with small_disk(tmp_path / "disk") as disk:
        run_dir = disk / "run"
        run_dir.mkdir()
        filler = fill(disk)
        with pytest.warns(MetricLogWarning, match="run.json .No space left on device.: the run's name"):
            metric_core.init(run_dir, process_name="w", file_format="jsonl", flush_interval=60)
        ledger = Ledger()
        for step in range(3):
            ledger.record(100)
            assert isinstance(ledger.flush(step), DiskFullError)
        filler.unlink()
        for step in range(3, 6):
            ledger.record(100)
            assert ledger.flush(step) is None
        values, scan = values_read(run_dir)  # the open journal, as a kill would leave it
        assert sorted(values.astype(int).tolist()) == list(range(600))
        assert not scan.report.has_skips, scan.report.summary()
        metric_core.shutdown()


class FailingWrites:
    """``os.write`` on journals fails as the test says: the n-th call raises ENOSPC, or
    writes half of what it was given and the next call raises."""

    def __init__(self, monkeypatch) -> None:
        self.real = os.write
        self.calls = 0
        self.plan: dict[int, str] = {}
        monkeypatch.setattr(os, "write", self)

    def __call__(self, fd: int, data) -> int:
        try:
            is_journal = os.readlink(f"/proc/self/fd/{fd}").endswith(".journal")
        except OSError:
            is_journal = False
        if not is_journal:
            return self.real(fd, data)
        self.calls += 1
        action = self.plan.get(self.calls)
        if action == "fail":
            raise OSError(errno.ENOSPC, "No space left on device")
        if action == "half":
            self.plan[self.calls + 1] = "fail"
            return self.real(fd, bytes(data)[: max(1, len(data) // 2)])
        return self.real(fd, data)


@pytest.mark.parametrize("file_format", FORMATS)
def test_failed_and_half_writes_at_many_points_lose_and_invent_nothing(tmp_path, monkeypatch, file_format):
    writes = FailingWrites(monkeypatch)
    rng = np.random.default_rng(7)
    for call in range(1, 120):
        if rng.random() < 0.3:
            writes.plan[call] = "half" if rng.random() < 0.5 else "fail"
    run_dir = tmp_path / "run"
    metric_core.init(
        run_dir, process_name="w", file_format=file_format, segment_records=700, flush_interval=0.02
    )
    ledger = Ledger()
    failures = 0
    for step in range(80):
        ledger.record(int(rng.integers(1, 200)))
        failures += ledger.flush(step) is not None
        if step % 9 == 0:
            time.sleep(0.03)  # let the writer thread write and seal (and fail) too
    writes.plan.clear()
    assert ledger.flush(80) is None
    metric_core.shutdown()
    assert failures > 5
    ledger.check(run_dir, dropped_allowed=False)
    scan = scan_run(run_dir)
    assert not scan.report.has_skips, scan.report.summary()
    assert scan.report.clean_shutdowns() == {("w", 0)}


def test_a_deleted_run_directory_is_said_at_the_next_flush(tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    metric_core.init(run_dir, process_name="w", flush_interval=60)
    metric_core.record_metric("k", 1.0)
    metric_core.flush(0)
    shutil.rmtree(run_dir)
    metric_core.record_metric("k", 2.0)
    with pytest.raises(RunDirGoneError) as caught:
        metric_core.flush(1)
    assert f"(was the run directory {run_dir} removed?)" in str(caught.value)
    assert "1 record(s) are kept in memory" in str(caught.value)
    with pytest.raises(RunDirGoneError, match="kept in memory"):
        metric_core.flush(2)
    run_dir.mkdir()  # recreated: writing resumes, with what was kept
    metric_core.flush(3)
    metric_core.shutdown()
    values, _ = values_read(run_dir)
    assert values.tolist() == [2.0]


WRITER_CHILD = """
import sys, time, metric_core
run_dir = sys.argv[1]
metric_core.init(run_dir, process_name="w", flush_interval=0.05)
i = 0
while True:
    for _ in range(50):
        metric_core.record_metric("k", float(i)); i += 1
    print("R", i, time.time(), flush=True)
    time.sleep(0.01)
"""


def test_the_writer_thread_outlives_a_full_disk_and_keeps_writing_in_the_background(tmp_path):
    import threading

    from metric_core.errors import NoDataError

    def written() -> set[int]:
        try:
            return set(values_read(run_dir)[0].astype(int).tolist())
        except NoDataError:  # nothing written yet
            return set()

    def wait_for(condition, what: str) -> None:  # a condition, polled (no fixed wait)
        deadline = time.monotonic() + 120
        while not condition():
            assert proc.poll() is None and time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    with small_disk(tmp_path / "disk") as disk:
        run_dir = disk / "run"
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER_CHILD, str(run_dir)], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None
        lines: list[list[str]] = []  # the child's "R <records so far> <time>", as it says them
        reader = threading.Thread(target=lambda: lines.extend(x.split() for x in proc.stdout), daemon=True)
        reader.start()
        recorded = lambda: int(lines[-1][1]) if lines else 0  # noqa: E731
        wait_for(lambda: written(), "the writer thread's first records on disk")
        filler = fill(disk)
        full_at = recorded()
        # the writer thread (a write every 0.05 s) fails, backs off and retries while the
        # child records 2,000 more
        wait_for(lambda: recorded() >= full_at + 2000, "records made while the disk is full")
        assert not set(range(full_at + 2000)) <= written(), "they could not all be written to a full disk"
        filler.unlink()
        freed_at, freed = recorded(), time.time()
        wait_for(lambda: set(range(freed_at)) <= written(), "everything it kept, written")
        # then it goes on: killed once the child has recorded for 1.5 s since (the records
        # of its first half second, at least, must then be on disk)
        wait_for(lambda: float(lines[-1][2]) > freed + 1.5, "records made after the disk was freed")
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.time()
        proc.wait()
        reader.join(timeout=30)
        proc.stdout.close()
        old = max(int(n) for kind, n, t in (x for x in lines if len(x) == 3) if float(t) < killed - 1.0)
        assert old > freed_at  # records made after the disk was freed are among them
        values, scan = values_read(run_dir)
        got = set(values.astype(int).tolist())
        assert set(range(old)) <= got, f"{len(set(range(old)) - got)} records older than 1 s lost"
        assert not scan.report.unreadable_files


RUN_JSON_CHILD = """
import sys, time, metric_core
root, name = sys.argv[1], sys.argv[2]
print("ready", flush=True)
start = float(sys.stdin.readline())  # the same moment for every process
for r in range(25):
    time.sleep(max(0.0, start + r * 0.05 - time.time()))
    metric_core.init(f"{root}/run{r}", rank=0, process_name=name, flush_interval=60)
    metric_core.shutdown()
print("ok", flush=True)
"""


def test_rank_zero_processes_of_many_roles_start_together(tmp_path):
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RUN_JSON_CHILD, str(tmp_path), f"Role{i}_r0"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(8)
    ]
    for proc in procs:  # every one has imported metric_core: none is slower to start
        assert proc.stdout is not None and proc.stderr is not None
        if proc.stdout.readline() != "ready\n":
            pytest.fail(f"a child failed to start: {proc.stderr.read()}")
    start = time.time() + 0.2
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(f"{start!r}\n")
        proc.stdin.close()
    for proc in procs:
        assert proc.wait(timeout=120) == 0 and proc.stdout.read().strip() == "ok", proc.stderr.read()
    import json

    for r in range(25):
        run = tmp_path / f"run{r}"
        assert json.loads((run / "run.json").read_text())["name"] == f"run{r}"
        assert not [p for p in run.iterdir() if p.name.endswith(".tmp")]


SEALING_CHILD = """
import os, sys, metric_core
run_dir, progress = sys.argv[1], sys.argv[2]
import time
metric_core.init(run_dir, process_name="w", segment_records=1000, flush_interval=0.01)
i = step = 0
while True:
    time.sleep(0.003)
    for _ in range(97):
        metric_core.record_metric("k", float(i)); i += 1
    metric_core.flush(step); step += 1
    with open(progress + ".tmp", "w") as f:
        f.write(str(i))
    os.replace(progress + ".tmp", progress)
"""


@pytest.mark.parametrize("file_format", ["parquet"])
def test_a_read_while_journals_are_being_sealed_misses_no_flushed_record(tmp_path, file_format):
    run_dir, progress = tmp_path / "run", tmp_path / "progress"
    proc = subprocess.Popen([sys.executable, "-c", SEALING_CHILD, str(run_dir), str(progress)])
    try:
        deadline = time.monotonic() + 120
        while not progress.exists():  # its first step flushed
            assert proc.poll() is None and time.monotonic() < deadline, "the writer did not start"
            time.sleep(0.01)
        # Up to 40 reads, and past the fifth no longer than 10 s: the run grows as it is read,
        # so on a loaded machine each read is longer than the one before.
        reads, started = 0, time.monotonic()
        while reads < 40 and (reads < 5 or time.monotonic() - started < 10):
            reads += 1
            flushed = int(progress.read_text())
            values, scan = values_read(run_dir)
            got = values.astype(int)
            assert len(set(got.tolist())) == len(got)
            assert set(range(flushed)) <= set(got.tolist())
            assert not scan.report.unreadable_files, scan.report.summary()
    finally:
        proc.kill()
        proc.wait()


def test_a_long_process_name_is_written_and_read_back_whole(tmp_path):
    name = "GeneratorActor_" + "x" * 300
    c = MetricCollector(tmp_path, process_name=name, rank=3)
    c.record("k", 1.0)
    c.flush(0)
    c.shutdown()
    scan = scan_run(tmp_path)
    assert scan.frame.select("process", "rank").unique().collect().rows() == [(name, 3)]
    assert max(len(p.name) for p in tmp_path.iterdir()) < 140


def test_two_sources_that_share_a_process_name_never_share_a_file(tmp_path):
    for rank in (0, 1):
        c = MetricCollector(tmp_path, process_name="worker", rank=rank)
        c.record("k", float(rank))
        c.flush(0)
        c.shutdown()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["worker.r0.00000.parquet", "worker.r1.00000.parquet"]


def test_a_value_too_large_for_a_float_names_its_key(tmp_path):
    metric_core.init(tmp_path, process_name="w")
    with pytest.raises(
        ValueError, match=r"^metric 'big': value 100000000000\.\.\.\(401 digits\) is too large"
    ):
        metric_core.record_metric("big", 10**400)


def test_a_planted_symlink_at_a_segment_name_is_never_written_through(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "w.r0.00000.journal").symlink_to(outside)
    metric_core.init(run_dir, process_name="w", flush_interval=60)
    metric_core.record_metric("k", 1.0)
    metric_core.flush(0)
    metric_core.shutdown()
    assert outside.read_text() == "precious"
    values, _ = values_read(run_dir)
    assert values.tolist() == [1.0]
