"""metriclog diff: where two runs differ, against each run's own reduce outputs."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
from metriclog.main import app
from typer.testing import CliRunner

from metric_core import Reduce
from metric_core.offline.diff import diff_runs
from metric_core.offline.engine import reduce_run

from .test_compare import BASE_TIME, write_job, write_timed

runner = CliRunner()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A job, its copy, and the same job with one value of ``loss`` changed at step 37."""
    root = tmp_path_factory.mktemp("diff")
    write_job(root / "run", seed=3, lr=0.1, steps=45)
    shutil.copytree(root / "run", root / "copy")
    write_job(root / "changed", seed=3, lr=0.1, steps=45, change=(37, "loss", 1e-9))
    return root


def test_a_run_and_its_copy_are_equal(job):
    result = runner.invoke(app, ["diff", str(job / "run"), str(job / "copy")])
    assert result.exit_code == 0, result.output
    assert (
        result.stdout.splitlines()[-1]
        == "equal, bit for bit (NaN equals NaN; -0.0 differs from 0.0): 4 key(s)"
    )


def test_one_value_changed_at_step_37_is_named_with_its_key(job):
    result = runner.invoke(app, ["diff", str(job / "run"), str(job / "changed"), "--format", "json"])
    assert result.exit_code == 5, result.output
    report = json.loads(result.stdout)
    assert report["equal"] is False
    assert [(d["key"], d["first"], d["differing"]) for d in report["differences"]] == [("loss", 37, 1)]
    a = reduce_run(job / "run", keys=["loss"], steps="37:38")["value"][0]
    b = reduce_run(job / "changed", keys=["loss"], steps="37:38")["value"][0]
    assert (report["differences"][0]["first_a"], report["differences"][0]["first_b"]) == (a, b)
    assert report["differences"][0]["largest"] == abs(a - b)
    table = runner.invoke(app, ["diff", str(job / "run"), str(job / "changed")])
    assert table.exit_code == 5
    assert "the runs differ, bit for bit" in table.stdout and " loss " in table.stdout
    within = runner.invoke(app, ["diff", str(job / "run"), str(job / "changed"), "--rtol", "1e-6"])
    assert within.exit_code == 0, within.output
    per_rank = diff_runs(job / "run", job / "changed", mode="per_rank_reduce")
    assert [(d.process, d.key, d.first) for d in per_rank.differences] == [("trainer_r0", "loss", 37)]


def test_nan_equals_nan_and_signed_zeros_differ_only_bit_for_bit(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_timed(a, {0: math.nan, 1: 0.0, 2: 1.0}, start=BASE_TIME, reduction=Reduce.MAX)
    write_timed(b, {0: math.nan, 1: -0.0, 2: 1.0}, start=BASE_TIME, reduction=Reduce.MAX)
    assert math.copysign(1, reduce_run(b)["value"][1]) == -1  # the reduction keeps the sign
    bits = diff_runs(a, b)
    assert not bits.equal
    assert [(d.first, d.first_a, d.first_b, d.largest) for d in bits.differences] == [(1, 0.0, -0.0, 0.0)]
    assert diff_runs(a, b, atol=0.0).equal
    cli = runner.invoke(app, ["diff", str(a), str(b), "--atol", "0"])
    assert cli.exit_code == 0
    assert cli.stdout.splitlines()[-1] == "equal, within --rtol 0 --atol 0: 1 key(s)"


def test_keys_and_steps_only_in_one_run(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_timed(a, {s: float(s) for s in range(6)}, start=BASE_TIME)
    write_timed(a, {0: 1.0}, start=BASE_TIME, key="only_a", rank=1)
    write_timed(b, {s: float(s) for s in range(2, 8)}, start=BASE_TIME)
    report = diff_runs(a, b)
    assert report.keys_only_in_a == ["only_a"] and report.keys_only_in_b == []
    (x,) = report.differences
    assert (x.key, x.differing, x.only_in_a, x.only_in_b) == ("x", 0, [0, 1], [6, 7])
    out = json.loads(runner.invoke(app, ["diff", str(a), str(b), "--format", "json"]).stdout)
    assert out["keys_only_in_a"] == ["only_a"] and out["differences"][0]["only_in_b"] == [6, 7]


@pytest.mark.parametrize("seed", range(8))
def test_random_perturbations_against_an_oracle(tmp_path, seed):
    """A random run and a copy with random changes (a last bit, a NaN, a sign of zero, a step
    dropped, a key added), both reduced by reduce_run; the oracle walks the two reductions."""
    rng = np.random.default_rng(seed)
    keys = ["k0", "k1", "k2"]
    base = {(k, s): float(rng.normal() * 10.0 ** int(rng.integers(-5, 5))) for k in keys for s in range(20)}
    changed = dict(base)
    for _ in range(int(rng.integers(0, 4))):
        cell = list(base)[int(rng.integers(len(base)))]
        how = int(rng.integers(0, 4))
        if how == 0:
            changed[cell] = float(np.nextafter(changed[cell], np.inf))
        elif how == 1:
            changed[cell] = math.nan
        elif how == 2:
            changed[cell] = changed[cell] * (1 + 1e-12)
        else:
            del changed[cell]
    a, b = tmp_path / "a", tmp_path / "b"
    for run, values in ((a, base), (b, changed)):
        for rank, k in enumerate(keys):
            write_timed(
                run, {s: v for (kk, s), v in values.items() if kk == k}, start=BASE_TIME, key=k, rank=rank
            )
    rtol = [None, 1e-9][seed % 2]
    ra = {(r["key"], r["step"]): r["value"] for r in reduce_run(a).iter_rows(named=True)}
    rb = {(r["key"], r["step"]): r["value"] for r in reduce_run(b).iter_rows(named=True)}

    def equal(x, y):
        if math.isnan(x) or math.isnan(y):
            return math.isnan(x) and math.isnan(y)
        if rtol is None:
            return np.float64(x).tobytes() == np.float64(y).tobytes()
        return math.isclose(x, y, rel_tol=rtol)

    want = {}
    for k in keys:
        differing = sorted(
            s for (kk, s) in ra if kk == k and (k, s) in rb and not equal(ra[(k, s)], rb[(k, s)])
        )
        only_a = sorted(s for (kk, s) in ra if kk == k and (k, s) not in rb)
        if differing or only_a:
            want[k] = (differing[0] if differing else None, len(differing), only_a)
    report = diff_runs(a, b, rtol=rtol)
    assert {d.key: (d.first, d.differing, d.only_in_a) for d in report.differences} == want
    assert report.equal is (not want)
    code = runner.invoke(app, ["diff", str(a), str(b), *(["--rtol", str(rtol)] if rtol else [])]).exit_code
    assert code == (0 if not want else 5)


def test_a_key_reduced_otherwise_and_windows_from_each_runs_start(tmp_path):
    a, b, later = tmp_path / "a", tmp_path / "b", tmp_path / "later"
    write_timed(a, {0: 1.0, 1: 2.0}, start=BASE_TIME)
    write_timed(b, {0: 1.0, 1: 2.0}, start=BASE_TIME, reduction=Reduce.MAX)
    (x,) = diff_runs(a, b).differences
    assert (x.key, x.differing, x.reductions) == ("x", 0, ("mean", "max"))
    write_timed(later, {0: 1.0, 1: 2.0}, start=BASE_TIME + 5000.5)
    assert diff_runs(a, later, by="time", every="1s").equal  # windows 0.0 and 1.0 s from each start
    write_timed(tmp_path / "other", {0: 1.0, 1: 2.5}, start=BASE_TIME + 7000.25)
    (w,) = diff_runs(a, tmp_path / "other", by="time", every="1s").differences
    assert (w.first, w.first_a, w.first_b, w.largest) == (1.0, 2.0, 2.5, 0.5)
