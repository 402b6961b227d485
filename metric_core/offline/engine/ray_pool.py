"""``--engine ray``: the engine's tasks computed as Ray tasks, folded here in task order.

Each Ray task runs the local engine's own code (``tasks.TaskWork``) on one task's
partitions (files, or Parquet row groups: the plan and the files fix them, never the
cluster) and returns their partial states (numpy arrays and a small frame of labels,
exact sums included: they pickle); this process folds them in the tasks' order, and the
output is bit-identical to ``--engine local``. At most twice the
cluster's CPUs of tasks are in flight. Ray is an optional extra (``metriclog[ray]``),
imported only here.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from metric_core.errors import MetricLogError, MissingDependencyError, NoDataError

if TYPE_CHECKING:
    from metric_core.offline import filters
    from metric_core.offline.engine import partials
    from metric_core.offline.engine.tasks import Task, TaskWork
    from metric_core.offline.read import OnProgress


def on_ray(
    work: TaskWork,
    items: list[Task],
    sizes: list[int],
    on_progress: OnProgress | None,
    *,
    seen: filters.Seen,
    address: str | None,
) -> Generator[tuple[int, partials.Partial | None], None, None]:
    """Each task's states, in the tasks' order, as (index, state), then (index, None)."""
    ray = connect(address)
    remote = ray.remote(_task)
    shared = ray.put(work)
    window = max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))
    refs: dict[int, Any] = {}
    done_bytes, total = 0, sum(sizes)

    def submit(upto: int) -> None:
        for j in range(len(refs), min(upto, len(items))):
            refs[j] = remote.remote(shared, items[j])

    try:
        submit(window)
        for i in range(len(items)):
            try:
                states, found = ray.get(refs.pop(i))
            except ray.exceptions.RayTaskError as exc:
                if isinstance(exc.cause, MetricLogError):
                    raise exc.cause from None
                raise
            submit(i + 1 + window)
            seen.merge(found)
            for state in states:
                yield i, state
            done_bytes += sizes[i]
            if on_progress is not None:
                on_progress(i + 1, len(items), done_bytes, total)
            yield i, None
    finally:
        for ref in refs.values():
            ray.cancel(ref)


def _task(work: TaskWork, task: Task) -> tuple[list[partials.Partial], Any]:
    """One task on a Ray worker: its partitions' states, and the ranks and keys it read."""
    from metric_core.offline import filters
    from metric_core.offline.storage import is_remote

    if not is_remote(work.scan.run_dir) and not work.scan.run_dir.exists():
        raise NoDataError(
            str(work.scan.run_dir),
            "this Ray cluster's workers cannot see it: give a run directory every node can read "
            "(a shared file system), or run with --engine local",
        )
    seen = filters.Seen.wanted_by(work.plan)
    states = list(work(task, seen))
    return states, seen.found()


def _reachable(address: str | None) -> None:
    """Fail at once, naming it, where a cluster's ``host:port`` (or ``ray://host:port``)
    takes no connection: Ray itself retries an address that is not there for ever."""
    if address is None or ":" not in address:  # "auto", "local": Ray finds or starts its own
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not port.isdigit():
        return  # Ray's own message says what is wrong with it
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise MetricLogError(
            f"cannot reach the Ray cluster at {address} ({exc.strerror or exc}): start it "
            "(ray start --head), give the address its head printed (--ray-address or RAY_ADDRESS), "
            "or run with --engine local"
        ) from None


# How long a cluster's address may take to accept a connection.
RAY_CONNECT_TIMEOUT_S = 10.0


def connect(address: str | None) -> Any:
    """Ray, connected to ``address`` (or ``RAY_ADDRESS``), else to a local cluster it starts."""
    try:
        import ray
    except ImportError:
        raise MissingDependencyError(
            "--engine ray needs Ray, which is not installed: pip install 'metriclog[ray]'"
        ) from None
    if not ray.is_initialized():
        logging.getLogger("ray").setLevel(logging.ERROR)  # its start-up chatter is not the command's output
        address = address or os.environ.get("RAY_ADDRESS") or None
        _reachable(address)
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
        except ConnectionError as exc:
            raise MetricLogError(f"cannot reach the Ray cluster at {address}: {exc}") from None
    return ray
