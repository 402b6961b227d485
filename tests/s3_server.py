"""moto's standalone S3 server on a free localhost port, for the tests and benchmarks that
read runs from object storage (``moto[server]``, in the dev extra)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import IO

# Credentials for the test server (it takes any, unless told to check them).
KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def s3_server(log: IO[str] | None = None, **env: str) -> Iterator[str]:
    """The server's endpoint URL, while it runs; each request it serves is a line in ``log``."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=log or subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("moto's S3 server did not start") from None
                time.sleep(0.2)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=30)
