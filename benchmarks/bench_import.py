"""What a training rank pays to load metric_core: start-up time and memory.

Each round runs, each in a fresh process (so nothing is cached in the interpreter):

  python      the bare interpreter: the floor every variant starts from
  now         ``import metric_core; init(); record_metric(); flush(); shutdown()``
  REV         the same with metric_core as of git revision REV (``--baseline REV``)

and reports, as medians over rounds: the wall time of ``import metric_core`` plus
``init()`` (where imports happen), the process's peak RSS after shutdown, and the
heavy modules the process loaded (polars, wandb, matplotlib, typer).

Usage: python benchmarks/bench_import.py [--repeats 15] [--baseline REV]
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

HEAVY = ("polars", "wandb", "matplotlib", "typer", "pandas", "duckdb")

CHILD = textwrap.dedent(
    """
    import json, sys, time
    t0 = time.perf_counter()
    if sys.argv[1] != "python":
        import metric_core
        metric_core.init(sys.argv[2], rank=0, process_name="bench")
        loaded = time.perf_counter() - t0
        metric_core.record_metric("loss", 0.5)
        metric_core.flush(0)
        metric_core.shutdown()
    else:
        loaded = time.perf_counter() - t0
    print(json.dumps({
        "load_s": loaded,
        # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across exec
        "rss_mib": int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) / 1024,
        "modules": len(sys.modules),
        "heavy": sorted(m for m in %(heavy)r if m in sys.modules),
    }))
    """
) % {"heavy": HEAVY}


def run(variant: str, baseline: Path | None) -> dict:
    env = {**os.environ}
    if variant not in ("python", "now"):
        assert baseline is not None
        env["PYTHONPATH"] = str(baseline)
        # ahead of the install of this checkout
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, variant, tmp],
            check=True,
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp,
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--baseline", metavar="REV", help="also measure metric_core at this git revision")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_record import export_baseline
    from bench_reduce import compile_sources

    compile_sources()
    variants = ["python", "now"]
    baseline = None
    if args.baseline:
        scratch = Path(tempfile.mkdtemp(prefix="metriclog-baseline-"))
        atexit.register(shutil.rmtree, scratch, True)  # the exported revision goes when this ends
        baseline = export_baseline(args.baseline, scratch)
        variants.append(args.baseline)
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(args.repeats):  # interleaved: drift in machine load hits every variant alike
        for v in variants:
            results[v].append(run(v, baseline))
    print(f"repeats: {args.repeats}; medians; load = import metric_core + init()")
    print(f"{'variant':<12}{'load ms':>10}{'peak RSS MiB':>14}{'modules':>9}  heavy modules loaded")
    med: dict[str, dict[str, float]] = {}
    for v in variants:
        rows = results[v]
        med[v] = {k: statistics.median(r[k] for r in rows) for k in ("load_s", "rss_mib", "modules")}
        heavy = ", ".join(rows[-1]["heavy"]) or "none"
        m = med[v]
        print(f"{v:<12}{m['load_s'] * 1000:>10.0f}{m['rss_mib']:>14.1f}{m['modules']:>9.0f}  {heavy}")
    if baseline is not None:
        now, base, floor = med["now"], med[args.baseline], med["python"]
        print()
        print(
            f"now / {args.baseline}: load {now['load_s'] / base['load_s']:.2f}x, peak RSS "
            f"{now['rss_mib'] / base['rss_mib']:.2f}x (above the bare interpreter: "
            f"{now['rss_mib'] - floor['rss_mib']:.1f} MiB against "
            f"{base['rss_mib'] - floor['rss_mib']:.1f} MiB)"
        )


if __name__ == "__main__":
    main()
