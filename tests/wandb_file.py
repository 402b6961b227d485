"""Read back what the real wandb client wrote to a ``run-<id>.wandb`` file.

The format: a 7-byte header (":W&B", then version bytes), then LevelDB-log framing in
32 KiB blocks: each chunk is crc32c (4 bytes), length (2), type (1: FULL, 2: FIRST,
3: MIDDLE, 4: LAST), then the payload; a block's tail shorter than a chunk header is
zero padding. Each reassembled payload is a ``wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path, timeout: float = 30.0) -> list[pb.Record]:
    """The records of a finished run. wandb's service process writes the file; this waits
    (up to ``timeout``) for its exit record rather than read a file still being written."""
    deadline = time.monotonic() + timeout
    while True:
        records = _parse(Path(path).read_bytes(), path)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def _parse(data: bytes, path: Path) -> list[pb.Record]:
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, pending, records = HEADER, b"", []
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, pos)
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == FULL:
            pending = payload
        elif kind == FIRST:
            pending = payload
            continue
        elif kind == MIDDLE:
            pending += payload
            continue
        elif kind == LAST:
            pending += payload
        else:
            continue
        rec = pb.Record()
        rec.ParseFromString(pending)
        records.append(rec)
        pending = b""
    return records


def history_rows(records: list[pb.Record]) -> list[dict]:
    rows = []
    for rec in records:
        if rec.WhichOneof("record_type") == "history":
            row = {}
            for item in rec.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = item_value(item)
            rows.append(row)
    return rows


def item_value(item) -> object:
    """A history item's value: newer clients set a typed field instead of value_json."""
    if item.value_json:
        return json.loads(item.value_json)
    for name in ("number", "integer", "boolean", "text"):
        if item.HasField(name):
            return getattr(item, name)
    return None


def run_record(records: list[pb.Record]) -> pb.RunRecord:
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert runs, f"no run record among {[r.WhichOneof('record_type') for r in records][:20]}"
    return runs[0]


def config_of(records: list[pb.Record]) -> dict:
    out: dict = {}
    for rec in records:
        kind = rec.WhichOneof("record_type")
        items = rec.run.config.update if kind == "run" else rec.config.update if kind == "config" else []
        for item in items:
            out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


def metric_definitions(records: list[pb.Record]) -> dict[str, str]:
    """Defined metrics: name (or glob) -> its step_metric."""
    out = {}
    for rec in records:
        if rec.WhichOneof("record_type") == "metric":
            m = rec.metric
            out[m.name or m.glob_name] = m.step_metric
    return out


def find_run_file(root: Path, run_id: str) -> Path:
    matches = list(Path(root).rglob(f"run-{run_id}.wandb"))
    assert matches, f"no run-{run_id}.wandb below {root}"
    return matches[0]


def tables_of(run_file: Path, key: str) -> dict[int, list[dict]]:
    """Each step's ``wandb.Table`` of ``key``, as the real client wrote it: the history row
    names the table's file (a key with a slash comes nested), which holds columns and rows."""
    out = {}
    for row in history_rows(read_records(run_file)):
        path = row[key]["path"] if key in row else row.get(f"{key}/path")
        if path is not None:
            table = json.loads((Path(run_file).parent / "files" / path).read_text())
            out[row["step"]] = [dict(zip(table["columns"], values, strict=True)) for values in table["data"]]
    return out


def logged_tables(run_file: Path, key: str) -> list[tuple[int | None, str, list[dict]]]:
    """Every table logged under ``key``, in the order logged: (step, W&B's ``_type``, rows).
    An incremental table's file holds the rows that log added (``incremental-table-file``);
    an immutable one's, all of its rows (``table-file``)."""
    out = []
    for row in history_rows(read_records(run_file)):
        value = row.get(key)
        meta = (
            value
            if isinstance(value, dict)
            else {name[len(key) + 1 :]: v for name, v in row.items() if name.startswith(f"{key}/")}
        )
        if "path" in meta:
            table = json.loads((Path(run_file).parent / "files" / meta["path"]).read_text())
            rows = [dict(zip(table["columns"], values, strict=True)) for values in table["data"]]
            out.append((row.get("step"), meta["_type"], rows))
    return out
