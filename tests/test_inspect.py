"""metriclog inspect and plot on runs written by the writer with known failure patterns."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from metriclog.main import app
from typer.testing import CliRunner

from metric_core import Metric, MetricCollector, Reduce, scan_run
from metric_core.offline.engine import execute
from metric_core.offline.inspect import inspect_run
from metric_core.offline.inspect.health import state_said
from metric_core.offline.plan import make_plan
from metric_core.offline.plot import plot_run

from .conftest import killed_after, write_other_tool_run

runner = CliRunner()
T0 = 1_760_000_000.0
STEP_S = 2.0


def source(
    run_dir: Path,
    process: str,
    rank: int,
    steps: range,
    *,
    end: str = "shutdown",
    nan_from: int | None = None,
    delay: float = 0.0,
    file_format: str = "parquet",
) -> None:
    """Record trainer/loss and trainer/grad_norm each step, with known timestamps.

    end: "shutdown" (clean), "killed" (the process died: no shutdown, no seal), or "hung" (alive
    but silent: its last records were flushed, nothing more comes, no shutdown).
    """

    def write() -> MetricCollector:
        c = MetricCollector(
            run_dir, rank=rank, process_name=process, flush_interval=3600, file_format=file_format
        )
        for step in steps:
            t = T0 + step * STEP_S + delay
            loss = math.nan if nan_from is not None and step >= nan_from else 1.0 / (step + 1)
            c.push(Metric("trainer/loss", loss, Reduce.MEAN, t))
            c.push(Metric("trainer/loss", loss, Reduce.MEAN, t + 0.1))
            c.push(Metric("trainer/grad_norm", float(step % 7), Reduce.MAX, t + 0.2))
            c.flush(step)
        return c

    if end == "shutdown":
        write().shutdown()
    else:  # killed or hung: on disk, both leave what was flushed, unsealed, with no end
        killed_after(write)


def write_meta(run_dir: Path, world_size: int) -> None:
    (run_dir / "run.json").write_text(json.dumps({"name": run_dir.name, "world_size": world_size}))


@pytest.fixture(params=["parquet", "jsonl"])
def crashed(tmp_path, request):
    """Rank 1 killed at step 40, rank 2 hung after step 70, rank 3 NaN from step 55,
    rank 5 of world_size 6 never wrote, the rest run to step 99 and shut down.

    In Parquet every file carries the writer's key hashes, which inspect groups on; with
    JSONL segments it groups on the key strings."""
    run = tmp_path / "crashed"
    run.mkdir()
    write_meta(run, 6)
    fmt = request.param
    source(run, "TrainActor_r0", 0, range(100), file_format=fmt)
    source(run, "TrainActor_r1", 1, range(41), end="killed", file_format=fmt)
    source(run, "TrainActor_r2", 2, range(71), end="hung", file_format=fmt)
    source(run, "TrainActor_r3", 3, range(100), nan_from=55, file_format=fmt)
    source(run, "TrainActor_r4", 4, range(100), delay=9.0, file_format=fmt)  # started late, keeps pace
    return run


def test_inspect_reports_exactly_the_known_failures(crashed):
    report = inspect_run(scan_run(crashed))
    by_rank = {s.rank: s for s in report.sources}
    assert report.world_size == 6
    assert report.missing_ranks == [5]
    assert {r: s.status for r, s in by_rank.items()} == {
        0: "finished",
        1: "stopped_early",
        2: "stopped_early",
        3: "finished",
        4: "finished",
    }
    assert by_rank[1].last_step == 40 and by_rank[2].last_step == 70
    assert by_rank[1].clean_shutdown is False and by_rank[0].clean_shutdown is True
    newest = T0 + 99 * STEP_S + 9.0 + 0.2
    assert by_rank[1].lag_s == pytest.approx(newest - (T0 + 40 * STEP_S + 0.2))
    assert by_rank[0].records == 300 and by_rank[0].keys == 2
    first = report.first_to_stop
    assert (first.process, first.rank, first.last_step) == ("TrainActor_r1", 1, 40)
    assert first.last_values == {"trainer/grad_norm": float(40 % 7), "trainer/loss": 1.0 / 41}
    assert [dataclasses.asdict(n) for n in report.nonfinite] == [
        {
            "process": "TrainActor_r3",
            "rank": 3,
            "key": "trainer/loss",
            "first_step": 55,
            "first_timestamp": T0 + 55 * STEP_S,
            "count": 2 * 45,
        }
    ]
    assert report.stragglers == []  # rank 4 started 9 s late but takes the steps' time of the others
    assert [(s.process, s.last_step) for s in report.stopped_early] == [
        ("TrainActor_r1", 40),
        ("TrainActor_r2", 70),
    ]
    assert report.still_running is False  # its newest record is from 2025


def test_a_clean_run_reports_nothing(tmp_path):
    run = tmp_path / "clean"
    run.mkdir()
    write_meta(run, 2)
    source(run, "TrainActor_r0", 0, range(50))
    source(run, "TrainActor_r1", 1, range(50))
    report = inspect_run(scan_run(run))
    assert report.missing_ranks == []
    assert report.first_to_stop is None
    assert report.nonfinite == []
    assert report.stragglers == []
    assert {s.status for s in report.sources} == {"finished"}


def test_a_job_that_died_together_is_unfinished_not_stopped_early(tmp_path):
    run = tmp_path / "died"
    run.mkdir()
    for rank in range(3):
        source(run, f"TrainActor_r{rank}", rank, range(30), end="killed")
    report = inspect_run(scan_run(run))
    assert {s.status for s in report.sources} == {"unfinished"}


def test_the_quiet_threshold_follows_each_sources_own_cadence(tmp_path):
    """A slow source (one step per 100 s) silent for 300 s is not late; a fast one is."""
    run = tmp_path / "cadence"
    run.mkdir()
    for process, rank, step_s, last in (("fast", 0, 2.0, 500), ("slow", 1, 100.0, 10)):
        c = MetricCollector(run, rank=rank, process_name=process, flush_interval=3600)
        for step in range(last + 1):
            c.push(Metric("x", 1.0, Reduce.MEAN, T0 + step * step_s))
            c.flush(step)
        c.abort()  # no clean end
    # fast ends at T0+1000; slow at T0+1000 too. Add a third, fast source that ends 300 s early.
    c = MetricCollector(run, rank=2, process_name="fast_quiet", flush_interval=3600)
    for step in range(351):
        c.push(Metric("x", 1.0, Reduce.MEAN, T0 + step * 2.0))
        c.flush(step)
    c.abort()
    statuses = {s.process: s.status for s in inspect_run(scan_run(run)).sources}
    assert statuses == {"fast": "unfinished", "slow": "unfinished", "fast_quiet": "stopped_early"}


def step_times(
    run: Path, process: str, rank: int, times: list[float], *, shutdown: bool | None = True
) -> MetricCollector:
    """A source that records one key at each of ``times`` (one step each), then shuts down,
    aborts (``shutdown=False``: ends without shutdown()) or stays open (None: still writing)."""
    c = MetricCollector(run, rank=rank, process_name=process, flush_interval=3600)
    for step, t in enumerate(times):
        c.push(Metric("x", float(step), Reduce.MEAN, t))
        c.flush(step)
    if shutdown is not None:
        c.shutdown() if shutdown else c.abort()
    return c


def test_a_straggler_is_slower_by_a_sustained_margin_and_noise_or_a_late_start_is_not(tmp_path):
    """Four generators of 0.02 s steps with 30% jitter, started up to 0.2 s apart (10 steps),
    one of them with a single step 10 times too long; a fifth 1.3 times slower all along."""
    rng = np.random.default_rng(3)
    run = tmp_path / "run"
    gaps = {}
    for rank in range(5):
        gap = rng.uniform(0.014, 0.026, 300) * (1.3 if rank == 4 else 1.0)
        if rank == 1:
            gap[150] = 0.2  # one late step
        times = T0 + 0.05 * rank + np.cumsum(gap)  # start-up skew
        gaps[rank] = np.diff(times)  # as the float64 timestamps hold them
        step_times(tmp_path / "run", f"GeneratorActor_r{rank}", rank, list(times))
    step_times(run, "TrainActor_r0", 0, list(T0 + np.cumsum(rng.uniform(0.5, 0.7, 30))))  # its own role
    (slow,) = inspect_run(scan_run(run)).stragglers
    assert (slow.process, slow.rank) == ("GeneratorActor_r4", 4)
    assert slow.step_time_s == pytest.approx(np.median(gaps[4]), rel=1e-12)
    others = np.median([np.median(gaps[r]) for r in range(4)])
    assert slow.role_step_time_s == pytest.approx(others, rel=1e-12)
    assert slow.step_time_s / slow.role_step_time_s > 1.2


def test_ranks_stopped_together_at_different_steps_are_told_by_each_one_s_last_step(tmp_path, india):
    """A new user's trial: a rank hung at step 20 while the other went on to 390, then the
    launcher stopped both; the story said "together after step 20" of both."""
    run = tmp_path / "run"
    writers = [
        step_times(run, f"TrainActor_r{rank}", rank, list(T0 + 0.02 * np.arange(steps)), shutdown=None)
        for rank, steps in ((0, 101), (1, 51), (2, 101))
    ]
    for c in writers:
        c.abort()
    died = inspect_run(scan_run(run), now=T0 + 3600)
    assert [s.last_step for s in sorted(died.sources, key=lambda s: s.rank)] == [100, 50, 100]
    story = died.verdict()[0]
    assert "together after steps 50 to 100 (their last flushed)" in story, story
    assert "after step 50 (" not in story


def test_a_run_still_writing_is_still_running_and_a_job_that_died_together_is_said_so(tmp_path, india):
    run = tmp_path / "run"
    newest = T0 + 100 * 0.02
    writing = [
        step_times(
            run, f"TrainActor_r{rank}", rank, list(T0 + 0.02 * np.arange(101) - 0.001 * rank), shutdown=None
        )
        for rank in range(3)
    ]
    running = inspect_run(scan_run(run), now=newest + 0.1)
    assert running.still_running and running.first_to_stop is None and running.stopped_early == []
    assert {s.status for s in running.sources} == {"unfinished"}
    assert running.verdict() == [
        "The run looks still running: its newest record is 100 ms old (2025-10-09T14:23:22+05:30); "
        "its sources step every 20 ms."
    ]
    for c in writing:  # the job ends without shutdown()
        c.abort()
    died = inspect_run(scan_run(run), now=newest + 3600)
    assert not died.still_running and died.first_to_stop is None
    # One event, no culprit: no first failure, and the sources that ended together
    as_json = json.loads(died.to_json())
    assert as_json["first_failure"] is None
    assert as_json["together"] == [{"process": f"TrainActor_r{r}", "rank": r} for r in range(3)]
    story, together = died.verdict()
    assert re.fullmatch(
        r"all 3 ranks ended without shutdown\(\) together after step 100 \(their last flushed\) at \S+\.",
        story,
    ), story
    assert re.fullmatch(
        r"No source stopped before the others: all 3 ended without shutdown\(\) within [\d.]+ m?s of each "
        r"other, the last at \S+ \(the whole job was stopped, or crashed together\)\.",
        together,
    ), together


def test_a_source_without_shutdown_among_finished_ones_is_named(tmp_path, india):
    run = tmp_path / "run"
    times = list(T0 + 2.0 * np.arange(50))
    step_times(run, "TrainActor_r0", 0, times)
    step_times(run, "TrainActor_r1", 1, times)
    step_times(run, "TrainActor_r2", 2, times, shutdown=False)
    report = inspect_run(scan_run(run), now=T0 + 10_000)
    assert report.verdict() == [
        "TrainActor_r2 (rank 2) exited without shutdown() after step 49 (its last flushed)."
    ]


def test_a_source_of_another_tool_s_file_that_stopped_early_is_named_too(crashed):
    rows = [
        {
            "key": "trainer/loss",
            "value": 1.0,
            "reduction": "mean",
            "step": s,
            "timestamp": T0 + s * STEP_S,
            "rank": 7,
            "process": "Evaluator_r7",
        }
        for s in range(20)
    ]
    (crashed / "evaluator.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    verdict = inspect_run(scan_run(crashed)).verdict()
    stopped = [line.split(" (rank")[0] for line in verdict if "stopped" in line and "last record" in line]
    assert stopped == ["Evaluator_r7", "TrainActor_r1", "TrainActor_r2"]  # the first to stop first


def test_no_straggler_on_the_suite_s_clean_runs(tmp_path):
    """Runs as the other tests write them: the writer's sources a little apart, the sample
    run (two roles), and real processes started one after another."""
    from .conftest import write_collector_run

    runs = [Path(__file__).resolve().parent.parent / "sample_logs" / "rl_run"]
    for seed, n in ((1, 4), (2, 8)):
        runs.append(tmp_path / f"run{seed}")
        write_collector_run(runs[-1], [(f"TrainActor_r{r}", r) for r in range(n)], steps=40, seed=seed)
    for run in runs:
        report = inspect_run(scan_run(run))
        assert report.stragglers == [], run
        assert not [line for line in report.verdict() if "Straggler" in line]


def test_inspect_table_fits_the_terminal_and_says_what_it_left_out(crashed, india):
    wide = runner.invoke(app, ["inspect", str(crashed)], env={"COLUMNS": "200"})
    narrow = runner.invoke(app, ["inspect", str(crashed)], env={"COLUMNS": "80"})
    table = [line for line in narrow.stdout.splitlines() if line[:1] in "┌│╞└"]
    assert table and max(map(len, table)) <= 80
    # the story and the notes too, wrapped (a path longer than a line stays whole, alone)
    assert all(len(line) <= 80 or " " not in line.strip() for line in narrow.stdout.splitlines())

    def header(stdout: str) -> list[str]:
        return [c.strip() for c in next(x for x in stdout.splitlines() if x[:1] == "│").strip("│").split("┆")]

    assert header(narrow.stdout)[:3] == ["process", "rank", "state"]
    said = " ".join(narrow.stdout.split())  # a note wrapped over lines, read as one
    hidden = ", ".join(c for c in header(wide.stdout) if c not in header(narrow.stdout))
    assert f"columns not shown, for the terminal's width (80): {hidden}; --json has them all" in said
    assert "2025-10-09T14:23:20+05:30" in wide.stdout  # T0: ISO 8601, local time with its offset
    assert "columns not shown" not in runner.invoke(app, ["inspect", str(crashed)]).stdout  # a pipe: whole


def test_inspect_command_table_verdict_and_json(crashed, india):
    result = runner.invoke(app, ["inspect", str(crashed)])
    assert result.exit_code == 0, result.output
    verdict = result.stdout.split("\n\n", 1)[1]  # lags from the newest record, T0 + 207.2
    # The story first: rank 1's writer was killed first (after step 40), then rank 2's
    # (after step 70); the others' writers are this process, alive.
    story, *verdict = verdict.splitlines()
    assert re.fullmatch(
        r"TrainActor_r1 \(rank 1\) died after step 40 \(its last flushed\): no exception or signal recorded "
        r"\(SIGKILL, the OOM killer, os\._exit or a native crash\); [\d.]+ (ms|s) later 1 other rank died "
        r"with no exception or signal recorded\.",
        story,
    ), story
    assert verdict == [
        "Rank 5 of world_size 6 never wrote a record.",
        "TrainActor_r1 (rank 1) stopped first: last record at step 40, 2025-10-09T14:24:40+05:30, "
        "2.1 min before the newest record of the run.",
        f"  its last values: trainer/grad_norm=5, trainer/loss={1 / 41:.6g}",
        "TrainActor_r2 (rank 2) stopped early: last record at step 70, 2025-10-09T14:25:40+05:30, "
        "67.0 s before the newest record of the run.",
        f"  its last values: trainer/grad_norm=0, trainer/loss={1 / 71:.6g}",
        "Non-finite values in trainer/loss on TrainActor_r3 (rank 3) from step 55 "
        "(2025-10-09T14:25:10+05:30), 90 in all.",
    ]
    as_json = runner.invoke(app, ["inspect", str(crashed), "--json"])
    data = json.loads(as_json.stdout)
    for field in ("run_dir", "world_size", "missing_ranks", "sources", "first_to_stop", "nonfinite"):
        assert field in data
    for field in (
        "process",
        "rank",
        "files",
        "records",
        "skipped",
        "truncated",
        "keys",
        "first_step",
        "last_step",
        "first_timestamp",
        "last_timestamp",
        "lag_s",
        "clean_shutdown",
        "status",
    ):
        assert field in data["sources"][0]


def test_sample_run_names_its_killed_generator_first_to_stop():
    sample = Path(__file__).resolve().parent.parent / "sample_logs" / "rl_run"
    report = inspect_run(scan_run(sample))
    first = report.first_to_stop
    assert (first.process, first.status) == ("GeneratorActor_r1", "stopped_early")
    gen = next(s for s in report.sources if s.process == "GeneratorActor_r1")
    assert gen.truncated and gen.skipped > 0 and not gen.clean_shutdown


def test_plot_global_reduce_draws_the_reduction_band_and_marks(crashed, tmp_path):
    scan = scan_run(crashed)
    out = tmp_path / "loss.png"
    fig = plot_run(scan, make_plan(keys=["trainer/*"]), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "crashed" in fig.get_suptitle()
    ax_grad, ax_loss = fig.axes  # keys sorted
    assert ax_loss.get_ylabel() == "trainer/loss\n(mean)" and ax_loss.get_xlabel() == "step"
    truth = execute(make_plan(keys=["trainer/loss"]), scan).frame
    (line,) = [ln for ln in ax_loss.get_lines() if ln.get_label() == "_trainer/loss"]
    np.testing.assert_array_equal(line.get_xdata(), truth["step"].to_numpy())
    # Two queries may sum a step's values in another order (streaming is parallel).
    np.testing.assert_allclose(line.get_ydata(), truth["value"].to_numpy(), rtol=1e-12)
    assert not ax_loss.collections  # every source recorded the same loss: no band of no width
    marks = {
        ln.get_label(): ln.get_xdata()[0] for ln in ax_loss.get_lines() if not ln.get_label().startswith("_")
    }
    # Where each source that did not finish stopped, in the words inspect and watch use
    health = {s.process: s for s in inspect_run(scan).sources}
    assert marks == {
        f"TrainActor_r1 {state_said(health['TrainActor_r1'])}": 40,
        f"TrainActor_r2 {state_said(health['TrainActor_r2'])}": 70,
        "non-finite from here: TrainActor_r3": 55,
    }
    assert {state_said(health[p]) for p in ("TrainActor_r1", "TrainActor_r2")} == {
        "died after step 40 (its last flushed)",
        "died after step 70 (its last flushed)",
    }
    assert not any("non-finite" in ln.get_label() for ln in ax_grad.get_lines())


def test_plot_of_one_source_draws_and_names_no_band(tmp_path):
    """A new user's trial: the legend named the band of the sources' values for a run of
    one source, where no band (no spread) can be drawn."""
    run = tmp_path / "run"
    c = MetricCollector(run, rank=0)
    for step in range(5):
        c.push(Metric("x", float(step), Reduce.MEAN, T0 + step))
        c.flush(step)
    c.shutdown()
    fig = plot_run(scan_run(run), make_plan(keys=["x"]), tmp_path / "plot.png")
    (ax,) = fig.axes
    assert len(ax.collections) == 0
    texts = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    assert not any("lowest to highest" in t for t in texts), texts


def test_plot_per_rank_draws_a_line_per_source(crashed, tmp_path):
    fig = plot_run(
        scan_run(crashed), make_plan(mode="per_rank_reduce", keys=["trainer/grad_norm"]), tmp_path / "g.png"
    )
    (ax,) = fig.axes
    labels = [
        ln.get_label()
        for ln in ax.get_lines()
        if "rank" in ln.get_label() and "stopped" not in ln.get_label()
    ]
    assert labels == [f"TrainActor_r{r} (rank {r})" for r in range(5)]
    r1 = next(ln for ln in ax.get_lines() if ln.get_label() == "TrainActor_r1 (rank 1)")
    assert list(r1.get_xdata()) == list(range(41))


def test_plot_raw_points_over_wall_clock_time(crashed, tmp_path):
    fig = plot_run(
        scan_run(crashed),
        make_plan(mode="per_rank_no_reduce", keys=["trainer/grad_norm"]),
        tmp_path / "raw.png",
    )
    (ax,) = fig.axes
    assert ax.get_xlabel().startswith("wall-clock time")
    r0 = next(ln for ln in ax.get_lines() if ln.get_label() == "TrainActor_r0 (rank 0)")
    assert r0.get_linestyle() == "None"
    assert r0.get_xdata()[0] == (T0 + 0.2) / 86400  # matplotlib's dates: days since 1970


def test_plot_of_many_raw_points_draws_each_bins_lowest_and_highest_and_says_so(
    crashed, tmp_path, monkeypatch
):
    from metric_core.offline import plot

    monkeypatch.setattr(plot, "RAW_POINTS", 50)
    monkeypatch.setattr(plot, "BINS", 7)
    scan = scan_run(crashed)
    plan = make_plan(mode="per_rank_no_reduce", keys=["trainer/grad_norm"])
    fig = plot_run(scan, plan, tmp_path / "raw.png")
    (ax,) = fig.axes
    assert ax.get_xlabel().endswith("; decimated: lowest and highest of 7 time bins per source")
    raw = execute(plan, scan).frame
    health = inspect_run(scan)
    lo = min(s.first_timestamp for s in health.sources)
    width = (max(s.last_timestamp for s in health.sources) - lo) / 7
    for source in health.sources:
        mine = raw.filter(raw["process"] == source.process)
        t, v = mine["timestamp"].to_numpy(), mine["value"].to_numpy()
        bins = np.clip(np.floor((t - lo) / width), 0, 6)
        want = set()
        for b in np.unique(bins):
            inside = bins == b
            want |= {
                (t[inside][np.argmin(v[inside])] / 86400, v[inside].min()),
                (t[inside][np.argmax(v[inside])] / 86400, v[inside].max()),
            }
        (line,) = [ln for ln in ax.get_lines() if ln.get_label() == f"{source.process} (rank {source.rank})"]
        assert set(zip(line.get_xdata(), line.get_ydata(), strict=True)) == want, source.process


def test_plot_band_is_the_sources_own_statistic_and_the_figure_has_one_legend(tmp_path):
    """Three sources; 'x' by mean (a band of each source's mean), 'n' by sum (no band: the
    sum of the whole is no source's), 'once' recorded at one step only (drawn as a point);
    six keys in all, so the title must stay above the first subplot."""
    run = tmp_path / "run"
    rng = np.random.default_rng(4)
    values = {}
    for rank in range(3):
        c = MetricCollector(run, rank=rank, process_name=f"TrainActor_r{rank}", flush_interval=3600)
        for step in range(20):
            xs = rng.normal(rank, 1.0, 4)
            values[(rank, step)] = xs
            for v in xs:
                c.push(Metric("x", float(v), Reduce.MEAN, T0 + step))
            c.push(Metric("n", 1.0, Reduce.SUM, T0 + step))
            c.push(Metric("s", float(100 * rank), Reduce.STD, T0 + step))
            for k in ("a", "b"):
                c.push(Metric(k, 1.0, Reduce.MAX, T0 + step))
            if step == 7 and rank == 0:
                c.push(Metric("once", 3.0, Reduce.MAX, T0 + step))
            c.flush(step)
        c.shutdown()
    out = tmp_path / "plot.png"
    fig = plot_run(scan_run(run), make_plan(keys=["*"]), out)
    axes = dict(zip(["a", "b", "n", "once", "s", "x"], fig.axes, strict=True))
    means = np.array([[values[(r, s)].mean() for s in range(20)] for r in range(3)])
    (band,) = axes["x"].collections
    ys = band.get_paths()[0].vertices[:, 1]
    np.testing.assert_allclose(
        np.sort(np.unique(ys)), np.sort(np.unique([*means.min(0), *means.max(0)])), rtol=1e-12
    )
    assert len(axes["n"].collections) == 0  # sum: no band
    assert len(axes["a"].collections) == 0  # every source's the same: a band of no width is not drawn
    assert len(axes["s"].collections) == 0  # std: the sources' own stds (0) cannot hold the whole's (81.6)
    (std,) = [ln for ln in axes["s"].get_lines() if ln.get_label() == "_s"]
    np.testing.assert_allclose(std.get_ydata(), np.std([0.0, 100.0, 200.0]), rtol=1e-12)
    (point,) = [ln for ln in axes["once"].get_lines() if ln.get_label() == "_once"]
    assert list(point.get_xdata()) == [7] and point.get_marker() == "o"
    assert [ax.get_legend() for ax in fig.axes] == [None] * 6 and len(fig.legends) == 1
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [
        "lowest to highest of the sources' own values of the statistic"
    ]
    fig.canvas.draw()
    title = fig._suptitle.get_window_extent()
    assert title.y0 >= max(ax.get_window_extent().y1 for ax in fig.axes)  # above every subplot
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_plot_says_when_no_font_draws_a_key(tmp_path):
    run = tmp_path / "run"
    c = MetricCollector(run, rank=0)
    key = "loss/\U0001fae0\U0001fae1"  # emoji no font of a plain system draws
    c.record(key, 1.0, Reduce.MEAN)
    c.shutdown()
    said = []
    plot_run(scan_run(run), make_plan(keys=["loss/*"]), tmp_path / "p.png", on_warning=said.append)
    assert said == [
        f"'{key}' holds characters no installed font draws (\U0001fae0\U0001fae1): they show as boxes in the "
        "plot; install a font that has them (e.g. Noto Sans CJK), and the plot uses it"
    ]


def test_plot_command_errors(crashed, tmp_path):
    bad = runner.invoke(app, ["plot", str(crashed), "--key", "trainer/*", "--out", str(tmp_path / "x.jpg")])
    assert bad.exit_code == 2
    none = runner.invoke(app, ["plot", str(crashed), "--key", "nothing/*", "--out", str(tmp_path / "x.png")])
    assert none.exit_code == 1
    assert none.stderr == (
        f"Error: no record in {crashed} matches the filters: --key 'nothing/*' matches no key; "
        "the run's keys: trainer/grad_norm, trainer/loss\n"
    )
    ok = runner.invoke(app, ["plot", str(crashed), "--key", "trainer/loss", "--out", str(tmp_path / "x.png")])
    assert ok.exit_code == 0 and (tmp_path / "x.png").exists()


@pytest.mark.parametrize("raw_points", [10**9, 20], ids=["all", "decimated"])
def test_plot_of_raw_points_by_time_windows(crashed, tmp_path, monkeypatch, raw_points):
    from metric_core.offline import plot

    monkeypatch.setattr(plot, "RAW_POINTS", raw_points)
    monkeypatch.setattr(plot, "BINS", 7)  # fewer bins than points: decimating drops some
    plan = make_plan(mode="per_rank_no_reduce", keys=["trainer/grad_norm"], by="time", every=1.0)
    fig = plot_run(scan_run(crashed), plan, tmp_path / "raw.png")
    (ax,) = fig.axes
    assert ax.get_xlabel().startswith("wall-clock time")
    assert ("decimated" in ax.get_xlabel()) == (raw_points == 20)
    drawn = {
        (x, y)
        for ln in ax.get_lines()
        if "(rank" in ln.get_label() and "stopped" not in ln.get_label()
        for x, y in zip(ln.get_xdata(), ln.get_ydata(), strict=True)
    }
    records = execute(dataclasses.replace(plan, by="step", every=None), scan_run(crashed)).frame
    every = set(zip(records["timestamp"].to_numpy() / 86400, records["value"].to_list(), strict=True))
    assert drawn <= every and (drawn == every) == (raw_points > 20)  # every point, or a subset


def test_a_cache_kept_between_calls_reads_only_the_files_written_since(tmp_path):
    import os
    import struct

    run = tmp_path / "run"
    sealed = MetricCollector(run, rank=0, process_name="TrainActor_r0", flush_interval=3600)
    for step in range(5):
        sealed.push(Metric("x", float(step), Reduce.MEAN, T0 + step))
        sealed.flush(step)
    sealed.shutdown()  # a sealed segment: unchanged from now on
    open_ = MetricCollector(run, rank=1, process_name="TrainActor_r1", flush_interval=3600)
    open_.push(Metric("x", 0.0, Reduce.MEAN, T0))
    open_.flush(0)
    cache: dict = {}
    first = inspect_run(run, cache=cache, now=T0 + 10)
    assert [s.last_step for s in first.sources] == [4, 0]
    # The sealed segment's column data garbled in place, its size and time kept (as a
    # listing shows it, unchanged): a call that read it again would find it damaged.
    (segment,) = run.glob("TrainActor_r0*.parquet")
    whole, listed = segment.read_bytes(), segment.stat()
    data_end = len(whole) - 8 - struct.unpack("<I", whole[-8:-4])[0]  # where the footer starts
    segment.write_bytes(whole[:4] + bytes(b ^ 0x55 for b in whole[4:data_end]) + whole[data_end:])
    os.utime(segment, ns=(listed.st_atime_ns, listed.st_mtime_ns))
    assert inspect_run(run, now=T0 + 10).skipped_records == 5  # read again, it is damaged
    for step in (1, 2):
        open_.push(Metric("x", float(step), Reduce.MEAN, T0 + step))
        open_.flush(step)
    second = inspect_run(run, cache=cache, now=T0 + 10)
    assert second.skipped_records == 0  # the sealed segment's aggregates: kept, not read again
    assert [s.last_step for s in second.sources] == [4, 2]  # the file written to since: read again
    segment.write_bytes(whole)
    os.utime(segment, ns=(listed.st_atime_ns, listed.st_mtime_ns))
    assert second.to_dict() | {"checked_at": 0} == inspect_run(run, now=T0 + 10).to_dict() | {"checked_at": 0}
    open_.shutdown()


def test_another_tools_parquet_is_read_once_and_checked_as_it_is_aggregated(tmp_path, monkeypatch):
    """Another tool's files (one of two sources, one of one) with a null value, a timestamp
    before 1970 and a NaN are each read once, in frames, and checked as they are read: the
    bad rows are counted, never aggregated, and what each source did is what its good rows
    say; a call that keeps a cache counts them again without reading the unchanged file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from metric_core.offline import read
    from metric_core.offline.inspect import aggregates as aggregates_module

    monkeypatch.setattr(aggregates_module, "BATCH_ROWS", 7)  # several frames a file
    rng = np.random.default_rng(3)
    files = {"two.parquet": [("Generator_r0", 0), ("Generator_r1", 1)], "one.parquet": [("Trainer_r2", 2)]}
    good: dict[tuple[str, int], list[dict]] = {}
    for name, sources in files.items():
        rows = []
        for step in range(12):
            for process, rank in sources:
                for key in ("a", "b"):
                    rows.append(
                        {
                            "key": key,
                            "value": float(rng.normal()),
                            "step": step,
                            "timestamp": T0 + step * 2.0 + rank * 0.1 + (key == "b") * 0.01,
                            "rank": rank,
                            "process": process,
                            "reduction": "mean",
                        }
                    )
        rows[3]["value"], rows[8]["timestamp"], rows[13]["value"] = None, -5.0, float("nan")
        for r in rows:
            if r["value"] is not None and r["timestamp"] > 0:
                good.setdefault((r["process"], r["rank"]), []).append(r)
        table = pa.Table.from_pylist(rows)
        for col in ("key", "reduction", "process"):
            table = table.set_column(table.column_names.index(col), col, table[col].dictionary_encode())
        pq.write_table(table, tmp_path / name, row_group_size=10)

    opened: list[str] = []
    batches = read.scan.categorical_batches

    def counting(path, *a, **k):
        opened.append(path.name)
        return batches(path, *a, **k)

    monkeypatch.setattr(read.scan, "categorical_batches", counting)
    monkeypatch.setattr(read.scan, "run_parquet_checks", lambda *a: pytest.fail("checked in its own read"))
    cache: dict = {}
    report = inspect_run(tmp_path, cache=cache, now=T0 + 30)
    assert sorted(opened) == sorted(files)  # each file once
    assert report.skipped_records == 4  # two in each file
    for src in report.sources:
        rows = good[(src.process, src.rank)]
        assert src.records == len(rows)
        assert (src.first_step, src.last_step) == (0, 11)
        assert src.first_timestamp == min(r["timestamp"] for r in rows)
        assert src.last_timestamp == max(r["timestamp"] for r in rows)
    nan = [r for rows in good.values() for r in rows if math.isnan(r["value"])]
    assert [
        (b.process, b.rank, b.key, b.first_step, b.first_timestamp, b.count) for b in report.nonfinite
    ] == [(r["process"], r["rank"], r["key"], r["step"], r["timestamp"], 1) for r in nan]

    again = inspect_run(tmp_path, cache=cache, now=T0 + 30)
    assert sorted(opened) == sorted(files)  # unchanged: not read again
    assert again.to_dict() == report.to_dict()


def test_a_scan_read_twice_counts_another_tools_bad_records_once_and_a_changed_file_is_said(tmp_path):
    """A file checked as it is read is counted once, however often the scan is read; one
    replaced by a half-written copy between the scan and the read is said as changed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from metric_core.errors import RunChangedError

    rows = {"key": ["a"] * 4, "value": [1.0, None, 2.0, 3.0], "reduction": ["mean"] * 4, "step": [0, 1, 2, 3]}
    rows |= {"timestamp": [T0, T0 + 1, T0 + 2, T0 + 3], "rank": [0, 1, 0, 1]}  # two sources in the file
    pq.write_table(pa.table(rows), tmp_path / "other.parquet")
    scan = scan_run(tmp_path, defer_checks=True)
    first = inspect_run(scan, now=T0 + 10).to_dict()
    assert first["skipped_records"] == 1 and [s["records"] for s in first["sources"]] == [2, 1]
    assert inspect_run(scan, now=T0 + 10).to_dict() == first
    assert execute(make_plan(), scan).frame["count"].to_list() == [1, 1, 1]  # the null value's step is gone
    assert scan.report.skipped_records == 1

    scan = scan_run(tmp_path, defer_checks=True)
    whole = (tmp_path / "other.parquet").read_bytes()
    (tmp_path / "other.parquet").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(RunChangedError, match="changed while it was read"):
        inspect_run(scan)


def test_a_files_keys_merged_in_shares_count_each_key_once(tmp_path, monkeypatch):
    """A file read in many frames, its per-key rows merged as they double and in shares of
    a hash of the key (both made small here): each key is counted once, and a key's NaNs
    in two frames are one key with two of them, first at the first one's step."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from metric_core.offline.inspect import aggregates as aggregates_module

    monkeypatch.setattr(aggregates_module, "BATCH_ROWS", 7)
    monkeypatch.setattr(aggregates_module, "MERGED_KEYS", 5)
    rows = [
        {"key": f"k{k}", "value": math.nan if k == 3 and step in (1, 4) else 1.0, "step": step}
        for step in range(6)
        for k in range(30)
    ]
    rows += [{"key": f"once/{i}", "value": 2.0, "step": 6} for i in range(40)]
    for i, r in enumerate(rows):
        r.update(timestamp=T0 + i * 0.01, rank=0, reduction="mean")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "keys.parquet", row_group_size=50)
    report = inspect_run(tmp_path, now=T0 + 30)
    (source,) = report.sources
    assert source.keys == 70 and source.records == len(rows)
    first_nan = next(r for r in rows if r["key"] == "k3" and math.isnan(r["value"]))
    assert [(b.key, b.first_step, b.first_timestamp, b.count) for b in report.nonfinite] == [
        ("k3", 1, first_nan["timestamp"], 2)
    ]


def test_a_cache_never_gives_a_file_the_aggregates_of_an_older_version_of_it(tmp_path):
    """A cache filled from one scan, given with a later scan whose own ``earlier`` saw the
    file after it grew: the file is unchanged for that scan, not for the cache, and is
    read again."""
    run = tmp_path / "run"
    live = MetricCollector(run, rank=0, process_name="TrainActor_r0", flush_interval=3600)
    live.push(Metric("x", 0.0, Reduce.MEAN, T0))
    live.flush(0)
    cache: dict = {}
    first = scan_run(run, defer_checks=True)
    inspect_run(first, cache=cache, now=T0 + 10)
    live.push(Metric("x", 1.0, Reduce.MEAN, T0 + 1))
    live.flush(1)  # the journal grew
    second = scan_run(run, defer_checks=True, earlier=first)
    third = scan_run(run, defer_checks=True, earlier=second)
    assert all(third.unchanged(fid) for fid in third.file_ids)
    report = inspect_run(third, cache=cache, now=T0 + 10)
    assert [s.last_step for s in report.sources] == [1]
    assert report.to_dict() == inspect_run(run, now=T0 + 10).to_dict() | {
        "checked_at": report.to_dict()["checked_at"]
    }
    live.shutdown()


# A rank that calls init() and ends before it records a metric: killed, an exception (line 4
# of the script), or a clean shutdown.
ENDED_AT_ONCE = """
import os, signal, sys, metric_core
metric_core.init(sys.argv[1], rank=0, process_name="Trainer_r0", world_size=1)
if sys.argv[2] == "exception": raise ValueError("bad config")
if sys.argv[2] == "kill": os.kill(os.getpid(), signal.SIGKILL)
metric_core.shutdown()
"""


@pytest.mark.parametrize(
    ("end", "code", "told"),
    [
        ("kill", -9, "died before its first flush: no exception or signal recorded (SIGKILL, the OOM killer, "
                     "os._exit or a native crash)"),
        ("exception", 1, "raised ValueError('bad config') before its first flush at <string>:4 (<module>)"),
        ("shutdown", 0, "shut down cleanly"),
    ],
)  # fmt: skip
def test_a_run_whose_attempt_ended_before_recording_says_so_and_how_it_ended(tmp_path, end, code, told):
    import subprocess
    import sys

    run = tmp_path / "run"
    rank = subprocess.run([sys.executable, "-c", ENDED_AT_ONCE, str(run), end], capture_output=True)
    assert rank.returncode == code, rank.stderr
    assert list(run.glob("Trainer_r0.r0.*")), "init() put the attempt on disk"
    for command in (["inspect", str(run)], ["reduce", str(run)]):
        done = subprocess.run(
            [str(Path(sys.executable).with_name("metriclog")), *command], capture_output=True, text=True
        )
        assert done.returncode == 1 and done.stdout == "", done.stderr
        assert done.stderr == (
            f"Error: no readable metric record in {run}: its attempt ended before recording any metric: "
            f"Trainer_r0 (rank 0) {told}\n"
        ), command


@pytest.mark.parametrize("layout", ["one file of three sources", "a file a source"])
def test_a_file_of_many_keys_is_compacted_frame_by_frame_and_its_keys_counted_on_disk(
    tmp_path, monkeypatch, layout
):
    """A file whose sources no other file holds, read in frames, never holds a row for each
    of its keys: what it merges at a time is at most a frame's first keys by name and what
    it kept, and its (source, key) pairs past COUNTED_KEYS wait in a temporary directory,
    removed at the end. The report is the records': each source's count of keys, the last
    values of the one that stopped (a key's newest record in an earlier frame than its
    others), its non-finite values (a key NaN in two frames, another past the first keys)."""
    import tempfile

    import polars as pl
    import pyarrow as pa
    import pyarrow.parquet as pq

    from metric_core.offline.inspect import aggregates, health

    for module, name, value in [
        (aggregates, "LAST_VALUES", 5),
        (health, "LAST_VALUES", 5),
        (aggregates, "BATCH_ROWS", 40),
        (aggregates, "MERGED_KEYS", 20),
        (aggregates, "COUNTED_KEYS", 60),
        (aggregates, "SHARES", 4),
    ]:
        monkeypatch.setattr(module, name, value)
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    merged: list[int] = []  # the rows a key of each merge
    for name in ("_merged_keys", "_merged_share"):
        merge = getattr(aggregates, name)
        monkeypatch.setattr(
            aggregates, name, lambda keys, by, f=merge: merged.append(keys.height) or f(keys, by)
        )
    spills: list[int] = []
    spill = aggregates._DistinctKeys._spill
    monkeypatch.setattr(aggregates._DistinctKeys, "_spill", lambda self: spills.append(1) or spill(self))

    rng = np.random.default_rng(11)
    rows = []
    for rank in range(3):
        n = 400 + 50 * rank
        for i in range(n):
            key = f"k/{int(rng.integers(0, 150 + 40 * rank)):04d}"  # keys met again in later frames
            step = min(i // 20, 3) if rank == 0 else i * 100 // n  # rank 0 stops early
            value = float(rng.normal())
            if (rank, i) in {(1, 10), (1, 230), (2, 50), (2, 60), (2, 300)}:  # in two frames or more
                key, value = "k/0003" if rank == 1 else "k/0170", math.nan  # among the first, and not
            stamp = T0 + step + i * 1e-3 + rank * 1e-4
            if rank == 0 and i % 97 == 5:
                stamp += 4.0  # newer than the key's records in later frames
            rows.append(
                {"key": key, "value": value, "reduction": "mean", "step": step, "timestamp": stamp}
                | {"rank": rank, "process": f"Actor_r{rank}"}
            )
    records = pl.DataFrame(rows)
    run = tmp_path / "run"
    run.mkdir()
    if layout == "one file of three sources":
        pq.write_table(pa.Table.from_pylist(rows), run / "all.parquet", row_group_size=100)
    else:
        for rank in range(3):
            mine = [r for r in rows if r["rank"] == rank]
            pq.write_table(pa.Table.from_pylist(mine), run / f"r{rank}.parquet", row_group_size=100)

    report = inspect_run(run, now=T0 + 1000)
    for s in report.sources:
        assert s.keys == records.filter(pl.col("rank") == s.rank)["key"].n_unique()
    (stopped,) = report.stopped_early
    mine = records.filter(pl.col("rank") == 0).with_row_index()
    newest = mine.sort("timestamp", "index").group_by("key").last().sort("key").head(5)
    assert list(stopped.last_values) == newest["key"].to_list()
    assert list(stopped.last_values.values()) == newest["value"].to_list()
    bad = records.with_row_index().filter(pl.col("value").is_nan())
    truth = bad.group_by("process", "rank", "key").agg(
        count=pl.len(), first_step=pl.col("step").min(), first_timestamp=pl.col("timestamp").min()
    )
    got = {(b.process, b.rank, b.key): (b.count, b.first_step, b.first_timestamp) for b in report.nonfinite}
    assert got == {(p, r, k): (c, f, t) for p, r, k, c, f, t in truth.iter_rows()}
    assert len(got) == 2 and all(c > 1 for c, _, _ in got.values())
    assert spills  # counted on disk
    assert not any(temp.iterdir())  # and the disk let go
    assert max(merged) <= 2 * max(20, 3 * 5) + 3 * 5 + bad.height  # never every key's row


def test_keys_met_again_and_again_past_the_counted_keys_take_the_disk_of_their_distinct_pairs(
    tmp_path, monkeypatch
):
    """A file whose keys come back every step, read in frames past COUNTED_KEYS (so its
    pairs go to disk): what waits on disk, counted in the files themselves after each write,
    stays near its distinct (source, key) pairs, not its records; the count is the keys'."""
    import tempfile

    import polars as pl
    import pyarrow as pa
    import pyarrow.parquet as pq

    from metric_core.offline.inspect import aggregates

    monkeypatch.setattr(aggregates, "BATCH_ROWS", 40)
    monkeypatch.setattr(aggregates, "COUNTED_KEYS", 20)
    monkeypatch.setattr(aggregates, "SHARES", 4)
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    on_disk: list[int] = []
    write = aggregates._DistinctKeys._write

    def counted(self, share, rows):
        write(self, share, rows)
        on_disk.append(sum(pl.read_ipc(f).height for f in Path(self.spill.name).glob("*.arrow")))

    monkeypatch.setattr(aggregates._DistinctKeys, "_write", counted)
    keys, steps = 60, 100
    rows = [
        {"key": f"metric/{k:03d}", "value": float(k * step), "step": step, "timestamp": T0 + step + k * 1e-3}
        | {"rank": 0, "reduction": "mean"}
        for step in range(steps)
        for k in range(keys)
    ]
    run = tmp_path / "run"
    run.mkdir()
    pq.write_table(pa.Table.from_pylist(rows), run / "rank0.parquet", row_group_size=200)
    (source,) = inspect_run(run, now=T0 + steps).sources
    assert source.keys == keys and source.records == keys * steps
    assert on_disk  # its pairs went to disk
    assert max(on_disk) <= 2 * keys + 4 * 20 // 4 + 2 * 40  # never its records' (6,000)
    assert not any(temp.iterdir())


def test_another_tools_sources_are_running_while_they_write_and_ended_once_silent(tmp_path):
    """Files that record no life (another tool's): a source is ``running`` while its newest
    record is within its quiet threshold of the wall clock, ``ended`` once silent past it
    (the run is over: how it ended is not recorded; it was once called running however
    old), and ``stopped_early`` by the lag rule whatever the clock; still_running agrees."""
    t0 = 1.76e9
    write_other_tool_run(tmp_path, {0: 300, 1: 300, 2: 100}, t0)
    for now, state, live in ((t0 + 300.5, "running", True), (t0 + 3600, "ended", False)):
        report = inspect_run(scan_run(tmp_path), now=now)
        assert [s.state for s in report.sources] == [state, state, "stopped_early"]
        assert report.still_running is live
        assert [s["state"] for s in json.loads(report.to_json())["sources"]] == [
            state,
            state,
            "stopped_early",
        ]
    result = CliRunner().invoke(app, ["inspect", str(tmp_path)])
    assert result.exit_code == 0 and "running" not in result.output and " ended " in result.output
    write_other_tool_run(tmp_path / "together", {0: 300, 1: 300})  # none stopped early
    verdict = inspect_run(scan_run(tmp_path / "together"), now=t0 + 3600).verdict()
    assert verdict[0].startswith("No source stopped before the others: all 2 ended within 0 ms of each other")
    assert "shutdown()" not in verdict[0]
    assert "(their files record no end: how they ended is not known)" in verdict[0]
