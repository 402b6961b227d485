"""Which frames carry their keys as polars Categorical.

The reader hands over key, reduction and process as Categorical: the engine groups on
their codes without hashing each string. But polars keeps every string a Categorical ever
held for the life of the process (its global categories: about 90 bytes a distinct
string), so a run of millions of distinct keys would hold them all, whatever the work
needs. Keys are Categorical while the distinct keys admitted stay within ``KEY_BUDGET``;
past it, frames carry their keys as plain strings (the engine codes those with categories
of its own, freed with the frame). The records are the same either way.
"""

from __future__ import annotations

import threading

import numpy as np

# Loaded here, on the thread that imports the reader: ``np.unique`` loads ``numpy.ma`` lazily
# (numpy's module ``__getattr__``), and two reading threads doing that at once recurse until
# RecursionError (soak seed 535793175: `keys` on 4 threads)
import numpy.ma
import polars as pl

KEY_BUDGET = 1 << 18  # distinct keys held as Categorical, at most (about 24 MiB)

_lock = threading.Lock()
_admitted = np.empty(0, dtype=np.uint64)  # hashes of the keys admitted, sorted


def categorical_keys(distinct: pl.Series) -> bool:
    """Whether a frame whose keys are among ``distinct`` may carry them as Categorical (they
    are then counted as admitted)."""
    global _admitted
    if len(distinct) > KEY_BUDGET:
        return False
    hashes = np.unique(distinct.hash(seed=0).to_numpy())
    with _lock:
        new = np.setdiff1d(hashes, _admitted, assume_unique=True)
        if not len(new):
            return True
        if len(_admitted) + len(new) > KEY_BUDGET:
            return False
        _admitted = np.union1d(_admitted, new)
    return True
