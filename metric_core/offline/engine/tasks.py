"""What a plan reads, and in which order: the files cut into tasks of about
PARTITION_ROWS records in the order of the first bucket each may hold, the columns read,
and where ``--by time`` windows start; the files' order by content (``data_order``: what
breaks ties of time in per_rank_no_reduce)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import polars as pl

from metric_core.format.schema import TIMESTAMP_RANGE, default_process_name, parse_json
from metric_core.metric import LoggingMode
from metric_core.offline import filters
from metric_core.offline.engine import partials
from metric_core.offline.engine.filtering import key_matching, nothing_kept, plan_filtered, statistic_chooser
from metric_core.offline.engine.timeorder import Part
from metric_core.offline.plan import By, ReducePlan, key_matcher
from metric_core.offline.read import RunScan
from metric_core.offline.read.parquet import kept_first_times, row_group_lows
from metric_core.offline.read.report import FileReport
from metric_core.offline.storage import RunPath, open_read, raise_store_failure

# What breaks a tie of timestamps between a first (or last) record and another, after them
# the value's bits (``partials``)
TIE_COLUMNS = ("step", "process", "rank")

T = TypeVar("T")

# Records a partition holds (its states are made and folded as one): smaller partitions
# lower the peak memory on another tool's large files, for no speed (bench_memory.py).
PARTITION_ROWS = 125_000


# From about this many Parquet records on, reading them with pyarrow's dictionaries beats
# decoding every string with polars by more than pyarrow's import (0.1 s) costs.
DICTIONARY_READ_RECORDS = 2_000_000


@dataclass(frozen=True)
class Task:
    """What one thread reduces: ``reads`` (file id, row groups or None for the whole file),
    in that order; ``lo``, the first bucket they may hold; ``size``, their bytes (what
    progress counts)."""

    reads: list[tuple[int, list[int] | None]]
    lo: float
    size: int


def cut(
    plan: ReducePlan,
    scan: RunScan,
    fids: Sequence[int],
    t0: float | None,
    row_groups: bool,
    rows: int | None = None,
) -> list[Task]:
    """The files ``fids`` cut into tasks of about ``rows`` records, in the order of the
    first bucket (step, or ``--by time`` window) each may hold, then of ``fids``: a bucket
    is finished once no task still to come may hold it.

    A part is a Parquet row group when the files are read through the dictionaries
    (``row_groups``) and its footer has the statistics, else a whole file with the range
    its writer declared (or none: it may hold any bucket, and goes first). Which records
    share a task or a partition changes no bit of the result (``partials``).
    """
    rows = PARTITION_ROWS if rows is None else rows
    column = "timestamp" if plan.by is By.TIME else "step"
    parts = parts_of(scan, fids, row_groups, column)
    if plan.by is By.TIME:
        assert t0 is not None and plan.every is not None
        every = float(plan.every)
        parts = [
            dataclasses.replace(p, lo=math.floor((p.lo - t0) / every) if p.lo > -math.inf else p.lo)
            for p in parts
        ]
    order = sorted(range(len(parts)), key=lambda i: (parts[i].lo, i))
    chunks: list[list[int]] = []
    held = 0
    for i in order:
        if not chunks or (held and held + parts[i].rows > rows):
            chunks.append([])
            held = 0
        chunks[-1].append(i)
        held += parts[i].rows
    out = []
    for chunk in chunks:
        reads: list[tuple[int, list[int] | None]] = []
        size = 0
        for i in sorted(chunk):
            p, rep = parts[i], scan.report.files[parts[i].fid]
            size += rep.size * p.rows // max(rep.records, 1) if p.groups is not None else rep.size
            last = reads[-1] if reads else None
            if last is not None and p.groups is not None and last[0] == p.fid and last[1] is not None:
                last[1].extend(p.groups)  # the next row groups of the same file: one read
            else:
                reads.append((p.fid, None if p.groups is None else list(p.groups)))
        out.append(Task(reads, parts[chunk[0]].lo, size))
    return out


def data_order(scan: RunScan, fids: Sequence[int]) -> list[int]:
    """``fids`` in an order their contents fix, whatever the files are named or wherever
    they were copied: by source, attempt, first step and time, and bytes (as listed, so
    whatever was checked of them since); files alike in all of these by a digest of their
    bytes (read only for them). per_rank_no_reduce puts records of one time in this order,
    so a renamed run gives the same rows."""

    def described(fid: int) -> tuple[Any, ...]:
        rep = scan.report.files[fid]
        process, rank = rep.source or rep.single_source or _first_source(rep.path) or ("", -1)
        return (
            process,
            rank,
            rep.attempt_started or 0.0,
            rep.attempt or "",
            _known(rep.steps),
            _known(rep.timestamps),
            rep.format,
            rep.listed[0] if rep.listed is not None else rep.size,
        )

    keys = {fid: described(fid) for fid in fids}
    counts = Counter(keys.values())
    for fid, key in keys.items():
        if counts[key] > 1:  # as alike as their descriptions go: their bytes tell them apart
            keys[fid] = (*key, _digest(scan.report.files[fid].path))
    return sorted(fids, key=lambda fid: keys[fid])


def _known(declared: tuple[Any, Any] | None) -> tuple[Any, ...]:
    """A declared range as a sort key: none sorts first."""
    return () if declared is None else (declared,)


def _first_source(path: RunPath) -> tuple[str, int] | None:
    """The source of another tool's JSON lines file's first record (its footer-less kin of
    ``single_source``), so its place among the files is the same as a Parquet copy's."""
    if not path.name.endswith(".jsonl"):
        return None
    try:
        with open_read(path) as f:
            first = parse_json(f.readline(1 << 16))
        rank = first["rank"]
        if not isinstance(rank, int) or isinstance(rank, bool):
            return None
        return str(first.get("process") or default_process_name(rank)), rank
    except Exception as exc:
        raise_store_failure(path, exc)  # a store's failure fails the command, as any read of it
        if isinstance(exc, (OSError, ValueError, KeyError, TypeError)):
            return None  # gone, or not JSON: its reading says what is wrong
        raise


def _digest(path: RunPath) -> str:
    digest = hashlib.blake2b(digest_size=16)
    try:
        with open_read(path) as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    except Exception as exc:
        raise_store_failure(path, exc)  # a store's failure fails the command, as any read of it
        if isinstance(exc, OSError):
            return "~"  # gone or unreadable: its reading says so; here it only goes last
        raise
    return digest.hexdigest()


def parts_of(scan: RunScan, fids: Sequence[int], row_groups: bool, column: str = "timestamp") -> list[Part]:
    """Files as parts with the lowest value of ``column`` (timestamp or step) they may hold
    (``timeorder``): Parquet row groups by their footer's statistics when read through the
    dictionaries (``row_groups``; a checksummed segment's from its checked metadata, since
    no checksum covers the footer), else whole files by their writer's declared range; a
    file that declares none may hold any value (-inf)."""
    out: list[Part] = []
    for fid in fids:
        rep = scan.report.files[fid]
        groups = None
        if row_groups and rep.row_groups is not None:
            groups = [(float(t) if column == "timestamp" else s, n) for n, s, t in rep.row_groups]
        elif row_groups and rep.format == "parquet":
            groups = row_group_lows(rep.path, column)
        declared = rep.timestamps if column == "timestamp" else rep.steps
        if groups is not None:
            out += [Part(fid, (g,), lo, rows) for g, (lo, rows) in enumerate(groups)]
        elif declared is not None:
            out.append(Part(fid, None, declared[0], rep.records))
        else:
            out.append(Part(fid, None, -math.inf, rep.records))
    return out


@dataclass
class TaskWork:
    """What reduces one task's records, wherever it runs (a thread here, or a Ray worker:
    it pickles; the filters and the statistic chooser are made from the plan where it runs).

    Called with a task, it yields the task's records as partitions of about PARTITION_ROWS
    (cut where the reads' frames end, which the files fix), each reduced as soon as it is
    read; ``seen`` gathers the ranks and keys read."""

    plan: ReducePlan
    scan: RunScan
    dictionaries: bool
    kept: list[str]
    t0: float | None
    rows: int  # a partition's records (PARTITION_ROWS, as this process has it)
    direct: bool = False  # hand records over as rows where they may be (``partials.Rows``)

    def __call__(self, task: Task, seen: filters.Seen) -> Iterator[partials.Partial]:
        plan = self.plan
        match = key_matcher(plan.keys) if plan.keys else None
        statistic_of = statistic_chooser(plan)
        rows = self.rows
        pieces: list[pl.DataFrame] = []
        held = 0
        take_batch = None
        if takes_batches(plan):  # batches may go to the engine as pyarrow read them
            take_batch = functools.partial(
                partials.batch_partial,
                plan=plan,
                statistic_of=statistic_of,
                t0=self.t0,
                seen=seen,
                direct=self.direct,
            )
        for fid, groups in task.reads:
            batches = read_batches(
                plan, self.scan, fid, self.dictionaries, self.kept, groups, rows, seen, take_batch
            )
            for frame in batches:
                if isinstance(frame, partials.Partial):
                    yield frame
                    continue
                for start in range(0, frame.height, rows):  # a whole file read at once, too
                    pieces.append(key_matching(frame.slice(start, rows), match))
                    held += pieces[-1].height
                    if held >= rows:
                        records = pl.concat(pieces, how="vertical_relaxed")
                        yield partials.partition_states(records, plan, statistic_of, self.t0, self.direct)
                        pieces, held = [], 0
        if held:
            yield partials.partition_states(
                pl.concat(pieces, how="vertical_relaxed"), plan, statistic_of, self.t0, self.direct
            )


def read_batches(
    plan: ReducePlan,
    scan: RunScan,
    fid: int,
    dictionaries: bool,
    kept: list[str],
    row_groups: list[int] | None,
    rows: int | None,
    seen: filters.Seen,
    take_batch: Callable[[Any], T | None] | None = None,
) -> Iterator[pl.DataFrame | T]:
    """One file's ``kept`` columns (``columns_read``; or those of its ``row_groups``) as
    ``RunScan.batches`` reads them, the plan's rank and step filters applied. The ranks and
    keys read are noted in ``seen`` before the filters drop any. A batch ``take_batch``
    took (``RunScan.offered``) comes as it made it: no filter is applied to it, so it is
    given only where the plan has none (``takes_batches``)."""
    assert take_batch is None or takes_batches(plan)
    for df in scan.offered(
        fid, kept, take_batch, dictionaries=dictionaries, row_groups=row_groups, rows=rows
    ):
        if not isinstance(df, pl.DataFrame):
            yield df
            continue
        seen.add(
            df["rank"].unique() if seen.ranks is not None else None,
            df["key"].unique().cast(pl.String) if seen.keys is not None else None,
        )
        yield plan_filtered(plan, df.lazy(), kept).collect()


def takes_batches(plan: ReducePlan) -> bool:
    """Whether a plan's records may go to the engine as pyarrow read them
    (``partials.batch_partial``): in global_reduce, where no ``--ranks``, ``--steps`` or
    ``--key`` filter drops any."""
    return plan.mode is LoggingMode.GLOBAL_REDUCE and not (plan.ranks or plan.steps is not None or plan.keys)


def columns_read(plan: ReducePlan, scan: RunScan) -> list[str]:
    """The plan's input columns, and wherever a key's statistic may be first or last (a
    ``--reduce`` pattern, a file's declared reductions, or what its footer says its
    ``reduction`` column may hold) the timestamp, and the step, process and rank that break
    its ties. The same columns for every file of a run (``RunScan.offered`` adds the
    required fields of a file it does not trust, to check each record)."""
    every_key = any(set(pattern) == {"*"} for pattern, _ in plan.overrides)  # whatever was recorded
    first_last = any(s.name in FIRST_LAST for _, s in plan.overrides) or (
        not every_key and any(_may_record_first_last(rep) for rep in scan.report.files)
    )
    return sorted({*plan.input_columns, *(("timestamp", *TIE_COLUMNS) if first_last else ())})


FIRST_LAST = ("first", "last")
# Every spelling of first and last a file's reduction column may hold (they are read in
# any case)
_FIRST_LAST_SPELLINGS = tuple(
    "".join(letters) for name in FIRST_LAST for letters in itertools.product(*((c, c.upper()) for c in name))
)


def _may_record_first_last(rep: FileReport) -> bool:
    """Whether a file's records may name first or last: by the reductions its writer
    declared, or by the bounds of its reduction column (its footer's statistics). A name is
    read stripped of white space, in any case (``Statistic.parse``): between ASCII bounds,
    a text that starts with white space is below "!", and one that starts with a spelling
    of first or last lies from that spelling up to the texts it begins."""
    if rep.keys is not None:
        return any(r.strip().lower() in FIRST_LAST for _, r in rep.keys)
    if rep.reductions is None:
        return True
    low, high = rep.reductions
    if low[:1] <= " ":
        return True
    return any(high >= s and (low <= s or low.startswith(s)) for s in _FIRST_LAST_SPELLINGS)


def reads_dictionaries(scan: RunScan) -> bool:
    return sum(f.records for f in scan.report.files if f.format == "parquet") >= DICTIONARY_READ_RECORDS


def single_sources(scan: RunScan) -> dict[tuple[str, int], list[int]] | None:
    """Each source's files, when every file holds one source (the writer's, or another
    tool's whose footer says so); else None."""
    out: dict[tuple[str, int], list[int]] = {}
    for fid in scan.file_ids:
        rep = scan.report.files[fid]
        source = rep.source or rep.single_source
        if source is None:
            return None
        out.setdefault(source, []).append(fid)
    return out


def first_time(plan: ReducePlan, scan: RunScan) -> float:
    """The earliest timestamp among the records the filters keep: where ``--by time`` windows
    start. What the files declare tells it when it is exact (``_declared_first_time``);
    else every file is read for it (``_read_first_time``)."""
    declared = _declared_first_time(plan, scan)
    if declared is not None:
        return declared
    return _read_first_time(plan, scan)


def _read_first_time(plan: ReducePlan, scan: RunScan) -> float:
    """The earliest timestamp of the records kept, from a read of every file on the engine's
    threads, as the reduction reads it (``RunScan.batches``, the columns it reads): another
    tool's rows checked and counted, a damaged row group skipped (and skipped by the
    reduction too), so the windows start at a record the reduction reads."""
    from metric_core.offline.engine.pool import on_threads

    match = key_matcher(plan.keys) if plan.keys else None
    # the keys of the records the rank and step filters keep, to name what a --key matched
    seen = dataclasses.replace(filters.Seen.wanted_by(plan), ranks=None) if plan.keys else filters.Seen()
    fields = sorted({*columns_read(plan, scan), "key", "rank", "step", "timestamp"})

    def lows(fid: int) -> Iterator[float]:
        for df in read_batches(plan, scan, fid, True, fields, None, PARTITION_ROWS, filters.Seen()):
            seen.add(None, df["key"].unique().cast(pl.String))
            low = key_matching(df, match)["timestamp"].min()
            if low is not None:
                yield float(low)  # type: ignore[arg-type]

    fids = scan.file_ids
    found = on_threads(lows, fids, [scan.report.files[fid].size for fid in fids], None)
    t0 = min((low for _, low in found if low is not None), default=None)
    if t0 is None:  # named as the engine names them, with the keys of the records kept
        raise nothing_kept(plan, scan, filters.unmatched(plan, seen))
    return t0


def _declared_first_time(plan: ReducePlan, scan: RunScan) -> float | None:
    """The earliest timestamp of the records kept, from what the run's files declare
    without a read of their records: the earliest time of each row group of the writer's
    checksummed segments (else of each of its segments), of each row group of another
    tool's Parquet file where its footer shows that record is kept (``kept_first_times``).
    The earliest of these is where the windows start if its row group reads, checked as
    the reduction will read it (``RunScan.reads_whole``): a damaged one is skipped there,
    and the next earliest is taken. With ``--ranks``, of the files of the ranks kept, where
    every file holds one source. None when a key or step filter or a restart's rewind
    drops records, or a file declares nothing exact."""
    if plan.keys or plan.steps is not None:
        return None
    fids = scan.file_ids
    if plan.ranks:
        sources = single_sources(scan)
        if sources is None:
            return None
        kept = [ids for (_, rank), ids in sources.items() if any(lo <= rank <= hi for lo, hi in plan.ranks)]
        fids = [fid for ids in kept for fid in ids]
    lows: list[tuple[float, int, int | None]] = []  # (time, file, its row group, or None: the file)
    for fid in fids:
        rep = scan.report.files[fid]
        if rep.replaced_from is not None:
            return None
        if scan.trusted(fid) and rep.row_groups is not None:  # the writer's, checksummed
            lows += [(t, fid, g) for g, (_, _, t) in enumerate(rep.row_groups)]
        elif scan.trusted(fid) and rep.timestamps is not None:  # the writer's, trusted
            lows.append((rep.timestamps[0], fid, None))
        elif rep.format == "parquet" and not scan.trusted(fid):  # another tool's: its footer
            times = kept_first_times(rep.path)
            if times is None:
                return None
            lows += [(t, fid, g) for g, t in enumerate(times)]
        else:
            return None
    fields = columns_read(plan, scan)
    for low, fid, group in sorted(lows):
        if group is None or scan.reads_whole(fid, fields, [group]):
            lo, hi = TIMESTAMP_RANGE
            return low if lo <= low < hi else None  # else a time no clock's: the record is skipped
    return None
