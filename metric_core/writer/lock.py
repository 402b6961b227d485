"""One live writer per source: a lock the operating system releases when its holder dies.

Two live processes writing the same (process, rank) into one run directory would mix
their segments; the second ``init()`` is refused with a ``ConfigError`` naming the first.
The lock is ``flock`` on ``.{stem}.lock`` (hidden: not data), held while the writer is
open and removed when it closes. The kernel drops it when the holder exits or is killed,
so a restart after a crash is never refused (the file stays; the next writer takes it).
Where the file system has no working locks (some network file
systems), a ``MetricLogWarning`` says so and writing goes on unguarded.
"""

from __future__ import annotations

import contextlib
import errno
import os
import weakref
from pathlib import Path

from metric_core.atomic import holder, write_holder
from metric_core.errors import ConfigError, UnsafePathError, warn

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

_HELD = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
_FLAGS = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class SourceLock:
    """The lock of one source in one run directory (``acquire``, then ``release``)."""

    def __init__(self, run_dir: Path, stem: str, process: str, rank: int) -> None:
        self.path = run_dir / f".{stem}.lock"
        self.process = process
        self.rank = rank
        self._fd: int | None = None
        self._owner = 0  # the pid that took it: a forked child neither holds nor removes it

    def acquire(self) -> None:
        """Take the lock, or raise ``ConfigError`` naming the live writer that holds it."""
        while not self._try_acquire():
            pass  # its last holder removed the file between our open and our lock: again

    def _try_acquire(self) -> bool:
        try:
            fd = os.open(self.path, _FLAGS, 0o666)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafePathError(
                    f"{self.path} is a symlink: metriclog does not write through links it did not make"
                ) from None
            warn(f"could not create {self.path} ({exc.strerror}): a second writer is not detected")
            return True
        if fcntl is None:
            os.close(fd)
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            held_by = holder(fd)
            os.close(fd)
            if exc.errno in _HELD:
                raise ConfigError(
                    f"{self.process} (rank {self.rank}) is already being written into {self.path.parent} "
                    f"by a live process ({held_by}): two writers of one source would mix their records. "
                    "Give this process another process_name or rank, or stop the other one"
                ) from None
            warn(
                f"the file system of {self.path.parent} has no working locks ({exc.strerror}): "
                "a second live writer of this source would not be detected"
            )
            return True
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(self.path))
        except OSError:
            same = False
        if not same:
            os.close(fd)
            return False
        self._fd, self._owner = fd, os.getpid()
        _held.add(self)
        write_holder(fd)
        return True

    def release(self) -> None:
        """Remove the lock file (a clean run directory keeps no trace of it) and drop the lock."""
        if self._fd is not None:
            if self._owner == os.getpid():
                with contextlib.suppress(OSError):
                    self.path.unlink()
            with contextlib.suppress(OSError):
                os.close(self._fd)  # the last descriptor of it closed drops the flock
            self._fd = None

    def _forget(self) -> None:
        """In a forked child: close the inherited descriptor, so a child that outlives its
        parent does not keep the source locked, and never remove the parent's file."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


_held: weakref.WeakSet[SourceLock] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for lock in list(_held):
        lock._forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
