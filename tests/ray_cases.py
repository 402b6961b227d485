"""--engine ray on a local Ray (2 CPUs): every mode and statistic gives the same bits as
--engine local, on the writer's files (several segments a source) and another tool's, and
on the same records split into 1, 3 and 7 files a rank, renamed, rows shuffled.

Run by tests/test_ray.py in a pytest process of its own (Ray's driver can end the process
it runs in)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from metric_core import reduce_run
from metric_core.errors import MissingDependencyError
from tests.conftest import write_collector_run

ray = pytest.importorskip("ray")

STATS = ["mean", "sum", "max", "min", "std", "count", "median", "p99", "first", "last"]
KEYS = ["trainer/loss", "trainer/grad_norm", "policy/tokens", "policy/latency_s"]  # conftest's


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, local_ray):
    """The writer's run, cut into many segments, and the same records as one foreign file."""
    own = tmp_path_factory.mktemp("own")
    sources = [("TrainActor_r0", 0), ("TrainActor_r1", 1), ("Generator_r0", 0)]
    truth = write_collector_run(own, sources, steps=40, segment_records=150)
    foreign = tmp_path_factory.mktemp("foreign")
    pl.DataFrame(truth).with_columns(pl.col("key").cast(pl.Categorical)).write_parquet(
        foreign / "metrics.parquet", row_group_size=500
    )
    return own, foreign


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"mode": "per_rank_reduce"},
        {"mode": "per_rank_no_reduce"},
        {"by": "time", "every": "3s"},
        {"mode": "per_rank_reduce", "by": "time", "every": "2s"},
        {"keys": ["trainer/*"], "ranks": "0", "steps": "5:30"},
        # each statistic on one key at a time, four at once (a Ray session's tasks are what
        # this file spends its time on)
        *(
            {"reduce": [f"{k}={s}" for k, s in zip(KEYS, STATS[i : i + 4], strict=False)]}
            for i in range(0, len(STATS), 4)
        ),
        {
            "mode": "per_rank_reduce",
            "reduce": [f"{k}={s}" for k, s in zip(KEYS, ("median", "first", "std"), strict=False)],
        },
    ],
    ids=str,
)
def test_ray_gives_the_local_engines_bits(runs, options, monkeypatch):
    from metric_core.offline import engine

    monkeypatch.setattr(engine.tasks, "PARTITION_ROWS", 300)  # many tasks, several partitions each
    for run in runs:
        local = reduce_run(run, **options)
        on_ray = reduce_run(run, engine="ray", **options)
        assert local.height > 0
        assert on_ray.equals(local), (run, options)


@pytest.mark.parametrize(
    "options",
    [
        {"by": "time", "every": "3s"},
        {"mode": "per_rank_reduce", "by": "time", "every": "3s"},
        {"by": "time", "every": "3s", "attempts": "all"},
        {"mode": "per_rank_reduce", "keys": ["trainer/*"]},
    ],
    ids=str,
)
def test_ray_reads_a_restarted_source_as_the_local_engine(tmp_path_factory, local_ray, options, monkeypatch):
    """A source restarted at step 10 after dying with its segments sealed: its first
    attempt's Parquet segments are rewound in the Ray workers too (global_reduce --by time
    reads no step column: the rewind needs it), none skipped, the local engine's bits."""
    from metric_core import make_plan
    from metric_core.offline import engine

    monkeypatch.setattr(engine.tasks, "PARTITION_ROWS", 40)
    run = tmp_path_factory.getbasetemp() / "restarted"
    if not run.exists():
        run.mkdir()
        write_collector_run(run, [("TrainActor_r0", 0)], steps=20, shutdown=False, segment_records=90)
        write_collector_run(run, [("TrainActor_r0", 0)], steps=20, first_step=10, seed=1, segment_records=90)
    plan = make_plan(**options)
    local = engine.run_plan(run, plan)
    on_ray = engine.run_plan(run, plan, engine="ray")
    assert on_ray.frame.equals(local.frame)
    assert local.frame.height > 0
    for result in (local, on_ray):
        assert not result.scan.report.has_skips, result.scan.report.summary()


def test_the_command_line_writes_the_same_file_with_either_engine(runs, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from cli.main import app
    from metric_core.offline import engine

    monkeypatch.setattr(engine.tasks, "PARTITION_ROWS", 300)
    own, _ = runs
    files = {}
    for name in ("local", "ray"):
        out = tmp_path / f"{name}.csv"
        args = ["reduce", str(own), "--reduce", "*=p99", "--engine", name, "--out", str(out)]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        files[name] = out.read_bytes()
    assert files["ray"] == files["local"]


def test_plot_and_upload_on_ray_give_the_local_engines_bits(runs, tmp_path, monkeypatch):
    import shutil

    from metric_core import make_plan, plot_run, upload_run
    from metric_core.offline import engine
    from metric_core.offline.upload import WandB
    from tests.wandb_file import find_run_file, history_rows, read_records

    monkeypatch.setattr(engine.tasks, "PARTITION_ROWS", 300)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    own, _ = runs
    pngs, rows = {}, {}
    for name in ("local", "ray"):
        out = tmp_path / f"{name}.png"
        plot_run(own, make_plan(keys=["trainer/*"], reduce=["*=p99"]), out, engine=name)
        pngs[name] = out.read_bytes()
        copy = tmp_path / name / "own"
        shutil.copytree(own, copy)
        plan = make_plan(mode="per_rank_reduce", reduce=["*=median"])
        result = upload_run(copy, plan, WandB("proj", offline=True), engine=name)
        written = [read_records(find_run_file(copy / ".metriclog", o.run_id)) for o in result.outcomes]
        # each row without W&B's clock of this upload (_timestamp, _runtime)
        rows[name] = [
            [{k: v for k, v in r.items() if k not in ("_timestamp", "_runtime")} for r in history_rows(w)]
            for w in written
        ]
    assert pngs["ray"] == pngs["local"]
    assert len(rows["local"]) == 3 and all(rows["local"])
    assert rows["ray"] == rows["local"]


def test_without_ray_the_message_names_the_install(monkeypatch, runs):
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(MissingDependencyError, match=r"pip install 'metriclog\[ray\]'"):
        reduce_run(runs[0], engine="ray")
    assert Path(runs[0]).is_dir()


def test_a_cluster_that_cannot_see_the_run_directory_says_so(tmp_path, local_ray):
    """A Ray cluster on "another machine": the command runs in a mount namespace of its own,
    where the run's folder is a tmpfs holding the run, and joins this module's local
    cluster, whose workers see that folder empty. The command fails with one Error: line
    naming the directory, not a traceback from a worker."""
    hidden, written = tmp_path / "hidden", tmp_path / "written"
    hidden.mkdir()
    run = hidden / "run"
    write_collector_run(written, [("TrainActor_r0", 0)], steps=5)
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs unshare -m (a mount namespace) to hide a folder from the cluster")
    metriclog = Path(sys.executable).with_name("metriclog")
    seen_alone = f"mount -t tmpfs none '{hidden}' && cp -r '{written}' '{run}'"
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"{seen_alone} && exec '{metriclog}' reduce '{run}' --engine ray"],
        capture_output=True,
        text=True,
        env={**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address},
        timeout=600,
    )
    assert not run.exists()  # here, as the cluster's workers see it
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == [
        f"Error: no readable metric record in {run}: this Ray cluster's workers cannot see it: give a run "
        "directory every node can read (a shared file system), or run with --engine local"
    ], done.stderr


def test_the_same_records_split_renamed_and_shuffled_give_the_local_bits_on_ray(
    tmp_path, local_ray, monkeypatch
):
    """Issue 42: tests/test_exact_engine.py's records (sums, means and stds that rounding
    trips on, and every other statistic) split into 1, 3 and 7 files a rank of random
    names, each file's rows shuffled, reduced on Ray in partitions of other sizes (a task a
    file, their states merged in whatever order they end): every value of every mode has
    the bits of the local engine's reduction of the unsplit run in one partition a file."""
    from metric_core.offline import engine
    from tests.test_exact_engine import EVERY, records, split

    df = records(seed=31, others=True)
    runs = []
    for into in (1, 3, 7):
        runs.append(tmp_path / f"split{into}")
        split(df, into, runs[-1], seed=into)
    assert len(list(runs[-1].glob("*.parquet"))) == 7 * 4
    for mode in ("global_reduce", "per_rank_reduce"):
        for by in ("step", "time"):
            options = {"mode": mode, "by": by, **({"every": EVERY} if by == "time" else {})}
            monkeypatch.setattr(engine.tasks, "PARTITION_ROWS", 1_000_000)
            local = reduce_run(runs[0], **options)
            others = [c for c in local.columns if c != "value"]
            local = local.sort(others)
            assert local.height > 100
            monkeypatch.setattr(engine.tasks, "PARTITION_ROWS", 300)  # 1 to 4 partitions a file
            for run in runs:
                on_ray = reduce_run(run, engine="ray", **options).sort(others)
                assert on_ray.select(others).equals(local.select(others)), (run.name, options)
                want, got = (f["value"].cast(pl.Float64).to_numpy().view("int64") for f in (local, on_ray))
                moved = local.filter(pl.Series(want != got)).select(others).rows()
                assert not moved, f"{run.name} {options}: {len(moved)} values changed bits, e.g. {moved[:5]}"
