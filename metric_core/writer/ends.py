"""How an attempt ends, recorded before the process is gone; and where a hung one is stuck.

``init()`` (with ``catch_signals``, the default) installs, once per process and for every
open collector:

* ``sys.excepthook`` and ``threading.excepthook``, chained to the hooks found (never
  swallowing): an uncaught exception of the main thread is an ``exception`` end event
  (a ``KeyboardInterrupt``: a ``signal`` end, SIGINT), one of another thread a
  ``thread_exception`` event, each with the exception's type, message and the innermost
  frame outside the standard library and site-packages (``describe``);
* ``faulthandler.register`` for SIGTERM, SIGINT and SIGHUP, each into a file of its own
  in ``stacks/`` (C code: it runs even while the main thread is blocked in native code,
  and from an ``init()`` outside the main thread), chained to the handler found, so the
  process then ends exactly as it would have; the file holds every thread's stack at
  that moment. A handler installed later with ``signal.signal`` replaces it;
* ``faulthandler.enable`` for fatal signals (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL),
  unless faulthandler is already enabled (pytest, ``-X faulthandler``,
  ``PYTHONFAULTHANDLER``): then such an end is not recorded and reads ``died``.

Each stack file starts with a line of metriclog's (what it is, and the main thread's id
as faulthandler prints it); a file that holds no more at the end of the attempt is removed.

A framework that catches its children's exceptions itself (multiprocessing,
``torch.multiprocessing.spawn``, Ray) never lets them reach the excepthook:
``record_exception(exc)`` or the ``@record`` decorator records them.

``HangWatch`` is the writer thread's: once no ``flush()`` returned for ``hang_dump_after``
seconds, it saves every thread's stack into ``stacks/`` (once per stall) and records a
``dump`` event.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import os
import signal
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from metric_core.atomic import create_exclusive
from metric_core.format.life import CAUGHT_SIGNALS, STACKS_DIR, stack_name

if TYPE_CHECKING:
    from metric_core.writer.collector import MetricCollector

FATAL = "fatal"
F = TypeVar("F", bound=Callable[..., Any])

_collectors: list[MetricCollector] = []  # the open collectors that catch ends, oldest first
_hooks: dict[str, Any] = {}  # the hooks found when metric_core installed its own
_lock = threading.Lock()


def describe(exc: BaseException) -> dict[str, str | None]:
    """An exception as an end event holds it: its type, message and where it was raised.

    >>> try:
    ...     raise ValueError("bad batch")
    ... except ValueError as e:
    ...     describe(e)["type"], describe(e)["message"]
    ('ValueError', 'bad batch')
    """
    try:
        message = str(exc)
    except Exception:  # an exception whose __str__ fails: its type still says what happened
        message = f"<{type(exc).__name__} whose message could not be read>"
    try:
        where = _where(exc.__traceback__)
    except Exception:
        where = None
    return {"type": type(exc).__name__, "message": message[:2000], "where": where}


def record_exception(exc: BaseException) -> None:
    """Record ``exc`` as how this process's attempt ends (for a framework that catches it):
    ``inspect`` and ``watch`` then tell its type, message and where it was raised. Returns
    nothing; does nothing before ``init``.

    >>> import metric_core, tempfile
    >>> _ = metric_core.init(tempfile.mkdtemp(), process_name="worker")
    >>> try:
    ...     1 / 0
    ... except ZeroDivisionError as e:
    ...     metric_core.record_exception(e)
    >>> metric_core.shutdown()
    """
    _record(end_of(exc))


def record(fn: F) -> F:
    """Decorate a process's entry point: an exception it raises is recorded, then raised on.

    As torchelastic's ``@record``: for a function a framework runs and whose exceptions it
    catches itself (``torch.multiprocessing.spawn``, ``multiprocessing``, Ray actors).
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (Exception, KeyboardInterrupt) as exc:
            record_exception(exc)
            raise

    return wrapper  # type: ignore[return-value]


def install(collector: MetricCollector) -> None:
    """Catch the ends of ``collector``'s attempt (see the module's docstring)."""
    with _lock:
        if not _hooks:
            _hooks["sys"] = sys.excepthook
            _hooks["threading"] = threading.excepthook
            sys.excepthook = _excepthook
            threading.excepthook = _thread_excepthook
            os.register_at_fork(after_in_child=_forgotten_in_child)
        _collectors.append(collector)
        collector._stack_files = _open_stack_files(collector)


def uninstall(collector: MetricCollector) -> None:
    """Stop catching ``collector``'s ends; remove its stack files that caught nothing."""
    with _lock:
        if collector not in _collectors:
            return
        _collectors.remove(collector)
        files = collector._stack_files
        collector._stack_files = {}
    for name, (f, path, handler_then) in files.items():
        if name in CAUGHT_SIGNALS:
            _unregister(getattr(signal, name), handler_then)
        elif name == FATAL:
            faulthandler.disable()
        _close_empty(f, path)
    _reregister_newest()


def _unregister(sig: int, handler_then: Any) -> None:
    """Give ``sig`` back as it was, but for a handler ``signal.signal()`` installed since
    (which replaced faulthandler's): that one stays. faulthandler's own unregister puts back
    the handler it found, so the later one is installed again after it."""
    current = signal.getsignal(sig)
    if current is handler_then or current is None:
        faulthandler.unregister(sig)
    elif threading.current_thread() is threading.main_thread():
        faulthandler.unregister(sig)
        signal.signal(sig, current)
    # else: outside the main thread the later handler cannot be installed again; faulthandler
    # keeps its (inactive) registration rather than take it away


def main_thread_line(what: str) -> str:
    """The first line of a stack file: what it is, and the main thread's id as faulthandler writes it."""
    ident = threading.main_thread().ident or 0
    return f"metriclog: {what}; main thread 0x{ident:016x}\n"


class HangWatch:
    """Saves every thread's stack once a flush is ``after`` seconds overdue, once per stall."""

    def __init__(self, collector: MetricCollector, after: float | None) -> None:
        self.collector = collector
        self.after = after
        self.dumped_for: float | None = None  # the flush (monotonic time) whose stall was dumped
        self.dumps = 0

    def check(self, last_flush: float) -> None:
        if self.after is None or self.dumped_for == last_flush:
            return
        overdue = time.monotonic() - last_flush
        if overdue < self.after:
            return
        self.dumped_for = last_flush
        self.dumps += 1
        c = self.collector
        writer = c._writer
        try:
            path = _stack_path(c, f"hang-{self.dumps}")
            with os.fdopen(create_exclusive(path), "w") as f:
                f.write(main_thread_line(f"no flush for {overdue:.1f} s, in step {c.step}"))
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError:
            return  # a full disk: the heartbeat goes on, and says the process is alive
        rel = f"{STACKS_DIR}/{path.name}"
        writer.end_event({"kind": "dump", "timestamp": time.time(), "step": c.step, "path": rel})


def _record(event: dict[str, Any]) -> None:
    event.setdefault("timestamp", time.time())
    for collector in list(_collectors):
        with contextlib.suppress(Exception):  # a dying process: what can be written is
            collector._writer.end_event(event)


def end_of(exc: BaseException) -> dict[str, Any]:
    """The end event an exception makes: a ``KeyboardInterrupt`` is SIGINT."""
    if isinstance(exc, KeyboardInterrupt):
        return {"kind": "signal", "signal": "SIGINT"}
    return {"kind": "exception", "exception": describe(exc)}


def _excepthook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    try:
        _record(end_of(exc))
    finally:
        _hooks.get("sys", sys.__excepthook__)(kind, exc, tb)


def _thread_excepthook(args: Any) -> None:
    try:
        if args.exc_value is not None and not isinstance(args.exc_value, SystemExit):
            thread = args.thread.name if args.thread is not None else "?"
            _record({"kind": "thread_exception", "thread": thread, "exception": describe(args.exc_value)})
    finally:
        _hooks.get("threading", threading.__excepthook__)(args)


def _forgotten_in_child() -> None:
    """A forked child (a data-loader worker) is not the attempt: its signals and ends are its
    own (the collector itself is forgotten there too: ``collector._forget_in_child``)."""
    for collector in _collectors:
        for name, (f, _, handler_then) in collector._stack_files.items():
            if name in CAUGHT_SIGNALS:
                _unregister(getattr(signal, name), handler_then)
            elif name == FATAL:
                faulthandler.disable()
            with contextlib.suppress(OSError):
                f.close()
        collector._stack_files = {}
    _collectors.clear()


def _stack_path(collector: MetricCollector, what: str, *, armed: bool = False) -> Path:
    folder = collector.run_dir / STACKS_DIR
    if folder.is_symlink():  # never written through a link metriclog did not make
        raise OSError(f"{folder} is a symlink")
    folder.mkdir(exist_ok=True)
    return folder / stack_name(collector._writer.stem, collector._writer.attempt, what, armed=armed)


def _open_stack_files(collector: MetricCollector) -> dict[str, tuple[Any, Path, Any]]:
    """A file per caught signal (and one for fatal signals), registered with faulthandler:
    armed (hidden) until the signal comes; its first line says so, not that it came."""
    out: dict[str, tuple[Any, Path, Any]] = {}
    wanted = [s for s in CAUGHT_SIGNALS if hasattr(signal, s)]
    if not faulthandler.is_enabled() or any(FATAL in c._stack_files for c in _collectors[:-1]):
        wanted.append(FATAL)
    for name in wanted:
        try:
            path = _stack_path(collector, name, armed=True)
            f = os.fdopen(create_exclusive(path), "w")
        except OSError:
            continue  # a read-only run directory: the records matter, these do not
        try:
            what = f"{name} comes" if name != FATAL else "a fatal signal comes"
            f.write(main_thread_line(f"every thread's stack if {what}"))
            f.flush()
        except OSError:  # a full disk
            with contextlib.suppress(OSError):
                f.close()  # its buffer cannot be written either
            with contextlib.suppress(OSError):
                path.unlink()
            continue
        if name == FATAL:
            faulthandler.enable(file=f, all_threads=True)
            out[name] = (f, path, None)
        else:
            sig = getattr(signal, name)
            faulthandler.register(sig, file=f, all_threads=True, chain=True)
            out[name] = (f, path, signal.getsignal(sig))
    return out


def _reregister_newest() -> None:
    """With two collectors open, one ends: the other's files take the signals again."""
    if not _collectors:
        return
    for name, (f, _, _) in _collectors[-1]._stack_files.items():
        if name in CAUGHT_SIGNALS:
            faulthandler.register(getattr(signal, name), file=f, all_threads=True, chain=True)
        elif name == FATAL and not faulthandler.is_enabled():
            faulthandler.enable(file=f, all_threads=True)


def _close_empty(f: Any, path: Path) -> None:
    """Close an armed stack file: remove it when it holds only metriclog's first line (its
    signal never came), else show it (its name without the leading dot)."""
    with contextlib.suppress(OSError):
        f.close()
        if path.read_text(errors="replace").count("\n") <= 1:
            path.unlink()
            with contextlib.suppress(OSError):
                path.parent.rmdir()  # only when empty
        else:
            path.rename(path.with_name(path.name.lstrip(".")))


_LIBRARY_PATHS = tuple(
    {
        os.path.realpath(p)
        for key in ("stdlib", "platstdlib", "purelib", "platlib")
        if (p := sysconfig.get_paths().get(key))
    }
)


def _where(tb: TracebackType | None) -> str | None:
    """The innermost frame outside the standard library and site-packages, as
    ``file:line in function`` (the innermost frame of all when every one is a library's)."""
    frames = traceback.extract_tb(tb)
    if not frames:
        return None
    chosen = next((f for f in reversed(frames) if not _in_library(f.filename)), frames[-1])
    return f"{chosen.filename}:{chosen.lineno} in {chosen.name}"


def _in_library(filename: str) -> bool:
    if filename.startswith("<"):
        return True
    real = os.path.realpath(filename)
    return "site-packages" in real.split(os.sep) or real.startswith(_LIBRARY_PATHS)
