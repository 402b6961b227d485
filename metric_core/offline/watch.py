"""``metriclog watch``: a run followed while it is written, and its hung sources caught.

Each poll is ``inspect``'s reading of the run, judged against the wall clock: a source
is **stalled** when it has not finished and has been silent for longer than ``inspect``'s
stop rule allows (ten times its usual step time, twice its longest pause), so a job whose
ranks all hang together (a collective that never returns) is caught as well as one rank
that hangs. A file unchanged since the last poll is not read again (``inspect_run``'s
cache): a poll reads the open journals and the segments sealed since.

A run in object storage is a copy that trails its job by the copy's interval: silence
there is judged against the newest object's time (when the copy last brought anything),
not the wall clock, so the delay is not taken for a hang; a job that hangs whole, and so
leaves nothing new to copy, is not caught there (docs/storage.md).

``watch_run`` reports each poll and each new stall through callbacks and returns why it
ended: every source finished, a stall (with ``exit_on_stall``), or ``stop`` was set.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from metric_core.errors import NoDataError, RunChangedError
from metric_core.offline.inspect import InspectReport, SourceHealth, inspect_run

# Exit codes of `metriclog watch` (docs/commands.md): 1 means the request could not be served.
FINISHED, STALLED, STOPPED = 0, 3, 130
# Polls in a row that may find a file changed while it was read before watch gives up.
CHANGED_POLLS = 5


@dataclass
class WatchResult:
    """Why watching ended (``FINISHED``, ``STALLED`` or ``STOPPED``), and the last poll."""

    code: int
    report: InspectReport | None
    stalled: list[SourceHealth] = field(default_factory=list)  # every source that stalled


def watch_run(
    run_dir: str | os.PathLike[str],
    *,
    interval: float = 2.0,
    on_poll: Callable[[InspectReport], None] | None = None,
    on_stall: Callable[[SourceHealth], None] | None = None,
    on_waiting: Callable[[str], None] | None = None,
    exit_on_stall: bool = False,
    stop: threading.Event | None = None,
    follow_symlinks: bool = False,
    attempts: str = "rewind",
) -> WatchResult:
    """Poll ``run_dir`` every ``interval`` seconds until every source finished (a clean
    ``shutdown()`` each), or, with ``exit_on_stall``, a source stalled, or ``stop`` is set.

    ``on_poll`` gets each poll's report, ``on_stall`` each source once, when it stalls
    (again only if it wrote again since), ``on_waiting`` why there is nothing to show yet
    (no record so far, or a file changed while it was read: ``CHANGED_POLLS`` such polls in
    a row raise ``RunChangedError``).
    """
    stop = stop or threading.Event()
    changed = 0  # polls in a row that found a file changed under them
    cache: dict[Any, Any] = {}
    said: dict[tuple[str, int], float] = {}  # a stalled source -> its newest record then
    stalled: list[SourceHealth] = []
    report = None
    while True:
        try:
            report = inspect_run(run_dir, follow_symlinks=follow_symlinks, attempts=attempts, cache=cache)
        except NoDataError as exc:  # not started yet: wait for its first records
            if on_waiting is not None:
                on_waiting(str(exc))
        except RunChangedError as exc:  # a file replaced while it was read (a copy): next poll
            changed += 1
            if changed >= CHANGED_POLLS:
                raise
            if on_waiting is not None:
                on_waiting(str(exc))
        else:
            changed = 0
            if on_poll is not None:
                on_poll(report)
            for source in report.sources:
                key = (source.process, source.rank)
                if source.stalled and said.get(key) != source.last_timestamp:
                    said[key] = source.last_timestamp
                    stalled.append(source)
                    if on_stall is not None:
                        on_stall(source)
            if all(s.status == "finished" for s in report.sources):
                return WatchResult(FINISHED, report, stalled)
            if exit_on_stall and stalled:
                return WatchResult(STALLED, report, stalled)
        if stop.wait(interval):
            return WatchResult(STOPPED, report, stalled)
