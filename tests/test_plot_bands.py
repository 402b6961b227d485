"""plot of several runs: a line per group (the mean across its runs) and a band, against
fractions over each run's own reduce output."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from metriclog.main import app
from typer.testing import CliRunner

from metric_core import make_plan
from metric_core.offline.engine import reduce_run
from metric_core.offline.plot import ema, plot_runs

from .test_compare import LRS, correctly_rounded_sqrt, seeds  # noqa: F401 (the fixture)

pytest.importorskip("matplotlib")
runner = CliRunner()


def per_group(runs, key, smooth=0.0):
    """Per lr: step -> the runs' values of ``key`` (each run's line smoothed first)."""
    out: dict[float, dict[int, list[float]]] = {}
    for run, lr in zip(runs, LRS, strict=True):
        frame = reduce_run(run, keys=[key]).sort("step")
        values = ema(frame["value"].to_numpy(), smooth) if smooth else frame["value"].to_numpy()
        for step, value in zip(frame["step"].to_list(), values.tolist(), strict=True):
            out.setdefault(lr, {}).setdefault(step, []).append(value)
    return out


@pytest.mark.parametrize(("band", "smooth"), [("std", 0.0), ("stderr", 0.6), ("minmax", 0.0)])
def test_a_line_and_a_band_per_group(seeds, tmp_path, band, smooth):  # noqa: F811
    fig = plot_runs(seeds, make_plan(keys=["loss"]), tmp_path / "bands.png", group_by="config.lr", band=band,
                    smooth=smooth)  # fmt: skip
    assert (tmp_path / "bands.png").stat().st_size > 0
    (ax,) = fig.axes
    truth = per_group(seeds, "loss", smooth)
    lines = {line.get_label(): line for line in ax.get_lines()}
    bands = [c for c in ax.collections if c.get_label() == "_band"]
    assert len(bands) == 2
    for i, lr in enumerate(sorted(truth)):  # groups in the order of their values: 0.01, then 0.1
        steps = sorted(truth[lr])
        n = len(truth[lr][0])
        line = lines[f"config.lr={lr}: mean of {n} run(s)"]
        want = [float(sum(map(Fraction, truth[lr][s])) / len(truth[lr][s])) for s in steps]
        assert line.get_xdata().tolist() == steps and line.get_ydata().tolist() == want
        lows = np.concatenate([path.vertices[:, 1] for path in bands[i].get_paths()])
        for s, mean in zip(steps, want, strict=True):
            values = [Fraction(v) for v in truth[lr][s]]
            m = sum(values) / len(values)
            ss = sum((v - m) ** 2 for v in values)
            if band == "minmax":
                low = min(truth[lr][s])
            elif band == "std":
                low = mean - correctly_rounded_sqrt(ss / len(values))
            elif len(values) > 1:
                low = mean - correctly_rounded_sqrt(ss / (len(values) - 1) / len(values))
            else:
                continue  # one run: no standard error, no band
            assert low in lows, (lr, s)
    said = {t.get_text() for t in ax.texts}
    assert said == {"2 of 3", "1 of 3", "1 of 2"}  # where runs of a group end


def test_the_command_draws_several_runs_and_one_run_as_before(seeds, tmp_path):  # noqa: F811
    many = runner.invoke(app, ["plot", *map(str, seeds), "--key", "loss", "--group-by", "config.lr",
                               "--band", "minmax", "--out", str(tmp_path / "m.svg")])  # fmt: skip
    assert many.exit_code == 0, many.output
    assert (tmp_path / "m.svg").read_text().count("<svg") == 1
    one = runner.invoke(app, ["plot", str(seeds[0]), "--key", "loss", "--out", str(tmp_path / "o.png")])
    assert one.exit_code == 0, one.output
    refused = runner.invoke(app, ["plot", *map(str, seeds[:2]), "--key", "loss", "--mode", "per_rank_reduce",
                                  "--out", str(tmp_path / "x.png")])  # fmt: skip
    assert refused.exit_code == 2
    assert "draws a line per group of runs" in refused.stderr
