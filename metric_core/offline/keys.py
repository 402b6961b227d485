"""What a run holds, key by key: ``list_keys`` (``metriclog keys``).

Every key with the reduction its records are kept under, how many records, from how many
sources, its first and last step and time, and how many of its values are NaN or infinite.

The writer declares all of this per segment (``key_stats`` in its metadata, docs/format.md),
so a run of its sealed segments is answered from their footers or first lines, once each
segment reads whole: its row groups read once and let go, their pages verified as reduce
verifies them (``RunScan.reads_whole``), no record grouped. A damaged row group is said
as reduce says it, and the segment's other row groups are read as below. Other files
(another tool's, the journals of a running job, segments sealed before the writer
declared it, a segment a restart rewound) are read once, only the columns the answer
needs, a row group at a time, and folded into per-key rows as they come: memory holds
the keys, not the records.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import polars as pl

from metric_core.offline import filters
from metric_core.offline.keyorder import boundaries, range_of, sample_of
from metric_core.offline.plan import key_matcher, make_plan
from metric_core.offline.read import OnProgress, OnRead, RunScan, all_skipped, scan_run
from metric_core.offline.read.parquet import footer

# Records of a file read at a time (a frame, then its per-key rows).
BATCH_ROWS = 500_000
# Per-key rows of the frames held before they are folded into one (or twice the rows folded)
FOLDED_ROWS = 1_000_000
# Rows of mostly distinct keys held, at most, before they go to a temporary directory
SPILLED_ROWS = 1_000_000
# Keys of the sample that cuts spilled rows into ranges, about (at most twice)
SAMPLED_KEYS = 1 << 16

_COLUMNS = ["key", "reduction", "process", "rank", "step", "timestamp", "value"]
# Counts of a frame (or a segment) fit 32 bits: held so, summed as 64 (millions of keys are
# held as rows until the end).
_STATS = {
    "records": pl.UInt32,
    "first_step": pl.Int64,
    "last_step": pl.Int64,
    "first_time": pl.Float64,
    "last_time": pl.Float64,
    "nonfinite": pl.UInt32,
}
# What a thread takes at a time: a file (its row groups, None: all), and whether its
# writer's metadata answers for it once it reads whole (``_declares_rows``).
_Part = tuple[int, list[int] | None, bool]
# A (key, reduction, source)'s row: what the frames and the declared statistics give.
_ROW = {"key": pl.String, "reduction": pl.Categorical, "source": pl.UInt32, **_STATS}


def list_keys(
    run: str | os.PathLike[str],
    *,
    keys: Iterable[str] = (),
    follow_symlinks: bool = False,
    attempts: str = "rewind",
    on_read: OnRead | None = None,
    on_progress: OnProgress | None = None,
) -> pl.DataFrame:
    """A row a key: ``key``, ``reductions``, ``records``, ``sources``, ``first_step``,
    ``last_step``, ``first_time``, ``last_time`` (epoch seconds), ``nonfinite``, as a
    polars DataFrame sorted by key; ``keys``: only keys matching these globs (``--key``).
    The writer's sealed segments are answered from their metadata once they read whole
    (their pages verified); other files, and a segment with a damaged row group, are read
    (their key, reduction, source, step, time and value columns), once, on the engine's
    threads. Raises ``NoDataError`` for a run without a readable record,
    ``FilteredOutError`` when no key matches ``keys``. ``key_frames`` hands the same rows
    over a range of keys at a time.

    >>> list_keys("sample_logs/rl_run").select("key", "reductions", "records", "sources").row(0)
    ('policy/latency_s', 'mean', 3840, 2)
    >>> list_keys("sample_logs/rl_run", keys=["trainer/*"])["key"].to_list()
    ['trainer/grad_norm', 'trainer/loss', 'trainer/lr', 'trainer/tokens_per_s']
    """
    frames = key_frames(
        run, keys=keys, follow_symlinks=follow_symlinks, attempts=attempts, on_read=on_read,
        on_progress=on_progress,
    )  # fmt: skip
    return pl.concat(list(frames), rechunk=False)


def key_frames(
    run: str | os.PathLike[str],
    *,
    keys: Iterable[str] = (),
    follow_symlinks: bool = False,
    attempts: str = "rewind",
    on_read: OnRead | None = None,
    on_progress: OnProgress | None = None,
) -> Iterator[pl.DataFrame]:
    """``list_keys``' rows as frames in key order, each a range of keys (on millions of
    keys, the whole answer is never held): the run is read before this returns, the
    frames are sorted as they are taken. Raises as ``list_keys``.

    >>> [f.height for f in key_frames("sample_logs/rl_run", keys=["trainer/*"])]
    [4]
    """
    from metric_core.offline.engine.pool import on_threads

    patterns = list(keys)
    match = key_matcher(patterns) if patterns else None
    scan = scan_run(run, follow_symlinks=follow_symlinks, attempts=attempts, defer_checks=True)
    seen = filters.Seen.wanted_by(make_plan(keys=patterns))
    fold = _Fold()

    def kept(rows: pl.DataFrame) -> pl.DataFrame:
        if seen.keys is not None:
            seen.add(None, rows["key"].unique())
        if match is None or not rows.height:
            return rows
        return rows.filter(pl.col("key").is_in([k for k in rows["key"].unique() if match(k)]))

    def read(part: _Part) -> Iterator[pl.DataFrame]:
        fid, groups, declared = part
        if declared and scan.reads_whole(fid, _COLUMNS):  # else read: what reads of it counts
            yield kept(_declared_rows(scan, fid, fold.source_id))
            return
        for df in scan.batches(fid, _COLUMNS, row_groups=groups, rows=BATCH_ROWS):
            if df.height:
                yield kept(_frame_rows(df, fold.source_id))

    try:
        parts: list[_Part] = []
        for fid in scan.file_ids:
            if _declares_rows(scan, fid):
                parts.append((fid, None, True))
            else:
                parts += [(fid, groups, False) for groups in _parts(scan, fid)]
        sizes = [_size(scan, fid, groups) for fid, groups, _ in parts]
        for _, rows in on_threads(read, parts, sizes, on_progress):
            if rows is not None:
                fold.add(rows)
    except BaseException:
        fold.close()
        raise
    finally:
        if on_read is not None:
            on_read(scan.report)
    if fold.held == 0 and not scan.report.records:  # every record found damaged as it was read
        raise all_skipped(scan.report)
    if fold.held == 0 and patterns:
        plan = make_plan(keys=patterns)
        raise filters.nothing_left(str(scan.run_dir), plan, filters.unmatched(plan, seen))
    return fold.frames()


def _declares_rows(scan: RunScan, fid: int) -> bool:
    """Whether a file's writer declared its rows a (key, reduction, source) (``key_stats``):
    the file is its writer's as sealed and no restart cut it. They hold once it reads whole."""
    rep = scan.report.files[fid]
    return (
        rep.key_stats is not None
        and rep.source is not None
        and scan.trusted(fid)
        and rep.replaced_from is None
    )


def _declared_rows(scan: RunScan, fid: int, source_id: Callable[[str, int], int]) -> pl.DataFrame:
    """A file's rows a (key, reduction, source) from its writer's ``key_stats``."""
    rep = scan.report.files[fid]
    assert rep.key_stats is not None and rep.source is not None
    stats = list(zip(*rep.key_stats, strict=True)) if rep.key_stats else [()] * 8
    names = ["key", "reduction", *_STATS]
    frame = pl.DataFrame(dict(zip(names, map(list, stats), strict=True)), schema={n: _ROW[n] for n in names})
    return frame.with_columns(source=pl.lit(source_id(*rep.source), pl.UInt32)).select(*_ROW)


def _parts(scan: RunScan, fid: int) -> list[list[int] | None]:
    """What of a file is read at a time, on a thread: a Parquet file's row groups, one by
    one; another file whole (None)."""
    rep = scan.report.files[fid]
    if rep.format != "parquet" or rep.unreadable is not None:
        return [None]
    try:
        groups = footer(rep.path).num_row_groups
    except Exception:  # read whole: its reading says what is wrong
        return [None]
    return [[g] for g in range(groups)] if groups > 1 else [None]


def _size(scan: RunScan, fid: int, groups: list[int] | None) -> int:
    """The bytes a part stands for (what progress counts)."""
    rep = scan.report.files[fid]
    if groups is None:
        return rep.size
    return rep.size // max(footer(rep.path).num_row_groups, 1)


def _frame_rows(df: pl.DataFrame, source_id: Callable[[str, int], int]) -> pl.DataFrame:
    """A frame's records as rows a (key, reduction, source)."""
    ts, step = pl.col("timestamp"), pl.col("step")
    grouped = df.group_by("key", "reduction", "process", "rank").agg(
        records=pl.len(),
        first_step=step.min(),
        last_step=step.max(),
        first_time=ts.min(),
        last_time=ts.max(),
        nonfinite=(~pl.col("value").is_finite()).sum(),
    )
    sources = grouped.select(pl.col("process").cast(pl.String), "rank").unique()
    ids = pl.Series("source", [source_id(p, r) for p, r in sources.iter_rows()], pl.UInt32)
    return (
        grouped.with_columns(pl.col("process").cast(pl.String))
        .join(sources.with_columns(ids), on=["process", "rank"])
        .select(pl.col("key").cast(pl.String), "reduction", "source", *_STATS)
        .cast(_ROW)  # type: ignore[arg-type]
    )


class _Fold:
    """Rows a (key, reduction, source) folded as they come: held rows are folded into one
    frame when they pass FOLDED_ROWS (or twice the rows folded before), so a run of a few
    keys holds a few rows whatever its records. Where a fold hardly shrinks them (keys
    mostly distinct: millions of them), they go to a temporary directory ($TMPDIR, removed
    when done) as they come, with an even sample of their keys kept; at the end they are
    cut into ranges of keys (``keyorder``), and each range is sorted and answered on its
    own (``frames``): memory holds a range, never the rows."""

    def __init__(self) -> None:
        self.parts: list[pl.DataFrame] = []
        self.held = 0
        self.folded = 0
        self.distinct = False
        self.sources: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()
        self.spill: tempfile.TemporaryDirectory[str] | None = None
        self.spilled: list[Path] = []
        self.sample: list[pl.Series] = []  # every ``every``-th key of each part spilled
        self.sampled = 0
        self.every = 1

    def source_id(self, process: str, rank: int) -> int:
        """A number for a (process, rank): sources are counted as numbers, not pairs of strings."""
        with self._lock:  # asked from the reading threads
            return self.sources.setdefault((process, int(rank)), len(self.sources))

    def add(self, rows: pl.DataFrame) -> None:
        self.parts.append(rows)
        self.held += rows.height
        if not self.distinct and len(self.parts) > 1 and self.held > max(FOLDED_ROWS, 2 * self.folded):
            before = self.held
            self.parts = [_folded(pl.concat(self.parts, how="vertical_relaxed"))]
            self.held = self.folded = self.parts[0].height
            self.distinct = self.folded > before // 2
        if self.distinct and self.held > SPILLED_ROWS:
            while self.parts:
                self._spill(self.parts.pop(0))

    def _spill(self, part: pl.DataFrame) -> None:
        if self.spill is None:
            self.spill = tempfile.TemporaryDirectory(prefix="metriclog-keys-")
        self.spilled.append(Path(self.spill.name) / f"{len(self.spilled):06d}.arrow")
        part.write_ipc(self.spilled[-1], compression="uncompressed")
        self.sample.append(part["key"].gather_every(self.every))
        self.sampled += len(self.sample[-1])
        if self.sampled > 2 * SAMPLED_KEYS:  # thinned by half: every other key kept
            self.sample = [pl.concat(self.sample).gather_every(2)]
            self.sampled, self.every = len(self.sample[0]), 2 * self.every

    def close(self) -> None:
        if self.spill is not None:
            self.spill.cleanup()
            self.spill = None

    def frames(self) -> Iterator[pl.DataFrame]:
        """A row a key, in key order: the rows cut into ranges of keys (``keyorder``), each
        range sorted and answered on its own, a frame a range."""
        try:
            yield from self._frames()
        finally:
            self.close()

    def _frames(self) -> Iterator[pl.DataFrame]:
        parts, self.parts = self.parts, []
        if self.spilled:
            sample = pl.concat(self.sample)
        else:
            sample = sample_of(pl.concat([p["key"] for p in parts]), self.held) if parts else pl.Series()
        bounds = boundaries(sample, self.held)
        if not len(bounds):  # one range: every row
            parts += [_read_once(path) for path in self.spilled]
            self.spilled = []
            yield _answer(pl.concat(parts, how="vertical_relaxed") if parts else pl.DataFrame(schema=_ROW))
            return
        pieces: list[list[pl.DataFrame | Path]] = [[] for _ in range(len(bounds) + 1)]
        spilled = len(self.spilled)
        while parts or self.spilled:  # each part cut by range and let go (a spilled one, spilled again)
            part = parts.pop(0) if parts else _read_once(self.spilled.pop(0))
            which = pl.Series("_range", range_of(part["key"], bounds))
            split = part.with_columns(which).partition_by("_range", as_dict=True, include_key=False)
            del part, which
            for (r,), piece in split.items():
                if spilled:
                    assert self.spill is not None
                    path = Path(self.spill.name) / f"range-{int(r):06d}-{len(pieces[int(r)]):06d}.arrow"  # type: ignore[call-overload]
                    piece.write_ipc(path, compression="uncompressed")
                    pieces[int(r)].append(path)  # type: ignore[call-overload]
                else:
                    pieces[int(r)].append(piece)  # type: ignore[call-overload]
            del split
        for r in range(len(pieces)):
            mine, pieces[r] = pieces[r], []
            frames = [_read_once(p) if isinstance(p, Path) else p for p in mine]
            if frames:
                yield _answer(pl.concat(frames, how="vertical_relaxed"))


def _read_once(path: Path) -> pl.DataFrame:
    frame = pl.read_ipc(path)
    path.unlink()
    return frame


def _answer(rows: pl.DataFrame) -> pl.DataFrame:
    """Rows a (key, reduction, source) as a row a key, sorted by key."""
    # Sorted a column at a time, each let go once gathered: a copy of the rows is never
    # held whole (a string column's gather copies its views, not its text).
    order = rows["key"].arg_sort()
    columns = {}
    for name in list(rows.columns):
        columns[name] = rows[name].gather(order)
        rows = rows.drop(name)
    del order
    rows = pl.DataFrame(columns)
    del columns
    starts = rows.select(start=pl.col("key").ne_missing(pl.col("key").shift(1)).fill_null(True))["start"]
    if starts.all():  # every key once: its row is its answer
        return rows.select(
            "key",
            reductions=pl.col("reduction").cast(pl.String),
            records=pl.col("records").cast(pl.UInt64),
            sources=pl.lit(1, pl.UInt32),
            first_step="first_step",
            last_step="last_step",
            first_time="first_time",
            last_time="last_time",
            nonfinite=pl.col("nonfinite").cast(pl.UInt64),
        )
    return (
        rows.with_columns(group=starts.cum_sum())
        .group_by("group", maintain_order=True)
        .agg(
            pl.col("key").first(),
            reductions=pl.col("reduction").cast(pl.String).unique().sort().str.join(","),
            records=pl.col("records").cast(pl.UInt64).sum(),
            sources=pl.col("source").n_unique(),
            first_step=pl.col("first_step").min(),
            last_step=pl.col("last_step").max(),
            first_time=pl.col("first_time").min(),
            last_time=pl.col("last_time").max(),
            nonfinite=pl.col("nonfinite").cast(pl.UInt64).sum(),
        )
        .drop("group")
    )


def _folded(rows: pl.DataFrame) -> pl.DataFrame:
    return rows.group_by("key", "reduction", "source").agg(
        pl.col("records").cast(pl.UInt64).sum(),
        pl.col("first_step").min(),
        pl.col("last_step").max(),
        pl.col("first_time").min(),
        pl.col("last_time").max(),
        pl.col("nonfinite").cast(pl.UInt64).sum(),
    )
