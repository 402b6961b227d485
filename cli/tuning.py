"""Settings of polars' streaming engine for the commands' queries, set before polars loads.

The commands stream a few columns of many small files into a group-by. For that, polars'
streaming engine holds far less memory with one file in flight, smaller morsels and a
larger table of groups, and jemalloc with one arena; as fast, measured with
benchmarks/bench_reduce.py. The engine reads Parquet with pyarrow, whose default
allocator (mimalloc) keeps what a file needed after it is done: pyarrow's jemalloc, where
the installed pyarrow has it, gives it back (30-120 MiB less than the system allocator at
the peak of another tool's 100M records, for 2-4% of the wall time of a 20M-record reduce;
benchmarks/bench_engine.py), else the system allocator; and glibc's malloc keeps one heap
for all threads. A value the user set is kept.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from pathlib import Path

ENGINE_SETTINGS = {
    "POLARS_NUM_READERS_PRE_INIT": "1",
    "POLARS_MAX_CONCURRENT_SCANS": "1",
    "POLARS_IDEAL_MORSEL_SIZE": "20000",
    "POLARS_HOT_TABLE_SIZE": "1048576",
}
JEMALLOC = "_RJEM_MALLOC_CONF"  # polars adds its own settings before these


def apply() -> None:
    """Set the engine's environment, unless polars is loaded already (then it is too late)."""
    if "polars" in sys.modules or "pyarrow" in sys.modules:
        return
    for name, value in ENGINE_SETTINGS.items():
        os.environ.setdefault(name, value)
    os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "jemalloc" if _arrow_has_jemalloc() else "system")
    conf = os.environ.get(JEMALLOC, "")
    if "narenas" not in conf:  # inherited from a parent that imported polars, or the user's
        os.environ[JEMALLOC] = f"{conf},narenas:1".lstrip(",")
    _one_malloc_arena()


def _arrow_has_jemalloc() -> bool:
    """Whether the installed pyarrow was built with jemalloc (its build configuration
    header says), found without importing it (naming a pool it lacks prints a warning)."""
    spec = importlib.util.find_spec("pyarrow")
    if spec is None or spec.origin is None:
        return False
    config = Path(spec.origin).parent / "include" / "arrow" / "util" / "config.h"
    try:
        return "#define ARROW_JEMALLOC\n" in config.read_text()
    except OSError:
        return False


M_ARENA_MAX = -8  # glibc's mallopt parameter


def _one_malloc_arena() -> None:
    """One heap for every thread of glibc's malloc (numpy's arrays, pyarrow's buffers), as
    MALLOC_ARENA_MAX=1 does, unless the user set that. By default each thread gets a heap
    of its own; the engine's partial states are made on a pool thread and freed on the
    main one, and each heap kept the other's holes: about 100 MiB more at the peak of a
    reduce of 100M records, for no speed (benchmarks/bench_engine.py)."""
    if sys.platform != "linux" or "MALLOC_ARENA_MAX" in os.environ:
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return
    mallopt(M_ARENA_MAX, 1)
