"""metric_core.torchforge.perf_tracker as a job meets it: a rank without torch times its
steps with torchforge's Tracer and trace, and the durations land in the run directory
under torchforge's names and reductions; memory tracking nested in another is skipped and
said once; CUDA timings come back in the order of the steps."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from metric_core import reduce_run
from metric_core.torchforge import Reduce, perf_tracker
from metric_core.torchforge.perf_tracker import Tracer, _TimerCUDA

REPO = Path(__file__).resolve().parents[1]
GIB = 1024**3

# A rank of a CPU job on a machine without torch: `import torch` fails in it.
JOB = """
import asyncio, sys, time
sys.modules["torch"] = None
from metric_core.torchforge import Tracer, trace

tracer = Tracer("rollout", track_memory=True, timer="gpu")  # no CUDA: the CPU clock, no memory
for _ in range(2):  # started again after stop
    tracer.start()
    time.sleep(0.02)
    tracer.step("generate")
    time.sleep(0.03)
    tracer.step("score")
    time.sleep(0.01)
    tracer.stop()

@trace("train")
def train_step():
    time.sleep(0.02)

@trace("ref", track_memory=True)
async def reference():
    await asyncio.sleep(0.02)

train_step()
asyncio.run(reference())
with trace("buffer") as t:
    time.sleep(0.01)
    t.step("sample")
assert sys.modules["torch"] is None
"""

# The least each value can be: what the job slept in it (the clock never runs slow).
SLEPT = {
    "rollout/generate": 0.02,
    "rollout/score": 0.03,
    "rollout/total": 0.06,
    "train/total": 0.02,
    "ref/total": 0.02,
    "buffer/sample": 0.01,
    "buffer/total": 0.01,
}


def test_a_rank_without_torch_times_its_steps_into_the_run_directory(tmp_path):
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("FORGE_DISABLE_METRICS", "DISABLE_PERF_METRICS")}
    env |= {"METRICLOG_DIR": str(run), "RANK": "0", "PYTHONPATH": str(REPO), "METRICLOG_PROCESS": "actor"}
    env.pop("METRIC_TIMER_USES_GPU", None)
    done = subprocess.run(
        [sys.executable, "-c", JOB], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    # what it could not do is said, once each
    assert done.stderr.count("GPU timing falls back to the CPU clock") == 1, done.stderr
    assert done.stderr.count("records no memory metrics") == 1, done.stderr

    raw = reduce_run(run, mode="per_rank_no_reduce")
    names = {f"{where}/duration_{how}_s" for where in SLEPT for how in ("avg", "max")}
    names = {n.replace("/total/duration", "/total_duration") for n in names}
    assert set(raw["key"]) == names
    for key, value in zip(raw["key"], raw["value"], strict=True):
        where = key.rsplit("/", 1)[0] if "/total_" not in key else key.split("/")[0] + "/total"
        assert value >= SLEPT[where], (key, value)
    counts = raw.group_by("key").len()
    assert dict(zip(counts["key"], counts["len"], strict=True)) == {
        n: 2 if n.startswith("rollout/") else 1 for n in names
    }
    # a session's total is its steps and the time after the last one
    rollout = {k: raw.filter(raw["key"] == k)["value"].to_list() for k in names if k.startswith("rollout/")}
    for i in range(2):
        steps = rollout["rollout/generate/duration_avg_s"][i] + rollout["rollout/score/duration_avg_s"][i]
        assert rollout["rollout/total_duration_avg_s"][i] >= steps + 0.01
        assert rollout["rollout/total_duration_max_s"][i] == rollout["rollout/total_duration_avg_s"][i]
    # torchforge's reductions: the _avg_ names a mean, the _max_ names a max
    reduced = reduce_run(run)
    for key, reduction in zip(reduced["key"], reduced["reduction"], strict=True):
        assert reduction == ("max" if "_max_" in key else "mean"), key


@pytest.fixture
def recorded(monkeypatch):
    calls: list[tuple[str, float, Reduce]] = []
    monkeypatch.setattr(perf_tracker, "record_metric", lambda *call: calls.append(call))
    return calls


def fake_cuda(allocated: list[int], peak: int) -> SimpleNamespace:
    """What only a GPU can say: the memory allocated (one value a call) and its peak."""
    readings = iter(allocated)
    resets: list[str] = []
    cuda = SimpleNamespace(
        is_available=lambda: True,
        memory_allocated=lambda: next(readings),
        max_memory_allocated=lambda: peak,
        reset_max_memory_allocated=lambda: resets.append("reset"),
        resets=resets,
    )
    return SimpleNamespace(cuda=cuda)


def test_memory_tracking_inside_another_is_skipped_and_said_once(recorded, monkeypatch, caplog):
    torch = fake_cuda([1 * GIB, 7 * GIB // 2, 2 * GIB, 2 * GIB], peak=4 * GIB)
    monkeypatch.setattr(perf_tracker, "_cuda", lambda: torch)
    inner = f"inner-{uuid.uuid4().hex}"  # warned once per prefix in a process
    outer = Tracer("outer", track_memory=True)
    with caplog.at_level(logging.WARNING):
        outer.start()
        for _ in range(3):
            with perf_tracker.trace(inner, track_memory=True) as tracer:
                tracer.step("work")
        outer.stop()
    said = [r.getMessage() for r in caplog.records if inner in r.getMessage()]
    assert said == [f"Nested memory tracking detected in {inner}. Skipping inner tracking."]
    memory = {(name, value, how) for name, value, how in recorded if "memory" in name}
    assert memory == {
        ("outer/memory_delta_end_start_avg_gb", 2.5, Reduce.MEAN),
        ("outer/memory_peak_max_gb", 4.0, Reduce.MAX),
    }
    assert len([n for n, _, _ in recorded if n.startswith(f"{inner}/work/")]) == 6  # its timing stays
    # the outer one ended: the next tracer tracks memory again, warned of nothing
    caplog.clear()
    with caplog.at_level(logging.WARNING), perf_tracker.trace("next", track_memory=True):
        pass
    assert ("next/memory_delta_end_start_avg_gb", 0.0, Reduce.MEAN) in recorded
    assert caplog.records == []
    assert torch.cuda.resets == ["reset"] * 4  # at each start and stop that tracked


class FakeEvent:
    """A CUDA event as the timer uses it: recorded at the test's time, complete once the
    device (the test's ``device_at``) has passed that time."""

    now = 0.0
    device_at = 0.0

    def __init__(self, enable_timing: bool) -> None:
        assert enable_timing
        self.at = float("inf")

    def record(self, stream: object) -> None:
        self.at = FakeEvent.now

    def query(self) -> bool:
        return self.at <= FakeEvent.device_at

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.at - self.at) * 1000.0


def test_cuda_timings_come_back_in_the_order_of_the_steps(monkeypatch):
    cuda = SimpleNamespace(is_available=lambda: True, Event=FakeEvent, current_stream=lambda: "stream")
    monkeypatch.setattr(perf_tracker, "_cuda", lambda: SimpleNamespace(cuda=cuda))
    timer = _TimerCUDA()
    for session in range(2):  # reusable after start()
        FakeEvent.now = FakeEvent.device_at = 0.0
        timer.start()
        for i in range(12):  # past the collection every 5 steps, the device behind the host
            FakeEvent.now += i + 1
            timer.step(f"s{i}")
            if i % 3 == 0:
                FakeEvent.device_at = FakeEvent.now - (i + 1)
        FakeEvent.now += 100
        FakeEvent.device_at = float("inf")
        durations, last_ms = timer.get_all_durations()
        assert durations == [(f"s{i}", (i + 1) * 1000.0) for i in range(12)], session
        assert last_ms == 100 * 1000.0
