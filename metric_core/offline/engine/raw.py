"""per_rank_no_reduce: every record kept, one source at a time, in time order."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import polars as pl

from metric_core.errors import (
    PlanError,
)
from metric_core.offline import filters
from metric_core.offline.engine.reading import (
    columns_read,
    data_order,
    first_time,
    key_matching,
    nothing_kept,
    parts_of,
    read_batches,
    reads_dictionaries,
)
from metric_core.offline.plan import By, ReducePlan, key_matcher
from metric_core.offline.read import OnProgress, RunScan, explain_read_errors
from metric_core.offline.timeorder import in_time_order

# per_rank_no_reduce hands over a source's records in frames of at most this many: the
# peak memory of the raw output's writer grows with it (benchmarks/bench_memory.py).
RAW_BATCH_ROWS = 100_000


def raw_mode(
    plan: ReducePlan, scan: RunScan, on_progress: OnProgress | None
) -> tuple[Callable[[], Iterator[pl.DataFrame]], list[PlanError]]:
    """per_rank_no_reduce: every record kept, one source at a time, in time order; the
    stream of its frames, and the filters that matched no record (once it ended).

    A file of one source (the writer's) is read when its source's turn comes; files that
    hold several sources (or do not say) are read first and held, to be split by source."""
    t0 = first_time(plan, scan) if plan.by is By.TIME else None
    match = key_matcher(plan.keys) if plan.keys else None
    dictionaries = reads_dictionaries(scan)
    kept = columns_read(plan, scan)
    seen, unmatched = filters.Seen.wanted_by(plan), list[PlanError]()
    by_source: dict[tuple[str, int], list[int]] = {}
    mixed: list[int] = []
    for fid in data_order(scan, scan.file_ids):  # records of one time: in this order
        rep = scan.report.files[fid]
        source = rep.source or rep.single_source
        (by_source.setdefault(source, []) if source is not None else mixed).append(fid)
    sizes = {fid: scan.report.files[fid].size for fid in scan.file_ids}
    total = sum(sizes.values())

    def read(fid: int, groups: list[int] | None = None) -> pl.DataFrame:
        return key_matching(read_part(plan, scan, fid, dictionaries, kept, seen, groups), match)

    @explain_read_errors
    def stream() -> Iterator[pl.DataFrame]:
        done = 0
        held = pl.concat([read(fid) for fid in mixed], how="vertical_relaxed") if mixed else None
        if held is not None:
            done += sum(sizes[fid] for fid in mixed)
        sources = set(by_source)
        if held is not None:
            sources |= set(held.select("process", "rank").unique().iter_rows())
        produced = False
        for i, (process, rank) in enumerate(sorted(sources)):
            fids = by_source.get((process, rank), [])
            if held is None:
                batches = in_time_order(parts_of(scan, fids, dictionaries), read, RAW_BATCH_ROWS)
            else:  # its held rows may fall anywhere in its time: all of it at once
                mine = held.filter((pl.col("process") == process) & (pl.col("rank") == rank))
                whole = pl.concat([*(read(fid) for fid in fids), mine], how="vertical_relaxed")
                batches = iter(
                    [whole.sort("timestamp", maintain_order=True)]
                )  # ties: the files' order (data_order)
            for batch in batches:
                if batch.height == 0:  # a filter left none of the source's records
                    continue
                if t0 is not None:
                    window = np.floor((batch["timestamp"].to_numpy() - t0) / float(plan.every or 0))
                    batch = batch.with_columns(window_start=pl.Series(t0 + window * float(plan.every or 0)))
                produced = True
                out = _lower_reductions(batch.select(plan.output_columns))
                for start in range(0, out.height, RAW_BATCH_ROWS):  # a part read whole may be large
                    piece = out.slice(start, RAW_BATCH_ROWS)
                    yield piece.with_columns(pl.col(pl.Categorical).cast(pl.String))
            done += sum(sizes[fid] for fid in fids)
            if on_progress is not None:
                on_progress(i + 1, len(sources), done, total)
        unmatched[:] = filters.unmatched(plan, seen)
        if not produced:
            raise nothing_kept(plan, scan, unmatched)

    return stream, unmatched


def read_part(
    plan: ReducePlan,
    scan: RunScan,
    fid: int,
    dictionaries: bool,
    kept: list[str],
    seen: filters.Seen,
    row_groups: list[int] | None = None,
) -> pl.DataFrame:
    """``read_batches`` as one frame."""
    return pl.concat(
        list(read_batches(plan, scan, fid, dictionaries, kept, row_groups, RAW_BATCH_ROWS, seen)),
        how="vertical_relaxed",  # keys as Categorical or, past read.interned's budget, text
    )


def _lower_reductions(df: pl.DataFrame) -> pl.DataFrame:
    """Reductions in lower case, as every mode reads them (another tool may write ``MEAN``),
    looking at each distinct one once."""
    if "reduction" not in df.columns:
        return df
    distinct = [r for r in df["reduction"].unique().cast(pl.String).to_list() if r is not None]
    changed = {r: r.lower() for r in distinct if r != r.lower()}
    if not changed:
        return df
    return df.with_columns(pl.col("reduction").cast(pl.String).replace(changed).cast(df["reduction"].dtype))
