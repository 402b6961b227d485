"""A run's sources: inspect's report, watch's display, and the commands run on a stall or an alarm."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import typer

from ..options import as_flag
from . import messages
from .messages import echo_prose, say
from .tables import print_rows

if TYPE_CHECKING:
    import polars as pl

    from metric_core.offline.inspect import InspectReport

# What a narrow terminal loses first of inspect's table (the rest from the right): it
# keeps each source and its status.
INSPECT_DROPPED_FIRST = ("files", "keys", "attempts", "truncated", "skipped", "records", "first")
INSPECT_KEPT = ("rank", "state", "end")


def sources_frame(report: InspectReport) -> pl.DataFrame:
    """inspect's per-source table as data: a row a source, numbers as numbers."""
    import polars as pl

    return pl.DataFrame(
        [
            {
                "process": s.process,
                "rank": s.rank,
                "state": s.state,
                "status": s.status,
                "end": s.end,
                "lag_s": s.lag_s,
                "first_step": s.first_step,
                "last_step": s.last_step,
                "first_timestamp": s.first_timestamp,
                "last_timestamp": s.last_timestamp,
                "records": s.records,
                "skipped": s.skipped,
                "truncated": s.truncated,
                "files": s.files,
                "keys": s.keys,
                "attempts": len(s.attempts),
                "stalled": s.stalled,
            }
            for s in report.sources
        ],
        schema_overrides={"end": pl.String},
    )


def print_inspect(report: InspectReport) -> None:
    """The per-source table, then the verdict."""
    from metric_core.clock import duration, local_time

    rows = [
        {
            "process": s.process,
            "rank": s.rank,
            "state": s.state,
            "end": s.end or "",  # how its newest attempt ended
            "lag": duration(s.lag_s),
            "steps": f"{s.first_step}-{s.last_step}" if s.records else "none",
            "last": local_time(s.last_timestamp),
            "first": local_time(s.first_timestamp),
            "records": s.records,
            "skipped": s.skipped,
            "truncated": "yes" if s.truncated else "",
            "files": s.files,
            "keys": s.keys,
            "attempts": len(s.attempts) if len(s.attempts) > 1 else "",
        }
        for s in report.sources
    ]
    for column in ("attempts", "end"):  # no restart, or no end recorded: no column
        if not any(row[column] for row in rows):
            for row in rows:
                del row[column]
    echo_prose(f"run {report.name} ({report.run_dir}), world_size {report.world_size or 'unknown'}")
    print_rows(
        rows,
        max_rows=1000,
        drop_first=INSPECT_DROPPED_FIRST,
        keep=INSPECT_KEPT,
        cut=("process",),
        whole="--json",
    )
    if report.samples:
        counts = ", ".join(f"{key} {n:,}" for key, n in sorted(report.samples.items()))
        echo_prose(f"samples (Reduce.SAMPLE; `metriclog samples {report.run_dir}` lists them): {counts}")
    typer.echo("")
    for line in report.verdict(as_flag):
        echo_prose(line)


class WatchDisplay:
    """What ``metriclog watch`` shows: on a terminal, a table of the sources redrawn in
    place after each poll; otherwise a line per change (a source seen, its state changed)."""

    def __init__(self) -> None:
        self.live: Any = None
        self.states: dict[tuple[str, int], str] = {}

    def __enter__(self) -> WatchDisplay:
        if sys.stdout.isatty():
            from rich.live import Live

            self.live = Live(auto_refresh=False, transient=False)
            messages.above(self.live)
            self.live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.stop()
            messages.above(None)

    def poll(self, report: InspectReport) -> None:
        if self.live is not None:
            self.live.update(_watch_table(report), refresh=True)
            return
        from metric_core.clock import local_time
        from metric_core.offline.inspect.health import state_said

        for s in report.sources:
            state = s.state
            if self.states.get((s.process, s.rank)) != state:
                self.states[(s.process, s.rank)] = state
                when = local_time(report.checked_at)
                print(f"{when} {s.process} (rank {s.rank}) {state_said(s)}", flush=True)

    def note(self, text: str) -> None:
        """A death, a restart, a dump: a line on stderr (above the table, on a terminal)."""
        say("note", text)

    def waiting(self, why: str) -> None:
        if self.live is not None:
            from rich.text import Text

            self.live.update(Text(f"waiting for records: {why}"), refresh=True)
        elif "waiting" not in self.states.values():
            self.states[("", -1)] = "waiting"
            say("info", f"waiting for records: {why}")


def _watch_table(report: InspectReport) -> Any:
    from rich.table import Table
    from rich.text import Text

    from metric_core.clock import duration, local_time

    table = Table(title=f"{report.name}: {local_time(report.checked_at)}", title_justify="left")
    for name in ("process", "rank", "state", "step", "silent", "step time"):
        table.add_column(name, justify="right" if name in ("rank", "step", "silent", "step time") else "left")
    styles = {
        "stalled": "bold red",
        "died": "bold red",
        "stopped_early": "red",
        "finished": "green",
        "running": "",
        "ended": "",
    }
    for s in report.sources:
        state = s.state
        table.add_row(
            s.process,
            str(s.rank),
            Text(state, style=styles[state]),
            "" if s.last_step is None else str(s.last_step),
            duration(s.silent_s),
            duration(s.cadence_s) if s.cadence_s else "",
        )
    return table


class EventCommands:
    """``watch --on-stall CMD`` and ``--on-alert CMD``: says each event (a stall, an alarm:
    anything with ``told()``, ``who()`` and ``variables(run_dir)``) on stderr, and runs CMD
    once for it (a shell command, not waited for, with the event in its environment); waits
    for the commands at the end."""

    def __init__(self, command: str | None, run_dir: str, *, option: str, kind: str = "warning") -> None:
        self.command, self.run_dir, self.option, self.kind = command, run_dir, option, kind
        self.children: list[tuple[str, Any, Any]] = []  # who, its process, its relay thread
        # On a terminal where watch redraws its table, a command's output goes through
        # this process's stderr (above the table): written straight to the terminal, it
        # would leave stale copies of the table behind.
        self.relay = False

    def __enter__(self) -> EventCommands:
        return self

    def __exit__(self, *exc: object) -> None:
        import subprocess

        for who, child, relay in self.children:
            try:
                code = child.wait(timeout=STALL_COMMAND_WAIT_S)
            except subprocess.TimeoutExpired:
                waited = f"{STALL_COMMAND_WAIT_S:.0f} s"
                say("warning", f"{self.option} command for {who} still runs after {waited}; left running")
                continue
            if relay is not None:  # the rest of what it said, relayed before the process ends
                relay.join(timeout=STALL_COMMAND_WAIT_S)
            if code:
                say("warning", f"{self.option} command for {who} exited with {code}")

    def run(self, event: Any) -> None:
        import subprocess

        say(self.kind, event.told())
        if self.command is None:
            return
        who = event.who()
        env = {**os.environ, **event.variables(str(self.run_dir))}
        if not self.relay:
            self.children.append((who, subprocess.Popen(self.command, shell=True, env=env), None))
            return
        import threading

        child = subprocess.Popen(
            self.command, shell=True, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

        def relay() -> None:
            for line in child.stdout or ():
                say("info", line.rstrip("\n"))

        relaying = threading.Thread(target=relay, daemon=True)
        relaying.start()
        self.children.append((who, child, relaying))


# How long watch waits, at its end, for the --on-stall and --on-alert commands it started.
STALL_COMMAND_WAIT_S = 30.0
