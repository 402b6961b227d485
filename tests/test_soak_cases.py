"""Runs the soak left behind where its seed alone does not make them again (the damage
depended on when its ranks were killed): kept as files, each with what it found."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

CASES = Path(__file__).parent / "soak" / "cases"
METRICLOG = str(Path(sys.executable).with_name("metriclog"))


def test_a_damaged_restarted_run_is_read_alike_by_every_command(tmp_path):
    """Seed 659228941: a segment whose metadata and first row group are damaged. ``reduce``
    skipped the row group (its pages fail their checksums), while upload's and plot's
    polars reads decoded it and failed ('Dictionary Index is out-of-bounds'), and
    ``--strict`` let the skip through."""
    run = shutil.copytree(CASES / "seed-659228941", tmp_path / "run")

    def metriclog(*args: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run([METRICLOG, *map(str, args)], capture_output=True, text=True, timeout=120)

    skipped = "33 record(s) skipped: 33 x row group 0 cannot be read"
    reduced = metriclog("reduce", run, "--mode", "per_rank_reduce", "--out", tmp_path / "r.parquet")
    assert reduced.returncode == 0, reduced.stderr
    assert skipped in reduced.stderr
    uploaded = metriclog(
        "upload", run, "--to", "tensorboard", "--logdir", tmp_path / "tb", "--mode", "per_rank_reduce"
    )
    assert uploaded.returncode == 0, uploaded.stderr
    assert skipped in uploaded.stderr
    plotted = metriclog("plot", run, "--key", "zero_d01/sum", "--out", tmp_path / "p.png")
    assert plotted.returncode == 0, plotted.stderr
    assert (tmp_path / "p.png").stat().st_size > 0
    strict = metriclog("reduce", run, "--strict", "--out", tmp_path / "s.parquet")
    assert strict.returncode != 0
    assert skipped in strict.stderr and "Traceback" not in strict.stderr
    assert not (tmp_path / "s.parquet").exists()
