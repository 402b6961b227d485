"""moto's standalone S3 server on a port of its own, for the tests and benchmarks that read
runs from object storage (``moto[server]``, in the dev extra)."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from typing import IO

# Credentials for the test server (it takes any, unless told to check them).
KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
RUNNING_ON = re.compile(r"Running on http://127\.0\.0\.1:(\d+)")


@contextlib.contextmanager
def nothing_listens() -> Iterator[int]:
    """A port bound (and so no other process's to listen on) where nothing listens: a
    connection to it is refused, while the context lasts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield int(s.getsockname()[1])


@contextlib.contextmanager
def s3_server(log: IO[str] | None = None, **env: str) -> Iterator[str]:
    """The server's endpoint URL, while it runs; each request it serves is a line in ``log``.

    The server binds port 0 (a free port the kernel picks) and says which: no two servers
    (of pytest-xdist's workers, or of other processes on the machine) can get the same."""
    with contextlib.ExitStack() as stack:
        out = log if log is not None else stack.enter_context(tempfile.TemporaryFile("w+"))
        out.flush()
        begin = os.lseek(out.fileno(), 0, os.SEEK_END)
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
            env={**os.environ, **env},
            stdout=subprocess.DEVNULL,
            stderr=out,
        )
        try:
            deadline = time.monotonic() + 60

            def port_said() -> str | None:  # its first lines: "Running on http://127.0.0.1:<port>"
                found = RUNNING_ON.search(os.pread(out.fileno(), 1 << 16, begin).decode(errors="replace"))
                return found.group(1) if found else None

            while (port := port_said()) is None:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("moto's S3 server did not start")
                time.sleep(0.05)
            endpoint = f"http://127.0.0.1:{port}"
            while True:  # bound: until it answers
                try:
                    urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise RuntimeError("moto's S3 server did not answer") from None
                    time.sleep(0.05)
            yield endpoint
        finally:
            proc.terminate()
            proc.wait(timeout=30)
