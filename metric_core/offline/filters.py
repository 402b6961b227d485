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

from metric_core.errors import FilteredOutError, PlanError, opt
from metric_core.offline.plan import ReducePlan, key_matcher

# Keys listed in full when the run has at most this many; else the nearest few.
LISTED_KEYS = 6
NEAREST_KEYS = 3


@dataclass
class Seen:
    """The ranks and keys of the records read, before the filters (each tracked only when a
    filter or pattern needs it). Safe to fill from several threads."""

    ranks: set[int] | None = None
    keys: set[str] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def wanted_by(cls, plan: ReducePlan) -> Seen:
        return cls(
            ranks=set() if plan.ranks else None,
            keys=set() if plan.keys or plan.overrides else None,
        )

    def add(self, ranks: Iterable[int] | None, keys: Iterable[str] | None) -> None:
        with self._lock:
            if self.ranks is not None and ranks is not None:
                self.ranks.update(ranks)
            if self.keys is not None and keys is not None:
                self.keys.update(keys)


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
            if not any(map(key_matcher([pattern]), keys)):
                out.append(
                    PlanError(f"matches no key; {_nearest(pattern, keys)}", option="keys", value=pattern)
                )
        for pattern, stat in plan.overrides:
            if not any(map(key_matcher([pattern]), keys)):
                out.append(
                    PlanError(
                        f"matches no key; {_nearest(pattern, keys)}",
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
        return FilteredOutError(run_dir, ": " + "; ".join(said))
    together = " together" if len(given) > 1 else ""
    return FilteredOutError(run_dir, f"{together}: {', '.join(given)}" + "".join(f"; {n}" for n in said))


def ranges(values: Iterable[int]) -> str:
    """``{0, 1, 2, 5}`` -> ``0-2, 5``."""
    out: list[list[int]] = []
    for v in sorted(values):
        if out and v == out[-1][1] + 1:
            out[-1][1] = v
        else:
            out.append([v, v])
    return ", ".join(f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in out)


def _nearest(pattern: str, keys: list[str]) -> str:
    if not keys:
        return "the run holds no key"
    if len(keys) <= LISTED_KEYS:
        return "the run's keys: " + ", ".join(keys)
    near = difflib.get_close_matches(pattern, keys, NEAREST_KEYS, cutoff=0.0)
    return f"nearest of the run's {len(keys)} keys: " + ", ".join(near)
