"""Groups set aside: an Accumulator's folded groups written to a temporary directory when
it holds more than SET_ASIDE_GROUPS (millions of keys in one step, none finished before
the last task), as runs sorted by bucket then key, and read back a slice of (bucket, key)
at a time, each slice's groups folded on their own.

A group's states fold in any order to the same bits (``partials``), so folding a slice's
groups from every run gives the same states as folding them all in memory. A slice holds
every group of its keys in its buckets (it is cut between two keys, never inside one), so
which reduction a key keeps is decided on all of its groups of a bucket at once, as when
they were held. Memory holds the groups of SET_ASIDE_GROUPS, or of a slice, not of all.

A run is an Arrow IPC file of record batches of BATCH_ROWS groups: the bucket, the label
columns ((process, rank,) key, reduction, as text), the state's fields (``s0``, ``s1``,
...) and the exact sums (counts, then each integer's sign, lowest digit's place and digits
as a list), with the first and last (bucket, key) of each batch held in memory to find
a slice's batches.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import polars as pl

from metric_core.offline.engine.partials import Partial
from metric_core.offline.keyorder import key_ranks

if TYPE_CHECKING:
    import pyarrow as pa

    from metric_core.offline.engine.exact import Digits, ExactState

# Groups an accumulator holds before it sets them all aside (what a group costs in memory
# is its label's text and about 100 bytes of states)
SET_ASIDE_GROUPS = 1 << 20
# Groups a record batch of a run: the grain a slice is read in
BATCH_ROWS = 1 << 15
# Groups read back and folded at a time, about (a slice's share of each run)
SLICE_GROUPS = 1 << 19

Bound = tuple[int, str]  # a (bucket, key): a slice holds the groups from one bound to before the next
_COUNTS = ("count", "nan", "pos_inf", "neg_inf")


@dataclass
class _Batch:
    first: Bound
    last: Bound
    rows: int


@dataclass
class _Run:
    path: Path
    batches: list[_Batch]
    labels: list[str]
    fields: int
    exact: bool
    squares: bool


class SetAside:
    """Runs of groups set aside (``write``), read back a slice at a time (``slices``,
    ``read``); the groups of buckets below ``taken`` were read and are skipped."""

    def __init__(self) -> None:
        self.dir: tempfile.TemporaryDirectory[str] | None = None
        self.runs: list[_Run] = []
        self.written = 0  # the runs written so far (each one's name: its number; runs read are removed)
        self.taken: int | None = None

    def write(
        self,
        bucket: np.ndarray,
        combo: np.ndarray,
        labels: pl.DataFrame,
        state: np.ndarray,
        exact: ExactState | None,
    ) -> None:
        """Groups (each one's bucket, its combo: a row of ``labels``, its states and exact
        sums) written as a run, in the order of bucket then key."""
        import pyarrow as pa

        if not len(bucket):
            return
        if self.dir is None:
            self.dir = tempfile.TemporaryDirectory(prefix="metriclog-groups-")
        labels = labels.with_columns(pl.col(pl.Categorical).cast(pl.String))
        rank = key_ranks(labels["key"])  # of each combo's key
        order = np.lexsort((rank[combo], bucket))
        del rank
        path = Path(self.dir.name) / f"{self.written:06d}.arrow"
        self.written += 1
        squares = exact is not None and exact.squares is not None
        run = _Run(path, [], labels.columns, len(state), exact is not None, squares)
        with pa.OSFile(str(path), "wb") as sink:
            writer = None
            for lo in range(0, len(order), BATCH_ROWS):
                rows = order[lo : lo + BATCH_ROWS]
                batch = _batch(bucket[rows], labels[combo[rows]], state[:, rows], exact, rows)
                if writer is None:
                    writer = pa.ipc.new_file(sink, batch.schema)
                writer.write_batch(batch)
                keys = batch.column("key")
                first = (int(bucket[rows[0]]), keys[0].as_py())
                run.batches.append(_Batch(first, (int(bucket[rows[-1]]), keys[-1].as_py()), len(rows)))
            assert writer is not None
            writer.close()
        self.runs.append(run)

    def rows_below(self, upto: float) -> int:
        """The groups set aside of buckets below ``upto`` (at most: by whole batches)."""
        return sum(b.rows for run in self.runs for b in run.batches if b.first[0] < upto and self._open(b))

    def slices(self, upto: float) -> list[tuple[Bound | None, Bound | None]]:
        """The buckets below ``upto`` cut between keys into slices of about SLICE_GROUPS
        groups of all runs: (from, to) bounds, None for no bound."""
        points = sorted(
            (b.first, b.rows) for run in self.runs for b in run.batches if b.first[0] < upto and self._open(b)
        )
        lo: Bound | None = None if self.taken is None else (self.taken, "")
        hi_end: Bound | None = None if upto == float("inf") else (int(upto), "")
        out: list[tuple[Bound | None, Bound | None]] = []
        held = 0
        for point, rows in points:
            if held >= SLICE_GROUPS and (lo is None or point > lo):
                out.append((lo, point))
                lo, held = point, 0
            held += rows
        out.append((lo, hi_end))
        return out

    def read(self, lo: Bound | None, hi: Bound | None) -> Iterator[Partial]:
        """The groups from ``lo`` to before ``hi`` of each run, as partitions' states (one a
        run and bucket: a partition's labels are distinct)."""
        import pyarrow as pa

        for run in self.runs:
            wanted = [
                i
                for i, b in enumerate(run.batches)
                if (lo is None or b.last >= lo) and (hi is None or b.first < hi) and self._open(b)
            ]
            if not wanted:
                continue
            with pa.OSFile(str(run.path), "rb") as source:
                reader = pa.ipc.open_file(source)
                for i in wanted:
                    yield from _partials(run, reader.get_batch(i), lo, hi)

    def take(self, upto: float) -> None:
        """The groups of buckets below ``upto`` were read: runs left with none other removed."""
        if upto == float("inf"):
            self.close()
            self.runs = []
            return
        self.taken = int(upto)
        kept = []
        for run in self.runs:
            if any(self._open(b) for b in run.batches):
                kept.append(run)
            else:
                run.path.unlink(missing_ok=True)
        self.runs = kept

    def _open(self, batch: _Batch) -> bool:
        """Whether the batch holds a group of a bucket not taken yet."""
        return self.taken is None or batch.last[0] >= self.taken

    def close(self) -> None:
        if self.dir is not None:
            self.dir.cleanup()
            self.dir = None


def _batch(
    bucket: np.ndarray, labels: pl.DataFrame, state: np.ndarray, exact: ExactState | None, rows: np.ndarray
) -> pa.RecordBatch:
    import pyarrow as pa

    columns: dict[str, pa.Array] = {"bucket": pa.array(bucket)}
    for name in labels.columns:
        columns[name] = labels[name].to_arrow()
    for j in range(len(state)):
        columns[f"s{j}"] = pa.array(np.ascontiguousarray(state[j]))
    if exact is not None:
        mine = exact.take(rows)
        for name in _COUNTS:
            columns[name] = pa.array(getattr(mine, name))
        _digit_columns(columns, "sum", mine.sum_digits)
        if mine.squares is not None:
            _digit_columns(columns, "sq", mine.squares)
    return pa.RecordBatch.from_pydict(columns)


def _digit_columns(columns: dict[str, pa.Array], prefix: str, digits: Digits) -> None:
    import pyarrow as pa

    offsets = np.r_[0, np.cumsum(digits.size, dtype=np.int64)].astype(np.int32)
    columns[f"{prefix}_sign"] = pa.array(digits.sign)
    columns[f"{prefix}_low"] = pa.array(digits.low)
    columns[f"{prefix}_digits"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(digits.digits))


def _partials(run: _Run, batch: pa.RecordBatch, lo: Bound | None, hi: Bound | None) -> Iterator[Partial]:
    """A batch's groups from ``lo`` to before ``hi`` (its rows are in (bucket, key) order),
    a bucket at a time."""
    from metric_core.offline.engine.exact import ExactState

    bucket = batch.column("bucket").to_numpy()
    key = pl.Series(batch.column("key"))
    a = 0 if lo is None else _below(bucket, key, lo)
    b = len(bucket) if hi is None else _below(bucket, key, hi)
    if a >= b:
        return
    labels = pl.DataFrame([pl.Series(name, batch.column(name)) for name in run.labels])[a:b]
    state = np.stack([batch.column(f"s{j}").to_numpy() for j in range(run.fields)])[:, a:b]
    exact = None
    if run.exact:
        count, nan, pos_inf, neg_inf = (batch.column(name).to_numpy()[a:b] for name in _COUNTS)
        squares = _digits(batch, "sq", a, b) if run.squares else None
        exact = ExactState(count, nan, pos_inf, neg_inf, _digits(batch, "sum", a, b), squares)
    bucket = bucket[a:b]
    edges = np.r_[0, np.flatnonzero(np.diff(bucket)) + 1, len(bucket)]
    none = np.empty(0, dtype=np.int64)
    for u, v in zip(edges[:-1].tolist(), edges[1:].tolist(), strict=True):
        whole = u == 0 and v == len(bucket)
        part = exact if whole or exact is None else exact.take(np.arange(u, v))
        yield Partial(
            bucket[u:v], np.arange(v - u, dtype=np.int64), labels[u:v], state[:, u:v], none, np.empty(0), part
        )


def _below(bucket: np.ndarray, key: pl.Series, bound: Bound) -> int:
    """How many of the sorted rows come before ``bound``."""
    b, k = bound
    before = (bucket < b) | ((bucket == b) & (key < k).to_numpy())
    return int(before.sum())


def _digits(batch: pa.RecordBatch, prefix: str, a: int, b: int) -> Digits:
    from metric_core.offline.engine.exact import Digits

    lists = batch.column(f"{prefix}_digits")
    offsets = lists.offsets.to_numpy()
    values = lists.values.to_numpy()
    return Digits(
        batch.column(f"{prefix}_sign").to_numpy()[a:b],
        batch.column(f"{prefix}_low").to_numpy()[a:b],
        np.diff(offsets[a : b + 1]).astype(np.uint8),
        np.ascontiguousarray(values[offsets[a] : offsets[b]]),
    )
