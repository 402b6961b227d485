"""Hostile and damaged input: each case gets a message naming the file, and loses nothing else.

Also the journal's checksums and its format version, and symlinks below the run directory.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from metriclog.main import app
from typer.testing import CliRunner

from metric_core import MetricCollector, scan_run

from .conftest import killed_after
from .test_reader import jsonl, rec, values

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def good_run(root: Path, n: int = 5) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    jsonl(root / "good.jsonl", [rec(i) for i in range(n)])
    return root


# -- run.json ------------------------------------------------------------------------------


def test_an_absurd_world_size_is_ignored_and_said(tmp_path):
    run = good_run(tmp_path / "run")
    (run / "run.json").write_text(json.dumps({"world_size": 10**12}))
    result = invoke("inspect", run, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["world_size"] is None and report["missing_ranks"] == []
    assert (
        "run.json: 'world_size' must be an integer from 1 to 1,048,576, not 1000000000000; ignored"
        in result.stderr
    )


@pytest.mark.parametrize("config", [[1, 2], "lr=0.1"])
def test_a_config_that_is_not_an_object_is_ignored_and_said(tmp_path, config):
    run = good_run(tmp_path / "run")
    (run / "run.json").write_text(json.dumps({"config": config}))
    result = invoke("upload", run, "--project", "p", "--dry-run")
    assert result.exit_code == 0, result.output
    shown = json.dumps(config)
    assert f"run.json: 'config' must be a JSON object, not {shown}; ignored" in result.stderr


def test_a_broken_run_json_does_not_block_the_data(tmp_path):
    run = good_run(tmp_path / "run")
    (run / "run.json").write_text("{not json")
    scan = scan_run(run)
    assert values(scan) == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert scan.report.notices[0].startswith("run.json: not valid JSON (")
    assert scan.report.notices[0].endswith("its metadata is ignored: fix or remove it")


# -- records -------------------------------------------------------------------------------


def test_timestamps_that_are_no_clock_are_skipped_and_inspect_stays_json(tmp_path):
    run = good_run(tmp_path / "run")
    jsonl(
        run / "odd.jsonl",
        [
            rec(10, timestamp=4.4e140),
            rec(11, timestamp=-1e20),
            '{"key": "loss", "value": 1, "reduction": "mean", "step": 12, "timestamp": Infinity, "rank": 0}',
            rec(13, value=float("nan")),
        ],
    )
    result = invoke("inspect", run, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout, parse_constant=lambda c: pytest.fail(f"{c} in strict JSON"))
    assert report["sources"][0]["records"] == 6
    assert report["first_to_stop"] is None or report["first_to_stop"]["last_values"]["loss"] is None
    assert (
        "odd.jsonl: 3 record(s) skipped: line 1: 'timestamp' is not Unix epoch seconds from 1970 to 2286; "
        "line 2: 'timestamp' is not Unix epoch seconds from 1970 to 2286; line 3:" in result.stderr
    )
    by_time = invoke("reduce", run, "--by", "time", "--every", "1s", "--out", tmp_path / "w.csv")
    assert by_time.exit_code == 0, by_time.output
    assert pl.read_csv(tmp_path / "w.csv").height == 6  # 5 one-second windows of good.jsonl, one of odd.jsonl


def test_a_nan_last_value_is_null_in_inspect_json(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    jsonl(run / "a.jsonl", [rec(i, process="a") for i in range(40)])
    jsonl(
        run / "b.jsonl",
        [rec(i, process="b", rank=1, value=float("nan") if i == 4 else 1.0) for i in range(5)],
    )
    result = invoke("inspect", run, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout, parse_constant=lambda c: pytest.fail(f"{c} in strict JSON"))
    assert report["first_to_stop"]["process"] == "b"
    assert report["first_to_stop"]["last_values"] == {"loss": None}


def test_an_extra_field_named_event_is_an_extra_field(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    jsonl(run / "a.jsonl", [rec(0, event="click"), rec(1, event="shutdown"), rec(2)])
    assert values(scan_run(run)) == [0.0, 1.0, 2.0]


def test_fractional_steps_in_parquet_are_skipped_and_said(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    df = pl.DataFrame([rec(i) for i in range(4)]).with_columns(step=pl.Series([0.0, 1.5, 2.0, float("nan")]))
    df.write_parquet(run / "a.parquet")
    scan = scan_run(run)
    assert scan.frame.select("step").collect()["step"].to_list() == [0, 2]
    told = "'step' is null or not an integer in int64's range"
    assert f"a.parquet: 2 record(s) skipped: row 1: {told}; row 3: {told}" in scan.report.summary()


def test_a_gzip_file_named_jsonl_is_named_and_the_rest_read(tmp_path):
    run = good_run(tmp_path / "run")
    (run / "packed.jsonl").write_bytes(gzip.compress(b'{"key": "loss"}\n'))
    result = invoke("reduce", run, "--mode", "per_rank_no_reduce")
    assert result.exit_code == 0, result.output
    assert (
        "packed.jsonl: unreadable, skipped (gzip-compressed data, not JSON lines: decompress it first "
        "(e.g. gunzip))" in result.stderr
    )
    assert sorted(values(scan_run(run))) == [0.0, 1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize(
    "where", ["zeros after the last line", "a NUL inside a line", "binary from the start", "after a BOM"]
)
def test_nul_bytes_in_json_lines_skip_the_lines_they_are_in_not_the_file(tmp_path, where):
    """A new user's trial: 4 KiB of zeros after the last line (what a file system can leave
    after a crash), or one NUL in a line, made the whole file "binary": every record lost.
    Now only those lines are skipped, each said; a file that is binary from its first line
    is still named unreadable."""
    run = tmp_path / "run"
    run.mkdir()
    lines = [json.dumps(rec(i)).encode() for i in range(4)]
    if where == "zeros after the last line":
        data, kept, said = (
            b"\n".join(lines) + b"\n" + b"\0" * 4096,
            [0.0, 1.0, 2.0, 3.0],
            "line 5: half-written",
        )
    elif where == "a NUL inside a line":
        lines[2] = lines[2][:10] + b"\0" + lines[2][11:]
        data, kept, said = b"\n".join(lines) + b"\n", [0.0, 1.0, 3.0], "line 3: not valid JSON"
    elif where == "after a BOM":  # a UTF-8 byte order mark first: still text
        data = b"\xef\xbb\xbf" + b"\n".join(lines) + b"\n\0\0"
        kept, said = [0.0, 1.0, 2.0, 3.0], "line 5: half-written"
    else:
        data, kept, said = b"\0\0\0" + b"\n".join(lines) + b"\n", None, "unreadable, skipped (binary data"
    (run / "a.jsonl").write_bytes(data)
    jsonl(run / "b.jsonl", [rec(9)])
    scan = scan_run(run)
    assert said in scan.report.summary(), scan.report.summary()
    assert sorted(values(scan)) == sorted([*(kept or []), 9.0])


@pytest.mark.parametrize(
    "column", [pa.array([{"a": 1.0}] * 2), pa.array([[1.0], [2.0]])], ids=["struct", "list"]
)
def test_a_parquet_value_of_a_nested_type_is_named_and_the_rest_read(tmp_path, column):
    run = good_run(tmp_path / "run")
    table = pa.table(
        {
            "key": ["k", "k"],
            "value": column,
            "reduction": ["mean"] * 2,
            "step": [0, 1],
            "timestamp": [1.7e9, 1.7e9],
            "rank": [0, 0],
        }
    )
    pq.write_table(table, run / "nested.parquet")
    result = invoke("reduce", run)
    assert result.exit_code == 0, result.output
    kind = "Struct({'a': Float64})" if pa.types.is_struct(column.type) else "List(Float64)"
    assert (
        f"nested.parquet: unreadable, skipped (column 'value' is {kind}: a record field must be a number "
        "or a string)" in result.stderr
    )


def test_a_directory_that_cannot_be_listed_is_said(tmp_path):
    if os.geteuid() == 0 and not shutil.which("setpriv"):
        pytest.skip("root reads every directory, and setpriv is missing to drop that")
    run = good_run(tmp_path / "run")
    locked = run / "locked"
    locked.mkdir()
    jsonl(locked / "x.jsonl", [rec(9)])
    locked.chmod(0)
    os.chmod(tmp_path, 0o755)
    code = (
        "from metric_core import scan_run; s = scan_run(%r); print(s.report.summary()); "
        "print(s.frame.collect().height)" % str(run)
    )
    cmd = [sys.executable, "-c", code]
    if os.geteuid() == 0:  # root ignores permissions: run without the capabilities for that
        cmd = [
            "setpriv",
            "--inh-caps=-dac_override,-dac_read_search",
            "--bounding-set=-dac_override,-dac_read_search",
            *cmd,
        ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    finally:
        locked.chmod(0o755)
    assert done.returncode == 0, done.stderr
    assert "  locked: directory not read (Permission denied)" in done.stdout
    assert done.stdout.strip().endswith("\n5")


def test_a_journal_damaged_in_the_middle_is_read_up_to_the_damage_and_said(tmp_path):

    def write() -> None:
        c = MetricCollector(tmp_path, process_name="w", flush_interval=60)
        for step in range(4):
            for i in range(10):
                c.record("k", float(step * 10 + i))
            c.flush(step)

    killed_after(write)
    (path,) = tmp_path.glob("*.journal")
    data = bytearray(path.read_bytes())
    # The third record frame: the header, one key frame and two steps, each a record frame
    # of 10 records (9 bytes of type, length and CRC, the step, 10 x 24 bytes) and a flush
    # frame (9 bytes, the step and its time) come before it.
    hlen = int.from_bytes(data[4:8], "little")
    klen = int.from_bytes(data[12 + hlen + 1 : 12 + hlen + 5], "little")
    frame = 12 + hlen + (9 + klen) + 2 * (9 + 8 + 240 + 9 + 16)
    data[frame + 9 + 8 + 5] ^= 0xFF  # a flipped bit in the first value of step 2
    path.write_bytes(bytes(data))
    scan = scan_run(tmp_path)
    assert values(scan) == [float(i) for i in range(20)]
    assert (
        f"fails its checksum (the file is damaged); its {len(data) - frame} byte(s) to the end are not read"
        in (scan.report.summary())
    )


def test_a_previous_format_journal_is_read_and_a_newer_one_refused(tmp_path):
    import struct

    head = json.dumps({"process": "old", "rank": 2, "created": 1.7e9}).encode()
    keys = json.dumps([[0, "k", "sum"]]).encode()
    rows = struct.pack("<q", 7) + struct.pack("<3d", 1.5, 0, 1.7e9) + struct.pack("<3d", 2.5, 0, 1.7e9 + 1)
    v1 = b"MLJ1" + struct.pack("<I", len(head)) + head
    v1 += b"K" + struct.pack("<I", len(keys)) + keys + b"R" + struct.pack("<I", len(rows)) + rows
    (tmp_path / "old.00000.journal").write_bytes(v1)
    scan = scan_run(tmp_path)
    got = scan.frame.collect().select("process", "rank", "step", "key", "value", "reduction").rows()
    assert got == [("old", 2, 7, "k", 1.5, "sum"), ("old", 2, 7, "k", 2.5, "sum")]
    (tmp_path / "new.00000.journal").write_bytes(b"MLJ9" + v1[4:])
    summary = scan_run(tmp_path).report.summary()
    assert (
        "new.00000.journal: unreadable, skipped (journal format 'MLJ9' is newer than this "
        "metriclog reads: upgrade metriclog)" in summary
    )


# -- symlinks and files reached twice --------------------------------------------------------


def test_a_symlink_out_of_the_run_directory_is_not_read_unless_asked(tmp_path):
    run = good_run(tmp_path / "run")
    secret = jsonl(tmp_path / "elsewhere.jsonl", [rec(100)])
    (run / "link.jsonl").symlink_to(secret)
    result = invoke("reduce", run, "--mode", "per_rank_no_reduce", "--out", tmp_path / "a.csv")
    assert result.exit_code == 0, result.output
    assert (
        f"link.jsonl: symlink to {secret}, outside the run directory: not read (--follow-symlinks reads it)"
        in result.stderr
    )
    assert pl.read_csv(tmp_path / "a.csv")["value"].to_list() == [0.0, 1.0, 2.0, 3.0, 4.0]
    followed = invoke(
        "reduce", run, "--mode", "per_rank_no_reduce", "--follow-symlinks", "--out", tmp_path / "b.csv"
    )
    assert followed.exit_code == 0, followed.output
    assert sorted(pl.read_csv(tmp_path / "b.csv")["value"].to_list()) == [0.0, 1.0, 2.0, 3.0, 4.0, 100.0]


def test_a_file_reached_twice_is_read_once_and_a_loop_ends(tmp_path):
    run = good_run(tmp_path / "run")
    (run / "again.jsonl").symlink_to(run / "good.jsonl")
    os.link(run / "good.jsonl", run / "hard.jsonl")
    (run / "sub").mkdir()
    (run / "sub" / "loop").symlink_to(run, target_is_directory=True)
    scan = scan_run(run, follow_symlinks=True)
    assert values(scan) == [0.0, 1.0, 2.0, 3.0, 4.0]
    summary = scan.report.summary()
    assert "good.jsonl is the same file as again.jsonl: read once" in summary
    assert "hard.jsonl is the same file as again.jsonl: read once" in summary
    assert "sub/loop is . again: read once" in summary
    plain = scan_run(run).report.summary()
    assert "sub/loop: symlink to a directory inside the run directory, not followed" in plain


def _run_with_samples(run: Path) -> list[float]:
    """A source's records and samples, written by the writer; the records' values."""
    import metric_core
    from metric_core import Reduce, record_metric

    metric_core.init(run, process_name="gen", catch_signals=False)
    for step in range(3):
        record_metric("loss", float(step))
        record_metric("rollout", {"prompt": str(step), "reward": float(step)}, Reduce.SAMPLE)
        metric_core.flush(step)
    metric_core.shutdown()
    return [0.0, 1.0, 2.0]


@pytest.mark.parametrize(
    "links",
    [
        {"a.jsonl": "b.jsonl", "b.jsonl": "a.jsonl"},  # a loop of two
        {"x.parquet": "x.parquet"},  # a link to itself
        {"y.r0.00000.journal": "y.r0.00000.journal"},
        {"gone.jsonl": "nowhere.jsonl"},  # a link to nothing
        {"run.json": "run.json"},
        {"samples/z.r0.00000.samples.jsonl": "z.r0.00000.samples.jsonl"},
    ],
    ids=["two", "self", "journal", "dangling", "run.json", "samples"],
)
def test_a_symlink_that_reaches_no_file_is_named_and_the_rest_read(tmp_path, links):
    run = tmp_path / "run"
    want = _run_with_samples(run)
    if "run.json" in links:
        (run / "run.json").unlink()
    for name, target in links.items():
        (run / name).symlink_to(target)
    for command in (
        ["reduce", run, "--mode", "per_rank_no_reduce", "--out", tmp_path / "o.csv"],
        ["keys", run],
        ["inspect", run],
        ["samples", run, "--out", tmp_path / "s.csv"],
    ):
        result = invoke(*command)
        assert result.exit_code == 0, result.output
        assert "Traceback" not in result.output
        for name, target in links.items():
            # samples reads journals and samples files; the others journals, records and run.json
            samples = name.endswith(".samples.jsonl")
            if name.endswith(".journal") or samples == (command[0] == "samples"):
                said = "which does not exist" if target == "nowhere.jsonl" else "a loop of symlinks"
                assert f"{name}: symlink to {target}, {said}" in result.stderr, (command, result.stderr)
    assert pl.read_csv(tmp_path / "o.csv")["value"].to_list() == want
    assert pl.read_csv(tmp_path / "s.csv")["prompt"].to_list() == [0, 1, 2]


@pytest.mark.parametrize(
    ("target", "said"),
    [("run", "a loop of symlinks that never reaches a directory"), ("gone", "which does not exist")],
)
def test_a_run_directory_that_is_a_symlink_to_no_directory_is_said_so(tmp_path, target, said):
    (tmp_path / "run").symlink_to(target)
    for command in ("reduce", "keys", "inspect", "samples"):
        result = invoke(command, tmp_path / "run")
        assert result.exit_code == 1, result.output
        assert result.stderr == (
            f"Error: no readable metric record in {tmp_path / 'run'}: it is a symlink to {target}, {said}\n"
        )


def test_upload_never_writes_through_planted_symlinks(tmp_path):
    run = good_run(tmp_path / "run")
    victims = []
    (run / ".metriclog").mkdir()
    for name in (".write-test", ".uploads.json.tmp"):
        victim = tmp_path / f"victim{len(victims)}"
        victim.write_text("precious")
        (run / ".metriclog" / name).symlink_to(victim)
        victims.append(victim)
    result = invoke("upload", run, "--project", "p", "--offline")
    assert result.exit_code == 0, result.output
    assert [v.read_text() for v in victims] == ["precious"] * 2
    assert json.loads((run / ".metriclog" / "uploads.json").read_text())["runs"]


def test_upload_refuses_a_planted_metriclog_directory_link(tmp_path):
    run = good_run(tmp_path / "run")
    outside = tmp_path / "outside"
    outside.mkdir()
    (run / ".metriclog").symlink_to(outside, target_is_directory=True)
    result = invoke("upload", run, "--project", "p", "--offline")
    assert result.exit_code == 1
    assert result.stderr.strip().endswith(
        f"Error: {run}/.metriclog is a symlink (to {outside}): metriclog does not write through links it "
        "did not make; remove it and upload again"
    )
    assert list(outside.iterdir()) == []


def test_a_malformed_metadata_field_never_makes_a_superseded_journal_count_twice(tmp_path):
    """One bad field (keys) in a sealed segment's metadata, and the journal it replaced left
    beside it by a kill between rename and unlink: every record is read once, it is said."""
    import pyarrow.parquet as pq

    c = MetricCollector(tmp_path, process_name="w", flush_interval=3600)
    for step in range(3):
        c.record("loss", float(step))
        c.flush(step)
    (journal,) = tmp_path.glob("*.journal")
    saved = journal.read_bytes()
    c.shutdown()
    (sealed,) = tmp_path.glob("*.parquet")
    table = pq.read_table(sealed)
    meta = json.loads(pq.read_metadata(sealed).metadata[b"metriclog"])
    del meta["checksum"]
    meta["keys"] = [["loss", 1]]  # not a reduction name, from a writer that signs it anyway
    signed = {**meta, "checksum": zlib.crc32(json.dumps(meta).encode())}
    pq.write_table(table.replace_schema_metadata({"metriclog": json.dumps(signed)}), sealed, **SEALED)
    journal.write_bytes(saved)
    scan = scan_run(tmp_path)
    assert sorted(scan.frame.collect()["value"].to_list()) == [0.0, 1.0, 2.0]
    assert scan.report.clean_shutdowns() == {("w", 0)}
    assert "malformed field(s) keys: ignored" in scan.report.summary()
    # The same field changed after sealing: the metadata fails its checksum and is ignored,
    # but the journal it names is still not read twice.
    unsigned = {**meta, "checksum": signed["checksum"] ^ 1}
    pq.write_table(table.replace_schema_metadata({"metriclog": json.dumps(unsigned)}), sealed, **SEALED)
    scan = scan_run(tmp_path)
    assert sorted(scan.frame.collect()["value"].to_list()) == [0.0, 1.0, 2.0]
    assert "its metriclog metadata fails its checksum (the file is damaged): ignored" in scan.report.summary()


# How the writer cuts a small segment, so its metadata's row groups still describe the file.
SEALED = {"write_page_checksum": True}


def test_another_tools_parquet_whose_every_record_is_bad_says_so_in_every_command(tmp_path):
    """Another tool's files are checked as they are read: when that check skips every
    record, each command says so (no traceback, no talk of filters); a source whose every
    record was skipped is not a source of the report when others remain."""
    bad = {"key": ["a", "a"], "value": [None, 1.0], "reduction": ["mean"] * 2, "step": [0, 1]}
    bad |= {"timestamp": [1.76e9, -5.0], "rank": [0, 0]}
    (tmp_path / "bad").mkdir()
    pq.write_table(pa.table(bad), tmp_path / "bad" / "other.parquet")
    for args in (
        ["reduce"],
        ["reduce", "--mode", "per_rank_reduce"],
        ["reduce", "--mode", "per_rank_no_reduce"],
        ["reduce", "--by", "time", "--every", "1s"],
        ["inspect"],
        ["upload", "--project", "p", "--dry-run"],
    ):
        result = invoke(*args, tmp_path / "bad")
        assert result.exit_code != 0 and isinstance(result.exception, SystemExit), args
        assert "every record was skipped" in result.output, args
        assert "Traceback" not in result.output and "filters" not in result.output, args
    good = {**bad, "value": [2.0, 3.0], "timestamp": [1.76e9, 1.76e9 + 1], "rank": [1, 1]}
    pq.write_table(pa.table(good), tmp_path / "bad" / "good.parquet")
    result = invoke("inspect", tmp_path / "bad", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [(s["rank"], s["records"]) for s in report["sources"]] == [(1, 2)]
    assert report["skipped_records"] == 2


def test_a_fifo_in_the_run_directory_is_skipped_not_opened(tmp_path):
    """Opening a FIFO blocks until someone writes to it: every command would hang."""
    import subprocess
    import sys

    from .conftest import write_collector_run

    run = tmp_path / "run"
    write_collector_run(run, [("TrainActor_r0", 0)], steps=5)
    for name in ("pipe.jsonl", "pipe.parquet", "x.r0.00000.journal", "run.json"):
        os.mkfifo(run / name)
    metriclog = str(Path(sys.executable).with_name("metriclog"))
    for command in (["reduce", str(run)], ["inspect", str(run)]):
        done = subprocess.run([metriclog, *command], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        for name in ("pipe.jsonl", "pipe.parquet", "x.r0.00000.journal"):
            assert f"{name}: not a regular file (a FIFO, socket or device): not read" in done.stderr
        assert "run.json: not a regular file" in done.stderr


def _deep_jsonl_line(run: Path) -> str:
    (run / "a.jsonl").write_text(json.dumps(GOOD_RECORD) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    return "a.jsonl: 1 record(s) skipped: line 2: JSON nested too deep to be a record"


def _deep_first_line_beside_a_good_file(run: Path) -> str:
    """With two files, the engine orders them by the source of another tool's JSONL file's
    first line: parsed there too, it is no record either."""
    pq.write_table(pa.Table.from_pylist([GOOD_RECORD]), run / "a.parquet")
    (run / "b.jsonl").write_text('{"key": ' * 100_000 + "1" + "}" * 100_000 + "\n")
    return "b.jsonl: 1 record(s) skipped: line 1: JSON nested too deep to be a record"


def _deep_run_json(run: Path) -> str:
    (run / "a.jsonl").write_text(json.dumps(GOOD_RECORD) + "\n")
    (run / "run.json").write_text("[" * 100_000 + "]" * 100_000)
    return "run.json: not valid JSON (JSON nested too deep to decode)"


def _timestamp_out_of_range(run: Path) -> str:
    import pyarrow as pa

    times = pa.array([1_700_000_000_000, 2**62], pa.timestamp("ms"))  # the second: 146 million years on
    table = pa.table({"key": ["k", "k"], "value": [1.0, 2.0], "reduction": ["mean"] * 2, "step": [0, 1]})
    pq.write_table(
        table.append_column("rank", pa.array([0, 0])).append_column("timestamp", times), run / "a.parquet"
    )
    return "a.parquet: 1 record(s) skipped: row 1: 'timestamp' is not Unix epoch seconds from 1970 to 2286"


def _binary_key_not_utf8(run: Path) -> str:
    import pyarrow as pa

    keys = pa.array([b"k", b"\xff\xfek"], pa.binary())  # the second is no text
    table = pa.table({"key": keys, "value": [1.0, 2.0], "reduction": ["mean"] * 2, "step": [0, 1]})
    pq.write_table(
        table.append_column("rank", pa.array([0, 0])).append_column("timestamp", pa.array([1.7e9] * 2)),
        run / "a.parquet",
    )
    return "a.parquet: 1 record(s) skipped: row 1: 'key' is null or not valid"


def _integer_key_string_value(run: Path) -> str:
    """Columns another tool typed otherwise: keys that are numbers, values that are text."""
    import pyarrow as pa

    table = pa.table(
        {"key": pa.array([1, 2]), "value": ["1.0", "two"], "reduction": ["mean"] * 2, "step": [0, 1]}
    )
    pq.write_table(
        table.append_column("rank", pa.array([0, 0])).append_column("timestamp", pa.array([1.7e9] * 2)),
        run / "a.parquet",
    )
    return (
        "a.parquet: 1 record(s) skipped: "
        "row 1: 'value' is null, not numeric, or an integer float64 cannot hold exactly"
    )


def _line_over_the_limit(run: Path) -> str:
    big = {
        **GOOD_RECORD,
        "key": "k" * (2 << 20),
    }  # a 2 MiB key: parsing such lines takes many times their size
    (run / "a.jsonl").write_text(json.dumps(GOOD_RECORD) + "\n" + json.dumps(big) + "\n")
    size = len(json.dumps(big))
    return f"a.jsonl: 1 record(s) skipped: line 2: a line of {size:,} bytes, over the 1,048,576 a record's"


GOOD_RECORD = {"key": "k", "value": 1.0, "reduction": "mean", "step": 0, "timestamp": 1.7e9, "rank": 0}


@pytest.mark.parametrize(
    "hostile",
    [
        _deep_jsonl_line,
        _deep_first_line_beside_a_good_file,
        _deep_run_json,
        _timestamp_out_of_range,
        _binary_key_not_utf8,
        _integer_key_string_value,
    ],
)
def test_hostile_input_is_skipped_and_said_never_a_traceback(tmp_path, hostile):
    run = tmp_path / "run"
    run.mkdir()
    said = hostile(run)
    for command in (
        ["reduce", str(run), "--mode", "per_rank_no_reduce", "--out", str(tmp_path / "o.csv")],
        ["reduce", str(run)],
        ["reduce", str(run), "--mode", "per_rank_reduce"],
        ["inspect", str(run)],
    ):
        result = runner.invoke(app, command)
        assert result.exit_code == 0, result.output
        assert said in result.output and "Traceback" not in result.output
    kept = pl.read_csv(tmp_path / "o.csv")
    assert kept["value"].to_list() == [1.0] and kept["timestamp"].to_list() == [
        1.7e9
    ]  # the good record, exact


def test_an_integer_value_float64_cannot_hold_is_refused_not_rounded(tmp_path):
    """Exact or refused: 2**53 + 1 and 2**63 - 1 would become other numbers as float64."""
    import pyarrow as pa

    run = tmp_path / "run"
    run.mkdir()
    big = [5, 2**53 + 1, 2**63 - 1, 2**53]
    table = pa.table({"key": ["k"] * 4, "value": pa.array(big, pa.int64()), "reduction": ["sum"] * 4})
    table = table.append_column("step", pa.array([0] * 4)).append_column("rank", pa.array([0] * 4))
    pq.write_table(table.append_column("timestamp", pa.array([1.7e9] * 4)), run / "a.parquet")
    lines = ["7", str(2**53 + 1), str(2**63 - 1), "1.5", "123456789012345678901234", str(2**53), str(2**64)]
    with open(run / "b.jsonl", "w") as f:
        for v in lines:
            f.write(f'{{"key":"j","value":{v},"reduction":"sum","step":0,"timestamp":1.7e9,"rank":1}}\n')
    for command in (
        ["reduce", str(run), "--mode", "per_rank_no_reduce", "--out", str(tmp_path / "o.csv")],
        ["inspect", str(run)],
    ):
        result = runner.invoke(app, command)
        assert result.exit_code == 0, result.output
        assert (
            "a.parquet: 2 record(s) skipped: row 1: 'value' is null, not numeric, or an integer float64 "
            "cannot hold exactly; row 2: 'value' is null" in result.output
        )
        assert (
            "b.jsonl: 3 record(s) skipped: line 2: 'value' is an integer float64 cannot hold exactly"
            in result.output
        )
    kept = pl.read_csv(tmp_path / "o.csv").sort("process", "value")
    # each exactly as written (2**64 too: beyond int64, but a float64 holds it)
    assert kept["value"].to_list() == [5.0, float(2**53), 1.5, 7.0, float(2**53), float(2**64)]


def test_a_format_3_journal_records_no_end_and_is_said_as_such(tmp_path):
    """A journal of an older writer (format 3: attempts, no heartbeat, no end events): read,
    and its attempt's end is not known (null), not guessed."""
    import struct
    import zlib

    from metric_core import inspect_run
    from metric_core.format import journal

    head = json.dumps(
        {"format": 3, "process": "old", "rank": 0, "created": 1.7e9, "attempt": "a" * 16}
    ).encode()
    rows = struct.pack("<3d", 1.5, 0, 1.7e9) + struct.pack("<3d", 2.5, 0, 1.7e9 + 1)
    data = b"MLJ3" + struct.pack("<II", len(head), zlib.crc32(head)) + head
    data += journal.key_frame([(0, "k", "sum")]) + journal.record_frame(7, rows)
    (tmp_path / "old.r0.00000.journal").write_bytes(data)
    report = inspect_run(tmp_path)
    (attempt,) = report.sources[0].attempts
    assert attempt.records == 2 and attempt.end is None and report.first_failure is None


def test_a_file_that_fails_as_it_is_read_is_skipped_and_named_the_rest_read(tmp_path):
    """Another tool's Parquet whose pages are damaged (its footer intact): the scan takes it,
    the read fails; the file is skipped and named, never 'run again' (it did not change)."""
    import pyarrow as pa

    run = tmp_path / "run"
    run.mkdir()
    n = 1000
    table = pa.table({"key": ["loss"] * n, "value": [float(i) for i in range(n)], "reduction": ["mean"] * n})
    table = table.append_column("step", pa.array(range(n))).append_column("timestamp", pa.array([1.7e9] * n))
    pq.write_table(table.append_column("rank", pa.array([0] * n)), run / "good.parquet")
    pq.write_table(table.append_column("rank", pa.array([1] * n)), run / "bad.parquet")
    data = bytearray((run / "bad.parquet").read_bytes())
    data[4:60] = b"\xff" * 56  # the first page's header
    (run / "bad.parquet").write_bytes(bytes(data))
    out = tmp_path / "o.csv"
    for command in (["reduce", run, "--mode", "per_rank_no_reduce", "--out", out], ["inspect", run]):
        result = invoke(*command)
        assert result.exit_code == 0, result.output
        assert "bad.parquet: 1000 record(s) skipped: 1000 x row group 0 cannot be read (" in result.stderr
        assert "Run again" not in result.output and "run again" not in result.output
    assert pl.read_csv(out)["value"].to_list() == [float(i) for i in range(n)]  # good.parquet, whole
    strict = invoke("reduce", run, "--strict", "--out", tmp_path / "s.csv")
    assert strict.exit_code == 1 and "bad.parquet" in strict.stderr


def test_wide_refuses_more_keys_than_its_limit_naming_it(tmp_path):
    c = MetricCollector(tmp_path / "run", process_name="w")
    for i in range(10_001):
        c.record(f"k{i}", 1.0)
    c.shutdown()
    result = invoke("reduce", tmp_path / "run", "--wide", "--out", tmp_path / "w.csv")
    assert result.exit_code == 1 and not (tmp_path / "w.csv").exists()
    assert result.stderr == (
        "Error: --wide makes a column of each key, and the result has more than 10,000 keys: choose "
        "some with --key PATTERN, or leave it out (a row a key)\n"
    )
    assert (
        invoke("reduce", tmp_path / "run", "--wide", "--key", "k1*", "--out", tmp_path / "w.csv").exit_code
        == 0
    )


@pytest.mark.parametrize("size", [0, 11, "half"])
def test_a_parquet_file_cut_short_is_said_so_not_in_polars_words(tmp_path, size):
    """A new user's trial: "ComputeError: parquet: File out of specification: The file must
    end with PAR1 or PARE" for a file cut short or empty; the rest of the run is read."""
    run = tmp_path / "run"
    run.mkdir()
    pl.DataFrame([rec(i) for i in range(50)]).write_parquet(tmp_path / "whole.parquet")
    data = (tmp_path / "whole.parquet").read_bytes()
    (run / "cut.parquet").write_bytes(data[: len(data) // 2 if size == "half" else size])
    jsonl(run / "b.jsonl", [rec(9)])
    scan = scan_run(run)
    said = scan.report.summary()
    assert "cut.parquet: unreadable, skipped (not a whole Parquet file: it lacks the footer" in said, said
    assert "ComputeError" not in said and values(scan) == [9.0]
