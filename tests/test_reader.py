"""The reader survives and reports every bad input of docs/reading.md, and loses nothing else."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from metric_core import scan_run
from metric_core.errors import NoDataError

from .conftest import write_collector_run


def rec(i: int, **over) -> dict:
    r = {
        "key": "loss",
        "value": float(i),
        "reduction": "mean",
        "step": i,
        "timestamp": 1.7e9 + i,
        "rank": 0,
        "process": "p0",
    }
    r.update(over)
    return r


def jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def values(scan) -> list[float]:
    return sorted(scan.frame.collect()["value"].to_list())


def test_bad_jsonl_lines_are_skipped_with_line_numbers_and_the_rest_is_kept(tmp_path):
    jsonl(
        tmp_path / "a.jsonl",
        [
            rec(0),
            "{not json",
            rec(2, value="abc"),
            {k: v for k, v in rec(3).items() if k != "step"},
            rec(4, value=True),
            "",
            rec(6, step="6"),
            rec(7, value=None),
            [1, 2],
            rec(9, rank=1.5),
            rec(10),
        ],
    )
    scan = scan_run(tmp_path)
    (f,) = scan.report.files
    assert f.skipped_lines == [
        (2, "not valid JSON"),
        (9, "not a JSON object"),
        (3, "'value' is not a number"),
        (4, "'step' is missing or null"),
        (8, "'value' is missing or null"),
        (10, "'rank' is not an integer"),
    ]
    assert f.skipped == 6
    assert values(scan) == [0.0, 1.0, 6.0, 10.0]  # true -> 1.0; "6" is a valid step
    summary = scan.report.summary()
    assert (  # the first bad lines, though the JSON checks found lines 2 and 9 before the fields' checks
        "a.jsonl: 6 record(s) skipped: line 2: not valid JSON; line 3: 'value' is not a number; line 4: "
        "'step' is missing or null (+3 more; in all: "
    ) in " ".join(summary.split())


def test_the_summary_counts_every_reason_past_the_lines_it_shows(tmp_path):
    """A file of many bad lines: the first three lines shown, then how many more, and every
    reason with its count over the whole file (not only the lines shown)."""
    lines = [rec(0)] + ["{not json"] * 10 + [rec(i, value="abc") for i in range(20, 25)] + [rec(30)]
    jsonl(tmp_path / "a.jsonl", lines)
    summary = scan_run(tmp_path).report.summary()
    assert (
        "a.jsonl: 15 record(s) skipped: line 2: not valid JSON; line 3: not valid JSON; line 4: not valid "
        "JSON (+12 more; in all: 5 x 'value' is not a number; 10 x not valid JSON)"
    ) in " ".join(summary.split())


def test_bad_fields_on_the_fast_path_are_reported_too(tmp_path):
    """A file polars parses whole: bad fields still get their line numbers."""
    jsonl(tmp_path / "a.jsonl", [rec(0), rec(1, value="abc"), rec(2), {"key": "k"}, rec(4)])
    (f,) = scan_run(tmp_path).report.files
    assert sorted(f.skipped_lines) == [
        (2, "'value' is not a number"),
        (4, "'value' is missing or null"),
    ]


def test_half_written_last_line_is_skipped_and_said(tmp_path):
    path = tmp_path / "r.jsonl"
    jsonl(path, [rec(0), rec(1)])
    with open(path, "a") as f:
        f.write('{"key": "loss", "value": 2.0, "redu')
    scan = scan_run(tmp_path)
    (f,) = scan.report.files
    assert f.truncated
    assert f.skipped_lines == [(3, "half-written last line (the writer was killed mid-write)")]
    assert values(scan) == [0.0, 1.0]


def test_a_complete_last_line_without_newline_is_kept(tmp_path):
    (tmp_path / "r.jsonl").write_text(json.dumps(rec(0)) + "\n" + json.dumps(rec(1)))
    scan = scan_run(tmp_path)
    assert values(scan) == [0.0, 1.0]
    assert not scan.report.has_skips


def test_python_json_nan_tokens_and_string_spellings_are_numbers(tmp_path):
    (tmp_path / "r.jsonl").write_text(
        "\n".join(
            json.dumps(rec(i, value=v))
            for i, v in enumerate([math.nan, math.inf, -math.inf, "NaN", "-Infinity"])
        )
        + "\n"
    )
    got = scan_run(tmp_path).frame.collect().sort("step")["value"].to_list()
    assert math.isnan(got[0]) and math.isnan(got[3])
    assert got[1] == math.inf and got[2] == -math.inf and got[4] == -math.inf


def test_missing_process_is_filled_from_rank_and_extra_fields_are_ignored(tmp_path):
    r = rec(0, rank=3, extra={"a": 1})
    del r["process"]
    jsonl(tmp_path / "x.jsonl", [r])
    df = scan_run(tmp_path).frame.collect()
    assert df.select("process", "rank").row(0) == ("rank3", 3)


def test_unreadable_parquet_is_named_and_skipped(tmp_path):
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    jsonl(tmp_path / "ok.jsonl", [rec(0)])
    scan = scan_run(tmp_path)
    (bad,) = scan.report.unreadable_files
    assert bad.path.name == "broken.parquet"
    assert "broken.parquet: unreadable, skipped" in scan.report.summary()
    assert values(scan) == [0.0]


def test_parquet_lacking_a_required_column_is_skipped_and_counted(tmp_path):
    pq.write_table(pa.table({"key": ["a"], "value": [1.0]}), tmp_path / "thin.parquet")
    jsonl(tmp_path / "ok.jsonl", [rec(0)])
    scan = scan_run(tmp_path)
    f = next(f for f in scan.report.files if f.path.name == "thin.parquet")
    assert f.skip_reasons == {"lacks column(s) reduction, step, timestamp, rank": 1}


@pytest.mark.parametrize("seed", range(3))
def test_a_parquet_files_skipped_records_are_told_by_their_rows(tmp_path, seed, monkeypatch):
    """Another tool's Parquet with bad records in several row groups: each skipped one is
    told by its row (from 0, as pyarrow and polars number them), whichever read found it:
    the scan's frame (the whole file checked), or the engine's reads of row groups cut
    into tasks, by step, by time and per rank."""
    from metric_core.offline.engine import run_plan, tasks
    from metric_core.offline.plan import make_plan

    rng = np.random.default_rng(seed)
    n = 2_000
    value, timestamp = rng.normal(size=n), 1.76e9 + np.arange(n) / 10
    bad = np.sort(rng.choice(n, 9, replace=False))
    kinds = rng.integers(0, 3, len(bad))
    null_value = bad[kinds == 0]
    timestamp[bad[kinds == 1]] = np.nan
    timestamp[bad[kinds == 2]] = rng.choice([-5.0, 1e11, np.inf], int((kinds == 2).sum()))
    table = pa.table(
        {
            "key": [f"k{i % 3}" for i in range(n)],
            "value": pa.array(value, mask=np.isin(np.arange(n), null_value)),
            "reduction": ["mean"] * n,
            "step": np.arange(n) // 3,
            "timestamp": timestamp,
            "rank": np.zeros(n, dtype=np.int64),
        }
    )
    pq.write_table(table, tmp_path / "other.parquet", row_group_size=int(rng.integers(150, 700)))
    time_reason = "'timestamp' is not Unix epoch seconds from 1970 to 2286"
    value_reason = "'value' is null, not numeric, or an integer float64 cannot hold exactly"
    want = sorted(
        (int(row), value_reason if kind == 0 else time_reason) for row, kind in zip(bad, kinds, strict=True)
    )

    def told(report) -> list[tuple[int, str]]:
        (f,) = report.files
        assert f.skipped == len(bad)
        return sorted(f.skipped_lines)

    scan = scan_run(tmp_path)
    scan.frame.collect()
    assert told(scan.report) == want
    assert f"row {want[0][0]}: {want[0][1]}" in scan.report.summary()
    monkeypatch.setattr(tasks, "PARTITION_ROWS", 250)  # tasks cut inside row groups
    for plan in (make_plan(), make_plan(by="time", every="7s"), make_plan(mode="per_rank_reduce")):
        result = run_plan(tmp_path, plan)
        result.frame  # noqa: B018 (read: the checks run as it is read)
        assert told(result.scan.report) == want, plan


def test_parquet_nulls_and_other_types_are_handled(tmp_path):
    ts = pa.array([1_700_000_000_000_000, 1_700_000_001_500_000, None], pa.timestamp("us", tz="UTC"))
    pq.write_table(
        pa.table(
            {
                "key": ["a", "b", "c"],
                "value": pa.array([1, None, 3], pa.int32()),
                "reduction": ["mean"] * 3,
                "step": [0, 1, 2],
                "timestamp": ts,
                "rank": [0, 0, 0],
            }
        ),
        tmp_path / "typed.parquet",
    )
    scan = scan_run(tmp_path)
    df = scan.frame.collect()
    assert df.select("key", "value", "timestamp", "process").rows() == [("a", 1.0, 1.7e9, "rank0")]
    (f,) = scan.report.files
    assert f.skipped == 2


def test_empty_directory_stray_files_and_dot_files(tmp_path):
    with pytest.raises(NoDataError, match=r"no \*.jsonl or \*.parquet file was found"):
        scan_run(tmp_path)
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / ".hidden.jsonl").write_text("garbage\n")
    (tmp_path / ".cache").mkdir()
    jsonl(tmp_path / ".cache" / "x.jsonl", ["garbage"])
    with pytest.raises(NoDataError):
        scan_run(tmp_path)
    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    jsonl(tmp_path / "sub" / "deeper" / "r.jsonl", [rec(5)])
    scan = scan_run(tmp_path)
    assert values(scan) == [5.0]
    assert not scan.report.has_skips


def test_a_directory_of_only_bad_records_is_no_data(tmp_path):
    jsonl(tmp_path / "bad.jsonl", ["nope", rec(1, value="x")])
    with pytest.raises(NoDataError, match="every record was skipped"):
        scan_run(tmp_path)


def test_not_a_directory(tmp_path):
    with pytest.raises(NoDataError, match="it does not exist"):
        scan_run(tmp_path / "missing")
    (tmp_path / "file").write_text("")
    with pytest.raises(NoDataError, match="it is not a directory"):
        scan_run(tmp_path / "file")


def test_truncated_journal_is_read_up_to_its_last_whole_frame(tmp_path):
    write_collector_run(tmp_path, [("w", 0)], steps=4, shutdown=False)
    # An unclean end seals its journal; recreate the crash state from a live collector.
    from metric_core import MetricCollector

    c = MetricCollector(tmp_path / "live", rank=0, process_name="w", flush_interval=3600)
    for step in range(3):
        for i in range(10):
            c.record("k", float(step * 10 + i))
        c.flush(step)
    (journal,) = (tmp_path / "live").glob("*.journal")
    data = journal.read_bytes()
    journal.write_bytes(data[:-50])  # cut the last frame
    scan = scan_run(tmp_path / "live")
    (f,) = scan.report.files
    assert f.truncated
    assert values(scan) == [float(i) for i in range(20)]
    assert "unfinished write at the end" in scan.report.summary()


def test_both_formats_and_many_sources_read_into_one_frame(tmp_path):
    a = write_collector_run(tmp_path, [("TrainActor_r0", 0), ("TrainActor_r1", 1)], file_format="parquet")
    b = write_collector_run(tmp_path, [("GeneratorActor_r0", 0)], file_format="jsonl", seed=3)
    df = scan_run(tmp_path).frame.collect()
    assert df.height == len(a) + len(b)
    got = df.group_by("process").agg(pl.col("value").sum()).sort("process")
    truth = pl.DataFrame(a + b).group_by("process").agg(pl.col("value").sum()).sort("process")
    np.testing.assert_allclose(got["value"].to_numpy(), truth["value"].to_numpy(), rtol=1e-12)


def test_a_damaged_sealed_jsonl_segment_is_validated_not_trusted(tmp_path):
    truth = write_collector_run(tmp_path, [("g", 0)], steps=3, file_format="jsonl")
    (segment,) = tmp_path.glob("*.jsonl")
    with open(segment, "a") as f:
        f.write('{"key": "x", "value": \n')  # something appended to a sealed file
    scan = scan_run(tmp_path)
    (rep,) = scan.report.files
    # records 2.., a block line, the shutdown line and its block line, then the appended one
    line = len(truth) + 5
    assert rep.skip_reasons == {f"line {line} fails its block's checksum (the file is damaged)": 1}
    assert sorted(values(scan)) == sorted(r["value"] for r in truth)
    assert scan.report.clean_shutdowns() == {("g", 0)}


def test_what_the_writer_declares_matches_the_records(tmp_path):
    """Key reductions, step and time ranges come from segment metadata where the writer
    declared them (sealed Parquet and JSONL, a journal), and from the data elsewhere."""
    truth = write_collector_run(tmp_path, [("TrainActor_r0", 0)], steps=7, seed=1)
    truth += write_collector_run(tmp_path, [("GeneratorActor_r0", 0)], steps=5, file_format="jsonl", seed=2)
    truth += write_collector_run(tmp_path, [("TrainActor_r1", 1)], steps=3, shutdown=None, seed=3)
    foreign = [dict(r, process="external", rank=9, key="ext/" + r["key"]) for r in truth[:40]]
    pl.DataFrame(foreign).write_parquet(tmp_path / "external.parquet")
    truth += foreign
    scan = scan_run(tmp_path)
    declared = {f.path.name: f.keys is not None for f in scan.report.files}
    assert declared["external.parquet"] is False and sum(declared.values()) == len(declared) - 1
    firsts: dict[tuple[str, int], float] = {}
    for r in truth:
        source = (r["process"], r["rank"])
        firsts[source] = min(firsts.get(source, math.inf), r["timestamp"])
    assert scan.first_timestamps() == firsts
    pairs = {pair for f in scan.report.files if f.keys is not None for pair in f.keys}
    assert pairs == {(r["key"], r["reduction"]) for r in truth if r["process"] != "external"}
    by_file = {f.path.name: f for f in scan.report.files}
    for name, f in by_file.items():
        if f.steps is not None:
            source = f.source
            steps = [r["step"] for r in truth if (r["process"], r["rank"]) == source]
            assert f.steps == (min(steps), max(steps)), name


def test_durations_and_local_times_as_people_read_them(india):
    from metric_core.clock import duration, local_time

    assert [duration(s) for s in (0.0503, 0.002, 2.25, 90, 5400, 1796238599)] == [
        "50 ms",
        "2 ms",
        "2.2 s",
        "90.0 s",
        "90.0 min",
        "20790 d",
    ]
    assert local_time(1_760_000_000.25) == "2025-10-09T14:23:20+05:30"  # 08:53:20.25 UTC, in India
    assert local_time(1_760_000_000.25, millis=True) == "2025-10-09T14:23:20.250+05:30"
    assert local_time(float("nan")) == "unknown"


def test_an_earlier_scan_gives_the_counts_of_the_files_unchanged_since(tmp_path):
    """``scan_run(earlier=)``: a file the earlier scan read whole and that is unchanged
    keeps its counts (another tool's bad rows are not counted twice, and are dropped); a
    file written to since, or a segment with a damaged row group, is read again."""
    import os
    import struct

    write_collector_run(tmp_path, [("Trainer_r0", 0)], steps=4)
    (intact,) = tmp_path.glob("Trainer_r0*.parquet")
    write_collector_run(tmp_path, [("Trainer_r1", 1)], steps=4)
    (damaged,) = tmp_path.glob("Trainer_r1*.parquet")
    whole = damaged.read_bytes()
    data_end = len(whole) - 8 - struct.unpack("<I", whole[-8:-4])[0]  # where the footer starts
    damaged.write_bytes(whole[:4] + bytes(b ^ 0x55 for b in whole[4:data_end]) + whole[data_end:])
    rows = [rec(0), rec(1, value=None), rec(2), rec(3, timestamp=-1.0)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "other.parquet")
    grown = jsonl(tmp_path / "grown.jsonl", [rec(0, process="p1", rank=1)])

    first = scan_run(tmp_path, defer_checks=True)
    truth = sorted(first.frame.collect()["value"].to_list())  # read whole, checked
    counts = {Path(f.path).name: (f.records, f.skipped) for f in first.report.files}
    assert counts["other.parquet"] == (2, 2) and counts[damaged.name][0] == 0
    with grown.open("a") as f:
        f.write(json.dumps(rec(1, process="p1", rank=1)) + "\n")
    os.utime(grown, (1e9, 1e9))  # its size and time differ from the listing's

    again = scan_run(tmp_path, defer_checks=True, earlier=first)
    names = {Path(again.report.files[fid].path).name: fid for fid in again.file_ids}
    assert [n for n, fid in sorted(names.items()) if again.unchanged(fid)] == [intact.name, "other.parquet"]
    assert again.report.files[names["other.parquet"]].skipped == 2  # before anything is read
    assert sorted(again.frame.collect()["value"].to_list()) == sorted([*truth, 1.0])
    assert {Path(f.path).name: (f.records, f.skipped) for f in again.report.files} == counts | {
        "grown.jsonl": (2, 0)
    }


def test_a_row_group_of_distinct_keys_read_in_frames_holds_its_dictionary_once(tmp_path):
    """Another tool's row group of 200,000 distinct keys (an Arrow dictionary, as pyarrow
    writes one), read in frames of 25,000 records: every key comes back once, and the most
    Arrow held (its pool's count, in a process of its own) stays within a few times the
    keys' text, not a dictionary of all of them a frame (pyarrow's batches each carry their
    own: 13 times the text on main, under 6 since)."""
    n = 200_000
    keys = [f"eval/rollout/reward/sample_{i:010d}/abcdefghij" for i in range(n)]
    table = pa.table(
        {
            "key": pa.DictionaryArray.from_arrays(pa.array(np.arange(n, dtype=np.int32)), pa.array(keys)),
            "value": pa.array(np.arange(n, dtype=np.float64)),
            "reduction": pa.array(["mean"] * n),
            "step": pa.array(np.zeros(n, dtype=np.int64)),
            "timestamp": pa.array(np.full(n, 1.76e9)),
            "rank": pa.array(np.zeros(n, dtype=np.int64)),
        }
    )
    run = tmp_path / "run"
    run.mkdir()
    pq.write_table(table, run / "other.parquet", row_group_size=n)
    child = f"""
import sys, polars as pl, pyarrow as pa
from metric_core import scan_run
scan = scan_run(sys.argv[1])
frames = list(scan.batches(scan.file_ids[0], ["key", "value"], row_groups=[0], rows={n // 8}))
pl.concat([f.select(pl.col("key").cast(pl.String), "value") for f in frames]).write_parquet(sys.argv[2])
print(pa.default_memory_pool().max_memory())
"""
    out = tmp_path / "got.parquet"
    found = subprocess.run(
        [sys.executable, "-c", child, str(run), str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    got = pl.read_parquet(out)
    assert got["key"].to_list() == keys
    assert got["value"].to_list() == list(map(float, range(n)))
    text = sum(len(k) for k in keys)
    assert int(found.stdout) < 8 * text, (found.stdout, text)


def test_the_tail_hands_a_source_over_in_step_order_when_a_journal_is_sealed_as_read(tmp_path, monkeypatch):
    """A journal sealed between the tail's listing of the files and its reading of them: its
    segment is read in the same poll, so no step of the next journal comes before its last
    steps (soak seed 67290745: a raw alarm on the next step, the series restarted)."""
    from metric_core.offline.read import tail as tail_module
    from metric_core.writer.segments import RawFileWriter

    w = RawFileWriter(tmp_path, process="t", rank=0, segment_records=2)
    codes = [("loss", "mean")]
    for step in range(4):  # 2 records fill a journal, closed at its flush; step 3's stays open
        values = [step, step + 0.5][: 1 if step == 3 else 2]
        w.enqueue(step, np.array([[v, 0.0, 1.7e9 + step] for v in values]).tobytes(), len(values), codes)
        w.mark_flush(step)
        w.write()
    assert len(list(tmp_path.glob("*.journal"))) == 4  # 3 closed, none sealed yet

    tail = tail_module.RunTail(tmp_path)
    listed = tail_module.list_data_files

    def list_then_seal(*args, **kwargs):
        found = listed(*args, **kwargs)
        w.seal_ready()  # the writer thread seals the closed journals now, after the listing
        return found

    monkeypatch.setattr(tail_module, "list_data_files", list_then_seal)
    first = tail.poll()
    monkeypatch.setattr(tail_module, "list_data_files", listed)
    assert len(list(tmp_path.glob("*.journal"))) == 1 and len(list(tmp_path.glob("*.parquet"))) == 3
    assert sorted(first["value"].to_list()) == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0]
    assert tail.poll().height == 0  # nothing twice
    w.close(clean_shutdown=True)


def test_the_tail_reads_a_step_whose_journal_rotated_before_its_flush_when_the_flush_is_seen(tmp_path):
    """A step of more than twice ``segment_records`` rotates its journal before its flush,
    which then goes in the next journal; until the first is sealed, the tail must take its
    records as the newer journal's flush settles them, not hand the step over without them
    (soak seed 283683272: the console printed step 18 of 27 with none of its records, then
    called all 60 late; 6 in 25 trials of such a writer followed)."""
    from metric_core.offline.read.tail import RunTail
    from metric_core.writer.segments import RawFileWriter

    w = RawFileWriter(tmp_path, process="t", rank=0, segment_records=2)
    codes = [("loss", "mean")]
    values = [0.0, 0.25, 0.5, 0.75]
    w.enqueue(0, np.array([[v, 0.0, 1.7e9] for v in values]).tobytes(), len(values), codes)
    w.write()  # 4 records, no flush yet: the journal rotates
    w.mark_flush(0)
    w.enqueue(1, np.array([[1.0, 0.0, 1.7e9 + 1]]).tobytes(), 1, codes)
    w.write()  # step 0's flush and a record of step 1, in the next journal
    assert len(list(tmp_path.glob("*.journal"))) == 2  # neither sealed yet

    tail = RunTail(tmp_path)
    records = tail.poll()
    (source,) = tail.sources.values()
    assert source.done == 0  # step 0 is flushed: every one of its records is read with it
    assert sorted(records.filter(pl.col("step") == 0)["value"].to_list()) == values
    w.seal_ready()
    assert tail.poll().filter(pl.col("step") == 0).height == 0  # and none again from its segment
    w.close(clean_shutdown=True)


@pytest.mark.parametrize("cut", ["mid-line", "at a line's end", "after line 1"])
def test_an_older_writers_segment_cut_short_counts_every_record_its_metadata_says_it_held(tmp_path, cut):
    """sample_logs/ holds segments of a writer before block lines: their first line declares
    ``records`` and ``bytes`` but no checksum. Cut short, every record it wrote and the file
    no longer holds is counted (not the one half-written line alone), and said as cut short."""
    import shutil

    run = shutil.copytree(Path(__file__).resolve().parents[1] / "sample_logs" / "rl_run", tmp_path / "run")
    path = run / "GeneratorActor_r0.r0.00001.jsonl"
    data = path.read_bytes()
    meta = json.loads(data[: data.index(b"\n")])
    assert "checksum" not in meta and meta["bytes"] == len(data) - data.index(b"\n") - 1
    half = len(data) // 2
    at = {
        "mid-line": half,
        "at a line's end": data.index(b"\n", half) + 1,
        "after line 1": data.index(b"\n") + 1,
    }[cut]
    path.write_bytes(data[:at])
    kept = data[:at].count(b'\n{"key":')  # whole record lines left
    scan = scan_run(run)
    rep = next(f for f in scan.report.files if f.path.name == path.name)
    assert rep.records == kept and rep.skipped == meta["records"] - kept
    said = scan.report.summary()
    left = at - data.index(b"\n") - 1
    assert "the file is cut short" in said and f"{left:,} of the" in said
    frame = scan.frame.filter(pl.col("process") == "GeneratorActor_r0", pl.col("step").is_between(120, 239))
    assert frame.select(pl.len()).collect().item() == kept
    whole = scan_run(Path(__file__).resolve().parents[1] / "sample_logs" / "rl_run")
    assert not any(f.skipped for f in whole.report.files if f.path.name == path.name)
