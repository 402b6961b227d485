"""Alarms on values (issue 43): the rules against an oracle written apart from them (numpy's
sliding windows, polars' exponentially weighted mean and variance), on seeded series."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from metric_core.offline.alerts import ALPHA, RECOVER_STEPS, WARM_UP, Alarms, AlertRuleError, parse_rule


def test_rules_parse_and_bad_ones_name_the_forms():
    assert parse_rule("train/loss: nonfinite").kind == "nonfinite"
    r = parse_rule("train/grad_norm > 100")
    assert (r.pattern, r.kind, r.x) == ("train/grad_norm", ">", 100.0)
    assert parse_rule("eval/* < -1e3").x == -1000.0
    r = parse_rule("rollout/reward: drop 50% over 20 steps")
    assert (r.kind, r.x, r.n) == ("drop", 0.5, 20)
    r = parse_rule("train/loss: spike 5 sigma")
    assert (r.kind, r.x) == ("spike", 5.0)
    for bad in (
        "train/loss",
        "loss: explodes",
        "loss >",
        "loss: drop 0% over 5 steps",
        "loss: spike 0 sigma",
    ):
        with pytest.raises(AlertRuleError, match="--alert"):
            parse_rule(bad)


def _bad_oracle(kind: str, x: np.ndarray, a: float, n: int) -> np.ndarray:
    """Whether each value breaks the rule, computed whole-array."""
    finite = np.isfinite(x)
    if kind == "nonfinite":
        return ~finite
    out = np.zeros(len(x), dtype=bool)
    if kind == ">":
        return finite & (x > a)
    if kind == "<":
        return finite & (x < a)
    idx = np.flatnonzero(finite)
    f = x[idx]
    if kind == "drop":
        if len(f) > n:
            top = np.lib.stride_tricks.sliding_window_view(f[:-1], n).max(axis=1)
            out[idx[n:]] = f[n:] < top - a * np.abs(top)
        return out
    s = pl.Series(f)
    mean = s.ewm_mean(alpha=ALPHA, adjust=False).to_numpy()
    var = s.ewm_var(alpha=ALPHA, adjust=False, bias=True).to_numpy()
    j = np.arange(1, len(f))
    judged = (j >= WARM_UP) & (var[:-1] > 0)
    out[idx[1:]] = judged & (np.abs(f[1:] - mean[:-1]) > a * np.sqrt(np.where(var[:-1] > 0, var[:-1], 1.0)))
    return out


def _episodes(bad: np.ndarray, counted: np.ndarray | None = None) -> list[int]:
    """Where episodes start: a step that breaks the rule starts one, 3 steps in a row within
    it end it; a step not ``counted`` (a NaN for a rule that is not ``nonfinite``) is neither."""
    starts, inside, calm = [], False, 0
    for t, b in enumerate(bad):
        if counted is not None and not counted[t]:
            continue
        if b:
            calm = 0
            if not inside:
                inside = True
                starts.append(t)
        elif inside:
            calm += 1
            if calm >= RECOVER_STEPS:
                inside, calm = False, 0
    return starts


def _series(rng: np.random.Generator, steps: int) -> np.ndarray:
    """A noisy curve with NaN stretches, excursions, collapses and spikes."""
    x = 10 + np.cumsum(rng.normal(0, 0.1, steps)) + rng.normal(0, 0.3, steps)
    for _ in range(rng.integers(0, 4)):
        at = rng.integers(0, steps)
        x[at : at + rng.integers(1, 8)] = rng.choice([math.nan, math.inf, -math.inf])
    for _ in range(rng.integers(0, 4)):
        at = rng.integers(0, steps)
        x[at : at + rng.integers(1, 10)] *= rng.choice([0.2, 3.0])
    for _ in range(rng.integers(0, 4)):
        x[rng.integers(0, steps)] += rng.normal(0, 20)
    return x


@pytest.mark.parametrize("seed", range(40))
def test_each_rule_alarms_once_an_episode_as_the_oracle_says(seed):
    rng = np.random.default_rng(seed)
    x = _series(rng, int(rng.integers(30, 400)))
    rules = ["k: nonfinite", "k > 12", "k < 8", "k: drop 40% over 10 steps", "k: spike 4 sigma"]
    for text in rules:
        rule = parse_rule(text)
        alarms = Alarms([rule], on="raw")
        got = [a.step for t, v in enumerate(x) for a in alarms.feed("k", t, float(v), ("r0", 0))]
        counted = None if rule.kind == "nonfinite" else np.isfinite(x)
        want = _episodes(_bad_oracle(rule.kind, x, rule.x, rule.n), counted)
        assert got == want, (text, seed)


@pytest.mark.parametrize("seed", range(20))
def test_a_steps_several_raw_values_are_one_step_of_an_episode(seed):
    """Soak (issue 43): an episode ended after 3 values within the rule, where the docs say
    3 steps; a step is within the rule when all its values are, breaks it when any does."""
    rng = np.random.default_rng(1000 + seed)
    steps = int(rng.integers(20, 120))
    per_step = [
        rng.choice([-1.0, 20.0, 5.0, math.nan], size=int(rng.integers(1, 5)), p=[0.1, 0.2, 0.6, 0.1])
        for _ in range(steps)
    ]
    for text in ["k: nonfinite", "k > 12", "k < 0"]:
        rule = parse_rule(text)
        alarms = Alarms([rule], on="raw")
        got = [
            a.step
            for t, vs in enumerate(per_step)
            for v in vs
            for a in alarms.feed("k", t, float(v), ("r0", 0))
        ]
        if rule.kind == "nonfinite":
            bad = np.array([bool(np.isnan(vs).any()) for vs in per_step])
            counted = None
        else:
            finite = [vs[np.isfinite(vs)] for vs in per_step]
            bad = np.array([bool(_bad_oracle(rule.kind, f, rule.x, 0).any()) for f in finite])
            counted = np.array([len(f) > 0 for f in finite])
        assert got == _episodes(bad, counted), (text, seed)


def test_a_nan_neither_breaks_a_threshold_nor_ends_its_episode():
    alarms = Alarms([parse_rule("k > 100")], on="global")
    values = [200, math.nan, math.nan, math.nan, 300, 1, 1, 1, 300]
    got = [a.step for t, v in enumerate(values) for a in alarms.feed("k", t, float(v))]
    assert got == [0, 8]  # 200 .. 300 is one episode: the NaNs are no evidence it recovered


def test_a_restart_from_the_newest_step_judged_rewinds_a_raw_series_read_in_one_look():
    """Soak (issue 43): a restart from the step its attempt last wrote was not taken for a
    rewind, and a look that read both attempts judged them mixed by step."""
    from metric_core.offline.alerts import ValueWatch

    rows = [  # attempt a: steps 0-4 NaN from 2; attempt b (a restart): steps 4-6, NaN at 4
        *[("a", s, 100.0 + s, math.nan if s >= 2 else 1.0) for s in range(5)],
        *[("b", s, 200.0 + s, math.nan if s == 4 else 1.0) for s in range(4, 7)],
    ]
    records = pl.DataFrame(
        {
            "process": ["r0"] * len(rows),
            "rank": [0] * len(rows),
            "attempt": [r[0] for r in rows],
            "step": [r[1] for r in rows],
            "timestamp": [r[2] for r in rows],
            "key": ["k"] * len(rows),
            "value": [r[3] for r in rows],
        }
    ).sample(fraction=1.0, shuffle=True, seed=3)
    watch = ValueWatch(None, Alarms([parse_rule("k: nonfinite")], on="raw"))
    got = [(a.step, a.value) for a in watch.judge(records, {}, {})]
    assert [s for s, _ in got] == [2, 4]  # the first attempt's episode, and the restart's own


def test_a_series_is_a_key_of_a_source_and_an_alarm_names_it():
    alarms = Alarms([parse_rule("train/*: nonfinite"), parse_rule("train/loss > 5")], on="raw")
    said = []
    for step in range(10):
        for rank in range(4):
            v = math.nan if (rank == 2 and step >= 4) else 1.0 + rank
            said += alarms.feed("train/loss", step, v, (f"r{rank}", rank))
        said += alarms.feed("eval/loss", step, math.nan, ("r0", 0))  # not watched
    (alert,) = said  # rank 2 stays NaN: one alarm, on rank 2 only
    assert (alert.key, alert.step, alert.process, alert.rank) == ("train/loss", 4, "r2", 2)
    assert alert.variables()["METRICLOG_RULE"] == "train/*: nonfinite"
    assert alert.told().startswith("train/loss is nan at step 4 on r2 (rank 2) (a raw value: not finite")


def test_a_restart_rewinds_a_series():
    alarms = Alarms([parse_rule("k > 1")], on="global")
    got = [a.step for s, v in [(0, 2), (1, 2), (2, 2), (1, 2), (2, 0.5)] for a in alarms.feed("k", s, v)]
    assert got == [0, 1]  # the rewind to step 1 starts the series again: a new episode


def test_a_key_recorded_several_times_a_step_is_one_series_not_a_rewind():
    """Raw values of one step (micro-batches) follow one another: no reset between them."""
    alarms = Alarms([parse_rule("k: nonfinite")], on="raw")
    said = [
        a.step
        for step in range(6)
        for v in ([math.nan] * 3 if step in (2, 3) else [1.0, 2.0, 3.0])
        for a in alarms.feed("k", step, v, ("r0", 0))
    ]
    assert said == [2]  # one episode: steps 2-3, every value NaN
