"""Keys put in order a bounded range at a time.

polars' sort of millions of strings holds several times their views for the time of the
sort. Here the keys are cut into ranges of at most about RANGE_KEYS by a few boundaries
drawn from an even sample of them (every key of a range sorts before every key of the
next), and each range is sorted on its own: the same order as one stable sort of all the
keys (ties in their first order), never the whole sort held at once.
"""

from __future__ import annotations

import numpy as np
import polars as pl

# Keys sorted at a time, at most about (a range's share of the sample may be uneven)
RANGE_KEYS = 1 << 20
# Keys of the sample a range, for choosing the boundaries
SAMPLE_PER_RANGE = 64


def key_ranks(keys: pl.Series) -> np.ndarray:
    """Each key's place in the stable order of ``keys`` (the inverse of ``arg_sort``), one
    range at a time."""
    n = len(keys)
    rank = np.empty(n, dtype=np.int64)
    if n <= RANGE_KEYS:
        rank[stable_order(keys)] = np.arange(n)
        return rank
    which = range_of(keys, boundaries(sample_of(keys, n), n))
    counts = np.bincount(which, minlength=1)
    members = np.argsort(which, kind="stable")  # each range's keys in their first order
    del which
    edges = np.r_[0, np.cumsum(counts)]
    for lo, hi in zip(edges[:-1].tolist(), edges[1:].tolist(), strict=True):
        at = members[lo:hi]
        rank[at[stable_order(keys.gather(at))]] = np.arange(lo, hi)
    return rank


def boundaries(sample: pl.Series, n: int) -> pl.Series:
    """Keys that cut ``n`` keys into ranges of about RANGE_KEYS (sorted, distinct; none for
    ``n`` at most that), chosen from an even ``sample`` of them."""
    ranges = -(-n // RANGE_KEYS)
    if ranges <= 1 or not len(sample):
        return pl.Series(dtype=pl.String)
    ordered = sample.cast(pl.String).sort()
    picks = (np.arange(1, ranges) * len(ordered)) // ranges
    return ordered.gather(picks).unique(maintain_order=True)


def sample_of(keys: pl.Series, n: int) -> pl.Series:
    """An even sample of ``keys`` (``n`` of them in all), enough for ``boundaries``."""
    ranges = -(-n // RANGE_KEYS)
    return keys.gather_every(max(n // (ranges * SAMPLE_PER_RANGE), 1))


def range_of(keys: pl.Series, bounds: pl.Series) -> np.ndarray:
    """Each key's range among ``bounds`` (0 to len(bounds)): range r holds the keys from
    bounds[r - 1] to before bounds[r]."""
    if not len(bounds):
        return np.zeros(len(keys), dtype=np.uint32)
    return bounds.search_sorted(keys.cast(pl.String), side="right").to_numpy()


def stable_order(keys: pl.Series) -> np.ndarray:
    """The order that sorts ``keys``, ties in their first order."""
    frame = pl.DataFrame({"key": keys.cast(pl.String)})
    return frame.select(pl.arg_sort_by("key", maintain_order=True)).to_series().to_numpy()
