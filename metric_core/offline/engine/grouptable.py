"""Records added straight into their groups, across partitions: the compiled path's table.

In ``global_reduce`` a group (step and key) takes records of every source, and in a run
of several files each source's come in partitions of their own (a file a rank, each key
once a step: another tool's files, or the writer's): a partition's states are then about
as many as its records, and folding them into the accumulator costs more than the records
did. There (not in one file of every source's records side by side, whose partitions'
states already hold several records a group; rows_50M of bench_memory.py was 20% slower
through the table), on the compiled path (``exact.path()``), the records of groups whose
statistic is ``sum``, ``mean``, ``std``, ``min``, ``max`` or ``count`` are handed over as
they are (``partials.Rows``), and the accumulator adds them into a ``GroupTable``: one C
hash table of (bucket, combo) groups, each with its count, min, max and exact sums in
int64 digits (``_exact.Table``). In global_reduce's batches taken as read, so are those of
medians and pNN, counted alone (their values are kept beside: ``Partial.values_by_row``).
Taking the groups out (``drain``) gives them in the form of a partition's states
(``partials.FIELDS`` up to max, ``exact.ExactState``), which the accumulator folds in as
it folds any partition's. The same integers, the same min and max, so the same bits as the
states' path (the numpy one is the reference: the tests run both).
"""

from __future__ import annotations

import math

import numpy as np

from metric_core.offline.engine import exact
from metric_core.offline.engine.exact import Digits, ExactState
from metric_core.offline.engine.partials import KEEP_COUNT, MAX, MIN, UNTIMED, N, Rows

_FIRST, _LAST = int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)


def available() -> bool:
    """Whether records may be handed over as rows (the compiled extension, with its table)."""
    return exact._native is not None and hasattr(exact._native, "Table")


class GroupTable:
    """Groups (bucket, combo) and what their records add up to, until drained."""

    def __init__(self) -> None:
        assert exact._native is not None
        self._table = exact._native.Table()
        # whether some combo added keeps more than a count (else its groups drain as counts)
        self._more = False

    def __len__(self) -> int:
        return len(self._table)

    def add(self, rows: Rows, combo_of: np.ndarray) -> None:
        """``rows``' records into their groups, their combos numbered by ``combo_of`` (one
        number, and one of ``rows.squares``, for each of the partition's labels)."""
        self._more = self._more or bool((np.asarray(rows.squares) != KEEP_COUNT).any())
        self._table.add(
            np.ascontiguousarray(rows.bucket, dtype=np.int64),
            np.ascontiguousarray(rows.combo, dtype=np.int64),
            np.ascontiguousarray(rows.value, dtype=np.float64),
            np.ascontiguousarray(combo_of, dtype=np.int64),
            np.ascontiguousarray(rows.squares, dtype=np.uint8),
        )

    def below(self, upto: float) -> int:
        """The groups of the buckets below ``upto``."""
        return int(self._table.below(*_bound(upto)))

    def drain(self, upto: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, ExactState | None]:
        """The groups of the buckets below ``upto`` taken out, in the order of bucket then
        combo: their buckets, combos, states (count, min, max) and exact sums; where every
        combo added kept its count alone (medians and pNN), their counts and no sums."""
        k = self.below(upto)
        squares = bool(self._table.squares)
        bucket, combo, count, nan, pos_inf, neg_inf = (np.empty(k, np.int64) for _ in range(6))
        low, high = np.empty(k), np.empty(k)
        kept = k if squares else 0
        s_parts = np.empty(k, np.int8), np.empty(k, np.int16), np.empty(k, np.uint8)
        q_parts = np.empty(kept, np.int8), np.empty(kept, np.int16), np.empty(kept, np.uint8)
        s_digits, q_digits = self._table.drain(
            *_bound(upto), bucket, combo, count, nan, pos_inf, neg_inf, low, high, *s_parts, *q_parts
        )
        if not self._more:  # as a partition's states of medians' and pNN's groups are
            return bucket, combo, count.astype(np.float64)[None, :], None
        state = np.empty((UNTIMED, k))
        state[N], state[MIN], state[MAX] = count, low, high
        sums = Digits(*s_parts, np.frombuffer(s_digits, np.uint32))
        sq = Digits(*q_parts, np.frombuffer(q_digits, np.uint32)) if squares else None
        return bucket, combo, state, ExactState(count, nan, pos_inf, neg_inf, sums, sq)


def _bound(upto: float) -> tuple[int, bool]:
    """``upto`` as the table takes it: an int64 bound, and whether every group is below it."""
    if upto == math.inf:
        return 0, True
    if upto == -math.inf:
        return _FIRST, False
    return min(max(math.floor(upto), _FIRST), _LAST), False
