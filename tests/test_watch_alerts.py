"""``metriclog watch --alert`` beside real writer processes: one alarm per episode, named by
key, step and rank, and none over a healthy run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
METRICLOG = str(Path(sys.executable).with_name("metriclog"))

WRITER = """
import math, sys, time
import numpy as np
import metric_core
from metric_core import Reduce, record_metric
run, rank, steps, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
metric_core.init(run, rank=rank, process_name=f"TrainActor_r{rank}", flush_interval=0.05, world_size=4)
rng = np.random.default_rng(rank)
for step in range(steps):
    loss = 2.0 / (1 + step / 100) + rng.normal(0, 0.01)
    if mode == "faults" and rank == 2 and step == 30:
        loss = math.nan  # one rank's loss turns NaN at one step
    record_metric("train/loss", loss, Reduce.MEAN)
    grad = 1.0 + rng.normal(0, 0.05)
    if mode == "faults" and 50 <= step <= 52:
        grad = 500.0  # an explosion of three steps: one episode
    record_metric("train/grad_norm", grad, Reduce.MEAN)
    reward = 1.0 + rng.normal(0, 0.02)
    if mode == "faults" and step == 70:
        reward = 3.0  # a spike
    record_metric("rollout/reward", reward, Reduce.MEAN)
    metric_core.flush(step)
    if step % 20 == 0:
        time.sleep(0.01)
metric_core.shutdown()
"""

RULES = [
    "train/loss: nonfinite",
    "train/grad_norm > 100",
    "rollout/reward: spike 6 sigma",
    "rollout/reward: drop 50% over 20 steps",
    "train/*: nonfinite",
]


SIDECAR = ["upload", "--project", "p", "--offline", "--follow"]


def _watch(
    tmp_path: Path, steps: int, mode: str, *args: str, verb: list[str] | None = None
) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``metriclog watch`` (or ``verb``: the sidecar) with the rules beside a job of 4 writers;
    what it said, and its ``--on-alert`` commands' lines."""
    run, said = tmp_path / "run", tmp_path / "alerts.txt"
    command = (
        'echo "$METRICLOG_KEY|$METRICLOG_STEP|$METRICLOG_VALUE|$METRICLOG_PROCESS|$METRICLOG_RANK'
        f'|$METRICLOG_RULE" >> {said}'
    )
    rules = [a for r in RULES for a in ("--alert", r)]
    watcher = subprocess.Popen(
        [
            METRICLOG,
            *(verb or ["watch"])[:1],
            str(run),
            *(verb or ["watch"])[1:],
            "--wait",
            "--interval",
            "0.2",
            *rules,
            "--on-alert",
            command,
            *args,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(run), str(rank), str(steps), mode])
        for rank in range(4)
    ]
    try:
        assert [w.wait(timeout=300) for w in writers] == [0, 0, 0, 0]
        _, err = watcher.communicate(timeout=120)
    finally:
        for p in [*writers, watcher]:
            if p.poll() is None:
                p.kill()
    done = subprocess.CompletedProcess(watcher.args, watcher.returncode, "", err)
    return done, sorted(said.read_text().splitlines()) if said.exists() else []


@pytest.mark.parametrize("verb", [["watch"], SIDECAR], ids=["watch", "sidecar"])
def test_one_alarm_per_episode_naming_key_step_and_rank(tmp_path, verb):
    done, alerts = _watch(tmp_path, 120, "faults", verb=verb)
    assert done.returncode == 0, done.stderr
    grad = [a for a in alerts if a.startswith("train/grad_norm|")]
    (first_rank,) = {a.split("|")[4] for a in grad}  # the first rank whose own value broke it
    reward_71 = _mean_reward(71)
    assert alerts == sorted(
        [
            "train/loss|30|nan|TrainActor_r2|2|train/loss: nonfinite",
            "train/loss|30|nan|TrainActor_r2|2|train/*: nonfinite",
            # every rank recorded 500.0 in the explosion (steps 50-52): one alarm, its mean exactly that
            f"train/grad_norm|50|500.0|TrainActor_r{first_rank}|{first_rank}|train/grad_norm > 100",
            # every rank recorded 3.0 at step 70: a spike of the global mean, no rank of its own
            "rollout/reward|70|3.0|||rollout/reward: spike 6 sigma",
            # and the step after it is less than half the largest of the previous 20 (the spike)
            f"rollout/reward|71|{reward_71!r}|||rollout/reward: drop 50% over 20 steps",
        ]
    ), done.stderr
    assert done.stderr.count("alert: ") == 5
    assert (
        "alert: train/loss is nan at step 30 on TrainActor_r2 (rank 2) (its global value: not finite"
        in done.stderr
    )


def _mean_reward(at: int) -> float:
    """The global mean of the ranks' rewards at step ``at`` (none faulty), from the writers'
    own generators: the mean of 4 doubles, correctly rounded."""
    from fractions import Fraction

    import numpy as np

    values = []
    for rank in range(4):
        rng = np.random.default_rng(rank)
        for _ in range(at + 1):  # each step draws loss, grad, reward noise, in that order
            rng.normal(0, 0.01), rng.normal(0, 0.05)
            reward = 1.0 + rng.normal(0, 0.02)
        values.append(reward)
    return float(sum(Fraction(v) for v in values) / 4)


def test_a_healthy_run_of_2000_steps_raises_no_alarm(tmp_path):
    done, alerts = _watch(tmp_path, 2000, "healthy")
    assert done.returncode == 0, done.stderr
    assert alerts == [] and "alert:" not in done.stderr


def test_raw_alarms_judge_each_rank_apart(tmp_path):
    done, alerts = _watch(tmp_path, 120, "faults", "--alert-on", "raw")
    assert done.returncode == 0, done.stderr
    grads = [a for a in alerts if a.startswith("train/grad_norm|")]
    assert grads == [f"train/grad_norm|50|500.0|TrainActor_r{r}|{r}|train/grad_norm > 100" for r in range(4)]
    losses = [a for a in alerts if a.startswith("train/loss|")]
    assert losses == sorted(
        [
            "train/loss|30|nan|TrainActor_r2|2|train/loss: nonfinite",
            "train/loss|30|nan|TrainActor_r2|2|train/*: nonfinite",
        ]
    )


def test_a_rule_that_is_none_is_an_error_naming_the_forms(tmp_path):
    (tmp_path / "run").mkdir()
    done = subprocess.run(
        [METRICLOG, "watch", str(tmp_path / "run"), "--alert", "train/loss explodes"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "--alert 'train/loss explodes' is not a rule: write one of 'KEY: nonfinite'" in done.stderr


def test_alert_on_or_on_alert_without_a_rule_is_an_error(tmp_path):
    (tmp_path / "run").mkdir()
    for verb in (["watch"], SIDECAR):
        for option, value in (("--on-alert", "true"), ("--alert-on", "raw"), ("--alert-on", "global")):
            done = subprocess.run(
                [METRICLOG, verb[0], str(tmp_path / "run"), *verb[1:], option, value],
                capture_output=True,
                text=True,
            )
            assert done.returncode == 1 and "Traceback" not in done.stderr, (verb, option, done.stderr)
            assert f"Error: {option} works only with --alert: add --alert RULE" in done.stderr, done.stderr
    done = subprocess.run(
        [METRICLOG, "upload", str(tmp_path / "run"), "--project", "p", "--alert", "x > 1"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "--alert works only with --follow" in done.stderr, done.stderr


def test_the_sidecar_says_a_bad_rule_as_watch_does(tmp_path):
    (tmp_path / "run").mkdir()
    done = subprocess.run(
        [METRICLOG, "upload", str(tmp_path / "run"), *SIDECAR[1:], "--alert", "loss: spike -1 sigma"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "--alert 'loss: spike -1 sigma': a spike is more than 0 sigma" in done.stderr, done.stderr


RESTARTED = """
import math, os, sys, time
import metric_core
from metric_core import Reduce, record_metric
run, start, end, nan_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), [int(a) for a in sys.argv[4:]]
metric_core.init(run, rank=0, process_name="Trainer_r0", world_size=1, flush_interval=0.05, step=start)
for step in range(start, end):
    record_metric("train/loss", math.nan if step in nan_at else 1.0 / (step + 1), Reduce.MEAN)
    metric_core.flush(step)
    time.sleep(0.02)
if end < 30:
    time.sleep(600)  # alive until the test kills it: its job restarts it from a checkpoint
metric_core.shutdown()
"""


@pytest.mark.parametrize("on", ["global", "raw"])
def test_the_sidecar_judges_a_restarts_rewound_steps_and_no_step_twice(tmp_path, on):
    """Attempt 1 has a NaN at step 5 and is killed after step 19; its restart from step 9 has
    a NaN at step 9 (a step judged already, now with a value of its own). The restart replaces
    rows handed over, so the sidecar reads the run anew: step 9 alarms, step 5 (unchanged)
    does not alarm twice."""
    import json
    import signal
    import time

    run, said, log = tmp_path / "run", tmp_path / "alerts.txt", tmp_path / "sidecar.log"
    command = f'echo "$METRICLOG_KEY|$METRICLOG_STEP|$METRICLOG_VALUE|$METRICLOG_PROCESS" >> {said}'
    sidecar = subprocess.Popen(
        [
            *(METRICLOG, "upload", str(run), *SIDECAR[1:], "--wait", "--interval", "0.2", "--alert-on", on),
            *("--alert", "train/loss: nonfinite", "--on-alert", command),
        ],
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
    )
    first = subprocess.Popen([sys.executable, "-c", RESTARTED, str(run), "0", "20", "5"])
    ledger = run / ".metriclog" / "uploads.json"

    def sent() -> int:
        try:
            return max((e["rows_sent"] for e in json.loads(ledger.read_text())["runs"].values()), default=0)
        except (OSError, ValueError):
            return 0

    try:
        deadline = time.monotonic() + 120
        while sent() < 15:  # rows past step 9 handed over: the restart replaces some
            assert time.monotonic() < deadline and sidecar.poll() is None, log.read_text()
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        restart = subprocess.run([sys.executable, "-c", RESTARTED, str(run), "9", "30", "9"], timeout=120)
        assert restart.returncode == 0
        assert sidecar.wait(timeout=120) == 0, log.read_text()
    finally:
        for p in (first, sidecar):
            if p.poll() is None:
                p.kill()
    err = log.read_text()
    assert "restarted from a checkpoint: Trainer_r0 (rank 0) from step 9" in err, err
    assert said.read_text().splitlines() == [
        "train/loss|5|nan|Trainer_r0",
        "train/loss|9|nan|Trainer_r0",
    ], err


class _Event:
    def told(self) -> str:
        return "an alert"

    def who(self) -> str:
        return "rank0"

    def variables(self, run_dir: str) -> dict[str, str]:
        return {"METRICLOG_RUN": run_dir}


def test_a_relayed_commands_every_line_is_said_before_watch_ends(tmp_path, capsys):
    """On a terminal where watch redraws its table, a command's output is relayed through
    watch's stderr: all of it, before watch ends (its end once left the relay behind: lines
    lost)."""
    from metriclog.output.sources import EventCommands

    with EventCommands("seq -f 'L%g' 1 3000", str(tmp_path), option="--on-alert", kind="alert") as alerts:
        alerts.relay = True
        alerts.run(_Event())
    said = capsys.readouterr().err.splitlines()
    assert [line for line in said if line.startswith("L")] == [f"L{i}" for i in range(1, 3001)]
