"""The local engine's pool (``engine.pool``): outputs in the items' order, whatever runs
ahead, and what runs ahead of the reader bounded in bytes."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from metric_core.offline.engine import pool
from metric_core.offline.engine.partials import Rows


def test_an_item_holding_nothing_hands_over_and_more_waits_for_the_budget():
    ahead = pool._Ahead(budget=100)
    assert ahead.hand(0, 500, timeout=0)  # its first, however large: the reader needs it
    assert ahead.hand(1, 500, timeout=0)  # another item's first too
    assert not ahead.hand(0, 1, timeout=0)  # a second one: 1,000 bytes are held already
    ahead.read(0, 500)
    ahead.read(1, 500)
    assert ahead.hand(0, 60, timeout=0) and ahead.hand(0, 40, timeout=0)  # within the budget
    assert not ahead.hand(0, 1, timeout=0)
    assert ahead.hand(2, 10_000, timeout=0)


def test_an_output_waiting_for_room_is_let_through_once_the_reader_reads():
    ahead = pool._Ahead(budget=10)
    assert ahead.hand(0, 10, timeout=0)
    through = threading.Event()

    def second() -> None:
        if ahead.hand(0, 10, timeout=60):
            through.set()

    waiting = threading.Thread(target=second)
    waiting.start()
    assert not through.is_set()  # no room until the read below
    ahead.read(0, 10)
    waiting.join(60)
    assert through.is_set()


def test_an_outputs_size_is_its_arrays_and_frames():
    import polars as pl

    rows = Rows(np.zeros(10, np.int64), np.zeros(10, np.int64), np.zeros(10), np.zeros(3, np.uint8))
    assert pool._size(rows) == 10 * 8 * 3 + 3
    assert pool._size(pl.DataFrame({"a": np.arange(100)})) == 800
    assert pool._size((rows, np.zeros(5))) == 243 + 40


@pytest.mark.parametrize("budget", [0, 1 << 10, 1 << 30])
def test_every_output_comes_in_the_items_order_whatever_runs_ahead(monkeypatch, budget):
    """Items of many outputs of 8 KiB, on the pool's threads: each item's outputs, in order,
    then its end, in the items' order; and at no moment more held than the budget allows
    beyond one output an item."""
    monkeypatch.setattr(pool, "AHEAD_BYTES", budget)
    held, most, lock = [0], [0], threading.Lock()

    def work(item: int):
        for k in range(20):
            out = np.full(1024, item * 100 + k, dtype=np.int64)
            with lock:  # counted before it is handed over: an upper bound of what is held
                held[0] += 1
                most[0] = max(most[0], held[0])
            yield out

    got = []
    for i, out in pool.on_threads(work, list(range(12)), [1] * 12, None):
        if out is not None:
            with lock:
                held[0] -= 1
            got.append((i, int(out[0])))
        else:
            got.append((i, None))
    want = [(i, v) for i in range(12) for v in [*(i * 100 + k for k in range(20)), None]]
    assert got == want
    in_flight = 2 * pool.pl.thread_pool_size()  # items started at once at most
    # one an item in flight, plus what fits the budget, plus one a thread about to be handed
    assert most[0] <= in_flight + budget // 8192 + pool.pl.thread_pool_size() + 1


def test_a_long_sequence_is_sized_from_its_first_items():
    """A row a combo (a partition's labels as Python values): not walked item by item."""
    import sys

    arrays = [np.zeros(10) for _ in range(1000)]
    assert pool._size(arrays) == sys.getsizeof(arrays) + 1000 * 80
    assert pool._size(arrays[:10]) == 800  # a short one, item by item
