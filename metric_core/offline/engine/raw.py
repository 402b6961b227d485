"""per_rank_no_reduce: every record kept, one source at a time, in time order."""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa

from metric_core.errors import (
    PlanError,
)
from metric_core.offline import filters
from metric_core.offline.engine.filtering import key_matching, nothing_kept
from metric_core.offline.engine.tasks import (
    columns_read,
    data_order,
    first_time,
    parts_of,
    read_batches,
    reads_dictionaries,
)
from metric_core.offline.engine.timeorder import Part, Read, in_time_order
from metric_core.offline.plan import By, ReducePlan, key_matcher
from metric_core.offline.read import OnProgress, RunScan, explain_read_errors

# per_rank_no_reduce hands over a source's records in frames of at most this many: the
# peak memory of the raw output's writer grows with it (benchmarks/bench_memory.py).
RAW_BATCH_ROWS = 100_000


def raw_mode(
    plan: ReducePlan, scan: RunScan, on_progress: OnProgress | None
) -> tuple[Callable[[], Iterator[pl.DataFrame]], list[PlanError]]:
    """per_rank_no_reduce: every record kept, one source at a time, in time order; the
    stream of its frames, and the filters that matched no record (once it ended).

    A file of one source (the writer's) is read when its source's turn comes; files that
    hold several sources (or do not say) are read first, once, their rows set aside by
    source in a temporary directory (``_Spilled``): each source's turn then holds about
    ``RAW_BATCH_ROWS`` of its records, however large a file of many sources is."""
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
        with tempfile.TemporaryDirectory(prefix="metriclog-raw-") as spill_dir:
            yield from sources_in_turn(Path(spill_dir))

    def sources_in_turn(spill_dir: Path) -> Iterator[pl.DataFrame]:
        done = 0
        spilled = _Spilled(spill_dir)
        for fid in mixed:  # read once, each source's rows set aside on disk
            for batch in read_batches(plan, scan, fid, dictionaries, kept, None, RAW_BATCH_ROWS, seen):
                spilled.add(key_matching(batch, match))
            done += sizes[fid]
        spilled.close()
        produced = False
        sources = sorted({*by_source, *spilled.parts})
        for i, source in enumerate(sources):
            fids = by_source.get(source, [])
            # its files' parts, then its rows of the files that hold several sources: records
            # of one time in the files' order, those of its own files first
            parts = [*parts_of(scan, fids, dictionaries), *spilled.parts.get(source, [])]
            for batch in in_time_order(parts, spilled.or_read(read), RAW_BATCH_ROWS):
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


class _Spilled:
    """Rows of files that hold several sources, set aside by source: a file of Arrow record
    batches (uncompressed) a source, a batch for each frame read, each a part for
    ``in_time_order`` whose earliest timestamp is known exactly; their files are numbered
    below the run's file ids, so that ``or_read`` tells them apart."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.parts: dict[tuple[str, int], list[Part]] = {}
        self.paths: dict[int, Path] = {}
        self._writers: dict[tuple[str, int], tuple[int, pa.ipc.RecordBatchFileWriter, pa.Schema]] = {}

    def add(self, frame: pl.DataFrame) -> None:
        if frame.height == 0:
            return
        frame = frame.with_columns(pl.col(pl.Categorical).cast(pl.String))  # one schema a file
        for (process, rank), rows in frame.partition_by("process", "rank", as_dict=True).items():
            source = (str(process), int(rank))
            batch = rows.rechunk().to_arrow().combine_chunks().to_batches()[0]  # one batch, one part
            if source not in self._writers:
                fid = -1 - len(self._writers)
                self.paths[fid] = self.folder / f"{-fid}.arrow"
                self._writers[source] = (
                    fid,
                    pa.ipc.new_file(str(self.paths[fid]), batch.schema),
                    batch.schema,
                )
            fid, writer, schema = self._writers[source]
            writer.write_batch(batch.cast(schema))
            parts = self.parts.setdefault(source, [])
            earliest = rows["timestamp"].min()
            lo = -math.inf if earliest is None else float(earliest)  # type: ignore[arg-type]
            parts.append(Part(fid, (len(parts),), lo, rows.height))

    def close(self) -> None:
        for _, writer, _ in self._writers.values():
            writer.close()

    def or_read(self, read: Read) -> Read:
        """``read``, but for the parts set aside here."""

        def either(fid: int, groups: list[int] | None) -> pl.DataFrame:
            if fid >= 0:
                return read(fid, groups)
            with pa.OSFile(str(self.paths[fid]), "rb") as source:  # read into memory of its own
                batches = pa.ipc.open_file(source)
                table = pa.Table.from_batches([batches.get_batch(g) for g in groups or ()])
            return pl.from_arrow(table).rechunk()  # type: ignore[return-value]

        return either
