"""A ``console`` backend in ``global_reduce`` mode (metric_core.torchforge), beside real rank
processes: rank 0's console shows each step's global reduction while the job runs, in
torchforge's ``ConsoleBackend`` format, equal to numpy over what every rank recorded; a rank
that dies is let go and said; the last steps are printed before rank 0 exits, or said; and
no rank loads polars."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import wait_for

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # real rank processes and rank 0's printer, for seconds each

# A torchforge job: only metric_core.torchforge names, torchforge's calls and config. Each
# rank writes what it recorded to truth-<rank>.jsonl before it flushes the step. Rank 0, with
# "live", goes on to the next step only once the printer printed this one on its console
# (its own stderr, the file "out"): the steps are printed while the job runs.
JOB = r"""
import asyncio, json, os, signal, sys, time
import numpy as np
from metric_core.torchforge import Reduce, get_or_create_metric_logger, record_metric

c = json.loads(sys.argv[1])
rank = int(os.environ["RANK"])

def wait_for(condition, what):
    deadline = time.monotonic() + 120
    while not condition():
        if time.monotonic() > deadline:
            sys.exit(f"rank {rank} timed out waiting for {what}")
        time.sleep(0.02)

def printed(step):
    with open(c["out"]) as f:
        return f"- METRICS STEP {step} ===" in f.read()

async def main():
    mlogger = await get_or_create_metric_logger(process_name="trainer")
    console = {"logging_mode": "global_reduce", **c.get("console", {})}
    start = c.get("start", 0)  # a job resumed from a checkpoint at this step
    await mlogger.init_backends.call_one({"console": console}, start)
    rng = np.random.default_rng([rank, start])
    with open(f"truth-{rank}.jsonl", "w") as truth:
        for step in range(start, c["steps"]):
            for _ in range(3):
                for key, how, value in (
                    ("loss", Reduce.MEAN, 1e6 + rng.normal()),
                    ("tokens", Reduce.SUM, float(rng.integers(0, 1000))),
                    ("grad/max", Reduce.MAX, rng.normal()),
                    ("grad/min", Reduce.MIN, rng.normal()),
                    ("grad/std", Reduce.STD, rng.normal()),
                ):
                    record_metric(key, value, how)
                    truth.write(json.dumps([step, key, value]) + "\n")
            truth.flush()
            if step == c["steps"] - 1 and rank == c.get("hold_last"):
                wait_for(lambda: os.path.exists("release"), "release")
            await mlogger.flush.call_one(step)
            if step == c.get("die_after", {}).get(str(rank)):
                os.kill(os.getpid(), signal.SIGKILL)
            if rank == 0 and c.get("live") and step < c["steps"] - 1:
                wait_for(lambda: printed(step), f"step {step} printed")
    if rank == 0:
        open("shutting", "w").close()
    await mlogger.shutdown.call_one()
    heavy = sorted({m.split(".")[0] for m in sys.modules} & {"polars", "pandas", "wandb", "typer", "rich"})
    print(f"rank {rank} exits; heavy modules: {heavy}", file=sys.stderr, flush=True)

asyncio.run(main())
"""
HOW = {"loss": np.mean, "tokens": np.sum, "grad/max": np.max, "grad/min": np.min, "grad/std": np.std}
STEP = re.compile(
    r"^INFO:metric_core\.torchforge\.metrics: (=== \[global_reduce\] - METRICS STEP (\d+) ===\n"
    r"(?:  .*\n)*==============================\n)\n",
    re.M,
)


def torchforge_text(step: int, values: dict[str, str]) -> str:
    """torchforge's ``ConsoleBackend.log_batch`` message at 6e77f0b, its f-strings as they are."""
    metrics_str = "\n".join(f"  {key}: {value}" for key, value in sorted(values.items()))
    return f"=== [global_reduce] - METRICS STEP {step} ===\n{metrics_str}\n==============================\n"


def start(tmp_path: Path, world: int, **config) -> tuple[list[subprocess.Popen], Path]:
    """The ranks of a job, rank 0's stderr in ``out``."""
    run, out = tmp_path / "run", tmp_path / "rank0.err"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "FORGE_DISABLE_METRICS", "METRICLOG_DIR")}
    env.update(METRICLOG_DIR=str(run), WORLD_SIZE=str(world), PYTHONPATH=str(REPO))
    arg = json.dumps({**config, "out": str(out)})
    with out.open("w") as rank0_err:
        ranks = [
            subprocess.Popen(
                [sys.executable, "-c", JOB, arg],
                cwd=tmp_path,
                env={**env, "RANK": str(r)},
                stderr=rank0_err if r == 0 else subprocess.PIPE,
                text=True,
            )
            for r in range(world)
            if r not in config.get("absent", ())  # a rank that never starts: the last ones only
        ]
    return ranks, out


def ended(ranks: list[subprocess.Popen], out: Path, killed: set[int] = frozenset()) -> str:
    """Every rank ended as planned without loading anything heavy; rank 0's console."""
    for r, p in enumerate(ranks):
        _, err = p.communicate(timeout=180)
        if r in killed:
            assert p.returncode == -9, err
            continue
        said = out.read_text() if r == 0 else err
        assert p.returncode == 0, said
        assert f"rank {r} exits; heavy modules: []" in said, said
    return out.read_text()


def printed_steps(console: str) -> dict[int, dict[str, str]]:
    """Each step's block as rank 0's console shows it (in torchforge's format, each once,
    in order): its values as printed."""
    steps: dict[int, dict[str, str]] = {}
    for m in STEP.finditer(console):
        step = int(m.group(2))
        lines = m.group(1).splitlines()[1:-1]
        values = dict(line[2:].split(": ", 1) for line in lines)
        assert m.group(1) == torchforge_text(step, values)
        assert step not in steps, f"step {step} printed twice"
        steps[step] = values
    assert list(steps) == sorted(steps), "steps in order"
    assert console.count("METRICS STEP") == len(steps), console  # no block out of the format
    return steps


def recorded(tmp_path: Path, world: int) -> list[tuple[int, int, str, float]]:
    return [
        (r, *json.loads(line))
        for r in range(world)
        for line in (tmp_path / f"truth-{r}.jsonl").read_text().splitlines()
    ]


def check(steps: dict[int, dict[str, str]], values: list[tuple[int, int, str, float]], ranks_at) -> None:
    """Each printed step equals numpy over the values its ranks recorded (sums and means are
    exact: the correctly rounded ``fractions`` sum and mean too); ``ranks_at(step)``: the
    ranks whose values the step holds."""
    assert sorted(steps) == sorted({s for _, s, _, _ in values})
    for step, shown in steps.items():
        assert set(shown) == set(HOW)
        for key, how in HOW.items():
            of = [v for r, s, k, v in values if s == step and k == key]
            assert len(of) == 3 * len(ranks_at(step)), (step, key)
            assert {r for r, s, k, _ in values if s == step and k == key} == ranks_at(step)
            value = float(shown[key])
            assert str(value) == shown[key]  # as Python prints a float, as torchforge's f-string does
            assert value == pytest.approx(float(how(np.array(of))), rel=1e-12), (step, key)
            exact = sum(Fraction(v) for v in of)
            if key == "tokens":
                assert value == float(exact), (step, key)
            if key == "loss":
                assert value == float(exact / len(of)), (step, key)
            if key in ("grad/max", "grad/min"):
                assert value == float(how(np.array(of))), (step, key)


def test_each_global_step_is_printed_on_rank_0_live_in_torchforges_format_equal_to_numpy(tmp_path):
    """Rank 0 goes on only once a step was printed; rank 1 flushes the last step after rank 0
    began its shutdown, which waits for it: the last step is printed before rank 0 exits."""
    world, steps = 3, 6
    ranks, out = start(tmp_path, world, steps=steps, live=True, hold_last=1)
    wait_for(lambda: (tmp_path / "shutting").exists() or ranks[0].poll() is not None, "rank 0's shutdown")
    (tmp_path / "release").touch()
    console = ended(ranks, out)
    printed = printed_steps(console)
    check(printed, recorded(tmp_path, world), lambda step: set(range(world)))
    (last,) = [m for m in STEP.finditer(console) if m.group(2) == str(steps - 1)]
    assert last.end() <= console.index("rank 0 exits"), console
    warned = [line for line in console.splitlines() if line.startswith("WARNING")]
    assert [w for w in warned if "reading and printing the steps took" not in w] == [], console  # late: load


def test_a_rank_that_dies_is_let_go_said_once_and_the_steps_go_on_without_it(tmp_path):
    world, steps = 3, 6
    ranks, out = start(tmp_path, world, steps=steps, live=True, die_after={"2": 2})
    console = ended(ranks, out, killed={2})
    printed = printed_steps(console)
    check(printed, recorded(tmp_path, world), lambda step: {0, 1, 2} if step <= 2 else {0, 1})
    said = [line for line in console.splitlines() if "trainer_r2 (rank 2)" in line]
    assert len(said) == 1 and "the steps go on without it" in said[0], console
    assert said[0].startswith("WARNING:metric_core.torchforge.metrics: console (global_reduce): "), said
    # said before the first step printed without it
    assert console.index(said[0]) < console.index("- METRICS STEP 3 ==="), console


def test_a_step_not_flushed_by_every_rank_when_rank_0_stops_waiting_is_said_not_printed(tmp_path):
    """Rank 0's shutdown waits "wait" seconds for the printer; rank 1 flushes its last step
    only after rank 0 exited: the printer printed the steps before it and says this one."""
    world, steps = 2, 4
    ranks, out = start(tmp_path, world, steps=steps, hold_last=1, console={"wait": 1})
    _, _ = ranks[0].communicate(timeout=180)
    (tmp_path / "release").touch()
    console = ended(ranks, out)
    printed = printed_steps(console)
    assert sorted(printed) == list(range(steps - 1)), console
    values = [v for v in recorded(tmp_path, world) if v[1] < steps - 1]
    check(printed, values, lambda step: {0, 1})
    said = (
        f"WARNING:metric_core.torchforge.metrics: console (global_reduce): stopped (SIGTERM) after step "
        f"{steps - 2}: step {steps - 1} not printed (trainer_r1 (rank 1) did not flush it); `metriclog "
        f"reduce {tmp_path / 'run'}` computes it from the files"
    )
    assert said in console, console
    assert console.index(said) < console.index("rank 0 exits"), console
    assert "printer ended with exit code" not in console, console


def test_a_printer_whose_rank_0_died_prints_what_is_complete_and_says_it_stopped(tmp_path):
    """Rank 0 SIGKILLed after its flush of step 2: its printer (an orphan now) looks once
    more, prints the steps complete by then, says it stopped, and ends; rank 1 trains on (and
    holds its last step until then, or the printer would print every step as the job's end)."""
    world, steps = 2, 6
    ranks, out = start(tmp_path, world, steps=steps, live=True, die_after={"0": 2}, hold_last=1)
    wait_for(lambda: "stopped (rank 0 (pid" in out.read_text(), "the printer's last words")
    (tmp_path / "release").touch()
    console = ended(ranks, out, killed={0})
    printed = printed_steps(console)
    assert 1 in printed and sorted(printed) == list(range(len(printed))), console
    values = recorded(tmp_path, world)
    check(printed, [v for v in values if v[1] in printed], lambda step: {0, 1} if step <= 2 else {1})
    (said,) = [line for line in console.splitlines() if "stopped (rank 0 (pid" in line]
    assert said.startswith("WARNING:metric_core.torchforge.metrics: console (global_reduce): "), said
    assert f"after step {max(printed)}:" in said, said


# Ranks of metric_core itself, for a printer run in this process: rank 1 holds its last
# step until the test releases it (the job goes on while the printer is slow).
WRITER = r"""
import json, os, sys, time
import metric_core
c = json.loads(sys.argv[1])
rank = c["rank"]
metric_core.init(c["run"], rank=rank, process_name="trainer", world_size=2, flush_interval=c["interval"])
for step in range(c["steps"]):
    while rank == 1 and step == c["steps"] - 1 and not os.path.exists(c["release"]):
        time.sleep(0.02)
    metric_core.record_metric("loss", float(10 * step + rank))
    metric_core.flush(step)
metric_core.shutdown()
"""


def test_a_printer_that_cannot_keep_up_says_so_once_and_prints_every_step_late_in_order(tmp_path):
    """A console that takes a whole flush interval to show the first step (a blocked
    terminal): the look took more than half a flush interval, which is said once, and every
    step is printed all the same, once, in order."""
    import logging
    import threading

    from metric_core.offline.console import Printer

    run, steps, flush_interval = tmp_path / "run", 5, 0.2
    config = {"run": str(run), "steps": steps, "interval": flush_interval, "release": str(tmp_path / "go")}
    ranks = [
        subprocess.Popen([sys.executable, "-c", WRITER, json.dumps({**config, "rank": r})], cwd=tmp_path)
        for r in range(2)
    ]
    shown: list[str] = []

    class SlowConsole(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            shown.append(record.getMessage())
            until = time.monotonic() + flush_interval
            while len(shown) == 1 and time.monotonic() < until:  # the first step takes that long to show
                time.sleep(0.01)

    log = logging.getLogger("tests.console.slow")
    log.handlers[:] = [SlowConsole()]
    log.setLevel(logging.INFO)
    log.propagate = False
    wait_for(lambda: (run / "run.json").exists() or ranks[0].poll() is not None, "rank 0's init")
    printer = Printer(run, log, flush_interval=flush_interval)
    ended: list[str] = []
    looking = threading.Thread(target=lambda: ended.append(printer.run()))
    looking.start()
    wait_for(lambda: any("took" in m for m in shown), "the printer to say it is late")
    (tmp_path / "go").touch()
    looking.join(timeout=120)
    for p in ranks:
        assert p.wait(timeout=120) == 0
    assert ended == ["finished"], shown
    notes = [m for m in shown if "reading and printing the steps took" in m]
    assert len(notes) == 1 and "more than half the flush interval (200 ms)" in notes[0], shown
    printed = printed_steps(
        "".join(f"INFO:metric_core.torchforge.metrics: {m}\n" for m in shown if "STEP" in m)
    )
    assert sorted(printed) == list(range(steps)), shown
    for step, values in printed.items():
        assert values == {"loss": str(float(np.mean([10 * step, 10 * step + 1])))}


def test_a_job_resumed_at_a_step_prints_from_that_step_the_restarts_values(tmp_path):
    """The job ran steps 0-3, then was resumed from step 2 into the same run directory
    (``init_backends(config, global_step=2)``): its console shows steps 2-5, each once, with
    the resumed job's values (steps 2 and 3 are the restart's, read as W&B's rewind)."""
    world = 2
    ranks, out = start(tmp_path, world, steps=4)
    ended(ranks, out)
    ranks, out = start(tmp_path, world, steps=6, start=2, live=True)
    console = ended(ranks, out)
    printed = printed_steps(console)
    assert sorted(printed) == [2, 3, 4, 5], console
    check(printed, recorded(tmp_path, world), lambda step: {0, 1})


def test_a_console_wait_that_is_no_number_is_refused_naming_it(tmp_path, monkeypatch):
    import asyncio

    from metric_core.torchforge import MetricCollector, metric_actors, metrics
    from metric_core.torchforge.metric_actors import get_or_create_metric_logger

    monkeypatch.setattr(metric_actors, "_global_logger", None)  # a fresh process's
    monkeypatch.setattr(metrics, "process_name", None)
    monkeypatch.setenv("METRICLOG_DIR", str(tmp_path / "run"))
    monkeypatch.delenv("RANK", raising=False)

    async def main() -> None:
        mlogger = await get_or_create_metric_logger(process_name="trainer")
        await mlogger.init_backends.call_one({"console": {"logging_mode": "global_reduce", "wait": "1m"}})

    MetricCollector._instances.clear()
    try:
        with pytest.raises(ValueError, match=r"backend 'console': wait='1m' must be seconds"):
            asyncio.run(main())
    finally:
        MetricCollector._instances.clear()
    assert not (tmp_path / "run").exists()  # refused before anything started


def test_a_rank_that_never_wrote_holds_every_step_and_is_counted_when_rank_0_stops_waiting(tmp_path):
    world, steps = 3, 3
    ranks, out = start(tmp_path, world, steps=steps, console={"wait": 1}, absent=[2])
    console = ended(ranks, out)
    assert printed_steps(console) == {}, console
    said = (
        "WARNING:metric_core.torchforge.metrics: console (global_reduce): stopped (SIGTERM): steps 0-2 not "
        "printed (1 rank(s) that never wrote (run.json counts 3) did not flush them); `metriclog reduce "
        f"{tmp_path / 'run'}` computes them from the files"
    )
    assert said in console, console
