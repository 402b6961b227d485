"""Read a run directory into one polars LazyFrame in the record schema, with a health report.

Every file docs/format.md describes is read (recursively: ``*.jsonl``, ``*.parquet`` and the
writer's ``*.journal`` tails; names starting with "." are not data). Bad input is
survived and reported, never silently dropped:

* a JSONL line that is not JSON, lacks a required field, or holds a value that is not
  a number is skipped and reported with its line number;
* a half-written last JSONL line (a crash mid-write) is skipped and reported as such;
* a Parquet file that cannot be read is skipped and named;
* a journal cut short by a kill is read up to its last complete frame, and one whose
  frame fails its checksum up to the frame before it (both said);
* a record whose timestamp is not finite or lies outside 1970-2286 (``TIMESTAMP_RANGE``:
  not Unix epoch seconds) is skipped and counted;
* a file that is compressed or binary under a ``.jsonl`` name, or a Parquet file whose
  columns have types no record can hold (a struct ``value``), is skipped and named;
* a directory that cannot be listed, a broken ``run.json`` and values out of bounds in
  it are reported, and the rest is read;
* a symlink is followed only inside the run directory (unless ``follow_symlinks``),
  and a file reached twice (links, loops) is read once; both are said.

The happy path is vectorized: JSONL goes through polars' NDJSON parser with every
field read as text and cast in bulk, Parquet is scanned lazily. Only a JSONL file that
polars cannot parse at all falls back to a line-by-line pass that finds the bad lines.

Modules: ``scan`` (``scan_run`` and ``RunScan``), ``discover`` (the listing, run.json,
each sealed segment's metadata), one reader per format (``jsonl``, ``parquet``,
``journal``), ``validate`` (records typed and checked, bad ones counted by reason),
``attempts`` (a restarted source, read as W&B's rewind), ``failures`` (a read's errors
said) and ``report`` (the health report).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from metric_core.offline.read.failures import all_skipped, explain_read_errors
    from metric_core.offline.read.report import FileReport, ReadReport, Shutdown
    from metric_core.offline.read.scan import (
        OnProgress,
        OnRead,
        RunScan,
        fetch_numpy_api,
        read_sealed,
        scan_run,
    )

# Each name is loaded from its module when first asked for: importing the package (as
# ``read.report`` does, which the samples and upload code need) loads no polars, so the
# upload command can still fork its reading child before polars' thread pool exists.
_HOMES = {
    "all_skipped": "failures",
    "explain_read_errors": "failures",
    "FileReport": "report",
    "ReadReport": "report",
    "Shutdown": "report",
    "OnProgress": "scan",
    "OnRead": "scan",
    "RunScan": "scan",
    "fetch_numpy_api": "scan",
    "read_sealed": "scan",
    "scan_run": "scan",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)


__all__ = [
    "FileReport",
    "OnProgress",
    "OnRead",
    "ReadReport",
    "RunScan",
    "Shutdown",
    "all_skipped",
    "explain_read_errors",
    "fetch_numpy_api",
    "read_sealed",
    "scan_run",
]
