"""MLflow as a destination: what `upload --to mlflow` wrote, read back with the real
``MlflowClient`` from a SQLite store in the test's tmp_path, equals `reduce` exactly (an
infinity as MLflow's SQL store keeps it, +-DBL_MAX); a second upload adds nothing; a
follow beside a running job ends equal to a plain upload; a killed upload, started
again, leaves every step once."""

from __future__ import annotations

import math
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from metric_core import MetricCollector, make_plan, reduce_run
from metric_core.offline.upload import MLflow, upload_run

pytest.importorskip("mlflow")
pytest.importorskip("sqlalchemy")

DBL_MAX = 1.7976931348623157e308
SAMPLE = Path(__file__).parent.parent / "sample_logs" / "rl_run"
METRICLOG = str(Path(sys.executable).with_name("metriclog"))


def store(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/mlruns.db"


def runs_of(uri: str, experiment: str = "metriclog") -> dict[str, dict[str, list[tuple[int, int, float]]]]:
    """Every run of ``experiment``, by name: key -> [(step, timestamp, value)] in step order."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    out = {}
    for run in client.search_runs([found.experiment_id]):
        assert run.info.run_name not in out, f"two MLflow runs named {run.info.run_name}"
        out[run.info.run_name] = {
            key: sorted(
                ((m.step, m.timestamp, m.value) for m in client.get_metric_history(run.info.run_id, key)),
                key=lambda m: (m[0], m[1]),
            )
            for key in run.data.metrics
        }
    return out


def stored(value: float) -> float:
    return math.copysign(DBL_MAX, value) if math.isinf(value) else value


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def rl_meta(run: Path) -> dict:
    import json

    return json.loads((run / "run.json").read_text())


def rl_config(run: Path) -> dict:
    return rl_meta(run).get("config") or {}


@pytest.fixture
def rl_run(tmp_path):
    run = tmp_path / "rl_run"
    shutil.copytree(SAMPLE, run)  # the ledger goes into the run directory
    return run


@pytest.mark.parametrize("mode", ["global_reduce", "per_rank_reduce"])
def test_the_sample_run_read_back_equals_reduce_exactly_and_a_second_upload_adds_nothing(
    rl_run, tmp_path, mode
):
    uri = store(tmp_path)
    result = upload_run(rl_run, make_plan(mode=mode), MLflow(uri))
    assert {o.action for o in result.outcomes} == {"uploaded to MLflow"}
    frame = reduce_run(rl_run, mode=mode)
    got = runs_of(uri)
    sources = [None] if mode == "global_reduce" else sorted(set(frame["process"]))
    assert sorted(got) == sorted("rl_run" if s is None else f"rl_run_{s}" for s in sources)
    for source in sources:
        mine = frame if source is None else frame.filter(frame["process"] == source)
        held = got["rl_run" if source is None else f"rl_run_{source}"]
        assert set(held) == set(mine["key"])
        for key in set(mine["key"]):
            rows = mine.filter(mine["key"] == key).sort("step")
            assert [s for s, _, _ in held[key]] == rows["step"].to_list(), (source, key)
            assert all(
                same(v, stored(w)) for (_, _, v), w in zip(held[key], rows["value"].to_list(), strict=True)
            ), (source, key)
    # a reduced step's time: its run's first record time, in integer milliseconds
    raw = reduce_run(rl_run, mode="per_rank_no_reduce")
    for source in sources:
        mine = raw if source is None else raw.filter(raw["process"] == source)
        first = round(min(mine["timestamp"].to_list()) * 1000)
        held = got["rl_run" if source is None else f"rl_run_{source}"]
        assert {t for points in held.values() for _, t, _ in points} == {first}, source
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    for found in client.search_runs([client.get_experiment_by_name("metriclog").experiment_id]):
        tags, params = found.data.tags, found.data.params
        config = rl_config(rl_run)  # run.json's config: its text as params
        assert {k: params[k] for k in config} == {
            k: v if isinstance(v, str) else repr(v) for k, v in config.items()
        }
        assert params["metriclog.mode"] == mode
        assert tags["metriclog.run_id"] == rl_meta(rl_run)["run_id"]
        if mode == "per_rank_reduce":
            process = found.info.run_name.removeprefix("rl_run_")
            ranks = set(frame.filter(frame["process"] == process)["rank"])
            assert tags["metriclog.process"] == process and {int(tags["metriclog.rank"])} == ranks
    again = upload_run(rl_run, make_plan(mode=mode), MLflow(uri))
    assert {o.action for o in again.outcomes} == {"skipped"}
    assert runs_of(uri) == got  # not one metric more


def test_infinities_come_back_as_dbl_max_and_timestamps_are_the_records(tmp_path):
    run = tmp_path / "exp"
    c = MetricCollector(run, rank=0)
    values = [1.5, math.inf, -math.inf, math.nan, 0.1]
    for step, value in enumerate(values):
        c.record("x", value)
        c.flush(step)
    c.shutdown()
    uri = store(tmp_path)
    upload_run(run, make_plan(mode="per_rank_no_reduce"), MLflow(uri, "raw"))
    raw = reduce_run(run, mode="per_rank_no_reduce")
    ((_, held),) = runs_of(uri, "raw").items()
    points = held["x"]
    assert [s for s, _, _ in points] == list(range(5))
    assert all(same(v, stored(w)) for (_, _, v), w in zip(points, values, strict=True))
    assert [v for _, _, v in points][1:3] == [DBL_MAX, -DBL_MAX]
    # each raw record at its own time, in integer milliseconds
    assert [t for _, t, _ in points] == [round(t * 1000) for t in raw["timestamp"].to_list()]


def test_an_illegal_key_is_mapped_and_said(tmp_path):
    from metric_core.offline.upload.mlflow import MAX_KEY, mlflow_keys

    assert mlflow_keys(["a//b", "/lead", "c/./d", "e/../f", "ok/key 1:x"]) == {
        "a//b": "a/b",
        "/lead": "lead",
        "c/./d": "c/_/d",
        "e/../f": "e/_/f",
        "ok/key 1:x": "ok/key 1:x",
    }
    from metric_core.errors import RequestError

    with pytest.raises(
        RequestError, match=f"the key 'k{{{MAX_KEY + 1}}}' holds 251 characters and MLflow takes at most 250"
    ):
        mlflow_keys(["k" * (MAX_KEY + 1)])


def test_dry_run_says_what_it_would_send_and_sends_nothing(rl_run, tmp_path):
    from typer.testing import CliRunner

    from cli.main import app

    uri = store(tmp_path)
    done = CliRunner().invoke(
        app,
        [
            "upload",
            str(rl_run),
            "--to",
            "mlflow",
            "--tracking-uri",
            uri,
            "--dry-run",
            "--mode",
            "per_rank_reduce",
        ],
    )
    assert done.exit_code == 0, done.output
    assert "uploaded to MLflow" in done.output and "rl_run_TrainActor_r0" in done.output
    assert "dry run: nothing was uploaded" in done.output
    assert not (tmp_path / "mlruns.db").exists()


def test_options_of_another_destination_are_refused():
    from typer.testing import CliRunner

    from cli.main import app

    for args, says in [
        (["--to", "mlflow", "--project", "p"], "--project is W&B's: not with --to mlflow"),
        (["--project", "p", "--experiment", "e"], "--experiment works only with --to mlflow"),
        (["--to", "tensorboard", "--logdir", "x", "--tracking-uri", "u"], "--tracking-uri works only with"),
    ]:
        done = CliRunner().invoke(app, ["upload", str(SAMPLE), *args])
        assert done.exit_code == 2 and says in " ".join(done.output.split()), (args, done.output)


def _long_run(run: Path, steps: int) -> None:
    c = MetricCollector(run, rank=0, process_name="w")
    for step in range(steps):
        c.record("a", float(step))
        c.record("b", step * 0.5)
        c.flush(step)
    c.shutdown()


def _metrics_in(db: Path) -> int:
    try:
        with sqlite3.connect(db, timeout=0.1) as con:
            return con.execute("SELECT COUNT(*) FROM metrics").fetchone()[0]
    except sqlite3.Error:  # not made yet, or locked by the writer a moment
        return 0


@pytest.mark.slow  # a real upload process, killed, and another
def test_a_killed_upload_started_again_leaves_every_step_once(tmp_path):
    run, steps = tmp_path / "long", 20_000
    _long_run(run, steps)
    uri = store(tmp_path)
    command = [METRICLOG, "upload", str(run), "--to", "mlflow", "--tracking-uri", uri]
    (tmp_path / "tmp").mkdir()  # the killed upload leaves its planned rows' files: in the test's own place
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    first = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while _metrics_in(tmp_path / "mlruns.db") == 0:  # a condition, not a fixed wait
            assert first.poll() is None, first.stderr.read() if first.stderr else ""
            assert time.monotonic() < deadline, "the upload sent nothing"
            time.sleep(0.01)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    part = _metrics_in(tmp_path / "mlruns.db")
    assert 0 < part < 2 * steps, "killed mid-way"
    again = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert again.returncode == 0, again.stderr
    assert "resumed" in again.stderr, again.stderr
    (held,) = runs_of(uri).values()
    for key, scale in (("a", 1.0), ("b", 0.5)):
        assert [s for s, _, _ in held[key]] == list(range(steps)), f"each step of {key} once"
        assert [v for _, _, v in held[key]] == [s * scale for s in range(steps)]
    assert _metrics_in(tmp_path / "mlruns.db") == 2 * steps


def test_each_steps_samples_are_a_json_artifact_beside_the_store(tmp_path):
    """Steps 0-4 hold a scalar and a sample, step 5 a sample only: steps 0-4's samples go
    as JSON artifacts (in mlartifacts/ beside the SQLite store, never ./mlruns), step 5's
    is said to have no row."""
    import json

    from mlflow.tracking import MlflowClient

    from metric_core.offline.upload import UploadEvents

    from .test_upload import _run_with_samples

    run = tmp_path / "exp"
    _run_with_samples(run)
    said = []
    uri = store(tmp_path)
    upload_run(run, make_plan(), MLflow(uri), events=UploadEvents(message=lambda k, t: said.append(t)))
    client = MlflowClient(tracking_uri=uri)
    (found,) = client.search_runs([client.get_experiment_by_name("metriclog").experiment_id])
    steps = sorted(a.path for a in client.list_artifacts(found.info.run_id, "samples"))
    assert steps == [f"samples/step_{s:09d}" for s in range(5)]
    for s in range(5):
        where = client.download_artifacts(
            found.info.run_id, f"samples/step_{s:09d}/gen.json", str(tmp_path / "dl")
        )
        assert json.loads(Path(where).read_text()) == [{"prompt": str(s), "reward": float(s)}]
    assert (tmp_path / "mlartifacts").is_dir() and not (Path.cwd() / "mlruns").exists()
    assert any("1 step(s) of samples have no row to go with" in t for t in said), said


def test_a_missing_client_names_the_install(monkeypatch):
    from metric_core.errors import MissingDependencyError

    monkeypatch.setitem(sys.modules, "mlflow", None)  # an import of it fails, as when not installed
    with pytest.raises(MissingDependencyError, match=r"pip install 'metriclog\[mlflow\]'"):
        MLflow("sqlite:///x.db").load_client()


def test_a_run_whose_ledger_is_lost_is_found_by_its_tag_and_nothing_is_sent_twice(tmp_path):
    run = tmp_path / "exp"
    _long_run(run, 30)
    uri = store(tmp_path)
    upload_run(run, make_plan(), MLflow(uri))
    before = runs_of(uri)
    shutil.rmtree(run / ".metriclog")  # the ledger gone: MLflow itself says what it holds
    again = upload_run(run, make_plan(), MLflow(uri))
    assert again.outcomes[0].rows_sent == 30
    assert runs_of(uri) == before  # the same one run, each step once


def test_a_dry_run_follow_says_each_run_it_would_send_and_writes_nothing_to_the_store(rl_run, tmp_path):
    """``--follow --dry-run``: each planned run is said with what would happen to it, and
    neither the store nor the run's ledger is made; beside an earlier upload, the runs it
    holds are said to be skipped and the store keeps every metric it had, no more."""
    from typer.testing import CliRunner

    from cli.main import app

    uri = store(tmp_path)
    args = ["upload", str(rl_run), "--to", "mlflow", "--tracking-uri", uri, "--mode", "per_rank_reduce"]
    follow = [*args, "--follow", "--dry-run", "--until-idle", "0.1s"]
    sources = sorted(set(reduce_run(rl_run, mode="per_rank_reduce")["process"]))
    done = CliRunner().invoke(app, follow)
    assert done.exit_code == 0, done.output
    said = [line for line in done.stderr.splitlines() if line.startswith("dry run: ")]
    assert sorted(line.split()[2] for line in said[:-1]) == [f"rl_run_{s}" for s in sources]
    assert all(line.endswith("would be uploaded to MLflow") for line in said[:-1]), said
    assert said[-1].startswith("dry run: nothing was uploaded"), said
    assert not (tmp_path / "mlruns.db").exists() and not (tmp_path / "mlartifacts").exists()
    assert not (rl_run / ".metriclog").exists()
    uploaded = CliRunner().invoke(app, args)
    assert uploaded.exit_code == 0, uploaded.output
    held, metrics = runs_of(uri), _metrics_in(tmp_path / "mlruns.db")
    again = CliRunner().invoke(app, follow)
    assert again.exit_code == 0, again.output
    assert sum("would be skipped" in line for line in again.stderr.splitlines()) == len(sources)
    assert runs_of(uri) == held and _metrics_in(tmp_path / "mlruns.db") == metrics
