"""torchforge's ``forge.observability.utils``: ``get_proc_name_with_rank``, without monarch.

torchforge's module reads monarch's ``context()`` and ``current_rank()``; here they are
``metric_core.torchforge.metrics``'s stand-ins, read from the launcher's environment, and
they are names of this module too, as they are of torchforge's (a test may patch
``metric_core.torchforge.utils.current_rank`` as it patched
``forge.observability.utils.current_rank``).
"""

from __future__ import annotations

import logging

from metric_core.torchforge.metrics import context, current_rank

__all__ = ["context", "current_rank", "get_proc_name_with_rank"]

logger = logging.getLogger(__name__)


def get_proc_name_with_rank(proc_name: str | None = None) -> str:
    """``{process}_r{rank}``: torchforge's name of a rank, in its logs and per-rank W&B runs.

    The process is ``proc_name``, else this process's name (the one given to
    ``get_or_create_metric_logger``, else ``METRICLOG_PROCESS``, else the script's name);
    the rank is the launcher's (``RANK``, ``SLURM_PROCID``, ...; 0 without one).

    torchforge's process of a process mesh has a mesh hash in its actor name
    (``TrainActor_1abc2def``), which it puts before the rank; a process here belongs to no
    mesh, so there is none, as for torchforge's direct process (``client_r0``): a name with
    ``_`` in it is kept whole.

    >>> get_proc_name_with_rank("MyProcess")
    'MyProcess_r0'
    >>> get_proc_name_with_rank("trainer_actor")
    'trainer_actor_r0'
    """
    name = proc_name if proc_name is not None else context().actor_instance.actor_id.actor_name
    return f"{name}_r{current_rank().rank}"
