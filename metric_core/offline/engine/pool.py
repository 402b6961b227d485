"""The local engine's pool of threads: tasks computed in parallel, their outputs handed over
in the tasks' order with bounded memory (``ray_pool`` does the same on a Ray cluster)."""

from __future__ import annotations

import atexit
import collections
import dataclasses
import queue
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator
from itertools import islice
from typing import Any, TypeVar

import numpy as np
import polars as pl

from metric_core.offline.read import OnProgress

# Bytes of outputs (a partition's states or records) the tasks may have handed over and the
# reader not yet read, beyond one output a task: what lets the next tasks read on while this
# one's are folded (a task held to one output waited most of the time: --by time took 15%
# longer on two cores), and what bounds the memory that takes.
AHEAD_BYTES = 32 << 20
# Tasks in flight (started and not yet read to the end) per pool thread: a thread that is
# done with its task starts a later one while an earlier task is still being read.
IN_FLIGHT_PER_THREAD = 2


T = TypeVar("T")
R = TypeVar("R")


class _Stopped(Exception):
    """The reader of ``on_threads`` went away: a task's thread stops."""


def on_threads(
    work: Callable[[T], Iterator[R]], items: list[T], sizes: list[int], on_progress: OnProgress | None
) -> Generator[tuple[int, R | None], None, None]:
    """``work(item)``'s outputs for every item, computed on a pool of threads and yielded
    in the items' order as (the item's index, an output), then (the index, None) once the
    item is done. At most IN_FLIGHT_PER_THREAD items a thread are in flight, and the outputs
    handed over ahead of the reader are one an item, and more within AHEAD_BYTES
    (``_Ahead``), so memory stays bounded."""
    threads = max(1, min(len(items), pl.thread_pool_size()))
    stop = threading.Event()
    handed: list[queue.SimpleQueue[tuple[str, Any, int]]] = [queue.SimpleQueue() for _ in items]
    ahead = _Ahead(AHEAD_BYTES)

    def run(i: int) -> None:
        def put(kind: str, what: Any) -> None:
            size = _size(what) if kind == "out" else 0
            while kind == "out" and not ahead.hand(i, size, timeout=0.05):
                if stop.is_set():
                    raise _Stopped
            handed[i].put((kind, what, size))  # the end of an item never waits: its thread moves on

        if stop.is_set():  # queued before the reader went away
            return
        try:
            for out in work(items[i]):
                put("out", out)
            put("done", None)
        except _Stopped:
            return
        except BaseException as exc:  # handed to the reader, raised there
            put("error", exc)

    # Daemon threads: a stream left half read (kept alive by a traceback, say) never stops
    # the interpreter from exiting; at exit they are stopped and waited for (``_stop_pools``).
    todo: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    pool = [threading.Thread(target=_serve, args=(todo, run), daemon=True) for _ in range(threads)]
    with _pools_lock:  # another thread's pool is known before its threads run
        _live_pools[:] = [live for live in _live_pools if any(t.is_alive() for t in live[2])]
        _live_pools.append((stop, todo, pool))
        for thread in pool:
            thread.start()
    done_bytes, total = 0, sum(sizes)
    upcoming = iter(range(len(items)))
    try:
        for j in islice(upcoming, threads * IN_FLIGHT_PER_THREAD):
            todo.put(j)
        for i in range(len(items)):
            while (got := handed[i].get())[0] == "out":
                ahead.read(i, got[2])
                yield i, got[1]
            if got[0] == "error":
                raise got[1]
            for j in islice(upcoming, 1):
                todo.put(j)
            done_bytes += sizes[i]
            if on_progress is not None:
                on_progress(i + 1, len(items), done_bytes, total)
            yield i, None
    finally:
        # Its threads end once their reads return: until then the pool stays in
        # ``_live_pools``, for the exit to wait for them (a Ctrl-C lands here at once).
        stop.set()
        for _ in pool:
            todo.put(None)


# The pools whose threads may not have ended yet (dropped once they all have). At exit,
# before the interpreter tears down, each is stopped and its threads waited for (a
# moment): a thread left inside pyarrow's C++ while the process exits makes it abort
# ("terminate called without an active exception") instead of exiting with its status.
_live_pools: list[tuple[threading.Event, queue.SimpleQueue[int | None], list[threading.Thread]]] = []
_pools_lock = threading.Lock()


@atexit.register
def _stop_pools() -> None:
    for stop, todo, pool in list(_live_pools):
        stop.set()
        for _ in pool:
            todo.put(None)
    deadline = time.monotonic() + 10.0
    for _, _, pool in list(_live_pools):
        for thread in pool:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


class _Ahead:
    """What a pool's items have handed over and its reader not yet read: an item may always
    hand over an output while it holds none there, and more while every output held stays
    within ``budget`` bytes (so the item being read, or the next one, never waits on the
    others' outputs: no deadlock)."""

    def __init__(self, budget: int) -> None:
        self.budget, self.bytes = budget, 0
        self.held: collections.Counter[int] = collections.Counter()
        self.changed = threading.Condition()

    def hand(self, item: int, size: int, timeout: float) -> bool:
        """Whether ``item`` may hand over an output of ``size`` bytes (counted as held if
        so), waiting up to ``timeout`` seconds for the room."""
        with self.changed:
            if not self.changed.wait_for(
                lambda: not self.held[item] or self.bytes + size <= self.budget, timeout
            ):
                return False
            self.held[item] += 1
            self.bytes += size
            return True

    def read(self, item: int, size: int) -> None:
        """An output of ``item`` read: its room is free."""
        with self.changed:
            self.held[item] -= 1
            self.bytes -= size
            self.changed.notify_all()


def _size(output: Any) -> int:
    """The bytes an output holds in its arrays and frames (a partition's ``Partial``, its
    ``Rows`` and exact sums; a frame); of anything else, its own."""
    if isinstance(output, np.ndarray):
        return int(output.nbytes)
    if isinstance(output, pl.DataFrame | pl.Series):
        return int(output.estimated_size())
    if isinstance(output, dict):
        return sum(_size(part) for part in output.values())
    if isinstance(output, tuple | list):
        if len(output) > 64:  # a row a combo, say: its first items' sizes as the rest's
            return sys.getsizeof(output) + len(output) * sum(map(_size, output[:8])) // 8
        return sum(_size(part) for part in output)
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        return sum(_size(getattr(output, f.name)) for f in dataclasses.fields(output))
    return sys.getsizeof(output)


def _serve(todo: queue.SimpleQueue[int | None], run: Callable[[int], None]) -> None:
    """A pool thread: ``run`` each item index handed to it, until None."""
    while (i := todo.get()) is not None:
        run(i)
