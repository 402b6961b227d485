"""The truth of a job, from the ledgers its ranks kept (``worker.py``), and every statistic
computed exactly over it.

A record a returned ``flush()`` covered is *required*: every command must see it. One
recorded after the last returned flush of an attempt that died is *optional*: a kill may
or may not have left it on disk. Nothing else may ever be read. Restarts are rewound as
docs/durability.md says: an attempt replaces its source's earlier attempts' records from
the step of its own first flush on.

Statistics are exact (``fractions.Fraction`` over the float64 values, ``math.isqrt`` for
the square root of std's variance), and sum, mean and std are compared bit for bit with
the correctly rounded exact value, as the engine computes them (docs/modes.md).
"""

from __future__ import annotations

import fnmatch
import json
import math
from collections import defaultdict
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path

import numpy as np


@dataclass
class Rec:
    process: str
    rank: int
    step: int
    key: str
    reduction: str
    value: str  # float.hex of the float64 the file must hold
    required: bool
    attempt: int
    alt_step: int | None = None  # the step it was recorded in, where a seal may have kept it


@dataclass
class Smp:
    process: str
    rank: int
    step: int
    key: str
    sample: dict
    required: bool
    alt_step: int | None = None


@dataclass
class Attempt:
    process: str
    rank: int
    number: int
    started: float
    end: str  # shutdown, exception, signal, died
    signal: str | None
    ended_at: float
    first_step: int | None
    records: list[Rec] = field(default_factory=list)
    samples: list[Smp] = field(default_factory=list)
    big: dict | None = None
    exception: str | None = None  # the type an ``exception`` end raised


@dataclass
class Truth:
    attempts: dict[tuple[str, int], list[Attempt]]
    records: dict[tuple[str, int], list[Rec]]  # rewound, in the order recorded
    samples: list[Smp]
    foreign: dict[tuple[str, int], list[Rec]]
    # every attempt's records, in the order recorded, those a restart replaced optional:
    # what a source whose restarted attempt's declaration was destroyed may read back
    unrewound: dict[tuple[str, int], list[Rec]] = field(default_factory=dict)

    def sources(self) -> dict[tuple[str, int], list[Rec]]:
        return {**self.records, **self.foreign}


def read_truth(job_dir: Path, job: dict, runner_notes: dict) -> Truth:
    attempts: dict[tuple[str, int], list[Attempt]] = {}
    for plan in job["ranks"]:
        source = (plan["process"], plan["rank"])
        found = []
        for number in (1, 2):
            path = job_dir / "ledger" / f"r{plan['rank']}.a{number}.jsonl"
            if path.exists():
                notes = runner_notes.get(f"{plan['rank']}.{number}", {})
                found.append(_attempt(path, source, number, notes, plan["segment_records"]))
        attempts[source] = found
    records, samples, unrewound = {}, [], {}
    for source, those in attempts.items():
        kept: list[Rec] = []
        every: list[Rec] = []
        for i, attempt in enumerate(those):
            later = [a.first_step for a in those[i + 1 :] if a.first_step is not None]
            kept += [_rewound(r, later) for r in attempt.records if _kept(r, later)]
            every += [r if _kept(r, later) else replace(r, required=False) for r in attempt.records]
            samples += [_rewound(s, later) for s in attempt.samples if _kept(s, later)]
        records[source] = kept
        unrewound[source] = every
    foreign: dict[tuple[str, int], list[Rec]] = defaultdict(list)
    path = job_dir / "ledger" / "foreign.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            e = json.loads(line)
            foreign[(e["p"], e["rank"])].append(
                Rec(e["p"], e["rank"], e["s"], e["k"], e["r"], e["v"], True, 0)
            )
    return Truth(attempts, records, samples, dict(foreign), unrewound)


def _kept(r: Rec | Smp, later: list[int]) -> bool:
    return all(min(r.step, r.step if r.alt_step is None else r.alt_step) < f for f in later)


def _rewound(r, later: list[int]):
    """A record whose two possible labels fall on either side of a restart's first step
    may or may not be replaced: optional."""
    if r.alt_step is not None and not all(max(r.step, r.alt_step) < f for f in later):
        r.required = False
    return r


def _attempt(path: Path, source: tuple[str, int], number: int, notes: dict, segment_records: int) -> Attempt:
    """An attempt's records and samples, labelled with the step of the flush that covered
    them. A journal that fills up between two flushes (twice ``segment_records`` records,
    or ``segment_records`` before the attempt's first flush) is sealed then, and the
    records sealed keep the step they were recorded in (docs/format.md): where that could
    have happened, either label is allowed (``alt_step``). ``low``..``rows`` bound the
    open journal's records at the last flush: where a seal may have come between two
    flushes, how many records followed it in the new journal depends on the writer
    thread's timing (a flush then seals a journal of ``segment_records`` or more)."""
    low, rows, flushed = 0, 0, False
    pending_r: list[dict] = []
    pending_s: list[dict] = []
    records: list[Rec] = []
    samples: list[Smp] = []
    started = ended = 0.0
    end, sig, first_step, big, exception = "died", None, None, None, None
    raised = False
    for line in path.read_text().splitlines():
        e = json.loads(line)
        t = e["t"]
        if t == "start":
            started = ended = e["time"]
        elif t == "rec":
            pending_r.append(e)
        elif t == "smp":
            pending_s.append(e)
        elif t == "ack":
            ended = e["time"]
            if first_step is None:
                first_step = e["step"]
            low += len(pending_r) + len(pending_s)
            rows += len(pending_r) + len(pending_s)
            early = rows >= 2 * segment_records or (not flushed and rows >= segment_records)
            records += [
                Rec(*source, e["step"], r["k"], r["r"], r["v"], True, number, r["s"] if early else None)
                for r in pending_r
            ]
            samples += [
                Smp(*source, e["step"], s["k"], s["d"], True, s["s"] if early else None) for s in pending_s
            ]
            pending_r, pending_s = [], []
            if early:  # sealed between the flushes, maybe: what followed, sealed now if full
                low, rows = 0, min(rows, segment_records - 1)
            elif low >= segment_records:
                low = rows = 0  # sealed at this flush
            elif rows >= segment_records:
                low, rows = 0, segment_records - 1  # sealed now, or not full
            flushed = True
        elif t == "big":
            big = e
        elif t == "fault":
            ended = e["time"]
            end, sig = {
                "sigkill": ("died", None),
                "exit": ("died", None),
                "raise": ("exception", None),
                "sigterm": ("signal", "SIGTERM"),
                "hang": ("died", None),
            }[e["kind"]]
            exception = "RuntimeError" if e["kind"] == "raise" else None
        elif t == "nfraise":
            # record_metric raised NonFiniteError after buffering the value; uncaught, the
            # attempt ends with it, and the writer writes what it buffered as the process
            # exits (docs/durability.md: "after the value is recorded, so the file holds it"):
            # the step's records up to that value are required, not optional
            ended, end, exception, raised = e["time"], "exception", "NonFiniteError", True
        elif t == "done":
            end, ended = "shutdown", e["time"]
    if notes.get("killed_with") == "SIGTERM":
        end, sig = "signal", "SIGTERM"
    if "killed_at" in notes:
        ended = notes["killed_at"]
    records += [Rec(*source, r["s"], r["k"], r["r"], r["v"], raised, number) for r in pending_r]
    samples += [Smp(*source, s["s"], s["k"], s["d"], raised) for s in pending_s]
    return Attempt(*source, number, started, end, sig, ended, first_step, records, samples, big, exception)


# -- statistics ------------------------------------------------------------------------


def statistic_of(key: str, reduction: str, overrides: list[str]) -> str:
    """A key's statistic: the last ``--reduce`` pattern that matches it, else its reduction."""
    for pattern in reversed(overrides):
        glob, stat = pattern.rsplit("=", 1)
        if fnmatch.fnmatchcase(key, glob):
            return stat
    return reduction


def check_value(stat: str, values: list[float], got: float, times: list[float] | None = None) -> str | None:
    """None when ``got`` is the statistic ``stat`` of ``values`` (in the order read, with
    their timestamps for first and last), else what is wrong."""
    n = len(values)
    if stat == "count":
        return None if got == n else f"count {got!r}, expected {n}"
    if stat in ("first", "last"):
        assert times is not None
        edge = min(times) if stat == "first" else max(times)
        allowed = [v for v, t in zip(values, times, strict=True) if t == edge]
        return (
            None if any(_same(got, v) for v in allowed) else f"{stat} {got!r}, expected one of {allowed[:4]}"
        )
    if stat == "median" or stat.startswith("p"):
        arr = np.array(values, dtype=np.float64)
        with np.errstate(all="ignore"):  # inf - inf in numpy's interpolation: NaN, as the engine's
            want = float(np.median(arr)) if stat == "median" else float(np.percentile(arr, float(stat[1:])))
        return None if _same(got, want, zeros=True) else f"{stat} {got!r}, numpy says {want!r}"
    if any(math.isnan(v) for v in values):
        return None if math.isnan(got) else f"{stat} {got!r} of a group holding NaN, expected NaN"
    if stat in ("max", "min"):
        want = max(values) if stat == "max" else min(values)
        return None if _same(got, want, zeros=True) else f"{stat} {got!r}, expected {want!r}"
    infinite = {v for v in values if math.isinf(v)}
    if infinite:
        want = math.nan if stat == "std" or len(infinite) == 2 else next(iter(infinite))
        return (
            None
            if _same(got, want)
            else f"{stat} {got!r} of a group holding {sorted(infinite)}, IEEE says {want!r}"
        )
    exact = [Fraction(v) for v in values]
    total = sum(exact, Fraction(0))
    mean = total / n
    if stat == "sum":
        want = _rounded(total)
    elif stat == "mean":
        want = _rounded(mean)
    elif stat == "std":
        want = _root(sum(((v - mean) ** 2 for v in exact), Fraction(0)) / n)
    else:
        raise ValueError(f"no oracle for statistic {stat!r}")
    if _same(got, want):  # bit for bit: an exact zero is +0.0
        return None
    return f"{stat} {got!r}, the correctly rounded exact value is {want!r}"


def _rounded(x: Fraction) -> float:
    """The float64 nearest ``x`` (ties to even; +-inf past the range)."""
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def _root(x: Fraction) -> float:
    """The float64 nearest the square root of ``x`` (>= 0): ``math.isqrt`` of ``x`` scaled
    to at least 112 bits gives a root ``r`` of at least 56 bits, exact or between ``r`` and
    ``r + 1``; where it is not exact, ``r + 1/2`` rounds to the same float (no midpoint of
    53-bit floats lies between: round to odd)."""
    if x == 0:
        return 0.0
    k = (112 - (x.numerator.bit_length() - x.denominator.bit_length())) // 2 + 2
    num, den = (x.numerator * 4**k, x.denominator) if k >= 0 else (x.numerator, x.denominator * 4**-k)
    q, remainder = divmod(num, den)
    r = math.isqrt(q)
    inexact = remainder != 0 or r * r != q
    return _rounded((2 * r + inexact) / Fraction(2) ** (k + 1))


def _same(got: float, want: float, *, zeros: bool = False) -> bool:
    if math.isnan(want):
        return math.isnan(got)
    if zeros and got == 0 and want == 0:
        return True
    return float(got).hex() == float(want).hex()


# -- alarms on values (issue 43) -------------------------------------------------------
#
# What the alarms see (docs/commands.md, "Alerts"): the values as they land, so each rule
# judges, series by series, in step order: ``--alert-on raw`` every raw value of one key of
# one source (a step's several values, from several loop steps of one flush, one after
# another in the order recorded, as alerts.py takes them); ``global`` each step's global
# reduction of one key (as ``reduce`` computes it) once every live rank flushed it, a dead
# rank's unflushed records included (every reader reads them once its process is over).
#
# The values are the records the raw read returned before any damage (``checks.raw``:
# each matched to the ledger), with their timestamps: every acknowledged value, and of an
# attempt that died, the unacknowledged values its files hold; an alarm on one of those
# fires exactly when the files hold it (watch reads a dead attempt's journal whole once
# its process is over, as reduce does; a write the kill cut short is skipped by both).
#
# A restart: the values a restart replaced were seen as they landed (an alarm said on one
# stays said), and "a restart that rewinds a series starts its rules again from there". The
# code does so only when one poll read the dead attempt and a later one the restart (a step
# below the series' newest); when one poll reads both, they are sorted together by step and
# no rewind is seen; and with --alert-on global, a step handed over before the restart
# flushed keeps the dead attempt's values (the restart's are late: dropped), and steps
# handed over while no attempt of the source was alive go without it. What the alarms say
# there depends on when watch looked. The generator (``_alerts``) keeps events out of
# those steps, and the drop and spike rules (whose state is every value) out of jobs with a
# restart: whichever way the code reads them, the alarms are then the same, and equal to
# the ones computed here from the rewound records.

ALPHA, WARM_UP, RECOVER = 0.1, 20, 3  # docs/commands.md: alpha 0.1, judged after 20 values, 3 steps


@dataclass(frozen=True)
class Expected:
    rule: str
    key: str
    step: int
    value: str  # repr(float), as METRICLOG_VALUE
    who: frozenset[tuple[str, str]]  # (process, rank) it may name: raw, its own; global, the first


def expected_alarms(rows: list[dict], rules: list[dict], on: str) -> list[Expected]:
    """Every alarm a watch with ``rules`` (``--alert-on on``) must say, over ``rows`` (the raw
    records read back, with their timestamps)."""
    out: list[Expected] = []
    for rule in rules:
        mine = [r for r in rows if fnmatch.fnmatchcase(r["key"], rule["pattern"])]
        series: dict[tuple, list[dict]] = defaultdict(list)
        for r in mine:
            series[(r["key"], (r["process"], r["rank"])) if on == "raw" else (r["key"], None)].append(r)
        for (key, source), members in sorted(series.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
            if source is not None:  # raw: in step order, a step's values as recorded
                ordered = sorted(members, key=lambda r: (r["step"], r["timestamp"], r["order"]))
                points = [(r["step"], float(r["value"]), {(r["process"], str(r["rank"]))}) for r in ordered]
            else:
                by_step: dict[int, list[dict]] = defaultdict(list)
                for r in members:
                    by_step[r["step"]].append(r)
                points = []
                for step in sorted(by_step):
                    group = by_step[step]
                    value = reduced(group[0]["reduction"], [float(r["value"]) for r in group])
                    points.append((step, value, _first_offender(rule, group)))
            for step, value, who in _episodes(rule, points):
                out.append(Expected(rule["text"], key, step, repr(value), frozenset(who)))
    return out


def _first_offender(rule: dict, group: list[dict]) -> set[tuple[str, str]]:
    """A global alarm's process: the first (by time) whose own value broke a nonfinite or
    threshold rule at that step, any of those tied; none for a drop or a spike."""
    if rule["kind"] not in ("nonfinite", ">", "<"):
        return {("", "")}
    broke = [r for r in group if _breaks_alone(rule, float(r["value"]))]
    if not broke:
        return {("", "")}
    first = min(r["timestamp"] for r in broke)
    return {(r["process"], str(r["rank"])) for r in broke if r["timestamp"] == first}


def _breaks_alone(rule: dict, v: float) -> bool:
    if rule["kind"] == "nonfinite":
        return not math.isfinite(v)
    if not math.isfinite(v):
        return False
    return v > rule["x"] if rule["kind"] == ">" else v < rule["x"]


def _episodes(rule: dict, points: list[tuple[int, float, set]]):
    """The first point of each episode of ``rule`` over one series: an episode starts at a
    value that breaks the rule and ends after ``RECOVER`` values in a row within it. A value
    that is not finite feeds only ``nonfinite``: for another rule it breaks nothing and is
    left out of the drop's window and the spike's baseline (and counts as within the rule:
    the soak records none on keys such rules watch)."""
    finite = [v for _, v, _ in points if math.isfinite(v)]
    spike = _spike_breaks(finite, rule["x"]) if rule["kind"] == "spike" else None
    in_episode, calm, seen = False, 0, 0
    for step, v, who in points:
        if rule["kind"] == "nonfinite" or not math.isfinite(v):
            broke = rule["kind"] == "nonfinite" and not math.isfinite(v)
        elif rule["kind"] in "<>":
            broke = _breaks_alone(rule, v)
        elif rule["kind"] == "drop":
            window = finite[max(0, seen - rule["n"]) : seen]
            top = max(window) if window else 0.0
            broke = len(window) == rule["n"] and v < top - rule["x"] * abs(top)
            seen += 1
        else:
            broke = spike[seen]
            seen += 1
        if broke:
            calm = 0
            if not in_episode:
                in_episode = True
                yield step, v, who
        elif in_episode:
            calm += 1
            if calm >= RECOVER:
                in_episode, calm = False, 0


def _spike_breaks(values: list[float], k: float) -> list[bool]:
    """Whether each value is more than ``k`` standard deviations from the baseline of the
    values before it: polars' ``ewm_mean``/``ewm_var(alpha=0.1, adjust=False, bias=True)``
    (docs/commands.md names them), judged from the 21st value on."""
    import polars as pl

    if not values:
        return []
    s = pl.Series(values, dtype=pl.Float64)
    mean = s.ewm_mean(alpha=ALPHA, adjust=False).to_list()
    var = s.ewm_var(alpha=ALPHA, adjust=False, bias=True).to_list()
    out = [False] * len(values)
    for i in range(WARM_UP, len(values)):
        m, v2 = mean[i - 1], var[i - 1]
        out[i] = v2 > 0 and abs(values[i] - m) > k * math.sqrt(v2)
    return out


def reduced(stat: str, values: list[float]) -> float:
    """A group's global value as the engine computes it (``check_value``'s rules): NaN when
    any is; max and min; sum and mean of infinities as IEEE says, else correctly rounded."""
    if any(math.isnan(v) for v in values):
        return math.nan
    if stat in ("max", "min"):
        return max(values) if stat == "max" else min(values)
    infinite = {v for v in values if math.isinf(v)}
    if infinite:
        return math.nan if len(infinite) == 2 else next(iter(infinite))
    total = sum((Fraction(v) for v in values), Fraction(0))
    if stat == "sum":
        return _rounded(total)
    if stat == "mean":
        return _rounded(total / len(values))
    raise ValueError(f"no global value for statistic {stat!r}")
