"""Where a thread is: the writer thread's look at the training thread at each heartbeat.

A place is two ``file:line in function`` strings: the innermost frame of the caller's own
code (outside the standard library, site-packages and metric_core), and the innermost frame
overall. A rank blocked in ``torch.distributed.all_reduce`` is then at its own training line
and in the collective; a rank sleeping in a function of its own is at that function twice.
Reading frames costs the writer thread a few microseconds a heartbeat and the training
thread nothing.
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig
import threading
from types import FrameType

import metric_core

Place = tuple[str, str]  # (the caller's innermost frame, the innermost frame)


def _library_roots() -> tuple[str, ...]:
    """Where library code lives, longest first (a frame under one is not the caller's own)."""
    roots = {sysconfig.get_paths().get(name) for name in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots.update(getattr(site, "getsitepackages", list)())
    roots.add(os.path.dirname(os.path.abspath(metric_core.__file__)))
    clean = {os.path.abspath(r) for r in roots if r}
    return tuple(sorted(clean, key=len, reverse=True))


_ROOTS = _library_roots()
_CWD = os.getcwd()


def _library(path: str) -> str | None:
    """``path`` relative to the library root that holds it; None for the caller's own code."""
    if path.startswith("<"):  # <frozen importlib._bootstrap>, <string>: never the caller's line
        return path
    for root in _ROOTS:
        if path.startswith(root + os.sep) or path == root:
            rel = path[len(root) + 1 :]
            return f"metric_core/{rel}" if root.endswith(os.sep + "metric_core") else rel
    return None


def _own(path: str) -> str:
    """The caller's file as the user knows it: relative to the directory the job started in."""
    if path.startswith(_CWD + os.sep):
        return path[len(_CWD) + 1 :]
    return path


def _say(frame: FrameType, name: str) -> str:
    return f"{name}:{frame.f_lineno} in {frame.f_code.co_name}"


def place_of(frame: FrameType) -> Place:
    """The place of a thread whose innermost frame is ``frame``."""
    inner_path = frame.f_code.co_filename
    lib = _library(inner_path)
    inner = _say(frame, lib if lib is not None else _own(inner_path))
    if lib is None:
        return (inner, inner)
    f: FrameType | None = frame.f_back
    while f is not None:
        path = f.f_code.co_filename
        if _library(path) is None:
            return (_say(f, _own(path)), inner)
        f = f.f_back
    return (inner, inner)  # library code all the way down (a thread pool's worker)


def main_place() -> Place | None:
    """Where the main thread is now (None: it has ended)."""
    ident = threading.main_thread().ident
    frame = sys._current_frames().get(ident) if ident is not None else None
    return place_of(frame) if frame is not None else None


def all_places() -> dict[str, Place]:
    """Every thread's place but the caller's own, by thread name (``name#ident`` where two
    threads share a name)."""
    frames = sys._current_frames()
    me = threading.get_ident()
    names: dict[int, str] = {t.ident: t.name for t in threading.enumerate() if t.ident is not None}
    out: dict[str, Place] = {}
    for ident, frame in frames.items():
        if ident == me:
            continue
        name = names.get(ident, f"thread-{ident}")
        if name in out:
            name = f"{name}#{ident}"
        out[name] = place_of(frame)
    return out
