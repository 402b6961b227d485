"""``metriclog plot``: a PNG, SVG or PDF of some keys, with where sources stopped and where
values went bad.

* ``global_reduce``: a line per key, with the band of its sources' own values of the same
  statistic (lowest to highest; none for ``sum``, ``count`` and ``std``, whose whole is no
  source's);
* ``per_rank_reduce``: a line per source; past MAX_LINES sources in a panel, their median,
  the band from their 10th to 90th percentile, and their lowest and highest, per step;
* ``per_rank_no_reduce``: the raw points over wall-clock time, a colour per source; past
  RAW_POINTS points, each source's lowest and highest value in each of BINS time bins
  (the x label says so), so memory does not grow with the run.

A source that did not shut down cleanly gets a dashed vertical line where it stopped; the
first non-finite value of a source gets a dotted red line. One subplot per key, one legend
for the figure below them, wall-clock axes as local dates and times in one format, a line
of few points with its points marked. ``smooth`` draws each line as TensorBoard's
smoothing slider does (``ema``), the line as recorded faint behind it.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from pathlib import PurePosixPath
from typing import Any

import polars as pl

from metric_core.errors import MissingDependencyError, PlanError, RequestError, as_keyword, opt, warn
from metric_core.metric import LoggingMode
from metric_core.offline.engine import execute
from metric_core.offline.inspect import InspectReport, inspect_run
from metric_core.offline.inspect.health import state_said
from metric_core.offline.plan import Engine, ReducePlan, Statistic
from metric_core.offline.read import OnProgress, OnRead, RunScan, explain_read_errors, scan_run
from metric_core.offline.storage import run_path, written_at

MAX_KEYS = 12
FORMATS = (".png", ".svg", ".pdf")
MAX_LINES = 8  # sources drawn a line each in a panel; past them, their spread
# per_rank_no_reduce draws every point up to this many; past it, each source's lowest and
# highest value in each of BINS equal bins of the run's time (the shape a screen can show).
RAW_POINTS = 200_000
BINS = 2000


@explain_read_errors
def plot_run(
    run: RunScan | str | os.PathLike[str],
    plan: ReducePlan,
    out: str | os.PathLike[str] | None = None,
    *,
    follow_symlinks: bool = False,
    on_read: OnRead | None = None,
    on_progress: OnProgress | None = None,
    on_warning: Callable[[str], None] | None = None,
    spelling: Callable[[str], str] = as_keyword,
    engine: Engine | str = Engine.LOCAL,
    ray_address: str | None = None,
    smooth: float = 0.0,
) -> Any:
    """Draw ``plan``'s keys of a run (a directory, or a scan of one); save it to ``out`` (a
    .png, .svg or .pdf) if given; return the matplotlib Figure. ``smooth`` in [0, 1):
    TensorBoard's smoothing weight (``ema``). ``on_progress`` follows the reduction's read;
    ``on_warning`` gets what the plot cannot show and the filters that matched nothing (a
    ``MetricLogWarning`` by default), naming options as ``spelling`` does (``MetricLogError.text``).
    ``engine`` and ``ray_address`` say where the reductions run (``engine.execute``).
    Raises ``PlanError`` for a ``smooth`` outside [0, 1) or an ``out`` of another suffix,
    ``NoDataError`` when no record is left to draw, and what ``run_plan`` raises.

    >>> from metric_core import make_plan
    >>> fig = plot_run("sample_logs/rl_run", make_plan(keys=["trainer/loss"]))
    >>> fig.axes[0].get_ylabel().splitlines()  # the key, and the statistic its line shows
    ['trainer/loss', '(mean)']
    """
    _check_request(plan, out, smooth)
    scan = (
        run
        if isinstance(run, RunScan)
        else scan_run(run, follow_symlinks=follow_symlinks, attempts=plan.attempts)
    )
    if on_read is not None:
        on_read(scan.report)
    plt = _pyplot()
    health = inspect_run(scan)
    where = {"engine": engine, "ray_address": ray_address}
    reduced = execute(plan, scan, on_progress=on_progress, **where)
    if plan.mode is LoggingMode.PER_RANK_NO_REDUCE:
        result, decimated = _raw_points(reduced.batches(), health)
    else:
        result, decimated = reduced.frame, False
    for note in reduced.unmatched:
        (on_warning or warn)(note.text(spelling))
    keys = _keys(plan, result)
    recorders = {
        key: set(zip(part["process"], part["rank"], strict=True))
        for (key,), part in scan.frame.select("key", "process", "rank")
        .unique()
        .collect(engine="streaming")
        .partition_by("key", as_dict=True)
        .items()
    }
    families, missing = _fonts([scan.name, *keys])
    for text, chars in missing.items():
        (on_warning or warn)(
            f"'{text}' holds characters no installed font draws ({chars}): they show as boxes in the plot; "
            "install a font that has them (e.g. Noto Sans CJK), and the plot uses it"
        )
    with plt.rc_context({"font.family": ["DejaVu Sans", *families]}), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Glyph .* missing from font")  # said once, above
        band = _band(plan, scan, result, where) if plan.mode is LoggingMode.GLOBAL_REDUCE else None
        return _figure(plt, plan, scan, result, health, recorders, keys, decimated, band, out, smooth)


def _figure(
    plt: Any,
    plan: ReducePlan,
    scan: RunScan,
    result: pl.DataFrame,
    health: InspectReport,
    recorders: dict[str, set[tuple[str, int]]],
    keys: list[str],
    decimated: bool,
    band: dict[str, tuple[pl.DataFrame, str]] | None,
    out: str | os.PathLike[str] | None,
    smooth: float = 0.0,
) -> Any:
    """One subplot per key (``result``'s rows of it), the marks of ``health``, ``band``
    (global_reduce), one legend."""
    mode = plan.mode
    # constrained layout keeps the title, the axes and the figure's one legend apart
    fig, axes = plt.subplots(
        len(keys), 1, figsize=(10, 2.4 * len(keys) + 1.6), sharex=True, squeeze=False, layout="constrained"
    )
    x_col = "timestamp" if mode is LoggingMode.PER_RANK_NO_REDUCE else plan.bucket
    clock = x_col != "step"  # a wall-clock axis: matplotlib dates (days since 1970), local time
    x_of = (lambda v: v / 86400.0) if clock else (lambda v: v)
    for ax, key in zip(axes[:, 0], keys, strict=True):
        data = result.filter(pl.col("key") == key)
        if mode is LoggingMode.GLOBAL_REDUCE:
            x, y = x_of(data[x_col].to_numpy()), data["value"].to_numpy()
            stat = data["reduction"][0]
            _line(ax, x, y, smooth, color="C0", label=f"_{key}")  # the axis names it: not in the legend
            b = band[key][0] if band is not None and key in band else None
            if b is not None and (b["lo"] < b["hi"]).any():  # no spread (one source): no band, none said
                ax.fill_between(
                    x_of(b[plan.bucket].to_numpy()),
                    b["lo"].to_numpy(),
                    b["hi"].to_numpy(),
                    alpha=0.25,
                    color="C0",
                    label="lowest to highest of the sources' own values of the statistic",
                )
        elif mode is LoggingMode.PER_RANK_REDUCE and data.select("process", "rank").n_unique() > MAX_LINES:
            _spread(ax, data, x_col, x_of, smooth)
        else:
            for i, ((process, rank), part) in enumerate(
                data.partition_by("process", "rank", as_dict=True, maintain_order=True).items()
            ):
                x, y = x_of(part[x_col].to_numpy()), part["value"].to_numpy()
                style = {"color": f"C{i % 10}", "label": f"{process} (rank {rank})"}
                if mode is LoggingMode.PER_RANK_REDUCE:
                    _line(ax, x, y, smooth, **style)
                else:
                    ax.plot(x, y, linestyle="none", marker=".", markersize=3, **style)
        _mark(ax, health, key, x_col, recorders.get(key, set()), x_of)
        ax.set_ylabel(f"{key}\n({stat})" if mode is LoggingMode.GLOBAL_REDUCE else key)
        ax.grid(alpha=0.3)
    if clock:
        _date_axis(axes[-1, 0])
    x_label = {
        "step": "step",
        "window_start": f"window start ({_local_zone()})",
        "timestamp": f"wall-clock time ({_local_zone()})",
    }
    axes[-1, 0].set_xlabel(
        x_label[x_col]
        + (f"; decimated: lowest and highest of {BINS:,} time bins per source" if decimated else "")
        + (f"; lines smoothed as TensorBoard does (weight {smooth:g}), faint: as recorded" if smooth else "")
    )
    _one_legend(fig, axes[:, 0])
    fig.suptitle(f"{scan.name}: {', '.join(keys) if len(keys) < 4 else f'{len(keys)} keys'} ({mode.value})")
    return _saved(fig, out)


def plot_runs(
    runs: Sequence[str | os.PathLike[str]],
    plan: ReducePlan,
    out: str | os.PathLike[str] | None = None,
    *,
    group_by: str | None = None,
    keep_missing: bool = False,
    labels: Sequence[str] | None = None,
    band: str = "std",
    smooth: float = 0.0,
    follow_symlinks: bool = False,
    on_read: OnRead | None = None,
    on_progress: OnProgress | None = None,
    engine: Engine | str = Engine.LOCAL,
    ray_address: str | None = None,
) -> Any:
    """Draw ``plan``'s keys (global_reduce) of several runs, grouped as ``compare_runs``
    groups them (``group_by``, ``keep_missing``, ``labels``): per group, a line of the mean
    across its runs and a shaded ``band``: ``std`` (mean ± the population std), ``stderr``
    (mean ± the standard error) or ``minmax`` (lowest to highest run). ``smooth`` smooths
    each run's line (``ema``) before the runs are aggregated. Where fewer runs of a group
    hold a step than before, their count is written on its line. Saved to ``out`` if given;
    returns the matplotlib Figure.

    >>> from metric_core import make_plan
    >>> fig = plot_runs(["sample_logs/rl_run"], make_plan(keys=["trainer/loss"]), band="minmax")
    >>> fig.axes[0].get_ylabel().splitlines()
    ['trainer/loss', '(mean)']
    """
    from metric_core.offline.compare import across_runs, bucket_column, group_rows, reduce_runs

    _check_request(plan, out, smooth)
    if plan.mode is not LoggingMode.GLOBAL_REDUCE:
        raise PlanError(
            "draws a line per group of runs: plot several runs in global_reduce, or one run in another mode",
            option="mode",
            value=plan.mode.value,
        )
    if band not in BANDS:
        raise PlanError(f"is not one of {', '.join(BANDS)}", option="band", value=band)
    plt = _pyplot()
    reduced = reduce_runs(
        runs, plan, labels=labels, follow_symlinks=follow_symlinks, on_read=on_read, on_progress=on_progress,
        engine=engine, ray_address=ray_address,
    )  # fmt: skip
    x_col = bucket_column(plan)
    if smooth:
        reduced = [dataclasses.replace(r, frame=_smoothed(r.frame, x_col, smooth)) for r in reduced]
    rows, groups, order = group_rows(reduced, group_by, keep_missing)
    stats = across_runs(rows, ["group", x_col, "key"], ("mean", "std", "stderr", "min", "max"))
    keys = _keys(plan, stats)
    fig, axes = plt.subplots(
        len(keys), 1, figsize=(10, 2.4 * len(keys) + 1.6), sharex=True, squeeze=False, layout="constrained"
    )
    for ax, key in zip(axes[:, 0], keys, strict=True):
        for g, value in enumerate(order):
            part = stats.filter((pl.col("group") == g) & (pl.col("key") == key)).sort(x_col)
            n = list(groups.values()).count(value)
            name = "runs" if group_by is None else f"{group_by}={'(none)' if value is None else value}"
            _banded(ax, part, x_col, band, n, color=f"C{g % 10}", label=f"{name}: mean of {n} run(s)")
        ax.set_ylabel(f"{key}\n({stats.filter(pl.col('key') == key)['reduction'][0]})")
        ax.grid(alpha=0.3)
    said = {
        "std": "mean ± std (population)",
        "stderr": "mean ± standard error",
        "minmax": "lowest to highest",
    }
    axes[-1, 0].set_xlabel(
        ("step" if x_col == "step" else "seconds from each run's first record")
        + f"; band: {said[band]} across runs"
        + (f"; each run smoothed as TensorBoard does (weight {smooth:g})" if smooth else "")
    )
    _one_legend(fig, axes[:, 0])
    fig.suptitle(f"{len(reduced)} runs: {', '.join(keys) if len(keys) < 4 else f'{len(keys)} keys'}")
    return _saved(fig, out)


BANDS = ("std", "stderr", "minmax")


def _banded(ax: Any, part: pl.DataFrame, x_col: str, band: str, n: int, **style: Any) -> None:
    """A group's mean line, its band, and its count of runs where that drops."""
    import numpy as np

    x, mean, count = part[x_col].to_numpy(), part["mean"].to_numpy(), part["count"].to_numpy()
    if band == "minmax":
        lo, hi = part["min"].to_numpy(), part["max"].to_numpy()
    else:
        spread = part[band].to_numpy().astype(np.float64)  # null (one run) as NaN: no band there
        lo, hi = mean - spread, mean + spread
    ax.plot(x, mean, marker=_marker(x), **style)
    ax.fill_between(x, lo, hi, alpha=0.2, color=style["color"], label="_band")
    for i in np.flatnonzero((count < np.r_[n, count[:-1]]) & (count < n)):
        ax.annotate(
            f"{count[i]} of {n}", (x[i], mean[i]), textcoords="offset points", xytext=(2, 4),
            fontsize="x-small", color=style["color"],
        )  # fmt: skip


def _smoothed(frame: pl.DataFrame, x_col: str, weight: float) -> pl.DataFrame:
    """Each key's line of one run smoothed (``ema``), in the order of its steps."""
    parts = [
        part.sort(x_col).with_columns(value=pl.Series(ema(part.sort(x_col)["value"].to_numpy(), weight)))
        for part in frame.partition_by("key", maintain_order=True)
    ]
    return pl.concat(parts)


def _check_request(plan: ReducePlan, out: str | os.PathLike[str] | None, smooth: float) -> None:
    if out is not None and PurePosixPath(str(out)).suffix.lower() not in FORMATS:
        raise PlanError("is not a .png, .svg or .pdf file", option="out", value=str(out))
    if not 0.0 <= smooth < 1.0:
        raise PlanError(
            "is a weight of the past from 0 (none) to below 1", option="smooth", value=str(smooth)
        )
    if not plan.keys:
        raise PlanError("choose the keys to plot, e.g. " + opt("keys") + "'trainer/*'")


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingDependencyError(
            "metriclog plot needs matplotlib: pip install 'metriclog[plot]'"
        ) from None
    return plt


def _keys(plan: ReducePlan, result: pl.DataFrame) -> list[str]:
    keys = sorted(result["key"].unique().to_list())
    if len(keys) > MAX_KEYS:
        raise RequestError(
            "the keys chosen ("
            + opt("keys")
            + f"{' '.join(plan.keys)}) are {len(keys)}; plot at most {MAX_KEYS} "
            "at once (narrow the pattern)"
        )
    return keys


def _saved(fig: Any, out: str | os.PathLike[str] | None) -> Any:
    if out is not None:
        with written_at(run_path(out)) as local:
            local.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(local, dpi=110)  # the format by the suffix: PNG, SVG or PDF
    return fig


def ema(values: Any, weight: float) -> Any:
    """TensorBoard's smoothing of a line: an exponential moving average with ``weight`` of
    the past, debiased (the first points are not pulled toward 0); a non-finite value is
    kept as it is and skipped by the average; a constant line is kept as it is.

    >>> ema([1.0, 2.0, float("nan"), 3.0], 0.5).tolist()
    [1.0, 1.6666666666666667, nan, 2.4285714285714284]
    """
    import numpy as np

    y = np.asarray(values, dtype=np.float64)
    out = y.copy()
    if len(y) == 0 or weight == 0 or bool((y == y[0]).all()):
        return out
    last, n = 0.0, 0
    for i, v in enumerate(y):
        if np.isfinite(v):
            last = last * weight + (1 - weight) * v
            n += 1
            out[i] = last / (1 - weight**n)
    return out


def _line(ax: Any, x: Any, y: Any, smooth: float, **style: Any) -> None:
    """A line as recorded, or smoothed with the recorded one faint behind it."""
    if not smooth:
        ax.plot(x, y, marker=_marker(x), **style)
        return
    ax.plot(x, y, alpha=0.25, linewidth=1, color=style.get("color"), label="_raw")
    ax.plot(x, ema(y, smooth), marker=_marker(x), **style)


def _spread(ax: Any, data: pl.DataFrame, x_col: str, x_of: Callable[[Any], Any], smooth: float) -> None:
    """Many sources in a panel: per x, their finite values' median, the band from their 10th
    to 90th percentile, and their lowest and highest (said in the legend)."""
    n = data.select("process", "rank").n_unique()
    v = pl.col("value").filter(pl.col("value").is_finite())  # a non-finite value has its own mark
    per = (
        data.group_by(x_col)
        .agg(
            mid=v.median(),
            p10=v.quantile(0.1, "linear"),
            p90=v.quantile(0.9, "linear"),
            lo=v.min(),
            hi=v.max(),
        )
        .sort(x_col)
    )
    x = x_of(per[x_col].to_numpy())
    ax.fill_between(
        x,
        per["p10"].to_numpy(),
        per["p90"].to_numpy(),
        alpha=0.25,
        color="C0",
        label=f"10-90% of {n} sources",
    )
    ax.plot(
        x,
        per["lo"].to_numpy(),
        color="C0",
        linewidth=0.6,
        linestyle="--",
        label=f"lowest and highest of {n} sources",
    )
    ax.plot(x, per["hi"].to_numpy(), color="C0", linewidth=0.6, linestyle="--", label="_hi")
    _line(ax, x, per["mid"].to_numpy(), smooth, color="C0", label=f"median of {n} sources")


# Statistics whose per-source values bracket the global one (and pNN). A sum or a count of
# the whole is not among its sources' (the band would sit far below the line), nor is a std
# (the whole's spreads across sources too), so they get none.
BANDED = frozenset({"mean", "max", "min", "median", "first", "last"})


def _band(
    plan: ReducePlan, scan: RunScan, result: pl.DataFrame, where: dict[str, Any]
) -> dict[str, tuple[pl.DataFrame, str]]:
    """Per key, the lowest and highest per-source value of the statistic the line shows
    (each source reduced with that same statistic), where that statistic has a band."""
    stats = dict(result.group_by("key").agg(pl.col("reduction").first()).iter_rows())
    banded = [k for k, stat in stats.items() if stat in BANDED or stat.startswith("p")]
    if not banded:
        return {}
    # each key's line statistic, for every source: what the global reduction used
    same = tuple((glob.escape(k), Statistic.parse(stats[k])) for k in banded)
    per_source = execute(
        dataclasses.replace(plan, mode=LoggingMode.PER_RANK_REDUCE, overrides=plan.overrides + same),
        scan,
        **where,
    ).frame
    lows = per_source.group_by(plan.bucket, "key").agg(lo=pl.col("value").min(), hi=pl.col("value").max())
    return {
        key: (part.sort(plan.bucket), stats[key])
        for (key,), part in lows.partition_by("key", as_dict=True).items()
        if key in banded
    }


def _marker(x: Any) -> str | None:
    """A line of few points shows them (one point alone draws no line)."""
    return "o" if len(x) <= 30 else None


def _local_zone() -> str:
    offset = datetime.now().astimezone().strftime("%z")
    return f"local time, UTC{offset[:3]}:{offset[3:]}"


def _date_axis(ax: Any) -> None:
    import matplotlib.dates as mdates
    from dateutil import tz

    locator = mdates.AutoDateLocator(tz=tz.tzlocal())
    ax.xaxis.set_major_locator(locator)
    low, high = ax.get_xlim()  # days: one format for every tick, by the span shown
    span = (high - low) * 86400.0
    shape = "%H:%M:%S" if span < 600 else "%H:%M" if span < 86400 else "%m-%d %H:%M"
    ax.xaxis.set_major_formatter(mdates.DateFormatter(shape, tz=tz.tzlocal()))


def _one_legend(fig: Any, axes: Any) -> None:
    """Every subplot's labels once, in one legend below the axes."""
    seen: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(label, handle)
    if seen:
        fig.legend(
            seen.values(), seen.keys(), loc="outside lower center", ncols=min(3, len(seen)), fontsize="small"
        )


def _fonts(texts: Iterable[str]) -> tuple[list[str], dict[str, str]]:
    """The installed font families that draw the characters of ``texts`` matplotlib's own
    font lacks (to fall back on), and per text the characters no installed font draws."""
    from matplotlib import font_manager
    from matplotlib.ft2font import FT2Font

    wanted = {c for text in texts for c in text if not c.isascii()}
    if not wanted:
        return [], {}
    found: dict[str, str] = {}  # a character -> the first family that draws it
    for entry in font_manager.fontManager.ttflist:
        if entry.name.startswith("Last Resort"):  # matplotlib's own: a box for every character
            continue
        try:
            charmap = FT2Font(entry.fname).get_charmap()
        except (OSError, RuntimeError, ValueError):
            continue
        for c in wanted - found.keys():
            if ord(c) in charmap:
                found[c] = entry.name
    missing = {t: "".join(c for c in dict.fromkeys(t) if not c.isascii() and c not in found) for t in texts}
    return list(dict.fromkeys(found.values())), {t: chars for t, chars in missing.items() if chars}


def _mark(
    ax: Any,
    health: InspectReport,
    key: str,
    x_col: str,
    recorders: set[tuple[str, int]],
    x_of: Callable[[Any], Any],
) -> None:
    """Dashed line where a source of this key stopped; dotted red line at its first non-finite
    value (``x_of``: a step, or epoch seconds, as the axis places it)."""
    for source in health.sources:
        if source.status == "finished" or (source.process, source.rank) not in recorders:
            continue
        x = x_of(source.last_timestamp if x_col != "step" else source.last_step)
        ax.axvline(
            x, color="grey", linestyle="--", linewidth=1, label=f"{source.process} {state_said(source)}"
        )
    for item in health.nonfinite:
        if item.key != key:
            continue
        x = x_of(item.first_timestamp if x_col != "step" else item.first_step)
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
