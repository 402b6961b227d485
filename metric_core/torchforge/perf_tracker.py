"""torchforge's ``forge.observability.perf_tracker``: time blocks of code, record the durations.

``Tracer(prefix)`` times the steps between ``start()`` and ``stop()`` and records them,
at ``stop()``, with ``record_metric`` (``metric_core.torchforge``'s, so they land in the
run directory beside every other value), under torchforge's names:

* ``{prefix}/{step}/duration_avg_s`` (``Reduce.MEAN``) and ``{prefix}/{step}/duration_max_s``
  (``Reduce.MAX``), for each ``step(step)``: the time since the previous step (or start);
* ``{prefix}/total_duration_avg_s`` and ``{prefix}/total_duration_max_s``: start to stop;
* with ``track_memory=True`` and CUDA, ``{prefix}/memory_delta_end_start_avg_gb`` (the
  allocated memory at stop less that at start) and ``{prefix}/memory_peak_max_gb`` (the
  peak in between), in GiB. A tracer that tracks memory inside another one in the same
  thread tracks none (the peak is the device's), and says so once per prefix.

``trace(prefix)`` is the same as a decorator (of a function or a coroutine function: one
total per call) or as a context manager (``with trace(prefix) as tracer:`` gives the
started ``Tracer``, stopped at the block's end, an exception too).

``timer="gpu"`` times with CUDA events, polled by a thread so ``step`` never waits for the
device; without CUDA it times with the CPU clock. ``METRIC_TIMER_USES_GPU`` overrides every
tracer's ``timer``; ``DISABLE_PERF_METRICS`` or ``FORGE_DISABLE_METRICS`` make tracers do
nothing (``metric_core.torchforge.env``).

torch is imported only when it is asked for (a ``"gpu"`` timer, ``track_memory=True``):
a CPU job without torch uses ``Tracer`` and ``trace`` as they are.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from types import ModuleType, TracebackType
from typing import Any, Protocol, TypeVar

from metric_core.torchforge.env import DISABLE_PERF_METRICS, FORGE_DISABLE_METRICS, METRIC_TIMER_USES_GPU
from metric_core.torchforge.metrics import Reduce, record_metric

__all__ = ["Tracer", "trace"]

logger = logging.getLogger(__name__)

TIMERS = ("cpu", "gpu")
GIB = 1024**3

F = TypeVar("F", bound=Callable[..., Any])


class Tracer:
    """Times the steps of a block, from ``start()`` to ``stop()``; records them at ``stop()``.

    Args:
        prefix: the start of every metric name: ``{prefix}/{step}/duration_avg_s``, ...
        track_memory: record the CUDA memory allocated from start to stop, and its peak.
        timer: ``"cpu"`` (``time.perf_counter``) or ``"gpu"`` (CUDA events, where CUDA is
            available, else the CPU clock).

    A tracer can be started again after ``stop()``; ``step`` or ``stop`` before ``start``,
    or ``start`` twice, raise ``ValueError``.

    >>> from unittest.mock import patch
    >>> with patch("metric_core.torchforge.perf_tracker.record_metric") as record:
    ...     tracer = Tracer("rollout")
    ...     tracer.start()
    ...     tracer.step("generate")
    ...     tracer.stop()
    >>> [c.args[0] for c in record.call_args_list]  # doctest: +NORMALIZE_WHITESPACE
    ['rollout/total_duration_avg_s', 'rollout/total_duration_max_s',
     'rollout/generate/duration_avg_s', 'rollout/generate/duration_max_s']
    """

    def __init__(self, prefix: str, track_memory: bool = False, timer: str = "cpu") -> None:
        _check_timer(timer)
        self.prefix = prefix
        self.track_memory = track_memory
        self.time_with_gpu = timer == "gpu"
        # read once, as torchforge does: a tracer made while disabled stays disabled
        self._disable = bool(DISABLE_PERF_METRICS.get_value() or FORGE_DISABLE_METRICS.get_value())
        self._timer: _Timer | None = None  # None while stopped
        self._memory_started = False
        self._start_mem = 0.0
        self._torch: Any = None  # torch, once memory tracking imported it

    def start(self) -> None:
        """Starts timing (and memory tracking): the first step is timed from here."""
        if self._disable:
            return
        if self._timer is not None:
            raise ValueError(f"Tracer {self.prefix!r} has already been started: call stop() before start()")
        self._timer = _TimerCUDA() if self._gpu_timing() else _TimerCPU()
        self._timer.start()
        if self.track_memory:
            self._start_memory_tracking()

    def step(self, step_name: str) -> None:
        """Ends the step ``step_name``: the time since the previous step, or since start."""
        if self._disable:
            return
        if self._timer is None:
            raise ValueError(f"Tracer {self.prefix!r} must be started before calling step")
        self._timer.step(step_name)

    def stop(self) -> None:
        """Records every step's duration, the total and the memory; the tracer can start again."""
        if self._disable:
            return
        if self._timer is None:
            raise ValueError(f"Tracer {self.prefix!r} must be started before calling stop")
        timer, self._timer = self._timer, None
        try:
            durations_ms, last_ms = timer.get_all_durations()
            self._record_timing(durations_ms, last_ms)
        finally:
            if self._memory_started:
                self._stop_memory_tracking()

    def _gpu_timing(self) -> bool:
        forced = METRIC_TIMER_USES_GPU.get_value()
        wanted = self.time_with_gpu if forced is None else _is_true(forced)
        if not wanted:
            return False
        if _cuda() is None:
            _warn_once("Tracer: CUDA is not available; GPU timing falls back to the CPU clock")
            return False
        return True

    def _record_timing(self, durations_ms: list[tuple[str, float]], last_ms: float) -> None:
        total_s = (sum(ms for _, ms in durations_ms) + last_ms) / 1000.0
        record_metric(f"{self.prefix}/total_duration_avg_s", total_s, Reduce.MEAN)
        record_metric(f"{self.prefix}/total_duration_max_s", total_s, Reduce.MAX)
        for name, ms in durations_ms:
            record_metric(f"{self.prefix}/{name}/duration_avg_s", ms / 1000.0, Reduce.MEAN)
            record_metric(f"{self.prefix}/{name}/duration_max_s", ms / 1000.0, Reduce.MAX)

    def _start_memory_tracking(self) -> None:
        if getattr(_memory, "active", False):
            _warn_nested_memory_tracking(self.prefix)
            return
        torch = _cuda()
        if torch is None:
            _warn_once("Tracer: CUDA is not available; track_memory records no memory metrics")
            return
        _memory.active = True
        torch.cuda.reset_max_memory_allocated()
        self._start_mem = torch.cuda.memory_allocated()
        self._memory_started = True
        self._torch = torch

    def _stop_memory_tracking(self) -> None:
        torch = self._torch
        self._memory_started = False
        _memory.active = False
        delta_gb = (torch.cuda.memory_allocated() - self._start_mem) / GIB
        peak_gb = torch.cuda.max_memory_allocated() / GIB
        record_metric(f"{self.prefix}/memory_delta_end_start_avg_gb", delta_gb, Reduce.MEAN)
        record_metric(f"{self.prefix}/memory_peak_max_gb", peak_gb, Reduce.MAX)
        torch.cuda.reset_max_memory_allocated()


def trace(prefix: str, track_memory: bool = False, timer: str = "cpu") -> _Trace:
    """A ``Tracer`` as a decorator (one total per call, sync or async) or a context manager.

    ``timer`` is checked here, before anything is decorated or entered.

    >>> from unittest.mock import patch
    >>> with patch("metric_core.torchforge.perf_tracker.record_metric") as record:
    ...     with trace("train") as tracer:
    ...         tracer.step("forward")
    ...     @trace("eval")
    ...     def evaluate():
    ...         return "done"
    ...     evaluate()
    'done'
    >>> sorted({c.args[0].rsplit("_", 2)[0] for c in record.call_args_list})
    ['eval/total_duration', 'train/forward/duration', 'train/total_duration']
    """
    _check_timer(timer)
    return _Trace(prefix, track_memory, timer)


class _Trace:
    """What ``trace`` returns: a decorator, and a context manager giving its ``Tracer``."""

    def __init__(self, prefix: str, track_memory: bool, timer: str) -> None:
        self._settings = (prefix, track_memory, timer)
        self._entered: list[Tracer] = []  # a stack: the same object may be entered again inside

    def _tracer(self) -> Tracer:
        prefix, track_memory, timer = self._settings
        return Tracer(prefix, track_memory=track_memory, timer=timer)

    def __call__(self, func: F) -> F:
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def timed_coroutine(*args: Any, **kwargs: Any) -> Any:
                tracer = self._tracer()
                tracer.start()
                try:
                    return await func(*args, **kwargs)
                finally:
                    tracer.stop()

            return timed_coroutine  # type: ignore[return-value]

        @functools.wraps(func)
        def timed(*args: Any, **kwargs: Any) -> Any:
            tracer = self._tracer()
            tracer.start()
            try:
                return func(*args, **kwargs)
            finally:
                tracer.stop()

        return timed  # type: ignore[return-value]

    def __enter__(self) -> Tracer:
        tracer = self._tracer()
        tracer.start()
        self._entered.append(tracer)
        return tracer

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._entered.pop().stop()


class _Timer(Protocol):
    """A timing backend: durations in milliseconds, as torchforge's timers give them."""

    def start(self) -> None: ...

    def step(self, name: str) -> None: ...

    def get_all_durations(self) -> tuple[list[tuple[str, float]], float]:
        """Each step's ``(name, ms)`` and the ms from the last step (or start) to now."""
        ...


class _TimerCPU:
    """Times with the CPU's clock (``time.perf_counter``); reusable after each ``start()``."""

    # The clock it reads, a class attribute so a test can give it a clock of its own.
    _clock: Callable[[], float] = staticmethod(time.perf_counter)

    def __init__(self) -> None:
        self._durations: list[tuple[str, float]] = []
        self._last: float | None = None

    def start(self) -> None:
        self._durations = []
        self._last = self._clock()

    def step(self, name: str) -> None:
        if self._last is None:
            raise ValueError("the timer must be started before calling step")
        now = self._clock()
        self._durations.append((name, (now - self._last) * 1000.0))
        self._last = now

    def get_all_durations(self) -> tuple[list[tuple[str, float]], float]:
        last_ms = 0.0 if self._last is None else (self._clock() - self._last) * 1000.0
        return list(self._durations), last_ms


class _TimerCUDA:
    """Times with CUDA events on the current stream, without waiting for the device.

    Each ``step`` records an event; a pool thread waits for it to complete and measures
    it against the previous one. ``get_all_durations`` waits for every measurement, and
    gives them in the order of the steps. Raises ``RuntimeError`` without CUDA.
    """

    # Completed measurements are collected every this many steps, so a long chain of
    # steps holds no more pending futures than that.
    COLLECT_EVERY = 5

    def __init__(self, max_workers: int = 2) -> None:
        torch = _cuda()
        if torch is None:
            raise RuntimeError("CUDA is not available for timing")
        self._torch = torch
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="cuda-timer")
        self._pending: list[tuple[str, Future[float]]] = []
        self._durations: list[tuple[str, float]] = []
        self._last: Any = None  # the event the next step is measured from

    def start(self) -> None:
        self._pending = []
        self._durations = []
        self._last = self._record_event()

    def step(self, name: str) -> None:
        if self._last is None:
            raise ValueError("the timer must be started before calling step")
        end = self._record_event()
        self._pending.append((name, self._executor.submit(_elapsed_ms, self._last, end)))
        self._last = end
        if len(self._pending) >= self.COLLECT_EVERY:
            self._collect(wait=False)

    def get_all_durations(self) -> tuple[list[tuple[str, float]], float]:
        if self._last is None:
            return [], 0.0
        end = self._record_event()
        last = self._executor.submit(_elapsed_ms, self._last, end)
        self._collect(wait=True)
        return list(self._durations), last.result()

    def _record_event(self) -> Any:
        event = self._torch.cuda.Event(enable_timing=True)
        event.record(self._torch.cuda.current_stream())
        return event

    def _collect(self, *, wait: bool) -> None:
        """Moves measured steps, in their order, from pending to durations (up to the
        first one still being measured, unless ``wait``)."""
        while self._pending and (wait or self._pending[0][1].done()):
            name, future = self._pending.pop(0)
            self._durations.append((name, future.result()))

    def __del__(self) -> None:
        executor = getattr(self, "_executor", None)
        if executor is not None:
            executor.shutdown(wait=False)


def _elapsed_ms(start: Any, end: Any) -> float:
    """Waits (in a pool thread) until ``end`` completed on the device; ms from ``start``."""
    pause = 0.001
    while not end.query():
        time.sleep(pause)
        pause = min(pause * 1.5, 0.05)
    return float(start.elapsed_time(end))


# Memory tracking in this thread: a tracer started inside another one tracks none.
_memory = threading.local()


def _cuda() -> ModuleType | None:
    """torch, if it is installed and CUDA is available (importing it the first time)."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _check_timer(timer: str) -> None:
    if timer not in TIMERS:
        raise ValueError(f'timer must be "cpu" or "gpu", not {timer!r}')


def _is_true(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)


# Bounded, as torchforge's: prefixes made per call (f"step_{i}") do not grow it forever.
@functools.lru_cache(maxsize=1000)
def _warn_nested_memory_tracking(prefix: str) -> None:
    logger.warning(f"Nested memory tracking detected in {prefix}. Skipping inner tracking.")


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)
