"""cli.background: work in a forked child, its result or its exit code back in the parent.

A fresh interpreter runs each case, as the CLI does: polars not yet loaded, so it forks.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from cli import background

SCRIPT = """
import os, sys
import typer
from cli import background

def work():
    case = sys.argv[1]
    if case == "exit":
        typer.echo("Error: told to stop", err=True)
        raise typer.Exit(3)
    if case == "crash":
        raise ValueError("boom")
    if case == "died":
        os._exit(9)
    return {"pid": os.getpid(), "data": list(range(3))}

pending = background.start(work)
try:
    result = pending()
except typer.Exit as exc:
    sys.exit(exc.exit_code)
print(result["pid"] != os.getpid(), result["data"])
"""


def run(case: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT, case], capture_output=True, text=True, timeout=60)


def test_the_result_comes_back_from_another_process():
    done = run("ok")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split(maxsplit=1) == ["True", "[0, 1, 2]\n"]


@pytest.mark.parametrize(
    ("case", "code", "says"),
    [
        ("exit", 3, "Error: told to stop"),  # reported by the child, once
        ("crash", 1, "ValueError: boom"),  # an unexpected error keeps its traceback
        ("died", 1, "Error: the process reading the run ended early (exit code 9)"),
    ],
)
def test_a_failure_in_the_child_is_the_exit_code_of_the_parent(case, code, says):
    done = run(case)
    assert done.returncode == code
    assert done.stderr.count(says) == 1, done.stderr


def test_with_polars_loaded_the_work_runs_here_when_asked():
    import polars  # noqa: F401  (its thread pool would not survive a fork)

    calls = []
    pending = background.start(lambda: calls.append(1) or "done")
    assert calls == []
    assert pending() == "done" and calls == [1]


def test_upload_forks_before_polars_loads():
    """The options, the credentials check and the send path must not load polars: with
    polars loaded, upload would read the run in this process instead of in a child."""
    script = (
        "import sys\n"
        "from cli.main import _plan, Mode, By\n"
        "from metric_core import upload\n"
        "_plan(Mode.per_rank_reduce, By.time, '10s', ['loss=p99'], ['trainer/*'], '0-3', '5:9')\n"
        "upload.has_credentials()\n"
        "print('polars' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "False\n"
