"""The command's start and end (``metriclog``, ``python -m metriclog``): a stop (Ctrl-C, or
SIGTERM from ``timeout``, Slurm, ``docker stop``) is caught from the entry point's first
line, before the commands and the libraries they use load (most of a short command's
time), until the process is gone. At any moment it ends the command with exit code 130
and at most one line, never a traceback:

* while the commands load: at once (nothing is made yet);
* while a command runs: as ``KeyboardInterrupt``, so what it made in temporary
  directories and half-written files is removed on the way out (``cli.main``);
* once it is done, while the interpreter ends: at once.

This module imports only modules built into the interpreter: whatever it imports runs
before a stop is caught. So it sets the handlers with ``_signal``, the C module that
``signal`` wraps: ``signal`` builds its enums as it loads, which takes longer than
everything else here.
"""

from __future__ import annotations

import _signal
import _thread
import atexit
import os
import sys

STOPPED = 130  # a command's exit code when a stop ended it (a shell's, for a Ctrl-C)

_stopping = False  # a stop came
_done = False  # the command is done: the interpreter ends
_first = _signal.SIGINT  # the signal of the first stop
# The standard streams the process started with closed (``>&-``): written to /dev/null. A
# command whose rows go to stdout refuses to make them for no one (``options.rows``).
STARTED_CLOSED: set[str] = set()
_lost = False  # a stop's KeyboardInterrupt landed where Python could not raise it


def main() -> None:
    """``metriclog``: stops caught, then the commands loaded and the one asked for run; the
    process then ends without the interpreter's teardown (``_leave``), once the exception
    that ended the command is let go (what it held, a stream cut short, ends first)."""
    code: object = 0
    try:
        try:
            catch_stops()  # in the try: a stop may land as soon as its first handler is set
            for name in ("stdout", "stderr"):  # started closed (>&-): said to no one, as to a reader gone
                if getattr(sys, name) is None:
                    setattr(sys, name, open(os.devnull, "w"))  # noqa: SIM115 (open until the process ends)
                    STARTED_CLOSED.add(name)
            # No command does linear algebra: numpy's OpenBLAS would start a thread a core
            # as it loads, whose spinning costs a short command about a sixth of its CPU.
            os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
            from .main import main as run  # typer, the commands' options and what they import

            run()
        finally:
            _end()
    except SystemExit as done:  # the command's end (typer ends every command so)
        code = done.code
    except KeyboardInterrupt:  # a stop while the commands loaded (or after a library's own end)
        _end()
        code = STOPPED
    except Exception:
        if not _stopping:
            raise
        code = STOPPED  # a library that made the stop an error of its own, while it loaded
    _leave(code)


def _leave(code: object) -> None:
    """End the process with exit status ``code`` (``SystemExit``'s) as the interpreter
    would: the threads it waits for joined, then the ``atexit`` functions run (temporary
    directories removed, a Ray started here shut down, wandb's and logging's ends), what
    only reference cycles hold finalized, then the output flushed; but not its teardown,
    which frees every module and what it holds one by one: about 0.05 s after a large
    reduce, for nothing (the command's files are written and closed by then)."""
    import contextlib
    import gc

    threading = sys.modules.get("threading")
    if threading is not None and hasattr(threading, "_shutdown"):
        threading._shutdown()  # non-daemon threads, as the interpreter joins them first
    atexit._run_exitfuncs()
    gc.collect()  # what only a cycle holds, finalized (a stream left at a broken pipe says its report)
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # as the interpreter says a SystemExit of a message
        with contextlib.suppress(OSError, ValueError):
            print(code, file=sys.stderr)
        status = 1
    _flush()
    os._exit(status & 0xFF)


def catch_stops() -> None:
    """Ctrl-C (where it is not ignored, as in a background job) and SIGTERM raise
    ``KeyboardInterrupt`` in the main thread; done once a process."""
    if _signal.getsignal(_signal.SIGTERM) is _stop:
        return
    _signal.signal(_signal.SIGTERM, _stop)
    if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
        _signal.signal(_signal.SIGINT, _stop)
    # Registered first, so it runs last: from there on the interpreter drops its own
    # handlers, and a stop would kill the process by the signal's default action.
    atexit.register(_ignore_stops)
    sys.unraisablehook = _unraisable(sys.unraisablehook)


def stopping() -> bool:
    """Whether a stop came."""
    return _stopping


def _stop(signum: int, frame: object) -> None:
    global _stopping, _lost, _first
    if _done:
        os._exit(STOPPED)  # the command is done and its output flushed: nothing to clean up
    if _lost:
        _lost = False  # raised again, where it can go through
    elif _stopping and signum == _signal.SIGTERM:
        return  # again (timeout(1) signals the process, then its group): the cleanup goes on
    elif not _stopping:
        _stopping, _first = True, signum
    raise KeyboardInterrupt


def _unraisable(report):  # type: ignore[no-untyped-def]
    """``sys.unraisablehook`` that gives a stop back: a stop that lands in code whose
    exceptions Python cannot raise (a weakref callback, as the import system's module
    locks have; a ``__del__``) would be reported as "Exception ignored ... Traceback" and
    lost. It is delivered again instead, from another thread (from this one, it would
    land in this hook), to raise in the main thread's next instruction."""

    def hook(unraisable) -> None:  # type: ignore[no-untyped-def]
        global _lost
        if _stopping and isinstance(unraisable.exc_value, KeyboardInterrupt):
            _lost = True
            _thread.start_new_thread(_thread.interrupt_main, (_first,))
        else:
            report(unraisable)

    return hook


def _end() -> None:
    """The command is done: its output flushed, a stop from here on ends the process at once."""
    global _done
    _flush()
    _done = True


def _flush() -> None:
    """stdout and stderr flushed: a pipe its reader closed, or a stream closed, is no error
    of the command's."""
    import contextlib  # after the commands loaded it (not before: see above)

    for stream in (sys.stdout, sys.stderr):
        if stream is not None:  # closed at the start, and a stop came before ``main`` replaced it
            with contextlib.suppress(OSError, ValueError):
                stream.flush()


def _ignore_stops() -> None:
    if _signal.getsignal(_signal.SIGTERM) is _stop:
        _signal.signal(_signal.SIGTERM, _signal.SIG_IGN)
        if _signal.getsignal(_signal.SIGINT) is _stop:
            _signal.signal(_signal.SIGINT, _signal.SIG_IGN)
