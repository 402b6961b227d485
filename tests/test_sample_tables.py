"""Samples (Reduce.SAMPLE) as torchforge's PR #486 shows them live, and as `upload
--sample-tables incremental` sends them: read back from what the real wandb client wrote
offline, against a sort of the recorded samples; every sample stays in the run's files."""

from __future__ import annotations

import json
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

import metric_core
from metric_core import MetricCollector, Reduce, read_samples, record_metric, reduce_metrics_states
from metric_core.errors import ConfigError, MetricLogWarning
from metric_core.writer.sidecar import sidecar_command

from .wandb_file import find_run_file, logged_tables

METRICLOG = str(Path(sys.executable).with_name("metriclog"))


@pytest.fixture
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    root = tmp_path / "wandb_root"
    root.mkdir()
    return root


def recorded_steps(steps: int = 4, per_step: int = 6, seed: int = 0) -> list[list[dict[str, Any]]]:
    """Each step's samples: distinct random rewards, a list field, a text field."""
    rng = np.random.default_rng(seed)
    return [
        [{"prompt": f"{step}/{i}", "reward": float(rng.normal()), "ids": [i, step]} for i in range(per_step)]
        for step in range(steps)
    ]


def bottom_top(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """torchforge's SampleAccumulator(top_k=1, bottom_k=1) by a sort: the lowest, then the highest."""
    rewards = np.array([s["reward"] for s in samples])
    return [samples[int(np.argmin(rewards))], samples[int(np.argmax(rewards))]]


def prompts(rows: list[dict[str, Any]]) -> list[str]:
    return [r["prompt"] for r in rows]


def live_run(tmp_path: Path, root: Path, mode: str, steps: list[list[dict[str, Any]]], **more: Any) -> Path:
    cfg = {"project": "p", "dir": str(root), "mode": "offline", "logging_mode": mode}
    c = MetricCollector(tmp_path / "run", rank=0, process_name="gen_r0", backends={"wandb": cfg}, **more)
    for step, samples in enumerate(steps):
        for sample in samples:
            c.record("rollout", sample, Reduce.SAMPLE)
        c.record("loss", float(step))
        c.flush(step)
    c.shutdown()
    (run_file,) = root.rglob("run-*.wandb")
    return run_file


def test_per_rank_reduce_logs_each_steps_bottom_and_top_into_one_incremental_table(tmp_path, offline):
    steps = recorded_steps()
    run_file = live_run(tmp_path, offline, "per_rank_reduce", steps)

    logged = logged_tables(run_file, "rollout_table")
    assert [(step, kind) for step, kind, _ in logged] == [(s, "incremental-table-file") for s in range(4)]
    want = [bottom_top(samples) for samples in steps]
    assert [prompts(rows) for _, _, rows in logged] == [prompts(w) for w in want]
    assert [json.loads(r["ids"]) for _, _, rows in logged for r in rows] == [
        s["ids"] for w in want for s in w
    ]
    assert list(logged[0][2][0]) == ["ids", "prompt", "reward"]  # torchforge's sorted columns

    # at finish: every row once more, as one immutable table under the key itself
    ((step, kind, rows),) = logged_tables(run_file, "rollout")
    assert (step, kind) == (3, "table-file")
    assert prompts(rows) == [s["prompt"] for w in want for s in w]

    # every sample is still in the run's files, whatever the backend showed
    assert [s.fields for s in read_samples(tmp_path / "run").samples] == [s for ss in steps for s in ss]


def test_per_rank_no_reduce_streams_every_sample_without_top_or_bottom(tmp_path, offline):
    steps = recorded_steps(steps=3, per_step=5, seed=1)
    run_file = live_run(tmp_path, offline, "per_rank_no_reduce", steps, flush_interval=0.05)

    logged = logged_tables(run_file, "rollout_table")
    increments = [row for _, kind, rows in logged for row in rows if kind == "incremental-table-file"]
    assert prompts(increments) == [s["prompt"] for ss in steps for s in ss]
    assert [r["reward"] for r in increments] == [s["reward"] for ss in steps for s in ss]
    ((_, kind, rows),) = logged_tables(run_file, "rollout")
    assert kind == "table-file" and prompts(rows) == prompts(increments)


def test_metriclog_samples_still_lists_every_sample_a_live_backend_left_out(tmp_path, offline):
    import subprocess

    steps = recorded_steps(steps=2, per_step=7, seed=2)
    live_run(tmp_path, offline, "per_rank_reduce", steps)
    done = subprocess.run(
        [METRICLOG, "samples", str(tmp_path / "run"), "--format", "json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    listed = json.loads(done.stdout)
    assert [(r["step"], r["prompt"], r["reward"]) for r in listed] == [
        (step, s["prompt"], s["reward"]) for step, ss in enumerate(steps) for s in ss
    ]


def test_flush_returns_the_samples_states_and_reduce_metrics_states_joins_the_ranks(tmp_path):
    steps = [recorded_steps(steps=1, per_step=5, seed=seed)[0] for seed in (3, 4)]
    states = []
    for rank, samples in enumerate(steps):
        c = MetricCollector(tmp_path / "run", rank=rank, process_name=f"gen_r{rank}")
        for sample in samples:
            c.record("rollout", sample, Reduce.SAMPLE)
        c.record("loss", 1.0)
        states.append(c.flush(0, return_state=True))
        c.shutdown()
    for rank_states, samples in zip(states, steps, strict=True):
        assert rank_states["rollout"] == {"reduction_type": "sample", "samples": bottom_top(samples)}
    merged = {m.key: m for m in reduce_metrics_states(states)}
    assert merged["rollout"].reduction is Reduce.SAMPLE
    assert merged["rollout"].value == bottom_top(steps[0]) + bottom_top(steps[1])
    assert merged["loss"].value == 1.0


def test_a_field_that_comes_after_the_columns_were_set_is_said_and_kept_on_disk(tmp_path, offline):
    late = {"prompt": "1/0", "reward": 5.0, "judge": "ok"}
    steps = [[{"prompt": "0/0", "reward": 1.0}], [late]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_file = live_run(tmp_path, offline, "per_rank_reduce", steps)
    said = [str(w.message) for w in caught if issubclass(w.category, MetricLogWarning)]
    assert [s for s in said if "judge" in s] == [
        "samples of 'rollout': field(s) judge came after the W&B table's columns were set (prompt, "
        "reward); an incremental table cannot grow columns, so W&B does not show them. Every field "
        "is on disk: `metriclog samples` lists them"
    ]
    rows = [row for _, _, rows in logged_tables(run_file, "rollout_table") for row in rows]
    assert rows == [{"prompt": "0/0", "reward": 1.0}, {"prompt": "1/0", "reward": 5.0}]
    assert read_samples(tmp_path / "run").samples[-1].fields == late


# torchforge's GRPO Episode as PR #486 gives it a to_dict (apps/grpo/main.py), without torch.
@dataclass
class Episode:
    episode_id: str
    pad_id: int
    request_len: int
    response_len: int
    target: Any | None = None
    request: str | None = None
    response: str | None = None
    completion: Any | None = None
    ref_logprobs: Any | None = None
    reward: float | None = None
    reward_breakdown: dict[str, float] | None = None
    advantage: float | None = None
    policy_version: int | None = None
    excluded: list[str] | None = None

    def to_dict(self, exclude: list[str] | None = None) -> dict[str, Any]:
        self.excluded = exclude
        result = {
            "episode_id": self.episode_id,
            "policy_version": self.policy_version,
            "prompt": self.request,
            "response": self.response,
            "target": str(self.target),
            "reward": self.reward,
            "advantage": self.advantage,
            "request_len": self.request_len,
            "response_len": self.response_len,
            "pad_id": self.pad_id,
            "ref_logprobs": self.ref_logprobs,
            "completion": self.completion,
        }
        if self.reward_breakdown is not None and "reward_breakdown" not in (exclude or []):
            result.update(self.reward_breakdown)
        for key in exclude or []:
            result.pop(key, None)
        return result


def test_record_episode_sample_records_the_episode_dict_without_tensors_or_completion(tmp_path):
    from metric_core.torchforge import record_episode_sample

    episodes = [
        Episode(
            f"e{i}",
            0,
            8,
            16,
            target=4,
            request="2+2?",
            response=str(i),
            completion=object(),
            ref_logprobs=[-0.5] * 3,
            reward=float(i),
            reward_breakdown={"MathReward": float(i)},
            advantage=0.5 - i,
            policy_version=1,
        )
        for i in range(3)
    ]
    metric_core.init(tmp_path / "run", process_name="controller")
    for episode in episodes:
        record_episode_sample("main_samples/continuous_rollouts/sample_table", episode)
    metric_core.flush(0)
    metric_core.shutdown()
    assert [e.excluded for e in episodes] == [["ref_logprobs", "completion"]] * 3
    got = read_samples(tmp_path / "run").samples
    assert {s.key for s in got} == {"main_samples/continuous_rollouts/sample_table"}
    assert [s.fields for s in got] == [
        {
            "episode_id": f"e{i}",
            "policy_version": 1,
            "prompt": "2+2?",
            "response": str(i),
            "target": "4",
            "reward": float(i),
            "advantage": 0.5 - i,
            "request_len": 8,
            "response_len": 16,
            "pad_id": 0,
            "MathReward": float(i),
        }
        for i in range(3)
    ]


def test_record_episode_sample_and_sample_accumulator_are_torchforges_names():
    import metric_core.torchforge as tf
    from metric_core.torchforge import metrics

    assert {"SampleAccumulator", "record_episode_sample"} <= set(tf.__all__) & set(metrics.__all__)
    acc = tf.SampleAccumulator(tf.Reduce.SAMPLE, top_k=2, bottom_k=1, key="score")
    for i, score in enumerate([3.0, -1.0, 7.0, 5.0]):
        acc.append({"i": i, "score": score})
    assert acc.get_state() == {
        "reduction_type": "sample",
        "samples": [{"i": 1, "score": -1.0}, {"i": 3, "score": 5.0}, {"i": 2, "score": 7.0}],
    }
    assert Reduce.SAMPLE.accumulator_class is tf.SampleAccumulator


def upload(run: Path, *more: str) -> list[tuple[int | None, str, list[dict[str, Any]]]]:
    from cli.main import app

    done = CliRunner().invoke(app, ["upload", str(run), "--project", "p", "--offline", "--force-new", *more])
    assert done.exit_code == 0, done.output
    ledger = json.loads((run / ".metriclog" / "uploads.json").read_text())["runs"]
    newest = list(ledger)[-1]
    return find_run_file(run / ".metriclog" / "wandb", newest)


def written_run(run: Any, steps: list[list[dict[str, Any]]]) -> None:
    """A run of one process whose step k holds ``steps[k]`` as samples of 'rollout' and a loss."""
    metric_core.init(run, process_name="gen")
    for step, samples in enumerate(steps):
        for sample in samples:
            record_metric("rollout", sample, Reduce.SAMPLE)
        record_metric("loss", float(step))
        metric_core.flush(step)
    metric_core.shutdown()


def test_upload_sample_tables_incremental_sends_torchforges_shape_and_per_step_stays_the_default(
    tmp_path, offline
):
    steps = recorded_steps(steps=3, per_step=6, seed=5)
    written_run(tmp_path / "run", steps)
    # upload's choice, by a sort: the top 2 by reward, then the bottom 2, lowest first
    chosen = []
    for samples in steps:
        order = np.argsort([s["reward"] for s in samples], kind="stable")
        chosen.append([samples[i] for i in order[::-1][:2]] + [samples[i] for i in order[:2]])

    run_file = upload(tmp_path / "run", "--sample-tables", "incremental")
    logged = logged_tables(run_file, "rollout_table")
    assert [(step, kind) for step, kind, _ in logged] == [(s, "incremental-table-file") for s in range(3)]
    assert [prompts(rows) for _, _, rows in logged] == [prompts(c) for c in chosen]
    ((step, kind, rows),) = logged_tables(run_file, "rollout")
    assert (step, kind) == (2, "table-file")
    assert prompts(rows) == [s["prompt"] for c in chosen for s in c]

    run_file = upload(tmp_path / "run")  # the default: a table a step, under the key
    assert logged_tables(run_file, "rollout_table") == []
    per_step = logged_tables(run_file, "rollout")
    assert [(step, kind, prompts(rows)) for step, kind, rows in per_step] == [
        (s, "table-file", prompts(c)) for s, c in enumerate(chosen)
    ]


def test_upload_follow_sends_the_incremental_tables_and_their_immutable_copy_at_the_end(tmp_path, offline):
    from metric_core import make_plan
    from metric_core.offline.samples import SampleChoice
    from metric_core.offline.upload import Follow, WandB, upload_run

    steps = recorded_steps(steps=3, per_step=4, seed=6)
    written_run(tmp_path / "run", steps)
    choice = SampleChoice(top=1, bottom=1, tables="incremental")
    upload_run(
        tmp_path / "run",
        make_plan(),
        WandB("p", offline=True),
        follow=Follow(interval=0.2),
        samples=choice,
    )
    ledger = json.loads((tmp_path / "run" / ".metriclog" / "uploads.json").read_text())["runs"]
    (run_id,) = ledger
    run_file = find_run_file(tmp_path / "run" / ".metriclog" / "wandb", run_id)
    want = [list(reversed(bottom_top(samples))) for samples in steps]  # upload's order: top, then bottom
    logged = logged_tables(run_file, "rollout_table")
    assert [(step, prompts(rows)) for step, _, rows in logged] == [
        (s, prompts(w)) for s, w in enumerate(want)
    ]
    ((step, kind, rows),) = logged_tables(run_file, "rollout")
    assert (step, kind, prompts(rows)) == (2, "table-file", [s["prompt"] for w in want for s in w])


def test_a_sample_tables_value_that_is_none_of_the_two_is_refused(tmp_path):
    from cli.main import app

    done = CliRunner().invoke(app, ["upload", str(tmp_path), "--project", "p", "--sample-tables", "incr"])
    assert done.exit_code == 2
    assert "'incr' is not one of per-step, incremental; did you mean 'incremental'?" in done.output
    with pytest.raises(
        ConfigError, match="sidecar: sample_tables='increment' is not one of per-step, incremental"
    ):
        sidecar_command("run", {"project": "p", "sample_tables": "increment"})
    command = sidecar_command("run", {"project": "p", "sample_tables": "incremental"})
    assert command[-2:] == ["--sample-tables", "incremental"]


def test_a_global_reduce_wandb_config_passes_sample_tables_to_the_sidecar():
    from metric_core.torchforge.metrics import sidecar_options

    config = {"logging_mode": "global_reduce", "project": "p", "sample_tables": "incremental"}
    options = sidecar_options(config)
    assert options == {
        "mode": "global_reduce",
        "offline": False,
        "project": "p",
        "sample_tables": "incremental",
    }
    assert sidecar_command("run", options)[-2:] == ["--sample-tables", "incremental"]
