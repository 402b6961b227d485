"""metriclog watch beside real writer processes: hung sources are caught, healthy ones are
not (fast steps on a loaded machine included), a lockstep hang is one stall, and watch ends
by itself when the job is over."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import write_other_tool_run
from tests.lockstep import run_job

pytestmark = pytest.mark.slow
METRICLOG = str(Path(sys.executable).with_name("metriclog"))  # the installed command
STEP_S = 0.2

WRITER = """
import sys, time
import metric_core
from metric_core import Reduce, record_metric
run, process = sys.argv[1], sys.argv[2]
rank, steps, hang_at = (int(a) for a in sys.argv[3:6])
step_s = float(sys.argv[6])
world = int(sys.argv[7]) if len(sys.argv) > 7 else None
metric_core.init(run, rank=rank, process_name=process, flush_interval=0.05, world_size=world)
for step in range(steps):
    if step == hang_at:
        print("hung", flush=True)
        time.sleep(600)  # alive, silent: a hang
    record_metric("loss", 1.0 / (step + 1), Reduce.MEAN)
    metric_core.flush(step)
    time.sleep(step_s)
metric_core.shutdown()
"""


def writers(
    run: Path, plan: list[tuple[int, int]], step_s: float = STEP_S, world: int | None = None
) -> list[subprocess.Popen]:
    """One writer process per (steps, step it hangs at: -1 for none); ``world``: the job's
    world_size, when it has more ranks than the plan starts."""
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                WRITER,
                str(run),
                f"TrainActor_r{rank}",
                str(rank),
                str(steps),
                str(hang),
                str(step_s),
                *([str(world)] if world is not None else []),
            ],
            stdout=subprocess.DEVNULL,
        )
        for rank, (steps, hang) in enumerate(plan)
    ]


def watch(run: Path, tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``metriclog watch`` of a job started with it: ``--wait``, as the job may not have made
    its run directory yet (on a busy machine it had not, and watch refused the path)."""
    said = tmp_path / "stalls.txt"
    fields = "$METRICLOG_PROCESS $METRICLOG_RANK $METRICLOG_LAST_STEP|$METRICLOG_PROCESSES|$METRICLOG_WHERE"
    command = f'echo "{fields}" >> {said}'
    done = subprocess.run(
        [METRICLOG, "watch", str(run), "--wait", "--interval", "0.2", "--on-stall", command, *args],
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
    children = writers(run, [(400, -1), (40, 8), (400, -1)])  # rank 1 hangs after step 7
    try:
        done, stalls = watch(run, tmp_path, "--exit-on-stall", "--stall-after", "2")
        running = [child.poll() is None for child in children]
    finally:
        stop(children)
    assert done.returncode == 3, done.stderr
    assert stalls == ["TrainActor_r1 1 7|TrainActor_r1|<string>:13 in <module>"]
    assert running[0] and running[2]  # the healthy ones were still writing when it was caught
    assert "TrainActor_r1 (rank 1) stalled at step 7: silent for " in done.stderr
    assert "TrainActor_r1 (rank 1) stalled at step 7" in done.stdout  # a line per change


def test_watch_catches_every_rank_hanging_together(tmp_path):
    """The usual collective deadlock: every source silent at once, none behind another."""
    run = tmp_path / "run"
    children = writers(run, [(40, 10), (40, 10), (40, 10)])
    try:
        done, stalls = watch(run, tmp_path, "--exit-on-stall", "--stall-after", "2")
    finally:
        stop(children)
    assert done.returncode == 3, done.stderr
    (stall,) = stalls  # one stall of the sources that went silent together, not one per source
    culprit, together, where = stall.split("|")
    # All in one place: none stands apart, and none is named (who went silent first never decides)
    assert culprit == "  9" and where == ""
    assert set(together.split(",")) == {f"TrainActor_r{r}" for r in range(3)}
    assert "3 sources stalled together at step 9" in done.stderr
    assert "at <string>:13 in <module>; none stands apart" in done.stderr


def finished_without_a_stall(run: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """Two healthy writers watched to their end: watch exits 0, with no stall said."""
    children = writers(run, [(10, -1), (12, -1)])
    try:
        done, stalls = watch(run, tmp_path, *args)
        codes = [child.wait(timeout=60) for child in children]
    finally:
        stop(children)
    assert done.returncode == 0, done.stderr
    assert codes == [0, 0] and stalls == []
    assert "stalled" not in done.stdout + done.stderr
    return done


def test_watch_ends_with_0_once_every_source_finished_and_says_no_stall(tmp_path):
    done = finished_without_a_stall(tmp_path / "run", tmp_path)
    lines = done.stdout.splitlines()
    stamps = [line.split()[0] for line in lines[-2:]]  # in time order (one second may hold both)
    assert stamps == sorted(stamps) and all("finished at step" in line for line in lines[-2:])


def test_another_tools_file_beside_the_writers_neither_stalls_nor_holds_watch_open(tmp_path):
    """Soak (issue 43's alarms): a file of another tool written before the job (no writer,
    no heartbeat) was called stalled and kept watch from ending, while the sidecar, rightly,
    holds nothing for it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    run = tmp_path / "run"
    run.mkdir()
    steps = list(range(40))
    pq.write_table(
        pa.table(
            {
                "key": ["other/loss"] * 40,
                "value": [float(s) for s in steps],
                "reduction": ["mean"] * 40,
                "step": steps,
                "timestamp": [time.time() - 120 + s for s in steps],  # silent for 80 s already
                "rank": [7] * 40,
                "process": ["OtherTool"] * 40,
            }
        ),
        run / "other.parquet",
    )
    finished_without_a_stall(run, tmp_path, "--stall-after", "2")


def test_watch_does_not_call_a_run_finished_while_a_rank_of_world_size_never_wrote(tmp_path):
    run = tmp_path / "run"
    children = writers(run, [(10, -1), (12, -1)], world=3)  # rank 2 of 3 never starts
    try:
        done, stalls = watch(run, tmp_path, "--restart-grace", "1s")
        codes = [child.wait(timeout=60) for child in children]
    finally:
        stop(children)
    assert codes == [0, 0] and stalls == []
    assert done.returncode == 4, done.stderr  # over, not finished
    said = " ".join(done.stderr.split())
    assert "rank 2 of world_size 3 never wrote a record" in said, said
    assert "waiting 1.0 s for it or a restart (--restart-grace)" in said, said


def test_a_rank_that_finished_before_rank_0_started_does_not_end_watch(tmp_path):
    """Soak seed 425763428: a fast rank finished before the others started, and before rank
    0 wrote run.json; watch took the one source it saw as the whole job and ended with 0."""
    run = tmp_path / "run"
    one = subprocess.run(
        [sys.executable, "-c", WRITER, str(run), "TrainActor_r1", "1", "3", "-1", "0.01", "2"],
        stdout=subprocess.DEVNULL,
        timeout=120,
    )
    assert one.returncode == 0 and not (run / "run.json").exists()
    child = subprocess.Popen(
        [METRICLOG, "watch", str(run), "--interval", "0.2", "--restart-grace", "1s"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    said = ""
    for line in child.stderr:  # a condition: watch says it waits for the other ranks
        said += line
        if "no rank 0 has written" in line:
            break
    zero = subprocess.run(
        [sys.executable, "-c", WRITER, str(run), "TrainActor_r0", "0", "3", "-1", "0.01", "2"],
        stdout=subprocess.DEVNULL,
        timeout=120,
    )
    out, err = child.communicate(timeout=120)
    said = " ".join((said + err).split())
    assert zero.returncode == 0
    assert "waiting up to 10.0 s for the job's other ranks" in said, said
    assert child.returncode == 0, said
    assert "TrainActor_r0 (rank 0) finished at step 2" in out, out


def test_a_mistyped_path_is_an_error_at_once_unless_wait_is_given(tmp_path):
    for command in (
        ["watch", str(tmp_path / "typo")],
        ["upload", str(tmp_path / "typo"), "--project", "p", "--follow"],
    ):
        done = subprocess.run([METRICLOG, *command], capture_output=True, text=True, timeout=60)
        assert done.returncode == 1, done.stderr
        assert done.stderr.strip().splitlines()[-1] == (
            f"Error: no readable metric record in {tmp_path / 'typo'}: it does not exist: check the path, or "
            "give --wait to wait for the job to create it"
        )


def test_watch_waits_for_a_run_that_has_not_started_and_stops_on_ctrl_c(tmp_path):
    child = subprocess.Popen(
        [METRICLOG, "watch", str(tmp_path / "later"), "--interval", "0.1", "--wait"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a background job ignores it
    )
    first = child.stderr.readline()  # blocks until watch said it waits (a condition, not a fixed wait)
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=60)
    err = first + err
    assert child.returncode == 130, err
    assert "waiting for records" in err and "Traceback" not in err
    assert out == ""


def test_fast_steps_on_a_loaded_machine_never_stall(tmp_path):
    run = tmp_path / "run"
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        children = writers(run, [(1000, -1), (1000, -1)], step_s=0.01)  # 10 ms steps for about 10 s
        try:
            done, stalls = watch(run, tmp_path)
        finally:
            stop(children)
    finally:
        stop(hogs)
    assert done.returncode == 0, done.stderr
    assert stalls == [] and "stalled" not in done.stdout + done.stderr


def test_a_lockstep_hang_is_one_stall_and_a_job_killed_whole_ends_watch(tmp_path):
    run, go_on = tmp_path / "run", tmp_path / "go-on"
    job = threading.Thread(
        target=run_job,
        args=(run,),
        kwargs={"world": 4, "steps": 12, "action": ["hold", "1", "5", str(go_on)], "hang_dump_after": 1.0},
    )
    job.start()  # rank 1 is held in step 5 until go_on exists; the others wait for it in their collective

    def go_on_once_stalled() -> None:  # a condition: watch ran its command for the stall
        while job.is_alive() and not (tmp_path / "stalls.txt").exists():
            time.sleep(0.05)
        go_on.touch()

    releaser = threading.Thread(target=go_on_once_stalled)
    releaser.start()
    try:
        done, stalls = watch(run, tmp_path)  # default settings
    finally:
        go_on.touch()
        releaser.join()
        job.join()
    assert done.returncode == 0, done.stderr  # the job went on and finished
    (stall,) = stalls
    culprit, together, where = stall.split("|")
    # The held rank, not whoever went silent first: the others wait for it in their collective
    assert culprit == "Trainer_r1 1 5", stall
    assert where.startswith("tests/lockstep_worker.py:") and where.endswith(" in train_step"), where
    assert together.split(",")[0] == "Trainer_r1"
    assert sorted(together.split(",")) == [f"Trainer_r{r}" for r in range(4)]
    assert done.stderr.count("stalled at step") == 1
    waiting = "waiting for it: Trainer_r0 (rank 0), Trainer_r2 (rank 2), Trainer_r3 (rank 3)"
    assert f"{waiting} at tests/lockstep_worker.py:" in done.stderr
    # inspect afterwards: the pause, with the held rank's place apart from the others'
    report = json.loads(
        subprocess.run(
            [METRICLOG, "inspect", str(run), "--json"], capture_output=True, text=True, check=True
        ).stdout
    )
    (pause,) = [p for p in report["pauses"] if p["seconds"] >= 5]
    apart, waiting = pause["stuck_in"]
    assert apart["sources"] == [{"process": "Trainer_r1", "rank": 1}] and apart["where"] == where
    assert [s["rank"] for s in waiting["sources"]] == [0, 2, 3] and waiting["where"].endswith(" in allreduce")


TWO_STALLS = """
import os, sys, threading, time
import metric_core
from metric_core import Reduce, record_metric
run, rank, second = sys.argv[1], int(sys.argv[2]), sys.argv[3]
metric_core.init(run, rank=rank, process_name=f"TrainActor_r{rank}", flush_interval=0.05)


def stuck_first():
    time.sleep(600)


def stuck_second():
    time.sleep(600)


for step in range(100_000):
    if rank == 0 and step == 5:
        stuck_first()
    if rank > 0 and os.path.exists(second):
        if rank == 1:
            stuck_second()
        threading.Event().wait(600)  # rank 2 waits for rank 1, as in a collective
    record_metric("loss", 1.0, Reduce.MEAN)
    metric_core.flush(step)
    time.sleep(0.1)
"""


def test_a_second_stall_names_its_own_culprit_not_a_source_of_an_earlier_one(tmp_path):
    """Rank 0 hangs first; long after, rank 1 hangs and rank 2 waits for it. The second stall
    is ranks 1 and 2's: rank 0, silent still, is the first stall's, not a third place that
    hides rank 1 as the one standing apart."""
    from metric_core.offline.inspect.health import EPISODE_S
    from metric_core.offline.watch import watch_run

    run, second = tmp_path / "run", tmp_path / "second"
    children = [
        subprocess.Popen([sys.executable, "-c", TWO_STALLS, str(run), str(rank), str(second)])
        for rank in range(3)
    ]
    episodes, halt = [], threading.Event()
    watching = threading.Thread(
        target=watch_run,
        args=(run,),
        kwargs={"interval": 0.2, "on_stall": episodes.append, "stall_after": 2.0, "stop": halt, "wait": True},
    )
    watching.start()

    def until(ok, what: str) -> None:
        deadline = time.monotonic() + 120
        while not ok():
            assert time.monotonic() < deadline and watching.is_alive(), what
            time.sleep(0.05)

    try:
        until(lambda: len(episodes) >= 1, "the first stall")
        until(lambda: time.time() > episodes[0].since + 2 * EPISODE_S, "a second stall apart from the first")
        second.touch()
        until(lambda: len(episodes) >= 2, "the second stall")
    finally:
        halt.set()
        watching.join(timeout=60)
        stop(children)
    first, later = episodes[:2]
    assert (first.culprit.process, [h.process for h, _ in first.held]) == ("TrainActor_r0", ["TrainActor_r0"])
    assert later.culprit is not None and later.culprit.process == "TrainActor_r1", later.told()
    assert sorted(h.process for h, _ in later.held) == ["TrainActor_r1", "TrainActor_r2"], later.told()
    said = later.variables(str(run))
    assert said["METRICLOG_PROCESS"] == "TrainActor_r1" and said["METRICLOG_WHERE"].endswith(
        " in stuck_second"
    )
    assert said["METRICLOG_PROCESSES"] == "TrainActor_r1,TrainActor_r2"
    assert "waiting for it: TrainActor_r2 (rank 2) at " in later.told(), later.told()


DIES_AFTER_INIT = """
import os, signal, sys
import metric_core
from metric_core import Reduce, record_metric
run, rank, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
metric_core.init(run, rank=rank, process_name=f"TrainActor_r{rank}", flush_interval=0.05)  # no world_size
if how == "exit":
    os._exit(1)  # after init(), before its first record
if how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if how == "quiet":  # shut down cleanly, having recorded nothing
    metric_core.shutdown()
    sys.exit(0)
for step in range(20):
    record_metric("loss", 1.0 / (step + 1), Reduce.MEAN)
    metric_core.flush(step)
metric_core.shutdown()
"""


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_a_rank_that_died_after_init_before_its_first_record_is_a_source_that_died(tmp_path, how):
    """run.json without world_size (another launcher): nothing says how many ranks there
    are, so the rank's journal (init() writes its header) is all there is of it."""
    run = tmp_path / "run"
    for rank, does in ((1, how), (0, "steps")):
        done = subprocess.run([sys.executable, "-c", DIES_AFTER_INIT, str(run), str(rank), does], timeout=120)
        assert done.returncode == (0 if does == "steps" else 1 if how == "exit" else -signal.SIGKILL)
    assert json.loads((run / "run.json").read_text()).get("world_size") is None
    report = json.loads(
        subprocess.run(
            [METRICLOG, "inspect", str(run), "--json"], capture_output=True, text=True, check=True
        ).stdout
    )
    by_rank = {s["rank"]: s for s in report["sources"]}
    assert sorted(by_rank) == [0, 1], report["sources"]
    dead = by_rank[1]
    assert (dead["process"], dead["records"], dead["first_step"], dead["last_step"]) == (
        "TrainActor_r1",
        0,
        None,
        None,
    )
    assert dead["state"] == "died" and dead["end"] in ("died", "exit"), dead
    assert by_rank[0]["state"] == "finished" and by_rank[0]["records"] == 20
    text = subprocess.run([METRICLOG, "inspect", str(run)], capture_output=True, text=True, check=True).stdout
    assert "TrainActor_r1 (rank 1)" in text and "before its first flush" in text, text
    done = subprocess.run(
        [METRICLOG, "watch", str(run), "--interval", "0.2", "--restart-grace", "0s"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 4, (done.returncode, done.stdout, done.stderr)  # over, not finished: it died
    assert "TrainActor_r1 (rank 1) died before its first flush" in done.stderr + done.stdout, done.stderr


@pytest.mark.parametrize(("how", "code"), [("exit", 4), ("kill", 4), ("quiet", 0)])
def test_watch_ends_when_every_rank_ended_before_recording_anything(tmp_path, how, code):
    """Soak seed 391353656: the one rank of a job was stopped before its first flush. The run
    holds attempts that all ended and no record: watch said it was waiting for records, for
    ever. It ends as any run whose every source died (4, after --restart-grace), or, where
    each shut down cleanly, as a finished run (0)."""
    run = tmp_path / "run"
    subprocess.run([sys.executable, "-c", DIES_AFTER_INIT, str(run), "0", how], timeout=120)
    done = subprocess.run(
        [METRICLOG, "watch", str(run), "--interval", "0.2", "--restart-grace", "0s"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
    if code == 4:
        assert "TrainActor_r0 (rank 0) died before its first flush" in done.stderr, done.stderr


def test_watch_ends_by_itself_when_every_rank_died(tmp_path):
    run = tmp_path / "run"
    children = writers(run, [(400, -1), (400, -1)])
    watching = subprocess.Popen(
        [METRICLOG, "watch", str(run), "--wait", "--interval", "0.2", "--restart-grace", "1s"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not both_recorded(run):  # a condition: each has a step's records, not only its journal's header
        assert time.monotonic() < deadline, "the writers did not start"
        time.sleep(0.05)
    for child in children:
        child.send_signal(signal.SIGKILL)
        child.wait()
    _, err = watching.communicate(timeout=60)
    assert watching.returncode == 4, err
    assert err.count(" died after step ") == 2 and "no exception or signal recorded" in err


def both_recorded(run: Path) -> bool:
    """Whether both writers' records are in the run (a killed writer's journal is read)."""
    from metric_core import scan_run
    from metric_core.errors import NoDataError, RunChangedError

    try:
        frame = scan_run(run).frame.select("process").unique().collect()
    except (NoDataError, RunChangedError, OSError):
        return False
    return frame.height == 2


def test_on_a_terminal_the_table_redraws_in_place_under_the_lines_it_says(tmp_path):
    """A terminal emulator shows what a user sees: one table, the stall's lines above it,
    and no stale copies of the table (its command's output included)."""
    import fcntl
    import pty
    import struct
    import termios

    import pyte

    run = tmp_path / "run"
    children = writers(run, [(30, -1), (30, 10)])  # rank 1 hangs after step 9
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    watching = subprocess.Popen(
        [
            METRICLOG,
            "watch",
            str(run),
            "--wait",  # the writers may not have made the run directory yet
            "--interval",
            "0.2",
            "--stall-after",
            "1.5",
            "--restart-grace",
            "0",
            "--on-stall",
            "echo paged $METRICLOG_PROCESSES",
        ],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env={**os.environ, "TERM": "xterm-256color"},
    )
    os.close(slave)
    screen = pyte.Screen(120, 40)
    stream = pyte.ByteStream(screen)
    shown = bytearray()

    def read() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the terminal's last writer is gone
                return
            if not chunk:
                return
            shown.extend(chunk)
            stream.feed(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    try:
        while b"paged TrainActor_r1" not in shown:  # a condition: the stall's command ran
            assert watching.poll() is None, bytes(shown).decode(errors="replace")
            assert time.monotonic() < deadline, bytes(shown).decode(errors="replace")
            time.sleep(0.05)
        children[0].wait(timeout=60)
        children[1].kill()  # the hung rank dies: every source finished or died, watch ends
        assert watching.wait(timeout=60) == 4
    finally:
        stop(children)
    reader.join(timeout=10)
    os.close(master)
    lines = [line.rstrip() for line in screen.display if line.strip()]
    assert sum(line.startswith("run: ") for line in lines) == 1, "\n".join(lines)
    assert sum(line.startswith("┏") for line in lines) == 1, "\n".join(lines)
    said = [line for line in lines if "stalled at step 9" in line or line == "paged TrainActor_r1"]
    assert len(said) == 2, "\n".join(lines)
    assert lines.index(said[-1]) < next(i for i, line in enumerate(lines) if line.startswith("run: "))


@pytest.fixture(autouse=True)
def _writers_see_this_checkout(monkeypatch):
    root = str(Path(__file__).resolve().parent.parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))


def test_watch_ends_on_another_tools_files_once_they_are_silent(tmp_path):
    """Files that record no life (another tool's), written long ago: every source is ended
    (or stopped early) by the wall clock, and watch ends as for a run whose sources died
    (4, after --restart-grace), where it once watched them as running for ever."""
    write_other_tool_run(tmp_path, {0: 300, 1: 300, 2: 100})  # rank 2 stopped early
    done = subprocess.run(
        [METRICLOG, "watch", str(tmp_path), "--interval", "0.2", "--restart-grace", "0s"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 4, (done.returncode, done.stdout, done.stderr)
    assert "the job is over: every source ended or stopped_early, and no restart came within" in done.stderr
