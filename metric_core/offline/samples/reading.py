"""``read_samples``: every sample of a run, its sealed files and journals each read once,
the samples a later attempt replaced left out, the filters applied, in a fixed order."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from metric_core.errors import MetricLogError, PlanError
from metric_core.format import journal
from metric_core.format import sample as sample_codec
from metric_core.offline.plan import key_matcher
from metric_core.offline.read.report import FileReport, ReadReport
from metric_core.offline.samples.files import (
    SamplesPart,
    read_journal_samples,
    read_samples_file,
    samples_files_and_journals,
)
from metric_core.offline.storage import RunPath, _is_upath, run_path

LISTINGS = 10  # a run whose journals vanish after this many listings in a row is being moved


@dataclass
class Sample:
    step: int
    rank: int
    process: str
    timestamp: float
    key: str
    fields: dict[str, Any]
    attempt: str = ""
    order: int = 0  # within its source: the order recorded

    def sort_key(self) -> tuple[Any, ...]:
        return (self.key, self.step, self.rank, self.process, self.timestamp, self.order)


@dataclass
class SampleSet:
    """The samples read; ``report``: what could not be read, file by file (said as the
    records' reader says it: ``ReadReport.summary``); ``notes``: what else was left out."""

    samples: list[Sample] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    replaced: int = 0  # left out: a later attempt of their source replaced them
    report: ReadReport | None = None

    def keys(self) -> dict[str, int]:
        """Samples per key."""
        out: dict[str, int] = {}
        for s in self.samples:
            out[s.key] = out.get(s.key, 0) + 1
        return out


def read_samples(
    run: str | os.PathLike[str] | RunPath,
    *,
    keys: Iterable[str] = (),
    ranks: Iterable[tuple[int, int]] = (),
    steps: tuple[int | None, int | None] | None = None,
    attempts: str = "rewind",
    sealed: dict[str, SamplesPart] | None = None,
    known: Iterable[Any] | None = None,
) -> SampleSet:
    """Every sample of ``run`` that the filters keep (``keys``: globs; ``ranks``: ranges;
    ``steps``: START:STOP, STOP excluded), in the order ``Sample.sort_key`` gives. ``sealed``
    keeps the sealed files read, by path, for a caller that reads the run again; ``known``:
    the run's attempts as its records were read (``RunScan.report.attempts``), which may start
    later than any sample (a restart that records none): read from the run when not given.

    Returns a ``SampleSet``: ``samples``, ``report`` (the files read, and what of them was
    not: a damaged block, a journal cut short, a symlink to nothing) and ``notes`` (a sample
    that is no dict). Raises ``PlanError`` for an ``attempts``
    that is neither rewind nor all, ``NoDataError`` when ``run`` is no directory.

    >>> len(read_samples("sample_logs/rl_run").samples)
    0
    """
    if attempts not in ("rewind", "all"):
        raise PlanError("must be rewind or all for samples", option="attempts", value=attempts)
    root: RunPath = run if _is_upath(run) else run_path(run)  # type: ignore[assignment, arg-type]
    out = SampleSet()
    out.report, parts = _parts(root, {} if sealed is None else sealed)
    if attempts == "rewind":
        parts, out.replaced = _rewind(parts, record_attempts(root) if known is None else known)
    recorded: dict[tuple[str, int], int] = {}  # samples of each source so far: the order recorded
    for part in parts:
        base = recorded.get((part.process, part.rank), 0)
        recorded[(part.process, part.rank)] = base + len(part.rows)
        for order, (step, key, at, fields) in enumerate(part.rows, base):
            if not isinstance(fields, dict):
                out.notes.append(f"a sample of '{key}' of {part.process} is not a dict: left out")
                continue
            out.samples.append(Sample(step, part.rank, part.process, at, key, fields, part.attempt, order))
    out.samples = kept(out.samples, keys=keys, ranks=ranks, steps=steps)
    out.samples.sort(key=Sample.sort_key)
    return out


def kept(
    samples: list[Sample],
    *,
    keys: Iterable[str] = (),
    ranks: Iterable[tuple[int, int]] = (),
    steps: tuple[int | None, int | None] | None = None,
) -> list[Sample]:
    """The samples the filters keep (``keys``: globs; ``ranks``: ranges; ``steps``: START:STOP)."""
    wanted = key_matcher(keys) if keys else None
    rank_ranges = tuple(ranks)
    start, stop = steps if steps is not None else (None, None)
    return [
        s
        for s in samples
        if (wanted is None or wanted(s.key))
        and (not rank_ranges or any(lo <= s.rank <= hi for lo, hi in rank_ranges))
        and (start is None or s.step >= start)
        and (stop is None or s.step < stop)
    ]


def _parts(root: RunPath, sealed_read: dict[str, SamplesPart]) -> tuple[ReadReport, list[SamplesPart]]:
    """The run's sealed samples files and the journals none of them supersedes, and the
    report of their reading. A journal that vanishes between the listing and its reading was
    sealed meanwhile (its samples file is written before it goes): the run is listed again,
    where that file now is."""
    for _ in range(LISTINGS):
        report = ReadReport(run_dir=root, unit="sample")
        parts = _parts_listed(root, report, sealed_read)
        if parts is not None:
            return report, parts
    raise MetricLogError(
        f"{root}: journals kept vanishing while they were read ({LISTINGS} listings): is another "
        "process moving the run's files? Read it again once the job is done"
    )


def _parts_listed(
    root: RunPath, report: ReadReport, sealed_read: dict[str, SamplesPart]
) -> list[SamplesPart] | None:
    """None: a journal listed was sealed before it was read."""
    sealed: list[RunPath] = []
    journals: list[RunPath] = []
    for path in samples_files_and_journals(root, report):
        name = path.name
        if sample_codec.is_samples_file(name):
            sealed.append(path)
        elif name.endswith(journal.SUFFIX):
            journals.append(path)
    parts: list[SamplesPart] = []
    superseded: set[str] = set()
    for path in sealed:
        part = sealed_read.get(str(path)) or read_samples_file(path, _file(report, path))
        if part is not None:
            sealed_read[str(path)] = part
            parts.append(part)
            superseded.add(part.seq)
    for path in journals:
        if path.name in superseded:
            continue  # sealed meanwhile, or a kill between the samples file and the unlink
        try:
            part = read_journal_samples(path, _file(report, path), report)
        except FileNotFoundError:
            return None
        if part is not None:
            parts.append(part)
    # Oldest attempt first; within one, the segments in the order written.
    parts.sort(key=lambda p: (p.process, p.rank, p.started, p.seq))
    return parts


def _file(report: ReadReport, path: RunPath) -> FileReport:
    rep = FileReport(path=path, format=path.suffix.lstrip("."))
    report.files.append(rep)
    return rep


def record_attempts(root: RunPath) -> list[Any]:
    """The attempts of the run's sources, as its records say (none for a run of samples only)."""
    from metric_core.errors import MetricLogError
    from metric_core.offline.read import scan_run

    try:
        return list(scan_run(str(root), defer_checks=True).report.attempts)
    except MetricLogError:
        return []


def _rewind(parts: list[SamplesPart], known: Iterable[Any]) -> tuple[list[SamplesPart], int]:
    """Leave out what a later attempt of the same source replaced (from its first step on):
    the parts kept (new ones where rows go; a part read is never changed), and how many went."""
    by_source: dict[tuple[str, int], list[SamplesPart]] = {}
    for part in parts:
        by_source.setdefault((part.process, part.rank), []).append(part)
    from_records: dict[tuple[str, int], dict[str, tuple[float, int | None]]] = {}
    for a in known:
        if a.started is not None and math.isfinite(a.started):
            from_records.setdefault((a.process, a.rank), {})[a.attempt] = (a.started, a.first_step)
    replaced = 0
    kept_parts = []
    for source, group in by_source.items():
        starts = dict(from_records.get(source, {}))
        for part in group:
            started, first = starts.get(part.attempt, (part.started, None))
            starts[part.attempt] = (started, first if first is not None else part.first_step)
        for part in group:
            later = [
                first
                for attempt, (started, first) in starts.items()
                if attempt != part.attempt and started > part.started and first is not None
            ]
            if later:
                cut = min(later)
                kept = [row for row in part.rows if row[0] < cut]
                replaced += len(part.rows) - len(kept)
                part = dataclasses.replace(part, rows=kept)
            kept_parts.append(part)
    return kept_parts, replaced
