"""A launcher like torchrun for tests: starts the ranks of tests/lockstep_worker.py, and
when one fails, SIGTERMs the survivors (blocked in their collective) and restarts every
rank from a checkpoint step, with ``TORCHELASTIC_RESTART_COUNT`` counting restarts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

WORKER = Path(__file__).with_name("lockstep_worker.py")
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Job:
    """What the launcher saw: each attempt's exit codes by rank."""

    codes: list[dict[int, int]] = field(default_factory=list)


def _coordinator(server: socket.socket, world: int, conns: list) -> None:
    """The collective: replies to every rank once all sent their step. A rank that dies
    leaves the others blocked, their connections open (the launcher stops them, as torchrun
    does, and then closes them)."""
    try:
        for _ in range(world):
            conn, _ = server.accept()
            conns.append(conn.makefile("rwb", buffering=0))
        while True:
            for c in conns:
                if not c.readline():
                    return
            for c in conns:
                c.write(b"ok\n")
    except OSError:
        return


def run_job(
    run_dir: Path,
    *,
    world: int = 4,
    steps: int = 20,
    action: list[str] | None = None,
    restart_from: int = 10,
    hang_dump_after: float = 0.0,
    timeout: float = 120.0,
) -> Job:
    """Run the job to its end: a first attempt (with ``action``), then, if a rank failed,
    a second from ``restart_from`` without it."""
    job = Job()
    start, restarts = 0, 0
    while True:
        server = socket.create_server(("127.0.0.1", 0))
        port = server.getsockname()[1]
        conns: list = []
        coordinator = threading.Thread(target=_coordinator, args=(server, world, conns), daemon=True)
        coordinator.start()
        env = {
            **os.environ,
            "WORLD_SIZE": str(world),
            "TORCHELASTIC_RESTART_COUNT": str(restarts),
            "HANG_DUMP_AFTER": str(hang_dump_after),
            "PYTHONPATH": str(ROOT),
        }
        env.pop("PYTHONFAULTHANDLER", None)
        args = [str(run_dir), str(port), str(steps), str(start), *(action or [])]
        procs = {
            rank: subprocess.Popen(
                [sys.executable, str(WORKER), *args],
                env={**env, "RANK": str(rank)},
                stderr=subprocess.DEVNULL,
            )
            for rank in range(world)
        }
        deadline = time.monotonic() + timeout
        failed = False
        while any(p.poll() is None for p in procs.values()):
            if time.monotonic() > deadline:
                for p in procs.values():
                    p.kill()
                raise TimeoutError(f"the lockstep job did not end in {timeout} s")
            if not failed and any(p.poll() not in (None, 0) for p in procs.values()):
                failed = True  # as torchrun: the survivors are stopped
                for p in procs.values():
                    if p.poll() is None:
                        p.send_signal(signal.SIGTERM)
            time.sleep(0.02)
        server.close()
        for c in conns:
            c.close()
        job.codes.append({rank: p.returncode for rank, p in procs.items()})
        if not any(job.codes[-1].values()) or restarts:
            return job
        start, restarts, action = restart_from, restarts + 1, None
