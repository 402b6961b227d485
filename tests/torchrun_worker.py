"""One rank of a real ``torchrun`` job (gloo) for tests/culprit_trials.py: every step ends in
``dist.all_reduce``; rank SLEEPER sleeps SECONDS at step AT in a function of its own, before
its flush of the step or after it.

    python -m torch.distributed.run --nproc_per_node 4 tests/torchrun_worker.py \
        RUN_DIR STEPS SLEEPER AT SECONDS before|after
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

import metric_core
from metric_core import Reduce


def data_wait(seconds: float) -> None:
    time.sleep(seconds)


def save_checkpoint(seconds: float) -> None:
    time.sleep(seconds)


def main() -> None:
    run_dir, steps, sleeper, at, seconds, order = sys.argv[1:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    metric_core.init(run_dir, process_name=f"Trainer_r{rank}", flush_interval=0.1, hang_dump_after=0)
    grad = torch.ones(1)
    for step in range(int(steps)):
        metric_core.record_metric("loss", 1.0 / (step + 1) + rank, Reduce.MEAN)
        hit = rank == int(sleeper) and step == int(at)
        if hit and order == "before":
            data_wait(float(seconds))
        dist.all_reduce(grad)
        metric_core.flush(step)
        if hit and order == "after":
            save_checkpoint(float(seconds))
    metric_core.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
