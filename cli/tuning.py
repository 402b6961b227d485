"""Settings of polars' streaming engine for the commands' queries, set before polars loads.

The commands stream a few columns of many small files into a group-by. For that, polars'
streaming engine holds far less memory with one file in flight, smaller morsels and a
larger table of groups, and jemalloc with one arena; as fast, measured with
benchmarks/bench_reduce.py. The engine reads Parquet with pyarrow, whose default
allocator keeps what a file needed after it is done: the system allocator gives it
back before the next file (about 100 MiB less per file in flight). A value the user set
is kept.
"""

from __future__ import annotations

import os
import sys

ENGINE_SETTINGS = {
    "POLARS_NUM_READERS_PRE_INIT": "1",
    "POLARS_MAX_CONCURRENT_SCANS": "1",
    "POLARS_IDEAL_MORSEL_SIZE": "20000",
    "POLARS_HOT_TABLE_SIZE": "1048576",
    "ARROW_DEFAULT_MEMORY_POOL": "system",
}
JEMALLOC = "_RJEM_MALLOC_CONF"  # polars adds its own settings before these


def apply() -> None:
    """Set the engine's environment, unless polars is loaded already (then it is too late)."""
    if "polars" in sys.modules or "pyarrow" in sys.modules:
        return
    for name, value in ENGINE_SETTINGS.items():
        os.environ.setdefault(name, value)
    conf = os.environ.get(JEMALLOC, "")
    if "narenas" not in conf:  # inherited from a parent that imported polars, or the user's
        os.environ[JEMALLOC] = f"{conf},narenas:1".lstrip(",")
