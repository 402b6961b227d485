"""Writing an imported run: each stream through the writer's own ``RawFileWriter`` (so its
segments are sealed and checksummed as a training job's are), then ``run.json`` last."""

from __future__ import annotations

import collections
import hashlib
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from metric_core import run_json
from metric_core.atomic import create_file
from metric_core.format.schema import TIMESTAMP_RANGE
from metric_core.offline.importers.source import Item, Stream, Text
from metric_core.writer.segments import RawFileWriter

# Records handed to the writer at a time: what an import holds in memory beyond the writer's.
BATCH = 65_536
_INT64 = (-(1 << 63), (1 << 63) - 1)


class StreamWriter:
    """One stream's records into one source's segments, a batch at a time."""

    def __init__(
        self, run_dir: Path, stream: Stream, reduction: str, skipped: collections.Counter[str], *, run_id: str
    ) -> None:
        self.writer = RawFileWriter(run_dir, process=stream.process, rank=stream.rank)
        # The attempt from the source too, not at random: two imports of one source are one run
        # to a later upload (its ledger compares the writers' attempts), not a restart of it.
        self.writer.attempt = hashlib.blake2b(
            f"{run_id}/{stream.process}/{stream.rank}".encode(), digest_size=8
        ).hexdigest()
        self.reduction = reduction
        self.skipped = skipped
        self.records = self.samples = 0
        self._codes: dict[str, int] = {}
        self._table: list[tuple[str, str]] = []
        self._steps: list[int] = []
        self._rows: list[tuple[float, float, float]] = []

    def write_all(self, items: Iterator[Item]) -> None:
        lo, hi = TIMESTAMP_RANGE
        try:
            for item in items:
                at = item.timestamp if isinstance(item, Text) else item[3]
                if not lo <= at < hi:
                    self.skipped["records with a wall time outside 1970-2286 (not a clock's)"] += 1
                elif not _INT64[0] <= item[0] <= _INT64[1]:
                    self.skipped["records with a step outside int64"] += 1
                elif isinstance(item, Text):
                    self._write_batch()  # in the order read
                    self.writer.enqueue_samples(item.step, [(item.key, item.timestamp, item.sample)])
                    self.samples += 1
                else:
                    self._add(*item)
            self._write_batch()
        except BaseException:
            self.writer.release()
            raise
        self.writer.close(clean_shutdown=True)

    def _add(self, step: int, key: str, value: float, timestamp: float) -> None:
        code = self._codes.get(key)
        if code is None:
            code = self._codes[key] = len(self._table)
            self._table.append((key, self.reduction))
        self._steps.append(step)
        self._rows.append((value, code, timestamp))
        if len(self._rows) >= BATCH:
            self._write_batch()

    def _write_batch(self) -> None:
        if self._rows:
            # by step, each step's records in the order read: a frame a step (MLflow gives a key at a time)
            order = np.argsort(np.array(self._steps, dtype=np.int64), kind="stable")
            rows = np.array(self._rows, dtype=np.float64)[order]
            steps = np.array(self._steps, dtype=np.int64)[order]
            starts = np.flatnonzero(np.r_[True, steps[1:] != steps[:-1]]).tolist()
            for a, b in zip(starts, [*starts[1:], len(steps)], strict=True):  # runs of one step, in order
                self.writer.enqueue(int(steps[a]), rows[a:b].tobytes(), b - a, self._table)
            self.records += len(self._rows)
            self._rows, self._steps = [], []
        self.writer.write()
        self.writer.seal_ready()


def write_run_json(run_dir: Path, *, name: str, run_id: str, world_size: int, config: dict[str, Any],
                   source: dict[str, Any]) -> None:  # fmt: skip
    """run.json, last: its presence says the import is whole."""
    meta = {
        "name": name,
        "run_id": run_id,
        "world_size": world_size,
        "created": time.time(),
        "config": _json_safe(config),
        "imported_from": source,
    }
    create_file(run_dir / run_json.NAME, run_json.encode(meta))


def _json_safe(value: Any) -> Any:
    """Config as strict JSON: a NaN or an infinity as its text (run.json is strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return json.loads(json.dumps(value, default=str))
