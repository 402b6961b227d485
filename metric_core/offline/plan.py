"""What to compute: a ``ReducePlan`` (mode, grouping, statistics per key, filters).

A plan knows nothing about how it is computed (``metric_core.offline.engine.execute`` runs it
on polars) and imports nothing heavy, so the command line checks its options, and
``upload_run`` forks its reducing child, before polars loads.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from metric_core.errors import PlanError, RequestError, opt
from metric_core.metric import LoggingMode

BASIC_STATS = ("mean", "sum", "max", "min", "std")
OFFLINE_STATS = ("count", "median", "first", "last")
EVERY_WITHOUT_TIME = "is a window length: group by time too (" + opt("by") + "'time')"
_PERCENTILE = re.compile(r"^p(\d{1,2}(?:\.\d+)?|100)$")


class By(str, Enum):
    """What a reducing mode groups records by, besides the key (and the source)."""

    STEP = "step"
    TIME = "time"


class Engine(str, Enum):
    """Where a plan runs: this machine's threads, or Ray tasks (the same bits either way)."""

    LOCAL = "local"
    RAY = "ray"

    @classmethod
    def of(cls, value: Engine | str) -> Engine:
        """``value`` as an Engine; PlanError for another name."""
        try:
            return cls(value)
        except ValueError:
            raise PlanError(
                f"is not one of {', '.join(e.value for e in cls)}", option="engine", value=value
            ) from None


@dataclass(frozen=True)
class Statistic:
    """One statistic of docs/modes.md: a name, and for ``pNN`` its quantile in [0, 1]."""

    name: str
    quantile: float | None = None

    @classmethod
    def parse(cls, text: str) -> Statistic:
        """``mean``, ``sum``, ``max``, ``min``, ``std``, ``count``, ``median``, ``first``,
        ``last`` or ``pNN`` (``p99``, ``p99.9``).

        >>> Statistic.parse("p99").quantile
        0.99
        """
        name = text.strip().lower()
        if name in BASIC_STATS or name in OFFLINE_STATS:
            return cls(name)
        match = _PERCENTILE.match(name)
        if match:
            q = float(match.group(1))
            if q <= 100:
                return cls(name, q / 100)  # as numpy's percentile divides it
        allowed = ", ".join((*BASIC_STATS, *OFFLINE_STATS, "pNN (NN from 0 to 100, e.g. p99, p99.9)"))
        raise PlanError(f"unknown statistic '{text}': use one of {allowed}")


@dataclass(frozen=True)
class ReducePlan:
    """What to compute; ``metric_core.offline.engine.execute`` computes it.

    ``overrides`` are (glob, statistic) pairs; for a key matched by several, the last
    one given wins. ``ranks`` are inclusive ranges; ``steps`` is a half-open
    [start, stop) range, either end open when None.
    """

    mode: LoggingMode = LoggingMode.GLOBAL_REDUCE
    by: By = By.STEP  # a string ("step", "time") is taken too
    every: float | None = None
    overrides: tuple[tuple[str, Statistic], ...] = ()
    keys: tuple[str, ...] = ()
    ranks: tuple[tuple[int, int], ...] = ()
    steps: tuple[int | None, int | None] | None = None
    # How a restarted source's attempts are read: "rewind", "all" or an attempt id (see
    # offline.read.attempts); a read option, but it shapes the data like the filters.
    attempts: str = "rewind"

    def __post_init__(self) -> None:
        if self.by not in ("step", "time"):
            raise PlanError("must be step or time", option="by", value=self.by)
        object.__setattr__(self, "by", By(self.by))
        if self.by is By.TIME and (self.every is None or self.every <= 0):
            raise PlanError(
                "needs a window length, e.g. " + opt("every") + "'10s'", option="by", value="time"
            )
        if self.mode is LoggingMode.PER_RANK_NO_REDUCE and self.overrides:
            raise PlanError(
                "has no effect with " + opt("mode") + "'per_rank_no_reduce' (raw values are kept): drop it, "
                "or choose a reducing mode",
                option="reduce",
                value=f"{self.overrides[0][0]}={self.overrides[0][1].name}",
            )
        if self.by is By.STEP and self.every is not None:
            raise PlanError(EVERY_WITHOUT_TIME, option="every", value=self.every)

    def as_dict(self) -> dict[str, Any]:
        """The plan as plain JSON values: what the upload's ids are derived from (so its
        shape never changes: earlier uploads are recognized by it) and W&B configs show."""
        return {
            "mode": self.mode.value,
            "by": self.by.value,
            "every": self.every,
            "reduce": [[pattern, stat.name] for pattern, stat in self.overrides],
            "keys": list(self.keys),
            "ranks": [list(r) for r in self.ranks],
            "steps": list(self.steps) if self.steps else None,
            "attempts": self.attempts,
        }

    @property
    def bucket(self) -> str:
        return "window_start" if self.by is By.TIME else "step"

    @property
    def group_columns(self) -> list[str]:
        if self.mode is LoggingMode.PER_RANK_REDUCE:
            return ["process", "rank", self.bucket]
        return [self.bucket]

    @property
    def output_columns(self) -> list[str]:
        if self.mode is LoggingMode.PER_RANK_NO_REDUCE:  # each record keeps its step, and its window
            window = ["window_start"] if self.by is By.TIME else []
            return ["process", "rank", "step", *window, "timestamp", "key", "value", "reduction"]
        return [*self.group_columns, "key", "value", "reduction", "count"]

    @property
    def sort_columns(self) -> list[str]:
        if self.mode is LoggingMode.PER_RANK_NO_REDUCE:
            return ["process", "rank", "timestamp"]
        return [*self.group_columns, "key"]

    @property
    def input_columns(self) -> list[str]:
        cols = {"key", "value", "reduction"}
        if self.mode is not LoggingMode.GLOBAL_REDUCE:
            cols |= {"process", "rank", "timestamp", "step"}
        if self.ranks:
            cols.add("rank")
        cols.add("timestamp" if self.by is By.TIME else "step")
        if any(s.name in ("first", "last") for _, s in self.overrides) or self.by is By.TIME:
            cols.add("timestamp")
        if self.steps is not None:
            cols.add("step")
        return sorted(cols)


def one_rank_a_process(sources: Iterable[tuple[str, int]]) -> None:
    """The per-rank modes' sources (process, rank) each with a process name of its own: a
    W&B run, a TensorBoard folder and a shared run's key suffix are named by process, so
    two ranks of one name would mix their rows in one run. Raises RequestError when two share one."""
    seen: dict[str, int] = {}
    for process, rank in sources:
        other = seen.setdefault(process, rank)
        if other != rank:
            low, high = sorted((other, rank))
            raise RequestError(
                f"ranks {low} and {high} both write as process {process!r}, and the per-rank modes "
                "name a run by its process: their rows would mix in one run. Give each rank a process "
                f"name of its own (e.g. {process}_r{low}, {process}_r{high}), or use "
                + opt("mode")
                + "global_reduce"
            )


def key_matcher(patterns: Iterable[str]) -> Callable[[str], bool]:
    """Whether a key matches any of the shell-style globs (``fnmatch``, case-sensitive).

    >>> key_matcher(["trainer/*", "[!p]*"])("trainer/loss"), key_matcher(["[!]"])("x")
    (True, False)
    """
    patterns = tuple(patterns)
    return lambda key: any(fnmatch.fnmatchcase(key, p) for p in patterns)


def parse_ranks(text: str) -> tuple[tuple[int, int], ...]:
    """``0,2-5`` -> ((0, 0), (2, 5))."""
    ranges = []
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise PlanError(f"{_holds(part, text)}not a rank or a range like 2-5", option="ranks", value=text)
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise PlanError(f"{_holds(part, text)}a range that runs backwards", option="ranks", value=text)
        ranges.append((lo, hi))
    return tuple(ranges)


def _holds(part: str, text: str) -> str:
    return "is " if part == text.strip() else f"holds '{part}', "


def parse_steps(text: str) -> tuple[int | None, int | None]:
    """``100:200`` -> (100, 200), the steps 100 to 199; ``100:`` and ``:200`` leave an end open;
    a negative end counts from the run's last step (``-5:``: the last 5, see ``last_steps``)."""
    m = re.fullmatch(r"\s*(-?\d+)?\s*:\s*(-?\d+)?\s*", text)
    if not m or ":" not in text:
        raise PlanError("is not START:STOP, e.g. 100:200 (steps 100 to 199)", option="steps", value=text)
    start = int(m.group(1)) if m.group(1) else None
    stop = int(m.group(2)) if m.group(2) else None
    if start is not None and stop is not None and (start < 0) == (stop < 0) and stop <= start:
        raise PlanError("has STOP at or before START: STOP is excluded", option="steps", value=text)
    return start, stop


def last_steps(steps: tuple[int | None, int | None], last: int) -> tuple[int | None, int | None]:
    """``steps`` with a negative end counted back from ``last``, the run's highest step, as
    Python slices count: ``-5:`` is the last 5 steps, ``:-1`` all but the last.

    >>> last_steps((-5, None), 99), last_steps((None, -1), 99), last_steps((10, 20), 99)
    ((95, None), (None, 99), (10, 20))
    """
    start, stop = steps
    return (
        last + 1 + start if start is not None and start < 0 else start,
        last + 1 + stop if stop is not None and stop < 0 else stop,
    )


def counts_back(steps: tuple[int | None, int | None] | None) -> bool:
    """Whether ``steps`` has an end counted back from the run's last step."""
    return steps is not None and any(v is not None and v < 0 for v in steps)


_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str, option: str = "every") -> float:
    """``10s``, ``500ms``, ``2m``, ``1.5h`` or plain seconds -> seconds (``option``: the
    parameter a bad one is said of)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|min|m|h|d)?\s*", text)
    if not m:
        raise PlanError("is not a duration like 10s, 500ms, 5m or 1h", option=option, value=text)
    seconds = float(m.group(1)) * _UNITS[m.group(2) or "s"]
    if seconds <= 0:
        raise PlanError("must be longer than zero", option=option, value=text)
    return seconds


def parse_overrides(items: Sequence[str]) -> tuple[tuple[str, Statistic], ...]:
    """``['trainer/*=p99', 'loss=median']`` -> ((glob, Statistic), ...)."""
    out = []
    for item in items:
        pattern, sep, stat = item.rpartition("=")
        if not sep or not pattern:
            raise PlanError("is not PATTERN=STAT, e.g. 'trainer/*=p99'", option="reduce", value=item)
        try:
            out.append((pattern, Statistic.parse(stat)))
        except PlanError as exc:
            raise PlanError(f"names an {exc.message}", option="reduce", value=item) from None
    return tuple(out)


def make_plan(
    *,
    mode: LoggingMode | str = LoggingMode.GLOBAL_REDUCE,
    by: By | str = By.STEP,
    every: float | str | None = None,
    reduce: str | Sequence[str] | dict[str, str] = (),
    keys: str | Sequence[str] = (),
    ranks: str | Sequence[tuple[int, int]] = (),
    steps: str | tuple[int | None, int | None] | None = None,
    attempts: str = "rewind",
) -> ReducePlan:
    """Build a plan from command-line style options (strings are parsed; ``reduce`` and
    ``keys`` take one string or several). A bad value raises ``PlanError`` naming it.

    >>> make_plan(mode="per_rank_reduce", by="time", every="30s", reduce=["loss=p99"]).overrides
    (('loss', Statistic(name='p99', quantile=0.99)),)
    """
    try:
        mode = LoggingMode(mode)
    except ValueError:
        allowed = ", ".join(m.value for m in LoggingMode)
        raise PlanError(f"is not one of {allowed}", option="mode", value=mode) from None
    try:
        by = By(by)
    except ValueError:
        raise PlanError("must be step or time", option="by", value=by) from None
    if by is By.STEP and every is not None:  # said with the value given, before it is parsed
        raise PlanError(EVERY_WITHOUT_TIME, option="every", value=every)
    if isinstance(reduce, dict):
        items = [f"{k}={v}" for k, v in reduce.items()]
    else:
        items = [reduce] if isinstance(reduce, str) else list(reduce)  # one PATTERN=STAT
    return ReducePlan(
        mode=mode,
        by=by,
        every=parse_duration(every) if isinstance(every, str) else every,
        overrides=parse_overrides(items),
        keys=(keys,) if isinstance(keys, str) else tuple(keys),
        ranks=parse_ranks(ranks) if isinstance(ranks, str) else tuple(ranks),
        steps=parse_steps(steps) if isinstance(steps, str) else steps,
        attempts=attempts.strip() or "rewind",
    )
