"""Accumulators and reduce_metrics_states against numpy over the raw values."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metric_core import LoggingMode, Metric, Reduce, reduce_metrics_states
from metric_core.metric import MeanAccumulator

NUMPY = {
    Reduce.MEAN: np.mean,
    Reduce.SUM: np.sum,
    Reduce.MAX: np.max,
    Reduce.MIN: np.min,
    Reduce.STD: np.std,  # ddof=0
}


def test_names_follow_the_seed():
    assert [m.value for m in LoggingMode] == ["global_reduce", "per_rank_reduce", "per_rank_no_reduce"]
    # The seed's five reductions of numbers, and torchforge's later SAMPLE (whole dicts)
    assert {r.value for r in Reduce} == {"mean", "sum", "max", "min", "std", "sample"}
    assert Reduce.MEAN.accumulator_class is MeanAccumulator
    m = Metric("loss", 1.0, Reduce.MEAN)
    assert m.timestamp > 1.6e9
    assert m.step is None


@pytest.mark.parametrize("reduction", list(NUMPY))
def test_states_merged_across_ranks_equal_numpy_over_all_values(reduction):
    rng = np.random.default_rng(1)
    ranks = [rng.normal(3.0, 2.0, size=n) for n in (1, 7, 50, 3)]
    states = []
    for values in ranks:
        acc = reduction.accumulator_class(reduction)
        for v in values[: len(values) // 2]:
            acc.append(float(v))
        acc.append_many(values[len(values) // 2 :])
        states.append({"k": acc.get_state()})
    (metric,) = reduce_metrics_states(states)
    truth = NUMPY[reduction](np.concatenate(ranks))
    assert metric.key == "k"
    assert metric.reduction is reduction
    assert metric.value == pytest.approx(truth, rel=1e-12)


def test_std_is_stable_where_the_seeds_formula_is_not():
    rng = np.random.default_rng(0)
    values = 1e8 + rng.normal(0.0, 1.0, size=10_000)
    truth = float(np.std(values))
    naive = math.sqrt(max(float(np.mean(values**2) - np.mean(values) ** 2), 0.0))
    assert abs(naive - truth) > 0.1  # the seed's sqrt(E[x^2] - E[x]^2) is far off
    states = []
    for part in np.array_split(values, 8):
        acc = Reduce.STD.accumulator_class(Reduce.STD)
        for v in part:
            acc.append(float(v))
        states.append({"lat": acc.get_state()})
    (metric,) = reduce_metrics_states(states)
    assert metric.value == pytest.approx(truth, rel=1e-6)


def test_single_value_std_is_zero_and_nan_propagates_through_max():
    acc = Reduce.STD.accumulator_class(Reduce.STD)
    acc.append(5.0)
    assert acc.get_value() == 0.0
    mx = Reduce.MAX.accumulator_class(Reduce.MAX)
    mx.append_many(np.array([1.0, math.nan, 3.0]))
    assert math.isnan(mx.get_value())


def test_mixed_reduction_states_are_refused():
    a = Reduce.MEAN.accumulator_class(Reduce.MEAN)
    b = Reduce.SUM.accumulator_class(Reduce.SUM)
    a.append(1.0)
    b.append(1.0)
    with pytest.raises(ValueError, match="Mismatched reduction types for key 'k'"):
        reduce_metrics_states([{"k": a.get_state()}, {"k": b.get_state()}])


@settings(max_examples=60, deadline=None)
@given(
    parts=st.lists(
        st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=20), min_size=1, max_size=6
    ),
    reduction=st.sampled_from(list(NUMPY)),
)
def test_reducing_per_rank_then_merging_equals_reducing_all_values(parts, reduction):
    states = []
    for part in parts:
        acc = reduction.accumulator_class(reduction)
        acc.append_many(np.asarray(part))
        states.append({"k": acc.get_state()})
    (metric,) = reduce_metrics_states(states)
    truth = float(NUMPY[reduction](np.concatenate([np.asarray(p) for p in parts])))
    assert metric.value == pytest.approx(truth, rel=1e-9, abs=1e-6)
