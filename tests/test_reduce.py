"""metriclog reduce against numpy over the raw values, for every mode, statistic and filter."""

from __future__ import annotations

import math
import shutil
from collections import defaultdict

import numpy as np
import polars as pl
import pytest

from metric_core import MetricCollector, Reduce, reduce_metrics_states, scan_run
from metric_core.errors import FilteredOutError, MetricLogWarning, PlanError
from metric_core.offline.engine import execute, reduce_run, run_plan
from metric_core.offline.plan import Statistic, key_matcher, make_plan

from .conftest import ONE_KEY_PER_REDUCTION, write_collector_run

SOURCES_PARQUET = [("TrainActor_r0", 0), ("TrainActor_r1", 1), ("TrainActor_r2", 2)]
SOURCES_JSONL = [("GeneratorActor_r0", 0), ("GeneratorActor_r1", 1)]
NUMPY = {
    "mean": np.mean,
    "sum": np.sum,
    "max": np.max,
    "min": np.min,
    "std": np.std,
    "median": np.median,
    "count": len,
}


@pytest.fixture(scope="module", params=["mixed", "parquet"])
def run(request, tmp_path_factory):
    """Many ranks, several values per step, missing keys, a rank that died (its journal left).

    "mixed" adds JSONL sources, so reduce groups on key strings; in "parquet" every file
    carries the writer's key hashes, so global_reduce by step groups on one integer.
    """
    root = tmp_path_factory.mktemp("run")
    truth = write_collector_run(root, SOURCES_PARQUET, steps=25, file_format="parquet", seed=1)
    fmt = "jsonl" if request.param == "mixed" else "parquet"
    truth += write_collector_run(root, SOURCES_JSONL, steps=25, file_format=fmt, seed=2)
    truth += write_collector_run(root, [("TrainActor_r3", 3)], steps=9, seed=3, shutdown=None)
    assert list(root.glob("TrainActor_r3.*.journal"))
    scan = scan_run(root)
    assert all(scan.report.files[i].hashed for i in scan.file_ids) is (request.param == "parquet")
    return root, truth


def numpy_stat(name: str, rows: list[dict]) -> float:
    values = np.array([r["value"] for r in rows])
    if name in ("first", "last"):
        order = np.argsort([r["timestamp"] for r in rows], kind="stable")
        return float(values[order[0] if name == "first" else order[-1]])
    if name.startswith("p"):
        return float(np.percentile(values, float(name[1:])))
    return float(NUMPY[name](values))


def expected(truth, *, per_rank=False, every=None, stat_of=None, keep=lambda r: True):
    rows = [r for r in truth if keep(r)]
    t0 = min(r["timestamp"] for r in rows)
    groups = defaultdict(list)
    for r in rows:
        bucket = r["step"] if every is None else t0 + math.floor((r["timestamp"] - t0) / every) * every
        source = (r["process"], r["rank"]) if per_rank else ()
        groups[(*source, bucket, r["key"])].append(r)
    out = {}
    for gk, grp in groups.items():
        stat = stat_of(gk[-1]) if stat_of else grp[0]["reduction"]
        out[gk] = (numpy_stat(stat, grp), len(grp), stat)
    return out


def check(frame, want, *, per_rank=False, bucket="step"):
    cols = (["process", "rank"] if per_rank else []) + [bucket, "key"]
    got = {
        tuple(row[:-3]): row[-3:] for row in frame.select(*cols, "value", "count", "reduction").iter_rows()
    }
    assert set(got) == set(want)
    for gk, (value, count, stat) in want.items():
        g_value, g_count, g_stat = got[gk]
        assert (g_count, g_stat) == (count, stat), gk
        tol = 1e-6 if stat == "std" else 1e-9
        assert g_value == pytest.approx(value, rel=tol, abs=1e-12), gk


@pytest.mark.parametrize("per_rank", [False, True], ids=["global", "per_rank"])
def test_recorded_reductions_by_step(run, per_rank):
    root, truth = run
    mode = "per_rank_reduce" if per_rank else "global_reduce"
    frame = reduce_run(root, mode=mode)
    check(frame, expected(truth, per_rank=per_rank), per_rank=per_rank)
    cols = ["process", "rank", "step"] if per_rank else ["step"]
    assert frame.columns == [*cols, "key", "value", "reduction", "count"]
    assert frame.equals(frame.sort([*cols, "key"]))
    assert str(frame.schema["value"]) == "Float64"
    assert str(frame.schema["count"]) == "Int64"


@pytest.mark.parametrize(
    "stat",
    ["mean", "sum", "max", "min", "std", "count", "median", "p99", "p99.9", "p0", "p50", "first", "last"],
)
@pytest.mark.parametrize("per_rank", [False, True], ids=["global", "per_rank"])
def test_every_statistic_as_an_override(run, stat, per_rank):
    root, truth = run
    mode = "per_rank_reduce" if per_rank else "global_reduce"
    frame = reduce_run(root, mode=mode, reduce=[f"*={stat}"])
    check(frame, expected(truth, per_rank=per_rank, stat_of=lambda k: stat), per_rank=per_rank)


def test_overrides_apply_by_glob_and_the_last_match_wins(run):
    root, truth = run
    frame = reduce_run(root, reduce=["policy/*=median", "policy/latency_s=p90", "trainer/l?ss=max"])

    def stat_of(key):
        return {"policy/latency_s": "p90", "policy/tokens": "median", "trainer/loss": "max"}.get(key) or next(
            r["reduction"] for r in truth if r["key"] == key
        )

    check(frame, expected(truth, stat_of=stat_of))


@pytest.mark.parametrize("every", [1.0, 2.5, 10.0])
@pytest.mark.parametrize("per_rank", [False, True], ids=["global", "per_rank"])
def test_wall_clock_windows(run, every, per_rank):
    root, truth = run
    mode = "per_rank_reduce" if per_rank else "global_reduce"
    frame = reduce_run(root, mode=mode, by="time", every=f"{every}s")
    assert "window_start" in frame.columns and "step" not in frame.columns
    check(frame, expected(truth, per_rank=per_rank, every=every), per_rank=per_rank, bucket="window_start")


def test_filters_keys_ranks_and_steps(run):
    root, truth = run
    frame = reduce_run(root, keys=["trainer/*", "policy/tokens"], ranks="0,2-3", steps="5:12")

    def keep(r):
        return (
            (r["key"].startswith("trainer/") or r["key"] == "policy/tokens")
            and r["rank"] in (0, 2, 3)
            and (5 <= r["step"] < 12)
        )

    check(frame, expected(truth, keep=keep))


def test_windows_align_to_the_first_timestamp_of_the_selected_data(run):
    root, truth = run
    frame = reduce_run(root, by="time", every="3s", steps="4:", keys=["trainer/*"])
    keep = lambda r: r["step"] >= 4 and r["key"].startswith("trainer/")  # noqa: E731
    t0 = min(r["timestamp"] for r in truth if keep(r))
    assert frame["window_start"].min() == t0
    check(frame, expected(truth, every=3.0, keep=keep), bucket="window_start")


def test_per_rank_no_reduce_is_every_raw_record_sorted(run):
    root, truth = run
    frame = reduce_run(root, mode="per_rank_no_reduce")
    assert frame.columns == ["process", "rank", "step", "timestamp", "key", "value", "reduction"]
    want = sorted((r["process"], r["rank"], r["timestamp"], r["step"], r["key"], r["value"]) for r in truth)
    got = [(p, rk, t, s, k, v) for p, rk, s, t, k, v, _ in frame.iter_rows()]
    assert got == want


def test_offline_global_reduce_equals_merging_live_states(tmp_path):
    rng = np.random.default_rng(7)
    collectors = [MetricCollector(tmp_path, rank=r, process_name=f"r{r}") for r in range(4)]
    live = {}
    for step in range(10):
        states = []
        for c in collectors:
            for key, red in ONE_KEY_PER_REDUCTION:
                for v in (1e8 if red is Reduce.STD else 0) + rng.normal(size=int(rng.integers(1, 20))):
                    c.record(key, float(v), red)
            states.append(c.flush(step, return_state=True))
        for metric in reduce_metrics_states(states):
            live[(step, metric.key)] = metric.value
    for c in collectors:
        c.shutdown()
    offline = {(s, k): v for s, k, v in reduce_run(tmp_path).select("step", "key", "value").iter_rows()}
    assert offline.keys() == live.keys()
    for (step, key), value in live.items():
        if key in ("x", "n"):
            assert offline[(step, key)] == value  # exact
        else:
            assert offline[(step, key)] == pytest.approx(value, rel=1e-9 if key != "d" else 1e-6)


def test_a_key_under_two_reductions_keeps_its_first_records_reduction_in_every_mode(tmp_path):
    """Never a whole run broken: the reduction of the key's first record (by time) is kept,
    the records under the other are skipped and said, in every mode and whatever the
    order the sources are read in; --reduce KEY=STAT reduces them all."""
    b = MetricCollector(tmp_path, rank=1, process_name="TrainActor_r1")
    a = MetricCollector(tmp_path, rank=0, process_name="TrainActor_r0")
    b.record("loss", 5.0, Reduce.MAX)  # the first record of 'loss', by time: max
    for step in range(3):
        a.record("loss", float(step), Reduce.MEAN)
        a.record("acc", 1.0, Reduce.MEAN)
        a.flush(step)
        b.record("loss", 7.0 + step, Reduce.MAX)
        b.flush(step)
    a.record("loss", 1.0, Reduce.MAX)
    with pytest.warns(
        MetricLogWarning, match="key 'loss' was recorded with reduction 'mean', and now with 'max'"
    ):
        a.flush(3)  # the writer says it, once, at the next flush (never in record)
    a.shutdown()
    b.shutdown()
    for mode in ("global_reduce", "per_rank_reduce"):
        result = run_plan(tmp_path, make_plan(mode=mode))
        loss = result.frame.filter(pl.col("key") == "loss")
        assert set(loss["reduction"]) == {"max"} and loss["count"].sum() == 5, mode  # b's 4, a's last
        mixed = result.scan.report.mixed["loss"]
        assert (mixed.kept, mixed.skipped) == ("max", {"mean": 3}), mode
        assert result.frame.filter(pl.col("key") == "acc")["count"].sum() == 3  # other keys untouched
    summary = result.scan.report.summary()
    assert (
        "key 'loss' is recorded under more than one reduction: 3 record(s) under 'mean' (by TrainActor_r0"
        in summary
    )
    every = run_plan(tmp_path, make_plan(reduce=["loss=sum"])).frame.filter(pl.col("key") == "loss")
    assert (
        every["value"].sum() == pytest.approx(5.0 + 7 + 8 + 9 + 0 + 1 + 2 + 1) and every["count"].sum() == 8
    )
    from metriclog.main import app
    from typer.testing import CliRunner

    said = CliRunner().invoke(app, ["reduce", str(tmp_path), "--out", str(tmp_path / "o.csv")])
    assert said.exit_code == 0 and "--reduce 'loss=STAT'" in said.stderr
    nothing = CliRunner().invoke(
        app, ["reduce", str(tmp_path), "--ranks", "5", "--out", str(tmp_path / "n.csv")]
    )
    assert (
        nothing.exit_code == 1 and "matches the filters" in nothing.stderr
    )  # a filter keeping nothing says so
    strict = CliRunner().invoke(app, ["reduce", str(tmp_path), "--strict", "--out", str(tmp_path / "s.csv")])
    assert strict.exit_code == 1 and "3 record(s) under 'mean' skipped" in strict.stderr


def test_nan_makes_a_statistic_nan_as_in_numpy(tmp_path):
    c = MetricCollector(tmp_path, rank=0)
    for v in (1.0, math.nan, 3.0):
        c.record("k", v, Reduce.MAX)
    c.shutdown()
    for stat in ("max", "min", "mean", "median", "p50", "std", "sum"):
        value = reduce_run(tmp_path, reduce=[f"k={stat}"])["value"][0]
        assert math.isnan(value), stat
    assert reduce_run(tmp_path, reduce=["k=count"])["value"][0] == 3.0
    assert reduce_run(tmp_path, reduce=["k=last"])["value"][0] == 3.0


def test_a_single_value_has_zero_std(tmp_path):
    c = MetricCollector(tmp_path, rank=0)
    c.record("k", 5.0, Reduce.STD)
    c.shutdown()
    assert reduce_run(tmp_path)["value"].to_list() == [0.0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"reduce": ["k=avg"]},
            "reduce='k=avg' names an unknown statistic 'avg': use one of mean, sum, max, min, std, "
            "count, median, first, last, pNN (NN from 0 to 100, e.g. p99, p99.9)",
        ),
        ({"reduce": ["k"]}, "reduce='k' is not PATTERN=STAT, e.g. 'trainer/*=p99'"),
        ({"ranks": "1-x"}, "ranks='1-x' is not a rank or a range like 2-5"),
        ({"ranks": "5-2"}, "ranks='5-2' is a range that runs backwards"),
        ({"steps": "200:100"}, "steps='200:100' has STOP at or before START: STOP is excluded"),
        ({"steps": "100"}, "steps='100' is not START:STOP, e.g. 100:200 (steps 100 to 199)"),
        ({"by": "time"}, "by='time' needs a window length, e.g. every='10s'"),
        ({"by": "time", "every": "ten"}, "every='ten' is not a duration like 10s, 500ms, 5m or 1h"),
        ({"every": 5.0}, "every=5.0 is a window length: group by time too (by='time')"),
        (
            {"mode": "global"},
            "mode='global' is not one of global_reduce, per_rank_reduce, per_rank_no_reduce",
        ),
    ],
)
def test_bad_plans_say_what_is_wrong_naming_the_parameter(kwargs, message):
    with pytest.raises(PlanError) as err:
        make_plan(**kwargs)
    assert str(err.value) == message


def test_glob_matching():
    cases = {
        "trainer/*": ["trainer/loss", "trainer/a/b"],
        "a?c": ["abc"],
        "[lr]oss": ["loss", "ross"],
        "x[!0-9]": ["xa"],
        "a.b": ["a.b"],
    }
    for pattern, hits in cases.items():
        for hit in hits:
            assert key_matcher([pattern])(hit), (pattern, hit)
    assert not key_matcher(["a.b"])("axb")
    assert not key_matcher(["x[!0-9]"])("x1")
    assert Statistic.parse("P99.9") == Statistic("p99.9", 99.9 / 100)  # as np.percentile divides it


def test_plan_reads_only_the_columns_a_mode_needs():
    assert make_plan().input_columns == ["key", "reduction", "step", "value"]
    assert "rank" in make_plan(ranks="0-3").input_columns
    assert {"process", "rank"} <= set(make_plan(mode="per_rank_reduce").input_columns)


def test_filters_that_match_nothing_are_no_data_naming_the_filter_and_what_the_run_holds(run):
    from metric_core.errors import NoDataError

    root, _ = run
    with pytest.raises(NoDataError) as err:
        _ = execute(make_plan(keys=["nothing/*"]), scan_run(root)).frame
    assert str(err.value) == (
        f"no record in {root} matches the filters: keys='nothing/*' matches no key; "
        "the run's keys: policy/latency_s, policy/tokens, trainer/grad_norm, trainer/loss"
    )
    with pytest.raises(NoDataError) as err:
        _ = execute(make_plan(keys=["trainer/*"], ranks="3", steps="20:"), scan_run(root)).frame
    assert str(err.value) == (  # each filter matches records, but not one record matches all
        f"no record in {root} matches the filters together: keys='trainer/*', ranks='3', steps='20:'"
    )
    with pytest.raises(NoDataError) as err:  # rank 9 matches nothing, but it is --steps that leaves none
        _ = execute(make_plan(keys=["trainer/*"], ranks="0,9", steps="100000:"), scan_run(root)).frame
    assert str(err.value) == (
        f"no record in {root} matches the filters together: keys='trainer/*', ranks='0,9', steps='100000:'; "
        "ranks='9' matches no record (no rank 9); the run's ranks: 0-3"
    )


def test_by_time_with_a_key_that_matches_nothing_names_the_key_and_not_the_ranks_kept(run):
    """--by time looks for its first record with a query of its own; when the keys match
    nothing, it names them, and ranks that matched are not said to match nothing."""
    root, _ = run
    with pytest.raises(FilteredOutError) as err:
        _ = run_plan(root, make_plan(by="time", every=3.0, keys=["trainer/los"], ranks="0")).frame
    said = str(err.value)
    assert "keys='trainer/los' matches no key" in said and "matches no record (no rank" not in said


def test_a_filter_or_pattern_that_matches_nothing_is_said_and_fatal_with_strict(run):
    from metric_core.errors import UnmatchedError

    root, _ = run
    plan = make_plan(keys=["trainer/*", "trainer/los"], reduce=["trainer/lss=p99"], ranks="0,9")
    result = run_plan(root, plan)
    frame = result.frame
    assert set(frame["key"]) == {"trainer/grad_norm", "trainer/loss"}
    assert [str(n) for n in result.unmatched] == [
        "ranks='9' matches no record (no rank 9); the run's ranks: 0-3",
        "keys='trainer/los' matches no key; the run's keys: policy/latency_s, policy/tokens, "
        "trainer/grad_norm, trainer/loss",
        "reduce='trainer/lss=p99' matches no key; the run's keys: policy/latency_s, policy/tokens, "
        "trainer/grad_norm, trainer/loss",
    ]
    with pytest.raises(UnmatchedError) as err:
        _ = run_plan(root, plan, strict=True).frame
    assert str(err.value).startswith("strict=True: ranks='9' matches no record (no rank 9); ")


def test_patterns_are_matched_against_every_key_though_only_some_are_held_to_name(run, monkeypatch):
    """Past SAMPLED_KEYS distinct keys, the keys held to name the nearest to a typo are the
    first few; a pattern that matches only a key never held is still matched."""
    from metric_core.offline import filters

    root, _ = run
    monkeypatch.setattr(filters, "SAMPLED_KEYS", 2)
    plan = make_plan(reduce=["trainer/lss=p99", "trainer/loss=max", "policy/tokens=min"])
    result = run_plan(root, plan)
    frame = result.frame
    assert set(frame.filter(pl.col("key") == "trainer/loss")["reduction"]) == {"max"}
    assert set(frame.filter(pl.col("key") == "policy/tokens")["reduction"]) == {"min"}
    (note,) = result.unmatched  # both other patterns matched, whichever two keys were held
    prefix = "reduce='trainer/lss=p99' matches no key; nearest of the first 2 of the run's keys: "
    assert str(note).startswith(prefix)
    named = str(note)[len(prefix) :].split(", ")
    assert 1 <= len(named) <= 2 and set(named) <= set(frame["key"])


def test_the_python_api_names_its_parameters_and_takes_one_string_where_a_list_fits(run):
    root, truth = run
    with pytest.raises(PlanError) as err:
        reduce_run(root, key=["trainer/*"])
    assert str(err.value) == (
        "reduce_run() takes no option 'key': did you mean 'keys'? it takes mode, by, every, reduce, keys, "
        "ranks, steps, attempts"
    )
    one = reduce_run(root, keys="trainer/loss", reduce="trainer/loss=max")
    listed = reduce_run(root, keys=["trainer/loss"], reduce=["trainer/loss=max"])
    assert one.equals(listed) and set(one["reduction"]) == {"max"}
    values = [r["value"] for r in truth if r["key"] == "trainer/loss" and r["step"] == 0]
    assert one.filter(pl.col("step") == 0)["value"].item() == np.max(values)


@pytest.mark.parametrize("first_step", [2**24 - 3, -4])
def test_large_and_negative_steps(tmp_path, first_step):
    """The writer's steps run from 0 (it refuses a negative one); another tool's may be negative."""
    truth = write_collector_run(tmp_path / "w", SOURCES_PARQUET, steps=6, first_step=abs(first_step))
    if first_step < 0:  # the same records, as another tool wrote them, 8 steps lower
        truth = [dict(r, step=r["step"] - 8) for r in truth]
        shutil.rmtree(tmp_path / "w")
        pl.DataFrame(truth).write_parquet(tmp_path / "other.parquet")
    check(execute(make_plan(), scan_run(tmp_path)).frame, expected(truth))
    per_rank = execute(make_plan(mode="per_rank_reduce"), scan_run(tmp_path)).frame
    check(per_rank, expected(truth, per_rank=True), per_rank=True)


def test_a_foreign_file_among_the_writers_files_is_grouped_by_key_strings(tmp_path):
    import polars as pl

    truth = write_collector_run(tmp_path, SOURCES_PARQUET, steps=4)
    foreign = [dict(r, rank=7, process="external") for r in truth if r["rank"] == 0]
    pl.DataFrame(foreign).write_parquet(tmp_path / "external.parquet")
    scan = scan_run(tmp_path)
    assert not all(scan.report.files[i].hashed for i in scan.file_ids)
    check(execute(make_plan(), scan).frame, expected(truth + foreign))


def test_a_key_recorded_two_ways_is_fine_when_the_filters_keep_one(tmp_path):
    a = MetricCollector(tmp_path, rank=0, process_name="TrainActor_r0")
    b = MetricCollector(tmp_path, rank=1, process_name="TrainActor_r1")
    a.record("loss", 1.0, Reduce.MEAN)
    a.record("loss", 3.0, Reduce.MEAN)
    b.record("loss", 2.0, Reduce.MAX)
    a.shutdown()
    b.shutdown()
    assert reduce_run(tmp_path, ranks="0").select("value", "reduction", "count").row(0) == (2.0, "mean", 2)


def test_a_sealed_file_rewritten_with_its_metadata_kept_is_reduced_as_it_now_reads(tmp_path):
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    write_collector_run(tmp_path, [("TrainActor_r0", 0)], steps=3)
    (path,) = tmp_path.glob("*.parquet")
    table = pq.read_table(path)  # keeps the writer's key-value metadata
    renamed = pc.replace_substring(table["key"].cast("string"), "trainer/loss", "trainer/renamed")
    pq.write_table(table.set_column(0, "key", renamed).drop_columns("key_hash"), path)
    counts = dict(reduce_run(tmp_path).group_by("key").agg(pl.col("count").sum()).iter_rows())
    rows = pq.read_table(path).to_pylist()
    assert "trainer/loss" not in counts
    assert counts == {key: sum(r["key"] == key for r in rows) for key in {r["key"] for r in rows}}


@pytest.mark.parametrize("pattern", ["[!]", "[a-", "[]", "[]]", "[!]]"])
def test_odd_key_patterns_match_as_fnmatch_does(tmp_path, pattern):
    import fnmatch

    from metriclog.main import app
    from typer.testing import CliRunner

    keys = ["[!]", "[a-", "[]", "]", "a", "!"]
    c = MetricCollector(tmp_path, process_name="p")
    for key in keys:
        c.record(key, 1.0)
    c.flush(0)
    c.shutdown()
    out = tmp_path / "out.csv"
    result = CliRunner().invoke(app, ["reduce", str(tmp_path), "--key", pattern, "--out", str(out)])
    expected = sorted(k for k in keys if fnmatch.fnmatchcase(k, pattern))
    assert "Traceback" not in result.output
    if expected:
        assert result.exit_code == 0, result.output
        assert sorted(pl.read_csv(out)["key"].to_list()) == expected
    else:
        assert result.exit_code == 1, result.output


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl", ".csv", ".json"])
def test_a_result_written_from_python_reads_back_and_is_never_read_as_data(tmp_path, suffix):
    """``metric_core.write_result`` writes what the command line's --out writes: the rows,
    marked as a result, so a later read of the run directory names it and leaves it out."""
    import metric_core

    write_collector_run(tmp_path, [("TrainActor_r0", 0), ("TrainActor_r1", 1)], steps=5)
    before = reduce_run(tmp_path)
    out = tmp_path / f"result{suffix}"
    assert metric_core.write_result(before, out, derived="my script") == before.height
    back = {
        ".parquet": pl.read_parquet,
        ".jsonl": pl.read_ndjson,
        ".csv": pl.read_csv,
        ".json": pl.read_json,
    }[suffix](out)
    assert back.select("step", "key", "count").rows() == before.select("step", "key", "count").rows()
    assert back["value"].to_list() == before["value"].to_list()
    scan = scan_run(tmp_path)
    if suffix in (".parquet", ".jsonl"):  # the files a reader would take for data
        assert f"result{suffix}: a result metriclog wrote (my script), not data" in "\n".join(
            scan.report.notices
        )
    assert reduce_run(tmp_path).equals(before)
    assert not list(tmp_path.glob(".*.partial"))
    with pytest.raises(PlanError, match=r"out='.*x.txt' must name a file ending in \.parquet"):
        metric_core.write_result(before, tmp_path / "x.txt", derived="my script")
    halves = [before.head(3), before.tail(before.height - 3)]  # frames of one schema, as a list
    assert (
        metric_core.write_result(halves, tmp_path.parent / f"halves{suffix}", derived="my script")
        == before.height
    )
    with pytest.raises(ValueError, match="no frame to write"):
        metric_core.write_result([], tmp_path.parent / f"none{suffix}", derived="my script")
    assert not (tmp_path.parent / f"none{suffix}").exists()


@pytest.mark.parametrize("ranks", [None, "0", "7"])
def test_counting_steps_back_takes_the_last_step_of_the_sources_kept_from_every_kind_of_file(tmp_path, ranks):
    """The writer's files say their last step; another tool's file is read for it: ``-2:``
    is the last two steps of the sources the ranks keep, whichever file holds them."""
    truth = write_collector_run(tmp_path, [("TrainActor_r0", 0)], steps=6)
    other = [  # rank 7 goes on to step 9, in a file no writer declared
        {"key": "loss", "value": float(s), "reduction": "mean", "step": s, "timestamp": 1.7e9 + s, "rank": 7}
        for s in range(10)
    ]
    pl.DataFrame(other).write_parquet(tmp_path / "other.parquet")
    every = [(r["rank"], r["step"]) for r in truth] + [(7, s) for s in range(10)]
    kept = [step for rank, step in every if ranks is None or rank == int(ranks)]
    last = max(kept)
    df = reduce_run(tmp_path, mode="per_rank_no_reduce", steps="-2:", **({"ranks": ranks} if ranks else {}))
    assert sorted(set(df["step"].to_list())) == [last - 1, last]
    assert df.height == sum(1 for step in kept if step >= last - 1)


@pytest.mark.parametrize("held_keys", [2, 1 << 20])
def test_keys_met_set_aside_on_disk_decide_a_later_sources_mixed_key_as_if_held(
    tmp_path, monkeypatch, held_keys
):
    """per_rank_reduce of sources each in files of their own is reduced a source at a time,
    and remembers each key's reduction for the sources after: past HELD_KEYS, the keys met go
    to a temporary directory (removed at the end) and are read back only when a later frame
    meets one of them again. A key a later source recorded under another reduction keeps
    the first one, its other records skipped and counted, as when every key is held."""
    import tempfile

    import pyarrow as pa
    import pyarrow.parquet as pq

    from metric_core.offline.engine import reductions

    monkeypatch.setattr(reductions, "HELD_KEYS", held_keys)
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    rng = np.random.default_rng(9)
    run = tmp_path / "run"
    run.mkdir()
    truth: dict[tuple[int, int, str], list[float]] = defaultdict(list)
    reduction_of = {}
    for rank in range(3):
        keys = [f"u/r{rank}/k{i}" for i in range(6)] + (["shared"] if rank != 1 else [])
        rows: dict[str, list] = {c: [] for c in ("key", "value", "reduction", "step", "timestamp", "rank")}
        for step in range(3):
            for i, key in enumerate(keys):
                for _ in range(2):
                    red = ("max" if rank == 2 else "mean") if key == "shared" else ["mean", "max"][i % 2]
                    value = float(rng.normal())
                    rows["key"].append(key)
                    rows["value"].append(value)
                    rows["reduction"].append(red)
                    rows["step"].append(step)
                    rows["timestamp"].append(1.76e9 + step + rank * 0.1)
                    rows["rank"].append(rank)
                    if key != "shared" or rank == 0:  # rank 2's 'shared' records are skipped
                        truth[(rank, step, key)].append(value)
                        reduction_of[key] = red
        pq.write_table(pa.table(rows), run / f"rank{rank}.parquet")
    result = run_plan(run, make_plan(mode="per_rank_reduce"))
    frame = result.frame
    assert not any(temp.iterdir())
    got = {
        (r, s, k): (v, red, n)
        for r, s, k, v, red, n in frame.select(
            "rank", "step", "key", "value", "reduction", "count"
        ).iter_rows()
    }
    want = {}
    for (rank, step, key), values in truth.items():
        red = reduction_of[key]
        want[(rank, step, key)] = (
            float(np.mean(values) if red == "mean" else np.max(values)),
            red,
            len(values),
        )
    assert got.keys() == want.keys()
    for k, (v, red, n) in want.items():
        assert got[k][1:] == (red, n)
        assert got[k][0] == pytest.approx(v, rel=1e-12, abs=1e-15)
    mixed = result.scan.report.mixed["shared"]
    assert (mixed.kept, mixed.skipped) == ("mean", {"max": 6})


@pytest.mark.parametrize("mode", ["global_reduce", "per_rank_reduce"])
def test_counts_are_a_float_value_column_as_every_other_statistic(tmp_path, mode):
    # Soak seed 894035802: a source whose every key reduced to a count came out as a frame of
    # int64 values, and the Parquet writer refused it beside the other sources' float64 frames.
    from metriclog.main import app
    from typer.testing import CliRunner

    run, out = tmp_path / "run", tmp_path / "out.parquet"
    values = {0: [1.0, 2.0, 4.0], 1: [3.0, 5.0]}
    for rank, keys in ((0, ["a", "q/x"]), (1, ["a"])):
        c = MetricCollector(run, rank=rank)
        for step in range(3):
            for key in keys:
                for v in values[rank]:
                    c.record(key, v, Reduce.MEAN)
            c.flush(step)
        c.shutdown()
    args = [
        "reduce",
        str(run),
        "--mode",
        mode,
        "--reduce",
        "*=count",
        "--reduce",
        "q/*=p50",
        "--out",
        str(out),
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    table = pl.read_parquet(out)
    assert table.schema["value"] == pl.Float64
    counts = table.filter(pl.col("key") == "a").sort("step", *(["rank"] if mode == "per_rank_reduce" else []))
    if mode == "global_reduce":
        assert counts["value"].to_list() == [5.0] * 3
    else:
        assert counts["value"].to_list() == [3.0, 2.0] * 3
    assert table.filter(pl.col("key") == "q/x")["value"].to_list() == [float(np.median(values[0]))] * 3
    only_counts = reduce_run(run, mode=mode, reduce=["*=count"])
    assert only_counts.schema["value"] == pl.Float64


def _frames(n: int, rows: int, seed: int = 0):
    """``n`` frames of a result's shape, ``rows`` rows each, of random values."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        yield pl.DataFrame(
            {
                "step": np.arange(i * rows, (i + 1) * rows, dtype=np.int64),
                "key": [f"loss/{k}" for k in rng.integers(0, 1000, rows)],
                "value": rng.normal(size=rows),
            }
        )


def test_a_parquet_result_is_written_in_order_beside_the_next_frame_and_a_failure_leaves_nothing(tmp_path):
    """A stream of frames is written in order (a thread writes one frame while the next is
    made); a stream that fails part way, or a disk that runs full, raises, and leaves no
    result and no half-written file."""
    import metric_core
    from tests.test_faults import small_disk

    out = tmp_path / "result.parquet"
    assert metric_core.write_result(_frames(9, 5_000), out, derived="test") == 45_000
    assert pl.read_parquet(out).equals(pl.concat(_frames(9, 5_000)))

    def failing():
        yield from _frames(3, 5_000)
        raise RuntimeError("the engine failed")

    with pytest.raises(RuntimeError, match="the engine failed"):
        metric_core.write_result(failing(), tmp_path / "failed.parquet", derived="test")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.parquet"]
    with small_disk(tmp_path / "small", "1m") as disk:
        with pytest.raises(OSError):
            metric_core.write_result(_frames(40, 20_000, seed=1), disk / "big.parquet", derived="test")
        assert list(disk.iterdir()) == []
