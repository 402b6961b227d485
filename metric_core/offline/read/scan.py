"""``scan_run``: a run directory read lazily into ``RunScan`` (every file's frame, and the
health report), whose files are checked as they are read, by the scan itself."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import polars as pl
from polars.exceptions import PanicException

from metric_core.errors import NoDataError, RunChangedError
from metric_core.format.schema import KEY_HASH, REQUIRED_FIELDS
from metric_core.format.segment import Damaged, SegmentMeta
from metric_core.offline.read.attempts import REWIND, resolve
from metric_core.offline.read.discover import (
    Derived,
    copies,
    list_data_files,
    listed_writer_meta,
    read_run_json,
    superseded_tails,
    take_attempt,
    writer_meta,
)
from metric_core.offline.read.failures import all_skipped, is_read_failure
from metric_core.offline.read.interned import categorical_keys
from metric_core.offline.read.journal import read_journal
from metric_core.offline.read.jsonl import read_jsonl
from metric_core.offline.read.parquet import (
    BatchTaken,
    NotTheFile,
    categorical_batches,
    check_groups,
    drop_bad_rows,
    pages_carry_checksums,
    run_parquet_checks,
    scan_parquet,
    verify,
)
from metric_core.offline.read.report import COUNTING, FileReport, ReadReport, rel
from metric_core.offline.read.validate import RECORD_OK
from metric_core.offline.storage import (
    RunPath,
    is_remote,
    is_store_failure,
    name_of,
    not_a_directory,
    run_path,
    size_and_mtime,
    storage_errors,
)

T = TypeVar("T")


@functools.cache
def fetch_numpy_api() -> None:
    """polars hands arrays to numpy through numpy's C API, which it fetches the first time;
    a Ctrl-C or SIGTERM raised in the Python code of that fetch makes it panic (a Rust
    traceback) where the command would otherwise stop cleanly. Fetched once: by the
    command line as it starts, and by ``scan_run`` and ``read_sealed`` for a library
    caller. A stop that comes meanwhile is held (blocked in this thread) until it is done,
    for that moment only: blocked, not handled, so no handler is replaced, e.g. the
    writer's in a process that does both (``metric_core.writer.ends``)."""
    stops = {signal.SIGINT, signal.SIGTERM}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    try:
        pl.Series([0.0]).to_numpy()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


# Called with the health report as soon as a run is read, before anything can fail on it,
# so a caller can say what was skipped even when the command then fails.
OnRead = Callable[[ReadReport], None]
# Called as the files are read: (parts done, parts, bytes done, bytes).
OnProgress = Callable[[int, int, int, int], None]


@dataclass
class RunScan:
    """A run directory read lazily: each file's frame in the record schema (plus
    ``file_id``), the run's ``meta`` (run.json) and its health ``report``.

    Ask it for data: ``frame`` (the whole run), ``file_frame`` (one file) or ``batches``
    (one file, read once, in frames). Each file's rows are checked the first time they
    are read, however they are asked for: another tool's rows (nulls, non-numbers, bad
    times) counted in the report and dropped, a checksummed segment's pages verified. The
    report is whole once every file was read.
    """

    run_dir: RunPath
    report: ReadReport
    meta: dict[str, Any]
    _parts: dict[int, pl.LazyFrame] = field(default_factory=dict)  # file_id -> that file's frame
    # Another tool's files whose rows are not checked yet (fid -> its check query), and
    # those checked and counted already: a later read drops their bad rows, uncounted.
    _pending: dict[int, pl.LazyFrame | None] = field(default_factory=dict)
    _counted: set[int] = field(default_factory=set)
    # Records handed over per file, and the files that failed as they were read (skipped
    # from there on, said in the report; ``batches`` reads them no more).
    _taken: dict[int, int] = field(default_factory=dict)
    _failed: set[int] = field(default_factory=set)
    # Files as an earlier scan read them whole (``scan_run``'s ``earlier``): their counts are its.
    _unchanged: set[int] = field(default_factory=set)
    _counting: threading.Lock = field(default=COUNTING, repr=False)  # one lock for every report's counts

    def __getstate__(self) -> dict[str, Any]:  # to a Ray worker (--engine ray): not the lock
        return {k: v for k, v in self.__dict__.items() if k != "_counting"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _counting=COUNTING)

    @property
    def file_ids(self) -> list[int]:
        """The ids of the files read (their reports: ``report.files[file_id]``), in path order."""
        return list(self._parts)

    @property
    def frame(self) -> pl.LazyFrame:
        """The whole run as one frame, every file checked first (another tool's files, not
        read yet, are read once more for it: a reader of one file at a time reads less)."""
        self._check_all()
        return pl.concat(list(self._parts.values()), how="vertical")

    def file_frame(self, fid: int) -> pl.LazyFrame:
        """One file's frame, its pages verified first. Another tool's rows that fail their
        check are left out here, and counted in the report by the read that checks the whole
        file (``batches``, ``frame``): a file read in parts is never counted twice."""
        self._verify([fid])
        part = self._parts[fid]
        return part.filter(RECORD_OK) if fid in self._pending else part

    def trusted(self, fid: int) -> bool:
        """The file's rows need no check (the writer's): what its metadata declares of them
        (their steps and times) holds."""
        return fid not in self._pending and fid not in self._counted

    def reads_whole(self, fid: int, fields: list[str], row_groups: list[int] | None = None) -> bool:
        """Whether a read of the file's record ``fields`` gives every record it holds (of its
        ``row_groups``, None: all): what its metadata declares of them holds only then. A
        Parquet file's row groups are read once for it, checked as every read checks them
        (``check_groups``): one that fails is counted in the report, and skipped by every
        read after. A file given up on does not; another's damage (a JSONL segment's
        blocks, a journal's frames) was found as it was listed."""
        rep = self.report.files[fid]
        if fid in self._failed or rep.unreadable is not None:
            return False
        return rep.format != "parquet" or check_groups(rep, fields, row_groups)

    def checks_as_read(self, fid: int) -> bool:
        """A read of the file checks its rows or verifies its pages as it goes: read it
        once, with ``batches``, rather than through a query over ``file_frame``."""
        rep = self.report.files[fid]
        return not self.trusted(fid) or (rep.page_checksums is True and not rep.verified)

    def unchanged(self, fid: int) -> bool:
        """The file is as the ``earlier`` scan given to ``scan_run`` listed it (its
        ``FileReport.identity``), and its counts in the report are that scan's, whole: a
        file that needs no read for them now. What a caller kept of its read of the file
        then (keyed on the identity) still holds."""
        return fid in self._unchanged

    def _take_counts(self, earlier: RunScan) -> None:
        """The counts of each file ``earlier`` read whole (checked, not given up on) that is
        unchanged since (``FileReport.identity``). Another tool's file counts once it was read
        whole; the writer's files need no read for their counts (what their metadata
        declares), but a checksummed segment with a damaged row group is left out: a read of
        it verifies its pages again (and would count the damage twice)."""
        files = earlier.report.files
        whole = {
            files[fid].identity: files[fid]
            for fid in earlier.file_ids
            if fid not in earlier._pending
            and fid not in earlier._failed
            and not (files[fid].page_checksums is True and files[fid].skipped)
        }
        for fid in self.file_ids:
            rep = self.report.files[fid]
            before = whole.get(rep.identity) if rep.identity is not None else None
            if before is not None:
                rep.records, rep.skipped = before.records, before.skipped
                rep.skip_reasons = dict(before.skip_reasons)
                self._counted_now(fid)
                self._unchanged.add(fid)

    @property
    def full_report(self) -> ReadReport:
        """The health report with every file checked (another tool's files not read yet are
        read for it now): what a caller that must know of any skip before it reads asks."""
        self._check_all()
        return self.report

    def for_other_processes(self) -> RunScan:
        """The scan, every file checked and verified now, to be read in other processes
        (Ray workers), whose counts could not reach this report."""
        self._check_all()
        return self

    def _checked(self, fid: int, df: pl.DataFrame, start: int) -> pl.DataFrame:
        """A file's records (whole, or some of its row groups, each read once; the first of
        them its row ``start``, from 0): an unchecked file's bad rows counted in the report
        and dropped. Safe from several threads."""
        if fid in self._pending:
            with self._counting:
                return drop_bad_rows(df, self.report.files[fid], start)
        if fid in self._counted:
            return df.filter(RECORD_OK)
        return df

    def batches(
        self,
        fid: int,
        columns: list[str],
        *,
        dictionaries: bool = True,
        row_groups: list[int] | None = None,
        rows: int | None = None,
    ) -> Iterator[pl.DataFrame]:
        """One file's ``columns`` (or those of its ``row_groups``), read once and checked
        (``_checked``), a restart's rewind applied, strings as polars Categorical. With
        ``dictionaries``, Parquet is read by pyarrow in frames of at most ``rows`` records
        (None: one frame), its strings kept as dictionary codes, never decoded
        (``categorical_batches``); another file is one frame. A file not checked yet is
        also read with the fields its check needs; read whole, it is then counted (a later
        read drops its bad rows without counting them again)."""
        for df in self.offered(
            fid, columns, None, dictionaries=dictionaries, row_groups=row_groups, rows=rows
        ):
            assert isinstance(df, pl.DataFrame)
            yield df

    def offered(
        self,
        fid: int,
        columns: list[str],
        take_batch: Callable[[Any], T | None] | None,
        *,
        dictionaries: bool = True,
        row_groups: list[int] | None = None,
        rows: int | None = None,
    ) -> Iterator[pl.DataFrame | T]:
        """``batches``, where a Parquet batch read through the dictionaries whose records
        need no cast, fill or drop is first offered to ``take_batch`` as pyarrow read it (its
        columns as ``batches`` would have them, strings as dictionary arrays): what it
        makes of it (not None) comes instead of its frame, its records counted as read.
        What ``take_batch`` raises is raised as it is: the caller's failure, not the file's."""
        rep = self.report.files[fid]
        columns = sorted({*columns, *(REQUIRED_FIELDS if not self.trusted(fid) else ())})
        if fid in self._failed or rep.unreadable is not None:  # given up on (by a check of it, say)
            yield self._no_records(fid, columns)
            return
        given = False
        try:
            for start, got in self._frames(rep, fid, columns, dictionaries, row_groups, rows, take_batch):
                out: pl.DataFrame | T
                if isinstance(got, BatchTaken):
                    records, out = got.records, got.value
                else:
                    out = self._checked(fid, got, start)
                    records = out.height
                with self._counting:
                    self._taken[fid] = self._taken.get(fid, 0) + records
                given = True
                yield out
        except NotTheFile as exc:  # the caller's own failure
            raise exc.failure from None
        except (Exception, PanicException) as exc:
            if not is_read_failure(exc) or is_store_failure(exc):
                raise
            self._give_up(fid, exc)
            if not given:
                yield self._no_records(fid, columns)
            return
        if row_groups is None:  # read whole: its bad rows are counted
            self._counted_now(fid)

    def _frames(
        self,
        rep: FileReport,
        fid: int,
        columns: list[str],
        dictionaries: bool,
        row_groups: list[int] | None,
        rows: int | None,
        take_batch: Callable[[Any], T | None] | None = None,
    ) -> Iterator[tuple[int, pl.DataFrame | BatchTaken[T]]]:
        """The file's frames, each with the number of its first row in the file (from 0)."""
        if rep.format == "parquet":  # by pyarrow: page checksums verified, a failing row group skipped
            # A restart's rewind (the scan's frames have it) drops records by their step,
            # which the columns asked for need not hold (global_reduce --by time reads none).
            rewind = rep.replaced_from
            if rewind is None:
                yield from categorical_batches(
                    rep.path, columns, rep.hashed, row_groups, rows, rep=rep, take_batch=take_batch
                )
                return
            step_added = "step" not in columns
            read = [*columns, "step"] if step_added else columns
            frames: Iterator[tuple[int, pl.DataFrame | BatchTaken[None]]]
            frames = categorical_batches(rep.path, read, rep.hashed, row_groups, rows, rep=rep)
            for start, df in frames:  # the writer's: trusted, not checked (its rows not told)
                assert isinstance(df, pl.DataFrame)  # nothing taken
                df = df.filter(pl.col("step") < rewind)
                yield start, df.drop("step") if step_added else df
        else:
            assert row_groups is None, "row groups are read through the dictionaries"
            frame = self._parts[fid].select(columns).collect()
            strings: list[str] = [c for c in ("reduction", "process") if c in columns]
            if "key" in columns and categorical_keys(frame["key"].unique()):  # else too many: as text
                strings.append("key")
            yield 0, frame.with_columns(pl.col(strings).cast(pl.Categorical))

    def _no_records(self, fid: int, columns: list[str]) -> pl.DataFrame:
        """A frame of no records, typed as the file's frames are."""
        schema = self._parts[fid].select(columns).collect_schema()
        strings = {c: pl.Categorical() for c in ("key", "reduction", "process") if c in schema}
        return pl.DataFrame(schema={**dict(schema), **strings})

    def _give_up(self, fid: int, exc: BaseException) -> None:
        """A file that fails as it is read: the run changed (it did, since it was listed:
        ``RunChangedError``, run again), or the file cannot be read (its records not read
        yet are skipped and said, and the rest of the run is read)."""
        rep = self.report.files[fid]
        try:
            now: tuple[int, int] | None = size_and_mtime(rep.path)
        except OSError:
            now = None
        name = rel(rep.path, self.run_dir)
        if rep.listed is not None and now != rep.listed:
            raise RunChangedError(
                f"{name} changed while it was read ({'gone' if now is None else 'its size or time differ'}): "
                "run again once it is complete"
            ) from None
        with self._counting:
            if fid in self._failed:
                return
            self._failed.add(fid)
            rep.give_up(exc, self._taken.get(fid, 0))

    def _counted_now(self, fid: int) -> None:
        """A file not checked yet has had its bad rows counted in the report (read whole,
        or counted by an earlier read of it): a later read drops them without counting."""
        with self._counting:
            if self._pending.pop(fid, False) is not False:
                self._counted.add(fid)
                self._parts[fid] = self._parts[fid].filter(RECORD_OK)

    def _check_all(self) -> None:
        """Check every unchecked file now (for a query over ``frame`` rather than per file),
        and verify every checksummed segment not verified yet (``frame`` reads them with
        polars, which checks no page checksum)."""
        self._verify(list(self._parts))
        self._check(list(self._pending))

    def _check(self, fids: list[int]) -> None:
        """Check the unchecked files among ``fids`` in one query (their counts in the report).
        Under the lock: a file counted meanwhile by a read of it is not counted again."""
        with self._counting:
            todo = [fid for fid in fids if fid in self._pending]
            if not todo:
                return
            frames = [self._parts[fid] for fid in todo]
            run_parquet_checks(
                frames, [(i, self.report.files[fid], self._pending[fid]) for i, fid in enumerate(todo)]
            )
            for fid, frame in zip(todo, frames, strict=True):
                self._parts[fid] = frame
                self._counted.add(fid)
                del self._pending[fid]

    def _verify(self, fids: list[int]) -> None:
        """Verify the checksummed segments among ``fids`` not verified yet, so that a query
        over their frames (polars, which checks no page checksum) reads only what checks."""
        for fid in fids:
            rep, frame = self.report.files[fid], self._parts[fid]
            good = _verified(rep, frame)
            if good is not frame:  # a row group was damaged: the others, as ``resolve`` left them
                if rep.replaced_from is not None:
                    good = good.filter(pl.col("step") < rep.replaced_from)
                if fid in self._counted:  # its bad rows counted already: dropped, as before
                    good = good.filter(RECORD_OK)
                with self._counting:
                    self._parts[fid] = _framed(good, rep, fid)

    @property
    def name(self) -> str:
        return str(self.meta.get("name") or name_of(self.run_dir))

    def first_timestamps(self) -> dict[tuple[str, int], float]:
        """Each source's earliest record time: declared by the writer, or read from the rest."""
        first: dict[tuple[str, int], float] = {}
        rest = []
        for fid in self._parts:
            rep = self.report.files[fid]
            if rep.source is not None and rep.timestamps is not None:
                first[rep.source] = min(first.get(rep.source, math.inf), rep.timestamps[0])
            else:  # rows as listed, unchecked (the upload ids made of these must not change)
                self._verify([fid])  # but pages that fail their checksums are not read
                rest.append(self._parts[fid])
        if rest:
            found = pl.concat(rest).group_by("process", "rank").agg(pl.col("timestamp").min())
            for process, rank, ts in found.collect(engine="streaming").iter_rows():
                first[(process, rank)] = min(first.get((process, rank), math.inf), ts)
        return first


def scan_run(
    run_dir: str | os.PathLike[str],
    *,
    follow_symlinks: bool = False,
    attempts: str = REWIND,
    defer_checks: bool = False,
    earlier: RunScan | None = None,
) -> RunScan:
    """Read every metric file below ``run_dir`` into one LazyFrame and a health report.

    ``run_dir`` itself may be a symlink; below it, symlinks that lead out of it are
    skipped (and said) unless ``follow_symlinks``. ``attempts`` says how a source's
    restarts are read (``offline.read.attempts``): ``"rewind"`` (a restart replaces the
    earlier attempts' records from its first step on), ``"all"``, or an attempt id.
    Raises NoDataError when the directory has no readable record.

    Another tool's Parquet files are checked row by row (nulls, values that are not
    numbers, timestamps that are not a clock's) before the scan returns, which reads them
    once more. With ``defer_checks`` they are not: each is checked as it is first read
    (``RunScan.batches`` reads it once; ``trusted`` tells it apart), and the report is
    complete once every such file was read.

    ``earlier``, a scan of the same run made before (``watch``'s last poll), gives the
    counts of each file unchanged since (``FileReport.identity``) whose counts it had
    whole (``RunScan.unchanged``): such a file needs no read for the report to be whole.

    >>> scan = scan_run("sample_logs/rl_run")
    >>> scan.frame.select(pl.len()).collect().item(), scan.report.skipped_records
    (16200, 25)
    """
    fetch_numpy_api()
    root = run_path(run_dir)
    if isinstance(root, Path) and not root.is_dir():
        raise NoDataError(str(root), not_a_directory(root))
    report = ReadReport(run_dir=root)
    with storage_errors(root):
        paths = list_data_files(root, report, follow_symlinks=follow_symlinks)
        meta = read_run_json(root, report)
        found = {  # each footer or first line read once (an object's, once per version of it)
            p: listed_writer_meta(p, *size_and_mtime(p)) if is_remote(p) else writer_meta(p) for p in paths
        }
    for path, what in found.items():
        if isinstance(what, Derived):
            report.notices.append(
                f"{rel(path, root)}: a result metriclog wrote ({what.command}), not data: not read"
            )
        elif isinstance(what, Damaged):
            report.notices.append(
                f"{rel(path, root)}: {what.reason} (the file is damaged): ignored; its records are "
                "read and checked as another tool's"
            )
    metas = {p: None if isinstance(m, Damaged) else m for p, m in found.items() if not isinstance(m, Derived)}
    paths = list(metas)
    copied = copies(metas)
    for copy, original in copied.items():
        report.notices.append(
            f"{rel(copy, root)} is a copy of {rel(original, root)} (the same sealed segment): read once"
        )
        del metas[copy]
    paths = [p for p in paths if p not in copied]
    for path, declared in metas.items():
        if declared is not None and declared.ignored:
            report.notices.append(
                f"{rel(path, root)}: its metriclog metadata has malformed field(s) "
                f"{', '.join(declared.ignored)}: ignored; its records are read and checked"
            )
    superseded = superseded_tails(
        {p: m for p, m in found.items() if p in paths and not isinstance(m, Derived)}
    )
    frames: list[pl.LazyFrame] = []
    checks: list[tuple[int, FileReport, pl.LazyFrame | None]] = []
    file_ids: list[int] = []
    for path in paths:
        suffix = path.suffix
        rep = FileReport(path=path, format=suffix.lstrip("."))
        with contextlib.suppress(OSError):
            rep.listed = size_and_mtime(path)
        report.files.append(rep)
        if path in superseded:
            rep.superseded_by = superseded[path]
            continue
        take_attempt(rep, metas[path])
        if suffix == ".parquet" and isinstance(found[path], Damaged):
            rep.page_checksums = True  # the writer's file
        check: pl.LazyFrame | None = None
        trusted = True
        if suffix == ".parquet":
            frame, trusted, check = scan_parquet(path, metas[path], rep, report)
        elif suffix == ".journal":
            frame = read_journal(path, rep, report)
        else:
            frame = read_jsonl(path, metas[path], rep, report)
        if frame is not None and not defer_checks:
            frame = _verified(rep, frame)
        if frame is not None:
            if not trusted:
                checks.append((len(frames), rep, check))
            frames.append(_framed(frame, rep, len(report.files) - 1))
            file_ids.append(len(report.files) - 1)
    pending = {file_ids[i]: query for i, _, query in checks} if defer_checks else {}
    if not defer_checks:
        run_parquet_checks(frames, checks)
    restarted = _restarted(report, file_ids)
    for i, fid in enumerate(file_ids):  # a restart's rewind counts records with polars: verified first
        if report.files[fid].source in restarted:
            frames[i] = _framed(_verified(report.files[fid], frames[i]), report.files[fid], fid)
    kept = resolve(report, dict(zip(file_ids, frames, strict=True)), attempts)
    frames = [kept[fid] for fid in file_ids]
    if not paths:
        raise NoDataError(str(root), "no *.jsonl or *.parquet file was found")
    if not frames or report.records == 0:
        raise all_skipped(report)
    scan = RunScan(
        run_dir=root,
        report=report,
        meta=meta,
        _parts=dict(zip(file_ids, frames, strict=True)),
        _pending=pending,
    )
    if earlier is not None:
        scan._take_counts(earlier)
    return scan


def _restarted(report: ReadReport, fids: list[int]) -> set[tuple[str, int]]:
    """The sources of more than one attempt among the files ``fids``."""
    attempts: dict[tuple[str, int], set[str | None]] = {}
    for fid in fids:
        rep = report.files[fid]
        if rep.source is not None:
            attempts.setdefault(rep.source, set()).add(rep.attempt)
    return {source for source, found in attempts.items() if len(found) > 1}


def _framed(frame: pl.LazyFrame, rep: FileReport, fid: int) -> pl.LazyFrame:
    """A file's frame as a ``RunScan`` holds it: with ``key_hash`` and ``file_id``."""
    if not rep.hashed:
        frame = frame.with_columns(pl.lit(None, pl.Int64).alias(KEY_HASH))
    return frame.with_columns(file_id=pl.lit(fid, pl.Int32))


def _verified(rep: FileReport, frame: pl.LazyFrame) -> pl.LazyFrame:
    """A file's ``frame``; a Parquet file whose pages carry checksums (``page_checksums``;
    another tool's, as its first page says) verified first, once (``verify``): the frame of
    its undamaged row groups when one is damaged."""
    if rep.format != "parquet" or rep.verified:
        return frame
    if rep.page_checksums is None:
        rep.page_checksums = pages_carry_checksums(rep.path)
    if not rep.page_checksums:
        return frame
    rep.verified = True
    good = verify(rep)
    return frame if good is None else good


def read_sealed(
    path: RunPath, report: ReadReport, meta: SegmentMeta | None
) -> tuple[pl.DataFrame | None, FileReport]:
    """One Parquet or JSONL file (a sealed segment, or another tool's file) read whole and
    checked as ``scan_run`` reads it: its records, or None, and its report (in ``report``)."""
    fetch_numpy_api()
    rep = FileReport(path=path, format=path.suffix.lstrip("."))
    report.files.append(rep)
    take_attempt(rep, meta)
    if path.suffix == ".parquet":
        frame, trusted, check = scan_parquet(path, meta, rep, report)
        if frame is not None:
            frame = _verified(rep, frame)
        if frame is not None and not trusted:
            frames = [frame]
            run_parquet_checks(frames, [(0, rep, check)])
            frame = frames[0]
    else:
        frame = read_jsonl(path, meta, rep, report)
    return (None if frame is None else frame.collect()), rep
