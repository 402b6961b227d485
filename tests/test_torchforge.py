"""metric_core.torchforge as a torchforge user meets it: their job, with one import line
changed, gives W&B the global reduction numpy gives over what every rank recorded; a
process that records without any setup writes into METRICLOG_DIR and ends as expected;
torchforge's states merge with ours; extra wandb settings reach the real wandb client."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import metric_core
from metric_core import inspect_run, read_samples, reduce_metrics_states, reduce_run
from metric_core.errors import NotInitializedError
from metric_core.metric import MaxAccumulator, MeanAccumulator, MinAccumulator, StdAccumulator, SumAccumulator
from metric_core.torchforge import LoggingMode, Metric, MetricCollector, Reduce, WandbBackend, record_metric
from metric_core.torchforge.metric_actors import get_or_create_metric_logger

from .wandb_file import find_run_file, history_rows, read_records, run_record, tables_of

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def a_fresh_process(monkeypatch):
    """What a process starts with: no per-rank collector, no logger, no name given yet."""
    from metric_core.torchforge import metric_actors, metrics

    MetricCollector._instances.clear()
    monkeypatch.setattr(metric_actors, "_global_logger", None)
    monkeypatch.setattr(metrics, "process_name", None)
    yield
    MetricCollector._instances.clear()


# A torchforge job: only metric_core.torchforge names, torchforge's calls and config.
JOB = """
import asyncio, json, os, sys
import numpy as np
from metric_core.torchforge import Reduce, get_or_create_metric_logger, record_metric

async def main():
    rank, steps = int(os.environ["RANK"]), int(sys.argv[1])
    mlogger = await get_or_create_metric_logger(process_name="trainer")
    await mlogger.init_backends.call_one({
        "wandb": {"logging_mode": "global_reduce", "project": "p", "mode": "offline"},
    })
    rng = np.random.default_rng(rank)
    truth = []
    for step in range(steps):
        for _ in range(3):
            for key, how, value in (
                ("loss", Reduce.MEAN, 1e6 + rng.normal()),
                ("tokens", Reduce.SUM, float(rng.integers(0, 1000))),
                ("grad/max", Reduce.MAX, rng.normal()),
                ("grad/std", Reduce.STD, rng.normal()),
            ):
                record_metric(key, value, how)
                truth.append([step, key, value])
        await mlogger.flush.call_one(step)
    await mlogger.shutdown.call_one()
    with open(f"truth-{rank}.json", "w") as f:
        json.dump(truth, f)

asyncio.run(main())
"""
HOW = {"loss": np.mean, "tokens": np.sum, "grad/max": np.max, "grad/std": np.std}


def job_env(run: Path, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "FORGE_DISABLE_METRICS", "METRICLOG_DIR")}
    return {**env, "METRICLOG_DIR": str(run), "WANDB_SILENT": "true", "PYTHONPATH": str(REPO), **more}


@pytest.mark.slow
def test_a_torchforge_job_with_a_global_reduce_wandb_config_uploads_numpy_over_every_rank(tmp_path):
    run, steps, world = tmp_path / "run", 12, 3
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", JOB, str(steps)],
            cwd=tmp_path,
            env=job_env(run, RANK=str(r), WORLD_SIZE=str(world)),
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    for p in ranks:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        assert "sidecar" not in err, err  # rank 0 waited for its sidecar, which ended well
    recorded = [v for r in range(world) for v in json.loads((tmp_path / f"truth-{r}.json").read_text())]
    ledger = json.loads((run / ".metriclog" / "uploads.json").read_text())["runs"]
    ((run_id, entry),) = ledger.items()
    assert entry["finished"], entry
    rows = history_rows(read_records(find_run_file(run / ".metriclog" / "wandb", run_id)))
    assert [row["step"] for row in rows] == list(range(steps))
    for row in rows:
        for key, how in HOW.items():
            values = np.array([v for s, k, v in recorded if s == row["step"] and k == key])
            assert len(values) == 3 * world
            assert row[key] == pytest.approx(float(how(values)), rel=1e-12, abs=1e-12), (row["step"], key)


ADOPTED = """
import os, sys
from metric_core.torchforge import Reduce, record_metric
for i in range(5):
    record_metric("loss", float(i), Reduce.MEAN)
if os.fork() == 0:  # a data-loader worker: records nothing under its parent's name, says so once
    record_metric("worker/items", 1.0)
    record_metric("worker/items", 2.0)
    os._exit(0)
os.wait()
record_metric("loss", 5.0)
"""


def test_a_process_that_records_without_setup_writes_into_metriclog_dir_and_ends_as_expected(tmp_path):
    run = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-c", ADOPTED],
        cwd=tmp_path,
        env=job_env(run, RANK="2", METRICLOG_PROCESS="collector"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("records nothing") == 1, done.stderr
    records = reduce_run(run, mode="per_rank_no_reduce")
    assert records["key"].to_list() == ["loss"] * 6
    assert records["value"].to_list() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert set(zip(records["process"], records["rank"], strict=True)) == {("collector_r2", 2)}
    report = inspect_run(run)
    ((source,),) = [report.sources]
    assert source.end == "exit" and source.attempts[-1].adopted
    assert source.status == "finished" and report.first_failure is None


def test_record_metric_before_setup_warns_once_and_drops(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("METRICLOG_DIR", raising=False)
    with caplog.at_level(logging.WARNING):
        for i in range(3):
            record_metric("loss", float(i))
    said = [r for r in caplog.records if "Skipping metric collection" in r.message]
    assert len(said) == 1
    with pytest.raises(NotInitializedError):  # no collector was started
        metric_core.get_collector()
    assert list(tmp_path.iterdir()) == []


def test_forge_disable_metrics_records_nothing_even_with_a_run_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("METRICLOG_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("FORGE_DISABLE_METRICS", "true")

    async def job():
        mlogger = await get_or_create_metric_logger(process_name="trainer")
        await mlogger.init_backends.call_one({"console": {"logging_mode": "per_rank_reduce"}})
        record_metric("loss", 1.0)
        await mlogger.shutdown.call_one()

    asyncio.run(job())
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("reduction", [Reduce.MEAN, Reduce.SUM, Reduce.MAX, Reduce.MIN, Reduce.STD])
def test_torchforge_states_and_ours_merge_to_numpy_over_every_value(reduction):
    rng = np.random.default_rng(7)
    parts = [rng.normal(size=n) for n in (5, 1, 9, 4)]
    ours = {
        Reduce.MEAN: MeanAccumulator,
        Reduce.SUM: SumAccumulator,
        Reduce.MAX: MaxAccumulator,
        Reduce.MIN: MinAccumulator,
        Reduce.STD: StdAccumulator,
    }[reduction]
    states = []
    for i, values in enumerate(parts):
        if i % 2:  # a state as torchforge's accumulators write it, from its formulas
            s, n = float(sum(values)), len(values)
            state = {
                Reduce.MEAN: {"sum": s, "count": n},
                Reduce.SUM: {"total": s},
                Reduce.MAX: {"max_val": float(max(values))},
                Reduce.MIN: {"min_val": float(min(values))},
                Reduce.STD: {"sum": s, "sum_sq": float(sum(v * v for v in values)), "count": n},
            }[reduction]
            states.append({"k": {"reduction_type": reduction.value, **state}})
        else:
            acc = ours(reduction)
            for v in values:
                acc.append(v)
            states.append({"k": acc.get_state()})
    (metric,) = reduce_metrics_states(states)
    truth = {
        Reduce.MEAN: np.mean,
        Reduce.SUM: np.sum,
        Reduce.MAX: np.max,
        Reduce.MIN: np.min,
        Reduce.STD: np.std,
    }[reduction](np.concatenate(parts))
    assert metric.value == pytest.approx(float(truth), rel=1e-12)


def offline_wandb(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "wandb_root"
    root.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return root


def test_keyword_backends_pass_every_wandb_setting_to_the_real_client(tmp_path, monkeypatch):
    root = offline_wandb(tmp_path, monkeypatch)
    monkeypatch.setenv("METRICLOG_DIR", str(tmp_path / "run"))
    config = {
        "wandb": {
            "logging_mode": "per_rank_reduce",
            "project": "p",
            "name": "exp",
            "tags": ["rl", "v2"],
            "notes": "a new reward",
            "dir": str(root),
            "mode": "offline",
        }
    }

    async def job():
        mlogger = await get_or_create_metric_logger(process_name="trainer")
        await mlogger.init_backends.call_one(config)
        for step in range(3):
            for v in (1.0, 2.0, 4.0 * step):
                record_metric("loss", v, Reduce.MEAN)
            await mlogger.flush.call_one(step)
        await mlogger.shutdown.call_one()

    asyncio.run(job())
    (path,) = root.rglob("run-*.wandb")
    records = read_records(path)
    run = run_record(records)
    assert (run.display_name, run.run_group, list(run.tags), run.notes) == (
        "exp_trainer_r0",
        "exp",
        ["rl", "v2"],
        "a new reward",
    )
    rows = [r for r in history_rows(records) if "loss" in r]
    assert [(r["step"], r["loss"]) for r in rows] == [
        (s, float(np.mean([1.0, 2.0, 4.0 * s]))) for s in range(3)
    ]


def test_a_global_reduce_backend_starts_no_run_in_a_rank(tmp_path, monkeypatch):
    root = offline_wandb(tmp_path, monkeypatch)
    backend = WandbBackend(logging_mode=LoggingMode.GLOBAL_REDUCE, project="p", dir=str(root))
    from metric_core.metric import BackendRole

    asyncio.run(backend.init(BackendRole.LOCAL, None, "trainer_r0"))
    asyncio.run(backend.log_batch([Metric("loss", 1.0, Reduce.MEAN)], 0))
    assert backend.run is None
    assert list(root.rglob("*.wandb")) == []


def test_an_unknown_wandb_setting_is_named(tmp_path, monkeypatch):
    offline_wandb(tmp_path, monkeypatch)
    from metric_core.errors import ConfigError
    from metric_core.metric import BackendRole

    backend = WandbBackend(logging_mode=LoggingMode.PER_RANK_REDUCE, project="p", colour="red")
    with pytest.raises(ConfigError, match="colour"):
        asyncio.run(backend.init(BackendRole.LOCAL, None, "trainer_r0"))


EARLY = """
import asyncio, os
from metric_core.torchforge import get_or_create_metric_logger, record_metric
record_metric("setup/x", 1.0)  # before any setup: a source of its own, in METRICLOG_DIR
async def main():
    mlogger = await get_or_create_metric_logger(process_name="trainer")
    await mlogger.init_backends.call_one({"console": {"logging_mode": "per_rank_reduce"}})
    for step in range(2):
        record_metric("loss", float(step))
        await mlogger.flush.call_one(step)
    await mlogger.shutdown.call_one()
asyncio.run(main())
if os.fork() == 0:  # a worker that sets itself up, under a name of its own, records
    import metric_core
    metric_core.init(os.environ["METRICLOG_DIR"], process_name="worker")
    record_metric("worker/items", 3.0)
    metric_core.shutdown()
    os._exit(0)
os.wait()
"""


def test_recording_before_init_backends_keeps_those_values_and_then_uses_the_backends(tmp_path):
    run = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-c", EARLY],
        cwd=tmp_path,
        env=job_env(run, METRICLOG_PROCESS="early"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "[trainer_r0] step 0: loss=0" in done.stdout and "[trainer_r0] step 1: loss=1" in done.stdout
    rows = reduce_run(run, mode="per_rank_no_reduce")
    got = sorted(zip(rows["process"], rows["key"], rows["value"], strict=True))
    assert got == [
        ("early_r0", "setup/x", 1.0),
        ("trainer_r0", "loss", 0.0),
        ("trainer_r0", "loss", 1.0),
        ("worker", "worker/items", 3.0),
    ]
    report = inspect_run(run)
    assert {s.process: s.status for s in report.sources} == {
        "early_r0": "finished",
        "trainer_r0": "finished",
        "worker": "finished",
    }


def test_forge_disable_metrics_spelled_1_disables_recording_and_flushes_quietly(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("METRICLOG_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("FORGE_DISABLE_METRICS", "1")

    async def job():
        mlogger = await get_or_create_metric_logger(process_name="trainer")
        await mlogger.init_backends.call_one({"console": {"logging_mode": "per_rank_reduce"}})
        record_metric("loss", 1.0)
        await mlogger.flush.call_one(0)
        await mlogger.shutdown.call_one()

    with caplog.at_level(logging.WARNING):
        asyncio.run(job())
    assert not (tmp_path / "run").exists()
    assert [r.message for r in caplog.records] == []


def test_a_misspelled_global_backend_is_refused_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("METRICLOG_DIR", str(tmp_path / "run"))

    async def job():
        mlogger = await get_or_create_metric_logger(process_name="trainer")
        await mlogger.init_backends.call_one({"wanbd": {"logging_mode": "global_reduce", "project": "rl"}})

    with pytest.raises(ValueError, match="Unknown logger backend type: wanbd"):
        asyncio.run(job())
    with pytest.raises(ValueError, match="backend 'console': logging_mode 'per_rank' is not one of"):
        asyncio.run(_init({"console": {"logging_mode": "per_rank"}}))
    assert not (tmp_path / "run").exists()


async def _init(config):
    mlogger = await get_or_create_metric_logger(process_name="trainer")
    await mlogger.init_backends.call_one(config)


def test_torchforge_samples_are_kept_whole_and_the_live_wandb_backend_shows_top_and_bottom(
    tmp_path, monkeypatch
):
    root = offline_wandb(tmp_path, monkeypatch)
    monkeypatch.setenv("METRICLOG_DIR", str(tmp_path / "run"))
    config = {
        "wandb": {"logging_mode": "per_rank_reduce", "project": "p", "dir": str(root), "mode": "offline"}
    }
    recorded = [
        {"prompt": f"q{i}", "reward": r, "ids": [i, 2**64]} for i, r in enumerate([0.5, -1.0, 2.0, 0.1])
    ]

    async def job():
        mlogger = await get_or_create_metric_logger(process_name="generator")
        await mlogger.init_backends.call_one(config)
        for sample in recorded:
            record_metric("rollout", sample, Reduce.SAMPLE)
        record_metric("reward", 1.0)
        await mlogger.flush.call_one(0)
        await mlogger.shutdown.call_one()

    asyncio.run(job())
    assert [s.fields for s in read_samples(tmp_path / "run").samples] == recorded
    (path,) = root.rglob("run-*.wandb")
    ((step, shown),) = tables_of(path, "rollout").items()
    # torchforge's SampleAccumulator: the bottom 1, then the top 1, by reward
    assert [s["prompt"] for s in shown] == ["q1", "q2"] and step == 0
