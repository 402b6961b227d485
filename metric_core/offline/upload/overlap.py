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
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from metric_core.atomic import hold_stops
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
    # forked with stops held, so none lands between the fork and the guard below (the child,
    # unguarded, would write on in what the caller then removes); each side lets them go
    let_go = hold_stops()
    child = context.Process(target=_child, args=(work, send, let_go), daemon=True)
    try:
        child.start()
    except BaseException:
        let_go()
        raise
    send.close()

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
        let_go()
        yield result
    finally:
        receive.close()  # a child still sending its result is told at once (EPIPE)
        if child.is_alive():
            child.terminate()
            child.join(10)
            if child.is_alive():
                child.kill()
                child.join()


def _child(work: Callable[[], Any], send: Connection, let_go: Callable[[], None]) -> None:
    try:
        let_go()  # the stops held while it was forked (``started``)
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
