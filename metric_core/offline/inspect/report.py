"""What ``inspect_run`` reports, and its JSON (docs/commands.md): a source's health, the
first to stop, non-finite values, stragglers."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from metric_core.errors import as_keyword, spell_options
from metric_core.offline.inspect.story import Failure, Pause
from metric_core.offline.inspect.verdict import verdict_lines
from metric_core.offline.read.attempts import Attempt


@dataclass
class SourceHealth:
    """One source (process, rank) of the run."""

    process: str
    rank: int
    files: int
    skipped: int
    truncated: bool
    dropped: int  # recorded, but its writer could not write them (its D frames)
    records: int
    keys: int
    # Its steps and the times of its first and newest records; a source that recorded
    # nothing (its attempt died after init(), or has not stepped yet): no step (None), and
    # the time its newest attempt started for both.
    first_step: int | None
    last_step: int | None
    first_timestamp: float
    last_timestamp: float
    lag_s: float  # the newest record of any source minus this source's newest
    cadence_s: float | None  # its median gap between consecutive steps
    clean_shutdown: bool
    status: str  # "finished", "stopped_early" or "unfinished"
    # Each init() of the source that wrote into the run (a restart is a new one), oldest first.
    attempts: list[Attempt] = field(default_factory=list)
    silent_s: float = 0.0  # the wall clock (the report's checked_at) minus its newest record
    # Not finished nor over, and silent against the wall clock for ``stall_after_s`` (judged
    # once it has a cadence): a hang, even when every source hangs together.
    stalled: bool = False
    stall_after_s: float | None = None  # max(10 s, 10 step times, twice its longest pause), or as asked
    end: str | None = None  # its newest attempt's end (``offline.inspect.story``): "running", "died", ...
    # Where its main thread is (a running source whose writer says it): {"own", "inner", "since"},
    # and "threads" once it was silent 10 s.
    where: dict[str, Any] | None = None
    no_heartbeat: bool = False  # running, but its writer thread is not heard (native code, SIGSTOP)
    # What it is now, in the one vocabulary of inspect, watch, plot and the sidecar: running,
    # stalled, finished, died (or stopped_early or ended, for files that record no life).
    state: str = ""


@dataclass
class FirstToStop:
    """The source that stopped first, and its last value of every key (NaN stays NaN)."""

    process: str
    rank: int
    last_step: int | None  # (a source that stopped early has a record: never None)
    last_timestamp: float
    lag_s: float
    status: str
    last_values: dict[str, float]


@dataclass
class NonFinite:
    """Where a source's key first held NaN or an infinity, and how many it held."""

    process: str
    rank: int
    key: str
    first_step: int
    first_timestamp: float
    count: int


@dataclass
class Straggler:
    """A source whose median step time is STRAGGLER_RATIO times its role's or more; and the
    step it reached latest after the fastest source of its role."""

    process: str
    rank: int
    worst_lag_s: float
    at_step: int
    step_time_s: float  # its median time from one step's last record to the next one's
    role_step_time_s: float  # the median of the other sources' of its role


@dataclass
class InspectReport:
    """What ``inspect_run`` found; ``to_json()`` is the object docs/commands.md describes."""

    run_dir: str
    name: str
    world_size: int | None
    missing_ranks: list[int]
    sources: list[SourceHealth]
    first_to_stop: FirstToStop | None
    nonfinite: list[NonFinite]
    stragglers: list[Straggler]
    skipped_records: int
    unreadable_files: list[str]
    # A source that has not finished wrote recently against the wall clock (``checked_at``)
    # and its cadence: the job is likely still running.
    still_running: bool = False
    checked_at: float = 0.0
    # Every source that stopped early, the first to stop first (``first_to_stop`` is the first).
    stopped_early: list[FirstToStop] = field(default_factory=list)
    # The earliest attempt end that was not a clean shutdown (``offline.inspect.story``).
    first_failure: Failure | None = None
    # The sources whose attempts failed first all together (one event, no culprit): then no
    # first_failure. [{"process", "rank"}]
    together: list[dict[str, Any]] = field(default_factory=list)
    pauses: list[Pause] = field(default_factory=list)
    # Samples (Reduce.SAMPLE) per key: not records, read by ``metriclog samples``.
    samples: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """Strict JSON: a number that is not finite (NaN, infinity) becomes null."""
        return _strict_json(self.to_dict())

    def verdict(self, spelling: Callable[[str], str] = as_keyword) -> list[str]:
        """The plain-words verdict that follows the table (options named as ``spelling`` says)."""
        return [spell_options(line, spelling) for line in verdict_lines(self)]


def _strict_json(report: dict[str, Any]) -> str:
    """JSON with every non-finite number as null.

    >>> json.loads(_strict_json({"last_values": {"loss": float("nan"), "lr": 0.1}}))
    {'last_values': {'loss': None, 'lr': 0.1}}
    """

    def finite(obj: Any) -> Any:
        if isinstance(obj, float) and not math.isfinite(obj):
            return None
        if isinstance(obj, dict):
            return {k: finite(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [finite(v) for v in obj]
        return obj

    return json.dumps(finite(report), indent=2, allow_nan=False)
