"""Write sample_logs/rl_run: a small RL-style run, through metric_core's own writer.

Four sources over 300 steps: two trainers (Parquet) and two generators (JSONL).
GeneratorActor_r1 dies at step 181: it is written by a child process that is then
SIGKILLed, leaving its open journal as any kill does, and its last frame is cut short,
as when the kill lands mid-write. Values and timestamps are seeded, so reruns give the same records.

Usage: python scripts/make_sample_logs.py [OUT_DIR]   (default sample_logs/rl_run)
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np

from metric_core import Metric, MetricCollector, Reduce, run_json

STEPS = 300
START = 1_760_000_000.0  # 2025-10-09 08:53:20 UTC
STEP_SECONDS = 6.0
KILLED = ("GeneratorActor_r1", 1, 181)


def trainer(c: MetricCollector, rank: int, rng: np.random.Generator) -> None:
    for step in range(STEPS):
        t = START + step * STEP_SECONDS + rank * 0.05
        base = 2.5 * np.exp(-step / 120) + 0.4
        for _ in range(4):
            t += 1.2
            c.push(Metric("trainer/loss", base + rng.normal(0, 0.05), Reduce.MEAN, t))
        c.push(
            Metric("trainer/grad_norm", abs(rng.normal(1.0, 0.3)) * (1 + 3 * (step % 97 == 0)), Reduce.MAX, t)
        )
        c.push(Metric("trainer/lr", 3e-4 * min(1.0, (step + 1) / 50), Reduce.MEAN, t))
        c.push(Metric("trainer/tokens_per_s", rng.normal(5.1e4, 2e3), Reduce.SUM, t))
        c.flush(step)


def generator(c: MetricCollector, rank: int, rng: np.random.Generator, stop_at: int | None) -> None:
    for step in range(STEPS if stop_at is None else stop_at):
        t = START + step * STEP_SECONDS + 0.5 + rank * 0.07
        for _ in range(8):
            t += 0.6
            c.push(Metric("policy/tokens_generated", float(rng.integers(200, 1200)), Reduce.SUM, t))
            c.push(Metric("policy/latency_s", rng.lognormal(0.3, 0.4), Reduce.MEAN, t))
            c.push(Metric("policy/reward", rng.normal(0.1 + step / 400, 0.5), Reduce.MEAN, t))
        c.push(Metric("policy/latency_std_s", rng.lognormal(0.3, 0.4), Reduce.STD, t))
        c.flush(step)


def main(out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / "run.json").write_bytes(  # as rank 0's init() writes it, with its checksum
        run_json.encode(
            {
                "name": out.name,
                "run_id": "5a3c0e6b9f2d4a18b7e1c0d2f4a6b8c9",  # fixed: the sample is regenerated alike
                "world_size": 2,
                "config": {"model": "toy-policy-1b", "lr": 3e-4, "batch_size": 64, "algorithm": "grpo"},
            }
        )
    )
    for process, rank, fmt in (
        ("TrainActor_r0", 0, "parquet"),
        ("TrainActor_r1", 1, "parquet"),
        ("GeneratorActor_r0", 0, "jsonl"),
        ("GeneratorActor_r1", 1, "jsonl"),
    ):
        rng = np.random.default_rng(1000 + 10 * rank + len(process))
        if process == KILLED[0]:
            killed(out, process, rank, fmt, rng)
            continue
        # Small segments, so the sample shows several sealed files per source.
        c = MetricCollector(out, rank=rank, process_name=process, file_format=fmt, segment_records=3000)
        if process.startswith("Train"):
            trainer(c, rank, rng)
        else:
            generator(c, rank, rng, None)
        c.shutdown()
    print(f"wrote {out}")


def killed(out: Path, process: str, rank: int, fmt: str, rng: np.random.Generator) -> None:
    """The source that dies: written by a child process, which is SIGKILLed at step 181."""
    pid = os.fork()
    if pid == 0:
        c = MetricCollector(
            out, rank=rank, process_name=process, file_format=fmt, segment_records=3000, flush_interval=0.1
        )
        generator(c, rank, rng, KILLED[2])
        time.sleep(1.0)  # its writer thread seals the full segments, as it would have by then
        os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    (journal,) = out.glob(f"{process}.*.journal")
    data = journal.read_bytes()
    journal.write_bytes(data[: len(data) - 100])  # the kill cut the last write short
    (out / f".{process}.r{rank}.lock").unlink()  # a kill leaves its lock file: not data, not kept here


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("sample_logs/rl_run"))
