"""Many runs at once: ``upload RUN...`` uploads each run as if alone (an earlier upload of
one of them is not repeated), and ``compare --to`` sends the across-run result as runs of its
own, read back from the real wandb client's offline files, a real MLflow SQLite store and
TensorBoard's own EventAccumulator, equal to compare's own output."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from metriclog.main import app
from typer.testing import CliRunner

from metric_core import make_plan
from metric_core.offline.compare import compare_runs
from metric_core.offline.engine import execute
from metric_core.offline.read import scan_run

from .test_compare import write_seeds
from .wandb_file import config_of, find_run_file, history_rows, read_records, run_record

runner = CliRunner()
LRS = (0.1, 0.1, 0.01, 0.01, 0.01)  # 5 seeds of one job, 2 groups by config.lr
STATS = ("mean", "std", "std_sample", "stderr", "min", "max", "median", "count")


@pytest.fixture(autouse=True)
def offline_env(wandb_offline, monkeypatch, tmp_path):
    """W&B offline and logged out; the user cache (a comparison's ledger) in the test's place."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    return write_seeds(tmp_path_factory.mktemp("many"), lambda i: 6 + i % 2, LRS)  # ending at steps 5 and 6


def copies(seeds, tmp_path, n):
    """Fresh copies of the first ``n`` runs (an upload keeps its ledger in the run directory)."""
    import shutil

    out = []
    for run in seeds[:n]:
        shutil.copytree(run, tmp_path / run.name)
        out.append(tmp_path / run.name)
    return out


def ledger_ids(run_dir: Path) -> dict[str, dict]:
    return json.loads((run_dir / ".metriclog" / "uploads.json").read_text())["runs"]


def reduced(run_dir: Path) -> dict[str, dict[int, dict[str, float]]]:
    """``reduce --mode per_rank_reduce`` of the run: per W&B run name, step -> key -> value."""
    frame = execute(make_plan(mode="per_rank_reduce"), scan_run(run_dir)).frame
    out: dict[str, dict[int, dict[str, float]]] = {}
    for process, step, key, value in frame.select("process", "step", "key", "value").iter_rows():
        out.setdefault(f"{run_dir.name}_{process}", {}).setdefault(step, {})[key] = value
    return out


# --- upload RUN... -----------------------------------------------------------------------


def test_runs_uploaded_together_are_each_the_upload_of_it_alone_and_an_earlier_one_adds_nothing(
    seeds, tmp_path
):
    a, b = copies(seeds, tmp_path, 2)
    per_rank = ["--project", "p", "--group", "g", "--mode", "per_rank_reduce"]
    alone = runner.invoke(app, ["upload", str(a), *per_rank])
    assert alone.exit_code == 0, alone.output
    a_ids = ledger_ids(a)
    assert len(a_ids) == 2  # a W&B run per source
    a_files = sorted(p.name for p in (a / ".metriclog").rglob("*.wandb"))

    both = runner.invoke(app, ["upload", str(tmp_path / "seed*"), *per_rank])
    assert both.exit_code == 0, both.output
    assert f"run 1 of 2: {a}" in both.stderr and f"run 2 of 2: {b}" in both.stderr
    assert both.stderr.count("already written offline") == 2 and "2 of 2 runs went" in both.stderr
    assert ledger_ids(a) == a_ids  # the same ids, untouched: A is not sent again
    assert sorted(p.name for p in (a / ".metriclog").rglob("*.wandb")) == a_files
    b_ids = ledger_ids(b)
    for run, ids in ((a, a_ids), (b, b_ids)):  # each as the upload of it alone writes it
        got = {}
        for run_id, entry in ids.items():
            found = read_records(find_run_file(run / ".metriclog", run_id))
            assert run_record(found).run_group == "g"
            got[entry["name"]] = {
                row["step"]: {k: v for k, v in row.items() if not k.startswith("_") and k != "step"}
                for row in history_rows(found)
            }
        assert got == reduced(run)
    separately = tmp_path / "alone" / b.name
    separately.parent.mkdir()
    import shutil

    shutil.copytree(seeds[1], separately)
    assert runner.invoke(app, ["upload", str(separately), *per_rank]).exit_code == 0
    assert ledger_ids(separately).keys() == b_ids.keys()  # uploaded alone, B has the ids it had with A


def test_a_run_that_fails_does_not_stop_the_others_and_the_exit_code_is_the_worst(seeds, tmp_path):
    a, b = copies(seeds, tmp_path, 2)
    missing = tmp_path / "nothing-here"
    listed = tmp_path / "runs.txt"
    listed.write_text(f"{a}\n# not this one\n{missing}\n\n{b}\n")
    done = runner.invoke(app, ["upload", f"@{listed}", "--project", "p"])
    assert done.exit_code == 1, done.output
    assert f"Error: {missing}: " in done.stderr
    assert f"2 of 3 runs went; 1 failed ({missing}), said above" in " ".join(done.stderr.split())
    assert len(ledger_ids(a)) == 1 and len(ledger_ids(b)) == 1  # the run after the failure went too


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--follow"], "--follow follows one run while its job writes it, and 2 were given"),
        (["--name", "x"], "--name 'x' names one run, and 2 were given"),
    ],
)
def test_follow_and_name_take_one_run(seeds, tmp_path, args, says):
    a, b = copies(seeds, tmp_path, 2)
    done = runner.invoke(app, ["upload", str(a), str(b), "--project", "p", *args])
    assert done.exit_code == 2 and says in " ".join(done.output.split()), done.output
    assert not (a / ".metriclog" / "uploads.json").exists()


# --- compare --to --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compared(seeds):
    """compare's own output, per group (config.lr): {(step, key/stat): value}."""
    result = compare_runs([str(s) for s in seeds], group_by="config.lr")
    out: dict[float, dict[tuple[int, str], float]] = {}
    for row in result.frame.iter_rows(named=True):
        for stat in STATS:
            if row[stat] is not None:
                out.setdefault(row["config.lr"], {})[(row["step"], f"{row['key']}/{stat}")] = float(row[stat])
    return out


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def group_of(name: str) -> float:
    return float(name.rsplit("config.lr=", 1)[1])


def compare_to(seeds, *args: str):
    return runner.invoke(app, ["compare", *map(str, seeds), "--group-by", "config.lr", *args])


def test_compare_to_wandb_is_a_run_per_group_tagged_with_its_runs_and_a_second_send_adds_nothing(
    seeds, compared, tmp_path
):
    sent = compare_to(seeds, "--to", "wandb", "--project", "p")
    assert sent.exit_code == 0, sent.output
    (ledger,) = (tmp_path / "cache" / "metriclog").rglob("uploads.json")
    entries = json.loads(ledger.read_text())["runs"]
    assert sorted(group_of(e["name"]) for e in entries.values()) == [0.01, 0.1]
    for run_id, entry in entries.items():
        found = read_records(find_run_file(ledger.parent, run_id))
        lr = group_of(entry["name"])
        labels = sorted(s.name for s, x in zip(seeds, LRS, strict=True) if x == lr)
        record = run_record(found)
        assert sorted(record.tags) == sorted(["metriclog-compare", *labels])
        assert record.run_group == entry["name"].split("/")[0]
        said = config_of(found)["metriclog"]["compared_runs"]
        assert sorted(r["label"] for r in said) == labels
        assert all(r["run_id"] for r in said)  # run.json's run_id of each
        got = {
            (row["step"], k): v
            for row in history_rows(found)
            for k, v in row.items()
            if not k.startswith("_") and k != "step"
        }
        assert got.keys() == compared[lr].keys()
        assert all(same(got[k], compared[lr][k]) for k in got), lr
    files = sorted(p.name for p in ledger.parent.rglob("*.wandb"))
    again = compare_to(seeds, "--to", "wandb", "--project", "p")
    assert again.exit_code == 0 and again.stderr.count("already written offline") == 2, again.output
    assert sorted(p.name for p in ledger.parent.rglob("*.wandb")) == files
    reordered = compare_to(list(reversed(seeds)), "--to", "wandb", "--project", "p")  # the same comparison
    assert reordered.exit_code == 0 and reordered.stderr.count("already written offline") == 2


def test_compare_to_mlflow_reads_back_as_compare_s_output_with_its_runs_as_tags(seeds, compared, tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlruns.db"
    sent = compare_to(seeds, "--to", "mlflow", "--tracking-uri", uri, "--experiment", "sweep")
    assert sent.exit_code == 0, sent.output
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("sweep").experiment_id

    def read_back():
        out = {}
        for run in client.search_runs([experiment]):
            history = {
                (m.step, key): m.value
                for key in run.data.metrics
                for m in client.get_metric_history(run.info.run_id, key)
            }
            count = sum(len(client.get_metric_history(run.info.run_id, k)) for k in run.data.metrics)
            out[run.info.run_name] = (history, count, run.data.tags)
        return out

    runs = read_back()
    assert len(runs) == 2
    for name, (history, count, tags) in runs.items():
        lr = group_of(name)
        assert count == len(history)  # a value a step
        assert history.keys() == compared[lr].keys()
        assert all(same(history[k], compared[lr][k]) for k in history), lr
        labels = sorted(s.name for s, x in zip(seeds, LRS, strict=True) if x == lr)
        assert sorted(json.loads(tags["metriclog.compared_labels"])) == labels
        assert len(json.loads(tags["metriclog.compared_runs"])) == len(labels)
        assert tags["metriclog.group_by"] == "config.lr"
    again = compare_to(seeds, "--to", "mlflow", "--tracking-uri", uri, "--experiment", "sweep")
    assert again.exit_code == 0 and again.stderr.count("already uploaded to MLflow") == 2, again.output
    assert read_back() == runs


def test_compare_to_tensorboard_is_a_folder_per_group_named_for_the_comparison(seeds, compared, tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    logdir = tmp_path / "tb"
    sent = compare_to(seeds, "--to", "tensorboard", "--logdir", str(logdir), "--across", "mean,std,count")
    assert sent.exit_code == 0, sent.output
    (base,) = [p for p in logdir.iterdir() if p.is_dir()]
    assert base.name.startswith("compare-")
    folders = sorted(p.name for p in base.iterdir())
    assert folders == ["config.lr=0.01", "config.lr=0.1"]
    for folder in folders:
        acc = event_accumulator.EventAccumulator(
            str(base / folder), size_guidance={event_accumulator.SCALARS: 0}
        )
        acc.Reload()
        got = {(e.step, tag): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
        want = {
            k: v
            for k, v in compared[group_of(folder)].items()
            if k[1].rsplit("/", 1)[1] in ("mean", "std", "count")
        }
        assert got.keys() == want.keys()
        assert all(same(got[k], float(np.float32(v))) for k, v in want.items())  # TensorBoard keeps float32
    files = sorted(str(p.relative_to(logdir)) for p in logdir.rglob("events.out.tfevents.*"))
    again = compare_to(seeds, "--to", "tensorboard", "--logdir", str(logdir), "--across", "mean,std,count")
    assert again.exit_code == 0 and again.stderr.count("already written to") == 2, again.output
    assert sorted(str(p.relative_to(logdir)) for p in logdir.rglob("events.out.tfevents.*")) == files


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--project", "p"], "--project works only with --to"),
        (["--dry-run"], "--dry-run works only with --to"),
        (["--to", "wandb", "--project", "p", "--out", "x.csv"], "--out chooses how the result is printed"),
        (["--to", "tensorboard"], "--to tensorboard writes under --logdir DIR"),
        (["--to", "mlflow", "--project", "p"], "--project is W&B's: not with --to mlflow"),
    ],
)
def test_compare_to_refuses_options_that_would_not_be_used(seeds, args, says):
    done = compare_to(seeds[:2], *args)
    assert done.exit_code == 2 and says in " ".join(done.output.split()), done.output


def test_a_dry_run_of_compare_to_sends_nothing_and_says_the_runs(seeds, tmp_path):
    done = compare_to(seeds, "--to", "wandb", "--project", "p", "--dry-run", "--key", "loss")
    assert done.exit_code == 0, done.output
    assert "dry run: nothing was uploaded" in done.stderr
    assert len(set(re.findall(r"compare-[0-9a-f]{8}/config\.lr=[0-9.]+", done.stdout))) == 2
    assert "loss/mean" in done.stdout
    assert not (tmp_path / "cache").exists()


def test_expanding_the_runs_loads_no_polars_before_upload_forks_its_reader():
    """upload reads each run in a forked child while wandb loads, only while this process
    has no polars (its threads do not survive a fork): finding the runs as compare does must
    not load it."""
    import subprocess
    import sys

    code = (
        "import sys, metric_core.offline.upload, metric_core.offline.compare as c\n"
        "c.expand_runs(['sample_logs/rl_run']); print('polars' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr


def test_two_sends_of_one_comparison_at_once_are_refused(seeds, tmp_path):
    """The second would hand every row over twice: the lock beside the ledger refuses it."""
    import fcntl
    import os

    pytest.importorskip("tensorboardX")
    logdir = tmp_path / "tb"
    args = ("--to", "tensorboard", "--logdir", str(logdir), "--key", "loss")
    assert compare_to(seeds, *args).exit_code == 0
    (lock_file,) = logdir.glob(".upload-*.lock")
    held = os.open(lock_file, os.O_RDWR)
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        busy = compare_to(seeds, *args, "--force-new")
    finally:
        os.close(held)
    assert (
        busy.exit_code == 1
        and "another `metriclog upload` of the same upload of the comparison compare-"
        in (" ".join(busy.stderr.split()))
    ), busy.output
    assert compare_to(seeds, *args, "--force-new").exit_code == 0  # once it is free


def test_compare_to_in_per_rank_reduce_names_each_source_s_metrics(seeds, tmp_path):
    """Sources are matched across runs by process: a metric per key, process and statistic."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlruns.db"
    result = compare_runs([str(s) for s in seeds[:3]], mode="per_rank_reduce", keys=["acc"], across=["max"])
    want = {
        (row["step"], f"acc/{row['process']}/max"): row["max"] for row in result.frame.iter_rows(named=True)
    }
    done = runner.invoke(
        app,
        ["compare", *map(str, seeds[:3]), "--mode", "per_rank_reduce", "--key", "acc", "--across", "max",
         "--to", "mlflow", "--tracking-uri", uri],
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("metriclog").experiment_id])
    assert run.info.run_name.startswith("compare-") and "/" not in run.info.run_name  # no --group-by
    got = {
        (m.step, key): m.value
        for key in run.data.metrics
        for m in client.get_metric_history(run.info.run_id, key)
    }
    assert {k for _, k in got} == {"acc/trainer_r0/max", "acc/trainer_r1/max"}
    assert got == want
