"""Per-source aggregates of a run, a file at a time: each source's steps (when each was
reached and done) and each (source, key)'s last value and non-finite values."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from metric_core.format.schema import KEY_HASH, keys_by_hash
from metric_core.offline.read import FileReport, OnProgress, RunScan, all_skipped

# Records of another tool's file aggregated at a time (the file is read once, in frames).
BATCH_ROWS = 500_000
# Per-key rows of a file's frames held before they are merged (or twice the keys merged):
# merging at every frame would group a run of millions of keys again and again
MERGED_KEYS = 500_000
# Keys whose last value a source that stopped early lists, at most (the first by name; the
# source's ``keys`` says how many it has)
LAST_VALUES = 1_000
# Distinct (source, key) pairs of a compacted file held to be counted, at most: past it they
# wait in a temporary directory, in SHARES shares of a hash of the key, counted a share at a time
COUNTED_KEYS = 1 << 20
SHARES = 32

Source = tuple[str, int]  # (process, rank)
# A cache's entry for the scan its files' aggregates come from: the next call's ``earlier``
# (``scan_run``), which tells the files unchanged since.
EARLIER = "scan"


@dataclass
class SourceSteps:
    """One source's steps, across its files: each ``step``, the time of its first record
    (``reached``) and of its last (``done``), as arrays (a source's own, no query each)."""

    step: np.ndarray
    reached: np.ndarray
    done: np.ndarray
    files: list[int]
    records: int
    first_step: int = field(init=False)
    last_step: int = field(init=False)
    first_timestamp: float = field(init=False)
    last_timestamp: float = field(init=False)

    def __post_init__(self) -> None:  # the ends, once
        self.first_step, self.last_step = int(self.step.min()), int(self.step.max())
        self.first_timestamp, self.last_timestamp = float(self.reached.min()), float(self.done.max())

    @classmethod
    def merged(cls, parts: list[tuple[int, pl.DataFrame]]) -> SourceSteps | None:
        """From each of its files' steps (file id, frame): a step in two files is one.
        None when no record of the source was kept."""
        frame = parts[0][1] if len(parts) == 1 else pl.concat([f for _, f in parts])
        step, reached, done = (frame[name].to_numpy() for name in ("step", "reached", "done"))
        if not len(step):
            return None
        if len(parts) > 1:
            step, where = np.unique(step, return_inverse=True)
            first, last = np.full(len(step), np.inf), np.full(len(step), -np.inf)
            np.minimum.at(first, where, reached)
            np.maximum.at(last, where, done)
            reached, done = first, last
        return cls(step, reached, done, sorted({fid for fid, _ in parts}), int(frame["records"].sum()))


def aggregate(
    scan: RunScan, on_progress: OnProgress | None = None, cache: dict[Any, Any] | None = None
) -> tuple[dict[Source, SourceSteps], pl.DataFrame, dict[Source, int]]:
    """Per source its steps, per (source, key) what inspect says of keys, and per source
    how many keys it has, a file at a time: each file is read once, and memory holds one
    file's columns (another tool's: a frame of them), not the run's.

    A source whose records are all in one file (its footer says so) keeps, of that file's
    rows a key, only what the report lists (``compacted``): its first LAST_VALUES keys by
    name and its keys with non-finite values, and its count of keys; a source of millions
    of keys holds no row for each. A file read in frames is cut so frame by frame
    (``_Compaction``), so that not even the file's rows are held at once. A source across
    files keeps every row, to be merged.

    ``cache`` (kept between calls) holds each file's aggregates and the scan they were
    read in: a file unchanged since that scan (``RunScan.unchanged``: ``scan`` was made
    with it as ``earlier``) is not read again.

    Files of one source (their writer's metadata or their footer's statistics say which)
    are grouped by file id alone (no string hashed per record); other files are grouped by
    process and rank as well.
    """
    files = scan.report.files
    sources = {i: files[i].source or files[i].single_source for i in scan.file_ids}
    one_source = {i for i, source in sources.items() if source is not None}
    # files whose sources no other file holds: their rows a key are compacted as they are read
    alone = _files_alone(scan.file_ids, sources)
    counted: dict[Source, int] = {}  # the keys of the sources of those files
    # the writer's files group on its key hashes (another tool's file of one source, on strings)
    hashes = _key_hashes([files[i] for i in one_source if files[i].hashed])
    sizes = {fid: files[fid].size for fid in scan.file_ids}
    per_source: dict[Source, list[tuple[int, pl.DataFrame]]] = {}
    by_key = []
    done = 0
    used = {}
    shared = False  # a source's keys come from more than one file (then merged)
    for n, fid in enumerate(scan.file_ids, 1):
        known = (files[fid].identity, sources[fid], fid in alone)
        if cache is not None and scan.unchanged(fid) and known in cache:  # as the last call read it
            steps, keys, counts = cache[known]
        else:
            by = [] if fid in one_source else ["process", "rank"]
            names = hashes if fid in one_source and files[fid].hashed else None
            key = KEY_HASH if names is not None else "key"
            columns = [*by, "step", key, "value", "timestamp"]
            counts = None
            # another tool's file: checked as it is read, once; a checksummed segment: verified.
            # Read in frames, a file whose sources are its own is compacted frame by frame.
            if scan.checks_as_read(fid):
                frames = scan.batches(fid, columns, rows=BATCH_ROWS)
                if fid in alone:
                    found, keys, counts = _compacted_aggregates(frames, by, key, names)
                else:
                    found, keys = _batched_aggregates(frames, by, key)
            else:
                found, keys = _file_aggregates(scan.file_frame(fid).select(columns), by, key)
            if names is not None and counts is None:
                keys = keys.join(names, on=KEY_HASH).select("key", *keys.columns[1:])
            if by:
                steps = found.partition_by("process", "rank", as_dict=True, include_key=False)
            else:
                process, rank = sources[fid]  # type: ignore[misc]
                steps = {(process, rank): found}
                # a code a key, not a string (millions of keys)
                source = [
                    pl.lit(process, pl.Categorical).alias("process"),
                    pl.lit(rank, pl.Int64).alias("rank"),
                ]
                keys = keys.select(*source, pl.all())
                if counts is not None:  # keyed by no column: the one source's
                    counts = {(process, rank): counts[()]} if () in counts else {}
            if fid in alone and counts is None:
                keys, counts = compacted(keys)
        if counts is not None:
            counted.update(counts)
        if cache is not None and known[0] is not None:
            used[known] = (steps, keys, counts)
        for source, found in steps.items():
            per_source.setdefault(source, []).append((fid, found))  # type: ignore[arg-type]
        shared = shared or any(len(per_source[source]) > 1 for source in steps)
        by_key.append(keys)
        done += sizes[fid]
        if on_progress is not None:
            on_progress(n, len(sizes), done, sum(sizes.values()))
    if cache is not None:  # files gone (a journal sealed) leave the cache
        cache.clear()
        cache.update(used)
        cache[EARLIER] = scan
    # Each file's rows are one a (source, key): files of sources of their own are merged as they are
    per_key = (
        by_key[0]
        if len(by_key) == 1
        else pl.concat(by_key, how="vertical_relaxed")
        if not shared
        else _merged_keys(pl.concat(by_key, how="vertical_relaxed"), ["process", "rank", "key"])
    )
    del by_key
    merged = {
        source: SourceSteps.merged(per_source.pop(source)) for source in list(per_source)
    }  # frames freed
    steps = {source: its for source, its in merged.items() if its is not None}  # not all checked away
    if not steps:
        raise all_skipped(scan.report)
    # the other sources' keys, counted on their rows (grouped on codes: millions of keys)
    rows = per_key.select(pl.col("process").cast(pl.Categorical), "rank").group_by("process", "rank").len()
    counts = {(process, rank): n for process, rank, n in rows.iter_rows()}
    counts.update(counted)  # a compacted source's rows are not all its keys
    return steps, per_key, counts


def _files_alone(file_ids: list[int], sources: dict[int, Source | None]) -> set[int]:
    """The files no other file shares a source with: a file of one source no other file of
    one source has, when every file has one (another file's sources are known only once it
    is read); the only file, whatever it holds."""
    if len(file_ids) == 1:
        return set(file_ids)
    if any(sources[fid] is None for fid in file_ids):
        return set()
    files_of: dict[Source | None, int] = {}
    for fid in file_ids:
        files_of[sources[fid]] = files_of.get(sources[fid], 0) + 1
    return {fid for fid in file_ids if files_of[sources[fid]] == 1}


def compacted(keys: pl.DataFrame) -> tuple[pl.DataFrame, dict[Source, int]]:
    """A file's rows a (source, key), of sources no other file holds, cut to what the report
    lists: each source's first LAST_VALUES keys by name and its keys with non-finite values;
    and each source's count of keys."""
    counts = {
        (str(process), int(rank)): int(n)
        for process, rank, n in keys.group_by("process", "rank").len().iter_rows()
    }
    if keys.height <= LAST_VALUES * max(len(counts), 1):
        return keys, counts
    kept = [keys.filter(pl.col("nonfinite") > 0)]
    for process, rank in counts:  # a query a source: never a copy of its rows
        mine = (pl.col("process") == process) & (pl.col("rank") == rank) & (pl.col("nonfinite") == 0)
        kept.append(keys.lazy().filter(mine).top_k(LAST_VALUES, by="key", reverse=True).collect())
    return pl.concat(kept, how="vertical_relaxed"), counts


def _compacted_aggregates(
    frames: Iterator[pl.DataFrame], by: list[str], key: str, names: pl.DataFrame | None
) -> tuple[pl.DataFrame, pl.DataFrame, dict[tuple[Any, ...], int]]:
    """``_batched_aggregates`` of a file whose sources no other file holds, its rows a key
    compacted as its frames come (``_Compaction``; ``names``: the key of each key hash),
    with each source's count of keys (keyed by its ``by`` values)."""
    parts: list[pl.DataFrame] = []
    compaction = _Compaction(by, names)
    try:
        for df in frames:
            steps, found = _file_aggregates(df.lazy(), by, key)
            parts.append(steps)
            compaction.add(found)
            del df, found
        keys, counts = compaction.result()
    finally:
        compaction.close()
    return _merged_steps(parts, by), keys, counts


class _Compaction:
    """A file's rows a (source, key), frame by frame, cut to what ``compacted`` keeps: each
    source's first LAST_VALUES keys by name (a key among a source's first is among the first
    of each frame that holds it, so merging each frame's first with those kept gives the
    file's, whole), its keys with non-finite values, and its count of keys
    (``_DistinctKeys``). A key listed only for its non-finite values (not among the first)
    has no last value here: the report lists none for it, and the frames where its values
    were finite are not kept."""

    def __init__(self, by: list[str], names: pl.DataFrame | None) -> None:
        self.by, self.names = by, names
        self.first: list[pl.DataFrame] = []  # merged (the first), then frames' not merged yet
        self.firsts = 0
        self.bad: list[pl.DataFrame] = []  # the same
        self.bads = 0
        self.distinct = _DistinctKeys(by)

    def add(self, keys: pl.DataFrame) -> None:
        """A frame's rows a (``by``, key) (or key hash, named here)."""
        if self.names is not None:
            keys = keys.join(self.names, on=KEY_HASH).select("key", *keys.columns[1:])
        keys = keys.with_columns(pl.col("key").cast(pl.String))
        self.distinct.add(keys.select(*self.by, "key"))
        first = _first_by_name(keys, self.by)
        self.first.append(first)
        self.firsts += first.height
        if len(self.first) > 1 and self.firsts > max(MERGED_KEYS, 2 * self.first[0].height):
            self.first = [self._first()]
            self.firsts = self.first[0].height
        bad = keys.filter(pl.col("nonfinite") > 0)
        if bad.height:
            self.bad.append(bad)
            self.bads += bad.height
            if len(self.bad) > 1 and self.bads > max(MERGED_KEYS, 2 * self.bad[0].height):
                self.bad = [_merged_keys(pl.concat(self.bad, how="vertical_relaxed"), [*self.by, "key"])]
                self.bads = self.bad[0].height

    def _first(self) -> pl.DataFrame:
        """The rows of the first keys by name of the frames so far, merged (in file order)."""
        if len(self.first) == 1:
            return self.first[0]
        merged = _merged_keys(pl.concat(self.first, how="vertical_relaxed"), [*self.by, "key"])
        return _first_by_name(merged, self.by)

    def result(self) -> tuple[pl.DataFrame, dict[tuple[Any, ...], int]]:
        """The rows kept, and each source's count of keys (keyed by its ``by`` values)."""
        assert self.first, "a file read gives a frame at least"
        kept = self._first()
        if self.bad:
            on = [*self.by, "key"]
            bad = self.bad[0]
            if len(self.bad) > 1:
                bad = _merged_keys(pl.concat(self.bad, how="vertical_relaxed"), on)
            only = bad.join(kept.select(on), on=on, how="anti").with_columns(
                last_value=pl.lit(None, pl.Float64), last_timestamp=pl.lit(None, pl.Float64)
            )
            kept = pl.concat([kept, only], how="vertical_relaxed")
        return kept, self.distinct.counts()

    def close(self) -> None:
        self.distinct.close()


def _first_by_name(keys: pl.DataFrame, by: list[str]) -> pl.DataFrame:
    """The rows of each source's (``by``'s) first LAST_VALUES keys by name."""
    if keys.height <= LAST_VALUES:
        return keys
    if not by:
        return keys.top_k(LAST_VALUES, by="key", reverse=True)
    return keys.filter(pl.col("key").rank("ordinal").over(by) <= LAST_VALUES)


class _DistinctKeys:
    """The distinct (``by``, key) pairs of a file's frames, counted per ``by``: held (and made
    distinct as they double) while they are at most COUNTED_KEYS, else set aside in a
    temporary directory ($TMPDIR, removed when done) in SHARES shares of a hash of the key
    as they come, each share counted on its own at the end: memory holds a share. A share
    on disk is made distinct again as it doubles past a quarter of COUNTED_KEYS, so keys
    met again and again (millions of keys a step, many steps) take the disk of their
    distinct pairs, not of their records."""

    def __init__(self, by: list[str]) -> None:
        self.by = by
        self.parts: list[pl.DataFrame] = []
        self.held = 0
        self.distinct = 0
        self.spill: tempfile.TemporaryDirectory[str] | None = None
        self.spilled = 0
        self.on_disk = [0] * SHARES  # rows in each share's files
        self.kept = [0] * SHARES  # rows of each share made distinct last

    def add(self, rows: pl.DataFrame) -> None:
        """A frame's (``by``, key) pairs, each once."""
        self.parts.append(rows)  # processes as codes
        self.held += rows.height
        if self.spill is None and len(self.parts) > 1 and self.held > max(COUNTED_KEYS, 2 * self.distinct):
            self.parts = [pl.concat(self.parts).unique()]
            self.held = self.distinct = self.parts[0].height
        if self.held > COUNTED_KEYS:  # mostly distinct (millions of keys): to disk
            self._spill()

    def counts(self) -> dict[tuple[Any, ...], int]:
        """Each ``by``'s count of distinct keys."""
        if self.spill is None:
            rows = pl.concat(self.parts).unique() if len(self.parts) > 1 else self.parts[0]
            return _counted(rows.lazy(), self.by)
        self._spill()
        counts: dict[tuple[Any, ...], int] = {}
        folder = Path(self.spill.name)
        for share in range(SHARES):
            files = sorted(folder.glob(f"{share:03d}-*.arrow"))
            if files:
                for source, n in _counted(pl.scan_ipc(files).unique(), self.by).items():
                    counts[source] = counts.get(source, 0) + n
                for path in files:
                    path.unlink()
        return counts

    def _spill(self) -> None:
        if self.spill is None:
            self.spill = tempfile.TemporaryDirectory(prefix="metriclog-inspect-")
        share = (pl.col("key").hash(seed=0) % SHARES).alias("_share")
        while self.parts:
            part = self.parts.pop(0).with_columns(share)
            for (n,), piece in part.partition_by("_share", as_dict=True, include_key=False).items():
                at = int(n)  # type: ignore[call-overload]
                self._write(at, piece)
                if self.on_disk[at] > max(COUNTED_KEYS // 4, 2 * self.kept[at]):
                    self._made_distinct(at)
        self.held = 0

    def _write(self, share: int, rows: pl.DataFrame) -> None:
        assert self.spill is not None
        self.spilled += 1
        rows.write_ipc(
            Path(self.spill.name) / f"{share:03d}-{self.spilled:06d}.arrow", compression="uncompressed"
        )
        self.on_disk[share] += rows.height

    def _made_distinct(self, share: int) -> None:
        assert self.spill is not None
        files = sorted(Path(self.spill.name).glob(f"{share:03d}-*.arrow"))
        rows = pl.scan_ipc(files).unique().collect()
        for path in files:
            path.unlink()
        self.on_disk[share] = 0
        self._write(share, rows)
        self.kept[share] = rows.height

    def close(self) -> None:
        if self.spill is not None:
            self.spill.cleanup()
            self.spill = None


def _counted(rows: pl.LazyFrame, by: list[str]) -> dict[tuple[Any, ...], int]:
    """Rows a distinct (``by``, key), counted per ``by``."""
    if not by:
        n = rows.select(pl.len()).collect().item()
        return {(): n} if n else {}
    return {tuple(row[:-1]): row[-1] for row in rows.group_by(by).len().collect().iter_rows()}


def _batched_aggregates(
    frames: Iterator[pl.DataFrame], by: list[str], key: str
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """``_file_aggregates`` of a file read in frames: each frame's, merged (the last
    value is the one of the newest timestamp of all, the first in file order of equals)."""
    parts: list[pl.DataFrame] = []
    keys: list[pl.DataFrame] = []  # merged so far (the first), then frames' not merged yet
    held = 0
    for df in frames:
        steps, found = _file_aggregates(df.lazy(), by, key)
        parts.append(steps)
        keys.append(found)
        held += found.height
        if len(keys) > 1 and held > max(MERGED_KEYS, 2 * keys[0].height):  # merged as they double
            keys = [_merged_keys(pl.concat(keys, how="vertical_relaxed"), [*by, key])]
            held = keys[0].height
    assert keys, "a file read gives a frame at least"
    merged = _merged_keys(pl.concat(keys, how="vertical_relaxed"), [*by, key]) if len(keys) > 1 else keys[0]
    # a key's row keeps its process as a code (4 bytes, not a string's 16: millions of keys)
    text = [c for c in (key,) if merged.schema[c] == pl.Categorical]
    return _merged_steps(parts, by), merged.with_columns(pl.col(text).cast(pl.String))


def _merged_steps(parts: list[pl.DataFrame], by: list[str]) -> pl.DataFrame:
    """A file's rows a (``by``, step), from its frames' (processes as text)."""
    steps = pl.concat(parts)
    if len(parts) > 1:
        steps = steps.group_by(*by, "step", maintain_order=True).agg(
            pl.col("records").sum(), pl.col("reached").min(), pl.col("done").max()
        )
    return steps.with_columns(pl.col(pl.Categorical).cast(pl.String))


def _merged_keys(keys: pl.DataFrame, by: list[str]) -> pl.DataFrame:
    """Per-key aggregates of parts (in file order) of the same records, as one: the last
    value is the one of the newest timestamp of all (the first in file order of equals).
    Millions of keys are merged in shares (by a hash of the key: ``by``'s last column), a
    share at a time, so the grouping holds one share."""
    shares = -(-keys.height // MERGED_KEYS)
    if shares <= 1:
        return _merged_share(keys, by)
    if keys[by[-1]].n_unique() == keys.height:  # each key once (a run of distinct keys): as it is
        return keys
    share = keys[by[-1]].hash(seed=0) % shares
    return pl.concat([_merged_share(keys.filter(share == r), by) for r in range(shares)])


def _merged_share(keys: pl.DataFrame, by: list[str]) -> pl.DataFrame:
    return keys.group_by(*by, maintain_order=True).agg(
        pl.col("last_value").max_by("last_timestamp"),
        pl.col("last_timestamp").max(),
        pl.col("nonfinite").sum(),
        pl.col("first_bad_step").min(),
        pl.col("first_bad_timestamp").min(),
    )


def _file_aggregates(frame: pl.LazyFrame, by: list[str], key: str) -> tuple[pl.DataFrame, pl.DataFrame]:
    """One file's records per (``by``, step) and per (``by``, ``key``), from one read: last
    value and non-finite count per key; where the first non-finite value came is looked
    up in a second pass only when there is one."""
    ts = pl.col("timestamp")
    bad = ~pl.col("value").is_finite()
    steps, keys = pl.collect_all(
        [
            frame.group_by(*by, "step").agg(records=pl.len(), reached=ts.min(), done=ts.max()),
            frame.group_by(*by, key).agg(
                last_value=pl.col("value").max_by("timestamp"), last_timestamp=ts.max(), nonfinite=bad.sum()
            ),
        ]
    )
    if not keys["nonfinite"].sum():
        keys = keys.with_columns(
            first_bad_step=pl.lit(None, pl.Int64), first_bad_timestamp=pl.lit(None, pl.Float64)
        )
    else:
        first_bad = (
            frame.filter(bad)
            .group_by(*by, key)
            .agg(first_bad_step=pl.col("step").min(), first_bad_timestamp=ts.min())
            .collect()
        )
        keys = keys.join(first_bad, on=[*by, key], how="left", nulls_equal=True)
    return steps, keys


def _key_hashes(files: list[FileReport]) -> pl.DataFrame | None:
    """key_hash -> key for files that all carry the writer's hashes, unless two keys collide."""
    if not all(f.hashed and f.keys is not None for f in files):
        return None
    table = keys_by_hash(key for f in files for key, _ in f.keys or ())
    if table is None:
        return None
    return pl.DataFrame(
        {KEY_HASH: list(table), "key": list(table.values())}, schema={KEY_HASH: pl.Int64, "key": pl.String}
    )
