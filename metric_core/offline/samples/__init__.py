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

Modules: ``files`` (the run's samples files listed, each read), ``reading``
(``read_samples``: attempts, filters, order), ``choosing`` (``choose``, ``SampleChoice``),
``frame`` (``samples_frame``) and ``upload_tables`` (``SampleTables``, for uploads).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from metric_core.errors import PlanError
from metric_core.offline.samples.choosing import SampleChoice, choose
from metric_core.offline.samples.frame import EXACT_FLOAT_INT, FIXED, column_names, field_names, samples_frame
from metric_core.offline.samples.reading import (
    LISTINGS,
    Sample,
    SampleSet,
    kept,
    read_samples,
    record_attempts,
)
from metric_core.offline.samples.upload_tables import SampleTables

if TYPE_CHECKING:
    import polars as pl

__all__ = [
    "EXACT_FLOAT_INT",
    "FIXED",
    "LISTINGS",
    "Sample",
    "SampleChoice",
    "SampleSet",
    "SampleTables",
    "choose",
    "column_names",
    "field_names",
    "kept",
    "read_samples",
    "record_attempts",
    "samples_frame",
    "select_samples",
]


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
    Returns the chosen samples as a polars DataFrame (a column a field) and the
    ``SampleSet`` read. Raises ``PlanError`` for a filter or choice it cannot parse.

    >>> frame, read = select_samples("sample_logs/rl_run", top=2, by="reward")
    >>> frame.columns, read.notes
    (['step', 'rank', 'process', 'timestamp', 'key'], [])
    """
    from metric_core.offline.plan import counts_back, last_steps, parse_ranks, parse_steps
    from metric_core.offline.read.discover import run_json_notices

    for name, count in (("top", top), ("bottom", bottom), ("random", random)):
        if count < 0:
            raise PlanError("must be 0 or more", option=name, value=str(count))
    if isinstance(ranks, str):
        ranks = parse_ranks(ranks)
    if isinstance(steps, str):
        steps = parse_steps(steps)
    read = read_samples(run, attempts=attempts)  # once: the filters choose in memory
    read.notes[:0] = run_json_notices(run)  # a damaged run.json is said, as by the other commands
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
