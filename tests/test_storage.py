"""Runs in object storage: a real S3-compatible server (moto's, started here on localhost)
holding runs the writer wrote, copied up with boto3 as any sync tool would. Every command
gives on ``s3://bucket/run`` what it gives on the local copy; what the store refuses is one
``Error:`` line."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from metric_core import inspect_run, reduce_run, scan_run
from metric_core.errors import MissingDependencyError, RequestError
from metric_core.offline.storage import run_path

from .conftest import write_collector_run
from .s3_server import KEYS, nothing_listens, s3_server
from .wandb_file import find_run_file, history_rows, read_records

pytest.importorskip("moto.server", reason="the S3 tests need moto[server] (the dev extra)")
boto3 = pytest.importorskip("boto3")

METRICLOG = str(Path(sys.executable).with_name("metriclog"))
NOW = 2_000_000_000.0  # inspect's "now", so that silences compare


def copy_up(client, local: Path, bucket: str, prefix: str) -> None:
    """Every file of a run directory (hidden ones too), as a sync tool copies it."""
    for path in sorted(local.rglob("*")):
        if path.is_file():
            key = path.relative_to(local).as_posix()
            client.upload_file(str(path), bucket, f"{prefix}/{key}" if prefix else key)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """The server, with three runs in bucket ``runs``: sample_logs' (JSONL, Parquet, a killed
    journal), the writer's run in many Parquet segments with a killed source, and another
    tool's Parquet file."""
    local = {"rl_run": Path("sample_logs/rl_run")}
    home = tmp_path_factory.mktemp("runs")  # each run under its name in the bucket
    own = local["own"] = home / "own"
    truth = write_collector_run(
        own, [("TrainActor_r0", 0), ("TrainActor_r1", 1)], steps=30, segment_records=200
    )
    write_collector_run(own, [("Generator_r0", 0)], steps=25, file_format="jsonl", seed=1)
    write_collector_run(own, [("Generator_r1", 1)], steps=12, seed=2, shutdown=None)  # killed: a journal
    (own / "run.json").write_text(json.dumps({"name": "own", "run_id": "own-run-0001", "world_size": 4}))
    foreign = local["foreign"] = home / "foreign"
    foreign.mkdir()
    pl.DataFrame(truth).write_parquet(foreign / "metrics.parquet", row_group_size=300)
    with s3_server() as endpoint, pytest.MonkeyPatch.context() as mp:
        env = {"AWS_ENDPOINT_URL": endpoint, **KEYS}
        for name, value in env.items():
            mp.setenv(name, value)
        mp.delenv("AWS_PROFILE", raising=False)
        client = boto3.client("s3")
        client.create_bucket(Bucket="runs")
        for name, path in local.items():
            copy_up(client, path, "runs", name)
        yield {"endpoint": endpoint, "env": env, "local": local, "client": client}


def cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """The installed command, in its own process (as a user runs it)."""
    return subprocess.run(
        [METRICLOG, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


@pytest.mark.parametrize("run", ["rl_run", "own", "foreign"])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"mode": "per_rank_reduce"},
        {"mode": "per_rank_no_reduce"},
        {"by": "time", "every": "5s"},
        {"reduce": ["*=p99"]},
        {"mode": "per_rank_reduce", "reduce": ["*=median"], "keys": ["*loss*", "policy/*"]},
        {"reduce": ["*=std"], "steps": "3:20"},
    ],
    ids=str,
)
def test_a_run_in_a_bucket_reduces_to_the_local_bits(s3, run, options):
    local = reduce_run(s3["local"][run], **options)
    remote = reduce_run(f"s3://runs/{run}", **options)
    assert local.height > 0
    assert remote.equals(local), (run, options)


@pytest.mark.parametrize("run", ["rl_run", "own", "foreign"])
def test_inspect_of_a_bucket_says_what_it_says_of_the_local_copy(s3, run):
    local = inspect_run(s3["local"][run], now=NOW).to_dict()
    remote = inspect_run(f"s3://runs/{run}", now=NOW).to_dict()
    assert remote.pop("run_dir") == f"s3://runs/{run}"
    local.pop("run_dir")
    assert remote == local
    assert remote["sources"], "the run has sources"


def test_the_command_line_reads_a_bucket_and_writes_to_one(s3, tmp_path):
    env = s3["env"]
    for suffix in ("parquet", "csv", "jsonl"):
        args = ["--mode", "per_rank_reduce", "--reduce", "*=p99"]
        done = cli("reduce", "s3://runs/own", *args, "--out", f"s3://runs/results/own.{suffix}", env=env)
        assert done.returncode == 0, done.stderr
        assert f"to s3://runs/results/own.{suffix}" in done.stderr
        ref = tmp_path / f"own.{suffix}"
        done = cli("reduce", str(s3["local"]["own"]), *args, "--out", str(ref), env=env)
        assert done.returncode == 0, done.stderr
        stored = s3["client"].get_object(Bucket="runs", Key=f"results/own.{suffix}")["Body"].read()
        assert stored == ref.read_bytes(), suffix
    # the JSONL result carries its marker, so a later read of the bucket does not take it for data
    marker = s3["client"].get_object(Bucket="runs", Key="results/.own.jsonl.metriclog")["Body"].read()
    assert json.loads(marker) == json.loads((tmp_path / ".own.jsonl.metriclog").read_bytes())
    printed = [
        cli("reduce", run, "--steps", "2:4", env=env) for run in ("s3://runs/own", str(s3["local"]["own"]))
    ]
    assert printed[0].returncode == 0 and printed[0].stdout == printed[1].stdout
    assert "Traceback" not in printed[0].stderr


def test_plot_of_a_bucket_is_the_local_plot(s3, tmp_path):
    pytest.importorskip("matplotlib")
    env = s3["env"]
    done = cli("plot", "s3://runs/own", "--key", "trainer/*", "--out", "s3://runs/plots/own.png", env=env)
    assert done.returncode == 0, done.stderr
    ref = tmp_path / "own.png"
    done = cli("plot", str(s3["local"]["own"]), "--key", "trainer/*", "--out", str(ref), env=env)
    assert done.returncode == 0, done.stderr
    stored = s3["client"].get_object(Bucket="runs", Key="plots/own.png")["Body"].read()
    assert stored[:8] == b"\x89PNG\r\n\x1a\n"
    assert stored == ref.read_bytes()


def test_a_run_uploaded_from_a_bucket_and_from_disk_is_one_upload(s3, tmp_path):
    cache = tmp_path / "cache"
    env = {
        **s3["env"],
        "XDG_CACHE_HOME": str(cache),
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "NETRC": "/nonexistent-netrc",
    }
    env.pop("WANDB_DIR", None)
    done = cli("upload", "s3://runs/own", "--project", "proj", "--offline", env=env)
    assert done.returncode == 0, done.stderr
    (ledger_path,) = cache.glob("metriclog/*/uploads.json")
    ((run_id, entry),) = json.loads(ledger_path.read_text())["runs"].items()
    assert entry["finished"]
    rows = history_rows(read_records(find_run_file(ledger_path.parent, run_id)))
    truth = reduce_run(s3["local"]["own"])
    assert len(rows) == truth["step"].n_unique()
    loss = truth.filter(pl.col("key") == "trainer/loss").sort("step")
    assert [r["trainer/loss"] for r in rows if "trainer/loss" in r] == loss["value"].to_list()
    # nothing was written into the bucket
    listed = s3["client"].list_objects_v2(Bucket="runs", Prefix="own/")["Contents"]
    assert not [o["Key"] for o in listed if "/.metriclog" in o["Key"]]
    # the same run, copied down: its upload is the one above
    copy = tmp_path / "own"
    shutil.copytree(s3["local"]["own"], copy)
    again = cli("upload", str(copy), "--project", "proj", "--offline", env=env)
    assert again.returncode == 0, again.stderr
    assert "already written offline" in again.stderr
    assert not (copy / ".metriclog").exists()


def test_a_run_copied_up_with_its_ledger_is_not_uploaded_again(s3, tmp_path):
    env = {
        **s3["env"],
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
    }
    run = tmp_path / "synced"
    write_collector_run(run, [("TrainActor_r0", 0)], steps=6, seed=7)
    (run / "run.json").write_text(json.dumps({"name": "synced", "run_id": "synced-run-0001"}))
    first = cli("upload", str(run), "--project", "proj", "--offline", env=env)
    assert first.returncode == 0, first.stderr
    assert (run / ".metriclog" / "uploads.json").is_file()
    copy_up(s3["client"], run, "runs", "synced")  # .metriclog/ with it, as `aws s3 sync` copies
    again = cli("upload", "s3://runs/synced", "--project", "proj", "--offline", env=env)
    assert again.returncode == 0, again.stderr
    assert "already written offline" in again.stderr
    other = cli("upload", "s3://runs/synced", "--project", "other", "--offline", env=env)
    assert other.returncode == 0 and "already" not in other.stderr, "another project is another upload"


def test_watch_follows_a_finished_run_in_a_bucket(s3, tmp_path):
    client = s3["client"]
    finished = tmp_path / "finished"
    write_collector_run(finished, [("TrainActor_r0", 0)], steps=5)
    copy_up(client, finished, "runs", "finished")
    done = cli("watch", "s3://runs/finished", "--interval", "0.2", env=s3["env"])
    assert done.returncode == 0, done.stderr


def test_follow_says_it_needs_a_filesystem(s3):
    done = cli("upload", "s3://runs/own", "--project", "p", "--follow", "--offline", env=s3["env"])
    assert done.returncode == 1
    assert done.stderr.startswith("Error: s3://runs/own: --follow reads a run while its writers append")


@pytest.mark.parametrize(
    "fault", ["missing bucket", "no run there", "no credentials", "unknown key", "no server"]
)
def test_what_the_store_refuses_is_one_error_line(s3, fault):
    env, url = dict(s3["env"]), "s3://runs/own"
    unset = []
    with contextlib.ExitStack() as stack:
        if fault == "missing bucket":
            url = "s3://no-such-bucket/own"
        elif fault == "no run there":
            url = "s3://runs/not-a-run"
        elif fault == "no credentials":
            unset = ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]
            env["AWS_SHARED_CREDENTIALS_FILE"] = env["AWS_CONFIG_FILE"] = "/nonexistent"
            env["AWS_EC2_METADATA_DISABLED"] = "true"
        elif fault == "unknown key":  # a server that checks keys, and knows none
            env["AWS_ENDPOINT_URL"] = stack.enter_context(s3_server(INITIAL_NO_AUTH_ACTION_COUNT="0"))
        else:
            env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{stack.enter_context(nothing_listens())}"
        full = {k: v for k, v in {**os.environ, **env}.items() if k not in unset}
        done = subprocess.run(
            [METRICLOG, "inspect", url], capture_output=True, text=True, timeout=300, env=full
        )
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), done.stderr
    assert "Traceback" not in done.stderr
    expected = {
        "missing bucket": "the bucket no-such-bucket does not exist",
        "no run there": "nothing is stored under it",
        "no credentials": "no usable credentials",
        "unknown key": "access denied",
        "no server": "did not answer",
    }[fault]
    assert expected in lines[0]
    for secret in ("testing",):
        assert secret not in done.stderr


def test_a_file_url_is_a_local_path(tmp_path):
    assert run_path(f"file://{tmp_path}") == tmp_path
    assert run_path(f"file://localhost{tmp_path}") == tmp_path
    with pytest.raises(RequestError, match="not on otherhost"):
        run_path("file://otherhost/data/run")
    local = reduce_run("sample_logs/rl_run")
    assert reduce_run(f"file://{Path('sample_logs/rl_run').resolve()}").equals(local)


def test_an_unknown_scheme_and_a_missing_extra_are_said(monkeypatch):
    with pytest.raises(RequestError, match="not hdfs://"):
        run_path("hdfs://cluster/run")
    monkeypatch.setitem(sys.modules, "upath", None)  # as if universal_pathlib were not installed
    with pytest.raises(MissingDependencyError, match=r"pip install 'metriclog\[s3\]'"):
        run_path("s3://runs/own")


def test_the_ray_engine_reads_a_bucket_from_its_tasks(s3, tmp_path):
    """``--engine ray`` on a run in a bucket: its tasks read the objects (the server's
    address and keys reach them through the environment), and the file written is the
    local engine's. Through the command line, in a process of its own: Ray's driver can end
    the process it runs in (tests/test_ray.py)."""
    pytest.importorskip("ray")
    metriclog = str(Path(sys.executable).with_name("metriclog"))
    out = {}
    for engine, run in (("local", str(s3["local"]["own"])), ("ray", "s3://runs/own")):
        out[engine] = tmp_path / f"{engine}.parquet"
        options = ["--mode", "per_rank_reduce", "--reduce", "*=p99", "--engine", engine]
        command = [metriclog, "reduce", run, *options, "--out", str(out[engine])]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
    assert pl.read_parquet(out["ray"]).equals(pl.read_parquet(out["local"]))


def test_a_run_at_the_root_of_a_bucket_is_named_after_it(s3):
    client = s3["client"]
    client.create_bucket(Bucket="rootrun")
    copy_up(client, s3["local"]["foreign"], "rootrun", "")  # no run.json: no name in it
    scan = scan_run("s3://rootrun")
    assert scan.name == "rootrun"
    assert reduce_run("s3://rootrun").equals(reduce_run(s3["local"]["foreign"]))


def test_a_ledger_in_the_bucket_that_is_not_one_is_ignored(s3, tmp_path):
    client = s3["client"]
    copy_up(client, s3["local"]["own"], "runs", "badledger")
    client.put_object(Bucket="runs", Key="badledger/.metriclog/uploads.json", Body=b"[1, 2]")
    env = {
        **s3["env"],
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
    }
    for extra in (["--dry-run"], []):
        done = cli("upload", "s3://runs/badledger", "--project", "proj", "--offline", *extra, env=env)
        assert done.returncode == 0, done.stderr
        assert "already" not in done.stderr


def test_an_object_the_store_refuses_fails_the_command(s3):
    """An object in a storage class that cannot be read (Glacier) is not a damaged file to
    skip: the command fails, naming it, rather than reduce the rest."""
    client = s3["client"]
    for path in sorted(s3["local"]["own"].iterdir()):
        if path.is_file():
            frozen = path.name.startswith("TrainActor_r1")
            extra = {"StorageClass": "GLACIER"} if frozen else {}
            client.upload_file(str(path), "runs", f"frozen/{path.name}", ExtraArgs=extra)
    done = cli("reduce", "s3://runs/frozen", env=s3["env"])
    assert done.returncode == 1, done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: s3://runs/frozen/TrainActor_r1"), done.stderr
    assert "archived" in lines[0] and "restore it" in lines[0]
    assert "<?xml" not in lines[0]
    assert not done.stdout


MID_QUERY = """
import sys
from metric_core import make_plan, scan_run
from metric_core.errors import StorageError
from metric_core.offline.engine import execute
scan = scan_run(sys.argv[1])
print("scanned", flush=True)
sys.stdin.readline()
try:
    execute(make_plan(), scan).frame
except StorageError as exc:
    print("StorageError:", exc)
"""


def test_a_store_that_goes_away_mid_read_is_one_storage_error(s3, tmp_path):
    with s3_server() as endpoint:
        env = {**os.environ, **KEYS, "AWS_ENDPOINT_URL": endpoint}
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket="brief")
        copy_up(client, s3["local"]["own"], "brief", "own")
        child = subprocess.Popen(
            [sys.executable, "-c", MID_QUERY, "s3://brief/own"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "scanned"
    out, err = child.communicate("go\n", timeout=300)  # the server is gone now
    assert child.returncode == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("StorageError: "), out + err
    assert "did not answer" in lines[0]


def test_a_scheme_in_capitals_is_the_same_url(s3):
    assert reduce_run("S3://runs/own").equals(reduce_run(s3["local"]["own"]))


def test_the_writer_refuses_a_url(tmp_path, monkeypatch):
    """A training job given a bucket URL must not write a folder named 's3:' where it runs."""
    import metric_core
    from metric_core.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="the writer appends to files on a local or network filesystem"):
        metric_core.init("s3://runs/live", process_name="TrainActor_r0")
    assert not list(tmp_path.iterdir()), "nothing was written"


def test_a_bucket_copy_is_judged_at_its_newest_object(s3):
    """The time of the newest copy, as the store lists it, is what a copy's silences are
    measured against (inspect's and watch's "now"), not the wall clock."""
    listed = s3["client"].list_objects_v2(Bucket="runs", Prefix="own/")["Contents"]
    newest = max(o["LastModified"] for o in listed).timestamp()
    report = inspect_run("s3://runs/own")
    assert report.checked_at == pytest.approx(newest, abs=1e-3)
    source = next(s for s in report.sources if s.status != "finished")
    assert source.silent_s == pytest.approx(newest - source.last_timestamp, abs=1e-3)


def test_pyarrow_reads_through_fsspec_where_it_takes_no_url(s3, monkeypatch):
    """pyarrow reads no az:// URL: it is handed a file fsspec opens. The same, done here
    for S3 (every object of the run handed over as a file fsspec opened), gives the same
    bits."""
    import uuid

    from metric_core.offline.read import parquet

    options = ({}, {"mode": "per_rank_reduce", "reduce": ["*=p99"]})
    want = {
        (i, run): reduce_run(s3["local"][run], **o)
        for i, o in enumerate(options)
        for run in ("own", "foreign")
    }
    given = []

    @contextlib.contextmanager
    def through_fsspec(path):  # as arrow_source does for az://
        with path.open("rb", cache_type="none") as f:
            given.append(type(f))
            yield f

    monkeypatch.setattr(parquet, "arrow_source", through_fsspec)
    bucket = f"fsspec-{uuid.uuid4().hex}"  # objects no earlier read has seen (footers are kept)
    s3["client"].create_bucket(Bucket=bucket)
    for run in ("own", "foreign"):
        copy_up(s3["client"], s3["local"][run], bucket, run)
    for i, o in enumerate(options):
        for run in ("own", "foreign"):
            assert reduce_run(f"s3://{bucket}/{run}", **o).equals(want[i, run]), (o, run)
    assert given and all(t is not str for t in given), "pyarrow was handed an fsspec file"


def test_an_out_to_a_missing_bucket_fails_before_the_read(s3, tmp_path):
    for command in (["reduce", "s3://runs/own"], ["plot", "s3://runs/own", "--key", "trainer/*"]):
        suffix = "png" if command[0] == "plot" else "parquet"
        done = cli(*command, "--out", f"s3://no-such-out/x.{suffix}", env=s3["env"])
        assert done.returncode == 1
        # one line: the run, whose killed journal a read would warn of, was not read
        assert done.stderr.strip().splitlines() == [
            f"Error: s3://no-such-out/x.{suffix}: the bucket no-such-out does not exist "
            "(or these credentials cannot see it): check the URL"
        ], done.stderr


def test_a_folder_of_several_runs_says_so(s3, tmp_path):
    """A bucket root (or a folder) that holds runs is read as one run, and said."""
    both = tmp_path / "both"
    for name in ("a", "b"):
        shutil.copytree(s3["local"]["own"], both / name)
    copy_up(s3["client"], both, "runs", "both")
    for location in (both, "s3://runs/both"):
        notices = scan_run(location).report.notices
        for name in ("a", "b"):
            assert any(
                n.startswith(f"{name}/run.json: {name} looks like a run of its own") for n in notices
            ), notices


def test_an_object_whose_key_no_path_names_is_named_and_the_rest_read(s3):
    """A key ending in "/" that holds bytes, or with a ".." part, cannot be read as a path:
    it was read as an empty file, or taken for a hidden one, without a word."""
    line = json.dumps(
        {"key": "k", "value": 1.0, "reduction": "mean", "step": 0, "timestamp": 1.7e9, "rank": 0}
    )
    for key in ("odd/good.jsonl", "odd/e.jsonl/", "odd/x/../d.jsonl", "odd/s/z.r0.00000.samples.jsonl/"):
        s3["client"].put_object(Bucket="runs", Key=key, Body=line.encode() + b"\n")
    s3["client"].put_object(Bucket="runs", Key="odd/folder/", Body=b"")  # a console's folder: no data
    scan = scan_run("s3://runs/odd")
    assert [(rel, why) for rel, why in scan.report.skipped_paths] == [
        ("s3://runs/odd/e.jsonl/", "its key ends in '/', which no path names: not read"),
        ("s3://runs/odd/x/../d.jsonl", "its key has a '.' or '..' part, which no path names: not read"),
    ]
    assert scan.report.records == 1
    done = cli("samples", "s3://runs/odd", env=s3["env"])
    assert "s/z.r0.00000.samples.jsonl/: its key ends in '/', which no path names: not read" in done.stderr
    assert "folder" not in done.stderr and "Traceback" not in done.stderr
