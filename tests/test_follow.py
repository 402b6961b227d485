"""upload --follow beside real writer processes: what the real wandb client wrote offline,
read back, equals numpy over the values the writers recorded, in every mode; killed and
started again, it still does, with no row twice; a live source holds the global steps
however long it is silent, a dead one is let go, and the follow ends by itself."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from metric_core import reduce_run
from tests.conftest import wait_for
from tests.wandb_file import find_run_file, history_rows, read_records

METRICLOG = str(Path(sys.executable).with_name("metriclog"))
pytestmark = pytest.mark.slow  # real writer processes and a follower, for seconds each

# A rank records 3 keys a step, a few values each, with a background flush mid-step (so a
# step is on disk in parts), and writes what it recorded to truth-<rank>.jsonl.
WRITER = """
import glob, json, os, signal, sys, time
import numpy as np
import pyarrow.parquet as pq
import metric_core
from metric_core import Reduce, record_metric
from metric_core.format import journal
c = json.loads(sys.argv[1])
run, rank = c["run"], c["rank"]
open(f"{c['go']}.{rank}", "w").close()  # imported; the ranks started together init together
while not os.path.exists(c["go"]):
    time.sleep(0.01)
if c.get("die") == "before_init":  # init() puts the attempt on disk: this rank leaves no file
    os.kill(os.getpid(), signal.SIGKILL)
metric_core.init(
    run, rank=rank, process_name=f"Trainer_r{rank}", world_size=c["world"],
    flush_interval=c.get("flush_interval") or 0.02,
    sidecar=c.get("sidecar") if rank == 0 else None, step=c.get("start"),
    segment_records=c.get("segment_records") or 1_000_000,
)
rng = np.random.default_rng([rank, c.get("start") or 0])
# A restart whose first flush is flush(first_flush), steps after init(step=start): what it
# recorded before, sealed before that flush (segment_records 1), keeps the step start, and it
# replaces the earlier attempt's records from first_flush on (the truth file is named so).
first_flush = c.get("first_flush")
with open(f"{run}/../truth-{rank}-{first_flush or c.get('start') or 0}.jsonl", "a") as truth:
    for step in range(c.get("start") or 0, c["steps"]):
        if first_flush is not None and c["start"] < step <= first_flush:
            continue  # the steps up to its first flush recorded nothing of their own
        if step == c.get("die"):
            os.kill(os.getpid(), signal.SIGKILL)  # after its flush of the step before
        if step == c.get("pause_at"):
            time.sleep(c["pause_s"])  # an evaluation, a checkpoint
        held = time.monotonic()  # alive, silent (a hang) until the test lets it go or kills it
        while step == c.get("hold_at") and not os.path.exists(c["release"]) and time.monotonic() - held < 300:
            time.sleep(0.01)
        for i in range(4):
            for key, how, value in (
                ("loss", Reduce.MEAN, 1e6 + rng.normal()),
                ("tokens", Reduce.SUM, float(rng.integers(0, 1000))),
                ("grad/max", Reduce.MAX, rng.normal()),
            ):
                record_metric(key, value, how)
                truth.write(json.dumps([step, key, value]) + "\\n")
            time.sleep(c["pause"] / 4)
        truth.flush()
        if step == c.get("die_unflushed"):  # once its records of the step are on disk, before flush(step)
            recorded, deadline = (step + 1 - (c.get("start") or 0)) * 12, time.monotonic() + 120
            while time.monotonic() < deadline:
                (path,) = glob.glob(f"{run}/Trainer_r{rank}.r{rank}.*.journal")
                decoded = journal.decode(open(path, "rb").read())
                if decoded.table is not None and decoded.table.num_rows >= recorded:
                    break
                time.sleep(0.01)
            os.kill(os.getpid(), getattr(signal, c.get("die_signal") or "SIGKILL"))
            time.sleep(60)  # a caught SIGTERM ends the process from the signal's handler
        if first_flush is not None and step == c["start"]:  # once all it recorded is sealed
            sealed, deadline = 0, time.monotonic() + 120
            while sealed < 12 and time.monotonic() < deadline:
                time.sleep(0.01)
                sealed = sum(
                    pq.ParquetFile(path).metadata.num_rows
                    for path in glob.glob(f"{run}/Trainer_r{rank}.r{rank}.*.parquet")
                )
            assert sealed == 12, sealed
            metric_core.flush(first_flush)
            continue
        metric_core.flush(step)
metric_core.shutdown()
"""
HOW = {"loss": np.mean, "tokens": np.sum, "grad/max": np.max}


def writers(run: Path, steps: int, ranks: int | list[int], *, pause: float = 0.1, **more) -> list:
    """A writer process per rank (``ranks``: how many, or which), ``more``: die, die_unflushed,
    die_signal, pause_at, hold_at and flush_interval (rank -> the step it SIGKILLs itself at,
    or at the end of, once the step's records are on disk and before its flush; the signal
    of that end (default SIGKILL); pauses ``pause_s`` at, hangs at until ``release(run)`` or
    its kill; its writer's background flush interval; or pause_at, hold_at: the step every
    rank pauses or hangs at), sidecar (rank 0's), start (the step it resumes from),
    first_flush (a restart's first flush: the step after start it flushes first, its records
    of start sealed before it), segment_records, world.

    Steps of ``pause`` (0.1 s): the sidecar calls a rank stopped early after about ten
    steps of silence and hands its steps over without it; at 0.04 s a loaded machine
    stalled a writer that long (twice in full runs of the suite). The ranks started
    together begin once every one of them has imported metric_core (as a job's ranks
    rendezvous): on a loaded machine one took seconds longer to start, and the sidecar
    counted the sources without it. This returns when they have begun."""
    run.mkdir(exist_ok=True)
    which = range(ranks) if isinstance(ranks, int) else ranks
    world = more.get("world", ranks if isinstance(ranks, int) else len(ranks))
    go = run.parent / f"go-{uuid.uuid4().hex}"
    config = {"run": str(run), "steps": steps, "pause": pause, "world": world, "go": str(go)}
    config["release"] = str(run.parent / "release")
    config.update({k: more[k] for k in ("start", "first_flush", "segment_records", "pause_s") if k in more})

    def of(r: int) -> dict:
        steps = {k: more.get(k, {}).get(r) for k in ("die", "die_unflushed", "die_signal", "flush_interval")}
        for name in ("pause_at", "hold_at"):
            at = more.get(name)
            steps[name] = at.get(r) if isinstance(at, dict) else at
        return steps

    children = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                WRITER,
                json.dumps({**config, "rank": r, **of(r), "sidecar": more.get("sidecar")}),
            ],
            cwd=run.parent,  # not the repository: the sidecar must not depend on it
        )
        for r in which
    ]
    deadline = time.monotonic() + 120
    while not all(Path(f"{go}.{r}").exists() for r in which):
        assert all(c.poll() is None for c in children), "a writer failed to start"
        assert time.monotonic() < deadline, "the writers did not start"
        time.sleep(0.02)
    go.touch()
    return children


def release(run: Path) -> None:
    """The ranks held (``writers``' hold_at) go on."""
    (run.parent / "release").touch()


def command(run: Path, *args: str) -> list[str]:
    return [
        METRICLOG,
        "upload",
        str(run),
        "--project",
        "p",
        "--offline",
        "--follow",
        "--wait",  # started before the job: it waits for the directory
        "--interval",
        "0.2",
        *args,
    ]


def follow(run: Path, *args: str) -> subprocess.Popen:
    """A follower beside the job."""
    return subprocess.Popen(command(run, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def follow_logged(run: Path, log: Path, *args: str) -> subprocess.Popen:
    """A follower beside the job whose stderr goes to ``log``, to be read while it runs."""
    return subprocess.Popen(command(run, *args), stdout=subprocess.DEVNULL, stderr=log.open("w"), text=True)


def rows_sent(run: Path) -> int:
    ledger = run / ".metriclog" / "uploads.json"
    if not ledger.exists():
        return 0
    return max((e["rows_sent"] for e in json.loads(ledger.read_text())["runs"].values()), default=0)


def followed(run: Path, *args: str) -> subprocess.CompletedProcess:
    """A follower run to its end."""
    return subprocess.run(command(run, *args), capture_output=True, text=True, timeout=120)


def truth(run: Path, ranks: int) -> dict[int, list[tuple[int, str, float]]]:
    """What each rank recorded; a restart's records replace the earlier attempt's from its
    first step on (W&B's rewind, as the run is read)."""
    out: dict[int, list[tuple[int, str, float]]] = {}
    for r in range(ranks):
        attempts = sorted(run.parent.glob(f"truth-{r}-*.jsonl"), key=lambda p: int(p.stem.split("-")[-1]))
        values: list[tuple[int, str, float]] = []
        for path in attempts:
            start = int(path.stem.split("-")[-1])
            values = [v for v in values if v[0] < start]
            values += [tuple(json.loads(line)) for line in path.read_text().splitlines()]
        out[r] = values
    return out


def runs_written(run: Path) -> dict[str, dict]:
    """The ledger's runs, by W&B run name: the newest entry of each."""
    entries = json.loads((run / ".metriclog" / "uploads.json").read_text())["runs"]
    out: dict[str, dict] = {}
    for run_id, e in sorted(entries.items(), key=lambda kv: kv[1]["updated"]):
        out[e["name"]] = {**e, "id": run_id}
    return out


def rows_of(run: Path, name: str, finished: bool = True) -> list[dict]:
    entry = runs_written(run)[name]
    assert entry["finished"] == finished, entry
    return history_rows(read_records(find_run_file(run / ".metriclog" / "wandb", entry["id"])))


def expected_steps(values: list[tuple[int, str, float]]) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for step in sorted({s for s, _, _ in values}):
        out[step] = {
            key: float(how(np.array([v for s, k, v in values if s == step and k == key])))
            for key, how in HOW.items()
        }
    return out


def check(rows: list[dict], expected: dict[int, dict[str, float]]) -> None:
    steps = [row["step"] for row in rows]
    assert steps == sorted(expected), "every step once, in order"
    for row in rows:
        want = expected[row["step"]]
        assert set(row) - {"step", "_timestamp", "_runtime", "_step"} == set(want)
        for key, value in want.items():
            assert row[key] == pytest.approx(value, rel=1e-12, abs=1e-12), (row["step"], key)


def ended_as_recorded(sidecar: subprocess.Popen, run: Path, ranks: int) -> str:
    """The follower ended by itself, no record came late, and its global run holds numpy's
    reduction of what the ranks recorded; what it said."""
    _, err = sidecar.communicate(timeout=120)
    assert sidecar.returncode == 0, err
    assert "came after" not in err
    values = [v for vs in truth(run, ranks).values() for v in vs]
    check(rows_of(run, "run"), expected_steps(values))
    return err


def finish(children: list[subprocess.Popen], timeout: float = 120) -> None:
    for child in children:
        child.wait(timeout=timeout)


def test_global_reduce_followed_live_equals_numpy_over_what_every_rank_recorded(tmp_path):
    run = tmp_path / "run"
    sidecar = follow(run)  # started before the job: it waits for the directory, then run.json's ranks
    first = sidecar.stderr.readline()  # blocks until the follower said it (a condition, not a wait)
    ranks = writers(run, steps=40, ranks=3)
    finish(ranks)
    _, err = sidecar.communicate(timeout=120)
    err = first + err
    assert sidecar.returncode == 0, err
    recorded = truth(run, 3)
    check(rows_of(run, "run"), expected_steps([v for values in recorded.values() for v in values]))
    assert "wrote offline run" in err and "40 rows" in err
    assert f"waiting for {run} to be created" in err


def test_per_rank_modes_followed_live_equal_numpy_per_source(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    reduced, raw = (
        follow(run, "--mode", "per_rank_reduce", "--name", "red"),
        follow(run, "--mode", "per_rank_no_reduce", "--name", "raw"),
    )
    ranks = writers(run, steps=30, ranks=2)
    finish(ranks)
    for sidecar in (reduced, raw):
        _, err = sidecar.communicate(timeout=120)
        assert sidecar.returncode == 0, err
    for rank, values in truth(run, 2).items():
        check(rows_of(run, f"red_Trainer_r{rank}"), expected_steps(values))
        rows = rows_of(run, f"raw_Trainer_r{rank}")
        got = [(row["step"], k, v) for row in rows for k, v in row.items() if k in HOW]
        assert got == [(s, k, v) for s, k, v in values], "every raw record once, in the order recorded"


def test_time_windows_followed_live_equal_the_offline_reduction(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    sidecar = follow(run, "--by", "time", "--every", "0.5s")
    finish(writers(run, steps=40, ranks=2))
    _, err = sidecar.communicate(timeout=120)
    assert sidecar.returncode == 0, err
    rows = rows_of(run, "run")
    offline = reduce_run(run, by="time", every="0.5s")
    assert [r["window_start"] for r in rows] == sorted(offline["window_start"].unique().to_list())
    for row in rows:
        part = offline.filter(offline["window_start"] == row["window_start"])
        # the same statistics, its partitions the polls' (bit-identity holds for one plan's partitions)
        assert {k: row[k] for k in part["key"]} == pytest.approx(
            dict(zip(part["key"], part["value"], strict=True)), rel=1e-12
        )


def test_a_follower_killed_mid_run_and_started_again_misses_no_row_and_sends_none_twice(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    ranks = writers(run, steps=80, ranks=2, hold_at=40)  # the job runs on past the kill
    first = follow(run)
    wait_for(lambda: rows_sent(run) >= 5, "the follower to hand over some rows")
    first.send_signal(signal.SIGKILL)
    first.wait()
    killed = runs_written(run)["run"]
    assert not killed["finished"] and 0 < killed["rows_sent"] <= 40
    second = follow(run)
    release(run)
    finish(ranks)
    _, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    assert "offline runs cannot be resumed" in err
    values = [v for vs in truth(run, 2).values() for v in vs]
    check(rows_of(run, "run"), expected_steps(values))
    wandb_files = list((run / ".metriclog" / "wandb").rglob("*.wandb"))
    assert len(wandb_files) == 1, "the interrupted offline run's files were removed"


def test_a_pause_and_a_death_give_the_exact_rows_and_the_follow_ends_by_itself(tmp_path):
    run = tmp_path / "run"
    ranks = writers(run, steps=30, ranks=3, pause_at={1: 10}, pause_s=8.0, die={2: 15})
    sidecar = follow(run, "--restart-grace", "1s")
    finish(ranks)
    _, err = sidecar.communicate(timeout=120)
    assert sidecar.returncode == 0, err  # it ended by itself: no --until-idle, no Ctrl-C
    assert ranks[2].returncode == -signal.SIGKILL
    assert "Trainer_r2 (rank 2) died" in err and "Trainer_r1 (rank 1) died" not in err
    assert "came after" not in err and "fresh" not in err, "the paused rank was held, not let go"
    values = [v for vs in truth(run, 3).values() for v in vs]
    check(rows_of(run, "run"), expected_steps(values))
    plain = reduce_run(run)  # what a plain upload of the finished run hands W&B
    rows = {r["step"]: r for r in rows_of(run, "run")}
    for step, key, value in plain.select("step", "key", "value").iter_rows():
        assert rows[step][key] == pytest.approx(value, rel=1e-12, abs=1e-12)


def test_a_hung_rank_holds_the_steps_while_alive_and_its_kill_lets_the_follow_end(tmp_path):
    run = tmp_path / "run"
    ranks = writers(run, steps=40, ranks=3, hold_at={2: 10})  # never released: killed below
    log = tmp_path / "follow.log"
    sidecar = follow_logged(run, log, "--restart-grace", "1s")
    finish(ranks[:2])
    wait_for(lambda: "is alive but silent" in log.read_text(), "the follower to say it holds the steps")
    assert ranks[2].poll() is None and rows_sent(run) == 10, "steps 10-39 wait for the live rank"
    ranks[2].kill()
    ranks[2].wait()
    assert sidecar.wait(timeout=120) == 0
    err = log.read_text()
    assert "Trainer_r2 (rank 2) died" in err and "the steps go on without it" in err
    values = [v for vs in truth(run, 3).values() for v in vs]
    check(rows_of(run, "run"), expected_steps(values))


def test_a_follower_that_could_not_look_for_a_while_does_not_take_a_live_rank_for_dead(tmp_path):
    # On a loaded machine the follower itself may not run for seconds: the heartbeats a live
    # rank wrote meanwhile are in its journal, and a writer's silence is counted to when the
    # follower last read it, not to the wall clock (it said "died: no heartbeat for 12 s" of a
    # rank it had not read, and handed its steps over without it).
    from metric_core.format import journal
    from metric_core.format.life import DEAD_AFTER_MIN_S

    run = tmp_path / "run"
    ranks = writers(run, steps=30, ranks=3, hold_at={2: 10})  # held until released below
    log = tmp_path / "follow.log"
    sidecar = follow_logged(run, log)
    finish(ranks[:2])
    wait_for(lambda: rows_sent(run) == 10, "steps 0-9 handed over")

    def heartbeat() -> float:
        (path,) = run.glob("Trainer_r2.r2.*.journal")
        return journal.decode(path.read_bytes(), records=False).life.alive or 0.0

    sidecar.send_signal(signal.SIGSTOP)  # the follower does not run (a loaded machine)
    try:
        stopped = time.time()
        wait_for(lambda: heartbeat() > stopped + DEAD_AFTER_MIN_S + 1, "rank 2 to beat on meanwhile")
    finally:
        sidecar.send_signal(signal.SIGCONT)
    release(run)
    finish(ranks[2:])
    assert sidecar.wait(timeout=120) == 0
    err = log.read_text()
    assert "died" not in err and "came after" not in err and "fresh" not in err, err
    values = [v for vs in truth(run, 3).values() for v in vs]
    check(rows_of(run, "run"), expected_steps(values))


def test_let_go_after_lets_a_silent_rank_go_and_its_return_writes_fresh_runs(tmp_path):
    run = tmp_path / "run"
    ranks = writers(run, steps=40, ranks=3, hold_at={2: 10})
    log = tmp_path / "follow.log"
    sidecar = follow_logged(run, log, "--let-go-after", "1s")
    wait_for(lambda: "Trainer_r2 (rank 2) is silent for" in log.read_text(), "the follower to let it go")
    release(run)
    finish(ranks)
    assert sidecar.wait(timeout=120) == 0
    err = log.read_text()
    assert "(--let-go-after 1.0 s)" in err
    assert "written to fresh W&B runs that hold them" in err
    values = [v for vs in truth(run, 3).values() for v in vs]
    check(rows_of(run, "run"), expected_steps(values))  # the newest run: every record, exact
    assert len(list((run / ".metriclog" / "wandb").rglob("*.wandb"))) == 1, "the earlier run's files went"


def test_a_job_starts_its_own_sidecar_with_init_and_shutdown_waits_for_its_last_rows(tmp_path):
    run = tmp_path / "run"
    ranks = writers(run, steps=30, ranks=2, sidecar={"project": "p", "offline": True, "interval": 0.2})
    finish(ranks)  # rank 0's shutdown() returned: the sidecar ended
    log = (run / ".metriclog" / "sidecar.log").read_text()
    assert "wrote offline run (" in log and "30 rows" in log, log
    values = [v for vs in truth(run, 2).values() for v in vs]
    check(rows_of(run, "run"), expected_steps(values))


def test_a_rank_restarted_from_a_checkpoint_mid_follow_is_read_as_a_rewind(tmp_path):
    run = tmp_path / "run"
    ranks = writers(run, steps=60, ranks=2, pause=0.05)
    sidecar = follow(run)
    written = run.parent / "truth-1-0.jsonl"
    wait_for(
        lambda: written.exists() and len(written.read_text().splitlines()) >= 25 * 12, "25 steps written"
    )
    ranks[1].send_signal(signal.SIGKILL)  # killed; its job restarts it from the checkpoint of step 15
    ranks[1].wait()
    wait_for(lambda: rows_sent(run) > 26, "the other rank's steps to go without the dead one")
    restarted = writers(run, steps=60, ranks=[1], pause=0.05, start=15, world=2)
    finish([ranks[0], *restarted])
    _, err = sidecar.communicate(timeout=120)
    assert sidecar.returncode == 0, err
    assert "restarted from a checkpoint: Trainer_r1 (rank 1) from step 15" in err
    assert err.count("restarted from a checkpoint") == 1, "the restart's own rows replace nothing"
    values = [v for vs in truth(run, 2).values() for v in vs]
    check(rows_of(run, "run"), expected_steps(values))
    assert len(list((run / ".metriclog" / "wandb").rglob("*.wandb"))) == 1, "the replaced run's files went"


def test_a_rank_that_starts_late_is_waited_for_as_run_json_says(tmp_path):
    run = tmp_path / "run"
    sidecar = follow(run)
    early = writers(run, steps=40, ranks=[0], world=2)
    written = run.parent / "truth-0-0.jsonl"  # 12 lines a step
    # rank 1 loads its model for a while: it starts once rank 0 has written ten steps
    wait_for(lambda: written.exists() and len(written.read_text().splitlines()) >= 10 * 12, "rank 0's steps")
    late = writers(run, steps=40, ranks=[1], world=2)
    finish([*early, *late])
    ended_as_recorded(sidecar, run, ranks=2)


def test_another_tools_files_beside_the_job_are_not_counted_as_its_ranks(tmp_path):
    run = tmp_path / "run"
    (run / "other").mkdir(parents=True)
    now = time.time()
    with open(run / "other" / "other_tool.jsonl", "w") as f:  # two sources of another tool
        for rank in (100, 101):
            for step in range(3):
                record = {"process": f"Other_r{rank}", "rank": rank, "step": step, "key": "other/loss"}
                record.update(reduction="mean", value=rank + step, timestamp=now)
                f.write(json.dumps(record) + "\n")
    sidecar = follow(run)
    finish(writers(run, steps=20, ranks=[0], world=2))
    finish(writers(run, steps=20, ranks=[1], world=2))  # starts once rank 0 is done: still waited for
    _, err = sidecar.communicate(timeout=120)
    assert sidecar.returncode == 0, err
    assert "came after" not in err and "fresh" not in err, err
    rows = {r["step"]: r for r in rows_of(run, "run")}
    plain = reduce_run(run)  # what a plain upload of the finished run hands W&B
    assert sorted(rows) == sorted(plain["step"].unique().to_list())
    for step, key, value in plain.select("step", "key", "value").iter_rows():
        assert rows[step][key] == pytest.approx(value, rel=1e-12, abs=1e-12), (step, key)
    values = [v for vs in truth(run, 2).values() for v in vs]
    for step, want in expected_steps(values).items():  # numpy over what both ranks recorded
        assert {k: rows[step][k] for k in want} == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_following_another_tools_finished_run_until_idle_equals_a_plain_upload(tmp_path):
    import shutil

    run = tmp_path / "rl_run"
    shutil.copytree(Path(__file__).parents[1] / "sample_logs" / "rl_run", run)
    done = followed(run, "--until-idle", "1s", "--mode", "per_rank_reduce")
    assert done.returncode == 0, done.stderr
    assert "GeneratorActor_r1 (rank 1) did not shut down" in done.stderr  # killed: its runs stay open
    expected = reduce_run(run, mode="per_rank_reduce")
    for (process,), part in expected.group_by("process"):
        rows = rows_of(run, f"rl_run_{process}", finished=False)
        assert [r["step"] for r in rows] == sorted(part["step"].unique().to_list())
        for row in rows:
            at = part.filter(part["step"] == row["step"])
            assert {k: row[k] for k in at["key"]} == pytest.approx(
                dict(zip(at["key"], at["value"], strict=True))
            )


def test_follow_options_go_with_follow_and_a_dry_run_follows_without_sending(tmp_path):
    from typer.testing import CliRunner

    from cli.main import app

    runner = CliRunner()
    alone = runner.invoke(app, ["upload", "sample_logs/rl_run", "--project", "p", "--until-idle", "1s"])
    assert alone.exit_code == 2 and "--until-idle works only with --follow" in alone.output
    bad = runner.invoke(
        app, ["upload", "sample_logs/rl_run", "--project", "p", "--follow", "--until-idle", "x"]
    )
    assert bad.exit_code == 2 and "--until-idle 'x' is not a duration" in bad.output
    dry = runner.invoke(
        app,
        ["upload", "sample_logs/rl_run", "--project", "p", "--follow", "--dry-run", "--until-idle", "0.1s"],
    )
    assert dry.exit_code == 0, dry.output
    assert "dry run: nothing was uploaded" in dry.output
    assert not (Path("sample_logs/rl_run") / ".metriclog").exists()


def test_a_segment_sealed_mid_step_does_not_let_a_partial_step_go(tmp_path):
    run = tmp_path / "run"
    sidecar = follow(run)
    finish(writers(run, steps=30, ranks=2, segment_records=5))  # 12 records a step: sealed mid-step
    ended_as_recorded(sidecar, run, ranks=2)


def test_until_idle_through_a_pause_leaves_the_runs_open_for_the_rest(tmp_path):
    run = tmp_path / "run"
    ranks = writers(run, steps=30, ranks=2, hold_at=10)  # silent from step 10 on, alive
    sidecar = follow(run, "--until-idle", "1.5s")
    _, err = sidecar.communicate(timeout=120)
    assert sidecar.returncode == 0, err
    assert "did not shut down: the runs hold everything written so far and stay open" in err
    entry = runs_written(run)["run"]
    assert not entry["finished"] and 5 <= entry["rows_sent"] <= 10
    release(run)
    finish(ranks)
    again = follow(run)  # the job went on: the same command continues (offline: a fresh whole run)
    _, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    values = [v for vs in truth(run, 2).values() for v in vs]
    check(rows_of(run, "run"), expected_steps(values))


def test_a_rank_that_never_writes_keeps_the_run_open_and_is_named(tmp_path):
    run = tmp_path / "run"
    finish(writers(run, steps=10, ranks=[0, 1], world=3))  # run.json says 3; rank 2 never started
    done = followed(run, "--until-idle", "1s")
    assert done.returncode == 0, done.stderr
    assert "rank 2 of world_size 3 never wrote a record" in " ".join(done.stderr.split())  # inspect's words
    assert not runs_written(run)["run"]["finished"]


def test_a_rank_dead_before_its_first_record_is_named_and_the_follow_ends_by_itself(tmp_path):
    run = tmp_path / "run"
    log = tmp_path / "follow.log"
    sidecar = follow_logged(run, log, "--restart-grace", "1s")
    # rank 1 is SIGKILLed before its init(): no file of it is there to be seen dying
    ranks = writers(run, steps=20, ranks=2, die={1: "before_init"})
    finish(ranks)
    assert ranks[1].returncode == -signal.SIGKILL and ranks[0].returncode == 0
    assert not list(run.glob("Trainer_r1.*")), "rank 1 left no file"
    assert sidecar.wait(timeout=120) == 0, log.read_text()  # it ended by itself
    err = " ".join(log.read_text().split())  # messages are wrapped at the terminal's width
    assert "rank 1 of world_size 2 never wrote a record" in err  # inspect's words
    assert "ended: every source that wrote finished or died" in err
    check(rows_of(run, "run"), expected_steps(truth(run, 2)[0]))  # finished, every step of rank 0


def test_let_go_after_lets_a_rank_that_never_wrote_go_while_the_others_train(tmp_path):
    run = tmp_path / "run"
    log = tmp_path / "follow.log"
    sidecar = follow_logged(run, log, "--let-go-after", "2s", "--restart-grace", "1s")
    ranks = writers(run, steps=30, ranks=2, die={1: "before_init"}, hold_at={0: 20})
    # rank 0 holds at step 20, alive; steps 0-19 go without the rank that never wrote
    wait_for(lambda: rows_sent(run) >= 20, "the steps to go without rank 1")
    assert ranks[0].poll() is None, "rank 0 is still training"
    release(run)
    finish(ranks)
    assert sidecar.wait(timeout=120) == 0, log.read_text()
    err = " ".join(log.read_text().split())
    assert "rank 1 of world_size 2 never wrote a record" in err and "(--let-go-after 2.0 s)" in err
    check(rows_of(run, "run"), expected_steps(truth(run, 2)[0]))


def started_at(run: Path, rank: int) -> str:
    """When rank ``rank``'s attempt started, as its journal's header says (``init()`` writes
    it), in local ISO 8601 time to the second."""
    from datetime import datetime

    from metric_core.format import journal

    (path,) = run.glob(f"Trainer_r{rank}.r{rank}.*.journal")
    started = journal.decode(path.read_bytes()).attempt["attempt_started"]
    return datetime.fromtimestamp(started).astimezone().isoformat(timespec="seconds")


def test_a_rank_alive_but_silent_since_its_init_is_said_from_its_start_and_its_kill_as_a_death(tmp_path):
    run = tmp_path / "run"
    log = tmp_path / "follow.log"
    sidecar = follow_logged(run, log, "--restart-grace", "1s")
    ranks = writers(run, steps=20, ranks=2, hold_at={1: 0})  # rank 1 hangs after init(), before a record
    finish(ranks[:1])
    said = "Trainer_r1 (rank 1) is alive and has written no record in the "
    wait_for(lambda: said in " ".join(log.read_text().split()), "the follower to say it holds the steps")
    ranks[1].kill()  # killed before its first record
    ranks[1].wait()
    assert sidecar.wait(timeout=120) == 0, log.read_text()
    err = " ".join(log.read_text().split())
    # where it is, as its heartbeats say: the line of the writer script it is held at
    assert f"since it started at {started_at(run, 1)}, at <string>:" in err, err
    assert "in <module>: the global steps wait" in err, err
    assert "Trainer_r1 (rank 1) died before its first flush: no exception or signal recorded (SIGKILL" in err
    assert "unknown" not in err, err
    check(rows_of(run, "run"), expected_steps(truth(run, 2)[0]))


def test_let_go_after_counts_a_rank_that_has_not_written_from_its_start(tmp_path):
    run = tmp_path / "run"
    log = tmp_path / "follow.log"
    sidecar = follow_logged(run, log, "--let-go-after", "3s", "--restart-grace", "1s")
    ranks = writers(run, steps=30, ranks=2, hold_at={1: 0, 0: 20})
    wait_for(lambda: rows_sent(run) >= 20, "the steps to go without rank 1")
    started = started_at(run, 1)  # its journal, before it writes and seals it
    release(run)
    finish(ranks)
    assert sidecar.wait(timeout=120) == 0, log.read_text()
    err = " ".join(log.read_text().split())
    said = err.split("Trainer_r1 (rank 1) has written no record in the ", 1)[1].split(" (--let-go-after")[0]
    seconds, rest = said.split(" s since it started at ")  # let go after 3 s of silence, not at once
    assert float(seconds) >= 3.0 and rest == started, err
    assert "unknown" not in err, err
    values = [v for vs in truth(run, 2).values() for v in vs]
    check(rows_of(run, "run"), expected_steps(values))  # the newest run: every record, exact


def test_a_follow_started_after_a_restart_reads_the_dead_attempts_records_no_flush_covered(tmp_path):
    run = tmp_path / "run"
    first = writers(run, steps=20, ranks=2, die_unflushed={1: 5})
    finish(first)
    assert first[1].returncode == -signal.SIGKILL
    # restarted from its checkpoint after step 5: its first attempt's records of step 5, on
    # disk though no flush covered them, stay (as every command reads them)
    finish(writers(run, steps=20, ranks=[1], start=6, world=2))
    done = followed(run, "--restart-grace", "1s")  # its first look finds the dead attempt
    assert done.returncode == 0, done.stderr
    values = [v for vs in truth(run, 2).values() for v in vs]
    assert any(s == 5 for s, _, _ in truth(run, 2)[1]), "rank 1's unflushed step 5 is in the truth"
    check(rows_of(run, "run"), expected_steps(values))
    plain = reduce_run(run)  # what a plain upload of the finished run hands W&B
    rows = {r["step"]: r for r in rows_of(run, "run")}
    for step, key, value in plain.select("step", "key", "value").iter_rows():
        assert rows[step][key] == pytest.approx(value, rel=1e-12, abs=1e-12)


def test_a_restart_replaces_from_its_first_flush_not_from_the_step_its_first_segment_holds(tmp_path):
    # Soak seed 238951300: rank 1 SIGTERMed with its records of step 5 on disk, no flush
    # covering them, restarted at step 5 (init(step=5)), its first flush steps later: what it
    # recorded before that flush was sealed first and keeps step 5. As every reader takes it,
    # the restart replaces from its first flush's step (6), so step 5 holds both attempts'
    # records; the follow took the sealed segment's lowest step for it and left out the dead
    # attempt's step 5. Here step 5 goes before the restart's records of it come: they are
    # late, and said to be the restart's.
    run = tmp_path / "run"
    sidecar = follow(run)
    first = writers(run, steps=20, ranks=2, die_unflushed={1: 5}, die_signal={1: "SIGTERM"})
    first[1].wait(timeout=120)
    assert first[1].returncode == -signal.SIGTERM
    # rank 1 over, the follow hands step 5 over without it once rank 0 flushed it: the
    # restart's records of step 5 then come after it, and the follow writes a fresh run
    wait_for(lambda: rows_sent(run) >= 6, "step 5 handed over")
    again = writers(run, steps=20, ranks=[1], start=5, first_flush=6, segment_records=1, world=2)
    finish([first[0], *again])
    assert again[0].returncode == 0
    _, err = sidecar.communicate(timeout=120)
    assert sidecar.returncode == 0, err
    recorded = truth(run, 2)
    assert sum(1 for s, _, _ in recorded[1] if s == 5) == 24, "both attempts' step 5 are in the truth"
    rows = rows_of(run, "run")
    check(rows, expected_steps([v for vs in recorded.values() for v in vs]))  # numpy over the records
    plain = reduce_run(run)  # what a plain upload of the finished run hands W&B
    by_step = {r["step"]: r for r in rows}
    assert sorted(by_step) == sorted(plain["step"].unique().to_list())
    for step, key, value in plain.select("step", "key", "value").iter_rows():
        assert by_step[step][key] == pytest.approx(value, rel=1e-12, abs=1e-12), (step, key)
    said = re.search(r"Trainer_r1 \(rank 1\): \d+ of its restart: a restart's records from before", err)
    assert said and "let go" not in err, err  # the late records are named as the restart's


def test_a_sidecar_with_a_bad_option_fails_in_init_before_the_job_trains(tmp_path):
    import metric_core
    from metric_core.errors import ConfigError

    with pytest.raises(ConfigError, match="sidecar: mode='global' is not one of global_reduce"):
        metric_core.init(tmp_path / "run", rank=0, sidecar={"project": "p", "mode": "global"})
    with pytest.raises(ConfigError, match="sidecar: no option 'projet'; did you mean 'project'"):
        metric_core.init(tmp_path / "run", rank=0, sidecar={"projet": "p"})
    assert not (tmp_path / "run" / ".metriclog" / "sidecar.log").exists()


def test_strict_follow_fails_on_the_records_a_killed_writer_left_unfinished(tmp_path):
    import shutil

    run = tmp_path / "rl_run"
    shutil.copytree(Path(__file__).parents[1] / "sample_logs" / "rl_run", run)
    done = followed(run, "--strict", "--until-idle", "0.5s")
    assert done.returncode == 1, done.stderr
    assert "25 record(s) skipped: unfinished write at the end" in done.stderr


def test_a_second_follower_of_the_same_upload_is_refused_and_another_mode_is_not(tmp_path):
    run = tmp_path / "run"
    ranks = writers(run, steps=40, ranks=2, hold_at=20)  # the job runs on while the second tries
    first = follow(run)
    wait_for(lambda: rows_sent(run) > 0, "the first follower to hold the upload")
    second = followed(run)
    assert second.returncode == 1
    assert (
        "another `metriclog upload` of the same upload" in second.stderr
        and f"pid {first.pid} on " in second.stderr
    )
    other = follow(run, "--mode", "per_rank_reduce")
    release(run)
    finish(ranks)
    for sidecar in (first, other):
        _, err = sidecar.communicate(timeout=120)
        assert sidecar.returncode == 0, err
    values = [v for vs in truth(run, 2).values() for v in vs]
    check(rows_of(run, "run"), expected_steps(values))


# A job of 4 ranks in multiprocessing (issue 41, defect 1): 8 keys of every reduction, one
# recorded as numpy float32, a sample dict a step on rank 0; rank ``kill`` records step
# ``at``, waits until those records are in its journal, and is SIGKILLed before flush(at).
KILLED_JOB = """
import glob, json, multiprocessing as mp, os, signal, sys, time
import numpy as np

def rank_main(c, rank):
    import metric_core
    from metric_core import Reduce, record_metric
    from metric_core.format import journal
    run = c["run"]
    metric_core.init(run, rank=rank, process_name=f"Trainer_r{rank}", world_size=4, flush_interval=0.02)
    rng = np.random.default_rng(rank)
    written = 0
    truth, kept = open(f"{run}/../truth-{rank}-0.jsonl", "w"), open(f"{run}/../samples-{rank}.jsonl", "w")
    with truth, kept:
        for step in range(c["steps"]):
            for _ in range(3):
                for key, how, value in (
                    ("loss", Reduce.MEAN, 1.0 + rng.normal()),
                    ("tokens", Reduce.SUM, int(rng.integers(0, 100))),
                    ("grad/max", Reduce.MAX, rng.normal()),
                    ("grad/min", Reduce.MIN, rng.normal()),
                    ("spread", Reduce.STD, rng.normal()),
                    ("lr", Reduce.MEAN, np.float32(1e-4 * (1 + step))),
                    ("count", Reduce.SUM, 1),
                    ("acc", Reduce.MEAN, float(rng.random())),
                ):
                    record_metric(key, value, how)
                    truth.write(json.dumps([step, key, float(value)]) + "\\n")
                    written += 1
            if c["samples"] and rank == 0:
                sample = {"prompt": f"p{step}", "reward": float(rng.random()), "len": step}
                record_metric("gen", sample, Reduce.SAMPLE)
                kept.write(json.dumps([step, sample]) + "\\n")
            truth.flush()
            kept.flush()
            if rank == c["kill"] and step == c["at"]:
                deadline = time.monotonic() + 120  # its records of this step on disk, unflushed
                while time.monotonic() < deadline:
                    (path,) = glob.glob(f"{run}/Trainer_r{rank}.r{rank}.*.journal")
                    decoded = journal.decode(open(path, "rb").read())
                    rows = 0 if decoded.table is None else decoded.table.num_rows
                    samples = step + 1 if c["samples"] and rank == 0 else 0
                    if rows >= written and len(decoded.samples) >= samples:
                        break
                    time.sleep(0.01)
                os.kill(os.getpid(), signal.SIGKILL)
            metric_core.flush(step)
            time.sleep(0.005)
    metric_core.shutdown()

if __name__ == "__main__":
    c = json.loads(sys.argv[1])
    ranks = [mp.Process(target=rank_main, args=(c, r)) for r in range(4)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join()
    print(json.dumps([p.exitcode for p in ranks]))
"""
KILLED_HOW = {
    "loss": np.mean, "tokens": np.sum, "grad/max": np.max, "grad/min": np.min,
    "spread": np.std, "lr": np.mean, "count": np.sum, "acc": np.mean,
}  # fmt: skip


def rows_by_project(run: Path, project: str) -> tuple[dict, list[dict]]:
    """The ledger's newest run written to ``project``, and its rows as the wandb client wrote them."""
    entries = json.loads((run / ".metriclog" / "uploads.json").read_text())["runs"]
    run_id, entry = max(
        ((i, e) for i, e in entries.items() if e["project"] == project), key=lambda ie: ie[1]["updated"]
    )
    rows = history_rows(read_records(find_run_file(run / ".metriclog" / "wandb", run_id)))
    return {**entry, "id": run_id}, rows


@pytest.mark.parametrize(("kill", "samples"), [(3, True), (0, True), (3, False)])
def test_a_rank_sigkilled_mid_step_ends_the_follow_cleanly_equal_to_a_plain_upload(tmp_path, kill, samples):
    from tests.wandb_file import tables_of

    run = tmp_path / "run"
    sidecar = follow(run, "--restart-grace", "1s")
    job = subprocess.run(
        [sys.executable, "-c", KILLED_JOB,
         json.dumps({"run": str(run), "steps": 200, "kill": kill, "at": 120, "samples": samples})],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert job.returncode == 0, job.stderr
    assert json.loads(job.stdout) == [-signal.SIGKILL if r == kill else 0 for r in range(4)]
    _, err = sidecar.communicate(timeout=120)
    assert sidecar.returncode == 0, err
    assert "Traceback" not in err and "came after" not in err and "fresh" not in err, err
    assert f"Trainer_r{kill} (rank {kill}) died after step 119" in err

    # numpy over what every rank recorded: the killed rank's unflushed step 120 included
    values = [v for vs in truth(run, 4).values() for v in vs]
    expected = {
        step: {k: float(how(np.array([v for s, kk, v in values if s == step and kk == k])))
               for k, how in KILLED_HOW.items()}
        for step in sorted({s for s, _, _ in values})
    }  # fmt: skip
    entry, rows = rows_by_project(run, "p")
    assert entry["finished"]
    assert [r["step"] for r in rows] == list(range(200))
    for row in rows:
        for key, value in expected[row["step"]].items():
            assert row[key] == pytest.approx(value, rel=1e-12, abs=1e-15), (row["step"], key)

    # a plain upload of the finished run hands W&B the same rows and the same samples
    plain = subprocess.run(
        [METRICLOG, "upload", str(run), "--project", "plain", "--offline"], capture_output=True, text=True
    )
    assert plain.returncode == 0, plain.stderr
    plain_entry, plain_rows = rows_by_project(run, "plain")
    assert plain_entry["finished"] and len(plain_rows) == len(rows)
    for got, want in zip(rows, plain_rows, strict=True):
        assert {k for k in got if not k.startswith("_")} == {k for k in want if not k.startswith("_")}
        for key in KILLED_HOW:
            assert got[key] == pytest.approx(want[key], rel=1e-12, abs=1e-15), (got["step"], key)
    if samples:
        recorded = dict(map(json.loads, (tmp_path / "samples-0.jsonl").read_text().splitlines()))
        followed_tables = tables_of(find_run_file(run / ".metriclog" / "wandb", entry["id"]), "gen")
        plain_tables = tables_of(find_run_file(run / ".metriclog" / "wandb", plain_entry["id"]), "gen")
        assert followed_tables == plain_tables
        assert followed_tables == {step: [sample] for step, sample in recorded.items()}


def flushed(run: Path, ranks: int, step: int) -> bool:
    """Every rank's journal holds its flush of ``step`` (a condition on the files, not a wait)."""
    from metric_core.format import journal

    done = 0
    for path in run.glob("*.journal"):
        decoded = journal.decode(path.read_bytes(), records=False)
        done += decoded.last_flush is not None and decoded.last_flush >= step
    return done >= ranks


def plain(run: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [METRICLOG, "upload", str(run), "--project", "p", "--offline", *args], capture_output=True, text=True
    )


def test_a_plain_upload_of_a_running_job_sends_its_settled_steps_and_a_later_one_the_rest(tmp_path):
    """Issue 41, defect 2: the upload of a job still writing leaves its run open; the next one
    after the job ended adds every step, none lost and none twice, and only then is it done."""
    run = tmp_path / "run"
    ranks = writers(run, steps=150, ranks=2, hold_at=120)  # alive, silent in step 120
    wait_for(lambda: flushed(run, 2, 119), "both ranks to flush step 119")
    early = plain(run)
    assert early.returncode == 0, early.stderr
    assert "the job still writes this run" in early.stderr, early.stderr
    entry = runs_written(run)["run"]
    assert not entry["finished"] and entry["rows_sent"] == 120
    values = [v for vs in truth(run, 2).values() for v in vs]
    check(rows_of(run, "run", finished=False), expected_steps([v for v in values if v[0] < 120]))
    release(run)
    finish(ranks)
    later = plain(run)
    assert later.returncode == 0, later.stderr
    assert "skipped" not in later.stderr and "still writes" not in later.stderr
    assert "was written offline while its job ran (120 rows)" in later.stderr, later.stderr
    values = [v for vs in truth(run, 2).values() for v in vs]
    check(rows_of(run, "run"), expected_steps(values))  # steps 0-149, each once, exact
    assert len(list((run / ".metriclog" / "wandb").rglob("*.wandb"))) == 1, "the open run's files went"
    again = plain(run)
    assert again.returncode == 0 and "already written offline (150 rows" in again.stderr, again.stderr


def test_a_running_job_to_tensorboard_and_online_w_and_b_continues_where_it_stopped(tmp_path):
    """Issue 41, defect 2: to TensorBoard, the file of a run still written holds its settled
    steps and is written again whole once the job ended; online, the next upload resumes the
    same W&B run at the row after the server's last (a fake server: only it holds rows)."""
    from metric_core import make_plan
    from metric_core.offline.engine import execute
    from metric_core.offline.read import scan_run
    from metric_core.offline.upload import upload_run
    from metric_core.offline.upload.ledger import Ledger
    from metric_core.offline.upload.runs import plan_runs
    from metric_core.offline.upload.send import WandB, send_runs
    from metric_core.offline.upload.tensorboard import TensorBoard
    from tests.test_tensorboard import scalars
    from tests.test_upload import FakeInit, FakeRun

    run = tmp_path / "run"
    ranks = writers(run, steps=60, ranks=2, hold_at=40)
    wait_for(lambda: flushed(run, 2, 39), "both ranks to flush step 39")
    logdir = tmp_path / "tb"
    upload_run(run, make_plan(), TensorBoard(logdir))
    assert [s for s, _, _ in scalars(logdir / "run")["loss"]] == list(range(40))
    from metric_core.offline.upload.settled import settled_runs

    ledger = Ledger(tmp_path / "uploads.json")
    with settled_runs(run, make_plan(), name="run", group=None, share_run=False, request={}) as planned:
        first = FakeRun()
        (outcome,) = send_runs(planned, ledger, WandB("p", init=FakeInit(first), sleep=lambda s: None))
    assert [r["step"] for r in first.logged] == list(range(40))
    assert not ledger.get(outcome.run_id)["finished"]
    release(run)
    finish(ranks)
    later = upload_run(run, make_plan(), TensorBoard(logdir))
    assert not later.plan.open and [o.action for o in later.outcomes] == ["wrote to TensorBoard"]
    values = [v for vs in truth(run, 2).values() for v in vs]
    expected = expected_steps(values)
    got = scalars(logdir / "run")
    assert [s for s, _, _ in got["loss"]] == list(range(60)), "each step once, in one file"
    assert [v for _, v, _ in got["loss"]] == [float(np.float32(expected[s]["loss"])) for s in range(60)]
    with plan_runs(execute(make_plan(), scan_run(run)), name="run", request={}) as planned:
        second = FakeRun(server_rows=40)
        fake = FakeInit(second)
        (outcome,) = send_runs(planned, ledger, WandB("p", init=fake, sleep=lambda s: None))
    assert fake.calls[0]["resume"] == "must" and outcome.action == "resumed"
    check([*first.logged, *second.logged], expected)  # every step once, in one W&B run
    assert ledger.get(outcome.run_id)["finished"]


def test_a_lockstep_silence_is_one_note_naming_the_rank_the_others_wait_for(tmp_path):
    """As watch gives one warning a stall: the sidecar's note of ranks that hold the steps is
    one for the episode, the held rank first, whoever went silent first."""
    import threading

    from tests.lockstep import run_job

    run, go_on = tmp_path / "run", tmp_path / "go-on"
    log = tmp_path / "follow.log"
    sidecar = follow_logged(run, log, "--restart-grace", "1s")
    hold = ["hold", "1", "5", str(go_on)]
    job = threading.Thread(target=run_job, args=(run,), kwargs={"world": 4, "steps": 12, "action": hold})
    job.start()  # rank 1 is held in step 5 until go_on exists; the others wait in their collective
    try:
        wait_for(lambda: "the global steps wait" in log.read_text(), "the note that the steps wait", 120)
    finally:
        go_on.touch()
        job.join()
    assert sidecar.wait(timeout=120) == 0, log.read_text()
    err = " ".join(log.read_text().split())
    assert err.count("the global steps wait") == 1, err
    (note,) = [n for n in err.split("note: ") if "the global steps wait" in n]
    assert note.startswith("Trainer_r1 (rank 1) is alive but silent for "), note
    assert ", at tests/lockstep_worker.py:" in note and " in train_step; waiting for it: " in note, note
    assert "waiting for it: Trainer_r0 (rank 0), Trainer_r2 (rank 2), Trainer_r3 (rank 3)" in note, note


def test_a_rank_whose_heartbeat_stopped_is_said_so_and_named_as_watch_names_it(tmp_path):
    """Every rank held in step 10 at the same line; rank 2 stopped (SIGSTOP stands in for
    native code holding the GIL): its writer is not heard. The sidecar's note says so
    (``NO_HEARTBEAT``, not the place its last heartbeat said) and names it as the one the
    others wait for, as watch's ``culprit_of`` does."""
    import os

    from metric_core.offline.inspect.health import NO_HEARTBEAT

    run = tmp_path / "run"
    ranks = writers(run, steps=40, ranks=3, hold_at=10)
    log = tmp_path / "follow.log"
    sidecar = follow_logged(run, log, "--restart-grace", "1s")
    written = run.parent / "truth-2-0.jsonl"
    try:
        wait_for(
            lambda: written.exists() and len(written.read_text().splitlines()) >= 10 * 12, "step 9 of rank 2"
        )
        os.kill(ranks[2].pid, signal.SIGSTOP)
        wait_for(lambda: "the global steps wait" in log.read_text(), "the note that the steps wait", 120)
    finally:
        for child in [*ranks, sidecar]:
            child.kill()
            child.wait(timeout=60)
    err = " ".join(log.read_text().split())
    (note,) = [n for n in err.split("note: ") if "the global steps wait" in n]
    assert note.startswith("Trainer_r2 (rank 2) is alive but silent for "), note
    # (rank 0 and 1 wait in the same loop, seen at its one line or the other)
    assert f", at {NO_HEARTBEAT}; waiting for it: Trainer_r0 (rank 0)" in note, note
    assert "Trainer_r1 (rank 1)" in note.split("waiting for it: ")[1], note


def test_follow_to_tensorboard_and_to_mlflow_end_equal_to_plain_uploads(tmp_path):
    """Issue 45: every destination follows through the one contract. Followed beside the
    job, the event files hold what a plain --to tensorboard writes after it (read back by
    TensorBoard), and the MLflow runs (global, and per rank) what a plain --to mlflow
    sends (read back by MlflowClient: steps, timestamps and values)."""
    pytest.importorskip("tensorboardX")
    pytest.importorskip("mlflow")
    from metric_core import make_plan
    from metric_core.offline.upload import MLflow, TensorBoard, upload_run
    from tests.test_mlflow import runs_of
    from tests.test_tensorboard import scalars

    run = tmp_path / "run"
    run.mkdir()
    live = ["--follow", "--wait", "--interval", "0.2"]
    followers = [
        subprocess.Popen(
            [METRICLOG, "upload", str(run), *to, *live],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for to in (
            ["--to", "tensorboard", "--logdir", str(tmp_path / "tb-followed")],
            ["--to", "mlflow", "--tracking-uri", f"sqlite:///{tmp_path}/followed.db"],
            [
                "--to",
                "mlflow",
                "--tracking-uri",
                f"sqlite:///{tmp_path}/ranks.db",
                "--mode",
                "per_rank_reduce",
            ],
        )
    ]
    finish(writers(run, steps=30, ranks=2))
    for sidecar in followers:
        _, err = sidecar.communicate(timeout=120)
        assert sidecar.returncode == 0, err
        assert "came after" not in err, err
    upload_run(run, make_plan(), TensorBoard(tmp_path / "tb-plain"))
    upload_run(run, make_plan(), MLflow(f"sqlite:///{tmp_path}/plain.db"))
    followed, plain = (
        {k: [(s, v) for s, v, _ in points] for k, points in scalars(tmp_path / d / "run").items()}
        for d in ("tb-followed", "tb-plain")
    )
    expected = expected_steps([v for vs in truth(run, 2).values() for v in vs])
    assert followed == plain
    assert followed["loss"] == [(s, float(np.float32(expected[s]["loss"]))) for s in range(30)]
    assert runs_of(f"sqlite:///{tmp_path}/followed.db") == runs_of(f"sqlite:///{tmp_path}/plain.db")
    upload_run(run, make_plan(mode="per_rank_reduce"), MLflow(f"sqlite:///{tmp_path}/ranks-plain.db"))
    ranks = runs_of(f"sqlite:///{tmp_path}/ranks.db")
    assert sorted(ranks) == ["run_Trainer_r0", "run_Trainer_r1"]
    assert ranks == runs_of(f"sqlite:///{tmp_path}/ranks-plain.db")
    (held,) = runs_of(f"sqlite:///{tmp_path}/plain.db").values()
    assert [s for s, _, _ in held["loss"]] == list(range(30))
    assert [v for _, _, v in held["loss"]] == pytest.approx(
        [expected[s]["loss"] for s in range(30)], rel=1e-12
    )
