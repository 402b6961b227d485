"""The story of a run: how each attempt of each source ended, which failed first, and
where the job paused (``inspect`` tells it; docs/commands.md describes the fields).

An attempt's ``end`` comes from what its writer recorded (``metric_core.format.life``, and the
stack files of ``metric_core.writer.ends`` in ``stacks/``):

* ``shutdown``: a clean ``shutdown()``;
* ``exception``: an uncaught exception of the main thread (or, when nothing else ended
  it, of another thread), or one ``record_exception`` recorded;
* ``signal``: SIGTERM, SIGINT or SIGHUP (a stack file that caught it, or a
  ``KeyboardInterrupt``), or a fatal signal (SIGSEGV, SIGABRT, ...);
* ``exit``: the interpreter exited without ``shutdown()``;
* ``running``: the newest attempt of its source, with a heartbeat recent enough;
* ``died``: none of these (SIGKILL, the OOM killer, ``os._exit``, a native crash).

Where two ends are recorded (a user's SIGTERM handler that raises), the earlier one is
the end. An attempt of files without a life (another tool's, metriclog's before format
4) has no ``end`` unless it shut down.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from metric_core.format.life import (
    CAUGHT_SIGNALS,
    STACK_NAME,
    STACKS_DIR,
    Life,
    place_text,
    process_gone,
    process_state,
)
from metric_core.offline.read.attempts import LEGACY, Attempt
from metric_core.offline.read.report import ReadReport, rel
from metric_core.offline.storage import RunPath, is_remote, listed_below, size_and_mtime

_FATAL = {
    "Segmentation fault": "SIGSEGV",
    "Aborted": "SIGABRT",
    "Bus error": "SIGBUS",
    "Floating-point exception": "SIGFPE",
    "Floating point exception": "SIGFPE",
    "Illegal instruction": "SIGILL",
}
# Errors a rank raises because a peer died (gloo, NCCL, a barrier): they yield to that death.
CONSEQUENCE = re.compile(
    r"closed by peer|reset by peer|remote worker|DistBackendError|BrokenBarrier|broken barrier"
    r"|communicator was aborted|Broken pipe|Connection refused",
    re.IGNORECASE,
)
# Ends this close together are one event: a consequence yields to the other.
SAME_EVENT_S = 1.0
PAUSE_MIN_S = 10.0  # the default --pause-after: this, or PAUSE_STEPS step times if longer
PAUSE_STEPS = 10.0
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')
_LIBRARY = re.compile(r"[/\\](site|dist)-packages[/\\]|[/\\]lib[/\\]python\d+(\.\d+)?[/\\]|^<")


@dataclass
class StackFile:
    """A stack dump of ``writer.ends`` in ``stacks/``: ``what`` is SIGTERM, SIGINT, SIGHUP,
    ``fatal`` or ``hang-N``."""

    path: RunPath
    rel: str
    attempt: str
    what: str
    mtime: float | None  # None in object storage (an object's time is its copy's)
    text: str = ""

    @property
    def caught(self) -> bool:
        """Whether it holds a dump (a file whose signal never came holds only its first line)."""
        return self.text.count("\n") > 1

    @property
    def signal(self) -> str | None:
        if self.what in CAUGHT_SIGNALS:
            return self.what
        if self.what == "fatal":
            found = re.search(r"Fatal Python error: ([^\n]+)", self.text)
            return _FATAL.get(found.group(1).strip(), "fatal signal") if found else "fatal signal"
        return None

    def where(self) -> str | None:
        """The innermost frame of the main thread outside the standard library and
        site-packages (the innermost of all when every one is a library's)."""
        first, _, rest = self.text.partition("\n")
        main = re.search(r"main thread (0x[0-9a-f]+)", first)
        block = None
        for part in re.split(r"\n\s*\n", rest):
            head = part.strip().splitlines()[:1]
            if head and main is not None and main.group(1) in head[0]:
                block = part
        if block is None:
            return None
        frames = [m for line in block.splitlines() if (m := _FRAME.match(line))]  # innermost first
        if not frames:
            return None
        chosen = next((m for m in frames if not _LIBRARY.search(m.group("file"))), frames[0])
        return f"{chosen.group('file')}:{chosen.group('line')} in {chosen.group('func')}"


@dataclass
class Failure:
    """The earliest attempt end that was not a clean shutdown."""

    process: str
    rank: int
    attempt: str
    number: int | None
    end: str
    exception: dict[str, Any] | None
    signal: str | None
    ended_at: float | None
    last_step: int | None
    where: str | None = None  # where its main thread was when it ended


@dataclass
class Pause:
    """A stretch in which sources took no step for at least their pause threshold."""

    step: int
    start: float
    seconds: float
    ongoing: bool
    sources: list[dict[str, Any]] = field(default_factory=list)  # [{"process", "rank"}]
    stuck_in: list[dict[str, Any]] = field(default_factory=list)  # [{"where", "sources"}]


def list_stacks(root: RunPath) -> dict[str, list[StackFile]]:
    """The stack files of the run, by attempt id (each read: they are small)."""
    folder = root / STACKS_DIR
    out: dict[str, list[StackFile]] = {}
    found: list[Any]
    try:
        if is_remote(root):
            found = [p for p in listed_below(folder) if p.name.endswith(".txt")]  # type: ignore[arg-type]
        elif folder.is_dir() and not folder.is_symlink():
            found = sorted(p for p in folder.iterdir() if p.is_file() and not p.is_symlink())
        else:
            return out
    except (OSError, FileNotFoundError):
        return out
    for path in found:
        match = STACK_NAME.match(path.name)
        if match is None:
            continue
        mtime = None
        try:
            size, mtime_ns = size_and_mtime(path)
            text = _text(path, size, mtime_ns)  # a file unchanged since the last look is not read again
            if isinstance(path, Path):
                mtime = mtime_ns / 1e9
        except OSError:
            continue
        f = StackFile(path, rel(path, root), match["attempt"], match["what"], mtime, text)
        out.setdefault(f.attempt, []).append(f)
    return out


@functools.lru_cache(maxsize=1024)
def _text(path: RunPath, size: int, mtime_ns: int) -> str:
    return path.read_bytes()[: 1 << 20].decode(errors="replace")


def tell(
    report: ReadReport, root: RunPath, now: float
) -> tuple[Failure | None, list[dict[str, Any]], dict[str, list[StackFile]]]:
    """Fill every attempt's end fields; the first failure of the run, or, where the
    attempts that failed first all ended together (one event: the launcher stopped them,
    the node went down), no first failure and those sources (``together``)."""
    stacks = list_stacks(root)
    shutdowns = {(s.process, s.rank, s.attempt): s.timestamp for s in report.shutdowns}
    by_source: dict[tuple[str, int], list[Attempt]] = {}
    for a in report.attempts:  # oldest first within a source
        by_source.setdefault((a.process, a.rank), []).append(a)
    for attempts in by_source.values():
        for i, a in enumerate(attempts, 1):
            life = report.lives.get((a.process, a.rank, a.attempt))
            a.number = life.restart + 1 if life is not None and life.restart is not None else i
            _end(a, life, stacks.get(a.attempt, []), shutdowns, a is attempts[-1], now)
    failure = first_failure(report.attempts)
    if failure is not None:
        over = ended_together([a for a in report.attempts if a.number == failure.number])
        if over:
            together = [
                {"process": a.process, "rank": a.rank}
                for a in sorted(over, key=lambda a: (a.rank, a.process))
            ]
            return None, together, stacks
    return failure, [], stacks


def ended_together(group: list[Attempt]) -> list[Attempt]:
    """The attempts of one attempt number (``Attempt.number``: every source's first, or
    second, ...) when every one failed and they ended together (``_together``: one event, the
    launcher stopped them or the node went down, no culprit); else none. ``tell`` (JSON's
    ``together``) and ``story_lines`` (the verdict) tell by it."""
    over = [a for a in group if a.failed]
    return over if len(over) == len(group) and _together(over) else []


def first_failure(attempts: list[Attempt]) -> Failure | None:
    """The earliest end that was not a shutdown; within ``SAME_EVENT_S`` of it, an end that
    is a consequence of a peer's death (a SIGTERM, a gloo or NCCL error) yields to another."""
    failed = sorted(
        (a for a in attempts if a.failed and a.ended_at is not None),
        key=lambda a: (a.ended_at, a.process, a.rank),
    )
    if not failed:
        return None
    first = failed[0]
    if _consequence(first):
        near = [a for a in failed if a.ended_at - first.ended_at <= SAME_EVENT_S]  # type: ignore[operator]
        first = next((a for a in near if not _consequence(a)), first)
    return Failure(
        first.process,
        first.rank,
        first.attempt,
        first.number,
        first.end,  # type: ignore[arg-type]
        first.exception,
        first.signal,
        first.ended_at,
        first.last_step,
        first.where,
    )


def _together(ended: list[Attempt]) -> bool:
    """Several attempts that ended the same way within ``SAME_EVENT_S``: one event, no culprit."""
    times = [a.ended_at for a in ended if a.ended_at is not None]
    if len(ended) < 2 or len(times) < len(ended):
        return False
    same = {(a.end, a.signal) for a in ended}
    return (
        len(same) == 1
        and ended[0].end in ("signal", "died", "exit")
        and max(times) - min(times) <= SAME_EVENT_S
    )


def _consequence(a: Attempt) -> bool:
    if a.end == "signal":
        return a.signal in ("SIGTERM", "SIGHUP", "SIGINT")
    if a.end == "exception" and a.exception is not None:
        return bool(CONSEQUENCE.search(f"{a.exception.get('type')}: {a.exception.get('message')}"))
    return a.end == "exit"


def _end(
    a: Attempt,
    life: Life | None,
    stacks: list[StackFile],
    shutdowns: dict[tuple[str, int, str | None], float | None],
    newest: bool,
    now: float,
) -> None:
    a.stacks = sorted(f.rel for f in stacks if f.caught)
    if life is not None:
        a.host, a.pid = life.host, life.pid
        a.last_step = life.last_flush[0] if life.last_flush is not None else None
        a.thread_exceptions = [
            {"thread": e.get("thread"), **(e.get("exception") or {}), "timestamp": e.get("timestamp")}
            for e in life.ends
            if e["kind"] == "thread_exception"
        ]
    key = (a.process, a.rank, None if a.attempt == LEGACY else a.attempt)
    failing = life is not None and any(e.get("in_shutdown") for e in life.ends)  # shutdown() mid-exception
    if not failing and (
        key in shutdowns or (a.attempt == LEGACY and any(k[:2] == key[:2] for k in shutdowns))
    ):
        a.end, a.ended_at = "shutdown", shutdowns.get(key)
        return
    if life is None:
        return  # no life recorded (another tool's files, or older ones): the end is not known
    ended: list[tuple[float, int, str, dict[str, Any] | None, str | None]] = []
    for e in life.ends:
        at = float(e.get("timestamp") or math.nan)
        if e["kind"] == "exception":
            ended.append((at, 0, "exception", e.get("exception"), None))
        elif e["kind"] == "signal":
            ended.append((at, 1, "signal", None, str(e.get("signal"))))
    wheres: dict[str, str | None] = {}
    for f in stacks:
        if f.caught and f.signal is not None:
            at = f.mtime if f.mtime is not None else (life.alive or math.nan)
            ended.append((at, 1, "signal", None, f.signal))
            wheres.setdefault(f.signal, f.where())
    if ended:
        at, _, a.end, a.exception, a.signal = min(ended, key=lambda e: (_or_inf(e[0]), e[1]))
        a.ended_at = at if math.isfinite(at) else life.alive
        a.where = a.exception.get("where") if a.exception else wheres.get(a.signal or "")
        return
    exits = [e for e in life.ends if e["kind"] == "exit"]
    if not exits and newest and not life.dead(now) and not process_gone(life):
        a.end = "running"  # a thread's exception does not end a process that goes on
        return
    if not exits and newest and process_state(life, a.started) is True:
        a.end, a.no_heartbeat = "running", True  # its process is there, its writer thread is not heard
        return
    if a.thread_exceptions:  # the process ended without shutdown() after it: the likely cause
        a.end, a.exception = (
            "exception",
            {k: a.thread_exceptions[0].get(k) for k in ("type", "message", "where")},
        )
        a.ended_at, a.where = (exits[-1].get("timestamp") if exits else life.alive), a.exception.get("where")
        return
    if exits:
        a.end, a.ended_at = "exit", exits[-1].get("timestamp")
        a.adopted = bool(exits[-1].get("adopted"))
        return
    a.end, a.ended_at = "died", life.alive


def end_of(a: Attempt, life: Life, stacks: list[StackFile], now: float) -> None:
    """Fill the end fields of ``a``, the newest attempt of its source, which did not shut
    down, from its life and stack files: the rule ``inspect`` tells ends by, for a follower
    that reads the run as it grows."""
    _end(a, life, stacks, {}, True, now)


def _or_inf(x: float) -> float:
    return x if math.isfinite(x) else math.inf


def pauses(
    report: ReadReport,
    stacks: dict[str, list[StackFile]],
    step_times: dict[tuple[str, int], float | None],
    now: float,
    pause_after: float | None = None,
) -> list[Pause]:
    """Every stretch in which a source (or several at once) took no step for at least
    ``pause_after`` seconds (default: max(PAUSE_MIN_S, PAUSE_STEPS step times) per source),
    ended or not; overlapping ones are one pause, whose sources are grouped by where
    their main thread was stuck (a stack dump of the pause, when there is one)."""
    found: list[tuple[float, float, int, bool, Attempt]] = []  # start, end, step, ongoing, attempt
    for a in report.attempts:
        life = report.lives.get((a.process, a.rank, a.attempt))
        if life is None:
            continue
        step_time = step_times.get((a.process, a.rank))
        if step_time is None and life.flushes > 1 and life.first_flush and life.last_flush:
            step_time = (life.last_flush[1] - life.first_flush[1]) / (life.flushes - 1)
        threshold = (
            pause_after if pause_after is not None else max(PAUSE_MIN_S, PAUSE_STEPS * (step_time or 0.0))
        )
        for step, start, seconds in life.gaps:
            if seconds >= threshold:
                found.append((start, start + seconds, int(step), False, a))
        if life.last_flush is not None and a.end != "shutdown":
            tail_end = now if a.end == "running" else (a.ended_at or life.alive)
            if tail_end is not None and tail_end - life.last_flush[1] >= threshold:
                found.append((life.last_flush[1], tail_end, life.last_flush[0] + 1, a.end == "running", a))
    found.sort(key=lambda p: (p[0], p[4].process, p[4].rank))
    out: list[Pause] = []
    members: list[list[tuple[float, float, int, bool, Attempt]]] = []
    for item in found:
        if members and item[0] <= out[-1].start + out[-1].seconds:
            last = out[-1]
            last.seconds = max(last.seconds, item[1] - last.start)
            last.step = min(last.step, item[2])
            last.ongoing |= item[3]
            members[-1].append(item)
        else:
            out.append(Pause(item[2], item[0], item[1] - item[0], item[3]))
            members.append([item])
    for pause, items in zip(out, members, strict=True):
        seen: dict[tuple[str, int], str | None] = {}
        for start, end, _, _, a in items:
            seen.setdefault((a.process, a.rank), None)
            where = _stuck_in(
                a, report.lives.get((a.process, a.rank, a.attempt)), stacks.get(a.attempt, []), start, end
            )
            if where is not None:
                seen[(a.process, a.rank)] = where
        pause.sources = [{"process": p, "rank": r} for p, r in sorted(seen)]
        groups: dict[str, list[dict[str, Any]]] = {}
        for (p, r), where in sorted(seen.items()):
            if where is not None:
                groups.setdefault(where, []).append({"process": p, "rank": r})
        pause.stuck_in = [
            {"where": w, "sources": s} for w, s in sorted(groups.items(), key=lambda g: (len(g[1]), g[0]))
        ]
    return out


def _stuck_in(a: Attempt, life: Life | None, stacks: list[StackFile], start: float, end: float) -> str | None:
    """Where the attempt's main thread was during a pause: where its heartbeats said it was
    (``Life.place_in``), else a hang dump the writer made in it, else the stack file of the
    signal that ended it (writers before journal format 6 say no place)."""
    if life is not None and (place := life.place_in(start, end)) is not None:
        return place_text(*place)
    by_rel = {f.rel: f for f in stacks}
    for e in life.ends if life is not None else []:
        if e["kind"] == "dump" and start <= float(e.get("timestamp") or -1) <= end + SAME_EVENT_S:
            f = by_rel.get(str(e.get("path")))
            if f is not None and (where := f.where()) is not None:
                return where
    for f in stacks:
        if f.caught and f.signal is not None and a.ended_at is not None and start <= a.ended_at <= end + 5:
            with contextlib.suppress(Exception):
                if (where := f.where()) is not None:
                    return where
    return None


def story_lines(failure: Failure | None, attempts: list[Attempt], pauses_found: list[Pause]) -> list[str]:
    """The verdict's first lines: each attempt of the job, how it failed (who first, why,
    who followed) or ended, and where it paused."""
    from metric_core.clock import duration, local_time

    lines = []
    numbers = sorted({a.number for a in attempts if a.number is not None and a.end is not None})
    several = len(numbers) > 1
    told = []
    for n in numbers:
        group = [a for a in attempts if a.number == n]
        label = f"attempt {n}" if several else ""
        if n > 1 and several:
            firsts = [a.first_step for a in group if a.first_step is not None]
            label += f" restarted from step {min(firsts)} and" if firsts else " restarted and"
        over = ended_together(group)
        if over:
            steps = sorted({a.last_step for a in over if a.last_step is not None})
            at = (  # each rank's own last step: the lowest alone was said for all (a new user's trial)
                after_step(steps[0] if steps else None, many=True)
                if len(steps) <= 1
                else f" after steps {steps[0]} to {steps[-1]} (their last flushed)"
            )
            when = f" at {local_time(over[0].ended_at)}" if over[0].ended_at is not None else ""
            head = f"{label}: " if label and not label.endswith("and") else f"{label} " if label else ""
            told.append(
                f"{head}all {len(over)} ranks {_what_short(over[0], True)} together{at}{when}".strip()
            )
            continue
        failed = first_failure(group)
        if failed is None:
            ends = {a.end for a in group}
            how = (
                "finished cleanly"
                if all(a.ended_well for a in group)
                else "is still running"
                if "running" in ends
                else None
            )
            if how is not None and (several or failure is not None):
                told.append(f"{label} {how}".strip())
            continue
        who = f"{failed.process} (rank {failed.rank})"
        text = (
            f"{label}{':' if label and not label.endswith('and') else ''} {who} {ended_how(failed)}".strip()
        )
        others = [a for a in group if (a.process, a.rank) != (failed.process, failed.rank) and a.failed]
        if others and failed.ended_at is not None:
            kinds: dict[tuple[Any, ...], list[Attempt]] = {}
            for a in others:
                kinds.setdefault((a.end, a.signal, (a.exception or {}).get("type")), []).append(a)
            # in time order: the group that ended first is told first, whatever its ranks
            for members in sorted(
                kinds.values(), key=lambda m: min(_or_inf(a.ended_at or math.nan) for a in m)
            ):
                later = max((a.ended_at or failed.ended_at) - failed.ended_at for a in members)
                n = len(members)
                count = (
                    ("the other rank" if n == 1 else f"the other {n} ranks")
                    if n == len(group) - 1
                    else ("1 other rank" if n == 1 else f"{n} other ranks")
                )
                text += f"; {duration(max(later, 0.0))} later {count} {_what_short(members[0], n > 1)}"
        told.append(text)
    if told:
        lines.append("; ".join(told) + ".")
    for p in pauses_found:
        names = ", ".join(f"{s['process']} (rank {s['rank']})" for s in p.sources)
        state = "and is still paused" if p.ongoing else f"for {duration(p.seconds)}"
        lines.append(f"Pause: {names} took no step from {local_time(p.start)} (step {p.step}) {state}.")
        for stuck in p.stuck_in:
            stuck_names = ", ".join(f"{s['process']} (rank {s['rank']})" for s in stuck["sources"])
            lines.append(f"  stuck at {stuck['where']}: {stuck_names}")
    return lines


def after_step(last_step: int | None, many: bool = False) -> str:
    """The one step a death is told by: the last step the attempt flushed, said as such."""
    its = "their" if many else "its"
    return (
        f" before {its} first flush" if last_step is None else f" after step {last_step} ({its} last flushed)"
    )


def ended_how(f: Failure | Attempt) -> str:
    """How an attempt ended, in words that follow its name: "raised ValueError('bad batch')
    after step 12 (its last flushed) at train.py:25 (step)", "was stopped by SIGTERM after
    step 30 (its last flushed)", "died after step 8 (its last flushed): no exception or
    signal recorded (...)". Used by ``inspect``, ``watch`` and the sidecar alike."""
    step = after_step(f.last_step)
    if f.end == "exception" and f.exception is not None:
        where = f.exception.get("where")
        message = short_paths(str(f.exception.get("message")))
        return f"raised {f.exception.get('type')}({message!r}){step}{_at(where)}"
    if f.end == "signal":
        return f"was stopped by {f.signal}{step}{_at(f.where)}"
    if f.end == "exit":
        return f"exited without shutdown(){step}"
    return (
        f"died{step}: no exception or signal recorded (SIGKILL, the OOM killer, os._exit or a native crash)"
    )


def _what_short(a: Attempt, many: bool) -> str:
    """What ranks that ended as ``a`` did, after their count ("the other 3 ranks ...")."""
    if a.end == "signal":
        launcher = " (the launcher)" if a.signal in ("SIGTERM", "SIGHUP") else ""
        return f"{'were' if many else 'was'} stopped by {a.signal}{launcher}"
    if a.end == "exception" and a.exception is not None:
        return f"raised {a.exception.get('type')}({short_paths(str(a.exception.get('message')))!r})"
    if a.end == "exit":
        return "ended without shutdown()"
    return "died with no exception or signal recorded"


_LONG_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[/\\][^/\\\s:'\"]+){4,}")


def short_paths(message: str) -> str:
    """A message with each long path in it shortened from the left to its last two parts
    (a build path inside gloo's error): ``.../tcp/pair.cc``. The message is whole otherwise."""
    return _LONG_PATH.sub(lambda m: ".../" + "/".join(re.split(r"[/\\]", m.group(0))[-2:]), message)


def _at(where: str | None) -> str:
    """``/long/path/train.py:88 in step`` as `` at train.py:88 (in step)``."""
    if not where:
        return ""
    place, _, function = where.rpartition(" in ")
    path, sep, line = place.rpartition(":")
    return f" at {os.path.basename(path)}{sep}{line} ({function})" if sep else f" at {where}"
