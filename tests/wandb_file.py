"""Read back what the real wandb client wrote to a ``run-<id>.wandb`` file, with the reader
``metriclog import`` uses (``metric_core.offline.importers.wandb_offline``: LevelDB-log
framing, each chunk's checksum verified, each record a ``wandb_internal_pb2.Record``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

from metric_core.offline.importers.wandb_offline import item_key, item_value, records


def read_records(path: Path, timeout: float = 30.0) -> list[pb.Record]:
    """The records of a finished run. wandb's service process writes the file; this waits
    (up to ``timeout``) for its exit record rather than read a file still being written."""
    deadline = time.monotonic() + timeout
    while True:
        found = list(records(Path(path), lambda text: None))
        if any(r.WhichOneof("record_type") == "exit" for r in found) or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def history_rows(found: list[pb.Record]) -> list[dict]:
    return [
        {item_key(item): item_value(item) for item in rec.history.item}
        for rec in found
        if rec.WhichOneof("record_type") == "history"
    ]


def run_record(found: list[pb.Record]) -> pb.RunRecord:
    runs = [r.run for r in found if r.WhichOneof("record_type") == "run"]
    assert runs, f"no run record among {[r.WhichOneof('record_type') for r in found][:20]}"
    return runs[0]


def config_of(found: list[pb.Record]) -> dict:
    out: dict = {}
    for rec in found:
        kind = rec.WhichOneof("record_type")
        items = rec.run.config.update if kind == "run" else rec.config.update if kind == "config" else []
        for item in items:
            out[item_key(item)] = json.loads(item.value_json)
    return out


def metric_definitions(found: list[pb.Record]) -> dict[str, str]:
    """Defined metrics: name (or glob) -> its step_metric."""
    out = {}
    for rec in found:
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
