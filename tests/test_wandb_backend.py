"""The live wandb backend, driven through the real wandb client in offline mode."""

from __future__ import annotations

import numpy as np
import pytest

from metric_core import MetricCollector, Reduce

from .wandb_file import history_rows, metric_definitions, read_records, run_record


@pytest.fixture
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return tmp_path / "wandb_root"


def only_run_file(root):
    files = list(root.rglob("run-*.wandb"))
    assert len(files) == 1, files
    return files[0]


def test_per_rank_reduce_logs_numpy_reductions_per_step(tmp_path, offline):
    offline.mkdir()
    cfg = {
        "project": "p",
        "group": "exp1",
        "dir": str(offline),
        "mode": "offline",
        "logging_mode": "per_rank_reduce",
        "config": {"lr": 0.01},
    }
    c = MetricCollector(tmp_path / "run", rank=0, process_name="TrainActor_r0", backends={"wandb": cfg})
    rng = np.random.default_rng(0)
    truth = []
    for step in range(4):
        loss = rng.normal(size=6)
        for v in loss:
            c.record("trainer/loss", float(v), Reduce.MEAN)
        c.record("trainer/grad_norm", float(step), Reduce.MAX)
        c.flush(step)
        truth.append((step, float(np.mean(loss)), float(step)))
    c.shutdown()
    records = read_records(only_run_file(offline))
    run = run_record(records)
    assert (run.display_name, run.run_group) == ("exp1_TrainActor_r0", "exp1")
    assert metric_definitions(records).get("*") == "step"
    rows = [r for r in history_rows(records) if "trainer/loss" in r]
    got = [(r["step"], r["trainer/loss"], r["trainer/grad_norm"]) for r in rows]
    assert len(got) == len(truth)
    for (s, loss, gn), (ts, tloss, tgn) in zip(got, truth, strict=True):
        assert s == ts
        assert loss == pytest.approx(tloss, rel=1e-12)
        assert gn == tgn


def test_per_rank_no_reduce_streams_each_record_with_its_timestamp(tmp_path, offline):
    offline.mkdir()
    cfg = {
        "project": "p",
        "group": "g",
        "dir": str(offline),
        "mode": "offline",
        "logging_mode": "per_rank_no_reduce",
    }
    c = MetricCollector(
        tmp_path / "run", rank=1, process_name="GeneratorActor_r1", backends={"wandb": cfg}, step=3
    )
    for i in range(5):
        c.record("policy/latency_s", 0.1 * i)
    c.flush(3)
    c.shutdown()
    records = read_records(only_run_file(offline))
    rows = [r for r in history_rows(records) if "policy/latency_s" in r]
    kinds = [r.WhichOneof("record_type") for r in records]
    assert [r["policy/latency_s"] for r in rows] == [0.1 * i for i in range(5)], kinds
    assert {r["step"] for r in rows} == {3}
    assert all(r["_timestamp"] > 1.6e9 for r in rows)


def test_share_run_without_an_id_is_a_clear_error(tmp_path, offline):
    from metric_core.errors import ConfigError

    cfg = {"project": "p", "mode": "offline", "per_rank_share_run": True}
    with pytest.raises(ConfigError, match="per_rank_share_run needs a shared run id"):
        MetricCollector(tmp_path, backends={"wandb": cfg})
