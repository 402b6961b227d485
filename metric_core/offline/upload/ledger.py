"""The upload ledger: per destination run, the rows planned, the rows handed over, and
whether it finished; one format for every destination (``destination.Destination``).

W&B's and MLflow's live in ``RUN_DIR/.metriclog/uploads.json``, or in the user cache
(keyed by the run's identity) when the run is in object storage or its directory is not
writable; TensorBoard's beside its event files. It is replaced atomically on every update.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from metric_core.atomic import held_lock, new_hidden_file, replace_file
from metric_core.errors import UnsafePathError, UploadError
from metric_core.offline.storage import is_remote, storage_errors


class Ledger:
    """Per destination run: rows planned, rows handed over, finished; saved atomically."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, dict[str, Any]] = self._read()

    def _read(self) -> dict[str, dict[str, Any]]:
        if not self.path.exists():
            return {}
        try:
            entries = dict(json.loads(self.path.read_text()).get("runs", {}))
        except (OSError, ValueError) as exc:
            raise UploadError(
                f"upload ledger {self.path} is damaged ({exc}); move it away to start over"
            ) from None
        for entry in entries.values():  # TensorBoard's ledgers before the one format said "rows"
            if "rows" in entry:
                entry.setdefault("rows_sent", entry.pop("rows"))
        return entries

    @classmethod
    def for_run_dir(cls, run_dir: Any, identity: str) -> Ledger:
        """``RUN_DIR/.metriclog/uploads.json``; the user cache's, keyed by the run's identity,
        for a run in object storage, a run directory that is not writable, or one uploaded
        from a bucket before (the same run read from disk and from a bucket is one upload)."""
        cached = _cache_dir(identity) / "uploads.json"
        if is_remote(run_dir):
            cached.parent.mkdir(parents=True, exist_ok=True)
            if not cached.exists():  # a copy of a run uploaded where it was written
                stored = _stored_entries(run_dir)
                if stored:
                    _save(cached, stored)
            return cls(cached)
        home = run_dir / ".metriclog"
        if cached.is_file() and not (home / "uploads.json").exists():
            return cls(cached)
        try:
            home.mkdir(exist_ok=True)
            _refuse_links(home, home / "wandb", home / "uploads.json")
            with new_hidden_file(home / "write-test") as (_, probe):
                pass
            probe.unlink()
        except OSError:
            home = cached.parent
            home.mkdir(parents=True, exist_ok=True)
        return cls(home / "uploads.json")

    @classmethod
    def in_cache(cls, identity: str, *, create: bool = True) -> Ledger | None:
        """The user cache's ledger of ``identity`` (``create=False``: None when there is none)."""
        path = _cache_dir(identity) / "uploads.json"
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
            return cls(path)
        return cls(path) if path.is_file() else None

    @classmethod
    def existing(cls, run_dir: Any, identity: str) -> Ledger | None:
        """The run's ledger if there is one, without creating anything (for a dry run)."""
        cached = _cache_dir(identity) / "uploads.json"
        places = [cached] if is_remote(run_dir) else [run_dir / ".metriclog" / "uploads.json", cached]
        for path in places:
            if path.is_file() and not path.is_symlink():
                return cls(path)
        stored = _stored_entries(run_dir) if is_remote(run_dir) else None
        if stored:
            ledger = cls(cached)
            ledger.entries = stored
            return ledger
        return None

    def latest(self, base_id: str) -> dict[str, Any] | None:
        """The newest entry for a planned run: its own, or that of a fresh id it was sent under."""
        entries = [
            {**e, "id": run_id}
            for run_id, e in self.entries.items()
            if run_id == base_id or e.get("base_id") == base_id
        ]
        return max(entries, key=lambda e: e.get("updated", 0.0)) if entries else None

    def get(self, run_id: str) -> dict[str, Any] | None:
        return self.entries.get(run_id)

    def update(self, run_id: str, **fields: Any) -> None:
        self.update_many({run_id: fields})

    def update_many(self, updates: dict[str, dict[str, Any]]) -> None:
        """Update runs' entries. Uploads of other runs of the same directory may run at the
        same time (two modes followed side by side): the file is read again under a lock
        and only these entries change."""
        lock = os.open(self.path.with_name(".uploads.lock"), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.entries = self._read()
            now = time.time()
            for run_id, fields in updates.items():
                self.entries.setdefault(run_id, {}).update(fields, updated=now)
            _save(self.path, self.entries)
        finally:
            os.close(lock)  # and the lock with it


def _cache_dir(identity: str) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "metriclog" / identity[:32]


def _save(path: Path, entries: dict[str, dict[str, Any]]) -> None:
    replace_file(path, (json.dumps({"runs": entries}, indent=2, sort_keys=True) + "\n").encode())


def _stored_entries(run_dir: Any) -> dict[str, dict[str, Any]] | None:
    """The entries of the ledger a bucket holds beside a remote run (copied up with it from
    where it was uploaded), if it holds one that reads as a ledger."""
    stored = run_dir / ".metriclog" / "uploads.json"
    with storage_errors(stored):
        if not stored.is_file():
            return None
        data = stored.read_bytes()
    try:
        runs = json.loads(data)["runs"]
    except (ValueError, KeyError, TypeError):
        return None  # not a ledger: this upload starts its own
    if not isinstance(runs, dict) or not all(isinstance(e, dict) for e in runs.values()):
        return None
    return runs


def _refuse_links(*paths: Path) -> None:
    """metriclog writes under RUN_DIR/.metriclog only through directories it made itself."""
    for path in paths:
        if path.is_symlink():
            raise UnsafePathError(
                f"{path} is a symlink (to {os.readlink(path)}): metriclog does not write through "
                "links it did not make; remove it and upload again"
            )


@contextlib.contextmanager
def only_upload(home: Path, key: str, run: Any) -> Iterator[None]:
    """One upload of a run to a destination (the same request) at a time, across processes,
    plain or ``--follow``: two would hand every row over twice and remove each other's
    unfinished runs. An OS lock on a file beside the ledger (``home``), which names its
    holder; the kernel drops it when the holder ends, however it ends."""
    try:
        if home.is_symlink():
            raise OSError("a symlink: the ledger refuses it, and says so")
        home.mkdir(parents=True, exist_ok=True)
    except OSError:  # not writable: the ledger goes to the user's cache, and no lock is kept
        yield
        return

    def busy(held_by: str) -> UploadError:
        return UploadError(
            f"another `metriclog upload` of the same upload of {run} is running ({held_by}); two "
            "would hand every row over twice. Wait for it to end, or stop it (or upload another mode "
            "or project)"
        )

    with held_lock(home / f".upload-{key[:16]}.lock", busy):
        yield
