"""Every option with a fixed set of choices takes them as a torchforge user spells them:
the enum's member name (``--mode GLOBAL_REDUCE``), with ``-`` or ``_``, in any case; a
wrong one is refused naming the choices, with the near ones ("did you mean")."""

from __future__ import annotations

from pathlib import Path

import pytest
from metriclog.main import app
from typer.testing import CliRunner

import metric_core
from metric_core import Reduce

runner = CliRunner()
SAMPLE = Path(__file__).resolve().parent.parent / "sample_logs" / "rl_run"
# The columns of reduce's long format in each mode (SPEC.md, "reduce output").
COLUMNS = {
    "global_reduce": "step,key,value,reduction,count",
    "per_rank_reduce": "process,rank,step,key,value,reduction,count",
    "per_rank_no_reduce": "process,rank,step,timestamp,key,value,reduction",
}


def invoke(*args: object):
    return runner.invoke(app, [str(a) for a in args])


@pytest.mark.parametrize(
    ("mode", "spellings"),
    [
        ("global_reduce", ["GLOBAL_REDUCE", "global-reduce", "Global_Reduce", "GLOBAL-REDUCE"]),
        ("per_rank_reduce", ["PER_RANK_REDUCE", "per-rank-reduce"]),
        ("per_rank_no_reduce", ["PER_RANK_NO_REDUCE", "per-rank-no-reduce"]),
    ],
)
def test_mode_takes_the_enum_name_and_dashes(mode, spellings):
    want = invoke("reduce", SAMPLE, "--mode", mode, "--format", "csv")
    assert want.exit_code == 0, want.output
    assert want.stdout.splitlines()[0] == COLUMNS[mode]
    for spelled in spellings:
        got = invoke("reduce", SAMPLE, "--mode", spelled, "--format", "csv")
        assert got.exit_code == 0, (spelled, got.output)
        assert got.stdout == want.stdout, spelled


@pytest.fixture(scope="module")
def samples_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("choices") / "run"
    metric_core.init(run, rank=0, process_name="gen_r0")
    for step in range(2):
        for reward in (0.25, 0.75):
            metric_core.record_metric("rollout", {"reward": reward + step, "text": "t"}, Reduce.SAMPLE)
        metric_core.flush(step)
    metric_core.shutdown()
    return run


@pytest.mark.parametrize(
    ("args", "option", "value", "spellings"),
    [
        (["reduce", SAMPLE, "--format", "csv"], "--by", "step", ["STEP", "Step"]),
        (["reduce", SAMPLE, "--format", "csv"], "--engine", "local", ["LOCAL"]),
        (["reduce", SAMPLE, "--format", "csv"], "--attempts", "all", ["ALL", "All"]),
        (["reduce", SAMPLE, "--format", "csv"], "--attempts", "rewind", ["REWIND"]),
        (["reduce", SAMPLE], "--format", "jsonl", ["JSONL", "JsonL"]),
        (["keys", SAMPLE], "--format", "json", ["JSON"]),
        (["inspect", SAMPLE], "--format", "csv", ["CSV"]),
        (["samples", "SAMPLES_RUN", "--format", "csv"], "--attempts", "all", ["ALL"]),
        (["samples", "SAMPLES_RUN"], "--format", "jsonl", ["JSONL"]),
    ],
)
def test_every_choice_takes_any_case(samples_run, args, option, value, spellings):
    args = [samples_run if a == "SAMPLES_RUN" else a for a in args]
    want = invoke(*args, option, value)
    assert want.exit_code == 0, want.output
    assert want.stdout.strip()
    for spelled in spellings:
        got = invoke(*args, option, spelled)
        assert got.exit_code == 0, (spelled, got.output)
        assert got.stdout == want.stdout, spelled


def test_upload_to_takes_any_case(tmp_path):
    want = invoke("upload", SAMPLE, "--to", "tensorboard", "--logdir", tmp_path / "a", "--dry-run")
    assert want.exit_code == 0, want.output
    got = invoke("upload", SAMPLE, "--to", "TensorBoard", "--logdir", tmp_path / "a", "--dry-run")
    assert got.exit_code == 0, got.output
    assert got.stdout == want.stdout


@pytest.mark.parametrize("spelled", ["RAW", "Raw", "GLOBAL"])
def test_alert_on_takes_any_case(tmp_path, spelled):
    """Past the options, the missing run directory is what is refused."""
    want = invoke("watch", tmp_path / "no-such-run", "--alert", "x > 1", "--alert-on", spelled.lower())
    got = invoke("watch", tmp_path / "no-such-run", "--alert", "x > 1", "--alert-on", spelled)
    assert got.exit_code == want.exit_code == 1
    assert got.stderr == want.stderr
    assert "no-such-run: it does not exist" in got.stderr, got.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["reduce", "--mode", "globl-reduce"],
            "Invalid value for '--mode': 'globl-reduce' is not one of global_reduce, per_rank_reduce, "
            "per_rank_no_reduce; did you mean 'global_reduce'?",
        ),
        (
            ["reduce", "--mode", "PER-RANK"],
            "Invalid value for '--mode': 'PER-RANK' is not one of global_reduce, per_rank_reduce, "
            "per_rank_no_reduce; did you mean 'per_rank_reduce' or 'per_rank_no_reduce'?",
        ),
        (
            ["reduce", "--by", "TIMES"],
            "Invalid value for '--by': 'TIMES' is not one of step, time; did you mean 'time'?",
        ),
        (
            ["reduce", "--engine", "Rayy"],
            "Invalid value for '--engine': 'Rayy' is not one of local, ray; did you mean 'ray'?",
        ),
        (
            ["keys", "--format", "CVS"],
            "Invalid value for '--format': 'CVS' is not one of table, csv, json, jsonl; did you mean 'csv'?",
        ),
        (
            ["samples", "--attempts", "rewnd"],
            "Invalid value for '--attempts': 'rewnd' is not one of rewind, all; did you mean 'rewind'?",
        ),
        (
            ["watch", "--alert-on", "rwa"],
            "Invalid value for '--alert-on': 'rwa' is not one of raw, global; did you mean 'raw'?",
        ),
        (
            ["upload", "--to", "WANDBB", "--project", "p"],
            "Invalid value for '--to': 'WANDBB' is not one of wandb, tensorboard, mlflow; did you mean "
            "'wandb'?",
        ),
    ],
)
def test_a_wrong_choice_names_the_choices_and_the_near_ones(tmp_path, args, message):
    command, *options = args
    result = invoke(command, tmp_path / "no-such-run", *options)  # not read: the options fail first
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == f"Error: {message}"
    assert "Value error" not in result.output
