"""A run read as it grows, for a reader that follows it (the sidecar, ``watch``'s alarms):
what settled since the last poll.

``RunTail`` reads only what is new on each poll: an open journal from where its settled part
ended (``journal.decode(..., after=)``), a sealed segment once (the records of the journal it
replaces that were read already are skipped), another tool's file once, as it is when first
seen. A record is *settled* once its step is final: an ``F`` frame (``flush(step)``) or the
clean end covers it, or it is in a sealed segment. Each source's state (``SourceState``: its
attempts, steps, silence, whether it holds the others back) goes with it; when a step is
complete across sources is the settling's (``upload.settle``).
"""

from __future__ import annotations

import collections
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from metric_core.format.life import Life
from metric_core.format.segment import Damaged, SegmentMeta
from metric_core.offline.inspect import story
from metric_core.offline.inspect.health import quiet_threshold
from metric_core.offline.read import ReadReport, fetch_numpy_api, read_sealed
from metric_core.offline.read.attempts import Attempt
from metric_core.offline.read.discover import Derived, list_data_files, read_run_json, writer_meta
from metric_core.offline.read.journal import CUT_WRITE, UNFINISHED
from metric_core.offline.read.report import rel
from metric_core.offline.read.validate import BAD_TIME, POLARS_SCHEMA, plausible

Source = tuple[str, int]
COLUMNS = ["process", "rank", "step", "key", "value", "reduction", "timestamp"]
# What every poll returns, records or none: the record's columns and the writer's attempt.
# Frames of one schema concatenate however the polls went (a poll that found nothing
# beside one that found records: a follow's last read after a kill).
TAIL_SCHEMA: dict[str, pl.DataType] = {**{c: POLARS_SCHEMA[c] for c in COLUMNS}, "attempt": pl.String()}
# Gaps between steps a source must have shown before it can be called stopped early: a
# source that wrote one step is waited for, not dropped from the watermark.
MIN_GAPS = 3
# A source silent against the wall clock is let go no sooner than this (another machine's
# clock may be off by a little).
WALL_CLOCK_MIN_S = 5.0


@dataclass
class AttemptState:
    """One attempt of a source (an ``init()``): when it started, its first step, its
    highest complete step, whether it shut down cleanly, and its life as its files
    recorded it (by journal name: a sealed segment's replaces its journal's)."""

    started: float = -math.inf
    first_step: int | None = None
    done: int | None = None
    finished: bool = False
    lives: dict[str, Life] = field(default_factory=dict)
    merged: Life | None = field(default=None, repr=False)  # of ``lives``, until one changes
    # Why its process is over (``dead``), as found at the start of the last poll, before its
    # files were read: what that poll read of it is all it wrote.
    over: str | None = None
    # Running (its process is there) but its writer thread is not heard, as ``dead`` found it
    # last (``Attempt.no_heartbeat``: native code holding the GIL, or stopped).
    no_heartbeat: bool = False

    def flushed(self, step: int) -> None:
        self.done = step if self.done is None else max(self.done, step)

    def first_flushed(self, step: int | None) -> None:
        """The step of its first ``flush(step)`` as a file declares it (``attempt_first_step``,
        or a journal's first ``F`` frame), the lowest of them, as ``read.attempts`` takes it:
        what a restart replaces from. A segment sealed before the attempt's first flush
        declares none, and its records' steps are not it (they keep the step ``init()`` was
        given, while the flush may come steps later): it tells nothing."""
        if step is not None:
            self.first_step = step if self.first_step is None else min(self.first_step, step)

    def lived(self, name: str, life: Life) -> None:
        """What the file ``name`` (a journal, or the segment that replaced it) recorded."""
        self.lives[name] = life
        self.merged = None

    @property
    def life(self) -> Life | None:
        if self.merged is None and self.lives:
            self.merged = Life.merged(list(self.lives.values()))
        return self.merged

    def dead(self, now: float, who: tuple[str, int, str], stacks: dict[str, list[Any]]) -> str | None:
        """How its process ended, in ``inspect``'s words (``story.ended_how``: "was stopped by
        SIGTERM after step 30 (its last flushed)"), though it did not shut down; None while it
        is alive, or when its files record no life (an older writer's). ``now``: when its files
        were read last (every frame written before then was read); ``who``: its process, rank
        and attempt id; ``stacks``: the run's stack files by attempt (``story.list_stacks``)."""
        life = self.life
        self.no_heartbeat = False
        if self.finished or life is None:
            return None
        a = Attempt(who[0], who[1], who[2], self.started, self.first_step)
        story.end_of(a, life, stacks.get(who[2], []), now)
        self.no_heartbeat = a.no_heartbeat
        return story.ended_how(a) if a.failed else None


@dataclass
class SourceState:
    """What the follower knows of one source."""

    process: str
    rank: int
    clock: float = -math.inf  # its newest settled record's timestamp
    first: float = math.inf  # its earliest record's timestamp
    static: bool = False  # only in another tool's files: read once, holds nothing back
    attempts: dict[str, AttemptState] = field(default_factory=dict)
    gaps: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=10_000))
    longest: float = 0.0  # its longest gap
    step_end: tuple[int, float] | None = None  # its newest step and that step's newest record

    def attempt(self, attempt: str, started: float | None = None) -> AttemptState:
        state = self.attempts.setdefault(attempt, AttemptState())
        if started is not None:
            state.started = started
        return state

    @property
    def newest(self) -> AttemptState:
        """The latest attempt: a restart's state is the source's (an earlier attempt's end is not)."""
        return (
            max(self.attempts.items(), key=lambda a: (a[1].started, a[0]))[1]
            if self.attempts
            else AttemptState()
        )

    @property
    def done(self) -> int | None:
        return self.newest.done

    @property
    def finished(self) -> bool:
        return self.newest.finished

    def note(self, steps: np.ndarray, times: np.ndarray) -> None:
        """Settled records (in record order): their steps' cadence, and the clock."""
        if not len(times):
            return
        self.clock = max(self.clock, float(times.max()))
        self.first = min(self.first, float(times.min()))
        starts = np.flatnonzero(np.r_[True, steps[1:] != steps[:-1]])
        newest = np.maximum.reduceat(times, starts)
        for step, at in zip(steps[starts].tolist(), newest.tolist(), strict=True):
            if self.step_end is None or step > self.step_end[0]:
                if self.step_end is not None:
                    gap = at - self.step_end[1]
                    self.gaps.append(gap)
                    self.longest = max(self.longest, gap)
                self.step_end = (step, at)
            elif step == self.step_end[0]:
                self.step_end = (step, max(at, self.step_end[1]))

    @property
    def silent_since(self) -> float:
        """What its silence counts from: its newest record, or its newest attempt's start
        (``init()`` writes it in the journal's header) when that is later: a rank that has
        not written yet, or restarted and not written since."""
        return max(self.clock, self.newest.started)

    @property
    def over(self) -> str | None:
        """Why the newest attempt's process is over without a shutdown, as the last poll found
        it before it read the source's files (None: alive, or not known): its records no flush
        covered were read then, so the steps may go on without it."""
        return None if self.static or not self.attempts else self.newest.over

    @property
    def has_life(self) -> bool:
        """Its writer records heartbeats (format 4 on): its silence is told from its death."""
        return bool(self.attempts) and bool(self.newest.lives)

    def stopped_early(self, newest: float, now: float | None = None) -> bool:
        """``inspect``'s rule, against the newest record of the run; with ``now``, also
        against the wall clock (``watch``'s stall), past at least ``WALL_CLOCK_MIN_S`` (clocks
        of other machines may be a little off): a source that hangs after the others
        finished is let go too."""
        if self.finished or len(self.gaps) < MIN_GAPS:
            return False
        lag = newest - self.clock
        silent = -math.inf if now is None else now - self.clock
        threshold = quiet_threshold(None, self.longest)  # the rule without its median: a lower bound
        if lag <= threshold and silent <= max(threshold, WALL_CLOCK_MIN_S):  # the cheap half first
            return False
        threshold = quiet_threshold(statistics.median(self.gaps), self.longest)
        return lag > threshold or silent > max(threshold, WALL_CLOCK_MIN_S)

    def holds(self, newest: float, now: float, let_go_after: float | None = None) -> bool:
        """Whether the others' global steps wait for it: while it lives, however long it is
        silent (unless ``let_go_after`` seconds of silence); a writer that records no life
        (an older one) by ``inspect``'s stop rule."""
        if self.finished or self.static:
            return False
        if let_go_after is not None and now - self.silent_since > let_go_after:
            return False
        if self.has_life:
            return self.over is None
        return not self.stopped_early(newest, now)


@dataclass
class _Journal:
    decoded: Any  # journal.Decoded of what was read so far
    taken: int = 0  # records taken
    size: int = 0  # its bytes when last read
    progress: tuple[int, int] = (-1, -1)  # its records and flushes when last read
    # Rows past the settled part taken already (its writer is over, or the job ended): the
    # next decode starts at the settled part again, and these are not taken twice.
    beyond: int = 0
    truncated_said: bool = False


class RunTail:
    """The records of a run directory that settled since the last ``poll``."""

    def __init__(self, run_dir: Path, *, follow_symlinks: bool = False) -> None:
        self.root = run_dir
        self.follow_symlinks = follow_symlinks
        self.journals: dict[Path, _Journal] = {}
        self.done: set[Path] = set()  # sealed segments read, journals sealed since
        self.sources: dict[Source, SourceState] = {}
        self.notices: list[str] = []  # what the caller should say (each once)
        self.meta: dict[str, Any] = {}
        self.run_json_damaged: str | None = None  # why run.json is damaged, as the latest poll read it
        self.skipped = 0
        self.active = False  # the last poll found something written (settled or not)
        self.vanished = False  # the last poll found a journal sealed after it listed the files
        self.looked_at: float | None = None  # when the last poll began to read the files
        self._noticed: set[str] = set()
        fetch_numpy_api()  # before a stop can land in polars' first hand-over to numpy

    def source(self, process: str, rank: int) -> SourceState:
        return self.sources.setdefault((process, rank), SourceState(process, rank))

    def poll(self, final: bool = False) -> pl.DataFrame:
        """The records settled since the last poll (``TAIL_SCHEMA``), in file order;
        with ``final``, every record read (the job is over: nothing will settle them).

        The records of an attempt whose process is over (``AttemptState.dead``: its end
        recorded, its pid gone, its heartbeat stopped) are read whole as well, as every
        command reads them: no flush will cover them, and the steps go on without it. Its
        verdict is taken before its files are read, so what is read is all it wrote; an
        attempt first seen in this poll is judged once its files were read, and a dead one's
        journal is read again then."""
        self.active = False
        # A writer's silence is counted to when its files were last read, not to now: a
        # follower that did not look for a while (a loaded machine, a slow hand-over to W&B)
        # must not take a live writer whose heartbeats it has not read yet for dead.
        looked_at = time.time() if self.looked_at is None else self.looked_at
        judged = set()
        stacks = self._stacks()
        for state in self.sources.values():
            for name, a in state.attempts.items():
                a.over = a.dead(looked_at, (state.process, state.rank, name), stacks)
                judged.add(id(a))
        report = ReadReport(run_dir=self.root)
        if not self.meta.get("run_id"):
            self.meta = read_run_json(self.root, report)
            self.run_json_damaged = report.run_json_damaged
        frames = []
        self.looked_at = time.time()  # every frame written before this is read below
        paths = list_data_files(self.root, report, follow_symlinks=self.follow_symlinks)
        sealed = [p for p in paths if p.suffix != ".journal" and p not in self.done]
        for path in sealed:  # first: a sealed segment ends the journal it replaces
            frame = self._sealed(path, report)
            if frame is not None:
                frames.append(frame)
        self.vanished = False
        journals = [p for p in paths if p.suffix == ".journal" and p not in self.done]
        newest = _newest_journals(journals)
        for path in journals:
            stem, seq = _journal_seq(path)
            frame = self._journal(path, final, superseded=seq < newest.get(stem, seq))
            if frame is not None:
                frames.append(frame)
        # Attempts first seen now (a follow started after a rank died, or a fresh reading of
        # the run): without this, their records no flush covered would wait for the next poll,
        # and a step, or the end, could go without them.
        fresh: dict[int, tuple[AttemptState, tuple[str, int, str], list[Path]]] = {}
        for path, tail in self.journals.items():
            d = tail.decoded
            of = self.sources.get((d.process, d.rank)) if d.process is not None else None
            name = d.attempt.get("attempt") or ""
            found = of.attempts.get(name) if of is not None else None
            if found is not None and id(found) not in judged:
                fresh.setdefault(id(found), (found, (str(d.process), int(d.rank or 0), name), []))[2].append(
                    path
                )
        stacks = self._stacks() if fresh else stacks
        for a, who, journals in fresh.values():
            a.over = a.dead(self.looked_at, who, stacks)
            for path in journals if a.over is not None else []:
                frame = self._journal(path, final)
                if frame is not None:
                    frames.append(frame)
        if self.vanished:
            # A journal sealed between the listing and its reading: its segment is read now, not
            # with the next poll, or a later journal's records (read in this poll) would come
            # before its last ones, and a source's records would not come in step order.
            for path in list_data_files(self.root, report, follow_symlinks=self.follow_symlinks):
                if path.suffix != ".journal" and path not in self.done:
                    frame = self._sealed(path, report)
                    if frame is not None:
                        frames.append(frame)
        for where, why in report.skipped_paths:
            self._notice(f"{rel(where, self.root)}: {why}")
        for rep in report.files:
            for reason, n in rep.skip_reasons.items():
                self.skipped += n
                self._notice(f"{rel(rep.path, self.root)}: {n} record(s) skipped: {reason}")
        return pl.concat([empty_tail(), *frames], how="vertical")

    def how_ended(self, key: Source) -> str | None:
        """How the newest attempt of ``key`` ended, told from everything read so far (its
        verdict, ``over``, was taken before the last poll read its files: its last flush may
        have come after)."""
        state = self.sources.get(key)
        if state is None or not state.attempts:
            return None
        name = max(state.attempts.items(), key=lambda a: (a[1].started, a[0]))[0]
        who = (state.process, state.rank, name)
        return state.attempts[name].dead(self.looked_at or time.time(), who, self._stacks()) or state.over

    def _stacks(self) -> dict[str, list[Any]]:
        """The run's stack files by attempt, where an attempt may have ended (a SIGTERM's
        stacks say so): read only while some attempt has not shut down."""
        if all(a.finished for s in self.sources.values() for a in s.attempts.values()):
            return {}
        return story.list_stacks(self.root)

    def _notice(self, text: str) -> None:
        if text not in self._noticed:
            self._noticed.add(text)
            self.notices.append(text)

    def _sealed(self, path: Path, report: ReadReport) -> pl.DataFrame | None:
        self.done.add(path)
        self.active = True
        meta = writer_meta(path)
        if isinstance(meta, Derived):
            return None
        skip = 0
        if isinstance(meta, Damaged):
            self._notice(f"{rel(path, self.root)}: {meta.reason} (the file is damaged): ignored")
        if meta is not None and meta.supersedes is not None:  # damaged metadata's too, as scan_run
            journal = path.with_name(meta.supersedes)
            tailed = self.journals.pop(journal, None)
            self.done.add(journal)
            skip = tailed.taken if tailed is not None else 0
        frame, rep = read_sealed(path, report, meta if isinstance(meta, SegmentMeta) else None)
        if rep.unreadable:
            self._notice(f"{rel(path, self.root)}: not read: {rep.unreadable}")
        if frame is None:
            frame = empty_tail()
        if skip and (rep.skipped or rep.unreadable):
            # Its first ``skip`` records were handed over from the journal; with units of it
            # skipped, which of the rest are new cannot be told apart: none is taken twice.
            rest = max(frame.height - skip, 0)
            self.skipped += rest
            self._notice(
                f"{rel(path, self.root)}: damaged after {skip:,} of its records were read from its "
                f"journal: its {rest:,} other record(s) are not read"
            )
            frame = frame.clear()
        frame = frame.select(COLUMNS).cast(POLARS_SCHEMA).slice(skip)  # type: ignore[arg-type]
        if isinstance(meta, SegmentMeta) and meta.source is not None:
            state = self.source(*meta.source)
            attempt = meta.attempt or ""
            a = state.attempt(attempt, meta.attempt_started)
            a.first_flushed(meta.attempt_first_step)
            if meta.steps is not None:
                # A segment ends at a flush, but one sealed at twice its size without one ends
                # inside a step: its last step is complete only at a clean end (or the next flush).
                a.flushed(meta.steps[1] if meta.clean_shutdown else meta.steps[1] - 1)
            a.finished |= meta.clean_shutdown
            if a.finished:
                a.over = None
            if meta.life is not None:
                a.lived(meta.supersedes, meta.life)
            state.note(frame["step"].to_numpy(), frame["timestamp"].to_numpy())
            return frame.with_columns(attempt=pl.lit(attempt))
        for (process, rank), part in frame.group_by("process", "rank", maintain_order=True):
            state = self.source(str(process), int(rank))  # type: ignore[call-overload]
            state.static = True
            state.note(part["step"].to_numpy(), part["timestamp"].to_numpy())
        return frame.with_columns(attempt=pl.lit(""))

    def _journal(self, path: Path, final: bool = False, superseded: bool = False) -> pl.DataFrame | None:
        """The records of a journal read since the last poll: those a flush in it settled;
        every whole one once the job ended (``final``), its writer is over, or the writer
        went on to a newer journal (``superseded``: its last records wait for a flush the
        newer one holds, which settles them when it comes, so they are read now, not after the
        flush was seen: a step must not be taken as complete before its records are read)."""
        from metric_core.format import journal  # pyarrow: only for runs that hold a journal

        tail = self.journals.get(path)
        start = 0 if tail is None else tail.decoded.settled_bytes
        try:
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read()
        except FileNotFoundError:
            self.vanished = True  # sealed meanwhile: ``poll`` reads its segment
            return None
        except OSError as exc:
            self._notice(f"{rel(path, self.root)}: not read: {exc}")
            return None
        decoded = journal.decode(data, after=None if tail is None else tail.decoded)
        for problem in decoded.problems:
            self._notice(f"{rel(path, self.root)}: {problem}")
        if decoded.process is None or decoded.rank is None:
            return None  # nothing whole yet
        if tail is None:
            tail = self.journals[path] = _Journal(decoded)
        # Records or steps written since the last poll, settled or not (a heartbeat is neither).
        progress = (
            tail.taken - tail.beyond + (decoded.table.num_rows if decoded.table is not None else 0),
            decoded.life.flushes,
        )
        if progress != tail.progress:
            self.active = True
        tail.decoded, tail.size, tail.progress = decoded, start + len(data), progress
        state = self.source(decoded.process, decoded.rank)
        attempt = decoded.attempt.get("attempt") or ""
        a = state.attempt(attempt, decoded.attempt.get("attempt_started"))
        a.first_flushed(decoded.attempt.get("attempt_first_step", decoded.first_flush))
        if decoded.last_flush is not None:
            a.flushed(decoded.last_flush)
        a.finished |= decoded.shutdown is not None
        if a.finished:
            a.over = None  # it ended cleanly after all (between the verdict and this read)
        if decoded.version >= 4:
            a.lived(path.name, decoded.life)
        # At the end (every source idle), or once its writer is over, the records no flush
        # covered are taken as they are stamped, as every command reads them; a write the
        # writer's death cut short is said.
        whole = final or a.over is not None
        rows = 0 if decoded.table is None else decoded.table.num_rows
        first, end = tail.beyond, max(tail.beyond, rows if whole or superseded else decoded.settled_records)
        tail.beyond = end - decoded.settled_records
        if whole and decoded.truncated and not tail.truncated_said:
            tail.truncated_said = True
            self.skipped += decoded.truncated_records
            self._notice(  # as every command says it (``journal.take_damage``)
                f"{rel(path, self.root)}: {decoded.truncated_records} record(s) skipped: {UNFINISHED}"
                if decoded.truncated_records
                else f"{rel(path, self.root)}: {CUT_WRITE}"
            )
        if decoded.table is None or end <= first:
            return None
        frame = pl.from_arrow(decoded.table.slice(first, end - first))
        assert isinstance(frame, pl.DataFrame)
        ok = frame.select(plausible(pl.col("timestamp"))).to_series()
        if not ok.all():
            self.skipped += int((~ok).sum())
            self._notice(f"{rel(path, self.root)}: {int((~ok).sum())} record(s) skipped: {BAD_TIME}")
            frame = frame.filter(ok)
        tail.taken += frame.height  # as the sealed segment holds them: without the skipped
        frame = frame.select(COLUMNS).cast(POLARS_SCHEMA)  # type: ignore[arg-type]
        state.note(frame["step"].to_numpy(), frame["timestamp"].to_numpy())
        return frame.with_columns(attempt=pl.lit(attempt))


def _journal_seq(path: Path) -> tuple[str, int]:
    """A journal's writer (``{stem}.r{rank}``) and its number in that writer's sequence."""
    stem, _, seq = path.name[: -len(".journal")].rpartition(".")
    return stem, int(seq) if seq.isdigit() else -1


def _newest_journals(paths: list[Path]) -> dict[str, int]:
    """Each writer's newest journal number among ``paths``: the one it writes now."""
    newest: dict[str, int] = {}
    for path in paths:
        stem, seq = _journal_seq(path)
        newest[stem] = max(seq, newest.get(stem, seq))
    return newest


def empty_tail() -> pl.DataFrame:
    return pl.DataFrame(schema=TAIL_SCHEMA)


def counted(sources: dict[Source, SourceState]) -> int:
    """The sources that count toward the job's size (``run.json``'s world_size, ``--sources``):
    the writer's own; another tool's files beside them are not the job's ranks (of a run
    only another tool wrote, every source)."""
    return sum(1 for s in sources.values() if not s.static) or len(sources)


# Without run.json (written by the first rank 0 at init(): not started yet, or another tool's
# files), how long after the first record the sidecar and watch wait for it before they take
# the sources they see as all.
NO_RUN_JSON_WAIT_S = 10.0


def expected_sources(meta: dict[str, Any]) -> int | None:
    """``run.json``'s world size, when the writer recorded one."""
    size = meta.get("world_size")
    return size if isinstance(size, int) and size > 0 else None
