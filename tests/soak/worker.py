"""One rank of a soak job, a real process:

    python tests/soak/worker.py JOB_DIR RANK ATTEMPT START

It records what its plan in ``JOB_DIR/job.json`` says and keeps a ledger,
``JOB_DIR/ledger/r{RANK}.a{ATTEMPT}.jsonl``, written with one ``os.write`` a line group
on a file opened with ``O_APPEND`` (so a kill of this process loses none of it):

* ``rec``: a value about to be recorded: step it is stamped with (the writer's current
  step), key, reduction, the float64 the file must hold (``float.hex``), before
  ``record_metric`` is called;
* ``smp``: a sample about to be recorded;
* ``ack``: ``flush(step)`` returned: every ``rec``/``smp`` line since the previous ``ack``
  belongs to ``step`` and must be read back (fsynced);
* ``start``, ``hang``, ``fault``, ``done``: what happened, with the wall time;
* ``nfraise``: ``record_metric`` raised ``NonFiniteError`` (``init(on_nonfinite="raise")``)
  where the worker expected it, at the first non-finite value of a key ``nonfinite_keys``
  matches (the ``rec`` lines of that step stop at that value: the rest is not recorded);
  the rank then ends with it, uncaught. ``nfwrong``: it raised elsewhere, or did not.
* ``wrong``: a check of the worker's own failed (``what`` says which): a ``Tracer``'s
  values.

A GRPO-shaped job (``job["torchforge"]["grpo"]``) records through ``metric_core.torchforge``,
as torchforge's actors do: ``record_metric`` with its ``Reduce``, each sample as an episode
through ``record_episode_sample`` (``to_dict(exclude=[...])``), and a ``Tracer`` around each
step (its ``stop()`` records the durations; the ledger gets each before it is recorded, from
a wrapper of the ``record_metric`` the tracer calls, as tests/test_grpo_app.py takes them).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time


def main() -> None:
    job_dir, rank, attempt, start = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    with open(os.path.join(job_dir, "job.json")) as f:
        job = json.load(f)
    plan = job["ranks"][rank]
    ledger = Ledger(os.path.join(job_dir, "ledger", f"r{rank}.a{attempt}.jsonl"))
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import metric_core
    from metric_core import Reduce
    from tests.soak.generator import alert_value, values_for

    seed = plan["values_seed"] if attempt == 1 else plan["restart"]["values_seed"]
    rng = random.Random(seed)
    fault = plan["fault"] if attempt == 1 else None
    pause = plan["pause"] if attempt == 1 else None
    alerts = job.get("alerts")
    events, alert_rng, raise_on = {}, random.Random(f"{seed}-alerts"), None
    if alerts:
        events = {(s, k): kind for s, k, kind in alerts["events"][rank][attempt - 1]}
        raise_on = alerts["raise_on"]
    ledger.write({"t": "start", "time": time.time(), "pid": os.getpid(), "start": start})
    options = {"on_nonfinite": "raise", "nonfinite_keys": raise_on} if raise_on else {}
    metric_core.init(
        os.path.join(job_dir, "run"),
        rank=rank,
        process_name=plan["process"],
        file_format=job["format"],
        step=start,
        flush_interval=plan["flush_interval"],
        world_size=job["world"],
        segment_records=plan["segment_records"],
        hang_dump_after=0,
        **options,
    )
    current = start  # the step the writer stamps records with until the next flush
    reductions = {r.value: r for r in Reduce}
    record, record_sample, tracer = metric_core.record_metric, metric_core.record_metric, None
    if (job.get("torchforge") or {}).get("grpo"):
        from metric_core.torchforge import metrics, perf_tracker

        def traced(key: str, value: float, reduction: Reduce = Reduce.MEAN) -> None:
            ledger.write({"t": "rec", "s": current, "k": key, "r": reduction.value, "v": float(value).hex()})
            tracer_values.append((key, value, reduction.value))
            real(key, value, reduction)

        real, tracer_values = perf_tracker.record_metric, []
        perf_tracker.record_metric = traced  # the name the Tracer calls
        record = metrics.record_metric

        def record_sample(key: str, sample: dict, _: Reduce) -> None:
            metrics.record_episode_sample(key, Episode(sample))

        tracer = perf_tracker.Tracer(plan["process"].split("_r")[0].lower() + "_perf", timer="cpu")
    for step in range(start, plan["steps"]):
        lines, calls = [], []
        for spec in job["keys"]:
            if rng.random() >= plan["key_share"]:
                continue
            for value in values_for(rng, spec["family"], rng.randint(1, 3)):
                lines.append(
                    {
                        "t": "rec",
                        "s": current,
                        "k": spec["key"],
                        "r": spec["reduction"],
                        "v": float(value).hex(),
                    }
                )
                calls.append((spec["key"], value, reductions[spec["reduction"]]))
        for spec in alerts["keys"] if alerts else []:
            value = alert_value(alert_rng, spec["key"], events.get((step, spec["key"])))
            lines.append(
                {"t": "rec", "s": current, "k": spec["key"], "r": spec["reduction"], "v": value.hex()}
            )
            calls.append((spec["key"], value, reductions[spec["reduction"]]))
        if plan["samples"]:
            for key in job["sample_keys"]:
                for j in range(rng.randint(0, 3)):
                    sample = {
                        "reward": round(rng.uniform(-1, 1), 6),
                        "text": f"r{rank} a{attempt} {step}.{j}",
                        "n": rng.randint(0, 10**6),
                    }
                    lines.append({"t": "smp", "s": current, "k": key, "d": sample})
                    calls.append((key, sample, Reduce.SAMPLE))
        stop = _raises_at(calls, raise_on)
        if stop is not None:  # the rest of the step is never recorded
            lines, calls = lines[: stop + 1], calls[: stop + 1]
        ledger.write(*lines)
        if tracer is not None:
            tracer.start()
        for i, (key, value, how) in enumerate(calls):
            try:
                (record_sample if how is Reduce.SAMPLE else record)(key, value, how)
            except metric_core.NonFiniteError as exc:
                if i != stop or exc.key != key or exc.step != current:
                    ledger.write(
                        {"t": "nfwrong", "at": [i, key, exc.step], "expected": [stop, current]}, sync=True
                    )
                    os._exit(7)
                ledger.write({"t": "nfraise", "time": time.time(), "key": key, "step": exc.step}, sync=True)
                raise
        if stop is not None:
            ledger.write({"t": "nfwrong", "at": None, "expected": [stop, current]}, sync=True)
            os._exit(7)
        if plan["big_int"] and attempt == 1 and step == start:
            big_int(metric_core, ledger, current)
        if tracer is not None:
            tracer.step("record")
        if plan["step_sleep"]:
            time.sleep(plan["step_sleep"])
        if tracer is not None:
            tracer.step("sleep")
            tracer_values.clear()
            tracer.stop()
            check_tracer(ledger, tracer.prefix, tracer_values, plan["step_sleep"])
        if pause and pause["at"] == step:
            time.sleep(pause["seconds"])
        if fault and fault["at"] == step and not fault["after_flush"]:
            do_fault(fault["kind"], ledger)
        if (step - start + 1) % plan["flush_every"] == 0 or step == plan["steps"] - 1:
            metric_core.flush(step)
            ledger.write({"t": "ack", "step": step, "time": time.time()}, sync=True)
            current = step + 1
        if fault and fault["at"] == step and fault["after_flush"]:
            do_fault(fault["kind"], ledger)
    metric_core.shutdown()
    ledger.write({"t": "done", "time": time.time()}, sync=True)


class Episode:
    """torchforge's GRPO ``Episode`` as far as ``record_episode_sample`` sees it: ``to_dict``
    with the fields torchforge leaves out (a tensor, the completion object) beside the sample's."""

    def __init__(self, sample: dict) -> None:
        self.sample = sample

    def to_dict(self, exclude: list[str] | None = None) -> dict:
        out = {**self.sample, "ref_logprobs": [-0.5, -0.25], "completion": object()}
        for key in exclude or []:
            out.pop(key, None)
        return out


def check_tracer(ledger: Ledger, prefix: str, got: list, slept: float) -> None:
    """What ``Tracer.stop()`` recorded of a step timed ``record`` then ``sleep``: torchforge's
    keys and reductions, durations that are not negative, the sleep at least as long as asked,
    the total at least the sum of its steps (one call a step: avg and max the same)."""
    values = {(key, how): value for key, value, how in got}
    want = {
        (f"{prefix}/{name}_{suffix}", how)
        for name in ("total_duration", "record/duration", "sleep/duration")
        for suffix, how in (("avg_s", "mean"), ("max_s", "max"))
    }
    problem = None
    if set(values) != want or len(got) != len(want):
        problem = f"Tracer.stop() recorded {sorted(values)}, expected {sorted(want)}"
    elif any(v < 0 for v in values.values()):
        problem = f"a negative duration: {values}"
    elif values[(f"{prefix}/sleep/duration_max_s", "max")] < slept:
        problem = f"the sleep of {slept} s timed {values[(f'{prefix}/sleep/duration_max_s', 'max')]} s"
    elif values[(f"{prefix}/total_duration_max_s", "max")] + 1e-6 < sum(
        values[(f"{prefix}/{name}/duration_max_s", "max")] for name in ("record", "sleep")
    ):
        problem = f"the total is less than the sum of the steps: {values}"
    elif any(
        values[(k.replace("_avg_s", "_max_s"), "max")] != v for (k, h), v in values.items() if h == "mean"
    ):
        problem = f"avg and max differ for one call a step: {values}"
    if problem:
        ledger.write({"t": "wrong", "what": problem}, sync=True)


def _raises_at(calls: list, patterns: str | None) -> int | None:
    """Which of a step's calls ``record_metric`` must raise ``NonFiniteError`` at: the first
    non-finite value of a key ``patterns`` matches (``fnmatch``, as ``--key`` takes them)."""
    import fnmatch
    import math

    if patterns is None:
        return None
    for i, (key, value, _) in enumerate(calls):
        if (
            not isinstance(value, dict)
            and not math.isfinite(float(value))
            and fnmatch.fnmatchcase(key, patterns)
        ):
            return i
    return None


def big_int(metric_core, ledger: Ledger, current: int) -> None:
    """An integer float64 cannot hold (docs/format.md: exact or refused): record_metric
    refuses it with a ValueError naming the key; if it takes it, the ledger says so and
    holds the value the file then holds, so the rest of the checks go on."""
    from metric_core import Reduce

    value = 2**53 + 1
    try:
        metric_core.record_metric("bigint/sum", value, Reduce.SUM)
    except ValueError as exc:
        ledger.write({"t": "big", "refused": True, "names_key": "bigint/sum" in str(exc)})
        return
    ledger.write(
        {"t": "big", "refused": False},
        {"t": "rec", "s": current, "k": "bigint/sum", "r": "sum", "v": float(value).hex()},
    )


def do_fault(kind: str, ledger: Ledger) -> None:
    ledger.write({"t": "fault", "kind": kind, "time": time.time()}, sync=True)
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)  # the signal ends the process; never reached
    elif kind == "raise":
        raise RuntimeError("soak fault")
    elif kind == "exit":
        os._exit(3)
    elif kind == "hang":
        ledger.write({"t": "hang", "time": time.time()}, sync=True)
        while True:  # alive and silent until the runner ends it
            time.sleep(0.05)


class Ledger:
    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, *entries: dict, sync: bool = False) -> None:
        if entries:
            os.write(self.fd, "".join(json.dumps(e) + "\n" for e in entries).encode())
        if sync:
            os.fsync(self.fd)


if __name__ == "__main__":
    main()
