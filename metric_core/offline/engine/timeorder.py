"""One source's records in time order, with a bounded part of them in memory.

per_rank_no_reduce writes each source's records sorted by time, ties in file order: the
bits of one stable sort of all of the source's files, concatenated in file order. Sorting
them all at once holds the source whole; this module gets the same rows holding about
``batch_rows`` of them, using the time range each part of a file declares (a writer's
segment metadata, a Parquet row group's footer statistics).

Parts are read in the order of their first timestamp. Once a part is read, no record still
to come is earlier than the next part's first timestamp, so every held record earlier than
that is final: it is sorted (by time, then by its part's place in file order, then by its
place in the part) and handed over. Parts that overlap in time stay held together until
the next part begins after them; a file that spans a source's whole time is held whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import polars as pl


@dataclass(frozen=True)
class Part:
    """A file (``groups`` None) or some row groups of one, with its earliest timestamp
    (-inf when it does not say) and its number of records."""

    fid: int
    groups: tuple[int, ...] | None
    lo: float
    rows: int


Read = Callable[[int, list[int] | None], pl.DataFrame]
ORDER = "_file_order"


def in_time_order(parts: list[Part], read: Read, batch_rows: int) -> Iterator[pl.DataFrame]:
    """The records of ``parts`` (listed in the files' order, ``engine.tasks.data_order``)
    sorted by timestamp, ties in that order, as frames of at most ``batch_rows`` records."""
    order = sorted(range(len(parts)), key=lambda i: (parts[i].lo, i))
    held: list[pl.DataFrame] = []
    fresh = 0  # records read since held records were last looked at
    kept = 0  # records held back then
    pos = 0
    while pos < len(order):
        first = order[pos]
        # Consecutive row groups of one file, next in time too, are read in one go.
        groups = list(parts[first].groups or ())
        rows = parts[first].rows
        pos += 1
        while (
            groups
            and pos < len(order)
            and order[pos] == order[pos - 1] + 1
            and parts[order[pos]].fid == parts[first].fid
            and parts[order[pos]].groups is not None
            and rows + parts[order[pos]].rows <= batch_rows
        ):
            groups += parts[order[pos]].groups or ()
            rows += parts[order[pos]].rows
            pos += 1
        frame = read(parts[first].fid, groups if parts[first].groups is not None else None)
        held.append(frame.with_columns(pl.lit(first, pl.Int32).alias(ORDER)))
        fresh += frame.height
        cut = parts[order[pos]].lo if pos < len(order) else math.inf
        # Looked at once a batch is read, and no sooner than as many records as were held
        # back last time, so records that overlap are not filtered again and again.
        if pos < len(order) and (fresh < max(batch_rows, kept) or cut == -math.inf):
            continue
        whole = pl.concat(held, how="vertical_relaxed")  # keys Categorical, or text (read.interned)
        held = []
        # The order found once, then what is ready gathered a batch at a time (no sorted
        # copy of the whole), what waits gathered once. Rows held in file order need no
        # order column.
        in_order = whole[ORDER].is_sorted()
        order_of = None  # in time order already: slices of it
        times = whole["timestamp"]
        if not (in_order and times.is_sorted()):
            by = ["timestamp"] if in_order else ["timestamp", ORDER]
            order_of = whole.select(pl.arg_sort_by(by, maintain_order=True)).to_series()
            times = times.gather(order_of)
        at = times.search_sorted(cut, side="left") if cut < math.inf else whole.height
        held = [_rows(whole, order_of, at, whole.height - at)] if at < whole.height else []
        kept, fresh = sum(f.height for f in held), 0
        for start in range(0, at, batch_rows):
            yield _rows(whole, order_of, start, min(batch_rows, at - start)).drop(ORDER)


def _rows(frame: pl.DataFrame, order: pl.Series | None, start: int, n: int) -> pl.DataFrame:
    """Rows ``start`` to ``start + n`` of ``frame`` taken in ``order`` (None: as they are),
    in one chunk a column: what writers take fastest."""
    return (frame.slice(start, n) if order is None else frame[order.slice(start, n)]).rechunk()
