"""``metriclog keys``: answered from the writer's metadata where it declares each key, read
from the records elsewhere, the same rows either way, and the value column not read when
the metadata answers."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from metriclog.main import app
from typer.testing import CliRunner

from metric_core import Metric, MetricCollector, Reduce, list_keys, scan_run
from metric_core.errors import NoDataError
from metric_core.offline.engine import make_plan, run_plan
from metric_core.writer import segments
from tests.conftest import flip_a_page

BASE = 1_760_000_000.0
runner = CliRunner()


def _write(run: Path, file_format: str, segment_records: int = 1_000_000) -> list[dict]:
    """Two sources of the writer, keys on some steps only, a few values NaN or infinite;
    every record written, as the truth."""
    rng = np.random.default_rng(7)
    truth = []
    for process, rank in (("TrainActor_r0", 0), ("GenActor_r1", 1)):
        c = MetricCollector(
            run, rank=rank, process_name=process, file_format=file_format, segment_records=segment_records
        )
        for step in range(12):
            for key, red in (
                ("trainer/loss", Reduce.MEAN),
                ("trainer/grad", Reduce.MAX),
                ("policy/tok", Reduce.SUM),
            ):
                if key == "policy/tok" and rank == 0:
                    continue
                if key == "trainer/grad" and step % 4 == rank:
                    continue
                for _ in range(3):
                    value = float(rng.normal())
                    if rng.random() < 0.08:
                        value = [math.nan, math.inf, -math.inf][int(rng.integers(3))]
                    ts = BASE + step + float(rng.uniform(0, 0.9)) + rank * 0.01
                    c.push(Metric(key, value, red, ts))
                    truth.append(
                        {"key": key, "value": value, "reduction": red.value, "step": step, "timestamp": ts,
                         "rank": rank, "process": process}
                    )  # fmt: skip
            c.flush(step)
        c.shutdown()
    return truth


def _expected(truth: list[dict]) -> list[dict]:
    """The rows keys lists, computed from the records written."""
    out = []
    for key in sorted({r["key"] for r in truth}):
        mine = [r for r in truth if r["key"] == key]
        out.append(
            {
                "key": key,
                "reductions": ",".join(sorted({r["reduction"] for r in mine})),
                "records": len(mine),
                "sources": len({(r["process"], r["rank"]) for r in mine}),
                "first_step": min(r["step"] for r in mine),
                "last_step": max(r["step"] for r in mine),
                "first_time": min(r["timestamp"] for r in mine),
                "last_time": max(r["timestamp"] for r in mine),
                "nonfinite": int(np.sum(~np.isfinite([r["value"] for r in mine]))),
            }
        )
    return out


_JSON_SCHEMA = {
    "key": pl.String, "value": pl.String, "reduction": pl.String, "step": pl.Int64, "timestamp": pl.Float64,
    "rank": pl.Int64, "process": pl.String,
}  # fmt: skip


def _as_another_tool(run: Path, to: Path) -> None:
    """The writer's records, rewritten by pyarrow as another tool would: no metriclog metadata,
    keys as an Arrow dictionary, the sources interleaved in one file."""
    frames = [pl.read_parquet(p).drop("key_hash") for p in sorted(run.glob("*.parquet"))]
    frames += [
        pl.read_ndjson(p, schema=_JSON_SCHEMA)
        .filter(pl.col("key").is_not_null())
        .select("key", pl.col("value").cast(pl.Float64), "reduction", "step", "timestamp", "rank", "process")
        for p in sorted(run.glob("*.jsonl"))
    ]
    table = pl.concat(frames).sort("timestamp").to_arrow()
    table = table.set_column(0, "key", table["key"].cast(pa.string()).dictionary_encode())
    to.mkdir()
    pq.write_table(table, to / "all.parquet", row_group_size=50)


@pytest.mark.parametrize("file_format", ["parquet", "jsonl"])
def test_keys_from_the_writers_metadata_equal_the_records_and_another_tools_copy_read(tmp_path, file_format):
    run = tmp_path / "run"
    truth = _write(run, file_format, segment_records=20)  # several sealed segments a source
    assert len(list(run.glob(f"*.{file_format}"))) > 2
    want = _expected(truth)
    assert list_keys(run).to_dicts() == want  # the writer's metadata
    _as_another_tool(run, tmp_path / "copy")
    assert list_keys(tmp_path / "copy").to_dicts() == want  # the records read


def test_keys_of_another_tools_file_count_only_the_records_kept(tmp_path):
    """Rows another tool wrote badly (a null value, a time that is no clock's) are skipped,
    and said, as reduce skips them; a key only they hold is not listed."""
    rows = {
        "key": ["a/x", "a/x", "b/y", "b/y", "c/z"],
        "value": [1.0, float("nan"), None, 2.0, 3.0],
        "reduction": ["mean", "mean", "sum", "sum", "max"],
        "step": [0, 5, 1, 2, 3],
        "timestamp": [BASE, BASE + 5, BASE + 1, BASE + 2, BASE * 1000],
        "rank": [0, 1, 2, 3, 0],
        "process": ["p_r0", "p_r1", "p_r2", "p_r3", "p_r0"],
    }
    (tmp_path / "run").mkdir()
    pq.write_table(pa.table(rows), tmp_path / "run" / "x.parquet")
    reports = []
    got = list_keys(tmp_path / "run", on_read=reports.append).to_dicts()
    assert got == [
        {"key": "a/x", "reductions": "mean", "records": 2, "sources": 2, "first_step": 0, "last_step": 5,
         "first_time": BASE, "last_time": BASE + 5, "nonfinite": 1},
        {"key": "b/y", "reductions": "sum", "records": 1, "sources": 1, "first_step": 2, "last_step": 2,
         "first_time": BASE + 2, "last_time": BASE + 2, "nonfinite": 0},
    ]  # fmt: skip
    assert reports[0].skipped_records == 2


def test_keys_key_filters_as_reduces_key_does(tmp_path):
    run = tmp_path / "run"
    truth = _write(run, "parquet")
    result = runner.invoke(app, ["keys", str(run), "--key", "trainer/*", "--format", "json"])
    assert result.exit_code == 0, result.output
    want = [row for row in _expected(truth) if row["key"].startswith("trainer/")]
    assert json.loads(result.stdout) == want and len(want) == 2
    both = runner.invoke(
        app, ["keys", str(run), "--key", "policy/tok", "--key", "*/grad", "--format", "json"]
    )
    assert [row["key"] for row in json.loads(both.stdout)] == ["policy/tok", "trainer/grad"]
    none = runner.invoke(app, ["keys", str(run), "--key", "trainer/lss"])
    assert none.exit_code == 1
    assert none.stderr.splitlines()[-1] == (
        f"Error: no record in {run} matches the filters: --key 'trainer/lss' matches no key; the run's "
        "keys: policy/tok, trainer/grad, trainer/loss"
    )
    reduced = runner.invoke(app, ["reduce", str(run), "--key", "trainer/lss"])
    assert reduced.exit_code == 1 and reduced.stderr.splitlines()[-1] == none.stderr.splitlines()[-1]


def _damage_values(path: Path) -> None:
    """Overwrite the data of every ``value`` column chunk of a Parquet file, leaving its
    footer (and the metadata in it) as it was."""
    meta = pq.read_metadata(path)
    column = meta.schema.names.index("value")
    data = bytearray(path.read_bytes())
    for g in range(meta.num_row_groups):
        chunk = meta.row_group(g).column(column)
        start = chunk.data_page_offset
        data[start : start + chunk.total_compressed_size] = b"\xff" * chunk.total_compressed_size
    path.write_bytes(bytes(data))


def test_keys_of_segments_whose_values_are_destroyed_fail_as_reduce_does(tmp_path):
    """Segments whose values are destroyed but whose footers are whole: their metadata is not
    taken for what a read gives. keys finds every row group damaged, as reduce does, and
    fails as reduce fails, saying so."""
    run = tmp_path / "run"
    truth = _write(run, "parquet")
    for path in run.glob("*.parquet"):
        _damage_values(path)
    reports: list = []
    with pytest.raises(NoDataError) as listed:
        list_keys(run, on_read=reports.append)
    with pytest.raises(NoDataError) as reduced:  # every row group damaged: no record left to reduce
        run_plan(run, make_plan(), on_read=reports.append).frame  # noqa: B018
    assert reports[0].skipped_records == reports[-1].skipped_records == len(truth)
    assert "row group 0 is damaged" in reports[0].summary()
    assert str(listed.value) == str(reduced.value)


def test_keys_of_a_flipped_and_a_truncated_segment_count_what_reduce_reads(tmp_path, monkeypatch):
    """A bit flipped in one row group's page of a sealed segment, another segment cut short
    (soak seeds 9061, 9066): keys counts neither from their metadata. The flipped segment's
    other row groups are read, the truncated one is unreadable, and the rows equal those of
    the records written less the damaged ones (read from the files before the damage), and
    those of the records per_rank_no_reduce returns, with the same warning."""
    monkeypatch.setattr(segments, "ROW_GROUP_RECORDS", 8)  # row groups of 8 records
    run = tmp_path / "run"
    truth = _write(run, "parquet", segment_records=20)
    flipped, cut = run / "TrainActor_r0.r0.00001.parquet", run / "GenActor_r1.r1.00002.parquet"
    assert pq.read_metadata(flipped).num_row_groups == 3
    lost = pq.ParquetFile(flipped).read_row_group(1).to_pylist() + pq.read_table(cut).to_pylist()
    flip_a_page(flipped, group=1)
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    gone = {(r["rank"], r["key"], r["timestamp"]) for r in lost}
    kept = [r for r in truth if (r["rank"], r["key"], r["timestamp"]) not in gone]
    assert len(gone) == len(lost) > 8 and len(kept) == len(truth) - len(lost)

    reports: list = []
    listed = list_keys(run, on_read=reports.append).to_dicts()
    raw = run_plan(run, make_plan(mode="per_rank_no_reduce"))
    assert listed == _expected(kept) == _expected(raw.frame.to_dicts())
    assert reports[0].summary() == raw.scan.report.summary()
    said = reports[0].summary()
    assert "row group 1 is damaged" in said and f"{cut.name}: unreadable" in said
    result = runner.invoke(app, ["keys", str(run), "--format", "json"])
    assert result.exit_code == 0 and json.loads(result.stdout) == _expected(kept)
    assert "row group 1 is damaged" in result.stderr


@pytest.mark.parametrize("folded_rows", [4, 1_000_000])
def test_keys_of_many_files_and_row_groups_fold_to_the_rows_of_every_record(
    tmp_path, monkeypatch, folded_rows
):
    """Rows folded early (a few keys, many records) or held to the end (keys mostly
    distinct) give the same answer: that of the records themselves."""
    from metric_core.offline import keys as keys_module

    monkeypatch.setattr(keys_module, "FOLDED_ROWS", folded_rows)
    monkeypatch.setattr(keys_module, "BATCH_ROWS", 7)
    rng = np.random.default_rng(3)
    truth = []
    (tmp_path / "run").mkdir()
    for f in range(3):
        n = 120
        rows = {
            "key": [f"k/{int(k)}" for k in rng.integers(0, 90, n)],
            "value": [float(v) if v > -1.5 else math.nan for v in rng.normal(size=n)],
            "reduction": [["mean", "sum"][int(r)] for r in rng.integers(0, 2, n)],
            "step": [int(s) for s in rng.integers(-5, 50, n)],
            "timestamp": [BASE + float(t) for t in rng.uniform(0, 100, n)],
            "rank": [int(r) for r in rng.integers(0, 4, n)],
            "process": None,
        }
        rows["process"] = [f"Actor_r{r}" for r in rows["rank"]]
        pq.write_table(pa.table(rows), tmp_path / "run" / f"part{f}.parquet", row_group_size=25)
        truth += [dict(zip(rows, values, strict=True)) for values in zip(*rows.values(), strict=True)]
    assert list_keys(tmp_path / "run").to_dicts() == _expected(truth)


def test_inspect_lists_the_last_values_of_a_stopped_sources_first_keys_by_name(tmp_path):
    """A source of many keys that stopped early: its last values of the first 1,000 keys by
    name (not a dict of every key), each the value of that key's newest record."""
    from metric_core import inspect_run

    names = [f"k/{i:05d}" for i in range(1_200)]
    rows: dict[str, list] = {
        c: [] for c in ("key", "value", "reduction", "step", "timestamp", "rank", "process")
    }
    for step in range(100):
        for rank, keys in ((0, names if step <= 30 else []), (1, ["loss"])):
            for i, key in enumerate(keys):
                rows["key"].append(key)
                rows["value"].append(float(step * 10_000 + i))
                rows["reduction"].append("mean")
                rows["step"].append(step)
                rows["timestamp"].append(BASE + step + rank * 0.01)
                rows["rank"].append(rank)
                rows["process"].append(f"Actor_r{rank}")
    (tmp_path / "run").mkdir()
    pq.write_table(pa.table(rows), tmp_path / "run" / "x.parquet")
    report = inspect_run(tmp_path / "run")
    assert [(s.process, s.status) for s in report.stopped_early] == [("Actor_r0", "stopped_early")]
    assert report.stopped_early[0].last_values == {
        key: float(30 * 10_000 + i) for i, key in enumerate(names[:1_000])
    }
    assert next(s.keys for s in report.sources if s.rank == 0) == 1_200


@pytest.mark.parametrize(("range_keys", "spilled_rows"), [(1, 10**9), (16, 10**9), (16, 20), (1 << 20, 20)])
def test_keys_of_many_keys_come_a_range_of_keys_at_a_time_in_key_order(
    tmp_path, monkeypatch, range_keys, spilled_rows
):
    """Past RANGE_KEYS rows the keys are sorted a range at a time (never all at once) and
    handed over a frame a range, the rows of mostly distinct keys set aside in a temporary
    directory past SPILLED_ROWS (removed at the end): the frames, one after another, are
    the sorted answer of the records themselves."""
    from metric_core.offline import keyorder
    from metric_core.offline import keys as keys_module
    from metric_core.offline.keys import key_frames

    monkeypatch.setattr(keyorder, "RANGE_KEYS", range_keys)
    monkeypatch.setattr(keys_module, "SPILLED_ROWS", spilled_rows)
    monkeypatch.setattr(keys_module, "SAMPLED_KEYS", 8)  # thinned as it grows
    monkeypatch.setattr(keys_module, "FOLDED_ROWS", 30)
    monkeypatch.setattr(keys_module, "BATCH_ROWS", 50)
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    rng = np.random.default_rng(5)
    n = 400
    ids = rng.integers(0, 300, n)
    rows = {
        "key": [f"k/{'é' if k % 7 == 0 else ''}{int(k) * 7919 % 1000:03d}/{'x' * int(k % 40)}" for k in ids],
        "value": [float(v) if v > -1.5 else math.inf for v in rng.normal(size=n)],
        "reduction": [["mean", "max"][int(k % 3 == 0)] for k in ids],
        "step": [int(s) for s in rng.integers(0, 9, n)],
        "timestamp": [BASE + float(t) for t in rng.uniform(0, 100, n)],
        "rank": [int(r) for r in rng.integers(0, 3, n)],
    }
    rows["process"] = [f"Actor_r{r}" for r in rows["rank"]]
    (tmp_path / "run").mkdir()
    pq.write_table(pa.table(rows), tmp_path / "run" / "part.parquet", row_group_size=60)
    truth = [dict(zip(rows, values, strict=True)) for values in zip(*rows.values(), strict=True)]

    stream = key_frames(tmp_path / "run")
    frames = [next(stream)]
    assert any(temp.iterdir()) == (spilled_rows < n)
    frames += list(stream)
    assert pl.concat(frames).to_dicts() == _expected(truth)
    assert not any(temp.iterdir())
    if range_keys < 300:  # about a frame a range, none empty
        assert len(frames) > 1 and all(f.height for f in frames)
    else:
        assert len(frames) == 1


@pytest.mark.parametrize("layout", ["a file a source", "one file", "a source in two files"])
def test_inspect_of_sources_of_many_keys_holds_what_it_lists_and_counts_every_key(
    tmp_path, monkeypatch, layout
):
    """A source whose records are all in one file keeps, of its rows a key, only what the
    report lists (its first LAST_VALUES keys by name, its keys with non-finite values) and
    its count of keys; the report is that of the records themselves, in every layout."""
    from metric_core import inspect_run
    from metric_core.offline.inspect import aggregates, health

    monkeypatch.setattr(aggregates, "LAST_VALUES", 5)
    monkeypatch.setattr(health, "LAST_VALUES", 5)
    monkeypatch.setattr(aggregates, "BATCH_ROWS", 40)
    rng = np.random.default_rng(4)
    frames = []
    for rank in range(3):
        n = 150 + 30 * rank
        ids = rng.permutation(n)
        steps = np.arange(n) // 10 if rank else np.minimum(np.arange(n) // 10, 4)  # rank 0 stops early
        value = rng.normal(size=n)
        value[rng.random(n) < 0.05] = np.inf
        frames.append(
            pl.DataFrame(
                {
                    "key": [f"r/{int(i) * 7 % 1000:04d}" for i in ids],
                    "value": value,
                    "reduction": "mean",
                    "step": steps,
                    "timestamp": BASE + steps + rank * 0.01 + np.arange(n) * 1e-4,
                    "rank": rank,
                    "process": f"Actor_r{rank}",
                }
            )
        )
    run = tmp_path / "run"
    run.mkdir()
    if layout == "a file a source":
        for rank, frame in enumerate(frames):
            frame.write_parquet(run / f"r{rank}.parquet", row_group_size=50)
    elif layout == "one file":
        pl.concat(frames).sort("timestamp").write_parquet(run / "all.parquet", row_group_size=50)
    else:
        for rank, frame in enumerate(frames):
            frame[:70].write_parquet(run / f"r{rank}a.parquet")
            frame[70:].write_parquet(run / f"r{rank}b.parquet")
    records = pl.concat(frames)

    report = inspect_run(run)
    for s in report.sources:
        mine = records.filter(pl.col("rank") == s.rank)
        assert s.keys == mine["key"].n_unique()
    (stopped,) = report.stopped_early
    mine = records.filter(pl.col("rank") == 0)
    newest = mine.sort("timestamp").group_by("key").last().sort("key").head(5)
    assert stopped.last_values == dict(zip(newest["key"], newest["value"], strict=True))
    bad = records.filter(~pl.col("value").is_finite())
    truth = bad.group_by("process", "rank", "key").agg(count=pl.len(), first_step=pl.col("step").min())
    got = {(n.process, n.rank, n.key): (n.count, n.first_step) for n in report.nonfinite}
    assert got == {(p, r, k): (c, f) for p, r, k, c, f in truth.iter_rows()}
    per_key = aggregates.aggregate(scan_run(run))[1]
    if layout == "a source in two files":  # merged from every row
        assert per_key.height == records.select("rank", "key").n_unique()
    else:
        assert per_key.height <= 5 * 3 + bad.height
