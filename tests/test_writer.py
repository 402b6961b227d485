"""The writer: round trips on real files, step stamping, backends, configuration errors."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import re
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

import metric_core
from metric_core import LoggerBackend, LoggingMode, MetricCollector, Reduce, reduce_run, scan_run
from metric_core.errors import ConfigError, NoDataError, NotInitializedError
from metric_core.metric import BackendRole

from .conftest import ONE_KEY_PER_REDUCTION, write_collector_run


def read_back(run_dir: Path) -> pl.DataFrame:
    scan = scan_run(run_dir)
    assert not scan.report.has_skips, scan.report.summary()
    return scan.frame.drop("file_id").collect().sort("process", "timestamp")


@pytest.mark.parametrize("file_format", ["parquet", "jsonl"])
def test_every_record_comes_back_exactly_with_its_step(tmp_path, file_format):
    truth = write_collector_run(
        tmp_path,
        [("TrainActor_r0", 0), ("GeneratorActor_r0", 0), ("TrainActor_r1", 1)],
        file_format=file_format,
        segment_records=37,  # many sealed segments
    )
    got = read_back(tmp_path)
    expected = pl.DataFrame(truth).select("process", "rank", "step", "key", "value", "reduction")
    key = ["process", "rank", "step", "key", "value", "reduction"]
    assert got.height == len(truth)
    assert got.select(key).sort(key).equals(expected.sort(key))
    suffixes = {p.suffix for p in tmp_path.iterdir() if p.name != "run.json"}
    assert suffixes == {"." + file_format}, "after shutdown only sealed segments remain"


def test_module_api_stamps_steps_as_spec_section_4(tmp_path):
    metric_core.init(tmp_path, rank=3, process_name="TrainActor_r3", step=10)
    for step in range(10, 13):
        for i in range(step - 9):
            metric_core.record_metric("loss", float(i), Reduce.MEAN)
        metric_core.flush(step)
    metric_core.record_metric("loss", 99.0)  # recorded after flush(12): step 13
    assert metric_core.get_collector().step == 13
    metric_core.shutdown()
    df = read_back(tmp_path)
    assert df["step"].to_list() == [10, 11, 11, 12, 12, 12, 13]
    assert df["value"].to_list() == [0.0, 0.0, 1.0, 0.0, 1.0, 2.0, 99.0]
    assert set(df["rank"]) == {3}
    assert set(df["process"]) == {"TrainActor_r3"}


@pytest.mark.parametrize("file_format", ["parquet", "jsonl"])
def test_values_of_every_accepted_type_and_non_finite_values_round_trip(tmp_path, file_format):
    c = MetricCollector(tmp_path, rank=0, process_name="p", file_format=file_format)
    inputs = [
        1,
        True,
        False,
        np.float32(0.5),
        np.int64(7),
        np.array(2.5),
        0.1,
        1e-300,
        1.7976931348623157e308,
        math.nan,
        math.inf,
        -math.inf,
        -0.0,
    ]
    for v in inputs:
        c.record("k", v)
    c.shutdown()
    got = read_back(tmp_path)["value"].to_numpy()
    expected = np.array([float(v) for v in inputs])
    np.testing.assert_array_equal(got, expected)  # NaN == NaN here, bit-exact otherwise


def test_bad_values_keys_and_reductions_are_clear_errors(tmp_path):
    c = MetricCollector(tmp_path, rank=0)
    with pytest.raises(TypeError, match=r"metric 'trainer/loss': value '0\.3' of type str is not a number"):
        c.record("trainer/loss", "0.3")
    with pytest.raises(TypeError, match="metric 'x': value None"):
        c.record("x", None)
    with pytest.raises(TypeError, match="metric key must be a non-empty string"):
        c.record(5, 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reduction 'avg' is not one of mean, sum, max, min, std"):
        c.record("x", 1.0, "avg")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is 70,000 bytes: a key holds at most 65,536 bytes"):
        c.record("k" * 70_000, 1.0)  # a reader refuses a line that long
    c.record("x", 1.0, "max")  # the string form of a Reduce is accepted
    c.shutdown()
    df = read_back(tmp_path)
    assert df.select("key", "value", "reduction").rows() == [("x", 1.0, "max")]


BEFORE_INIT = """
import metric_core
for call in (lambda: metric_core.record_metric("loss", 1.0), lambda: metric_core.flush(0)):
    try:
        call()
    except metric_core.MetricLogError as exc:
        print(type(exc).__name__, exc)
"""


def test_record_before_init_says_what_to_do():
    # in a fresh interpreter: this one may have run init() and shutdown() in earlier tests
    done = subprocess.run([sys.executable, "-c", BEFORE_INIT], capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines() == [
        f"NotInitializedError {what} was called before metric_core.init(run_dir): call metric_core.init() "
        "once per process before recording metrics."
        for what in ("record_metric()", "flush()")
    ], done.stderr


def test_record_or_flush_after_shutdown_says_it_came_after_shutdown_and_to_init_again(tmp_path):
    metric_core.init(tmp_path / "run", rank=1, process_name="TrainActor_r1")
    metric_core.record_metric("loss", 1.0)
    metric_core.flush(0)
    metric_core.shutdown()
    ended = f"TrainActor_r1 (rank 1) in {tmp_path / 'run'}"
    for what, call in (
        ("record_metric()", lambda: metric_core.record_metric("loss", 2.0)),
        ("record_metric()", lambda: metric_core.record_metric("new_key", 2.0, Reduce.SUM)),
        ("flush()", lambda: metric_core.flush(1)),
        ("get_collector()", metric_core.get_collector),
    ):
        with pytest.raises(NotInitializedError) as caught:
            call()
        assert str(caught.value) == (
            f"{what} was called after metric_core.shutdown() ended the recording of {ended}: call "
            "metric_core.init(run_dir) again to record more (it starts a new attempt of the source)."
        )
    metric_core.init(tmp_path / "run", rank=1, process_name="TrainActor_r1")  # and it records again
    metric_core.record_metric("loss", 3.0)
    metric_core.flush(1)
    metric_core.shutdown()
    assert read_back(tmp_path / "run").sort("step")["value"].to_list() == [1.0, 3.0]


def test_init_twice_is_refused_until_shutdown(tmp_path):
    metric_core.init(tmp_path / "a")
    with pytest.raises(ConfigError, match="already called"):
        metric_core.init(tmp_path / "b")
    metric_core.shutdown()
    metric_core.init(tmp_path / "b", world_size=4, config={"lr": 0.1})
    meta = json.loads((tmp_path / "b" / "run.json").read_text())
    assert (meta["name"], meta["world_size"], meta["config"]) == ("b", 4, {"lr": 0.1})


def test_rank_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    metric_core.init(tmp_path)
    metric_core.record_metric("a", 1.0)
    metric_core.shutdown()
    df = read_back(tmp_path)
    assert df.select("rank", "process").row(0) == (5, "rank5")
    assert not (tmp_path / "run.json").exists()  # only rank 0 writes it


def test_shutdown_is_recorded_and_an_unclean_end_is_not(tmp_path):
    write_collector_run(tmp_path, [("clean", 0)], steps=2)
    write_collector_run(tmp_path, [("died", 1)], steps=2, shutdown=False)
    scan = scan_run(tmp_path)
    assert scan.report.clean_shutdowns() == {("clean", 0)}


@pytest.mark.parametrize("file_format", ["parquet", "jsonl"])
def test_a_restarted_process_appends_new_segments_and_loses_nothing(tmp_path, file_format):
    """A restart from step 0 writes new segments beside the old ones; by default it replaces
    the first attempt (it restarted at its first step), and --attempts all keeps both."""
    first = write_collector_run(tmp_path, [("trainer", 0)], steps=3, file_format=file_format, shutdown=False)
    second = write_collector_run(tmp_path, [("trainer", 0)], steps=3, file_format=file_format, seed=9)
    everything = scan_run(tmp_path, attempts="all").frame.collect()
    assert everything.height == len(first) + len(second)
    rewound = scan_run(tmp_path)
    assert sorted(rewound.frame.collect()["value"].to_list()) == sorted(r["value"] for r in second)
    assert f"{len(first)} record(s) of steps 0-2 of attempt" in rewound.report.summary()


@pytest.mark.parametrize("file_format", ["parquet", "jsonl"])
def test_sealed_files_are_plain_files_other_tools_read(tmp_path, file_format):
    duckdb = pytest.importorskip("duckdb")
    pd = pytest.importorskip("pandas")
    truth = write_collector_run(tmp_path, [("TrainActor_r0", 0)], steps=5, file_format=file_format)
    files = sorted(tmp_path.glob(f"*.{file_format}"))
    if file_format == "parquet":
        frame = pd.concat([pd.read_parquet(f) for f in files])
        n = duckdb.sql(f"select count(*) from read_parquet({[str(f) for f in files]})").fetchall()[0][0]
        assert list(pq.read_schema(files[0]).names) == [
            "key",
            "value",
            "reduction",
            "step",
            "timestamp",
            "rank",
            "process",
            "key_hash",  # an extra column (docs/format.md allows them): blake2b-64 of the key
        ]
        for key, value in frame.groupby("key")["key_hash"].unique().items():
            digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
            assert list(value) == [int.from_bytes(digest, "little", signed=True)]
    else:
        frame = pd.concat([pd.read_json(f, lines=True, precise_float=True) for f in files])
        frame = frame[frame["key"].notna()]  # the writer's segment and shutdown event lines
        n = len(frame)
    assert len(frame) == n == len(truth)
    assert sorted(frame["value"].tolist()) == sorted(r["value"] for r in truth)


def test_the_writers_strings_are_parquet_dictionaries_where_keys_share_a_reduction(tmp_path):
    """Each string column chunk is dictionary-encoded, as readers group on it; a dictionary
    holding a reduction once per key would be stored plainly, every string spelling out."""
    metric_core.init(tmp_path, rank=0, process_name="TrainActor_r0")
    for step in range(3):
        for i, reduction in enumerate([Reduce.MEAN, Reduce.MEAN, Reduce.SUM, Reduce.MEAN, Reduce.SUM]):
            metric_core.record_metric(f"k{i}", float(step * 10 + i), reduction)
        metric_core.flush(step)
    metric_core.shutdown()
    (path,) = tmp_path.glob("*.parquet")
    meta = pq.read_metadata(path)
    for g in range(meta.num_row_groups):
        for c in range(meta.num_columns):
            column = meta.row_group(g).column(c)
            if column.path_in_schema in ("key", "reduction", "process"):
                assert "RLE_DICTIONARY" in column.encodings, column.path_in_schema
    got = pq.read_table(path).to_pylist()
    assert [(r["step"], r["key"], r["reduction"], r["value"]) for r in got] == [
        (step, f"k{i}", reduction, float(step * 10 + i))
        for step in range(3)
        for i, reduction in enumerate(["mean", "mean", "sum", "mean", "sum"])
    ]


class Recording(LoggerBackend):
    """A per-rank reduce backend that keeps what it is given."""

    def __init__(self, mode: str = "per_rank_reduce") -> None:
        super().__init__({"logging_mode": mode})
        self.batches: list[tuple[int, dict[str, float]]] = []
        self.streamed: list[tuple[str, float, int]] = []
        self.finished = False
        self.role = None

    async def init(self, role, controller_logger_metadata=None, process_name=None):
        self.role = role

    async def log_batch(self, metrics, global_step):
        self.batches.append((global_step, {m.key: m.value for m in metrics}))

    def log_stream(self, metric, global_step):
        self.streamed.append((metric.key, metric.value, global_step))

    async def finish(self):
        self.finished = True


def test_per_rank_reduce_backend_gets_numpy_reductions_of_each_step(tmp_path):
    rng = np.random.default_rng(4)
    backend = Recording()
    c = MetricCollector(tmp_path, rank=0, backends={"mine": backend}, flush_interval=0.01)
    raw: dict[int, dict[str, list[float]]] = {}
    for step in range(6):
        for key, red in ONE_KEY_PER_REDUCTION:
            values = (1e8 if red is Reduce.STD else 0) + rng.normal(size=int(rng.integers(1, 40)))
            for v in values:
                c.record(key, float(v), red)
            raw.setdefault(step, {})[key] = list(values)
        if step == 2:
            import time

            time.sleep(0.05)  # let the writer thread drain part of the step
        c.flush(step)
    c.shutdown()
    assert backend.role is BackendRole.LOCAL
    assert backend.finished
    assert [s for s, _ in backend.batches] == list(range(6))
    for step, reduced in backend.batches:
        for key, fn in (("m", np.mean), ("s", np.sum), ("x", np.max), ("n", np.min), ("d", np.std)):
            assert reduced[key] == pytest.approx(float(fn(raw[step][key])), rel=1e-9), (step, key)


def test_flush_returns_states_that_merge_into_the_global_reduction(tmp_path):
    rng = np.random.default_rng(2)
    collectors = [MetricCollector(tmp_path, rank=r) for r in range(3)]
    all_values = []
    for c in collectors:
        values = 1e8 + rng.normal(size=50)
        all_values.extend(values)
        for v in values:
            c.record("lat", float(v), Reduce.STD)
    states = [c.flush(0, return_state=True) for c in collectors]
    for c in collectors:
        c.shutdown()
    (metric,) = metric_core.reduce_metrics_states(states)
    assert metric.value == pytest.approx(float(np.std(all_values)), rel=1e-6)


def test_a_stream_backend_gets_every_raw_record_off_the_training_thread(tmp_path):
    backend = Recording("per_rank_no_reduce")
    c = MetricCollector(tmp_path, rank=0, backends={"mine": backend}, step=7)
    for i in range(5):
        c.record("k", float(i))
    c.flush(7)
    c.shutdown()
    assert backend.streamed == [("k", float(i), 7) for i in range(5)]


def test_global_reduce_backend_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"global_reduce is not computed live.*metriclog reduce"):
        MetricCollector(tmp_path, backends={"console": {"logging_mode": "global_reduce"}})
    with pytest.raises(ConfigError, match="logging_mode 'sometimes' is not one of"):
        MetricCollector(tmp_path, backends={"console": {"logging_mode": "sometimes"}})
    with pytest.raises(ConfigError, match="unknown backend 'tensorboard'"):
        MetricCollector(tmp_path, backends={"tensorboard": {}})
    with pytest.raises(ConfigError, match="file_format 'csv' is not supported"):
        MetricCollector(tmp_path, file_format="csv")


def test_console_backend_prints_reduced_values(tmp_path, capsys):
    c = MetricCollector(
        tmp_path,
        rank=0,
        process_name="TrainActor_r0",
        backends={"console": {"logging_mode": "per_rank_reduce"}},
    )
    c.record("loss", 1.0)
    c.record("loss", 2.0)
    c.flush(4)
    c.shutdown()
    assert "[TrainActor_r0] step 4: loss=1.5" in capsys.readouterr().out


def test_asyncio_code_flushes_without_blocking_its_loop(tmp_path):
    backend = Recording()

    async def main():
        c = MetricCollector(tmp_path, rank=0, backends={"mine": backend})
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        for step in range(3):
            c.record("k", float(step))
            await c.aflush(step)
        task.cancel()
        c.shutdown()  # a sync call inside a running loop still works
        return ticks

    ticks = asyncio.run(main())
    assert ticks > 0
    assert backend.batches == [(0, {"k": 0.0}), (1, {"k": 1.0}), (2, {"k": 2.0})]
    assert read_back(tmp_path)["step"].to_list() == [0, 1, 2]


def test_a_value_recorded_while_aflush_writes_belongs_to_the_next_step(tmp_path):
    """asyncio code records from other tasks while ``await c.aflush(step)`` writes (torchforge's
    GRPO app: the rollouts loop runs while the training loop flushes). As in torchforge's
    collector, whose flush takes the step's values when it is called, a value recorded after
    the call belongs to the next step, on disk and live, also when the background drain takes
    it while the flush's write is still under way (it was stamped with the flushed step,
    after that step's end)."""
    backend = Recording()
    writing, go = threading.Event(), threading.Event()

    async def main():
        c = MetricCollector(tmp_path, rank=0, flush_interval=0.01, backends={"mine": backend})
        real_write = c._writer.write

        def held_write():  # the flush's write waits; the background drain goes on
            if threading.current_thread() is not c._thread:
                writing.set()
                assert go.wait(60)
            real_write()

        c._writer.write = held_write
        c.record("k", 1.0)
        flushing = asyncio.create_task(c.aflush(0))
        while not writing.is_set():
            await asyncio.sleep(0.001)
        c.record("k", 2.0)  # recorded after aflush(0) was called
        deadline = time.monotonic() + 60
        while len(c._buffer):  # the background drain has taken it
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        go.set()
        await flushing
        c.record("k", 3.0)
        await c.aflush(1)
        c.shutdown()

    asyncio.run(main())
    assert backend.batches == [(0, {"k": 1.0}), (1, {"k": 2.5})]
    back = read_back(tmp_path).sort("value")
    assert back["value"].to_list() == [1.0, 2.0, 3.0]
    assert back["step"].to_list() == [0, 1, 1]
    assert reduce_run(tmp_path, mode="global_reduce").filter(pl.col("key") == "k").sort("step")[
        "value"
    ].to_list() == [1.0, 2.5]


def test_background_flush_makes_records_durable_without_a_flush_call(tmp_path):
    import time

    c = MetricCollector(tmp_path, rank=0, flush_interval=0.05)
    c.record("k", 1.0)
    deadline = time.time() + 5
    while time.time() < deadline:  # the journal is there from init(), the record once written
        with contextlib.suppress(NoDataError):
            if scan_run(tmp_path).report.records == 1:
                break
        time.sleep(0.02)
    assert scan_run(tmp_path).frame.collect()["value"].to_list() == [1.0]
    c.shutdown()


def test_seal_interval_seals_an_open_segment(tmp_path):
    import time

    c = MetricCollector(tmp_path, rank=0, seal_interval=0.0, flush_interval=0.05)
    c.record("k", 1.0)
    c.flush(0)
    deadline = time.time() + 10

    def sealed() -> list[str]:  # the writer's heartbeats go on in a journal of their own
        return [p.suffix for p in tmp_path.iterdir() if p.is_file() and p.suffix in (".parquet", ".jsonl")]

    while time.time() < deadline and sealed() != [".parquet"]:
        time.sleep(0.02)  # the writer thread seals it
    assert sealed() == [".parquet"]
    assert scan_run(tmp_path).report.records == 1  # every record is in the sealed segment, once
    c.shutdown()
    assert read_back(tmp_path)["value"].to_list() == [1.0]


def test_logging_mode_enum_is_what_backends_take():
    assert Recording("per_rank_no_reduce").logging_mode is LoggingMode.PER_RANK_NO_REDUCE


def test_a_collector_left_open_is_written_at_exit_and_not_called_finished(tmp_path):
    """Not shut down, not flushed: interpreter exit writes what it recorded, without a clean end."""
    import subprocess
    import sys

    code = (
        "from metric_core import MetricCollector\n"
        f"c = MetricCollector({str(tmp_path)!r}, process_name='left', flush_interval=3600)\n"
        "for i in range(5):\n"
        "    c.record('k', float(i))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    scan = scan_run(tmp_path)
    assert sorted(scan.frame.collect()["value"].to_list()) == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert scan.report.clean_shutdowns() == set()
    assert [p.suffix for p in tmp_path.iterdir()] == [".parquet"]  # sealed


def test_a_per_rank_no_reduce_backend_gets_every_raw_record_as_batches(tmp_path):
    """A second RawFileWriter as a live stream backend: its files hold the same records."""
    from metric_core.writer.segments import RawFileWriter

    mirror = RawFileWriter(tmp_path / "mirror", process="copy", rank=5, file_format="jsonl")
    c = MetricCollector(tmp_path / "run", rank=1, process_name="w", backends={"mirror": mirror})
    truth = []
    for step in range(4):
        for i, (key, red) in enumerate(ONE_KEY_PER_REDUCTION):
            value = float("nan") if (step, i) == (2, 3) else step * 10.0 + i
            c.record(key, value, red)
            truth.append((step, key, red.value, value))
        c.flush(step)
    c.shutdown()
    got = read_back(tmp_path / "mirror").sort("step", "key")
    expected = sorted(truth, key=lambda t: (t[0], t[1]))
    assert got.select("step", "key", "reduction").rows() == [t[:3] for t in expected]
    np.testing.assert_array_equal(got["value"].to_numpy(), [t[3] for t in expected])
    assert set(got["process"]) == {"copy"} and set(got["rank"]) == {5}


def test_a_second_live_writer_of_a_source_is_refused_and_a_restart_after_a_kill_is_not(tmp_path):
    import os
    import subprocess
    import sys

    from .conftest import killed_after

    first = MetricCollector(tmp_path, process_name="trainer", rank=3)
    other_process = subprocess.run(
        [
            sys.executable,
            "-c",
            "from metric_core import MetricCollector\n"
            f"MetricCollector({str(tmp_path)!r}, process_name='trainer', rank=3)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert other_process.returncode != 0
    assert "trainer (rank 3) is already being written into" in other_process.stderr
    assert f"pid {os.getpid()}" in other_process.stderr
    with pytest.raises(ConfigError, match="already being written"):
        MetricCollector(tmp_path, process_name="trainer", rank=3)  # in this process too
    MetricCollector(tmp_path, process_name="trainer", rank=4).shutdown()  # another source is fine
    first.record("k", 1.0)
    first.shutdown()

    def killed() -> None:
        c = MetricCollector(tmp_path, process_name="trainer", rank=3)
        c.record("k", 2.0)
        c.flush(0)

    killed_after(killed)  # dies holding the lock: the kernel drops it
    restarted = MetricCollector(tmp_path, process_name="trainer", rank=3)
    restarted.record("k", 3.0)
    restarted.shutdown()
    # three attempts of one source, each from step 0: each restart replaces the one before
    assert sorted(scan_run(tmp_path, attempts="all").frame.collect()["value"].to_list()) == [1.0, 2.0, 3.0]
    assert scan_run(tmp_path).frame.collect()["value"].to_list() == [3.0]
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".lock"], "a clean end leaves no lock file"


@pytest.mark.parametrize("file_format", ["parquet", "jsonl"])
def test_offline_steps_are_the_steps_the_live_logger_logged_even_when_written_before_the_flush(
    tmp_path, file_format
):
    """flush(k) every 10 iterations, with a writer thread that writes each record long before
    its flush: offline, every record carries the k of the flush that covered it, as the live
    per-rank logger labelled it; records no flush covered keep the current step."""
    import time

    live = Recording()
    c = MetricCollector(
        tmp_path, process_name="w", flush_interval=0.005, file_format=file_format, backends={"live": live}
    )
    truth = []
    for i in range(30):
        c.record("loss", float(i))
        truth.append(float(i))
        time.sleep(0.002)  # the writer thread writes some of them before their flush
        if i % 10 == 9:
            c.flush(i)  # the live logger logs step i: the mean of the last ten values
    c.record("loss", 99.0)  # no flush covers it: it keeps the current step, 30
    c.shutdown()
    assert [step for step, _ in live.batches[:3]] == [9, 19, 29]
    offline = reduce_run(tmp_path, mode="per_rank_reduce")
    got = dict(zip(offline["step"].to_list(), offline["value"].to_list(), strict=True))
    for step, values in live.batches[:3]:
        assert got[step] == values["loss"] == pytest.approx(np.mean(truth[step - 9 : step + 1]), rel=1e-15)
    assert got[30] == 99.0 and set(got) == {9, 19, 29, 30}


def test_a_restart_that_does_not_give_its_step_is_placed_by_its_first_flush_and_warned(tmp_path):
    first = MetricCollector(tmp_path, process_name="w", step=0)
    for step in range(300):
        first.record("k", 1.0)
        first.flush(step)
    first.abort()  # the job died
    restarted = MetricCollector(tmp_path, process_name="w")  # from the checkpoint of step 250
    restarted.record("k", 2.0)  # stamped 0, the initial step, until the flush says where it is
    with pytest.warns(
        metric_core.MetricLogWarning, match=r"the first flush is flush\(250\), but init\(\) was"
    ):
        restarted.flush(250)
    for step in range(251, 260):
        restarted.record("k", 2.0)
        restarted.flush(step)
    restarted.shutdown()
    got = reduce_run(tmp_path, mode="per_rank_reduce")
    assert got.filter(pl.col("step") < 250)["value"].unique().to_list() == [1.0]
    assert got.filter(pl.col("step") >= 250)["value"].unique().to_list() == [2.0]
    assert got["step"].to_list() == list(range(260))  # steps 250-299 of the first attempt replaced
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a restart that says its step, or a usual loop: no warning
        c = MetricCollector(tmp_path / "other", process_name="w", step=250)
        c.record("k", 1.0)
        c.flush(250)
        c.shutdown()


def test_a_flush_marker_survives_the_memory_bound_and_labels_only_its_records(tmp_path):
    """While writing fails, the oldest waiting records are dropped past max_unwritten, but a
    flush marker never is: records written before it keep its step, not the next one's."""
    from metric_core.format import journal
    from metric_core.writer.segments import RawFileWriter

    w = RawFileWriter(tmp_path, process="w", rank=0, max_unwritten=5)
    codes = [("k", "mean")]

    def rows(*values: float) -> bytes:
        return np.array([[v, 0.0, 1.7e9] for v in values]).tobytes()

    w.enqueue(10, rows(1, 2, 3), 3, codes)
    w.write()  # the writer thread wrote them, stamped 10
    w.mark_flush(19)  # then flush(19) could not write (a full disk, say)
    w.enqueue(20, rows(4, 5, 6), 3, codes)
    w.enqueue(20, rows(7, 8, 9), 3, codes)  # past the bound: 4, 5, 6 are dropped, the marker kept
    w.mark_flush(29)
    w.write()
    (path,) = tmp_path.glob("*.journal")
    table = journal.decode(path.read_bytes()).table
    got = dict(zip(table["value"].to_pylist(), table["step"].to_pylist(), strict=True))
    assert got == {1.0: 19, 2.0: 19, 3.0: 19, 7.0: 29, 8.0: 29, 9.0: 29}
    assert w.take_drops()["records"] == 3
    w.close(clean_shutdown=True)


def test_a_forked_child_neither_holds_nor_removes_its_parents_lock(tmp_path):
    import subprocess
    import sys

    script = f"""
import os, sys
from metric_core import MetricCollector
from metric_core.errors import ConfigError
c = MetricCollector({str(tmp_path)!r}, process_name="w")
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a child that exits normally: its exit handlers run
os.waitpid(pid, 0)
assert (c.run_dir / ".w.r0.lock").exists(), "the child removed the parent's lock file"
try:
    MetricCollector({str(tmp_path)!r}, process_name="w")
except ConfigError:
    print("still locked")
c.shutdown()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "still locked"


@pytest.mark.parametrize(
    ("step", "says"),
    [
        (1.5, "not 1.5 of type float"),
        (True, "not True of type bool"),
        ("7", "not '7' of type str"),
        (np.float64(3.0), "of type float64"),
        (-1, "step -1 is out of range"),
        (2**63 + 5, "step 9223372036854775813 is out of range"),
    ],
)
def test_flush_refuses_a_step_that_is_not_an_int64_and_the_source_goes_on(tmp_path, step, says):
    c = MetricCollector(tmp_path, process_name="p")
    c.record("x", 1.0)
    with pytest.raises(ValueError, match=re.escape(says)):
        c.flush(step)
    c.flush(np.int64(4))  # numpy integers (and 0-d integer tensors) are integers
    c.record("x", 2.0)
    c.flush(4)  # the same step again is allowed
    with pytest.raises(ValueError, match="step 3 is below the previous flush's step 4"):
        c.flush(3)
    c.record("x", 3.0)
    c.flush(5)
    c.shutdown()  # a refused flush left the source able to end cleanly
    got = read_back(tmp_path).sort("value")
    assert got["step"].to_list() == [4, 4, 5] and got["value"].to_list() == [1.0, 2.0, 3.0]
    assert scan_run(tmp_path).report.clean_shutdowns() == {("p", 0)}
