"""Samples (Reduce.SAMPLE) recorded by real rank processes come back exactly as recorded,
from sealed files and from a killed rank's journal; chosen per step as a sort says; never
mistaken for records; a damaged block is left out and said."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import metric_core
from metric_core import Reduce, make_plan, read_samples, record_metric, reduce_run
from metric_core.offline.samples import choose, samples_frame
from metric_core.offline.upload import Follow, WandB, upload_run

from .wandb_file import find_run_file, history_rows, read_records, tables_of

METRICLOG = str(Path(sys.executable).with_name("metriclog"))

# A rank records samples of every kind of field; after each flush it writes what it recorded
# (as JSON: numpy scalars as the numbers they hold) to truth-<rank>.jsonl.
RANK = """
import json, os, signal, sys
import numpy as np
import metric_core
from metric_core import Reduce, record_metric
run, rank, fmt, steps, die = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
metric_core.init(run, rank=rank, process_name=f"gen_r{rank}", file_format=fmt, flush_interval=0.05)
rng = np.random.default_rng(rank)
with open(f"{run}/../truth-{rank}.jsonl", "w") as truth:
    for step in range(steps):
        for i in range(5):
            sample = {
                "prompt": f"rank {rank} step {step} #{i} \\u00e9",
                "reward": float(rng.normal()) if i != 3 else float("nan"),
                "tokens": int(rng.integers(0, 2**60)) * 4,
                "ok": bool(i % 2),
                "note": None if i else "first",
                "ids": [int(x) for x in rng.integers(0, 100, 3)],
                "meta": {"temperature": 0.7, "stop": ["</s>"]},
                "np": np.float32(0.5) * i,
            }
            if i == 4:
                del sample["note"]  # a field missing from a sample
            record_metric("rollout/sample", sample, Reduce.SAMPLE)
            record_metric("rollout/reward", sample["reward"])
            sample["np"] = float(sample["np"])
            truth.write(json.dumps([step, rank, sample]) + "\\n")
        if step == die:
            truth.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step: this step's samples were never flushed
        metric_core.flush(step)
        truth.write(json.dumps(["flushed", step]) + "\\n")
        truth.flush()
metric_core.shutdown()
"""


def job(tmp_path: Path, fmt: str, ranks: int = 3, steps: int = 6, die: dict[int, int] | None = None) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    children = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(run), str(r), fmt, str(steps), str((die or {}).get(r, -1))],
            cwd=tmp_path,
        )
        for r in range(ranks)
    ]
    for child in children:
        child.wait(timeout=120)
    return run


def truth(tmp_path: Path, ranks: int, flushed_only: bool = True) -> list[tuple[int, int, dict]]:
    """What each rank recorded; with ``flushed_only``, up to its last returned flush."""
    out = []
    for r in range(ranks):
        pending = []
        for line in (tmp_path / f"truth-{r}.jsonl").read_text().splitlines():
            row = json.loads(line)
            if row[0] == "flushed":
                out += pending
                pending = []
            else:
                pending.append((row[0], row[1], row[2]))
        if not flushed_only:
            out += pending
    return out


def same(a: object, b: object) -> bool:
    """Equal, NaN equal to NaN (json.loads gives NaN for NaN, as recorded)."""
    if isinstance(a, float) and isinstance(b, float) and np.isnan(a) and np.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


@pytest.mark.slow  # a job of real rank processes
@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_every_sample_of_every_rank_comes_back_exactly_as_recorded(tmp_path, fmt):
    run = job(tmp_path, fmt)
    want = truth(tmp_path, 3)
    got = read_samples(run)
    assert got.notes == [] and got.report.summary() == ""
    assert sorted((s.rank, s.step) for s in got.samples) == sorted((r, s) for s, r, _ in want)
    by_prompt = {s.fields["prompt"]: s for s in got.samples}
    assert len(by_prompt) == len(want) == 3 * 6 * 5
    for step, rank, sample in want:
        back = by_prompt[sample["prompt"]]
        assert (back.step, back.rank, back.process, back.key) == (
            step,
            rank,
            f"gen_r{rank}",
            "rollout/sample",
        )
        assert same(back.fields, sample), (back.fields, sample)
    assert list((run / "samples").iterdir()), "sealed into files of their own"
    # The command gives the same, field by field (lists and dicts as JSON text).
    out = tmp_path / "all.parquet"
    done = subprocess.run([METRICLOG, "samples", str(run), "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    import polars as pl

    rows = {r["prompt"]: r for r in pl.read_parquet(out).iter_rows(named=True)}
    assert len(rows) == len(want)
    for step, rank, sample in want:
        row = rows[sample["prompt"]]
        back = {k: json.loads(row[k]) if k in ("ids", "meta") else row[k] for k in sample}
        assert same(back, sample) and (row["step"], row["rank"]) == (step, rank)
        assert "note" in sample or row["note"] is None
    # Never records: the scalar reduction sees the scalar key only, and skips no file.
    reduced = reduce_run(run, mode="per_rank_no_reduce")
    assert set(reduced["key"]) == {"rollout/reward"}
    assert reduced.height == 3 * 6 * 5


def test_a_killed_ranks_flushed_samples_are_all_there(tmp_path):
    run = job(tmp_path, "parquet", ranks=2, steps=6, die={1: 3})
    flushed = truth(tmp_path, 2)
    recorded = truth(tmp_path, 2, flushed_only=False)
    got = {s.fields["prompt"] for s in read_samples(run).samples}
    every = {sample["prompt"] for _, _, sample in recorded}
    assert {sample["prompt"] for _, _, sample in flushed} <= got <= every  # nothing lost, nothing invented
    assert any(p.suffix == ".journal" for p in run.iterdir()), "rank 1 left its journal"


@pytest.mark.parametrize("sealed_when", ["listed", "about to be read"])
def test_a_journal_sealed_while_the_run_is_read_loses_none_of_its_samples(tmp_path, monkeypatch, sealed_when):
    """The writer seals a journal (samples file first, then the unlink) between the reader's
    listing and its reading: the sidecar met this live and stopped with "No such file"."""
    run = tmp_path / "run"
    metric_core.init(run, rank=0, process_name="gen", catch_signals=False)
    recorded = []
    for step in range(3):
        for i in range(4):
            recorded.append({"prompt": f"p{step}-{i}", "reward": float(step * 10 + i)})
            record_metric("rollout", recorded[-1], Reduce.SAMPLE)
        metric_core.flush(step)
    journal = next(run.glob("*.journal"))
    walk = os.walk

    def walk_and_seal(top, *args, **kwargs):
        for entry in walk(top, *args, **kwargs):
            if sealed_when == "listed" and journal.name in entry[2]:
                metric_core.shutdown()  # after the listing named the journal, before its lstat
            yield entry
        if sealed_when == "about to be read" and journal.exists():
            metric_core.shutdown()

    monkeypatch.setattr(os, "walk", walk_and_seal)
    got = read_samples(run)
    assert not journal.exists(), "the journal was sealed as the run was read"
    assert [s.fields for s in got.samples] == recorded and not got.notes and not got.report.summary()


def test_top_bottom_and_random_choices_equal_a_sort_and_numpys_generator(tmp_path):
    run = job(tmp_path, "parquet", ranks=3, steps=4)
    samples = read_samples(run, keys=["rollout/*"]).samples
    top = choose(samples, top=2, bottom=1, by="reward")
    for step in range(4):
        group = [s for s in samples if s.step == step]
        scored = [s for s in group if not np.isnan(s.fields["reward"])]
        assert len(scored) == len(group) - 3  # NaN rewards are left out, one a rank
        rewards = sorted((s.fields["reward"] for s in scored), reverse=True)
        chosen = [s.fields["reward"] for s in top if s.step == step]
        assert chosen == [rewards[0], rewards[1], rewards[-1]]
    drawn = choose(samples, random=3, seed=11)
    rng = np.random.default_rng(11)
    for step in range(4):
        group = [s for s in samples if s.step == step]  # ordered by rank, process, time, order recorded
        assert group == sorted(group, key=lambda s: (s.rank, s.process, s.timestamp, s.order))
        picked = sorted(rng.choice(len(group), size=3, replace=False).tolist())
        assert [s.fields["prompt"] for s in drawn if s.step == step] == [
            group[i].fields["prompt"] for i in picked
        ]
    assert len(choose(samples[:2], top=5, bottom=5, by="reward")) == 2  # fewer than asked: each once


def test_tied_scores_fill_the_top_and_the_bottom_with_different_samples(tmp_path):
    """A step of 4 samples with two tied in the middle (torchforge's GRPO rewards are a few
    fractions, ties are common): the top 2 and the bottom 2 are all 4 of them, as a sort
    ascending gives them (its first 2 and its last 2); one tied sample was both the top's
    second and the bottom's second, shown once, and the other tied one was not shown."""
    metric_core.init(tmp_path / "run", process_name="controller")
    rewards = [1 / 6, 0.0, 1 / 6, 0.5, 0.5, 0.5, 0.0]
    for i, reward in enumerate(rewards):
        record_metric("rollout", {"i": i, "reward": reward}, Reduce.SAMPLE)
        if i == 3:
            metric_core.flush(0)
    metric_core.flush(1)
    metric_core.shutdown()
    samples = read_samples(tmp_path / "run").samples
    for step, (top, bottom) in {0: (2, 2), 1: (1, 2)}.items():
        group = [s for s in samples if s.step == step]
        ranked = sorted(group, key=lambda s: s.fields["reward"])  # stable: ties in recorded order
        want = {s.fields["i"] for s in ranked[len(ranked) - top :] + ranked[:bottom]}
        got = [s.fields["i"] for s in choose(samples, top=top, bottom=bottom, by="reward") if s.step == step]
        assert sorted(got) == sorted(want) and len(got) == len(set(got)), (step, got)


def test_the_command_writes_every_chosen_sample_with_the_union_of_fields(tmp_path):
    run = job(tmp_path, "jsonl", ranks=2, steps=3)
    done = subprocess.run(
        [METRICLOG, "samples", str(run), "--top", "1", "--by", "reward", "--ranks", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    rows = list(csv.DictReader(io.StringIO(done.stdout)))
    want = [s for s in read_samples(run, ranks=[(1, 1)]).samples if not np.isnan(s.fields["reward"])]
    for step in range(3):
        best = max((s for s in want if s.step == step), key=lambda s: s.fields["reward"])
        (row,) = [r for r in rows if r["step"] == str(step)]
        assert row["prompt"] == best.fields["prompt"] and row["rank"] == "1"
        assert json.loads(row["ids"]) == best.fields["ids"] and row["tokens"] == str(best.fields["tokens"])
    fields = ["prompt", "reward", "tokens", "ok", "note", "ids", "meta", "np"]
    assert list(rows[0]) == ["step", "rank", "process", "timestamp", "key", *fields]
    out = tmp_path / "all.parquet"
    done = subprocess.run([METRICLOG, "samples", str(run), "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    import polars as pl

    frame = pl.read_parquet(out)
    assert frame.height == 2 * 3 * 5
    assert frame["tokens"].dtype == pl.Int64 and frame["note"].null_count() == frame.height - 6


def test_a_flipped_bit_in_a_sealed_block_leaves_that_block_out_and_says_so(tmp_path):
    run = job(tmp_path, "jsonl", ranks=1, steps=2)
    (path,) = (run / "samples").iterdir()
    data = bytearray(path.read_bytes())
    at = data.index(b"rank 0 step 1 #2")
    data[at + 5] ^= 0x01  # "step" -> "stdp" in a prompt: still valid JSON, but not what was written
    path.write_bytes(bytes(data))
    got = read_samples(run)
    said = got.report.summary()
    assert got.samples == [] and f"samples/{path.name}: 10 sample(s) skipped: 10 x a block at byte" in said
    assert "fails its checksum (the file is damaged)" in said
    assert all("stdp" not in s.fields["prompt"] for s in got.samples)


def test_a_sample_too_large_is_refused_and_an_odd_field_kept_as_repr_said_once(tmp_path):
    metric_core.init(tmp_path, process_name="gen")
    record_metric("big", {"text": "x" * (2 << 20)}, Reduce.SAMPLE)
    for _ in range(2):
        record_metric("odd", {"when": object(), "n": 1}, Reduce.SAMPLE)
    with pytest.warns(metric_core.MetricLogWarning) as said:
        metric_core.flush(0)
    metric_core.shutdown()
    texts = [str(w.message) for w in said]
    assert any("sample of 'big' is" in t and "not recorded" in t for t in texts), texts
    assert sum("kept as their repr" in t for t in texts) == 1, texts
    got = read_samples(tmp_path).samples
    assert [s.key for s in got] == ["odd", "odd"] and got[0].fields["n"] == 1
    assert got[0].fields["when"].startswith("<object object")


def test_a_sample_must_be_a_dict(tmp_path):
    metric_core.init(tmp_path, process_name="gen")
    with pytest.raises(TypeError, match=r"metric 'k': a sample \(Reduce.SAMPLE\) is a dict"):
        record_metric("k", [1, 2], Reduce.SAMPLE)


def test_samples_frame_types_follow_the_values():
    from metric_core.offline.samples import Sample

    rows = [
        Sample(0, 0, "p", 1.0, "k", {"a": 1, "b": 2**70, "c": 1, "d": "x", "e": True}),
        Sample(0, 0, "p", 2.0, "k", {"a": 2, "b": 1, "c": 0.5, "d": 3, "e": None}),
    ]
    frame = samples_frame(rows)
    assert [str(t) for t in frame.dtypes[5:]] == ["Int64", "String", "Float64", "String", "Boolean"]
    assert frame["b"].to_list() == [str(2**70), "1"]  # past 64 bits: exact, as text


@pytest.mark.parametrize("follow", [False, True], ids=["upload", "follow"])
def test_upload_sends_each_steps_chosen_samples_as_a_table_in_its_row(tmp_path, monkeypatch, follow):
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = job(tmp_path, "parquet", ranks=2, steps=3)
    samples = read_samples(run).samples
    more = {"follow": Follow(interval=0.2)} if follow else {}
    upload_run(run, make_plan(), WandB("p", offline=True), **more)
    upload_run(run, make_plan(mode="per_rank_reduce"), WandB("p", offline=True), name="ranks")
    ledger = json.loads((run / ".metriclog" / "uploads.json").read_text())["runs"]
    files = {e["name"]: find_run_file(run / ".metriclog" / "wandb", i) for i, e in ledger.items()}
    for name, source in (("run", None), ("ranks_gen_r0", "gen_r0"), ("ranks_gen_r1", "gen_r1")):
        tables = tables_of(files[name], "rollout/sample")
        assert sorted(tables) == [0, 1, 2], name
        for step, rows in tables.items():
            group = [s for s in samples if s.step == step and source in (None, s.process)]
            scored = sorted(
                (s for s in group if not np.isnan(s.fields["reward"])), key=lambda s: -s.fields["reward"]
            )
            want = (
                scored[:2] + scored[::-1][:2]
            )  # the default: top 2 by reward, then the bottom 2, lowest first
            assert [r["prompt"] for r in rows] == [s.fields["prompt"] for s in want], (name, step)
            assert [json.loads(r["ids"]) for r in rows] == [s.fields["ids"] for s in want]


def one_rank(
    run: Path, steps: int, *, fmt: str = "parquet", start: int | None = None, samples: bool = True, **more
):
    """In this process: a source recording 3 samples and a scalar a step (``samples=False``:
    the scalar only), from ``start``."""
    metric_core.init(run, process_name="gen", file_format=fmt, step=start, **more)
    for step in range(start or 0, steps):
        for i in range(3):
            if samples:
                record_metric("rollout", {"prompt": f"{start}/{step}/{i}", "reward": float(i)}, Reduce.SAMPLE)
        record_metric("rollout", float(step)) if not samples else record_metric("loss", float(step))
        metric_core.flush(step)
    metric_core.shutdown()


def test_a_restart_that_records_no_samples_still_replaces_the_earlier_ones_from_its_first_step(tmp_path):
    one_rank(tmp_path, 10)
    one_rank(tmp_path, 8, start=5, samples=False)
    got = read_samples(tmp_path)
    assert sorted({s.step for s in got.samples}) == [0, 1, 2, 3, 4] and got.replaced == 15
    assert len(read_samples(tmp_path, attempts="all").samples) == 30


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_damaged_metadata_or_a_cut_file_is_said_never_read_as_other_data(tmp_path, fmt):
    one_rank(tmp_path / "a", 3, fmt=fmt)
    (path,) = (tmp_path / "a" / "samples").iterdir()
    data = path.read_bytes()
    at = data.index(b'"rank": 0') + len(b'"rank": ')
    path.write_bytes(data[:at] + b"1" + data[at + 1 :])  # the metadata says another rank
    got = read_samples(tmp_path / "a")
    said = got.report.summary()
    assert got.samples == [] and f"samples/{path.name}: unreadable, skipped (" in said, said
    if fmt == "jsonl":  # a file cut after its first block: the rest is missing, and said
        one_rank(tmp_path / "b", 3, fmt=fmt)
        (path,) = (tmp_path / "b" / "samples").iterdir()
        lines = path.read_bytes().splitlines(keepends=True)
        path.write_bytes(b"".join(lines[:5]))  # metadata, 3 samples, and half of nothing
        got = read_samples(tmp_path / "b")
        said = got.report.summary()
        assert (
            got.samples == []
            and "9 x missing from the file, whose metadata declares 9 (cut or damaged)" in said
        )


def test_a_damaged_journal_is_said(tmp_path):
    script = (
        "import os, signal, metric_core\n"
        "from metric_core import Reduce, record_metric\n"
        f"metric_core.init({str(tmp_path)!r}, process_name='gen')\n"
        "for step in range(3):\n"
        "    record_metric('rollout', {'prompt': str(step)}, Reduce.SAMPLE)\n"
        "    metric_core.flush(step)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    subprocess.run([sys.executable, "-c", script], timeout=60)
    (journal,) = tmp_path.glob("*.journal")
    data = bytearray(journal.read_bytes())
    data[data.index(b'"prompt": "1"') + 12] ^= 0x01  # inside the second sample's frame
    journal.write_bytes(bytes(data))
    got = read_samples(tmp_path)
    assert [s.fields["prompt"] for s in got.samples] == ["0"]
    said = got.report.summary()
    assert f"{journal.name}: 0 sample(s) skipped: frame at byte" in said and "fails its checksum" in said


def test_a_source_of_samples_only_seals_by_size_and_the_commands_say_what_the_run_holds(tmp_path):
    one_rank(tmp_path, 4, samples=True, segment_records=5)
    assert len(list((tmp_path / "samples").iterdir())) >= 2  # a samples file a segment
    assert len(read_samples(tmp_path).samples) == 12
    done = subprocess.run([METRICLOG, "inspect", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "rollout 12" in done.stdout


def test_a_samples_key_that_is_a_scalar_key_too_goes_beside_it_in_wb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    one_rank(tmp_path, 2, samples=True)
    metric_core.init(tmp_path, process_name="gen2")
    record_metric("rollout", 7.0)  # the samples key, as a scalar
    metric_core.flush(0)
    metric_core.shutdown()
    said = []
    from metric_core.offline.upload import UploadEvents

    upload_run(
        tmp_path,
        make_plan(),
        WandB("p", offline=True),
        events=UploadEvents(message=lambda k, t: said.append(t)),
    )
    ledger = json.loads((tmp_path / ".metriclog" / "uploads.json").read_text())["runs"]
    ((run_id, _),) = ledger.items()
    run_file = find_run_file(tmp_path / ".metriclog" / "wandb", run_id)
    rows = history_rows(read_records(run_file))
    assert rows[0]["rollout"] == 7.0 and rows[0]["step"] == 0
    assert sorted(tables_of(run_file, "rollout_samples")) == [0, 1]
    assert any("go as 'rollout_samples'" in t for t in said)


def test_a_journal_cut_short_is_said_as_reduce_says_it_and_only_its_last_frame_is_lost(tmp_path):
    """A killed rank's journal cut in its last samples frame (a disk that filled, a copy cut
    short): the samples of whole frames come back, and the cut is said, as reduce says it."""
    run = tmp_path / "run"
    script = (
        "import os, signal, metric_core\n"
        "from metric_core import Reduce, record_metric\n"
        f"metric_core.init({str(run)!r}, process_name='gen')\n"
        "for step in range(6):\n"
        "    for i in range(5):\n"
        "        record_metric('rollout', {'prompt': f'{step}/{i}', 'reward': float(i)}, Reduce.SAMPLE)\n"
        "    record_metric('loss', float(step))\n"
        "    metric_core.flush(step)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    subprocess.run([sys.executable, "-c", script], timeout=120)
    (journal,) = run.glob("*.journal")
    data = journal.read_bytes()
    journal.write_bytes(data[: data.rindex(b'"5/4"')])  # inside the frame that holds 5/4
    done = subprocess.run([METRICLOG, "samples", str(run)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    prompts = [r["prompt"] for r in csv.DictReader(io.StringIO(done.stdout))]
    flushed = [f"{step}/{i}" for step in range(5) for i in range(5)]  # in frames before the cut
    assert prompts[:25] == flushed and set(prompts[25:]) < {f"5/{i}" for i in range(4)}
    # nothing a flush wrote was lost: a notice, not a skip of "0 record(s)" that --strict refused
    cut = "its last write was cut short (the writer was killed mid-write, or is writing now): that write"
    cut += " is not read"
    assert f"  {journal.name}: {cut}" in done.stderr.splitlines(), done.stderr
    assert "skipped" not in done.stderr
    strict = [METRICLOG, "reduce", str(run), "--strict"]
    reduced = subprocess.run(strict, capture_output=True, text=True, timeout=120)
    assert reduced.returncode == 0 and f"  {journal.name}: {cut}" in reduced.stderr.splitlines(), (
        reduced.stderr
    )


@pytest.mark.parametrize(
    ("by", "said"),
    [
        ("rewrd", "is no field of the samples"),
        ("prompt", "is not a number in any sample (it holds text)"),
        ("ok", "is not a number in any sample (it holds bool)"),
    ],
)
def test_ranking_by_a_field_that_is_no_number_of_any_sample_is_an_error_naming_the_numeric_ones(
    tmp_path, by, said
):
    from metriclog.main import app
    from typer.testing import CliRunner

    run = job(tmp_path, "parquet", ranks=1, steps=2)
    result = CliRunner().invoke(app, ["samples", str(run), "--top", "1", "--by", by])
    assert result.exit_code == 1, result.output
    assert result.stderr == f"Error: --by '{by}' {said}; the samples' numeric fields: np, reward, tokens\n"
    assert result.stdout == ""
    with pytest.raises(metric_core.MetricLogError, match=f"^by='{by}' {re.escape(said)}"):
        metric_core.select_samples(run, top=1, by=by)


def test_a_key_whose_samples_lack_the_ranking_field_is_said(tmp_path):
    metric_core.init(tmp_path, process_name="gen")
    record_metric("scored", {"reward": 1.0}, Reduce.SAMPLE)
    record_metric("unscored", {"prompt": "x"}, Reduce.SAMPLE)
    metric_core.flush(0)
    metric_core.shutdown()
    frame, read = metric_core.select_samples(tmp_path, top=1, by="reward")
    assert frame["key"].to_list() == ["scored"]
    assert [str(n) for n in read.notes] == [
        "by='reward': no sample of 'unscored' holds it as a number; none of theirs is shown"
    ]


def _unrelated_parquet(run: Path) -> None:
    import polars as pl

    pl.DataFrame({"a": [1, 2], "b": ["x", "y"]}).write_parquet(run / "t.parquet")


@pytest.mark.parametrize("fill", [lambda run: None, _unrelated_parquet], ids=["empty", "unrelated"])
def test_a_run_without_metriclog_files_is_the_error_reduce_gives(tmp_path, fill):
    from metriclog.main import app
    from typer.testing import CliRunner

    run = tmp_path / "run"
    run.mkdir()
    fill(run)
    listed = CliRunner().invoke(app, ["samples", str(run)])
    reduced = CliRunner().invoke(app, ["reduce", str(run)])
    assert listed.exit_code == reduced.exit_code == 1, listed.output
    assert listed.stderr == reduced.stderr and listed.stderr.startswith(
        f"Error: no readable metric record in {run}"
    )


def test_a_run_of_records_only_says_there_is_no_sample(tmp_path):
    from metriclog.main import app
    from typer.testing import CliRunner

    one_rank(tmp_path, 2, samples=False)
    result = CliRunner().invoke(app, ["samples", str(tmp_path), "--format", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == []
    assert result.stderr == (
        f"warning: {tmp_path} holds no sample (Reduce.SAMPLE), records only: "
        f"`metriclog keys {tmp_path}` lists their keys\n"
    )


def test_a_run_whose_samples_files_could_none_be_read_is_an_error_after_the_warning(tmp_path):
    from metriclog.main import app
    from typer.testing import CliRunner

    one_rank(tmp_path, 3, samples=True)
    (path,) = (tmp_path / "samples").iterdir()
    path.write_bytes(path.read_bytes()[:100])  # cut inside its first bytes
    result = CliRunner().invoke(app, ["samples", str(tmp_path)])
    assert result.exit_code == 1, result.output
    warning, *_, error = result.stderr.splitlines()
    assert warning == f"warning: skipped 0 sample(s) and 1 unreadable file(s) in {tmp_path}:"
    assert f"  samples/{path.name}: unreadable, skipped (" in result.stderr
    assert error == (
        f"Error: no sample (Reduce.SAMPLE) in {tmp_path}: none of its samples files could be read "
        "(see the warning above)"
    )
