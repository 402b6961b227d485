"""How each attempt ended, which rank failed first, and where a paused job was stuck:
real processes of a lockstep job under a launcher that, like torchrun, SIGTERMs the
survivors when a rank dies and restarts everyone from a checkpoint."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from tests.lockstep import ROOT, WORKER, run_job

pytestmark = pytest.mark.slow
runner = CliRunner()


def inspect_json(run_dir: Path, *args: str) -> dict:
    result = runner.invoke(app, ["inspect", str(run_dir), "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def verdict(run_dir: Path, *args: str) -> str:
    result = runner.invoke(app, ["inspect", str(run_dir), *args])
    assert result.exit_code == 0, result.output
    return result.stdout


def attempts_of(report: dict) -> dict[tuple[str, int], dict]:
    return {(s["process"], a["number"]): a for s in report["sources"] for a in s["attempts"]}


@pytest.mark.parametrize(
    ("how", "end", "sig", "code"),
    [
        ("raise", "exception", None, 1),
        ("exit", "died", None, 1),
        ("kill", "died", None, -signal.SIGKILL),
        ("segv", "signal", "SIGSEGV", -signal.SIGSEGV),
    ],
)
def test_a_failed_rank_is_named_first_and_the_restart_told(tmp_path, how, end, sig, code):
    job = run_job(tmp_path, action=[how, "2", "13"])
    first, second = job.codes
    assert first[2] == code
    assert all(
        first[r] == -signal.SIGTERM for r in (0, 1, 3)
    )  # stopped by the launcher, as without metriclog
    assert all(c == 0 for c in second.values())

    report = inspect_json(tmp_path)
    attempts = attempts_of(report)
    failed = attempts[("Trainer_r2", 1)]
    assert failed["end"] == end and failed["signal"] == sig
    for rank in (0, 1, 3):  # blocked in native code (recv) when SIGTERM came
        survivor = attempts[(f"Trainer_r{rank}", 1)]
        assert (survivor["end"], survivor["signal"]) == ("signal", "SIGTERM")
        assert survivor["stacks"] and survivor["stacks"][0].startswith("stacks/")
        assert (tmp_path / survivor["stacks"][0]).read_text().count("\n") > 2
    for rank in range(4):
        assert attempts[(f"Trainer_r{rank}", 2)]["end"] == "shutdown"
        assert attempts[(f"Trainer_r{rank}", 2)]["last_step"] == 19  # its last flush(19), not shutdown's
    ff = report["first_failure"]
    assert (ff["process"], ff["rank"], ff["number"], ff["end"]) == ("Trainer_r2", 2, 1, end)
    assert ff["last_step"] == 12
    if how == "raise":
        assert ff["exception"]["type"] == "ValueError" and ff["exception"]["message"] == "bad batch"
        lines = WORKER.read_text().splitlines()
        line = next(i for i, text in enumerate(lines, 1) if 'raise ValueError("bad batch")' in text)
        assert ff["exception"]["where"] == f"{WORKER}:{line} in train_step"

    text = verdict(tmp_path)
    assert "Trainer_r2 (rank 2)" in text and "restarted from step 10" in text and "finished cleanly" in text
    assert "SIGTERM" in text
    if how == "raise":
        assert "ValueError('bad batch')" in text
    if end == "died":
        assert "no exception or signal recorded" in text


def test_a_rank_that_sleeps_while_the_others_wait_stands_alone(tmp_path):
    run_job(tmp_path, steps=12, action=["sleep", "1", "5", "3"], hang_dump_after=1.0)
    report = inspect_json(tmp_path, "--pause-after", "1.5")
    assert len(report["pauses"]) == 1
    pause = report["pauses"][0]
    assert pause["step"] == 5 and pause["seconds"] >= 2.5 and not pause["ongoing"]
    assert [s["rank"] for s in pause["sources"]] == [0, 1, 2, 3]
    alone, waiting = pause["stuck_in"]
    assert [s["rank"] for s in alone["sources"]] == [1]
    assert alone["where"].endswith("in train_step")  # the line of time.sleep
    assert sorted(s["rank"] for s in waiting["sources"]) == [0, 2, 3]
    assert waiting["where"].endswith("in allreduce")
    assert report["first_failure"] is None
    text = verdict(tmp_path, "--pause-after", "1.5")
    assert "Pause:" in text and "stuck at" in text


USER_HOOKS = """
import os, signal, sys, time, threading
import metric_core

marker = sys.argv[2]
def on_term(signum, frame):
    open(marker + ".term", "w").write("handler ran")
    sys.exit(7)
if sys.argv[3] == "handler":
    signal.signal(signal.SIGTERM, on_term)
def hook(kind, value, tb):
    open(marker + ".hook", "w").write(kind.__name__)
sys.excepthook = hook
if sys.argv[4] == "metriclog":
    metric_core.init(sys.argv[1], process_name="p", flush_interval=0.1)
    metric_core.record_metric("x", 1.0)
    metric_core.flush(0)
open(marker + ".ready", "w").write("")
if sys.argv[5] == "raise":
    raise RuntimeError("boom")
time.sleep(60)
"""


def _run_user_script(tmp_path: Path, handler: str, with_metriclog: str, end: str) -> int:
    script = tmp_path / "user.py"
    script.write_text(textwrap.dedent(USER_HOOKS))
    marker = tmp_path / f"m-{handler}-{with_metriclog}-{end}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTHONFAULTHANDLER", None)
    p = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "run"), str(marker), handler, with_metriclog, end],
        env=env,
    )
    if end == "raise":
        return p.wait(timeout=60)
    ready = Path(f"{marker}.ready")
    while not ready.exists() and p.poll() is None:  # a condition, polled
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=0.05)
    p.send_signal(signal.SIGTERM)
    return p.wait(timeout=60)


@pytest.mark.parametrize("handler", ["handler", "none"])
def test_a_users_sigterm_handler_runs_and_exit_status_is_unchanged(tmp_path, handler):
    without = _run_user_script(tmp_path, handler, "plain", "wait")
    with_it = _run_user_script(tmp_path, handler, "metriclog", "wait")
    assert with_it == without == (7 if handler == "handler" else -signal.SIGTERM)
    if handler == "handler":
        assert (tmp_path / "m-handler-metriclog-wait.term").read_text() == "handler ran"
    attempt = inspect_json(tmp_path / "run")["sources"][0]["attempts"][0]
    assert (attempt["end"], attempt["signal"]) == ("signal", "SIGTERM")


def test_a_users_excepthook_still_runs(tmp_path):
    without = _run_user_script(tmp_path, "none", "plain", "raise")
    with_it = _run_user_script(tmp_path, "none", "metriclog", "raise")
    assert with_it == without == 1
    assert (tmp_path / "m-none-metriclog-raise.hook").read_text() == "RuntimeError"
    attempt = inspect_json(tmp_path / "run")["sources"][0]["attempts"][0]
    assert attempt["end"] == "exception" and attempt["exception"]["message"] == "boom"


ENDS = """
import os, signal, sys, threading, time, multiprocessing
import metric_core


@metric_core.record
def child(run):
    metric_core.init(run, process_name="child", rank=1, flush_interval=0.1)
    metric_core.record_metric("x", 1.0)
    metric_core.flush(0)
    raise KeyError("lost shard")


def main(run, how, hang_dump_after):
    if how == "cycles":  # a handler installed after init(), then init()/shutdown() twice
        for cycle in range(2):
            metric_core.init(run, process_name="p", flush_interval=0.1)
            if cycle == 0:
                signal.signal(signal.SIGTERM, lambda *_: os._exit(7))
            metric_core.record_metric("x", 1.0)
            metric_core.flush(cycle)
            metric_core.shutdown()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    if how == "finally":
        metric_core.init(run, process_name="p", flush_interval=0.1)
        try:
            metric_core.record_metric("x", 1.0)
            metric_core.flush(0)
            raise RuntimeError("in the loop")
        finally:
            metric_core.shutdown()
    if how == "spawned":
        p = multiprocessing.get_context("spawn").Process(target=child, args=(run,))
        p.start()
        p.join()
        sys.exit(p.exitcode)
    metric_core.init(run, process_name="p", flush_interval=0.1, hang_dump_after=hang_dump_after)
    if how == "offline":
        import metric_core.offline.read as reader  # the reading side here too: the writer's handlers stay
    for step in range(3):
        metric_core.record_metric("x", float(step))
        metric_core.flush(step)
    if how in ("thread", "thread_alive"):
        loader = threading.Thread(target=lambda: 1 / 0, name="loader")
        loader.start()
        loader.join()
        if how == "thread":
            sys.exit(0)
        metric_core.flush(3)
        open(run + ".ready", "w").close()
        time.sleep(120)
    if how == "fork":  # a forked worker that exits normally: the parent's attempt goes on
        pid = os.fork()
        if pid == 0:
            sys.exit(0)
        os.waitpid(pid, 0)
        metric_core.record_metric("x", 9.0)
        metric_core.flush(3)
        metric_core.shutdown()
    if how == "exit":
        sys.exit(3)
    if how in ("sigint", "offline"):
        os.kill(os.getpid(), signal.SIGINT if how == "sigint" else signal.SIGTERM)
        time.sleep(30)
    if how == "stall":
        time.sleep(1.5)
        metric_core.flush(3)
        metric_core.shutdown()
    if how == "alive":
        open(run + ".ready", "w").close()
        time.sleep(120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
"""


def _ends(tmp_path: Path, how: str, hang_dump_after: str = "0") -> tuple[subprocess.Popen, Path]:
    script, run = tmp_path / "ends.py", tmp_path / "run"
    script.write_text(ENDS)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTHONFAULTHANDLER", None)
    return subprocess.Popen(
        [sys.executable, str(script), str(run), how, hang_dump_after], env=env, stderr=subprocess.PIPE
    ), run


@pytest.mark.parametrize(
    ("how", "code", "end", "detail"),
    [
        ("thread", 0, "exception", ("ZeroDivisionError", "division by zero")),
        ("exit", 3, "exit", None),
        ("sigint", -signal.SIGINT, "signal", "SIGINT"),  # as Python ends on a KeyboardInterrupt
        ("offline", -signal.SIGTERM, "signal", "SIGTERM"),
        ("spawned", 1, "exception", ("KeyError", "'lost shard'")),
        ("finally", 1, "exception", ("RuntimeError", "in the loop")),  # shutdown() in a finally
        ("fork", 0, "shutdown", None),
    ],
)
def test_each_end_is_recorded_and_the_exit_status_kept(tmp_path, how, code, end, detail):
    child, run = _ends(tmp_path, how)
    assert child.wait(timeout=60) == code
    (source,) = inspect_json(run)["sources"]
    (attempt,) = source["attempts"]
    assert attempt["end"] == end
    if isinstance(detail, tuple):
        assert (attempt["exception"]["type"], attempt["exception"]["message"]) == detail
    elif end == "signal":
        assert attempt["signal"] == detail
    if how == "fork":
        assert attempt["records"] == 4 and attempt["last_step"] == 3
    if how == "thread":
        assert attempt["thread_exceptions"][0]["thread"] == "loader"
    if how == "spawned":  # the framework caught it; @metric_core.record recorded it
        assert attempt["exception"]["where"].endswith("in child")
    # Stack files only for signals that came: the others were armed, hidden, and say only that
    folder = run / "stacks"
    files = list(folder.iterdir()) if folder.exists() else []
    visible = {p.name.split(".")[-2] for p in files if not p.name.startswith(".")}
    came = {"sigint": "SIGINT", "offline": "SIGTERM"}.get(how)
    assert visible <= {came}, sorted(p.name for p in files)
    for p in files:
        first = p.read_text().splitlines()[0]
        assert "received" not in first and (p.name.startswith(".") or p.name.split(".")[-2] == came), first


def test_a_stalled_flush_leaves_a_stack_dump_and_a_pause(tmp_path):
    child, run = _ends(tmp_path, "stall", hang_dump_after="0.5")
    assert child.wait(timeout=60) == 0
    report = inspect_json(run, "--pause-after", "1")
    (attempt,) = report["sources"][0]["attempts"]
    assert attempt["end"] == "shutdown"
    (dump,) = attempt["stacks"]
    assert dump.startswith("stacks/") and dump.endswith(".hang-1.txt")
    text = (run / dump).read_text()
    assert text.startswith("metriclog: no flush for") and "ends.py" in text
    (pause,) = report["pauses"]
    assert pause["step"] == 3 and pause["seconds"] >= 1.4
    line = ENDS.splitlines().index("        time.sleep(1.5)") + 1
    where = f"{tmp_path / 'ends.py'}:{line} in main"
    assert pause["stuck_in"] == [{"where": where, "sources": [{"process": "p", "rank": 0}]}]
    assert not list((run / "stacks").glob("*SIG*")), "the files of signals that never came are gone"


def test_a_users_handler_installed_after_init_survives_init_shutdown_cycles(tmp_path):
    child, _ = _ends(tmp_path, "cycles")
    assert child.wait(timeout=60) == 7, child.stderr.read()  # its handler ran: os._exit(7)


@pytest.mark.parametrize("how", ["alive", "thread_alive"])
def test_a_live_writer_is_running_and_a_killed_one_died(tmp_path, how):
    child, run = _ends(tmp_path, how)
    ready = Path(f"{run}.ready")
    while not ready.exists():  # a condition, polled
        with contextlib.suppress(subprocess.TimeoutExpired):
            assert child.wait(timeout=0.05) is None, child.stderr.read()
    first = inspect_json(run)["sources"][0]["attempts"][0]
    assert first["end"] == "running" and first["ended_at"] is None  # a thread's error does not end it
    assert [e["thread"] for e in first["thread_exceptions"]] == (["loader"] if how == "thread_alive" else [])
    child.kill()
    child.wait()
    deadline = time.monotonic() + 60  # dead: its pid gone, and no heartbeat for two intervals
    while (second := inspect_json(run)["sources"][0]["attempts"][0])["end"] == "running":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    if how == "alive":
        assert second["end"] == "died"
        assert "no exception or signal recorded" in verdict(run)
    else:  # it ended without shutdown() after its loader thread failed: that is the likely cause
        assert second["end"] == "exception" and second["exception"]["type"] == "ZeroDivisionError"


def test_an_error_that_follows_a_peers_death_yields_to_it_within_a_second():
    from metric_core.offline.inspect.story import first_failure
    from metric_core.offline.read.attempts import Attempt

    def ended(process: str, end: str, at: float, **more) -> Attempt:
        return Attempt(process, int(process[-1]), "a" + process[-1], 0.0, 0, end=end, ended_at=at, **more)

    peer_error = {"type": "RuntimeError", "message": "[gloo] Connection closed by peer [10.0.0.2]:5678"}
    survivor = ended("Trainer_r0", "exception", 100.00, exception=peer_error)
    culprit = ended("Trainer_r2", "died", 100.40)
    stopped = ended("Trainer_r1", "signal", 100.05, signal="SIGTERM")
    assert first_failure([survivor, stopped, culprit]).process == "Trainer_r2"
    late = ended("Trainer_r3", "died", 101.50)  # more than a second after: a later event
    assert first_failure([survivor, late]).process == "Trainer_r0"
    own_error = ended(
        "Trainer_r1", "exception", 100.30, exception={"type": "ValueError", "message": "bad batch"}
    )
    assert first_failure([survivor, own_error, culprit]).process == "Trainer_r1"  # the earliest real cause


TERM_BEFORE_ANY_WRITE = """
import os, sys, time
import metric_core

run, attempt = sys.argv[1], sys.argv[2]
# A writer thread that would not write for a minute: nothing of this attempt reaches the disk
# but what init() itself writes.
metric_core.init(run, rank=0, process_name="Trainer_r0", file_format="jsonl", step=0,
                 flush_interval=60.0, hang_dump_after=0)
metric_core.record_metric("loss", 1.0 if attempt == "1" else 2.0, metric_core.Reduce.MEAN)
if attempt == "1":
    open(run + ".ready", "w").close()
    time.sleep(120)  # the SIGTERM comes here, before any flush() or write of the writer thread
metric_core.flush(0)
metric_core.shutdown()
"""


def test_an_attempt_stopped_before_its_first_write_is_told(tmp_path):
    # soak seed 7037: SIGTERM right after init(), before the writer thread's first write,
    # left only stack files; the restart's files made inspect say nothing of the first attempt
    script, run = tmp_path / "term.py", tmp_path / "run"
    script.write_text(TERM_BEFORE_ANY_WRITE)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTHONFAULTHANDLER", None)
    first = subprocess.Popen([sys.executable, str(script), str(run), "1"], env=env)
    ready = Path(f"{run}.ready")
    while not ready.exists() and first.poll() is None:  # a condition, polled
        with contextlib.suppress(subprocess.TimeoutExpired):
            first.wait(timeout=0.05)
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=60) == -signal.SIGTERM
    # Killed by the signal itself, the process never showed the file it filled: it keeps its
    # armed (hidden) name, and only the signal that came has one
    (stopped,) = [p.name for p in (run / "stacks").iterdir() if p.name.endswith(".SIGTERM.txt")]
    assert not [p for p in (run / "stacks").iterdir() if not p.name.startswith(".")]
    assert [p.name for p in run.glob("Trainer_r0.*")] == ["Trainer_r0.r0.00000.journal"]
    second = subprocess.run([sys.executable, str(script), str(run), "2"], env=env, timeout=60)
    assert second.returncode == 0
    assert sorted(p.name for p in run.glob("Trainer_r0.*")) == [
        "Trainer_r0.r0.00000.journal",  # the first attempt's, never overwritten
        "Trainer_r0.r0.00001.jsonl",
    ]

    report = inspect_json(run)
    (source,) = report["sources"]
    first_attempt, second_attempt = source["attempts"]
    assert stopped == f".Trainer_r0.r0.{first_attempt['attempt']}.SIGTERM.txt"
    assert (first_attempt["number"], first_attempt["end"], first_attempt["signal"]) == (
        1,
        "signal",
        "SIGTERM",
    )
    assert first_attempt["pid"] == first.pid and first_attempt["records"] == 0
    assert first_attempt["stacks"] == [f"stacks/{stopped}"]
    assert (second_attempt["number"], second_attempt["end"], second_attempt["records"]) == (2, "shutdown", 1)
    ff = report["first_failure"]
    assert (ff["attempt"], ff["end"], ff["signal"]) == (first_attempt["attempt"], "signal", "SIGTERM")
    assert "was stopped by SIGTERM" in verdict(run)


def test_the_story_follows_time_and_keeps_messages_whole():
    """Issue 43: the groups of ranks that followed a failure are told in the order they ended,
    not by rank; an exception message is whole (a long path in it shortened from the left in
    text only), never cut."""
    from metric_core.offline.inspect import story
    from metric_core.offline.read.attempts import Attempt

    gloo = (
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer "
        "[127.0.0.1]:28561, after a long wait of the collective that the peer never joined"
    )

    def attempt(rank: int, end: str, at: float, **how: object) -> Attempt:
        a = Attempt(f"Trainer_r{rank}", rank, f"{rank:016x}", 0.0, 0, number=1, end=end, ended_at=at)
        a.last_step = 9
        for k, v in how.items():
            setattr(a, k, v)
        return a

    attempts = [
        attempt(0, "signal", 100.9, signal="SIGTERM"),
        attempt(1, "signal", 100.9, signal="SIGTERM"),
        attempt(2, "exception", 100.0, exception={"type": "ValueError", "message": "bad batch"}),
        attempt(3, "exception", 100.5, exception={"type": "RuntimeError", "message": gloo}),
    ]
    (line,) = story.story_lines(story.first_failure(attempts), attempts, [])
    shown = gloo.replace("/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc", ".../tcp/pair.cc")
    assert line == (
        "Trainer_r2 (rank 2) raised ValueError('bad batch') after step 9 (its last flushed); "
        f"500 ms later 1 other rank raised RuntimeError({shown!r}); "
        "900 ms later 2 other ranks were stopped by SIGTERM (the launcher)."
    ), line
    assert attempts[3].exception["message"] == gloo  # JSON keeps it whole
