"""A random job from a seed: everything below comes from one ``random.Random(seed)``, so a
seed is the whole job (the values each rank records come from a seed drawn here too).

A job is a plain dict (JSON, kept beside the run as ``job.json``):

* ``format``: the writer's file format; ``keys``: every key with its reduction and the
  family of values it gets; ``sample_keys``: keys of ``Reduce.SAMPLE`` dicts;
* ``ranks``: per rank its steps, flush cadence, the writer's ``flush_interval`` and
  ``segment_records``, and what happens to it: a ``fault`` (``sigkill``, ``sigterm``,
  ``raise``, ``exit`` for ``os._exit``, ``hang``) at a step, a ``pause``, a ``restart``
  from a checkpoint into the same run directory after the fault;
* ``foreign``: another tool's file beside the writer's (Parquet or JSONL, the record
  schema of docs/format.md), or None;
* ``damage``: sealed files to damage after the job (bit flips, truncations), or [];
* ``follow``, ``live_upload``, ``uploads``: an ``upload --follow`` beside the job, a plain
  ``upload`` started while it runs, and the uploads and plot after it (every fifth seed);
* ``by_time``, ``overrides``: the ``--by time`` and ``--reduce`` commands of this job.
"""

from __future__ import annotations

import random

REDUCTIONS = ("mean", "sum", "max", "min", "std")
FAMILIES = ("count", "decimal", "offset", "nonfinite", "np_float32", "np_int64", "zero_d")
FAULTS = ("sigkill", "sigterm", "raise", "exit", "hang")
STATISTICS = (
    "mean",
    "sum",
    "max",
    "min",
    "std",
    "count",
    "first",
    "last",
    "median",
    "p0",
    "p50",
    "p90",
    "p99.9",
    "p100",
)
MODES = ("global_reduce", "per_rank_reduce", "per_rank_no_reduce")


def make_job(seed: int) -> dict:
    """The job of ``seed``: the same dict for the same seed, on any machine."""
    rng = random.Random(seed)
    world = rng.choice((1, 1, 2, 2, 3, 4, 4, 5, 6, 8))
    keys = []
    for i in range(rng.randint(1, 40)):
        reduction = REDUCTIONS[i % len(REDUCTIONS)] if i < len(REDUCTIONS) else rng.choice(REDUCTIONS)
        family = rng.choice(FAMILIES)
        keys.append({"key": f"{family}{i:02d}/{reduction}", "reduction": reduction, "family": family})
    sample_keys = [f"rollout/s{i}" for i in range(rng.choice((0, 0, 1, 2)))]
    ranks = [_rank(rng, rank, sample_keys) for rank in range(world)]
    if rng.random() < 0.1:  # an integer float64 cannot hold: refused, naming the key
        ranks[0]["big_int"] = True
    uploads = seed % 5 == 0
    return {
        "seed": seed,
        "format": rng.choice(("parquet", "jsonl")),
        "world": world,
        "keys": keys,
        "sample_keys": sample_keys,
        "ranks": ranks,
        "hang_kill_after": round(rng.uniform(1.0, 3.0), 2),
        "foreign": _foreign(rng) if rng.random() < 0.3 else None,
        "damage": [
            {"kind": rng.choice(("flip", "truncate")), "seed": rng.getrandbits(32)}
            for _ in range(rng.choice((0, 0, 0, 1, 2)))
        ],
        "follow": uploads and rng.random() < 0.8,
        "live_upload": uploads and rng.random() < 0.3,
        "uploads": uploads,
        "tensorboard_mode": rng.choice(MODES),
        "by_time": {"mode": rng.choice(MODES), "every": rng.choice(("0.05s", "200ms", "0.5s", "1s", "3s"))},
        "overrides": {
            "mode": rng.choice(MODES[:2]),
            "patterns": [
                f"{rng.choice(('*', *(k['family'] + '*' for k in keys), '*/' + rng.choice(REDUCTIONS)))}"
                f"={rng.choice(STATISTICS)}"
                for _ in range(rng.randint(1, 3))
            ],
        },
        "job_seed": rng.getrandbits(32),
    }


def _rank(rng: random.Random, rank: int, sample_keys: list[str]) -> dict:
    steps = rng.randint(2, 30)
    plan = {
        "rank": rank,
        "process": f"Trainer_r{rank}",
        "steps": steps,
        "flush_every": rng.choice((1, 1, 1, 2, 3, 5)),
        "flush_interval": rng.choice((0.02, 0.05, 0.2, 1.0)),
        "segment_records": rng.choice((30, 100, 500, 1_000_000)),
        "key_share": rng.choice((0.2, 0.5, 1.0)),
        "step_sleep": rng.choice((0.0, 0.0, 0.005, 0.02)),
        "samples": bool(sample_keys) and rng.random() < 0.6,
        "values_seed": rng.getrandbits(32),
        "fault": None,
        "pause": None,
        "restart": None,
        "big_int": False,
    }
    if rng.random() < 0.35:
        plan["fault"] = {
            "kind": rng.choice(FAULTS),
            "at": rng.randint(0, steps - 1),
            "after_flush": rng.random() < 0.3,  # else mid-step: recorded, not flushed
            "hang_ended_by": rng.choice(("SIGKILL", "SIGTERM")),  # what the runner ends a hang with
        }
        if rng.random() < 0.5:
            plan["restart"] = {"back": rng.randint(0, 3), "values_seed": rng.getrandbits(32)}
    if rng.random() < 0.15:
        plan["pause"] = {"at": rng.randint(0, steps - 1), "seconds": round(rng.uniform(0.2, 1.5), 2)}
    return plan


def _foreign(rng: random.Random) -> dict:
    return {
        "format": rng.choice(("parquet", "jsonl")),
        "sources": rng.randint(1, 2),
        "steps": rng.randint(1, 20),
        "seed": rng.getrandbits(32),
    }


def values_for(rng: random.Random, family: str, n: int) -> list:
    """``n`` values of ``family`` as a rank records them (Python numbers, numpy scalars,
    0-d arrays). numpy is imported here, in the rank, not by the generator."""
    import numpy as np

    out: list = []
    for _ in range(n):
        if family == "count":
            out.append(rng.randint(0, 1000))
        elif family == "decimal":
            out.append(float(f"{rng.randint(-1000, 1000) / 10 ** rng.randint(1, 3)}"))
        elif family == "offset":
            out.append(1e12 + rng.randint(-(10**6), 10**6) / 1000)
        elif family == "nonfinite":
            out.append(rng.choice((float("nan"), float("inf"), float("-inf"), rng.uniform(-1, 1), 0.5)))
        elif family == "np_float32":
            out.append(np.float32(rng.uniform(-100, 100)))
        elif family == "np_int64":
            out.append(np.int64(rng.randint(-(2**40), 2**40)))
        else:  # zero_d: a 0-d array, as a 0-d tensor is
            out.append(np.array(rng.uniform(-1e3, 1e3)))
    return out
