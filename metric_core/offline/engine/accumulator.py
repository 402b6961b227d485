"""The Accumulator: partitions' states (``partials``) folded group by group, in blocks of
buckets, their exact sums added beside them; median/pNN values held beside them (spilled
to temporary files past SPILL_VALUES); finished groups taken out as frames."""

from __future__ import annotations

import dataclasses
import itertools
import math
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl

from metric_core.offline.engine.partials import (
    COUNTED,
    Partial,
    Rows,
    add_exact,
    concat_exact,
    empty_cells,
    fold,
    is_statistic,
    statistic,
    take_exact,
    with_fields,
)
from metric_core.offline.engine.setaside import SET_ASIDE_GROUPS, SetAside
from metric_core.offline.plan import Statistic

if TYPE_CHECKING:
    from metric_core.offline.engine.exact import ExactState
    from metric_core.offline.engine.grouptable import GroupTable

_BLOCK_BITS = 8  # buckets (steps, windows) per block of the accumulator
# A group's place in its block: its bucket's offset in the block, then its combo
_COMBO_BITS = 32
_COMBO_MASK = (1 << _COMBO_BITS) - 1
# A block's groups met since it was last settled, at most (or a quarter of those it holds,
# up to CHUNK_GROUPS): each settling copies the chunks they fall in
LOOSE_GROUPS = 1 << 14
LOOSE_PARTS = 32  # ... and at most this many partitions' groups (each is one round of folds)
# Groups of a chunk of a block (what placing new groups copies at a time): past twice
# this, a chunk is split
CHUNK_GROUPS = 1 << 20
# median/pNN values held in memory (24 bytes each) before they go to a temporary file
SPILL_VALUES = 1_000_000
# median/pNN values whose groups' quantiles are computed in one query: polars' group_by
# holds about 80 bytes a value, so a smaller slice lowers the peak of *=p99 over many
# values, for some time (benchmarks/bench_engine.py and bench_memory.py measure both)
SLICE_VALUES = 500_000
# labels in a chunk of their own, at least: merging the chunks of new labels copies at most
# about this many (a run of millions of keys is never copied whole to be one chunk)
SEALED_LABELS = 1 << 20
# groups the table of records handed over as rows holds (``grouptable``: about 150 bytes
# each) before they are folded in with the others
TABLE_GROUPS = 1 << 20
TABLE_RECORDS = 2  # ... and keeps taking records past it while they are this many a group or more
KNOWN_LABELS = 64  # sets of labels whose numbers are kept (``_Labels.numbers``)


class _Labels:
    """The combos folded so far: each one's label (a row of (process, rank,) key and
    statistic), numbered in the order they came.

    A label is looked up by a hash of its row (``hashes``, sorted, with the combo each
    numbers), then checked against the row itself; labels whose hash another label has
    (which 64 bits make rare) are numbered in ``collided`` instead. Memory: the labels, and
    16 bytes a label, never a Python object each; the labels are in chunks (``sealed``),
    so numbering new ones copies a few of them, not all.
    """

    def __init__(self) -> None:
        self.table = pl.DataFrame()
        self.hashes = np.empty(0, dtype=np.uint64)
        self.numbered = np.empty(0, dtype=np.int64)
        self.collided: dict[tuple[Any, ...], int] = {}
        self.collided_hashes = np.empty(0, dtype=np.uint64)  # sorted
        # labels before this row are in chunks of at least SEALED_LABELS, never copied again;
        # those after it, in tail_parts chunks (made one past 32)
        self.sealed = 0
        self.tail_parts = 0
        # the numbers of labels given as Python values too (``Partial.names``): a reader's
        # partitions of one file, or of files of the same keys, have the same labels
        self.known: dict[tuple[tuple[Any, ...], ...], np.ndarray] = {}

    def __len__(self) -> int:
        return self.table.height

    def numbers(self, labels: pl.DataFrame, names: tuple[tuple[Any, ...], ...] | None = None) -> np.ndarray:
        """The combo of each row of ``labels`` (distinct rows); labels not met before are
        numbered next, in row order. ``names``: the rows of ``labels`` as Python values,
        where the caller has them (then labels met as a whole before are not looked up)."""
        if names is not None:
            known = self.known.get(names)
            if known is None:
                known = self.known[names] = self._numbers(labels)
                if len(self.known) > KNOWN_LABELS:
                    self.known = {names: known}
            return known.copy()
        return self._numbers(labels)

    def _numbers(self, labels: pl.DataFrame) -> np.ndarray:
        labels = labels.with_columns(
            pl.col(c).cast(pl.Categorical) for c in ("process", "reduction") if c in labels
        )
        h = labels.hash_rows(seed=0).to_numpy()
        out = np.full(labels.height, -1, dtype=np.int64)
        at = _found(self.hashes, h)
        known = np.flatnonzero(at >= 0)
        combo = self.numbered[at[known]]
        same = _same_rows(self.table[combo], labels[known])
        out[known[same]] = combo[same]
        rest = np.flatnonzero(out < 0)
        hashed = h[rest]
        uniq, counts = np.unique(hashed, return_counts=True)
        odd = (_found(self.hashes, hashed) >= 0) | (_found(self.collided_hashes, hashed) >= 0)
        odd |= counts[np.searchsorted(uniq, hashed)] > 1
        for i in rest[odd].tolist():  # a label sharing its hash with another
            out[i] = self.collided.get(labels.row(i), -1)
        fresh = np.flatnonzero(out < 0)
        if not len(fresh):
            return out
        out[fresh] = len(self) + np.arange(len(fresh))
        shares = np.zeros(labels.height, dtype=bool)
        shares[rest[odd]] = True
        for i in fresh[shares[fresh]].tolist():
            self.collided[labels.row(i)] = int(out[i])
            self.collided_hashes = np.insert(
                self.collided_hashes, np.searchsorted(self.collided_hashes, h[i]), h[i]
            )
        plain = fresh[~shares[fresh]]
        order = np.argsort(h[plain])
        where = np.searchsorted(self.hashes, h[plain][order])
        self.hashes = np.insert(self.hashes, where, h[plain][order])
        self.numbered = np.insert(self.numbered, where, out[plain][order])
        self.table = pl.concat([self.table, labels[fresh]], rechunk=False) if len(self) else labels[fresh]
        self.tail_parts += 1
        if self.tail_parts > 32:  # the labels since the last seal in one chunk (never a copy of all)
            head, tail = self.table[: self.sealed], self.table[self.sealed :].rechunk()
            self.table = pl.concat([head, tail], rechunk=False) if self.sealed else tail
            self.tail_parts = 1
            if tail.height >= SEALED_LABELS:
                self.sealed, self.tail_parts = len(self), 0
        return out

    def rows(self, combo: np.ndarray) -> pl.DataFrame:
        """The labels of ``combo`` (process and reduction Categorical)."""
        return self.table[combo]


def _found(sorted_: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Where each of ``x`` is in ``sorted_``, or -1."""
    if not len(sorted_):
        return np.full(len(x), -1, dtype=np.int64)
    at = np.minimum(np.searchsorted(sorted_, x), len(sorted_) - 1)
    return np.where(sorted_[at] == x, at, -1)


def _same_rows(a: pl.DataFrame, b: pl.DataFrame) -> np.ndarray:
    """Whether each row of ``a`` equals the same row of ``b`` (nulls equal)."""
    if not a.height:
        return np.zeros(0, dtype=bool)
    same = pl.all_horizontal(pl.col(c).eq_missing(b[c]) for c in a.columns)
    return a.select(same).to_series().to_numpy()


@dataclass
class _Chunk:
    """Some of a block's groups: ``ids`` (each group's place: _COMBO_BITS), sorted, their
    ``state`` (fields x groups) and their exact sums (``exact``, None while no group has
    one); ``pending``: exact sums folded in since, each with the places of its groups in
    the chunk, added to ``exact`` all at once (``settled``)."""

    ids: np.ndarray
    state: np.ndarray
    exact: ExactState | None = None
    pending: list[tuple[ExactState, np.ndarray]] = field(default_factory=list)
    pending_groups: int = 0

    def add(self, exact: ExactState | None, at: np.ndarray) -> None:
        """Exact sums of the chunk's groups at places ``at``, to be added."""
        if exact is None:
            return
        self.pending.append((exact, at))
        self.pending_groups += len(at)
        if self.pending_groups > max(len(self.ids) >> 2, LOOSE_GROUPS) or len(self.pending) > LOOSE_PARTS:
            self.settled()

    def settled(self) -> ExactState | None:
        """``exact`` with every pending sum added."""
        if self.pending:
            parts = [(self.exact, np.arange(len(self.ids))), *self.pending]
            self.exact = add_exact(parts, len(self.ids))
            self.pending, self.pending_groups = [], 0
        return self.exact

    def joined(self, after: _Chunk) -> _Chunk:
        """This chunk's groups and then ``after``'s (whose ids are all past these), as one."""
        return _Chunk(
            np.concatenate([self.ids, after.ids]),
            np.concatenate([self.state, after.state], axis=1),
            concat_exact([(self.settled(), len(self.ids)), (after.settled(), len(after.ids))]),
        )

    def piece(self, lo: int, hi: int) -> _Chunk:
        """Its groups ``lo`` to ``hi`` as a chunk of their own (copies)."""
        exact = self.settled()
        hi = min(hi, len(self.ids))
        return _Chunk(
            self.ids[lo:hi].copy(), self.state[:, lo:hi].copy(), take_exact(exact, np.arange(lo, hi))
        )


@dataclass
class _Block:
    """The groups of 2**_BLOCK_BITS consecutive buckets folded so far, in ``chunks`` of
    consecutive ids (each at most twice CHUNK_GROUPS); and, in ``loose``, the states (ids,
    states, exact sums) of groups met since the last ``settle``, in the order they came (a
    group may be there more than once). Memory grows with the groups, not with the combos times the
    buckets, and placing new groups copies one chunk at a time."""

    chunks: list[_Chunk] = field(default_factory=list)
    fields: int = COUNTED
    held: int = 0  # the groups in chunks
    loose: list[tuple[np.ndarray, np.ndarray, ExactState | None]] = field(default_factory=list)
    loose_groups: int = 0

    @property
    def groups(self) -> int:
        """The groups held (at most: a loose group may be there more than once)."""
        return self.held + self.loose_groups

    def _last_id(self) -> int:
        """The highest id held in chunks, -1 for none."""
        return next((int(c.ids[-1]) for c in reversed(self.chunks) if len(c.ids)), -1)

    def _chunk_of(self, ids: np.ndarray) -> np.ndarray:
        firsts = np.array([int(c.ids[0]) if len(c.ids) else -1 for c in self.chunks], dtype=np.int64)
        return np.maximum(np.searchsorted(firsts, ids, side="right") - 1, 0)

    def fold(self, ids: np.ndarray, state: np.ndarray, exact: ExactState | None) -> None:
        """One partition's states (and exact sums) of the groups ``ids`` (each once) folded in."""
        if len(state) > self.fields:
            self.fields = len(state)
            for chunk in self.chunks:
                chunk.state = with_fields(chunk.state, self.fields)
        hit = np.zeros(len(ids), dtype=bool)
        last = self._last_id()
        if len(ids) and int(ids.min()) > last:  # steps (or combos) past every group held: all new
            chunks = []
        else:
            chunks = list(
                _by_chunk(self._chunk_of(ids) if len(self.chunks) > 1 else None, self.chunks, len(ids))
            )
        for chunk, sel in chunks:
            mine_ids = ids[sel]
            start = int(np.searchsorted(chunk.ids, mine_ids[0]))
            if np.array_equal(chunk.ids[start : start + len(sel)], mine_ids):  # a run of the chunk's groups
                hit[sel] = True
                whole = len(sel) == len(ids)
                fold(chunk.state[:, start : start + len(sel)], state if whole else state[:, sel])
                chunk.add(exact if whole else take_exact(exact, sel), np.arange(start, start + len(sel)))
                continue
            at = _found(chunk.ids, mine_ids)  # else each looked up
            found = at >= 0
            if found.any():
                at, rows = at[found], sel[found]
                hit[rows] = True
                chunk.state[:, at] = fold(chunk.state[:, at], state[:, rows])
                chunk.add(take_exact(exact, rows), at)
        if hit.all():
            return
        new = ~hit
        if hit.any():
            ids, state, exact = ids[new], state[:, new], take_exact(exact, np.flatnonzero(new))
        self.loose.append((ids, state, exact))
        self.loose_groups += int(new.sum())
        if (
            self.loose_groups > min(max(self.held >> 2, LOOSE_GROUPS), CHUNK_GROUPS)
            or len(self.loose) > LOOSE_PARTS
        ):
            self.settle()

    def settle(self) -> None:
        """The loose groups placed among the others, each one's states folded, its exact
        sums added (in one ``add_exact`` for all, and one a chunk they go to)."""
        if not self.loose or self._appended():
            return
        fields = self.fields
        ids = np.concatenate([i for i, _, _ in self.loose])
        states = np.concatenate([with_fields(s, fields) for _, s, _ in self.loose], axis=1)
        exacts = [e for _, _, e in self.loose]
        sizes = [len(i) for i, _, _ in self.loose]
        self.loose, self.loose_groups = [], 0
        if (ids[1:] > ids[:-1]).all():  # each group once, in order (new steps among those held)
            merged = fold(empty_cells(len(ids), fields), states)
            group_of = np.arange(len(ids))
        else:
            order = np.argsort(ids, kind="stable")
            ids, states = ids[order], states[:, order]
            first = np.r_[True, ids[1:] != ids[:-1]]
            starts = np.flatnonzero(first)
            group_of = np.empty(len(ids), dtype=np.int64)
            group_of[order] = np.cumsum(first) - 1
            runs = np.diff(np.r_[starts, len(ids)])
            merged = fold(empty_cells(len(starts), fields), states[:, starts])
            for j in range(1, int(runs.max())):  # each group's next state, where it has one
                at = np.flatnonzero(runs > j)
                merged[:, at] = fold(merged[:, at], states[:, starts[at] + j])
            ids = ids[starts]
        del states
        edges = np.cumsum([0, *sizes])
        merged_exact = add_exact(
            [(e, group_of[lo:hi]) for e, lo, hi in zip(exacts, edges[:-1], edges[1:], strict=True)], len(ids)
        )
        del exacts
        if not self.chunks:
            self.chunks = [_Chunk(np.empty(0, dtype=np.int64), empty_cells(0, fields))]
        chunks: list[_Chunk] = []
        for chunk, sel in _by_chunk(self._chunk_of(ids), self.chunks, len(ids), every=True):
            if len(sel):
                where = np.searchsorted(chunk.ids, ids[sel])
                size = len(chunk.ids) + len(sel)
                moved = np.arange(len(chunk.ids)) + np.searchsorted(
                    where, np.arange(len(chunk.ids)), side="right"
                )
                parts = [(chunk.exact, moved), *((e, moved[at]) for e, at in chunk.pending)]
                parts.append((take_exact(merged_exact, sel), where + np.arange(len(sel))))
                chunk = _Chunk(
                    np.insert(chunk.ids, where, ids[sel]),
                    np.insert(chunk.state, where, merged[:, sel], axis=1),
                    add_exact(parts, size),
                )
            chunks += _split(chunk)
        self.chunks = chunks
        self.held += len(ids)

    def _appended(self) -> bool:
        """The loose groups placed as a chunk after the others, where each is there once,
        in order, past every group held (a partition's new steps, the usual case when a
        source's files are reduced on their own): their states are copied once, side by
        side, never inserted among the others'; a chunk is joined to the one before it
        while that one is no more than twice its size and the two fit in a chunk (so a
        block holds few chunks, and a group is copied a few times at most). False, with
        nothing done, where they are not all new."""
        last = self._last_id()
        for ids, _, _ in self.loose:
            if len(ids) and (int(ids[0]) <= last or not (ids[1:] > ids[:-1]).all()):
                return False
            last = int(ids[-1]) if len(ids) else last
        new = _Chunk(
            np.concatenate([i for i, _, _ in self.loose]),
            np.concatenate([with_fields(s, self.fields) for _, s, _ in self.loose], axis=1),
            concat_exact([(e, len(i)) for i, _, e in self.loose]),
        )
        self.held += len(new.ids)
        self.loose, self.loose_groups = [], 0
        chunks = [c for c in self.chunks if len(c.ids)]
        chunks += _split(new)
        while len(chunks) > 1 and len(chunks[-2].ids) <= min(
            2 * len(chunks[-1].ids), 2 * CHUNK_GROUPS - len(chunks[-1].ids)
        ):
            *chunks, before, after = chunks
            chunks.append(before.joined(after))
        self.chunks = chunks
        return True

    def take(self, below: int | None) -> list[_Chunk]:
        """The groups whose ids are below ``below`` (None: all), taken out."""
        self.settle()
        if below is None:
            out, self.chunks, self.held = self.chunks, [], 0
            return out
        out = []
        while self.chunks:
            chunk = self.chunks[0]
            n = int(np.searchsorted(chunk.ids, below))
            if n == len(chunk.ids):
                out.append(self.chunks.pop(0))
                continue
            if n:
                out.append(chunk.piece(0, n))
                self.chunks[0] = chunk.piece(n, len(chunk.ids))
            break
        self.held -= sum(len(c.ids) for c in out)
        return out


def _by_chunk(
    which: np.ndarray | None, chunks: list[_Chunk], n: int, every: bool = False
) -> Iterator[tuple[_Chunk, np.ndarray]]:
    """Each chunk with the rows (of ``n``) that fall in it (``which``: each row's chunk;
    None: one chunk, all rows), skipping chunks with none unless ``every``."""
    if which is None:
        if chunks:
            yield chunks[0], np.arange(n)
        return
    order = np.argsort(which, kind="stable")
    bounds = np.searchsorted(which[order], np.arange(len(chunks) + 1))
    for k, chunk in enumerate(chunks):
        sel = order[bounds[k] : bounds[k + 1]]
        if len(sel) or every:
            yield chunk, sel


def _split(chunk: _Chunk) -> list[_Chunk]:
    """A chunk in pieces of CHUNK_GROUPS, when it grew past twice that."""
    if len(chunk.ids) <= 2 * CHUNK_GROUPS:
        return [chunk]
    return [chunk.piece(c, c + CHUNK_GROUPS) for c in range(0, len(chunk.ids), CHUNK_GROUPS)]


@dataclass
class Accumulator:
    """Partitions' states folded into blocks of buckets (in any order: the same bits).

    Memory grows with the groups (bucket and combo) not taken out yet (``take``) and the
    combos met, not with the records; the values of median/pNN groups are held with them
    (in a temporary directory past ``SPILL_VALUES``). Past SET_ASIDE_GROUPS groups held
    (and while no median/pNN value came), every group is set aside on disk with its label
    (``setaside``), and the groups below a bucket are then read back a slice of keys at a
    time (``slices``), not taken.
    """

    labels: _Labels = field(default_factory=_Labels)
    blocks: dict[int, _Block] = field(default_factory=dict)
    value_cells: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)
    held_values: int = 0
    spills: list[tuple[Path, int, int]] = field(default_factory=list)  # (file, first, last bucket)
    spent: list[Path] = field(default_factory=list)  # spilled files no later take needs
    spilled: int = 0  # the files written so far (each one's name: its number)
    spill_dir: tempfile.TemporaryDirectory[str] | None = None
    taken: int | None = None  # the buckets below this one were taken out
    aside: SetAside | None = None  # groups set aside on disk
    sets_aside: bool = True  # may set groups aside (not once a median/pNN value came)
    table: GroupTable | None = None  # records handed over as rows, in their groups (``grouptable``)
    # whether the table still takes rows: not once it held TABLE_GROUPS groups of about a
    # record each (then each partition's rows are made states at once, as the states' path does)
    tables: bool = True
    table_rows: int = 0  # the records added into the table since it was empty

    def add(self, p: Partial) -> None:
        if not len(p.bucket) and p.rows is None:
            return
        if len(p.values):  # a value's group is told by its combo: held with its labels
            self.sets_aside = False
            if self.aside is not None:
                self._read_back()
        self._fold(p)
        if self.sets_aside and self._groups_held() > SET_ASIDE_GROUPS:
            self.set_aside()

    def _groups_held(self) -> int:
        table = 0 if self.table is None else len(self.table)
        return table + sum(block.groups for block in self.blocks.values())

    def _rows(self, rows: Rows, combo_of: np.ndarray) -> None:
        """Records handed over as rows, into the table (or, once it no longer takes them,
        into a table of their own, folded in at once)."""
        from metric_core.offline.engine.grouptable import GroupTable

        if not self.tables:
            alone = GroupTable()
            alone.add(rows, combo_of)
            self._fold_numbered(*alone.drain(math.inf))
            return
        if self.table is None:
            self.table = GroupTable()
        self.table.add(rows, combo_of)
        self.table_rows += len(rows)
        if len(self.table) > TABLE_GROUPS:
            # fewer records a group than TABLE_RECORDS: folding each partition's states costs no more
            self.tables = self.table_rows >= TABLE_RECORDS * len(self.table)
            self._drain(math.inf)

    def _drain(self, upto: float) -> None:
        """The table's groups of the buckets below ``upto`` folded in with the others'."""
        if self.table is not None and len(self.table):
            self._fold_numbered(*self.table.drain(upto))
            if not len(self.table):
                self.table, self.table_rows = None, 0

    def set_aside(self) -> None:
        """Every group held written to disk with its label (``setaside``), and forgotten
        here, the labels too."""
        self._drain(math.inf)
        if not self.blocks:
            return
        if self.labels.table["key"].null_count():  # a key without text has no place in key order
            self.sets_aside = False
            return
        from metric_core.offline.engine import exact as exact_sums

        fields = max(block.fields for block in self.blocks.values())
        buckets, combos, states, exacts = [], [], [], []
        for b in sorted(self.blocks):
            for chunk in self.blocks[b].take(None):
                buckets.append((b << _BLOCK_BITS) + (chunk.ids >> _COMBO_BITS))
                combos.append(chunk.ids & _COMBO_MASK)
                states.append(with_fields(chunk.state, fields))
                exacts.append(chunk.settled())
        self.blocks = {}
        labels, self.labels = self.labels.table, _Labels()
        exact = None
        if any(e is not None for e in exacts):  # a group without exact sums takes empty ones
            squares = any(e is not None and e.squares is not None for e in exacts)
            exact = exact_sums.concat(
                [
                    exact_sums.ExactState.empty(len(c), squares=squares)
                    if e is None
                    else e
                    if e.squares is not None or not squares
                    else dataclasses.replace(e, squares=exact_sums.Digits.zeros(len(e)))
                    for e, c in zip(exacts, combos, strict=True)
                ]
            )
        del exacts
        state = np.concatenate(states, axis=1)
        del states
        if self.aside is None:
            self.aside = SetAside()
        self.aside.write(np.concatenate(buckets), np.concatenate(combos), labels, state, exact)

    def _read_back(self) -> None:
        """The groups set aside folded back in (held from then on)."""
        assert self.aside is not None
        aside, self.aside = self.aside, None
        try:
            for p in aside.read(None, None):
                self._fold(p)
        finally:
            aside.close()

    def slices(self, upto: float) -> Iterator[tuple[Accumulator, bool]]:
        """The groups of the buckets below ``upto``, when some are set aside: every group
        set aside, then read back a slice of (bucket, key) at a time, each slice's in an
        accumulator of its own (closed once the next is asked for), with whether it is the
        last. Those groups are gone from this one after."""
        self.set_aside()
        assert self.aside is not None
        bounds = self.aside.slices(upto)
        for i, (lo, hi) in enumerate(bounds):
            part = Accumulator(sets_aside=False)
            try:
                for p in self.aside.read(lo, hi):
                    part.add(p)
                yield part, i + 1 == len(bounds)
            finally:
                part.close()
        self.aside.take(upto)
        if upto == math.inf:
            self.aside = None

    def _fold(self, p: Partial) -> None:
        combo_of = self.labels.numbers(p.labels, p.names)
        combo = combo_of[p.combo]
        self._fold_numbered(p.bucket, combo, p.state, p.exact)
        if p.rows is not None:
            self._rows(p.rows, combo_of)
        if len(p.values):
            if p.values_by_row:  # each value's group told by its row, counted in the table
                assert p.rows is not None
                rows, at = p.rows, p.value_group
                if len(at) == len(rows):  # every row's (its rows in order, each once)
                    self.value_cells.append((rows.bucket, combo_of[rows.combo], p.values))
                else:
                    self.value_cells.append((rows.bucket[at], combo_of[rows.combo[at]], p.values))
            else:
                self.value_cells.append((p.bucket[p.value_group], combo[p.value_group], p.values))
            self.held_values += len(p.values)
            if self.held_values > SPILL_VALUES:
                self._spill()

    def _fold_numbered(
        self, bucket: np.ndarray, combo: np.ndarray, state: np.ndarray, exact: ExactState | None
    ) -> None:
        """States of groups (bucket, combo numbered here), in bucket order, folded in."""
        if not len(bucket):
            return
        block_of = bucket >> _BLOCK_BITS  # non-decreasing: the groups come in bucket order
        edges = np.flatnonzero(np.diff(block_of)) + 1
        for lo, hi in zip(np.r_[0, edges], np.r_[edges, len(block_of)], strict=True):
            b = int(block_of[lo])
            ids = ((bucket[lo:hi] - (b << _BLOCK_BITS)) << _COMBO_BITS) | combo[lo:hi]
            whole = lo == 0 and hi == len(block_of)
            part = exact if whole else take_exact(exact, np.arange(lo, hi))
            self.blocks.setdefault(b, _Block()).fold(ids, state[:, lo:hi], part)

    def _spill(self) -> None:
        """The median/pNN values held so far, to a temporary Parquet file sorted by bucket."""
        if self.spill_dir is None:
            self.spill_dir = tempfile.TemporaryDirectory(prefix="metriclog-values-")
        frame = self._held().sort("bucket", maintain_order=True)
        path = Path(self.spill_dir.name) / f"{self.spilled:05d}.parquet"
        self.spilled += 1
        # lz4: read back soon, and faster than zstd both ways
        frame.write_parquet(path, row_group_size=1 << 15, statistics=True, compression="lz4")
        self.spills.append((path, int(frame["bucket"][0]), int(frame["bucket"][-1])))
        self.value_cells, self.held_values = [], 0

    def _held(self) -> pl.DataFrame:
        if not self.value_cells:
            return pl.DataFrame(schema={"bucket": pl.Int64, "_combo": pl.Int64, "value": pl.Float64})
        bucket, combo, values = (np.concatenate(parts) for parts in zip(*self.value_cells, strict=True))
        return pl.DataFrame({"bucket": bucket, "_combo": combo, "value": values})

    def _value_ranges(self, lo: int | None, hi: int | None) -> list[pl.LazyFrame]:
        """The median/pNN values (with their group: bucket, _combo) of the buckets from
        ``lo`` to below ``hi`` (None: no bound), held or spilled, in slices of whole
        buckets that each hold about ``SLICE_VALUES`` values; values of later buckets stay."""
        for path in self.spent:  # what the slices of the last take read
            path.unlink(missing_ok=True)
        self.spent = []
        if not self.value_cells and not self.spills:  # no median/pNN values: nothing to split
            return [self._held().lazy()]
        held = self._held()
        mine = held
        if hi is not None:
            later = pl.Series(held["bucket"].to_numpy() >= hi)
            mine, rest = held.filter(~later), held.filter(later)
            columns = (rest["bucket"].to_numpy(), rest["_combo"].to_numpy(), rest["value"].to_numpy())
            self.value_cells = [columns] if rest.height else []
        else:
            self.value_cells = []
        self.held_values = held.height - mine.height
        files = [
            path
            for path, first, last in self.spills
            if (lo is None or last >= lo) and (hi is None or first < hi)
        ]
        scan = mine.lazy()
        if files:
            self.spent = [path for path, _, last in self.spills if hi is None or last < hi]
            self.spills = [s for s in self.spills if s[0] not in self.spent]
            scan = pl.concat([pl.scan_parquet(files), scan])
            if lo is not None:
                scan = scan.filter(pl.col("bucket") >= lo)
            if hi is not None:
                scan = scan.filter(pl.col("bucket") < hi)
        per_bucket = scan.group_by("bucket").len().sort("bucket").collect()
        edges, held_n, shares = [], 0, {}
        first = per_bucket["bucket"][0] if per_bucket.height else None
        for bucket, n in per_bucket.iter_rows():
            if held_n and held_n + n > SLICE_VALUES:
                edges.append(bucket)
                held_n = 0
            held_n += n
            if n > SLICE_VALUES:  # a bucket of more: in shares of its groups (combo modulo k)
                shares[bucket] = -(-n // SLICE_VALUES)
        slices = []
        for start, stop in itertools.pairwise([None, *edges, None]):
            part = scan
            if start is not None:
                part = part.filter(pl.col("bucket") >= start)
            if stop is not None:
                part = part.filter(pl.col("bucket") < stop)
            k = shares.get(first if start is None else start, 1)
            slices += [part.filter(pl.col("_combo") % k == r) for r in range(k)] if k > 1 else [part]
        return slices

    def close(self) -> None:
        self.table = None
        if self.spill_dir is not None:
            self.spill_dir.cleanup()
            self.spill_dir = None
        if self.aside is not None:
            self.aside.close()
            self.aside = None

    def cells_below(self, upto: float) -> int:
        """The groups (at most) of the blocks that start below bucket ``upto``, set aside ones too."""
        aside = 0 if self.aside is None else self.aside.rows_below(upto)
        table = 0 if self.table is None else self.table.below(upto)
        blocks = sum(block.groups for b, block in self.blocks.items() if b << _BLOCK_BITS < upto)
        return aside + table + blocks

    def cuts(self, upto: float, groups: int) -> list[float]:
        """Where to cut the taking of the buckets below ``upto`` (block edges, then ``upto``)
        so that each take holds at most about ``groups`` groups."""
        self._drain(upto)
        out: list[float] = []
        held = 0
        for b in sorted(self.blocks):
            if b << _BLOCK_BITS >= upto:
                break
            if held and held + self.blocks[b].groups > groups:
                out.append(b << _BLOCK_BITS)
                held = 0
            held += self.blocks[b].groups
        return [*out, upto]

    def take(self, upto: float = math.inf) -> Taken:
        """The groups of the buckets below ``upto`` (an integer, or inf: all), taken out
        (``Taken``): their buckets and combos, the labels the combos number (not gathered
        a row a group: on millions of keys that copy was the peak), each group's count and
        the statistic its reduction names, and their median/pNN values
        (``_value_ranges``), to be read before ``close``. Each chunk of states is freed
        once its statistics are read."""
        hi = None if upto == math.inf else math.floor(upto)
        self._drain(upto)
        buckets, combos, parts, exacts = [], [], [], []
        for b in sorted(self.blocks):
            first = b << _BLOCK_BITS
            if hi is not None and first >= hi:
                break
            block = self.blocks[b]
            part = hi is not None and first + (1 << _BLOCK_BITS) > hi  # the block hi falls in
            for chunk in block.take((hi - first) << _COMBO_BITS if part and hi is not None else None):
                parts.append(chunk.state)
                exacts.append(chunk.settled())
                buckets.append(first + (chunk.ids >> _COMBO_BITS))
                combos.append(chunk.ids & _COMBO_MASK)
            if not block.groups:
                del self.blocks[b]
        values = self._value_ranges(self.taken, hi)
        self.taken = hi
        labels = self.labels.table
        if hi is None:  # every group taken: the labels are not needed again
            self.labels = _Labels()
        if not parts:
            return Taken(
                np.empty(0, np.int64),
                np.empty(0, np.int64),
                labels,
                np.empty(0, np.int64),
                np.empty(0),
                values,
            )
        reduction = labels["reduction"].to_physical().to_numpy()  # each combo's statistic, as a code
        named = labels["reduction"].unique()
        plain = [
            (int(code), Statistic.parse(name).name)
            for code, name in zip(named.to_physical().to_list(), named.cast(pl.String).to_list(), strict=True)
            if is_statistic(name)
        ]
        counts, values_of = [], []
        parts.reverse()
        exacts.reverse()
        for combo in combos:  # a chunk at a time, each freed once read
            state, exact = parts.pop(), exacts.pop()
            code = reduction[combo]
            value = np.full(len(combo), np.nan)
            for c, name in plain:
                rows = code == c
                if rows.all():  # a float column whatever the statistic (a count's is integral)
                    value = statistic(state, exact, name).astype(np.float64, copy=False)
                elif rows.any():
                    value[rows] = statistic(state, exact, name, where=rows)[rows]
            counts.append(statistic(state, exact, "count"))
            values_of.append(value)
            del state, exact
        return Taken(
            np.concatenate(buckets),
            np.concatenate(combos),
            labels,
            np.concatenate(counts),
            np.concatenate(values_of),
            values,
        )


@dataclass
class Taken:
    """Groups taken out of an Accumulator: each one's ``bucket`` and ``combo`` (a row of
    ``labels``: (process, rank,) key, reduction; process and reduction Categorical), in
    the order of bucket then combo, its ``count``, and ``value``: the statistic its
    reduction names, NaN for median and pNN (computed from ``values``: their values, a
    slice of groups at a time) and for a reduction that is not a statistic."""

    bucket: np.ndarray
    combo: np.ndarray
    labels: pl.DataFrame
    count: np.ndarray
    value: np.ndarray
    values: list[pl.LazyFrame]
