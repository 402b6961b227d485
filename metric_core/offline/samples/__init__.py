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
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from metric_core.errors import Message, NoSamplesError, PlanError, RequestError, opt
from metric_core.format.sample import is_samples_file
from metric_core.offline.filters import nearest
from metric_core.offline.samples.choosing import SampleChoice, choose, number
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

    from metric_core.offline.read.report import ReadReport  # its package loads polars

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
    "ranked_by",
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
    on_read: Callable[[ReadReport], None] | None = None,
) -> tuple[pl.DataFrame, SampleSet]:
    """``read_samples`` then ``choose``, as a table (``samples_frame``); ``ranks`` and
    ``steps`` may be given as the command line spells them (``0,2-5``, ``100:200``).
    ``on_read`` is called with the report of the files read as soon as they are (what was
    not read, as ``reduce_run``'s ``on_read`` gets it). Returns the chosen samples as a
    polars DataFrame (a column a field) and the ``SampleSet`` read.

    Raises ``PlanError`` for a filter or choice it cannot parse; ``NoDataError`` for a run
    with no metriclog file, as ``reduce_run`` raises it (a ``NoSamplesError`` for one whose
    samples files could not be read); ``RequestError`` for a ``by`` that no sample kept
    holds as a number, naming the fields nearest to it. A run of records only gives no row,
    and a note that says so.

    >>> frame, read = select_samples("sample_logs/rl_run", top=2, by="reward")
    >>> frame.columns
    ['step', 'rank', 'process', 'timestamp', 'key']
    >>> print(read.notes[0].split(": ")[0])
    sample_logs/rl_run holds no sample (Reduce.SAMPLE), records only
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
    if on_read is not None and read.report is not None:
        on_read(read.report)
    every = read.samples
    if not every and not read.replaced:
        read.notes.append(_no_samples(run, read))
    sources_kept = kept(every, keys=keys, ranks=ranks)
    if counts_back(steps):  # counted back from the last step of the samples' sources kept
        steps = last_steps(steps, max((s.step for s in sources_kept), default=-1))  # type: ignore[arg-type]
    read.samples = kept(sources_kept, steps=steps)
    if (keys or ranks or steps) and every and not read.samples:  # said, as reduce says it
        names = sorted({s.key for s in every})
        shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
        read.notes.append(f"the filters left none of the run's {len(every):,} samples; their keys: {shown}")
    if by and (top or bottom) and read.samples:
        read.notes += ranked_by(read.samples, by)
    chosen = choose(read.samples, top=top, bottom=bottom, by=by, random=random, seed=seed)
    return samples_frame(chosen), read


def ranked_by(samples: list[Sample], by: str) -> list[Message]:
    """Checks the field ``by`` that ``samples`` are ranked by: a ``RequestError`` when none of
    them holds it as a number (naming the nearest fields that are numbers), else a note per
    key none of whose samples does (none of them is shown)."""
    numeric: dict[str, set[str]] = {}  # field -> the keys of samples where it is a number
    kinds: set[str] = set()  # what ``by`` holds where it is not a number
    for s in samples:
        for name, value in s.fields.items():
            if number(value) is not None:
                numeric.setdefault(str(name), set()).add(s.key)
            elif name == by and value is not None:
                kinds.add("text" if isinstance(value, str) else type(value).__name__)
    if by not in numeric:
        if kinds:
            what = "is not a number in any sample (it holds " + ", ".join(sorted(kinds)) + ")"
        else:
            what = "is no field of the samples"
        fields = sorted(numeric)
        instead = (
            nearest(by, fields, whose="the samples'", noun="numeric fields")
            if fields
            else ("no field of theirs is a number: " + opt("random") + "N chooses some at random")
        )
        raise RequestError(opt("by") + repr(by) + f" {what}; {instead}")
    missing = sorted({s.key for s in samples} - numeric[by])
    if not missing:
        return []
    shown = ", ".join(repr(k) for k in missing[:10]) + (", ..." if len(missing) > 10 else "")
    return [opt("by") + repr(by) + f": no sample of {shown} holds it as a number; none of theirs is shown"]


def _no_samples(run: str | os.PathLike[str], read: SampleSet) -> str:
    """What a run with no sample holds instead: records only (said); raises the error of a
    run whose samples files could not be read (said above), and ``reduce``'s error for a
    run with no metriclog file."""
    from metric_core.offline.read import scan_run

    where = str(read.report.run_dir) if read.report is not None else str(run)
    if read.report is not None and any(is_samples_file(f.path.name) for f in read.report.files):
        raise NoSamplesError(where, "none of its samples files could be read (see the warning above)")
    scan_run(run, defer_checks=True)  # raises reduce's error when the run holds no record either
    return f"{where} holds no sample (Reduce.SAMPLE), records only: `metriclog keys {where}` lists their keys"
