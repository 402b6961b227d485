"""The data model: Reduce, Metric, LoggingMode and the mergeable accumulators.

Names follow torchforge's observability module ('Metric Logging updates 5/N'). Two
things differ from it on purpose:

* ``StdAccumulator`` keeps (count, mean, M2) and merges with Chan et al.'s parallel
  formula. torchforge's sqrt(E[x^2] - E[x]^2) cancels catastrophically: for values
  1e8 + N(0, 1) it returns 1.41 where the true std is ~1.
* An accumulator that saw no value gives NaN (torchforge: 0.0 for the mean and the std,
  -inf/inf for max/min): a step without values has no mean, and 0.0 would plot as one.
* Accumulators also take whole numpy arrays (``append_many``), so the collector can
  reduce a drained batch without a Python loop per value.

States use torchforge's names (``sum``/``count``; ``total``; ``max_val``; ``min_val``;
``sum``/``sum_sq``/``count``), with what is needed beyond them (a ``count`` for sum, max
and min, ``mean``/``m2`` for std), so ``reduce_metrics_states`` merges torchforge's
states and these alike (docs/compat.md).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np


class LoggingMode(Enum):
    """How a backend receives metrics (and how ``metriclog`` reduces them offline)."""

    GLOBAL_REDUCE = "global_reduce"
    PER_RANK_REDUCE = "per_rank_reduce"
    PER_RANK_NO_REDUCE = "per_rank_no_reduce"


class BackendRole(Enum):
    """LOCAL backends live in a rank; GLOBAL ones in a controller that merges states."""

    LOCAL = "local"
    GLOBAL = "global"


class Reduce(str, Enum):
    """How the values of one key are reduced within a step.

    The members are strings ("mean", ...), which is what the raw record stores.
    """

    MEAN = "mean"
    SUM = "sum"
    MAX = "max"
    MIN = "min"
    STD = "std"
    # Not a reduction of numbers: ``record_metric(key, sample_dict, Reduce.SAMPLE)`` keeps the
    # whole dict, in files of their own (``metriclog samples``; docs/format.md).
    SAMPLE = "sample"

    @property
    def accumulator_class(self) -> type[MetricAccumulator]:
        return _ACCUMULATORS[self]

    def __str__(self) -> str:
        return self.value


@dataclass
class Metric:
    """One observation of one metric.

    ``step``, ``rank`` and ``process`` are filled in by the collector when the metric
    is written; a reduced Metric carries the step it was reduced for.
    """

    key: str
    value: Any  # a number; a list of sample dicts for a reduced Reduce.SAMPLE
    reduction: Reduce = Reduce.MEAN
    timestamp: float = field(default_factory=time.time)
    step: int | None = None
    rank: int | None = None
    process: str | None = None


class MetricAccumulator:
    """Accumulates the values of one key; its state merges with other ranks' states."""

    def __init__(self, reduction: Reduce) -> None:
        self.reduction = reduction
        self.reset()

    @property
    def reduction_type(self) -> Reduce:
        """torchforge's name of ``reduction``."""
        return self.reduction

    def reset(self) -> None:
        raise NotImplementedError

    def append(self, value: float) -> None:
        import numpy as np

        self.append_many(np.asarray([value], dtype=np.float64))

    def append_many(self, values: np.ndarray) -> None:
        raise NotImplementedError

    def get_value(self) -> float:
        return self.get_reduced_value_from_states([self.get_state()])

    def get_state(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def get_reduced_value_from_states(cls, states: Sequence[dict[str, Any]]) -> float:
        raise NotImplementedError


class MeanAccumulator(MetricAccumulator):
    def reset(self) -> None:
        self.sum = 0.0
        self.count = 0

    def append_many(self, values: np.ndarray) -> None:
        self.sum += float(values.sum())
        self.count += len(values)

    def get_state(self) -> dict[str, Any]:
        return {"reduction_type": self.reduction.value, "sum": self.sum, "count": self.count}

    @classmethod
    def get_reduced_value_from_states(cls, states: Sequence[dict[str, Any]]) -> float:
        count = sum(s["count"] for s in states)
        return sum(s["sum"] for s in states) / count if count else math.nan


class SumAccumulator(MeanAccumulator):
    """The mean's sum and count; the state names the sum ``total``, as torchforge's does."""

    def get_state(self) -> dict[str, Any]:
        return {"reduction_type": self.reduction.value, "total": self.sum, "count": self.count}

    @classmethod
    def get_reduced_value_from_states(cls, states: Sequence[dict[str, Any]]) -> float:
        return float(sum(s["total"] for s in states))


class _ExtremumAccumulator(MetricAccumulator):
    _array_method = "max"  # or "min": the name of the numpy method and of the builtin
    _field = "max_val"  # the state's name of the value, torchforge's

    def reset(self) -> None:
        self.value: float | None = None
        self.count = 0

    def append_many(self, values: np.ndarray) -> None:
        if len(values) == 0:
            return
        # NaN propagates, as in numpy and in the offline reduction.
        batch = float(getattr(values, self._array_method)())
        if self.value is None or math.isnan(batch):
            self.value = batch
        elif not math.isnan(self.value):
            self.value = _EXTREMA[self._array_method]([self.value, batch])
        self.count += len(values)

    def get_state(self) -> dict[str, Any]:
        # An empty state holds torchforge's identity (-inf for max), and count 0 says it is empty.
        empty = -math.inf if self._array_method == "max" else math.inf
        value = empty if self.value is None else self.value
        return {"reduction_type": self.reduction.value, self._field: value, "count": self.count}

    @classmethod
    def get_reduced_value_from_states(cls, states: Sequence[dict[str, Any]]) -> float:
        # torchforge's states carry no count: theirs are never taken for empty.
        values = [s[cls._field] for s in states if s.get("count", 1) > 0]
        if not values:
            return math.nan
        if any(math.isnan(v) for v in values):
            return math.nan
        return float(_EXTREMA[cls._array_method](values))


class MaxAccumulator(_ExtremumAccumulator):
    _array_method = "max"


class MinAccumulator(_ExtremumAccumulator):
    _array_method = "min"
    _field = "min_val"


_EXTREMA = {"max": max, "min": min}


class StdAccumulator(MetricAccumulator):
    """Population std (ddof=0) from (count, mean, M2), merged with Chan's formula.

    The state also carries torchforge's ``sum`` and ``sum_sq``, so torchforge's code can
    merge it; states that have only those (torchforge's own) are merged from them.
    """

    def reset(self) -> None:
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0
        self.sum = 0.0
        self.sum_sq = 0.0

    def append_many(self, values: np.ndarray) -> None:
        if len(values) == 0:
            return
        n_b = len(values)
        mean_b = float(values.mean())
        m2_b = float(((values - mean_b) ** 2).sum())
        self.count, self.mean, self.m2 = _merge_moments((self.count, self.mean, self.m2), (n_b, mean_b, m2_b))
        self.sum += float(values.sum())
        self.sum_sq += float((values * values).sum())

    def get_state(self) -> dict[str, Any]:
        return {
            "reduction_type": self.reduction.value,
            "count": self.count,
            "mean": self.mean,
            "m2": self.m2,
            "sum": self.sum,
            "sum_sq": self.sum_sq,
        }

    @classmethod
    def get_reduced_value_from_states(cls, states: Sequence[dict[str, Any]]) -> float:
        acc: tuple[int, float, float] = (0, 0.0, 0.0)
        for s in states:
            acc = _merge_moments(acc, _moments(s))
        count, _, m2 = acc
        if count == 0:
            return math.nan
        return math.sqrt(max(m2, 0.0) / count)


class SampleAccumulator(MetricAccumulator):
    """A step's samples of one key, as torchforge keeps them: the ``top_k`` and ``bottom_k``
    by the field ``key`` (``reward``; a sample without it counts as 0.0). Only for live
    display: every sample is on disk whatever this keeps (``metriclog samples``)."""

    def __init__(self, reduction: Reduce, top_k: int = 1, bottom_k: int = 1, key: str = "reward") -> None:
        self.top_k, self.bottom_k, self.key = top_k, bottom_k, key
        super().__init__(reduction)

    def reset(self) -> None:
        self._top: list[tuple[float, int, dict[str, Any]]] = []  # a min-heap of the largest
        self._bottom: list[tuple[float, int, dict[str, Any]]] = []  # a min-heap of the negated smallest
        self._seen = 0

    def append(self, value: Any) -> None:
        if not isinstance(value, dict):
            raise ValueError(f"Expected dict, got {type(value)}")
        import heapq

        score = _score(value.get(self.key, 0.0))
        self._seen += 1
        for heap, k, sign in ((self._top, self.top_k, 1.0), (self._bottom, self.bottom_k, -1.0)):
            if k <= 0:
                continue
            item = (sign * score, self._seen, value)
            if len(heap) < k:
                heapq.heappush(heap, item)
            else:
                heapq.heappushpop(heap, item)

    def append_many(self, values: Any) -> None:
        for value in values:
            self.append(value)

    def get_value(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The bottom ones, then the top ones (torchforge's order), each sample once."""
        bottom = [s for _, _, s in sorted(self._bottom, key=lambda t: (-t[0], t[1]))]
        top = [s for _, _, s in sorted(self._top)]
        return bottom + [s for s in top if not any(s is b for b in bottom)]

    def get_state(self) -> dict[str, Any]:
        return {"reduction_type": self.reduction.value, "samples": self.get_value()}

    @classmethod
    def get_reduced_value_from_states(cls, states: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:  # type: ignore[override]
        return [sample for s in states for sample in s.get("samples", [])]


def _score(value: Any) -> float:
    try:
        score = float(value)
    except (TypeError, ValueError):
        return 0.0
    return 0.0 if math.isnan(score) else score


def _moments(state: dict[str, Any]) -> tuple[int, float, float]:
    """(count, mean, M2) of a std state: ours, or torchforge's (sum, sum_sq, count)."""
    count = state["count"]
    if "m2" in state:
        return count, state["mean"], state["m2"]
    if count == 0:
        return 0, 0.0, 0.0
    mean = state["sum"] / count
    return count, mean, max(state["sum_sq"] - state["sum"] * mean, 0.0)


def _merge_moments(a: tuple[int, float, float], b: tuple[int, float, float]) -> tuple[int, float, float]:
    n_a, mean_a, m2_a = a
    n_b, mean_b, m2_b = b
    if n_a == 0:
        return n_b, mean_b, m2_b
    if n_b == 0:
        return n_a, mean_a, m2_a
    n = n_a + n_b
    delta = mean_b - mean_a
    return n, mean_a + delta * n_b / n, m2_a + m2_b + delta * delta * n_a * n_b / n


_ACCUMULATORS: dict[Reduce, type[MetricAccumulator]] = {
    Reduce.MEAN: MeanAccumulator,
    Reduce.SUM: SumAccumulator,
    Reduce.MAX: MaxAccumulator,
    Reduce.MIN: MinAccumulator,
    Reduce.STD: StdAccumulator,
    Reduce.SAMPLE: SampleAccumulator,
}


def reduce_metrics_states(states: Iterable[dict[str, dict[str, Any]]]) -> list[Metric]:
    """Merge per-rank accumulator states ({key: state}) into one reduced Metric per key:
    torchforge's states and ours alike. Raises ``ValueError`` for a key whose states name
    different reductions.

    This is what a live GLOBAL_REDUCE controller does with the states each rank
    returns from ``MetricCollector.flush(step, return_state=True)``.

    >>> a = MeanAccumulator(Reduce.MEAN); a.append(1.0); a.append(2.0)
    >>> b = MeanAccumulator(Reduce.MEAN); b.append(6.0)
    >>> reduce_metrics_states([{"loss": a.get_state()}, {"loss": b.get_state()}])[0].value
    3.0
    """
    by_key: dict[str, list[dict[str, Any]]] = {}
    for rank_states in states:
        for key, state in rank_states.items():
            by_key.setdefault(key, []).append(state)
    metrics = []
    for key, key_states in by_key.items():
        first = key_states[0]["reduction_type"]
        other = next((s["reduction_type"] for s in key_states if s["reduction_type"] != first), None)
        if other is not None:  # torchforge's words, which its users' code may match
            raise ValueError(f"Mismatched reduction types for key '{key}': {first} vs {other}")
        reduction = Reduce(first)
        value = reduction.accumulator_class.get_reduced_value_from_states(key_states)
        metrics.append(Metric(key=key, value=value, reduction=reduction))
    return metrics
