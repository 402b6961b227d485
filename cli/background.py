"""Work done in a forked child process while this process does something else.

``metriclog upload`` reads and reduces the run (polars) in a child while it imports
wandb itself, which takes about half a second: on two cores the two overlap. The child
reports its own errors on the shared stderr, as the command would have; the parent
only learns the exit code.

Where a fork is unsafe the work runs in this process instead, when its result is asked
for: polars already loaded (its thread pool does not survive a fork; so under the test
runner), other threads running, or no fork on this platform.
"""

from __future__ import annotations

import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import click
import typer

T = TypeVar("T")


def start(work: Callable[[], T]) -> Callable[[], T]:
    """Start ``work`` in a forked child; the returned function waits for its result."""
    import multiprocessing

    if (
        "polars" in sys.modules
        or threading.active_count() > 1
        or "fork" not in multiprocessing.get_all_start_methods()
    ):
        return work
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(work, send), daemon=True)
    child.start()
    send.close()

    def result() -> T:
        with receive:
            try:
                status, value = receive.recv()
            except EOFError:
                child.join()
                typer.echo(
                    f"Error: the process reading the run ended early (exit code {child.exitcode}); "
                    "run again, and report it if it happens again",
                    err=True,
                )
                raise typer.Exit(1) from None
        child.join()
        if status == "exit":
            raise typer.Exit(value)
        return value  # type: ignore[no-any-return]

    return result


def _child(work: Callable[[], Any], send: Connection) -> None:
    try:
        message = ("ok", work())
    except (typer.Exit, click.exceptions.Exit) as exc:  # already reported on stderr
        message = ("exit", exc.exit_code)
    except KeyboardInterrupt:
        message = ("exit", 130)
    except BaseException:
        traceback.print_exc()
        message = ("exit", 1)
    with send:
        send.send(message)
