"""What a `metriclog` command costs before it does any work: CPU seconds (user + system,
of the whole process) of small commands on sample_logs/rl_run, medians over rounds.

Most of a small command's CPU is loading Python packages (polars, numpy, pyarrow, typer),
and the soak (tests/soak/) runs about eight commands a job, so this is most of what a soak
job costs. typer 0.29 parses every option through a pydantic ``TypeAdapter`` (it imports
pydantic and builds an adapter per option, each run); pyproject.toml keeps typer below it.
``--typer VERSION`` runs the same commands beside the installed typer with that version
(installed with pip into a temporary folder put first on ``PYTHONPATH``), side by side.

Usage: python benchmarks/bench_cli_start.py [--repeats 9] [--typer 0.29.2]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = str(ROOT / "sample_logs" / "rl_run")
COMMANDS = {
    "--help": ["--help"],
    "reduce": ["reduce", RUN, "--steps", "0:3"],
    "keys": ["keys", RUN],
    "inspect": ["inspect", RUN, "--format", "json"],
}


def cpu_of(args: list[str], env: dict[str, str]) -> float:
    """CPU seconds (user + system) of one run of ``python -m metriclog ARGS``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(
        [sys.executable, "-m", "metriclog", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def typer_version(env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", "import typer, sys; print(typer.__version__, 'pydantic' in sys.modules)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    version, _ = done.stdout.split()
    return version


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--typer", default=None, help="a typer version to run beside the installed one")
    args = parser.parse_args()
    variants = {"installed": {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}}
    with tempfile.TemporaryDirectory(prefix="bench-typer-") as other:
        if args.typer:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "install",
                    "-q",
                    "--no-deps",
                    "--target",
                    other,
                    f"typer=={args.typer}",
                ],
                check=True,
            )
            path = os.pathsep.join(p for p in (other, os.environ.get("PYTHONPATH")) if p)
            variants[f"typer {args.typer}"] = {**variants["installed"], "PYTHONPATH": path}
        names = {name: f"{name} (typer {typer_version(env)})" for name, env in variants.items()}
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.repeats):  # interleaved: a noisy moment hits every variant alike
            for command, argv in COMMANDS.items():
                for name, env in variants.items():
                    times.setdefault((command, name), []).append(cpu_of(argv, env))
    print(f"CPU seconds a command (user + system), median of {args.repeats}:")
    print(f"  {'command':<10}" + "".join(f"{names[n]:>32}" for n in variants))
    for command in COMMANDS:
        medians = [statistics.median(times[(command, n)]) for n in variants]
        ratio = f"   x{medians[1] / medians[0]:.2f}" if len(medians) == 2 else ""
        print(f"  {command:<10}" + "".join(f"{m:>32.3f}" for m in medians) + ratio)


if __name__ == "__main__":
    main()
