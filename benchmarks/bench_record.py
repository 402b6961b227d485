"""Per-record cost of record_metric, including the background writing.

Each variant runs in its own process and records N values over 10 keys, with a
flush (one training step) every 100 records; the figure is the whole process's CPU
time (all threads: the writer thread and polars/arrow pools included) from just
before the loop to just after shutdown, divided by N. Variants, side by side:

  seed        torchforge's in-memory path: a Metric dataclass with a timestamp,
              pushed into a per-key accumulator (no I/O at all)
  parquet     metric_core.record_metric, file_format="parquet"
  jsonl       metric_core.record_metric, file_format="jsonl"
  torchforge  metric_core.torchforge.record_metric (torchforge's semantics: a Metric and a
              per-rank singleton lookup a call) into metric_core's parquet files
  sample      record_metric(key, a 2 KB dict, Reduce.SAMPLE), a tenth as many; besides the
              process's CPU, the caller's thread alone (``time.thread_time``): what the
              training loop pays, the writer thread encoding the samples apart
  wandb       every record streamed through wandb.log, offline mode (fewer records,
              since it is slow; the cost per record is what is compared)

  parquet-nostats, jsonl-nostats
              parquet and jsonl with the writer's per-segment key statistics (``key_stats``
              in a sealed segment's metadata, which ``metriclog keys`` answers from) not
              computed, each run beside its counterpart as it ships, to show their cost

The writing's throughput, as it ships (key_stats on): the process's CPU but for the
record_metric calls themselves (``time.thread_time`` around them in the caller's thread):
flush() making the step durable, the writer thread, sealing each segment (1M records by
default: a 2M-record run seals two, key_stats included), a record's share of each. Printed
as ns a record and records a second on one core, with and without key_stats.

  parquet@REV, jsonl@REV (with --baseline REV)
              the same, with metric_core as it was at git revision REV, so a change
              is measured against its base in the same run

  call-KIND   what the check of integers costs (exact or refused: an int past 2**53 is
              refused): one record_metric call in the caller's thread alone
              (``time.thread_time``, the writer thread apart), by the kind of value (a
              float, a small int, a bool, numpy's int64, uint64, float64 and float32, a
              0-d numpy array of int64, and tf-int: an int through
              metric_core.torchforge.record_metric), against the same call without the
              check (the hot path as it was before it, compiled over the same module's
              globals) in the same process, alternating every step, so machine load
              hits both alike. ``--only-calls`` measures these alone.

``--step-every 1`` makes every record a step of its own: the figure is then mostly the
cost of ``flush(step)``.

Usage: python benchmarks/bench_record.py [--records 2000000] [--repeats 5] [--baseline REV]
                                         [--step-every 100] [--call-records 200000] [--only-calls]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

KEYS = 10
STEP_EVERY = 100

CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    # record_metric and MetricCollector.push as they were before the check of integers
    # (exact or refused), compiled over their module's globals by the call-KIND variants.
    UNCHECKED_RECORD = '''
    def _unchecked_record_metric(key, value, reduction=Reduce.MEAN):
        entry = _key_codes.get(key)
        if entry is not None and entry[0] is reduction:
            code = entry[1]
        elif reduction == "sample":
            _sample(key, value)
            return
        else:
            code = _intern(key, reduction)
        try:
            _extend((value, code, _now()))
        except (TypeError, ValueError, OverflowError):
            _extend((_as_float(key, value), code, _now()))
    '''
    UNCHECKED_PUSH = '''
    def _unchecked_push(self, metric):
        key, value, reduction = metric.key, metric.value, metric.reduction
        at = metric.timestamp if metric.timestamp is not None else _now()
        entry = self._codes.get(key)
        if entry is not None and entry[0] is reduction:
            code = entry[1]
        elif reduction == "sample":
            self.record_sample(key, value, at)
            return
        else:
            code = self._intern(key, reduction)
        try:
            self._extend((value, code, at))
        except (TypeError, ValueError, OverflowError):
            self._extend((_as_float(key, value), code, at))
    '''
    variant, n, run_dir, step_every = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    keys = [f"trainer/metric_{i}" for i in range(%(keys)d)]
    if variant == "seed":
        from dataclasses import dataclass, field
        from enum import Enum

        class Reduce(Enum):
            MEAN = "mean"

        @dataclass
        class Metric:
            key: str
            value: float
            reduction: Reduce
            timestamp: float = field(default_factory=time.time)

        class MeanAccumulator:
            def __init__(self, reduction):
                self.reduction = reduction
                self.sum = 0.0
                self.count = 0

            def append(self, value):
                self.sum += value
                self.count += 1

        class MetricCollector:
            def __init__(self):
                self.accumulators = {}
                self.per_rank_no_reduce_backends = []

            def push(self, metric):
                for backend in self.per_rank_no_reduce_backends:
                    backend.log_stream(metric=metric, global_step=0)
                key = metric.key
                if key not in self.accumulators:
                    self.accumulators[key] = MeanAccumulator(metric.reduction)
                self.accumulators[key].append(metric.value)

            def flush(self, step):
                states = {k: (a.sum, a.count) for k, a in self.accumulators.items()}
                self.accumulators.clear()
                return states

        collector = MetricCollector()

        def record_metric(key, value, reduction=Reduce.MEAN):
            collector.push(Metric(key=key, value=value, reduction=reduction))

        flush = collector.flush
        shutdown = lambda: None
        mean = Reduce.MEAN
    elif variant == "wandb":
        os.environ["WANDB_MODE"] = "offline"
        os.environ["WANDB_SILENT"] = "true"
        import wandb
        run = wandb.init(project="bench", dir=run_dir)
        step_box = [0]

        def record_metric(key, value, reduction=None):
            run.log({key: value, "step": step_box[0]})

        def flush(step):
            step_box[0] = step + 1

        shutdown = run.finish
        mean = None
    else:
        import metric_core
        if variant.endswith("-nostats"):  # the writer without its per-segment key statistics
            from metric_core.writer import seal
            seal._key_stats = lambda table: ()
            variant = variant[: -len("-nostats")]
        own = variant in ("torchforge", "sample") or variant.startswith("call-")
        file_format = "parquet" if own else variant
        metric_core.init(run_dir, rank=0, process_name="bench", file_format=file_format)
        record_metric, flush, shutdown = metric_core.record_metric, metric_core.flush, metric_core.shutdown
        mean = metric_core.Reduce.MEAN
        if variant in ("torchforge", "call-tf-int"):
            from metric_core.torchforge import record_metric  # records into the collector init started
    start = time.process_time()
    wall = time.perf_counter()
    step = 0
    caller = 0.0
    if variant.startswith("call-"):
        import textwrap, types
        import numpy as np
        from metric_core.writer import api, collector as collector_module
        kinds = {
            "float": float, "int": int, "tf-int": int, "bool": lambda j: j %% 2 == 0,
            "np.int64": np.int64, "np.uint64": np.uint64, "np.float64": np.float64,
            "np.float32": np.float32, "0d-int64": lambda j: np.array(j, dtype=np.int64),
        }
        values = [kinds[variant[len("call-"):]](j) for j in range(step_every)]
        pairs = [(keys[j %% len(keys)], values[j]) for j in range(step_every)]
        # the hot paths as they were before the check, over the same globals as today's
        exec(textwrap.dedent(UNCHECKED_RECORD), api.__dict__)
        exec(textwrap.dedent(UNCHECKED_PUSH), collector_module.__dict__)
        collector = api._active
        tf = variant == "call-tf-int"  # torchforge's record_metric pushes into the collector
        unchecked_push = types.MethodType(collector_module._unchecked_push, collector)
        unchecked = record_metric if tf else api._unchecked_record_metric

        def run_checked():
            t = time.thread_time()
            for key, value in pairs:
                record_metric(key, value, mean)
            return time.thread_time() - t

        def run_unchecked():
            if tf:
                collector.push = unchecked_push
            t = time.thread_time()
            for key, value in pairs:
                unchecked(key, value, mean)
            spent = time.thread_time() - t
            if tf:
                del collector.push
            return spent

        unchecked_ns = 0.0
        for i in range(n // step_every):  # which goes first alternates: a flush precedes it
            if i %% 2:
                caller += run_checked()
                unchecked_ns += run_unchecked()
            else:
                unchecked_ns += run_unchecked()
                caller += run_checked()
            flush(step)
            step += 1
        n = 2 * n  # every record of both counts in the process's CPU
    elif variant == "sample":
        sample = {"prompt": "p" * 1000, "response": "r" * 900, "reward": 0.5, "ids": list(range(20))}
        for i in range(n // step_every):
            t = time.thread_time()
            for j in range(step_every):
                record_metric("rollout/sample", sample, metric_core.Reduce.SAMPLE)
            caller += time.thread_time() - t
            flush(step)
            step += 1
    else:
        for i in range(n // step_every):
            t = time.thread_time()
            for j in range(step_every):
                record_metric(keys[j %% len(keys)], 0.001 * j + i, mean)
            caller += time.thread_time() - t
            flush(step)
            step += 1
    shutdown()
    cpu = time.process_time() - start
    calls = n // 2 if variant.startswith("call-") else n
    print(json.dumps({"cpu_ns": cpu / n * 1e9, "wall_ns": (time.perf_counter() - wall) / n * 1e9,
                      "caller_ns": caller / calls * 1e9,
                      "unchecked_ns": unchecked_ns / calls * 1e9 if variant.startswith("call-") else 0.0}))
    """
) % {"keys": KEYS}


def run_variant(
    variant: str, n: int, baseline: Path | None = None, step_every: int = STEP_EVERY
) -> dict[str, float]:
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    if "@" in variant:
        assert baseline is not None
        variant = variant.split("@")[0]
        env["PYTHONPATH"] = str(baseline)
        # ahead of the editable install of this checkout
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, variant, str(n), tmp, str(step_every)],
            check=True,
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp,  # not the checkout: `python -c` puts the working directory first on sys.path
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _shallow_copy_ns() -> float:
    """What ``dict(sample)`` of the benchmark's 2 KB sample costs: the floor of a sample's
    cost in the caller's thread."""
    import timeit

    sample = {"prompt": "p" * 1000, "response": "r" * 900, "reward": 0.5, "ids": list(range(20))}
    return min(timeit.repeat(lambda: dict(sample), number=100_000, repeat=5)) / 100_000 * 1e9


def export_baseline(rev: str, into: Path) -> Path:
    """metric_core as of git revision ``rev``, byte-compiled, in ``into``."""
    import compileall

    root = Path(__file__).resolve().parent.parent
    archive = subprocess.run(
        ["git", "archive", rev, "metric_core"], cwd=root, check=True, capture_output=True
    )
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    compileall.compile_dir(into / "metric_core", quiet=1)
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=2_000_000)
    parser.add_argument("--wandb-records", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", metavar="REV", help="also measure metric_core at this git revision")
    parser.add_argument("--step-every", type=int, default=STEP_EVERY, help="records a step (1: flush's cost)")
    parser.add_argument("--call-records", type=int, default=200_000, help="records of each call-KIND variant")
    parser.add_argument("--only-calls", action="store_true", help="measure the call-KIND variants alone")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_reduce import compile_sources

    compile_sources()
    variants = {} if args.only_calls else {
        "seed": args.records,
        "parquet": args.records,
        "parquet-nostats": args.records,  # beside its counterpart: paired rounds are adjacent
        "jsonl": args.records,
        "jsonl-nostats": args.records,
        "torchforge": args.records,
        "sample": args.records // 10,
        "wandb": args.wandb_records,
    }  # fmt: skip
    calls = {f"call-{kind}": args.call_records for kind in CALL_KINDS}
    variants.update(calls)
    baseline = None
    if args.baseline:
        scratch = Path(tempfile.mkdtemp(prefix="metriclog-baseline-"))
        atexit.register(shutil.rmtree, scratch, True)  # the exported revision goes when this ends
        baseline = export_baseline(args.baseline, scratch)
        if not args.only_calls:  # each beside its counterpart of today: paired rounds are adjacent
            paired = {}
            for variant, n in variants.items():
                paired[variant] = n
                if variant in ("parquet", "jsonl"):
                    paired[f"{variant}@{args.baseline}"] = n
            variants = paired
    results: dict[str, list[float]] = {v: [] for v in variants}
    callers: dict[str, list[float]] = {v: [] for v in variants}
    unchecked: dict[str, list[float]] = {v: [] for v in calls}
    for round_ in range(args.repeats):  # interleaved, so drift in machine load hits all alike
        order = list(variants.items())
        for variant, n in order if round_ % 2 == 0 else reversed(order):  # neither always first
            measured = run_variant(variant, n, baseline, args.step_every)
            results[variant].append(measured["cpu_ns"])
            callers[variant].append(measured["caller_ns"])
            if variant in calls:
                unchecked[variant].append(measured["unchecked_ns"])
    print_calls(callers, unchecked, args.call_records, args.repeats)
    if args.only_calls:
        return
    med = {v: statistics.median(xs) for v, xs in results.items()}
    print(
        f"records: {args.records:,} (wandb: {args.wandb_records:,}), {args.step_every} a step; "
        f"repeats: {args.repeats}; medians"
    )
    width = max(10, *(len(v) + 2 for v in variants))
    print(f"{'variant':<{width}}{'CPU ns/record':>15}{'vs seed':>10}{'vs wandb.log':>15}")
    for v in (v for v in variants if v not in calls):  # the calls' own table is above
        print(
            f"{v:<{width}}{med[v]:>15.0f}{med[v] / med['seed']:>9.2f}x{med['wandb'] / med[v]:>14.0f}x cheaper"
        )
    print()
    print(f"parquet / seed = {med['parquet'] / med['seed']:.2f}x (target <= 1.0x)")
    print(f"jsonl   / seed = {med['jsonl'] / med['seed']:.2f}x (target <= 2.0x)")
    print(
        f"wandb.log / parquet = {med['wandb'] / med['parquet']:.0f}x, wandb.log / jsonl = "
        f"{med['wandb'] / med['jsonl']:.0f}x (target >= 50x)"
    )
    print_writing(results, callers)
    copy = _shallow_copy_ns()
    print(
        f"a 2 KB sample: {statistics.median(callers['sample']):.0f} ns in the caller's thread (a shallow "
        f"copy of the dict alone: {copy:.0f} ns), {med['sample']:.0f} ns of the process's CPU with the "
        "writer's encoding"
    )
    if args.baseline:
        for fmt in ("parquet", "jsonl"):
            ratios = [a / b for a, b in zip(results[fmt], results[f"{fmt}@{args.baseline}"], strict=True)]
            print(
                f"{fmt} now / at {args.baseline} = {med[fmt] / med[f'{fmt}@{args.baseline}']:.3f}x "
                f"(median of paired rounds {statistics.median(ratios):.3f}x, range "
                f"{min(ratios):.3f}-{max(ratios):.3f}; target <= 1.05x)"
            )


def print_writing(cpu: dict[str, list[float]], callers: dict[str, list[float]]) -> None:
    """The writing's CPU a record (the process's but for the record_metric calls) and its
    throughput on one core, with key_stats as it ships and without: medians, and the
    median of the paired rounds' ratios."""
    print("writing (flush, the writer thread, sealing), CPU a record and throughput on one core; medians")
    print(f"{'format':<9}{'ns/record':>11}{'records/s':>13}{'without key_stats':>19}{'key_stats':>12}")
    for fmt in ("parquet", "jsonl"):
        on = [c - k for c, k in zip(cpu[fmt], callers[fmt], strict=True)]
        off = [c - k for c, k in zip(cpu[f"{fmt}-nostats"], callers[f"{fmt}-nostats"], strict=True)]
        ratio = statistics.median(a / b for a, b in zip(on, off, strict=True))
        print(
            f"{fmt:<9}{statistics.median(on):>11.0f}{1e9 / statistics.median(on):>13,.0f}"
            f"{statistics.median(off):>16.0f} ns{ratio:>11.3f}x"
        )
    print()


CALL_KINDS = (
    "float",
    "int",
    "bool",
    "np.int64",
    "np.uint64",
    "np.float64",
    "np.float32",
    "0d-int64",
    "tf-int",
)


def print_calls(
    checked: dict[str, list[float]], unchecked: dict[str, list[float]], n: int, repeats: int
) -> None:
    """One record_metric call in the caller's thread, by kind of value, with the check of
    integers and without it (in the same processes, alternating): medians of the repeats,
    and the median of each process's difference."""
    print(
        f"record_metric in the caller's thread, ns a call, with the check of integers and without it "
        f"({n:,} calls each, alternating in one process; {repeats} repeats, medians)"
    )
    print(f"{'value':<12}{'checked':>9}{'unchecked':>11}{'check costs':>13}{'ratio':>8}")
    for kind in CALL_KINDS:
        now, then = checked[f"call-{kind}"], unchecked[f"call-{kind}"]
        diff = statistics.median(a - b for a, b in zip(now, then, strict=True))
        ratio = statistics.median(a / b for a, b in zip(now, then, strict=True))
        print(
            f"{kind:<12}{statistics.median(now):>9.0f}{statistics.median(then):>11.0f}"
            f"{diff:>+13.0f}{ratio:>7.2f}x"
        )
    print()


if __name__ == "__main__":
    main()
