"""``metriclog diff``: where two runs' reductions differ, key by key.

Both runs are reduced with one plan (``compare.reduce_runs``: global_reduce or
per_rank_reduce, by step or by window from each run's start). Two values of one (source,)
step and key are equal:

* by default, bit for bit: any difference in the last bit counts, and ``-0.0`` differs from
  ``0.0``; a NaN equals a NaN (any NaN: a NaN's payload is not the run's);
* with a tolerance (``rtol`` or ``atol`` given, even 0), when ``|a - b| <= max(atol, rtol *
  max(|a|, |b|))`` (``math.isclose``'s rule, symmetric), or ``a == b`` (the same infinity,
  ``-0.0`` and ``0.0``), or both are NaN.

For each key (and source) that differs: the first step where it does, the largest
difference and where (a NaN or an infinity against another value is an infinite one), how
many steps differ, the steps only one run has, and the statistic each run reduced it
with when they differ. The keys only one run has are listed. ``DiffReport.equal`` is
whether nothing differs.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from metric_core.errors import PlanError
from metric_core.metric import LoggingMode
from metric_core.offline.compare import bucket_column, plan_of, reduce_runs
from metric_core.offline.plan import Engine, ReducePlan
from metric_core.offline.read import OnProgress, OnRead


@dataclass(frozen=True)
class KeyDiff:
    """How one key (of one source, in per_rank_reduce) differs between the runs."""

    key: str
    process: str | None
    differing: int  # steps (windows) both runs have, where the values differ
    first: Any = None  # the first of them (a step, or a window's offset)
    first_a: float | None = None
    first_b: float | None = None
    largest: float | None = None  # the largest |a - b| (inf for a NaN or inf against another value)
    largest_at: Any = None
    largest_a: float | None = None
    largest_b: float | None = None
    only_in_a: list[Any] = field(default_factory=list)  # steps of this key only run A has
    only_in_b: list[Any] = field(default_factory=list)
    reductions: tuple[str, str] | None = None  # the statistics, when the runs' differ


@dataclass(frozen=True)
class DiffReport:
    """``diff_runs``' answer. ``rtol`` and ``atol`` are None for a comparison bit for bit."""

    run_a: str
    run_b: str
    bucket: str  # "step" or "window_offset"
    rtol: float | None
    atol: float | None
    keys_compared: int
    differences: list[KeyDiff]
    keys_only_in_a: list[str]
    keys_only_in_b: list[str]

    @property
    def equal(self) -> bool:
        return not (self.differences or self.keys_only_in_a or self.keys_only_in_b)

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON values: a value that is not finite as the string ``"NaN"``,
        ``"Infinity"`` or ``"-Infinity"`` (as ``reduce --format json`` writes them)."""
        return _plain(
            {
                "equal": self.equal,
                "run_a": self.run_a,
                "run_b": self.run_b,
                "compared_by": self.bucket,
                "tolerance": None if self.rtol is None else {"rtol": self.rtol, "atol": self.atol},
                "keys_compared": self.keys_compared,
                "keys_only_in_a": self.keys_only_in_a,
                "keys_only_in_b": self.keys_only_in_b,
                "differences": [d.__dict__ for d in self.differences],
            }
        )

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)


def diff_runs(
    run_a: str | os.PathLike[str],
    run_b: str | os.PathLike[str],
    plan: ReducePlan | None = None,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    strict: bool = False,
    follow_symlinks: bool = False,
    on_read: OnRead | None = None,
    on_progress: OnProgress | None = None,
    engine: Engine | str = Engine.LOCAL,
    ray_address: str | None = None,
    **options: Any,
) -> DiffReport:
    """Compare two runs reduced with one plan (``plan``, or ``make_plan``'s ``options``),
    value by value (module docstring). ``rtol``/``atol``: a tolerance instead of bits (both
    default to 0 once either is given). The other options are ``run_plan``'s.

    >>> report = diff_runs("sample_logs/rl_run", "sample_logs/rl_run", keys=["trainer/*"])
    >>> report.equal, report.keys_compared
    (True, 4)
    """
    import numpy as np
    import polars as pl

    plan = plan_of(plan, options)
    for name, value in (("rtol", rtol), ("atol", atol)):
        if value is not None and not value >= 0:
            raise PlanError("must be a number, 0 or more", option=name, value=value)
    tolerant = rtol is not None or atol is not None
    a, b = reduce_runs(
        [run_a, run_b], plan, labels=["a", "b"], strict=strict, follow_symlinks=follow_symlinks,
        on_read=on_read, on_progress=on_progress, engine=engine, ray_address=ray_address,
    )  # fmt: skip
    bucket = bucket_column(plan)
    source = ["process"] if plan.mode is LoggingMode.PER_RANK_REDUCE else []
    keys_a, keys_b = set(a.frame["key"].to_list()), set(b.frame["key"].to_list())
    common = sorted(keys_a & keys_b)
    joined = (
        a.frame.filter(pl.col("key").is_in(common))
        .rename({"value": "a", "reduction": "reduction_a"})
        .join(
            b.frame.rename({"value": "b", "reduction": "reduction_b"}),
            on=[*source, bucket, "key"],
            how="full",
            coalesce=True,
        )
        .filter(pl.col("key").is_in(common))
        .sort([*source, "key", bucket])
    )
    va = joined["a"].fill_null(np.nan).to_numpy()
    vb = joined["b"].fill_null(np.nan).to_numpy()
    both = (joined["a"].is_not_null() & joined["b"].is_not_null()).to_numpy()
    nans = np.isnan(va) & np.isnan(vb)
    with np.errstate(invalid="ignore", over="ignore"):
        if tolerant:
            close = np.abs(va - vb) <= np.maximum(
                atol or 0.0, (rtol or 0.0) * np.maximum(np.abs(va), np.abs(vb))
            )
            same = (va == vb) | close | nans
        else:
            same = (va.view(np.int64) == vb.view(np.int64)) | nans
        difference = np.where(np.isfinite(va) & np.isfinite(vb), np.abs(va - vb), np.inf)
    joined = joined.with_columns(
        differ=pl.Series(both & ~same),
        difference=pl.Series(difference),
        only_a=pl.col("b").is_null(),
        only_b=pl.col("a").is_null(),
    )
    differs = pl.col("differ")

    def at_largest(column: str) -> pl.Expr:  # the first of the largest differences
        by = pl.col("difference").filter(differs)
        return pl.col(column).filter(differs).sort_by(by, descending=True, maintain_order=True).first()

    per_key = joined.group_by([*source, "key"], maintain_order=True).agg(
        differing=differs.sum(),
        first=pl.col(bucket).filter(differs).first(),
        first_a=pl.col("a").filter(differs).first(),
        first_b=pl.col("b").filter(differs).first(),
        largest=pl.col("difference").filter(differs).max(),
        largest_at=at_largest(bucket),
        largest_a=at_largest("a"),
        largest_b=at_largest("b"),
        only_in_a=pl.col(bucket).filter(pl.col("only_a")),
        only_in_b=pl.col(bucket).filter(pl.col("only_b")),
        reduction_a=pl.col("reduction_a").drop_nulls().first(),
        reduction_b=pl.col("reduction_b").drop_nulls().first(),
    )
    differences = []
    for row in per_key.iter_rows(named=True):
        reductions = (row.pop("reduction_a"), row.pop("reduction_b"))
        row["reductions"] = reductions if reductions[0] != reductions[1] else None
        if row["differing"] or row["only_in_a"] or row["only_in_b"] or row["reductions"]:
            differences.append(KeyDiff(process=row.pop("process", None), **row))
    return DiffReport(
        run_a=a.run_dir,
        run_b=b.run_dir,
        bucket=bucket,
        rtol=(rtol or 0.0) if tolerant else None,
        atol=(atol or 0.0) if tolerant else None,
        keys_compared=len(common),
        differences=differences,
        keys_only_in_a=sorted(keys_a - keys_b),
        keys_only_in_b=sorted(keys_b - keys_a),
    )


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
