"""W&B offline runs: the ``run-<id>.wandb`` transaction log of an ``offline-run-*`` folder.

wandb has no public reader of it: its framing is LevelDB's log (``framing.leveldb_records``)
and each record a ``wandb_internal_pb2.Record``. A history row becomes a record per number
it holds, at its ``_step`` and ``_timestamp``; a string becomes a sample ``{"text": ...}``;
media, tables and other objects are counted and said. W&B's own keys (``_runtime``, ...)
are not metrics. The run's config goes to run.json; its display name names the source.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from metric_core.errors import SourceError
from metric_core.offline.importers.framing import leveldb_records
from metric_core.offline.importers.source import (
    PAST_FLOAT64,
    Importer,
    Item,
    Stream,
    Text,
    Warn,
    file_identity,
    number,
)


def records(path: Path, warn: Warn) -> Iterator[Any]:
    """Each ``wandb_internal_pb2.Record`` of a run file, in the order written."""
    from wandb.proto import wandb_internal_pb2 as pb

    with Path(path).open("rb") as f:
        try:
            for offset, data in leveldb_records(f, str(path), warn):
                record = pb.Record()  # type: ignore[attr-defined]
                try:
                    record.ParseFromString(data)
                except Exception:  # protobuf's DecodeError
                    warn(f"{path}: the record at byte {offset:,} is not a W&B record: skipped")
                    continue
                yield record
        except ValueError as exc:  # not a W&B file
            raise SourceError(str(exc)) from None


def item_value(item: Any) -> Any:
    """A history or config item's value: newer clients set a typed field instead of value_json."""
    if item.value_json:
        return json.loads(item.value_json)
    for name in ("number", "integer", "boolean", "text"):
        if item.HasField(name):
            return getattr(item, name)
    return None


def item_key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


class WandbImporter(Importer):
    kind = "wandb"

    def __init__(self, warn: Warn, run_file: Path) -> None:
        super().__init__(warn)
        self.run_file = run_file
        self.run_id = run_file.stem.removeprefix("run-")
        self.name = self.run_id

    @classmethod
    def at(cls, warn: Warn, path: Path) -> WandbImporter:
        """The run at ``path``: its run file, its ``offline-run-*`` folder, or a folder holding one."""
        if path.is_file():
            return cls(warn, path)
        files = sorted(path.glob("run-*.wandb")) or sorted(path.glob("offline-run-*/run-*.wandb"))
        if len(files) != 1:
            found = ", ".join(str(f.relative_to(path)) for f in files[:5]) or "none"
            raise SourceError(
                f"{path}: a W&B import takes one run, and this holds {len(files)} run files ({found}): "
                "name one offline-run-* folder"
            )
        return cls(warn, files[0])

    def identity(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "run": self.run_id,
            "file": file_identity(self.run_file, self.run_file.parent),
        }

    def streams(self) -> Iterator[Stream]:
        # The run record comes first: its display name names the source.
        for record in records(self.run_file, lambda text: None):
            if record.WhichOneof("record_type") == "run":
                self.name = record.run.display_name or self.run_id
                break
        yield Stream(self.name, 0, self._items())

    def _items(self) -> Iterator[Item]:
        for record in records(self.run_file, self.warn):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                yield from self._row({item_key(i): item_value(i) for i in record.history.item})
            elif kind in ("run", "config"):
                items = record.run.config.update if kind == "run" else record.config.update
                for item in items:
                    if item_key(item) != "_wandb":
                        self.config[item_key(item)] = _config_value(item_value(item))

    def _row(self, row: dict[str, Any]) -> Iterator[Item]:
        step, at = row.get("_step"), number(row.get("_timestamp"))
        if not isinstance(step, int) or isinstance(step, bool) or at is None:
            self.skipped["history rows without _step or _timestamp"] += 1
            return
        for key, value in row.items():
            if key.startswith("_"):
                continue
            as_number = number(value)
            if as_number is not None:
                yield (step, key, as_number, at)
            elif isinstance(value, str):
                yield Text(step, key, at, {"text": value})
            elif isinstance(value, int):
                self.skipped[PAST_FLOAT64] += 1
            else:
                self.skipped["media, tables and other objects (not imported)"] += 1


def _config_value(value: Any) -> Any:
    """A config entry's value: W&B keeps each as ``{"value": v}`` (with ``desc``)."""
    if isinstance(value, dict) and "value" in value and set(value) <= {"value", "desc"}:
        return value["value"]
    return value
