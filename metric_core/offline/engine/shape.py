"""Reshaping a result: ``--wide`` (a column per key), and per_rank_reduce frames of
several sources put in source order."""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import polars as pl

from metric_core.errors import (
    RequestError,
    opt,
)
from metric_core.offline.plan import ReducePlan

# The keys --wide makes columns of, at most: a row of more is no table anyone reads, and
# each pivoted frame holds a column per key.
MAX_WIDE_KEYS = 10_000


def pivot_wide(frames: Iterable[pl.DataFrame], plan: ReducePlan) -> Iterator[pl.DataFrame]:
    """One row per step (per source), one column per key, keys in sorted order, as frames.

    Each frame of a result holds whole steps (of one source), so each is pivoted on its
    own. A key absent from some frames is a null column there, and which keys there are
    is known only at the end: the pivoted frames wait in a temporary directory ($TMPDIR,
    removed when done) until then, so memory holds a frame, not the result."""
    index = plan.group_columns
    with tempfile.TemporaryDirectory(prefix="metriclog-wide-") as tmp:
        keys: set[str] = set()
        files = []
        for i, frame in enumerate(frames):
            keys.update(frame["key"].unique().to_list())
            if len(keys) > MAX_WIDE_KEYS:  # before a pivot would make its columns
                raise RequestError(
                    opt("wide", flag=True) + f" makes a column of each key, and the result has more "
                    f"than {MAX_WIDE_KEYS:,} keys: choose some with " + opt("keys") + "PATTERN, or leave it "
                    "out (a row a key)"
                )
            wide = frame.pivot(on="key", index=index, values="value")
            files.append(Path(tmp) / f"{i:06d}.parquet")
            wide.write_parquet(files[-1])
        for path in files:
            part = pl.read_parquet(path)
            missing = [pl.lit(None, pl.Float64).alias(k) for k in sorted(keys) if k not in part.columns]
            yield part.with_columns(missing).select(*index, *sorted(keys)).sort(index)
            path.unlink()


def source_by_source(frames: Iterator[pl.DataFrame]) -> Iterator[pl.DataFrame]:
    """per_rank_reduce frames of several sources each (a run whose files hold several
    sources is reduced as one, step range after step range), a source at a time, in the
    output's order: each source's rows wait in files of a temporary directory ($TMPDIR,
    removed when done) until the last frame is read, so memory holds a frame."""
    with tempfile.TemporaryDirectory(prefix="metriclog-sources-") as tmp:
        files: dict[tuple[str, int], list[Path]] = {}
        for n, frame in enumerate(frames):
            for k, (source, part) in enumerate(frame.partition_by("process", "rank", as_dict=True).items()):
                path = Path(tmp) / f"{n:06d}-{k:06d}.parquet"
                part.write_parquet(path)
                files.setdefault(source, []).append(path)
        for source in sorted(files):
            for path in files[source]:
                yield pl.read_parquet(path)
                path.unlink()
