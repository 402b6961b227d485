"""What happened in a crashed or hung run: per-source health and a verdict (docs/commands.md).

Status of a source:

* ``finished``: its writer recorded a clean ``shutdown()``.
* ``stopped_early``: no clean shutdown, and it went quiet long before the others. "Long"
  is measured against the source's own cadence: its lag (the newest record of any source
  minus its own newest) must exceed both 10 times its typical gap between steps (the
  median time from one step's last record to the next one's) and twice the longest gap
  it ever took on its own (an evaluation pause, a checkpoint). A source that steps every
  2 s is late after 20 s of silence; one that steps every 10 min is not late after 30 min.
* ``unfinished``: no clean shutdown, but among the last to write: the whole job died
  together, or is still running.

The run is **still running** when a source that has not finished is still within its
quiet threshold of the wall clock (the stop rule above, with "now" for the newest record).

Stragglers are sources slower than the rest of their role (the process name without
its ``_rN`` suffix) by a sustained margin: their median step time (over at least
MIN_STEP_TIMES steps) is at least STRAGGLER_RATIO times the median of the other sources'
median step times. One late step, jitter, or a source that started late but keeps pace
is not a straggler.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from metric_core.clock import duration, local_time
from metric_core.errors import in_python, opt, spell
from metric_core.offline import story
from metric_core.offline.read import (
    FileReport,
    OnProgress,
    OnRead,
    RunScan,
    all_skipped,
    changed_files_said,
    scan_run,
)
from metric_core.offline.read.attempts import Attempt
from metric_core.offline.samples import read_samples
from metric_core.offline.storage import newest_listed
from metric_core.offline.story import Failure, Pause
from metric_core.schema import KEY_HASH, keys_by_hash

QUIET_FACTOR = 10.0
STALL_MIN_S = 10.0  # no silence shorter than this is a stall: scheduling noise on fast steps
OWN_GAP_FACTOR = 2.0
STRAGGLER_RATIO = 1.2
MIN_STEP_TIMES = 10
_ROLE = re.compile(r"_r\d+$")


@dataclass
class SourceHealth:
    """One source (process, rank) of the run."""

    process: str
    rank: int
    files: int
    skipped: int
    truncated: bool
    dropped: int  # recorded, but its writer could not write them (its D frames)
    records: int
    keys: int
    first_step: int
    last_step: int
    first_timestamp: float
    last_timestamp: float
    lag_s: float  # the newest record of any source minus this source's newest
    cadence_s: float | None  # its median gap between consecutive steps
    clean_shutdown: bool
    status: str  # "finished", "stopped_early" or "unfinished"
    # Each init() of the source that wrote into the run (a restart is a new one), oldest first.
    attempts: list[Attempt] = field(default_factory=list)
    silent_s: float = 0.0  # the wall clock (the report's checked_at) minus its newest record
    # Not finished nor over, and silent against the wall clock for ``stall_after_s`` (judged
    # once it has a cadence): a hang, even when every source hangs together.
    stalled: bool = False
    stall_after_s: float | None = None  # max(10 s, 10 step times, twice its longest pause), or as asked
    end: str | None = None  # its newest attempt's end (``offline.story``): "running", "died", ...


@dataclass
class FirstToStop:
    """The source that stopped first, and its last value of every key (NaN stays NaN)."""

    process: str
    rank: int
    last_step: int
    last_timestamp: float
    lag_s: float
    status: str
    last_values: dict[str, float]


@dataclass
class NonFinite:
    """Where a source's key first held NaN or an infinity, and how many it held."""

    process: str
    rank: int
    key: str
    first_step: int
    first_timestamp: float
    count: int


@dataclass
class Straggler:
    """A source whose median step time is STRAGGLER_RATIO times its role's or more; and the
    step it reached latest after the fastest source of its role."""

    process: str
    rank: int
    worst_lag_s: float
    at_step: int
    step_time_s: float  # its median time from one step's last record to the next one's
    role_step_time_s: float  # the median of the other sources' of its role


@dataclass
class InspectReport:
    """What ``inspect_run`` found; ``to_json()`` is the object docs/commands.md describes."""

    run_dir: str
    name: str
    world_size: int | None
    missing_ranks: list[int]
    sources: list[SourceHealth]
    first_to_stop: FirstToStop | None
    nonfinite: list[NonFinite]
    stragglers: list[Straggler]
    skipped_records: int
    unreadable_files: list[str]
    # A source that has not finished wrote recently against the wall clock (``checked_at``)
    # and its cadence: the job is likely still running.
    still_running: bool = False
    checked_at: float = 0.0
    # Every source that stopped early, the first to stop first (``first_to_stop`` is the first).
    stopped_early: list[FirstToStop] = field(default_factory=list)
    # The earliest attempt end that was not a clean shutdown (``offline.story``).
    first_failure: Failure | None = None
    pauses: list[Pause] = field(default_factory=list)
    # Samples (Reduce.SAMPLE) per key: not records, read by ``metriclog samples``.
    samples: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """Strict JSON: a number that is not finite (NaN, infinity) becomes null."""
        return _strict_json(self.to_dict())

    def verdict(self, spelled: Callable[[str], str] = in_python) -> list[str]:
        """The plain-words verdict that follows the table (options named as ``spelled`` says)."""
        return [spell(line, spelled) for line in _verdict(self)]


@changed_files_said
def inspect_run(
    run: RunScan | str | os.PathLike[str],
    *,
    follow_symlinks: bool = False,
    attempts: str = "rewind",
    on_read: OnRead | None = None,
    on_progress: OnProgress | None = None,
    now: float | None = None,
    cache: dict[Any, Any] | None = None,
    pause_after: float | None = None,
    stall_after: float | None = None,
) -> InspectReport:
    """Per-source health and what stopped first, for a run directory (or a scan of one);
    ``on_progress`` is called after each file is read; ``now`` (by default the wall clock,
    or for a run in object storage its newest object's time) is what "still running" and a
    stall are judged against; ``pause_after`` is the silence that makes a pause (default:
    max(10 s, 10 step times) per source), ``stall_after`` the silence that makes a live
    source stalled (default: max(10 s, 10 step times, twice its longest pause)). ``cache``
    (a dict kept between
    calls, as ``watch_run`` does) keeps each file's aggregates while the file is unchanged,
    so a call reads only the files written since the last.

    >>> report = inspect_run("sample_logs/rl_run")
    >>> report.first_to_stop.process, report.first_to_stop.last_step
    ('GeneratorActor_r1', 179)
    >>> [s.status for s in report.sources]
    ['finished', 'stopped_early', 'finished', 'finished']
    """
    scan = (
        run
        if isinstance(run, RunScan)
        else scan_run(run, follow_symlinks=follow_symlinks, attempts=attempts, defer_checks=True)
    )
    try:  # another tool's files are checked as they are aggregated: the report is whole after
        steps, per_key = _aggregate(scan, on_progress, cache)
    finally:
        if on_read is not None:
            on_read(scan.report)
    nonfinite = per_key.filter(pl.col("nonfinite") > 0).select(
        "process",
        "rank",
        "key",
        first_step=pl.col("first_bad_step"),
        first_timestamp=pl.col("first_bad_timestamp"),
        count=pl.col("nonfinite"),
    )
    sources_keys = (
        per_key.select(pl.col("process").cast(pl.Categorical), "rank").group_by("process", "rank").len()
    )
    keys = {(p, r): n for p, r, n in sources_keys.iter_rows()}  # grouped on codes: millions of keys
    newest = max(s.last_timestamp for s in steps.values())
    clean = scan.report.clean_shutdowns()
    cadence = _cadence(steps)
    sources = []
    if now is None:  # a copy in a bucket trails its job: judged at the time of its newest object
        now = time.time() if isinstance(scan.run_dir, Path) else newest_listed(scan.run_dir)
    failure, stacks = story.tell(scan.report, scan.run_dir, now)
    live = False
    for source, its in sorted(steps.items()):
        typical, longest, _ = cadence[source]
        lag = newest - its.last_timestamp
        tried = [a for a in scan.report.attempts if (a.process, a.rank) == source]
        ended_well = source in clean or (bool(tried) and tried[-1].ended_well)
        sources.append(
            SourceHealth(
                process=source[0],
                rank=source[1],
                **_file_health(scan, its.files),
                records=its.records,
                keys=keys.get(source, 0),
                first_step=its.first_step,
                last_step=its.last_step,
                first_timestamp=its.first_timestamp,
                last_timestamp=its.last_timestamp,
                lag_s=lag,
                cadence_s=typical,
                clean_shutdown=ended_well,
                status=_status(ended_well, lag, typical, longest),
                attempts=tried,
            )
        )
        health = sources[-1]
        health.silent_s = silent = now - its.last_timestamp
        health.end = health.attempts[-1].end if health.attempts else None
        quiet = _status(False, silent, typical, longest) == "stopped_early"
        over = bool(tried) and tried[-1].failed
        health.stall_after_s = stall_after or stall_threshold(typical, longest)
        health.stalled = (
            health.status != "finished" and typical is not None and not over and silent > health.stall_after_s
        )
        # Still running: its heartbeat goes on (a hang is running too), or, for a writer that
        # records none, it wrote within its quiet threshold of the wall clock.
        if health.end == "running" or (health.status == "unfinished" and not quiet and health.end is None):
            live = True
    # Only sources that stopped early are named as stopping first: sources that stopped
    # together, or are still writing, differ by noise.
    stopped = _stopped_early(per_key, sources)
    paused = story.pauses(scan.report, stacks, {s: c[0] for s, c in cadence.items()}, now, pause_after)
    world_size = scan.meta.get("world_size")
    present = {rank for _, rank in steps}
    missing = sorted(set(range(int(world_size))) - present) if isinstance(world_size, int) else []
    return InspectReport(
        run_dir=str(scan.run_dir),
        name=scan.name,
        world_size=world_size if isinstance(world_size, int) else None,
        missing_ranks=missing,
        sources=sources,
        first_to_stop=stopped[0] if stopped else None,
        nonfinite=[
            NonFinite(**row)
            for row in nonfinite.sort("first_timestamp", "process", "rank", "key").iter_rows(named=True)
        ],
        stragglers=_stragglers(steps, cadence),
        skipped_records=scan.report.skipped_records,
        unreadable_files=[str(f.path) for f in scan.report.unreadable_files],
        still_running=live,
        checked_at=now,
        stopped_early=stopped,
        first_failure=failure,
        pauses=paused,
        samples=read_samples(scan.run_dir, known=scan.report.attempts).keys(),
    )


def _strict_json(report: dict[str, Any]) -> str:
    """JSON with every non-finite number as null.

    >>> json.loads(_strict_json({"last_values": {"loss": float("nan"), "lr": 0.1}}))
    {'last_values': {'loss': None, 'lr': 0.1}}
    """

    def finite(obj: Any) -> Any:
        if isinstance(obj, float) and not math.isfinite(obj):
            return None
        if isinstance(obj, dict):
            return {k: finite(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [finite(v) for v in obj]
        return obj

    return json.dumps(finite(report), indent=2, allow_nan=False)


@dataclass
class _Steps:
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
    def merged(cls, parts: list[tuple[int, pl.DataFrame]]) -> _Steps | None:
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


Source = tuple[str, int]


def _aggregate(
    scan: RunScan, on_progress: OnProgress | None = None, cache: dict[Any, Any] | None = None
) -> tuple[dict[Source, _Steps], pl.DataFrame]:
    """Per source its steps, and per (source, key), a file at a time: each file is read
    once, and memory holds one file's columns (another tool's: a frame of them), not the
    run's.

    Files of one source (their writer's metadata or their footer's statistics say which)
    are grouped by file id alone (no string hashed per record); other files are grouped by
    process and rank as well.
    """
    files = scan.report.files
    sources = {i: files[i].source or files[i].single_source for i in scan.file_ids}
    vouched = {i for i, source in sources.items() if source is not None}
    # the writer's files group on its key hashes (another tool's file of one source, on strings)
    hashes = _key_hashes([files[i] for i in vouched if files[i].hashed])
    sizes = {fid: files[fid].size for fid in scan.file_ids}
    per_source: dict[Source, list[tuple[int, pl.DataFrame]]] = {}
    by_key = []
    done = 0
    used = {}
    for n, fid in enumerate(scan.file_ids, 1):
        known = _file_identity(files[fid], sources[fid]) if cache is not None else None
        if known is not None and known in cache:  # type: ignore[operator]
            steps, keys, counts = used[known] = cache[known]  # type: ignore[index]
            scan.counted_before(fid, *counts)  # as the call that read it counted them
        else:
            by = [] if fid in vouched else ["process", "rank"]
            names = hashes if fid in vouched and files[fid].hashed else None
            key = KEY_HASH if names is not None else "key"
            columns = [*by, "step", key, "value", "timestamp"]
            # another tool's file: checked as it is read, once; a checksummed segment: verified
            if scan.checks_as_read(fid):
                found, keys = _batched_aggregates(scan.batches(fid, columns, rows=BATCH_ROWS), by, key)
            else:
                found, keys = _file_aggregates(scan.file_frame(fid).select(columns), by, key)
            if names is not None:
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
            counts = (files[fid].records, files[fid].skipped, dict(files[fid].skip_reasons))
        if known is not None:
            used[known] = (steps, keys, counts)
        for source, found in steps.items():
            per_source.setdefault(source, []).append((fid, found))  # type: ignore[arg-type]
        by_key.append(keys)
        done += sizes[fid]
        if on_progress is not None:
            on_progress(n, len(sizes), done, sum(sizes.values()))
    if cache is not None:  # files gone (a journal sealed) leave the cache
        cache.clear()
        cache.update(used)
    per_key = (
        by_key[0]
        if len(by_key) == 1
        else _merged_keys(pl.concat(by_key, how="vertical_relaxed"), ["process", "rank", "key"])
    )
    del by_key
    merged = {source: _Steps.merged(per_source.pop(source)) for source in list(per_source)}  # frames freed
    steps = {source: its for source, its in merged.items() if its is not None}  # not all checked away
    if not steps:
        raise all_skipped(scan.report)
    return steps, per_key


def _file_identity(rep: FileReport, source: Any) -> tuple[Any, ...] | None:
    """What a file's aggregates depend on: the file as it was listed, before its records
    were read (a file written to since is read again the next time), and how it was read."""
    if rep.listed is None:
        return None
    return (str(rep.path), *rep.listed, rep.replaced_from, rep.hashed, source)


# Records of another tool's file aggregated at a time (the file is read once, in frames).
BATCH_ROWS = 500_000
# Per-key rows of a file's frames held before they are merged (or twice the keys merged):
# merging at every frame would group a run of millions of keys again and again
MERGED_KEYS = 500_000


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
    steps = pl.concat(parts)
    if len(parts) > 1:
        steps = steps.group_by(*by, "step", maintain_order=True).agg(
            pl.col("records").sum(), pl.col("reached").min(), pl.col("done").max()
        )
    strings = pl.col(pl.Categorical).cast(pl.String)
    return steps.with_columns(strings), merged.with_columns(strings)


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


Cadence = dict[Source, tuple[float | None, float | None, int]]


def _cadence(steps: dict[Source, _Steps]) -> Cadence:
    """Per source: the median and the longest gap between consecutive steps' last records,
    and how many gaps there were."""
    out: Cadence = {}
    for source, its in steps.items():
        gaps = np.diff(np.sort(its.done))
        out[source] = (float(np.median(gaps)), float(gaps.max()), len(gaps)) if len(gaps) else (None, None, 0)
    return out


def stall_threshold(typical: float | None, longest: float | None) -> float:
    """How long a live source may be silent before it is stalled: ``STALL_MIN_S``, ten times
    its usual step time, or twice its longest pause, whichever is longest."""
    return max(STALL_MIN_S, QUIET_FACTOR * (typical or 0.0), OWN_GAP_FACTOR * (longest or 0.0))


def _status(clean: bool, lag: float, typical: float | None, longest: float | None) -> str:
    if clean:
        return "finished"
    threshold = max(QUIET_FACTOR * (typical or 0.0), OWN_GAP_FACTOR * (longest or 0.0))
    return "stopped_early" if lag > threshold and lag > 0 else "unfinished"


def _file_health(scan: RunScan, file_ids: list[int]) -> dict[str, Any]:
    files = [scan.report.files[i] for i in file_ids]
    return {
        "files": len(files),
        "skipped": sum(f.skipped for f in files),
        "truncated": any(f.truncated for f in files),
        "dropped": sum(f.dropped_records for f in files),  # recorded, but its writer could not write them
    }


def _stopped_early(per_key: pl.DataFrame, sources: list[SourceHealth]) -> list[FirstToStop]:
    """Every source that stopped early, the first to stop first, with its last values."""
    stopped = sorted(
        (s for s in sources if s.status == "stopped_early"),
        key=lambda s: (s.last_timestamp, s.process, s.rank),
    )
    if not stopped:
        return []
    last_values = (
        per_key.sort("key").group_by("process", "rank", maintain_order=True).agg("key", "last_value")
    )
    values = {(p, r): dict(zip(k, v, strict=True)) for p, r, k, v in last_values.iter_rows()}
    return [
        FirstToStop(
            process=s.process,
            rank=s.rank,
            last_step=s.last_step,
            last_timestamp=s.last_timestamp,
            lag_s=s.lag_s,
            status=s.status,
            last_values=values.get((s.process, s.rank), {}),  # NaN stays a float; to_json writes null
        )
        for s in stopped
    ]


def _stragglers(steps: dict[Source, _Steps], cadence: Cadence) -> list[Straggler]:
    """Sources whose median step time is STRAGGLER_RATIO times the median of the other
    sources' of their role or more (each measured over MIN_STEP_TIMES steps at least)."""
    roles: dict[str, dict[tuple[str, int], float]] = {}
    for (process, rank), (typical, _, n) in cadence.items():
        if typical is not None and n >= MIN_STEP_TIMES:
            roles.setdefault(_ROLE.sub("", process), {})[(process, rank)] = typical
    slow: dict[tuple[str, int], tuple[float, float]] = {}
    for members in roles.values():
        for source, own in members.items():
            others = [t for s, t in members.items() if s != source]
            if others and own >= STRAGGLER_RATIO * statistics.median(others) > 0:
                slow[source] = (own, statistics.median(others))
    if not slow:
        return []
    slow_roles = {_ROLE.sub("", process) for process, _ in slow}
    with_role = pl.concat(  # the sources of the roles with a straggler: a row a step of each
        pl.LazyFrame({"step": its.step, "reached": its.reached}).select(
            pl.lit(process, pl.String).alias("process"),
            pl.lit(rank, pl.Int64).alias("rank"),
            pl.lit(_ROLE.sub("", process)).alias("role"),
            "step",
            "reached",
        )
        for (process, rank), its in steps.items()
        if _ROLE.sub("", process) in slow_roles
    )
    fastest = with_role.group_by("role", "step").agg(fastest=pl.col("reached").min())
    lag = pl.col("reached") - pl.col("fastest")
    behind = (
        with_role.join(fastest, on=["role", "step"])
        .group_by("process", "rank")
        .agg(worst_lag_s=lag.max(), at_step=pl.col("step").sort_by(lag, pl.col("step")).last())
        .sort("process", "rank")
        .collect(engine="streaming")  # a row a step of every source: no window, no index lists
    )
    out = [
        Straggler(process, rank, worst, at_step, *slow[(process, rank)])
        for process, rank, worst, at_step in behind.iter_rows()
        if (process, rank) in slow
    ]
    return sorted(out, key=lambda s: -s.step_time_s / s.role_step_time_s)


def _verdict(report: InspectReport) -> list[str]:
    """Every source that is not healthy, the most important first: ranks that never wrote,
    sources that stopped early, records lost, sources that ended without shutdown() while
    others finished, restarts, non-finite values, stragglers; then what the run as a whole
    looks like (still running, stopped together, finished)."""
    lines = story.story_lines(
        report.first_failure, [a for s in report.sources for a in s.attempts], report.pauses
    )
    if report.missing_ranks:
        lines.append(
            f"Ranks {', '.join(map(str, report.missing_ranks))} of world_size {report.world_size} "
            "never wrote a record."
        )
    for i, stop in enumerate(report.stopped_early):
        kind = "stopped first" if i == 0 and len(report.stopped_early) > 1 else "stopped early"
        lines.append(
            f"{stop.process} (rank {stop.rank}) {kind}: last record at step {stop.last_step}, "
            f"{local_time(stop.last_timestamp)}, {duration(stop.lag_s)} before the newest record of the run."
        )
        lines.append("  its last values: " + ", ".join(f"{k}={_fmt(v)}" for k, v in stop.last_values.items()))
    for src in report.sources:
        if src.dropped:
            lines.append(
                f"{src.process} (rank {src.rank}) recorded {src.dropped} record(s) that its writer "
                "could not write (its disk was full or its directory gone for too long): they are missing."
            )
    finished = [s for s in report.sources if s.status == "finished"]
    if finished and not report.still_running:
        for src in report.sources:
            if src.status == "unfinished" and src.end is None:  # an end recorded is in the story
                lines.append(
                    f"{src.process} (rank {src.rank}) ended without shutdown() while {len(finished)} "
                    f"source(s) finished cleanly: last record at step {src.last_step}, "
                    f"{local_time(src.last_timestamp)}."
                )
    for src in report.sources:
        for a in src.attempts:
            if a.replaced and a.replaced_steps is not None and a.replaced_by is not None:
                lo, hi = a.replaced_steps
                lines.append(
                    f"{src.process} (rank {src.rank}) was restarted at step {a.restarted_at}: "
                    f"{a.replaced} record(s) of steps {lo}-{hi} of its attempt {a.attempt} were replaced "
                    f"by attempt {a.replaced_by} ({opt('attempts')}'all' keeps them)."
                )
    for item in report.nonfinite:
        lines.append(
            f"Non-finite values in {item.key} on {item.process} (rank {item.rank}) from step "
            f"{item.first_step} ({local_time(item.first_timestamp)}), {item.count} in all."
        )
    for s in report.stragglers:
        lines.append(
            f"Straggler: {s.process} (rank {s.rank}) takes {duration(s.step_time_s)} a step, "
            f"{s.step_time_s / s.role_step_time_s:.2f}x the {duration(s.role_step_time_s)} of the rest "
            f"of its role; at step {s.at_step} it was {duration(s.worst_lag_s)} behind the fastest."
        )
    lines += _overall(report, problems=bool(lines))
    if report.skipped_records or report.unreadable_files:
        lines.append(
            f"{report.skipped_records} record(s) and {len(report.unreadable_files)} file(s) "
            "could not be read (see the warning above)."
        )
    return lines


def _overall(report: InspectReport, problems: bool) -> list[str]:
    """What the run as a whole looks like."""
    statuses = {s.status for s in report.sources}
    newest = max(s.last_timestamp for s in report.sources)
    if report.still_running:
        steps = [s.cadence_s for s in report.sources if s.cadence_s]
        ends = dict.fromkeys([duration(min(steps)), duration(max(steps))]) if steps else {}
        pace = f"; its sources step every {' to '.join(ends)}" if ends else ""
        live = [s for s in report.sources if s.end == "running"]
        if live and all(s.stalled for s in live):
            return [
                f"The run is still running but hung: its writers are alive, and no source took a step for "
                f"{duration(report.checked_at - newest)} (since {local_time(newest)}){pace}."
            ]
        return [
            f"The run looks still running: its newest record is {duration(report.checked_at - newest)} "
            f"old ({local_time(newest)}){pace}."
        ]
    if statuses == {"finished"}:
        if report.first_failure is not None:
            return ["The newest attempt of every source recorded a clean shutdown."]
        return (
            ["Every source recorded a clean shutdown."]
            if problems
            else ["Every source finished cleanly; no non-finite values."]
        )
    unfinished = [s for s in report.sources if s.status == "unfinished"]
    if not report.stopped_early and len(unfinished) == len(report.sources):
        # When they ended, where their writers recorded it; else their last records.
        ended = [
            s.attempts[-1].ended_at if s.attempts and s.attempts[-1].ended_at else s.last_timestamp
            for s in unfinished
        ]
        spread = max(ended) - min(ended)
        return [
            f"No source stopped before the others: all {len(unfinished)} ended without shutdown() within "
            f"{duration(spread)} of each other, the last at {local_time(max(ended))} (the whole job was "
            "stopped, or crashed together)."
        ]
    return []


def _fmt(v: float | str) -> str:
    return v if isinstance(v, str) else f"{v:.6g}"
