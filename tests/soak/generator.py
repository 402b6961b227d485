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
* ``by_time``, ``overrides``: the ``--by time`` and ``--reduce`` commands of this job;
* ``alerts``: alarms on values (issue 43), or None: see ``_alerts``. Drawn from a random
  of its own (``random.Random(f"alerts-{seed}")``), so every other part of a seed's job is
  what it was before alarms joined the soak.
* ``torchforge``: what issue 44 added, from a random of its own too (``_torchforge``): a
  GRPO-shaped job (its ranks named after GRPO's actors, recording through
  ``metric_core.torchforge``: ``record_metric``, ``Tracer``, ``record_episode_sample``), the
  console's ``global_reduce`` printer beside the job, and the uploads' ``--sample-tables``.
  Every choice a command takes is spelled at random besides (``spell``).
* ``across``: issue 46's commands over many runs, from a random of its own too
  (``_across``): ``compare`` of the run and copies of it, ``diff`` of the run and a copy,
  ``compare --to tensorboard`` and ``upload`` of several runs.
* ``trackers``: issue 45's destinations and imports, from a random of its own too
  (``_trackers``): ``upload --to mlflow`` into a SQLite store of the job's own, and
  ``import`` of what an upload wrote (MLflow, TensorBoard) or of an export of the records.
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


def make_job(
    seed: int, alerts: bool = True, torchforge: bool = True, across: bool = True, trackers: bool = True
) -> dict:
    """The job of ``seed``: the same dict for the same seed, on any machine (``alerts``:
    False, the job as it was before alarms joined the soak: ``alerts`` None; ``torchforge``:
    False, as it was before issue 44's parts joined it: ``torchforge`` None)."""
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
    job = {
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
    job["alerts"] = _alerts(random.Random(f"alerts-{seed}"), job) if alerts else None
    job["torchforge"] = _torchforge(random.Random(f"torchforge-{seed}"), job) if torchforge else None
    job["across"] = _across(random.Random(f"across-{seed}")) if across else None
    job["trackers"] = _trackers(random.Random(f"trackers-{seed}"), job) if trackers else None
    return job


# -- many runs at once (issue 46) ---------------------------------------------------------

ACROSS_SHARE = 0.2


def _across(rng: random.Random) -> dict | None:
    """For 1 job in 5: ``compare`` of the run and 1-2 copies of it, and ``diff`` of the run
    and a copy, in ``mode``; for a quarter of them (``to``), that comparison sent to
    TensorBoard (``compare --to``), the run and a copy uploaded by one ``upload RUN RUN``
    and plotted with a band (``plot RUN... --band``):
    few, since writing TensorBoard's files loads torch where it is installed (tensorboardX
    imports it), about 1.8 s of CPU a command."""
    if rng.random() >= ACROSS_SHARE:
        return None
    spec = {"copies": rng.choice((1, 2)), "mode": rng.choice(MODES[:2])}
    return {**spec, "to": rng.random() < 0.25}  # drawn last: earlier seeds keep their draws


# -- other trackers, out and in (issue 45) ------------------------------------------------

# Small shares: an MLflow command costs several seconds of CPU (importing mlflow and opening
# its SQL store), an import and its reduce about two small commands; the soak is CPU-bound.
MLFLOW_SHARE = 0.04
IMPORT_SHARE = 0.1
REDUCE_ON_IMPORT = ("mean", "sum", "max", "min", "std")


def _trackers(rng: random.Random, job: dict) -> dict | None:
    """For about 1 job in 25: ``upload --to mlflow`` in ``mlflow`` mode (then again: nothing
    added), and for half of those ``import`` of what it wrote; for about 1 in 10: ``import``
    of ``source`` (what the TensorBoard upload wrote, or a CSV or JSONL export of the raw
    records). Each import with ``--reduce reduce``."""
    mlflow = rng.choice(MODES[:2]) if rng.random() < MLFLOW_SHARE else None
    source = "mlflow" if mlflow and rng.random() < 0.5 else None
    if source is None and rng.random() < IMPORT_SHARE:
        source = "tensorboard" if job["uploads"] else rng.choice(("csv", "jsonl"))
    if mlflow is None and source is None:
        return None
    imported = {"source": source, "reduce": rng.choice(REDUCE_ON_IMPORT)} if source else None
    return {"mlflow": mlflow, "import": imported}


# -- torchforge's habits (issue 44) ------------------------------------------------------

# The actors of torchforge's GRPO app, as a GRPO-shaped job names its ranks (rank = index,
# cycled), and the prefix of each one's Tracer.
GRPO_ROLES = ("Controller", "Generator", "ReferenceModel", "TitanTrainer", "ReplayBuffer")
GRPO_SHARE = 0.3
CONSOLE_SHARE = 0.3


def _torchforge(rng: random.Random, job: dict) -> dict:
    """A GRPO-shaped job or not; the console printer beside it or not; each upload's
    ``--sample-tables``. A GRPO-shaped job renames its ranks' processes (``{role}_r{rank}``)
    and its samples key (torchforge's ``main_samples/continuous_rollouts/sample_table``)."""
    grpo = rng.random() < GRPO_SHARE
    if grpo:
        for plan in job["ranks"]:
            plan["process"] = f"{GRPO_ROLES[plan['rank'] % len(GRPO_ROLES)]}_r{plan['rank']}"
        if job["sample_keys"]:
            job["sample_keys"][0] = "main_samples/continuous_rollouts/sample_table"
    return {
        "grpo": grpo,
        "console": rng.random() < CONSOLE_SHARE,
        "sample_tables": {who: rng.choice(("per-step", "incremental")) for who in ("plain", "follow")},
        "spelling_seed": rng.getrandbits(32),
    }


def spell(rng: random.Random, value: str) -> str:
    """``value`` (a choice a command takes) as a user may write it: as it is, the enum's
    member name (``GLOBAL_REDUCE``), with ``-`` for ``_``, or in mixed case."""
    return rng.choice(
        (value, value.upper(), value.replace("_", "-"), value.title(), value.upper().replace("_", "-"))
    )


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


# -- alarms on values (issue 43) -------------------------------------------------------

# The keys alarms watch: each rank records one value of each a step (after the job's other
# keys), from ``(low, high)``, or an event's value at a step its plan names.
ALERT_KEYS = {
    "alarm/loss": {
        "base": (0.0, 1.0),
        "reductions": ("mean", "max", "min", "sum"),
        "events": ("nan", "inf", "-inf"),
    },
    "alarm/grad": {
        "base": (0.0, 1.0),
        "reductions": ("max", "mean", "sum", "min"),
        "events": ("high", "low"),
    },
    "alarm/reward": {"base": (0.5, 1.0), "reductions": ("mean", "min", "max"), "events": ("collapse",)},
}
# The rules a job may get, as ``--alert`` takes them and as the oracle reads them.
NONFINITE_RULES = ("alarm/loss: nonfinite", "alarm/l*: nonfinite", "alarm/*: nonfinite")
THRESHOLD_RULES = (
    {"text": "alarm/grad > 100", "pattern": "alarm/grad", "kind": ">", "x": 100.0},
    {"text": "alarm/g* < -100", "pattern": "alarm/g*", "kind": "<", "x": -100.0},
)
STATEFUL_RULES = (  # only in jobs without a restart: see _alerts
    {
        "text": "alarm/reward: drop 50% over 5 steps",
        "pattern": "alarm/reward",
        "kind": "drop",
        "x": 0.5,
        "n": 5,
    },
    {"text": "alarm/reward: spike 4 sigma", "pattern": "alarm/reward", "kind": "spike", "x": 4.0},
)
ALERT_SHARE = 0.3  # of the jobs: a watch --alert beside them (its CPU is the soak's cost)
RAISE_SHARE = 0.3  # of those: init(on_nonfinite="raise") in every rank


def _alerts(rng: random.Random, job: dict) -> dict | None:
    """Alarms on values for ``job``, or None: the rules, ``--alert-on``, the keys' reductions,
    per rank and attempt the events (``[step, key, kind]``: a NaN, an infinity, a value past
    a threshold, a collapse), and ``raise_on``, the ``nonfinite_keys`` of
    ``init(on_nonfinite="raise")`` (None: off). Such a job has no restart (its plans are
    changed: a rank that raises ends there).

    Where the events may fall keeps the alarms the same whatever the timing of the readers
    (the oracle's ``expected_alarms`` says why):

    * on one rank and key, events come in bursts of consecutive steps, bursts at least
      ``4 * flush_every + 4`` steps apart, so an episode's end is the same counted in values
      (as alerts.py does) or in steps (as docs/commands.md says) (the report of issue 43's
      soak says more);
    * a rank that restarts: its first attempt's events end well before any step its restart
      may replay, and its restart's come well after the last step its first attempt may have
      written; with ``--alert-on global``, no rank's event comes at or after the first step
      a restart may replay (which of the two attempts' values a global step was reduced over,
      and whether it waited for the restart at all, depends on when watch looked);
    * the drop and spike rules only in jobs without a restart (their state is every value).
    """
    if rng.random() >= ALERT_SHARE:
        return None
    raise_on = rng.choice(("alarm/loss", "alarm/l*", "alarm/*")) if rng.random() < RAISE_SHARE else None
    if raise_on:
        for plan in job["ranks"]:
            plan["restart"] = None
    restarts = any(p["restart"] and p["fault"] for p in job["ranks"])
    rules: list[dict] = []
    if rng.random() < 0.8 or raise_on:
        text = rng.choice(NONFINITE_RULES)
        rules.append({"text": text, "pattern": text.split(":")[0], "kind": "nonfinite"})
    rules += [dict(r) for r in THRESHOLD_RULES if rng.random() < 0.6]
    if not restarts:
        rules += [dict(r) for r in STATEFUL_RULES if rng.random() < 0.5]
    if not rules:
        rules.append({"text": NONFINITE_RULES[0], "pattern": "alarm/loss", "kind": "nonfinite"})
    on = rng.choice(("raw", "global"))
    keys = [{"key": k, "reduction": rng.choice(spec["reductions"])} for k, spec in ALERT_KEYS.items()]
    # a step from which no rank's event comes (global: a restart's replay, see above)
    last = min(
        (_first_replayed(p) - 2 * p["flush_every"] - 8 for p in job["ranks"] if p["restart"] and p["fault"]),
        default=10**9,
    )
    events = []
    for plan in job["ranks"]:
        mine = []
        for attempt in (1, 2):
            lo, hi = 0, plan["steps"] - 1
            if plan["restart"] and plan["fault"]:
                if attempt == 1:
                    hi = _first_replayed(plan) - 2 * plan["flush_every"] - 8
                else:
                    lo = plan["fault"]["at"] + plan["flush_every"] + 8
            if on == "global":
                hi = min(hi, last)
            if attempt == 2 and not (plan["restart"] and plan["fault"]):
                mine.append([])
                continue
            mine.append(_bursts(rng, lo, hi, plan["flush_every"], keys))
        events.append(mine)
    return {
        "rules": rules,
        "on": on,
        "keys": keys,
        "events": events,
        "raise_on": raise_on,
        "follow": rng.random() < 0.7,  # with the upload --follow, where the job has one
    }


def _first_replayed(plan: dict) -> int:
    """The lowest step a restart of ``plan`` may start from: its first attempt's last flush
    is at most ``flush_every`` steps before its fault, and it rewinds up to 3 steps."""
    return plan["fault"]["at"] - plan["flush_every"] - 3


def _bursts(rng: random.Random, lo: int, hi: int, flush_every: int, keys: list[dict]) -> list[list]:
    out: list[list] = []
    for spec in keys:
        if rng.random() < 0.4:
            continue
        kinds = ALERT_KEYS[spec["key"]]["events"]
        step = lo + rng.randint(0, 6)
        while step <= hi:
            length = rng.choice((1, 1, 2, 3))
            out += [[s, spec["key"], rng.choice(kinds)] for s in range(step, min(step + length, hi + 1))]
            step += length + 4 * flush_every + 4 + rng.randint(0, 8)
    return sorted(out)


def alert_value(rng: random.Random, key: str, kind: str | None) -> float:
    """The value of ``key`` a rank records at a step: its base, or ``kind``'s (an event). Two
    draws of ``rng`` whatever the kind, so an event changes no other value."""
    low, high = ALERT_KEYS[key]["base"]
    base, u = rng.uniform(low, high), rng.random()
    return {
        None: base,
        "nan": float("nan"),
        "inf": float("inf"),
        "-inf": float("-inf"),
        "high": 1000.0 + 1000.0 * u,
        "low": -1000.0 - 1000.0 * u,
        "collapse": 0.01 + 0.09 * u,
    }[kind]
