"""metriclog watch beside real writer processes: hung sources are caught, healthy ones are not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

METRICLOG = str(Path(sys.executable).with_name("metriclog"))  # the installed command
STEP_S = 0.2

WRITER = """
import sys, time
import metric_core
from metric_core import Reduce, record_metric
run, process = sys.argv[1], sys.argv[2]
rank, steps, hang_at = (int(a) for a in sys.argv[3:6])
metric_core.init(run, rank=rank, process_name=process, flush_interval=0.05)
for step in range(steps):
    if step == hang_at:
        print("hung", flush=True)
        time.sleep(600)  # alive, silent: a hang
    record_metric("loss", 1.0 / (step + 1), Reduce.MEAN)
    metric_core.flush(step)
    time.sleep(STEP_S)
metric_core.shutdown()
""".replace("STEP_S", str(STEP_S))


def writers(run: Path, plan: list[tuple[int, int]]) -> list[subprocess.Popen]:
    """One writer process per (steps, step it hangs at: -1 for none)."""
    return [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(run), f"TrainActor_r{rank}", str(rank), str(steps), str(hang)],
            stdout=subprocess.DEVNULL,
        )
        for rank, (steps, hang) in enumerate(plan)
    ]


def watch(run: Path, tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    said = tmp_path / "stalls.txt"
    command = f'echo "$METRICLOG_PROCESS $METRICLOG_RANK $METRICLOG_LAST_STEP" >> {said}'
    done = subprocess.run(
        [METRICLOG, "watch", str(run), "--interval", "0.2", "--on-stall", command, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done, sorted(said.read_text().splitlines()) if said.exists() else []


def stop(children: list[subprocess.Popen]) -> None:
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)


def test_watch_runs_its_command_for_a_hung_source_and_not_for_healthy_ones(tmp_path):
    run = tmp_path / "run"
    children = writers(run, [(40, -1), (40, 8), (40, -1)])  # rank 1 hangs after step 7
    try:
        done, stalls = watch(run, tmp_path, "--exit-on-stall")
        running = [child.poll() is None for child in children]
    finally:
        stop(children)
    assert done.returncode == 3, done.stderr
    assert stalls == ["TrainActor_r1 1 7"]
    assert running[0] and running[2]  # the healthy ones were still writing when it was caught
    assert "TrainActor_r1 (rank 1) stalled at step 7: silent for " in done.stderr
    assert "TrainActor_r1 (rank 1) stalled at step 7" in done.stdout  # a line per change


def test_watch_catches_every_rank_hanging_together(tmp_path):
    """The usual collective deadlock: every source silent at once, none behind another."""
    run = tmp_path / "run"
    children = writers(run, [(40, 10), (40, 10), (40, 10)])
    try:
        done, stalls = watch(run, tmp_path, "--exit-on-stall")
    finally:
        stop(children)
    assert done.returncode == 3, done.stderr
    # each once; --exit-on-stall stops at the first poll that finds any, which may hold them all
    assert set(stalls) <= {f"TrainActor_r{r} {r} 9" for r in range(3)} and stalls


def test_watch_ends_with_0_once_every_source_finished_and_says_no_stall(tmp_path):
    run = tmp_path / "run"
    children = writers(run, [(10, -1), (12, -1)])
    try:
        done, stalls = watch(run, tmp_path)
        codes = [child.wait(timeout=60) for child in children]
    finally:
        stop(children)
    assert done.returncode == 0, done.stderr
    assert codes == [0, 0] and stalls == []
    assert "stalled" not in done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-2:] == sorted(lines[-2:]) and all("finished at step" in line for line in lines[-2:])


def test_watch_waits_for_a_run_that_has_not_started_and_stops_on_ctrl_c(tmp_path):
    child = subprocess.Popen(
        [METRICLOG, "watch", str(tmp_path / "later"), "--interval", "0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a background job ignores it
    )
    time.sleep(3)
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 130, err
    assert "waiting for records" in err and "Traceback" not in err
    assert out == ""


@pytest.fixture(autouse=True)
def _writers_see_this_checkout(monkeypatch):
    root = str(Path(__file__).resolve().parent.parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
