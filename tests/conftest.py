"""Shared fixtures: runs written by the real writer, and raw values for ground truth."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from metric_core import Metric, MetricCollector, Reduce

# Scripts, not tests: a rank of a torchrun job (needs torch) and the trials that start them.
collect_ignore = ["torchrun_worker.py", "culprit_trials.py"]

# pytest-xdist's workers start with COLUMNS=80 and LINES=24 in their environment, where
# the pytest that started them had neither: the command line's tables would be cut to 80
# columns there. A worker's terminal is its controller's.
os.environ.setdefault(
    "MLS_CONTROLLER_TERMINAL", json.dumps({k: os.environ.get(k) for k in ("COLUMNS", "LINES")})
)
for _name, _value in json.loads(os.environ["MLS_CONTROLLER_TERMINAL"]).items():
    if _value is None:
        os.environ.pop(_name, None)
        # readline, which pytest imports (pdb), sets COLUMNS and LINES in the C environment,
        # unseen by os.environ: the commands a test starts would inherit them
        os.unsetenv(_name)
    else:
        os.environ[_name] = _value

# Ray starts its workers at niceness 15 (RAY_worker_niceness): beside a busy process at 0
# (a CPU hog, the suite's other workers) they get about 3% of a core, and the Ray cases
# took past their 20 minutes. The suite's Ray workers run at the niceness of the tests.
os.environ.setdefault("RAY_worker_niceness", "0")

SUITE_TMP: Path | None = None  # this pytest process's own, from pytest_configure on


def pytest_configure(config):
    """The suite's own temporary directory, for this process and every one it starts
    ($TMPDIR): what another metriclog on the machine leaves in the shared one is not the
    suite's. Each pytest process makes its own, beside the others in the machine's
    temporary directory: under pytest-xdist each worker (and the pytest that
    tests/test_ray.py starts) has one, so the check below sees only what its own tests
    left, whatever the others are doing. Not nested: Ray's socket paths live below it, and
    a Unix socket's path is at most 107 bytes. Made here, not on import: a process that
    imports a test module and is no pytest (a Ray worker) makes none it would never remove.

    W&B's cache, data and settings directories (its service's logs, staged tables) are
    this process's too, never the user's."""
    global SUITE_TMP
    machine = os.environ.setdefault("MLS_MACHINE_TMPDIR", tempfile.gettempdir())
    SUITE_TMP = Path(tempfile.mkdtemp(prefix="mls-", dir=machine))
    os.environ["TMPDIR"] = tempfile.tempdir = str(SUITE_TMP)
    for name in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):
        os.environ[name] = str(SUITE_TMP / name.lower())


def pytest_unconfigure(config):
    """This process's temporary directory goes when it ends (xdist's controller's holds the
    workers' pytest tmp_path directories)."""
    if SUITE_TMP is not None:
        shutil.rmtree(SUITE_TMP, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def no_temporary_directory_is_left_behind():
    """Every temporary directory metriclog makes ($TMPDIR/metriclog-*) is gone when the
    tests of this process end."""
    yield
    assert SUITE_TMP is not None
    left = sorted(str(p) for p in SUITE_TMP.glob("metriclog-*"))
    assert not left, f"temporary directories left behind: {left}"


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


@pytest.fixture
def india(monkeypatch):
    """Local time is India's (UTC+05:30, no summer time): times printed for a person show it."""
    monkeypatch.setenv("TZ", "IST-5:30")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


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

    ``shutdown``: True ends cleanly, False uncleanly (``abort()``: sealed, no end marker),
    None not at all: the source is written by a forked child that is then SIGKILLed, so
    its last segment stays a journal, as after any kill.

    Each source records keys with several values per step, some keys only on some steps,
    with known timestamps (about one step per second, sources slightly apart).
    """
    rng = np.random.default_rng(seed)
    truth: list[dict] = []
    for process, rank in sources:
        source = _source_records(rng, process, rank, range(first_step, first_step + steps))
        truth += [r for step_records in source for r in step_records]

        def write(source=source, process=process, rank=rank) -> MetricCollector:
            c = MetricCollector(
                run_dir,
                rank=rank,
                process_name=process,
                file_format=file_format,
                segment_records=segment_records,
                step=first_step,
            )
            for step, step_records in enumerate(source, start=first_step):
                for r in step_records:
                    c.push(Metric(r["key"], r["value"], Reduce(r["reduction"]), r["timestamp"]))
                c.flush(step)
            return c

        if shutdown is None:
            killed_after(write)
        elif shutdown:
            write().shutdown()
        else:
            write().abort()
    return truth


def _source_records(rng: np.random.Generator, process: str, rank: int, steps: range) -> list[list[dict]]:
    out = []
    for step in steps:
        records = []
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
                records.append(
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
        out.append(records)
    return out


def write_other_tool_run(run: Path, last_steps: dict[int, int], t0: float = 1.76e9) -> None:
    """Parquet as another tool writes it (no metriclog metadata, no journal, no life): one
    file a rank of process "trainer", key "loss" at every step 0 .. ``last_steps[rank]``,
    a step a second from ``t0``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    run.mkdir(parents=True, exist_ok=True)
    for rank, last in last_steps.items():
        n = last + 1
        table = {
            "key": ["loss"] * n, "value": np.arange(n) * 1.0, "reduction": ["mean"] * n, "step": np.arange(n),
            "timestamp": t0 + np.arange(n) * 1.0, "rank": [rank] * n, "process": ["trainer"] * n,
        }  # fmt: skip
        pq.write_table(pa.table(table), run / f"r{rank}.parquet")


def flip_a_page(path: Path, group: int, column: str = "value") -> None:
    """Flip a bit of the last byte of one row group's ``column`` chunk in a Parquet file: page
    data, which a page checksum covers; the footer stays as it was."""
    import pyarrow.parquet as pq

    meta = pq.read_metadata(path)
    chunk = meta.row_group(group).column(meta.schema.names.index(column))
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    data = bytearray(path.read_bytes())
    data[start + chunk.total_compressed_size - 1] ^= 0x10
    path.write_bytes(bytes(data))


def killed_after(work: Callable[[], object]) -> None:
    """Run ``work`` in a forked child that then SIGKILLs itself: no shutdown, no exit handler,
    nothing sealed; what is on disk is what a kill leaves."""
    pid = os.fork()
    if pid == 0:  # the child: never return into the test runner
        try:
            work()
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os.kill(os.getpid(), signal.SIGKILL)
    for _ in range(600):  # a minute at most: a child stuck on a lock it inherited is killed
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise AssertionError("the writing child hung")
    assert os.waitstatus_to_exitcode(status) == -signal.SIGKILL, "the writing child failed (see stderr)"


def wait_for(condition: Callable[[], object], what: str, timeout: float = 120.0) -> None:
    """Poll ``condition`` until it holds (a condition, never a fixed wait); fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def wandb_offline(monkeypatch):
    """W&B offline and logged out: no key, no netrc, its files in the test's own place."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.setenv("NETRC", "/nonexistent-netrc")


def on_a_terminal(command: list[str], *, width: int | None = None) -> tuple[int, str, bytes]:
    """Run ``command`` with stderr on a pseudo-terminal and stdout on a pipe: its exit code,
    what the terminal showed (colours and cursor moves removed), and its stdout. The
    terminal is 160 columns wide by ``COLUMNS``, or, given ``width``, by its own size with
    ``COLUMNS`` unset."""
    import fcntl
    import pty
    import re
    import struct
    import subprocess
    import termios

    screen, terminal = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    if width is None:
        env["COLUMNS"] = "160"
    else:
        fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, width, 0, 0))
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=terminal, env=env)
    os.close(terminal)
    shown = b""
    while True:
        try:
            chunk = os.read(screen, 65536)
        except OSError:  # EIO: the process closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(screen)
    stdout = child.communicate(timeout=300)[0]
    return child.returncode, re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown.decode(errors="replace")), stdout


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (``make test``): a worker more than the cores. About a third of the
    suite's time is spent waiting on processes it started (jobs, sidecars, watch, servers)
    and the extra worker runs tests in those gaps. PYTEST_XDIST_AUTO_NUM_WORKERS and
    ``-n logical`` are xdist's to count."""
    if "PYTEST_XDIST_AUTO_NUM_WORKERS" in os.environ or config.option.numprocesses == "logical":
        return None
    return len(os.sched_getaffinity(0)) + 1


def pytest_collection_modifyitems(config, items):
    """The Ray cases (a pytest of their own, over a minute alone and several minutes on a
    loaded machine) go first: under pytest-xdist they start at once on one worker while
    the others share the rest, instead of last, alone, making the suite that much longer."""
    items.sort(key=lambda item: item.nodeid != "tests/test_ray.py::test_the_ray_engine_cases_pass")
