"""Reading samples (``Reduce.SAMPLE``) back, and choosing some per step.

Samples are read from the sealed ``samples/*.samples.parquet|jsonl`` files and from the
journals of segments not sealed yet (a crashed or running job), each once: a sealed file
names the journal it supersedes. Damaged parts are left out and said, never guessed at:
a Parquet file whose page checksum fails, a JSONL block whose CRC fails, a journal frame
that fails its own. A restarted source's later attempt replaces the samples of its
earlier ones from its first step on (``attempts="rewind"``, as for records), unless
``attempts="all"``.

``read_samples`` gives every kept sample in a fixed order: by key, step, then rank,
process, timestamp and the order recorded. ``choose`` picks per (key, step): the top and
bottom by a field, or some at random with ``numpy.random.default_rng(seed)``.
``samples_frame`` turns them into a table: ``step``, ``rank``, ``process``,
``timestamp``, ``key`` and the union of the samples' fields.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from metric_core import journal
from metric_core import sample as sample_codec
from metric_core.errors import MetricLogError, NoDataError, PlanError, opt
from metric_core.offline.plan import key_matcher
from metric_core.offline.storage import RunPath, _is_upath, arrow_source, listing, open_read, run_path

if TYPE_CHECKING:
    import polars as pl

FIXED = ("step", "rank", "process", "timestamp", "key")
_BLOCK_PREFIX = b'{"event": "block", '
LISTINGS = 10  # a run whose journals vanish after this many listings in a row is being moved
EXACT_FLOAT_INT = 2**53  # integers past this lose digits as float64: such a mixed field is text


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
    """The samples read, and what could not be read (each note names the file)."""

    samples: list[Sample] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    replaced: int = 0  # left out: a later attempt of their source replaced them

    def keys(self) -> dict[str, int]:
        """Samples per key."""
        out: dict[str, int] = {}
        for s in self.samples:
            out[s.key] = out.get(s.key, 0) + 1
        return out


@dataclass
class _Part:
    """The samples of one file, and the attempt they belong to."""

    process: str
    rank: int
    attempt: str
    started: float
    first_step: int | None
    seq: str
    rows: list[tuple[int, str, float, Any]]  # (step, key, timestamp, sample)


def read_samples(
    run: str | os.PathLike[str] | RunPath,
    *,
    keys: Iterable[str] = (),
    ranks: Iterable[tuple[int, int]] = (),
    steps: tuple[int | None, int | None] | None = None,
    attempts: str = "rewind",
    sealed: dict[str, _Part] | None = None,
    known: Iterable[Any] | None = None,
) -> SampleSet:
    """Every sample of ``run`` that the filters keep (``keys``: globs; ``ranks``: ranges;
    ``steps``: START:STOP, STOP excluded), in the order ``Sample.sort_key`` gives. ``sealed``
    keeps the sealed files read, by path, for a caller that reads the run again; ``known``:
    the run's attempts as its records were read (``RunScan.report.attempts``), which may start
    later than any sample (a restart that records none): read from the run when not given.

    >>> len(read_samples("sample_logs/rl_run").samples)
    0
    """
    if attempts not in ("rewind", "all"):
        raise PlanError("must be rewind or all for samples", option="attempts", value=attempts)
    root: RunPath = run if _is_upath(run) else run_path(run)  # type: ignore[assignment, arg-type]
    out = SampleSet()
    parts = _parts(root, out.notes, {} if sealed is None else sealed)
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


def _parts(root: RunPath, notes: list[str], sealed_read: dict[str, _Part]) -> list[_Part]:
    """The run's sealed samples files and the journals none of them supersedes. A journal
    that vanishes between the listing and its reading was sealed meanwhile (its samples
    file is written before it goes): the run is listed again, where that file now is."""
    for _ in range(LISTINGS):
        parts = _parts_listed(root, notes, sealed_read)
        if parts is not None:
            return parts
    raise MetricLogError(
        f"{root}: journals kept vanishing while they were read ({LISTINGS} listings): is another "
        "process moving the run's files? Read it again once the job is done"
    )


def _parts_listed(root: RunPath, notes: list[str], sealed_read: dict[str, _Part]) -> list[_Part] | None:
    """None: a journal listed was sealed before it was read."""
    sealed: list[RunPath] = []
    journals: list[RunPath] = []
    for path in _listed(root):
        name = path.name
        if sample_codec.is_samples_file(name):
            sealed.append(path)
        elif name.endswith(journal.SUFFIX):
            journals.append(path)
    parts: list[_Part] = []
    superseded: set[str] = set()
    for path in sealed:
        part = sealed_read.get(str(path)) or _read_sealed(path, notes)
        if part is not None:
            sealed_read[str(path)] = part
            parts.append(part)
            superseded.add(part.seq)
    for path in journals:
        if path.name in superseded:
            continue  # sealed meanwhile, or a kill between the samples file and the unlink
        try:
            part = _read_journal(path, notes)
        except FileNotFoundError:
            return None
        if part is not None:
            parts.append(part)
    # Oldest attempt first; within one, the segments in the order written.
    parts.sort(key=lambda p: (p.process, p.rank, p.started, p.seq))
    return parts


def _listed(root: RunPath) -> list[RunPath]:
    if not isinstance(root, Path):
        return [p for p in listing(root) if not any(part.startswith(".") for part in p.parts[-3:])]
    if not root.is_dir():
        raise NoDataError(str(root), "it is not a directory" if root.exists() else "it does not exist")
    found: list[RunPath] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            path = Path(dirpath) / name
            # Only regular files, never through a symlink: a FIFO would block (the record
            # reader says what it skips).
            if name.startswith(".") or not _ours(name):
                continue
            try:
                if stat.S_ISREG(os.lstat(path).st_mode):
                    found.append(path)
            except FileNotFoundError:  # a journal sealed since it was listed: its samples file
                found.append(path)  # may not be listed yet, so reading it says to list again
    return found


def _ours(name: str) -> bool:
    return sample_codec.is_samples_file(name) or name.endswith(journal.SUFFIX)


def _read_sealed(path: RunPath, notes: list[str]) -> _Part | None:
    try:
        if path.name.endswith(".parquet"):
            meta, rows = _sealed_parquet(path)
        else:
            meta, rows = _sealed_jsonl(path, notes)
        if sample_codec.meta_checksum(meta) != meta.get("checksum"):
            raise ValueError("its metadata fails its checksum (the file is damaged)")
    except Exception as exc:  # a damaged file is said and left out, whatever the reader hit
        notes.append(f"{path}: not read ({_gist(exc)}); its samples are left out")
        return None
    return _Part(
        str(meta["process"]),
        int(meta["rank"]),
        str(meta.get("attempt") or ""),
        float(meta.get("attempt_started") or 0.0),
        meta.get("attempt_first_step"),
        str(meta["supersedes"]),
        rows,
    )


def _sealed_parquet(path: RunPath) -> tuple[dict[str, Any], list[tuple[int, str, float, Any]]]:
    import pyarrow.parquet as pq

    # Read by arrow's own file (never a Python file object, whose buffers arrow's threads
    # would release at the interpreter's exit), on this thread.
    with arrow_source(path) as source:
        pf = pq.ParquetFile(source, page_checksum_verification=True)
        kv = pf.metadata.metadata or {}
        if sample_codec.PARQUET_KEY not in kv:
            raise ValueError("not a samples file of metriclog (no metriclog.samples metadata)")
        meta = json.loads(kv[sample_codec.PARQUET_KEY])
        table = pf.read(columns=["step", "rank", "process", "key", "timestamp", "sample"], use_threads=False)
    if set(table.column("process").unique().to_pylist()) - {meta.get("process")} or set(
        table.column("rank").unique().to_pylist()
    ) - {meta.get("rank")}:
        raise ValueError("its rows name another source than its metadata")
    cols = [table.column(c).to_pylist() for c in ("step", "key", "timestamp", "sample")]
    rows = [(s, k, t, json.loads(x)) for s, k, t, x in zip(*cols, strict=True)]
    if len(rows) != meta.get("samples"):
        raise ValueError(f"{len(rows)} samples where its metadata says {meta.get('samples')}")
    return meta, rows


def _sealed_jsonl(
    path: RunPath, notes: list[str]
) -> tuple[dict[str, Any], list[tuple[int, str, float, Any]]]:
    """A sealed JSONL samples file: its metadata line, then blocks of lines, each followed by
    a line with the block's CRC-32. A block that fails it is left out, and said."""
    with open_read(path) as f:
        data = f.read()
    first = data.find(b"\n") + 1
    meta = json.loads(data[:first])
    if meta.get("event") != sample_codec.SEGMENT_EVENT:
        raise ValueError("not a samples file of metriclog (no samples_segment line)")
    rows: list[tuple[int, str, float, Any]] = []
    pos, block_start = first, first
    while pos < len(data):
        end = data.find(b"\n", pos)
        end = len(data) if end < 0 else end + 1
        line = data[pos:end]
        if line.startswith(_BLOCK_PREFIX):
            check = json.loads(line)
            block = data[block_start:pos]
            if zlib.crc32(block) == check["crc32"]:
                for text in block.splitlines():
                    one = json.loads(text)
                    if (one["process"], one["rank"]) != (meta.get("process"), meta.get("rank")):
                        raise ValueError("its lines name another source than its metadata")
                    rows.append((int(one["step"]), str(one["key"]), float(one["timestamp"]), one["sample"]))
            else:
                notes.append(
                    f"{path}: a block of {check['lines']} sample(s) at byte {block_start} fails its "
                    "checksum (the file is damaged): left out"
                )
            block_start = end
        pos = end
    if block_start < len(data):
        notes.append(
            f"{path}: {len(data) - block_start} byte(s) at its end are not in a checked block: left out"
        )
    missing = int(meta.get("samples", 0)) - len(rows)
    if missing > 0:
        notes.append(f"{path}: {missing} of its {meta['samples']} samples are not in it (cut or damaged)")
    return meta, rows


def _gist(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _read_journal(path: RunPath, notes: list[str]) -> _Part | None:
    try:
        with open_read(path) as f:
            decoded = journal.decode(f.read(), records=False)
    except FileNotFoundError:
        raise  # sealed since it was listed: the caller lists the run again
    except OSError as exc:
        notes.append(f"{path}: not read ({exc.strerror or exc}); its samples are left out")
        return None
    for problem in decoded.problems:  # what follows a damaged frame is not read: samples too
        notes.append(f"{path}: {problem}")
    if not decoded.samples or decoded.process is None or decoded.rank is None:
        return None
    attempt = decoded.attempt
    return _Part(
        decoded.process,
        decoded.rank,
        str(attempt.get("attempt") or ""),
        float(attempt.get("attempt_started") or 0.0),
        attempt.get("attempt_first_step", decoded.first_flush),
        path.name,
        list(decoded.samples),
    )


def record_attempts(root: RunPath) -> list[Any]:
    """The attempts of the run's sources, as its records say (none for a run of samples only)."""
    from metric_core.errors import MetricLogError
    from metric_core.offline.read import scan_run

    try:
        return list(scan_run(str(root), defer_checks=True).report.attempts)
    except MetricLogError:
        return []


def _rewind(parts: list[_Part], known: Iterable[Any]) -> tuple[list[_Part], int]:
    """Leave out what a later attempt of the same source replaced (from its first step on):
    the parts kept (new ones where rows go; a part read is never changed), and how many went."""
    by_source: dict[tuple[str, int], list[_Part]] = {}
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


def select_samples(
    run: str | os.PathLike[str],
    *,
    keys: Iterable[str] = (),
    ranks: str | Iterable[tuple[int, int]] = (),
    steps: str | tuple[int | None, int | None] | None = None,
    attempts: str = "rewind",
    top: int = 0,
    bottom: int = 0,
    by: str | None = None,
    random: int = 0,
    seed: int = 0,
) -> tuple[pl.DataFrame, SampleSet]:
    """``read_samples`` then ``choose``, as a table (``samples_frame``); ``ranks`` and
    ``steps`` may be given as the command line spells them (``0,2-5``, ``100:200``).

    >>> frame, read = select_samples("sample_logs/rl_run", top=2, by="reward")
    >>> frame.columns, read.notes
    (['step', 'rank', 'process', 'timestamp', 'key'], [])
    """
    from metric_core.offline.plan import counts_back, last_steps, parse_ranks, parse_steps

    for name, count in (("top", top), ("bottom", bottom), ("random", random)):
        if count < 0:
            raise PlanError("must be 0 or more", option=name, value=str(count))
    if isinstance(ranks, str):
        ranks = parse_ranks(ranks)
    if isinstance(steps, str):
        steps = parse_steps(steps)
    read = read_samples(run, attempts=attempts)  # once: the filters choose in memory
    every = read.samples
    sources_kept = kept(every, keys=keys, ranks=ranks)
    if counts_back(steps):  # counted back from the last step of the samples' sources kept
        steps = last_steps(steps, max((s.step for s in sources_kept), default=-1))  # type: ignore[arg-type]
    read.samples = kept(sources_kept, steps=steps)
    if (keys or ranks or steps) and every and not read.samples:  # said, as reduce says it
        names = sorted({s.key for s in every})
        shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
        read.notes.append(f"the filters left none of the run's {len(every):,} samples; their keys: {shown}")
    chosen = choose(read.samples, top=top, bottom=bottom, by=by, random=random, seed=seed)
    return samples_frame(chosen), read


# -- choosing ---------------------------------------------------------------------------


def choose(
    samples: list[Sample],
    *,
    top: int = 0,
    bottom: int = 0,
    by: str | None = None,
    random: int = 0,
    seed: int = 0,
) -> list[Sample]:
    """Per (key, step), in ``read_samples``' order: the ``top`` and ``bottom`` by the field
    ``by`` (samples where it is missing, not a number or NaN are left out; a sample is shown
    once when it is in both), or ``random`` drawn without replacement by one
    ``numpy.random.default_rng(seed)``, group after group. None of them: every sample."""
    if by and not (top or bottom):
        raise PlanError(
            f"ranks {opt('top', flag=True)} and {opt('bottom', flag=True)}: give one of them",
            option="by",
            value=by,
        )
    if not (top or bottom or random):
        return samples
    if random and (top or bottom):
        raise PlanError(
            f"takes {opt('top', flag=True)}/{opt('bottom', flag=True)} or {opt('random', flag=True)}, "
            "not both",
            option="random",
            value=str(random),
        )
    if (top or bottom) and not by:
        raise PlanError(
            f"needs the field to rank by: {opt('by')}FIELD", option="top", value=str(top or bottom)
        )
    import numpy as np

    rng = np.random.default_rng(seed) if random else None
    chosen: list[Sample] = []
    for group in _groups(samples):
        if rng is not None:
            picked = sorted(rng.choice(len(group), size=min(random, len(group)), replace=False).tolist())
            chosen += [group[i] for i in picked]
            continue
        scored = [
            (score, i) for i, s in enumerate(group) if (score := _number(s.fields.get(by or ""))) is not None
        ]
        high = sorted(scored, key=lambda t: (-t[0], t[1]))[:top] if top else []
        low = sorted(scored, key=lambda t: (t[0], t[1]))[:bottom] if bottom else []
        seen: set[int] = set()
        for _, i in high + low:
            if i not in seen:
                seen.add(i)
                chosen.append(group[i])
    return chosen


def _groups(samples: list[Sample]) -> Iterable[list[Sample]]:
    group: list[Sample] = []
    for s in samples:
        if group and (s.key, s.step) != (group[0].key, group[0].step):
            yield group
            group = []
        group.append(s)
    if group:
        yield group


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return None if math.isnan(number) else number


# -- as a table -------------------------------------------------------------------------


def field_names(samples: list[Sample]) -> list[str]:
    """The union of the samples' fields, in the order first met."""
    names: dict[str, None] = {}
    for s in samples:
        for name in s.fields:
            names.setdefault(str(name), None)
    return list(names)


def column_names(names: list[str]) -> dict[str, str]:
    """Each field's column: its name, or ``sample.{name}`` for one named like a fixed column
    (again prefixed while that is a field's name too)."""
    out = {}
    for name in names:
        column = name
        while column in FIXED or (column != name and column in names):
            column = f"sample.{column}"
        out[name] = column
    return out


def samples_frame(samples: list[Sample]) -> pl.DataFrame:
    """A row a sample: ``step``, ``rank``, ``process``, ``timestamp``, ``key``, then a column a
    field. A field missing from a sample is null; a field of one kind keeps it (integers
    exact, as Int64, or text past 64 bits); ints and floats together are Float64 (text if
    an integer would lose digits); lists and dicts, and any other mix of kinds, are JSON text."""
    import polars as pl

    columns: dict[str, Any] = {
        "step": pl.Series("step", [s.step for s in samples], pl.Int64),
        "rank": pl.Series("rank", [s.rank for s in samples], pl.Int64),
        "process": pl.Series("process", [s.process for s in samples], pl.String),
        "timestamp": pl.Series("timestamp", [s.timestamp for s in samples], pl.Float64),
        "key": pl.Series("key", [s.key for s in samples], pl.String),
    }
    for name, column in column_names(field_names(samples)).items():
        values = [s.fields.get(name) for s in samples]
        columns[column] = _column(column, values)
    return pl.DataFrame(columns)


def _column(name: str, values: list[Any]) -> pl.Series:
    import polars as pl

    kinds = {_kind(v) for v in values if v is not None}
    if kinds == {"bool"}:
        return pl.Series(name, values, pl.Boolean)
    if kinds == {"int"} and all(v is None or -(2**63) <= v < 2**63 for v in values):
        return pl.Series(name, values, pl.Int64)
    if (
        kinds
        and kinds <= {"int", "float"}
        and all(v is None or isinstance(v, float) or abs(v) <= EXACT_FLOAT_INT for v in values)
    ):
        return pl.Series(name, [None if v is None else float(v) for v in values], pl.Float64)
    if kinds == {"str"}:
        return pl.Series(name, values, pl.String)
    # lists, dicts, and fields of mixed kinds: JSON text (a string quoted, so "1" is not 1)
    return pl.Series(
        name, [None if v is None else json.dumps(v, ensure_ascii=False) for v in values], pl.String
    )


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    return "json"


# -- for uploads --------------------------------------------------------------------------


@dataclass(frozen=True)
class SampleChoice:
    """Which samples an upload sends per step and key: ``top``/``bottom`` by ``by``, or
    ``random`` (seeded by ``seed``). By default, the top 2 and bottom 2 by ``reward`` where
    a key's samples have it, else 4 at random; ``enabled=False`` sends none."""

    top: int | None = None
    bottom: int | None = None
    by: str | None = None
    random: int | None = None
    seed: int = 0
    enabled: bool = True

    def picks(self, samples: list[Sample]) -> list[Sample]:
        if self.random is not None or self.top is not None or self.bottom is not None:
            ranked = bool(self.top or self.bottom)
            return choose(
                samples,
                top=self.top or 0,
                bottom=self.bottom or 0,
                by=(self.by or "reward") if ranked else None,
                random=self.random or 0,
                seed=self.seed,
            )
        by = self.by or "reward"
        if any(_number(s.fields.get(by)) is not None for s in samples):
            return choose(samples, top=2, bottom=2, by=by)
        return choose(samples, random=4, seed=self.seed)


class SampleTables:
    """The samples an upload attaches to its history rows: per W&B run (its source's, or
    every source's) and step, each key's chosen samples as a ``wandb.Table``, logged in the
    same ``log`` call as that step's scalars. ``refresh`` reads them again (``upload
    --follow``, before each poll's rows)."""

    def __init__(
        self, run: str | os.PathLike[str] | RunPath, plan: Any, choice: SampleChoice, *, share_run: bool
    ) -> None:
        self.run, self.plan, self.choice, self.share_run = run, plan, choice, share_run
        self.root: RunPath = run if _is_upath(run) else run_path(run)  # type: ignore[assignment, arg-type]
        self.known: list[Any] | None = None  # the records' attempts: read once samples are found
        self.by_step: dict[tuple[str | None, int], dict[str, list[Sample]]] = {}
        self.newest = -1
        self.attached: set[tuple[str | None, int]] = set()
        self.renamed: set[str] = set()  # samples keys that are scalar keys too (said once)
        self._sealed: dict[str, _Part] = {}  # sealed files do not change: read once
        self.refresh()

    def refresh(self) -> None:
        """Read the run's samples again (``upload --follow``: before each poll's rows go)."""
        read = self._read(self.known or ())
        if read.samples and self.known is None:  # a run without samples costs no scan of its records
            self.known = record_attempts(self.root)
            read = self._read(self.known)
        groups: dict[tuple[str | None, int], dict[str, list[Sample]]] = {}
        for s in read.samples:
            per_source = self.plan.mode.value != "global_reduce"
            where = (s.process if per_source and not self.share_run else None, s.step)
            key = f"{s.key}/{s.process}" if per_source and self.share_run else s.key
            groups.setdefault(where, {}).setdefault(key, []).append(s)
        self.by_step = groups
        self.newest = max((step for _, step in groups), default=-1)

    def _read(self, known: Iterable[Any]) -> SampleSet:
        return read_samples(
            self.root,
            keys=self.plan.keys,
            ranks=self.plan.ranks,
            steps=self.plan.steps,
            attempts="rewind",
            sealed=self._sealed,
            known=known,
        )

    def __bool__(self) -> bool:
        return bool(self.by_step)

    def tables(self, source: str | None, step: int) -> dict[str, Any]:
        """``{key: wandb.Table}`` of ``source``'s (None: every source's) samples at ``step``,
        each once a run."""

        where = (source, step)
        if where in self.attached or where not in self.by_step:
            return {}
        from metric_core.writer.backends.wandb import samples_table

        self.attached.add(where)
        out = {}
        for key, samples in self.by_step[where].items():
            chosen = self.choice.picks(samples)
            if chosen:
                out[key] = samples_table([s.fields for s in chosen])
        return out

    def unattached(self) -> int:
        """Steps with samples that no row of any run took (no scalar at that step)."""
        return len(set(self.by_step) - self.attached)
