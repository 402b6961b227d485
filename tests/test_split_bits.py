"""The same bits however the records are split (issue 42): the sidecar's polls.

``upload --follow`` reads a run while it grows and hands each step over once every rank
flushed it, the step's records gathered over several polls. Here two real writer
processes record values float sums trip on (integers past 2**53, decimal fractions,
values on a 1e12 offset), one rank a block of steps ahead of the other, so a step's
records reach the follower in two polls, in another order than a reduction of the
finished files reads them. The rows the real wandb client wrote offline, read back, are
bit for bit a plain ``reduce`` of the finished run and the correctly rounded exact values
(``fractions``, ``math.isqrt``); a naive float sum in the polls' order is checked to
differ from them first, so the test can fail.

(The other splits: files, row groups, partitions and threads in
tests/test_exact_engine.py; Ray tasks in tests/ray_cases.py.)
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from metric_core import reduce_run
from tests.conftest import wait_for
from tests.test_exact import root, rounded
from tests.test_follow import follow, runs_written
from tests.wandb_file import find_run_file, history_rows, read_records

pytestmark = pytest.mark.slow  # real writer processes and a follower, for seconds

RANKS = 2
BLOCK = 5  # steps a block: a rank writes a block when the test lets it
BLOCKS = 4
PER_RANK = 5  # values of a key a rank records a step
EVERY = "0.5s"

# A rank of the job: it records the values the test gave it (values-<rank>.json: a list a
# step of [key, value]), a block of steps each time the test lets it (go-<rank>-<block>).
WRITER = """
import json, os, sys, time
import metric_core
from metric_core import Reduce, record_metric
c = json.loads(sys.argv[1])
rank = c["rank"]
steps = json.load(open(c["values"]))
metric_core.init(
    c["run"], rank=rank, process_name=f"Trainer_r{rank}", world_size=c["world"], flush_interval=0.02
)
for block in range(c["blocks"]):
    go, waited = f"{c['control']}/go-{rank}-{block}", time.monotonic()
    while not os.path.exists(go):
        assert time.monotonic() - waited < 300, "the test never let this rank go on"
        time.sleep(0.01)
    for step in range(block * c["block"], (block + 1) * c["block"]):
        for key, value in steps[step]:
            record_metric(key, value, Reduce(key.split("/")[1]))
        metric_core.flush(step)
metric_core.shutdown()
"""


def family(rng: np.random.Generator, name: str) -> list[float]:
    if name == "count":  # integers: a sum of a few passes 2**53, where float64 integers are even
        return (4e15 + rng.integers(0, 1000, PER_RANK)).tolist()
    if name == "tenth":  # 0.1 .. 0.9: none is what it says
        return (rng.integers(1, 10, PER_RANK) / 10).tolist()
    if name == "offset":  # 1e12 and a decimal fraction
        return (1e12 + rng.integers(1, 100, PER_RANK) / 10).tolist()
    raise AssertionError(name)


KEYS = [f"{f}/{s}" for f in ("count", "tenth", "offset") for s in ("sum", "mean", "std")]


def recorded(seed: int) -> list[list[list[tuple[str, float]]]]:
    """Each rank's values: a list a step of (key, value), in the order recorded."""
    rng = np.random.default_rng(seed)
    return [
        [[(key, v) for key in KEYS for v in family(rng, key.split("/")[0])] for _ in range(BLOCK * BLOCKS)]
        for _ in range(RANKS)
    ]


def exact(values: list[float], stat: str) -> float:
    """sum, mean or population std, correctly rounded from the exact value (``fractions``)."""
    xs = [Fraction(v) for v in values]
    n, total = len(xs), sum(xs, Fraction(0))
    if stat == "sum":
        return rounded(total)
    if stat == "mean":
        return rounded(total / n)
    return root(sum(((x - total / n) ** 2 for x in xs), Fraction(0)) / n)


def naive(values: list[float], stat: str) -> float:
    """The same in float64, added one value after another in the order given."""
    total = 0.0
    for v in values:
        total += v
    mean = total / len(values)
    if stat == "sum":
        return total
    if stat == "mean":
        return mean
    spread = 0.0
    for v in values:
        spread += (v - mean) ** 2
    return math.sqrt(spread / len(values))


def bits(x: float) -> int:
    return int(np.float64(x).view(np.int64))


def journal_flushed(run: Path, rank: int, step: int) -> bool:
    """``rank``'s journal holds its flush of ``step`` (a condition on the file)."""
    from metric_core.format import journal

    paths = list(run.glob(f"Trainer_r{rank}.r{rank}.*.journal"))
    if not paths:
        return False
    decoded = journal.decode(paths[0].read_bytes(), records=False)
    return decoded.last_flush is not None and decoded.last_flush >= step


def sent(run: Path, name: str) -> int:
    """The rows the follower of W&B run ``name`` handed over so far (its ledger entry)."""
    ledger = run / ".metriclog" / "uploads.json"
    if not ledger.exists():
        return 0
    entries = json.loads(ledger.read_text())["runs"].values()
    return max((e["rows_sent"] for e in entries if e["name"] == name), default=0)


def written_rows(run: Path, name: str) -> list[dict]:
    entry = runs_written(run)[name]
    assert entry["finished"], entry
    return history_rows(read_records(find_run_file(run / ".metriclog" / "wandb", entry["id"])))


def test_the_rows_followed_poll_by_poll_are_a_plain_reduce_bit_for_bit(tmp_path):
    run, control = tmp_path / "run", tmp_path / "control"
    run.mkdir()
    control.mkdir()
    values = recorded(seed=42)
    steps = range(BLOCK * BLOCKS)

    # the data can tell: in the order the polls bring a step's records (rank 1's, a block
    # earlier, then rank 0's), a naive float sum, mean or std is not the exact value
    # everywhere, nor the same as in the files' order (rank 0's, then rank 1's)
    truth, poll_order, file_order = {}, {}, {}
    for step in steps:
        for key in KEYS:
            stat = key.split("/")[1]
            mine = [[v for k, v in values[rank][step] if k == key] for rank in range(RANKS)]
            truth[step, key] = exact(mine[0] + mine[1], stat)
            poll_order[step, key] = naive(mine[1] + mine[0], stat)
            file_order[step, key] = naive(mine[0] + mine[1], stat)
    for stat in ("sum", "mean", "std"):
        group = [g for g in truth if g[1].endswith(stat)]
        off = [g for g in group if bits(poll_order[g]) != bits(truth[g])]
        moved = [g for g in group if bits(poll_order[g]) != bits(file_order[g])]
        assert len(off) >= 5 and len(moved) >= 3, (stat, len(off), len(moved))

    for rank in range(RANKS):
        (tmp_path / f"values-{rank}.json").write_text(json.dumps(values[rank]))
    by_step = follow(run, "--name", "steps")
    by_time = follow(run, "--name", "windows", "--by", "time", "--every", EVERY)
    config = {"run": str(run), "world": RANKS, "blocks": BLOCKS, "block": BLOCK, "control": str(control)}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, json.dumps({**config, "rank": r, "values": f"values-{r}.json"})],
            cwd=tmp_path,
        )
        for r in range(RANKS)
    ]

    def failed() -> bool:
        return any(p.poll() not in (None, 0) for p in ranks)

    def go(rank: int, block: int) -> None:
        (control / f"go-{rank}-{block}").touch()
        last = (block + 1) * BLOCK - 1
        # after its last block a rank shuts down: its journal becomes a sealed segment
        ended = block + 1 == BLOCKS
        wait_for(
            lambda: (ranks[rank].poll() == 0 if ended else journal_flushed(run, rank, last)) or failed(),
            f"rank {rank} to flush {last}",
        )
        assert not failed(), "a writer failed"

    try:
        # rank 1 runs a block ahead: when rank 0 completes block b, the follower read rank
        # 1's records of block b + 1 already, and hands a step of it over a poll or more later
        go(1, 0)
        for block in range(BLOCKS):
            if block + 1 < BLOCKS:
                go(1, block + 1)
            go(0, block)
            handed = (block + 1) * BLOCK
            wait_for(lambda n=handed: sent(run, "steps") >= n, f"the steps of block {block} handed over")
        for p in ranks:
            assert p.wait(timeout=120) == 0
        for follower in (by_step, by_time):
            _, err = follower.communicate(timeout=120)
            assert follower.returncode == 0, err
            assert "came after" not in err, err
    finally:
        for p in [*ranks, by_step, by_time]:
            if p.poll() is None:
                p.kill()
                p.wait()

    # by step: the rows are the plain reduction of the finished run, and the exact values
    rows = written_rows(run, "steps")
    assert [r["step"] for r in rows] == list(steps)
    plain = {(s, k): v for s, k, v in reduce_run(run).select("step", "key", "value").iter_rows()}
    assert set(plain) == set(truth)
    got = {(row["step"], key): row[key] for row in rows for key in KEYS}
    not_plain = [(g, got[g], plain[g]) for g in truth if bits(got[g]) != bits(plain[g])]
    not_exact = [(g, got[g], truth[g]) for g in truth if bits(got[g]) != bits(truth[g])]
    assert not not_plain, f"{len(not_plain)} of {len(truth)} values not the plain reduce's: {not_plain[:5]}"
    assert not not_exact, f"{len(not_exact)} of {len(truth)} values not the exact ones: {not_exact[:5]}"

    # by time: each window's row is the plain reduction's, bit for bit
    rows = written_rows(run, "windows")
    windows = reduce_run(run, by="time", every=EVERY)
    plain = {(w, k): v for w, k, v in windows.select("window_start", "key", "value").iter_rows()}
    assert [r["window_start"] for r in rows] == sorted({w for w, _ in plain})
    for row in rows:
        keys = {k for w, k in plain if w == row["window_start"]}
        assert {k for k in row if k in KEYS} == keys
        for key in keys:
            assert bits(row[key]) == bits(plain[row["window_start"], key]), (row["window_start"], key)
