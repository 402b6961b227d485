"""When a followed run's steps are complete (``upload --follow``, ``watch``'s global alarms).

``Follower`` keeps the records of buckets not complete yet (``read.tail.RunTail`` reads them
as they settle), and decides which are: a source's step ``k`` once it flushed ``k`` (the
writer then stamps ``k + 1``); a ``global_reduce`` step once every *holding* source did; a
``--by time`` window once every holding source's newest settled record is past its end. A
source stops holding the others back when it finished (a clean ``shutdown()``), died, or,
for a writer that records no life, ``inspect``'s rule calls it stopped early. Until
``sources`` sources wrote (``run.json``'s ``world_size`` by default), no step is complete,
so ranks that start a little late are waited for.

Complete buckets are reduced by the engine's own partial states (``engine.reduce_records``)
and become history rows, in bucket order: a run's rows are the same whichever poll produced
them, which is what a restarted follower (and a later plain ``upload``) continues from. A
record that arrives for a bucket already handed over (a source that appears after the
others passed its steps, a clock behind the others') cannot be added to its row: it is
counted and said, and a plain ``upload`` after the job gives the exact rows.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import polars as pl

from metric_core.errors import spell_options
from metric_core.metric import LoggingMode
from metric_core.offline.engine import KeyReductions, key_matching, plan_filtered, reduce_records
from metric_core.offline.plan import By, ReducePlan, key_matcher, one_rank_a_process
from metric_core.offline.read.report import MixedKey
from metric_core.offline.read.tail import COLUMNS, Source, SourceState, counted, empty_tail
from metric_core.offline.upload.restarts import replaced_from

# The count of sources while run.json, which holds it, is not written yet: every source
# that may still come is waited for.
UNKNOWN_SOURCES = 1 << 30


@dataclass
class Ready:
    """A W&B run's rows that became complete on one poll: ``run`` is the process of a
    per-rank run (None: the one run), ``rows`` the history rows in order."""

    run: str | None
    rows: list[dict[str, Any]]


class Follower:
    """Pending records, and the buckets that became complete (``ready``)."""

    def __init__(
        self,
        plan: ReducePlan,
        *,
        share_run: bool,
        sources: int | None,
        let_go_after: float | None = None,
        rename: bool = True,
    ) -> None:
        self.plan = plan
        self.rename = rename  # keys made W&B-safe (``runs.safe_keys``); off, rows keep them as recorded
        self.let_go_after = let_go_after
        self.share_run = share_run
        self.expected = sources
        self.pending = empty_tail()
        self.raw = plan.mode is LoggingMode.PER_RANK_NO_REDUCE
        self.per_source = plan.mode is not LoggingMode.GLOBAL_REDUCE and not share_run
        self.sent: dict[str | None, float] = {}  # each run's last bucket handed over
        self.sent_steps: dict[tuple[str, int, str], int] = {}  # each attempt's highest step handed over
        self.late: dict[Source, int] = {}  # records that came after their bucket was handed over
        # of those, sources whose late records are a restart's (another attempt's steps were
        # handed over): recorded before its first flush and sealed, they keep its start's step
        self.late_restarts: set[Source] = set()
        self.kept_sources: set[Source] = set()  # of the records kept (the plan's filters passed)
        self.replaced: dict[Source, int] = {}  # a restart replaced what was handed over, from this step
        self.t0: float | None = None
        self.recorded = KeyReductions()
        self.mixed: dict[str, MixedKey] = {}  # keys met under a second reduction (its records skipped)
        self._mixed_noticed: dict[str, dict[str, int]] = {}
        self.mapping: dict[str, str] = {}
        self.match = key_matcher(plan.keys) if plan.keys else None

    def mixed_notices(self) -> list[str]:
        """What to say of the keys met under a second reduction since the last call (their
        records under it skipped), with options spelled as on the command line."""
        out = []
        for key, m in sorted(self.mixed.items()):
            if m.skipped and self._mixed_noticed.get(key) != m.skipped:
                self._mixed_noticed[key] = dict(m.skipped)
                out.append(spell_options(m.text(), lambda name: f"--{name} "))
        return out

    def add(self, records: pl.DataFrame, sources: dict[Source, SourceState]) -> None:
        """New settled records; what a restart of a source replaces is dropped (W&B's rewind)."""
        if records.height:
            kept = plan_filtered(self.plan, records.lazy(), [*COLUMNS, "attempt"]).collect()
            if self.plan.mode is not LoggingMode.GLOBAL_REDUCE:  # a run per process: one rank each
                self.kept_sources.update(kept.select("process", "rank").unique().iter_rows())
                one_rank_a_process(sorted(self.kept_sources))
            self.pending = pl.concat([self.pending, key_matching(kept, self.match)], how="vertical_relaxed")
        if self.plan.attempts != "all":
            self._rewind(sources)
        self._drop_late()

    def _rewind(self, sources: dict[Source, SourceState]) -> None:
        for (process, rank), state in sources.items():
            if len(state.attempts) < 2:
                continue
            ordered = sorted(state.attempts.items(), key=lambda a: (a[1].started, a[0]))
            cuts = replaced_from([a.first_step for _, a in ordered])
            for (attempt, _), cut in zip(ordered, cuts, strict=True):
                if cut is None:
                    continue
                old = (
                    (pl.col("process") == process)
                    & (pl.col("rank") == rank)
                    & (pl.col("attempt") == attempt)
                    & (pl.col("step") >= cut)
                )
                self.pending = self.pending.filter(~old)
                if self.sent_steps.get((process, rank, attempt), -math.inf) >= cut:
                    self.replaced.setdefault((process, rank), cut)

    def _bucket(self) -> pl.Expr:
        """A record's bucket as ``sent`` holds it: its step, window number or (shared raw) time."""
        if self.plan.by is By.TIME:
            assert self.t0 is not None
            return ((pl.col("timestamp") - self.t0) / float(self.plan.every or 0)).floor()
        if self.raw and self.share_run:
            return pl.col("timestamp")
        return pl.col("step").cast(pl.Float64)

    def _drop_late(self) -> None:
        """Records of buckets already handed over (a source let go that came back): counted
        (``late``), not sent; the follow then writes fresh runs that hold them."""
        if not self.sent or (self.raw and self.per_source):  # a source's records come in order
            return
        if self.per_source:
            sent = pl.col("process").replace_strict(self.sent, default=-math.inf, return_dtype=pl.Float64)
        else:
            sent = pl.lit(self.sent.get(None, -math.inf))
        late = self._bucket() <= sent
        found = self.pending.filter(late)
        if found.height:
            for process, rank, attempt, n in found.group_by("process", "rank", "attempt").len().iter_rows():
                self.late[(process, rank)] = self.late.get((process, rank), 0) + n
                if any(at[:2] == (process, rank) and at[2] != attempt for at in self.sent_steps):
                    self.late_restarts.add((process, rank))
            self.pending = self.pending.filter(~late)

    def ready(self, sources: dict[Source, SourceState], ending: bool = False) -> list[Ready]:
        """The rows of every bucket that became complete; with ``ending``, of every bucket."""
        if not self.pending.height:
            return []
        if self.plan.by is By.TIME or (self.raw and self.share_run):
            limit = self._mark(sources, ending, lambda s: s.clock)
            if limit == -math.inf:
                return []
            if self.plan.by is By.TIME and self.t0 is None:
                self.t0 = float(self.pending["timestamp"].min())  # type: ignore[arg-type]
            if limit == math.inf:
                done = pl.lit(True)
            elif self.plan.by is By.TIME:
                assert self.t0 is not None
                done = self._bucket() < math.floor((limit - self.t0) / float(self.plan.every or 0))
            else:
                done = pl.col("timestamp") <= limit
        elif self.raw:
            done = pl.lit(True)  # settled records of a source's own run: nothing to wait for
        elif self.per_source:
            marks = pl.DataFrame(
                [
                    (p, r, math.inf if ending or s.finished or s.static else _or_infinity(s.done))
                    for (p, r), s in sources.items()
                ],
                schema={"process": pl.String, "rank": pl.Int64, "_mark": pl.Float64},
                orient="row",
            )
            joined = self.pending.join(marks, on=["process", "rank"], how="left", maintain_order="left")
            done = joined["step"].cast(pl.Float64) <= joined["_mark"]
        else:
            done = pl.col("step") <= self._mark(sources, ending, lambda s: _or_infinity(s.done))
        complete = self.pending.filter(done)
        if not complete.height:
            return []
        self.pending = self.pending.filter(~done)
        highest = complete.group_by("process", "rank", "attempt").agg(pl.col("step").max())
        for process, rank, attempt, step in highest.iter_rows():
            at = (process, rank, attempt)
            self.sent_steps[at] = max(step, self.sent_steps.get(at, step))
        return self._rows(complete, sources)

    def _mark(
        self, sources: dict[Source, SourceState], ending: bool, of: Callable[[SourceState], float]
    ) -> float:
        """The lowest ``of`` over the sources that hold the others back (inf: none does;
        -inf: fewer sources than expected wrote so far)."""
        if ending:
            return math.inf
        now = time.time()
        if counted(sources) < (self.expected or 1) and not self.missing_let_go(sources, now):
            return -math.inf
        newest = max((s.clock for s in sources.values()), default=-math.inf)
        return min(
            (of(s) for s in sources.values() if s.holds(newest, now, self.let_go_after)), default=math.inf
        )

    def missing_let_go(self, sources: dict[Source, SourceState], now: float) -> bool:
        """Whether the sources expected that never wrote stop holding the global steps:
        ``let_go_after`` seconds passed since the first record of the job's writers, as a
        source silent that long is let go (a rank that died before its first record left no
        file to be seen dying by). A count not known yet (no run.json) is waited for."""
        if self.let_go_after is None or not self.expected or self.expected >= UNKNOWN_SOURCES:
            return False
        if counted(sources) >= self.expected:
            return False
        first = min((s.first for s in sources.values() if not s.static), default=math.inf)
        return now - first > self.let_go_after

    def _rows(self, complete: pl.DataFrame, sources: dict[Source, SourceState]) -> list[Ready]:
        plan, bucket = self.plan, self.plan.bucket
        if self.raw and self.share_run:
            out = complete.sort("timestamp", maintain_order=True)
        elif self.raw:  # a source's records in attempt order (a reader started later sees them at once)
            started = {
                f"{p}\x00{r}\x00{a}": st.started
                for (p, r), s in sources.items()
                for a, st in s.attempts.items()
            }
            at = pl.format("{}\x00{}\x00{}", "process", "rank", "attempt")
            out = complete.sort(at.replace_strict(started, default=-math.inf), maintain_order=True)
        else:
            out = reduce_records(plan, complete, self.t0, self.recorded, self.mixed)
        if self.rename:
            self._map_keys(out["key"].unique().to_list())
        key = (
            pl.col("key").replace_strict(self.mapping, return_dtype=pl.String)
            if self.rename
            else pl.col("key")
        )
        out = out.with_columns(key=pl.format("{}/{}", key, "process") if self.share_run else key)
        ready = []
        for part in out.partition_by("process", maintain_order=True) if self.per_source else [out]:
            run = str(part["process"][0]) if self.per_source else None
            if self.raw:
                rows = [
                    {k: v, bucket: b, "_timestamp": t}
                    for k, v, b, t in part.select("key", "value", bucket, "timestamp").iter_rows()
                ]
                last = float(part["timestamp"].max())  # type: ignore[arg-type]
            else:
                rows = []
                for (at,), group in part.group_by(bucket, maintain_order=True):
                    rows.append({bucket: at, **dict(zip(group["key"], group["value"], strict=True))})
                last = float(part[bucket].max())  # type: ignore[arg-type]
                if plan.by is By.TIME:
                    assert self.t0 is not None
                    last = round((last - self.t0) / float(plan.every or 0))
            self.sent[run] = max(self.sent.get(run, -math.inf), last)
            ready.append(Ready(run, rows))
        return ready

    def _map_keys(self, keys: list[str]) -> None:
        from metric_core.offline.upload.runs import safe_keys

        new = [k for k in keys if k not in self.mapping]
        if new:
            self.mapping.update(safe_keys(new, taken=set(self.mapping.values())))


def _or_infinity(step: int | None) -> float:
    return -math.inf if step is None else float(step)
