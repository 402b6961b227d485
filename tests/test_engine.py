"""The engine's promises (docs/modes.md, "How results are computed"): exact where float64
allows, the same bits whatever the thread count or file order, one read of each file,
and the same result from any format holding the same records."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from metric_core import Metric, MetricCollector, Reduce
from metric_core.errors import MetricLogError
from metric_core.format.schema import default_process_name
from metric_core.offline import engine, read
from metric_core.offline.engine import accumulator, partials, reduce_run, run_plan
from metric_core.offline.plan import make_plan
from metric_core.offline.read import RunScan, parquet, scan_run

from .conftest import BASE_TIME, killed_after, write_collector_run
from .test_exact import KERNELS, kernel_of

SOURCES = [(f"TrainActor_r{r}", r) for r in range(4)]


def write_foreign(
    path: Path, rows: dict, *, dictionary: bool = True, row_group_size: int | None = None
) -> None:
    """Parquet as another tool writes it: no metriclog metadata, strings dictionary-encoded."""
    table = pa.table(rows)
    if dictionary:
        for name in ("key", "reduction", "process"):
            if name in table.column_names:
                table = table.set_column(
                    table.column_names.index(name), name, table[name].dictionary_encode()
                )
    pq.write_table(table, path, row_group_size=row_group_size)


def tie_order(timestamp: float, step: int, process: str, rank: int, value: float) -> tuple:
    """Where a record stands in the order first and last are taken in (docs/modes.md): by
    timestamp, then step, then source (a blake2b digest of the process name, as int64,
    then the rank), then the value's bits as int64."""
    digest = int.from_bytes(hashlib.blake2b(process.encode(), digest_size=8).digest(), "little", signed=True)
    return (timestamp, step, digest, rank, int(np.float64(value).view(np.int64)))


def exact_moments(values: np.ndarray) -> tuple[Fraction, Fraction]:
    """The exact sum and sum of squares of finite float64 values, as Fractions.

    Each value is an integer of 53 bits times 2**e (``np.frexp``); shifted to the smallest
    e, as Python integers, they add and square without rounding."""
    mantissa, exponent = np.frexp(values)
    ints = (mantissa * 2.0**53).astype(np.int64).astype(object)
    low = int(exponent.min())
    scaled = ints << (exponent - low).astype(object)
    unit = Fraction(2) ** (low - 53)
    return int(scaled.sum()) * unit, int((scaled * scaled).sum()) * unit * unit


@pytest.fixture(scope="module")
def hard_values(tmp_path_factory):
    """Groups of 10^6 values of 1e12 + N(0, 1) (and others) in four files, one per rank."""
    root = tmp_path_factory.mktemp("hard")
    rng = np.random.default_rng(7)
    groups = {  # key: (reduction, values)
        "big/sum": ("sum", 1e12 + rng.standard_normal(1_000_000)),
        "big/mean": ("mean", 1e12 + rng.standard_normal(1_000_000)),
        "big/std": ("std", 1e12 + rng.standard_normal(1_000_000)),
        "mid/std": ("std", 1e8 + rng.standard_normal(200_000)),
        "zero/sum": ("sum", rng.standard_normal(200_000)),
        "wide/sum": ("sum", rng.standard_normal(200_000) * 10.0 ** rng.integers(-8, 9, 200_000)),
        "tail/p99": ("p99", rng.standard_normal(200_000) * 1e3),
        "tail/p50": ("median", rng.standard_normal(200_001)),
    }
    for rank in range(4):
        parts = {k: (red, v[rank::4]) for k, (red, v) in groups.items()}
        n = sum(len(v) for _, v in parts.values())
        write_foreign(
            root / f"rank{rank}.parquet",
            {
                "key": np.repeat(list(parts), [len(v) for _, v in parts.values()]),
                "value": np.concatenate([v for _, v in parts.values()]),
                "reduction": np.repeat([r for r, _ in parts.values()], [len(v) for _, v in parts.values()]),
                "step": np.zeros(n, dtype=np.int64),
                "timestamp": BASE_TIME + np.arange(n) * 1e-6,
                "rank": np.full(n, rank),
            },
        )
    return root, groups


@pytest.mark.parametrize("kernel", ["compiled", "numpy"])
def test_sums_means_and_stds_of_a_million_values_a_group_are_correctly_rounded(hard_values, kernel):
    """Groups of 200,000 to 1,000,000 values (on a 1e12 and a 1e8 offset, of 16 decades),
    a quarter in each rank's file: the bins of many rows a group and exponent, read in
    partitions of several files. Each sum, mean and std is the correctly rounded value of
    the exact one, 0 ulp: the truth from Python integers (``exact_moments``), rounded by
    ``fractions`` and ``math.isqrt`` (tests.test_exact's ``rounded`` and ``root``), on the
    compiled path and the pure numpy one."""
    from tests.test_exact import kernel_of, root, rounded

    root_dir, groups = hard_values
    with kernel_of(kernel):
        got = dict(reduce_run(root_dir).select("key", "value").iter_rows())
    checked = 0
    for key, (reduction, values) in groups.items():
        if reduction not in ("sum", "mean", "std"):
            continue
        total, squares = exact_moments(values)
        n = len(values)
        if reduction == "sum":
            want = rounded(total)
            assert want == math.fsum(values)  # the oracle agrees with CPython's correctly rounded sum
        elif reduction == "mean":
            want = rounded(total / n)
        else:
            want = root((n * squares - total * total) / (n * n))
        assert np.float64(got[key]).view(np.int64) == np.float64(want).view(np.int64), (key, got[key], want)
        checked += 1
    assert checked == 6


def test_percentiles_equal_numpys(hard_values):
    root, groups = hard_values
    got = dict(reduce_run(root).select("key", "value").iter_rows())
    assert got["tail/p99"] == pytest.approx(np.percentile(groups["tail/p99"][1], 99), rel=1e-15, abs=0)
    assert got["tail/p50"] == pytest.approx(np.median(groups["tail/p50"][1]), rel=1e-15, abs=0)
    # every statistic on one group, against numpy
    values = groups["tail/p99"][1]
    for stat, truth in [
        ("min", values.min()),
        ("max", values.max()),
        ("count", len(values)),
        ("p0", np.percentile(values, 0)),
        ("p100", np.percentile(values, 100)),
        ("p37.5", np.percentile(values, 37.5)),
    ]:
        frame = reduce_run(root, keys=["tail/p99"], reduce=[f"*={stat}"])
        assert frame["value"][0] == pytest.approx(truth, rel=1e-15, abs=0), stat


def _run_cli(run: Path, out: Path, threads: int, *args: str, dictionaries: bool = False) -> bytes:
    """`metriclog reduce` in a fresh process with POLARS_MAX_THREADS=threads."""
    code = (
        "import sys\n"
        "from metric_core.offline import engine\n"
        f"engine.tasks.DICTIONARY_READ_RECORDS = {0 if dictionaries else 10**12}\n"
        "from metriclog.main import app\n"
        "app(sys.argv[1:])\n"
    )
    env = {**os.environ, "POLARS_MAX_THREADS": str(threads)}
    done = subprocess.run(
        [sys.executable, "-c", code, "reduce", str(run), "--out", str(out), *args],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return out.read_bytes()


@pytest.fixture(scope="module")
def many_files(tmp_path_factory):
    """A run of 12 writer files and 4 foreign ones, with every reduction."""
    root = tmp_path_factory.mktemp("many")
    write_collector_run(root, [(f"GeneratorActor_r{r}", r) for r in range(12)], steps=40, seed=3)
    rng = np.random.default_rng(5)
    for i in range(4):
        n = 3000
        write_foreign(
            root / f"foreign{i}.parquet",
            {
                "key": rng.choice(["ext/a", "ext/b", "trainer/loss"], n),
                "value": 1e9 + rng.standard_normal(n),
                "reduction": np.where(rng.random(n) < 2, "mean", "mean"),
                "step": rng.integers(0, 40, n),
                "timestamp": BASE_TIME + rng.uniform(0, 40, n),
                "rank": np.full(n, 20 + i),
            },
        )
    return root


@pytest.mark.parametrize(
    "args",
    [
        (),
        ("--mode", "per_rank_reduce"),
        ("--by", "time", "--every", "3s"),
        ("--reduce", "trainer/*=std", "--reduce", "policy/*=p90", "--reduce", "ext/b=first"),
    ],
    ids=["global", "per_rank", "by_time", "overrides"],
)
def test_output_is_bit_identical_across_runs_threads_and_file_order(many_files, tmp_path, args):
    outputs = {
        (threads, dictionaries): _run_cli(
            many_files,
            tmp_path / f"{threads}{dictionaries}.parquet",
            threads,
            *args,
            dictionaries=dictionaries,
        )
        for threads in (1, 2)
        for dictionaries in (False, True)
    }
    again = _run_cli(many_files, tmp_path / "again.parquet", 2, *args)
    # the same files, created in the reverse order (so a directory listing returns them otherwise)
    reversed_run = tmp_path / "reversed"
    reversed_run.mkdir()
    for path in sorted(many_files.iterdir(), reverse=True):
        shutil.copy2(path, reversed_run / path.name)
    other_order = _run_cli(reversed_run, tmp_path / "other.parquet", 2, *args)
    first = outputs[(1, False)]
    assert all(out == first for out in outputs.values())
    assert again == first and other_order == first
    # and the values are numpy's (the same bits need not be the right ones)
    frame = pl.read_parquet(tmp_path / "again.parquet")
    assert frame.height > 0 and frame["value"].is_not_null().all()


def row_group_reads(monkeypatch) -> list[tuple[str, int]]:
    """Every Parquet file is read through its dictionaries; the list fills with each row
    group read, as (file name, row group)."""
    reads: list[tuple[str, int]] = []
    original = read.scan.categorical_batches

    def counting(path, columns, hashed, row_groups=None, rows=None, *, rep, take_batch=None):
        groups = range(pq.ParquetFile(path).num_row_groups) if row_groups is None else row_groups
        reads.extend((Path(path).name, g) for g in groups)
        return original(path, columns, hashed, row_groups, rows, rep=rep, take_batch=take_batch)

    monkeypatch.setattr(read.scan, "categorical_batches", counting)
    monkeypatch.setattr(engine.tasks, "DICTIONARY_READ_RECORDS", 0)
    return reads


def value_slices(monkeypatch) -> list[int]:
    """The list fills with the number of slices of median/pNN values each take of the
    accumulator hands over (each a query of its own)."""
    slices: list[int] = []
    take = accumulator.Accumulator.take

    def counting(self, *args):
        taken = take(self, *args)
        slices.append(len(taken.values))
        return taken

    monkeypatch.setattr(accumulator.Accumulator, "take", counting)
    return slices


def test_each_file_is_read_once(many_files, tmp_path, monkeypatch):
    """One read of each data file's row groups for a reduce, in every reducing mode: the
    scan takes only metadata and footers."""
    reads = row_group_reads(monkeypatch)
    every = sorted(
        (p.name, g) for p in many_files.glob("*.parquet") for g in range(pq.ParquetFile(p).num_row_groups)
    )
    footers: list[str] = []
    read_metadata = pq.read_metadata

    def footer(path, *args, **kwargs):
        footers.append(Path(path).name)
        return read_metadata(path, *args, **kwargs)

    monkeypatch.setattr(pq, "read_metadata", footer)
    for mode in ("global_reduce", "per_rank_reduce", "per_rank_no_reduce"):
        reads.clear()
        footers.clear()
        run = shutil.copytree(many_files, tmp_path / mode)  # footers not read before (read ones are kept)
        result = run_plan(run, make_plan(mode=mode))
        assert result.frame.height > 0
        assert sorted(reads) == every, mode
        assert sorted(footers) == sorted({name for name, _ in every}), mode  # pyarrow parses each once
        assert result.scan.report.skipped_records == 0


@pytest.mark.parametrize(
    ("mode", "ranks"),
    [
        ("global_reduce", None),
        ("per_rank_no_reduce", None),
        ("global_reduce", "3-7,21"),
        ("per_rank_no_reduce", "3-7,21"),
    ],
)
def test_by_time_reads_each_file_once_where_the_files_declare_their_first_time(
    many_files, monkeypatch, mode, ranks
):
    """``--by time`` windows start at the first record kept. The writer's segments declare
    their time ranges, and another tool's footers hold their lowest timestamps and no
    nulls: no query over the run finds it (the run's lazy frames fail if collected), each
    row group is read once, and the first window starts at the lowest timestamp there is
    (with ``--ranks``, of the files of those ranks: each file holds one source)."""
    reads = row_group_reads(monkeypatch)
    paths = sorted(many_files.glob("*.parquet"))
    every = sorted((p.name, g) for p in paths for g in range(pq.ParquetFile(p).num_row_groups))
    kept = {*range(3, 8), 21} if ranks else None
    first = min(
        float(ts.min())
        for p in paths
        for t in [pq.read_table(p, columns=["timestamp", "rank"])]
        for ts in [
            t["timestamp"].to_numpy()[np.isin(t["rank"].to_numpy(), list(kept)) if kept else slice(None)]
        ]
        if len(ts)
    )
    scan = scan_run(many_files, defer_checks=True)
    assert sum(not scan.trusted(fid) for fid in scan.file_ids) == 4  # the other tool's files, unchecked

    def no_query(*_):
        pytest.fail("a query over the run's frames")

    monkeypatch.setattr(RunScan, "frame", property(no_query))
    monkeypatch.setattr(RunScan, "file_frame", no_query)
    plan = make_plan(mode=mode, by="time", every=2.0, **({"ranks": ranks} if ranks else {}))
    frame = engine.execute(plan, scan).frame
    assert sorted(reads) == every
    assert frame["window_start"].min() == first
    if kept is not None and "rank" in frame.columns:
        assert set(frame["rank"]) == kept
    assert scan.report.skipped_records == 0


def test_foreign_parquet_jsonl_and_journals_agree_with_the_writers_files(tmp_path):
    """The same records written by the writer (sealed Parquet, and journals of a killed
    writer), as another tool's Parquet (dictionary strings, integer values, timestamp-typed
    times, int32 ranks, no metadata) and as plain JSONL: the same results, to the bit."""
    records = write_collector_run(tmp_path / "scratch", SOURCES, steps=12, seed=11)
    for r in records:  # what an integer value column and microsecond timestamps can hold
        r["value"] = float(round(r["value"] * 1000))
        r["timestamp"] = round(r["timestamp"] * 1e6) / 1e6
    by_rank = {rank: [r for r in records if r["rank"] == rank] for _, rank in SOURCES}

    def write_own(run: Path, killed: bool) -> None:
        for (process, rank), rows in zip(SOURCES, by_rank.values(), strict=True):

            def write(process=process, rank=rank, rows=rows) -> MetricCollector:
                c = MetricCollector(run, rank=rank, process_name=process)
                for step in sorted({r["step"] for r in rows}):
                    for r in rows:
                        if r["step"] == step:
                            c.push(Metric(r["key"], r["value"], Reduce(r["reduction"]), r["timestamp"]))
                    c.flush(step)
                return c

            killed_after(write) if killed else write().shutdown()

    own, journals, foreign, jsonl = (tmp_path / name for name in ("own", "journals", "foreign", "jsonl"))
    write_own(own, killed=False)
    write_own(journals, killed=True)
    assert list(journals.glob("*.journal")) and not list(own.glob("*.journal"))
    foreign.mkdir()
    jsonl.mkdir()
    for (process, _rank), rows in zip(SOURCES, by_rank.values(), strict=True):
        frame = pl.DataFrame(rows).select("key", "value", "reduction", "step", "timestamp", "rank", "process")
        frame.write_ndjson(jsonl / f"{process}.jsonl")
        write_foreign(
            foreign / f"{process}.parquet",
            {
                "key": frame["key"].to_list(),
                "value": pa.array(frame["value"].cast(pl.Int64).to_list(), pa.int64()),
                "reduction": frame["reduction"].str.to_uppercase().to_list(),
                "step": frame["step"].to_list(),
                "timestamp": pa.array(
                    [round(t * 1e6) for t in frame["timestamp"]], pa.timestamp("us", tz="UTC")
                ),
                "rank": pa.array(frame["rank"].to_list(), pa.int32()),
                "process": frame["process"].to_list(),
            },
        )
    for plan in (
        {},
        {"mode": "per_rank_reduce"},
        {"mode": "per_rank_no_reduce"},
        {"by": "time", "every": "2s"},
        {"reduce": ["*=p75"]},
        {"reduce": ["*=first"]},
    ):
        mine = reduce_run(own, **plan)
        for other in (journals, foreign, jsonl):
            assert_same(mine, reduce_run(other, **plan), plan, other.name)


def assert_same(a: pl.DataFrame, b: pl.DataFrame, plan: dict, what: str) -> None:
    assert a.columns == b.columns, (plan, what)
    assert a.height == b.height, (plan, what)
    for col in a.columns:
        if a[col].dtype == pl.Float64:
            np.testing.assert_array_equal(
                a[col].to_numpy(), b[col].to_numpy(), err_msg=f"{plan} {what} {col}"
            )
        else:
            assert a[col].to_list() == b[col].to_list(), (plan, what, col)


def test_per_rank_reduce_streams_a_source_at_a_time_and_a_late_conflict_is_skipped_and_said(tmp_path):
    from metriclog.main import app
    from typer.testing import CliRunner

    for rank, reduction in ((0, Reduce.MEAN), (1, Reduce.MEAN), (2, Reduce.MAX)):
        c = MetricCollector(tmp_path / "run", rank=rank, process_name=f"TrainActor_r{rank}")
        for step in range(3):
            c.push(Metric("loss", float(step + rank), reduction, BASE_TIME + step))
            c.flush(step)
        c.shutdown()
    result = run_plan(tmp_path / "run", make_plan(mode="per_rank_reduce", ranks="0-1"))
    assert result.stream is not None  # one source at a time
    assert [b["rank"].unique().to_list() for b in result.batches()] == [[0], [1]]
    out = tmp_path / "out" / "loss.parquet"
    done = CliRunner().invoke(
        app, ["reduce", str(tmp_path / "run"), "--mode", "per_rank_reduce", "--out", str(out)]
    )
    assert done.exit_code == 0, done.output  # rank 0 recorded first, at the same time as rank 1
    assert "key 'loss' is recorded under more than one reduction: 3 record(s) under 'max'" in done.stderr
    assert "(by TrainActor_r2 (rank 2)) skipped" in done.stderr
    assert pl.read_parquet(out)["rank"].unique().sort().to_list() == [0, 1]


def test_another_tools_file_of_one_rank_is_streamed_with_its_source(tmp_path):
    """Footer statistics (rank min == max) make a foreign file one source's, so per_rank
    modes reduce it with that source alone; a file of several ranks is reduced with all."""
    rows = {"key": ["a"] * 4, "value": [1.0, 2.0, 3.0, 4.0], "reduction": ["mean"] * 4, "step": [0, 0, 1, 1]}
    write_foreign(tmp_path / "one.parquet", {**rows, "timestamp": [BASE_TIME] * 4, "rank": [3] * 4})
    assert [f.single_source for f in scan_run(tmp_path).report.files] == [("rank3", 3)]
    write_foreign(tmp_path / "two.parquet", {**rows, "timestamp": [BASE_TIME] * 4, "rank": [4, 5, 4, 5]})
    assert [f.single_source for f in scan_run(tmp_path).report.files] == [("rank3", 3), None]
    result = run_plan(tmp_path, make_plan(mode="per_rank_reduce"))
    assert result.frame.select("rank", "step", "value").rows() == [
        (3, 0, 1.5),
        (3, 1, 3.5),
        (4, 0, 1.0),
        (4, 1, 3.0),
        (5, 0, 2.0),
        (5, 1, 4.0),
    ]


def _foreign_rows(rng: np.random.Generator, rank: int, reductions: list[str]) -> dict:
    """Another tool's records of one rank: keys k0.. each under one of ``reductions``, 40
    steps, tied timestamps (first and last break ties by step, process, rank)."""
    keys = [f"k{i}" for i in range(len(reductions))]
    steps = np.repeat(np.arange(40), len(keys))
    return {
        "key": keys * 40, "value": rng.integers(-50, 50, len(steps)) / 8, "reduction": reductions * 40,
        "step": steps, "timestamp": BASE_TIME + steps // 4 * 1.0, "rank": [rank] * len(steps),
        "process": [f"gen_r{rank}"] * len(steps),
    }  # fmt: skip


def test_the_tie_columns_are_read_only_where_a_files_reductions_may_name_first_or_last(tmp_path):
    """Another tool's Parquet declares no keys; its footer's statistics bound its reduction
    column, so a run whose bounds leave out every spelling of first and last (in any case,
    padded with white space) reads no tie columns it does not group by (another tool's
    records are read with every required field, to check them: of the tie columns, only
    the process is left). A file whose bounds may hold one, a JSONL file (no statistics),
    a --reduce pattern of first or last each bring them back; a pattern '*' of another
    statistic decides every key, whatever the files recorded."""
    from metric_core.offline.engine.tasks import columns_read

    rng = np.random.default_rng(7)
    run = tmp_path / "run"
    run.mkdir()
    write_foreign(run / "a.parquet", _foreign_rows(rng, 0, ["mean", "sum", "max", "std"]))
    write_foreign(run / "b.parquet", _foreign_rows(rng, 1, ["min", "mean"]), dictionary=False)

    def read(**plan: object) -> list[str]:
        return columns_read(make_plan(**plan), scan_run(run))

    assert [f.reductions for f in scan_run(run).report.files] == [("max", "sum"), ("mean", "min")]
    assert read() == ["key", "reduction", "step", "value"]
    assert read(by="time", every="5s") == ["key", "reduction", "timestamp", "value"]
    everything = ["key", "process", "rank", "reduction", "step", "timestamp", "value"]
    assert read(mode="per_rank_reduce") == everything  # the columns it groups by
    assert read(reduce=["k1=last"]) == everything
    may_hold = (
        ["FIRST", "MAX"],  # (FIRST, MAX) and (LAST, MEAN): only in capitals
        ["LAST", "MEAN"],
        ["Last", "sum"],
        ["MEAN", "sum"],  # (MEAN, sum) holds "last"
        [" last", "mean"],  # read as "last": white space sorts below "!"
        ["last ", "mean"],  # from "last " on: texts that begin with "last"
        ["count", "last\u3000", "sum"],  # ASCII bounds, "last\u3000" between them
        ["mean", "Sum", "first\t"],
    )
    for reductions in may_hold:
        write_foreign(run / "c.parquet", _foreign_rows(rng, 2, reductions))
        assert read() == everything, reductions
        assert read(reduce=["*=p90"]) == ["key", "reduction", "step", "value"]
        assert read(reduce=["k*=p90"]) == everything  # a pattern that may leave a key its own
        _ = run_plan(run, make_plan()).frame  # read with its tie columns: no error
    (run / "c.parquet").unlink()
    pl.DataFrame(_foreign_rows(rng, 3, ["mean"])).write_ndjson(run / "d.jsonl")
    assert read() == everything  # no statistics: anything may be there


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_run_read_without_its_tie_columns_gives_the_bits_of_one_read_with_them(
    tmp_path, kernel, monkeypatch
):
    """The same records as Parquet (whose footers leave the process unread where no tie is
    broken) and as JSONL (no footer: every column read) reduce to the same bits, by step, by
    time and per rank, and a record whose timestamp is no clock's is skipped in both."""
    rng = np.random.default_rng(11)
    parquet_run, jsonl_run = tmp_path / "parquet", tmp_path / "jsonl"
    parquet_run.mkdir()
    jsonl_run.mkdir()
    for rank in range(3):
        rows = _foreign_rows(rng, rank, ["mean", "sum", "max", "std", "min"])
        if rank == 1:
            rows["timestamp"] = np.where(np.arange(len(rows["step"])) == 17, np.nan, rows["timestamp"])
        write_foreign(parquet_run / f"r{rank}.parquet", rows)
        pl.DataFrame(rows).write_ndjson(jsonl_run / f"r{rank}.jsonl")
    decoded: set[str] = set()  # the columns pyarrow decoded of the Parquet files
    real = pq.ParquetFile.read_row_group

    def reading(self, i, columns=None, **kwargs):
        decoded.update(columns or self.schema_arrow.names)
        return real(self, i, columns=columns, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", reading)
    with kernel_of(kernel):
        for plan in (make_plan(), make_plan(by="time", every="3s"), make_plan(mode="per_rank_reduce")):
            decoded.clear()
            read, everything = run_plan(parquet_run, plan), run_plan(jsonl_run, plan)
            assert_same(everything.frame, read.frame, {}, str(plan))
            assert read.scan.report.skipped_records == everything.scan.report.skipped_records == 1
            assert ("process" in decoded) == (plan.mode.value == "per_rank_reduce"), decoded


def test_a_first_or_last_the_footer_statistics_left_out_is_an_error_that_says_so(tmp_path, monkeypatch):
    """A Parquet footer whose statistics say its reduction column holds no first or last,
    where a record names one (statistics a writer got wrong): a clear error, never a
    result without the columns that break its ties."""
    rng = np.random.default_rng(3)
    write_foreign(tmp_path / "a.parquet", _foreign_rows(rng, 0, ["mean", "last"]))
    monkeypatch.setattr(parquet, "_footer_bounds", lambda path, name: ("max", "sum"))
    with pytest.raises(MetricLogError, match="footer statistics of its Parquet file bound the reduction"):
        _ = run_plan(tmp_path, make_plan()).frame


def test_percentile_values_spill_to_a_temporary_directory_and_give_the_same_bits(many_files, monkeypatch):
    import tempfile

    plan = make_plan(reduce=["trainer/*=p90", "policy/*=median", "ext/*=p10"])
    held = run_plan(many_files, plan).frame
    made: list[str] = []
    real = tempfile.TemporaryDirectory

    def recording(*args, **kwargs):
        made.append((d := real(*args, **kwargs)).name)
        return d

    monkeypatch.setattr(accumulator, "SPILL_VALUES", 500)
    monkeypatch.setattr(tempfile, "TemporaryDirectory", recording)
    spilled = run_plan(many_files, plan).frame
    assert made and not any(Path(d).exists() for d in made)  # spilled, then removed
    assert_same(held, spilled, {}, "spilled")


@pytest.mark.parametrize(
    "plan",
    [{}, {"mode": "per_rank_reduce"}, {"by": "time", "every": 1.0}, {"mode": "per_rank_no_reduce"}],
    ids=["global", "per_rank", "by_time", "raw"],
)
def test_another_tools_bad_rows_are_skipped_whichever_way_its_file_is_read(tmp_path, monkeypatch, plan):
    """A null value and a timestamp before 1970 are skipped and counted, once, whether the
    file is read by polars or through its dictionaries, and checked with the read or before:
    the result is that of the file without them."""
    rows = {
        "key": ["a", "a", "a", "a"],
        "value": [1.0, None, 3.0, 5.0],
        "reduction": ["mean"] * 4,
        "step": [0, 0, 0, 1],
        "timestamp": [BASE_TIME, BASE_TIME + 0.1, -5.0, BASE_TIME + 2.5],
        "rank": [0, 0, 0, 0],
    }
    (tmp_path / "bad").mkdir()
    (tmp_path / "clean").mkdir()
    write_foreign(tmp_path / "bad" / "other.parquet", rows)
    write_foreign(tmp_path / "clean" / "other.parquet", {k: [v[0], v[3]] for k, v in rows.items()})
    truth = run_plan(tmp_path / "clean", make_plan(**plan)).frame
    assert truth.height == 2
    for threshold in (0, 10**12):
        monkeypatch.setattr(engine.tasks, "DICTIONARY_READ_RECORDS", threshold)
        result = run_plan(tmp_path / "bad", make_plan(**plan))
        assert result.frame.equals(truth), threshold
        assert result.scan.report.skipped_records == 2


@pytest.mark.parametrize("row_groups", [False, True], ids=["files", "row_groups"])
def test_raw_mode_streams_a_source_in_time_order_and_gives_the_bits_of_one_sort(
    tmp_path, monkeypatch, row_groups
):
    """per_rank_no_reduce hands over a source in frames of at most RAW_BATCH_ROWS records,
    read a file (or, through the dictionaries, a Parquet row group) at a time; the rows are
    those of one stable sort of each source's files by time."""
    write_collector_run(tmp_path, SOURCES[:2], steps=30, seed=4, segment_records=50)
    n = 40  # another tool's file of one rank, in row groups of 7 rows, two of them interleaved
    times = BASE_TIME + np.arange(n, dtype=np.float64)
    times[14:28] = np.concatenate([times[14:28:2], times[15:28:2]])
    times[30] = times[29]  # a tie
    write_foreign(
        tmp_path / "other.parquet",
        {
            "key": ["ext/a"] * n,
            "value": np.arange(n) * 1.5,
            "reduction": ["mean"] * n,
            "step": np.arange(n) // 4,
            "timestamp": times,
            "rank": [9] * n,
        },
        row_group_size=7,
    )
    monkeypatch.setattr(engine.tasks, "DICTIONARY_READ_RECORDS", 0 if row_groups else 10**12)
    monkeypatch.setattr(engine.raw, "RAW_BATCH_ROWS", 20)
    result = run_plan(tmp_path, make_plan(mode="per_rank_no_reduce"))
    batches = list(result.batches())
    ours = sorted(f for f in tmp_path.glob("*.parquet") if f.name != "other.parquet")
    assert len(ours) >= 6
    truth = pl.concat(
        [pl.read_parquet(f).select(result.plan.output_columns) for f in ours]
        + [
            pl.read_parquet(tmp_path / "other.parquet")
            .with_columns(process=pl.lit("rank9"))
            .select(result.plan.output_columns)
        ],
        how="vertical_relaxed",
    ).sort("process", "rank", "timestamp", maintain_order=True)
    got = pl.concat(batches)
    assert got.equals(truth.with_columns(pl.col("process", "key", "reduction").cast(pl.String)))
    # every frame is at most RAW_BATCH_ROWS, the foreign file's too (held whole unless its
    # row groups say their times)
    assert max(b.height for b in batches) <= 20


@pytest.mark.parametrize("row_groups", [False, True], ids=["files", "row_groups"])
def test_raw_mode_sets_aside_the_sources_of_a_file_of_many_and_gives_the_bits_of_one_sort(
    tmp_path, monkeypatch, row_groups
):
    """Another tool's files that each hold several sources, interleaved, out of time order
    and with ties, one of them also a source of the writer's files: read once, set aside
    by source (not held whole), each source handed over as one stable sort of its own
    files, then its rows of the others, gives it."""
    write_collector_run(tmp_path, SOURCES[:2], steps=30, seed=5, segment_records=50)
    process, rank = SOURCES[0]
    rng = np.random.default_rng(7)
    files = []
    (tmp_path / "other").mkdir()
    for name, n, base in (("a.parquet", 90, 0.0), ("b.parquet", 60, 1000.0)):
        ranks = rng.choice([rank, 7, 8], n)
        times = BASE_TIME + base + rng.integers(0, 25, n).astype(np.float64)  # ties, unsorted
        frame = {
            "key": ["ext/a"] * n,
            "value": rng.normal(size=n),
            "reduction": ["mean"] * n,
            "step": rng.integers(0, 30, n),
            "timestamp": times,
            "rank": ranks,
            "process": [process if r == rank else f"Other_r{r}" for r in ranks],
        }
        write_foreign(tmp_path / "other" / name, frame, row_group_size=9)
        files.append(tmp_path / "other" / name)
    monkeypatch.setattr(engine.tasks, "DICTIONARY_READ_RECORDS", 0 if row_groups else 10**12)
    monkeypatch.setattr(engine.raw, "RAW_BATCH_ROWS", 20)
    read_whole = []
    real_read_part = engine.raw.read_part
    monkeypatch.setattr(
        engine.raw, "read_part", lambda *a, **k: read_whole.append(a[2]) or real_read_part(*a, **k)
    )
    result = run_plan(tmp_path, make_plan(mode="per_rank_no_reduce"))
    got = pl.concat(list(result.batches()))
    columns = result.plan.output_columns
    ours = sorted(tmp_path.glob("*.parquet"))
    truth = pl.concat(
        [pl.read_parquet(f).select(columns) for f in [*ours, *files]],
        how="vertical_relaxed",
    ).sort("process", "rank", "timestamp", maintain_order=True)
    assert got.equals(truth.with_columns(pl.col("process", "key", "reduction").cast(pl.String)))
    files_of = result.scan.report.files
    foreign = {fid for fid in result.scan.file_ids if files_of[fid].path.parent.name == "other"}
    assert not foreign & set(read_whole)  # never read whole to be split by source


@pytest.mark.parametrize("seed", range(6))
def test_in_time_order_equals_one_stable_sort(seed):
    """Parts with random, overlapping (or unknown) time ranges and ties, read in any batch
    size: the rows of one stable sort of the parts concatenated in file order."""
    from metric_core.offline.engine.timeorder import Part, in_time_order

    rng = np.random.default_rng(seed)
    frames, parts = [], []
    for fid in range(int(rng.integers(1, 9))):
        n = int(rng.integers(0, 30))
        start = float(rng.integers(0, 20))
        ts = np.round(start + rng.uniform(0, rng.choice([0.5, 5, 40]), n))  # many ties
        frames.append(pl.DataFrame({"timestamp": ts, "fid": np.full(n, fid), "row": np.arange(n)}))
        known = n and rng.random() < 0.8
        parts.append(Part(fid, None, float(ts.min()) if known else -math.inf, n))
    truth = pl.concat(frames).sort("timestamp", maintain_order=True)
    for batch_rows in (1, 7, 1000):
        out = list(in_time_order(parts, lambda fid, groups: frames[fid], batch_rows))
        got = pl.concat(out) if out else truth.clear()
        assert got.equals(truth), batch_rows


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (
            {"keys": ["nothing/*"]},
            "keys='nothing/*' matches no key; the run's keys: a, policy/latency_s, policy/tokens, "
            "trainer/grad_norm, trainer/loss",
        ),
        ({"ranks": "7"}, "ranks='7' matches no record (no rank 7); the run's ranks: 0, 4-5"),
    ],
    ids=["key", "ranks"],
)
def test_raw_mode_with_filters_that_leave_nothing_is_no_data_whatever_the_files(tmp_path, plan, message):
    """A writer's file and another tool's file of two ranks (held, then split by source)."""
    from metric_core.errors import NoDataError

    write_collector_run(tmp_path, SOURCES[:1], steps=3)
    rows = {"key": ["a"] * 4, "value": [1.0, 2.0, 3.0, 4.0], "reduction": ["mean"] * 4, "step": [0, 0, 1, 1]}
    write_foreign(tmp_path / "two.parquet", {**rows, "timestamp": [BASE_TIME] * 4, "rank": [4, 5, 4, 5]})
    assert run_plan(tmp_path, make_plan(mode="per_rank_no_reduce")).frame.height > 4
    with pytest.raises(NoDataError) as err:
        list(run_plan(tmp_path, make_plan(mode="per_rank_no_reduce", **plan)).batches())
    assert str(err.value) == f"no record in {tmp_path} matches the filters: {message}"


def test_the_steps_no_task_still_to_come_can_hold_are_handed_over_and_dropped(tmp_path, monkeypatch):
    """Another tool's files, one rank each, rows in step order in many row groups: tasks of
    row groups are folded in step order, and the steps no later task can hold leave memory
    as they are done. Every statistic still equals numpy over the records (ties of first
    and last: by content, ``tie_order``; p90's values spilled to files between), globally, per
    rank and by time, while at most a few blocks of steps are ever held."""
    rng = np.random.default_rng(5)
    stats = ["mean", "sum", "std", "min", "max", "first", "last", "p90"]
    steps, ranks = 3000, 4
    step = np.repeat(np.arange(steps), len(stats) * 2)
    records = []
    for rank in range(ranks):
        rows = {
            "key": [f"k/{stat}" for stat in stats] * (steps * 2),
            "value": rng.normal(1e6, 3.0, len(step)).round(3),
            "reduction": stats * (steps * 2),
            "step": step,
            "timestamp": BASE_TIME + step * 0.01,  # ties within a step, and across ranks
            "rank": np.full(len(step), rank),
        }
        write_foreign(tmp_path / f"part-{rank}.parquet", rows, row_group_size=4000)
        records += [dict(zip(rows, r, strict=True)) for r in zip(*rows.values(), strict=True)]
    monkeypatch.setattr(engine.tasks, "DICTIONARY_READ_RECORDS", 0)
    monkeypatch.setattr(engine.tasks, "PARTITION_ROWS", 10_000)
    monkeypatch.setattr(accumulator, "SPILL_VALUES", 3_000)  # p90's values spill, and are taken back
    monkeypatch.setattr(accumulator, "SLICE_VALUES", 1_000)
    monkeypatch.setattr(engine.finish, "TAKEN_GROUPS", 2)  # steps are taken as soon as a block is done
    held: list[int] = []
    add = accumulator.Accumulator.add

    def counting(self, p):
        add(self, p)
        held.append(len(self.blocks))

    monkeypatch.setattr(accumulator.Accumulator, "add", counting)

    def truth(group: list[dict]) -> float:
        values = np.array([r["value"] for r in group])
        name = group[0]["reduction"]
        if name in ("first", "last"):
            order = [
                tie_order(r["timestamp"], r["step"], default_process_name(r["rank"]), r["rank"], r["value"])
                for r in group
            ]
            return float(group[order.index(min(order) if name == "first" else max(order))]["value"])
        if name == "p90":
            return float(np.percentile(values, 90))
        return float(
            {"mean": np.mean, "sum": np.sum, "std": np.std, "min": np.min, "max": np.max}[name](values)
        )

    t0 = BASE_TIME
    for mode, every in [("global_reduce", None), ("per_rank_reduce", None), ("global_reduce", 0.02)]:
        held.clear()
        frame = run_plan(tmp_path, make_plan(mode=mode, by="time" if every else "step", every=every)).frame
        groups: dict[tuple, list[dict]] = {}
        for r in records:
            bucket = r["step"] if every is None else t0 + math.floor((r["timestamp"] - t0) / every) * every
            groups.setdefault(
                (*((r["rank"],) if mode == "per_rank_reduce" else ()), bucket, r["key"]), []
            ).append(r)
        columns = [
            *(["rank"] if mode == "per_rank_reduce" else []),
            "window_start" if every else "step",
            "key",
        ]
        got = {tuple(row[:-2]): row[-2:] for row in frame.select(*columns, "value", "count").iter_rows()}
        assert set(got) == set(groups)
        for group_key, group in groups.items():
            value, count = got[group_key]
            assert count == len(group)
            assert value == pytest.approx(truth(group), rel=1e-12, abs=1e-9), (mode, group_key)
        buckets = frame.select(columns[-2]).n_unique()
        assert max(held) <= 3 < buckets / 256, (mode, max(held))  # blocks of 256 steps (windows)


def test_a_large_row_group_is_reduced_a_partition_at_a_time(tmp_path, monkeypatch):
    """A row group far larger than a partition is read once, in frames, and reduced a
    partition at a time (never held whole as states); every statistic still equals numpy
    over the records, first and last ties (one step, one source) going to the lowest and
    the highest value's bits."""
    rng = np.random.default_rng(11)
    stats = ["mean", "sum", "std", "min", "max", "first", "last", "p90"]
    steps = 400
    step = np.repeat(np.arange(steps), len(stats) * 3)
    rows = {
        "key": [f"k/{stat}" for stat in stats] * (steps * 3),
        "value": rng.normal(1e9, 2.0, len(step)),
        "reduction": stats * (steps * 3),
        "step": step,
        "timestamp": BASE_TIME + step * 0.5,  # every record of a step at one time: ties
        "rank": np.zeros(len(step), dtype=np.int64),
    }
    write_foreign(tmp_path / "one.parquet", rows)  # one row group of 9600 records
    assert pq.ParquetFile(tmp_path / "one.parquet").num_row_groups == 1
    monkeypatch.setattr(engine.tasks, "DICTIONARY_READ_RECORDS", 0)
    monkeypatch.setattr(engine.tasks, "PARTITION_ROWS", 1000)
    sizes: list[int] = []
    states = partials.partition_states

    def recording(df, *args, **kwargs):
        sizes.append(df.height)
        return states(df, *args, **kwargs)

    monkeypatch.setattr(partials, "partition_states", recording)
    frame = run_plan(tmp_path, make_plan()).frame
    assert max(sizes) <= 1000 and sum(sizes) == len(step)
    values = np.asarray(rows["value"])
    for (s, key), group in frame.group_by("step", "key"):
        picked = values[(step == s) & (np.asarray(rows["key"]) == key)]
        name = key.split("/")[1]
        want = {
            "mean": np.mean, "sum": np.sum, "std": np.std, "min": np.min, "max": np.max,
            "first": lambda v: v[np.argmin(v.view(np.int64))],
            "last": lambda v: v[np.argmax(v.view(np.int64))], "p90": lambda v: np.percentile(v, 90),
        }[name](picked)  # fmt: skip
        assert group["value"][0] == pytest.approx(want, rel=1e-12), (s, key)
        assert group["count"][0] == len(picked)


def test_a_reader_that_stops_early_leaves_no_thread_behind(many_files):
    """The engine's threads hand partitions over one at a time: a result closed after its
    first frame stops them."""
    import threading
    import time

    before = threading.active_count()
    batches = run_plan(many_files, make_plan(mode="per_rank_reduce")).batches()
    assert next(batches).height > 0
    batches.close()
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == before


def test_partitions_with_and_without_first_and_last_fold_together(tmp_path, monkeypatch):
    """States carry first/last only where a statistic needs them: a partition without them
    folded before and after one with them, into the same steps, loses nothing."""
    rng = np.random.default_rng(3)
    steps = np.repeat(np.arange(300), 2)
    for name, keys in [("a", ["m/mean", "m/max"]), ("b", ["t/first", "t/last"]), ("c", ["m/mean", "t/last"])]:
        rows = {
            "key": keys * 300,
            "value": rng.normal(5.0, 1.0, 600),
            "reduction": [k.split("/")[1] for k in keys] * 300,
            "step": steps,
            "timestamp": BASE_TIME + steps + rng.uniform(0, 0.5, 600),
            "rank": np.full(600, ord(name)),
        }
        write_foreign(tmp_path / f"{name}.parquet", rows)
    monkeypatch.setattr(engine.tasks, "DICTIONARY_READ_RECORDS", 0)
    monkeypatch.setattr(engine.tasks, "PARTITION_ROWS", 200)
    records = pl.read_parquet(sorted(tmp_path.glob("*.parquet")))
    records = records.with_columns(pl.col(pl.Categorical).cast(pl.String))
    frame = run_plan(tmp_path, make_plan()).frame
    assert frame.height == 300 * 4
    for (s, key), group in frame.group_by("step", "key"):
        rows = records.filter((pl.col("step") == s) & (pl.col("key") == key))
        values, times = rows["value"].to_numpy(), rows["timestamp"].to_numpy()
        want = {
            "mean": np.mean(values),
            "max": np.max(values),
            "first": values[np.argmin(times)],
            "last": values[np.argmax(times)],
        }[key.split("/")[1]]
        assert group["value"][0] == pytest.approx(want, rel=1e-15), (s, key)


def test_a_result_is_taken_a_slice_of_steps_at_a_time(tmp_path, monkeypatch):
    """The steps a task finishes are handed over in frames of about TAKEN_GROUPS groups
    (whole blocks of 256 steps), not all at once; the frames together are the same bits."""
    rng = np.random.default_rng(8)
    step = np.repeat(np.arange(2000), 3)
    for rank in range(2):
        rows = {
            "key": ["a/mean", "b/std", "c/p90"] * 2000,
            "value": rng.normal(0.0, 1.0, 6000),
            "reduction": ["mean", "std", "p90"] * 2000,
            "step": step,
            "timestamp": BASE_TIME + step * 0.1,
            "rank": np.full(6000, rank),
        }
        write_foreign(tmp_path / f"r{rank}.parquet", rows)
    for mode in ("global_reduce", "per_rank_reduce"):
        whole = run_plan(tmp_path, make_plan(mode=mode)).frame
        monkeypatch.setattr(engine.finish, "TAKEN_GROUPS", 10)
        frames = list(run_plan(tmp_path, make_plan(mode=mode)).batches())
        monkeypatch.undo()
        sources = 1 if mode == "global_reduce" else 2
        assert len(frames) == sources * math.ceil(2000 / 256)
        assert all(f["step"].max() // 256 == f["step"].min() // 256 for f in frames)
        assert pl.concat(frames).equals(whole)


def test_a_stream_left_half_read_by_an_error_does_not_keep_the_process_alive(many_files):
    """A script that reads one frame of a result and then fails exits (daemon threads, the
    pool stopped when the stream is dropped), with the error, not a hang."""
    script = f"""
import metric_core.offline.engine as engine
from metric_core.offline.plan import make_plan
engine.tasks.PARTITION_ROWS = 50  # many partitions: the threads wait to hand theirs over
batches = engine.run_plan({str(many_files)!r}, make_plan(mode="per_rank_reduce")).batches()
next(batches)
raise SystemExit("failed while reading")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "failed while reading" in done.stderr


def test_a_thread_done_with_its_task_starts_a_later_one_while_an_earlier_one_is_unread(tmp_path, monkeypatch):
    """Tasks are handed over in order, but a thread that finished its task (of one
    partition, as a writer's row group is) goes on to a later one: task 0 finishes only
    once task 2 has started, which no thread would do if only as many tasks as threads
    were in flight, or if a task's end waited for the reader."""
    import threading

    for i in range(6):  # six files of ten steps each, one after the other
        write_collector_run(tmp_path, [(f"TrainActor_r{i}", i)], steps=10, first_step=10 * i, seed=i)
    want = run_plan(tmp_path, make_plan()).frame
    monkeypatch.setattr(engine.pool.pl, "thread_pool_size", lambda: 2)
    monkeypatch.setattr(engine.tasks, "PARTITION_ROWS", 200)  # tasks of one partition, of a file or two
    lock, later, firsts = threading.Lock(), threading.Semaphore(0), []
    work = engine.tasks.TaskWork.__call__

    def paced(self, task, **kwargs):  # task 0 (step 0 on) waits until tasks 1 and 2 have started
        with lock:
            firsts.append(task.lo)
        if task.lo > 0:
            later.release()
        elif not (later.acquire(timeout=20) and later.acquire(timeout=20)):
            raise AssertionError("task 2 never started while task 0 waited")
        yield from work(self, task, **kwargs)

    monkeypatch.setattr(engine.tasks.TaskWork, "__call__", paced)
    got = run_plan(tmp_path, make_plan()).frame
    assert len(firsts) >= 3 and min(firsts) == 0, firsts
    assert got.equals(want)


def test_per_rank_reduce_of_files_holding_several_sources_is_in_source_order(tmp_path, monkeypatch):
    """One file of two ranks, reduced as one, step range after step range: the output is
    still a source at a time (sorted by process, rank, step, key), long and --wide."""
    step = np.repeat(np.arange(600), 4)
    write_foreign(
        tmp_path / "both.parquet",
        {
            "key": ["a", "b"] * 1200,
            "value": np.arange(2400, dtype=np.float64),
            "reduction": ["mean", "max"] * 1200,
            "step": step,
            "timestamp": BASE_TIME + step.astype(np.float64),
            "rank": np.tile([0, 0, 1, 1], 600),
        },
    )
    monkeypatch.setattr(engine.finish, "TAKEN_GROUPS", 1)  # a frame a block of 256 steps
    plan = make_plan(mode="per_rank_reduce")
    frame = run_plan(tmp_path, plan).frame
    assert frame.height == 2400
    assert frame.equals(frame.sort("process", "rank", "step", "key"))
    wide = pl.concat(list(engine.pivot_wide(run_plan(tmp_path, plan).batches(), plan)))
    assert wide.equals(wide.sort("process", "rank", "step")) and wide.height == 1200


def test_by_time_starts_at_the_first_record_kept_when_a_cast_skips_the_earliest(tmp_path):
    """Another tool's values stored as text: the earliest record's value is not a number, so
    it is skipped, and the footer's lowest timestamp is not where the windows start."""
    rows = {"key": ["a"] * 3, "value": ["x", "1.0", "2.0"], "reduction": ["mean"] * 3, "step": [0, 1, 2]}
    rows |= {"timestamp": [BASE_TIME, BASE_TIME + 1.5, BASE_TIME + 2.5], "rank": [0, 0, 0]}
    write_foreign(tmp_path / "text.parquet", rows)
    assert parquet.kept_first_times(tmp_path / "text.parquet") is None
    result = run_plan(tmp_path, make_plan(by="time", every=1.0))
    assert result.frame["window_start"].to_list() == [BASE_TIME + 1.5, BASE_TIME + 2.5]
    assert result.scan.report.skipped_records == 1


@pytest.mark.parametrize("spill", [700, 10**9], ids=["spilled", "held"])
def test_values_spilled_across_many_takes_all_come_back(tmp_path, monkeypatch, spill):
    """median/pNN values spilled to many files, taken back over many takes: every
    group's p99 and median still equal numpy's over its records. (Spill files were once
    named by how many were live, so a spill after a take could take the name of one still
    held, and a take read values of other steps, or none: wrong numbers, NaN.)"""
    rng = np.random.default_rng(11)
    steps, keys, ranks = 2400, 5, 3
    truth: dict[tuple[int, str], list[float]] = {}
    for rank in range(ranks):
        step = np.repeat(np.arange(steps), keys)
        key = np.tile([f"k{k}" for k in range(keys)], steps)
        value = rng.normal(0.0, 1.0, len(step))
        rows = {
            "key": key.tolist(),
            "value": value,
            "reduction": ["p99" if k[-1] in "024" else "median" for k in key],
            "step": step,
            "timestamp": BASE_TIME + step * 0.01,
            "rank": np.full(len(step), rank),
        }
        write_foreign(tmp_path / f"part-{rank}.parquet", rows, row_group_size=1000)
        for s, k, v in zip(step.tolist(), key.tolist(), value.tolist(), strict=True):
            truth.setdefault((s, k), []).append(v)
    monkeypatch.setattr(engine.tasks, "DICTIONARY_READ_RECORDS", 0)
    monkeypatch.setattr(engine.tasks, "PARTITION_ROWS", 500)
    monkeypatch.setattr(accumulator, "SPILL_VALUES", spill)  # dozens of spill files, or none
    monkeypatch.setattr(accumulator, "SLICE_VALUES", 400)  # a take's quantiles in several queries
    slices = value_slices(monkeypatch)
    monkeypatch.setattr(engine.finish, "TAKEN_GROUPS", 2)  # a take a block of 256 steps
    frame = run_plan(tmp_path, make_plan()).frame
    got = {(s, k): v for s, k, v in frame.select("step", "key", "value").iter_rows()}
    assert set(got) == set(truth)
    for (s, k), values in truth.items():
        want = np.percentile(values, 99 if k[-1] in "024" else 50)
        assert got[s, k] == pytest.approx(want, rel=1e-15, abs=1e-15), (s, k)
    assert max(slices) > 1  # held or spilled, a take's values are split into slices


def test_a_state_of_counts_alone_where_every_statistic_is_a_percentile(tmp_path, monkeypatch):
    """A partition whose every group is median/pNN keeps its groups' counts alone (their
    values are kept apart), one of means the exact sums too, one with std the exact squares
    too; folded together (a mean's groups with and without the squares, p99's with and
    without sums), each statistic and count still equals numpy's over its records. (The
    partitions of frames, ``partition_states``: batches taken as read, where the records of
    means and stds go to the C table as rows, are test_arrow_rows.py's.)"""
    monkeypatch.setattr(partials, "batch_partial", lambda *args, **kwargs: None)
    rng = np.random.default_rng(3)
    steps = 40
    truth: dict[tuple[int, str], list[float]] = {}
    reductions = {"q": "p99", "m": "mean", "s": "std"}
    for name, keys in [("a", ["q"]), ("b", ["m", "q"]), ("c", ["q"]), ("d", ["s", "q", "m"])]:
        value = rng.normal(1e6, 2.0, steps * 3 * len(keys))
        step = np.repeat(np.arange(steps), 3 * len(keys))
        key = keys * (steps * 3)
        rows = {"key": key, "value": value, "reduction": [reductions[k] for k in key], "step": step}
        write_foreign(
            tmp_path / f"{name}.parquet", {**rows, "timestamp": BASE_TIME + step, "rank": [0] * len(step)}
        )
        for s, k, v in zip(step.tolist(), key, value.tolist(), strict=True):
            truth.setdefault((s, k), []).append(v)
    blocks: list[int] = []
    exacts: list[str] = []  # what each partition's exact sums held
    add = accumulator.Accumulator.add

    def fields(self, p):
        add(self, p)
        blocks.append(max(b.fields for b in self.blocks.values()))
        exacts.append("none" if p.exact is None else "sums" if p.exact.squares is None else "squares")

    monkeypatch.setattr(accumulator.Accumulator, "add", fields)
    monkeypatch.setattr(engine.tasks, "PARTITION_ROWS", 60)  # each file alone in its partitions
    frame = run_plan(tmp_path, make_plan()).frame
    got = {(s, k): (v, n) for s, k, v, n in frame.select("step", "key", "value", "count").iter_rows()}
    assert set(got) == set(truth)
    for (s, k), values in truth.items():
        want = {"q": lambda v: np.percentile(v, 99), "m": np.mean, "s": np.std}[k](np.array(values))
        assert got[s, k] == (pytest.approx(want, rel=1e-12), len(values)), (s, k)
    # a's counts, b's exact sums (mean), d's exact squares (std): m's groups fold sums with squares
    assert set(blocks) == {partials.COUNTED}  # no min, max, first or last: counts alone
    assert set(exacts) == {"none", "sums", "squares"}

    blocks.clear()
    exacts.clear()
    quantiles = run_plan(tmp_path, make_plan(reduce=["*=p99"])).frame
    assert set(blocks) == {partials.COUNTED}  # the whole run: counts alone
    assert set(exacts) == {"none"}
    for s, k, v, n in quantiles.select("step", "key", "value", "count").iter_rows():
        assert (v, n) == (pytest.approx(np.percentile(truth[s, k], 99), rel=1e-15), len(truth[s, k])), (s, k)


@pytest.mark.parametrize("kernel_name", KERNELS)
@pytest.mark.parametrize("stat", ["median", "p50", "p99", "p99.9", "p37.5", "p0", "p100"])
def test_median_and_percentiles_are_numpys_to_the_bit(tmp_path, stat, kernel_name):
    """median and pNN equal np.median and np.percentile bit for bit: groups of 1 to 9
    values of both signs around zero (where a formula that differs rounds far off, in
    relative terms), huge values whose sum overflows, zeros, and a NaN. (Which of -0.0 and
    0.0 a percentile gives where they tie depends on the sort, numpy's or polars'; a
    median's sum starts at 0.0, so its sign does not.)"""
    rng = np.random.default_rng(17)
    steps, key, value = [], [], []
    for step in range(600):
        n = 1 + step % 9
        kind = step % 5
        if kind == 0:
            v = rng.normal(0.0, 8.0, n)  # both signs: the two middle values nearly cancel
        elif kind == 1:
            v = np.full(n, 1.7e308) * rng.choice([-1.0, 1.0], n)  # their sum overflows
        elif kind == 2:
            v = rng.choice([-0.0, 0.0, 1e-300], n)
        else:
            v = rng.normal(1e6, 3.0, n)
        if step == 7:
            v[0] = np.nan
        steps += [step] * n
        key += ["k"] * n
        value += v.tolist()
    write_foreign(
        tmp_path / "part.parquet",
        {
            "key": key,
            "value": value,
            "reduction": ["mean"] * len(key),
            "step": steps,
            "timestamp": BASE_TIME + np.array(steps, dtype=float),
            "rank": [0] * len(key),
        },
    )
    with kernel_of(kernel_name):  # order statistics by the extension's selection, or polars' sort
        got = run_plan(tmp_path, make_plan(reduce=[f"*={stat}"])).frame
    by_step = {s: np.array([v for s2, v in zip(steps, value, strict=True) if s2 == s]) for s in set(steps)}
    for s, v, n in got.select("step", "value", "count").iter_rows():
        values = by_step[s]
        with np.errstate(over="ignore", invalid="ignore"):  # numpy's own, on the huge values
            want = np.median(values) if stat == "median" else np.percentile(values, float(stat[1:]))
        assert n == len(values)
        if stat == "median":  # to the bit, the sign of a zero too
            assert np.array([v]).view(np.int64)[0] == np.array([want]).view(np.int64)[0], (s, values, v, want)
        else:  # a tie of -0.0 and 0.0 gives either, as the sort has it
            assert np.array_equal([v], [want], equal_nan=True), (s, values, v, want)


@pytest.mark.parametrize(
    "args",
    [{}, {"mode": "per_rank_reduce"}, {"reduce": ["trainer/*=std", "policy/*=p90", "ext/b=first"]}],
    ids=["global", "per_rank", "overrides"],
)
def test_how_groups_are_held_and_keys_typed_changes_no_bit(many_files, monkeypatch, args):
    """Groups placed a few at a time into chunks of a few (each group folded in the order
    its states came), and keys handed over as text past the interning budget: the same
    bits as the defaults, which hold everything in one chunk and keys as Categorical."""
    monkeypatch.setattr(engine.tasks, "DICTIONARY_READ_RECORDS", 0)
    want = run_plan(many_files, make_plan(**args)).frame
    monkeypatch.setattr(accumulator, "CHUNK_GROUPS", 16)
    monkeypatch.setattr(accumulator, "LOOSE_GROUPS", 8)
    monkeypatch.setattr(accumulator, "LOOSE_PARTS", 2)
    monkeypatch.setattr(read.interned, "KEY_BUDGET", 0)  # every frame's keys as text
    got = run_plan(many_files, make_plan(**args)).frame
    assert want.height > 100 and got.equals(want)


@pytest.mark.parametrize(
    "args",
    [{"mode": "per_rank_reduce"}, {"mode": "per_rank_reduce", "by": "time", "every": "1s"}, {}],
    ids=["per_rank", "per_rank-by-time", "global"],
)
@pytest.mark.parametrize("loose", [16, 4096], ids=["settled-often", "settled-late"])
def test_new_groups_placed_as_chunks_of_their_own_change_no_bit(tmp_path, monkeypatch, args, loose):
    """A source's partitions bring steps past every group held: their groups are placed as
    chunks of their own (``_Block._appended``), joined while the one before is no more than
    twice their size, split past twice CHUNK_GROUPS; partitions with no exact sums (only min
    keys), without squares (no std key yet) and with them follow one another, a rank's
    second file repeats steps of its first (placed among the others, as before). Settled
    often, or late (then loose partitions of a window's steps hold one group twice: those
    are not all new). The same bits as when every group is placed among the others, in
    every mode."""
    rng = np.random.default_rng(5)
    for rank in range(2):
        for part, steps in enumerate((np.arange(0, 900), np.arange(850, 1000))):
            step = np.repeat(steps, 4)
            key = np.tile(np.array(["a", "b", "c", "d"]), len(steps))
            keep = (key == "b") | ((key == "a") & (step >= 300)) | ((key == "c") & (step >= 61))
            keep |= (key == "d") & (step >= 61) & (step % 3 == 0)  # steps 0-60 (a partition): min alone
            step, key = step[keep], key[keep]
            n = len(step)
            reductions = {"a": "mean", "b": "min", "c": "std", "d": "sum"}
            rows = {
                "key": key, "value": rng.integers(-50, 50, n) * 0.1 + rng.choice([0.0, 1e12], n),
                "reduction": [reductions[k] for k in key], "step": step,
                "timestamp": BASE_TIME + step.astype(float) * 0.5, "rank": np.full(n, rank),
            }  # fmt: skip
            write_foreign(tmp_path / f"r{rank}-{part}.parquet", rows, row_group_size=173)
    monkeypatch.setattr(engine.tasks, "PARTITION_ROWS", 61)
    monkeypatch.setattr(accumulator, "CHUNK_GROUPS", 100)
    monkeypatch.setattr(accumulator, "LOOSE_GROUPS", loose)
    appended, joined = [], []
    real_appended, real_joined = accumulator._Block._appended, accumulator._Chunk.joined

    def counting_appended(self):
        appended.append(real_appended(self))
        return appended[-1]

    def counting_joined(self, after):
        joined.append(len(self.ids) + len(after.ids))
        return real_joined(self, after)

    def counting_split(chunk):
        pieces = real_split(chunk)
        split.append(len(pieces))
        return pieces

    split, real_split = [], accumulator._split
    monkeypatch.setattr(accumulator._Block, "_appended", counting_appended)
    monkeypatch.setattr(accumulator._Chunk, "joined", counting_joined)
    monkeypatch.setattr(accumulator, "_split", counting_split)
    got = run_plan(tmp_path, make_plan(**args)).frame
    monkeypatch.setattr(accumulator._Block, "_appended", lambda self: False)
    want = run_plan(tmp_path, make_plan(**args)).frame
    assert want.height > 400 and got.equals(want)
    if args.get("mode") == "per_rank_reduce" and loose == 16:
        assert True in appended and False in appended and joined and max(split) > 1  # each way
        assert max(joined) <= 2 * accumulator.CHUNK_GROUPS
    elif args.get("mode") == "per_rank_reduce":
        assert False in appended  # partitions held loose together, not all new


def test_many_distinct_keys_read_as_text_equal_numpy(tmp_path):
    """3,000 distinct keys, past a budget of 1,000 interned keys: the first row groups'
    keys come as Categorical, the later ones' as text, partitions mix both, and every group
    is numpy's mean."""
    rng = np.random.default_rng(11)
    n = 30_000
    keys = np.char.add("k/", (np.arange(n) // 10).astype("U4"))  # 400 of them a row group
    steps = rng.integers(0, 3, n)
    values = rng.standard_normal(n) + 1e6
    rows = {
        "key": keys, "value": values, "reduction": ["mean"] * n, "step": steps,
        "timestamp": BASE_TIME + steps.astype(float), "rank": np.zeros(n, dtype=np.int64),
    }  # fmt: skip
    write_foreign(tmp_path / "wide.parquet", rows, dictionary=False, row_group_size=4000)
    # In a process of its own: the keys admitted are counted for the life of the process,
    # and this one's earlier tests admitted some.
    script = f"""
import json, sys
from metric_core.offline import engine, read
from metric_core.offline.plan import make_plan
engine.tasks.DICTIONARY_READ_RECORDS = 0
engine.tasks.PARTITION_ROWS = 5000
read.interned.KEY_BUDGET = 1000
admitted = []
categorical_keys = read.interned.categorical_keys
def counting(distinct):
    admitted.append(categorical_keys(distinct))
    return admitted[-1]
read.parquet.categorical_keys = counting
engine.run_plan({str(tmp_path)!r}, make_plan()).frame.write_parquet({str(tmp_path / "out.parquet")!r})
print(json.dumps(admitted))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert set(json.loads(done.stdout)) == {True, False}
    frame = pl.read_parquet(tmp_path / "out.parquet")
    got = {(s, k): v for s, k, v in frame.select("step", "key", "value").iter_rows()}
    truth = pl.DataFrame({"step": steps, "key": keys, "value": values}).group_by("step", "key").agg("value")
    assert len(got) == truth.height
    for s, k, vs in truth.iter_rows():
        assert got[s, k] == pytest.approx(np.mean(vs), rel=1e-15), (s, k)


def test_a_partitions_index_is_the_size_of_its_rows_whatever_the_string_codes():
    """Keys and a reduction whose Categorical codes came late (after 50,000 other strings):
    the index of a partition's labels stays the size of its rows (it once allocated the
    product of the codes' spans: 830 MB here, 24 GB on a run of 1M keys)."""
    import tracemalloc
    import uuid

    tag = uuid.uuid4().hex
    pl.Series([f"{tag}-junk-{i}" for i in range(50_000)]).cast(pl.Categorical)
    n = 2000
    records = pl.DataFrame(
        {
            "key": [f"{tag}-k{i}" for i in range(n)],
            "value": np.arange(n, dtype=float),
            "reduction": [f"{tag}-mean"] * n,
            "step": np.zeros(n, dtype=np.int64),
            "timestamp": np.full(n, BASE_TIME),
            "rank": np.zeros(n, dtype=np.int64),
        }
    ).with_columns(pl.col("key", "reduction").cast(pl.Categorical))
    plan = make_plan(reduce=["*=mean"])
    tracemalloc.start()
    try:
        frame = engine.reduce_records(plan, records, None, engine.KeyReductions())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 50 * 2**20, f"{peak / 2**20:.0f} MiB traced"
    assert frame.sort("key")["value"].to_list() == [float(i) for i in sorted(range(n), key=lambda i: f"k{i}")]


def test_a_step_of_more_percentile_values_than_a_slice_is_taken_in_shares_of_its_keys(tmp_path, monkeypatch):
    """One step holding 6,000 p90 values of 600 keys, against slices of 500 values: the
    step's groups are computed a share at a time (its keys' combos modulo 12), and each is
    numpy's percentile of its values; a median key beside them is taken from the same
    slices."""
    rng = np.random.default_rng(23)
    n = 6000
    keys = np.array([f"k/{i % 600}" if i % 10 else f"m/{i % 7}" for i in range(n)])
    values = rng.normal(5.0, 2.0, n)
    zeros = np.zeros(n, dtype=np.int64)
    rows = {
        "key": keys, "value": values, "reduction": np.where(np.char.startswith(keys, "k"), "p90", "median"),
        "step": zeros, "timestamp": np.full(n, BASE_TIME), "rank": zeros,
    }  # fmt: skip
    write_foreign(tmp_path / "one_step.parquet", rows)
    monkeypatch.setattr(accumulator, "SLICE_VALUES", 500)
    slices = value_slices(monkeypatch)
    frame = run_plan(tmp_path, make_plan()).frame
    assert max(slices) == 12
    assert frame.height == len(set(keys.tolist()))
    for key, value, count in frame.select("key", "value", "count").iter_rows():
        mine = values[keys == key]
        want = np.median(mine) if key.startswith("m/") else np.percentile(mine, 90)
        assert (value, count) == (want, len(mine)), key


@pytest.mark.parametrize("writer", ["metric_core", "another tool"])
def test_renamed_files_give_every_mode_the_same_bits(tmp_path, writer):
    """The fold order comes from the files' contents, not their names: names that sort the
    other way round change no bit of any result (sums of twelve ranks' values of a wide
    range, in a fixed order of names, would change their last bits)."""
    run = tmp_path / "run"
    rng = np.random.default_rng(11)
    for rank in range(12):
        values = rng.lognormal(0.0, 8.0, size=(40, 16))  # wide range: the order shows in the last bits
        if writer == "metric_core":
            c = MetricCollector(run, rank=rank, process_name=f"w{rank:02d}")
            for step in range(40):
                for v in values[step]:
                    c.record("x", float(v), Reduce.MEAN)
                c.flush(step)
            c.shutdown()
        else:
            run.mkdir(exist_ok=True)
            steps = np.repeat(np.arange(40), 16)
            write_foreign(
                run / f"r{rank:02d}.parquet",
                {
                    "key": ["x"] * steps.size,
                    "value": values.ravel(),
                    "reduction": ["mean"] * steps.size,
                    "step": steps,
                    "timestamp": BASE_TIME + steps + rank / 100,
                    "rank": [rank] * steps.size,
                },
            )

    def results() -> list[pl.DataFrame]:
        modes = ("global_reduce", "per_rank_reduce", "per_rank_no_reduce")
        return [reduce_run(run, mode=m) for m in modes] + [reduce_run(run, by="time", every=1.5)]

    before = results()
    files = sorted(p for p in run.iterdir() if p.suffix == ".parquet")
    assert len(files) == 12
    for i, path in enumerate(files):  # the first file's name now sorts last
        path.rename(path.with_name(f"{len(files) - i:02d}-{path.name}"))
    after = results()
    for b, a in zip(before, after, strict=True):
        assert b.columns == a.columns and b.height == a.height > 0
        for column in b.columns:
            if b[column].dtype == pl.Float64:  # to the bit
                assert b[column].to_numpy().tobytes() == a[column].to_numpy().tobytes(), column
            else:
                assert b[column].equals(a[column]), column


def test_another_tools_bad_rows_are_counted_once_when_a_mixed_key_is_looked_up_mid_read(
    tmp_path, monkeypatch
):
    """A key under two reductions in another tool's file sends the engine back to the file
    for its first record while the file's row groups are being read and checked: its bad
    rows are counted once, as the truth has them."""
    monkeypatch.setattr(engine.tasks, "DICTIONARY_READ_RECORDS", 0)  # row groups, read in parts
    n = 400
    steps = np.arange(n) // 4
    times = BASE_TIME + np.arange(n, dtype=float)
    bad = {5, 150, 390}  # rows without a timestamp, in both row groups
    write_foreign(
        tmp_path / "other.parquet",
        {
            "key": ["x"] * n,
            "value": np.arange(n, dtype=float),
            "reduction": ["mean" if i % 2 else "max" for i in range(n)],
            "step": steps,
            "timestamp": pa.array([None if i in bad else t for i, t in enumerate(times)], pa.float64()),
            "rank": [0] * n,
        },
        row_group_size=200,
    )
    result = run_plan(tmp_path, make_plan(), on_read=None)
    frame = result.frame
    (rep,) = result.scan.report.files
    assert sum(rep.skip_reasons.values()) == rep.skipped == len(bad) and rep.records == n - len(bad)
    mixed = result.scan.report.mixed["x"]
    assert frame["count"].sum() + mixed.skipped["mean"] == n - len(bad)  # max kept, mean's counted


def test_the_fold_order_is_the_same_whether_or_not_the_files_were_checked_first(tmp_path):
    """What decides the files' order is fixed when they are listed: a whole-run check first
    (``--strict``, ``--by time`` without declared times), which drops another tool's bad
    rows from its counts, changes no bit."""
    rng = np.random.default_rng(5)
    for name, n, bad in (("a", 100, {3, 40, 41, 77, 99}), ("b", 97, set())):
        steps = np.arange(n) % 10
        write_foreign(
            tmp_path / f"{name}.parquet",
            {
                "key": ["x"] * n,
                "value": rng.lognormal(0.0, 8.0, n),
                "reduction": ["mean"] * n,
                "step": steps,
                "timestamp": pa.array([None if i in bad else BASE_TIME + i for i in range(n)], pa.float64()),
                "rank": [0] * n,
            },
        )
    plan = make_plan()
    as_listed = engine.execute(plan, scan_run(tmp_path, defer_checks=True)).frame
    checked = scan_run(tmp_path, defer_checks=True)
    assert checked.full_report.skipped_records == 5
    after_check = engine.execute(plan, checked).frame
    assert as_listed["value"].to_numpy().tobytes() == after_check["value"].to_numpy().tobytes()
    assert as_listed["count"].to_list() == after_check["count"].to_list()


# A restarted run of two sources, each restarted from a checkpoint into the same run
# directory: rank 0 dies after sealing its segments (Parquet or JSONL) and restarts at step
# 10; rank 1 is SIGKILLed (its segments stay journals) and restarts at step 15. Every plan
# is checked against the records the writers were given, selected here in plain Python by
# the documented rules: a restart replaces its source's records from its first step on
# (rewind), "all" keeps both attempts, an attempt id keeps only that attempt of its source
# and rewinds the others.
RESTARTED_AT = {0: 10, 1: 15}
ATTEMPT_CHOICES = {"rewind": None, "all": None, "rank 0's restart": (0, 2), "rank 1's first": (1, 1)}
PLAN_FILTERS = {
    "no filter": {},
    "keys": {"keys": ["trainer/*", "policy/tokens"]},
    "ranks and steps": {"ranks": "0", "steps": "5:25"},
}


@pytest.fixture(scope="module")
def restarted_runs(tmp_path_factory):
    """For each format: the run, the records written (each with its attempt, 1 or 2), and
    each rank's attempt ids in the order they started."""
    return {
        file_format: _restarted_run(tmp_path_factory, file_format) for file_format in ("parquet", "jsonl")
    }


def _restarted_run(tmp_path_factory, file_format):
    run = tmp_path_factory.mktemp(f"restarted-{file_format}")
    written = []
    for source, end in ((("TrainActor_r0", 0), False), (("TrainActor_r1", 1), None)):
        rank = source[1]
        options = {"steps": 20, "file_format": file_format, "segment_records": 90}
        first = write_collector_run(run, [source], seed=2 * rank, shutdown=end, **options)
        second = write_collector_run(
            run, [source], seed=2 * rank + 1, first_step=RESTARTED_AT[rank], **options
        )
        written += [{**r, "attempt": 1} for r in first] + [{**r, "attempt": 2} for r in second]
    ids: dict[int, list[str]] = {0: [], 1: []}
    for a in sorted(scan_run(run, attempts="all").report.attempts, key=lambda a: a.started):
        ids[a.rank].append(a.attempt)
    assert [len(ids[0]), len(ids[1])] == [2, 2]
    return run, written, ids


def _kept(record: dict, attempts: str, filters: dict) -> bool:
    """Whether a plan keeps a record the writers were given."""
    replaced = record["attempt"] == 1 and record["step"] >= RESTARTED_AT[record["rank"]]
    chosen = ATTEMPT_CHOICES[attempts]
    if chosen is not None and record["rank"] == chosen[0]:
        if record["attempt"] != chosen[1]:
            return False
    elif attempts != "all" and replaced:
        return False
    return (
        ("keys" not in filters or record["key"].startswith("trainer/") or record["key"] == "policy/tokens")
        and ("ranks" not in filters or record["rank"] == 0)
        and ("steps" not in filters or 5 <= record["step"] < 25)
    )


@pytest.mark.parametrize("filters", PLAN_FILTERS.values(), ids=PLAN_FILTERS.keys())
@pytest.mark.parametrize("attempts", ATTEMPT_CHOICES)
@pytest.mark.parametrize("by", ["step", "time"])
@pytest.mark.parametrize("mode", ["global_reduce", "per_rank_reduce", "per_rank_no_reduce"])
@pytest.mark.parametrize("layout", ["parquet", "parquet by row group", "jsonl"])
def test_every_plan_over_a_restarted_run_reads_every_record_it_keeps(
    restarted_runs, monkeypatch, layout, mode, by, attempts, filters
):
    """No file of a restarted source is skipped, whatever the plan reads of it (global_reduce
    --by time reads no step column, which a restart's rewind needs), with Parquet read a
    whole file or a row group a task: each group's count, and a max key's value, are those
    of the records the plan keeps; raw rows are those records, bit for bit."""
    run, written, ids = restarted_runs[layout.split()[0]]
    if layout == "parquet by row group":
        monkeypatch.setattr(engine.tasks, "DICTIONARY_READ_RECORDS", 0)
        monkeypatch.setattr(engine.tasks, "PARTITION_ROWS", 40)  # several tasks, several partitions each
    chosen = ATTEMPT_CHOICES[attempts]
    how = attempts if chosen is None else ids[chosen[0]][chosen[1] - 1]
    every = 3.0
    plan = make_plan(mode=mode, by=by, **({"every": f"{every}s"} if by == "time" else {}), **filters)
    result = run_plan(run, dataclasses.replace(plan, attempts=how))
    got = result.frame
    assert not result.scan.report.has_skips, result.scan.report.summary()  # never "unreadable, skipped"

    kept = [r for r in written if _kept(r, attempts, filters)]
    if by == "time":  # windows of `every` seconds from the first record kept
        t0 = min(r["timestamp"] for r in kept)
        kept = [{**r, "window_start": t0 + math.floor((r["timestamp"] - t0) / every) * every} for r in kept]
    if mode == "per_rank_no_reduce":
        assert sorted(got.rows()) == sorted(tuple(r[c] for c in got.columns) for r in kept)
        return
    bucket = "window_start" if by == "time" else "step"
    group = [bucket, "key"] if mode == "global_reduce" else ["process", "rank", bucket, "key"]
    groups: dict[tuple, list[dict]] = {}
    for r in kept:
        groups.setdefault(tuple(r[c] for c in group), []).append(r)
    assert {row[:-1]: row[-1] for row in got.select(*group, "count").rows()} == {
        g: len(rs) for g, rs in groups.items()
    }
    maxima = {g: max(r["value"] for r in rs) for g, rs in groups.items() if rs[0]["reduction"] == "max"}
    assert maxima  # trainer/grad_norm is kept by every filter
    assert {
        row[:-1]: row[-1] for row in got.filter(pl.col("reduction") == "max").select(*group, "value").rows()
    } == maxima


def test_a_step_of_more_groups_than_a_frame_is_handed_over_in_frames_in_order(tmp_path, monkeypatch):
    """One step of many keys (another tool's files: 2 ranks, each key its own) comes in
    frames of at most FRAME_GROUPS rows, not as one frame of the whole step, sorted as
    the output is, each key's mean and std as numpy's over its raw values."""
    rng = np.random.default_rng(41)
    keys = [f"eval/sample_{i:05d}/{'x' * (i % 7)}" for i in range(3000)]
    raw: dict[tuple[int, str], list[float]] = {}
    for rank in range(2):
        order = rng.permutation(6000) % 3000  # each key twice a rank, in no order
        value = rng.normal(0.0, 1.0, 6000)
        for k, v in zip(order.tolist(), value.tolist(), strict=True):
            raw.setdefault((rank, keys[k]), []).append(v)
        write_foreign(
            tmp_path / f"r{rank}.parquet",
            {
                "key": [keys[k] for k in order],
                "value": value,
                "reduction": ["std" if k % 2 else "mean" for k in order],
                "step": np.zeros(6000, dtype=np.int64),
                "timestamp": BASE_TIME + np.arange(6000) * 0.001,
                "rank": np.full(6000, rank),
            },
        )
    monkeypatch.setattr(engine.finish, "FRAME_GROUPS", 500, raising=False)
    for mode in ("global_reduce", "per_rank_reduce"):
        frames = list(run_plan(tmp_path, make_plan(mode=mode)).batches())
        assert max(f.height for f in frames) <= 500, [f.height for f in frames]
        got = pl.concat(frames)
        assert got.equals(got.sort(make_plan(mode=mode).sort_columns))
        assert got.height == (3000 if mode == "global_reduce" else 6000)
        for row in got.iter_rows(named=True):
            k = row["key"]
            values = raw[(0, k)] + raw[(1, k)] if mode == "global_reduce" else raw[(row["rank"], k)]
            want = np.std(values) if int(k.split("_")[1][:5]) % 2 else np.mean(values)
            assert row["value"] == pytest.approx(want, rel=1e-12, abs=1e-15), (mode, row)
            assert row["count"] == len(values)


@pytest.mark.parametrize("far", [7, 2**40])
def test_per_rank_reduce_of_one_file_of_several_sources_puts_them_in_process_then_rank_order(tmp_path, far):
    """Sources met in another order than their names' (a file of several, so reduced as one
    and put in order at the end), ranks close together or spanning more than 2**31: each
    source's rows come in the order of (process, rank), each value the numpy mean of its
    records."""
    process = ["zeta", "alpha", "zeta", "alpha", "mid", "mid"] * 2
    rank = [far, 1, 0, 2, far, 1] * 2
    value = np.arange(12, dtype=np.float64) * 0.1
    write_foreign(
        tmp_path / "several.parquet",
        {
            "key": ["k"] * 12,
            "value": value,
            "reduction": ["mean"] * 12,
            "step": [0] * 12,
            "timestamp": [BASE_TIME] * 12,
            "rank": rank,
            "process": process,
        },
    )
    got = (
        run_plan(tmp_path, make_plan(mode="per_rank_reduce")).frame.select("process", "rank", "value").rows()
    )
    sources = sorted(set(zip(process, rank, strict=True)))
    want = [
        (p, r, float(np.mean([v for v, q, s in zip(value, process, rank, strict=True) if (q, s) == (p, r)])))
        for p, r in sources
    ]
    assert got == want


@pytest.mark.parametrize("seed", range(6))
def test_a_takes_combos_are_numpys_unique(seed):
    """The distinct combos of a take, each one's first group and each group's combo among
    them (``finish._combos``: counted in place where the combos are few and near, sorted
    where they are far apart, none where each is there once, in order): numpy's unique."""
    from metric_core.offline.engine.finish import _combos

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 5000))
    top = [50, 3000, 1 << 20, 1 << 40][seed % 4]
    combo = rng.integers(0, top, n) if seed < 4 else np.arange(n) * 3
    if seed == 5:
        combo = np.tile(combo[:40], 3)
    for got, want in zip(
        _combos(combo), np.unique(combo, return_index=True, return_inverse=True), strict=True
    ):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("seed", range(8))
def test_rows_found_in_order_are_those_lexsort_leaves_as_they_are(seed):
    """``finish._in_order`` (a take's rows already in the result's order are not sorted
    again): true exactly where numpy's stable lexsort keeps every row in place, on columns
    of few values (ties in the later columns decided by the earlier ones), sorted or not."""
    from metric_core.offline.engine.finish import _in_order

    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 60))
    columns = [rng.integers(0, 3, n), rng.integers(0, 2, n), rng.integers(0, 2, n)][: 2 + seed % 2]
    for cols in (columns, [c[np.lexsort(columns)] for c in columns]):
        assert _in_order(cols) == bool((np.lexsort(cols) == np.arange(n)).all())


@pytest.mark.parametrize("seed", range(5))
def test_the_extensions_order_statistics_are_those_of_a_sort(seed):
    """``finish._order_statistics`` by the extension (a selection a group) and by polars'
    sort of each group: the same groups, counts, ranks, NaN flags, counts below zero and
    order statistics (a zero's sign aside: ``_signed_zeros`` gives it; and of a group that
    holds NaN, whose value is NaN whatever they are), for a median and for pNN; and the
    value they make is numpy's. Groups of 1 to 300 values, ties, +-0.0, infinities, NaN,
    negative buckets, one group of 20,000, groups of 5,000 in order but for one value (a
    metric's reset: the shapes that once made the selection quadratic), 600 groups of 1 to
    3 values (the extension's table of groups grows), each group's values in the order
    written, the groups' interleaved."""
    from metric_core.offline.engine.finish import _as_numpy, _order_statistics, _signed_zeros

    rng = np.random.default_rng(seed)
    sizes = np.r_[rng.integers(1, 300, 150), 20_000, 5_000, 5_000, 5_000, rng.integers(1, 4, 600)]
    group = np.repeat(np.arange(len(sizes)), sizes)
    pool = np.array([-0.0, 0.0, 1.5, -2.0, np.inf, -np.inf, 1e300, -1e-300])
    value = np.where(rng.random(len(group)) < 0.3, rng.choice(pool, len(group)), rng.normal(0, 4, len(group)))
    value[group == 3] = rng.choice([-0.0, 0.0], sizes[3])  # zeros alone
    value[np.flatnonzero(group == 5)[0]] = np.nan
    run = np.arange(1.0, 5_000.0)
    value[group == 151] = np.r_[run, 0.0]  # rising, the least value last
    value[group == 152] = np.r_[5_000.0, run]  # the greatest first
    value[group == 153] = np.r_[run[::-1], 5_000.0]  # falling, the greatest last
    keys = rng.random(len(group))  # when each value came: rising within its group
    order = np.argsort(keys[np.lexsort((keys, group))], kind="stable")
    bucket, combo = (group * 7919) % 13 - 6, group // 13  # (bucket, combo) tells each group
    part = pl.LazyFrame({"bucket": bucket[order], "_combo": combo[order], "value": value[order]})
    values_of = np.split(value, np.cumsum(sizes)[:-1])
    last = np.cumsum(sizes) - 1
    number = {(int(b), int(c)): g for g, (b, c) in enumerate(zip(bucket[last], combo[last], strict=True))}
    percent = {0.0: 0, 0.375: 37.5, 0.5: 50, 0.99: 99, 1.0: 100}
    for q in (None, *percent):
        found = {}
        for name in KERNELS:
            with kernel_of(name):
                got = _order_statistics(part, q)
            at = np.lexsort((got["_combo"], got["bucket"]))
            found[name] = {k: v[at] for k, v in got.items()}
        assert len(found["compiled"]["n"]) == len(sizes)
        clean = found["numpy"]["nan"] == 0  # a group holding NaN: NaN whatever its order statistics
        for k in found["numpy"]:
            kept = clean if k in ("lo", "hi") else slice(None)
            assert np.array_equal(found["compiled"][k][kept], found["numpy"][k][kept]), (q, k)
        assert (~clean).sum() == 1
        stats = {k: v.astype(np.float64) for k, v in found["compiled"].items()}
        _signed_zeros(stats, q)
        got_value = _as_numpy(stats, q)
        for j, (b, c) in enumerate(
            zip(found["compiled"]["bucket"].tolist(), found["compiled"]["_combo"].tolist(), strict=True)
        ):
            values = values_of[number[b, c]]
            with np.errstate(invalid="ignore", over="ignore"):
                want = np.median(values) if q is None else np.percentile(values, percent[q])
            assert np.array_equal([got_value[j]], [want], equal_nan=True), (q, b, c, got_value[j], want)
