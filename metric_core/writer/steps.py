"""Per-step reduction on the writer side: the values since the last ``flush(step)``, per key.

Only needed when a PER_RANK_REDUCE backend runs or ``flush(return_state=True)`` is asked
for; otherwise the collector drops what it hands over. Raw values are kept as the drained
chunks of the collector's buffer and folded into accumulators (numpy, one pass per key)
at the step's end, or earlier once ``MAX_PENDING`` of them wait, so memory stays bounded
when a script records for a long time without a flush.
"""

from __future__ import annotations

import array
from typing import Any

import numpy as np

from metric_core.metric import Metric, MetricAccumulator, Reduce

MAX_PENDING = 1_000_000


class StepReducer:
    """Accumulators per key code for the current step; ``code_table[code]`` is (key, reduction)."""

    def __init__(self, code_table: list[tuple[str, str]], *, rank: int, process: str) -> None:
        self.code_table = code_table
        self.rank = rank
        self.process = process
        self._pending: list[array.array[float]] = []
        self._pending_rows = 0
        self._accumulators: dict[int, MetricAccumulator] = {}

    def add(self, chunk: array.array[float]) -> None:
        """Keep a drained chunk: (value, code, timestamp) triples."""
        self._pending.append(chunk)
        self._pending_rows += len(chunk) // 3
        if self._pending_rows > MAX_PENDING:
            self._fold()

    def discard(self) -> None:
        """Forget the step's values (nobody asks for its reduction)."""
        self._pending.clear()
        self._pending_rows = 0

    @property
    def folding(self) -> bool:
        """Whether values were folded already (then the step must be ended with ``end``)."""
        return bool(self._accumulators)

    def end(self, step: int) -> tuple[list[Metric], dict[str, dict[str, Any]]]:
        """The step's reduced metrics and accumulator states; the next step starts empty."""
        self._fold()
        accs, self._accumulators = self._accumulators, {}
        metrics, states = [], {}
        for code, acc in sorted(accs.items()):
            key = self.code_table[code][0]
            metrics.append(
                Metric(
                    key=key,
                    value=acc.get_value(),
                    reduction=acc.reduction,
                    step=step,
                    rank=self.rank,
                    process=self.process,
                )
            )
            states[key] = acc.get_state()
        return metrics, states

    def _fold(self) -> None:
        if not self._pending:
            return
        rows = np.frombuffer(b"".join(c.tobytes() for c in self._pending), dtype=np.float64).reshape(-1, 3)
        self.discard()
        codes = rows[:, 1].astype(np.int64)
        order = np.argsort(codes, kind="stable")
        codes, values = codes[order], rows[order, 0]
        starts = np.flatnonzero(np.r_[True, codes[1:] != codes[:-1]])
        ends = np.r_[starts[1:], len(codes)]
        for s, e in zip(starts, ends, strict=True):
            code = int(codes[s])
            acc = self._accumulators.get(code)
            if acc is None:
                red = Reduce(self.code_table[code][1])
                acc = self._accumulators[code] = red.accumulator_class(red)
            acc.append_many(values[s:e])
