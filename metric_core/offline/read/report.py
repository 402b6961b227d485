"""What reading a run directory found: per file, what was read, skipped and why."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from metric_core.errors import Message, as_keyword, opt, spell_options
from metric_core.format.life import Life
from metric_core.offline.storage import RunPath, is_remote

MAX_LINES_KEPT = 1000


# Held while a count of a FileReport changes: the engine reads files from several threads.
COUNTING = threading.Lock()


@dataclass
class FileReport:
    """What reading one file gave."""

    path: RunPath
    format: str
    records: int = 0
    skipped: int = 0
    # the first skipped records, each (its line from 1; a Parquet file's row from 0, as
    # pyarrow and polars number them) and why
    skipped_lines: list[tuple[int, str]] = field(default_factory=list)
    skip_reasons: dict[str, int] = field(default_factory=dict)
    truncated: bool = False
    unreadable: str | None = None
    # What its writer declared: the (key, reduction) pairs of its records (a superset),
    # their step and time ranges; ``hashed`` when its frame carries the key_hash column.
    keys: list[tuple[str, str]] | None = None
    steps: tuple[int, int] | None = None
    timestamps: tuple[float, float] | None = None
    hashed: bool = False
    # Per (key, reduction): records, first and last step and time, non-finite values, as
    # its writer declared them (``SegmentMeta.key_stats``; files sealed since 2026-12-06).
    key_stats: tuple[tuple[str, str, int, int, int, float, float, int], ...] | None = None
    superseded_by: str | None = None
    source: tuple[str, int] | None = None  # set when the writer's metadata vouches for one source
    # What the writer could not write and dropped (its D frames): {"records", "steps", ...}.
    dropped: list[dict[str, Any]] = field(default_factory=list)
    # The writer's attempt (see ``offline.read.attempts``), when the file records it.
    attempt: str | None = None
    attempt_started: float | None = None
    attempt_first_step: int | None = None
    # What its writer recorded of the attempt's life (flush times, heartbeat, end events).
    life: Life | None = None
    # Its records from this step on are replaced by a later attempt's (and not read).
    replaced_from: int | None = None
    # Another tool's file whose footer says all its records are of one (process, rank):
    # the engine reads it with that source's files (attempts do not apply to it).
    single_source: tuple[str, int] | None = None
    # Another tool's Parquet file: the least and the greatest of its ``reduction`` column,
    # as its footer's statistics give them (ASCII text), when every row group has them.
    reductions: tuple[str, str] | None = None
    # A sealed Parquet segment whose pages carry checksums: what its (checked) metadata
    # declares of each row group (records, lowest step, earliest time), and the row groups
    # found damaged so far (skipped, their records counted in ``skipped``).
    row_groups: tuple[tuple[int, int, float], ...] | None = None
    damaged_groups: set[int] = field(default_factory=set)
    # Its pages carry checksums: the writer's Parquet file (a sealed segment, or one whose
    # metadata is damaged), or another tool's that wrote them (None: not looked at yet).
    # Its row groups are verified before polars reads it (polars checks no page checksum,
    # and a damaged page may not decode: ``scan._verified``).
    page_checksums: bool | None = None
    verified: bool = False  # every row group read once to verify it
    # (bytes, mtime in ns) before its records were read: a file that still shows these is
    # the file that was read (``identity``).
    listed: tuple[int, int] | None = None

    @property
    def identity(self) -> tuple[Any, ...] | None:
        """What the file's records as read depend on: the file as it was listed (its size
        and time) and how it was read (a restart's rewind, its keys' hashes). None when it
        could not be listed. Two scans that give a file the same identity read the same
        records from it (``scan_run``'s ``earlier``; inspect's cache keys aggregates on it)."""
        if self.listed is None:
            return None
        return (str(self.path), self.listed, self.replaced_from, self.hashed)

    @property
    def size(self) -> int:
        """The file's bytes now (0 if it is gone): what progress is counted in. (An object in
        object storage: its bytes when listed, without asking the store again.)"""
        if self.listed is not None and is_remote(self.path):
            return self.listed[0]
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    @property
    def dropped_records(self) -> int:
        return sum(int(d.get("records", 0)) for d in self.dropped)

    def give_up(self, exc: BaseException, taken: int = 0) -> None:
        """The file failed as it was read, after ``taken`` of its records: the rest skipped
        (and the file named unreadable when none of it was read)."""
        lost, self.records = max(self.records - taken, 0), taken
        why = f"{type(exc).__name__}: {exc}".splitlines()[0]
        if taken:
            self.skip(f"unreadable from record {taken + 1:,} on ({why})", lost)
        else:
            self.unreadable = f"{why}; its {lost:,} record(s) not read"
            self.skipped += lost

    def skip(self, reason: str, count: int = 1, lines: list[int] | None = None) -> None:
        self.skipped += count
        self.skip_reasons[reason] = self.skip_reasons.get(reason, 0) + count
        for line in lines or []:
            if len(self.skipped_lines) < MAX_LINES_KEPT:
                self.skipped_lines.append((line, reason))


@dataclass
class MixedKey:
    """A key recorded under more than one reduction: the one kept (its first record's),
    and the records under each other one, skipped."""

    key: str
    kept: str
    skipped: dict[str, int] = field(default_factory=dict)
    sources: set[str] = field(default_factory=set)  # that recorded them, where the mode tells
    # kept as that of the key's first record in the run; else the first met as files were
    # read (another tool's files declare no keys, so a second reduction shows up late)
    first_record: bool = True

    def text(self) -> str:
        others = ", ".join(f"{n:,} record(s) under '{r}'" for r, n in sorted(self.skipped.items()))
        by = f" (by {', '.join(sorted(self.sources))})" if self.sources else ""
        why = "that of its first record" if self.first_record else "the first one read"
        return (
            f"key '{self.key}' is recorded under more than one reduction: {others}{by} skipped, "
            f"'{self.kept}' ({why}) kept; reduce them all with " + opt("reduce") + f"'{self.key}=STAT'"
        )


@dataclass
class Shutdown:
    """A clean end recorded by a writer's shutdown()."""

    process: str
    rank: int
    timestamp: float | None
    attempt: str | None = None  # of the writer that shut down, when its file says


@dataclass
class ReadReport:
    """The health of a run directory: per file, what was read and what was skipped."""

    run_dir: RunPath
    files: list[FileReport] = field(default_factory=list)
    shutdowns: list[Shutdown] = field(default_factory=list)
    # (path, why), not read; a URL as text for an object whose key no path names
    skipped_paths: list[tuple[RunPath | str, str]] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)  # read anyway: run.json problems, duplicates
    # Why run.json is damaged (not JSON, or failing its checksum), if it is: its metadata was
    # ignored, and upload refuses to take another identity than its run_id.
    run_json_damaged: str | None = None
    attempts: list[Any] = field(default_factory=list)  # offline.read.attempts.Attempt, per source
    # Each attempt's life, its files' merged: (process, rank, attempt id) -> Life.
    lives: dict[tuple[str, int, str], Life] = field(default_factory=dict)
    # Keys recorded under more than one reduction (filled as a reduction reads the records).
    mixed: dict[str, MixedKey] = field(default_factory=dict)
    unit: str = "record"  # what its files hold, as the summary counts them: "sample" for samples

    @property
    def skipped_records(self) -> int:
        return sum(f.skipped for f in self.files) + sum(sum(m.skipped.values()) for m in self.mixed.values())

    @property
    def unreadable_files(self) -> list[FileReport]:
        return [f for f in self.files if f.unreadable is not None]

    @property
    def records(self) -> int:
        return sum(f.records for f in self.files)

    @property
    def has_skips(self) -> bool:
        """Whether anything written was not read: skipped records or files, damage, records the
        writers dropped. (Notices, such as a restart's replaced records, are not skips.)"""
        return (
            self.skipped_records > 0
            or bool(self.unreadable_files)
            or bool(self.skipped_paths)
            or any(f.skip_reasons for f in self.files)
            or self.dropped_records > 0
        )

    @property
    def dropped_records(self) -> int:
        """Records the writers recorded but could not write (counted in the files, see inspect)."""
        return sum(f.dropped_records for f in self.files)

    def clean_shutdowns(self) -> set[tuple[str, int]]:
        """The sources whose latest attempt shut down cleanly (a restart that then died did not)."""
        latest = {(a.process, a.rank): a.attempt for a in self.attempts}  # attempts are oldest first
        return {
            (s.process, s.rank)
            for s in self.shutdowns
            if s.attempt is None or latest.get((s.process, s.rank), s.attempt) == s.attempt
        }

    def summary(
        self, max_files: int = 8, max_lines: int = 3, spelling: Callable[[str], str] | None = as_keyword
    ) -> str:
        """A short multi-line summary of every skip, for stderr; '' when nothing was skipped.
        Options it names are spelled by ``spelling`` (None: left marked, ``errors.spell_options``)."""
        text = self._summary(max_files, max_lines)
        return text if spelling is None else spell_options(text, spelling)

    def _summary(self, max_files: int, max_lines: int) -> str:
        bad = [f for f in self.files if f.skipped or f.unreadable or f.skip_reasons]
        gaps = [f for f in self.files if f.dropped]
        mixed = any(m.skipped for m in self.mixed.values())
        if not (bad or gaps or self.skipped_paths or self.notices or mixed):
            return ""
        not_read = f", {len(self.skipped_paths)} path(s) not read" if self.skipped_paths else ""
        if bad or self.skipped_paths or mixed:
            head = (
                f"skipped {self.skipped_records} {self.unit}(s) and "
                f"{len(self.unreadable_files)} unreadable file(s){not_read} in {self.run_dir}:"
            )
        else:  # only what the reader did on purpose (a restart read as a rewind, a copy read once)
            head = f"in {self.run_dir}:"
        out = [head]
        for path, why in self.skipped_paths[:max_files]:
            out.append(f"  {rel(path, self.run_dir)}: {why}")
        if len(self.skipped_paths) > max_files:
            out.append(f"  ... and {len(self.skipped_paths) - max_files} more path(s) not read")
        out.extend("  " + notice for notice in self.notices)
        out.extend("  " + m.text() for _, m in sorted(self.mixed.items()) if m.skipped)
        for f in gaps:
            for d in f.dropped:
                steps = d.get("steps") or ["?", "?"]
                out.append(
                    f"  {rel(f.path, self.run_dir)}: its writer dropped {d.get('records')} record(s) of "
                    f"steps {steps[0]}-{steps[1]} that it could not write ({d.get('reason', 'write failed')})"
                )
        for f in bad[:max_files]:
            name = rel(f.path, self.run_dir)
            if f.unreadable is not None:
                out.append(f"  {name}: unreadable, skipped ({f.unreadable})")
                continue
            by_reason = "; ".join(
                f"{n} x {reason}" if n > 1 else reason for reason, n in sorted(f.skip_reasons.items())
            )
            if f.skipped_lines:
                shown = sorted(f.skipped_lines)[:max_lines]  # the first lines, whatever check found them
                where = "row" if f.format == "parquet" else "line"  # a Parquet row counted from 0
                detail = "; ".join(f"{where} {line}: {reason}" for line, reason in shown)
                if f.skipped > len(shown):  # the lines not shown: how many, and every reason counted
                    detail += f" (+{f.skipped - len(shown)} more; in all: {by_reason})"
            else:
                detail = by_reason
            out.append(f"  {name}: {f.skipped} {self.unit}(s) skipped: {detail}")
        if len(bad) > max_files:
            out.append(f"  ... and {len(bad) - max_files} more file(s)")
        return Message.joined("\n", out)  # the options its lines name, kept


def rel(path: RunPath | str, root: RunPath) -> str:
    """``path`` below ``root``, as text (a URL given as text too: ``storage.listing``'s unnamed)."""
    try:
        return str(path.relative_to(root))  # type: ignore[arg-type, union-attr]
    except (ValueError, AttributeError):
        text, base = str(path), str(root).rstrip("/") + "/"
        return text[len(base) :] if text.startswith(base) else text
