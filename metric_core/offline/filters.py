"""What the filters of a plan (``keys``, ``ranks``) and its ``reduce`` patterns matched.

A pattern that matches nothing is most often a typo. The engine notes the ranks and keys
the records held before any filter dropped them (``Seen``, filled as files are read), and
once the run is read, each filter or pattern that matched nothing is said, with what the
run holds instead (``unmatched``): a warning, an error with strict reading, and the reason
given when the filters leave no record at all (``nothing_left``).
"""

from __future__ import annotations

import difflib
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from metric_core.errors import FilteredOutError, Message, PlanError, opt
from metric_core.offline.plan import ReducePlan, key_matcher

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
