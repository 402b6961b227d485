"""``upload --follow``: the sidecar loop. Poll the run (``read.tail``), hand each
destination run the rows that became complete, keep the ledger, end when the job did.

Written once against the destination contract (``destination``): a run is opened when
its first row is ready, as a plain upload opens it (``Destination.decide``): a run the
ledger knows unfinished is resumed where the destination stopped (the rows it holds
skipped: a run's rows are the same whichever poll made them), or written again whole
where it cannot be continued (a W&B offline run, a TensorBoard event file). After each
poll the ledger holds the rows handed over, so a follower killed at any instant and
started again sends no row twice and misses none.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl

from metric_core.clock import duration, local_time
from metric_core.errors import DamagedRunJsonError, NoDataError, StrictModeError
from metric_core.offline.alerts import ValueWatch
from metric_core.offline.inspect import never_wrote, stall_threshold
from metric_core.offline.inspect.health import EPISODE_S, culprit_among, held_said, live_where, where_said
from metric_core.offline.plan import By, ReducePlan
from metric_core.offline.read.tail import NO_RUN_JSON_WAIT_S, RunTail, SourceState, counted, expected_sources
from metric_core.offline.samples import SampleChoice, SampleTables
from metric_core.offline.storage import missing_run
from metric_core.offline.upload.destination import (
    Destination,
    RunOutcome,
    Sender,
    UploadEvents,
    find_entry,
    would_be,
)
from metric_core.offline.upload.ledger import only_upload
from metric_core.offline.upload.restarts import AttemptStep, attempt_steps, replacing
from metric_core.offline.upload.runs import PlannedRun, PlannedRuns, request_key, run_config, run_id_for
from metric_core.offline.upload.settle import UNKNOWN_SOURCES, Follower, Ready

if TYPE_CHECKING:
    from metric_core.offline.upload import Follow

NEVER = 1 << 62  # rows to skip of a run that is skipped
# How ``follow_upload`` ended: every source finished, idle for ``until_idle``, every source
# finished or died and none restarted within ``restart_grace``, or ``stop``.
FINISHED, IDLE, OVER, STOPPED, REPLACED = "finished", "idle", "over", "stopped", "replaced"
RESTART_GRACE = 60.0  # --restart-grace's default: a launcher that restarts the job is waited for


@dataclass
class FollowedRun(PlannedRun):
    """A destination run filled as the job writes: its rows are not known ahead."""

    sent: int = 0  # rows handed over (or, in a dry run, that would be)
    top: int | None = None  # the highest step of the rows handed over

    def first_row_from(self, step: int) -> int | None:
        return None  # a restart's rewind is replayed from a fresh run (see ``decide``)

    def last_step(self) -> int | None:
        return self.top

    @property
    def rows(self) -> int:
        return self.sent


@dataclass
class _Open:
    run: FollowedRun
    outcome: RunOutcome
    handle: Any  # the destination's run (``Sender.open``); None: skipped, or a dry run
    skip: int = 0  # rows the destination holds already (a resumed run): the first ones made are not sent


@dataclass
class FollowState:
    """What a follow did so far: for the caller's display and its closing lines."""

    ended: str = ""
    polls: int = 0
    records: int = 0
    outcomes: list[RunOutcome] = field(default_factory=list)
    sources: dict[tuple[str, int], SourceState] = field(default_factory=dict)
    expected: int = 1  # sources that must have written (run.json's world_size, --sources)
    counted_by: str = "run.json"  # what gave ``expected``: run.json's world_size, or --sources
    dead: dict[tuple[str, int], str] = field(default_factory=dict)  # sources over without shutdown(): why

    @property
    def all_finished(self) -> bool:
        """Every source shut down cleanly, and as many wrote as the run expects."""
        done = all(s.finished or s.static for s in self.sources.values())
        return bool(self.sources) and done and counted(self.sources) >= self.expected

    @property
    def missing(self) -> str:
        """The expected sources that never wrote a record, in ``inspect``'s words ("": none,
        or their count is not known yet)."""
        seen = counted(self.sources)
        if seen >= self.expected or self.expected >= UNKNOWN_SOURCES:
            return ""
        if self.counted_by == "run.json":  # ranks 0 .. world_size - 1, as inspect names them
            own = [key for key, s in self.sources.items() if not s.static] or list(self.sources)
            ranks = sorted(set(range(self.expected)) - {rank for _, rank in own})
            if ranks:
                return never_wrote(ranks, self.expected)
        by = "run.json expects" if self.counted_by == "run.json" else "--sources counts"
        return f"{self.expected - seen} of the {self.expected} sources {by} never wrote a record"


def follow_upload(
    root: Path,
    plan: ReducePlan,
    to: Destination,
    *,
    name: str,
    group: str | None,
    share_run: bool,
    dry_run: bool,
    force_new: bool,
    follow_symlinks: bool,
    strict: bool,
    events: UploadEvents,
    request: dict[str, Any],
    follow: Follow,
    samples: SampleChoice | None = None,
) -> tuple[PlannedRuns, FollowState]:
    """Follow ``root`` until every source finished, every source finished or died and no
    new attempt began within ``follow.restart_grace`` seconds, ``follow.until_idle``
    seconds pass without a new record, or ``follow.stop`` is set (Ctrl-C: what is ready is
    handed over first). A live source holds the global steps however long it is silent,
    unless ``follow.let_go_after``."""
    stop = follow.stop or threading.Event()
    interval, sources, alarms = follow.interval, follow.sources, follow.alarms
    state = FollowState(counted_by="run.json" if sources is None else "--sources")
    key = request_key(plan, request, share_run)
    if not follow.wait and not root.exists():  # a mistyped path never waits
        raise missing_run(root)  # type: ignore[misc]
    if not _appeared(root, stop, interval, events):
        state.ended = STOPPED
        return PlannedRuns(runs=[]), state
    with contextlib.ExitStack() as held:
        if not dry_run:
            held.enter_context(only_upload(root / ".metriclog", key, root))
        replacing = False
        values = ValueWatch(None, alarms) if alarms is not None else None
        while True:
            pass_ = _Pass(
                root, plan, to, name, group or name, share_run, dry_run, force_new, strict, events, key
            )
            pass_.replacing = replacing
            pass_.tail = RunTail(root, follow_symlinks=follow_symlinks)
            pass_.follower = Follower(
                plan, share_run=share_run, sources=sources, let_go_after=follow.let_go_after
            )
            pass_.restart_grace = follow.restart_grace
            pass_.values = values
            if samples is not None and samples.enabled and not dry_run and to.takes_samples:
                pass_.samples = SampleTables(root, plan, samples, share_run=share_run)
            try:
                ended = pass_.run(stop, interval, follow.until_idle, state, sources is None)
            except KeyboardInterrupt:  # Ctrl-C or SIGTERM while it read or sent: what was sent stays
                ended = STOPPED
            except BaseException:
                pass_.close(finished=False)
                raise
            # Idle with a source that never shut down: the job may go on (a long pause), so
            # the runs stay open in the ledger, for a later upload to continue.
            pass_.close(finished=ended in (FINISHED, OVER) or (ended == IDLE and state.all_finished))
            state.outcomes = [o.outcome for o in pass_.runs.values()]
            if ended != REPLACED:
                state.ended = ended
                return pass_.planned, state
            for (
                opened
            ) in pass_.runs.values():  # e.g. W&B offline: `wandb sync` must not send the replaced rows
                if pass_.sender is not None:
                    pass_.sender.discard(opened.outcome)
            force_new = replacing = (
                True  # the rows handed over hold replaced records: fresh runs hold the rest
            )
            if values is not None:
                values.anew(pass_.tail.sources)


@dataclass
class _Pass:
    """One reading of the run from its start; a restart of a source that replaces rows
    already handed over ends it, and the next pass writes fresh runs."""

    root: Path
    plan: ReducePlan
    to: Destination
    name: str
    group: str
    share_run: bool
    dry_run: bool
    force_new: bool
    strict: bool
    events: UploadEvents
    key: str
    tail: RunTail = field(init=False)
    follower: Follower = field(init=False)
    runs: dict[str | None, _Open] = field(default_factory=dict)
    planned: PlannedRuns = field(default_factory=lambda: PlannedRuns(runs=[]))
    sender: Sender | None = None
    said: int = 0
    waiting_said: bool = False
    missing_said: bool = False  # the sources expected that never wrote were let go (--let-go-after)
    quiet_said: bool = False
    replacing: bool = False  # a pass after a restart replaced rows handed over
    let_go: set[tuple[str, int]] = field(default_factory=set)
    held: set[tuple[str, int]] = field(default_factory=set)  # live, silent sources said to hold the steps
    episode_clock: float = -math.inf  # the newest record of the silence episode said last
    restart_grace: float = RESTART_GRACE
    samples: SampleTables | None = None  # each step's samples, sent with its row
    values: ValueWatch | None = None  # alarms on values (--alert), judged on what the tail read
    over_since: float | None = None  # since when every source finished or died

    def run(
        self, stop: threading.Event, interval: float, until_idle: float | None, state: FollowState, wait: bool
    ) -> str:
        last_new = time.monotonic()
        first_record: float | None = None
        while True:
            records = self.tail.poll()
            if self.tail.active:
                last_new = time.monotonic()
            if records.height and first_record is None:
                first_record = time.monotonic()
            idle = until_idle is not None and time.monotonic() - last_new >= until_idle
            state.sources = self.tail.sources
            self._silences(last_new, state)
            over = self._over(state)  # every source finished or died, and no restart came
            if idle or over:  # the job is over: the records no flush covered are read as they are
                records = pl.concat([records, self.tail.poll(final=True)], how="vertical")
            state.polls += 1
            state.records += records.height
            self._notices(first_record, wait)
            state.expected = self.follower.expected or 1
            self.follower.add(records, self.tail.sources)
            if self.plan.by is By.TIME and self.follower.t0 is None and self.tail.sources:
                self.follower.t0 = self._earlier_t0()
            if self.follower.replaced:
                self.events.message("warning", _replaced(self.follower.replaced, self.to))
                return REPLACED
            if self.follower.late:
                self.events.message(
                    "warning", _late(self.follower.late, self.follower.late_restarts, self.to)
                )
                return REPLACED
            ending = state.all_finished or idle or over
            if self.values is not None:
                for alert in self.values.judge(records, self.tail.sources, self.tail.meta, final=ending):
                    self.events.alert(alert)
            self._send(self.follower.ready(self.tail.sources, ending=ending))
            for text in self.follower.mixed_notices():
                self.events.message("warning", text)
                if self.strict:
                    raise StrictModeError(text)
            if ending:
                return FINISHED if state.all_finished else IDLE if idle else OVER
            try:
                if stop.wait(interval):
                    raise KeyboardInterrupt
            except KeyboardInterrupt:
                self._send(self.follower.ready(self.tail.sources))  # what is complete goes first
                return STOPPED

    def _over(self, state: FollowState) -> bool:
        """Every source finished or died, and no new attempt began within ``restart_grace``;
        or every source that wrote ended, and the sources expected that never wrote (a rank
        that died before its first record left no file to be seen dying by) did not come
        within it either."""
        sources = self.tail.sources
        ended = bool(sources) and all(
            s.finished or s.static or key in state.dead for key, s in sources.items()
        )
        missing = state.missing
        if not ended or not (missing or (counted(sources) >= state.expected and state.dead)):
            self.over_since = None
            return False
        if self.over_since is None:
            self.over_since = time.monotonic()
            if self.restart_grace > 0:
                self.events.message(
                    "note",
                    f"every source that wrote finished or died, and {missing}; waiting "
                    f"{duration(self.restart_grace)} for it or a restart (--restart-grace)"
                    if missing
                    else f"every source finished or died; waiting {duration(self.restart_grace)} for the "
                    "job to be restarted (--restart-grace)",
                )
        return time.monotonic() - self.over_since >= self.restart_grace

    def _silences(self, last_new: float, state: FollowState) -> None:
        """Say once when a source dies or is let go, or holds the steps while silent; and
        when nothing is written."""
        now = time.time()
        newest = max((s.clock for s in self.tail.sources.values()), default=-math.inf)
        holding = not self.follower.per_source
        let_go_after = self.follower.let_go_after
        newly: list[tuple[str, int]] = []  # sources that began to hold the steps in this poll
        for key, source in self.tail.sources.items():
            who = f"{key[0]} (rank {key[1]})"
            why = source.over  # over, as found before the poll read its files
            if why is None:
                state.dead.pop(key, None)
            elif key not in state.dead:
                why = self.tail.how_ended(key) or why  # in inspect's words, from all it read
                state.dead[key] = why
                self.events.message(
                    "warning", f"{who} {why}" + ("; the steps go on without it" if holding else "")
                )
            let_go = not (source.finished or source.static) and not source.holds(newest, now, let_go_after)
            if let_go and why is None and key not in self.let_go:
                rule = (
                    f"--let-go-after {duration(let_go_after)}"
                    if let_go_after is not None
                    else "inspect's rule"
                )
                self.events.message(
                    "warning",
                    f"{who} {_silence(source, now)} ({rule}): the steps go on without it; if it writes "
                    "again, the runs are written again under fresh ids",
                )
            if let_go:
                self.let_go.add(key)
            elif key in self.let_go and source.finished:
                self.let_go.discard(key)
            silent = now - source.silent_since
            typical = _typical(source)
            if (
                holding
                and source.holds(newest, now, let_go_after)
                and source.has_life
                and silent > stall_threshold(typical, source.longest)
            ):
                if key not in self.held:
                    self.held.add(key)
                    newly.append(key)
            else:
                self.held.discard(key)
        if newly:
            self._held_note(newly, now)
        if holding and not self.missing_said and self.follower.missing_let_go(self.tail.sources, now):
            self.missing_said = True
            first = min((s.first for s in self.tail.sources.values() if not s.static), default=now)
            self.events.message(
                "warning",
                f"{state.missing or 'a source expected never wrote a record'}, {duration(now - first)} after "
                f"the first record (--let-go-after {duration(let_go_after or 0)}): the steps go on without "
                "it; if it writes, the runs are written again under fresh ids",
            )
        quiet = time.monotonic() - last_new
        # (while every source is over and the follow waits --restart-grace, it said so)
        known_over = bool(self.tail.sources) and all(
            s.finished or s.static or key in state.dead for key, s in self.tail.sources.items()
        )  # every source finished or died: no "may have died" (it did, and the end is said)
        if (
            quiet > QUIET_SAID_S
            and not self.quiet_said
            and self.tail.sources
            and self.over_since is None
            and not known_over
        ):
            self.quiet_said = True
            shut = all(s.finished or s.static for s in self.tail.sources.values())
            self.events.message(
                "note",
                f"nothing was written for {duration(quiet)} and "
                f"{state.missing if shut and state.missing else 'not every source shut down'}: the job may "
                "have died. Still following; Ctrl-C ends it (what is complete was handed over), "
                "--until-idle DURATION ends a follow after such a silence",
            )
        elif quiet <= QUIET_SAID_S:
            self.quiet_said = False

    def _held_note(self, newly: list[tuple[str, int]], now: float) -> None:
        """One note a silence episode, as ``watch`` gives one warning a stall: the sources
        that went silent within ``EPISODE_S`` of the episode's first are said together, with
        the one the others wait for first (``culprit_among``, as watch judges it: from where
        their heartbeats say they are, or the one whose heartbeat stopped), in watch's words
        (``held_said``); a source that joins an episode already said is not said again."""
        sources = self.tail.sources
        fresh = [k for k in newly if abs(sources[k].silent_since - self.episode_clock) > EPISODE_S]
        if not fresh:
            return
        self.episode_clock = min(sources[k].silent_since for k in fresh)
        # Every live source the silence holds, as watch counts them (``held_by_hang``: silent
        # half its stall threshold or more), not only those past theirs: thresholds differ by
        # source (a rank with a long checkpoint has a longer one), and the rank the others
        # wait for may be the last to cross its own.
        together = sorted(
            (
                k
                for k, s in sources.items()
                if s.has_life
                and s.over is None
                and not (s.finished or s.static)
                and abs(s.silent_since - self.episode_clock) <= EPISODE_S
                and now - s.silent_since >= 0.5 * stall_threshold(_typical(s), s.longest)
            ),
            key=lambda k: (k[1], k[0]),
        ) or sorted(fresh, key=lambda k: (k[1], k[0]))
        unheard = {k: sources[k].newest.no_heartbeat for k in together}  # as inspect tells it
        state = {k: (live_where(sources[k].newest.life, unheard[k]), unheard[k]) for k in together}
        culprit = culprit_among(state)
        first = sources[culprit] if culprit is not None else sources[together[0]]
        where = {k: where_said(*state[k]) for k in together}
        if culprit is not None:
            head = f"{culprit[0]} (rank {culprit[1]}) {_silence(first, now, alive=True)}"
        else:
            since = f" since step {first.step_end[0]}" if first.step_end else ""
            head = f"{len(together)} sources are alive but silent{since}"
        said = head + held_said(culprit, together, where)
        self.events.message(
            "note",
            f"{said}: the global steps wait (a long evaluation, or a hang); --let-go-after DURATION lets a "
            "silent one go",
        )

    def _notices(self, first_record: float | None, wait: bool) -> None:
        """What the reading found, each said once; why nothing goes, when it waits for sources."""
        if self.tail.run_json_damaged:  # refused before anything waits or goes (``_identity``)
            raise DamagedRunJsonError(str(self.root / "run.json"), self.tail.run_json_damaged)
        for notice in self.tail.notices[self.said :]:
            self.events.message("warning", notice)
        self.said = len(self.tail.notices)
        if self.strict and self.tail.skipped:
            raise StrictModeError(f"{self.tail.skipped} record(s) skipped (said above)")
        if wait:
            self.follower.expected = _expected(self.tail.meta, first_record)
        expected, seen = self.follower.expected or 1, counted(self.tail.sources)
        waited = first_record is not None and time.monotonic() - first_record > WAITING_SAID_S
        if (
            waited
            and seen < expected < UNKNOWN_SOURCES
            and not self.follower.per_source
            and not self.waiting_said
            and not self.missing_said
        ):
            self.waiting_said = True
            self.events.message(
                "warning",
                f"{seen} source(s) wrote so far, and run.json's world_size is {expected}: no global step or "
                f"window goes before {expected} have written. If fewer ranks write (only rank 0 records, "
                f"or a role without run.json's count), start with --sources {seen}",
            )

    def _send(self, ready: list[Ready]) -> None:
        if self.samples is not None and any(part.rows for part in ready):
            self.samples.refresh()  # the samples of these rows' steps were flushed before them
        for part in ready:
            if not part.rows:
                continue
            opened = self.runs.get(part.run) or self._open(part.run)
            run = opened.run
            keys = {k for row in part.rows for k in row if k not in (run.bucket, "_timestamp")}
            run.keys = sorted({*run.keys, *keys})
            rows = part.rows[max(0, opened.skip - run.sent) :]
            if run.bucket == "step":
                run.top = max((row["step"] for row in part.rows), default=run.top)
            if opened.handle is not None:
                assert self.sender is not None
                opened.outcome.rows_sent += self.sender.log_rows(opened.handle, rows, run)
            run.sent += len(part.rows)
        sent = [self.runs[part.run] for part in ready if part.rows and self.runs[part.run].handle is not None]
        if sent and self.sender is not None:  # one ledger write a poll, of the runs that got rows
            self.sender.ledger.update_many(
                {
                    o.outcome.run_id: {
                        "rows_sent": o.outcome.rows_sent,
                        **self._held(o.run),
                        "request": self.key,
                        "t0": self.follower.t0,  # where windows start, for a follower after this one
                    }
                    for o in sent
                }
            )

    def _earlier_t0(self) -> float | None:
        """Where an earlier follow of this upload started its windows: rows continued by a
        resumed run must fall in the same windows."""
        ledger = self.to.ledger(self.root, _identity(self.tail), create=False)
        for entry in (ledger.entries if ledger else {}).values():
            if entry.get("request") == self.key and entry.get("t0") is not None and not self.force_new:
                return float(entry["t0"])
        return None

    def _open(self, process: str | None) -> _Open:
        identity = _identity(self.tail)
        if not self.planned.identity:
            self.planned.identity = identity
            self.planned.config = run_config(self.tail.meta, self.plan, followed=True)
            self.planned.meta = dict(self.tail.meta)
        raw = self.follower.raw
        run = FollowedRun(
            run_id=run_id_for(identity, self.key, process),
            name=self.name if process is None else f"{self.name}_{process}",
            group=None if process is None else self.group,
            source=process,
            columns={},
            x_axis=None if raw else self.plan.bucket,
            keys=[],
            raw=raw,
            bucket=self.plan.bucket,
            attempts=self._attempts(process),
            attempt_steps=self._attempt_steps(process),
        )
        mine = {
            at: s.first
            for at, s in self.tail.sources.items()
            if process in (None, at[0]) and math.isfinite(s.first)
        }
        run.started = min(mine.values(), default=None)
        if process is not None and len(mine) == 1:
            run.rank = next(iter(mine))[1]
        self.planned.runs.append(run)
        if self.dry_run:
            entry = find_entry(self.to.ledger(self.root, identity, create=False), run, self.to)
            decision = self.to.decide(run, entry, self.force_new)
            opened = _Open(run, RunOutcome(run, decision.action, decision.run_id, 0, decision.message), None)
            would = would_be(decision.action)
            self.events.message("info", f"dry run: {run.name} ({decision.run_id}) would be {would}")
        else:
            if self.sender is None:
                ledger = self.to.ledger(self.root, identity)
                assert ledger is not None
                self.sender = self.to.sender(
                    self.planned, ledger, force_new=self.force_new, events=self.events, samples=self.samples,
                    live=True,
                )  # fmt: skip
            outcome, handle = self.sender.open(run)
            if self.replacing and handle is not None:
                outcome.message = (
                    f"{run.name}: a fresh run {outcome.run_id} holds the history with the restart"
                )
            if outcome.message:  # said now, as the follow may go on for hours
                self.events.message("info", outcome.message)
                outcome.message = ""
            opened = _Open(run, outcome, handle, skip=outcome.rows_sent if handle is not None else NEVER)
            if handle is not None:
                self.events.message("info", f"following into {run.name} ({outcome.run_id})")
        self.runs[process] = opened
        return opened

    def _attempts(self, process: str | None) -> list[str]:
        return sorted(
            {a for (p, _), s in self.tail.sources.items() if process in (None, p) for a in s.attempts if a}
        )

    def _attempt_steps(self, process: str | None) -> list[AttemptStep]:
        return attempt_steps(self.tail.sources, process) if self.plan.attempts == "rewind" else []

    def _held(self, run: FollowedRun) -> dict[str, Any]:
        """What the ledger keeps of the records a run's rows hold (``Sender.held``), as
        they are now."""
        run.attempt_steps = self._attempt_steps(run.source)
        run.attempts = self._attempts(run.source)
        assert self.sender is not None
        return self.sender.held(run)

    def close(self, *, finished: bool) -> None:
        for opened in self.runs.values():
            if opened.handle is not None and self.sender is not None:
                self.sender.close(opened.handle, opened.outcome, finished=finished, **self._held(opened.run))
                opened.handle = None


def _typical(source: SourceState) -> float | None:
    return statistics.median(source.gaps) if source.gaps else None


def _silence(source: SourceState, now: float, *, alive: bool = False) -> str:
    """How long ``source`` is silent, said from its newest step, or from its start (the
    journal's header) when it has written no record."""
    if source.step_end is not None:
        but = "alive but " if alive else ""
        return f"is {but}silent for {duration(now - source.clock)} since step {source.step_end[0]}"
    started = source.newest.started
    said = ("is alive and " if alive else "") + "has written no record"
    if not math.isfinite(started):  # an older writer's journal, which does not say when it started
        return f"{said} since it started"
    return f"{said} in the {duration(now - started)} since it started at {local_time(started)}"


def _appeared(root: Path, stop: threading.Event, interval: float, events: UploadEvents) -> bool:
    """Wait for the run directory (a sidecar may start before the job makes it); False: stopped."""
    if root.exists() and not root.is_dir():
        raise NoDataError(str(root), "it is not a directory")
    if not root.is_dir():
        events.message("note", f"waiting for {root} to be created (the job has not started)")
    try:
        while not root.is_dir():
            if stop.wait(interval):
                return False
    except KeyboardInterrupt:
        return False
    return True


WAITING_SAID_S = 10.0  # a follower that waits this long for run.json's sources says so
QUIET_SAID_S = 60.0  # a follower with nothing written for this long says so


def _expected(meta: dict[str, Any], first_record: float | None) -> int | None:
    """How many sources must have written before a global step can be complete: run.json's
    world_size (1 without one); while run.json is missing, every source for a while."""
    if meta.get("run_id") or (
        first_record is not None and time.monotonic() - first_record > NO_RUN_JSON_WAIT_S
    ):
        return expected_sources(meta)
    return UNKNOWN_SOURCES


def _identity(tail: RunTail) -> str:
    """``run_id`` from run.json; else the sources and their first record times (as
    ``run_identity``: the same ids a plain upload of the finished run uses)."""
    if tail.run_json_damaged:
        raise DamagedRunJsonError(str(tail.root / "run.json"), tail.run_json_damaged)
    given = tail.meta.get("run_id")
    if given:
        return str(given)
    firsts = [[p, r, s.first] for (p, r), s in sorted(tail.sources.items())]
    return hashlib.sha256(json.dumps(firsts).encode()).hexdigest()


def _late(late: dict[tuple[str, int], int], restarts: set[tuple[str, int]], to: Destination) -> str:
    which = ", ".join(
        f"{p} (rank {r}): {n}" + (" of its restart" if (p, r) in restarts else "")
        for (p, r), n in sorted(late.items())
    )
    why = [
        "a restart's records from before its first flush, sealed with the step it started at",
        "a source that was let go, or started after --sources were counted",
    ]
    if all(source in restarts for source in late):
        why = why[:1]
    elif not restarts:
        why = why[1:]
    return (
        f"record(s) came after their step or window was handed to {to.kind} ({which}: {'; or '.join(why)}); "
        f"the run is read again and written to fresh {to.kind} runs that hold them. The earlier run lacks "
        f"them: {to.left_behind()}"
    )


def _replaced(replaced: dict[tuple[str, int], int], to: Destination) -> str:
    return (
        f"{replacing(replaced)}; the run is read again and written to fresh {to.kind} runs (a rewind is "
        f"not used while following). The earlier run holds the replaced rows: {to.left_behind()}"
    )
