"""Files created safely inside a directory someone else may also write to.

metriclog never writes through a symlink it did not make: every file it writes under a
run directory is first created exclusively under a hidden name unique to this call
(``O_CREAT | O_EXCL | O_NOFOLLOW``: a planted file or symlink of that name makes the
call fail, never redirects it), then moved into place with ``os.replace`` (which
replaces a symlink at the target itself, not what it points to) or ``os.link`` (which
fails when the target exists: the first writer wins).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def create_exclusive(path: Path) -> int:
    """Create ``path``, which must not exist (not even as a dangling symlink); its fd."""
    return os.open(path, _FLAGS, 0o666)


@contextlib.contextmanager
def new_hidden_file(target: Path) -> Iterator[tuple[BinaryIO, Path]]:
    """A new hidden file beside ``target`` (``.{name}.{random}.tmp``), removed on error."""
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
    f = os.fdopen(create_exclusive(tmp), "wb")
    try:
        with f:
            yield f, tmp
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def replace_file(target: Path, data: bytes, *, fsync: bool = False) -> None:
    """Write ``target`` whole or not at all: a reader sees the old file or the new one."""
    with new_hidden_file(target) as (f, tmp):
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    publish(tmp, target)


def publish(tmp: Path, target: Path) -> None:
    """Move a finished hidden file into place atomically; on failure it is removed."""
    try:
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def create_file(target: Path, data: bytes) -> bool:
    """Write ``target`` whole unless it exists; False when another writer was first."""
    with new_hidden_file(target) as (f, tmp):
        f.write(data)
    try:
        os.link(tmp, target)
    except FileExistsError:
        return False
    except OSError:  # a file system without hard links: exclusive create, then write
        try:
            fd = create_exclusive(target)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return True


def write_holder(fd: int) -> None:
    """Write into a lock file who holds it (this process, host, since when), for the message
    another process that finds it held gives; a failure to write it is no failure to lock."""
    held = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(held).encode(), 0)


def holder(fd: int) -> str:
    """Who holds a lock file, as ``write_holder`` wrote it (its holder may not have yet)."""
    try:
        held = json.loads(os.pread(fd, 4096, 0))
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(held["since"])))
        return f"pid {held['pid']} on {held['host']}, since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "it did not say which"


@contextlib.contextmanager
def held_lock(path: Path, busy: Callable[[str], Exception]) -> Iterator[bool]:
    """An OS lock on ``path`` (made if need be, never through a symlink) for the block, across
    processes; the kernel drops it when its holder ends, however it ends. Held by another
    process: ``busy(who)`` is raised, ``who`` as that process wrote itself (``holder``).
    Yields False, holding nothing, where ``path`` cannot be opened (a folder not writable)."""
    try:
        lock = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held_by = holder(lock)
            for _ in range(20):  # it writes who it is just after it locks: a moment to say so
                if not held_by.startswith("it did not say"):
                    break
                time.sleep(0.05)
                held_by = holder(lock)
            raise busy(held_by) from None
        write_holder(lock)
        yield True
    finally:
        os.close(lock)


def hold_stops() -> Callable[[], None]:
    """Hold a stop (Ctrl-C, SIGTERM) from now on; the returned function lets it through (a
    stop that came meanwhile is raised as it returns: call it inside the ``try`` whose
    ``finally`` undoes what was made while it was held).

    A stop is held where Python handles it: its handler (the command line's, or Python's
    for Ctrl-C) is set aside and the stop recorded, whichever thread the signal reached. (A
    signal mask held it in this thread only: pyarrow's and polars' threads took the signal,
    and the stop was raised here all the same.) Nothing is held outside the main thread,
    where no handler can be set, nor a stop that has no Python handler (ignored, or the
    default's: the process ends at once)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    came: list[tuple[int, Any]] = []
    set_aside: dict[int, Callable[[int, Any], Any]] = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(signum)
        if callable(handler):
            set_aside[signum] = handler
            signal.signal(signum, lambda signum, frame: came.append((signum, frame)))

    def let_go() -> None:
        handlers = dict(set_aside)
        set_aside.clear()  # once, however often called
        try:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
        finally:  # every handler back, even where a stop landed in between (raised: it came)
            for signum, handler in handlers.items():
                if signal.getsignal(signum) is not handler:
                    signal.signal(signum, handler)
        if came:  # the first stop that came, as it would have been handled
            signum, frame = came[0]
            came.clear()
            handlers[signum](signum, frame)

    return let_go


def new_scratch_directory(prefix: str, let_go: Callable[[], None]) -> str:
    """A new temporary directory ($TMPDIR), made while stops are held (``hold_stops``); they
    stay held if it is made (``let_go`` in the caller's guard), are let go if it fails."""
    import tempfile

    try:
        return tempfile.mkdtemp(prefix=prefix)
    except BaseException:
        let_go()
        raise


@contextlib.contextmanager
def scratch_directory(prefix: str) -> Iterator[str]:
    """A new temporary directory ($TMPDIR) for the block, removed however it ends: no stop
    (``KeyboardInterrupt``) can come between its making and the removal's guard."""
    import shutil

    let_go = hold_stops()
    path = new_scratch_directory(prefix, let_go)
    try:
        let_go()
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
