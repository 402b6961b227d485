"""``import_source``: a run another tool logged, written into a run directory in our schema."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from metric_core import run_json
from metric_core.atomic import held_lock, replace_file
from metric_core.errors import PlanError, SourceError
from metric_core.format.schema import parse_json
from metric_core.metric import Reduce
from metric_core.offline.importers.source import Importer, Warn, hidden
from metric_core.offline.importers.write import StreamWriter, write_run_json

REDUCTIONS = tuple(r.value for r in Reduce if r is not Reduce.SAMPLE)
TABLE_SUFFIXES = (".csv", ".jsonl", ".ndjson", ".parquet")
# What a run directory holds as data (docs/format.md): a directory holding any is a run.
_DATA_SUFFIXES = (".parquet", ".jsonl", ".journal")
_LOCK = ".metriclog-import.lock"  # held by the import under way


@dataclass
class ImportResult:
    """What an import wrote: the run, each source's records and samples, what it skipped."""

    run_dir: Path
    run_id: str
    name: str
    kind: str
    added: bool  # False: the run directory held this import already, nothing was written
    sources: list[tuple[str, int, int, int]] = field(default_factory=list)  # process, rank, records, samples
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def records(self) -> int:
        return sum(s[2] for s in self.sources)


def import_source(
    src: str | Path,
    run_dir: str | Path,
    *,
    reduction: str = "mean",
    tracking_uri: str | None = None,
    experiment: str | None = None,
    run_id: str | None = None,
    step_col: str = "step",
    time_col: str | None = None,
    key_col: str | None = None,
    value_col: str | None = None,
    on_warning: Warn | None = None,
) -> ImportResult:
    r"""Import a run another tool logged into ``run_dir``, in the record schema.

    ``src`` is a TensorBoard event file or a folder of them, a W&B offline run folder
    (``offline-run-*``) or its ``run-*.wandb`` file, a CSV, JSONL or Parquet export, or
    ``mlflow`` (with ``tracking_uri`` and ``experiment`` or ``run_id``). Every record gets
    ``reduction``. Importing the same source into the same ``run_dir`` again adds nothing;
    a ``run_dir`` holding another run is refused.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> _ = (folder / "log.csv").write_text("step,loss,lr\n0,1.5,0.1\n1,1.25,0.1\n")
    >>> r = import_source(folder / "log.csv", folder / "run")
    >>> r.added, r.records, import_source(folder / "log.csv", folder / "run").added
    (True, 4, False)
    """
    if reduction not in REDUCTIONS:
        raise PlanError(f"is not one of {', '.join(REDUCTIONS)}", option="reduce", value=reduction)
    warn = on_warning or (lambda text: None)
    importer = _open(
        src, warn, tracking_uri=tracking_uri, experiment=experiment, run_id=run_id,
        step_col=step_col, time_col=time_col, key_col=key_col, value_col=value_col,
    )  # fmt: skip
    identity = importer.identity()
    digest = hashlib.blake2b(json.dumps(identity, sort_keys=True).encode(), digest_size=16).hexdigest()
    out = Path(run_dir)
    with _one_import(out):
        if _holds(out, digest, warn):
            return ImportResult(out, digest, importer.name, importer.kind, added=False)
        return _write(importer, src, out, digest, identity, reduction)


def _write(
    importer: Importer, src: str | Path, out: Path, digest: str, identity: dict[str, Any], reduction: str
) -> ImportResult:
    """Every stream of ``importer`` written into ``out``, then its run.json."""
    result = ImportResult(out, digest, importer.name, importer.kind, added=True)
    skipped: collections.Counter[str] = collections.Counter()
    for stream in importer.streams():  # a source refused as it is opened leaves nothing
        if not result.sources:
            # Said before the first record, gone after run.json: an import stopped in between
            # (a kill, a full disk) is known by it, and the same import started again redoes it.
            replace_file(out / run_json.IMPORTING, f"{digest}\n".encode(), fsync=True)
        writer = StreamWriter(out, stream, reduction, skipped, run_id=digest)
        writer.write_all(stream.items)
        result.sources.append((stream.process, stream.rank, writer.records, writer.samples))
    skipped.update(importer.skipped)
    result.skipped, result.name = dict(skipped), importer.name  # an importer may learn its name as it reads
    if not result.sources:
        raise SourceError(f"{src}: nothing to import (no stream of records found in it)")
    write_run_json(
        out, name=importer.name, run_id=digest, world_size=max(s[1] for s in result.sources) + 1,
        config=importer.config, source=identity,
    )  # fmt: skip
    (out / run_json.IMPORTING).unlink()
    return result


@contextlib.contextmanager
def _one_import(out: Path) -> Iterator[None]:
    """One import into ``out`` at a time, across processes: a second of the same source would
    take the first's records for those of a stopped import and remove them. An OS lock on
    ``out/.metriclog-import.lock``, which the kernel drops when its holder ends, however it
    ends; ``out`` is made for it, and removed again if the import wrote nothing there."""
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    path = out / _LOCK

    def busy(held_by: str) -> SourceError:
        return SourceError(
            f"another `metriclog import` into {out} is running ({held_by}): wait for it to end, or "
            "import into another directory"
        )

    with held_lock(path, busy) as held:  # not writable: nothing can be removed there anyway
        try:
            yield
        finally:
            if held:
                path.unlink(missing_ok=True)
            if made:
                with contextlib.suppress(OSError):  # not empty: what the import wrote
                    out.rmdir()


def _open(src: str | Path, warn: Warn, **options: Any) -> Importer:
    """The importer for ``src``, told by what it is."""
    if str(src) == "mlflow":
        from metric_core.offline.importers.mlflow_runs import MlflowImporter

        return MlflowImporter(warn, options["tracking_uri"], options["experiment"], options["run_id"])
    path = Path(src)
    if not path.exists():
        raise SourceError(f"{path}: no such file or directory")
    if path.is_file() and path.suffix.lower() in TABLE_SUFFIXES:
        from metric_core.offline.importers.tables import TableImporter

        return TableImporter(
            warn, path, step_col=options["step_col"], time_col=options["time_col"],
            key_col=options["key_col"], value_col=options["value_col"],
        )  # fmt: skip
    if path.suffix == ".wandb" or path.name.startswith("offline-run-") or any(path.glob("offline-run-*")):
        from metric_core.offline.importers.wandb_offline import WandbImporter

        return WandbImporter.at(warn, path)
    from metric_core.offline.importers.tensorboard import TensorBoardImporter, event_files

    if (path.is_file() and ".tfevents." in path.name) or (path.is_dir() and event_files(path)):
        return TensorBoardImporter(warn, path)
    raise SourceError(
        f"{path}: not a source metriclog imports: give a TensorBoard event file (events.out.tfevents.*) "
        "or a folder of them, a W&B offline run folder (offline-run-*) or its run-*.wandb file, a .csv, "
        ".jsonl or .parquet file, or mlflow with --tracking-uri and --experiment or --run-id"
    )


def _holds(run_dir: Path, run_id: str, warn: Warn) -> bool:
    """Whether ``run_dir`` holds this import already; refused when it holds anything else.
    What an import of the same source that was stopped before its end wrote is removed
    (said), to be written again."""
    meta_path = run_dir / run_json.NAME
    if meta_path.is_file():
        try:
            meta = parse_json(meta_path.read_bytes())
        except ValueError:
            meta = None
        if isinstance(meta, dict) and meta.get("run_id") == run_id and run_json.verified(meta) is not False:
            return True
        raise SourceError(
            f"{run_dir} holds another run (its run.json names another source): import into a new "
            "directory, or remove that one first"
        )
    if run_dir.is_dir():
        data = [p for p in run_dir.rglob("*") if p.suffix in _DATA_SUFFIXES and not hidden(p, run_dir)]
        stopped = _stopped_import(run_dir)
        if stopped == run_id:
            written = [p for p in run_dir.rglob("*") if _import_wrote(p) and not hidden(p.parent, run_dir)]
            for path in written:
                path.unlink()
            warn(
                f"{run_dir}: an import of this source was stopped before its end; its {len(data)} "
                "file(s) of records removed, imported again"
            )
            return False
        if data:
            raise SourceError(
                f"{run_dir} holds records ({data[0].relative_to(run_dir)}, ...) and no run.json: "
                + (
                    "an import of another source, stopped before its end"
                    if stopped
                    else "another run, or an import that was stopped before its end"
                )
                + "; import into a new directory, or remove that one first"
            )
    return False


def _stopped_import(run_dir: Path) -> str | None:
    """The run id of the import whose marker ``run_dir`` holds, if any."""
    try:
        return (run_dir / run_json.IMPORTING).read_text().strip() or None
    except (FileNotFoundError, UnicodeDecodeError):
        return None


def _import_wrote(path: Path) -> bool:
    """Whether ``path`` is what an import writes: records, or the writer's unfinished files."""
    return path.is_file() and (
        path.suffix in _DATA_SUFFIXES or (path.name.startswith(".") and path.suffix == ".tmp")
    )
