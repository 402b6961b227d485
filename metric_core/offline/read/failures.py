"""What a failed read says: a run whose every record was skipped, and a polars or pyarrow
error of a read turned into ``RunChangedError`` (or ``StorageError``)."""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import polars as pl
from polars.exceptions import PanicException

from metric_core.errors import NoDataError, RunChangedError, StorageError
from metric_core.format.sample import DIRECTORY, is_samples_file
from metric_core.offline.read.attempts import Attempt
from metric_core.offline.read.report import ReadReport
from metric_core.offline.storage import RunPath, explain_store_failure, is_remote, is_store_failure

T = TypeVar("T")


def all_skipped(report: ReadReport) -> NoDataError:
    """The error of a run without a record to read: with what the reader skipped (a run
    whose files are checked as they are read finds it out once they all were); or, where
    nothing was skipped, what the run holds instead: samples, or attempts that recorded no
    metric (an ``init()`` then a crash), each told as it ended."""
    extra = report.summary()
    if not extra and _has_samples(report.run_dir):
        return NoDataError(
            str(report.run_dir),
            f"it holds samples (Reduce.SAMPLE) only, no record: `metriclog samples {report.run_dir}` "
            "lists them",
        )
    if not extra and report.attempts:
        why = _recorded_nothing(report)  # tells each attempt's end
        ends = {"running" if a.end == "running" else a.ended_well for a in report.attempts}
        over = None if "running" in ends else ("finished" if ends == {True} else "died")
        return NoDataError(str(report.run_dir), why, over=over)
    return NoDataError(str(report.run_dir), "every record was skipped" + (f"\n{extra}" if extra else ""))


def _recorded_nothing(report: ReadReport) -> str:
    """The attempts of a run that holds no record, as inspect's story tells their ends:
    "its attempt ended before recording any metric: Trainer_r0 (rank 0) raised ..."."""
    import time

    from metric_core.offline.inspect import story
    from metric_core.offline.storage import newest_listed

    now = time.time() if isinstance(report.run_dir, Path) else newest_listed(report.run_dir)
    story.tell(report, report.run_dir, now)
    attempts = sorted(report.attempts, key=lambda a: (a.ended_at or math.inf, a.process, a.rank))
    several = len({a.number for a in attempts}) > 1

    def told(a: Attempt) -> str:
        who = f"{a.process} (rank {a.rank})" + (f" attempt {a.number}" if several else "")
        if a.failed:
            return f"{who} {story.ended_how(a)}"
        if a.ended_well:
            return f"{who} shut down cleanly"
        return f"{who} {'is still running' if a.end == 'running' else 'recorded no end'}"

    running = sum(a.end == "running" for a in attempts)
    its = "its attempt" if len(attempts) == 1 else f"its {len(attempts)} attempts"
    if not running:
        how = "ended before recording any metric"
    elif running == len(attempts):
        how = f"{'has' if len(attempts) == 1 else 'have'} recorded no metric yet"
    else:
        how = "recorded no metric"
    return f"{its} {how}: " + "; ".join(told(a) for a in attempts)


def _has_samples(run_dir: RunPath) -> bool:
    folder = run_dir / DIRECTORY
    return (
        not is_remote(folder) and folder.is_dir() and any(is_samples_file(p.name) for p in folder.iterdir())
    )


def is_read_failure(exc: BaseException) -> bool:
    """An error of polars or pyarrow reading a file (pyarrow's told by its module, so it
    is not imported for this; a polars panic too), or of the file system."""
    return isinstance(exc, (pl.exceptions.PolarsError, OSError, PanicException)) or type(
        exc
    ).__module__.startswith("pyarrow")


def explain_read_errors(function: Callable[..., T]) -> Callable[..., T]:
    """Turn a polars or pyarrow error of a read of a scanned run into ``RunChangedError``,
    and the failure of a store the read was from into ``StorageError``.

    The reader checks every file before a query runs, so a query fails only on a file that
    changed (or vanished) since: a live run being sealed, or a copy in progress.
    """

    def explained(exc: BaseException) -> BaseException:
        if is_store_failure(exc):  # polars' or pyarrow's cloud reader, mid-query
            return StorageError(f"reading from object storage failed: {explain_store_failure(exc)}")
        if isinstance(exc, OSError):
            return exc  # a local file's error, as it is
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return RunChangedError(
            f"reading the run failed: {first}. Did a file change during the read? Run again."
        )

    if inspect.isgeneratorfunction(function):  # a stream fails as it is read

        @functools.wraps(function)
        def stream(*args: Any, **kwargs: Any) -> Any:
            try:
                return (yield from function(*args, **kwargs))
            except (Exception, PanicException) as exc:
                if not is_read_failure(exc):
                    raise
                raise explained(exc) from None

        return stream  # type: ignore[return-value]

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return function(*args, **kwargs)
        except (Exception, PanicException) as exc:
            if not is_read_failure(exc):
                raise
            raise explained(exc) from None

    return wrapper
