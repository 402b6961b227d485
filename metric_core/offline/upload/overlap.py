"""Work done in a forked child process while this process does something else.

``upload_run`` reads and reduces the run (polars) in a child while it imports wandb
itself, which takes about half a second: on two cores the two overlap. The child sends
back its result, or the ``MetricLogError`` (or ``OSError``) it raised, which is raised
again here.

Where a fork is unsafe the work runs in this process instead, when its result is asked
for: polars already loaded (its thread pool does not survive a fork; so under the test
runner), other threads running, or no fork on this platform.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from metric_core.errors import MetricLogError, UploadError

T = TypeVar("T")


@contextlib.contextmanager
def started(work: Callable[[], T]) -> Iterator[Callable[[], T]]:
    """``work`` started in a forked child for the block, which is given a function that
    waits for its result. When the block ends the child is gone: stopped (SIGTERM, its
    cleanup run) if its result was not taken, so what the block then removes is not
    being written."""
    import multiprocessing

    if (
        "polars" in sys.modules
        or threading.active_count() > 1
        or "fork" not in multiprocessing.get_all_start_methods()
    ):
        yield work
        return
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    # The child starts its work once told to, from inside the guard below: a stop that lands
    # before (as the fork returns, whichever thread the signal reached) leaves a child that
    # was never told, and ends as soon as this end of ``wait`` closes, having written nothing
    # in what the caller then removes.
    wait, go = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(work, send, wait, go), daemon=True)
    global _forking

    def result() -> T:
        with receive:
            try:
                status, value = receive.recv()
            except EOFError:  # killed, or it exited without a word
                status, value = "gone", None
        child.join()
        if status == "ok":
            return value  # type: ignore[no-any-return]
        if status == "error":
            raise value
        if status == "interrupted":
            raise KeyboardInterrupt
        if status == "crashed":
            raise UploadError("reading the run failed (the traceback above says where): please report it")
        raise UploadError(
            f"the process reading the run ended early (exit code {child.exitcode}); "
            "run again, and report it if it happens again"
        )

    try:
        _forking = True
        try:
            child.start()
        finally:
            _forking = False
        send.close()
        wait.close()
        with contextlib.suppress(OSError):  # a child gone already: ``result`` says so
            go.send_bytes(b"go")
        yield result
    finally:
        go.close()  # a child never told ends
        receive.close()  # a child still sending its result is told at once (EPIPE)
        if child.is_alive():
            child.terminate()
            child.join(10)
            if child.is_alive():
                child.kill()
                child.join()


_forking = False  # ``started`` forks its child now


def _at_fork() -> None:
    """In a child ``started`` forks, from its first instant: SIGTERM ends it at once,
    silently (until ``_child`` catches it: nothing is done before), whatever the parent's
    handler or mask."""
    if _forking:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_at_fork)


def _child(work: Callable[[], Any], send: Connection, wait: Connection, go: Connection) -> None:
    go.close()  # its copy: the parent's end alone keeps ``wait`` open
    try:
        # Stopped by the parent's SIGTERM (``started``) with its cleanup run, whatever the
        # parent's handler (one that holds a stop would never raise it).
        signal.signal(signal.SIGTERM, _stopped)
        with wait:
            try:
                wait.recv_bytes()
            except EOFError:  # the parent left before its guard: nothing was asked
                return
        try:
            message: tuple[str, Any] = ("ok", work())
        except (MetricLogError, OSError) as exc:  # expected failures: raised again in the parent
            message = ("error", exc)
        except KeyboardInterrupt:
            message = ("interrupted", None)
        except BaseException:
            traceback.print_exc()  # a bug: its traceback is the report
            message = ("crashed", None)
        with send, contextlib.suppress(OSError):  # OSError: the parent is gone (interrupted)
            send.send(message)
    except KeyboardInterrupt:  # stopped by the parent (``started``) while it sent: the parent says why
        pass


def _stopped(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
