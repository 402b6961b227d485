"""run.json's checksum: real bit flips in a real run.json, every command checked.

``run_id`` in run.json is the run's upload identity. The oracle of every flip is the file
itself: a flipped file whose JSON is not what rank 0 wrote (or is no JSON) is damaged; a
damaged run.json is said once by each command that reads the run, and ``upload`` refuses
it (exit 1, naming run.json), never taking another identity. A run.json without a checksum
(every run written before it) is read as before, silently.
"""

from __future__ import annotations

import json
import random
import re
import zlib
from pathlib import Path

import pytest
from metriclog.main import app
from typer.testing import CliRunner

import metric_core
from metric_core import scan_run

runner = CliRunner()
DAMAGED = "run.json: its fields do not match its checksum"
STEPS = 4


@pytest.fixture(autouse=True)
def offline_env(wandb_offline):
    """Every test here runs W&B offline, logged out."""


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, bytes]:
    """A run rank 0 wrote through metric_core.init (records and samples), and its run.json."""
    run = tmp_path_factory.mktemp("runs") / "exp1"
    metric_core.init(run, rank=0, process_name="trainer", world_size=1, config={"lr": 3e-4, "note": "é"})
    for step in range(STEPS):
        metric_core.record_metric("loss", 1.0 / (step + 1))
        metric_core.record_metric("rollout", {"reward": float(step), "text": "t"}, metric_core.Reduce.SAMPLE)
        metric_core.flush(step)
    metric_core.shutdown()
    return run, (run / "run.json").read_bytes()


def copy_of(run: Path, into: Path, run_json: bytes | None) -> Path:
    import shutil

    shutil.copytree(run, into)
    if run_json is None:
        (into / "run.json").unlink()
    else:
        (into / "run.json").write_bytes(run_json)
    return into


def flipped(data: bytes, bit: int) -> bytes:
    out = bytearray(data)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def parsed(data: bytes) -> object:
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None  # no JSON: damaged by any reading


def test_the_writer_checksums_its_fields_as_docs_format_says(written):
    _, data = written
    meta = json.loads(data)
    assert list(meta)[-1] == "checksum"
    fields = {k: v for k, v in meta.items() if k != "checksum"}
    assert meta["checksum"] == zlib.crc32(json.dumps(fields, sort_keys=True).encode())
    assert re.fullmatch(r"[0-9a-f]{32}", meta["run_id"]) and meta["config"] == {"lr": 3e-4, "note": "é"}


def test_every_flip_of_the_run_id_and_a_bit_of_every_byte_is_caught(tmp_path, written):
    run, data = written
    original = json.loads(data)
    rng = random.Random(41)
    start = data.index(original["run_id"].encode())
    bits = {8 * i + rng.randrange(8) for i in range(len(data))}  # a bit of every byte
    bits |= set(range(8 * start, 8 * (start + len(original["run_id"]))))  # every bit of run_id
    fields = {k: v for k, v in original.items() if k != "checksum"}
    other_ids = caught = 0
    root = copy_of(run, tmp_path / "run", data)
    for bit in sorted(bits):
        damaged = flipped(data, bit)
        (root / "run.json").write_bytes(damaged)
        scan = scan_run(root)
        truth = parsed(damaged)
        # the oracle: a field rank 0 wrote is gone or changed (or the file is no JSON object)
        changed = not isinstance(truth, dict) or any(truth.get(k, ...) != v for k, v in fields.items())
        if isinstance(truth, dict) and truth.get("run_id") not in (None, original["run_id"]):
            other_ids += 1  # still JSON, another identity: what the checksum is for
        said = [n for n in scan.report.notices if n.startswith("run.json:")]
        assert scan.meta.get("run_id") in (None, original["run_id"]), (bit, damaged)  # never another one
        if scan.report.run_json_damaged:
            caught += 1
            assert scan.meta == {} and len(said) == 1, (bit, said)
        else:  # read as written: only the checksum's own name was hit (then read as without one)
            assert not changed and not said, (bit, damaged)
            assert {k: scan.meta[k] for k in fields} == fields and "checksum" not in truth
    assert other_ids >= 32  # every flip of a hex digit that leaves a character: still valid JSON
    assert caught >= len(bits) - len("checksum")  # all but flips of the checksum field's name


def _one_flip_to_another_run_id(data: bytes) -> bytes:
    original = json.loads(data)
    start = data.index(original["run_id"].encode())
    for bit in range(8 * start, 8 * (start + 32)):
        damaged = flipped(data, bit)
        truth = parsed(damaged)
        if isinstance(truth, dict) and truth["run_id"] != original["run_id"]:
            return damaged
    raise AssertionError("no flip of run_id kept the JSON valid")


def _reading_commands(run: Path, tmp_path: Path) -> dict[str, list[str]]:
    return {
        "reduce": ["reduce", str(run)],
        "keys": ["keys", str(run)],
        "samples": ["samples", str(run)],
        "inspect": ["inspect", str(run)],
        "plot": ["plot", str(run), "--key", "loss", "--out", str(tmp_path / "loss.png")],
        "watch": ["watch", str(run), "--interval", "0.1"],
    }


def _uploads(run: Path, tmp_path: Path) -> dict[str, list[str]]:
    common = ["upload", str(run), "--project", "p"]
    return {
        "upload": [*common, "--offline"],
        "upload --dry-run": [*common, "--dry-run"],
        "upload --follow": [*common, "--offline", "--follow", "--interval", "0.1"],
        "upload --to tensorboard": [
            "upload",
            str(run),
            "--to",
            "tensorboard",
            "--logdir",
            str(tmp_path / "tb"),
        ],
    }


def test_a_flipped_run_id_is_said_once_by_each_command_and_upload_refuses(tmp_path, written):
    run, data = written
    root = copy_of(run, tmp_path / "run", _one_flip_to_another_run_id(data))
    for name, argv in _reading_commands(root, tmp_path).items():
        result = runner.invoke(app, argv)
        assert result.exit_code == 0, (name, result.output)
        assert result.output.count(DAMAGED) == 1, (name, result.output)
        assert "Traceback" not in result.output
    for name, argv in _uploads(root, tmp_path).items():
        result = runner.invoke(app, argv)
        assert result.exit_code == 1, (name, result.output)
        errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1 and f"{root / 'run.json'}: its fields do not match its checksum" in errors[0]
        assert "derive from the run's content" not in result.output  # no other identity taken
        assert "Traceback" not in result.output
    # nothing was uploaded, under any identity
    assert not (root / ".metriclog" / "uploads.json").exists()
    assert not list((root / ".metriclog").glob("**/*.wandb"))
    assert not any((tmp_path / "tb").glob("**/events.*"))


def test_a_run_json_that_is_no_longer_json_is_refused_by_upload_too(tmp_path, written):
    run, data = written
    bit = 8 * data.index(b"{")  # '{' becomes 'z'
    root = copy_of(run, tmp_path / "run", flipped(data, bit + 6))
    assert parsed((root / "run.json").read_bytes()) is None
    reduced = runner.invoke(app, ["reduce", str(root)])
    assert reduced.exit_code == 0 and reduced.output.count("run.json: not valid JSON") == 1
    result = runner.invoke(app, ["upload", str(root), "--project", "p", "--dry-run"])
    assert result.exit_code == 1, result.output
    assert f"Error: {root / 'run.json'}: not valid JSON" in result.stderr


def _ids(result) -> list[str]:
    return sorted(set(re.findall(r"ml-[0-9a-f]{16}", result.output)))


def test_a_run_json_without_checksum_is_read_as_before_silently(tmp_path, written):
    run, data = written
    meta = json.loads(data)
    legacy = {k: v for k, v in meta.items() if k != "checksum"}
    checked = copy_of(run, tmp_path / "checked", data)
    old = copy_of(run, tmp_path / "old", json.dumps(legacy).encode())
    for name, argv in _reading_commands(old, tmp_path).items():
        result = runner.invoke(app, argv)
        assert result.exit_code == 0, (name, result.output)
        assert "run.json" not in result.output, (name, result.output)
    dry = [runner.invoke(app, ["upload", str(r), "--project", "p", "--dry-run"]) for r in (checked, old)]
    assert [d.exit_code for d in dry] == [0, 0] and "run.json" not in dry[1].output
    assert _ids(dry[0]) and _ids(dry[0]) == _ids(dry[1])  # one identity: run_id, with a checksum or not
    other = copy_of(run, tmp_path / "other", json.dumps({**legacy, "run_id": "f" * 32}).encode())
    moved = runner.invoke(app, ["upload", str(other), "--project", "p", "--dry-run"])
    assert moved.exit_code == 0 and _ids(moved) and not set(_ids(moved)) & set(_ids(dry[0]))  # run_id rules


def test_reformatted_it_still_matches(tmp_path, written):
    """The checksum covers the fields, not their layout: jq or json.dumps(indent=4) keep it."""
    run, data = written
    meta = json.loads(data)
    root = copy_of(run, tmp_path / "run", json.dumps(dict(reversed(list(meta.items()))), indent=4).encode())
    scan = scan_run(root)
    assert scan.report.run_json_damaged is None and scan.meta["run_id"] == meta["run_id"]
    assert not [n for n in scan.report.notices if "run.json" in n]


def test_a_config_of_any_python_values_checks(tmp_path):
    """run.json holds a config's values as JSON gives them back (str keys, str of the rest)."""
    metric_core.init(tmp_path, rank=0, config={1: "one", "path": tmp_path, "t": (1, 2), "nan": float("nan")})
    metric_core.record_metric("loss", 1.0)
    metric_core.flush(0)
    metric_core.shutdown()
    scan = scan_run(tmp_path)
    assert scan.report.run_json_damaged is None
    assert scan.meta["config"]["1"] == "one" and scan.meta["config"]["path"] == str(tmp_path)


def test_the_installed_command_refuses_it_from_its_reading_child(tmp_path, written):
    """A real ``metriclog upload`` reads the run in a forked child: the refusal crosses over."""
    import subprocess
    import sys

    run, data = written
    root = copy_of(run, tmp_path / "run", _one_flip_to_another_run_id(data))
    metriclog = str(Path(sys.executable).with_name("metriclog"))
    done = subprocess.run(
        [metriclog, "upload", str(root), "--project", "p", "--offline"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "run.json: its fields do not match its checksum" in errors[0]
    assert "Traceback" not in done.stderr and not (root / ".metriclog" / "uploads.json").exists()
