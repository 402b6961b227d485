"""--engine ray on a local Ray (2 CPUs): every mode and statistic gives the same bits as
--engine local, on the writer's files (several segments a source) and another tool's.

Run by tests/test_ray.py in a pytest process of its own (Ray's driver can end the process
it runs in)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import polars as pl
import pytest

from metric_core import reduce_run
from metric_core.errors import MissingDependencyError
from tests.conftest import write_collector_run

ray = pytest.importorskip("ray")

STATS = ["mean", "sum", "max", "min", "std", "count", "median", "p99", "first", "last"]


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
        *({"reduce": [f"*={stat}"]} for stat in STATS),
        *({"mode": "per_rank_reduce", "reduce": [f"*={stat}"]} for stat in ("median", "first", "std")),
    ],
    ids=str,
)
def test_ray_gives_the_local_engines_bits(runs, options, monkeypatch):
    from metric_core.offline import engine

    monkeypatch.setattr(engine.reading, "PARTITION_ROWS", 300)  # many tasks, several partitions each
    for run in runs:
        local = reduce_run(run, **options)
        on_ray = reduce_run(run, engine="ray", **options)
        assert local.height > 0
        assert on_ray.equals(local), (run, options)


def test_the_command_line_writes_the_same_file_with_either_engine(runs, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from cli.main import app
    from metric_core.offline import engine

    monkeypatch.setattr(engine.reading, "PARTITION_ROWS", 300)
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
    from metric_core.offline.upload import Destination
    from tests.wandb_file import find_run_file, history_rows, read_records

    monkeypatch.setattr(engine.reading, "PARTITION_ROWS", 300)
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
        result = upload_run(copy, plan, Destination("proj", offline=True), engine=name)
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


def test_a_cluster_that_cannot_see_the_run_directory_says_so(tmp_path):
    """A Ray cluster on "another machine": its head (and so its workers) started in a mount
    namespace where the run's folder is an empty tmpfs. Given that run, the command fails
    with one Error: line naming the directory, not a traceback from a worker."""
    hidden = tmp_path / "hidden"
    run = hidden / "run"
    write_collector_run(run, [("TrainActor_r0", 0)], steps=5)
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs unshare -m (a mount namespace) to hide a folder from the cluster")
    ray_cmd = Path(sys.executable).with_name("ray")
    head = subprocess.Popen(  # on a port of its own choosing (--port 0), which it says
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            f"mount -t tmpfs none '{hidden}' && exec '{ray_cmd}' start --head --block --port 0 "
            "--num-cpus 2 --include-dashboard false --disable-usage-stats",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},  # whatever token ~/.ray holds
    )
    said: list[str] = []

    def read() -> None:
        for line in head.stdout or ():
            said.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    port = None
    try:
        deadline = time.monotonic() + 120
        while port is None:  # until it says its address: "ray start --address='<ip>:<port>'"
            found = re.search(r"--address='[^']*:(\d+)'", "".join(said))
            port = int(found.group(1)) if found else None
            assert head.poll() is None or port is not None, "".join(said)
            assert time.monotonic() < deadline, "the Ray head did not start"
            time.sleep(0.1)
        env = {**os.environ, "RAY_ADDRESS": f"127.0.0.1:{port}", "RAY_AUTH_MODE": "disabled"}
        while True:  # until its GCS takes connections
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert head.poll() is None, "".join(said)
            assert time.monotonic() < deadline, "the Ray head did not start"
            time.sleep(0.1)
        metriclog = str(Path(sys.executable).with_name("metriclog"))
        done = subprocess.run(
            [metriclog, "reduce", str(run), "--engine", "ray"],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
    finally:
        os.killpg(head.pid, signal.SIGKILL)  # the head and all it started: SIGTERM takes 30 s
        head.wait(timeout=60)
        reader.join(timeout=60)
        # `ray start` leaves its address for later `ray.init()` calls on this machine to join
        current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
        if current.is_file() and current.read_text().strip().endswith(f":{port}"):
            current.unlink()
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == [
        f"Error: no readable metric record in {run}: this Ray cluster's workers cannot see it: give a run "
        "directory every node can read (a shared file system), or run with --engine local"
    ], done.stderr
