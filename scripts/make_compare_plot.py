"""Write docs/compare_bands.png: five seeds of a small job in two groups by config.lr, drawn
by ``metriclog plot`` with several runs (a line per group, its std band).

    python scripts/make_compare_plot.py [--out docs/compare_bands.png]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

import metric_core
from metric_core import Reduce, make_plan
from metric_core.offline.plot import plot_runs

LRS = (3e-4, 3e-4, 3e-4, 1e-3, 1e-3)


def job(run_dir: Path, seed: int, lr: float, steps: int) -> None:
    """A loss that falls faster with the larger lr, at a pace and with noise of its seed."""
    rng = np.random.default_rng(seed)
    pace = lr * 20 * (1 + 0.2 * float(rng.normal()))
    metric_core.init(run_dir, rank=0, process_name="trainer", config={"lr": lr, "seed": seed})
    for step in range(steps):
        for _ in range(4):
            loss = 2.0 * np.exp(-step * pace) + 0.3 + float(rng.normal(0, 0.08))
            metric_core.record_metric("train/loss", loss, Reduce.MEAN)
        metric_core.flush(step)
    metric_core.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    docs = Path(__file__).resolve().parent.parent / "docs"
    parser.add_argument("--out", default=str(docs / "compare_bands.png"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for seed, lr in enumerate(LRS):
            runs.append(Path(tmp) / f"seed{seed}")
            job(runs[-1], seed, lr, steps=200 - 25 * (seed % 3))  # seeds that stopped early
        plan = make_plan(keys=["train/loss"])
        plot_runs(runs, plan, args.out, group_by="config.lr", band="std", smooth=0.6)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
