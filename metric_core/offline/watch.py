"""``metriclog watch``: a run followed while it is written, its hung sources caught.

Each poll is ``inspect``'s reading of the run, judged against the wall clock. A source is

* **finished**: its newest attempt shut down cleanly;
* **died**: its newest attempt ended otherwise (an exception, a signal, an exit without
  ``shutdown()``, or its heartbeat is gone: ``offline.inspect.story``);
* **stalled**: alive (its writer's heartbeat goes on) but silent for ``stall_after``
  seconds (default: max(10 s, ten times its usual step time, twice its longest pause), so
  scheduling noise on fast steps never fires), also when every source hangs together (a
  collective that never returns);
* **running** otherwise.

Sources that go silent within ``EPISODE_S`` of each other are one **episode**: one
``on_stall`` call, whatever the number of sources (in a lockstep job where one rank hangs,
the others soon wait for it); a source that joins it, or a stack dump that appears later,
is said (``on_note``), never a second ``on_stall``. A new attempt of a source is said as
a restart. Watching ends by itself once every source finished (``FINISHED``), or every
source finished or died and no new attempt began within ``restart_grace`` (``OVER``). A
rank of ``world_size`` (run.json) that never wrote is waited for as long, and named: a run
with one is never ``FINISHED``. Without run.json's ``world_size`` and with no rank 0 among
the writers (rank 0's ``init()`` writes run.json), the end waits ``NO_RUN_JSON_WAIT_S``
from the first records seen: a fast rank may finish before the others start.

A file unchanged since the last poll is not read again (``inspect_run``'s cache).

A run in object storage is a copy that trails its job by the copy's interval: silence
there is judged against the newest object's time (when the copy last brought anything),
not the wall clock, so the delay is not taken for a hang; a job that hangs whole, and so
leaves nothing new to copy, is not caught there (docs/storage.md).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from metric_core.clock import duration
from metric_core.errors import NoDataError, RunChangedError
from metric_core.offline.alerts import Alarms, Alert, ValueWatch
from metric_core.offline.inspect import InspectReport, SourceHealth, inspect_run, never_wrote, story
from metric_core.offline.inspect.health import (
    EPISODE_S,
    culprit_of,
    held_by_hang,
    held_said,
    where_text,
)
from metric_core.offline.read.report import ReadReport
from metric_core.offline.read.tail import NO_RUN_JSON_WAIT_S
from metric_core.offline.storage import missing_run, run_path

# Exit codes of `metriclog watch` (docs/commands.md): 1 means the request could not be served.
FINISHED, STALLED, OVER, STOPPED = 0, 3, 4, 130
# Polls in a row that may find a file changed while it was read before watch gives up.
CHANGED_POLLS = 5
RESTART_GRACE = 60.0


@dataclass
class Episode:
    """Sources that went silent within ``EPISODE_S`` of each other: one stall."""

    sources: list[SourceHealth]
    since: float  # the newest record of its first source
    # The source the others wait for (``inspect.health.culprit_of``), None when none stands
    # apart; and every running source the hang holds, where it is (None: its writer does not say).
    culprit: SourceHealth | None
    held: list[tuple[SourceHealth, str | None]]
    stacks: set[str] = field(default_factory=set)  # dumps said so far, relative to the run directory

    @property
    def first(self) -> SourceHealth:
        return self.sources[0]

    def who(self) -> str:
        s = self.culprit or self.first
        return f"{s.process} (rank {s.rank})"

    def _where(self) -> dict[tuple[str, int], str | None]:
        return {(h.process, h.rank): w for h, w in self.held}

    def told(self) -> str:
        """The stall in words: the culprit and where it is, then the others grouped by where
        they wait; or, with none standing apart, every source by place (``held_said``, the
        sidecar's words too)."""
        s = self.culprit or self.first
        held = [(h.process, h.rank) for h, _ in self.held] or [(h.process, h.rank) for h in self.sources]
        culprit = (self.culprit.process, self.culprit.rank) if self.culprit is not None else None
        pace = f", steps every {duration(s.cadence_s)}" if s.cadence_s else ""
        dumps = f"; stack dumps: {', '.join(sorted(self.stacks))}" if self.stacks else ""
        silent = duration(s.silent_s)
        if culprit is not None:
            head = f"{self.who()} stalled at step {s.last_step}: silent for {silent}{pace}"
        else:
            head = f"{len(held)} sources stalled together at step {s.last_step}, silent for {silent}{pace}"
        return f"{head}{held_said(culprit, held, self._where())}{dumps}"

    def variables(self, run_dir: str) -> dict[str, str]:
        """What ``--on-stall``'s command gets: the culprit's process, rank and place (empty
        when none stands apart), and every source of the stall, the culprit first."""
        c, s = self.culprit, self.culprit or self.first
        held = [h for h, _ in self.held if h is not c] or [h for h in self.sources if h is not c]
        root = run_dir.rstrip("/")
        return {
            "METRICLOG_RUN_DIR": run_dir,
            "METRICLOG_PROCESS": c.process if c else "",
            "METRICLOG_RANK": str(c.rank) if c else "",
            "METRICLOG_WHERE": (self._where().get((c.process, c.rank)) or "") if c else "",
            "METRICLOG_LAST_STEP": str(s.last_step),
            "METRICLOG_SILENT_S": f"{s.silent_s:.3f}",
            "METRICLOG_PROCESSES": ",".join(h.process for h in ([c] if c else []) + held),
            "METRICLOG_STACKS": " ".join(f"{root}/{p}" for p in sorted(self.stacks)),
        }


@dataclass
class WatchResult:
    """Why watching ended (``FINISHED``, ``STALLED``, ``OVER`` or ``STOPPED``), and the last poll."""

    code: int
    report: InspectReport | None
    episodes: list[Episode] = field(default_factory=list)  # every stall, its sources
    alerts: list[Alert] = field(default_factory=list)  # every alarm on values, in order


def watch_run(
    run_dir: str | os.PathLike[str],
    *,
    interval: float = 2.0,
    on_poll: Callable[[InspectReport], None] | None = None,
    on_stall: Callable[[Episode], None] | None = None,
    on_note: Callable[[str], None] | None = None,
    on_waiting: Callable[[str], None] | None = None,
    exit_on_stall: bool = False,
    stop: threading.Event | None = None,
    follow_symlinks: bool = False,
    attempts: str = "rewind",
    stall_after: float | None = None,
    restart_grace: float = RESTART_GRACE,
    wait: bool = False,
    alarms: Alarms | None = None,
    on_alert: Callable[[Alert], None] | None = None,
) -> WatchResult:
    """Poll ``run_dir`` every ``interval`` seconds until every source finished, or finished
    or died with no restart within ``restart_grace`` seconds, or, with ``exit_on_stall``,
    a stall, or ``stop`` is set.

    ``on_poll`` gets each poll's report, ``on_stall`` each episode once, ``on_note`` what
    else happened (a death, a restart, a source that joined a stall, a dump that appeared),
    ``on_waiting`` why there is nothing to show yet (no record so far, or a file changed
    while it was read: ``CHANGED_POLLS`` such polls in a row raise ``RunChangedError``).
    A ``run_dir`` that does not exist is a ``NoDataError`` (a mistyped path never waits),
    unless ``wait``: then it is waited for, as the job that creates it may not have started.
    With ``alarms``, each poll also reads the values that settled since the last one
    (``alerts.ValueWatch``) and gives ``on_alert`` each new episode; the values left when
    watching ends are judged then.
    """
    missing = None if wait else missing_run(run_path(run_dir))
    if missing is not None:
        raise missing
    stop = stop or threading.Event()
    note = on_note or (lambda _: None)
    changed = 0  # polls in a row that found a file changed under them
    cache: dict[Any, Any] = {}
    episodes: list[Episode] = []
    stalled_at: dict[tuple[str, int], float] = {}  # a stalled source -> its newest record then
    seen: dict[tuple[str, int], tuple[str, str]] = {}  # a source -> (newest attempt, state)
    result = WatchResult(FINISHED, None)
    values = (
        ValueWatch(run_path(run_dir), alarms, follow_symlinks=follow_symlinks) if alarms is not None else None
    )
    alert = on_alert or (lambda _: None)
    over_since: float | None = None
    first_seen: float | None = None  # the first poll that found records
    said: set[str] = set()

    def grace_over() -> bool:  # the run looks over: whether it has, for --restart-grace
        nonlocal over_since
        over_since = over_since if over_since is not None else time.monotonic()
        return time.monotonic() - over_since >= restart_grace

    def run_json_noted(read: ReadReport) -> None:  # a damaged run.json, said once, not each poll
        for notice in read.notices:
            if notice.startswith("run.json:") and notice not in said:
                said.add(notice)
                note(notice)

    while True:
        try:
            report = inspect_run(
                run_dir,
                follow_symlinks=follow_symlinks,
                attempts=attempts,
                cache=cache,
                stall_after=stall_after,
                on_read=run_json_noted,
            )
        except NoDataError as exc:  # not started yet: wait for its first records
            if on_waiting is not None:
                on_waiting(str(exc))
            if exc.over is None:  # or its writers ended before recording any: over, as below
                over_since = None
            elif grace_over():
                result.code = FINISHED if exc.over == "finished" else OVER
                return _last_values(result, values, alert)
        except RunChangedError as exc:  # a file replaced while it was read (a copy): next poll
            changed += 1
            if changed >= CHANGED_POLLS:
                raise
            if on_waiting is not None:
                on_waiting(str(exc))
        else:
            changed = 0
            result.report = report
            if on_poll is not None:
                on_poll(report)
            for found in values.poll() if values is not None else []:
                result.alerts.append(found)
                alert(found)
            restarted = _changes(report, seen, note)
            fresh = _stalls(report, episodes, stalled_at, note)
            for episode in fresh:
                result.episodes.append(episode)
                if on_stall is not None:
                    on_stall(episode)
            # Another tool's files (no writer: no attempt, no heartbeat) hold nothing open, as
            # in the sidecar: the writers' sources decide the end, when there are any.
            writers = [s for s in report.sources if s.attempts]
            states = {s.state for s in writers} or {s.state for s in report.sources}
            # A rank of world_size that never wrote (it died before init(), or never started)
            # left no file to be seen finishing or dying by: the run did not finish.
            absent = (
                never_wrote(report.missing_ranks, report.world_size)
                if report.missing_ranks and report.world_size is not None
                else ""
            )
            # run.json is written by the first rank 0 at init(): until one wrote, with no
            # world_size to count by, more ranks may still start (the sidecar waits as long).
            first_seen = first_seen if first_seen is not None else time.monotonic()
            early = (
                report.world_size is None
                and bool(writers)
                and not any(s.rank == 0 for s in writers)
                and time.monotonic() - first_seen < NO_RUN_JSON_WAIT_S
            )
            if early and states <= {"finished", "died"} and "early" not in said:
                said.add("early")
                note(
                    "every source that wrote finished or died, but no rank 0 has written and there is "
                    f"no run.json: waiting up to {duration(NO_RUN_JSON_WAIT_S)} for the job's other ranks"
                )
            if states == {"finished"} and not absent and not early:
                result.code = FINISHED
                return _last_values(result, values, alert)
            if exit_on_stall and fresh:
                result.code = STALLED
                return result
            # Another tool's sources record no end: silent past their threshold (ended), or
            # stopped before the others and as silent since, they are over as the dead are.
            if states <= {"finished", "died", "ended", "stopped_early"} and not restarted and not early:
                if over_since is None and absent:
                    note(
                        f"every source that wrote finished or died, and {absent}; waiting "
                        f"{duration(restart_grace)} for it or a restart (--restart-grace)"
                    )
                if grace_over():
                    result.code = OVER
                    *most, end = sorted(states)
                    ends = f"{', '.join(most)} or {end}" if most else end
                    note(
                        f"the job is over: every source {ends}, and no restart came within "
                        f"{duration(restart_grace)} (--restart-grace)"
                    )
                    return _last_values(result, values, alert)
            else:
                over_since = None
        if stop.wait(interval):
            result.code = STOPPED
            return result


def _last_values(
    result: WatchResult, values: ValueWatch | None, alert: Callable[[Alert], None]
) -> WatchResult:
    """The job is over: what is left unsettled is judged (no flush will come)."""
    for found in values.poll(final=True) if values is not None else []:
        result.alerts.append(found)
        alert(found)
    return result


def _changes(
    report: InspectReport, seen: dict[tuple[str, int], tuple[str, str]], note: Callable[[str], None]
) -> bool:
    """Say each restart and each death once; whether a source restarted in this poll."""
    restarted = False
    for s in report.sources:
        key, who = (s.process, s.rank), f"{s.process} (rank {s.rank})"
        newest = s.attempts[-1] if s.attempts else None
        attempt, state = (newest.attempt if newest else ""), s.state
        before = seen.get(key)
        seen[key] = (attempt, state)
        if before is not None and before[0] != attempt and newest is not None:
            restarted = True
            start = f" from step {newest.first_step}" if newest.first_step is not None else ""
            note(f"{who} restarted: attempt {newest.number}{start}")
        if state == "died" and (before is None or before[1] != "died" or before[0] != attempt):
            how = story.ended_how(newest) if newest is not None and newest.end else "ended"
            note(f"{who} {how}")
    return restarted


def _stalls(
    report: InspectReport,
    episodes: list[Episode],
    stalled_at: dict[tuple[str, int], float],
    note: Callable[[str], None],
) -> list[Episode]:
    """Sort this poll's stalled sources into episodes; the episodes that began in it."""
    fresh: list[Episode] = []
    by_key = {(s.process, s.rank): s for s in report.sources}
    for key in [
        k
        for k, at in stalled_at.items()
        if k not in by_key or not by_key[k].stalled or by_key[k].last_timestamp != at
    ]:
        del stalled_at[key]  # it wrote again, ended, or is gone: a later silence is a new stall
    for episode in episodes:
        episode.sources = [s for s in episode.sources if (s.process, s.rank) in stalled_at]
    episodes[:] = [e for e in episodes if e.sources]
    for s in sorted((s for s in report.sources if s.stalled), key=lambda s: s.last_timestamp):
        key = (s.process, s.rank)
        if key in stalled_at:
            continue
        stalled_at[key] = s.last_timestamp
        joined = next((e for e in episodes if abs(s.last_timestamp - e.since) <= EPISODE_S), None)
        if joined is None:
            held = held_by_hang(report.sources, since=s.last_timestamp)
            episode = Episode([s], s.last_timestamp, culprit_of(held), [(h, where_text(h)) for h in held])
            episodes.append(episode)
            fresh.append(episode)
        else:
            joined.sources.append(s)
            if joined not in fresh:
                note(f"{s.process} (rank {s.rank}) stalled too, at step {s.last_step} (the same stall)")
    for episode in episodes:  # dumps: with the stall's first word, or said as they appear
        current = {(s.process, s.rank): s for s in report.sources}
        for member in episode.sources:
            now = current.get((member.process, member.rank), member)
            for path in now.attempts[-1].stacks if now.attempts else []:
                if path not in episode.stacks:
                    episode.stacks.add(path)
                    if episode not in fresh:
                        note(f"stack dump of {now.process} (rank {now.rank}) in the stall: {path}")
    return fresh
