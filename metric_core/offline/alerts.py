"""Alarms on the values themselves: a loss that turns NaN, a reward that collapses, a grad
norm that explodes. ``watch`` and the sidecar feed each key's values, step by step, to the
rules asked (``--alert``), and say each episode once.

Rules (docs/commands.md, "Alerts"), each on the keys a shell-style pattern matches:

* ``PATTERN: nonfinite``: a NaN or an infinity;
* ``PATTERN > X`` and ``PATTERN < X``: a threshold;
* ``PATTERN: drop X% over N steps``: below the largest of the previous N values by X% of
  its magnitude (N values seen first);
* ``PATTERN: spike K sigma``: more than K standard deviations away from an exponentially
  weighted baseline (``ALPHA``; its mean and variance, after ``WARM_UP`` values).

A series is one key (``--alert-on global``: the step's global reduction) or one key of one
source (``raw``: every raw value). An **episode** starts at the first value that breaks
the rule and ends after ``RECOVER_STEPS`` steps in a row within it (a step's several raw
values count as one step): one alarm an episode (a key that stays NaN alarms once, and again
only after it recovered). Values that are not finite feed only ``nonfinite``: a NaN is no
evidence of a threshold, a drop or a spike, and neither breaks nor keeps them.
"""

from __future__ import annotations

import collections
import math
import re
from dataclasses import dataclass, field
from typing import Any

from metric_core.errors import MetricLogError
from metric_core.offline.plan import key_matcher, make_plan

ALPHA = 0.1  # the EWMA's weight of the newest value
WARM_UP = 20  # values a spike baseline sees before it judges
RECOVER_STEPS = 3  # steps in a row within the rule that end an episode
FORMS = "'KEY: nonfinite', 'KEY > X', 'KEY < X', 'KEY: drop X% over N steps', 'KEY: spike K sigma'"

_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_RULE = re.compile(
    rf"^(?P<pattern>.+?)\s*(?:"
    rf"(?P<op>[<>])\s*(?P<x>{_NUMBER})"
    rf"|:\s*(?:(?P<nonfinite>nonfinite)"
    rf"|drop\s+(?P<pct>{_NUMBER})\s*%\s+over\s+(?P<n>\d+)\s+steps?"
    rf"|spike\s+(?P<k>{_NUMBER})\s+sigma))\s*$",
    re.IGNORECASE,
)


class AlertRuleError(MetricLogError):
    """An ``--alert`` that is not a rule."""


@dataclass(frozen=True)
class Rule:
    """One ``--alert``: its text as given, the key pattern, and what breaks it."""

    text: str
    pattern: str
    kind: str  # "nonfinite", ">", "<", "drop", "spike"
    x: float = math.nan  # the threshold; the drop's fraction; the spike's K
    n: int = 0  # the drop's window

    def describe(self) -> str:
        if self.kind == "nonfinite":
            return "not finite"
        if self.kind in "<>":
            return f"{self.kind} {self.x:g}"
        if self.kind == "drop":
            return f"dropped {self.x * 100:g}% below the largest of the previous {self.n} values"
        return f"{self.x:g} sigma from its baseline (EWMA, alpha {ALPHA:g})"


def parse_rule(text: str) -> Rule:
    """``--alert``'s text as a ``Rule``; an ``AlertRuleError`` naming the forms if it is none."""
    m = _RULE.match(text.strip())
    if m is None:
        raise AlertRuleError(f"--alert {text!r} is not a rule: write one of {FORMS} (KEY as --key takes it)")
    pattern = m["pattern"].strip()
    if m["op"]:
        return Rule(text, pattern, m["op"], float(m["x"]))
    if m["nonfinite"]:
        return Rule(text, pattern, "nonfinite")
    if m["pct"] is not None:
        pct, n = float(m["pct"]), int(m["n"])
        if not 0 < pct <= 100 or n < 1:
            raise AlertRuleError(
                f"--alert {text!r}: a drop is more than 0% and at most 100%, over 1 step or more"
            )
        return Rule(text, pattern, "drop", pct / 100, n)
    k = float(m["k"])
    if k <= 0:
        raise AlertRuleError(f"--alert {text!r}: a spike is more than 0 sigma")
    return Rule(text, pattern, "spike", k)


@dataclass
class Alert:
    """An episode's first value: which rule, key, step, value, and the source it was seen
    on (``--alert-on raw``: the value's own; ``global``: the first rank whose own value
    broke the rule, where one did, else None)."""

    rule: Rule
    key: str
    step: int
    value: float
    on: str  # "raw" or "global"
    process: str | None = None
    rank: int | None = None

    def who(self) -> str:
        return f"{self.key} at step {self.step}"

    def told(self) -> str:
        where = f" on {self.process} (rank {self.rank})" if self.process is not None else ""
        what = "its global value" if self.on == "global" else "a raw value"
        return (
            f"{self.key} is {self.value:g} at step {self.step}{where} ({what}: {self.rule.describe()}; "
            f"--alert '{self.rule.text}')"
        )

    def variables(self, run_dir: str = "") -> dict[str, str]:
        """What ``--on-alert``'s command gets."""
        return {
            "METRICLOG_RUN_DIR": run_dir,
            "METRICLOG_KEY": self.key,
            "METRICLOG_STEP": str(self.step),
            "METRICLOG_VALUE": repr(self.value),
            "METRICLOG_PROCESS": self.process or "",
            "METRICLOG_RANK": "" if self.rank is None else str(self.rank),
            "METRICLOG_RULE": self.rule.text,
        }


@dataclass
class _Series:
    """One rule's state on one series."""

    in_episode: bool = False
    calm: int = 0  # steps in a row within the rule, during an episode
    step: int | None = None  # the step its values come from now
    broke: bool = False  # whether a value of that step broke the rule
    recent: collections.deque[float] = field(default_factory=collections.deque)  # a drop's window
    mean: float = 0.0
    var: float = 0.0
    seen: int = 0  # finite values the spike baseline took


def breaks(rule: Rule, s: _Series, value: float) -> bool:
    """Whether ``value`` breaks ``rule``, given the series so far; then the series takes it."""
    finite = math.isfinite(value)
    if rule.kind == "nonfinite":
        return not finite
    if not finite:
        return False
    if rule.kind == ">":
        return value > rule.x
    if rule.kind == "<":
        return value < rule.x
    if rule.kind == "drop":
        broke = len(s.recent) == rule.n and value < (top := max(s.recent)) - rule.x * abs(top)
        s.recent.append(value)
        if len(s.recent) > rule.n:
            s.recent.popleft()
        return broke
    broke = s.seen >= WARM_UP and s.var > 0 and abs(value - s.mean) > rule.x * math.sqrt(s.var)
    if s.seen == 0:
        s.mean = value
    else:  # West's exponentially weighted mean and variance
        diff = value - s.mean
        inc = ALPHA * diff
        s.mean += inc
        s.var = (1 - ALPHA) * (s.var + diff * inc)
    s.seen += 1
    return broke


class Alarms:
    """The rules asked, fed series by series in step order: each new episode, once."""

    def __init__(self, rules: list[Rule], on: str = "global") -> None:
        if on not in ("raw", "global"):
            raise AlertRuleError(f"--alert-on must be raw or global, got {on!r}")
        self.rules = rules
        self.on = on
        self.matchers = [key_matcher([r.pattern]) for r in rules]
        self.series: dict[tuple[int, Any], _Series] = {}
        self._watched: dict[str, list[int]] = {}
        self.last_step: dict[tuple[str, Any], int] = {}  # a series' newest step fed
        self.last_attempt: dict[tuple[str, Any], Any] = {}  # and the attempt it came from (raw)

    def watched(self, key: str) -> list[int]:
        """The rules (indexes) that watch ``key``."""
        found = self._watched.get(key)
        if found is None:
            found = self._watched[key] = [i for i, m in enumerate(self.matchers) if m(key)]
        return found

    def feed(
        self,
        key: str,
        step: int,
        value: float,
        source: tuple[str, int] | None = None,
        attempt: Any = None,
    ) -> list[Alert]:
        """One value of a series (``source``: its source, raw; None: the global value), in
        step order (a step's several raw values one after another; ``attempt``: the raw
        value's attempt, its attempts one after another). A step before the series' newest,
        or a new attempt's step at or before it (a restart's rewind), starts its state again."""
        out: list[Alert] = []
        rules = self.watched(key)
        if not rules:
            return out
        last = self.last_step.get((key, source))
        rewound = last is not None and (
            step < last or (step == last and attempt != self.last_attempt.get((key, source)))
        )
        if rewound:
            for i in rules:
                self.series.pop((i, (key, source)), None)
        self.last_step[(key, source)] = step
        self.last_attempt[(key, source)] = attempt
        finite = math.isfinite(value)
        for i in rules:
            rule = self.rules[i]
            if not finite and rule.kind != "nonfinite":
                continue  # no evidence either way: it neither breaks the rule nor keeps it
            s = self.series.setdefault((i, (key, source)), _Series())
            if step != s.step:  # the step before is whole: within the rule if no value broke it
                if s.in_episode and s.step is not None and not s.broke:
                    s.calm += 1
                    if s.calm >= RECOVER_STEPS:
                        s.in_episode, s.calm = False, 0
                s.step, s.broke = step, False
            if breaks(rule, s, value):
                s.calm, s.broke = 0, True
                if not s.in_episode:
                    s.in_episode = True
                    process, rank = source if source is not None else (None, None)
                    out.append(Alert(rule, key, step, value, self.on, process, rank))
        return out

    def offends(self, key: str, value: float) -> list[Rule]:
        """The threshold and nonfinite rules a single raw value breaks by itself (so a global
        alarm can name the first rank that had such a value)."""
        found = []
        for i in self.watched(key):
            rule = self.rules[i]
            if rule.kind in ("nonfinite", "<", ">") and breaks(rule, _Series(), value):
                found.append(rule)
        return found


class ValueWatch:
    """A run's values as they settle (``tail.RunTail``, as the sidecar reads them), fed to
    ``Alarms``: raw, each source's records in step order; global, each step once every live
    source flushed it (``upload.settle.Follower``, reduced as ``reduce`` would)."""

    def __init__(self, run_dir: Any, alarms: Alarms, *, follow_symlinks: bool = False) -> None:
        from metric_core.offline.read.tail import RunTail

        self.alarms = alarms
        # Its own reader (watch), or none: the sidecar hands over what its reader read (``judge``).
        self.tail = RunTail(run_dir, follow_symlinks=follow_symlinks) if run_dir is not None else None
        patterns = sorted({r.pattern for r in alarms.rules})
        self.plan = make_plan(mode="global_reduce", keys=patterns)
        self.follower = self._follower()
        # (key, step, rule) -> the first raw value that broke the rule by itself: (time, process, rank)
        self.offender: dict[tuple[str, int, str], tuple[float, str, int]] = {}
        # Before a reading anew (``anew``): a global series' newest step judged, and a raw
        # series' of each attempt, (key, source, attempt) -> step; what is fed, kept as it goes.
        self.judged: dict[tuple[str, Any], int] = {}
        self.judged_raw: dict[tuple[str, Any, Any], int] = {}
        self.fed_raw: dict[tuple[str, Any, Any], int] = {}

    def _follower(self) -> Any:
        from metric_core.offline.upload.settle import Follower

        return (
            Follower(self.plan, share_run=False, sources=None, rename=False)
            if self.alarms.on == "global"
            else None
        )

    def anew(self, sources: dict[Any, Any]) -> None:
        """The run is read again from its start (the sidecar's fresh pass, after a restart
        replaced rows; ``sources``: the ``RunTail`` sources the pass before read). A value
        judged already is not judged again, a restart's rewound steps are: raw, each
        attempt's records after the newest of them judged (a restart is an attempt of its
        own); global, the steps before the first step a restart replaced."""
        from metric_core.offline.upload.restarts import replaced_from

        cuts = [
            cut
            for state in sources.values()
            for cut in replaced_from(
                [a.first_step for a in sorted(state.attempts.values(), key=lambda a: a.started)]
            )
            if cut is not None
        ]
        rewound = min(cuts, default=None)
        self.judged = {
            series: step if rewound is None else min(step, rewound - 1)
            for series, step in self.alarms.last_step.items()
            if series[1] is None
        }
        self.judged_raw = dict(self.fed_raw)
        self.follower = self._follower()

    def poll(self, final: bool = False) -> list[Alert]:
        """The alarms of the values that settled since the last poll (``final``: the job is
        over, every value read is settled)."""
        assert self.tail is not None
        return self.judge(self.tail.poll(final), self.tail.sources, self.tail.meta, final)

    def judge(
        self, records: Any, sources: dict[Any, Any], meta: dict[str, Any], final: bool = False
    ) -> list[Alert]:
        """The alarms of ``records`` (settled records, as ``RunTail.poll`` gives them), with the
        sources and run.json that reader knows."""
        import polars as pl

        from metric_core.offline.read.tail import expected_sources

        watched = (
            [k for k in records["key"].unique().to_list() if self.alarms.watched(k)] if records.height else []
        )
        mine = records.filter(records["key"].is_in(watched)) if watched else records.clear()
        out: list[Alert] = []
        if self.follower is None:
            attempt = ["attempt"] if "attempt" in mine.columns else []  # the tail's records have it
            # A source's attempts one after another (a poll may read a restart with the
            # attempt it replaced), each in step order.
            began = pl.col("timestamp").min().over("process", "rank", *attempt).alias("_began")
            for process, rank, step, key, value, *tried in (
                mine.with_columns(began)
                .sort("process", "rank", "_began", *attempt, "step", "timestamp")
                .select("process", "rank", "step", "key", "value", *attempt)
                .iter_rows()
            ):
                series = (key, (process, rank), tried[0] if tried else None)
                if step > self.judged_raw.get(series, -1):
                    out += self.alarms.feed(key, step, value, (process, rank), series[2])
                    self.fed_raw[series] = max(step, self.fed_raw.get(series, -1))
            return out
        for process, rank, step, key, value, at in mine.select(
            "process", "rank", "step", "key", "value", "timestamp"
        ).iter_rows():
            for rule in self.alarms.offends(key, value):
                first = self.offender.get((key, step, rule.text))
                if first is None or at < first[0]:
                    self.offender[(key, step, rule.text)] = (at, process, rank)
        self.follower.expected = expected_sources(meta)
        self.follower.add(mine, sources)
        for ready in self.follower.ready(sources, ending=final):
            for row in ready.rows:
                step = int(row["step"])
                for key, value in row.items():
                    if key == "step" or value is None or step <= self.judged.get((key, None), -1):
                        continue
                    for alert in self.alarms.feed(key, step, float(value)):
                        found = self.offender.get((key, step, alert.rule.text))
                        if found is not None:
                            alert.process, alert.rank = found[1], found[2]
                        out.append(alert)
        return out
