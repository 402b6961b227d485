"""Every heartbeat says where the rank is (issue 43): W frames in the journal, read back.

The main thread here is the test's own: it waits in functions of this file while the writer
thread beats, and the journal it writes is decoded as a reader would.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from metric_core.format import journal
from metric_core.format.life import Life
from metric_core.writer import collector as collector_module
from metric_core.writer.collector import MetricCollector


def _in(place: str, function: str) -> bool:
    """``place`` is a line of this file, in ``function``."""
    file, _, rest = place.partition(":")
    return file.endswith("test_where.py") and rest.endswith(f" in {function}")


def _life(run: Path) -> Life:
    (path,) = run.glob("*.journal")
    return journal.decode(path.read_bytes()).life


def data_wait(run: Path, *, at_least: float, until) -> Life:
    """Stay here (the place under test) until the journal says ``until`` and ``at_least`` passed.

    Another thread reads the journal, so whenever the writer looks, the main thread is here
    (reading it here put the main thread in ``_life`` at some looks: on a loaded machine, at
    the one look that took every thread's place)."""
    said: list[Life] = []
    done = threading.Event()

    def read() -> None:
        start = time.monotonic()
        while time.monotonic() < start + 120:
            said[:] = [_life(run)]
            if until(said[0]) and time.monotonic() - start >= at_least:
                break
            time.sleep(0.02)
        else:
            said.clear()
        done.set()

    reader = threading.Thread(target=read, name="journal-reader")
    reader.start()
    done.wait()
    reader.join()
    if not said:
        raise AssertionError(f"the journal never said it: {_life(run).where}")
    return said[0]


def test_a_pause_is_kept_with_the_place_it_was_spent_in(tmp_path, monkeypatch):
    monkeypatch.setattr(collector_module, "STALL_MIN_S", 0.3)
    c = MetricCollector(tmp_path, rank=0, process_name="r0", flush_interval=0.05)
    try:
        c.record("loss", 1.0)
        c.flush(0)
        life = data_wait(
            tmp_path,
            at_least=1.2,
            until=lambda life: (
                life.where is not None and "threads" in life.where and "data_wait" in life.where["own"]
            ),
        )
        own = life.where["own"]
        assert _in(own, "data_wait"), own
        # Silent past the stall threshold: every other thread's place, the writer's own excluded.
        threads = life.where["threads"]
        assert _in(threads["MainThread"][0], "data_wait") and "metriclog-writer-r0" not in threads
        assert {t.name for t in threading.enumerate()} - set(threads) == {"metriclog-writer-r0"}
        c.record("loss", 2.0)
        c.flush(1)
        after = _life(tmp_path)
        (gap,) = after.gaps
        assert gap[0] == 1 and gap[2] >= 1.2
        spent = after.place_in(gap[1], gap[1] + gap[2])
        assert spent is not None and _in(spent[0], "data_wait"), spent
    finally:
        c.shutdown()
    (segment,) = tmp_path.glob("*.parquet")
    sealed = Life.parse(json.loads(pq.read_metadata(segment).metadata[b"metriclog"])["life"])
    assert sealed is not None and [w[1] for w in sealed.gap_where] == [spent[0]]


def long_wait(run: Path) -> None:
    """Most of the pause is spent here: many heartbeats (the journal read here, not in a
    helper, so that every look finds this function)."""
    (path,) = run.glob("*.journal")
    start = time.monotonic()
    while time.monotonic() < start + 120:
        where = journal.decode(path.read_bytes()).life.where
        if time.monotonic() - start >= 3.0 and where is not None and _in(where["own"], "long_wait"):
            return
        time.sleep(0.02)
    raise AssertionError("the journal never said long_wait")


def short_end(run: Path) -> Life:
    """The pause's last moments, still going on: a few heartbeats, the newest."""
    (path,) = run.glob("*.journal")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        life = journal.decode(path.read_bytes()).life
        if life.where is not None and _in(life.where["own"], "short_end"):
            return life
        time.sleep(0.02)
    raise AssertionError("the journal never said short_end")


def test_a_pause_still_going_on_is_where_it_was_spent_most_as_a_sealed_gap_is(tmp_path):
    from metric_core.offline.inspect import inspect_run

    c = MetricCollector(tmp_path, rank=0, process_name="r0", flush_interval=0.05)
    try:
        c.record("loss", 1.0)
        c.flush(0)
        long_wait(tmp_path)
        life = short_end(tmp_path)
        assert _in(life.where["own"], "short_end")  # the newest heartbeat's place
        assert life.last_flush is not None
        spent = life.place_in(life.last_flush[1], time.time())
        assert spent is not None and _in(spent[0], "long_wait"), spent
        (pause,) = inspect_run(tmp_path, pause_after=1.0).pauses
        assert pause.ongoing
        (stuck,) = [s["where"] for s in pause.stuck_in]
        assert _in(stuck.split(",")[0], "long_wait"), pause.stuck_in
        c.record("loss", 2.0)
        c.flush(1)  # the pause ends: the gap kept says the same place
        (kept,) = _life(tmp_path).gap_where
        assert kept[1] == spent[0]
    finally:
        c.shutdown()


def test_a_rank_waiting_in_a_library_shows_its_own_line_and_the_wait(tmp_path):
    c = MetricCollector(tmp_path, rank=0, process_name="r0", flush_interval=0.05)
    never = threading.Event()
    try:
        c.record("loss", 1.0)
        c.flush(0)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            never.wait(0.05)  # the line the rank is at; the wait is the standard library's
            life = _life(tmp_path)
            if life.where is not None and life.where["inner"] != life.where["own"]:
                break
        assert life.where is not None
        assert _in(life.where["own"], "test_a_rank_waiting_in_a_library_shows_its_own_line_and_the_wait")
        assert life.where["inner"].startswith("threading.py:"), life.where
    finally:
        c.shutdown()


def test_an_unchanged_place_is_an_h_frame_and_a_new_journal_says_it_again(tmp_path):
    c = MetricCollector(tmp_path, rank=0, process_name="r0", flush_interval=0.02)
    try:
        c.record("loss", 1.0)
        c.flush(0)
        path = next(tmp_path.glob("*.journal"))

        def kinds() -> list[bytes]:
            data, pos, out = path.read_bytes(), 0, []
            pos = 4 + 8 + int.from_bytes(data[4:8], "little")
            while pos + 9 <= len(data):
                kind, length = data[pos : pos + 1], int.from_bytes(data[pos + 1 : pos + 5], "little")
                out.append(kind)
                pos += 9 + length
            return out

        deadline = time.monotonic() + 120
        while kinds().count(journal.HEARTBEAT) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        seen = kinds()
        assert seen.count(journal.HEARTBEAT) >= 5
        # One place, said once: the rest are 8-byte heartbeats.
        assert seen.count(journal.WHERE) == 1
    finally:
        c.shutdown()


def test_a_where_frame_that_is_not_one_ends_the_readable_part(tmp_path):
    body = journal.header("r0", 0, 1.0) + journal.heartbeat_frame(2.0)
    bad = journal._frame(journal.WHERE, json.dumps({"at": 3.0, "where": ["only one"]}).encode())
    decoded = journal.decode(body + bad + journal.heartbeat_frame(4.0))
    assert decoded.life.alive == 2.0
    assert any("where frame" in p for p in decoded.problems), decoded.problems


@pytest.mark.parametrize("version", [b"MLJ5", b"MLJ4"])
def test_older_journals_read_as_before(version):
    head = journal.header("r0", 0, 1.0)
    decoded = journal.decode(version + head[4:] + journal.heartbeat_frame(2.0))
    assert decoded.problems == [] and decoded.version == int(version[3:]) and decoded.life.alive == 2.0
    assert decoded.life.where is None


def test_the_odd_one_out_is_the_rank_the_others_wait_for():
    from metric_core.offline.inspect.health import odd_one_out

    wait = ("train.py:150 in <module>", "torch/distributed/distributed_c10d.py:2501 in all_reduce")
    data = ("train.py:119 in data_wait", "train.py:119 in data_wait")
    # Three wait in the collective, one is elsewhere: that one, whoever went silent first.
    assert odd_one_out({0: wait, 1: wait, 2: data, 3: wait}) == 2
    # Two ranks: no majority; the one not inside a known wait.
    assert odd_one_out({0: wait, 1: data}) == 1
    # All in one place: none stands apart.
    assert odd_one_out({0: wait, 1: wait, 2: wait}) is None
    # Alone in a wait while the others are all busy elsewhere: it waits for them, it is not it.
    busy = ("train.py:80 in forward", "train.py:80 in forward")
    assert odd_one_out({0: busy, 1: busy, 2: busy, 3: wait}) is None
    # Two apart from two, both busy: not known.
    assert odd_one_out({0: busy, 1: busy, 2: data, 3: data}) is None
    # A queue, a lock, a pipe are waits too.
    queue = ("train.py:60 in next_batch", "queue.py:180 in get")
    assert odd_one_out({0: queue, 1: data}) == 1
    assert odd_one_out({0: wait}) is None


def test_on_nonfinite_raise_stops_at_the_first_nan_of_a_watched_key_and_writes_it(tmp_path):
    """As maxtext's abort_on_nan_loss: the NaN is recorded, then NonFiniteError; other keys'
    NaNs, and every NaN without the option, are recorded as ever."""
    import math

    import numpy as np

    import metric_core
    from metric_core import NonFiniteError, Reduce

    metric_core.init(tmp_path / "off", process_name="r0")
    metric_core.record_metric("train/loss", math.nan, Reduce.MEAN)  # off by default: recorded
    metric_core.shutdown()

    run = tmp_path / "on"
    metric_core.init(
        run, process_name="r0", on_nonfinite="raise", nonfinite_keys=["train/loss", "*/grad_norm"]
    )
    try:
        metric_core.record_metric("train/loss", 0.5, Reduce.MEAN)
        metric_core.record_metric("eval/reward", math.inf, Reduce.MEAN)  # not watched
        metric_core.flush(0)
        metric_core.record_metric("train/loss", 0.25, Reduce.MEAN)
        with pytest.raises(NonFiniteError, match=r"metric 'train/loss' is nan at step 1") as caught:
            metric_core.record_metric("train/loss", np.float32("nan"), Reduce.MEAN)
        assert caught.value.key == "train/loss" and caught.value.step == 1
        with pytest.raises(NonFiniteError, match="'opt/grad_norm' is -inf"):
            metric_core.record_metric("opt/grad_norm", -math.inf, Reduce.MAX)
        metric_core.flush(1)
    finally:
        metric_core.shutdown()
    table = metric_core.scan_run(run).frame.collect().sort("step", "key", "value")
    got = [(r["step"], r["key"], r["value"]) for r in table.to_dicts()]
    assert got[:2] == [(0, "eval/reward", math.inf), (0, "train/loss", 0.5)]
    assert got[2][:2] == (1, "opt/grad_norm") and got[2][2] == -math.inf
    assert got[3] == (1, "train/loss", 0.25) and got[4][1] == "train/loss" and math.isnan(got[4][2])
    with pytest.raises(metric_core.MetricLogError, match="on_nonfinite must be one of record, raise"):
        metric_core.init(tmp_path / "bad", on_nonfinite="stop")


def test_a_stopped_process_is_running_without_a_heartbeat_not_dead(tmp_path):
    """SIGSTOP stands in for native code that holds the GIL: the writer thread cannot beat."""
    import os
    import signal
    import subprocess
    import sys

    from metric_core.offline.inspect import inspect_run
    from metric_core.offline.inspect.health import NO_HEARTBEAT, where_text

    run = tmp_path / "run"
    code = (
        "import sys, time, metric_core\n"
        "metric_core.init(sys.argv[1], process_name='r0', flush_interval=0.05)\n"
        "for s in range(3):\n    metric_core.record_metric('loss', 1.0); metric_core.flush(s)\n"
        "print('ready', flush=True)\ntime.sleep(600)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            (source,) = inspect_run(run).sources
            if source.no_heartbeat:
                break
            time.sleep(0.2)
        assert source.end == "running" and source.no_heartbeat, source
        assert where_text(source) == NO_HEARTBEAT
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=60)
        (source,) = inspect_run(run).sources
        assert source.end == "died" and not source.no_heartbeat
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_rank_that_steps_faster_than_its_flush_interval_is_not_looked_at(tmp_path):
    """A look at the main thread takes the GIL from it: a wake that saw a flush since the
    previous one writes nothing (the flushes say the rank lives); the place comes once the
    rank stops stepping."""
    c = MetricCollector(tmp_path, rank=0, process_name="r0", flush_interval=0.02)
    try:
        path = None
        step, start = 0, time.monotonic()
        while time.monotonic() - start < 0.5 or path is None:  # stepping, many wakes long
            c.record("loss", 1.0)
            c.flush(step)
            step += 1
            path = next(tmp_path.glob("*.journal"), None)
        data = path.read_bytes()
        kinds = _kinds(data)
        # its flush frames say it lives: no look, and no heartbeat that would say it is where it was
        assert kinds.count(journal.FLUSH) > 0 and kinds.count(journal.WHERE) == 0, kinds

        # the first look may come while this thread still reads the journal above (a loaded
        # machine: make test failed so once); the next looks find it waiting here
        def waiting(life: Life) -> bool:
            return life.where is not None and _in(life.where["own"], "data_wait")

        life = data_wait(tmp_path, at_least=0.0, until=waiting)
        assert _in(life.where["own"], "data_wait")
    finally:
        c.shutdown()


def _kinds(data: bytes) -> list[bytes]:
    """The frame types of a journal, in order."""
    pos, out = 4 + 8 + int.from_bytes(data[4:8], "little"), []
    while pos + 9 <= len(data):
        out.append(data[pos : pos + 1])
        pos += 9 + int.from_bytes(data[pos + 1 : pos + 5], "little")
    return out


def test_a_pid_reused_by_a_later_process_is_not_the_attempt_still_running():
    """A dead rank's pid taken by another process (containers reuse small pids) must not keep
    the attempt running: a process that started after the attempt is another one."""
    import os
    import socket

    from metric_core.format.life import pid_namespace, process_state

    here = Life(host=socket.gethostname(), pid=os.getpid(), pidns=pid_namespace())
    assert process_state(here, time.time()) is True  # this process started before "now"
    assert process_state(here, time.time() - 10 * 24 * 3600) is False  # an attempt from before it
