# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Shared fixtures and mocks for observability unit tests."""

# torchforge's tests/unit_tests/observability/conftest.py at 6e77f0b, with module paths
# changed to metric_core's.

from unittest.mock import MagicMock, patch

import pytest
from metric_core.torchforge.metrics import MetricCollector


@pytest.fixture(autouse=True)
def clear_metric_collector_singletons():
    """Clear MetricCollector singletons before each test to avoid state leakage."""
    MetricCollector._instances.clear()
    yield
    MetricCollector._instances.clear()


@pytest.fixture(autouse=True)
def clean_metrics_environment():
    """Override the global mock_metrics_globally fixture to allow real metrics testing."""
    import os

    from metric_core.torchforge.env import FORGE_DISABLE_METRICS

    # Set default state for tests (metrics enabled)
    if FORGE_DISABLE_METRICS.name in os.environ:
        del os.environ[FORGE_DISABLE_METRICS.name]

    yield


@pytest.fixture
def mock_rank():
    """Mock current_rank function with configurable rank."""
    with patch("metric_core.torchforge.metrics.current_rank") as mock:
        rank_obj = MagicMock()
        rank_obj.rank = 0
        mock.return_value = rank_obj
        yield mock


@pytest.fixture
def mock_actor_context():
    """Mock Monarch actor context for testing actor name generation."""
    with (
        patch("metric_core.torchforge.metrics.context") as mock_context,
        patch("metric_core.torchforge.metrics.current_rank") as mock_rank,
    ):
        # Setup mock context
        ctx = MagicMock()
        actor_instance = MagicMock()
        actor_instance.actor_id = "_1rjutFUXQrEJ[0].TestActorConfigured[0]"
        ctx.actor_instance = actor_instance
        mock_context.return_value = ctx

        # Setup mock rank
        rank_obj = MagicMock()
        rank_obj.rank = 0
        mock_rank.return_value = rank_obj

        yield {
            "context": mock_context,
            "rank": mock_rank,
            "expected_name": "TestActor_0XQr_r0",
        }


# What follows is metric_core's, not torchforge's: what test_perf_tracker.py needs here.

import asyncio
import importlib.util
import selectors
import time
import types

PERF_TRACKER_TESTS = "test_perf_tracker.py"


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(file_path, parent):
    """test_perf_tracker.py imports torch: where torch is absent, the file is one skip
    in the summary (-ra), not a collection error (its doctest module's either)."""
    collectors = yield
    if file_path.name == PERF_TRACKER_TESTS and importlib.util.find_spec("torch") is None:
        return [_TorchAbsent.from_parent(parent, path=file_path)]
    return collectors


class _TorchAbsent(pytest.File):
    def collect(self):
        pytest.skip(
            f"{self.path.name}: torch is not installed (pip install torch==2.13.0; "
            "the dev extra installs it on CPython 3.11, x86_64)",
            allow_module_level=True,
        )


@pytest.fixture(autouse=True)
def perf_tracker_virtual_clock(request, monkeypatch):
    """test_perf_tracker.py's tests run on a virtual clock: time passes when, and only as
    much as, the test sleeps.

    Its workflows sleep 50-150 ms in asyncio tasks and assert each step's duration
    within 20%, and the two tasks' total under 0.5 s: on a loaded machine a sleep
    overshoots by more than that, which tests the scheduler, not the tracer. Here the
    event loops ``asyncio.run`` makes jump to their next timer instead of waiting for it,
    and the CPU timer, the test module's ``time.perf_counter`` and ``time.sleep`` read
    and advance the same clock, so each sleep is exactly its length: the asserts check
    that each one is timed into the right step and the totals add up (and a workflow
    that ran the two tasks one after the other would still take 0.8 s).

    CUDA-timed cases (``timer="gpu"``) keep real time: events are timed by the device.
    """
    from metric_core.torchforge.perf_tracker import _TimerCPU

    callspec = getattr(request.node, "callspec", None)
    if request.path.name != PERF_TRACKER_TESTS or (callspec and callspec.params.get("timer") == "gpu"):
        yield
        return
    clock = VirtualClock()
    monkeypatch.setattr(_TimerCPU, "_clock", staticmethod(clock))
    monkeypatch.setattr(request.module, "time", _VirtualTime(clock))
    previous = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(_VirtualTimePolicy(clock))
    try:
        yield clock
    finally:
        asyncio.set_event_loop_policy(previous)


class VirtualClock:
    """Seconds that pass only by ``sleep``."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += max(0.0, seconds)


class _VirtualTime(types.ModuleType):
    """The ``time`` module, with ``perf_counter``, ``monotonic`` and ``sleep`` on the clock."""

    def __init__(self, clock):
        super().__init__("time")
        self.perf_counter = self.monotonic = clock
        self.sleep = clock.sleep

    def __getattr__(self, name):
        return getattr(time, name)


class _SkipAheadSelector(selectors.DefaultSelector):
    """A loop's selector that, with nothing ready, moves the clock to the loop's next timer
    instead of waiting for it (and waits for real only when no timer is due: a thread's
    wake-up)."""

    def __init__(self, clock):
        super().__init__()
        self._clock = clock

    def select(self, timeout=None):
        ready = super().select(None if timeout is None else 0)
        if not ready and timeout is not None:
            self._clock.sleep(timeout)
        return ready


class _VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, clock):
        self._virtual_clock = clock
        super().__init__(selector=_SkipAheadSelector(clock))

    def time(self):
        return self._virtual_clock()


class _VirtualTimePolicy(asyncio.DefaultEventLoopPolicy):
    def __init__(self, clock):
        super().__init__()
        self._clock = clock

    def new_event_loop(self):
        return _VirtualTimeLoop(self._clock)
