"""Choosing samples per (key, step): the top and bottom by a field, or some at random;
``SampleChoice``, what an upload sends."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from metric_core.errors import PlanError, opt
from metric_core.offline.samples.reading import Sample


def choose(
    samples: list[Sample],
    *,
    top: int = 0,
    bottom: int = 0,
    by: str | None = None,
    random: int = 0,
    seed: int = 0,
) -> list[Sample]:
    """Per (key, step), in ``read_samples``' order: the ``top`` and ``bottom`` by the field
    ``by`` (samples where it is missing, not a number or NaN are left out; among tied ones
    the bottom takes the first recorded, the top the last; a sample is shown once when it is
    in both, only when the group has fewer than ``top + bottom``), or ``random`` drawn without
    replacement by one ``numpy.random.default_rng(seed)``, group after group. None of them: every sample."""
    if by and not (top or bottom):
        raise PlanError(
            "ranks " + opt("top", flag=True) + " and " + opt("bottom", flag=True) + ": give one of them",
            option="by",
            value=by,
        )
    if not (top or bottom or random):
        return samples
    if random and (top or bottom):
        raise PlanError(
            "takes "
            + opt("top", flag=True)
            + "/"
            + opt("bottom", flag=True)
            + " or "
            + opt("random", flag=True)
            + ", "
            "not both",
            option="random",
            value=str(random),
        )
    if (top or bottom) and not by:
        raise PlanError(
            "needs the field to rank by: " + opt("by") + "FIELD", option="top", value=str(top or bottom)
        )
    import numpy as np

    rng = np.random.default_rng(seed) if random else None
    chosen: list[Sample] = []
    for group in _groups(samples):
        if rng is not None:
            picked = sorted(rng.choice(len(group), size=min(random, len(group)), replace=False).tolist())
            chosen += [group[i] for i in picked]
            continue
        scored = [
            (score, i) for i, s in enumerate(group) if (score := number(s.fields.get(by or ""))) is not None
        ]
        # one order for both ends, ties in recorded order: the bottom is its first ones and
        # the top its last ones (highest first), so tied samples fill both ends, each once
        ranked = sorted(scored)
        high = ranked[::-1][:top] if top else []
        low = ranked[:bottom] if bottom else []
        seen: set[int] = set()
        for _, i in high + low:
            if i not in seen:
                seen.add(i)
                chosen.append(group[i])
    return chosen


def _groups(samples: list[Sample]) -> Iterable[list[Sample]]:
    group: list[Sample] = []
    for s in samples:
        if group and (s.key, s.step) != (group[0].key, group[0].step):
            yield group
            group = []
        group.append(s)
    if group:
        yield group


def number(value: Any) -> float | None:
    """A field's value as the number it ranks by; None when it is no number (or NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return None if math.isnan(number) else number


SAMPLE_TABLES = ("per-step", "incremental")


@dataclass(frozen=True)
class SampleChoice:
    """Which samples an upload sends per step and key: ``top``/``bottom`` by ``by``, or
    ``random`` (seeded by ``seed``). By default, the top 2 and bottom 2 by ``reward`` where
    a key's samples have it, else 4 at random; ``enabled=False`` sends none.

    ``tables`` says how they go to W&B: ``per-step``, a table a step in that step's row
    (the default), or ``incremental``, torchforge's shape (its PR #486): one INCREMENTAL
    table a key, ``{key}_table``, that each step's row adds its samples to, and at the run's
    end one IMMUTABLE table of them all under the key. Incremental tables need W&B Server
    0.70 or later."""

    top: int | None = None
    bottom: int | None = None
    by: str | None = None
    random: int | None = None
    seed: int = 0
    enabled: bool = True
    tables: str = "per-step"

    def __post_init__(self) -> None:
        if self.tables not in SAMPLE_TABLES:
            raise PlanError(
                f"is not one of {', '.join(SAMPLE_TABLES)}", option="tables", value=str(self.tables)
            )

    def picks(self, samples: list[Sample]) -> list[Sample]:
        if self.random is not None or self.top is not None or self.bottom is not None:
            ranked = bool(self.top or self.bottom)
            return choose(
                samples,
                top=self.top or 0,
                bottom=self.bottom or 0,
                by=(self.by or "reward") if ranked else None,
                random=self.random or 0,
                seed=self.seed,
            )
        by = self.by or "reward"
        if any(number(s.fields.get(by)) is not None for s in samples):
            return choose(samples, top=2, bottom=2, by=by)
        return choose(samples, random=4, seed=self.seed)
