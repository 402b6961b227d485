"""The command line through Typer's CliRunner: exit codes, messages, output files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from metriclog.main import app
from typer.testing import CliRunner

from metric_core import MetricCollector, Reduce

from .conftest import on_a_terminal, write_collector_run

runner = CliRunner()
SAMPLE = Path(__file__).resolve().parent.parent / "sample_logs" / "rl_run"


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_run")
    truth = write_collector_run(root, [("TrainActor_r0", 0), ("TrainActor_r1", 1)], steps=8)
    return root, truth


def test_every_command_has_help_with_an_example():
    commands = [c.name or c.callback.__name__ for c in app.registered_commands]
    assert "reduce" in commands
    for name in commands:
        result = invoke(name, "--help")
        assert result.exit_code == 0, name
        assert "Example:" in result.output, name
        assert "metriclog " + name in result.output, name


def test_reduce_prints_a_table(run):
    root, _ = run
    result = invoke("reduce", root, "--key", "trainer/loss", "--steps", "0:2")
    assert result.exit_code == 0, result.output
    assert "trainer/loss" in result.stdout
    assert "count" in result.stdout
    assert result.stderr == ""


@pytest.mark.parametrize("suffix", [".parquet", ".csv", ".jsonl"])
def test_reduce_writes_files_by_extension(run, tmp_path, suffix):
    root, truth = run
    out = tmp_path / f"out{suffix}"
    result = invoke("reduce", root, "--mode", "per_rank_reduce", "--out", out)
    assert result.exit_code == 0, result.output
    groups = {(r["process"], r["step"], r["key"]) for r in truth}
    assert f"wrote {len(groups)} row(s) to {out}" in result.stderr
    read = {".parquet": pl.read_parquet, ".csv": pl.read_csv, ".jsonl": pl.read_ndjson}[suffix]
    df = read(out)
    assert df.columns == ["process", "rank", "step", "key", "value", "reduction", "count"]
    loss = df.filter((pl.col("key") == "trainer/loss") & (pl.col("rank") == 1) & (pl.col("step") == 3))
    values = [r["value"] for r in truth if r["key"] == "trainer/loss" and r["rank"] == 1 and r["step"] == 3]
    assert loss["value"][0] == pytest.approx(float(np.mean(values)), rel=1e-12)


def test_jsonl_output_keeps_non_finite_values(tmp_path):
    c = MetricCollector(tmp_path / "run", rank=0)
    c.record("k", float("inf"), Reduce.MAX)
    c.shutdown()
    out = tmp_path / "o.jsonl"
    assert invoke("reduce", tmp_path / "run", "--out", out).exit_code == 0
    assert json.loads(out.read_text())["value"] == "Infinity"


def test_wide_pivots_one_column_per_key(run):
    root, _ = run
    result = invoke("reduce", root, "--wide", "--steps", "0:1")
    assert result.exit_code == 0
    header = result.stdout.splitlines()[1]
    for key in ("policy/latency_s", "policy/tokens", "trainer/grad_norm", "trainer/loss"):
        assert key in header


@pytest.mark.parametrize("mode", ["global_reduce", "per_rank_reduce"])
def test_wide_is_pivoted_a_frame_at_a_time_with_every_key_a_column(tmp_path, monkeypatch, mode):
    """A key recorded only from step 150 on is a column of every row, null before; the file
    is the long result pivoted at once; frames wait in a temporary directory, then it goes."""
    import tempfile

    from metric_core.offline import engine

    c = MetricCollector(tmp_path / "run", rank=0)
    for step in range(300):
        c.record("a", float(step), Reduce.MEAN)
        if step >= 150:
            c.record("b", 2.0 * step, Reduce.SUM)
        c.flush(step)
    c.shutdown()
    long_out, wide_out = tmp_path / "long.parquet", tmp_path / "wide.parquet"
    assert invoke("reduce", tmp_path / "run", "--mode", mode, "--out", long_out).exit_code == 0
    made: list[str] = []
    real = tempfile.TemporaryDirectory

    def recording(*args, **kwargs):
        made.append((d := real(*args, **kwargs)).name)
        return d

    monkeypatch.setattr(tempfile, "TemporaryDirectory", recording)
    monkeypatch.setattr(engine, "TAKEN_GROUPS", 1)  # a frame a block of 256 steps
    assert invoke("reduce", tmp_path / "run", "--mode", mode, "--wide", "--out", wide_out).exit_code == 0
    index = ["step"] if mode == "global_reduce" else ["process", "rank", "step"]
    want = pl.read_parquet(long_out).pivot(on="key", index=index, values="value").sort(index)
    got = pl.read_parquet(wide_out)
    assert got.columns == [*index, "a", "b"] and got.equals(want.select(got.columns))
    assert got["b"].null_count() == 150 and got.height == 300
    assert made and not any(Path(d).exists() for d in made)


def test_wide_with_no_reduce_is_a_usage_error(run):
    root, _ = run
    result = invoke("reduce", root, "--wide", "--mode", "per_rank_no_reduce")
    assert result.exit_code == 2
    assert "--wide needs a reducing mode" in result.stderr


def test_mixed_reductions_exit_1_with_the_exact_message(tmp_path):
    a = MetricCollector(tmp_path, rank=0, process_name="TrainActor_r0")
    b = MetricCollector(tmp_path, rank=1, process_name="GeneratorActor_r1")
    a.record("loss", 1.0, Reduce.MEAN)
    b.record("loss", 2.0, Reduce.SUM)
    a.shutdown()
    b.shutdown()
    result = invoke("reduce", tmp_path)
    assert result.exit_code == 1
    assert result.stderr == (
        "Error: key 'loss' is recorded with more than one reduction (mean by TrainActor_r0 (rank 0); "
        "sum by GeneratorActor_r1 (rank 1)). Choose one with --reduce 'loss=STAT'.\n"
    )
    assert invoke("reduce", tmp_path, "--reduce", "loss=mean").exit_code == 0


def test_empty_directory_is_exit_1(tmp_path):
    result = invoke("reduce", tmp_path)
    assert result.exit_code == 1
    assert result.stderr == (
        f"Error: no readable metric record in {tmp_path}: no *.jsonl or *.parquet file was found\n"
    )


def test_missing_directory_is_exit_1(tmp_path):
    result = invoke("reduce", tmp_path / "nope")
    assert result.exit_code == 1
    assert "it is not a directory" in result.stderr


def test_skips_are_summarized_and_strict_makes_them_fatal(tmp_path):
    write_collector_run(tmp_path, [("w", 0)], steps=2)
    (tmp_path / "extra.jsonl").write_text(
        '{"key": "a", "value": "x", "reduction": "mean", "step": 0, "timestamp": 1.0, "rank": 0}\nnot json\n'
    )
    result = invoke("reduce", tmp_path)
    assert result.exit_code == 0
    assert "warning: skipped 2 record(s) and 0 unreadable file(s)" in result.stderr
    assert (
        "extra.jsonl: 2 record(s) skipped: line 2: not valid JSON; line 1: 'value' is not a number"
        in result.stderr
    )
    strict = invoke("reduce", tmp_path, "--strict")
    assert strict.exit_code == 1
    assert strict.stderr.endswith("Error: --strict: records or files were skipped (see above)\n")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--by", "time", "--every", "ten"], "--every 'ten' is not a duration"),
        (["--by", "time"], "--by time needs a window length"),
        (["--every", "5s"], "--every sets the window of --by time"),
        (["--steps", "5"], "--steps '5' is not START:STOP"),
        (["--ranks", "a-b"], "--ranks 'a-b'"),
        (["--reduce", "loss=avg"], "unknown statistic 'avg'"),
        (["--mode", "global"], "Invalid value for '--mode'"),
    ],
)
def test_bad_option_syntax_is_a_usage_error(run, args, message):
    root, _ = run
    result = invoke("reduce", root, *args)
    assert result.exit_code == 2
    assert message in result.stderr


def test_bad_out_extension_is_exit_1(run, tmp_path):
    root, _ = run
    result = invoke("reduce", root, "--out", tmp_path / "x.xlsx")
    assert result.exit_code == 1
    assert "use a file ending in .parquet, .csv, .jsonl" in result.stderr


def test_long_results_are_cut_and_the_cut_is_said(run):
    root, _ = run
    result = invoke("reduce", root, "--mode", "per_rank_no_reduce")
    assert result.exit_code == 0
    assert "more row(s) not shown" in result.stdout


def test_sample_run_reduces_and_reports_its_killed_generator():
    result = invoke("reduce", SAMPLE, "--key", "policy/*", "--steps", "179:182", "--mode", "per_rank_reduce")
    assert result.exit_code == 0, result.output
    assert "GeneratorActor_r1.r1.00001.journal" in result.stderr
    assert "unfinished write at the end" in result.stderr
    assert "GeneratorActor_r1" in result.stdout


def test_a_reduction_no_statistic_names_is_a_data_error_naming_every_such_key(tmp_path):
    lines = [
        {"key": key, "value": 1.0, "reduction": red, "step": 0, "timestamp": 1.7e9, "rank": 0}
        for key, red in (("a", "banana"), ("b", ""), ("c", "mean"))
    ]
    (tmp_path / "x.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = invoke("reduce", tmp_path)
    assert result.exit_code == 1, result.output
    assert "Usage:" not in result.output
    assert "'a' ('banana'), 'b' ('')" in result.stderr and "--reduce 'a=mean'" in result.stderr
    fixed = invoke("reduce", tmp_path, "--reduce", "a=max", "--reduce", "b=sum")
    assert fixed.exit_code == 0, fixed.output


def test_what_was_skipped_is_said_before_a_failure_too(tmp_path):
    good = {"key": "a", "value": 1.0, "reduction": "mean", "step": 0, "timestamp": 1.7e9, "rank": 0}
    (tmp_path / "x.jsonl").write_text(json.dumps(good) + "\nnot json\n" + json.dumps(good) + "\n")
    result = invoke("reduce", tmp_path, "--key", "nomatch*")
    assert result.exit_code == 1
    warning, error = result.stderr.index("x.jsonl: 1 record(s) skipped"), result.stderr.index("Error:")
    assert warning < error, result.stderr


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_a_result_written_into_the_run_directory_is_not_read_as_data(tmp_path, suffix):
    truth = write_collector_run(tmp_path, [("TrainActor_r0", 0), ("TrainActor_r1", 1)], steps=5)
    before = invoke("reduce", tmp_path, "--out", tmp_path.parent / "before.csv")
    export = invoke("reduce", tmp_path, "--mode", "per_rank_no_reduce", "--out", tmp_path / f"raw{suffix}")
    assert export.exit_code == 0, export.output
    assert "is inside the run directory" in export.stderr
    after = invoke("reduce", tmp_path, "--out", tmp_path.parent / "after.csv")
    assert after.exit_code == 0, after.output
    assert (
        f"raw{suffix}: a result metriclog wrote (reduce --mode per_rank_no_reduce), not data" in after.stderr
    )
    counts = pl.read_csv(tmp_path.parent / "after.csv")["count"]
    assert (
        counts.sum() == len(truth)
        and counts.to_list() == pl.read_csv(tmp_path.parent / "before.csv")["count"].to_list()
    )
    assert before.exit_code == 0


def test_a_copied_segment_is_read_once_and_the_copy_named(tmp_path):
    import shutil

    truth = write_collector_run(tmp_path, [("TrainActor_r0", 0)], steps=4)
    (segment,) = tmp_path.glob("*.parquet")
    (tmp_path / "Backup").mkdir()  # sorts before the original: the shallower one is still read
    shutil.copy(segment, tmp_path / "Backup" / segment.name)
    result = invoke("reduce", tmp_path, "--out", tmp_path.parent / "x.csv")
    assert result.exit_code == 0, result.output
    assert (
        f"Backup/{segment.name} is a copy of {segment.name} (the same sealed segment): read once"
        in result.stderr
    )
    assert pl.read_csv(tmp_path.parent / "x.csv")["count"].sum() == len(truth)


# `metriclog` with the progress bar's two-second wait set to zero
BAR_AT_ONCE = (
    "import sys\n"
    "from metriclog import output\n"
    "output.PROGRESS_AFTER_S = 0.0\n"
    "from metriclog.main import main\n"
    "main()\n"
)


@pytest.mark.parametrize(
    "command",
    [
        ["reduce", "{run}", "--mode", "per_rank_reduce"],
        ["reduce", "{run}", "--mode", "per_rank_no_reduce", "--out", "{tmp}/raw.csv"],
        ["inspect", "{run}"],
        ["upload", "{run}", "--project", "p", "--dry-run", "--mode", "per_rank_reduce"],
    ],
    ids=["reduce", "raw", "inspect", "upload"],
)
def test_a_long_read_shows_a_progress_bar_on_a_terminal_and_nothing_in_a_pipe(tmp_path, command):
    run = tmp_path / "run"
    write_collector_run(run, [(f"TrainActor_r{r}", r) for r in range(3)], steps=30)
    args = [a.format(run=run, tmp=tmp_path) for a in command]
    code, shown, stdout = on_a_terminal([sys.executable, "-c", BAR_AT_ONCE, *args])
    assert code == 0, shown
    assert "reading 3/3 parts" in shown, shown
    assert b"parts" not in stdout
    piped = runner.invoke(app, args)  # stderr not a terminal: no bar
    assert piped.exit_code == 0 and "parts" not in piped.output
