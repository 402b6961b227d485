"""Each command of a finished job, run and checked against the oracle.

The raw mode (``per_rank_no_reduce``) is checked first, record by record, against the
ledgers: every required record once, in order, bit for bit; an optional one at most once;
nothing else. The records it returned are then the ground truth of every reducing
command: each group's statistic computed exactly over them (``oracle.check_value``).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import threading
from collections import Counter, defaultdict
from fractions import Fraction
from pathlib import Path

import numpy as np

from tests.soak.oracle import Rec, Truth, check_value, expected_alarms, read_truth, statistic_of

# What a job is checked with, besides its raw records (always): a fixed seed of the suite
# can name the ones that found its bug (seeds.txt's ``only=``), so it costs less there.
CHECKS = frozenset(
    {
        "reduce",
        "by_time",
        "keys",
        "samples",
        "inspect",
        "uploads",
        "alerts",
        "torchforge",
        "across",
        "trackers",
    }
)


def check_job(job) -> None:
    spec = job.job
    truth = read_truth(job.dir, spec, job.notes)
    result = job.result
    result.records = sum(len(v) for v in truth.sources().values())
    for source, attempts in truth.attempts.items():
        for a in attempts:
            if a.big is not None and not a.big["refused"]:
                result.fail(
                    f"record_metric took 2**53 + 1 for 'bigint/sum' ({source[0]}), which float64 "
                    "cannot hold: it should refuse it with a ValueError naming the key (defect 3)"
                )
            elif a.big is not None and not a.big["names_key"]:
                result.fail("record_metric refused 2**53 + 1 without naming the key 'bigint/sum'")
    seen = raw(job, truth, damaged=set())
    if seen is None:
        return
    doubtful: list[dict] = []
    wanted = CHECKS if job.only is None else job.only
    if spec["alerts"] and "alerts" in wanted:
        alerts(job, seen)
    if spec["uploads"] and "uploads" in wanted:
        uploads(job, truth, seen)
    if job.console_done is not None:
        console(job, seen)
    if spec["damage"]:
        damaged = job.damage()
        if damaged:
            whole = seen
            seen = raw(job, truth, damaged=damaged, kind="reduce-raw-damaged")
            if seen is None:
                return
            doubtful = _left_out(whole, seen)
    if "reduce" in wanted:
        for mode in ("global_reduce", "per_rank_reduce"):
            reducing(job, seen, mode, doubtful=doubtful)
        overrides = job.job["overrides"]
        reducing(job, seen, overrides["mode"], tuple(overrides["patterns"]), doubtful=doubtful)
    if spec.get("across") and "across" in wanted:
        across(job, seen)
    if "by_time" in wanted:
        by_time(job, seen, doubtful)
    if "keys" in wanted:
        keys(job, seen)
    if spec["sample_keys"] and "samples" in wanted:
        samples(job, truth)
    if "inspect" in wanted:
        inspect(
            job,
            truth,
            damaged=set(job.notes.get("damaged_sources", [])),
            seen_sources={(r["process"], r["rank"]) for r in seen},
        )
    if spec.get("trackers") and "trackers" in wanted:
        trackers(job, seen)


# -- raw records ---------------------------------------------------------------------


def read_frame(path: Path) -> list[dict]:
    import polars as pl

    return pl.read_parquet(path).to_dicts()


def raw(job, truth: Truth, *, damaged: set, kind: str = "reduce-raw") -> list[dict] | None:
    """The raw records, checked against the ledgers; those read, in the order read."""
    result = job.result
    out = job.dir / "out" / f"{kind}.parquet"
    any_required = any(r.required for recs in truth.sources().values() for r in recs)
    done = job.command(
        kind,
        "reduce",
        str(job.run),
        "--mode",
        job.choice("per_rank_no_reduce"),
        "--out",
        str(out),
        expect=(0,) if any_required and not damaged else (0, 1),
    )
    if done.code != 0:
        if damaged and "no readable metric record" not in done.err:  # damage may leave nothing
            result.fail(f"{kind}: exit {done.code} after damage without saying no record was readable")
        return None
    rows = read_frame(out)
    by_source: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for i, row in enumerate(rows):
        row["order"] = i
        by_source[(row["process"], row["rank"])].append(row)
    expected = truth.sources()
    written = _everything_written(truth)
    seen: list[dict] = []
    lost_total = 0
    for source in sorted(set(by_source) | set(expected)):
        got, want = by_source.get(source, []), expected.get(source, [])
        times = [r["timestamp"] for r in got]
        if times != sorted(times):
            result.fail(f"{kind}: {source[0]} (rank {source[1]}): raw records not in time order")
        # when each attempt's successor started: no record of an attempt is stamped after it
        until = {a.number - 1: a.started for a in truth.attempts.get(source, []) if a.number > 1}
        gi, matched, lost = _match(got, want, until)
        if gi < len(got) and source in damaged and source in truth.unrewound:
            # the damage may have taken the restarted attempt's declaration of its restart
            # (its segment's first line, say): the records it replaced are read again
            again = _match(got, truth.unrewound[source], until)
            if again[0] == len(got):
                gi, matched, lost = again
        seen += matched
        extra = got[gi:]
        result.values += gi
        if lost:
            lost_total += len(lost)
            if source not in damaged:
                first = lost[0]
                result.fail(
                    f"{kind}: {len(lost)} acknowledged record(s) of {source[0]} (rank {source[1]}) "
                    f"lost or out of order, e.g. step {first.step} {first.key}={float.fromhex(first.value)!r}"
                    f" (attempt {first.attempt})"
                )
        for row in extra:
            ident = (
                row["process"],
                row["rank"],
                row["step"],
                row["key"],
                row["reduction"],
                float(row["value"]).hex(),
            )
            if ident not in written:
                result.fail(f"{kind}: a value never written was read: {_show(row)}")
            else:
                result.fail(
                    f"{kind}: a record read twice, out of order or that a restart replaced: {_show(row)}"
                )
            break  # one is enough to tell
    if lost_total and damaged and "warning" not in done.err.lower():
        result.fail(f"{kind}: {lost_total} record(s) of damaged files left out without a warning")
    if damaged:
        job.notes["damaged_sources"] = sorted(damaged)
    seen.sort(key=lambda r: r["order"])
    return seen


def _match(
    got: list[dict], want: list[Rec], until: dict[int, float] | None = None
) -> tuple[int, list[dict], list[Rec]]:
    """``got`` (a source's rows, in the order read) matched in order against ``want``: how
    many of ``got`` matched, those rows, and the required records of ``want`` not met.
    ``until``: attempt number -> when the next attempt started. An optional record (one no
    flush covered, of an attempt that died) is not met by a row stamped after that: the row
    is the next attempt's, an equal record of it (a NaN of the same key, kept at the same
    step by a seal before its first flush), which must then meet its own record."""
    until = until or {}
    gi, matched, lost = 0, [], []
    for rec in want:
        if gi < len(got) and _is(got[gi], rec):
            if not rec.required and got[gi]["timestamp"] >= until.get(rec.attempt, math.inf):
                continue  # the next attempt's row
            matched.append(got[gi])
            gi += 1
        elif rec.required:
            lost.append(rec)
    return gi, matched, lost


def _is(row: dict, rec: Rec) -> bool:
    return (
        row["step"] in (rec.step, rec.alt_step)
        and row["key"] == rec.key
        and row["reduction"] == rec.reduction
        and float(row["value"]).hex() == rec.value
    )


def _everything_written(truth: Truth) -> set[tuple]:
    out = set()
    for attempts in truth.attempts.values():
        for a in attempts:
            for r in a.records:
                out.add((r.process, r.rank, r.step, r.key, r.reduction, r.value))
                out.add((r.process, r.rank, r.alt_step, r.key, r.reduction, r.value))
    for recs in truth.foreign.values():
        for r in recs:
            out.add((r.process, r.rank, r.step, r.key, r.reduction, r.value))
    return out


def _show(row: dict) -> str:
    return ", ".join(
        f"{k}={row[k]!r}" for k in ("process", "rank", "step", "key", "value", "timestamp") if k in row
    )


def _left_out(whole: list[dict], damaged: list[dict]) -> list[dict]:
    """The rows of the raw read before the damage that the raw read after it left out.

    A damaged Parquet page is found by reading it: a flip in a column a command does not
    read (``rank`` for ``global_reduce``, say) leaves its row group in that command's
    answer, as docs/reading.md says. These rows may be in a reduced answer or not."""
    kept = Counter(_ident(r) for r in damaged)
    out = []
    for row in whole:
        if kept[_ident(row)]:
            kept[_ident(row)] -= 1
        else:
            out.append(row)
    return out


def _ident(row: dict) -> tuple:
    value = float(row["value"]).hex()
    return (row["process"], row["rank"], row["step"], row["key"], row["reduction"], row["timestamp"], value)


# -- reducing modes ------------------------------------------------------------------


def group_problem(members: list[dict], value: float) -> str | None:
    """What is wrong with ``value`` as a group's reduction (its records' own), or None."""
    return check_value(
        members[0]["reduction"], [m["value"] for m in members], value, [m["timestamp"] for m in members]
    )


def expected_groups(seen: list[dict], mode: str, label=lambda r: r["step"]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in seen:
        where = (
            (label(row), row["key"])
            if mode == "global_reduce"
            else (row["process"], row["rank"], label(row), row["key"])
        )
        groups[where].append(row)
    return groups


def compare_groups(
    job,
    kind: str,
    rows: list[dict],
    groups: dict[tuple, list[dict]],
    mode: str,
    stat_of,
    label: str = "step",
    maybe: dict[tuple, list[dict]] | None = None,
) -> None:
    """``rows`` (a reduced answer) against ``groups`` (the records read raw, by group).
    ``maybe`` holds records a command may or may not read (see ``_left_out``): a group
    they touch is right with all of them or none of them; a count between the two is
    let through unchecked (more than one damaged row group may feed it)."""
    result = job.result
    maybe = maybe or {}
    got = {}
    for row in rows:
        where = (
            (row[label], row["key"])
            if mode == "global_reduce"
            else (row["process"], row["rank"], row[label], row["key"])
        )
        if where in got:
            result.fail(f"{kind}: group {where} twice in the output")
        got[where] = row
    missing = sorted(set(groups) - set(got), key=str)
    extra = sorted(set(got) - set(groups) - set(maybe), key=str)
    if missing:
        result.fail(f"{kind}: {len(missing)} group(s) missing from the output, e.g. {missing[0]}")
    if extra:
        result.fail(f"{kind}: {len(extra)} group(s) in the output that hold no record, e.g. {extra[0]}")
    bad = []
    for where in set(groups) | set(maybe):
        row = got.get(where)
        if row is None:
            continue
        sure, extra_rows = groups.get(where, []), maybe.get(where, [])
        choices = [sure, sure + extra_rows] if extra_rows else [sure]
        choices = [c for c in choices if c]
        if extra_rows and not len(sure) <= row["count"] <= len(sure) + len(extra_rows):
            most = len(sure) + len(extra_rows)
            bad.append(f"{where}: count {row['count']}, expected {len(sure)} to {most}")
            continue
        if extra_rows and row["count"] not in {len(c) for c in choices}:
            continue  # some of the doubtful rows only: their values are not known apart
        members = next(c for c in choices if len(c) == row["count"]) if extra_rows else sure
        stat = stat_of(members[0]["key"], members[0]["reduction"])
        values = [m["value"] for m in members]
        problem = None
        if row["count"] != len(values):
            problem = f"count {row['count']}, expected {len(values)}"
        elif row["reduction"] != stat:
            problem = f"reduction {row['reduction']!r}, expected {stat!r}"
        else:
            problem = check_value(stat, values, row["value"], [m["timestamp"] for m in members])
        result.values += 1
        if problem:
            bad.append(f"{where}: {problem}")
    if bad:
        result.fail(f"{kind}: {len(bad)} wrong value(s), e.g. " + "; ".join(bad[:3]))


def reducing(
    job, seen: list[dict], mode: str, patterns: tuple[str, ...] = (), doubtful: list[dict] = ()
) -> None:
    """``reduce --mode MODE`` (with ``--reduce`` overrides: ``patterns``) against the
    groups of the records read raw (and of ``doubtful``, see ``_left_out``)."""
    name = "overrides" if patterns else mode
    out = job.dir / "out" / f"{name}.parquet"
    args = [a for p in patterns for a in ("--reduce", p)]
    done = job.command(
        f"reduce-{name}",
        "reduce",
        str(job.run),
        "--mode",
        job.choice(mode),
        *args,
        "--out",
        str(out),
        expect=(0,) if seen else (0, 1),
    )
    if done.code == 0:
        compare_groups(
            job,
            " ".join(["reduce --mode", mode, *args]),
            read_frame(out),
            expected_groups(seen, mode),
            mode,
            lambda key, red: statistic_of(key, red, patterns) if patterns else red,
            maybe=expected_groups(doubtful, mode),
        )


def across(job, seen: list[dict]) -> None:
    """``compare`` of the run and copies of it, against ``reduce``'s answer (checked against
    the records above): across identical runs each group's mean is the run's value (an exact
    zero +0.0, as a sum's), min, max and median are it too, the spreads 0 (NaN where it is not
    finite) and the count the runs'. And ``diff`` of the run and a copy: equal, exit 0."""
    spec = job.job["across"]
    mode = spec["mode"]
    reduced = job.dir / "out" / f"{mode}.parquet"
    names = {(r["process"], r["rank"]) for r in seen}
    if not reduced.exists() or (mode == "per_rank_reduce" and len({p for p, _ in names}) < len(names)):
        return  # nothing reduced (said there), or two ranks under one name: compare refuses it
    copies = [job.dir / f"copy{i}" for i in range(spec["copies"])]
    for copy in copies:
        shutil.copytree(job.run, copy, symlinks=True)
    out = job.dir / "out" / "compare.parquet"
    labels = [a for i in range(len(copies) + 1) for a in ("--label", f"r{i}")]
    runs = [str(job.run), *map(str, copies)]
    done = job.command("compare", "compare", *runs, *labels, "--mode", job.choice(mode), "--out", str(out))
    if done.code == 0:
        where = ("step", "key") if mode == "global_reduce" else ("process", "step", "key")
        want = {tuple(r[c] for c in where): r for r in read_frame(reduced)}
        got = {tuple(r[c] for c in where): r for r in read_frame(out)}
        if set(got) != set(want):
            odd = sorted(set(got) ^ set(want), key=str)[:3]
            job.result.fail(f"compare: groups {odd} not those of reduce's")
        bad = []
        for at, row in got.items():
            if at not in want:
                continue
            v = want[at]["value"]
            same = {"mean": 0.0 if v == 0 else v, "min": v, "max": v, "median": v}
            spread = 0.0 if math.isfinite(v) else math.nan
            wrong = [s for s, x in same.items() if not _same_float(row[s], x)]
            wrong += [s for s in ("std", "std_sample", "stderr") if not _same_float(row[s], spread)]
            if row["count"] != len(runs) or row["reduction"] != want[at]["reduction"]:
                wrong.append(f"count {row['count']} reduction {row['reduction']!r}")
            job.result.values += 1
            if wrong:
                bad.append(f"{at}: {', '.join(map(str, wrong))} (value {v!r})")
        if bad:
            said = "; ".join(bad[:3])
            job.result.fail(f"compare of {len(runs)} copies: {len(bad)} wrong row(s), e.g. {said}")
        if spec.get("to"):
            compare_to(job, runs, labels, mode, got)
    done = job.command("diff", "diff", str(job.run), str(copies[0]), "--mode", job.choice(mode))
    if done.code == 0 and "equal" not in done.out:
        job.result.fail(f"diff of the run and its copy: exit 0 but it does not say equal: {_tail(done.out)}")
    if spec.get("to"):
        upload_many(job, copies[0], mode, reduced)
        plot_bands(job, runs, labels, seen)


def plot_bands(job, runs: list[str], labels: list[str], seen: list[dict]) -> None:
    """``plot RUN...`` with a band: it renders (a PNG, whole) for the run and its copies."""
    keys = sorted({r["key"] for r in seen})[:2]
    if not keys:
        return
    png = job.dir / "out" / "bands.png"
    band = ("std", "stderr", "minmax")[job.job["seed"] % 3]
    # several runs are plotted in global_reduce: a line per group
    done = job.command(
        "plot-bands", "plot", *runs, *labels, *[a for k in keys for a in ("--key", k)],
        "--band", band, "--mode", job.choice("global_reduce"), "--out", str(png),
    )  # fmt: skip
    if done.code == 0 and (not png.exists() or not png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")):
        job.result.fail(f"plot of {len(runs)} runs with --band {band}: exit 0 but no PNG written")


def compare_to(job, runs: list[str], labels: list[str], mode: str, got: dict[tuple, dict]) -> None:
    """``compare --to tensorboard``: the comparison's every statistic as a tag (``KEY/STAT``,
    ``KEY/PROCESS/STAT`` per rank) at its step, the float32 of what ``compare`` printed. (A
    second send adding nothing is tests/test_upload_many.py's: here it would cost 3 s.)"""
    logdir = job.dir / "out" / "compare-tb"
    args = ["compare", *runs, *labels, "--mode", job.choice(mode), "--to", job.choice("tensorboard")]
    done = job.command("compare-to", *args, "--logdir", str(logdir))
    if done.code != 0:
        return
    sent = {(r["key"], r["step"]): r["value"] for r in _tensorboard_records(logdir)}
    want = {}
    for at, row in got.items():
        key = f"{at[-1]}/{at[0]}" if mode == "per_rank_reduce" else at[-1]
        for stat in ("mean", "std", "std_sample", "stderr", "min", "max", "median", "count"):
            if row[stat] is not None:
                want[(f"{key}/{stat}", at[-2])] = float(row[stat])
    bad = [f"{tag} step {step}: not sent" for tag, step in sorted(set(want) - set(sent))]
    bad += [f"{tag} step {step}: sent, not compared" for tag, step in sorted(set(sent) - set(want))]
    for at in set(want) & set(sent):
        job.result.values += 1
        if not _float32_equal(sent[at], want[at]):
            bad.append(f"{at[0]} step {at[1]}: {sent[at]!r} in TensorBoard, {want[at]!r} compared")
    if bad:
        said = "; ".join(sorted(bad)[:3])
        job.result.fail(f"compare --to tensorboard: {len(bad)} problem(s), e.g. {said}")


def upload_many(job, copy: Path, mode: str, reduced: Path) -> None:
    """``upload RUN COPY --to tensorboard``: a copy is the same run (its run.json's run_id), so
    the second is already written and the logdir holds reduce's values once, as float32."""
    logdir = job.dir / "out" / "many-tb"
    done = job.command(
        "upload-many", "upload", str(job.run), str(copy), "--to", job.choice("tensorboard"),
        "--logdir", str(logdir), "--mode", job.choice(mode),
    )  # fmt: skip
    if done.code != 0:
        return
    said = [line.strip() for line in done.err.splitlines() if line.strip().startswith(copy.name)]  # stderr
    if not said or not all(f": already written to {logdir}" in line for line in said):
        job.result.fail(f"upload of the run and a copy: the copy not said already written: {_tail(done.err)}")
    sent: dict[tuple, list[float]] = defaultdict(list)
    for r in _tensorboard_records(logdir):
        sent[(r["key"], r["step"])].append(r["value"])
    want: dict[tuple, list[float]] = defaultdict(list)
    for r in read_frame(reduced):
        want[(r["key"], r["step"])].append(r["value"])  # per rank: a value a source
    bad = [f"{key} step {step}" for key, step in sorted(set(want) ^ set(sent), key=str)]
    for at in set(want) & set(sent):
        job.result.values += len(want[at])
        if len(sent[at]) != len(want[at]) or not all(
            _float32_equal(s, w) for s, w in zip(sorted(sent[at]), sorted(want[at]), strict=True)
        ):
            bad.append(f"{at[0]} step {at[1]}: {sorted(sent[at])} sent, {sorted(want[at])} reduced")
    if bad:
        job.result.fail(f"upload of the run and its copy: {len(bad)} problem(s), e.g. " + "; ".join(bad[:3]))


def _same_float(got: float | None, want: float) -> bool:
    if got is None:
        return False
    bits = np.array([got, want], dtype=np.float64).view(np.int64)
    return (math.isnan(got) and math.isnan(want)) or bits[0] == bits[1]


def _seconds(every: str) -> float:
    return float(every[:-2]) / 1000 if every.endswith("ms") else float(every.rstrip("s"))


def by_time(job, seen: list[dict], doubtful: list[dict] = ()) -> None:
    """Windows of D from the first record kept; each record in [start, start + D). A record
    within a microsecond of a window's edge leaves its group unchecked (the engine computes
    the edge in float64); every other group is checked as by step. The first record may be
    one of ``doubtful`` (see ``_left_out``)."""
    spec = job.job["by_time"]
    mode, every = spec["mode"], spec["every"]
    out = job.dir / "out" / "by-time.parquet"
    done = job.command(
        "reduce-by-time",
        "reduce",
        str(job.run),
        "--mode",
        job.choice(mode),
        "--by",
        job.choice("time"),
        "--every",
        every,
        "--out",
        str(out),
        expect=(0,) if seen else (0, 1),
    )
    if done.code != 0 or not seen:
        return
    rows = read_frame(out)
    d = Fraction(_seconds(every))
    t0 = _anchor(rows, d, [seen, [*seen, *doubtful]])
    edgy = set()

    def window(row: dict) -> float:
        offset = Fraction(row["timestamp"]) - t0
        i = offset // d
        if min(offset - i * d, (i + 1) * d - offset) < Fraction(1, 10**6):
            edgy.add(int(i))
        return int(i)

    if mode == "per_rank_no_reduce":
        if not len(seen) <= len(rows) <= len(seen) + len(doubtful):
            job.result.fail(f"reduce --by time raw: {len(rows)} rows, the raw read had {len(seen)}")
        for row in rows:
            i = window(row)
            start = float(t0 + i * d)
            if i not in edgy and not math.isclose(row["window_start"], start, rel_tol=0, abs_tol=1e-6):
                job.result.fail(
                    f"reduce --by time --every {every} raw: window_start {row['window_start']!r} "
                    f"for a record at {row['timestamp']!r}, expected {start!r}"
                )
                break
            job.result.values += 1
        return
    index = {}  # the output's window starts, by window number
    for row in rows:
        i = round((Fraction(row["window_start"]) - t0) / d)
        if abs(Fraction(row["window_start"]) - (t0 + i * d)) > Fraction(1, 10**6):
            job.result.fail(
                f"reduce --by time --every {every}: window_start {row['window_start']!r} is not "
                f"the first record's time {float(t0)!r} plus a multiple of {every}"
            )
            return
        index[i] = row["window_start"]
        row["window"] = i
    groups = expected_groups(seen, mode, label=window)
    maybe = expected_groups(doubtful, mode, label=window)
    if edgy:  # the edge's records may be in either window: those windows are not checked
        for g in [*groups, *maybe]:
            if (g[0] if mode == "global_reduce" else g[2]) in edgy:
                groups.pop(g, None)
                maybe.pop(g, None)
        rows = [r for r in rows if r["window"] not in edgy]
    compare_groups(
        job,
        f"reduce --mode {mode} --by time --every {every}",
        rows,
        groups,
        mode,
        lambda key, red: red,
        label="window",
        maybe=maybe,
    )


def _anchor(rows: list[dict], d: Fraction, candidates: list[list[dict]]) -> Fraction:
    """The first record's time the windows of ``rows`` start from: of the first records of
    ``candidates``, the one every window start is a multiple of ``d`` from."""
    starts = [Fraction(r["window_start"]) for r in rows if r.get("window_start") is not None]
    times = [Fraction(min(r["timestamp"] for r in c)) for c in candidates if c]
    for t0 in times:
        if all(abs(s - t0 - round((s - t0) / d) * d) <= Fraction(1, 10**6) for s in starts):
            return t0
    return times[0]


# -- keys, samples, inspect ----------------------------------------------------------


def keys(job, seen: list[dict]) -> None:
    done = job.command(
        "keys", "keys", str(job.run), "--format", job.choice("json"), expect=(0,) if seen else (0, 1)
    )
    if done.code != 0:
        return
    got = {row["key"]: row for row in json.loads(done.out)}
    want: dict[str, dict] = {}
    for row in seen:
        k = want.setdefault(
            row["key"],
            {
                "records": 0,
                "sources": set(),
                "steps": [],
                "times": [],
                "nonfinite": 0,
                "reduction": row["reduction"],
            },
        )
        k["records"] += 1
        k["sources"].add((row["process"], row["rank"]))
        k["steps"].append(row["step"])
        k["times"].append(row["timestamp"])
        k["nonfinite"] += not math.isfinite(row["value"])
    if set(got) != set(want):
        job.result.fail(f"keys: keys {sorted(set(got) ^ set(want))[:5]} differ from the records read")
    bad = []
    for key in set(got) & set(want):
        g, w = got[key], want[key]
        expect = {
            "records": w["records"],
            "sources": len(w["sources"]),
            "first_step": min(w["steps"]),
            "last_step": max(w["steps"]),
            "first_time": min(w["times"]),
            "last_time": max(w["times"]),
            "nonfinite": w["nonfinite"],
        }
        for name, value in expect.items():
            job.result.values += 1
            if g.get(name) != value:
                bad.append(f"{key} {name}={g.get(name)!r}, expected {value!r}")
        if w["reduction"] not in str(g.get("reductions")):
            bad.append(f"{key} reductions={g.get('reductions')!r}, expected {w['reduction']!r}")
    if bad:
        job.result.fail(f"keys: {len(bad)} wrong field(s), e.g. " + "; ".join(bad[:3]))


def samples(job, truth: Truth, kind: str = "samples") -> list[dict] | None:
    """``samples --format json`` against the samples the ledgers hold; the rows it gave, or
    None where it failed (or found a problem)."""
    required = [s for s in truth.samples if s.required]
    done = job.command(
        kind, "samples", str(job.run), "--format", job.choice("json"), expect=(0,) if required else (0, 1)
    )
    if done.code != 0:
        return None
    got = json.loads(done.out) if done.out.strip() else []
    by_ident = {(s.key, s.sample["text"]): s for s in truth.samples}
    counts = Counter((row["key"], row.get("text")) for row in got)
    for ident, n in counts.items():
        if n > 1:
            job.result.fail(f"{kind}: {ident} listed {n} times")
            break
    bad = []
    for row in got:
        s = by_ident.get((row["key"], row.get("text")))
        if s is None:
            bad.append(f"a sample never recorded (or replaced by a restart): {row}")
            continue
        job.result.values += 1
        want = {"step": s.step, "rank": s.rank, "process": s.process, **s.sample}
        for name, value in want.items():
            if row.get(name) != value and not (name == "step" and row.get(name) == s.alt_step):
                bad.append(f"{s.key} {s.sample['text']!r}: {name}={row.get(name)!r}, expected {value!r}")
    lost = [s for s in required if (s.key, s.sample["text"]) not in counts]
    if lost:
        bad.append(f"{len(lost)} acknowledged sample(s) lost, e.g. {lost[0].key} {lost[0].sample}")
    if bad:
        job.result.fail(f"{kind}: {len(bad)} problem(s), e.g. " + "; ".join(bad[:3]))
        return None
    return got


def inspect(job, truth: Truth, damaged: set, seen_sources: set) -> None:
    done = job.command("inspect", "inspect", str(job.run), "--format", job.choice("json"), expect=(0, 1))
    if done.code != 0:
        if any(truth.sources().values()):
            job.result.fail(f"inspect: exit {done.code} on a run with records")
        return
    report = json.loads(done.out)
    sources = {(s["process"], s["rank"]): s for s in report["sources"]}
    failed = []
    damaged = {tuple(d) for d in damaged}
    for source, attempts in truth.attempts.items():
        for a in attempts:
            if a.end != "shutdown":
                failed.append(a)
        if source in damaged or (source not in seen_sources and source not in sources):
            continue  # a source none of whose records was read (all were optional) may be left out
        got = sources.get(source)
        if got is None:
            job.result.fail(f"inspect: no source {source}")
            continue
        ends = [(x.get("end"), x.get("signal")) for x in got.get("attempts", [])]
        if len(ends) != len(attempts):  # an attempt that left no record on disk need not be listed
            attempts = [a for a in attempts if any(r.required for r in a.records)]
        want = [(a.end, a.signal) for a in attempts]
        job.result.values += len(want)
        if len(ends) != len(want) or any(
            g[0] != w[0] or (w[1] and g[1] != w[1]) for g, w in zip(ends, want, strict=False)
        ):
            job.result.fail(f"inspect: {source[0]} attempts ended {ends}, the job did {want}")
        for x, a in zip(got.get("attempts", []), attempts, strict=False):
            if a.end == "exception" and (x.get("exception") or {}).get("type") != a.exception:
                job.result.fail(
                    f"inspect: {source[0]} attempt {a.number}: exception {x.get('exception')!r}, "
                    f"expected {a.exception}"
                )
    first = report.get("first_failure")
    if not failed:
        if first is not None and (first.get("process"), first.get("rank")) not in damaged:
            job.result.fail(f"inspect: first_failure {first!r} in a job where every attempt shut down")
        return
    if first is None:
        # Ranks that failed first all together (one event, no culprit: issue 43) have no first
        # failure; they are listed in ``together``, each a source whose attempt failed, and
        # they ended the same way within a second or two (the story's window)
        together = {(s.get("process"), s.get("rank")) for s in report.get("together") or []}
        earliest = min(a.ended_at for a in failed)
        first_failed = {(a.process, a.rank) for a in failed if a.ended_at <= earliest + 2.5}
        if together and together <= {(a.process, a.rank) for a in failed} and together & first_failed:
            return
        if not damaged:
            job.result.fail(
                f"inspect: first_failure is null, together {sorted(together)}; the job had {len(failed)} "
                "failed attempt(s)"
            )
        return
    if (first.get("process"), first.get("rank")) in damaged:
        return  # a damaged file may have lost how its attempt ended
    # The first to fail, of every source; or of those left whole, when the damage may have
    # taken every record of an earlier failure's source (it is then no source at all)
    candidates = []
    for pool in (failed, [a for a in failed if (a.process, a.rank) not in damaged]):
        if pool:
            earliest = min(a.ended_at for a in pool)
            candidates += [a for a in pool if a.ended_at <= earliest + 2.5]
    if not any(first.get("process") == a.process and first.get("end") == a.end for a in candidates):
        job.result.fail(
            f"inspect: first_failure is {first.get('process')} ({first.get('end')}); the first to fail "
            f"were {[(a.process, a.number, a.end) for a in candidates]}"
        )


# -- alarms on values (issue 43) -----------------------------------------------------


def alerts(job, seen: list[dict]) -> None:
    """``watch --alert`` (and ``upload --follow --alert``) beside the job: the alarms its
    ``--on-alert`` command was given, against ``oracle.expected_alarms`` over the records
    read back; each said once on stderr too. And ranks under ``on_nonfinite="raise"``."""
    spec = job.job["alerts"]
    ran = [("watch", "watch-alert", job.watch_done, spec["on"])]
    if "follow_alert_on" in job.notes:
        ran.append(("follow", "follow-alert", job.follow_done, job.notes["follow_alert_on"]))
    for who, kind, done, on in ran:
        if done is None or done.code not in (0, 4):
            continue  # its exit was checked, and failed, already
        job.result.commands[kind] += 1
        want = expected_alarms(seen, spec["rules"], on)
        path = job.dir / f"alerts-{who}.tsv"
        lines = path.read_text().splitlines() if path.exists() else []
        got = []
        for line in lines:
            fields = line.split("\t")
            if len(fields) != 7:
                job.result.fail(f"{kind}: --on-alert's line {line!r} is not 7 fields")
                return
            got.append(fields)
        job.result.values += len(want)
        problems = []
        left = list(want)
        for rule, key, step, value, process, rank, run_dir in got:
            match = next(
                (
                    w
                    for w in left
                    if (w.rule, w.key, str(w.step), w.value) == (rule, key, step, value)
                    and (process, rank) in w.who
                ),
                None,
            )
            if match is None:
                problems.append(
                    f"an alarm not expected: {rule!r} {key} step {step} value {value} "
                    f"on {process!r} rank {rank!r}"
                )
            else:
                left.remove(match)
            if run_dir != str(job.run):
                problems.append(f"METRICLOG_RUN_DIR {run_dir!r}, expected {str(job.run)!r}")
        for w in left:
            problems.append(
                f"an alarm missing: {w.rule!r} {w.key} step {w.step} value {w.value} on {sorted(w.who)}"
            )
        said = sum(1 for line in done.err.splitlines() if line.startswith("alert: "))
        if said != len(got):
            problems.append(f"{said} 'alert:' line(s) on stderr, {len(got)} --on-alert command(s) ran")
        if problems:
            job.result.fail(
                f"{kind} (--alert-on {on}): {len(problems)} problem(s) of {len(want)} alarm(s) expected, "
                f"{len(got)} said, e.g. " + "; ".join(problems[:4])
            )
    if spec["raise_on"]:
        nonfinite_raise(job, seen)


def nonfinite_raise(job, seen: list[dict]) -> None:
    """A rank under ``init(on_nonfinite="raise", nonfinite_keys=...)`` that met a NaN or an
    infinity of such a key raised ``NonFiniteError`` there (the worker checked where; the
    runner its exit): the value is in the files (the raw read holds it: the oracle required
    it), and ``inspect``'s story says it raised NonFiniteError."""
    raised = []
    for plan in job.job["ranks"]:
        path = job.dir / "ledger" / f"r{plan['rank']}.a1.jsonl"
        for line in path.read_text().splitlines():
            e = json.loads(line)
            if e["t"] == "nfraise":
                raised.append((plan["process"], plan["rank"], e))
    if not raised:
        return
    job.result.commands["nonfinite-raise"] += len(raised)
    for process, rank, e in raised:
        hits = [
            r
            for r in seen
            if (r["process"], r["rank"], r["key"], r["step"]) == (process, rank, e["key"], e["step"])
            and not math.isfinite(r["value"])
        ]
        if not hits:
            job.result.fail(
                f"nonfinite-raise: {process}'s {e['key']} at step {e['step']}, the value NonFiniteError was "
                "raised for, is not in the files"
            )
    done = job.command("inspect-story", "inspect", str(job.run), expect=(0, 1))
    text = " ".join((done.out + done.err).split())
    if "raised NonFiniteError" not in text or not any(process in text for process, _, _ in raised):
        job.result.fail(
            f"inspect: the story does not say {raised[0][0]} (rank {raised[0][1]}) raised NonFiniteError:\n"
            + _tail(done.out, 8)
        )


def _tail(text: str, lines: int = 4) -> str:
    return "\n".join("    " + line for line in text.strip().splitlines()[-lines:])


# -- the console's global_reduce printer (issue 44) ------------------------------------

CONSOLE_STEP = re.compile(
    r"^INFO:metric_core\.torchforge\.metrics: === \[global_reduce\] - METRICS STEP (\d+) ===$"
)
CONSOLE_RULE = "=============================="


def console(job, seen: list[dict]) -> None:
    """The printer a torchforge job's rank 0 starts for a ``global_reduce`` console backend
    (``python -m metric_core.offline.console``), run beside the job: each step printed once,
    in order, in torchforge's format, every key of the step with the value ``reduce`` gives
    (the global reduction of the records read raw, checked exactly). Every step is printed
    unless a rank restarted (the printer ends once every source is over, which may be before
    a restart writes); a restart's steps are not checked (the printer said so: it printed
    what the restart replaced)."""
    done = job.console_done
    if done.code != 0:
        return  # its exit was checked, and failed, already
    printed: list[tuple[int, dict[str, str]]] = []
    lines = done.err.splitlines()
    i = 0
    while i < len(lines):
        m = CONSOLE_STEP.match(lines[i])
        i += 1
        if not m:
            if lines[i - 1].startswith("  ") or lines[i - 1] == CONSOLE_RULE:
                job.result.fail(f"console: a line outside any step: {lines[i - 1]!r}")
                return
            continue
        values: dict[str, str] = {}
        while i < len(lines) and lines[i].startswith("  "):
            key, _, value = lines[i][2:].rpartition(": ")
            values[key] = value
            i += 1
        if i >= len(lines) or lines[i] != CONSOLE_RULE:
            job.result.fail(f"console: step {m.group(1)} not closed by its rule line")
            return
        i += 1
        if list(values) != sorted(values):
            job.result.fail(f"console: step {m.group(1)}'s keys not in order: {list(values)}")
        printed.append((int(m.group(1)), values))
    steps = [step for step, _ in printed]
    if steps != sorted(set(steps)):
        job.result.fail(f"console: steps printed out of order or twice: {steps}")
        return
    groups = expected_groups(seen, "global_reduce")
    want_steps = sorted({step for step, _ in groups})
    replayed = [n["from_step"] for name, n in job.notes.items() if name.endswith(".2") and "from_step" in n]
    until = min(replayed, default=math.inf)
    if not replayed and steps != want_steps:
        job.result.fail(f"console: steps {_span(steps)} printed, the records' steps {_span(want_steps)}")
    bad = []
    for step, values in printed:
        if step >= until:
            continue
        keys = {key for s, key in groups if s == step}
        if set(values) != keys:
            bad.append(f"step {step}: keys {sorted(set(values) ^ keys)} printed or missing")
            continue
        for key, text in values.items():
            job.result.values += 1
            problem = group_problem(groups[(step, key)], float(text))
            if problem:
                bad.append(f"step {step} {key}: {problem}")
    if bad:
        job.result.fail(f"console: {len(bad)} wrong step(s) or value(s), e.g. " + "; ".join(bad[:3]))


# -- uploads and plot (every fifth job) ----------------------------------------------


UNDERSCORED = ("step", "_timestamp", "_runtime", "_step")  # a W&B row's keys besides the values


def uploads(job, truth: Truth, seen: list[dict]) -> None:
    from metric_core.writer.backends.wandb import table_key
    from tests.wandb_file import find_run_file, history_rows, read_records

    spec = job.job
    run = job.run
    groups = expected_groups(seen, "global_reduce")
    sample_keys = set(spec["sample_keys"])

    files: dict[str, Path] = {}  # the W&B run file of each upload's run, by its name

    def rows_of(name: str) -> list[dict] | None:
        ledger = run / ".metriclog" / "uploads.json"
        entries = json.loads(ledger.read_text())["runs"] if ledger.exists() else {}
        newest = sorted((e for e in entries.items() if e[1]["name"] == name), key=lambda kv: kv[1]["updated"])
        if not newest:
            job.result.fail(f"upload: no W&B run named {name!r} in the ledger")
            return None
        files[name] = find_run_file(run / ".metriclog" / "wandb", newest[-1][0])
        return history_rows(read_records(files[name]))

    def samples_of(key: str) -> bool:
        """A key (or a part of one, ``{key}/_type``) a table of samples went under."""
        return any(key == t or key.startswith(t + "/") for k in sample_keys for t in (k, table_key(k)))

    def scalar_rows(rows: list[dict]) -> list[dict]:
        """The rows of steps: not the one the immutable tables of samples go in at the end."""
        return [r for r in rows if any(k not in UNDERSCORED and not samples_of(k) for k in r)]

    def check_rows(kind: str, rows: list[dict]) -> None:
        want_steps = sorted({g[0] for g in groups})
        steps = [r.get("step") for r in scalar_rows(rows)]
        if steps != want_steps:
            job.result.fail(f"{kind}: W&B steps {_span(steps)}, the records' steps {_span(want_steps)}")
        bad = []
        for row in rows:
            for key, value in row.items():
                if key in UNDERSCORED or isinstance(value, dict) or samples_of(key):
                    continue
                members = groups.get((row.get("step"), key))
                if members is None:
                    bad.append(f"step {row.get('step')} {key}: a value for a group with no record")
                    continue
                job.result.values += 1
                problem = group_problem(members, float(value))
                if problem:
                    bad.append(f"step {row['step']} {key}: {problem}")
        if bad:
            job.result.fail(f"{kind}: {len(bad)} wrong W&B value(s), e.g. " + "; ".join(bad[:3]))

    base = ["upload", str(run), "--project", "soak", "--offline"]
    plain = job.command("upload", *base, "--name", "plain", *job.sample_tables("plain"))
    plain_rows = rows_of("plain") if plain.code == 0 else None
    # the samples the uploads chose from: every one the files hold, as `samples` lists them
    listed = samples(job, truth, "samples-uploaded") if sample_keys and job.job["torchforge"] else None
    if plain_rows is not None:
        check_rows("upload (W&B offline)", plain_rows)
        if listed is not None:
            sample_tables(job, "upload", files["plain"], plain_rows, listed, "plain")
    if job.follow_done is not None and job.follow_done.code == 0:
        follow_rows = rows_of("follow")
        if follow_rows is not None:
            check_rows("upload --follow", follow_rows)
            if listed is not None:
                sample_tables(job, "upload --follow", files["follow"], follow_rows, listed, "follow")
            if plain_rows is not None and [r.get("step") for r in scalar_rows(follow_rows)] != [
                r.get("step") for r in scalar_rows(plain_rows)
            ]:
                job.result.fail("upload --follow: its steps differ from a plain upload's")
    if spec["live_upload"]:
        again = job.command("upload-live-again", *base, "--name", "live")
        if again.code == 0 and (rows := rows_of("live")) is not None:
            check_rows("upload started while the job ran, then again after it", rows)
    tensorboard(job, seen)
    keys_drawn = sorted({r["key"] for r in seen})[:3]
    if keys_drawn:
        png = job.dir / "out" / "plot.png"
        done = job.command(
            "plot", "plot", str(run), *[a for k in keys_drawn for a in ("--key", k)], "--out", str(png)
        )
        if done.code == 0 and (not png.exists() or png.stat().st_size == 0):
            job.result.fail("plot: exit 0 but no file written")


def sample_tables(job, kind: str, run_file: Path, rows: list[dict], listed: list[dict], who: str) -> None:
    """The W&B tables of samples an upload sent (``--sample-tables``, docs/commands.md),
    against the samples the files hold (``listed``): at each step with a row and samples of
    a key, the top 2 by reward, highest first, then the bottom 2, lowest first, each once.
    ``per-step``: a table under the key in the step's row. ``incremental``: ``{key}_table``
    in each such row with that step's added, then every row once more as one immutable
    table under the key, in one row at the last step any key's table took samples at. A step
    whose samples tie on reward is not checked (which of the tied goes is the order
    recorded, not the oracle's)."""
    from metric_core.writer.backends.wandb import table_key
    from tests.wandb_file import logged_tables

    mode = job.job["torchforge"]["sample_tables"][who]
    steps = {r.get("step") for r in rows}
    by_key: dict[str, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for sample in listed:
        if sample["step"] in steps:
            by_key[sample["key"]][sample["step"]].append(
                {field: sample[field] for field in ("reward", "text", "n")}
            )
    bad = []
    last = max((max(at) for at in by_key.values() if at), default=None)
    for key in sorted(set(job.job["sample_keys"]) | set(by_key)):
        want = []
        for step, group in sorted(by_key.get(key, {}).items()):
            ranked = sorted(group, key=lambda g: g["reward"])
            chosen = ranked[::-1][:2] + [g for g in ranked[:2] if g not in ranked[::-1][:2]]
            tied = len({g["reward"] for g in group}) < len(group)
            want.append((step, chosen, tied))
        if mode == "per-step":
            kinds = [(key, logged_tables(run_file, key), [(step, "table-file", c, t) for step, c, t in want])]
        else:
            # the incremental table goes under {key}_table (a key that ends in _table as it
            # is, docs/compat.md); the immutable copy at the end under the key
            incremental = [(step, "incremental-table-file", c, t) for step, c, t in want]
            every = [g for _, chosen, _ in want for g in chosen]
            final = [(last, "table-file", every, any(t for _, _, t in want))] if want else []
            name = table_key(key)
            kinds = (
                [(name, logged_tables(run_file, name), incremental + final)]
                if name == key
                else [
                    (name, logged_tables(run_file, name), incremental),
                    (key, logged_tables(run_file, key), final),
                ]
            )
        for name, logged, expected in kinds:
            job.result.values += len(expected)
            if [(step, k) for step, k, _ in logged] != [(step, k) for step, k, _, _ in expected]:
                bad.append(
                    f"{name}: tables {[(step, k) for step, k, _ in logged]}, expected "
                    f"{[(step, k) for step, k, _, _ in expected]}"
                )
                continue
            for (step, _, got_rows), (_, _, chosen, tied) in zip(logged, expected, strict=True):
                if not tied and got_rows != chosen:
                    bad.append(f"{name} at step {step}: {got_rows}, expected {chosen}")
    if bad:
        job.result.fail(
            f"{kind} --sample-tables {mode}: {len(bad)} wrong table(s), e.g. " + "; ".join(bad[:2])
        )


def tensorboard(job, seen: list[dict]) -> None:
    from tensorboard.backend.event_processing import event_accumulator as ea

    mode = job.job["tensorboard_mode"]
    logdir = job.dir / "out" / "tb"
    done = job.command(
        "upload-tensorboard",
        "upload",
        str(job.run),
        "--to",
        job.choice("tensorboard"),
        "--logdir",
        str(logdir),
        "--mode",
        job.choice(mode),
    )
    if done.code != 0:
        return
    by_folder: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    if mode == "per_rank_no_reduce":
        for row in seen:
            by_folder[f"run_{row['process']}"][row["key"]].append((row["step"], [row["value"]], "raw", []))
    else:
        for where, members in sorted(expected_groups(seen, mode).items(), key=lambda kv: kv[0][-2]):
            folder = "run" if mode == "global_reduce" else f"run_{where[0]}"
            by_folder[folder][where[-1]].append(
                (
                    where[-2],
                    [m["value"] for m in members],
                    members[0]["reduction"],
                    [m["timestamp"] for m in members],
                )
            )
    bad = []
    for folder, tags in by_folder.items():
        acc = ea.EventAccumulator(str(logdir / folder), size_guidance={ea.SCALARS: 0})
        acc.Reload()
        have = set(acc.Tags()["scalars"])
        for tag, wanted in tags.items():
            if tag not in have:
                bad.append(f"{folder}: no tag {tag}")
                continue
            events = acc.Scalars(tag)
            if [e.step for e in events] != [w[0] for w in wanted]:
                bad.append(
                    f"{folder} {tag}: steps {_span([e.step for e in events])}, expected "
                    f"{_span([w[0] for w in wanted])}"
                )
                continue
            for e, (step, values, stat, times) in zip(events, wanted, strict=True):
                job.result.values += 1
                want = values[0] if stat == "raw" else _float_of(stat, values, times)
                if not _float32_equal(e.value, want):
                    bad.append(f"{folder} {tag} step {step}: {e.value!r} in TensorBoard, {want!r} as float32")
                    break
    if bad:
        job.result.fail(
            f"upload --to tensorboard --mode {mode}: {len(bad)} problem(s), e.g. " + "; ".join(bad[:3])
        )


def _float_of(stat: str, values: list[float], times: list[float]) -> float:
    """The statistic as a float (the exact value rounded; for first/last the first tied)."""
    if stat == "count":
        return float(len(values))
    if stat in ("first", "last"):
        edge = min(times) if stat == "first" else max(times)
        return next(v for v, t in zip(values, times, strict=True) if t == edge)
    arr = np.array(values, dtype=np.float64)
    if stat in ("max", "min", "median") or stat.startswith("p"):
        with np.errstate(all="ignore"):
            return (
                float({"max": np.max, "min": np.min, "median": np.median}.get(stat, np.max)(arr))
                if not stat.startswith("p")
                else float(np.percentile(arr, float(stat[1:])))
            )
    if not np.isfinite(arr).all():
        with np.errstate(all="ignore"):
            return float({"sum": np.sum, "mean": np.mean, "std": np.std}[stat](arr))
    exact = [Fraction(v) for v in values]
    mean = sum(exact, Fraction(0)) / len(exact)
    if stat == "sum":
        return float(sum(exact, Fraction(0)))
    if stat == "mean":
        return float(mean)
    return math.sqrt(float(sum(((v - mean) ** 2 for v in exact), Fraction(0)) / len(exact)))


def _float32_equal(got: float, want: float) -> bool:
    """TensorBoard keeps float32: the same float32, or its neighbour where the float64
    lies within float32's rounding of an edge."""
    with np.errstate(over="ignore"):
        g, w = np.float32(got), np.float32(want)
    if np.isnan(w):
        return bool(np.isnan(g))
    if g == w:
        return True
    return bool(np.isfinite(g) and np.isfinite(w) and abs(int(g.view(np.int32)) - int(w.view(np.int32))) <= 1)


def _span(steps: list) -> str:
    return f"{len(steps)} from {steps[0]} to {steps[-1]}" if steps else "none"


# -- other trackers, out and in (issue 45) ---------------------------------------------

DBL_MAX = 1.7976931348623157e308  # what MLflow's SQL store keeps for an infinity


def trackers(job, seen: list[dict]) -> None:
    """``upload --to mlflow`` read back with ``MlflowClient`` against ``reduce``'s answer
    (checked against the records above), bit for bit, an infinity as +-DBL_MAX and -0.0 as
    0.0 (docs/destinations.md); again: not a
    metric more. Then ``import`` of what an upload wrote, or of an export of the raw records,
    and ``reduce`` of the imported run against what the source holds."""
    spec = job.job["trackers"]
    held = mlflow_upload(job, spec["mlflow"]) if spec["mlflow"] else None
    if spec["import"]:
        imported(job, spec["import"], seen, held)


def mlflow_upload(job, mode: str) -> list[dict] | None:
    """The values the MLflow runs hold, as records (process, rank, step, key, value,
    timestamp), or None when the upload or the reduce to compare with did not run."""
    reduced = job.dir / "out" / f"{mode}.parquet"
    if not reduced.exists():
        return None  # nothing reduced (said there)
    shutil.copyfile(_empty_store(job.dir.parent), job.dir / "out" / "mlruns.db")
    uri = f"sqlite:///{job.dir / 'out' / 'mlruns.db'}"
    args = ["upload", str(job.run), "--to", job.choice("mlflow"), "--tracking-uri", uri]
    args += ["--experiment", "soak", "--mode", job.choice(mode)]
    if job.command("upload-mlflow", *args).code != 0:
        return None
    held = _mlflow_records(uri)
    where = ("step", "key") if mode == "global_reduce" else ("process", "rank", "step", "key")
    got: dict[tuple, list[float]] = defaultdict(list)
    for r in held:
        got[tuple(r[c] for c in where)].append(r["value"])
    want = {tuple(r[c] for c in where): r["value"] for r in read_frame(reduced)}
    bad = []
    if set(got) != set(want):
        odd = sorted(set(got) ^ set(want), key=str)[:3]
        bad.append(f"groups {odd} in one of MLflow and reduce only")
    for at, values in got.items():
        if at not in want:
            continue
        job.result.values += 1
        stored = math.copysign(DBL_MAX, want[at]) if math.isinf(want[at]) else want[at] or 0.0
        if len(values) != 1 or not _same_float(values[0], stored):
            bad.append(f"{at}: {values!r} in MLflow, reduce's {want[at]!r}")
    if bad:
        job.result.fail(
            f"upload --to mlflow --mode {mode}: {len(bad)} problem(s), e.g. " + "; ".join(bad[:3])
        )
    before = _metric_rows(job.dir / "out" / "mlruns.db")
    if job.command("upload-mlflow-again", *args).code == 0:
        after = _metric_rows(job.dir / "out" / "mlruns.db")
        if after != before:
            job.result.fail(f"upload --to mlflow again: {after - before} metric(s) added, expected none")
    return held


_STORE_LOCK = threading.Lock()


def _empty_store(root: Path) -> Path:
    """An empty MLflow SQLite store, made once a soak and copied into each job that uploads
    there: making one (MLflow's schema migrations) costs more CPU than the upload itself,
    and tests/test_mlflow.py makes its stores from nothing."""
    path = root / "mlflow-empty.db"
    with _STORE_LOCK:
        if not path.exists():
            import logging

            from mlflow.tracking import MlflowClient

            for name in ("mlflow", "alembic"):  # its schema's set-up, said at INFO
                logging.getLogger(name).setLevel(logging.WARNING)

            making = root / "mlflow-empty.db.part"
            making.unlink(missing_ok=True)
            MlflowClient(tracking_uri=f"sqlite:///{making}").search_experiments()
            making.rename(path)
    return path


def _mlflow_records(uri: str) -> list[dict]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    out = []
    for run in client.search_runs([client.get_experiment_by_name("soak").experiment_id]):
        tags = run.data.tags
        process, rank = tags.get("metriclog.process"), int(tags.get("metriclog.rank", 0))
        for key in run.data.metrics:
            for m in client.get_metric_history(run.info.run_id, key):
                out.append(
                    {
                        "process": process,
                        "rank": rank,
                        "step": m.step,
                        "key": key,
                        "value": m.value,
                        "timestamp": m.timestamp / 1000,
                    }
                )
    return out


def _metric_rows(db: Path) -> int:
    import sqlite3

    with sqlite3.connect(db) as con:
        return con.execute("SELECT COUNT(*) FROM metrics").fetchone()[0]


def imported(job, spec: dict, seen: list[dict], held: list[dict] | None) -> None:
    """``import`` of ``spec["source"]``, then ``reduce --mode global_reduce`` of the imported
    run: each step and key's ``spec["reduce"]`` over the values the source holds, exactly
    (the TensorBoard files': float32, as TensorBoard's own reader gives them back)."""
    source, stat = spec["source"], spec["reduce"]
    out = job.dir / "out"
    options = ["--reduce", job.choice(stat)]
    if source == "mlflow":
        if held is None:
            return
        src = "mlflow"
        options += ["--tracking-uri", f"sqlite:///{out / 'mlruns.db'}", "--experiment", "soak"]
        truth = held
    elif source == "tensorboard":
        src = str(out / "tb")
        if not (out / "tb").is_dir() or not job.result.commands["upload-tensorboard"]:
            return
        truth = _tensorboard_records(out / "tb")
    else:
        import polars as pl

        path = out / f"export.{source}"
        frame = pl.DataFrame(
            {
                "step": [r["step"] for r in seen],
                "key": [r["key"] for r in seen],
                "value": [float(r["value"]) for r in seen],
                "time": [r["timestamp"] for r in seen],
            },
            schema={"step": pl.Int64, "key": pl.String, "value": pl.Float64, "time": pl.Float64},
        )
        if source == "csv":
            frame.write_csv(path)
            truth = seen
        else:  # JSON has no NaN or infinity: polars writes null, which import says it left out
            frame.write_ndjson(path)
            truth = [r for r in seen if math.isfinite(r["value"])]
        src = str(path)
        options += ["--key-col", "key", "--value-col", "value", "--time-col", "time"]
    truth = [{**r, "reduction": stat} for r in truth]
    run = out / f"imported-{source}"
    done = job.command(
        f"import-{source}", "import", src, str(run), *options, expect=(0,) if truth else (0, 1)
    )
    if done.code != 0:
        return
    if len(truth) < len(seen) and source == "jsonl" and "not imported" not in done.err:
        job.result.fail(f"import of a JSONL export: {len(seen) - len(truth)} null value(s) left out unsaid")
    reduced = out / f"imported-{source}.parquet"
    args = ["reduce", str(run), "--mode", job.choice("global_reduce"), "--out", str(reduced)]
    if job.command(f"reduce-imported-{source}", *args).code == 0:
        compare_groups(
            job,
            f"import of {source} --reduce {stat}, then reduce",
            read_frame(reduced),
            expected_groups(truth, "global_reduce"),
            "global_reduce",
            lambda key, red: stat,
        )


def _tensorboard_records(logdir: Path) -> list[dict]:
    """Every scalar of every event file below ``logdir``, as TensorBoard's reader gives it."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    out = []
    for folder in sorted({p.parent for p in logdir.rglob("events.out.tfevents.*")}):
        acc = ea.EventAccumulator(str(folder), size_guidance={ea.SCALARS: 0}, purge_orphaned_data=False)
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            for e in acc.Scalars(tag):
                out.append({"step": e.step, "key": tag, "value": e.value, "timestamp": e.wall_time})
    return out
