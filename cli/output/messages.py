"""Messages on stderr (``warning: ...``, ``Error: ...``) and report lines on stdout, wrapped at
the terminal's width."""

from __future__ import annotations

import os
import sys
import unicodedata
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import typer

from ..options import as_flag

if TYPE_CHECKING:
    from metric_core.offline.read import ReadReport

# The display watch redraws in place on a terminal, while it runs: lines are printed above
# it through its console (written to the terminal beside it, they leave stale copies).
_live: Any = None


def above(live: Any) -> None:
    """Messages go through ``live``'s console from now on, above what it draws (None: to stderr)."""
    global _live
    _live = live


def say(kind: str, text: str) -> None:
    """A message on stderr: ``warning: ...``, ``note: ...``, ``Error: ...``, or plain
    information; wrapped at the terminal's width (``wrapped``)."""
    if _live is not None:  # rich wraps it at the width of the terminal it draws on
        from rich.text import Text

        _live.console.print(Text(message_line(kind, text)))
        return
    typer.echo(wrapped(message_line(kind, text), message_width(sys.stderr)), err=True)


def error(text: str) -> None:
    """A command's one ``Error: ...`` message, on stderr; a list of skips the warning above
    said already (``said_skips``) is not said again in it."""
    for summary in _said:
        text = text.replace(f"\n{summary}", " (see the warning above)")
    say("Error", text)


_said: list[str] = []  # the skips said as warnings by this command, each its summary


def new_command() -> None:
    """A command starts: nothing said yet (the test runner runs many in one process)."""
    _said.clear()


def message_line(kind: str, text: str) -> str:
    return text if kind == "info" else f"{kind}: {text}"


def message_width(stream: Any) -> int | None:
    """The width the messages written to ``stream`` are wrapped at: ``COLUMNS`` when set (as
    rich and the tables take it), else the width of the terminal ``stream`` is; None (not
    wrapped) into a pipe or a file, where a message stays on one line for grep and logs."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    try:
        return os.get_terminal_size(stream.fileno()).columns if stream.isatty() else None
    except (AttributeError, OSError, ValueError):  # a stream with no descriptor (a test's)
        return None


# The narrowest width a message is wrapped at: on a terminal narrower than this, a word a
# line would be no easier to read than lines that run over.
MIN_WRAP = 40


def wrapped(text: str, width: int | None) -> str:
    """``text`` with each line longer than ``width`` broken at spaces, its continuation lines
    indented four more than it (messages indent their own parts by two: a continuation is
    not taken for one); a word longer than a line (a path, a URL) is never broken.

    >>> print(wrapped("warning: a message that runs past the width of the terminal", 40))
    warning: a message that runs past the
        width of the terminal
    """
    if width is None:
        return text
    import textwrap

    width = max(width, MIN_WRAP)
    out: list[str] = []
    for line in text.split("\n"):
        if display_width(line) <= width:
            out.append(line)
            continue
        body = line.lstrip(" ")
        indent = line[: len(line) - len(body)]
        out += textwrap.wrap(
            body,
            width,
            initial_indent=indent,
            subsequent_indent=indent + "    ",
            break_long_words=False,
            break_on_hyphens=False,
        ) or [line]
    return "\n".join(out)


def show_wrapped(show: Callable[..., None], file: Any = None) -> None:
    """What a usage error's ``show`` prints (usage, hint, ``Error: ...``), its lines wrapped."""
    import io

    said = io.StringIO()
    show(file=said)
    out = file or sys.stderr
    typer.echo(wrapped(said.getvalue().rstrip("\n"), message_width(out)), file=out)


def echo_prose(text: str) -> None:
    """A line of a report on stdout (inspect's story, a table's notes), wrapped as messages are."""
    typer.echo(wrapped(text, message_width(sys.stdout)))


def said_skips(report: ReadReport) -> None:
    """What the reader skipped, if anything (the ``on_read`` of the library's calls)."""
    summary = report.summary(spelling=as_flag)
    if summary:
        say("warning", summary)
        _said.append(summary)


def display_width(text: str) -> int:
    """The widest line as a terminal shows it (East Asian wide characters take two cells)."""
    return max(
        (
            sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in line)
            for line in text.splitlines()
        ),
        default=0,
    )


def gist(said: object) -> str:
    """The first line of what an error says (a client library's may run on for pages)."""
    return (str(said).strip().splitlines() or [type(said).__name__])[0]


def os_error_text(exc: BaseException | None) -> str:
    """An ``OSError`` as one line: the file it names, and what went wrong."""
    where = f"{exc.filename}: " if isinstance(exc, OSError) and exc.filename else ""
    return where + gist(exc.strerror if isinstance(exc, OSError) and exc.strerror else exc)
