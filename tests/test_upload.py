"""metriclog upload: the real wandb client in offline mode, read back from what it wrote;
a fake run object only for what a server does (resume, rows it already holds)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from metriclog.main import app
from metriclog.options import as_flag
from typer.testing import CliRunner

from metric_core import Metric, MetricCollector, Reduce, scan_run
from metric_core.errors import UploadError, as_keyword, spell_options
from metric_core.offline.engine import execute
from metric_core.offline.plan import make_plan
from metric_core.offline.upload import runs as upload_runs
from metric_core.offline.upload.ledger import Ledger
from metric_core.offline.upload.runs import plan_runs, safe_keys
from metric_core.offline.upload.send import UploadEvents, WandB, send_runs
from metric_core.offline.upload.tensorboard import TensorBoard

from .conftest import BASE_TIME, on_a_terminal, write_collector_run
from .wandb_file import config_of, find_run_file, history_rows, metric_definitions, read_records, run_record

runner = CliRunner()
METRICLOG = str(Path(sys.executable).with_name("metriclog"))  # the installed command


@pytest.fixture(autouse=True)
def offline_env(wandb_offline):
    """Every test here runs W&B offline, logged out."""


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("exp1")
    write_collector_run(root, [("TrainActor_r0", 0), ("GeneratorActor_r1", 1)], steps=4)
    (root / "run.json").write_text(json.dumps({"name": "exp1", "world_size": 2, "config": {"lr": 0.5}}))
    return root


def upload_cli(run_dir: Path, *args: str, process: bool = False):
    """``metriclog upload`` in this process (the Typer test runner), or as a real process:
    there polars is not loaded yet, so the run is read and reduced in a forked child."""
    argv = ["upload", str(run_dir), "--project", "proj", *args]
    if not process:
        return runner.invoke(app, argv)
    done = subprocess.run([METRICLOG, *argv], capture_output=True, text=True, timeout=300)
    return SimpleNamespace(
        exit_code=done.returncode, stdout=done.stdout, stderr=done.stderr, output=done.stdout + done.stderr
    )


def uploaded(run_dir: Path, run_id: str) -> list:
    return read_records(find_run_file(run_dir / ".metriclog", run_id))


def reduce_frame(run_dir: Path, **kw) -> pl.DataFrame:
    return execute(make_plan(**kw), scan_run(run_dir)).frame


@pytest.mark.parametrize(
    ("mode", "share", "process"),
    [
        ("global_reduce", False, False),
        ("per_rank_reduce", False, False),
        ("per_rank_reduce", True, False),
        ("per_rank_no_reduce", False, False),
        ("per_rank_no_reduce", True, False),
        ("global_reduce", False, True),
        ("per_rank_no_reduce", False, True),
    ],
)
def test_every_mode_lands_in_wandb_as_the_spec_maps_it(tmp_path, small_run, mode, share, process):
    run_dir = tmp_path / "exp1"
    import shutil

    shutil.copytree(small_run, run_dir)
    share_flag = ["--per-rank-share-run"] if share else []
    result = upload_cli(run_dir, "--mode", mode, "--offline", *share_flag, process=process)
    assert result.exit_code == 0, result.output
    assert "wandb sync" in result.stderr
    ledger = json.loads((run_dir / ".metriclog" / "uploads.json").read_text())["runs"]
    assert all(e["finished"] for e in ledger.values())
    truth = reduce_frame(run_dir, mode=mode)
    per_source = mode != "global_reduce" and not share
    assert len(ledger) == (2 if per_source else 1)
    for run_id, entry in ledger.items():
        records = uploaded(run_dir, run_id)
        run = run_record(records)
        assert run.run_id == run_id
        # the run describes the training run: nothing of the machine that replayed it
        # (its hardware and OS, system metrics, pip packages)
        assert not {r.WhichOneof("record_type") for r in records} & {"environment", "stats", "files"}
        config = config_of(records)
        assert config["lr"] == 0.5
        assert config["metriclog"]["mode"] == mode
        assert config["metriclog"]["source_run_dir"] == "exp1"
        rows = [r for r in history_rows(records) if any(not k.startswith("_") and k != "step" for k in r)]
        assert len(rows) == entry["rows_planned"] == entry["rows_sent"]
        assert all("_step" in r for r in rows)  # W&B's own counter, never ours
        if per_source:
            process = run.display_name.removeprefix("exp1_")
            assert run.run_group == "exp1"
            expected = truth.filter(pl.col("process") == process)
        else:
            assert run.display_name == "exp1"
            expected = truth
        if mode == "per_rank_no_reduce":
            assert metric_definitions(records).get("*") is None
            got = sorted(
                (r["_timestamp"], r["step"], k, v)
                for r in rows
                for k, v in r.items()
                if not k.startswith("_") and k != "step"
            )
            want = sorted(
                (t, s, f"{k}/{p}" if share else k, v)
                for p, t, s, k, v in expected.select(
                    "process", "timestamp", "step", "key", "value"
                ).iter_rows()
            )
            assert got == want
        else:
            assert metric_definitions(records).get("*") == "step"
            got = {
                (r["step"], k): v for r in rows for k, v in r.items() if not k.startswith("_") and k != "step"
            }
            # a std of values near 1e8 moves in its 9th digit with polars' summation order,
            # which the CLI's engine settings change (test_reduce allows 1e-6 against numpy)
            want = {
                (s, f"{k}/{p}" if share else k): (v, 1e-6 if r == "std" else 1e-12)
                for p, s, k, v, r in expected.select(
                    pl.col("process") if "process" in expected.columns else pl.lit(""),
                    "step",
                    "key",
                    "value",
                    "reduction",
                ).iter_rows()
            }
            assert got.keys() == want.keys()
            for gk, (value, tol) in want.items():
                assert got[gk] == pytest.approx(value, rel=tol), gk


@pytest.mark.parametrize("mode", ["global_reduce", "per_rank_no_reduce"])
def test_history_rows_are_exact_from_any_row_a_resume_starts_at(tmp_path, monkeypatch, mode):
    """Missing keys are left out, a NaN is sent as NaN, steps stay ints; rows are built a
    chunk at a time (4 here) and a resume may start anywhere, mid-chunk included."""
    monkeypatch.setattr(upload_runs, "HISTORY_CHUNK_ROWS", 4)
    c = MetricCollector(tmp_path, rank=0, process_name="w")
    raw, wide = [], []
    for step in range(10):
        a = float("nan") if step == 4 else float(step)
        c.push(Metric("a", a, Reduce.MEAN, BASE_TIME + step))
        raw.append({"a": a, "step": step, "_timestamp": BASE_TIME + step})
        wide.append({"a": a, "step": step})
        if step % 3:  # b is missing at steps 0, 3, 6, 9
            c.push(Metric("b", 2.0 * step, Reduce.MAX, BASE_TIME + step + 0.5))
            raw.append({"b": 2.0 * step, "step": step, "_timestamp": BASE_TIME + step + 0.5})
            wide[-1]["b"] = 2.0 * step
        c.flush(step)
    c.shutdown()
    with plan_runs(execute(make_plan(mode=mode), scan_run(tmp_path)), name="x") as upload:
        (run,) = upload.runs
        want = [json.dumps(row, sort_keys=True) for row in (raw if mode == "per_rank_no_reduce" else wide)]
        assert run.rows == len(want)
        for start in (0, 3, 4, 5, len(want) - 1, len(want)):
            assert [json.dumps(row, sort_keys=True) for row in run.history(start)] == want[start:]


def test_run_ids_are_deterministic_and_survive_a_copy(tmp_path, small_run):
    import shutil

    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(small_run, a)
    shutil.copytree(small_run, b)
    (a / "run.json").unlink()
    (b / "run.json").unlink()  # identity from the data itself

    def ids(run_dir: Path, **plan: str) -> list[str]:
        with plan_runs(execute(make_plan(**plan), scan_run(run_dir)), name="x") as upload:
            return [r.run_id for r in upload.runs]

    ids_a, ids_b = ids(a, mode="per_rank_reduce"), ids(b, mode="per_rank_reduce")
    assert ids_a == ids_b
    assert len(set(ids_a)) == 2
    ids_global = ids(a)
    assert not set(ids_global) & set(ids_a)


def test_rerun_of_a_finished_upload_is_skipped_and_force_new_uploads_again(tmp_path, small_run):
    import shutil

    run_dir = tmp_path / "exp1"
    shutil.copytree(small_run, run_dir)
    assert upload_cli(run_dir, "--offline").exit_code == 0
    again = upload_cli(run_dir, "--offline")
    assert again.exit_code == 0
    ((run_id, entry),) = json.loads((run_dir / ".metriclog" / "uploads.json").read_text())["runs"].items()
    assert again.stderr.endswith(
        f"already written offline ({entry['rows_sent']} rows, id {run_id}): skipped (--force-new uploads "
        f"again under fresh ids); sync it with: wandb sync {entry['sync_dir']}\n"
    )
    forced = upload_cli(run_dir, "--offline", "--force-new")
    assert forced.exit_code == 0
    assert "fresh id" in forced.stderr
    ledger = json.loads((run_dir / ".metriclog" / "uploads.json").read_text())["runs"]
    assert len(ledger) == 2 and all(e["finished"] for e in ledger.values())


def test_without_credentials_online_is_exit_1_and_dry_run_touches_nothing(tmp_path, small_run, monkeypatch):
    import shutil

    monkeypatch.delenv("WANDB_MODE")  # online asked for: WANDB_MODE=offline would be honoured

    run_dir = tmp_path / "exp1"
    shutil.copytree(small_run, run_dir)
    result = upload_cli(run_dir)
    assert result.exit_code == 1, result.output
    assert "Error: not logged in to W&B: run `wandb login`" in result.stderr
    assert "--offline" in result.stderr
    dry = upload_cli(run_dir, "--dry-run", "--mode", "per_rank_reduce")
    assert dry.exit_code == 0
    assert "exp1_TrainActor_r0" in dry.stdout and "exp1_GeneratorActor_r1" in dry.stdout
    assert not (run_dir / ".metriclog").exists()


def test_the_api_key_is_never_printed_or_written(tmp_path, small_run, monkeypatch):
    import shutil

    secret = "5ec4e7" * 6 + "abcd"  # 40 characters, as a W&B API key
    monkeypatch.setenv("WANDB_API_KEY", secret)
    run_dir = tmp_path / "exp1"
    shutil.copytree(small_run, run_dir)
    result = upload_cli(run_dir, "--offline", "--mode", "per_rank_reduce", process=True)
    assert result.exit_code == 0, result.output
    assert secret not in result.output
    written = [p for p in (run_dir / ".metriclog").rglob("*") if p.is_file()]
    assert any(p.name == "uploads.json" for p in written) and any(p.suffix == ".wandb" for p in written)
    assert not [p for p in written if secret.encode() in p.read_bytes()]


def test_a_run_that_cannot_be_read_is_one_error_line_from_the_reducing_child(tmp_path):
    (tmp_path / "empty").mkdir()
    result = upload_cli(tmp_path / "empty", "--offline", process=True)
    assert result.exit_code == 1
    assert result.stderr.count("Error: no readable metric record") == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "empty" / ".metriclog").exists()


def test_a_progress_bar_per_run_goes_to_stderr_when_it_is_a_terminal(tmp_path):
    run_dir = tmp_path / "exp1"
    write_collector_run(run_dir, [("TrainActor_r0", 0), ("GeneratorActor_r1", 1)], steps=1500)
    code, text, stdout = on_a_terminal(
        [METRICLOG, "upload", str(run_dir), "--project", "proj", "--offline", "--mode", "per_rank_reduce"]
    )
    assert code == 0, text
    for name in ("exp1_TrainActor_r0", "exp1_GeneratorActor_r1"):
        assert re.search(rf"{name} .*1500/1500 .*rows/s", text), text
    assert stdout == b""  # nothing of the bars where a pipe would take them


def test_unsafe_keys_are_renamed_and_reported():
    mapping = safe_keys(["trainer/loss", "_private", "a:b", "step", "a_b"])
    assert mapping["trainer/loss"] == "trainer/loss"
    assert mapping["_private"] == "m_private"
    assert mapping["step"] == "metric/step"
    assert mapping["a:b"] != mapping["a_b"]


# -- ledger and resume, with a fake run for what only a server does -----------------------


class FakeRun:
    def __init__(self, server_rows: int = 0, fail_logs_at: int | None = None) -> None:
        self.step = server_rows
        self.logged: list[dict] = []
        self.finished = False
        self.fail_logs_at = fail_logs_at
        self.sync_dir = None

    def define_metric(self, *args, **kwargs):
        pass

    def log(self, row):
        if self.fail_logs_at is not None and self.step >= self.fail_logs_at:
            raise ConnectionError("429 Too Many Requests")
        self.logged.append(row)
        self.step += 1

    def finish(self):
        self.finished = True


class FakeInit:
    def __init__(self, run: FakeRun, failures: int = 0) -> None:
        self.run = run
        self.calls: list[dict] = []
        self.failures = failures

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        if self.failures:
            self.failures -= 1
            raise ConnectionError("503 Service Unavailable")
        return self.run


@pytest.fixture
def planned(small_run):
    with plan_runs(execute(make_plan(), scan_run(small_run)), name="exp1") as upload:
        yield upload


def test_an_interrupted_online_upload_resumes_at_the_servers_next_row(tmp_path, planned):
    ledger = Ledger(tmp_path / "uploads.json")
    (run,) = planned.runs
    first = FakeRun(fail_logs_at=2)
    with pytest.raises(UploadError, match="logging to W&B failed 6 times: 429"):
        send_runs(planned, ledger, WandB("p", init=FakeInit(first), sleep=lambda s: None))
    assert ledger.get(run.run_id)["rows_sent"] == 2
    assert not ledger.get(run.run_id)["finished"]
    second = FakeRun(server_rows=2)
    fake = FakeInit(second)
    (outcome,) = send_runs(planned, ledger, WandB("p", init=fake, sleep=lambda s: None))
    assert fake.calls[0]["resume"] == "must" and fake.calls[0]["id"] == run.run_id
    assert outcome.action == "resumed" and "at row 2" in outcome.message
    assert [r["step"] for r in first.logged + second.logged] == list(range(run.rows))  # no row twice
    assert ledger.get(run.run_id)["finished"] and ledger.get(run.run_id)["rows_sent"] == run.rows


def test_init_failures_are_retried_with_backoff(tmp_path, planned):
    ledger = Ledger(tmp_path / "uploads.json")
    delays: list[float] = []
    fake = FakeInit(FakeRun(), failures=2)
    (outcome,) = send_runs(planned, ledger, WandB("p", init=fake, sleep=delays.append))
    assert delays == [1.0, 2.0]
    assert outcome.rows_sent == planned.runs[0].rows


def test_a_read_only_run_directory_keeps_its_ledger_in_the_user_cache(tmp_path, monkeypatch, small_run):
    import shutil

    run_dir = tmp_path / "ro"
    shutil.copytree(small_run, run_dir)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    os.chmod(run_dir, 0o555)
    try:
        if os.access(run_dir, os.W_OK):
            pytest.skip("running as a user that ignores permissions")
        ledger = Ledger.for_run_dir(run_dir, "abc123")
    finally:
        os.chmod(run_dir, 0o755)
    assert ledger.path == tmp_path / "cache" / "metriclog" / "abc123" / "uploads.json"


def test_a_read_only_run_directory_falls_back_even_as_root(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    blocker = tmp_path / "run"
    blocker.mkdir()
    (blocker / ".metriclog").write_text("a file where the ledger folder would go")
    ledger = Ledger.for_run_dir(blocker, "ident")
    assert ledger.path.parent == tmp_path / "cache" / "metriclog" / "ident"


KILL_CHILD = """
import sys
from metriclog.main import main
sys.argv = ["metriclog", "upload", sys.argv[1], "--project", "proj", "--offline",
            "--mode", "per_rank_no_reduce", "--per-rank-share-run"]
main()
"""


def test_a_killed_offline_upload_is_redone_as_a_fresh_offline_run(tmp_path):
    run_dir = tmp_path / "big"
    records = len(write_collector_run(run_dir, [("w", 0)], steps=1200))
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    child = subprocess.Popen(
        [sys.executable, "-c", KILL_CHILD, str(run_dir)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ledger_path = run_dir / ".metriclog" / "uploads.json"
    deadline = time.time() + 120
    while time.time() < deadline:
        if ledger_path.exists() and any(
            e["rows_sent"] >= 5000 for e in json.loads(ledger_path.read_text())["runs"].values()
        ):
            break
        if child.poll() is not None:
            pytest.fail("the upload finished before it could be killed")
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    (entry,) = json.loads(ledger_path.read_text())["runs"].values()
    assert not entry["finished"] and 5000 <= entry["rows_sent"] < entry["rows_planned"]
    again = upload_cli(run_dir, "--offline", "--mode", "per_rank_no_reduce", "--per-rank-share-run")
    assert again.exit_code == 0, again.output
    assert "cannot be resumed, so a fresh offline run" in again.stderr
    runs = json.loads(ledger_path.read_text())["runs"]
    fresh = [e for e in runs.values() if e["finished"]]
    assert len(runs) == 2 and len(fresh) == 1
    assert fresh[0]["rows_sent"] == fresh[0]["rows_planned"] == records
    (killed,) = [e for e in runs.values() if not e["finished"]]
    assert not Path(killed["sync_dir"]).exists()  # wandb sync would have sent it beside the redo
    assert "the interrupted run's files" in again.stderr


def test_wandb_limits_are_checked_before_anything_is_sent():
    from metric_core.offline.upload.runs import MAX_POINTS_PER_METRIC, PlannedRun, limit_warnings

    rows = MAX_POINTS_PER_METRIC + 1
    columns = {"step": np.arange(rows), "loss": np.zeros(rows)}
    many = PlannedRun("id", "exp1", None, None, columns, "step", ["loss"], points=rows)
    (warning,) = limit_warnings([many])
    assert f"up to {rows:,} points per metric" in warning
    assert "--by 'time' --every '10s'" in spell_options(warning, as_flag)  # as the command line says
    assert "by='time' every='10s'" in spell_options(warning, as_keyword)
    keys = [f"k{i}" for i in range(10_000)]
    wide = PlannedRun("id2", "exp2", None, None, {"step": np.arange(1)}, "step", keys, points=1)
    assert any("10,000 distinct metrics" in w for w in limit_warnings([wide]))
    few = {name: column[:10] for name, column in columns.items()}
    assert limit_warnings([PlannedRun("id3", "ok", None, None, few, "step", ["loss"], points=10)]) == []


@pytest.mark.parametrize("busy", [30, 15])
def test_a_raw_run_counts_the_points_of_its_busiest_key_over_every_frame(tmp_path, monkeypatch, busy):
    """Planned from the reduction's stream in frames of 4 records: the count of a key is
    summed over frames, and the rows are the records, in time order."""
    from metric_core.offline import engine

    monkeypatch.setattr(engine.raw, "RAW_BATCH_ROWS", 4)
    monkeypatch.setattr(engine.tasks, "DICTIONARY_READ_RECORDS", 0)  # row groups, each with its times
    monkeypatch.setattr(upload_runs, "MAX_POINTS_PER_METRIC", 20)
    lines = [
        {"key": key, "value": float(i), "reduction": "mean", "step": i, "timestamp": BASE_TIME + i, "rank": 0}
        for key, n in (("a", busy), ("b", 15))
        for i in range(n)
    ]
    pq.write_table(pa.Table.from_pylist(lines), tmp_path / "r0.parquet", row_group_size=4)
    result = execute(make_plan(mode="per_rank_no_reduce"), scan_run(tmp_path))
    assert len(list(result.batches())) > 1  # counted over several frames
    with plan_runs(result, name="x") as upload:
        (run,) = upload.runs
        assert run.points == busy and run.rows == busy + 15 and run.keys == ["a", "b"]
        history = list(run.history())
        truth = sorted(lines, key=lambda r: r["timestamp"])  # stable: ties in file order
        assert history == [
            {r["key"]: r["value"], "step": r["step"], "_timestamp": r["timestamp"]} for r in truth
        ]
        assert list(run.history(busy + 10)) == history[busy + 10 :]
        warned = [spell_options(w, as_flag) for w in upload.warnings if "points per metric" in w]
        assert warned == (
            [
                f"run x_rank0: up to {busy:,} points per metric; W&B shows at most 20: "
                "bucket with --by 'time' --every '10s' (or coarser)"
            ]
            if busy > 20
            else []
        )
        spill = upload.spill_dir
        assert spill is not None and len(os.listdir(spill)) == 4
    assert not os.path.exists(spill)


def test_upload_says_what_was_skipped_before_its_error_from_the_reading_child(tmp_path):
    good = {"key": "a", "value": 1.0, "reduction": "mean", "step": 0, "timestamp": 1.7e9, "rank": 0}
    (tmp_path / "x.jsonl").write_text(json.dumps(good) + "\nnot json\n")
    result = upload_cli(tmp_path, "--offline", "--key", "nomatch*", process=True)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.stderr
    warning, error = result.stderr.index("x.jsonl: 1 record(s) skipped"), result.stderr.index("Error:")
    assert warning < error, result.stderr


def test_what_makes_an_upload_the_same(tmp_path, small_run):
    """Another project, entity or data-shaping option is another upload under its own ids;
    the same request again is skipped, and a dry run says so, listing the keys."""
    import shutil

    run_dir = tmp_path / "exp1"
    shutil.copytree(small_run, run_dir)

    def ids(*args: str) -> set[str]:
        result = runner.invoke(app, ["upload", str(run_dir), "--offline", *args])
        assert result.exit_code == 0, result.output
        return set(json.loads((run_dir / ".metriclog" / "uploads.json").read_text())["runs"])

    a = ids("--project", "A")
    b = ids("--project", "B")
    assert len(a) == 1 and len(b) == 2  # a second run, not "already uploaded"
    seen = set(b)
    for extra in (
        ["--entity", "team"],
        ["--by", "time", "--every", "1s"],
        ["--reduce", "trainer/loss=p99"],
        ["--key", "trainer/*"],
        ["--steps", "0:2"],
        ["--name", "renamed"],
        ["--attempts", "all"],
    ):
        now = ids("--project", "B", *extra)
        assert len(now - seen) == 1, extra  # each a new upload
        seen = now
    again = runner.invoke(app, ["upload", str(run_dir), "--offline", "--project", "A"])
    assert "already written offline" in again.stderr and ids("--project", "A") == seen
    dry = runner.invoke(app, ["upload", str(run_dir), "--project", "A", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "skipped" in dry.stdout and "keys of exp1: " in dry.stdout and "trainer/loss" in dry.stdout
    fresh = runner.invoke(app, ["upload", str(run_dir), "--project", "C", "--dry-run"])
    assert "uploaded" in fresh.stdout or "written offline" in fresh.stdout


def test_after_a_restart_the_same_upload_sends_the_new_history(tmp_path):
    from .conftest import write_collector_run as write

    run_dir = tmp_path / "exp"
    write(run_dir, [("w", 0)], steps=6)
    first = runner.invoke(app, ["upload", str(run_dir), "--project", "p", "--offline"])
    assert first.exit_code == 0, first.output
    write(run_dir, [("w", 0)], steps=3, first_step=4, seed=5)  # restarted from step 4
    second = runner.invoke(app, ["upload", str(run_dir), "--project", "p", "--offline"])
    assert second.exit_code == 0, second.output
    assert "the job was restarted since it was written offline" in second.stderr
    runs = json.loads((run_dir / ".metriclog" / "uploads.json").read_text())["runs"]
    assert len(runs) == 2 and all(e["finished"] for e in runs.values())
    third = runner.invoke(app, ["upload", str(run_dir), "--project", "p", "--offline"])
    assert "already written offline" in third.stderr  # the restart's history, sent once


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--project", "bad/project name"], "--project 'bad/project name' holds /, which W&B does not allow"),
        (["--project", " "], "--project ' ' is blank: W&B needs a project name"),
        (["--project", "p", "--entity", "a:b"], "--entity 'a:b' holds :, which W&B does not allow"),
        (
            ["--project", "p", "--name", "x" * 200],
            f"--name '{'x' * 200}' is too long: W&B takes at most 128 characters",
        ),
        (
            ["--project", "p", "--per-rank-share-run"],
            "--per-rank-share-run shares one W&B run among the sources of a per-rank mode; "
            "--mode 'global_reduce' makes one run already",
        ),
        (
            ["--project", "p", "--mode", "per_rank_no_reduce", "--by", "time", "--every", "5s"],
            "--by 'time' groups reduced values into windows; --mode 'per_rank_no_reduce' uploads every "
            "raw record at its step (its timestamp is in each row)",
        ),
    ],
)
def test_a_request_that_cannot_be_served_fails_at_once_before_anything_is_read(tmp_path, args, says):
    result = runner.invoke(app, ["upload", str(tmp_path / "not-even-read"), "--dry-run", *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines()[-1] == f"Error: Invalid value: {says}"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--project", "p", "--name", " "], "--name ' ' is blank: W&B needs a run name"),
        (["--to", "mlflow", "--name", " "], "--name ' ' is blank: MLflow needs a run name"),
        (["--to", "mlflow", "--group", " "], "--group ' ' is blank: MLflow needs a group name"),
        (
            ["--to", "mlflow", "--name", "x" * 251],
            f"--name '{'x' * 251}' is too long: MLflow takes at most 250 characters",
        ),
        (["--to", "tensorboard", "--logdir", "tb", "--name", " "], "is blank: TensorBoard needs a run name"),
        (["--to", "tensorboard", "--logdir", "tb", "--group", "\t"], "is blank: TensorBoard needs a group"),
    ],
)
def test_a_bad_name_is_refused_naming_the_destination_chosen(tmp_path, args, says):
    result = runner.invoke(app, ["upload", str(tmp_path / "not-even-read"), "--dry-run", *args])
    assert result.exit_code == 2, result.output
    assert says in result.stderr.splitlines()[-1]
    for other in {"W&B", "MLflow", "TensorBoard"} - {says.split(": ")[-1].split()[0]}:
        assert other not in result.stderr, result.stderr


def test_a_name_too_long_for_w_and_b_goes_to_mlflow_and_tensorboard(small_run, tmp_path):
    """200 characters: more than W&B's 128, within MLflow's 250; TensorBoard has no rule of its own."""
    name = "n" * 200
    for args in (
        ["--to", "mlflow", "--tracking-uri", f"sqlite:///{tmp_path}/m.db"],
        ["--to", "tensorboard", "--logdir", str(tmp_path / "tb")],
    ):
        result = runner.invoke(app, ["upload", str(small_run), "--dry-run", "--name", name, *args])
        assert result.exit_code == 0, result.output
        assert name in result.output


def test_a_dry_run_says_a_pattern_that_matches_nothing_and_prints_no_null(small_run):
    result = upload_cli(small_run, "--dry-run", "--key", "trainer/loss", "--reduce", "trainer/lss=p99")
    assert result.exit_code == 0, result.output
    assert (
        "warning: --reduce 'trainer/lss=p99' matches no key; the run's keys: policy/latency_s, "
        "policy/tokens, trainer/grad_norm, trainer/loss"
    ) in result.stderr.splitlines()
    assert "null" not in result.stdout  # global_reduce's run has no group: a blank
    narrow = runner.invoke(
        app,
        ["upload", str(small_run), "--project", "p", "--dry-run", "--mode", "per_rank_reduce"],
        env={"COLUMNS": "60"},
    )
    header = [c.strip() for c in narrow.stdout.splitlines()[1].strip("│").split("┆")]
    assert header[:2] == ["name", "would be"]  # what a dry run is for stays
    assert "columns not shown, for the terminal's width (60): " in narrow.stdout
    strict = upload_cli(
        small_run, "--dry-run", "--key", "trainer/loss", "--reduce", "trainer/lss=p99", "--strict"
    )
    assert strict.exit_code == 1
    assert strict.stderr.splitlines()[-1].startswith(
        "Error: --strict: --reduce 'trainer/lss=p99' matches no key"
    )


def test_wandb_mode_offline_in_the_environment_is_honoured(tmp_path, small_run, monkeypatch):
    import shutil

    run_dir = tmp_path / "exp1"
    shutil.copytree(small_run, run_dir)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    result = runner.invoke(app, ["upload", str(run_dir), "--project", "p"])  # no --offline, no login
    assert result.exit_code == 0, result.output
    assert (
        "WANDB_MODE=offline is set: writing offline runs" in result.stderr and "wandb sync" in result.stderr
    )
    monkeypatch.setenv("WANDB_MODE", "disabled")
    disabled = runner.invoke(app, ["upload", str(run_dir), "--project", "q"])
    assert disabled.exit_code == 0 and "nothing is uploaded" in disabled.stderr
    ledger = json.loads((run_dir / ".metriclog" / "uploads.json").read_text())["runs"]
    assert len(ledger) == 1  # the disabled upload marked nothing


def test_an_error_no_retry_heals_is_not_retried(tmp_path, planned):
    from wandb.errors import UsageError

    ledger = Ledger(tmp_path / "uploads.json")
    delays: list[float] = []

    def rejected(**kwargs):
        raise UsageError("invalid project name")

    with pytest.raises(UploadError, match="starting the W&B run failed: invalid project name"):
        send_runs(planned, ledger, WandB("p", init=rejected, sleep=delays.append))
    assert delays == []


def test_a_restart_of_one_source_redoes_only_the_runs_that_hold_its_records(tmp_path):
    from .conftest import write_collector_run as write

    run_dir = tmp_path / "exp"
    write(run_dir, [("a", 0), ("b", 1)], steps=6)
    args = ["upload", str(run_dir), "--project", "p", "--offline", "--mode", "per_rank_reduce"]
    assert runner.invoke(app, args).exit_code == 0
    write(run_dir, [("a", 0)], steps=3, first_step=4, seed=5)  # only a restarts
    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.output
    assert again.stderr.count("the job was restarted since it was written offline") == 1
    assert "exp_a: the job was restarted" in again.stderr
    assert again.stderr.count("already written offline") == 1  # b's run is the same


def test_an_upload_an_earlier_version_made_is_still_recognized(tmp_path):
    import hashlib

    from .conftest import write_collector_run as write

    run_dir = tmp_path / "exp"
    write(run_dir, [("a", 0)], steps=3)
    (run_dir / "run.json").write_text(json.dumps({"name": "exp", "run_id": "abc"}))
    legacy = "ml-" + hashlib.sha256(b"abc|global_reduce|*").hexdigest()[:16]  # metriclog 0.1's id
    (run_dir / ".metriclog").mkdir()
    entry = {
        "finished": True,
        "rows_sent": 3,
        "rows_planned": 3,
        "project": "p",
        "entity": None,
        "updated": 1.0,
    }
    (run_dir / ".metriclog" / "uploads.json").write_text(json.dumps({"runs": {legacy: entry}}))
    same = runner.invoke(app, ["upload", str(run_dir), "--project", "p", "--offline"])
    assert same.exit_code == 0 and f"already uploaded (3 rows, id {legacy})" in same.stderr
    other = runner.invoke(app, ["upload", str(run_dir), "--project", "q", "--offline"])
    assert other.exit_code == 0 and "already uploaded" not in other.stderr  # another destination


def test_after_a_restart_an_online_upload_rewinds_its_wandb_run_to_the_restart(tmp_path, request):
    """Online, W&B rewinds a run (resume_from): the run uploaded before the restart is cut at
    the restart's first step and continued with the restart's history (a fake W&B server)."""
    from .conftest import write_collector_run as write

    run_dir = tmp_path / "exp"
    write(run_dir, [("w", 0)], steps=6)
    ledger = Ledger(tmp_path / "uploads.json")
    first = FakeRun()
    with plan_runs(execute(make_plan(), scan_run(run_dir)), name="exp", request={"project": "p"}) as before:
        send_runs(before, ledger, WandB("p", init=FakeInit(first), sleep=lambda s: None))
    assert [r["step"] for r in first.logged] == list(range(6))
    truth = write(run_dir, [("w", 0)], steps=4, first_step=3, seed=5)  # restarted from step 3
    after = plan_runs(execute(make_plan(), scan_run(run_dir)), name="exp", request={"project": "p"})
    request.addfinalizer(after.close)  # its rows stay in temporary files until it is closed
    (run,) = after.runs
    assert run.run_id == before.runs[0].run_id  # the same upload, continued
    second, init = FakeRun(server_rows=3), FakeInit(FakeRun())
    init.run = second
    (outcome,) = send_runs(after, ledger, WandB("p", init=init, sleep=lambda s: None))
    assert outcome.action == "rewound" and "restarted from step 3" in outcome.message
    assert init.calls[0]["resume_from"] == f"{run.run_id}?_step=3" and "resume" not in init.calls[0]
    assert [r["step"] for r in second.logged] == [3, 4, 5, 6]
    losses = {r["step"]: r["trainer/loss"] for r in second.logged}
    for step in range(3, 7):
        values = [t["value"] for t in truth if t["step"] == step and t["key"] == "trainer/loss"]
        assert losses[step] == pytest.approx(np.mean(values), rel=1e-15)
    again = send_runs(after, ledger, WandB("p", init=FakeInit(FakeRun()), sleep=lambda s: None))
    assert again[0].action == "skipped"


def test_a_server_that_cannot_be_reached_is_said_at_once_naming_it(tmp_path, planned, monkeypatch):
    """A wandb.init that times out is not retried: one error, naming the server and --offline."""
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    calls = []

    def unreachable(**kwargs):
        calls.append(kwargs)
        time.sleep(0.25)  # as long as the timeout: the server did not answer
        raise ConnectionError("timed out")

    with pytest.raises(
        UploadError, match=r"could not reach W&B \(http://127.0.0.1:9\) within 0.2 s.*offline"
    ):
        send_runs(
            planned,
            Ledger(tmp_path / "uploads.json"),
            WandB("p", connect_timeout=0.2, init=unreachable),
        )
    assert len(calls) == 1 and calls[0]["settings"]["init_timeout"] == 0.2


def test_an_upload_stopped_by_sigterm_leaves_no_temporary_directory(tmp_path):
    """timeout, Slurm and docker stop a job with SIGTERM: the raw runs' column files go too."""
    run_dir = tmp_path / "exp1"
    write_collector_run(run_dir, [(f"TrainActor_r{r}", r) for r in range(4)], steps=3000)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    child = subprocess.Popen(
        [METRICLOG, "upload", str(run_dir), "--project", "p", "--offline", "--mode", "per_rank_no_reduce"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "TMPDIR": str(scratch)},
    )
    deadline = time.monotonic() + 120
    while not list(scratch.glob("metriclog-upload-*")):
        assert child.poll() is None and time.monotonic() < deadline, "the upload never planned"
        time.sleep(0.02)
    child.send_signal(signal.SIGTERM)
    stderr = child.communicate(timeout=120)[1].decode()
    assert child.returncode != 0
    assert "Traceback" not in stderr, stderr
    assert not list(scratch.glob("metriclog-upload-*"))


def test_two_uploads_of_one_run_at_once_make_one_wandb_run_per_source(tmp_path):
    """Two plain uploads started together: one holds the run's upload, the other is refused
    (naming it) or, if it came after, skips what was written; never a run twice, and every
    path either prints exists."""
    run = tmp_path / "run"
    write_collector_run(run, [(f"TrainActor_r{r}", r) for r in range(4)], steps=100)
    metriclog = str(Path(sys.executable).with_name("metriclog"))
    command = [metriclog, "upload", str(run), "--project", "p", "--offline", "--mode", "per_rank_reduce"]
    both = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    ]
    said = "".join(out + err for out, err in (p.communicate(timeout=300) for p in both))
    codes = sorted(p.returncode for p in both)
    assert codes in ([0, 0], [0, 1]), said
    if codes == [0, 1]:
        assert "another `metriclog upload` of the same upload" in said and re.search(r"\(pid \d+ on ", said)
    written = sorted((run / ".metriclog" / "wandb").glob("offline-run-*"))
    assert len(written) == 4, written  # one W&B run per source
    printed = [p for line in re.findall(r"wandb sync (.+)", said) for p in line.split()]
    assert printed and all(Path(p).exists() for p in printed), printed


def test_an_unreachable_wandb_fails_a_plain_upload_with_one_line_that_says_what_to_do(tmp_path):
    run_dir = tmp_path / "exp1"
    write_collector_run(run_dir, [("TrainActor_r0", 0)], steps=3)
    env = {
        **os.environ,
        "WANDB_BASE_URL": "http://127.0.0.1:9",  # nothing listens there
        "WANDB_API_KEY": "0123456789" * 4,
        "WANDB_SILENT": "true",
    }
    env.pop("WANDB_MODE", None)
    done = subprocess.run(
        [METRICLOG, "upload", str(run_dir), "--project", "p", "--connect-timeout", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert errors[0].startswith("Error: could not reach W&B (http://127.0.0.1:9) within 1 s (")
    assert errors[0].endswith("or write offline runs with --offline and `wandb sync` them later")
    assert "init_timeout" not in done.stderr  # wandb's advice, meaningless on a command line


def test_a_follow_tries_an_unreachable_wandb_again_with_backoff_and_says_so(tmp_path, planned, monkeypatch):
    """The sidecar outlasts a network outage: each failed start is said, then tried again."""
    from metric_core.offline.upload.send import UploadEvents, WandBSender

    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    run = FakeRun()
    outages = [2]

    def flaky(**kwargs):
        if outages[0]:
            outages[0] -= 1
            time.sleep(0.06)  # as long as the timeout: the server did not answer
            raise ConnectionError("timed out")
        return run

    said, slept = [], []
    events = UploadEvents(message=lambda kind, text: said.append(text))
    to = WandB("p", connect_timeout=0.05, init=flaky, sleep=slept.append)
    sender = WandBSender(planned, Ledger(tmp_path / "uploads.json"), to, False, events, patience=600)
    (outcome,) = [sender.send(r) for r in planned.runs]
    assert outcome.rows_sent == planned.runs[0].rows and run.finished
    assert slept == [1.0, 2.0]  # backing off
    tries = [t for t in said if t.startswith("could not reach W&B (http://127.0.0.1:9)")]
    assert len(tries) == 2 and all("trying again in" in t for t in tries)
    impatient = WandBSender(planned, Ledger(tmp_path / "u2.json"), to, False, events)
    outages[0] = 1
    with pytest.raises(UploadError, match="could not reach W&B"):
        impatient.send(planned.runs[0])


def test_the_upload_key_keeps_the_shape_earlier_uploads_were_recorded_under():
    """Runs uploaded before are found again by a digest of the request and the plan's
    shape: a field renamed or reshaped would upload every earlier run a second time."""
    from metric_core.offline.upload.runs import request_key

    plan = make_plan(
        mode="per_rank_reduce", by="time", every="30s", reduce=["a*=p99"], ranks="0-3", steps="2:9"
    )
    request = {"entity": None, "project": "p", "name": None, "group": None}
    recorded = {  # the shape every ledger since ids held the plan took its ids from
        **request,
        "mode": "per_rank_reduce",
        "by": "time",
        "every": 30.0,
        "reduce": [["a*", "p99"]],
        "keys": [],
        "ranks": [[0, 3]],
        "steps": [2, 9],
        "attempts": "rewind",
        "share_run": False,
    }
    assert (
        request_key(plan, request, False)
        == hashlib.sha256(json.dumps(recorded, sort_keys=True).encode()).hexdigest()
    )


def one_name_two_ranks(run_dir: Path) -> dict[tuple[int, int], float]:
    """Ranks 0 and 1, both process "worker", 3 steps: each (rank, step)'s value."""
    values = {}
    for rank in (0, 1):
        c = MetricCollector(run_dir, process_name="worker", rank=rank)
        for step in range(3):
            values[rank, step] = float(rank * 10 + step)
            c.push(Metric("loss", values[rank, step], Reduce.MEAN, BASE_TIME + step))
            c.flush(step)
        c.shutdown()
    return values


@pytest.mark.parametrize(
    "args",
    [
        ["--mode", "per_rank_reduce", "--project", "p", "--offline"],
        ["--mode", "per_rank_no_reduce", "--per-rank-share-run", "--project", "p", "--offline"],
        ["--mode", "per_rank_reduce", "--to", "tensorboard", "--logdir", "{tb}"],
        ["--mode", "per_rank_reduce", "--project", "p", "--offline", "--follow", "--until-idle", "1s"],
    ],
    ids=["per-rank", "shared", "tensorboard", "follow"],
)
def test_two_ranks_of_one_process_name_are_refused_in_the_per_rank_modes(tmp_path, args):
    """A W&B run (a TensorBoard folder, a shared run's key suffix) is named by process:
    two ranks that write as one name would mix their rows (steps twice in one run). The
    upload says so, and sends nothing."""
    run_dir = tmp_path / "run"
    one_name_two_ranks(run_dir)
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    tb = tmp_path / "tb"
    command = [METRICLOG, "upload", str(run_dir)]
    done = subprocess.run(
        [*command, *(a.format(tb=tb) for a in args)], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines() == [
        "Error: ranks 0 and 1 both write as process 'worker', and the per-rank modes name a run by its "
        "process: their rows would mix in one run. Give each rank a process name of its own (e.g. "
        "worker_r0, worker_r1), or use --mode global_reduce"
    ]
    assert not list((run_dir / ".metriclog").rglob("*.wandb")) and not tb.exists()


def test_global_reduce_takes_two_ranks_of_one_process_name(tmp_path):
    run_dir = tmp_path / "run"
    values = one_name_two_ranks(run_dir)
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    command = [METRICLOG, "upload", str(run_dir), "--project", "p", "--offline"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    (run_id,) = json.loads((run_dir / ".metriclog" / "uploads.json").read_text())["runs"]
    rows = [r for r in history_rows(uploaded(run_dir, run_id)) if "loss" in r]
    assert [(r["step"], r["loss"]) for r in rows] == [
        (step, float(np.mean([values[0, step], values[1, step]]))) for step in range(3)
    ]


def test_a_follow_ended_idle_without_run_json_says_why_its_runs_stay_open(tmp_path):
    """Files without run.json (another tool's, or a job whose rank 0 has not started): how
    many sources the job has is not known, so the runs stay open, and the end says so."""
    run_dir = tmp_path / "run"
    for rank in (0, 1):
        c = MetricCollector(run_dir, process_name=f"worker_r{rank}", rank=rank)
        c.push(Metric("loss", float(rank), Reduce.MEAN, BASE_TIME))
        c.flush(0)
        c.shutdown()
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    command = [
        METRICLOG,
        "upload",
        str(run_dir),
        "--project",
        "p",
        "--offline",
        "--follow",
        "--until-idle",
        "1s",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert (
        "ended after --until-idle, but no run.json says how many sources the job has: the runs" in done.stderr
    )
    (entry,) = json.loads((run_dir / ".metriclog" / "uploads.json").read_text())["runs"].values()
    assert not entry["finished"] and entry["rows_sent"] == 1


def _run_with_samples(root: Path) -> None:
    """One rank: steps 0-4 with a scalar and a sample each, step 5 with a sample only."""
    import metric_core
    from metric_core import Reduce, record_metric

    metric_core.init(root, rank=0, process_name="Trainer_r0", world_size=1)
    try:
        for step in range(6):
            if step < 5:
                record_metric("loss", float(step))
            record_metric("gen", {"prompt": str(step), "reward": float(step)}, Reduce.SAMPLE)
            metric_core.flush(step)
    finally:
        metric_core.shutdown()


def test_a_second_upload_counts_only_samples_no_row_holds_not_those_sent_before(tmp_path):
    """Issue 41, defect 9: the steps of samples said to have no row are those no row of
    their run holds, not those this upload did not send (a run skipped holds them)."""
    from typer.testing import CliRunner

    from cli.main import app

    run = tmp_path / "exp"
    _run_with_samples(run)
    args = ["upload", str(run), "--project", "p", "--offline", "--mode", "per_rank_reduce"]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    assert "1 step(s) of samples" in first.output
    second = CliRunner().invoke(app, args)
    assert second.exit_code == 0, second.output
    assert "skipped" in second.output
    assert "6 step(s) of samples" not in second.output and "1 step(s) of samples" in second.output


# Rank ``rank`` of a job of 2: 3 values of "loss" a step, each step flushed; with
# ``die_unflushed``, SIGKILLed once its records of that step are on disk, before its flush;
# with ``start``, a restart from that step (init(step=start)) that, with ``hold``, records
# its first step and waits, alive and unflushed, for the file ``release`` before it
# flushes. What it recorded goes to truth-<rank>-<start>.jsonl.
RESTARTED_RANK = """
import glob, json, os, signal, sys, time
import metric_core
from metric_core import Reduce, record_metric
from metric_core.format import journal
c = json.loads(sys.argv[1])
run, rank, start = c["run"], c["rank"], c.get("start") or 0
metric_core.init(run, rank=rank, process_name=f"Trainer_r{rank}", world_size=2, flush_interval=0.02,
                 step=c.get("start"))
with open(f"{run}/../truth-{rank}-{start}.jsonl", "w") as truth:
    for step in range(start, c["steps"]):
        for i in range(3):
            value = 1000.0 * (start + 1) + step + i / 8 + rank / 64
            record_metric("loss", value, Reduce.MEAN)
            truth.write(json.dumps([step, value]) + "\\n")
        truth.flush()
        if step == c.get("die_unflushed"):
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                (path,) = glob.glob(f"{run}/Trainer_r{rank}.r{rank}.*.journal")
                decoded = journal.decode(open(path, "rb").read())
                if decoded.table is not None and decoded.table.num_rows >= 3 * (step + 1 - start):
                    break
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        if c.get("hold") and step == start:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                path = sorted(glob.glob(f"{run}/Trainer_r{rank}.r{rank}.*.journal"))[-1]  # its own
                decoded = journal.decode(open(path, "rb").read())
                if decoded.table is not None and decoded.table.num_rows >= 3:
                    break
                time.sleep(0.01)
            open(f"{run}/../held", "w").close()
            while not os.path.exists(f"{run}/../release") and time.monotonic() < deadline:
                time.sleep(0.01)
        metric_core.flush(step)
metric_core.shutdown()
"""


def rank_process(run: Path, rank: int, **more) -> subprocess.Popen:
    config = {"run": str(run), "rank": rank, "steps": 10, **more}
    return subprocess.Popen([sys.executable, "-c", RESTARTED_RANK, json.dumps(config)], cwd=run.parent)


def killed_then_restarted_and_held(run: Path) -> subprocess.Popen:
    """Rank 0 trains steps 0-9; rank 1 is SIGKILLed with its step 5 on disk, unflushed, and
    restarted from step 5: the restart has recorded its step 5 and not flushed it yet."""
    run.mkdir()
    ranks = [rank_process(run, 0), rank_process(run, 1, die_unflushed=5)]
    for rank in ranks:
        rank.wait(timeout=120)
    assert [r.returncode for r in ranks] == [0, -signal.SIGKILL]
    restart = rank_process(run, 1, start=5, hold=True)
    deadline = time.monotonic() + 120
    while not (run.parent / "held").exists():
        assert restart.poll() is None and time.monotonic() < deadline, "the restart did not start"
        time.sleep(0.02)
    return restart


def let_it_end(run: Path, restart: subprocess.Popen) -> None:
    (run.parent / "release").touch()
    assert restart.wait(timeout=120) == 0


def restarted_truth(run: Path) -> dict[int, float]:
    """numpy's mean of each step over what the ranks recorded, the restart replacing the
    killed attempt's records from its first flush (step 5) on."""
    values: dict[int, list[float]] = {}
    for rank, attempts in ((0, [0]), (1, [0, 5])):
        kept: list[tuple[int, float]] = []
        for start in attempts:
            kept = [v for v in kept if v[0] < start]
            kept += [tuple(json.loads(line)) for line in (run.parent / f"truth-{rank}-{start}.jsonl").open()]
        for step, value in kept:
            values.setdefault(step, []).append(value)
    return {step: float(np.mean(vs)) for step, vs in sorted(values.items())}


def newest_rows(run: Path) -> list[dict]:
    entries = json.loads((run / ".metriclog" / "uploads.json").read_text())["runs"]
    run_id = max(entries, key=lambda i: entries[i]["updated"])
    assert entries[run_id]["finished"]
    return [r for r in history_rows(uploaded(run, run_id)) if "loss" in r]


def test_a_restart_into_steps_a_finished_upload_sent_is_said_and_its_values_sent(tmp_path, monkeypatch):
    """Soak seed 612915615: a plain upload read the run whole as a job that was over (its
    check came before the rank's restart began) and finished the W&B run with the killed
    attempt's step 5 and the restart's records read before its first flush; the restart's
    flush(5) then replaced step 5 from there on. The next upload said 'skipped', leaving
    W&B with values that are not the run's. It says which steps are stale and writes a
    fresh run holding the restart's values; --force-new writes them again."""
    from metric_core.offline import upload as upload_package

    run = tmp_path / "run"
    restart = killed_then_restarted_and_held(run)
    try:
        monkeypatch.setattr(upload_package, "running", lambda root, **_: False)  # checked before it began
        first = upload_package.upload_run(run, make_plan(), WandB("proj", offline=True))
        assert [o.action for o in first.outcomes] == ["wrote offline"]
        upload_package.upload_run(run, make_plan(), TensorBoard(tmp_path / "tb"))
        monkeypatch.undo()
        assert [r["step"] for r in newest_rows(run)] == list(range(10))
    finally:
        let_it_end(run, restart)
    truth = restarted_truth(run)
    second = upload_cli(run, "--offline", process=True)
    assert second.exit_code == 0, second.output
    assert "skipped" not in second.stderr
    warned = [line for line in second.stderr.splitlines() if line.startswith("warning: run: restarted")]
    assert len(warned) == 1, second.stderr
    assert "Trainer_r1 (rank 1) from step 5" in warned[0] and "steps 5-9 of the W&B run ml-" in warned[0]
    rows = newest_rows(run)
    assert [r["step"] for r in rows] == sorted(truth)
    assert {r["step"]: r["loss"] for r in rows} == pytest.approx(truth, rel=1e-12)
    offline_runs = list((run / ".metriclog" / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 1, "the stale run's files are removed: `wandb sync` would send them"
    third = upload_cli(run, "--offline", process=True)
    assert third.exit_code == 0 and "already written offline (10 rows" in third.stderr, third.output
    again = upload_cli(run, "--offline", "--force-new", process=True)
    assert again.exit_code == 0 and "restarted from a checkpoint" not in again.stderr, again.output
    assert {r["step"]: r["loss"] for r in newest_rows(run)} == pytest.approx(truth, rel=1e-12)
    from .test_tensorboard import scalars  # it skips itself without tensorboard

    said: list[str] = []
    events = UploadEvents(message=lambda kind, text: said.append(f"{kind}: {text}"))
    upload_package.upload_run(run, make_plan(), TensorBoard(tmp_path / "tb"), events=events)
    assert any("restarted from a checkpoint" in s and "steps 5-9 of" in s for s in said), said
    loss = scalars(tmp_path / "tb" / "run")["loss"]
    assert [(step, value) for step, value, _ in loss] == [(s, float(np.float32(v))) for s, v in truth.items()]


def test_a_restart_begun_while_a_plain_upload_read_the_run_leaves_its_runs_open(tmp_path, monkeypatch):
    """The same race, caught as it happens: the job looked over when the upload began, a
    rank's restart began while the run was read. The upload sees it after its read and
    takes the run as a running job's: the complete steps only, the run left open; the next
    upload, after the job ended, sends every step as the records say."""
    from metric_core.offline import upload as upload_package

    real = upload_package.running
    looks: list[bool] = []  # the first look came before the restart began

    def running(root, **kw):
        looks.append(bool(looks) and real(root, **kw))
        return looks[-1]

    run = tmp_path / "run"
    restart = killed_then_restarted_and_held(run)
    try:
        monkeypatch.setattr(upload_package, "running", running)
        first = upload_package.upload_run(run, make_plan(), WandB("proj", offline=True))
        monkeypatch.undo()
        assert first.plan.open and looks == [False, True]  # the restart holds the steps until it flushes
        ledger = run / ".metriclog" / "uploads.json"
        entries = json.loads(ledger.read_text())["runs"].values() if ledger.exists() else []
        assert not any(e["finished"] for e in entries)
    finally:
        let_it_end(run, restart)
    truth = restarted_truth(run)
    second = upload_cli(run, "--offline", process=True)
    assert second.exit_code == 0 and "skipped" not in second.stderr, second.output
    assert {r["step"]: r["loss"] for r in newest_rows(run)} == pytest.approx(truth, rel=1e-12)


A, B, C = ("T_r1", 1, "a"), ("T_r1", 1, "b"), ("T_r1", 1, "c")


@pytest.mark.parametrize(
    ("sent", "now", "last_step", "stale"),
    [
        (None, [(*A, 0), (*B, 5)], 9, {}),  # a ledger written before it kept attempts: as before
        ([(*A, 0), (*B, 5)], [(*A, 0), (*B, 5)], 9, {}),  # replaced from 5 when sent already
        ([(*A, 0), (*B, None)], [(*A, 0), (*B, 5)], 9, {("T_r1", 1): (5, 9)}),  # flushed since
        ([(*A, 0), (*B, None)], [(*A, 0), (*B, 12)], 9, {}),  # from a step past the rows sent
        ([(*A, 0), (*B, 7)], [(*A, 0), (*B, 7), (*C, 3)], 9, {("T_r1", 1): (3, 9)}),  # A and B
        ([(*A, 0), (*B, 7)], [(*A, 0), (*B, 5)], 9, {("T_r1", 1): (5, 6)}),  # 7 on was replaced then
        ([(*A, 0), (*B, None)], [(*A, 0), (*B, 5)], None, {("T_r1", 1): (5, None)}),  # time windows
        ([("T_r0", 0, "x", 0), (*A, 0)], [("T_r0", 0, "x", 0), (*A, 0)], 9, {}),
    ],
)
def test_the_steps_a_restart_replaced_since_they_were_sent(sent, now, last_step, stale):
    from metric_core.offline.upload.restarts import stale_steps

    assert stale_steps(sent, now, last_step) == stale


@pytest.mark.parametrize("to", ["wandb offline", "tensorboard"])
def test_a_dry_run_says_what_would_be_done_in_words_that_read(tmp_path, to):
    """A new user's trial: "would be: wrote offline", "would be: wrote to TensorBoard"."""
    import shutil

    run = shutil.copytree(Path(__file__).resolve().parents[1] / "sample_logs" / "rl_run", tmp_path / "run")
    tensorboard = ["--to", "tensorboard", "--logdir", tmp_path / "tb"]
    where = ["--project", "p", "--offline"] if to == "wandb offline" else tensorboard
    result = runner.invoke(app, ["upload", str(run), *map(str, where), "--dry-run"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    (row,) = [line for line in result.stdout.splitlines() if line.startswith("│ run ")]
    said = [c.strip() for c in row.strip("│").split("┆")][1]
    assert said == ("written offline" if to == "wandb offline" else "written to TensorBoard"), row
    assert not (tmp_path / "tb").exists() and "dry run: nothing was uploaded" in result.output
