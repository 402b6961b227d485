"""Runs soak jobs and checks every command against the oracle.

    python -m tests.soak --seed 1234          # replay one seed (make soak SEED=1234)
    python -m tests.soak --minutes 60         # new seeds for an hour (make soak MINUTES=60)

A job: its ranks (real processes, ``worker.py``) are started together; a rank whose plan
says so SIGKILLs, SIGTERMs, raises, ``os._exit``s, pauses or hangs (the runner ends a
hang after ``hang_kill_after`` seconds, so every job ends), and is restarted from a
checkpoint into the same run directory when its plan says so. Another tool's file is
written beside the writer's before the ranks start; an ``upload --follow`` (with
``--let-go-after``) runs beside the job, a plain ``upload`` starts while it runs; a
``watch --alert ... --on-alert CMD`` runs beside a job with alarms on its values (and the
follow gets the ``--alert`` rules too), each CMD appending its ``METRICLOG_*`` variables to
a file of the job. Then
the commands run and are checked (``checks.py``); sealed files are damaged first where
the job says so (after the uploads, which are compared with each other).

A failed job keeps its directory (the run, the ledgers, every command's output) and
prints its seed and the command that replays it; a passed one is removed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tests.soak.generator import make_job, spell, values_for

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")
METRICLOG = str(Path(sys.executable).with_name("metriclog"))
JOB_TIMEOUT = 120.0  # a job's ranks, hangs and restarts included
COMMAND_TIMEOUT = 180.0
FOLLOW_AFTER_JOB = 60.0  # --restart-grace 5s and --let-go-after 2s: a follow ends well within this
MEMORY_BOUND_KIB = 1536 * 1024  # 1.5 GiB, the bound for any command
EXIT_CODES = {"raise": 1, "exit": 3, "sigkill": -9, "sigterm": -15}  # a fault's exit status


@dataclass
class Done:
    code: int
    out: str
    err: str
    rss_kib: int


@dataclass
class JobResult:
    seed: int
    failures: list[str] = field(default_factory=list)
    commands: Counter = field(default_factory=Counter)
    values: int = 0
    records: int = 0
    ranks: int = 0
    seconds: float = 0.0
    cpu: float = 0.0  # CPU seconds of its processes: ranks and commands
    cpu_by_kind: Counter = field(default_factory=Counter)  # of the commands, by kind; "ranks"
    artefacts: Path | None = None

    def fail(self, what: str) -> None:
        self.failures.append(what)


class Job:
    """One job's directory, processes and results."""

    def __init__(self, seed: int, root: Path, only: frozenset[str] | None = None) -> None:
        self.seed = seed
        self.only = only  # the checks to run (checks.CHECKS); None: all of them
        # without alarm keys or torchforge's parts (the checks that look at them are not run):
        # the job is the one the seed made before they joined the soak
        self.job = make_job(
            seed,
            alerts=only is None or "alerts" in only,
            torchforge=only is None or "torchforge" in only,
            across=only is None or "across" in only,
            trackers=only is None or "trackers" in only,
        )
        if only is not None and "uploads" not in only:  # no upload beside the job either
            self.job.update(follow=False, live_upload=False, uploads=False)
        self.dir = root / f"seed-{seed}"
        shutil.rmtree(self.dir, ignore_errors=True)
        (self.dir / "ledger").mkdir(parents=True)
        (self.dir / "out").mkdir()
        self.run = self.dir / "run"
        self.run.mkdir()
        (self.dir / "job.json").write_text(json.dumps(self.job, indent=1))
        self.result = JobResult(seed, ranks=self.job["world"], artefacts=self.dir)
        self.notes: dict[str, dict] = {}
        self.follow_done: Done | None = None
        self.n = 0
        self.env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "WANDB_SILENT": "true",
            "WANDB_CACHE_DIR": str(self.dir / "wandb-cache"),
            "WANDB_DATA_DIR": str(self.dir / "wandb-data"),
            "WANDB_CONFIG_DIR": str(self.dir / "wandb-config"),
            "TMPDIR": str(self.dir / "tmp"),
            "COLUMNS": "200",
        }
        self.watch_done: Done | None = None  # watch --alert beside the job
        self.console_done: Done | None = None  # the console's global_reduce printer beside it
        torchforge = self.job["torchforge"]
        self._spelling = random.Random(torchforge["spelling_seed"]) if torchforge else None
        self.env.pop("PYTHONFAULTHANDLER", None)
        self.env.pop("WANDB_MODE", None)
        (self.dir / "tmp").mkdir()

    def choice(self, value: str) -> str:
        """``value``, one of a fixed set an option takes (``--mode global_reduce``), spelled as
        a user may write it (``generator.spell``: ``GLOBAL_REDUCE``, ``global-reduce``, ...)."""
        return spell(self._spelling, value) if self._spelling else value

    # -- processes -------------------------------------------------------------------

    def start(
        self, kind: str, args: list[str], program: list[str] | None = None
    ) -> tuple[subprocess.Popen, Path]:
        """``metriclog ARGS`` (or ``PROGRAM ARGS``) started, its output in ``out/NN-KIND.*``."""
        self.n += 1
        stem = self.dir / "out" / f"{self.n:02d}-{kind}"
        argv = [*(program or [METRICLOG]), *args]
        (stem.with_suffix(".cmd")).write_text(" ".join(_quote(a) for a in argv) + "\n")
        with open(stem.with_suffix(".out"), "w") as out, open(stem.with_suffix(".err"), "w") as err:
            proc = subprocess.Popen(argv, stdout=out, stderr=err, env=self.env, cwd=self.dir)
        return proc, stem

    def finish(
        self,
        kind: str,
        proc: subprocess.Popen,
        stem: Path,
        timeout: float = COMMAND_TIMEOUT,
        expect: tuple[int, ...] = (0,),
    ) -> Done:
        """Wait for a command (its peak memory from wait4), then the checks every command
        gets: its exit code, no traceback, memory under the bound."""
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        done = Done(
            proc.returncode,
            stem.with_suffix(".out").read_text(),
            stem.with_suffix(".err").read_text(),
            usage.ru_maxrss,
        )
        self.result.commands[kind] += 1
        self.result.cpu += usage.ru_utime + usage.ru_stime
        self.result.cpu_by_kind[kind] += usage.ru_utime + usage.ru_stime
        line = stem.with_suffix(".cmd").read_text().strip()
        if proc.returncode == -signal.SIGKILL and not any(c == -9 for c in expect):
            self.result.fail(f"{kind}: did not end within {timeout:.0f} s (killed): {line}")
        elif proc.returncode not in expect:
            self.result.fail(f"{kind}: exit {proc.returncode}, expected {expect}: {line}\n{_tail(done.err)}")
        if "Traceback (most recent call last)" in done.err or "Traceback (most recent call last)" in done.out:
            self.result.fail(f"{kind}: a traceback on stderr: {line}\n{_tail(done.err, 12)}")
        if usage.ru_maxrss > MEMORY_BOUND_KIB:
            self.result.fail(f"{kind}: peak memory {usage.ru_maxrss // 1024} MiB over the bound: {line}")
        return done

    def command(self, kind: str, *args: str, expect: tuple[int, ...] = (0,)) -> Done:
        proc, stem = self.start(kind, list(args))
        return self.finish(kind, proc, stem, expect=expect)

    def start_rank(self, rank: int, attempt: int, start: int) -> subprocess.Popen:
        with open(self.dir / "out" / f"rank{rank}.a{attempt}.err", "w") as log:
            return subprocess.Popen(
                [sys.executable, str(WORKER), str(self.dir), str(rank), str(attempt), str(start)],
                # OPENBLAS_NUM_THREADS: numpy's threads would spin as it loads, for no linear algebra
                env={
                    **self.env,
                    "RANK": str(rank),
                    "WORLD_SIZE": str(self.job["world"]),
                    "OPENBLAS_NUM_THREADS": "1",
                },
                stdout=subprocess.DEVNULL,
                stderr=log,
                cwd=self.dir,
            )

    # -- the job ---------------------------------------------------------------------

    def alert_args(self, who: str, on: str) -> list[str]:
        """``--alert`` for each rule, ``--alert-on``, and ``--on-alert`` appending the alarm's
        variables, a line each (one ``printf``, one write, to a file opened to append), to
        ``alerts-{who}.tsv``."""
        spec = self.job["alerts"]
        form = "\\t".join(["%s"] * len(ALERT_VARIABLES)) + "\\n"  # printf's \t and \n
        values = " ".join(f'"$METRICLOG_{v}"' for v in ALERT_VARIABLES)
        command = f"printf '{form}' {values} >> {shlex.quote(str(self.dir / f'alerts-{who}.tsv'))}"
        return [
            *[a for rule in spec["rules"] for a in ("--alert", rule["text"])],
            "--alert-on",
            self.choice(on),
            "--on-alert",
            command,
        ]

    def run_ranks(self) -> None:
        job = self.job
        if job["foreign"]:
            write_foreign(job, self.dir)
        alerts = job["alerts"]
        watcher = None
        if alerts:
            restarts = any(p["restart"] and p["fault"] for p in job["ranks"])
            watcher = self.start(
                "watch",
                [
                    "watch",
                    str(self.run),
                    "--interval",
                    "0.5",
                    # the wait for a rank of world_size that has not written yet (a slow
                    # start beside ranks that finished) or a restart (started at once, but
                    # Python's start takes a while on a loaded machine)
                    "--restart-grace",
                    "8s" if restarts else "3s",
                    *self.alert_args("watch", alerts["on"]),
                ],
            )
        console = None
        if job["torchforge"] and job["torchforge"]["console"]:
            # what rank 0 of a torchforge job with a global_reduce console backend starts
            console = self.start(
                "console",
                [str(self.run), "--flush-interval", str(job["ranks"][0]["flush_interval"])],
                program=[sys.executable, "-m", "metric_core.offline.console"],
            )
        follower = None
        if job["follow"]:
            follow_alerts = []
            if alerts and alerts["follow"]:
                # --let-go-after 2s: a rank silent that long (a hang, a pause on a loaded
                # machine) is let go, and its later records are late for the global steps
                # handed over: the follow judges raw values in such a job
                silent = any((p["fault"] or {}).get("kind") == "hang" or p["pause"] for p in job["ranks"])
                follow_alerts = self.alert_args("follow", "raw" if silent else alerts["on"])
                self.notes["follow_alert_on"] = "raw" if silent else alerts["on"]
            follower = self.start(
                "upload-follow",
                [
                    "upload",
                    str(self.run),
                    "--project",
                    "soak",
                    "--offline",
                    "--name",
                    "follow",
                    "--follow",
                    "--wait",
                    "--interval",
                    "0.3",
                    "--let-go-after",
                    "2s",
                    "--restart-grace",
                    "5s",
                    *self.sample_tables("follow"),
                    *follow_alerts,
                ],
            )
        procs = {p["rank"]: (1, self.start_rank(p["rank"], 1, 0)) for p in job["ranks"]}
        live = None
        deadline = time.monotonic() + JOB_TIMEOUT
        hung: dict[int, float] = {}
        while procs:
            time.sleep(0.02)
            if time.monotonic() > deadline:
                for _, p in procs.values():
                    p.kill()
                    os.waitpid(p.pid, 0)
                self.result.fail(f"the job did not end within {JOB_TIMEOUT:.0f} s")
                break
            for rank, (attempt, proc) in list(procs.items()):
                plan = job["ranks"][rank]
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid == 0:
                    self._maybe_end_hang(rank, attempt, proc, plan, hung)
                    continue
                del procs[rank]
                code = proc.returncode = os.waitstatus_to_exitcode(status)
                self.result.cpu += usage.ru_utime + usage.ru_stime
                self.result.cpu_by_kind["ranks"] += usage.ru_utime + usage.ru_stime
                self._check_exit(rank, attempt, code, plan)
                if attempt == 1 and plan["restart"] and code != 0:
                    start = self._restart_step(rank, plan)
                    self.notes[f"{rank}.2"] = {"from_step": start}
                    procs[rank] = (2, self.start_rank(rank, 2, start))
            if job["live_upload"] and live is None and _acks(self.dir / "ledger" / "r0.a1.jsonl") >= 2:
                live = self.start(
                    "upload-live",
                    ["upload", str(self.run), "--project", "soak", "--offline", "--name", "live"],
                )
        if live is not None:
            self.finish("upload-live", *live)
        if watcher is not None:
            # 0 once every source finished; 4 once one died and no restart came
            ended = all(self._ended_cleanly(p["rank"]) for p in job["ranks"])
            self.watch_done = self.finish(
                "watch", *watcher, timeout=FOLLOW_AFTER_JOB, expect=(0,) if ended else (4,)
            )
        if follower is not None:
            self.follow_done = self.finish("upload-follow", *follower, timeout=FOLLOW_AFTER_JOB)
        if console is not None:  # it ends by itself once every source shut down or died
            self.console_done = self.finish("console", *console, timeout=FOLLOW_AFTER_JOB)
        (self.dir / "notes.json").write_text(json.dumps(self.notes, indent=1))

    def sample_tables(self, who: str) -> list[str]:
        """``--sample-tables`` of the upload ``who`` (``plain``, ``follow``), or none (its
        default, per-step) in a job from before issue 44 joined the soak."""
        torchforge = self.job["torchforge"]
        return ["--sample-tables", self.choice(torchforge["sample_tables"][who])] if torchforge else []

    def _maybe_end_hang(
        self, rank: int, attempt: int, proc: subprocess.Popen, plan: dict, hung: dict[int, float]
    ) -> None:
        fault = plan["fault"]
        if attempt != 1 or not fault or fault["kind"] != "hang":
            return
        if rank not in hung:
            ledger = self.dir / "ledger" / f"r{rank}.a1.jsonl"
            if ledger.exists() and '"t": "hang"' in ledger.read_text():
                hung[rank] = time.monotonic()
        elif time.monotonic() - hung[rank] > self.job[
            "hang_kill_after"
        ] and "killed_at" not in self.notes.get(f"{rank}.1", {}):
            how = fault["hang_ended_by"]
            self.notes[f"{rank}.1"] = {"killed_with": how, "killed_at": time.time()}
            proc.send_signal(getattr(signal, how))

    def _ended_cleanly(self, rank: int) -> bool:
        """Whether the newest attempt of ``rank`` shut down cleanly."""
        newest = 2 if f"{rank}.2" in self.notes else 1
        return self.notes.get(f"{rank}.{newest}", {}).get("code") == 0

    def _check_exit(self, rank: int, attempt: int, code: int, plan: dict) -> None:
        note = self.notes.setdefault(f"{rank}.{attempt}", {})
        note["code"] = code
        fault = plan["fault"] if attempt == 1 else None
        path = self.dir / "ledger" / f"r{rank}.a{attempt}.jsonl"
        ledger = path.read_text() if path.exists() else ""
        if '"t": "nfwrong"' in ledger:
            line = next(x for x in ledger.splitlines() if '"t": "nfwrong"' in x)
            self.result.fail(
                f"rank {rank} attempt {attempt}: record_metric under init(on_nonfinite='raise') did not "
                f"raise NonFiniteError where expected (at [call, key, step], expected [call, step]): {line}"
            )
        for line in ledger.splitlines():
            if '"t": "wrong"' in line:
                self.result.fail(f"rank {rank} attempt {attempt}: {json.loads(line)['what']}")
                break
        if '"t": "nfraise"' in ledger:
            want = 1  # NonFiniteError, uncaught
        elif fault is None:
            want = 0
        elif fault["kind"] == "hang":
            want = -getattr(signal, fault["hang_ended_by"])
        else:
            want = EXIT_CODES[fault["kind"]]
        if code != want:
            err = (self.dir / "out" / f"rank{rank}.a{attempt}.err").read_text()
            self.result.fail(
                f"rank {rank} attempt {attempt} exited {code}, expected {want}\n{_tail(err, 12)}"
            )

    def _restart_step(self, rank: int, plan: dict) -> int:
        acks = [
            json.loads(line)["step"]
            for line in (self.dir / "ledger" / f"r{rank}.a1.jsonl").read_text().splitlines()
            if '"t": "ack"' in line
        ]
        start = max(0, (acks[-1] + 1 if acks else 0) - plan["restart"]["back"])
        return min(start, plan["steps"] - 1)

    # -- damage ----------------------------------------------------------------------

    def damage_foreign(self) -> set[tuple[str, int]]:
        """Another tool's Parquet file written with page checksums: a bit of one page's data
        flipped (in half such jobs), which its checksum covers; its sources, if so. (Its
        footer is left whole: nothing tells a change there from what the tool wrote.)"""
        import pyarrow.parquet as pq

        spec = self.job["foreign"]
        path = self.run / "other" / "other_tool.parquet"
        if not spec or spec["format"] != "parquet" or not foreign_checksums(spec):
            return set()
        rng = random.Random(spec["seed"] ^ 0xF11)
        if rng.random() < 0.5:
            return set()
        meta = pq.read_metadata(path)
        chunk = meta.row_group(rng.randrange(meta.num_row_groups)).column(rng.randrange(meta.num_columns))
        start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
        data = bytearray(path.read_bytes())
        data[start + chunk.total_compressed_size - 1] ^= 1 << rng.randrange(8)  # page data, not a header
        path.write_bytes(bytes(data))
        self.notes.setdefault("damaged", []).append({"file": "other/other_tool.parquet", "kind": "flip"})
        return {(f"Other_r{k}", 100 + k) for k in range(spec["sources"])}

    def damage(self) -> set[tuple[str, int]]:
        """Flip bits in, or cut short, sealed segments of the writer (and a page of another
        tool's file that has checksums: ``damage_foreign``); the sources hit."""
        hit: set[tuple[str, int]] = set()
        sealed = sorted(p for p in self.run.glob("*.r*.*") if p.suffix in (".parquet", ".jsonl"))
        for damage in self.job["damage"]:
            if not sealed:
                break
            rng = random.Random(damage["seed"])
            path = rng.choice(sealed)
            data = bytearray(path.read_bytes())
            if not data:
                continue
            if damage["kind"] == "flip":
                for _ in range(rng.randint(1, 3)):
                    at = rng.randrange(len(data))
                    data[at] ^= 1 << rng.randrange(8)
            else:
                del data[rng.randrange(len(data)) :]
            path.write_bytes(bytes(data))
            rank = int(path.name.split(".r")[1].split(".")[0])
            hit.add((self.job["ranks"][rank]["process"], rank))
            self.notes.setdefault("damaged", []).append({"file": path.name, "kind": damage["kind"]})
        hit |= self.damage_foreign()
        (self.dir / "notes.json").write_text(json.dumps(self.notes, indent=1))
        return hit


def foreign_checksums(spec: dict) -> bool:
    """Whether another tool's Parquet file is written with page checksums (drawn from its
    seed apart, so that the jobs of the seeds kept are made as they were)."""
    return random.Random(spec["seed"] ^ 0xC4C).random() < 0.5


def write_foreign(job: dict, job_dir: Path) -> None:
    """Another tool's file (the record schema of docs/format.md, written with pyarrow or
    json), in a folder of the run, with its records in the ledger as required ones."""
    spec = job["foreign"]
    rng = random.Random(spec["seed"])
    keys = rng.sample(job["keys"], k=min(len(job["keys"]), rng.randint(1, 6)))
    now = time.time()
    rows = []
    for k in range(spec["sources"]):
        process, rank = f"Other_r{k}", 100 + k
        for step in range(spec["steps"]):
            for key in keys:
                for value in values_for(rng, key["family"], rng.randint(1, 2)):
                    rows.append(
                        {
                            "process": process,
                            "rank": rank,
                            "step": step,
                            "key": key["key"],
                            "reduction": key["reduction"],
                            "value": float(value),
                            "timestamp": now + step * 0.05 + len(rows) * 1e-4,
                        }
                    )
    folder = job_dir / "run" / "other"
    folder.mkdir()
    if spec["format"] == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        columns = {
            name: [r[name] for r in rows]
            for name in ("key", "value", "reduction", "step", "timestamp", "rank", "process")
        }
        pq.write_table(  # with page checksums, as Spark writes them, for half the jobs
            pa.table(columns),
            folder / "other_tool.parquet",
            row_group_size=max(1, len(rows) // 3),
            write_page_checksum=foreign_checksums(spec),
        )
    else:
        with open(folder / "other_tool.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps({**r, "value": _json_number(r["value"])}) + "\n")
    with open(job_dir / "ledger" / "foreign.jsonl", "w") as f:
        for r in rows:
            f.write(
                json.dumps(
                    {
                        "p": r["process"],
                        "rank": r["rank"],
                        "s": r["step"],
                        "k": r["key"],
                        "r": r["reduction"],
                        "v": r["value"].hex(),
                    }
                )
                + "\n"
            )


def _json_number(v: float) -> object:
    if v != v:
        return "NaN"
    if v in (float("inf"), float("-inf")):
        return "Infinity" if v > 0 else "-Infinity"
    return v


# What --on-alert's command writes of each alarm, tab-separated, in this order.
ALERT_VARIABLES = ("RULE", "KEY", "STEP", "VALUE", "PROCESS", "RANK", "RUN_DIR")


def _acks(path: Path) -> int:
    try:
        return path.read_text().count('"t": "ack"')
    except FileNotFoundError:
        return 0


def _tail(text: str, lines: int = 4) -> str:
    return "\n".join("    " + line for line in text.strip().splitlines()[-lines:])


def _quote(arg: str) -> str:
    return (
        arg
        if arg and all(c.isalnum() or c in "-_./=:,@" for c in arg)
        else "'" + arg.replace("'", "'\\''") + "'"
    )


# -- a job, start to end -------------------------------------------------------------


def run_one(seed: int, root: Path, *, keep: bool = False, only: frozenset[str] | None = None) -> JobResult:
    """One seed's job, run and checked (``only``: those of ``checks.CHECKS``, the raw
    records' always; the job's ranks and faults are the seed's whatever is checked)."""
    from tests.soak import checks

    started = time.monotonic()
    job = Job(seed, root, only)
    try:
        job.run_ranks()
        checks.check_job(job)
    except Exception as exc:  # a bug of the soak itself, or a product failure it did not expect
        import traceback

        job.result.fail(f"the soak itself failed: {exc!r}\n{_tail(traceback.format_exc(), 20)}")
    job.result.seconds = time.monotonic() - started
    if job.result.failures:  # beside what it failed on, for whoever reads the artefacts later
        (job.dir / "failures.txt").write_text(report(job.result) + "\n")
    elif not keep:
        shutil.rmtree(job.dir, ignore_errors=True)
        job.result.artefacts = None
    return job.result


def report(result: JobResult) -> str:
    lines = [
        f"FAIL seed {result.seed}: {len(result.failures)} failure(s); replay: make soak SEED={result.seed}",
        f"  artefacts (run dir, ledgers, outputs): {result.artefacts}",
    ]
    for failure in result.failures:
        lines.append("  - " + failure.replace("\n", "\n    "))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, action="append", help="replay this seed (repeatable)")
    parser.add_argument("--minutes", type=float, default=0, help="run new seeds for this long")
    parser.add_argument("--jobs", type=int, default=2, help="jobs at a time (default 2)")
    parser.add_argument("--root", type=Path, default=None, help="where jobs run (default: a temporary dir)")
    parser.add_argument("--keep", action="store_true", help="keep passed jobs' directories too")
    parser.add_argument("--first-seed", type=int, default=None, help="new seeds count up from here")
    parser.add_argument(
        "--only", default=None, help="run only these checks (comma-separated; the raw records' always)"
    )
    args = parser.parse_args(argv)
    from tests.soak.checks import CHECKS

    only = None if args.only is None else frozenset(args.only.split(","))
    if only is not None and not only <= CHECKS:
        parser.error(f"--only: unknown check in {args.only!r}; the checks: {','.join(sorted(CHECKS))}")
    root = args.root or Path(tempfile.mkdtemp(prefix="metriclog-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    total = Counter()
    results: list[JobResult] = []
    lock = threading.Lock()
    started = time.monotonic()

    def done(result: JobResult) -> None:
        with lock:
            results.append(result)
            total.update(result.commands)
            status = "ok" if not result.failures else "FAIL"
            print(
                f"seed {result.seed}: {status} ({result.ranks} rank(s), {result.records} records, "
                f"{result.values} values compared, {result.seconds:.1f} s, {result.cpu:.1f} s CPU)",
                flush=True,
            )
            if result.failures:
                print(report(result), flush=True)

    if args.seed:
        with ThreadPoolExecutor(args.jobs) as pool:
            for result in pool.map(lambda s: run_one(s, root, keep=args.keep, only=only), args.seed):
                done(result)
    else:
        first = args.first_seed if args.first_seed is not None else random.SystemRandom().randrange(10**9)
        seeds = iter(range(first, first + 10**9))
        end = started + args.minutes * 60

        def loop() -> None:
            while time.monotonic() < end:
                with lock:
                    seed = next(seeds)
                done(run_one(seed, root, keep=args.keep, only=only))

        threads = [threading.Thread(target=loop) for _ in range(args.jobs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    minutes = (time.monotonic() - started) / 60
    failed = [r for r in results if r.failures]
    print()
    print(
        f"soak summary: {len(results)} jobs in {minutes:.1f} min "
        f"({len(results) / max(minutes, 1e-9):.1f} jobs/min), "
        f"{sum(r.ranks for r in results)} ranks, {sum(r.records for r in results):,} records"
    )
    print("  commands: " + ", ".join(f"{k} {v}" for k, v in sorted(total.items())))
    print(f"  values compared: {sum(r.values for r in results):,}")
    cpu = sum(r.cpu for r in results) / max(len(results), 1)
    print(
        f"  CPU of the jobs' processes: {cpu:.1f} s a job (on 2 idle cores, about "
        f"{120 / max(cpu, 1e-9):.0f} jobs/min); load average now {os.getloadavg()[0]:.1f}"
    )
    by_kind = Counter()
    for r in results:
        by_kind.update(r.cpu_by_kind)
    print(
        "  CPU a job, by what ran: "
        + ", ".join(f"{k} {v / max(len(results), 1):.1f} s" for k, v in by_kind.most_common())
    )
    print(f"  peak memory of any child: {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024} MiB")
    print(
        f"  failures: {sum(len(r.failures) for r in failed)} in {len(failed)} job(s)"
        + (": seeds " + " ".join(str(r.seed) for r in sorted(failed, key=lambda r: r.seed)) if failed else "")
    )
    if not args.root and not any(r.artefacts for r in results):
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0
