"""How each source is judged: its cadence, finished / stopped early / unfinished, when it is
stalled, who stopped first with its last values, and stragglers."""

from __future__ import annotations

import re
import statistics
from typing import Any

import numpy as np
import polars as pl

# (STALL_MIN_S: no silence shorter is a stall, scheduling noise)
from metric_core.format.life import STALL_MIN_S, Life, place_text
from metric_core.offline.inspect import story
from metric_core.offline.inspect.aggregates import LAST_VALUES, Source, SourceSteps
from metric_core.offline.inspect.report import FirstToStop, SourceHealth, Straggler
from metric_core.offline.read import RunScan

QUIET_FACTOR = 10.0
OWN_GAP_FACTOR = 2.0
STRAGGLER_RATIO = 1.2
MIN_STEP_TIMES = 10
_ROLE = re.compile(r"_r\d+$")


Cadence = dict[Source, tuple[float | None, float | None, int]]

# Where a rank waits for others (its innermost frame, as ``writer.where`` says it): a
# collective, a lock, a queue, a pipe or a socket. A rank in one of these is not the culprit
# when the others are not.
KNOWN_WAIT = re.compile(
    r"^(torch/distributed/|torch/_C|threading\.py|queue\.py|multiprocessing/|socket\.py|"
    r"selectors\.py|ssl\.py|subprocess\.py|asyncio/|concurrent/futures/)"
)


def odd_one_out(places: dict[Source, tuple[str, str]]) -> Source | None:
    """The source the others wait for, from where each is (its own line, its innermost frame):
    the one whose line differs when all the others share one; with no such majority, the one
    not inside a known wait (``KNOWN_WAIT``) when the others are; otherwise none. Who went
    silent first never decides it."""
    if len(places) < 2:
        return None
    lines: dict[str, list[Source]] = {}
    for source, (own, _) in places.items():
        lines.setdefault(own, []).append(source)
    waiting = {source for source, (_, inner) in places.items() if KNOWN_WAIT.match(inner)}
    if len(places) >= 3 and len(lines) == 2:
        alone = [group[0] for group in lines.values() if len(group) == 1]
        # (Alone in a wait while the others are all busy elsewhere: it waits for them.)
        if len(alone) == 1 and not (alone[0] in waiting and not waiting - {alone[0]}):
            return alone[0]
    busy = [source for source in places if source not in waiting]
    return busy[0] if len(busy) == 1 else None


def cadence_of(steps: dict[Source, SourceSteps]) -> Cadence:
    """Per source: the median and the longest gap between consecutive steps' last records,
    and how many gaps there were."""
    out: Cadence = {}
    for source, its in steps.items():
        gaps = np.diff(np.sort(its.done))
        out[source] = (float(np.median(gaps)), float(gaps.max()), len(gaps)) if len(gaps) else (None, None, 0)
    return out


def quiet_threshold(typical: float | None, longest: float | None, floor: float = 0.0) -> float:
    """The one rule of "silent too long", for ``inspect`` (stopped early), ``watch`` (stalled)
    and the sidecar (a source without a life let go): ten times its usual step time, or twice
    its longest pause, whichever is longest (and ``floor`` at least)."""
    return max(floor, QUIET_FACTOR * (typical or 0.0), OWN_GAP_FACTOR * (longest or 0.0))


def stall_threshold(typical: float | None, longest: float | None) -> float:
    """How long a live source may be silent before it is stalled: ``quiet_threshold``, and
    ``STALL_MIN_S`` at least."""
    return quiet_threshold(typical, longest, STALL_MIN_S)


def source_status(clean: bool, lag: float, typical: float | None, longest: float | None) -> str:
    if clean:
        return "finished"
    threshold = quiet_threshold(typical, longest)
    return "stopped_early" if lag > threshold and lag > 0 else "unfinished"


def file_health(scan: RunScan, file_ids: list[int]) -> dict[str, Any]:
    files = [scan.report.files[i] for i in file_ids]
    return {
        "files": len(files),
        "skipped": sum(f.skipped for f in files),
        "truncated": any(f.truncated for f in files),
        "dropped": sum(f.dropped_records for f in files),  # recorded, but its writer could not write them
    }


def find_stopped_early(per_key: pl.DataFrame, sources: list[SourceHealth]) -> list[FirstToStop]:
    """Every source that stopped early, the first to stop first, with its last values."""
    stopped = sorted(
        (s for s in sources if s.status == "stopped_early"),
        key=lambda s: (s.last_timestamp, s.process, s.rank),
    )
    if not stopped:
        return []
    values = {}
    for s in stopped:  # the first LAST_VALUES keys by name: a source of millions lists no million
        # Two columns of the source's rows, never a copy of its rows whole or of the
        # processes as text (millions of keys): a query of its own per source.
        first = (
            per_key.lazy()
            .filter((pl.col("process") == s.process) & (pl.col("rank") == s.rank))
            .select("key", "last_value")
            .top_k(LAST_VALUES, by="key", reverse=True)
            .sort("key")
            .collect()
        )
        values[(s.process, s.rank)] = dict(first.iter_rows())
    return [
        FirstToStop(
            process=s.process,
            rank=s.rank,
            last_step=s.last_step,
            last_timestamp=s.last_timestamp,
            lag_s=s.lag_s,
            status=s.status,
            last_values=values.get((s.process, s.rank), {}),  # NaN stays a float; to_json writes null
        )
        for s in stopped
    ]


def find_stragglers(steps: dict[Source, SourceSteps], cadence: Cadence) -> list[Straggler]:
    """Sources whose median step time is STRAGGLER_RATIO times the median of the other
    sources' of their role or more (each measured over MIN_STEP_TIMES steps at least)."""
    roles: dict[str, dict[tuple[str, int], float]] = {}
    for (process, rank), (typical, _, n) in cadence.items():
        if typical is not None and n >= MIN_STEP_TIMES:
            roles.setdefault(_ROLE.sub("", process), {})[(process, rank)] = typical
    slow: dict[tuple[str, int], tuple[float, float]] = {}
    for members in roles.values():
        for source, own in members.items():
            others = [t for s, t in members.items() if s != source]
            if others and own >= STRAGGLER_RATIO * statistics.median(others) > 0:
                slow[source] = (own, statistics.median(others))
    if not slow:
        return []
    slow_roles = {_ROLE.sub("", process) for process, _ in slow}
    with_role = pl.concat(  # the sources of the roles with a straggler: a row a step of each
        pl.LazyFrame({"step": its.step, "reached": its.reached}).select(
            pl.lit(process, pl.String).alias("process"),
            pl.lit(rank, pl.Int64).alias("rank"),
            pl.lit(_ROLE.sub("", process)).alias("role"),
            "step",
            "reached",
        )
        for (process, rank), its in steps.items()
        if _ROLE.sub("", process) in slow_roles
    )
    fastest = with_role.group_by("role", "step").agg(fastest=pl.col("reached").min())
    lag = pl.col("reached") - pl.col("fastest")
    behind = (
        with_role.join(fastest, on=["role", "step"])
        .group_by("process", "rank")
        .agg(worst_lag_s=lag.max(), at_step=pl.col("step").sort_by(lag, pl.col("step")).last())
        .sort("process", "rank")
        .collect(engine="streaming")  # a row a step of every source: no window, no index lists
    )
    out = [
        Straggler(process, rank, worst, at_step, *slow[(process, rank)])
        for process, rank, worst, at_step in behind.iter_rows()
        if (process, rank) in slow
    ]
    return sorted(out, key=lambda s: -s.step_time_s / s.role_step_time_s)


# Sources whose silence began this close together stall as one episode (watch, the sidecar).
EPISODE_S = 5.0
NO_HEARTBEAT = "no heartbeat: stuck in native code holding the GIL, or stopped"


def live_where(life: Life | None, no_heartbeat: bool) -> dict[str, Any] | None:
    """Where a live source's main thread is: its newest heartbeat's place (``Life.where``:
    own, inner, since, and every thread's once it was silent long), for ``inspect``, ``watch``
    and the sidecar alike; None when its writer does not say, or is not heard (a place from
    before its heartbeat stopped is not where it is)."""
    if no_heartbeat or life is None or life.where is None:
        return None
    return dict(life.where)


def where_said(where: dict[str, Any] | None, no_heartbeat: bool) -> str | None:
    """A live source's place (``live_where``) in the commands' words; ``NO_HEARTBEAT`` for one
    whose writer is not heard; None when its writer does not say."""
    if no_heartbeat:
        return NO_HEARTBEAT
    return place_text(where["own"], where["inner"]) if where is not None else None


def where_text(s: SourceHealth) -> str | None:
    """Where a running source is, as the commands say it (None: its writer does not say)."""
    return where_said(s.where, s.no_heartbeat)


Who = tuple[str, int]  # a source: its process and rank


def culprit_among(held: dict[Who, tuple[dict[str, Any] | None, bool]]) -> Who | None:
    """Of the sources a hang holds (each with ``live_where`` and whether its heartbeat
    stopped), the one the others wait for: the only one; the one whose heartbeat stopped
    while the others' go on; else ``odd_one_out`` of where they are; None when none stands
    apart. ``watch`` (``culprit_of``) and the sidecar judge by it."""
    if len(held) == 1:
        return next(iter(held))  # alone in the hang: the others go on
    unheard = [who for who, (_, no_heartbeat) in held.items() if no_heartbeat]
    if len(unheard) == 1:
        return unheard[0]
    places = {
        who: (where["own"], where["inner"])
        for who, (where, no_heartbeat) in held.items()
        if where is not None and not no_heartbeat
    }
    return odd_one_out(places)


def held_said(culprit: Who | None, held: list[Who], where: dict[Who, str | None]) -> str:
    """The sources a stall holds, grouped by where each is (``where_said``), as ``watch`` and
    the sidecar say them after their first words: with a culprit, where it is and who waits
    for it (``, at P; waiting for it: a (rank 0), b (rank 1) at Q``); without, every source by
    place and that none stands apart (``: a (rank 0), b (rank 1) at Q; none stands apart``)."""

    def by_place(sources: list[Who]) -> str:
        groups: dict[str | None, list[str]] = {}
        for p, r in sources:
            groups.setdefault(where.get((p, r)), []).append(f"{p} (rank {r})")
        return "; ".join(", ".join(names) + (f" at {at}" if at else "") for at, names in groups.items())

    if culprit is not None:
        at = f", at {where[culprit]}" if where.get(culprit) else ""
        others = [who for who in held if who != culprit]
        return at + (f"; waiting for it: {by_place(others)}" if others else "")
    apart = (
        "none stands apart"
        if any(where.get(who) for who in held)
        else ("their writers do not say where they are")
    )
    return f": {by_place(held)}; {apart}"


def held_by_hang(sources: list[SourceHealth], since: float | None = None) -> list[SourceHealth]:
    """The running sources silent for half their stall threshold or more: those a hang
    holds (the others still take steps); with ``since`` (an episode's start: the newest
    record of its first source), only those whose silence began within ``EPISODE_S`` of it
    (a source of an earlier stall, silent still, is that stall's)."""
    return [
        s
        for s in sources
        if s.end == "running"
        and s.silent_s >= 0.5 * (s.stall_after_s or STALL_MIN_S)
        and (since is None or abs(s.last_timestamp - since) <= EPISODE_S)
    ]


def culprit_of(held: list[SourceHealth]) -> SourceHealth | None:
    """Of the sources a hang holds (``held_by_hang``), the one the others wait for
    (``culprit_among``); None when no source stands apart."""
    found = culprit_among({(s.process, s.rank): (s.where, s.no_heartbeat) for s in held})
    return next((s for s in held if (s.process, s.rank) == found), None)


def state_of(s: SourceHealth, quiet: bool = False) -> str:
    """A source's state (``SourceHealth.state``, which inspect sets): finished, died,
    stalled, running; or, for files that record no life (another tool's), stopped_early by
    the lag rule, else ended once it is ``quiet`` (silent past its threshold, as the whole
    run is: it is over, how it ended is not recorded), else running."""
    if s.status == "finished":
        return "finished"
    if s.attempts and s.attempts[-1].failed:
        return "died"
    if s.stalled:
        return "stalled"
    if s.end is None and s.status == "stopped_early":
        return "stopped_early"
    return "ended" if s.end is None and quiet else "running"


def state_said(s: SourceHealth) -> str:
    """A source's state with its one step: a death by the last step it flushed (as inspect
    and the sidecar say it), any other state by its newest record's step."""
    state = s.state
    if state == "died":
        return "died" + story.after_step(s.attempts[-1].last_step if s.attempts else None)
    return f"{state} at step {s.last_step}"
