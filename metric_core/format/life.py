"""What a writer records of its attempt's life beside the records: where it ran, its
heartbeat, when its steps ended, its pauses, and how it ended.

Both halves use it: the writer's journal decoder fills a ``Life`` from the frames
(``metric_core.format.journal``), sealing stores it in the segment's metadata
(``SegmentMeta.life``), and the reader merges the lives of an attempt's files
(``Life.merged``) to tell its story (``offline.read.attempts``, ``inspect``).

Each step's flush time is kept at full resolution in the open journal; a sealed segment
keeps the first and last flush and every **gap** between consecutive flushes of at
least ``GAP_KEPT_S`` (the ``MAX_GAPS`` longest where there are more: a bounded list
however many steps the segment holds), so a pause of a second or more shows in any
file, also across steps that recorded nothing.

Each heartbeat may say where the main thread is (``Life.where``: the caller's own innermost
frame and the innermost frame, ``metric_core.writer.where``); a gap kept also keeps the place
the rank spent most of it in (``Life.gap_where``), so a pause tells where it was spent in any
file, whether or not a stack was dumped.

An end event (``Life.ends``) is one of the writer's ``E`` frames: ``{"kind": ...,
"timestamp": ...}`` with ``kind`` ``"exception"`` (``exception``: ``{"type", "message",
"where"}``), ``"signal"`` (``signal``: ``"SIGINT"``, a ``KeyboardInterrupt``),
``"thread_exception"`` (an uncaught exception of another thread: ``thread`` and
``exception``), ``"exit"`` (the interpreter exited without ``shutdown()``) or
``"dump"`` (the writer saved every thread's stack: ``path``, relative to the run
directory, and ``step``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import socket
from dataclasses import dataclass, field
from typing import Any

# Gaps between consecutive flushes that a sealed segment keeps (shorter ones are step time),
# and how many at most (the longest: a segment of slow steps keeps its pauses, not every step).
GAP_KEPT_S = 1.0
MAX_GAPS = 1000
# A writer whose heartbeat is older than this many of its flush intervals (and DEAD_AFTER_MIN_S)
# is taken for dead: its background thread writes one at least every interval.
DEAD_AFTER_INTERVALS = 10
DEAD_AFTER_MIN_S = 5.0
# A source silent (no flush) this long is stalled at the least (``offline.inspect.health``); the
# writer then adds every thread's place to its heartbeat.
STALL_MIN_S = 10.0
END_KINDS = ("exception", "signal", "exit")
# Stack files (``metric_core.writer.ends`` writes them, ``offline.inspect.story`` reads them):
# ``stacks/{stem}.{attempt}.{what}.txt``, ``what`` a caught signal, ``fatal`` or ``hang-N``.
STACKS_DIR = "stacks"
CAUGHT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")
# A file armed for a signal (faulthandler writes into it if the signal comes) is hidden (a
# leading dot) until it holds a dump and the process could show it: ``stacks/`` lists the
# signals that came, not every one that might have.
STACK_NAME = re.compile(
    r"^(?P<armed>\.)?(?P<stem>[^.].*)\.(?P<attempt>[0-9a-f]{16})\.(?P<what>[A-Za-z0-9-]+)\.txt$"
)


def stack_name(stem: str, attempt: str, what: str, *, armed: bool = False) -> str:
    """The name of a stack file in ``STACKS_DIR`` (``STACK_NAME`` parses it back); ``armed``:
    a file made ready for a signal that has not come (hidden)."""
    return f"{'.' if armed else ''}{stem}.{attempt}.{what}.txt"


# Where launchers say how often they restarted the job: an attempt's number is this plus one.
RESTART_COUNT_VARS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")


def pid_namespace() -> str | None:
    """This process's pid namespace, where the system says (Linux), e.g. ``pid:[4026531836]``."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def restart_count() -> int | None:
    """The launcher's restart count of this process, where it sets one."""
    for name in RESTART_COUNT_VARS:
        raw = os.environ.get(name, "")
        if raw.strip().isdigit():
            return int(raw)
    return None


@dataclass
class Life:
    """One attempt's life as one file (or several, merged) recorded it."""

    host: str | None = None
    pid: int | None = None
    pidns: str | None = None  # its pid namespace (Linux): a pid means the same process only within it
    flush_interval: float | None = None
    restart: int | None = None  # the launcher's restart count (TORCHELASTIC_RESTART_COUNT, ...)
    alive: float | None = None  # the last sign of life: its newest frame's wall time
    flushes: int = 0
    first_flush: tuple[int, float] | None = None  # (step, wall time)
    last_flush: tuple[int, float] | None = None
    # Each gap between consecutive flushes of GAP_KEPT_S or more: [step in progress, start, seconds].
    gaps: list[list[Any]] = field(default_factory=list)
    ends: list[dict[str, Any]] = field(default_factory=list)  # its E frames, in order
    # Where the main thread was at the newest heartbeat that said: {"own", "inner", "since"}
    # (and "threads": {name: [own, inner]} once it was silent STALL_MIN_S).
    where: dict[str, Any] | None = None
    gap_where: list[list[Any]] = field(default_factory=list)  # [gap's start, own, inner] per gap kept
    # Heartbeats at each place since the last flush (not stored: a gap's place is its most seen).
    _beats: dict[tuple[str, str], int] = field(default_factory=dict, repr=False, compare=False)

    def copy(self) -> Life:
        """A copy whose lists and counts are its own (a follower decodes on from it)."""
        return dataclasses.replace(
            self,
            gaps=list(self.gaps),
            ends=list(self.ends),
            gap_where=list(self.gap_where),
            where=dict(self.where) if self.where is not None else None,
            _beats=dict(self._beats),
        )

    def beat(
        self, at: float, where: tuple[str, str] | None = None, threads: dict[str, Any] | None = None
    ) -> None:
        """A heartbeat at ``at``; ``where`` (a W frame) when the place changed, else it is the last one."""
        self.seen(at)
        if where is not None:
            if self.where is None or (self.where["own"], self.where["inner"]) != where:
                before = self.where
                self.where = {"own": where[0], "inner": where[1], "since": at}
                if before is not None and "threads" in before:  # the silence's, said once
                    self.where["threads"] = before["threads"]
            if threads:
                self.where["threads"] = {name: list(p) for name, p in threads.items()}
        if self.where is not None:
            place = (self.where["own"], self.where["inner"])
            self._beats[place] = self._beats.get(place, 0) + 1

    def flushed(self, step: int, at: float) -> None:
        """One flush(step) that ended at ``at``."""
        if self.last_flush is not None:
            gap = at - self.last_flush[1]
            if gap >= GAP_KEPT_S:
                self.gaps.append([self.last_flush[0] + 1, self.last_flush[1], gap])
                if (place := self.most_seen()) is not None:
                    self.gap_where.append([self.last_flush[1], *place])
                if len(self.gaps) > 2 * MAX_GAPS:
                    self._keep_longest_gaps()
        else:
            self.first_flush = (step, at)
        self._beats.clear()
        if self.where is not None:
            self.where.pop("threads", None)  # they told the silence this flush ended
        self.last_flush = (step, at)
        self.flushes += 1
        self.seen(at)

    def most_seen(self) -> tuple[str, str] | None:
        """Where the heartbeats since the last flush said the main thread was most often
        (the first of those seen as often): the place of the gap they fall in."""
        return max(self._beats, key=lambda p: self._beats[p]) if self._beats else None

    def _keep_longest_gaps(self) -> None:
        longest = sorted(self.gaps, key=lambda g: -g[2])[:MAX_GAPS]
        self.gaps = sorted(longest, key=lambda g: g[1])
        starts = {g[1] for g in self.gaps}
        self.gap_where = [w for w in self.gap_where if w[0] in starts]

    def seen(self, at: float) -> None:
        if math.isfinite(at) and (self.alive is None or at > self.alive):
            self.alive = at

    def dead(self, now: float) -> bool:
        """No heartbeat for long enough that the writer cannot be running."""
        if self.alive is None:
            return True
        interval = self.flush_interval or 1.0
        return now - self.alive > max(DEAD_AFTER_INTERVALS * interval, DEAD_AFTER_MIN_S)

    def to_dict(self) -> dict[str, Any]:
        if len(self.gaps) > MAX_GAPS:
            self._keep_longest_gaps()
        fields = dataclasses.asdict(self)
        del fields["_beats"]
        return {k: v for k, v in fields.items() if v is not None and v != []}

    def place_in(self, start: float, end: float) -> tuple[str, str] | None:
        """Where the main thread spent the pause from ``start`` to ``end``: the place kept for a
        gap that began there, or, for the pause still going on (no flush ended it), the place
        its heartbeats said most so far (``most_seen``, the rule a gap is kept by)."""
        for at, own, inner in self.gap_where:
            if abs(at - start) < 1e-6:
                return (own, inner)
        if self.last_flush is not None and abs(self.last_flush[1] - start) < 1e-6:
            return self.most_seen()
        return None

    @classmethod
    def parse(cls, raw: Any) -> Life | None:
        """A ``Life`` from its dict (a segment's metadata); None when it is not one."""
        if not isinstance(raw, dict):
            return None
        try:
            life = cls(
                host=_opt(raw.get("host"), str),
                pid=_opt(raw.get("pid"), int),
                pidns=_opt(raw.get("pidns"), str),
                flush_interval=_opt(raw.get("flush_interval"), float),
                restart=_opt(raw.get("restart"), int),
                alive=_opt(raw.get("alive"), float),
                flushes=int(raw.get("flushes", 0)),
                first_flush=_pair(raw.get("first_flush")),
                last_flush=_pair(raw.get("last_flush")),
                gaps=[[int(s), float(a), float(g)] for s, a, g in raw.get("gaps", [])],
                ends=[e for e in raw.get("ends", []) if is_event(e)],
                where=_where(raw.get("where")),
                gap_where=[[float(a), str(o), str(i)] for a, o, i in raw.get("gap_where", [])],
            )
        except (TypeError, ValueError, KeyError):
            return None
        return life

    @classmethod
    def merged(cls, lives: list[Life]) -> Life:
        """The lives of one attempt's files (in any order) as one: gaps between the files
        count too, ends are kept in time order."""
        out = cls()
        ordered = sorted(lives, key=lambda life: life.first_flush[1] if life.first_flush else math.inf)
        for life in ordered:
            for name in ("host", "pid", "pidns", "flush_interval", "restart"):
                if getattr(out, name) is None:
                    setattr(out, name, getattr(life, name))
            if life.alive is not None:
                out.seen(life.alive)
            if life.first_flush is not None:
                if out.last_flush is not None:
                    gap = life.first_flush[1] - out.last_flush[1]
                    if gap >= GAP_KEPT_S:
                        out.gaps.append([out.last_flush[0] + 1, out.last_flush[1], gap])
                else:
                    out.first_flush = life.first_flush
                out.gaps.extend(life.gaps)
                out.gap_where.extend(life.gap_where)
                assert life.last_flush is not None
                out.last_flush = life.last_flush
                out.flushes += life.flushes
                out._beats = {}  # the beats since the newest flush are this file's (or a later one's)
            for place, n in life._beats.items():
                out._beats[place] = out._beats.get(place, 0) + n
            out.ends.extend(life.ends)
            if life.where is not None and (out.where is None or life.where["since"] >= out.where["since"]):
                out.where = life.where
        out.ends.sort(key=lambda e: e.get("timestamp") or 0.0)
        return out


def place_text(own: str, inner: str) -> str:
    """A place as the commands say it: the job's own line, and the library call it is in."""
    return own if own == inner else f"{own}, in {inner}"


def is_event(e: Any) -> bool:
    """An end event as the writer writes it: a kind, and a time that is a number."""
    at = e.get("timestamp", 0.0) if isinstance(e, dict) else None
    return isinstance(e, dict) and isinstance(e.get("kind"), str) and type(at) in (int, float)


def _where(raw: Any) -> dict[str, Any] | None:
    if raw is None:
        return None
    out: dict[str, Any] = {"own": str(raw["own"]), "inner": str(raw["inner"]), "since": float(raw["since"])}
    if isinstance(raw.get("threads"), dict):
        out["threads"] = {str(n): [str(p[0]), str(p[1])] for n, p in raw["threads"].items()}
    return out


def _opt(value: Any, kind: type) -> Any:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(value)
    return kind(value)


def _pair(value: Any) -> tuple[int, float] | None:
    if value is None:
        return None
    step, at = value
    return (int(step), float(at))


def process_gone(life: Life) -> bool:
    """Its process is known to be gone: written on this host and in this pid namespace (a
    container with this host name but pids of its own is another place), and no process
    has its pid."""
    return process_state(life) is False


def process_state(life: Life, started: float | None = None) -> bool | None:
    """Whether its process is there (True), known gone (False), or not known (None: written
    on another host or in another pid namespace, or without a pid). A process with its pid
    that started after the attempt did (``started``) is another one: the pid was reused."""
    if life.pid is None or life.host != socket.gethostname() or life.pidns != pid_namespace():
        return None
    try:
        os.kill(life.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return None
    try:  # a zombie (killed, not yet waited for by its parent) is gone
        with open(f"/proc/{life.pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        if fields[0] in (b"Z", b"X"):
            return False
        if started is not None and math.isfinite(started):
            born = _boot_time() + int(fields[19]) / os.sysconf("SC_CLK_TCK")
            if born > started + PID_REUSED_AFTER_S:
                return False
        return True
    except (OSError, IndexError, ValueError):
        return True


# A process with the attempt's pid that started this long after the attempt is another one.
PID_REUSED_AFTER_S = 2.0


@functools.lru_cache(maxsize=1)
def _boot_time() -> float:
    with open("/proc/stat", "rb") as f:
        for line in f:
            if line.startswith(b"btime "):
                return float(line.split()[1])
    raise OSError("no btime in /proc/stat")
