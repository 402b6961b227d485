"""What a restart of a source replaces of the rows already handed to a destination.

A restart (a new attempt of a source, ``offline.read.attempts``) replaces the records of
the source's earlier attempts from the step of its first ``flush(step)`` on. The follow
finds a restart into rows it handed over as it reads (``tail.Follower``); a later upload
finds one from the ledger, which keeps, per W&B run, the attempts whose records its rows
hold (in start order, with the first step each had flushed then) and the last step sent
(``stale_steps``). An attempt seen before its first flush replaces nothing yet: its first
flush after the upload is what makes rows already sent stale.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

Source = tuple[str, int]
# One attempt as a run holds it: process, rank, attempt id, the step of its first flush
# (None: it had not flushed yet). A run's list holds each source's attempts in start order.
AttemptStep = tuple[str, int, str, int | None]


def replaced_from(first_steps: Sequence[int | None]) -> list[int | None]:
    """For one source's attempts in start order (the step of each one's first flush), the
    step from which a later attempt replaces each one's records (None: none does).

    >>> replaced_from([0, 9, None, 5])
    [5, 5, 5, None]
    """
    out: list[int | None] = []
    lowest: int | None = None
    for first in reversed(first_steps):
        out.append(lowest)
        if first is not None:
            lowest = first if lowest is None else min(lowest, first)
    return out[::-1]


def stale_steps(
    sent: Iterable[Sequence[Any]] | None, now: Iterable[AttemptStep], last_step: int | None
) -> dict[Source, tuple[int, int | None]]:
    """The steps of rows already sent that a restart replaced since: per source, the first
    and last of them (last None: not known, a run of time windows). ``sent`` is what a
    ledger entry holds (None: an entry written before it held attempts, read as before:
    nothing found), ``now`` the same of the run as read now, ``last_step`` the highest step
    of the rows sent."""
    if not sent:
        return {}
    then_cuts = _cuts(sent)
    now_cuts = _cuts(now)
    stale: dict[Source, tuple[int, int | None]] = {}
    for (process, rank, attempt), then in then_cuts.items():
        cut = now_cuts.get((process, rank, attempt))
        if cut is None or (then is not None and then <= cut):
            continue  # replaced from the same step when the rows were made (or not at all)
        if last_step is not None and cut > last_step:
            continue  # no row sent from there on
        last = last_step if then is None or last_step is None else min(then - 1, last_step)
        lo, hi = stale.get((process, rank), (cut, last))
        stale[(process, rank)] = (min(lo, cut), None if hi is None or last is None else max(hi, last))
    return stale


def replacing(replaced: dict[Source, int], to: str = "W&B") -> str:
    """The follow's and a later upload's words for a restart into rows handed over."""
    which = ", ".join(f"{p} (rank {r}) from step {s}" for (p, r), s in sorted(replaced.items()))
    return f"restarted from a checkpoint: {which}, replacing rows already handed to {to}"


def steps_said(stale: dict[Source, tuple[int, int | None]], of: str) -> str:
    """``step 9 of {of} was``, ``steps 9-12 of {of} were``, ``steps 9 on of {of} were``: the
    stale rows of every source."""
    lo = min(first for first, _ in stale.values())
    lasts = [last for _, last in stale.values()]
    if any(last is None for last in lasts):
        return f"steps {lo} on of {of} were"
    hi = max(last for last in lasts if last is not None)
    return f"step {lo} of {of} was" if lo == hi else f"steps {lo}-{hi} of {of} were"


def _cuts(attempts: Iterable[Sequence[Any]]) -> dict[tuple[str, int, str], int | None]:
    by_source: dict[Source, list[tuple[str, int | None]]] = {}
    for process, rank, attempt, first in attempts:
        by_source.setdefault((str(process), int(rank)), []).append((str(attempt), first))
    out: dict[tuple[str, int, str], int | None] = {}
    for (process, rank), held in by_source.items():
        for (attempt, _), cut in zip(held, replaced_from([f for _, f in held]), strict=True):
            out[(process, rank, attempt)] = cut
    return out


def attempt_steps(sources: dict[Source, Any], process: str | None) -> list[AttemptStep]:
    """``AttemptStep``s of the sources a run of ``process`` holds (None: every source), as a
    follower knows them (``tail.SourceState``: its attempts, their starts and first steps)."""
    out: list[AttemptStep] = []
    for (p, rank), state in sorted(sources.items()):
        if process not in (None, p) or state.static:
            continue
        for attempt, a in sorted(state.attempts.items(), key=lambda a: (a[1].started, a[0])):
            out.append((p, rank, attempt, a.first_step))
    return out
