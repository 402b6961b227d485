"""``metriclog plot``: a PNG of some keys, with where sources stopped and where values went bad.

* ``global_reduce``: a line per key, with the min-max band of the per-source reductions;
* ``per_rank_reduce``: a line per source;
* ``per_rank_no_reduce``: the raw points over wall-clock time, a colour per source; past
  RAW_POINTS points, each source's lowest and highest value in each of BINS time bins
  (the x label says so), so memory does not grow with the run.

A source that did not shut down cleanly gets a dashed vertical line where it stopped; the
first non-finite value of a source gets a dotted red line. One subplot per key.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import polars as pl

from metric_core.errors import MissingDependencyError, PlanError, RequestError
from metric_core.metric import LoggingMode
from metric_core.offline.engine import execute
from metric_core.offline.inspect import InspectReport, inspect_run
from metric_core.offline.plan import ReducePlan
from metric_core.offline.read import OnProgress, OnRead, RunScan, changed_files_said, scan_run

MAX_KEYS = 12
# per_rank_no_reduce draws every point up to this many; past it, each source's lowest and
# highest value in each of BINS equal bins of the run's time (the shape a screen can show).
RAW_POINTS = 200_000
BINS = 2000


@changed_files_said
def plot_run(
    run: RunScan | str | os.PathLike[str],
    plan: ReducePlan,
    out: str | os.PathLike[str] | None = None,
    *,
    follow_symlinks: bool = False,
    on_read: OnRead | None = None,
    on_progress: OnProgress | None = None,
) -> Any:
    """Draw ``plan``'s keys of a run (a directory, or a scan of one); save a PNG to ``out``
    if given; return the matplotlib Figure. ``on_progress`` follows the reduction's read.

    >>> from metric_core import make_plan
    >>> fig = plot_run("sample_logs/rl_run", make_plan(keys=["trainer/loss"]))
    >>> fig.axes[0].get_ylabel()
    'trainer/loss'
    """
    if out is not None and Path(out).suffix.lower() != ".png":
        raise PlanError("is not a PNG file: name it FILE.png", option="out", value=str(out))
    scan = (
        run
        if isinstance(run, RunScan)
        else scan_run(run, follow_symlinks=follow_symlinks, attempts=plan.attempts)
    )
    if on_read is not None:
        on_read(scan.report)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingDependencyError(
            "metriclog plot needs matplotlib: pip install 'metriclog[plot]'"
        ) from None
    if not plan.keys:
        raise PlanError("choose the keys to plot, e.g. {keys}'trainer/*'")
    health = inspect_run(scan)
    if plan.mode is LoggingMode.PER_RANK_NO_REDUCE:
        result, decimated = _raw_points(execute(plan, scan, on_progress=on_progress).batches(), health)
    else:
        result, decimated = execute(plan, scan, on_progress=on_progress).frame, False
    keys = sorted(result["key"].unique().to_list())
    if len(keys) > MAX_KEYS:
        raise RequestError(
            f"--key matches {len(keys)} keys; plot at most {MAX_KEYS} at once (narrow the pattern)"
        )
    recorders = {
        key: set(zip(part["process"], part["rank"], strict=True))
        for (key,), part in scan.frame.select("key", "process", "rank")
        .unique()
        .collect(engine="streaming")
        .partition_by("key", as_dict=True)
        .items()
    }
    mode = plan.mode
    band = None
    if mode is LoggingMode.GLOBAL_REDUCE:
        per_source = execute(dataclasses.replace(plan, mode=LoggingMode.PER_RANK_REDUCE), scan).frame
        band = per_source.group_by(plan.bucket, "key").agg(lo=pl.col("value").min(), hi=pl.col("value").max())
    fig, axes = plt.subplots(len(keys), 1, figsize=(10, 2.6 * len(keys) + 0.8), sharex=True, squeeze=False)
    x_col = "timestamp" if mode is LoggingMode.PER_RANK_NO_REDUCE else plan.bucket
    for ax, key in zip(axes[:, 0], keys, strict=True):
        data = result.filter(pl.col("key") == key)
        if mode is LoggingMode.GLOBAL_REDUCE:
            ax.plot(data[x_col].to_numpy(), data["value"].to_numpy(), label=f"{key} ({data['reduction'][0]})")
            if band is not None:
                b = band.filter(pl.col("key") == key).sort(plan.bucket)
                ax.fill_between(
                    b[plan.bucket].to_numpy(),
                    b["lo"].to_numpy(),
                    b["hi"].to_numpy(),
                    alpha=0.25,
                    label="min-max across sources",
                )
        else:
            for (process, rank), part in data.partition_by(
                "process", "rank", as_dict=True, maintain_order=True
            ).items():
                x, y = part[x_col].to_numpy(), part["value"].to_numpy()
                if mode is LoggingMode.PER_RANK_REDUCE:
                    ax.plot(x, y, label=f"{process} (rank {rank})")
                else:
                    ax.plot(
                        x, y, linestyle="none", marker=".", markersize=3, label=f"{process} (rank {rank})"
                    )
        _mark(ax, health, key, x_col, recorders.get(key, set()))
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="best")
    x_label = {
        "step": "step",
        "window_start": "window start (epoch s)",
        "timestamp": "wall-clock time (epoch s)",
    }
    axes[-1, 0].set_xlabel(
        x_label[x_col]
        + (f"; decimated: lowest and highest of {BINS:,} time bins per source" if decimated else "")
    )
    fig.suptitle(f"{scan.name}: {', '.join(keys) if len(keys) < 4 else f'{len(keys)} keys'} ({mode.value})")
    fig.tight_layout()
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(Path(out), dpi=110)
    return fig


def _mark(ax: Any, health: InspectReport, key: str, x_col: str, recorders: set[tuple[str, int]]) -> None:
    """Dashed line where a source of this key stopped; dotted red line at its first non-finite value."""
    for source in health.sources:
        if source.status == "finished" or (source.process, source.rank) not in recorders:
            continue
        x = source.last_timestamp if x_col != "step" else source.last_step
        ax.axvline(
            x, color="grey", linestyle="--", linewidth=1, label=f"{source.process} stopped ({source.status})"
        )
    for item in health.nonfinite:
        if item.key != key:
            continue
        x = item.first_timestamp if x_col != "step" else item.first_step
        ax.axvline(
            x, color="red", linestyle=":", linewidth=1.5, label=f"non-finite from here: {item.process}"
        )


def _raw_points(batches: Iterable[pl.DataFrame], health: InspectReport) -> tuple[pl.DataFrame, bool]:
    """Every raw point of ``batches``, or, past RAW_POINTS of them, each source's and key's
    lowest and highest value of each of BINS bins of the run's time (and whether it is so),
    holding at most RAW_POINTS points, or the bins', at a time."""
    lo = min(s.first_timestamp for s in health.sources)
    width = max((max(s.last_timestamp for s in health.sources) - lo) / BINS, 1e-9)
    series = ["process", "rank", "key"]
    kept: list[pl.DataFrame] = []
    held = 0
    bins: pl.DataFrame | None = None  # once past RAW_POINTS
    for batch in batches:
        if bins is None:
            kept.append(batch)
            held += batch.height
            if held <= RAW_POINTS:
                continue
            batch, kept = pl.concat(kept), []
        point = [c for c in batch.columns if c not in series]  # step or window_start, ...
        binned = batch.select(
            *series,
            _bin=((pl.col("timestamp") - lo) / width).floor().clip(0, BINS - 1),
            **{f"{c}_{end}": pl.col(c) for end in ("lo", "hi") for c in point},
        )
        bins = _lowest_highest(binned if bins is None else pl.concat([bins, binned]), series, point)
    if bins is None:
        return pl.concat(kept), False
    ends = [bins.select(*series, *[pl.col(f"{c}_{end}").alias(c) for c in point]) for end in ("lo", "hi")]
    return pl.concat(ends).unique(maintain_order=True).sort(*series, "timestamp"), True


def _lowest_highest(bins: pl.DataFrame, series: list[str], point: list[str]) -> pl.DataFrame:
    """Per source, key and bin, the point (``point``'s columns) with the lowest value
    (``_lo``) and the one with the highest (``_hi``)."""
    lo, hi = pl.col("value_lo"), pl.col("value_hi")
    return bins.group_by(*series, "_bin").agg(
        *[pl.col(f"{c}_lo").get(lo.arg_min()) for c in point],
        *[pl.col(f"{c}_hi").get(hi.arg_max()) for c in point],
    )
