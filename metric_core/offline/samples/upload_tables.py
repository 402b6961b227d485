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
    --follow``, before each poll's rows)."""

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

        where = (source, step)
        if where in self.attached or where not in self.by_step:
            return {}
        from metric_core.writer.backends.wandb import samples_table

        self.attached.add(where)
        out = {}
        for key, samples in self.by_step[where].items():
            chosen = self.choice.picks(samples)
            if chosen:
                out[key] = samples_table([s.fields for s in chosen])
        return out

    def unattached(self) -> int:
        """Steps with samples that no row of any run took (no scalar at that step)."""
        return len(set(self.by_step) - self.attached)
