"""The filters of a plan (``keys``, ``ranks``, ``steps``) and its ``reduce`` patterns: applied
(``plan_filtered``, ``key_matching``, ``statistic_chooser``), and what they matched.

A pattern that matches nothing is most often a typo. The engine notes the ranks and keys
the records held before any filter dropped them (``Seen``, filled as files are read), and
once the run is read, each filter or pattern that matched nothing is said, with what the
run holds instead (``unmatched``): a warning, an error with strict reading, and the reason
given when the filters leave no record at all (``nothing_left``).
"""

from __future__ import annotations

import difflib
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from metric_core.errors import FilteredOutError, Message, NoDataError, PlanError, opt
from metric_core.offline.plan import ReducePlan, key_matcher
from metric_core.offline.read import RunScan, all_skipped

# Keys listed in full when the run has at most this many; else the nearest few.
LISTED_KEYS = 6
NEAREST_KEYS = 3


# Keys held to name the nearest to a pattern that matched nothing, at most: a run of
# millions of keys is not held whole to say which of its keys are near a typo
SAMPLED_KEYS = 10_000


@dataclass
class Seen:
    """The ranks and keys of the records read, before the filters (each tracked only when a
    filter or pattern needs it): the ranks, which of ``patterns`` (key and ``reduce``
    patterns) matched a key, and the first SAMPLED_KEYS distinct keys (``more_keys``: there
    were more). Safe to fill from several threads."""

    ranks: set[int] | None = None
    keys: set[str] | None = None
    patterns: tuple[str, ...] = ()
    matched: set[str] = field(default_factory=set)
    more_keys: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def wanted_by(cls, plan: ReducePlan) -> Seen:
        tracked = bool(plan.keys or plan.overrides)
        return cls(
            ranks=set() if plan.ranks else None,
            keys=set() if tracked else None,
            patterns=(*plan.keys, *(pattern for pattern, _ in plan.overrides)),
        )

    def add(self, ranks: Iterable[int] | None, keys: Iterable[str] | None) -> None:
        """The ranks and the distinct ``keys`` of some records read."""
        if self.keys is None or keys is None:
            self._merge(ranks, None, set(), False)
            return
        keys = list(keys)
        matched = {p for p in set(self.patterns) - self.matched if any(map(key_matcher([p]), keys))}
        self._merge(ranks, keys, matched, False)

    def found(self) -> tuple[Any, ...]:
        """What was seen, as plain values (to hand to another process's ``Seen``: ``merge``)."""
        return self.ranks, self.keys, self.matched, self.more_keys

    def merge(self, found: tuple[Any, ...]) -> None:
        ranks, keys, matched, more = found
        self._merge(ranks, keys, matched, more)

    def _merge(
        self, ranks: Iterable[int] | None, keys: list[str] | set[str] | None, matched: set[str], more: bool
    ) -> None:
        with self._lock:
            if self.ranks is not None and ranks is not None:
                self.ranks.update(ranks)
            if self.keys is None or keys is None:
                return
            self.matched |= matched
            room = SAMPLED_KEYS - len(self.keys)
            new = [k for k in keys if k not in self.keys] if room < len(keys) else keys
            self.keys.update(list(new)[: max(room, 0)])
            self.more_keys = self.more_keys or more or len(new) > room


def unmatched(plan: ReducePlan, seen: Seen) -> list[PlanError]:
    """Each rank range, key pattern and ``reduce`` pattern of ``plan`` that matched no record."""
    out = []
    if seen.ranks is not None:
        for lo, hi in plan.ranks:
            if not any(lo <= r <= hi for r in seen.ranks):
                which = f"rank {lo}" if lo == hi else f"ranks {lo}-{hi}"
                out.append(
                    PlanError(
                        f"matches no record (no {which}); the run's ranks: {ranges(seen.ranks)}",
                        option="ranks",
                        value=f"{lo}" if lo == hi else f"{lo}-{hi}",
                    )
                )
    if seen.keys is not None:
        keys = sorted(seen.keys)
        for pattern in plan.keys:
            if pattern not in seen.matched:
                out.append(
                    PlanError(
                        f"matches no key; {_nearest(pattern, keys, seen.more_keys)}",
                        option="keys",
                        value=pattern,
                    )
                )
        for pattern, stat in plan.overrides:
            if pattern not in seen.matched:
                out.append(
                    PlanError(
                        f"matches no key; {_nearest(pattern, keys, seen.more_keys)}",
                        option="reduce",
                        value=f"{pattern}={stat.name}",
                    )
                )
    return out


def nothing_left(run_dir: str, plan: ReducePlan, notes: list[PlanError]) -> FilteredOutError:
    """The error of a result the filters left empty: the filters given (all of them, since
    any may be the one that left nothing), then those that matched no record (``notes``)."""
    given = []
    if plan.keys:
        given.append(opt("keys") + ", ".join(repr(k) for k in plan.keys))
    if plan.ranks:
        given.append(
            opt("ranks") + repr(",".join(f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in plan.ranks))
        )
    if plan.steps is not None:
        start, stop = plan.steps
        given.append(opt("steps") + repr(f"{'' if start is None else start}:{'' if stop is None else stop}"))
    said = [n.template or str(n) for n in notes]
    if len(given) == 1 and said:  # the one filter, and what it matched
        return FilteredOutError(run_dir, ": " + Message.joined("; ", said))
    together = " together" if len(given) > 1 else ""
    return FilteredOutError(
        run_dir, together + ": " + Message.joined(", ", given) + Message.joined("", ("; " + n for n in said))
    )


def ranges(values: Iterable[int]) -> str:
    """``{0, 1, 2, 5}`` -> ``0-2, 5``."""
    out: list[list[int]] = []
    for v in sorted(values):
        if out and v == out[-1][1] + 1:
            out[-1][1] = v
        else:
            out.append([v, v])
    return ", ".join(f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in out)


def _nearest(pattern: str, keys: list[str], more: bool = False) -> str:
    """The run's keys (``keys``; ``more``: the first SAMPLED_KEYS of more) nearest to ``pattern``."""
    if not keys:
        return "the run holds no key"
    return nearest(pattern, keys, more=more)


def nearest(
    wanted: str, names: list[str], *, whose: str = "the run's", noun: str = "keys", more: bool = False
) -> str:
    """``names`` said for a ``wanted`` that is none of them: all of them when they are few,
    else the nearest few (``more``: ``names`` are the first of more).

    >>> nearest("rewrd", ["reward", "tokens"], whose="the samples'", noun="numeric fields")
    "the samples' numeric fields: reward, tokens"
    """
    if len(names) <= LISTED_KEYS and not more:
        return f"{whose} {noun}: " + ", ".join(names)
    near = difflib.get_close_matches(wanted, names, NEAREST_KEYS, cutoff=0.0)
    among = f"the first {len(names):,} of {whose} {noun}" if more else f"{whose} {len(names)} {noun}"
    return f"nearest of {among}: " + ", ".join(near)


def plan_filtered(plan: ReducePlan, frame: pl.LazyFrame, columns: list[str] | None = None) -> pl.LazyFrame:
    """``columns`` (the plan's input columns by default) with the plan's rank and step
    filters applied (``--key`` is applied per file: ``key_matching``)."""
    lf = frame.select(plan.input_columns if columns is None else columns)
    if plan.ranks:
        rank = pl.col("rank")
        cond = pl.lit(False)
        for lo, hi in plan.ranks:
            cond = cond | rank.is_between(lo, hi)
        lf = lf.filter(cond)
    if plan.steps is not None:
        start, stop = plan.steps
        if start is not None:
            lf = lf.filter(pl.col("step") >= start)
        if stop is not None:
            lf = lf.filter(pl.col("step") < stop)
    return lf


def key_matching(df: pl.DataFrame, match: Callable[[str], bool] | None) -> pl.DataFrame:
    """The records whose key a ``--key`` pattern matches (each distinct key tested once)."""
    if match is None or df.height == 0:
        return df
    keys = [k for k in df["key"].unique().cast(pl.String) if match(k)]
    return df.filter(pl.col("key").cast(pl.String).is_in(keys))


def statistic_chooser(plan: ReducePlan) -> Callable[[str, str], str]:
    """The statistic of a key: the last ``--reduce`` pattern that matches it, or its recorded reduction."""
    overrides = [(key_matcher([pattern]), stat.name) for pattern, stat in plan.overrides]

    def statistic_of(key: str, recorded: str) -> str:
        chosen = [name for match, name in overrides if match(key)]
        return chosen[-1] if chosen else recorded

    return statistic_of


def nothing_kept(plan: ReducePlan, scan: RunScan, unmatched: list[PlanError]) -> NoDataError:
    """The error of a result without a record: every record was skipped (another tool's
    files, checked as they were read), or the filters left none."""
    if scan.report.records == 0:
        return all_skipped(scan.report)
    return nothing_left(str(scan.run_dir), plan, unmatched)
