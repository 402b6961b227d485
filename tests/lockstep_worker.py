"""One rank of a lockstep job (tests/lockstep.py launches it): every step ends in a
stand-in for an allreduce, a blocking ``recv`` in native code until every rank is there.

    python tests/lockstep_worker.py RUN_DIR PORT STEPS START [ACTION RANK STEP [SECONDS]]

ACTION, done by rank RANK at step STEP: ``raise``, ``exit`` (``os._exit(1)``), ``kill``
(SIGKILL itself), ``segv`` (SIGSEGV itself), ``sleep`` (SECONDS, while the others wait),
``hold`` (while the others wait, until the file at SECONDS' place exists), ``checkpoint``
(SECONDS in a function of its own after its flush of STEP, while the others wait in the next
step's collective).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

import metric_core
from metric_core import Reduce


def allreduce(sock: socket.socket, step: int) -> None:
    """Wait for every rank, as a collective does: blocked in recv (the GIL released)."""
    sock.sendall(f"{step}\n".encode())
    got = b""
    while not got.endswith(b"\n"):
        chunk = sock.recv(64)
        if not chunk:
            raise ConnectionError("Connection closed by peer")
        got += chunk


def train_step(rank: int, step: int, action: list[str]) -> None:
    metric_core.record_metric("loss", 1.0 / (step + 1) + rank, Reduce.MEAN)
    if not action or int(action[1]) != rank or int(action[2]) != step:
        return
    what = action[0]
    if what == "raise":
        raise ValueError("bad batch")
    if what == "exit":
        os._exit(1)
    if what == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if what == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if what == "sleep":
        time.sleep(float(action[3]))
    held = time.monotonic()  # until the test lets it go, or gives up on it
    while what == "hold" and not os.path.exists(action[3]) and time.monotonic() - held < 300:
        time.sleep(0.01)


def save_checkpoint(seconds: float) -> None:
    time.sleep(seconds)


def main() -> None:
    run_dir, port, steps, start, *action = sys.argv[1:]
    rank = int(os.environ["RANK"])
    metric_core.init(
        run_dir,
        process_name=f"Trainer_r{rank}",
        step=int(start),
        flush_interval=0.1,
        hang_dump_after=float(os.environ.get("HANG_DUMP_AFTER", "0")),
    )
    sock = socket.create_connection(("127.0.0.1", int(port)))
    for step in range(int(start), int(steps)):
        train_step(rank, step, action)
        allreduce(sock, step)
        metric_core.flush(step)
        if action and action[0] == "checkpoint" and int(action[1]) == rank and int(action[2]) == step:
            save_checkpoint(float(action[3]))
    metric_core.shutdown()


if __name__ == "__main__":
    main()
