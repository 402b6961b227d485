"""metriclog compare: statistics across runs against fractions over each run's own reduce."""

from __future__ import annotations

import json
import math
import shutil
import statistics
from collections import defaultdict
from decimal import Decimal, localcontext
from fractions import Fraction
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from metriclog.main import app
from metriclog.options import as_flag
from typer.testing import CliRunner

import metric_core
from metric_core import MetricCollector, Reduce
from metric_core.errors import PlanError, RequestError, spell_options
from metric_core.offline.compare import compare_runs
from metric_core.offline.engine import reduce_run
from metric_core.offline.engine.exact import sqrt_ratio

runner = CliRunner()
BASE_TIME = 1_760_000_000.0
LRS = (0.1, 0.1, 0.1, 0.01, 0.01)  # 5 seeds of one job, 2 groups by config.lr
KEYS = (("loss", Reduce.MEAN, 4), ("acc", Reduce.MAX, 2), ("tokens", Reduce.SUM, 3), ("lat", Reduce.STD, 5))


def write_job(run_dir: Path, *, seed: int, lr: float | None, steps: int, change=None) -> None:
    """One job of two ranks through the real writer: rank 0 by ``metric_core.init`` (which
    writes run.json with its config) and ``record_metric``, rank 1 by a collector of its
    own; values from ``seed``. ``change``: (step, key, delta) added to rank 0's first value
    of that key at that step."""
    rng = np.random.default_rng(seed)
    config = {"seed": seed, "opt": {"name": "adam"}} | ({} if lr is None else {"lr": lr})
    metric_core.init(run_dir, rank=0, process_name="trainer_r0", config=config, world_size=2)
    other = MetricCollector(run_dir, rank=1, process_name="trainer_r1")
    for step in range(steps):
        for rank in (0, 1):
            for key, reduction, n in KEYS:
                if key == "tokens" and (step + seed) % 4 == 0:
                    continue  # a key some steps lack
                for i in range(n):
                    value = float(rng.normal(1e8 if key == "lat" else 1.0, 1.0)) * (lr or 1.0)
                    if change is not None and (step, key, rank, i) == (change[0], change[1], 0, 0):
                        value += change[2]
                    if rank == 0:
                        metric_core.record_metric(key, value, reduction)
                    else:
                        other.push(metric_core.Metric(key, value, reduction))
        metric_core.flush(step)
        other.flush(step)
    other.shutdown()
    metric_core.shutdown()


def write_timed(
    run_dir: Path,
    values: dict[int, float],
    *,
    start: float,
    key: str = "x",
    reduction=Reduce.MEAN,
    rank: int = 0,
) -> None:
    """One source (rank ``rank``) recording ``values`` (step: value), a step a second from ``start``."""
    c = MetricCollector(run_dir, rank=rank, process_name=f"p{rank}")
    for step, value in values.items():
        c.push(metric_core.Metric(key, value, reduction, start + step))
        c.flush(step)
    c.shutdown()


def write_seeds(root: Path, steps, lrs=LRS) -> list[Path]:
    """The job with a seed a learning rate of ``lrs``, seed i of ``steps(i)`` steps."""
    runs = [root / f"seed{i}" for i in range(len(lrs))]
    for i, (run, lr) in enumerate(zip(runs, lrs, strict=True)):
        write_job(run, seed=i, lr=lr, steps=steps(i))
    return runs


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    """5 seeds in 2 groups by lr; they end at different steps (30 to 34)."""
    return write_seeds(tmp_path_factory.mktemp("seeds"), lambda i: 30 + i)


# --- the oracle: fractions over the runs' own reduce outputs ---------------------------


def correctly_rounded_sqrt(x: Fraction) -> float:
    """sqrt(x) to 60 digits (decimal), then to the nearest float64."""
    with localcontext() as ctx:
        ctx.prec = 60
        return float((Decimal(x.numerator) / Decimal(x.denominator)).sqrt())


def oracle(values: list[float]) -> dict[str, float | int | None]:
    n = len(values)
    if any(math.isnan(v) for v in values):
        nan = math.nan
        spread = nan if n > 1 else None
        return {"mean": nan, "std": nan, "std_sample": spread, "stderr": spread, "min": nan, "max": nan,
                "median": nan, "count": n}  # fmt: skip
    exact = [Fraction(v) for v in values]
    mean = sum(exact) / n
    ss = sum((x - mean) ** 2 for x in exact)
    ordered = sorted(exact)
    median = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    return {
        "mean": float(mean),
        "std": correctly_rounded_sqrt(ss / n),
        "std_sample": correctly_rounded_sqrt(ss / (n - 1)) if n > 1 else None,
        "stderr": correctly_rounded_sqrt(ss / (n - 1) / n) if n > 1 else None,
        "min": float(ordered[0]),
        "max": float(ordered[-1]),
        "median": float(median),
        "count": n,
    }


def values_of(runs: list[Path], groups: list, **options) -> dict[tuple, list[float]]:
    """Per (group, [process,] step, key): each run's own reduce_run value."""
    cells: dict[tuple, list[float]] = defaultdict(list)
    for run, group in zip(runs, groups, strict=True):
        frame = reduce_run(run, **options)
        index = [c for c in ("process", "step") if c in frame.columns]
        for row in frame.select(*index, "key", "value").iter_rows():
            cells[(group, *row[:-1])].append(row[-1])
    return cells


def expected(runs: list[Path], groups: list, **options) -> dict[tuple, dict]:
    """Per (group, [process,] step, key): the oracle over each run's own reduce_run values."""
    return {cell: oracle(values) for cell, values in values_of(runs, groups, **options).items()}


def same(a, b) -> bool:
    """Equal floats (NaN equals NaN; a zero's sign aside: a tie of -0.0 and 0.0), or both None."""
    if a is None or b is None:
        return a is b
    return (math.isnan(a) and math.isnan(b)) or a == b


def check(result_frame: pl.DataFrame, want: dict[tuple, dict], index: list[str]) -> None:
    got = {tuple(row[c] for c in [*index, "key"]): row for row in result_frame.iter_rows(named=True)}
    assert set(got) == set(want)
    for cell, stats in want.items():
        for name, value in stats.items():
            assert same(got[cell][name], value), (cell, name, got[cell][name], value)


# --- compare ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["global_reduce", "per_rank_reduce"])
def test_every_statistic_is_exact_against_fractions_over_each_runs_reduce(seeds, mode):
    result = compare_runs(seeds, mode=mode, group_by="config.lr")
    index = ["config.lr", *(["process"] if mode == "per_rank_reduce" else []), "step"]
    assert result.frame.columns == [*index, "key", "reduction", "mean", "std", "std_sample", "stderr",
                                    "min", "max", "median", "count"]  # fmt: skip
    want = expected(seeds, list(LRS), mode=mode)
    check(result.frame, want, index)
    # the check has teeth: numpy's float mean of the same values misses the exact one in places
    got = {tuple(row[:-1]): row[-1] for row in result.frame.select(*index, "key", "mean").iter_rows()}
    assert sum(float(np.mean(v)) != got[c] for c, v in values_of(seeds, list(LRS), mode=mode).items()) > 0
    assert result.frame.equals(result.frame.sort([*index, "key"]))
    assert sorted(set(result.frame["config.lr"])) == [0.01, 0.1]
    assert [g for _, _, g in result.runs] == list(LRS)


def test_a_statistic_the_stdlib_rounds_the_same():
    """The oracle's root against the standard library's correctly rounded stdev (3.12+)."""
    values = [1e8 + 0.1 * i for i in range(5)]
    if hasattr(statistics, "_float_sqrt_of_frac"):
        assert oracle(values)["std_sample"] == statistics.stdev(values)
        assert oracle(values)["std"] == statistics.pstdev(values)


def test_the_runs_in_any_order_give_the_same_bytes(seeds, tmp_path):
    outs = []
    for i, order in enumerate([seeds, seeds[::-1], [seeds[2], seeds[0], seeds[4], seeds[1], seeds[3]]]):
        out = tmp_path / f"{i}.csv"
        result = runner.invoke(
            app, ["compare", *map(str, order), "--group-by", "config.lr", "--out", str(out)]
        )
        assert result.exit_code == 0, result.output
        outs.append(out.read_bytes())
    assert outs[0] == outs[1] == outs[2]
    frame = pl.read_csv(tmp_path / "0.csv")
    assert frame.columns[:3] == ["config.lr", "step", "key"]


def test_runs_that_end_at_different_steps_are_counted_and_common_keeps_what_all_hold(seeds):
    result = compare_runs(seeds, keys=["loss"])
    counts = dict(result.frame.select("step", "count").iter_rows())
    assert counts == {s: 5 if s < 30 else 34 - s for s in range(34)}
    assert any("--common keeps only" in spell_options(note, as_flag) for note in result.notes)
    common = compare_runs(seeds, keys=["loss"], common=True)
    assert common.frame["step"].to_list() == list(range(30))
    grouped = compare_runs(seeds, keys=["loss"], common=True, group_by="config.lr")
    assert dict(grouped.frame.group_by("config.lr").agg(pl.col("step").max()).iter_rows()) == {
        0.1: 29,
        0.01: 32,
    }


def test_glob_and_a_file_of_runs(seeds, tmp_path):
    listed = tmp_path / "runs.txt"
    listed.write_text("# the seeds\n" + "\n".join(map(str, seeds[::-1])) + "\n\n")
    by_file = compare_runs([f"@{listed}"], keys=["acc"])
    by_glob = compare_runs([str(seeds[0].parent / "seed*")], keys=["acc"])
    assert by_file.frame.equals(by_glob.frame)
    assert [label for label, _, _ in by_glob.runs] == [f"seed{i}" for i in range(5)]
    with pytest.raises(RequestError, match="no run directory matches"):
        compare_runs([str(tmp_path / "nothing*")])


def test_a_run_without_the_group_key_is_named_or_kept_in_a_group_of_its_own(seeds, tmp_path):
    bare = tmp_path / "bare"
    write_job(bare, seed=9, lr=None, steps=3)
    with pytest.raises(RequestError) as caught:
        compare_runs([*seeds[:2], bare], group_by="config.lr")
    assert str(caught.value) == (
        f"run {bare} (bare) has no 'config.lr' in its run.json; its config has opt, seed: name a key every "
        "run has (dotted, e.g. config.lr), or keep_missing=True to put such runs in a group of their own"
    )
    cli = runner.invoke(app, ["compare", str(seeds[0]), str(bare), "--group-by", "config.lr"])
    assert cli.exit_code == 1
    assert "--keep-missing to put such runs" in cli.stderr
    kept = compare_runs([*seeds[:2], bare], group_by="config.lr", keep_missing=True, keys=["loss"])
    assert kept.frame["config.lr"].to_list()[-3:] == [None] * 3  # its own group, last
    assert kept.frame.filter(pl.col("config.lr").is_null())["count"].to_list() == [1, 1, 1]
    nested = compare_runs(seeds[:2], group_by="config.opt.name", keys=["loss"])
    assert set(nested.frame["config.opt.name"]) == {"adam"}


def test_two_runs_of_one_name_need_labels(seeds, tmp_path):
    twin = tmp_path / "elsewhere" / "seed0"
    shutil.copytree(seeds[1], twin)
    cli = runner.invoke(app, ["compare", str(seeds[0]), str(twin)])
    assert cli.exit_code == 1
    assert cli.stderr.splitlines()[-1] == (
        f"Error: runs {seeds[0]} and {twin} are both labelled 'seed0': name each run with --label NAME "
        "(one a run, in their order)"
    )
    labelled = compare_runs([seeds[0], twin], labels=["first", "second"], keys=["loss"])
    assert [label for label, _, _ in labelled.runs] == ["first", "second"]
    with pytest.raises(PlanError, match="names 1 run"):
        compare_runs([seeds[0], twin], labels=["one"])


def test_a_nan_in_one_run_makes_its_cell_nan_but_count(tmp_path):
    runs = [tmp_path / f"r{i}" for i in range(3)]
    for i, run in enumerate(runs):
        write_timed(run, {step: math.nan if (i, step) == (1, 1) else float(i + step) for step in range(3)},
                    start=BASE_TIME)  # fmt: skip
    frame = compare_runs(runs).frame
    nan_row = frame.filter(pl.col("step") == 1).row(0, named=True)
    assert nan_row["count"] == 3
    assert all(
        math.isnan(nan_row[s]) for s in ("mean", "std", "std_sample", "stderr", "min", "max", "median")
    )
    fine = frame.filter(pl.col("step") == 2).row(0, named=True)
    assert (fine["mean"], fine["min"], fine["max"], fine["std"]) == (3.0, 2.0, 4.0, math.sqrt(2 / 3))


@pytest.mark.parametrize("negative_first", [True, False])
def test_min_of_both_zeros_is_minus_zero_and_max_zero_in_any_label_order(tmp_path, negative_first):
    """min(-0.0, 0.0) is -0.0 and max is 0.0, as ``reduce`` has it: not whichever run's label
    sorts first."""
    zeros = (-0.0, 0.0) if negative_first else (0.0, -0.0)
    runs = [tmp_path / f"r{i}" for i in range(2)]
    for run, zero in zip(runs, zeros, strict=True):
        write_timed(run, {0: zero, 1: 1.0}, start=BASE_TIME, reduction=Reduce.MIN)  # a mean of -0.0 is 0.0
    row = compare_runs(runs).frame.filter(pl.col("step") == 0).row(0, named=True)
    assert math.copysign(1.0, row["min"]) == -1.0 and row["min"] == 0.0
    assert math.copysign(1.0, row["max"]) == 1.0 and row["max"] == 0.0
    assert (row["count"], row["std"]) == (2, 0.0)


def test_one_run_has_no_sample_spread(seeds):
    frame = compare_runs(seeds[:1], keys=["loss"]).frame
    assert set(frame["std"]) == {0.0}
    assert frame["std_sample"].null_count() == frame["stderr"].null_count() == frame.height


def test_by_time_windows_line_up_from_each_runs_start(tmp_path):
    """Runs started 1000 s apart: by wall-clock they never meet, from their starts they do."""
    runs = [tmp_path / f"r{i}" for i in range(3)]
    for i, run in enumerate(runs):
        write_timed(
            run, {step: float(step * (i + 1)) for step in range(10 + i)}, start=BASE_TIME + 1000.25 * i
        )
    result = compare_runs(runs, by="time", every="2s", across=["mean", "count"])
    assert result.frame.columns == ["window_offset", "key", "reduction", "mean", "count"]
    assert result.frame["window_offset"].to_list() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    assert result.frame["count"].to_list() == [3, 3, 3, 3, 3, 2]
    # window 0 holds steps 0 and 1 of each run: means 0.5, 1.0, 1.5; their mean 1.0
    assert result.frame["mean"].to_list()[:2] == [1.0, 5.0]


def test_across_chooses_and_orders_the_statistics(seeds):
    frame = compare_runs(seeds, keys=["acc"], across="median,count,mean").frame
    assert frame.columns == ["step", "key", "reduction", "median", "count", "mean"]
    cli = runner.invoke(app, ["compare", str(seeds[0]), "--across", "mean,sdt"])
    assert cli.exit_code == 2
    assert "--across 'mean,sdt' names 'sdt'" in cli.stderr


def test_per_rank_no_reduce_is_refused(seeds):
    cli = runner.invoke(app, ["compare", *map(str, seeds[:2]), "--mode", "per_rank_no_reduce"])
    assert cli.exit_code == 2
    assert "--mode 'per_rank_no_reduce' keeps every raw record" in cli.stderr


def test_wide_makes_a_column_per_key_and_statistic(seeds):
    result = compare_runs(seeds, keys=["acc", "loss"], across="mean,count", group_by="config.lr")
    wide = result.wide()
    assert wide.columns == ["config.lr", "step", "acc:mean", "acc:count", "loss:mean", "loss:count"]
    long = {
        (g, s, k): m for g, s, k, m in result.frame.select("config.lr", "step", "key", "mean").iter_rows()
    }
    for row in wide.iter_rows(named=True):
        assert row["loss:mean"] == long[(row["config.lr"], row["step"], "loss")]


def test_reductions_that_differ_between_runs_are_refused(tmp_path):
    runs = []
    for i, reduction in enumerate((Reduce.MEAN, Reduce.MAX)):
        run = tmp_path / f"r{i}"
        c = MetricCollector(run, rank=0, process_name="p")
        c.push(metric_core.Metric("x", 1.0, reduction, BASE_TIME))
        c.flush(0)
        c.shutdown()
        runs.append(run)
    with pytest.raises(RequestError, match="'x' is reduced with different statistics in the runs"):
        compare_runs(runs)
    assert compare_runs(runs, reduce=["x=max"]).frame["reduction"].to_list() == ["max"]


@pytest.mark.parametrize("seed", range(6))
def test_random_runs_against_the_oracle(tmp_path, seed):
    """Generated runs (1 to 7, random lengths, values across magnitudes, signed zeros, the odd
    NaN and infinity), one raw value a step and key: the oracle over the values written."""
    rng = np.random.default_rng(seed)
    n_runs = int(rng.integers(1, 8))
    truth: dict[tuple, list[float]] = defaultdict(list)
    runs = []
    for r in range(n_runs):
        run = tmp_path / f"run{r}"
        c = MetricCollector(run, rank=0, process_name="p")
        for step in range(int(rng.integers(1, 12))):
            for key in ("a", "b"):
                kind = rng.integers(0, 10)
                value = (
                    float(rng.choice([0.0, -0.0, math.nan, math.inf, 5e-324]))
                    if kind == 0
                    else float(rng.normal() * 10.0 ** int(rng.integers(-30, 30)))
                )
                c.push(metric_core.Metric(key, value, Reduce.MAX, BASE_TIME + step))
                truth[(step, key)].append(value)
            c.flush(step)
        c.shutdown()
        runs.append(run)
    result = compare_runs(runs[::-1])
    assert result.frame.height == len(truth)
    for row in result.frame.iter_rows(named=True):
        values = truth[(row["step"], row["key"])]
        assert row["count"] == len(values)
        if not any(math.isinf(v) for v in values):
            for name, value in oracle(values).items():
                assert same(row[name], value), (name, values, row)
            continue
        with np.errstate(invalid="ignore"):  # an infinity: numpy's answers, the spreads NaN
            for name, numpy in (("mean", np.mean), ("min", np.min), ("max", np.max), ("median", np.median)):
                assert same(row[name], float(numpy(values))), (name, values, row)
        assert math.isnan(row["std"])


def test_sqrt_ratio_is_correctly_rounded():
    """The roots compare's spreads are taken with, against decimal's to 60 digits: ratios of
    every size, exact squares, and ratios of two floats' squares."""
    rng = np.random.default_rng(7)
    cases = [(n * n, 1) for n in (1, 3, 2**60 + 1)] + [(1, 2**2200), (2**2100, 3), (2, 1), (10**400, 7)]
    cases += [
        (int(rng.integers(1, 2**62)) << int(rng.integers(0, 900)), int(rng.integers(1, 2**62)))
        for _ in range(300)
    ]
    cases += [
        (int(rng.integers(1, 2**40)), int(rng.integers(1, 2**62)) << int(rng.integers(0, 900)))
        for _ in range(300)
    ]
    for num, den in cases:
        assert sqrt_ratio(num, den) == correctly_rounded_sqrt(Fraction(num, den)), (num, den)


def test_per_rank_reduce_needs_a_process_name_a_rank(tmp_path):
    run = tmp_path / "twins"
    for rank in (0, 1):
        c = MetricCollector(run, rank=rank, process_name="worker")
        c.push(metric_core.Metric("x", 1.0, Reduce.MEAN, BASE_TIME))
        c.flush(0)
        c.shutdown()
    with pytest.raises(RequestError, match=f"^run {run}: ranks 0 and 1 both write as process 'worker'"):
        compare_runs([run], mode="per_rank_reduce")
    assert compare_runs([run]).frame["count"].to_list() == [1]


def test_every_output_format_holds_the_same_rows(seeds, tmp_path):
    frame = compare_runs(seeds, keys=["acc"], group_by="config.lr").frame
    out = tmp_path / "across.parquet"
    wrote = runner.invoke(
        app, ["compare", *map(str, seeds), "--key", "acc", "--group-by", "config.lr", "--out", str(out)]
    )
    assert wrote.exit_code == 0, wrote.output
    assert pl.read_parquet(out).equals(frame)
    printed = runner.invoke(app, ["compare", *map(str, seeds), "--key", "acc", "--group-by", "config.lr",
                                  "--format", "jsonl"])  # fmt: skip
    rows = [json.loads(line) for line in printed.stdout.splitlines()]
    assert [(r["config.lr"], r["step"], r["mean"], r["std_sample"]) for r in rows] == frame.select(
        "config.lr", "step", "mean", "std_sample"
    ).rows()
    wide = runner.invoke(app, ["compare", *map(str, seeds), "--key", "acc", "--across", "mean", "--wide"])
    assert wide.stdout.splitlines()[0] == "step,acc"
