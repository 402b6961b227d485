"""The three logging modes, computed offline from a run's raw records.

A ``ReducePlan`` (``metric_core.offline.plan``) says what to compute and knows nothing about
how. ``execute`` cuts the run's files into tasks (``tasks.tasks``: files, or row groups,
in the order of the first step or window each may hold), reads each once on a pool of
threads as partitions of about PARTITION_ROWS records, reduces each to partial states
(``metric_core.offline.engine.partials``) and folds those. A state depends on the records folded
in, not on their order (exact sums, first and last by content), so the output is the
same bits however the records are split, named, ordered or spread over threads.
Memory grows with the number of output groups (and with the values of median/pNN keys),
not with the records. Another engine can run the same plan over the same tasks
(docs/modes.md, "How results are computed").

Statistics follow numpy over all raw values of a group: ``mean`` is sum/count over
every value (not a mean of rank means), ``std`` is the population std (ddof=0), ``pNN``
is numpy's default (linear) percentile, and a group holding a NaN gives NaN for every
statistic but ``count``, ``first`` and ``last``.

One idea a module: ``run`` (``run_plan``, ``execute``, ``ReduceResult``), ``tasks`` (the
files cut into tasks, in an order their data fixes; the columns read; where time windows
start), ``filtering`` (the plan's filters applied), ``partials`` and
``accumulator`` (partial states, folded), ``exact`` (exact sums), ``setaside`` (groups set
aside on disk), ``pool`` and ``ray_pool`` (tasks computed on threads or as Ray tasks,
handed over in order), ``finish`` (result frames from the folded states; median and pNN),
``reductions`` (which reduction a key recorded under several keeps), ``raw`` and
``timeorder`` (per_rank_no_reduce: each source's records in time order), ``shape``
(``--wide``; per-rank frames put in source order).
"""

from metric_core.offline.engine.filtering import key_matching, plan_filtered
from metric_core.offline.engine.finish import reduce_records
from metric_core.offline.engine.reductions import KeyReductions
from metric_core.offline.engine.run import ReduceResult, execute, reduce_run, run_plan
from metric_core.offline.engine.shape import pivot_wide
from metric_core.offline.plan import Engine, make_plan

__all__ = [
    "Engine",
    "KeyReductions",
    "ReduceResult",
    "execute",
    "key_matching",
    "make_plan",
    "pivot_wide",
    "plan_filtered",
    "reduce_records",
    "reduce_run",
    "run_plan",
]
