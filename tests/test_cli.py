"""The command line through Typer's CliRunner: exit codes, messages, output files."""

from __future__ import annotations

import json
import os
import subprocess
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
ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "sample_logs" / "rl_run"
METRICLOG = str(Path(sys.executable).with_name("metriclog"))  # the installed command


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_run")
    truth = write_collector_run(root, [("TrainActor_r0", 0), ("TrainActor_r1", 1)], steps=8)
    return root, truth


def test_every_command_has_help_with_an_example_on_one_line_to_copy():
    commands = [c.name or c.callback.__name__ for c in app.registered_commands]
    assert "reduce" in commands
    for name in commands:
        result = runner.invoke(app, [name, "--help"], env={"COLUMNS": "60"}, terminal_width=60)
        assert result.exit_code == 0, name
        runs = {
            "compare": "RUN...",
            "plot": "RUN...",
            "upload": "RUN...",
            "diff": "RUN_A RUN_B",
            "import": "SRC RUN_DIR",
        }.get(name, "RUN_DIR")
        assert result.output.startswith(f"Usage: metriclog {name} [OPTIONS] {runs}\n"), name
        lines = result.output.splitlines()
        heading = next(i for i, line in enumerate(lines) if line in ("  Example:", "  Examples:"))
        shown = [line.strip() for line in lines[heading + 2 :] if line.strip().startswith("metriclog ")]
        docstring = app.registered_commands[commands.index(name)].callback.__doc__
        written = [line.strip() for line in docstring.splitlines() if line.strip().startswith("metriclog ")]
        assert shown == written, name  # each whole command on one line, however narrow the terminal


def test_a_command_built_alone_has_the_help_and_errors_it_has_among_all():
    """The installed command builds only the command it is asked for (a start-up saving):
    each one's help is the one the whole group gives, and a mistyped name still gets the
    suggestion."""
    env = {**os.environ, "COLUMNS": "60"}
    for command in app.registered_commands:
        name = command.name or command.callback.__name__
        # click formats a terminal of COLUMNS=60 at 58 (shutil's width less 2)
        whole = runner.invoke(app, [name, "--help"], env={"COLUMNS": "60"}, terminal_width=58)
        alone = subprocess.run([METRICLOG, name, "--help"], capture_output=True, text=True, env=env)
        assert alone.returncode == 0, name
        assert alone.stdout == whole.output, name
    typo = subprocess.run([METRICLOG, "reduc", str(SAMPLE)], capture_output=True, text=True, env=env)
    assert typo.returncode == 2
    assert "No such command 'reduc'. Did you mean 'reduce'?" in typo.stderr


def test_filters_that_match_nothing_name_the_filter_and_what_the_run_holds():
    key = invoke("reduce", SAMPLE, "--key", "nomatch/*")
    assert key.exit_code == 1
    assert key.stderr.splitlines()[-1] == (
        f"Error: no record in {SAMPLE} matches the filters: --key 'nomatch/*' matches no key; nearest of "
        "the run's 8 keys: policy/latency_s, policy/latency_std_s, policy/reward"
    )
    ranks = invoke("reduce", SAMPLE, "--ranks", "7")
    assert ranks.exit_code == 1
    assert ranks.stderr.splitlines()[-1] == (
        f"Error: no record in {SAMPLE} matches the filters: --ranks '7' matches no record (no rank 7); "
        "the run's ranks: 0-1"
    )


def test_a_reduce_pattern_that_matches_nothing_is_a_warning_and_with_strict_an_error(tmp_path):
    run = tmp_path / "run"
    write_collector_run(run, [("TrainActor_r0", 0), ("TrainActor_r1", 1)], steps=3)
    args = ["reduce", run, "--key", "trainer/loss", "--reduce", "trainer/lss=p99"]
    warned = invoke(*args, "--out", tmp_path / "out.csv")
    assert warned.exit_code == 0
    said = (
        "--reduce 'trainer/lss=p99' matches no key; the run's keys: policy/latency_s, policy/tokens, "
        "trainer/grad_norm, trainer/loss"
    )
    assert warned.stderr.splitlines()[-1] == f"warning: {said}"
    assert pl.read_csv(tmp_path / "out.csv")["reduction"].unique().to_list() == ["mean"]
    strict = invoke(*args, "--strict", "--out", tmp_path / "strict.csv")
    assert strict.exit_code == 1
    assert strict.stderr.splitlines()[-1] == f"Error: --strict: {said}"
    assert not list(tmp_path.glob("*strict.csv*"))  # nothing written


def table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line[:1] in "┌│╞└"]


def test_tables_fit_the_terminal_and_say_every_cut(tmp_path):
    run = tmp_path / "run"
    c = MetricCollector(run, rank=0)
    long_key = "eval/" + "very_long_name_" * 6 + "accuracy"  # 103 characters
    keys = [f"k{i:02d}" for i in range(63)]
    for step in range(3):
        for key in (*keys, long_key):
            c.record(key, step + 0.5, Reduce.MEAN)
        c.flush(step)
    c.shutdown()

    def reduce(*args: str, columns: str = "80"):
        result = runner.invoke(
            app, ["reduce", str(run), "--format", "table", *args], env={"COLUMNS": columns}
        )
        assert result.exit_code == 0, result.output
        assert "not shown" not in result.stdout and "are cut" not in result.stdout  # notes: on stderr
        assert max(map(len, result.stderr.splitlines()), default=0) <= int(columns)  # notes wrapped too
        return result.stdout + " ".join(result.stderr.split())  # a note wrapped over lines, as one

    wide = reduce("--wide")
    assert max(map(len, table_lines(wide))) <= 80
    header = [c.strip() for c in table_lines(wide)[1].strip("│").split("┆")]
    assert header[0] == "step" and len(header) < 65
    assert f"columns not shown, for the terminal's width (80): {65 - len(header)} columns; " in wide

    long = reduce("--key", "eval/*", columns="200")
    assert long_key in long and "cut" not in long  # whole where it fits
    cut = reduce("--key", "eval/*", "--mode", "per_rank_no_reduce", columns="60")
    assert max(map(len, table_lines(cut))) <= 60 and long_key not in cut and "…" in cut
    assert "long values are cut (…) for the terminal's width (60); --out FILE.csv has them whole" in cut


@pytest.mark.parametrize("columns", [1, 20, 24, 40])
def test_a_narrow_terminal_keeps_what_identifies_a_row_and_never_cuts_a_number(tmp_path, columns):
    run = tmp_path / "run"
    write_collector_run(run, [("GeneratorActor_r0", 0), ("GeneratorActor_r1", 1)], steps=2)
    c = MetricCollector(run, rank=2, process_name="评估_r2")  # East Asian wide characters
    c.record("评估/准确率", 1.234567e-05, Reduce.MEAN)
    c.flush(0)
    c.shutdown()
    for mode in ("per_rank_reduce", "per_rank_no_reduce"):
        keys = ["--key", "trainer/loss", "--key", "评估/*"]
        result = runner.invoke(
            app,
            ["reduce", str(run), "--mode", mode, "--format", "table", *keys],
            env={"COLUMNS": str(columns)},
        )
        assert result.exit_code == 0, result.output
        lines = table_lines(result.stdout)
        header = [c.strip() for c in lines[1].strip("│").split("┆")]
        assert {"process", "step", "key", "value"} <= set(header), (mode, header)
        rows = [[c.strip() for c in line.strip("│").split("┆")] for line in lines[3:-1]]
        at = {name: header.index(name) for name in ("process", "value")}
        # every process still tells its rank (cut in the middle, its end kept)
        assert {r[at["process"]][-3:] for r in rows} == {"_r0", "_r1", "_r2"}
        # a value is never cut: the wide source's is printed whole
        assert "1.234567e-05" in {r[at["value"]] for r in rows}
        assert all("…" not in r[at["value"]] for r in rows)


def test_times_print_as_local_iso_8601_with_the_offset(tmp_path, india):
    from datetime import datetime, timedelta, timezone

    run = tmp_path / "run"
    write_collector_run(run, [("TrainActor_r0", 0)], steps=3)
    raw = invoke("reduce", run, "--key", "trainer/loss", "--mode", "per_rank_no_reduce", "--format", "table")
    stamps = pl.read_parquet(next(run.glob("*.parquet"))).filter(pl.col("key") == "trainer/loss")["timestamp"]
    india_time = timezone(timedelta(hours=5, minutes=30))
    for t in stamps:
        assert datetime.fromtimestamp(t, india_time).isoformat(timespec="milliseconds") in raw.stdout


def test_raw_mode_by_time_keeps_each_record_s_step_beside_its_window(tmp_path):
    run = tmp_path / "run"
    truth = write_collector_run(run, [("TrainActor_r0", 0)], steps=4)
    out = tmp_path / "raw.parquet"
    args = ["--mode", "per_rank_no_reduce", "--by", "time", "--every", "1s", "--out", out]
    assert invoke("reduce", run, *args).exit_code == 0
    got = pl.read_parquet(out)
    assert got.columns == [
        "process",
        "rank",
        "step",
        "window_start",
        "timestamp",
        "key",
        "value",
        "reduction",
    ]
    want = sorted((r["step"], r["timestamp"], r["key"], r["value"]) for r in truth)
    assert sorted(got.select("step", "timestamp", "key", "value").rows()) == want
    t0 = min(r["timestamp"] for r in truth)
    np.testing.assert_array_equal(got["window_start"], t0 + np.floor((got["timestamp"] - t0) / 1.0))


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path):
    import os
    import subprocess

    read, write = os.pipe()
    os.close(read)  # as `| head -1` does once it has its line
    try:
        done = subprocess.run(
            [METRICLOG, "reduce", SAMPLE, "--mode", "per_rank_no_reduce"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
    assert done.returncode == 0
    assert "Broken pipe" not in done.stderr and "Traceback" not in done.stderr
    assert done.stderr.startswith("warning: skipped 25 record(s)")  # what it said before, only


@pytest.mark.parametrize("closed", [1, 2], ids=["stdout", "stderr"])
def test_a_command_started_with_its_output_closed_ends_quietly_and_writes_its_file(tmp_path, closed):
    """``metriclog ... >&-`` (or ``2>&-``): what it would say goes to no one, as to a reader
    that went away; the result file is written, exit 0, no traceback (it once failed on
    Python's None for the closed stream). Rows that would go to a closed stdout are refused
    before any read, exit 1 (a new user's trial: ``reduce RUN >&-`` lost them, exit 0)."""
    import os
    import subprocess

    def close() -> None:
        os.close(closed)

    rows = (
        ["reduce", SAMPLE],
        ["keys", SAMPLE],
        ["samples", SAMPLE],
        ["compare", SAMPLE, SAMPLE, "--label", "a", "--label", "b"],
    )
    for args in (["--version"], *rows, ["reduce", SAMPLE, "--out", tmp_path / "r.parquet"]):
        done = subprocess.run(
            [METRICLOG, *args],
            stdout=None if closed == 1 else subprocess.PIPE,
            stderr=None if closed == 2 else subprocess.PIPE,
            preexec_fn=close,
            text=True,
            timeout=120,
        )
        said = done.stderr if closed == 1 else done.stdout
        assert "Traceback" not in said, said
        if closed == 1 and args in rows:
            assert done.returncode == 1, (args, said)
            assert said.startswith("Error: standard output is closed (>&-)") and "--out FILE" in said
        else:
            assert done.returncode == 0, (args, done.stdout, done.stderr)
    assert pl.read_parquet(tmp_path / "r.parquet").height == 2400
    if closed == 1:  # a usage error is said first, as ever (exit 2)
        usage = subprocess.run(
            [METRICLOG, "reduce", SAMPLE, "--limit", "1", "--tail", "1"],
            stderr=subprocess.PIPE, preexec_fn=close, text=True, timeout=120,
        )  # fmt: skip
        assert usage.returncode == 2, usage.stderr


def test_diff_s_verdict_is_its_exit_code_when_its_reader_goes_away(tmp_path):
    """``diff A B | head -1``: a reader gone does not turn "they differ" (5) into 0."""
    import os
    import shutil
    import subprocess

    other = shutil.copytree(SAMPLE, tmp_path / "other")
    path = other / "TrainActor_r0.r0.00000.parquet"
    table = pl.read_parquet(path)
    table.with_columns(pl.col("value") * 2).write_parquet(path)
    for form in ([], ["--format", "json"]):
        read, write = os.pipe()
        os.close(read)  # as `| head -1` does once it has its line
        try:
            done = subprocess.run(
                [METRICLOG, "diff", SAMPLE, other, *form],
                stdout=write, stderr=subprocess.PIPE, text=True, timeout=120,
            )  # fmt: skip
        finally:
            os.close(write)
        assert done.returncode == 5, (form, done.stderr)
        assert "Traceback" not in done.stderr and "Broken pipe" not in done.stderr


def test_plot_creates_the_folders_of_its_out_file_as_reduce_does_and_says_a_key_that_matches_nothing(
    tmp_path,
):
    out = tmp_path / "new" / "dir" / "loss.png"
    result = invoke("plot", SAMPLE, "--key", "trainer/loss", "--key", "trainer/los", "--out", out)
    assert result.exit_code == 0, result.output
    assert out.read_bytes().startswith(b"\x89PNG")
    assert result.stderr.splitlines()[-2:] == [
        "warning: --key 'trainer/los' matches no key; nearest of the run's 8 keys: trainer/loss, trainer/lr, "
        "trainer/tokens_per_s",
        f"wrote {out}",
    ]


def test_reduce_prints_a_table(run):
    root, _ = run
    result = invoke("reduce", root, "--key", "trainer/loss", "--steps", "0:2", "--format", "table")
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


def test_jsonl_output_spells_non_finite_values_as_documented_and_the_documented_recipe_reads_them(tmp_path):
    c = MetricCollector(tmp_path / "run", rank=0)
    for step, v in enumerate((float("inf"), float("-inf"), float("nan"), 1.5)):
        c.record("k", v, Reduce.MAX)
        c.flush(step)
    c.shutdown()
    out = tmp_path / "o.jsonl"
    assert invoke("reduce", tmp_path / "run", "--out", out).exit_code == 0
    assert [json.loads(line)["value"] for line in out.read_text().splitlines()] == [
        "Infinity",
        "-Infinity",
        "NaN",
        1.5,
    ]
    # docs/format.md's recipe for reading them with polars
    back = pl.read_ndjson(out, schema_overrides={"value": pl.String}).with_columns(
        pl.col("value").cast(pl.Float64)
    )
    np.testing.assert_array_equal(back["value"].to_numpy(), [np.inf, -np.inf, np.nan, 1.5])
    assert (
        'pl.read_ndjson(path, schema_overrides={"value": pl.String})' in (ROOT / "docs/format.md").read_text()
    )


def test_wide_pivots_one_column_per_key(run):
    root, _ = run
    result = invoke("reduce", root, "--wide", "--steps", "0:1", "--format", "table")
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
    monkeypatch.setattr(engine.finish, "TAKEN_GROUPS", 1)  # a frame a block of 256 steps
    assert invoke("reduce", tmp_path / "run", "--mode", mode, "--wide", "--out", wide_out).exit_code == 0
    index = ["step"] if mode == "global_reduce" else ["process", "rank", "step"]
    want = pl.read_parquet(long_out).pivot(on="key", index=index, values="value").sort(index)
    got = pl.read_parquet(wide_out)
    assert got.columns == [*index, "a", "b"] and got.equals(want.select(got.columns))
    assert got["b"].null_count() == 150 and got.height == 300
    assert made and not any(Path(d).exists() for d in made)


def test_mixed_reductions_keep_the_first_and_say_the_rest_exactly(tmp_path):
    run = tmp_path / "run"
    a = MetricCollector(run, rank=0, process_name="TrainActor_r0")
    b = MetricCollector(run, rank=1, process_name="GeneratorActor_r1")
    a.record("loss", 1.0, Reduce.MEAN)
    b.record("loss", 2.0, Reduce.SUM)
    a.shutdown()
    b.shutdown()
    result = invoke("reduce", run, "--mode", "per_rank_reduce", "--out", tmp_path / "o.csv")
    assert result.exit_code == 0
    assert result.stderr == (
        f"warning: skipped 1 record(s) and 0 unreadable file(s) in {run}:\n"
        "  key 'loss' is recorded under more than one reduction: 1 record(s) under 'sum' (by "
        "GeneratorActor_r1 (rank 1)) skipped, 'mean' (that of its first record) kept; reduce them all "
        "with --reduce 'loss=STAT'\n"
        f"wrote 1 row(s) to {tmp_path / 'o.csv'}\n"
    )
    every = invoke("reduce", run, "--reduce", "loss=mean", "--out", tmp_path / "all.csv")
    assert every.exit_code == 0 and "skipped" not in every.stderr


def test_empty_directory_is_exit_1(tmp_path):
    result = invoke("reduce", tmp_path)
    assert result.exit_code == 1
    assert result.stderr == (
        f"Error: no readable metric record in {tmp_path}: no *.jsonl or *.parquet file was found\n"
    )


def test_missing_directory_is_exit_1(tmp_path):
    result = invoke("reduce", tmp_path / "nope")
    assert result.exit_code == 1
    assert result.stderr == f"Error: no readable metric record in {tmp_path / 'nope'}: it does not exist\n"
    (tmp_path / "file").write_text("")
    result = invoke("reduce", tmp_path / "file")
    assert (
        result.stderr == f"Error: no readable metric record in {tmp_path / 'file'}: it is not a directory\n"
    )


def test_skips_are_summarized_and_strict_makes_them_fatal(tmp_path):
    write_collector_run(tmp_path, [("w", 0)], steps=2)
    (tmp_path / "extra.jsonl").write_text(
        '{"key": "a", "value": "x", "reduction": "mean", "step": 0, "timestamp": 1.0, "rank": 0}\nnot json\n'
    )
    result = invoke("reduce", tmp_path)
    assert result.exit_code == 0
    assert "warning: skipped 2 record(s) and 0 unreadable file(s)" in result.stderr
    assert (
        "extra.jsonl: 2 record(s) skipped: line 1: 'value' is not a number; line 2: not valid JSON"
        in result.stderr
    )
    strict = invoke("reduce", tmp_path, "--strict")
    assert strict.exit_code == 1
    assert strict.stderr.endswith("Error: --strict: records or files were skipped (see above)\n")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--by", "time", "--every", "ten"], "--every 'ten' is not a duration like 10s, 500ms, 5m or 1h"),
        (["--by", "time"], "--by 'time' needs a window length, e.g. --every '10s'"),
        (["--every", "5s"], "--every '5s' is a window length: group by time too (--by 'time')"),
        (["--steps", "5"], "--steps '5' is not START:STOP, e.g. 100:200 (steps 100 to 199)"),
        (["--steps", "9:3"], "--steps '9:3' has STOP at or before START: STOP is excluded"),
        (["--ranks", "a-b"], "--ranks 'a-b' is not a rank or a range like 2-5"),
        (["--ranks", "0,5-2"], "--ranks '0,5-2' holds '5-2', a range that runs backwards"),
        (
            ["--reduce", "loss=avg"],
            "--reduce 'loss=avg' names an unknown statistic 'avg': use one of mean, sum, max, min, std, "
            "count, median, first, last, pNN (NN from 0 to 100, e.g. p99, p99.9)",
        ),
        (["--reduce", "loss"], "--reduce 'loss' is not PATTERN=STAT, e.g. 'trainer/*=p99'"),
        (
            ["--mode", "per_rank_no_reduce", "--reduce", "loss=p99"],
            "--reduce 'loss=p99' has no effect with --mode 'per_rank_no_reduce' (raw values are kept): "
            "drop it, or choose a reducing mode",
        ),
        (
            ["--mode", "per_rank_no_reduce", "--wide"],
            "--wide needs a reducing mode (global_reduce or per_rank_reduce)",
        ),
    ],
)
def test_bad_option_syntax_is_a_usage_error_naming_the_flag(run, args, message):
    root, _ = run
    result = invoke("reduce", root, *args)
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == f"Error: Invalid value: {message}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--mode", "global"],
            "Invalid value for '--mode': 'global' is not one of global_reduce, per_rank_reduce, "
            "per_rank_no_reduce; did you mean 'global_reduce'?",
        ),
        (
            ["--by", "steps"],
            "Invalid value for '--by': 'steps' is not one of step, time; did you mean 'step'?",
        ),
        (
            ["--out", "out.txt"],
            "Invalid value for '--out': 'out.txt': name a file ending in .parquet, .csv, .json, .jsonl "
            "(or - for stdout)",
        ),
    ],
)
def test_a_bad_choice_or_output_type_is_a_usage_error_before_anything_is_read(tmp_path, args, message):
    missing = tmp_path / "no-such-run"  # not read: the options fail first
    result = invoke("reduce", missing, *args)
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == f"Error: {message}"
    assert result.stderr.splitlines()[0] == "Usage: metriclog reduce [OPTIONS] RUN_DIR"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["keys", "--format", "xml"],
            "Invalid value for '--format': 'xml' is not one of table, csv, json, jsonl",
        ),
        (
            ["reduce", "--format", "jsn"],
            "Invalid value for '--format': 'jsn' is not one of table, csv, json, jsonl; did you mean 'json'?",
        ),
        (
            ["samples", "--format", "xml"],
            "Invalid value for '--format': 'xml' is not one of table, csv, json, jsonl",
        ),
        (
            ["inspect", "--format", "xml"],
            "Invalid value for '--format': 'xml' is not one of table, csv, json, jsonl",
        ),
        (
            ["upload", "--to", "tb", "--project", "p"],
            "Invalid value for '--to': 'tb' is not one of wandb, tensorboard, mlflow",
        ),
        (
            ["upload", "--to", "tensor", "--logdir", "tb"],
            "Invalid value for '--to': 'tensor' is not one of wandb, tensorboard, mlflow; did you mean "
            "'tensorboard'?",
        ),
    ],
)
def test_every_choice_lists_its_values_in_plain_words(tmp_path, args, message):
    """No "Value error," (pydantic's prefix, which typer's own enum check passes on)."""
    command, *options = args
    result = invoke(command, tmp_path / "no-such-run", *options)
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == f"Error: {message}"
    assert "Value error" not in result.output


def help_of(command: str) -> str:
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"}, terminal_width=200)
    assert result.exit_code == 0
    return " ".join(result.output.split())


@pytest.mark.parametrize("command", ["reduce", "keys", "samples", "inspect"])
def test_each_commands_help_says_what_each_json_format_prints(command):
    """What --help promises of --format json (and --json) is what is printed: an array of
    rows for the data commands, one object for inspect's report."""
    said = help_of(command)
    printed = [json.loads(invoke(command, SAMPLE, "--format", "json").stdout)]
    if command in ("keys", "inspect"):
        printed.append(json.loads(invoke(command, SAMPLE, "--json").stdout))
    if command == "inspect":
        assert "--json Print the report as one JSON object instead of the table." in said
        assert "json (the report as one JSON object, as --json)" in said
        assert all(isinstance(p, dict) and "sources" in p for p in printed)
    else:
        assert "json (one array of objects, a row each)" in said and "JSON object" not in said
        assert all(isinstance(p, list) and all(isinstance(row, dict) for row in p) for p in printed)
    if command == "keys":
        assert "--json Print the rows as one JSON array of objects, a key each (--format json)." in said
    if command == "samples":  # the sample run has none: an empty array, not nothing
        assert printed == [[]]


def test_steps_help_shows_that_a_negative_number_counts_back():
    for command in ("reduce", "upload", "plot", "samples"):
        assert (
            "--steps START:STOP Only steps START:STOP (STOP excluded), e.g. 100:200. A negative number "
            "counts back from the last step, as Python slices do: -5: is the last 5 steps, :-1 all but "
            "the last" + (" (not with --follow)." if command == "upload" else ".")
        ) in help_of(command), command


def test_long_results_are_cut_and_the_cut_is_said(run):
    root, _ = run
    result = invoke("reduce", root, "--mode", "per_rank_no_reduce", "--format", "table")
    assert result.exit_code == 0
    assert "more row(s) not shown" in result.stderr and "not shown" not in result.stdout


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
    "from metriclog.output import progress\n"
    "progress.PROGRESS_AFTER_S = 0.0\n"
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


def test_the_commands_read_parquet_with_pyarrows_jemalloc_where_it_has_one(tmp_path):
    """pyarrow's jemalloc gives a read file's memory back; a pyarrow built without it gets
    the system allocator, named without the warning an unknown pool prints."""
    import os
    import subprocess

    child = (
        "from metriclog import tuning; tuning.apply(); import pyarrow as pa; "
        "print(pa.default_memory_pool().backend_name, 'jemalloc' in pa.supported_memory_backends())"
    )
    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, check=True)
    backend, has_jemalloc = done.stdout.split()
    assert backend == ("jemalloc" if has_jemalloc == "True" else "system")
    assert done.stderr == ""
    env["ARROW_DEFAULT_MEMORY_POOL"] = "mimalloc"  # the user's own choice is kept
    done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.split()[0] == "mimalloc"


def piped(*args: object) -> tuple[bytes, str]:
    """The installed command with stdout and stderr on pipes: what a shell pipe gets."""
    import subprocess

    done = subprocess.run([METRICLOG, *map(str, args)], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout, done.stderr.decode()


@pytest.mark.slow  # the installed command, in eleven processes
def test_every_format_and_out_dash_give_the_rows_of_the_csv_file_and_stdout_holds_data_only(run, tmp_path):
    import io

    root, _ = run
    base = ["reduce", root, "--mode", "per_rank_reduce"]
    piped(*base, "--out", tmp_path / "x.csv")
    want = pl.read_csv(tmp_path / "x.csv").to_dicts()
    assert len(want) > 40  # more than a table shows: every row goes to a pipe
    parse = {
        "csv": lambda b: pl.read_csv(io.BytesIO(b)).to_dicts(),
        "json": lambda b: json.loads(b),
        "jsonl": lambda b: [json.loads(line) for line in b.splitlines()],
    }
    for args, form in [
        ([], "csv"),  # into a pipe, CSV by default
        (["--format", "csv"], "csv"),
        (["--format", "json"], "json"),
        (["--format", "jsonl"], "jsonl"),
        (["--out", "-"], "csv"),
        (["--out", "-", "--format", "jsonl"], "jsonl"),
    ]:
        out, err = piped(*base, *args)
        assert parse[form](out) == want, args
        assert "not shown" not in err
    piped(*base, "--out", tmp_path / "x.json")
    assert json.loads((tmp_path / "x.json").read_text()) == want
    assert parse["jsonl"](piped(*base, "--format", "jsonl", "--limit", "3")[0]) == want[:3]
    assert parse["csv"](piped(*base, "--tail", "2")[0]) == want[-2:]
    table, notes = piped(*base, "--format", "table")
    assert "more row(s) not shown" in notes and "not shown" not in table.decode()


def test_keys_lists_every_key_as_the_records_written_say(run):
    root, truth = run
    listed = {row["key"]: row for row in json.loads(piped("keys", root, "--json")[0])}
    assert sorted(listed) == sorted({r["key"] for r in truth})
    for key, row in listed.items():
        mine = [r for r in truth if r["key"] == key]
        assert row["records"] == len(mine)
        assert row["reductions"] == mine[0]["reduction"]
        assert row["sources"] == len({(r["process"], r["rank"]) for r in mine})
        assert (row["first_step"], row["last_step"]) == (
            min(r["step"] for r in mine),
            max(r["step"] for r in mine),
        )
        assert row["first_time"] == min(r["timestamp"] for r in mine)
        assert row["last_time"] == max(r["timestamp"] for r in mine)
        assert row["nonfinite"] == int(np.sum(~np.isfinite([r["value"] for r in mine])))


def test_inspect_gives_its_sources_table_as_data(run):
    root, _ = run
    rows = [json.loads(line) for line in piped("inspect", root, "--format", "jsonl")[0].splitlines()]
    assert [(r["process"], r["rank"], r["status"]) for r in rows] == [
        ("TrainActor_r0", 0, "finished"),
        ("TrainActor_r1", 1, "finished"),
    ]
    assert (
        json.loads(piped("inspect", root, "--format", "json")[0])["sources"][0]["process"] == "TrainActor_r0"
    )


@pytest.mark.slow  # the installed command, in four processes
def test_negative_steps_count_back_from_the_last_step_of_the_sources_kept(run):
    import io

    root, truth = run
    last = max(r["step"] for r in truth)
    for steps, want in [("-3:", (last - 2, last + 1)), (":-6", (0, last - 5)), ("-4:-1", (last - 3, last))]:
        out, _ = piped("reduce", root, "--mode", "per_rank_no_reduce", "--steps", steps)
        got = pl.read_csv(io.BytesIO(out))
        assert sorted(set(got["step"])) == list(range(*want)), steps
        assert got.height == sum(1 for r in truth if want[0] <= r["step"] < want[1])
    rank1 = [r for r in truth if r["rank"] == 1]
    out, _ = piped("reduce", root, "--ranks", "1", "--steps", "-1:", "--mode", "per_rank_reduce")
    assert set(pl.read_csv(io.BytesIO(out))["step"]) == {max(r["step"] for r in rank1)}


@pytest.mark.slow  # the installed command, once for each of the README's commands
def test_the_readmes_first_commands_run_as_written_against_the_installed_package():
    import re
    import shlex
    import subprocess

    readme = (ROOT / "README.md").read_text()
    section = readme.split("## The first five minutes", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    commands = [shlex.split(line) for line in block.splitlines() if line.strip()]
    assert len(commands) >= 4 and all(c[0] == ".venv/bin/metriclog" for c in commands)
    before = sorted(p.relative_to(SAMPLE) for p in SAMPLE.rglob("*"))
    for command in commands:
        command[0] = str(Path(sys.executable).with_name("metriclog"))  # the installed package's
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (command, done.stderr)
        assert "Traceback" not in done.stderr
    assert sorted(p.relative_to(SAMPLE) for p in SAMPLE.rglob("*")) == before  # nothing written there


@pytest.mark.slow  # the installed command, in five processes
def test_limit_and_tail_of_zero_give_the_columns_alone_and_a_clash_is_a_usage_error(run, tmp_path):
    root, _ = run
    for args in (["--limit", "0"], ["--tail", "0"]):
        out, _ = piped("reduce", root, *args)
        assert out.decode().splitlines() == ["step,key,value,reduction,count"], args
        assert json.loads(piped("keys", root, *args, "--format", "json")[0]) == []
    piped("keys", root, "--limit", "0", "--out", tmp_path / "k.csv")
    assert pl.read_csv(tmp_path / "k.csv").height == 0
    clash = invoke("reduce", root, "--out", tmp_path / "x.json", "--format", "csv")
    assert clash.exit_code == 2 and "--format chooses what goes to stdout" in clash.stderr


def test_a_message_names_its_options_in_each_callers_words_with_no_marks_in_its_text():
    """An error that names options says them as Python does (``every=``), as the command
    line does (``--every``) once mapped, and holds no control character either way; the
    options it names survive pickling (an upload's reading child hands its errors over)."""
    import pickle

    from metriclog.options import as_flag

    from metric_core.errors import PlanError, as_keyword
    from metric_core.offline.plan import make_plan

    with pytest.raises(PlanError) as caught:
        make_plan(by="time")
    error = pickle.loads(pickle.dumps(caught.value))
    assert str(error) == "by='time' needs a window length, e.g. every='10s'" == error.text(as_keyword)
    assert error.text(as_flag) == "--by 'time' needs a window length, e.g. --every '10s'"
    assert error.option == "by" and [o.name for o in error.template.parts if not isinstance(o, str)] == [
        "by",
        "every",
    ]
    for text in (str(error), error.text(as_flag)):
        assert not any(ord(c) < 32 for c in text)


def command_at(columns: str | None, *args: object) -> tuple[int, str, str]:
    """The installed command on pipes, with ``COLUMNS`` set to ``columns`` (None: unset)."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env.update({"TZ": "UTC"} if columns is None else {"TZ": "UTC", "COLUMNS": columns})
    done = subprocess.run(
        [METRICLOG, *map(str, args)], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )
    return done.returncode, done.stdout, done.stderr


def fits(text: str, width: int) -> bool:
    """Every line fits ``width``, but a word longer than a line (a path), alone on its line."""
    return all(len(line) <= width or " " not in line.strip() for line in text.splitlines())


@pytest.mark.slow  # the installed command, in eight processes
def test_messages_and_inspects_story_are_wrapped_at_columns_and_data_never_is(tmp_path):
    # The warning and the error, word for word (the sample run named from the checkout)
    code, _, err = command_at("80", "reduce", "sample_logs/rl_run", "--key", "nomatch")
    assert code == 1
    assert err.splitlines() == [
        "warning: skipped 25 record(s) and 0 unreadable file(s) in sample_logs/rl_run:",
        "  GeneratorActor_r1.r1.00001.journal: 25 record(s) skipped: 25 x unfinished",
        "      write at the end (the writer was killed mid-write, or is writing now)",
        "Error: no record in sample_logs/rl_run matches the filters: --key 'nomatch'",
        "    matches no key; nearest of the run's 8 keys: policy/latency_s,",
        "    policy/latency_std_s, trainer/grad_norm",
    ]
    # A usage error, said before anything is read
    code, _, err = command_at("60", "reduce", tmp_path / "none", "--out", "x.csv", "--format", "csv")
    assert code == 2
    assert err.splitlines()[-3:] == [
        "Error: Invalid value for --format: --format chooses what",
        "    goes to stdout; --out x.csv writes by its suffix: give",
        "    one of them",
    ]
    # inspect's story, its notes and its heading: each line fits, and the words are those
    # printed whole into a pipe, where nothing is wrapped
    for columns in ("80", "100"):
        code, narrow, narrow_err = command_at(columns, "inspect", SAMPLE)
        _, whole, whole_err = command_at(None, "inspect", SAMPLE)
        assert code == 0 and fits(narrow, int(columns)) and fits(narrow_err, int(columns))
        story = whole.split("\n\n", 1)[1]
        assert max(map(len, story.splitlines())) > 100  # long enough to be wrapped at both widths
        assert narrow.split("\n\n", 1)[1].split() == story.split()
        assert narrow_err.split() == whole_err.split()
    # Data is never wrapped: CSV, JSON and inspect's JSON report are the same at any width
    # (but for the report's figures of the wall clock, which moves between the two)
    import re

    def data(*args: object) -> str:
        out = command_at(*args)[1]
        return re.sub(r"[0-9.e+-]+", "0", out) if args[1] == "inspect" else out

    for args in (["reduce", SAMPLE, "--mode", "per_rank_no_reduce", "--key", "policy/*"],
                 ["keys", SAMPLE, "--format", "json"], ["inspect", SAMPLE, "--json"]):  # fmt: skip
        assert data("40", *args) == data(None, *args), args


@pytest.mark.slow  # the installed command, with stderr on a terminal
def test_on_a_terminal_messages_are_wrapped_at_its_width_without_columns(tmp_path):
    code, shown, _ = on_a_terminal([METRICLOG, "reduce", SAMPLE, "--ranks", "7"], width=72)
    text = shown.replace("\r\n", "\n")
    assert code == 1 and fits(text, 72), text
    assert " ".join(text.split()).endswith(
        "Error: no record in " + str(SAMPLE) + " matches the filters: --ranks '7' matches no record "
        "(no rank 7); the run's ranks: 0-1"
    )
    assert max(map(len, text.splitlines())) > 60  # wrapped near the terminal's width, not narrower


@pytest.mark.slow  # the installed command, and a killed writer
def test_the_documented_way_to_read_a_run_elsewhere_counts_a_killed_ranks_journal(tmp_path, monkeypatch):
    """docs/reading.md's commands, run as written: DuckDB over the run's Parquet files misses
    the killed rank's journal; over the file they make, DuckDB, polars and pandas read every
    record written, once."""
    import re
    import subprocess

    import duckdb

    run = tmp_path / "runs" / "exp1"
    truth = write_collector_run(run, [("TrainActor_r0", 0)], steps=12)
    truth += write_collector_run(run, [("TrainActor_r1", 1)], steps=12, seed=1, shutdown=None)  # killed
    assert list(run.glob("*.journal"))
    in_parquet = duckdb.sql(f"SELECT count(*) FROM '{run}/*.parquet'").fetchall()[0][0]
    assert in_parquet < len(truth)  # what the docs warn of

    doc = (ROOT / "docs" / "reading.md").read_text()
    section = doc.split("## Reading a whole run with DuckDB, polars or pandas", 1)[1].split("\n## ", 1)[0]
    (shell,) = re.findall(r"```sh\n(.*?)```", section, re.S)
    (python,) = re.findall(r"```python\n(.*?)```", section, re.S)
    command = shell.split()
    assert command[0] == "metriclog"
    done = subprocess.run([METRICLOG, *command[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=99)
    assert done.returncode == 0, done.stderr
    monkeypatch.chdir(tmp_path)
    names: dict = {}
    exec(python, names)  # the docs' Python, as written

    def records(rows) -> list[tuple]:
        return sorted((r["process"], r["rank"], r["step"], r["key"], r["value"]) for r in rows)

    want = records(truth)
    assert records(names["pl"].read_parquet("all.parquet").to_dicts()) == want
    assert records(names["raw"].to_dict("records")) == want  # pandas, the last one read
    counted = duckdb.sql(
        "SELECT process, count(*) AS records, max(step) AS last_step FROM 'all.parquet' GROUP BY ALL"
    ).fetchall()
    assert sorted(counted) == sorted(
        (p, sum(r["process"] == p for r in truth), max(r["step"] for r in truth if r["process"] == p))
        for p in ("TrainActor_r0", "TrainActor_r1")
    )


@pytest.mark.parametrize(
    "args",
    [
        ["reduce"],
        ["reduce", "--mode", "per_rank_reduce", "--wide"],
        ["reduce", "--mode", "per_rank_no_reduce", "--limit", "3"],
        ["reduce", "--steps", "-3:", "--format", "json"],
        ["reduce", "--key", "nomatch"],  # a failure after the read
        ["keys"],
        ["inspect"],
        ["inspect", "--json"],
        ["upload", "--project", "p", "--dry-run"],
        ["plot", "--key", "policy/*"],
    ],
)
def test_each_command_says_the_sample_runs_skipped_records_once(args, tmp_path):
    command, *options = args
    if command == "plot":
        options += ["--out", str(tmp_path / "p.png")]
    result = invoke(command, SAMPLE, *options)
    assert result.exit_code in (0, 1), result.output
    assert result.stderr.count("25 record(s) skipped") == 1, result.stderr


# A command whose work raises: a bug (ZeroDivisionError) after wandb.init hooked itself to the
# interpreter's excepthook, or an expected failure (UploadError), raised where the W&B run's
# rows are sent.
CRASH = """
import sys
from metric_core.errors import UploadError
from metric_core.offline.upload import send

def fail(*args, **kwargs):
    raise {raised}("the rows could not be sent")

send.WandBSender.log_rows = fail
from metriclog.start import main
sys.argv = ["metriclog", *sys.argv[1:]]
main()
"""


BUG_TAIL = "not in the run or the command: please report it, with the traceback above"


@pytest.mark.parametrize(
    ("raised", "tracebacks", "last_line"),
    [
        ("ZeroDivisionError", 1, f"Error: this is a bug in metriclog, {BUG_TAIL}"),
        ("UploadError", 0, "Error: the rows could not be sent"),
    ],
    ids=["bug", "expected"],
)  # fmt: skip
def test_a_bug_prints_one_traceback_and_says_it_is_a_bug_an_expected_failure_one_line(
    tmp_path, wandb_offline, raised, tracebacks, last_line
):
    import os
    import subprocess

    run = tmp_path / "run"
    # a source of its own a case: the W&B run id derives from the sources, and the two cases'
    # uploads may run at once (W&B refuses a second run of one id: "is in use")
    write_collector_run(run, [(f"{raised}_r0", 0)], steps=5)
    env = {**os.environ, "WANDB_DIR": str(tmp_path), "COLUMNS": "400"}
    done = subprocess.run(
        [sys.executable, "-c", CRASH.format(raised=raised), "upload", run, "--project", "p", "--offline"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("Traceback (most recent call last)") == tracebacks, done.stderr
    assert done.stderr.rstrip("\n").splitlines()[-1] == last_line, done.stderr
    assert sum(line.startswith("Error:") for line in done.stderr.splitlines()) == 1, done.stderr


@pytest.mark.parametrize("command", ["reduce", "plot", "compare", "samples", "keys"])
def test_an_out_that_is_a_directory_is_refused_before_any_read_naming_it(tmp_path, command):
    """A new user's trial: ``--out DIR.csv`` where DIR.csv is a directory failed after the
    read, naming the hidden file metriclog writes first (``.DIR.csv.partial``)."""
    suffix = ".png" if command == "plot" else ".csv"
    out = tmp_path / f"taken{suffix}"
    out.mkdir()
    args = {"plot": ["--key", "trainer/loss"], "compare": [SAMPLE, "--label", "a", "--label", "b"]}
    result = invoke(command, SAMPLE, *args.get(command, []), "--out", out)
    assert result.exit_code == 1, result.output
    assert f"--out {out}: is a directory: name a file to write" in result.stderr
    assert ".partial" not in result.stderr and "warning" not in result.stderr  # before the read
    assert list(out.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == [out.name]


def test_skips_said_as_a_warning_are_not_said_again_in_the_error(tmp_path):
    """A new user's trial: a run whose every record was skipped as it was read printed the
    list of skips twice, as a warning and again after ``Error:``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.conftest import flip_a_page

    run = tmp_path / "run"
    run.mkdir()
    columns = {"key": ["k"] * 6, "value": [1.0] * 6, "step": list(range(6)), "timestamp": [1.7e9] * 6}
    table = pa.table({**columns, "rank": [0] * 6})
    pq.write_table(
        table.append_column("reduction", pa.array(["mean"] * 6)), run / "p.parquet", write_page_checksum=True
    )
    flip_a_page(run / "p.parquet", group=0)
    result = invoke("reduce", run, "--out", tmp_path / "r.csv")
    assert result.exit_code == 1
    assert result.stderr.count("6 record(s) skipped: 6 x row group 0 cannot be read") == 1, result.stderr
    assert "every record was skipped (see the warning above)" in result.stderr
