"""``SampleTables``: the samples an upload attaches to its history rows, as W&B tables."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from metric_core.offline.samples.choosing import SampleChoice
from metric_core.offline.samples.files import SamplesPart
from metric_core.offline.samples.reading import Sample, SampleSet, read_samples, record_attempts
from metric_core.offline.storage import RunPath, _is_upath, run_path


class SampleTables:
    """The samples an upload attaches to its history rows: per W&B run (its source's, or
    every source's) and step, each key's chosen samples as a ``wandb.Table``, logged in the
    same ``log`` call as that step's scalars. ``refresh`` reads them again (``upload
    --follow``, before each poll's rows).

    With ``choice.tables == "incremental"`` (torchforge's shape), a run's key has one
    INCREMENTAL table, ``{key}_table``, each step's row adding that step's chosen samples
    to it, and ``finals`` gives the IMMUTABLE tables of them all, for the run's end."""

    def __init__(
        self, run: str | os.PathLike[str] | RunPath, plan: Any, choice: SampleChoice, *, share_run: bool
    ) -> None:
        self.run, self.plan, self.choice, self.share_run = run, plan, choice, share_run
        self.root: RunPath = run if _is_upath(run) else run_path(run)  # type: ignore[assignment, arg-type]
        self.known: list[Any] | None = None  # the records' attempts: read once samples are found
        self.by_step: dict[tuple[str | None, int], dict[str, list[Sample]]] = {}
        self.newest = -1
        self.attached: set[tuple[str | None, int]] = set()
        self.renamed: set[str] = set()  # samples keys that are scalar keys too (said once)
        self._sealed: dict[str, SamplesPart] = {}  # sealed files do not change: read once
        # incremental: a run's (its source's) tables, and the step its samples last went at
        self.incremental: dict[str | None, Any] = {}
        self.last_step: dict[str | None, int] = {}
        self.refresh()

    def refresh(self) -> None:
        """Read the run's samples again (``upload --follow``: before each poll's rows go)."""
        read = self._read(self.known or ())
        if read.samples and self.known is None:  # a run without samples costs no scan of its records
            self.known = record_attempts(self.root)
            read = self._read(self.known)
        groups: dict[tuple[str | None, int], dict[str, list[Sample]]] = {}
        for s in read.samples:
            per_source = self.plan.mode.value != "global_reduce"
            where = (s.process if per_source and not self.share_run else None, s.step)
            key = f"{s.key}/{s.process}" if per_source and self.share_run else s.key
            groups.setdefault(where, {}).setdefault(key, []).append(s)
        self.by_step = groups
        self.newest = max((step for _, step in groups), default=-1)

    def _read(self, known: Iterable[Any]) -> SampleSet:
        return read_samples(
            self.root,
            keys=self.plan.keys,
            ranks=self.plan.ranks,
            steps=self.plan.steps,
            attempts="rewind",
            sealed=self._sealed,
            known=known,
        )

    def __bool__(self) -> bool:
        return bool(self.by_step)

    def tables(self, source: str | None, step: int) -> dict[str, Any]:
        """``{key: wandb.Table}`` of ``source``'s (None: every source's) samples at ``step``,
        each once a run."""

        picked = self.chosen(source, step)
        if not picked:
            return {}
        from metric_core.writer.backends.wandb import IncrementalTables, samples_table, table_key

        out = {}
        for key, rows in picked.items():
            if self.choice.tables == "incremental":
                tables = self.incremental.setdefault(source, IncrementalTables())
                # its columns: the fields of every sample the run would take of the key, known now
                fields = self._chosen_fields(source, key) if key not in tables.tables else None
                out[table_key(key)] = tables.add(key, rows, fields)
                self.last_step[source] = step
            else:
                out[key] = samples_table(rows)
        return out

    def chosen(self, source: str | None, step: int) -> dict[str, list[dict[str, Any]]]:
        """``{key: [each chosen sample's fields]}`` of ``source``'s samples at ``step``, each
        once a run: what ``tables`` makes W&B's tables of, and what MLflow keeps as JSON."""
        where = (source, step)
        if where in self.attached or where not in self.by_step:
            return {}
        self.attached.add(where)
        out = {}
        for key, samples in self.by_step[where].items():
            picked = self.choice.picks(samples)
            if picked:
                out[key] = [s.fields for s in picked]
        return out

    def finals(self, source: str | None) -> dict[str, Any]:
        """Incremental: ``{key: IMMUTABLE table}`` of every sample ``source``'s run took (its
        end, as torchforge ends a run); else nothing."""
        tables = self.incremental.get(source)
        return tables.finals() if tables is not None else {}

    def _chosen_fields(self, source: str | None, key: str) -> set[str]:
        """The fields of the samples of ``key`` that ``source``'s run would take, at any step."""
        fields: set[str] = set()
        for (where, _), by_key in self.by_step.items():
            if where == source and key in by_key:
                for s in self.choice.picks(by_key[key]):
                    fields.update(s.fields)
        return fields

    def unattached(self) -> int:
        """Steps with samples that no row of any run took (no scalar at that step)."""
        return len(set(self.by_step) - self.attached)
