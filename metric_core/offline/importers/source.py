"""What every importer is: a source read as it goes, yielding records in our schema.

An importer names what identifies its source (``identity``: the run id of run.json is a
digest of it, so importing the same source again, or uploading it later, is recognised),
the run's name and config, and one ``Stream`` per writing source (process, rank) whose
items are ``(step, key, value, timestamp)`` tuples or ``Text`` samples, in the order read.
What it cannot carry it counts in ``skipped`` (a reason: how many), and the import says it.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

Warn = Callable[[str], None]
# What ``skipped`` counts an integer past 2**53 under: float64 cannot hold it exactly
PAST_FLOAT64 = "integers past 2**53 (float64 cannot hold them exactly)"


class Text(NamedTuple):
    """A sample (``Reduce.SAMPLE``): text and other values that are no number."""

    step: int
    key: str
    timestamp: float
    sample: dict[str, Any]


# (step, key, value, timestamp), or a sample
Item = tuple[int, str, float, float] | Text


@dataclass
class Stream:
    """One writing source of the imported run and its items, read lazily."""

    process: str
    rank: int
    items: Iterator[Item]


@dataclass
class Importer:
    """A source of another tool, read as it goes. Subclasses fill ``name`` and ``config``
    (by the end of ``streams`` at the latest) and count what they leave out in ``skipped``."""

    warn: Warn
    name: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    skipped: collections.Counter[str] = field(default_factory=collections.Counter)

    kind = ""

    def identity(self) -> dict[str, Any]:
        """What identifies the source, digested into the imported run's ``run_id``."""
        raise NotImplementedError

    def streams(self) -> Iterator[Stream]:
        raise NotImplementedError


def file_identity(path: Path, root: Path) -> list[Any]:
    """A file's part of an identity: its path below ``root``, its size and a digest of its
    first MiB (what tells one file from another without reading it whole)."""
    with path.open("rb") as f:
        head = hashlib.blake2b(f.read(1 << 20), digest_size=16).hexdigest()
    return [path.relative_to(root).as_posix() if path != root else path.name, path.stat().st_size, head]


def hidden(path: Path, root: Path) -> bool:
    """Whether ``path`` lies under a name starting with ``.`` below ``root`` (not data: a
    writer's work in progress, metriclog's own ``.metriclog/``)."""
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def number(value: Any) -> float | None:
    """A value as the float64 a record holds, or None when it is no number or float64
    cannot hold it exactly (an integer past 2**53). A bool is 0 or 1."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int):
        return float(value) if abs(value) <= 1 << 53 else None
    if isinstance(value, float):
        return value
    return None
