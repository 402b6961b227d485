"""Which reduction a key keeps when it was recorded under more than one: that of its
first record, decided before any result is handed over, the others' records counted."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
from polars.exceptions import PanicException

from metric_core.errors import (
    UnknownReductionError,
)
from metric_core.offline.engine import partials
from metric_core.offline.plan import ReducePlan, key_matcher
from metric_core.offline.read import RunScan
from metric_core.offline.read.report import MixedKey

# Keys met held in memory, at most, by a stream that sets them aside (``KeyReductions``)
HELD_KEYS = 1 << 20
_MET = {"key": pl.String, "reduction": pl.String}


@dataclass
class KeyReductions:
    """Each key's reduction as far as a stream has read: ``decided`` for a key met under
    more than one (its first record's), and ``met`` (a frame of key, reduction) for the
    keys met under one in earlier frames: a run of millions of keys holds them as columns,
    not as a Python object each. With ``spills``, met keys past HELD_KEYS go to a temporary
    directory (removed by ``close``) until a frame needs them (``known``): a stream whose
    every frame brings keys not met before (told by ``met_hashes``) never reads them back."""

    decided: dict[str, str] = field(default_factory=dict)
    met: pl.DataFrame = field(default_factory=lambda: pl.DataFrame(schema=_MET))
    # the 64-bit hashes of met's keys, sorted: a frame none of whose keys' hashes is here
    # met none of them before (no join of millions of strings to tell)
    met_hashes: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint64))
    spills: bool = False
    spilled: list[Path] = field(default_factory=list)
    spill_dir: tempfile.TemporaryDirectory[str] | None = None

    def remember(self, met: pl.DataFrame) -> None:
        """Keys (and their reductions) met in a frame, added to ``met``."""
        self.met = pl.concat([self.met, met]) if self.met.height else met
        self.met_hashes = np.sort(np.concatenate([self.met_hashes, _hashes(met["key"])]))
        if self.spills and self.met.height > HELD_KEYS:
            if self.spill_dir is None:
                self.spill_dir = tempfile.TemporaryDirectory(prefix="metriclog-keys-met-")
            self.spilled.append(Path(self.spill_dir.name) / f"{len(self.spilled):06d}.arrow")
            self.met.write_ipc(self.spilled[-1], compression="uncompressed")
            self.met = pl.DataFrame(schema=_MET)

    def known(self) -> pl.DataFrame:
        """Every key met so far with its reduction: read back once, if set aside, and held
        from then on (a stream that meets its keys again needs them at every frame)."""
        if self.spilled:
            self.met = pl.concat([*(pl.read_ipc(path) for path in self.spilled), self.met]).rechunk()
            self.spilled, self.spills = [], False
            self.close()
        return self.met

    def close(self) -> None:
        if self.spill_dir is not None:
            self.spill_dir.cleanup()
            self.spill_dir = None


def kept_reductions(
    scan: RunScan | None,
    merged: pl.DataFrame,
    recorded: KeyReductions,
    counts: np.ndarray,
    mixed: dict[str, MixedKey],
    remember: bool = True,
) -> np.ndarray | None:
    """Which groups of ``merged`` to keep: a key recorded under more than one reduction
    (and no ``--reduce`` pattern for it) keeps the reduction of its first record, and its
    groups under another are dropped, their records (``counts``) counted in ``mixed``.
    ``recorded`` holds each key's reduction: decided before (``first_reductions``), or met
    in earlier frames; this frame's keys are added to it (``remember``: a frame follows).
    None: keep every group. A reduction that is not a statistic is an error."""
    reductions = merged["reduction"].unique()
    if len(reductions) == 1 and not recorded.decided and not len(recorded.met_hashes):  # no key's to group
        if not partials.is_statistic(reductions[0]):
            raise UnknownReductionError(dict.fromkeys(merged["key"].unique().sort().to_list(), reductions[0]))
        if remember:
            recorded.remember(
                merged.select(pl.col("key").unique(), reduction=pl.lit(reductions[0], pl.String))
            )
        return None
    if not recorded.decided and _distinct_and_new(merged["key"], recorded.met_hashes):
        # each key under one reduction (millions of keys: no group_by of their strings)
        unknown = [r for r in reductions.cast(pl.String).to_list() if not partials.is_statistic(r)]
        if unknown:
            bad = merged.filter(pl.col("reduction").cast(pl.String).is_in(unknown)).sort("key")
            raise UnknownReductionError(
                dict(zip(bad["key"].to_list(), bad["reduction"].cast(pl.String).to_list(), strict=True))
            )
        if remember:
            recorded.remember(merged.select("key", pl.col("reduction").cast(pl.String)))
        return None
    per_key = (
        merged.group_by("key")
        .agg(reductions=pl.col("reduction").n_unique(), reduction=pl.col("reduction").cast(pl.String).min())
        .join(recorded.known().rename({"reduction": "prior"}), on="key", how="left")
    )
    # Met with two at once, and never before: the first record decides.
    fresh_mixed = (
        (pl.col("reductions") > 1) & pl.col("prior").is_null() & ~pl.col("key").is_in(list(recorded.decided))
    )
    for key in per_key.filter(fresh_mixed)["key"].sort().to_list():
        recorded.decided[key] = _first_reduction(scan, key, merged)
        mixed.setdefault(key, MixedKey(key, recorded.decided[key]))
    if len(recorded.decided):
        first = pl.DataFrame(
            {"key": list(recorded.decided), "first": list(recorded.decided.values())},
            schema={"key": pl.String, "first": pl.String},
        )
        per_key = per_key.join(first, on="key", how="left").with_columns(prior=pl.coalesce("first", "prior"))
    fresh = per_key.filter(pl.col("prior").is_null()).select("key", "reduction")
    if fresh.height and remember:
        recorded.remember(fresh)
    per_key = per_key.with_columns(prior=pl.coalesce("prior", "reduction"))  # each key's reduction
    unknown = [r for r in per_key["prior"].unique().to_list() if not partials.is_statistic(r)]
    if unknown:
        bad = per_key.filter(pl.col("prior").is_in(unknown)).sort("key")
        raise UnknownReductionError(dict(zip(bad["key"].to_list(), bad["prior"].to_list(), strict=True)))
    other = per_key.filter((pl.col("reductions") > 1) | (pl.col("reduction") != pl.col("prior")))
    if not other.height:
        return None
    prior = merged.select("key").join(
        other.select("key", "prior"), on="key", how="left", maintain_order="left"
    )
    keep = (prior["prior"].is_null() | (prior["prior"] == merged["reduction"].cast(pl.String))).to_numpy()
    kept_of = dict(zip(other["key"].to_list(), other["prior"].to_list(), strict=True))
    dropped = merged.with_columns(count=pl.Series(counts)).filter(pl.Series(~keep))
    for key, reduction, n in dropped.group_by("key", "reduction").agg(pl.col("count").sum()).iter_rows():
        entry = mixed.setdefault(key, MixedKey(key, kept_of[key], first_record=False))
        entry.skipped[reduction] = entry.skipped.get(reduction, 0) + int(n)
    if "process" in dropped.columns:  # a per-rank mode: who recorded them
        who = dropped.select("key", "process", "rank").unique().drop_nulls()
        for key, process, rank in who.iter_rows():
            mixed[key].sources.add(f"{process} (rank {rank})")
    return keep


def _hashes(keys: pl.Series) -> np.ndarray:
    return keys.hash(seed=0).to_numpy()


def _distinct_and_new(keys: pl.Series, met: np.ndarray) -> bool:
    """Whether no two of ``keys`` are equal and none is among the keys hashed in ``met``
    (sorted), told from their 64-bit hashes (equal keys, equal hashes): False also when
    two distinct keys share one, which is only slower."""
    hashes = np.sort(_hashes(keys))
    if (hashes[1:] == hashes[:-1]).any():
        return False
    if not len(met) or not len(hashes):
        return True
    at = np.minimum(np.searchsorted(met, hashes), len(met) - 1)
    return not (met[at] == hashes).any()


def _first_reduction(scan: RunScan | None, key: str, merged: pl.DataFrame) -> str:
    """The reduction of a key's first record over the whole run (``_first_records``: a
    query of its own, made only for a key met with two reductions that no file declared);
    without the run, of its first group in ``merged``."""
    if scan is not None:
        found = _first_records(scan, {key}, scan.file_ids)
        if key in found:
            return found[key]
    first = merged.filter(pl.col("key") == key).sort(merged.columns[0], "reduction").row(0, named=True)
    return str(first["reduction"])


def _firsts(records: pl.LazyFrame) -> pl.LazyFrame:
    return (
        records.sort("key", "timestamp", "step", "rank", "reduction", nulls_last=True)
        .group_by("key", maintain_order=True)
        .first()
    )


def first_reductions(plan: ReducePlan, scan: RunScan) -> dict[str, str]:
    """Each key that the files declare under more than one reduction, and that no
    ``--reduce`` pattern reduces, with the reduction of its first record
    (``_first_records``): decided before any result is handed over, so every mode and
    filter keeps the same one. Read from the files that declare the key."""
    declared: dict[str, set[str]] = {}
    holders: dict[str, list[int]] = {}
    for fid in scan.file_ids:
        for key, reduction in scan.report.files[fid].keys or ():
            declared.setdefault(key, set()).add(reduction.lower())
            holders.setdefault(key, []).append(fid)
    overrides = [key_matcher([pattern]) for pattern, _ in plan.overrides]
    mixed = {k for k, found in declared.items() if len(found) > 1 and not any(m(k) for m in overrides)}
    if not mixed:
        return {}
    return _first_records(scan, mixed, sorted({fid for k in mixed for fid in holders[k]}))


def _first_records(scan: RunScan, keys: set[str], fids: list[int]) -> dict[str, str]:
    """The reduction of the first record of each of ``keys`` in ``fids``: by time, then
    step, then rank (records of one time: the lowest rank's), then reduction name. (A file
    that cannot be read is left out here; its reading says so.)"""
    parts = [
        scan.file_frame(fid)
        .filter(pl.col("key").is_in(list(keys)))
        .select("key", "reduction", "timestamp", "step", "rank")
        for fid in fids
    ]
    if not parts:
        return {}
    readable = []
    for part in parts:  # each file's first records, on its own
        try:
            readable.append(_firsts(part).collect())
        except (pl.exceptions.PolarsError, PanicException):
            continue
    if not readable:
        return {}
    firsts = _firsts(pl.concat(readable).lazy()).collect()
    return dict(zip(firsts["key"].to_list(), firsts["reduction"].to_list(), strict=True))
