"""upload's overlap: work in a forked child, its result or its error back in the parent.

A fresh interpreter runs each case, as the command line does: polars not yet loaded, so it forks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from metric_core.offline.upload import overlap

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import os, sys
from metric_core.errors import MetricLogError, NoDataError
from metric_core.offline.upload import overlap

def work():
    case = sys.argv[1]
    if case == "error":
        raise NoDataError("runs/x", "told to stop")
    if case == "crash":
        raise ValueError("boom")
    if case == "died":
        os._exit(9)
    return {"pid": os.getpid(), "data": list(range(3))}

try:
    with overlap.started(work) as pending:
        result = pending()
except MetricLogError as exc:
    print(type(exc).__name__, getattr(exc, "where", None), exc, file=sys.stderr)
    sys.exit(3)
print(result["pid"] != os.getpid(), result["data"])
"""


def run(case: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT, case], capture_output=True, text=True, timeout=60)


def test_the_result_comes_back_from_another_process():
    done = run("ok")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split(maxsplit=1) == ["True", "[0, 1, 2]\n"]


@pytest.mark.parametrize(
    ("case", "says"),
    [
        # raised again in the parent, with its type, message and fields
        ("error", "NoDataError runs/x no readable metric record in runs/x: told to stop"),
        ("crash", "ValueError: boom"),  # a bug keeps its traceback (printed by the child)
        ("crash", "reading the run failed (the traceback above says where)"),
        ("died", "the process reading the run ended early (exit code 9)"),
    ],
)
def test_a_failure_in_the_child_is_raised_in_the_parent(case, says):
    done = run(case)
    assert done.returncode == 3
    assert done.stderr.count(says) == 1, done.stderr


def test_with_polars_loaded_the_work_runs_here_when_asked():
    import polars  # noqa: F401  (its thread pool would not survive a fork)

    calls = []
    with overlap.started(lambda: calls.append(1) or "done") as pending:
        assert calls == []
        assert pending() == "done" and calls == [1]


LEFT = """
import os, sys, time
from pathlib import Path
from metriclog.start import catch_stops
from metric_core.offline.upload import overlap

catch_stops()  # as the command line: a SIGTERM is a KeyboardInterrupt
here = Path(sys.argv[2])

def say_pid():  # whole or not at all: the parent reads it as soon as it is there
    (here / "pid.part").write_text(str(os.getpid()))
    os.replace(here / "pid.part", here / "pid")

def work():
    if sys.argv[1] == "sending":
        say_pid()
        return b"x" * (8 << 20)  # more than a pipe holds: the child waits in its send
    try:
        say_pid()  # in the guard: its cleanup will run
        while True:
            time.sleep(0.01)
    finally:
        (here / "cleaned").write_text("")

def waiting_in_its_send(pid):
    try:
        # the kernel function it sleeps in
        return Path(f"/proc/{pid}/wchan").read_text().endswith("pipe_write")
    except OSError:  # no /proc: the send is not seen, only likely
        time.sleep(0.5)
        return True

with overlap.started(work):
    while not (here / "pid").exists():
        time.sleep(0.01)
    pid = int((here / "pid").read_text())
    deadline = time.monotonic() + 60
    while sys.argv[1] == "sending" and not waiting_in_its_send(pid):
        assert time.monotonic() < deadline, "the child never waited in its send"
        time.sleep(0.01)
try:
    os.kill(pid, 0)
    print("alive")
except ProcessLookupError:
    print("gone")
"""


@pytest.mark.parametrize("case", ["working", "sending"])
def test_a_block_left_before_the_result_is_taken_stops_the_child_first(tmp_path, case):
    """upload removes the child's output folder once the block is left (a stop while wandb
    loads): the child must be gone by then, its cleanup run, with no traceback."""
    done = subprocess.run(
        [sys.executable, "-c", LEFT, case, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "gone\n"
    assert "Traceback" not in done.stderr, done.stderr
    assert (tmp_path / "cleaned").exists() == (case == "working")


def test_upload_forks_before_polars_loads():
    """The options, the credentials check, the runs found (``upload RUN...``) and the send
    path must not load polars: with polars loaded, upload would read the run in this process
    instead of in a child."""
    script = (
        "import sys\n"
        "from metric_core import LoggingMode\n"
        "from metric_core.offline.plan import By\n"
        "from metric_core.offline.upload import send\n"
        "from metriclog import options\n"
        "chosen = options.PlanOptions(LoggingMode.PER_RANK_REDUCE, By.TIME, '10s', ['p=p99'], ['t/*'],\n"
        "                             '0-3', '5:9', 'all')\n"
        "chosen.plan()\n"
        "from metric_core.credentials import has_credentials\n"
        "has_credentials()\n"
        "from metric_core.offline.compare import expand_runs\n"
        "expand_runs(['sample_logs/*'])\n"
        "print('polars' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "False\n"


FIRST_POLARS = """
import os, sys
main_pid, said = os.getpid(), sys.argv[1]

class FirstPolars:  # the pid of each process's first import of polars, in turn
    def find_spec(self, name, path=None, target=None):
        if name == "polars":
            with open(said, "a") as f:
                f.write(f"{os.getpid()}\\n")
            sys.meta_path.remove(self)
        return None

sys.meta_path.insert(0, FirstPolars())
from metriclog.start import main
sys.argv = ["metriclog", "upload", sys.argv[2], "--project", "p", "--offline"]
print(main_pid, flush=True)
main()
"""


def test_the_upload_command_reads_the_run_in_a_child_forked_before_polars_loads(tmp_path):
    """``metriclog upload`` itself, not only ``upload_run``: nothing on its way to the fork
    (the command's start, whether the job still writes) loads polars, so the child imports
    it first and this process only once the child is done."""
    run = shutil.copytree(ROOT / "sample_logs" / "rl_run", tmp_path / "run")
    said = tmp_path / "pids"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", FIRST_POLARS, said, run], capture_output=True, text=True, timeout=120,
        cwd=tmp_path, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    main_pid = int(done.stdout.split()[0])
    first, *then = [int(pid) for pid in said.read_text().split()]
    assert first != main_pid and then == [main_pid]
    assert "300 rows" in done.stderr


FORKING = """
import os, sys, time
from pathlib import Path
from metriclog.start import catch_stops
from metric_core.offline.upload import overlap

catch_stops()
here = Path(sys.argv[1])
(here / "out").mkdir()

def work():  # writes on until stopped, as the upload's reading child writes its columns
    while True:
        (here / "out" / f"{time.monotonic_ns()}").write_text("")
        time.sleep(0.001)

# the stop lands at the worst moment: the child forked, the parent still in Process.start
# (its pid not yet kept), its guard not entered
import multiprocessing.popen_fork as popen_fork

launch = popen_fork.Popen._launch

def stopped_as_forked(self, process):
    launch(self, process)  # the child never returns from it
    raise KeyboardInterrupt

popen_fork.Popen._launch = stopped_as_forked
try:
    with overlap.started(work):
        raise AssertionError("the stop was not raised")
except KeyboardInterrupt:
    pass
while True:  # every child ended (on the old code the child wrote on: the test timed out)
    try:
        os.waitpid(-1, 0)
    except ChildProcessError:  # none left (reaped already, or as it ended)
        break
print(len(list((here / "out").iterdir())))
"""


def test_a_stop_as_the_child_is_forked_leaves_a_child_that_writes_nothing_and_ends(tmp_path):
    """SIGTERM right after the fork (upload stopped as it starts reading), before the
    parent's guard: the child, never told to start, writes nothing and ends (it once wrote
    on, unguarded, and a ``metriclog-upload-*`` folder was left)."""
    done = subprocess.run(
        [sys.executable, "-c", FORKING, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "0\n"
    assert "Traceback" not in done.stderr, done.stderr


HELD = """
import os, sys, time
from pathlib import Path
from metric_core.atomic import hold_stops
from metric_core.offline.upload import overlap

here = Path(sys.argv[1])

def work():
    try:
        (here / "working").write_text("")
        while True:
            time.sleep(0.01)
    finally:
        (here / "cleaned").write_text("")

hold_stops()  # the caller holds stops (and keeps holding them)
try:
    with overlap.started(work):
        while not (here / "working").exists():
            time.sleep(0.01)
        raise RuntimeError("the block fails")
except RuntimeError:
    pass
print((here / "cleaned").exists())  # a child killed (SIGKILL, 10 s on) never cleans up
"""


def test_a_child_started_while_the_caller_holds_stops_is_still_stopped_with_its_cleanup(tmp_path):
    """The child takes the parent's SIGTERM whatever the parent made of stops: stopped at
    once, its cleanup run (it once kept them held: killed 10 s later, without cleanup)."""
    done = subprocess.run(
        [sys.executable, "-c", HELD, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "True\n"
    assert "Traceback" not in done.stderr, done.stderr
