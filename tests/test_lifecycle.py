"""Run lifecycles: a job killed at step k and restarted from its checkpoint at step j < k.

Real processes through the public API, SIGKILLed. The ground truth is numpy over exactly
the records that survive a rewind: the first attempt's steps below j, then the second
attempt's from j on; ``--attempts all`` is numpy over everything written.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from metriclog.main import app
from typer.testing import CliRunner

from .wandb_file import find_run_file, history_rows, read_records

KILLED_AT, RESTART_FROM, STEPS = 12, 7, 18
SOURCES = (("TrainActor_r0", 0), ("TrainActor_r1", 1))

SCRIPT = """
import sys, time
import metric_core
from metric_core import Reduce, record_metric
run, process, rank, attempt, first, last, give_step = sys.argv[1:8]
rank, attempt, first, last = int(rank), int(attempt), int(first), int(last)
if give_step == "yes":
    metric_core.init(run, rank=rank, process_name=process, step=first, flush_interval=0.01)
else:  # a restart that does not say where it starts: its first flush(k) tells
    metric_core.init(run, rank=rank, process_name=process, flush_interval=0.01)
for step in range(first, last + 1):
    for i in range(3):
        record_metric("loss", 1000.0 * attempt + 10.0 * step + i + rank / 10, Reduce.MEAN)
    record_metric("grad_norm", float(attempt * 100 + step), Reduce.MAX)
    metric_core.flush(step)
    print(step, flush=True)
if attempt == 1:
    time.sleep(600)  # killed here, after its flush of the last step
metric_core.shutdown()
"""


def values(attempt: int, step: int, rank: int) -> dict[str, list[float]]:
    return {
        "loss": [1000.0 * attempt + 10.0 * step + i + rank / 10 for i in range(3)],
        "grad_norm": [float(attempt * 100 + step)],
    }


def run_source(
    run: Path, process: str, rank: int, attempt: int, first: int, last: int, give_step: bool
) -> None:
    argv = [sys.executable, "-c", SCRIPT, str(run), process, str(rank), str(attempt), str(first), str(last)]
    child = subprocess.Popen([*argv, "yes" if give_step else "no"], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    for line in child.stdout:
        if attempt == 1 and int(line) == last:
            os.kill(child.pid, signal.SIGKILL)  # every step up to `last` was flushed
            break
    assert child.wait(timeout=120) == (-signal.SIGKILL if attempt == 1 else 0)


@pytest.fixture(scope="module")
def restarted(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("lifecycle") / "run"
    for process, rank in SOURCES:
        run_source(run, process, rank, 1, 0, KILLED_AT, give_step=True)
    for process, rank in SOURCES:  # rank 1 restarts without telling init() its step
        run_source(run, process, rank, 2, RESTART_FROM, STEPS - 1, give_step=rank == 0)
    return run


def surviving(everything: bool = False) -> pl.DataFrame:
    rows = []
    for process, rank in SOURCES:
        steps = [(1, s) for s in range(KILLED_AT + 1) if everything or s < RESTART_FROM]
        steps += [(2, s) for s in range(RESTART_FROM, STEPS)]
        for attempt, step in steps:
            for key, vs in values(attempt, step, rank).items():
                rows += [{"process": process, "rank": rank, "step": step, "key": key, "value": v} for v in vs]
    return pl.DataFrame(rows)


def expected(mode: str, everything: bool = False) -> pl.DataFrame:
    raw = surviving(everything)
    if mode == "per_rank_no_reduce":
        return raw.sort("process", "rank", "step", "key", "value")
    by = ["step", "key"] if mode == "global_reduce" else ["process", "rank", "step", "key"]
    out = []
    for group, part in raw.group_by(by, maintain_order=True):
        v = part["value"].to_numpy()
        value = float(np.max(v)) if group[-1] == "grad_norm" else float(np.mean(v))
        out.append({**dict(zip(by, group, strict=True)), "value": value, "count": len(v)})
    return pl.DataFrame(out).sort(by)


def reduced(run: Path, mode: str, *args: str) -> pl.DataFrame:
    out = run.parent / f"{mode}{'_'.join(args)}.parquet"
    result = CliRunner().invoke(app, ["reduce", str(run), "--mode", mode, "--out", str(out), *args])
    assert result.exit_code == 0, result.output
    return pl.read_parquet(out)


@pytest.mark.parametrize("mode", ["global_reduce", "per_rank_reduce", "per_rank_no_reduce"])
@pytest.mark.parametrize("everything", [False, True])
def test_every_mode_reads_exactly_the_records_that_survive_the_restart(restarted, mode, everything):
    got = reduced(restarted, mode, *(["--attempts", "all"] if everything else []))
    want = expected(mode, everything)
    if mode == "per_rank_no_reduce":
        got = got.select(want.columns).sort("process", "rank", "step", "key", "value")
        assert got.drop("value").equals(want.drop("value"))
    else:
        got = got.select(want.columns)
        assert got.drop("value").equals(want.drop("value")), (got, want)
    np.testing.assert_allclose(got["value"].to_numpy(), want["value"].to_numpy(), rtol=1e-15)


def test_the_replaced_records_are_said_and_inspect_lists_each_sources_attempts(restarted):
    result = CliRunner().invoke(app, ["inspect", str(restarted), "--json"])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[0] == f"warning: in {restarted}:"  # nothing skipped: no "skipped 0"
    for process, _ in SOURCES:
        replaced = (KILLED_AT + 1 - RESTART_FROM) * 4  # 3 losses and a grad_norm a step
        said = f"{process} (rank {process[-1]}): {replaced} record(s) of steps {RESTART_FROM}-{KILLED_AT}"
        assert f"{said} of attempt" in result.stderr
        assert f"which restarted at step {RESTART_FROM}" in result.stderr
    report = json.loads(result.stdout)
    for source in report["sources"]:
        first, second = source["attempts"]
        assert (first["first_step"], second["first_step"]) == (0, RESTART_FROM)
        assert first["replaced"] == (KILLED_AT + 1 - RESTART_FROM) * 4 and second["replaced"] == 0
        assert first["records"] == RESTART_FROM * 4 and second["records"] == (STEPS - RESTART_FROM) * 4
        assert source["first_step"] == 0 and source["last_step"] == STEPS - 1
        assert source["status"] == "finished"
    verdict = CliRunner().invoke(app, ["inspect", str(restarted)]).stdout
    for (process, rank), source in zip(SOURCES, report["sources"], strict=True):
        first, second = source["attempts"]
        assert (
            f"{process} (rank {rank}) was restarted at step {RESTART_FROM}: {first['replaced']} record(s) of "
            f"steps {RESTART_FROM}-{KILLED_AT} of its attempt {first['attempt']} were replaced by attempt "
            f"{second['attempt']} (--attempts 'all' keeps them)."
        ) in verdict.splitlines()


def test_the_offline_upload_is_one_continuous_history(restarted, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(restarted, run)
    result = CliRunner().invoke(app, ["upload", str(run), "--project", "p", "--offline"])
    assert result.exit_code == 0, result.output
    (run_id,) = json.loads((run / ".metriclog" / "uploads.json").read_text())["runs"]
    rows = [r for r in history_rows(read_records(find_run_file(run, run_id))) if "loss" in r]
    want = expected("global_reduce")
    assert [r["step"] for r in rows] == list(range(STEPS))
    loss = want.filter(pl.col("key") == "loss").sort("step")["value"].to_numpy()
    np.testing.assert_allclose([r["loss"] for r in rows], loss, rtol=1e-15)


def test_choosing_one_attempt_and_an_unknown_one(restarted):
    report = json.loads(CliRunner().invoke(app, ["inspect", str(restarted), "--json"]).stdout)
    second = report["sources"][0]["attempts"][1]["attempt"]
    got = reduced(restarted, "per_rank_reduce", "--attempts", second)
    r0 = got.filter(pl.col("rank") == 0)
    assert r0["step"].min() == RESTART_FROM and r0["step"].max() == STEPS - 1
    assert set(got.filter(pl.col("rank") == 1)["step"]) == set(range(STEPS))  # other sources: rewound
    bad = CliRunner().invoke(app, ["reduce", str(restarted), "--attempts", "nope"])
    assert (
        bad.exit_code == 2 and "--attempts 'nope' names no attempt of this run; its attempts: " in bad.output
    )


def test_a_restart_that_died_is_not_finished_because_the_attempt_before_was(tmp_path):
    from metric_core import MetricCollector, inspect_run

    from .conftest import killed_after

    first = MetricCollector(tmp_path, process_name="w")
    for step in range(5):
        first.record("loss", 1.0)
        first.flush(step)
    first.shutdown()  # a clean end, then the run is extended from a checkpoint

    def extended() -> None:
        c = MetricCollector(tmp_path, process_name="w", step=3)
        for step in range(3, 8):
            c.record("loss", 2.0)
            c.flush(step)

    killed_after(extended)
    (source,) = inspect_run(tmp_path).sources
    assert not source.clean_shutdown and source.status != "finished"
    assert [a.first_step for a in source.attempts] == [0, 3]


def test_files_written_before_attempts_existed_are_the_oldest_attempt(tmp_path):
    """A run that spans an upgrade: the earlier version's segments carry no attempt; a restart
    written by this version still replaces their records from its first step on."""
    import pyarrow.parquet as pq

    from metric_core import MetricCollector, scan_run

    old = MetricCollector(tmp_path, process_name="w")
    for step in range(6):
        old.record("loss", 1.0)
        old.flush(step)
    old.shutdown()
    (sealed,) = tmp_path.glob("*.parquet")
    meta = json.loads(pq.read_metadata(sealed).metadata[b"metriclog"])
    for field in ("attempt", "attempt_started", "attempt_first_step", "row_groups", "checksum"):
        del meta[field]  # as metriclog 0.1 wrote it
    pq.write_table(pq.read_table(sealed).replace_schema_metadata({"metriclog": json.dumps(meta)}), sealed)
    new = MetricCollector(tmp_path, process_name="w", step=4)
    for step in range(4, 8):
        new.record("loss", 2.0)
        new.flush(step)
    new.shutdown()
    rows = scan_run(tmp_path).frame.collect().sort("step")
    assert rows.select("step", "value").rows() == [(0, 1.0), (1, 1.0), (2, 1.0), (3, 1.0)] + [
        (s, 2.0) for s in range(4, 8)
    ]


NAN_SCRIPT = """
import json, math, sys, time
import metric_core
from metric_core import record_metric
run, first, last, segment_records = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
metric_core.init(
    run, rank=0, process_name="T_r0", file_format="jsonl", step=first, segment_records=segment_records
)
for step in range(first, last + 1):
    x = float(step * 10 + first)
    record_metric("x", x)
    record_metric("n", [math.nan, math.inf, -math.inf][step % 3])
    metric_core.flush(step)
    print(json.dumps({"step": step, "x": x}), flush=True)
if first == 0:
    time.sleep(600)  # killed here, after its flush of the last step
metric_core.shutdown()
"""


@pytest.mark.parametrize("segment_records", [1_000_000, 7], ids=["killed-as-a-journal", "sealed-as-it-went"])
def test_a_restart_is_rewound_when_its_jsonl_segments_hold_nan_and_infinities(tmp_path, segment_records):
    """Sealed JSONL segments holding NaN or +-inf are read record by record (not scanned on
    trust): their source and attempt still come from their checked metadata, so a restart
    replaces the steps it wrote again, and inspect lists both attempts and their ends. With
    segments of 7 records, each attempt seals steps 0-3 (4-7) as it goes, the first leaves
    steps 4-6 in its journal and the second seals steps 8-9 at its shutdown."""
    run, killed_at, restart_from, last = tmp_path / "run", 6, 4, 9
    recorded: dict[int, list[dict]] = {}
    for attempt, (first, to) in enumerate(((0, killed_at), (restart_from, last)), start=1):
        argv = [sys.executable, "-c", NAN_SCRIPT, str(run), str(first), str(to), str(segment_records)]
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None
        for line in child.stdout:  # what each flush that returned covered
            recorded.setdefault(attempt, []).append(json.loads(line))
            if attempt == 1 and recorded[1][-1]["step"] == killed_at:
                deadline = time.monotonic() + 120
                while len(list(run.glob("*.journal"))) > 1:  # every closed journal sealed first
                    assert time.monotonic() < deadline, sorted(p.name for p in run.iterdir())
                    time.sleep(0.05)
                os.kill(child.pid, signal.SIGKILL)
                break
        assert child.wait(timeout=120) == (-signal.SIGKILL if attempt == 1 else 0)
    assert list(run.glob("*.jsonl")), "the restart sealed its segments"
    # the truth: the first attempt's steps below the restart's first step, then the restart's
    want = [(r["step"], r["x"]) for r in recorded[1] if r["step"] < restart_from]
    want += [(r["step"], r["x"]) for r in recorded[2]]
    got = reduced(run, "per_rank_no_reduce")
    xs = got.filter(pl.col("key") == "x").sort("step")
    assert xs.select("step", "value").rows() == want
    n = got.filter(pl.col("key") == "n").sort("step")
    assert n["step"].to_list() == list(range(last + 1))
    assert [repr(v) for v in n["value"]] == [
        repr([math.nan, math.inf, -math.inf][s % 3]) for s in range(last + 1)
    ]
    result = CliRunner().invoke(app, ["inspect", str(run), "--json"])
    assert result.exit_code == 0, result.output
    (source,) = json.loads(result.stdout)["sources"]
    first, second = source["attempts"]
    assert (first["first_step"], second["first_step"]) == (0, restart_from)
    assert (first["end"], second["end"]) == ("died", "shutdown")
    assert first["replaced"] == 2 * (killed_at + 1 - restart_from)
    assert source["status"] == "finished" and source["end"] == "shutdown"
