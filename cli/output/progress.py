"""Progress bars on stderr, on a terminal only: a read's bytes, an upload's rows."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

PROGRESS_AFTER_S = 2.0  # a command that reads for longer shows a bar


@contextmanager
def read_progress(what: str = "reading") -> Iterator[Callable[[int, int, int, int], None] | None]:
    """A progress callback for the engine (parts done, parts, bytes done, bytes): on a
    terminal, a bar on stderr from two seconds on (bytes read, rate, time left); nothing
    otherwise."""
    import time

    if not sys.stderr.isatty():
        yield None
        return
    started = time.monotonic()
    bar: list[Any] = []

    def update(done: int, parts: int, done_bytes: int, total_bytes: int) -> None:
        if not bar:
            if time.monotonic() - started < PROGRESS_AFTER_S or done == parts:
                return
            bar.append(_byte_progress())
            bar[0].start()
            bar.append(bar[0].add_task(what, total=total_bytes))
        bar[0].update(bar[1], completed=done_bytes, description=f"{what} {done}/{parts} parts")
        if done == parts:  # the last call; also where a forked reader (upload's) stops its bar
            stop()

    def stop() -> None:
        if bar:
            bar[0].stop()
            bar.clear()

    try:
        yield update
    finally:
        stop()


def _byte_progress() -> Any:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    return Progress(*columns, console=Console(stderr=True), transient=True)


def rows_progress() -> Any:
    """A bar per run on stderr: rows sent, rows/s, time left."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    class RowRate(ProgressColumn):
        def render(self, task: Any) -> Text:
            return Text(f"{task.speed:,.0f} rows/s" if task.speed else "")

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        RowRate(),
        TimeRemainingColumn(),
    )
    return Progress(*columns, console=Console(stderr=True), transient=False)
