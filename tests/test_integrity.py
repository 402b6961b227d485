"""Nothing wrong comes back: single bits flipped anywhere in the writer's own files.

Each trial flips one random bit of a file the writer wrote (sealed Parquet, sealed JSONL,
an open journal) and reads the run. The ground truth is the records as the test made them,
not as any reader returned them. Over every trial:

* every record returned was written (a multiset inclusion);
* the records missing are exactly those of the units the warning names (a Parquet row
  group, the JSONL lines of a block, the rest of a journal), or of the whole file when it
  is named unreadable;
* what was written minus what was returned equals what the report says was skipped
  (a journal's rest cannot be counted: there, what is missing is a tail, and said).
"""

from __future__ import annotations

import collections
import json
import random
import re
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
from metriclog.main import app
from typer.testing import CliRunner

from metric_core import scan_run
from metric_core.errors import NoDataError
from metric_core.offline.engine import make_plan, run_plan
from metric_core.writer.segments import RawFileWriter
from tests.conftest import flip_a_page, write_collector_run

KEYS = [("loss", "mean"), ("grad/norm", "max"), ("tokens", "sum")]
STEPS, PER_STEP, BLOCK = 10, 50, 100  # 500 records in units of 100
SOURCE = ("TrainActor_r0", 0)
TRIALS = {"parquet": 400, "jsonl": 300, "journal": 200}


def written_run(root: Path, file_format: str, block: int = BLOCK) -> tuple[Path, list[tuple]]:
    """A run of one source in ``file_format`` (a journal: left open, as after a kill), and
    its records in the order written: (key, value, step, timestamp, rank, process)."""
    rng = np.random.default_rng(7)
    fmt = "parquet" if file_format == "journal" else file_format
    writer = RawFileWriter(root, process=SOURCE[0], rank=SOURCE[1], file_format=fmt, block_records=block)
    truth = []
    for step in range(STEPS):
        values = rng.normal(size=PER_STEP)
        codes = rng.integers(0, len(KEYS), PER_STEP)
        times = 1.76e9 + step + np.sort(rng.uniform(0, 1, PER_STEP))
        rows = np.stack([values, codes.astype(np.float64), times], axis=1)
        writer.append(step, rows.tobytes(), PER_STEP, KEYS)
        truth += [
            (KEYS[c][0], v, step, t, *SOURCE[::-1]) for v, c, t in zip(values, codes, times, strict=True)
        ]
    if file_format == "journal":
        writer.release()  # the journal stays, unsealed, as a killed writer leaves it
    else:
        writer.close(clean_shutdown=True)
    return root, [(k, v, s, t, r, p) for k, v, s, t, r, p in truth]


def read_back(run: Path) -> tuple[collections.Counter, dict[str, int], int, bool]:
    """The records read (as a multiset), the report's skip reasons, records skipped, and
    whether the file was named unreadable."""
    try:
        result = run_plan(run, make_plan(mode="per_rank_no_reduce"))
        frame = result.frame
    except NoDataError as exc:
        unreadable = "unreadable" in str(exc) and "0 unreadable" not in str(exc)
        return collections.Counter(), {"all": 0}, 0, unreadable or "every record" in str(exc)
    report = result.scan.report
    rows = frame.select("key", "value", "step", "timestamp", "rank", "process").rows()
    rows = [(k, v, s, t, r, p) for k, v, s, t, r, p in rows]
    reasons = {r: n for f in report.files for r, n in f.skip_reasons.items()}
    return collections.Counter(rows), reasons, report.skipped_records, bool(report.unreadable_files)


def named_lost(file_format: str, reasons: dict[str, int], pristine: bytes, truth: list[tuple]) -> list[tuple]:
    """The written records inside the units the reasons name."""
    out: list[tuple] = []
    if file_format == "parquet":
        for reason in reasons:
            for g in re.findall(r"row group (\d+) is damaged", reason):
                out += truth[int(g) * BLOCK : (int(g) + 1) * BLOCK]
    else:  # the lines of the pristine file; records are its lines that begin '{"key":'
        records = [i + 1 for i, line in enumerate(pristine.split(b"\n")) if line.startswith(b'{"key":')]
        where = {line: truth[i] for i, line in enumerate(records)}
        for reason in reasons:
            if "block's checksum" in reason:
                for lo, hi in re.findall(r"(\d+)(?:-(\d+))?", reason.split(" fail")[0]):
                    out += [where[n] for n in range(int(lo), int(hi or lo) + 1) if n in where]
    return out


@pytest.mark.parametrize("file_format", ["parquet", "jsonl", "journal"])
def test_a_flipped_bit_never_returns_a_record_that_was_not_written(tmp_path, file_format):
    run, truth = written_run(tmp_path / "run", file_format)
    (path,) = [p for p in run.iterdir() if p.suffix in (".parquet", ".jsonl", ".journal")]
    pristine = path.read_bytes()
    written = collections.Counter(truth)
    got, reasons, _, _ = read_back(run)
    assert got == written and not reasons  # the file as written reads whole
    rng = random.Random(f"flip-{file_format}")
    outcomes = collections.Counter()
    for _ in range(TRIALS[file_format]):
        at, bit = rng.randrange(len(pristine)), rng.randrange(8)
        damaged = bytearray(pristine)
        damaged[at] ^= 1 << bit
        path.write_bytes(bytes(damaged))
        where = f"bit {bit} of byte {at} of {len(pristine)}"
        try:
            got, reasons, skipped, unreadable = read_back(run)
        except Exception as exc:
            raise AssertionError(f"{where}: {type(exc).__name__}: {exc}") from exc
        assert not got - written, (
            f"{where}: records that were never written came back: {list(got - written)[:3]}"
        )
        lost = written - got
        if not lost:
            outcomes["nothing lost"] += 1
            continue
        if file_format == "journal":  # the rest of the journal from the damage on, said
            kept = sorted(got.elements(), key=truth.index)
            assert kept == truth[: len(kept)], f"{where}: a journal loses its tail, never a middle"
            assert reasons or unreadable, f"{where}: records lost without a word"
            outcomes["tail said"] += 1
            continue
        if unreadable:
            assert got == collections.Counter(), f"{where}: a file named unreadable gave records"
            outcomes["file named"] += 1
            continue
        assert sum(lost.values()) == skipped, f"{where}: lost {sum(lost.values())}, said {skipped}: {reasons}"
        assert lost == collections.Counter(named_lost(file_format, reasons, pristine, truth)), (
            f"{where}: the records lost are not those of the units named: {reasons}"
        )
        outcomes["unit named"] += 1
    path.write_bytes(pristine)
    # the trials reached damage that is found, not only bytes no reader looks at
    assert (
        outcomes["unit named"] + outcomes["file named"] + outcomes["tail said"] > TRIALS[file_format] // 3
    ), outcomes


runner = CliRunner()


@pytest.mark.parametrize("file_format", ["parquet", "jsonl"])
def test_a_damaged_unit_is_named_exit_0_and_1_with_strict(tmp_path, file_format):
    run, truth = written_run(tmp_path / "run", file_format)
    (path,) = [p for p in run.iterdir() if p.suffix == f".{file_format}"]
    data = bytearray(path.read_bytes())
    if file_format == "jsonl":
        at = data.index(b'"rank":0', len(data) // 2)  # a field renamed: rank -> rajk
        data[at + 3] = ord("j")
    else:  # a bit of a value in the middle of the run (in a data page of the value column)
        at = bytes(data).index(np.float64(truth[len(truth) // 2][1]).tobytes())
        data[at] ^= 0x10
    path.write_bytes(bytes(data))
    out = tmp_path / "raw.parquet"
    result = runner.invoke(app, ["reduce", str(run), "--mode", "per_rank_no_reduce", "--out", str(out)])
    assert result.exit_code == 0, result.output
    unit = "row group" if file_format == "parquet" else "block's checksum"
    assert path.name in result.stderr and unit in result.stderr and "damaged" in result.stderr
    kept = pl.read_parquet(out).height
    said = int(re.search(r"skipped (\d+) record", result.stderr).group(1))
    assert 0 < said < len(truth) and kept + said == len(truth)
    strict = runner.invoke(app, ["reduce", str(run), "--strict", "--out", str(tmp_path / "s.parquet")])
    assert strict.exit_code == 1 and "damaged" in strict.stderr
    # every way in reads the same records: a whole scan (plot's), inspect's, a library read
    scan = scan_run(run)
    assert scan.frame.select(pl.len()).collect().item() == kept and scan.report.skipped_records == said
    seen = runner.invoke(app, ["inspect", str(run), "--json"])
    assert seen.exit_code == 0 and json.loads(seen.stdout)["sources"][0]["records"] == kept


def test_a_jsonl_segment_cut_short_or_missing_a_block_says_what_its_writer_wrote(tmp_path):
    run, truth = written_run(tmp_path / "run", "jsonl")
    (path,) = run.glob("*.jsonl")
    lines = path.read_bytes().split(b"\n")
    blocks = [i for i, line in enumerate(lines) if line.startswith(b'{"event": "block"')]
    middle = lines[: blocks[0] + 1] + lines[blocks[1] + 1 :]  # the second block and its line, gone
    for name, data in (("cut", b"\n".join(lines[: blocks[1] + 1]) + b"\n"), ("middle", b"\n".join(middle))):
        path.write_bytes(data)
        result = run_plan(run, make_plan(mode="per_rank_no_reduce"))
        assert result.frame.height == len(truth) - BLOCK * (3 if name == "cut" else 1), name
        assert result.scan.report.skipped_records == len(truth) - result.frame.height, name
        assert "though its writer wrote them" in result.scan.report.summary(), name


@pytest.mark.parametrize("metadata", ["checked", "damaged"])
@pytest.mark.parametrize("block", [BLOCK, 1000], ids=["blocks-of-100", "one-block"])
def test_a_jsonl_segment_cut_short_returns_only_the_blocks_that_check(tmp_path, block, metadata):
    """A sealed segment cut anywhere after its first line, a bit flipped in what is left
    after its last whole block line ("TrainActor_r0" read as "TrainActor_r1", a source that
    never wrote); with ``damaged`` metadata, a digit of its first line flipped too (it fails
    its checksum). Exactly the records of the blocks whose block line survives come back;
    with checked metadata, every other record the writer wrote is counted as skipped, and
    the warning names the file and says it is cut short."""
    run, truth = written_run(tmp_path / "run", "jsonl", block)
    (path,) = run.glob("*.jsonl")
    pristine = path.read_bytes()
    first = pristine.index(b"\n") + 1
    block_ends = [m.end() for m in re.finditer(rb'\{"event": "block", [^\n]*\n', pristine)]
    rng = random.Random(f"cut-{block}-{metadata}")
    for _ in range(40):
        cut = rng.randrange(first, len(pristine))
        data = bytearray(pristine[:cut])
        verified = sum(end <= cut for end in block_ends)
        tail = data.find(b'"process":"TrainActor_r0"', max([first, *(e for e in block_ends if e <= cut)]))
        if tail != -1:
            data[tail + len(b'"process":"TrainActor_r')] ^= 1  # '0' -> '1'
        if metadata == "damaged":
            at = data.index(b'"timestamp": ') + len(b'"timestamp": ') + 3
            data[at] ^= 1  # a digit, still a digit: the line is JSON, its checksum fails
        path.write_bytes(bytes(data))
        want = truth[: min(verified * block, len(truth))]
        where = f"cut at byte {cut} of {len(pristine)}"
        if not want:  # nothing verified: nothing comes back, and the file is named
            with pytest.raises(NoDataError, match=re.escape(path.name)):
                run_plan(run, make_plan(mode="per_rank_no_reduce"))
            continue
        result = run_plan(run, make_plan(mode="per_rank_no_reduce"))
        rows = result.frame.select("key", "value", "step", "timestamp", "rank", "process").rows()
        assert collections.Counter(rows) == collections.Counter(want), (
            f"{where}: {len(rows)} records back, {len(want)} verified; never written: "
            f"{list(collections.Counter(rows) - collections.Counter(truth))[:2]}"
        )
        summary = result.scan.report.summary()
        if metadata == "checked" and len(want) < len(truth):
            assert result.scan.report.skipped_records == len(truth) - len(want), f"{where}: {summary}"
            assert path.name in summary and "the file is cut short" in summary, f"{where}: {summary}"
        if metadata == "damaged":
            assert f"{path.name}: its metriclog metadata fails its checksum" in summary, f"{where}: {summary}"
    path.write_bytes(pristine)


def test_two_sealed_jsonl_segments_joined_read_whole(tmp_path):
    """`cat a.jsonl b.jsonl > all.jsonl`: the second segment's metadata line starts its
    blocks again; nothing is damaged, nothing skipped."""
    a, truth_a = written_run(tmp_path / "a", "jsonl")
    (seg,) = a.glob("*.jsonl")
    joined = tmp_path / "joined"
    joined.mkdir()
    (joined / "all.jsonl").write_bytes(seg.read_bytes() * 2)
    result = run_plan(joined, make_plan(mode="per_rank_no_reduce"))
    assert result.frame.height == 2 * len(truth_a) and not result.scan.report.has_skips


def test_a_damaged_shutdown_line_still_ends_the_source_as_its_checked_metadata_says(tmp_path):
    run, _ = written_run(tmp_path / "run", "jsonl")
    (path,) = run.glob("*.jsonl")
    data = path.read_bytes()
    at = data.index(b'"event": "shutdown"') + 12
    path.write_bytes(data[:at] + b"X" + data[at + 1 :])
    report = run_plan(run, make_plan()).scan.report
    assert report.clean_shutdowns() == {SOURCE}
    assert "block's checksum (the file is damaged)" in report.summary()


@pytest.mark.parametrize("keys", [(), ("l*", "g*")], ids=["declared", "read"])
@pytest.mark.parametrize("mode", ["per_rank_no_reduce", "global_reduce"])
@pytest.mark.parametrize("writer", ["metriclog", "another tool"])
def test_by_time_windows_start_at_the_first_record_read_when_its_row_group_is_damaged(
    tmp_path, writer, mode, keys
):
    """A bit flipped in a page of the row group that holds the earliest records (soak seed
    606100269): the group is skipped, and the windows start at the first record read
    (docs/modes.md), not at the earliest time the file declares (the segment's metadata, or
    another tool's footer statistics) or a query over the run finds: a record no read
    returns. (A --key filter makes the engine find that time by reading the files.)"""
    run, truth = written_run(tmp_path / "run", "parquet")
    (path,) = run.glob("*.parquet")
    if writer == "another tool":  # the same records, with page checksums and footer statistics
        table = pq.read_table(path).drop_columns(["key_hash"]).replace_schema_metadata(None)
        path.unlink()
        pq.write_table(table, run / "other.parquet", row_group_size=BLOCK, write_page_checksum=True)
        path = run / "other.parquet"
    flip_a_page(path, group=0)
    every = 0.05
    kept = [k for k, _ in KEYS if not keys or k[0] in "lg"]
    times = np.array([t for k, _, _, t, _, _ in truth[BLOCK:] if k in kept])  # of row groups 1-4
    t0 = times.min()
    windows = t0 + np.floor((times - t0) / every) * every
    frame = run_plan(run, make_plan(mode=mode, by="time", every=every, keys=keys)).frame
    if mode == "per_rank_no_reduce":
        assert frame["timestamp"].to_list() == times.tolist()
        assert frame["window_start"].to_list() == windows.tolist()
    else:
        assert sorted(set(frame["window_start"].to_list())) == sorted(set(windows.tolist()))


@pytest.mark.parametrize("file_format", ["parquet", "jsonl"])
def test_a_flip_in_the_metadata_declaring_a_restart_is_said_when_the_restart_is_lost(tmp_path, file_format):
    """A restarted attempt's first segment declares, in its writer's metadata (a Parquet
    footer entry, a JSONL first line), the restart that replaces the records before it. A
    flip there that the reader cannot take (text that is no longer JSON, a JSONL line no
    longer the writer's, a checksum that fails) loses the declaration: the replaced records
    come back, as another tool's would, and the file is named as damaged. Soak seed
    238951129 found a flipped brace read as another tool's file, silently."""
    run = tmp_path / "run"
    first = write_collector_run(run, [("trainer", 0)], steps=3, file_format=file_format, shutdown=False)
    second = write_collector_run(run, [("trainer", 0)], steps=3, file_format=file_format, seed=9)
    replaced = sorted(r["value"] for r in second)
    both = sorted(r["value"] for r in first + second)
    *_, restarted = sorted(run.glob(f"*.{file_format}"))
    pristine = restarted.read_bytes()
    if file_format == "parquet":
        meta = pq.read_schema(restarted).metadata[b"metriclog"]
        lo = pristine.index(meta)
        hi = lo + len(meta)
    else:
        lo, hi = 0, pristine.index(b"\n")
    rng = random.Random(f"restart-{file_format}")
    outcomes = collections.Counter()
    for at in sorted(rng.sample(range(lo, hi), 120)):
        bit = rng.randrange(8)
        damaged = bytearray(pristine)
        damaged[at] ^= 1 << bit
        restarted.write_bytes(bytes(damaged))
        scan = scan_run(run)
        got = sorted(scan.frame.collect()["value"].to_list())
        said = scan.report.summary()
        where = f"bit {bit} of byte {at - lo} of the metadata {pristine[lo:hi][:60]!r}..."
        if got == replaced:
            outcomes["restart kept"] += 1
            continue
        assert restarted.name in said and ("damaged" in said or "unreadable" in said), (
            f"{where}: {len(got)} records read (the restart lost), and nothing said: {said!r}"
        )
        assert got in (both, sorted(r["value"] for r in first)), f"{where}: {len(got)} records"
        outcomes["said"] += 1
    restarted.write_bytes(pristine)
    assert outcomes["said"] > 20, outcomes  # the trials reached the declaration, not only its padding


@pytest.mark.parametrize("column", ["value", "key"])
@pytest.mark.parametrize("writer", ["metriclog, its metadata damaged", "another tool, page checksums"])
def test_a_damaged_page_is_skipped_alike_by_every_read_of_a_file_whose_pages_carry_checksums(
    tmp_path, writer, column
):
    """A page flipped in a file read as another tool's whose pages carry checksums: the
    writer's segment whose metadata is damaged too (soak seed 659228941: a flipped key
    page decoded as 'Dictionary Index is out-of-bounds' in polars), or another tool's file
    written with them. polars checks no page checksum, so every read of it through polars
    (plot's, upload's first times, --strict's check) verifies its pages first: each read
    returns the same records, none of them unwritten, and says the same skip."""
    run, truth = written_run(tmp_path / "run", "parquet")
    (path,) = run.glob("*.parquet")
    if writer.startswith("another tool"):
        table = pq.read_table(path).drop_columns(["key_hash"]).replace_schema_metadata(None)
        path.unlink()
        path = run / "other.parquet"
        pq.write_table(table, path, row_group_size=BLOCK, write_page_checksum=True)
    else:
        data = path.read_bytes()
        assert data.count(b'"records": 500') == 1
        path.write_bytes(data.replace(b'"records": 500', b'"records": 600'))  # fails its checksum
    flip_a_page(path, group=2, column=column)
    kept = collections.Counter(truth[: 2 * BLOCK] + truth[3 * BLOCK :])
    fields = ["key", "value", "step", "timestamp", "rank", "process"]
    engine = run_plan(run, make_plan(mode="per_rank_no_reduce"))
    assert collections.Counter(engine.frame.select(fields).rows()) == kept
    assert engine.scan.report.skipped_records == BLOCK
    scan = scan_run(run)
    assert collections.Counter(scan.frame.select(fields).collect().rows()) == kept
    assert scan.report.skipped_records == BLOCK and "row group 2 cannot be read" in scan.report.summary()
    plotted = runner.invoke(app, ["plot", str(run), "--key", "loss", "--out", str(tmp_path / "p.svg")])
    assert plotted.exit_code == 0, plotted.output
    tensorboard = ["--to", "tensorboard", "--logdir", str(tmp_path / "tb")]
    uploaded = runner.invoke(app, ["upload", str(run), *tensorboard, "--mode", "per_rank_reduce"])
    assert uploaded.exit_code == 0 and "row group 2 cannot be read" in uploaded.stderr, uploaded.output
    strict = runner.invoke(app, ["reduce", str(run), "--strict", "--out", str(tmp_path / "s.parquet")])
    assert strict.exit_code == 1 and "row group 2 cannot be read" in strict.stderr, strict.output


@pytest.mark.parametrize(
    "into", [10, 24 + 10, -1], ids=["its first record", "its second record", "its last byte"]
)
def test_a_journal_s_last_record_frame_cut_short_counts_the_records_its_header_declares(tmp_path, into):
    """The review of stop 61: a record frame cut before its first whole record was said as a
    notice (no record counted: ``--strict`` let it through) while one cut after it counted
    the whole records left. Every record its whole header declares is counted, none read."""
    from metric_core.format import journal

    run, truth = written_run(tmp_path / "run", "journal")
    (path,) = run.glob("*.journal")
    data = path.read_bytes()
    pos, frames = 4 + journal._HEAD.size + journal._HEAD.unpack_from(data, 4)[0], []  # past its header
    while pos < len(data):
        kind, length, _ = journal._FRAME.unpack_from(data, pos)
        frames.append((kind, pos, length))
        pos += journal._FRAME.size + length
    kind, start, length = [f for f in frames if f[0] == journal.RECORDS][-1]
    declared = (length - 8) // 24
    body = start + journal._FRAME.size + 8  # past the frame's header and its step
    path.write_bytes(data[: body + into if into >= 0 else start + journal._FRAME.size + length - 1])
    scan = scan_run(run)
    assert scan.report.skipped_records == declared and scan.report.has_skips
    assert scan.frame.select(pl.len()).collect().item() == len(truth) - declared
    strict = runner.invoke(app, ["reduce", str(run), "--strict", "--out", str(tmp_path / "s.parquet")])
    assert strict.exit_code == 1 and f"{declared} record(s) skipped" in strict.stderr, strict.output
