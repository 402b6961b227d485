"""TensorBoard as a destination: the event files, read back by TensorBoard's own
EventAccumulator, equal `reduce` in each mode to float32; a second upload writes nothing;
an interrupted one completes; the rounding to float32 is said."""

from __future__ import annotations

import json

import numpy as np
import pytest

from metric_core import make_plan, reduce_run
from metric_core.offline.upload import upload_run
from metric_core.offline.upload.tensorboard import TensorBoard

from .conftest import write_collector_run

pytest.importorskip("tensorboardX")
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def scalars(folder) -> dict[str, list[tuple[int, float, float]]]:
    """Every scalar TensorBoard reads in ``folder``: tag -> [(step, value, wall time)]."""
    acc = event_accumulator.EventAccumulator(str(folder), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value, e.wall_time) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture
def run(tmp_path):
    root = tmp_path / "exp"
    write_collector_run(root, [("TrainActor_r0", 0), ("TrainActor_r1", 1)], steps=6)
    return root


@pytest.mark.parametrize("mode", ["global_reduce", "per_rank_reduce", "per_rank_no_reduce"])
def test_event_files_equal_reduce_to_float32(run, tmp_path, mode):
    logdir = tmp_path / "tb"
    result = upload_run(run, make_plan(mode=mode), TensorBoard(logdir))
    assert {o.action for o in result.outcomes} == {"wrote to TensorBoard"}
    frame = reduce_run(run, mode=mode)
    sources = [None] if mode == "global_reduce" else sorted(set(frame["process"]))
    for source in sources:
        folder = logdir / ("exp" if source is None else f"exp_{source}")
        got = scalars(folder)
        mine = frame if source is None else frame.filter(frame["process"] == source)
        for key in set(mine["key"]):
            rows = mine.filter(mine["key"] == key)
            want = list(zip(rows["step"], np.float32(rows["value"].to_numpy()).tolist(), strict=True))
            assert [(s, v) for s, v, _ in got[key]] == want, (source, key)
            if mode == "per_rank_no_reduce":  # each value at its own wall time
                assert [w for _, _, w in got[key]] == pytest.approx(rows["timestamp"].to_list(), abs=1e-6)
    assert not list(logdir.rglob(".metriclog-partial-*"))


def test_a_second_upload_writes_nothing_and_an_interrupted_one_completes(run, tmp_path, monkeypatch):
    logdir = tmp_path / "tb"
    upload_run(run, make_plan(mode="per_rank_reduce"), TensorBoard(logdir))
    files = sorted(p for p in logdir.rglob("*") if p.is_file() and p.suffix != ".lock")  # (an upload's lock)
    stamps = [p.stat().st_mtime_ns for p in files]
    again = upload_run(run, make_plan(mode="per_rank_reduce"), TensorBoard(logdir))
    assert {o.action for o in again.outcomes} == {"skipped"}
    assert [p.stat().st_mtime_ns for p in files] == stamps  # nothing written again
    # An upload stopped half-way: a partial file left, and its run not in the ledger.
    from metric_core.offline.upload import tensorboard
    from metric_core.offline.upload.runs import PlannedRun

    other = tmp_path / "tb2"
    calls = {"n": 0}
    history = PlannedRun.history

    def dies_on_the_second_run(self, *args):  # the second run's rows: stopped as they are read
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return history(self, *args)

    monkeypatch.setattr(PlannedRun, "history", dies_on_the_second_run)
    with pytest.raises(KeyboardInterrupt):
        upload_run(run, make_plan(mode="per_rank_reduce"), TensorBoard(other))
    monkeypatch.setattr(PlannedRun, "history", history)
    assert list(other.rglob(".metriclog-partial-*")), "the second run's file was left half-written"
    entries = json.loads((other / tensorboard.LEDGER).read_text())["runs"].values()
    assert sorted(e["finished"] for e in entries) == [False, True]  # the second one not whole
    done = upload_run(run, make_plan(mode="per_rank_reduce"), TensorBoard(other))
    assert sorted(o.action for o in done.outcomes) == ["skipped", "wrote to TensorBoard"]
    for name in ("exp_TrainActor_r0", "exp_TrainActor_r1"):  # the same steps and values (a reduced
        # row has no time of its own: each is at the time it was written)
        steps_values = [
            {k: [(s, v) for s, v, _ in rows] for k, rows in scalars(d / name).items()}
            for d in (other, logdir)
        ]
        assert steps_values[0] == steps_values[1]
    assert not list(other.rglob(".metriclog-partial-*"))


def test_float32_rounding_is_counted_and_said(tmp_path):
    from metric_core import MetricCollector

    c = MetricCollector(tmp_path / "exp", rank=0)
    for step, value in enumerate([0.5, 0.1, 1e-300, 2.0]):  # 0.1 and 1e-300 are not float32s
        c.record("x", value)
        c.flush(step)
    c.shutdown()
    result = upload_run(tmp_path / "exp", make_plan(), TensorBoard(tmp_path / "tb"))
    (outcome,) = result.outcomes
    assert "2 value(s) changed when rounded to float32" in outcome.message


@pytest.mark.slow  # the installed command, in five processes
def test_the_command_writes_tensorboard_and_says_what_it_needs(run, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    metriclog = str(Path(sys.executable).with_name("metriclog"))
    done = subprocess.run(
        [metriclog, "upload", str(run), "--to", "tensorboard", "--logdir", str(tmp_path / "tb")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "wrote to TensorBoard exp (" in done.stderr
    assert set(scalars(tmp_path / "tb" / "exp")) == set(reduce_run(run)["key"])
    for args, says in [
        (["--to", "tensorboard"], "--to tensorboard writes under --logdir DIR: give it"),
        (
            ["--to", "tensorboard", "--logdir", "x", "--project", "p"],
            "--project is W&B's: not with --to tensorboard",
        ),
        (["--logdir", "x", "--project", "p"], "--logdir works only with --to tensorboard"),
        ([], "name the W&B project: --project P"),
    ]:
        bad = subprocess.run(
            [metriclog, "upload", str(run), *args], capture_output=True, text=True, timeout=60
        )
        assert bad.returncode == 2 and says in bad.stderr, (args, bad.stderr)


def test_samples_are_said_not_to_go_to_tensorboard(tmp_path):
    """Issue 41, defect 9: TensorBoard gets scalars only; the samples are said, not dropped silently."""
    from typer.testing import CliRunner

    from cli.main import app

    from .test_upload import _run_with_samples

    run = tmp_path / "exp"
    _run_with_samples(run)
    done = CliRunner().invoke(
        app, ["upload", str(run), "--to", "tensorboard", "--logdir", str(tmp_path / "tb")]
    )
    assert done.exit_code == 0, done.output
    assert "6 step(s) hold samples (Reduce.SAMPLE): the TensorBoard files hold scalars only" in done.output


def test_a_follow_treats_samples_as_a_plain_upload_does(tmp_path):
    """``--follow --to tensorboard`` and a plain ``--to tensorboard`` of the same run: the
    same scalars read back, neither writes the samples (no text, no tensor), and both say so."""
    from typer.testing import CliRunner

    from cli.main import app

    from .test_upload import _run_with_samples

    run = tmp_path / "exp"
    _run_with_samples(run)
    written = {}
    for how, extra in [("plain", []), ("follow", ["--follow", "--until-idle", "0.1s"])]:
        logdir = tmp_path / how
        done = CliRunner().invoke(
            app, ["upload", str(run), "--to", "tensorboard", "--logdir", str(logdir), *extra]
        )
        assert done.exit_code == 0, done.output
        assert (
            "6 step(s) hold samples (Reduce.SAMPLE): the TensorBoard files hold scalars only" in done.output
        ), how
        acc = event_accumulator.EventAccumulator(
            str(logdir / "exp"), size_guidance={event_accumulator.TENSORS: 0}
        )
        acc.Reload()
        assert acc.Tags()["tensors"] == [], how  # text summaries are tensors of the text plugin
        written[how] = {
            tag: [(step, value) for step, value, _ in events]
            for tag, events in scalars(logdir / "exp").items()
        }
    assert written["follow"] == written["plain"] and written["plain"]


def test_a_ledger_an_earlier_version_wrote_is_read_and_nothing_is_written_again(run, tmp_path):
    """Before the one ledger format, TensorBoard's ledger kept "rows" and no "rows_sent":
    such a ledger still says the runs are written."""
    from metric_core.offline.upload import tensorboard

    logdir = tmp_path / "tb"
    upload_run(run, make_plan(mode="per_rank_reduce"), TensorBoard(logdir))
    ledger = logdir / tensorboard.LEDGER
    old = {
        run_id: {
            "name": e["name"], "file": e["file"], "rows": e["rows_sent"], "attempts": e["attempts"],
            "attempts_sent": e["attempts_sent"], "last_step": e["last_step"], "finished": e["finished"],
        }
        for run_id, e in json.loads(ledger.read_text())["runs"].items()
    }  # fmt: skip
    ledger.write_text(json.dumps({"runs": old}, indent=1) + "\n")
    files = sorted(p for p in logdir.rglob("events.out.tfevents.*"))
    again = upload_run(run, make_plan(mode="per_rank_reduce"), TensorBoard(logdir))
    assert [o.action for o in again.outcomes] == ["skipped", "skipped"]
    assert [o.rows_sent for o in again.outcomes] == [e["rows"] for e in old.values()]
    assert sorted(p for p in logdir.rglob("events.out.tfevents.*")) == files


def test_the_writer_loads_no_torch_and_writes_what_torch_loaded_first_would(tmp_path):
    """tensorboardX's package imports torch where installed (about 1.8 s): an upload keeps
    it out, and a process that loaded torch before writes the same events with it."""
    import subprocess
    import sys

    pytest.importorskip("torch")
    write_collector_run(tmp_path / "run", [("w", 0)], steps=5)
    script = (
        "import sys\n"
        "if sys.argv[1] == 'torch': import torch\n"
        "from metric_core import make_plan\n"
        "from metric_core.offline.upload import upload_run\n"
        "from metric_core.offline.upload.tensorboard import TensorBoard\n"
        "upload_run(sys.argv[2], make_plan(), TensorBoard(sys.argv[3]))\n"
        "print('torch' in sys.modules, 'tensorboardX' in sys.modules)\n"
        "import torch\n"  # still importable after
        "print(torch.tensor([1.5]).item())\n"
    )
    written = {}
    for first in ("none", "torch"):
        logdir = tmp_path / first
        done = subprocess.run(
            [sys.executable, "-c", script, first, str(tmp_path / "run"), str(logdir)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == [str(first == "torch"), "True", "1.5"]
        # (step, value): a global run's wall time is when it was written
        written[first] = {tag: [e[:2] for e in events] for tag, events in scalars(logdir / "run").items()}
    assert written["none"] == written["torch"] and written["none"]
