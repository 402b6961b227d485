"""Each global step printed on rank 0's console as it settles: a ``console`` backend in
``global_reduce`` mode (``metric_core.torchforge``), in torchforge's ``ConsoleBackend`` format.

No rank computes the global reduction. Rank 0 starts this module as a child process
(``writer.sidecar.start_console``: ``python -m metric_core.offline.console RUN_DIR``) whose
stderr is rank 0's. It reads the run as ``upload --follow`` does (``read.tail.RunTail``),
settles its steps with the same ``upload.settle.Follower`` (a step once every source that
holds the others back flushed it; a dead source is let go once what it left is read), reduces
each step with the engine (the numbers ``metriclog reduce`` gives) and logs it as torchforge's
``ConsoleBackend.log_batch`` does, through a handler formatted as torchforge's ``get_logger``::

    INFO:metric_core.torchforge.metrics: === [global_reduce] - METRICS STEP 3 ===
      grad/max: 2.51
      loss: 0.312
    ==============================

It looks every half flush interval, so a step is printed within one flush interval of the
last flush of it while a look (read, reduce, print) takes less than half of one. One that
takes longer is said once; the next look starts at once, and the steps come late, in
order, none skipped or merged. It ends by itself once every source shut down or died (every
step printed), or it is stopped: SIGTERM (rank 0's shutdown past its wait), Ctrl-C, or rank
0 gone. Then it looks once more, prints the steps complete and says which it did not print.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import polars as pl

from metric_core.clock import duration
from metric_core.errors import MetricLogError
from metric_core.offline.plan import make_plan
from metric_core.offline.read.tail import RunTail, counted, expected_sources
from metric_core.offline.upload.settle import UNKNOWN_SOURCES, Follower, Ready

LOGGER = "metric_core.torchforge.metrics"  # what a torchforge job imports for forge.observability.metrics
NAME = "global_reduce"  # the process name torchforge's GlobalLoggingActor gives its global backends
RULE = "=============================="
SAID = "console (global_reduce): "
# Without run.json (another tool's files), how long after the first record every source
# that writes is waited for, as ``upload --follow`` waits; a wait for sources is said after it.
NO_RUN_JSON_WAIT_S = 10.0
FINISHED, OVER, STOPPED = "finished", "over", "stopped"


def step_text(step: int, values: dict[str, Any], name: str = NAME) -> str:
    """A step as torchforge's ``ConsoleBackend.log_batch`` words it: the keys in order, each
    value as Python prints it.

    >>> print(step_text(3, {"loss": 0.5, "reward/mean": 1.25, "grad": 2.0}))
    === [global_reduce] - METRICS STEP 3 ===
      grad: 2.0
      loss: 0.5
      reward/mean: 1.25
    ==============================
    <BLANKLINE>
    """
    body = "\n".join(f"  {key}: {values[key]}" for key in sorted(values))
    return f"=== [{name}] - METRICS STEP {step} ===\n{body}\n{RULE}\n"


class Printer:
    """A run followed onto a console: each global step logged once it is complete."""

    def __init__(
        self,
        root: Path,
        log: logging.Logger,
        *,
        flush_interval: float = 1.0,
        from_step: int = 0,
        parent: int | None = None,
        sources: int | None = None,
    ) -> None:
        self.root = root
        self.log = log
        self.flush_interval = flush_interval
        self.parent = parent
        self.sources = sources
        self.tail = RunTail(root)
        plan = make_plan(mode="global_reduce", steps=(from_step, None) if from_step else None)
        self.follower = Follower(plan, share_run=False, sources=sources, rename=False)
        self.stopping: str | None = None  # why it was stopped (a signal), once it was
        self.printed: int | None = None  # the last step printed
        self.first_record: float | None = None
        self._dead: set[tuple[str, int]] = set()
        self._late: dict[tuple[str, int], int] = {}
        self._replaced: set[tuple[str, int]] = set()
        self._notices = 0
        self._slow_said = False
        self._waiting_said = False

    def stop(self, signum: int, _frame: Any = None) -> None:
        """A signal handler: the next look is the last."""
        self.stopping = signal.Signals(signum).name

    def run(self) -> str:
        """Look, print, sleep, until every source is over (``FINISHED``, ``OVER``) or it is
        stopped (``STOPPED``: the steps not printed said)."""
        interval = self.flush_interval / 2
        while True:
            began = time.monotonic()
            why = self.stopping or self._parent_gone()
            records = self.tail.poll()
            if records.height and self.first_record is None:
                self.first_record = began
            self.follower.expected = self._expected()
            ended = self._ended()
            if ended:  # the job is over: the records no flush covered are read as they are
                records = pl.concat([records, self.tail.poll(final=True)], how="vertical")
            self._say_deaths()
            self.follower.add(records, self.tail.sources)
            self._print(self.follower.ready(self.tail.sources, ending=ended is not None))
            self._say_notices()
            if ended:
                return ended
            if why:
                self._say_unprinted(why)
                return STOPPED
            took = time.monotonic() - began
            if took > interval and not self._slow_said:
                self._slow_said = True
                self.log.warning(
                    f"{SAID}reading and printing the steps took {duration(took)}, more than half the flush "
                    f"interval ({duration(self.flush_interval)}): steps are printed late, in order, none "
                    "skipped; `metriclog reduce` gives the same numbers from the files"
                )
            self._sleep(interval - took)

    def _sleep(self, seconds: float) -> None:
        """Sleep in short slices: a signal or rank 0's end cuts it short."""
        until = time.monotonic() + seconds
        while not self.stopping and not self._parent_gone():
            left = until - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, 0.05))

    def _parent_gone(self) -> str | None:
        if self.parent is not None and os.getppid() != self.parent:
            return f"rank 0 (pid {self.parent}) is gone"
        return None

    def _expected(self) -> int:
        """How many sources must have written before a step is complete: ``sources``, else
        run.json's world size (rank 0 wrote it before it started this process)."""
        if self.sources is not None:
            return self.sources
        waited = self.first_record is not None and time.monotonic() - self.first_record > NO_RUN_JSON_WAIT_S
        if self.tail.meta.get("run_id") or waited:
            expected = expected_sources(self.tail.meta) or 1
            seen = counted(self.tail.sources)
            if waited and seen < expected and not self._waiting_said:
                self._waiting_said = True
                self.log.warning(
                    f"{SAID}{seen} of the {expected} ranks run.json counts (world_size) wrote so far: "
                    "no step is printed before every one has"
                )
            return expected
        return UNKNOWN_SOURCES

    def _ended(self) -> str | None:
        """Every source shut down (``FINISHED``), or shut down or died (``OVER``), and as
        many wrote as the run expects. A restarted job's rank 0 starts a printer of its own."""
        sources = self.tail.sources
        if not sources or counted(sources) < (self.follower.expected or 1):
            return None
        if all(s.finished or s.static for s in sources.values()):
            return FINISHED
        if all(s.finished or s.static or s.over is not None for s in sources.values()):
            return OVER
        return None

    def _print(self, ready: list[Ready]) -> None:
        for part in ready:
            for row in part.rows:
                step = int(row.pop("step"))
                self.log.info(step_text(step, row))
                self.printed = step

    def _say_deaths(self) -> None:
        """A source that died, said once in ``inspect``'s words, before its last records count."""
        for key, source in self.tail.sources.items():
            if source.over is not None and key not in self._dead:
                self._dead.add(key)
                why = self.tail.how_ended(key) or source.over
                self.log.warning(f"{SAID}{key[0]} (rank {key[1]}) {why}; the steps go on without it")

    def _say_notices(self) -> None:
        """What the reading found (skipped records, a key under two reductions, records that
        came after their step was printed, a restart), each said once."""
        for text in self.tail.notices[self._notices :]:
            self.log.warning(f"{SAID}{text}")
        self._notices = len(self.tail.notices)
        for text in self.follower.mixed_notices():
            self.log.warning(f"{SAID}{text}")
        for (process, rank), n in sorted(self.follower.late.items()):
            if self._late.get((process, rank)) != n:
                self._late[(process, rank)] = n
                self.log.warning(
                    f"{SAID}{n} record(s) of {process} (rank {rank}) came after their step was printed, "
                    f"so the printed step lacks them; `metriclog reduce {self.root}` counts them"
                )
        for (process, rank), step in sorted(self.follower.replaced.items()):
            if (process, rank) not in self._replaced:
                self._replaced.add((process, rank))
                self.log.warning(
                    f"{SAID}{process} (rank {rank}) restarted from step {step}: the steps from {step} on "
                    f"printed before hold what the restart replaces; `metriclog reduce {self.root}` reads "
                    "the restart's"
                )

    def _say_unprinted(self, why: str) -> None:
        """Stopped: which steps were not printed, and whom they wait for."""
        after = "" if self.printed is None else f" after step {self.printed}"
        pending = self.follower.pending
        if not pending.height:
            self.log.warning(
                f"{SAID}stopped ({why}){after}: the steps after it are not printed; "
                f"`metriclog reduce {self.root}` computes every step from the files"
            )
            return
        low, high = int(pending["step"].min()), int(pending["step"].max())  # type: ignore[arg-type]
        steps = f"step {low}" if low == high else f"steps {low}-{high}"
        now = time.time()
        newest = max((s.clock for s in self.tail.sources.values()), default=-math.inf)
        waiting = [
            f"{p} (rank {r})"
            for (p, r), s in sorted(self.tail.sources.items(), key=lambda kv: (kv[0][1], kv[0][0]))
            if s.holds(newest, now) and (s.done is None or s.done < high)
        ]
        them = "it" if low == high else "them"
        expected, seen = self.follower.expected or 1, counted(self.tail.sources)
        if seen < expected < UNKNOWN_SOURCES:  # a rank that never wrote holds every step
            waiting.append(f"{expected - seen} rank(s) that never wrote (run.json counts {expected})")
        of = f" ({' and '.join(waiting)} did not flush {them})" if waiting else ""
        self.log.warning(
            f"{SAID}stopped ({why}){after}: {steps} not printed{of}; `metriclog reduce {self.root}` "
            f"computes {them} from the files"
        )


def console_logger(stream: Any = None) -> logging.Logger:
    """The logger the steps go to, with torchforge's handler format (``INFO:name: message``)."""
    log = logging.getLogger(LOGGER)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s:%(name)s: %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False
    return log


def main(argv: list[str] | None = None) -> int:
    """``python -m metric_core.offline.console RUN_DIR``: what rank 0 starts (exit 0 once it
    ended or was stopped; 1, said in one line, if the run could not be read)."""
    parser = argparse.ArgumentParser(
        prog="python -m metric_core.offline.console",
        description="Print each global step of a run on this console as it settles (torchforge's format).",
    )
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--flush-interval", type=float, default=1.0, help="the ranks' flush interval")
    parser.add_argument("--from-step", type=int, default=0, help="the first step printed")
    parser.add_argument("--parent", type=int, default=None, help="rank 0's pid: it stops when rank 0 is gone")
    parser.add_argument("--sources", type=int, default=None, help="the sources a step waits for (run.json's)")
    args = parser.parse_args(argv)
    log = console_logger()
    printer = Printer(
        args.run_dir,
        log,
        flush_interval=max(args.flush_interval, 0.1),
        from_step=args.from_step,
        parent=args.parent,
        sources=args.sources,
    )
    stops = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    for signum in stops:
        signal.signal(signum, printer.stop)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)  # rank 0 started it with them held
    try:
        printer.run()
    except MetricLogError as exc:
        log.error(f"{SAID}stopped: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
