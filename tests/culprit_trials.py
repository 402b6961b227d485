"""Who hung, tried many times: a lockstep job of 4 ranks in which one rank sleeps 20-40 s in a
function of its own, with ``metriclog watch --on-stall`` beside it on default settings.

A trial passes when the stall command ran exactly once, its ``METRICLOG_PROCESS`` is the
sleeping rank, and ``inspect`` afterwards keeps the sleeping rank's place apart from the
others' (its own group in the pause's ``stuck_in``). Trials alternate the two orders: the
sleeping rank stops before its flush of the step (the others wait in that step's collective)
or after it (they wait in the next one's).

    python tests/culprit_trials.py [--runs 10] [--launcher lockstep|torchrun] [--parallel 2]

``--launcher lockstep`` is tests/lockstep.py (a socket stands in for the collective);
``torchrun`` starts tests/torchrun_worker.py with ``torch.distributed.run`` and gloo's
``all_reduce``, under ``--python`` (a Python with torch; metric_core from this checkout).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.lockstep import run_job  # noqa: E402

WORLD = 4
STEPS = 12
AT_STEP = 5


def trial(i: int, launcher: str, python: str, metriclog: str, base: Path) -> tuple[bool, str]:
    sleeper, order = i % WORLD, ("before", "after")[i % 2]
    seconds = 20 + (i * 7) % 21
    work = base / f"trial-{i}"
    work.mkdir()
    run, said = work / "run", work / "said.txt"
    command = f'echo "$METRICLOG_PROCESS|$METRICLOG_WHERE|$METRICLOG_PROCESSES" >> {said}'
    watcher = subprocess.Popen(
        [metriclog, "watch", str(run), "--wait", "--on-stall", command],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        if launcher == "lockstep":
            action = "sleep" if order == "before" else "checkpoint"
            run_job(
                run,
                world=WORLD,
                steps=STEPS,
                action=[action, str(sleeper), str(AT_STEP), str(seconds)],
                timeout=300,
            )
        else:
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            args = [str(run), str(STEPS), str(sleeper), str(AT_STEP), str(seconds), order]
            subprocess.run(
                [
                    python,
                    "-m",
                    "torch.distributed.run",
                    "--nproc_per_node",
                    str(WORLD),
                    "--master_port",
                    str(29500 + i),
                    str(ROOT / "tests" / "torchrun_worker.py"),
                    *args,
                ],
                env=env,
                check=True,
                timeout=300,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        _, err = watcher.communicate(timeout=120)
    finally:
        if watcher.poll() is None:
            watcher.kill()
    name = f"Trainer_r{sleeper}"
    lines = said.read_text().splitlines() if said.exists() else []
    report = json.loads(
        subprocess.run([metriclog, "inspect", str(run), "--json"], capture_output=True, text=True).stdout
    )
    pauses = [p for p in report["pauses"] if p["seconds"] >= 10]
    groups = pauses[0]["stuck_in"] if len(pauses) == 1 else []
    apart = [g for g in groups if g["sources"] == [{"process": name, "rank": sleeper}]]
    ok = (
        watcher.returncode == 0
        and len(lines) == 1
        and lines[0].split("|")[0] == name
        and len(groups) == 2
        and len(apart) == 1
    )
    said_line = lines[0] if lines else "(no stall command ran)"
    story = f"trial {i}: {name} slept {seconds} s {order} its flush of step {AT_STEP}"
    story += f": --on-stall got {said_line!r}"
    story += f"; inspect: {[(g['where'], [s['rank'] for s in g['sources']]) for g in groups]}"
    if watcher.returncode != 0:
        story += f"; watch exited {watcher.returncode}: {err.strip()[-300:]}"
    return ok, story


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--launcher", choices=("lockstep", "torchrun"), default="lockstep")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--python", default=sys.executable, help="the Python that runs torchrun's ranks")
    parser.add_argument("--metriclog", default=str(Path(sys.executable).with_name("metriclog")))
    args = parser.parse_args()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="culprit-") as base, ThreadPoolExecutor(args.parallel) as pool:
        results = list(
            pool.map(
                lambda i: trial(i, args.launcher, args.python, args.metriclog, Path(base)), range(args.runs)
            )
        )
    for ok, story in results:
        print(("PASS " if ok else "FAIL ") + story)
    passed = sum(ok for ok, _ in results)
    print(
        f"{args.launcher}: the sleeping rank named in {passed} of {args.runs} trials "
        f"({time.monotonic() - start:.0f} s)"
    )
    sys.exit(0 if passed == args.runs else 1)


if __name__ == "__main__":
    main()
