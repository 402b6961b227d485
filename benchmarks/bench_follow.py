"""The sidecar (`upload --follow`) against live per-rank W&B logging: latency and cost.

A job of N writer processes, each recording 20 keys at 10 steps a second (`flush(step)`
after each step) for --seconds, all starting together:

  latency   with a sidecar following the run (global_reduce, W&B offline, --interval 1):
            for each step, from the moment the last rank's flush(step) returned to the
            moment the sidecar's `run.log` of that step's row returned. Median and p99
            over the steps; target: median <= flush_interval (1 s) + 1 s.
  sidecar   the sidecar process's CPU (user + system, with the wandb service it waits
            for) per 1,000 records followed.
  training  each rank's own CPU per record (process time, and its children's: a live
            backend's wandb service), three ways, the same job each time:
              metriclog  files only (the sidecar runs beside them, not counted here)
              live       the seed's way: the wandb backend per rank, per_rank_reduce
                         (one run.log a step, 20 keys)
              stream     the wandb backend per rank, per_rank_no_reduce (a run.log a value)
            Target: metriclog's at least 50x below live.

Live W&B processes need about 135 MiB each, so the live rounds run at 4 and 32 ranks.

Usage: python benchmarks/bench_follow.py [--ranks 4,32,128] [--live-ranks 4,32] [--seconds 15]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

KEYS = 20
STEPS_PER_S = 10

WRITER = """
import json, os, sys, time
c = json.loads(sys.argv[1])
import metric_core
from metric_core import Reduce, record_metric
backends = None
if c["live"]:
    backends = {"wandb": {"project": "bench", "mode": "offline", "dir": c["wandb_dir"],
                          "logging_mode": c["live"]}}
if not c["bare"]:
    metric_core.init(c["run"], rank=c["rank"], process_name=f"Trainer_r{c['rank']}", world_size=c["world"],
                     backends=backends)
keys = [f"trainer/metric_{i:02d}" for i in range(c["keys"])]
flushed = []
while time.time() < c["start"]:
    time.sleep(0.001)
cpu0 = time.process_time()
period = 1.0 / c["rate"]
for step in range(c["steps"]):
    if not c["bare"]:
        for i, key in enumerate(keys):
            record_metric(key, step * 0.001 + i, Reduce.MEAN)
        metric_core.flush(step)
    flushed.append(time.time())
    wake = c["start"] + (step + 1) * period
    delay = wake - time.time()
    if delay > 0:
        time.sleep(delay)
if not c["bare"]:
    metric_core.shutdown()
import resource
me = resource.getrusage(resource.RUSAGE_SELF)
kids = resource.getrusage(resource.RUSAGE_CHILDREN)
cpu = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
json.dump({"flushed": flushed, "cpu": cpu, "loop_cpu": time.process_time() - cpu0,
           "records": c["steps"] * c["keys"]}, open(c["out"], "w"))
"""

SIDECAR = """
import json, sys, time
from pathlib import Path
c = json.loads(sys.argv[1])
import wandb
from metric_core import make_plan
from metric_core.offline.upload import Follow, UploadEvents, WandB
from metric_core.offline.upload.follow import follow_upload
handed = {}

def init(**kwargs):
    run = wandb.init(**kwargs)
    log = run.log
    def timed(row):
        log(row)
        handed[row["step"]] = time.time()
    run.log = timed
    return run

upload, state = follow_upload(
    Path(c["run"]), make_plan(), WandB("bench", offline=True, init=init), name="bench", group=None,
    share_run=False, dry_run=False, force_new=False, follow_symlinks=False, strict=False,
    events=UploadEvents(), request={}, follow=Follow(interval=c["interval"]),
)
json.dump({"handed": handed, "records": state.records, "ended": state.ended}, open(c["out"], "w"))
"""


def job(tmp: Path, ranks: int, seconds: float, live: str | None, sidecar: bool, bare: bool = False) -> dict:
    """One job: its ranks' reports, and the sidecar's (with its CPU)."""
    run = tmp / f"run-{ranks}-{live or 'files'}-{time.monotonic_ns()}"
    run.mkdir()
    steps = int(seconds * STEPS_PER_S)
    start = time.time() + 3.0 + 0.25 * ranks  # every rank imported and initialized by then
    base = {"run": str(run), "world": ranks, "keys": KEYS, "rate": STEPS_PER_S, "steps": steps,
            "start": start, "live": live, "wandb_dir": str(tmp), "bare": bare}  # fmt: skip
    env = {**os.environ, "WANDB_SILENT": "true", "WANDB_MODE": "offline"}
    side = None
    if sidecar:
        config = {"run": str(run), "interval": 1.0, "out": str(run / "sidecar.json")}
        side = subprocess.Popen([sys.executable, "-c", SIDECAR, json.dumps(config)], env=env)
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, json.dumps({**base, "rank": r, "out": str(run / f"w{r}.json")})],
            env=env,
        )
        for r in range(ranks)
    ]
    for w in writers:
        w.wait()
    out: dict = {"ranks": [json.loads((run / f"w{r}.json").read_text()) for r in range(ranks)]}
    if side is not None:
        _, status, usage = os.wait4(side.pid, 0)
        side.returncode = os.waitstatus_to_exitcode(status)
        out["sidecar"] = json.loads((run / "sidecar.json").read_text())
        out["sidecar_cpu"] = usage.ru_utime + usage.ru_stime
    return out


def latency(result: dict) -> list[float]:
    ready = [max(r["flushed"][k] for r in result["ranks"]) for k in range(len(result["ranks"][0]["flushed"]))]
    handed = {int(k): t for k, t in result["sidecar"]["handed"].items()}
    return [handed[k] - ready[k] for k in range(len(ready)) if k in handed]


def per_record_us(result: dict, field: str = "cpu") -> float:
    ranks = result["ranks"]
    return 1e6 * sum(r[field] for r in ranks) / sum(r["records"] for r in ranks)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", default="4,32,128")
    parser.add_argument("--live-ranks", default="4,32")
    parser.add_argument("--seconds", type=float, default=15.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-follow-") as tmp:
        print(
            f"{KEYS} keys x {STEPS_PER_S} steps/s a rank, {args.seconds:.0f} s; sidecar --interval 1, offline"
        )
        head = ("ranks", "median s", "p99 s", "steps", "sidecar CPU ms/1k rec", "rank loop CPU us/rec")
        print(" ".join(f"{h:>{w}}" for h, w in zip(head, (5, 9, 7, 6, 22, 21), strict=True)))
        for n in (int(x) for x in args.ranks.split(",")):
            result = job(Path(tmp), n, args.seconds, None, sidecar=True)
            lat = sorted(latency(result))
            p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
            cpu = 1e3 * result["sidecar_cpu"] / (result["sidecar"]["records"] / 1000)
            print(
                f"{n:>5} {statistics.median(lat):>9.2f} {p99:>7.2f} {len(lat):>6} {cpu:>22.2f} "
                f"{per_record_us(result, 'loop_cpu'):>21.2f}"
            )
        print()
        print("training-side CPU per record, us: what logging adds to a rank's loop (all its threads), over")
        print("the same loop without logging (its sleeps and wake-ups: 'bare'); in brackets, the rank's")
        print("whole life with its reaped children (start-up, a live backend's wandb service), not net")
        head = ("ranks", "bare", "metriclog", "live", "stream", "live/ml", "stream/ml")
        print(" ".join(f"{h:>{w}}" for h, w in zip(head, (5, 6, 16, 16, 16, 8, 10), strict=True)))
        for n in (int(x) for x in args.live_ranks.split(",")):
            bare = per_record_us(job(Path(tmp), n, args.seconds, None, sidecar=False, bare=True), "loop_cpu")
            ours = job(Path(tmp), n, args.seconds, None, sidecar=False)
            live = job(Path(tmp), n, args.seconds, "per_rank_reduce", sidecar=False)
            stream = job(Path(tmp), n, args.seconds, "per_rank_no_reduce", sidecar=False)
            loops = [per_record_us(r, "loop_cpu") - bare for r in (ours, live, stream)]
            whole = [per_record_us(r) for r in (ours, live, stream)]
            cells = " ".join(f"{a:>6.1f} [{b:>7.1f}]" for a, b in zip(loops, whole, strict=True))
            print(f"{n:>5} {bare:>6.1f} {cells} {loops[1] / loops[0]:>7.1f}x {loops[2] / loops[0]:>9.1f}x")


if __name__ == "__main__":
    main()
