"""The local engine's pool of threads: tasks computed in parallel, their outputs handed over
in the tasks' order with bounded memory (``ray_pool`` does the same on a Ray cluster)."""

from __future__ import annotations

import atexit
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator
from itertools import islice
from typing import Any, TypeVar

import polars as pl

from metric_core.offline.read import OnProgress

# Partitions a task may have reduced and not yet handed over: what lets the next task
# work while this one's are folded, and what bounds the memory that takes.
HANDED_AHEAD = 1
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
    item is done. At most IN_FLIGHT_PER_THREAD items a thread are in flight, and none runs
    more than HANDED_AHEAD outputs ahead of the reader, so memory stays bounded."""
    threads = max(1, min(len(items), pl.thread_pool_size()))
    stop = threading.Event()
    handed: list[queue.SimpleQueue[tuple[str, Any]]] = [queue.SimpleQueue() for _ in items]
    room = [threading.Semaphore(HANDED_AHEAD) for _ in items]  # outputs item i may hand over

    def run(i: int) -> None:
        def put(kind: str, what: Any) -> None:
            while kind == "out" and not room[i].acquire(timeout=0.05):
                if stop.is_set():
                    raise _Stopped
            handed[i].put((kind, what))  # the end of an item never waits: its thread moves on

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
                room[i].release()
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


def _serve(todo: queue.SimpleQueue[int | None], run: Callable[[int], None]) -> None:
    """A pool thread: ``run`` each item index handed to it, until None."""
    while (i := todo.get()) is not None:
        run(i)
