"""Everything the commands show, by what it is: ``messages`` (stderr, wrapped), ``tables``
(fit to the terminal), ``rows`` (a data command's rows to a file or stdout), ``progress``
(bars), ``reports`` (upload's and import's), ``sources`` (inspect, watch and their event
commands). This module only re-exports the names the commands use."""

from __future__ import annotations

from .messages import (
    echo_prose,
    error,
    gist,
    message_width,
    new_command,
    os_error_text,
    said_skips,
    say,
    show_wrapped,
    wrapped,
)
from .progress import read_progress
from .reports import RunsReport, print_import, print_upload, upload_events
from .rows import emit, write_frames, write_stdout
from .sources import EventCommands, WatchDisplay, print_inspect, sources_frame
from .tables import print_frames, print_rows, print_samples, print_table

__all__ = [
    "EventCommands",
    "RunsReport",
    "WatchDisplay",
    "echo_prose",
    "emit",
    "error",
    "gist",
    "message_width",
    "new_command",
    "os_error_text",
    "print_frames",
    "print_import",
    "print_inspect",
    "print_rows",
    "print_samples",
    "print_table",
    "print_upload",
    "read_progress",
    "said_skips",
    "say",
    "show_wrapped",
    "sources_frame",
    "upload_events",
    "wrapped",
    "write_frames",
    "write_stdout",
]
