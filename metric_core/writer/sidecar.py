"""The sidecar a job starts itself: ``metriclog upload RUN --follow`` as a child process.

``init(run_dir, sidecar={...})`` (on one process of the job, usually rank 0) or
``start_sidecar(run_dir, ...)`` runs it. It is a child process, so the training
process imports nothing more (no polars, no wandb); its output goes to
``RUN_DIR/.metriclog/sidecar.log``. It ends by itself once every source of the run shut
down (or after ten minutes without a record); ``shutdown()`` waits for it (up to
``wait`` seconds) so that the job's end does not cut its last rows.

``start_console`` starts the other child a rank may run: the printer of each global step
on its console (``metric_core.offline.console``, for a ``console`` backend in
``global_reduce`` mode of ``metric_core.torchforge``); ``end_console`` waits for it.
"""

from __future__ import annotations

import difflib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from metric_core.credentials import has_credentials
from metric_core.errors import ConfigError, MetricLogError, as_keyword, warn

# The printer of a console backend in global_reduce mode, run by its module's name: the rank
# imports none of it (it reads the run with polars).
CONSOLE_MODULE = "metric_core.offline.console"
CONSOLE_WAIT_S = 60.0  # how long rank 0's shutdown waits for the printer's last steps
CONSOLE_STOP_S = 30.0  # then, once stopped (SIGTERM), for its last look and its words
CONSOLE_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}  # what stops it

# upload_run's options as the command line spells them: flags, then options with a value.
_FLAGS = {
    "offline": "--offline",
    "share_run": "--per-rank-share-run",
    "force_new": "--force-new",
    "strict": "--strict",
    "no_samples": "--no-samples",
}
_VALUES = {
    "project": "--project",
    "entity": "--entity",
    "name": "--name",
    "group": "--group",
    "mode": "--mode",
    "by": "--by",
    "every": "--every",
    "keys": "--key",
    "reduce": "--reduce",
    "ranks": "--ranks",
    "steps": "--steps",
    "interval": "--interval",
    "until_idle": "--until-idle",
    "sources": "--sources",
    "sample_top": "--sample-top",
    "sample_bottom": "--sample-bottom",
    "sample_by": "--sample-by",
    "sample_random": "--sample-random",
    "sample_seed": "--sample-seed",
    "sample_tables": "--sample-tables",
}


def sidecar_command(run_dir: str | os.PathLike[str], options: dict[str, Any]) -> list[str]:
    """The ``metriclog upload --follow`` command line of ``options`` (``upload_run``'s names).

    >>> sidecar_command("runs/a", {"project": "rl", "keys": ["loss", "reward/*"], "offline": True})[4:]
    ['runs/a', '--follow', '--wait', '--project', 'rl', '--key', 'loss', '--key', 'reward/*', '--offline']
    >>> options = {"project": "rl", "reduce": {"lat": "p99"}, "ranks": [0, (2, 5)], "steps": (0, 100)}
    >>> sidecar_command("runs/a", options)[7:]
    ['--project', 'rl', '--reduce', 'lat=p99', '--ranks', '0,2-5', '--steps', '0:100']
    """
    unknown = [name for name in options if name not in (*_FLAGS, *_VALUES, "wait")]
    if unknown:
        near = difflib.get_close_matches(unknown[0], [*_FLAGS, *_VALUES, "wait"], 1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        known = ", ".join(sorted([*_FLAGS, *_VALUES, "wait"]))
        raise ConfigError(f"sidecar: no option {unknown[0]!r}; {hint}the options are {known}")
    if "project" not in options:
        raise ConfigError("sidecar: give the W&B project, e.g. sidecar={'project': 'my-project'}")
    command = [sys.executable, "-m", "metriclog", "upload", str(run_dir), "--follow", "--wait"]
    as_arguments: dict[str, list[str]] = {}
    for name, value in options.items():
        if name in _FLAGS:
            command += [_FLAGS[name]] if value else []
        elif name in _VALUES:
            as_arguments[name] = _as_arguments(name, value)
            for v in as_arguments[name]:
                command += [_VALUES[name], v]
    _check(as_arguments)
    return command


def _check(as_arguments: dict[str, list[str]]) -> None:
    """Bad values fail here, in the job, not in a child whose error only its log would hold."""
    from metric_core.offline.plan import make_plan, parse_duration  # no polars: see plan.py

    one = {k: v[0] for k, v in as_arguments.items() if k in ("mode", "by", "every", "ranks", "steps")}
    try:
        make_plan(**one, reduce=as_arguments.get("reduce", ()), keys=as_arguments.get("keys", ()))
        if "until_idle" in as_arguments:
            parse_duration(as_arguments["until_idle"][0], option="until_idle")
        if "interval" in as_arguments and not float(as_arguments["interval"][0]) >= 0.05:
            raise ValueError(f"interval={as_arguments['interval'][0]} must be at least 0.05 (seconds)")
        if "sources" in as_arguments and int(as_arguments["sources"][0]) < 1:
            raise ValueError(f"sources={as_arguments['sources'][0]} must be at least 1")
        tables = as_arguments.get("sample_tables", ["per-step"])[0]
        if tables not in ("per-step", "incremental"):  # SampleChoice's (offline.samples loads polars)
            raise ValueError(f"sample_tables={tables!r} is not one of per-step, incremental")
    except MetricLogError as exc:
        raise ConfigError(f"sidecar: {exc.text(as_keyword)}") from None
    except ValueError as exc:
        raise ConfigError(f"sidecar: {exc}") from None


def _as_arguments(name: str, value: Any) -> list[str]:
    """An option's value(s) as the command line takes them, from ``upload_run``'s types."""
    if name == "reduce" and isinstance(value, dict):
        return [f"{k}={getattr(v, 'value', v)}" for k, v in value.items()]
    if name == "ranks" and not isinstance(value, str):
        return [",".join(f"{r[0]}-{r[1]}" if isinstance(r, (list, tuple)) else str(r) for r in value)]
    if name == "steps" and isinstance(value, (list, tuple)):
        return [":".join("" if v is None else str(v) for v in value)]
    values = value if isinstance(value, (list, tuple)) else [value]
    return [str(getattr(v, "value", v)) for v in values]


def start_sidecar(run_dir: str | os.PathLike[str], **options: Any) -> subprocess.Popen[bytes]:
    """Start ``metriclog upload RUN_DIR --follow`` beside this process; its output goes to
    ``RUN_DIR/.metriclog/sidecar.log``. ``options`` are ``upload_run``'s (project, mode,
    offline, keys, ...) and ``until_idle``, ``sources``, ``interval``. ``until_idle``
    defaults to 10 minutes: a job killed before its ranks shut down does not leave the
    sidecar waiting for ever (Ctrl-C reaches it with the job: it hands W&B what it has).
    Returns the child process. Raises ``ConfigError`` for an option ``upload`` does not
    take, or for an online upload without W&B credentials here (before the job runs)."""
    command = sidecar_command(run_dir, {"until_idle": "10m", **options})
    offline = options.get("offline") or os.environ.get("WANDB_MODE") in ("offline", "dryrun", "disabled")
    if not offline and not has_credentials():  # it would stop at once, and the job learn it at its end
        raise ConfigError(
            "sidecar: W&B has no credentials here (WANDB_API_KEY, or `wandb login`), so the run would not be "
            "uploaded: log in, or give offline=True and `wandb sync` the run later"
        )
    home = Path(run_dir) / ".metriclog"
    home.mkdir(parents=True, exist_ok=True)
    log = os.open(home / "sidecar.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
    try:
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    finally:
        os.close(log)


def start_console(
    run_dir: str | os.PathLike[str], *, flush_interval: float = 1.0, from_step: int = 0
) -> subprocess.Popen[bytes]:
    """Start the printer of each global step on this process's console: ``python -m
    metric_core.offline.console RUN_DIR`` as a child that writes to this process's stderr,
    in torchforge's ``ConsoleBackend`` format (a ``console`` backend in ``global_reduce``
    mode). It looks every half ``flush_interval`` and prints the steps from ``from_step`` on;
    it ends once every source shut down or died, or when this process is gone. ``end_console``
    waits for it."""
    command = [
        sys.executable,
        "-m",
        CONSOLE_MODULE,
        str(run_dir),
        "--flush-interval",
        repr(float(flush_interval)),
        "--from-step",
        str(from_step),
        "--parent",
        str(os.getpid()),
    ]
    # It starts with these signals blocked (a child inherits the mask), and takes them once
    # its handlers are in place: a stop while it loads polars is its last look, not its death.
    held = signal.pthread_sigmask(signal.SIG_BLOCK, CONSOLE_SIGNALS)
    try:
        return subprocess.Popen(command, stdin=subprocess.DEVNULL)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def end_console(child: subprocess.Popen[bytes], wait: float = CONSOLE_WAIT_S) -> None:
    """Wait up to ``wait`` seconds for the printer to print every step (it ends once every
    source shut down or died); past that, stop it (SIGTERM): it prints the steps complete and
    says which it did not print. A printer that failed, or did not stop, is warned of."""
    try:
        code = child.wait(timeout=wait)
    except subprocess.TimeoutExpired:
        child.send_signal(signal.SIGTERM)
        try:
            code = child.wait(timeout=CONSOLE_STOP_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            warn(
                f"the metriclog console printer (pid {child.pid}) did not stop within {CONSOLE_STOP_S:.0f} s "
                "of SIGTERM and was killed; `metriclog reduce` computes the steps it did not print"
            )
            return
    if code != 0:
        warn(f"the metriclog console printer ended with exit code {code}; what it said is above, on stderr")
