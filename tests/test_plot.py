"""Plots people read: SVG and PDF, TensorBoard's smoothing, the spread of many sources."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from metric_core import MetricCollector, Reduce, make_plan, plot_run

pytest.importorskip("matplotlib")


def tensorboard_ema(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing, written from its description: a debiased EMA that skips
    non-finite values (and keeps them), and keeps a constant line as it is."""
    if all(v == values[0] for v in values):
        return list(values)
    out, last, n = [], 0.0, 0
    for v in values:
        if not math.isfinite(v):
            out.append(v)
            continue
        last = last * weight + (1 - weight) * v
        n += 1
        out.append(last / (1 - weight**n))
    return out


def write(run, sources: int, steps: int, seed: int = 0) -> dict[tuple[int, int], float]:
    rng = np.random.default_rng(seed)
    truth = {}
    for rank in range(sources):
        c = MetricCollector(run, rank=rank, process_name=f"gen_r{rank}")
        for step in range(steps):
            value = float(rng.normal(step, 1.0)) if (rank, step) != (0, 5) else float("nan")
            c.record("loss", value, Reduce.MEAN)
            truth[(rank, step)] = value
            c.flush(step)
        c.shutdown()
    return truth


@pytest.mark.parametrize("suffix", [".svg", ".pdf"])
def test_svg_and_pdf_are_written_whole(tmp_path, suffix):
    write(tmp_path / "run", 2, 5)
    out = tmp_path / f"plot{suffix}"
    plot_run(tmp_path / "run", make_plan(keys=["loss"]), out)
    data = out.read_bytes()
    if suffix == ".svg":
        assert ET.fromstring(data).tag.endswith("svg")
    else:
        assert data.startswith(b"%PDF") and data.rstrip().endswith(b"%%EOF")


def test_smoothing_is_tensorboards_with_the_recorded_line_behind(tmp_path):
    truth = write(tmp_path / "run", 2, 20)
    fig = plot_run(tmp_path / "run", make_plan(keys=["loss"], mode="per_rank_reduce"), smooth=0.6)
    lines = fig.axes[0].get_lines()
    for rank in range(2):
        recorded = [truth[(rank, s)] for s in range(20)]
        raw = [
            ln
            for ln in lines
            if ln.get_alpha() == 0.25 and np.allclose(ln.get_ydata(), recorded, equal_nan=True)
        ]
        smoothed = [ln for ln in lines if ln.get_label() == f"gen_r{rank} (rank {rank})"]
        assert len(raw) == 1 and len(smoothed) == 1
        np.testing.assert_allclose(smoothed[0].get_ydata(), tensorboard_ema(recorded, 0.6), rtol=1e-12)
    assert np.isnan(lines[1].get_ydata()[5]) or any(np.isnan(ln.get_ydata()[5]) for ln in lines)


def test_past_eight_sources_a_panel_shows_their_spread_said_in_the_legend(tmp_path):
    truth = write(tmp_path / "run", 10, 6, seed=3)
    fig = plot_run(tmp_path / "run", make_plan(keys=["loss"], mode="per_rank_reduce"))
    ax = fig.axes[0]
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "median of 10 sources" in labels and "10-90% of 10 sources" in labels
    assert "lowest and highest of 10 sources" in labels
    assert not any(label.startswith("gen_r") for label in labels)  # no line a source
    (median,) = [ln for ln in ax.get_lines() if ln.get_label() == "median of 10 sources"]
    for step, y in zip(median.get_xdata(), median.get_ydata(), strict=True):
        values = [truth[(r, int(step))] for r in range(10)]
        values = [v for v in values if not math.isnan(v)] if any(math.isnan(v) for v in values) else values
        assert y == pytest.approx(float(np.median(values)), rel=1e-12) or math.isnan(y)
