"""Ctrl-C at any moment of any command: a real SIGINT sent to a real ``metriclog`` process
ends it with exit code 130 and at most one line, never a traceback, never a death by the
signal. Sent from the moment the command's own code runs, then 50 ms, 150 ms, 300 ms and
1 s later: in the loading of the commands' libraries (most of a short command's time),
in the command, and at its end."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import metric_core
from metric_core import Reduce, record_metric

METRICLOG = str(Path(sys.executable).with_name("metriclog"))
DELAYS = (0.0, 0.05, 0.15, 0.3, 1.0)
COMMANDS = {
    "reduce": ["reduce", "{run}"],
    "keys": ["keys", "{run}"],
    "samples": ["samples", "{run}"],
    "inspect": ["inspect", "{run}"],
    "plot": ["plot", "{run}", "--key", "loss", "--out", "{tmp}/loss.png"],
    "watch": ["watch", "{run}"],
    "upload": ["upload", "{run}", "--to", "tensorboard", "--logdir", "{tmp}/tb"],
    "follow": ["upload", "{run}", "--project", "p", "--offline", "--follow", "--until-idle", "1s"],
}
SIGTERM_CAUGHT = 1 << (signal.SIGTERM - 1)  # its bit in /proc/PID/status's SigCgt


def a_run(run: Path) -> None:
    """Two sources' records and samples, each ended by shutdown()."""
    for rank in range(2):
        collector = metric_core.init(run, rank=rank, process_name=f"gen_r{rank}", catch_signals=False)
        assert collector is not None
        for step in range(20):
            record_metric("loss", float(step + rank))
            record_metric("rollout", {"prompt": f"{rank}/{step}", "reward": float(step)}, Reduce.SAMPLE)
            metric_core.flush(step)
        metric_core.shutdown()


class Command:
    """``metriclog`` started with its imports said on stderr (PYTHONPROFILEIMPORTTIME)."""

    def __init__(self, args: list[str]) -> None:
        self.process = subprocess.Popen(
            [METRICLOG, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={
                **os.environ,
                "PYTHONPROFILEIMPORTTIME": "1",
                "WANDB_MODE": "offline",
                "WANDB_SILENT": "true",
            },
            # a child of a process where Ctrl-C is ignored (a background job) would ignore it too
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        self.lines: list[str] = []
        self.loading = threading.Event()  # it began to import what its commands use
        self.reader = threading.Thread(target=self._read)
        self.reader.start()
        self.out = self.process.stdout.read  # type: ignore[union-attr]

    def _read(self) -> None:
        ours = False  # the package metriclog is imported: the command's own code runs
        for line in self.process.stderr:  # type: ignore[union-attr]
            self.lines.append(line)
            name = line.rsplit("|", 1)[-1].strip() if line.startswith("import time:") else None
            ours = ours or name == "metriclog"
            if ours and name == "typing":  # what the commands' options are declared with
                self.loading.set()
        self.loading.set()

    def catches_sigterm(self) -> bool:
        try:
            status = Path(f"/proc/{self.process.pid}/status").read_text()
        except OSError:
            return False
        caught = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
        return bool(int(caught, 16) & SIGTERM_CAUGHT)

    def running_its_own_code(self) -> None:
        """Waits until its stop handlers are installed, or it began to load its commands'
        libraries, whichever comes first: from then on a stop is the command's to handle."""
        while not (self.loading.is_set() or self.catches_sigterm()):
            self.loading.wait(0.001)

    def end(self) -> tuple[int, str, str]:
        out = self.out()
        code = self.process.wait(timeout=300)
        self.reader.join()
        said = "".join(line for line in self.lines if not line.startswith("import time:"))
        return code, out, said


def stopped_after(run: Path, tmp: Path, args: list[str], delay: float) -> tuple[int, str, str]:
    """``args`` run in a copy of ``run`` and sent SIGINT ``delay`` s after its own code runs."""
    shutil.copytree(run, tmp / "run")
    command = Command([a.format(run=tmp / "run", tmp=tmp) for a in args])
    command.running_its_own_code()
    time.sleep(delay)
    command.process.send_signal(signal.SIGINT)
    return command.end()


@pytest.mark.slow  # the installed command, started 6 times
@pytest.mark.parametrize("name", list(COMMANDS))
def test_ctrl_c_at_any_moment_exits_130_quietly(tmp_path, name):
    run = tmp_path / "run"
    a_run(run)
    (tmp_path / "alone").mkdir()
    natural = Command([a.format(run=run, tmp=tmp_path / "alone") for a in COMMANDS[name]]).end()
    assert natural[0] == 0, natural[2]  # not stopped, the command succeeds
    places = [tmp_path / f"after-{delay}" for delay in DELAYS]
    for place in places:
        place.mkdir()
    with ThreadPoolExecutor(len(DELAYS)) as pool:
        ends = list(pool.map(lambda p, d: stopped_after(run, p, COMMANDS[name], d), places, DELAYS))
    for delay, (code, _, said) in zip(DELAYS, ends, strict=True):
        assert code >= 0, f"{name} after {delay} s: killed by signal {-code}\n{said}"
        assert "Traceback" not in said, f"{name} after {delay} s:\n{said}"
        # the stop came before the command ended (130), or after it (its own code, as alone)
        assert code in (130, 0), f"{name} after {delay} s: exit {code}\n{said}"
        if code == 130:
            assert len(said.splitlines()) <= 1, f"{name} after {delay} s:\n{said}"
    assert ends[0][0] == 130, ends[0][2]  # sent while its commands loaded: it cannot have ended


LOST_STOP = """
import os, signal, sys, time
from cli.start import catch_stops

class Collected:
    def __del__(self):  # run where Python cannot raise: an exception here is "ignored"
        os.kill(os.getpid(), signal.{signal})
        for _ in range(100_000):
            pass

catch_stops()
try:
    Collected()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        pass
    print("the stop was lost")
except KeyboardInterrupt:
    print("stopped")
"""


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_stop_that_lands_where_python_cannot_raise_is_raised_again(name):
    """A stop inside a weakref callback or ``__del__`` (the import system's module locks
    have one: a Ctrl-C while a command loads can land there) is not reported as "Exception
    ignored ... Traceback" and lost: it is raised at the main thread's next instruction."""
    ran = subprocess.run(
        [sys.executable, "-c", LOST_STOP.format(signal=name)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[1],
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert (ran.stdout, ran.stderr) == ("stopped\n", "")


LEFT_READING = """
import sys, threading, time
from pathlib import Path
from metric_core.offline.engine.pool import on_threads

inside = threading.Event()

def work(item):
    yield item
    if item == 1:
        inside.set()
        time.sleep(0.5)  # a read still going (in pyarrow's C++, in a real run)
        Path(sys.argv[1]).write_text("returned")
    yield item

stream = on_threads(work, [0, 1], [1, 1], None)
next(stream)
inside.wait(60)
stream.close()  # as a Ctrl-C's KeyboardInterrupt closes it
sys.exit(130)
"""


def test_a_stream_stopped_while_its_thread_reads_waits_for_the_read_before_the_process_exits(tmp_path):
    """A thread left inside pyarrow's C++ as the interpreter tears down aborts the process
    ("terminate called without an active exception", SIGABRT, not exit 130): a stream closed
    by a stop keeps its pool known until its threads end, and the exit waits for them."""
    returned = tmp_path / "returned"
    ran = subprocess.run(
        [sys.executable, "-c", LEFT_READING, str(returned)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[1],
    )
    assert (ran.returncode, ran.stderr) == (130, "")
    assert returned.read_text() == "returned"  # the read ended before the process did


HELD_IN_ANOTHER_THREAD = """
import os, signal, sys, tempfile, threading, time
from pathlib import Path
from metriclog.start import catch_stops
from metric_core import atomic

catch_stops()
# another thread, as pyarrow's and polars' are: the signal may reach it rather than this one
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
made = tempfile.mkdtemp
came, wake = os.pipe()
os.set_blocking(wake, False)
signal.set_wakeup_fd(wake)  # written to as the signal reaches the process, in any thread

def stopped_as_made(*args, **kwargs):
    path = made(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)  # the stop comes as the directory is made
    os.read(came, 1)  # and has reached the process before this returns
    return path

tempfile.mkdtemp = stopped_as_made
try:
    with atomic.scratch_directory("metriclog-held-"):
        print("entered")
except KeyboardInterrupt:
    print("stopped")
print([p.name for p in Path(tempfile.gettempdir()).glob("metriclog-held-*")])
"""


def test_a_stop_held_while_a_directory_is_made_is_raised_inside_its_guard_whichever_thread_took_it(
    tmp_path,
):
    """A stop held (``hold_stops``) while a scratch directory is made comes once its removal
    is guarded, even where another thread took the signal (a signal mask held it in the
    main thread alone: an upload stopped by SIGTERM as it started left its directory)."""
    ran = subprocess.run(
        [sys.executable, "-c", HELD_IN_ANOTHER_THREAD],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[1],
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert (ran.returncode, ran.stderr) == (0, "")
    assert ran.stdout == "stopped\n[]\n"
