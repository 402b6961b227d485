"""metriclog import: runs written by the real tools (tensorboardX, torch.utils.tensorboard,
wandb offline, mlflow into SQLite, polars exports) come back exactly, as the tools stored them."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from metriclog.main import app
from typer.testing import CliRunner

from metric_core import reduce_run

from .conftest import wait_for

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "sample_logs" / "rl_run"
DBL_MAX = np.finfo(np.float64).max


def invoke(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def imported(src: object, run: Path, *options: object) -> tuple[str, str]:
    result = invoke("import", src, run, *options)
    assert result.exit_code == 0, result.output
    return result.stdout, result.stderr


def raw(run: Path) -> pl.DataFrame:
    """Every record of the run as written: step, key, value, timestamp, process."""
    frame = reduce_run(run, mode="per_rank_no_reduce")
    return frame.select("step", "key", "value", "timestamp", "process").sort("process", "key", "step")


def same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal value for value, bit for bit (-0.0 is not 0.0), NaN to a NaN."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape or not np.array_equal(np.isnan(got), np.isnan(want)):
        return False
    return bool(np.all(got[~np.isnan(got)].view(np.int64) == want[~np.isnan(want)].view(np.int64)))


def tensorboardx_run(logdir: Path, values: dict[str, list[tuple[int, float]]], texts=()) -> None:
    from tensorboardX import SummaryWriter

    w = SummaryWriter(str(logdir))
    for key, series in values.items():
        for step, value in series:
            w.add_scalar(key, value, step, walltime=1.7e9 + step)
    for step, text in texts:
        w.add_text("notes", text, step, walltime=1.7e9 + step)
    w.close()


def test_tensorboardx_scalars_and_text_come_back_as_float32_and_samples(tmp_path):
    rng = np.random.default_rng(3)
    values = {
        "train/loss": [(s, float(v)) for s, v in enumerate(rng.normal(size=50))],
        "eval/acc": [(s * 10, float(v)) for s, v in enumerate(rng.uniform(size=5))],
    }
    tensorboardx_run(tmp_path / "tb" / "exp1", values, texts=[(3, "hello **world**"), (7, "second")])
    _, err = imported(tmp_path / "tb", tmp_path / "run")
    assert "imported the tensorboard run 'tb'" in err and "exp1 (rank 0): 55 records, 2 samples" in err
    got = reduce_run(tmp_path / "run")  # global_reduce, mean of the one value a step
    for key, series in values.items():
        rows = got.filter(pl.col("key") == key).sort("step")
        assert rows["step"].to_list() == [s for s, _ in series]
        want = np.array([v for _, v in series], dtype=np.float32).astype(np.float64)
        assert same_bits(rows["value"].to_numpy(), want), key
    records = raw(tmp_path / "run")
    assert set(records["process"]) == {"exp1"}
    assert records.filter(pl.col("key") == "eval/acc")["timestamp"].to_list() == [
        1.7e9 + s * 10 for s in range(5)
    ]
    samples = invoke("samples", tmp_path / "run", "--format", "jsonl")
    assert samples.exit_code == 0, samples.output
    rows = [json.loads(line) for line in samples.stdout.splitlines()]
    assert [(r["step"], r["key"], r["text"]) for r in rows] == [  # the tag as tensorboardX stores it
        (3, "notes/text_summary", "hello **world**"),
        (7, "notes/text_summary", "second"),
    ]


def test_torch_summary_writer_simple_values_and_scalar_tensors_both_import(tmp_path):
    torch_tb = pytest.importorskip("torch.utils.tensorboard")
    rng = np.random.default_rng(4)
    plain, tensors = rng.normal(size=20), rng.normal(size=20)
    w = torch_tb.SummaryWriter(str(tmp_path / "tb"))
    for step in range(20):
        w.add_scalar("plain", float(plain[step]), step, walltime=1.7e9 + step)
        w.add_scalar("tensor", float(tensors[step]), step, walltime=1.7e9 + step, new_style=True)
    w.add_histogram("hist", rng.normal(size=100), 0)  # not a scalar: counted and said
    w.close()
    _, err = imported(tmp_path / "tb", tmp_path / "run")
    assert "not imported: 1 histo summaries" in err or "not imported: 1 histograms" in err, err
    got = reduce_run(tmp_path / "run")
    for key, want in (("plain", plain), ("tensor", tensors)):
        rows = got.filter(pl.col("key") == key).sort("step")
        assert rows["step"].to_list() == list(range(20))
        assert same_bits(rows["value"].to_numpy(), want.astype(np.float32).astype(np.float64)), key


def test_scalar_tensors_holding_their_bytes_in_tensor_content_import_exactly(tmp_path):
    """Scalars as TF2's summary ops write them, a tensor whose value is the bytes of
    ``tensor_content`` (not ``float_val``): float32, float64, float16 and bfloat16, rank 0
    and shape [1], written by tensorboard's own ``EventFileWriter``; each comes back as the
    value those bytes hold, widened exactly (NaN, +-inf, -0.0 and subnormals too)."""
    pytest.importorskip("tensorboard")
    from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    rng = np.random.default_rng(45)
    specials = [np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-310, -5e-324, 65504.0, 1e-8]
    base = np.concatenate([specials, rng.normal(scale=10.0 ** rng.integers(-20, 20, 40), size=40)])

    def bfloat16(values: np.ndarray) -> tuple[list[bytes], np.ndarray]:
        """Each value's bfloat16 (float32's upper 16 bits, truncated), as bytes and as float64."""
        high = (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return [h.tobytes() for h in high], (high.astype(np.uint32) << 16).view(np.float32).astype(np.float64)

    kinds = {}
    for name, dtype, np_type in [
        ("f32", types_pb2.DT_FLOAT, np.float32),
        ("f64", types_pb2.DT_DOUBLE, np.float64),
        ("f16", types_pb2.DT_HALF, np.float16),
    ]:
        with np.errstate(over="ignore", under="ignore"):
            narrow = base.astype(np_type)
        kinds[name] = (dtype, [v.astype(np_type).tobytes() for v in narrow], narrow.astype(np.float64))
    kinds["bf16"] = (types_pb2.DT_BFLOAT16, *bfloat16(base))
    scalars = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
    )
    writer = EventFileWriter(str(tmp_path / "tb"))
    for step in range(len(base)):
        values = []
        for name, (dtype, content, _) in kinds.items():
            for shape, tag in (([], name), ([1], f"{name}_1")):
                tensor = tensor_pb2.TensorProto(
                    dtype=dtype,
                    tensor_shape=tensor_shape_pb2.TensorShapeProto(
                        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=n) for n in shape]
                    ),
                    tensor_content=content[step],
                )
                values.append(summary_pb2.Summary.Value(tag=tag, metadata=scalars, tensor=tensor))
        writer.add_event(
            event_pb2.Event(wall_time=1.7e9 + step, step=step, summary=summary_pb2.Summary(value=values))
        )
    writer.close()
    imported(tmp_path / "tb", tmp_path / "run")
    got = raw(tmp_path / "run")
    assert sorted(set(got["key"])) == sorted(t for name in kinds for t in (name, f"{name}_1"))
    for name, (_, _, want) in kinds.items():
        for tag in (name, f"{name}_1"):
            rows = got.filter(pl.col("key") == tag).sort("step")
            assert rows["step"].to_list() == list(range(len(base)))
            assert rows["timestamp"].to_list() == [1.7e9 + s for s in range(len(base))]
            assert same_bits(rows["value"].to_numpy(), want), tag


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_seeded_scalars_with_nan_inf_negative_zero_and_subnormals_come_back_bit_for_bit(tmp_path, seed):
    rng = np.random.default_rng(seed)
    specials = np.array(
        [np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-45, -1e-40, np.finfo(np.float32).max], np.float32
    )
    n = int(rng.integers(50, 300))
    values = rng.normal(scale=10.0 ** rng.integers(-30, 30, n), size=n).astype(np.float32)
    values[rng.integers(0, n, 20)] = rng.choice(specials, 20)
    steps = np.sort(rng.choice(np.arange(-5, 10**6), n, replace=False))  # steps as written, any int
    tensorboardx_run(tmp_path / "tb", {"x": [(int(s), float(v)) for s, v in zip(steps, values, strict=True)]})
    imported(tmp_path / "tb", tmp_path / "run")
    got = raw(tmp_path / "run")
    assert got["step"].to_list() == steps.tolist()
    assert same_bits(got["value"].to_numpy(), values.astype(np.float64))


def test_importing_twice_adds_nothing_and_another_run_is_refused(tmp_path):
    tensorboardx_run(tmp_path / "tb", {"loss": [(0, 1.0), (1, 0.5)]})
    imported(tmp_path / "tb", tmp_path / "run")
    before = sorted(
        (p.relative_to(tmp_path / "run"), p.stat().st_mtime_ns) for p in (tmp_path / "run").rglob("*")
    )
    _, err = imported(tmp_path / "tb", tmp_path / "run")
    assert "holds this import already" in err and "nothing added" in err
    after = sorted(
        (p.relative_to(tmp_path / "run"), p.stat().st_mtime_ns) for p in (tmp_path / "run").rglob("*")
    )
    assert after == before
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    tensorboardx_run(tmp_path / "other", {"loss": [(0, 2.0)]})
    refused = invoke("import", tmp_path / "other", tmp_path / "run")
    assert refused.exit_code == 1
    assert refused.stderr.strip() == (
        f"Error: {tmp_path / 'run'} holds another run (its run.json names another source): import into a new "
        "directory, or remove that one first"
    )
    shutil.copytree(tmp_path / "tb", tmp_path / "copy" / "tb")  # the same files elsewhere: the same run
    imported(tmp_path / "copy" / "tb", tmp_path / "copy_run")
    assert json.loads((tmp_path / "copy_run" / "run.json").read_text())["run_id"] == meta["run_id"]
    # ... and one run to a later upload: the second finds the first's run and writes nothing
    first = invoke("upload", tmp_path / "run", "--to", "tensorboard", "--logdir", tmp_path / "logdir")
    second = invoke("upload", tmp_path / "copy_run", "--to", "tensorboard", "--logdir", tmp_path / "logdir")
    assert first.exit_code == second.exit_code == 0, second.output
    assert "wrote to TensorBoard" in first.output
    assert f"copy_run: already written to {tmp_path / 'logdir'}" in second.output


KILLED_IMPORT = """
import os, signal, sys
from metric_core.offline.importers import run, write
if sys.argv[3] == "before_run_json":  # every record written, run.json not yet
    run.write_run_json = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
else:  # the first stream written, the second begun
    made = write.StreamWriter.__init__
    def second_kills(self, *a, **k):
        made(self, *a, **k)
        if getattr(run, "streams_begun", 0):
            os.kill(os.getpid(), signal.SIGKILL)
        run.streams_begun = 1
    write.StreamWriter.__init__ = second_kills
run.import_source(sys.argv[1], sys.argv[2])
"""


@pytest.mark.parametrize("moment", ["before_run_json", "between_streams"])
def test_an_import_killed_before_its_end_is_redone_by_itself_and_refused_by_another(tmp_path, moment):
    values = {"loss": [(s, 1.0 / (s + 1)) for s in range(5)], "lr": [(s, 0.1 * s) for s in range(5)]}
    tensorboardx_run(tmp_path / "tb" / "a", values)
    tensorboardx_run(tmp_path / "tb" / "b", {"loss": [(s, 2.0 + s) for s in range(3)]})
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_IMPORT, tmp_path / "tb", tmp_path / "run", moment], cwd=ROOT
    )
    assert killed.returncode == -signal.SIGKILL
    assert not (tmp_path / "run" / "run.json").exists() and list((tmp_path / "run").glob("*.*"))
    partial = invoke("keys", tmp_path / "run")
    assert partial.exit_code == 0
    assert "an import into this directory stopped before its end" in partial.stderr
    tensorboardx_run(tmp_path / "other", {"loss": [(0, 2.0)]})
    refused = invoke("import", tmp_path / "other", tmp_path / "run")
    assert refused.exit_code == 1
    assert "an import of another source, stopped before its end; import into a new" in refused.stderr
    _, err = imported(tmp_path / "tb", tmp_path / "run")
    assert "an import of this source was stopped before its end" in err and "imported again" in err
    got = raw(tmp_path / "run")
    want = [
        (process, key, step, float(np.float32(value)))
        for process, series in (("a", values), ("b", {"loss": [(s, 2.0 + s) for s in range(3)]}))
        for key, points in series.items()
        for step, value in points
    ]
    assert sorted(zip(got["process"], got["key"], got["step"], got["value"], strict=True)) == sorted(want)
    assert not (tmp_path / "run" / ".metriclog-import").exists()
    _, again = imported(tmp_path / "tb", tmp_path / "run")
    assert "holds this import already" in again


GATED_IMPORT = """
import sys, time
from pathlib import Path
from metric_core.offline.importers import run
write = run.write_run_json
def gated(*a, **k):  # every record written; run.json waits for the gate
    Path(sys.argv[3] + ".waiting").touch()
    while not Path(sys.argv[3]).exists():
        time.sleep(0.01)
    write(*a, **k)
run.write_run_json = gated
run.import_source(sys.argv[1], sys.argv[2])
"""


def test_a_second_import_into_a_directory_being_imported_is_refused_and_removes_nothing(tmp_path):
    values = {"loss": [(s, 1.0 / (s + 1)) for s in range(5)]}
    tensorboardx_run(tmp_path / "tb" / "a", values)
    gate = tmp_path / "gate"
    first = subprocess.Popen(
        [sys.executable, "-c", GATED_IMPORT, tmp_path / "tb", tmp_path / "run", gate], cwd=ROOT
    )
    try:
        wait_for(
            lambda: Path(f"{gate}.waiting").exists() or first.poll() is not None, "the first import's records"
        )
        assert first.poll() is None
        second = invoke("import", tmp_path / "tb", tmp_path / "run")
        assert second.exit_code == 1
        said = second.stderr.strip()
        assert said.startswith(f"Error: another `metriclog import` into {tmp_path / 'run'} is running (pid ")
        assert said.endswith("): wait for it to end, or import into another directory")
    finally:
        gate.touch()
        assert first.wait(timeout=120) == 0
    got = raw(tmp_path / "run")
    want = [("a", "loss", step, float(np.float32(v))) for step, v in values["loss"]]
    assert sorted(zip(got["process"], got["key"], got["step"], got["value"], strict=True)) == want
    assert not list((tmp_path / "run").glob(".metriclog-import*"))


def test_an_import_refused_as_its_source_is_opened_leaves_no_directory(tmp_path):
    (tmp_path / "empty.csv").write_text("step,loss\n")
    refused = invoke("import", tmp_path / "empty.csv", tmp_path / "run")
    assert refused.exit_code == 1 and f"Error: {tmp_path / 'empty.csv'}: no numeric column" in refused.stderr
    assert not (tmp_path / "run").exists()


def test_a_flipped_byte_is_named_with_its_file_and_offset_and_a_torn_end_is_said(tmp_path):
    tensorboardx_run(tmp_path / "tb", {"loss": [(s, float(s)) for s in range(10)]})
    (event,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    data = bytearray(event.read_bytes())
    offsets, pos = [], 0
    while pos < len(data):  # the records' offsets, from their length fields
        offsets.append(pos)
        pos += 12 + int.from_bytes(data[pos : pos + 8], "little") + 4
    flipped = offsets[4]  # the file version is record 0: record 4 holds step 3
    data[flipped + 20] ^= 0x40
    event.write_bytes(bytes(data[:-3]))  # and the last record cut short
    _, err = imported(tmp_path / "tb", tmp_path / "run")
    assert f"warning: {event}: the record at byte {flipped:,} (" in err.replace("\n", " ")
    assert "fails its data checksum (CRC-32C): it is damaged and skipped" in err.replace("\n", " ")
    assert f"the last record, at byte {offsets[-1]:,}, is cut short" in err.replace("\n", " ")
    got = raw(tmp_path / "run")
    assert got["step"].to_list() == [0, 1, 2, 4, 5, 6, 7, 8]
    assert got["value"].to_list() == [0.0, 1.0, 2.0, 4.0, 5.0, 6.0, 7.0, 8.0]


def test_a_path_of_no_known_kind_is_refused_with_what_is_imported(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    result = invoke("import", tmp_path / "notes.txt", tmp_path / "run")
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: {tmp_path / 'notes.txt'}: not a source metriclog imports")
    assert not (tmp_path / "run").exists()


def test_a_wandb_offline_run_imports_its_history_steps_times_and_config(tmp_path, wandb_offline):
    import wandb

    rng = np.random.default_rng(5)
    loss, acc = rng.normal(size=30), rng.uniform(size=30)
    run = wandb.init(
        project="p", dir=str(tmp_path), mode="offline", config={"lr": 3e-4, "layers": 4}, name="exp-w"
    )
    for step in range(30):
        row = {"loss": float(loss[step]), "count": step * 7, "flag": step % 2 == 0}
        if step % 10 == 0:
            row["acc"] = float(acc[step])
        run.log(row, step=step)
    run.finish()
    wandb.teardown()  # the run file written whole (see the damaged run's test)
    (folder,) = (tmp_path / "wandb").glob("offline-run-*")
    _, err = imported(folder, tmp_path / "run")
    assert "imported the wandb run 'exp-w'" in err, err
    got = reduce_run(tmp_path / "run")

    def series(key):
        rows = got.filter(pl.col("key") == key).sort("step")
        return rows["step"].to_list(), rows["value"].to_numpy()

    assert series("loss")[0] == list(range(30)) and same_bits(series("loss")[1], loss)
    assert series("acc")[0] == [0, 10, 20] and same_bits(series("acc")[1], acc[[0, 10, 20]])
    assert series("count")[1].tolist() == [s * 7.0 for s in range(30)]
    assert series("flag")[1].tolist() == [float(s % 2 == 0) for s in range(30)]
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["name"] == "exp-w" and meta["config"] == {"lr": 3e-4, "layers": 4}
    assert set(raw(tmp_path / "run")["process"]) == {"exp-w"}


def test_a_damaged_wandb_run_file_names_the_chunk_and_a_torn_end_is_said(tmp_path, wandb_offline):
    import wandb

    run = wandb.init(project="p", dir=str(tmp_path), mode="offline", name="w")
    for step in range(2000):  # a run file of several 32 KiB blocks
        run.log({"loss": step * 0.5, "other": -float(step)}, step=step)
    run.finish()
    wandb.teardown()  # its service process has written the run file whole (finish alone may not wait)
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    data = bytearray(run_file.read_bytes())
    assert len(data) > 3 * 32768
    # the second block starts with a chunk (u32 checksum, u16 length, u8 type, payload): flip
    # the first byte of the first payload there (a chunk may be as short as one byte)
    chunk = 32768
    while int.from_bytes(data[chunk + 4 : chunk + 6], "little") == 0:
        chunk += 7
    data[chunk + 7] ^= 0x01
    # cut into the last record: past any zeros wandb left after it (cutting only those loses nothing)
    run_file.write_bytes(bytes(data).rstrip(b"\0")[:-5])
    _, err = imported(run_file, tmp_path / "run")
    said = err.replace("\n", " ")
    assert f"{run_file}: the chunk at byte {chunk:,} fails its checksum: the rest of its block" in said, err
    assert f"{run_file}: the last record, at byte" in said and "is cut short" in said
    loss = raw(tmp_path / "run").filter(pl.col("key") == "loss")
    steps = loss["step"].to_list()
    assert 0 < len(steps) < 2000 and steps == sorted(steps)
    assert loss["value"].to_list() == [s * 0.5 for s in steps]  # what was read is exact, nothing made up


@pytest.mark.parametrize("suffix", ["csv", "jsonl", "parquet"])
def test_exports_in_wide_and_long_form_import_their_columns(tmp_path, suffix):
    rng = np.random.default_rng(6)
    wide = pl.DataFrame(
        {"iteration": np.arange(0, 40, 2), "t": 1.7e9 + np.arange(20.0), "loss": rng.normal(size=20),
         "lr": np.full(20, 1e-3)}
    )  # fmt: skip
    long = wide.unpivot(["loss", "lr"], index=["iteration", "t"], variable_name="metric", value_name="v")

    def write(frame, path):
        {"csv": frame.write_csv, "jsonl": frame.write_ndjson, "parquet": frame.write_parquet}[suffix](path)

    write(wide, tmp_path / f"wide.{suffix}")
    write(long, tmp_path / f"long.{suffix}")
    imported(tmp_path / f"wide.{suffix}", tmp_path / "w", "--step-col", "iteration", "--time-col", "t")
    imported(
        tmp_path / f"long.{suffix}", tmp_path / "l", "--step-col", "iteration", "--time-col", "t",
        "--key-col", "metric", "--value-col", "v", "--reduce", "max",
    )  # fmt: skip
    reductions = {r: set(reduce_run(tmp_path / r, mode="per_rank_no_reduce")["reduction"]) for r in "wl"}
    assert reductions == {"w": {"mean"}, "l": {"max"}}  # --reduce: what every record carries
    for run in ("w", "l"):
        got = raw(tmp_path / run)
        for key in ("loss", "lr"):
            rows = got.filter(pl.col("key") == key)
            assert rows["step"].to_list() == wide["iteration"].to_list()
            assert rows["timestamp"].to_list() == wide["t"].to_list()
            assert same_bits(rows["value"].to_numpy(), wide[key].to_numpy()), (run, key)


def test_what_an_export_cannot_carry_is_counted_and_said_never_rounded(tmp_path):
    big = 2**53 + 1
    (tmp_path / "m.csv").write_text(f"step,loss,note,count\n0,1.0,a,{big}\n1,,b,7\n")
    _, err = imported(tmp_path / "m.csv", tmp_path / "run")
    assert "warning: not imported: 2 values of columns that are no numbers (note)" in err
    assert "warning: not imported: 1 integers past 2**53 (float64 cannot hold them exactly)" in err
    assert "warning: not imported: 1 empty cells" in err
    got = raw(tmp_path / "run")
    assert got.select("step", "key", "value").rows() == [(1, "count", 7.0), (0, "loss", 1.0)]


def test_a_column_of_numbers_keeps_them_past_a_nan_spelled_as_text_or_a_cell_of_text(tmp_path):
    """A new user's trial: metriclog's own ``reduce --wide --out x.jsonl`` writes NaN as
    "NaN", which made the whole column text, and every value of it was left out; so did
    one cell of text in a CSV column of numbers. Now the numbers are kept, the spellings
    of NaN and the infinities read, and only the cells of other text counted and left out."""
    import json
    import math

    rows = [
        {"step": 0, "loss": 1.5, "acc": 0.125},
        {"step": 1, "loss": "NaN", "acc": -0.0},
        {"step": 2, "loss": 2.5, "acc": "Infinity"},
        {"step": 3, "loss": "-Infinity", "acc": "n/a"},
    ]
    (tmp_path / "w.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "c.csv").write_text(
        "step,loss,acc\n" + "".join(f"{r['step']},{r['loss']},{r['acc']}\n" for r in rows)
    )
    for name in ("w.jsonl", "c.csv"):
        _, err = imported(tmp_path / name, tmp_path / name.replace(".", "_"))
        assert "warning: not imported: 1 cells of text that are no numbers, in columns of numbers" in err
        assert "columns that are no numbers" not in err and "empty cells" not in err, err
        got = raw(tmp_path / name.replace(".", "_")).sort("key", "step")
        want = sorted((k, r["step"], float(r[k])) for r in rows for k in ("loss", "acc") if r[k] != "n/a")
        assert [(k, s) for s, k, *_ in got.rows()] == [(k, s) for k, s, _ in want], name
        assert same_bits(got["value"].to_numpy(), np.array([v for *_, v in want])), name
        assert math.copysign(1, got.filter(pl.col("step") == 1, pl.col("key") == "acc")["value"][0]) == -1


def test_columns_named_key_or_value_import_and_a_file_of_records_is_told_to_use_the_long_form(tmp_path):
    """A new user's trial: a wide file with a column named ``key`` (or ``value``) failed as
    "not readable: duplicate column name 'key'", blaming the file; a file of metriclog's
    records (``reduce --out``) too, and in long form its other columns went unsaid."""
    (tmp_path / "k.csv").write_text("step,key,value,loss\n0,1,2.5,0.5\n1,3,4.5,0.25\n")
    _, err = imported(tmp_path / "k.csv", tmp_path / "k")
    got = sorted(raw(tmp_path / "k").select("key", "step", "value").rows())
    assert got == sorted(
        [
            ("key", 0, 1.0),
            ("key", 1, 3.0),
            ("value", 0, 2.5),
            ("value", 1, 4.5),
            ("loss", 0, 0.5),
            ("loss", 1, 0.25),
        ]
    )
    records = tmp_path / "records.parquet"
    pl.DataFrame(
        {"process": ["a", "b"], "rank": [0, 1], "step": [0, 0], "timestamp": [1.7e9, 1.7e9],
         "key": ["loss", "loss"], "value": [1.0, 2.0], "reduction": ["mean", "mean"]}
    ).write_parquet(records)  # fmt: skip
    refused = invoke("import", records, tmp_path / "r")
    assert refused.exit_code == 1 and "Traceback" not in refused.output
    advice = "--key-col key --value-col value --time-col timestamp"
    assert "holds metriclog's record columns" in refused.stderr and advice in refused.stderr
    assert "duplicate column" not in refused.stderr and not (tmp_path / "r").exists()
    _, err = imported(records, tmp_path / "long", *advice.split())  # as it advised: the times kept
    assert "not imported: 6 values of other columns (process, rank, reduction)" in err, err
    got = raw(tmp_path / "long")
    assert got["value"].to_list() == [1.0, 2.0] and got["timestamp"].to_list() == [1.7e9, 1.7e9]


def test_a_column_of_labels_with_a_number_here_and_there_stays_text(tmp_path):
    """The review of stop 61: one cell that reads as a number ("7", "nan", "1e5") made a
    column of labels a metric; a column is numbers when most of its cells are."""
    (tmp_path / "l.csv").write_text("step,loss,note\n0,0.5,ok\n1,0.25,fine\n2,0.125,7\n3,1,nan\n")
    _, err = imported(tmp_path / "l.csv", tmp_path / "l")
    assert "warning: not imported: 4 values of columns that are no numbers (note)" in err, err
    assert "cells of text" not in err
    assert set(raw(tmp_path / "l")["key"].to_list()) == {"loss"}


def test_json_lines_with_nan_and_infinity_bare_as_python_writes_them_import(tmp_path, monkeypatch):
    """Python's ``json.dumps`` writes NaN and the infinities bare, which polars' parser
    refuses ("TapeError at character 20"): such a file is read from a copy in a scratch
    folder, removed after; a line that is no JSON is refused, naming its line."""
    import json
    import math

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    values = [0.5, math.nan, math.inf, -math.inf, -0.0, 1e-310]
    (tmp_path / "w.jsonl").write_text(
        "".join(json.dumps({"step": i, "loss": v}) + "\n" for i, v in enumerate(values))
    )
    _, err = imported(tmp_path / "w.jsonl", tmp_path / "w")
    assert "not imported" not in err, err
    got = raw(tmp_path / "w")
    assert got["step"].to_list() == list(range(len(values)))
    assert same_bits(got["value"].to_numpy(), np.array(values))
    assert list(scratch.iterdir()) == []  # the copy is gone
    (tmp_path / "bad.jsonl").write_text('{"step": 0, "loss": NaN}\n{"step": 1, "loss":\n')
    refused = invoke("import", tmp_path / "bad.jsonl", tmp_path / "bad")
    assert refused.exit_code == 1 and "Traceback" not in refused.output
    assert "bad.jsonl: line 2, column 20 is not JSON (Expecting value)" in refused.stderr, refused.stderr
    assert list(scratch.iterdir()) == [] and not (tmp_path / "bad").exists()


def test_integer_columns_of_every_width_import_and_only_those_past_2_53_are_refused(tmp_path):
    """An int32 or uint8 column (a narrow type: its abs() overflowed, a traceback) imports
    as its values; of 64-bit ones, exactly those beyond 2**53 either way are refused."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {
        "epoch": pa.array([1, -(2**31), 3], pa.int32()),
        "u8": pa.array([1, 2, 255], pa.uint8()),
        "i64": pa.array([2**53, -(2**53) - 1, -(2**63)], pa.int64()),
        "u64": pa.array([2**53, 2**53 + 1, 2**64 - 1], pa.uint64()),
    }
    pq.write_table(pa.table({"step": pa.array([0, 1, 2], pa.int64()), **columns}), tmp_path / "n.parquet")
    _, err = imported(tmp_path / "n.parquet", tmp_path / "run")
    assert "warning: not imported: 4 integers past 2**53 (float64 cannot hold them exactly)" in err
    got = {(s, k): v for s, k, v in raw(tmp_path / "run").select("step", "key", "value").rows()}
    want = {
        (step, key): float(v)
        for key, array in columns.items()
        for step, v in enumerate(array.to_pylist())
        if abs(v) <= 2**53
    }
    assert got == want


@pytest.mark.parametrize("suffix", ["csv", "jsonl", "parquet"])
def test_an_export_of_many_batches_imports_every_row_and_counts_across_them(tmp_path, monkeypatch, suffix):
    """The file is read a batch at a time (here 97 rows, so 2,000 rows are many batches):
    every value comes back, in order, and what is left out is counted over all batches."""
    from metric_core.offline.importers import tables

    monkeypatch.setattr(tables, "BATCH_ROWS", 97)
    batches = []
    one_batch = tables.TableImporter._long
    monkeypatch.setattr(
        tables.TableImporter, "_long", lambda self, f: batches.append(f.height) or one_batch(self, f)
    )
    rng = np.random.default_rng(7)
    n = 2_000
    loss = rng.normal(size=n)
    loss[rng.choice(n, 50, replace=False)] = np.nan  # NaN stays NaN; a null is an empty cell
    empty = np.zeros(n, bool)
    empty[rng.choice(n, 30, replace=False)] = True
    frame = pl.DataFrame(
        {"step": np.arange(n) * 3, "t": 1.7e9 + np.arange(n) / 8, "count": np.arange(n, dtype=np.int64),
         "loss": pl.Series(loss).set(pl.Series(empty), None) if suffix != "jsonl" else loss,
         "note": [f"n{i}" for i in range(n)]}
    )  # fmt: skip
    if suffix == "jsonl":  # JSON has no NaN: nulls only
        frame = frame.with_columns(
            pl.when(pl.Series(empty)).then(None).otherwise(pl.col("loss")).alias("loss")
        )
        frame = frame.with_columns(pl.col("loss").fill_nan(0.0))
    path = tmp_path / f"m.{suffix}"
    {"csv": frame.write_csv, "jsonl": frame.write_ndjson, "parquet": frame.write_parquet}[suffix](path)
    _, err = imported(path, tmp_path / "run", "--time-col", "t")
    assert len(batches) >= n // 97 and sum(batches) == n
    assert f"warning: not imported: {n:,} values of columns that are no numbers (note)" in err
    assert "warning: not imported: 30 empty cells" in err
    got = raw(tmp_path / "run")
    want = frame["loss"].to_numpy()
    for key, values, kept in (
        ("count", np.arange(n, dtype=np.float64), np.ones(n, bool)),
        ("loss", want, ~empty),
    ):
        rows = got.filter(pl.col("key") == key)
        assert rows["step"].to_list() == (np.arange(n) * 3)[kept].tolist(), key
        assert rows["timestamp"].to_list() == (1.7e9 + np.arange(n) / 8)[kept].tolist(), key
        assert same_bits(rows["value"].to_numpy(), values[kept]), key


def test_a_step_no_integer_far_into_an_export_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    from metric_core.offline.importers import tables

    monkeypatch.setattr(tables, "BATCH_ROWS", 10)
    lines = [f"{i},{i * 0.5}" for i in range(500)]
    lines[437] = "437.5,1.0"
    (tmp_path / "m.csv").write_text("step,loss\n" + "\n".join(lines) + "\n")
    result = invoke("import", tmp_path / "m.csv", tmp_path / "run")
    assert result.exit_code == 1
    assert "row 438: the step column 'step' holds 437.5, not an integer" in result.stderr
    assert not (tmp_path / "run").exists()


def test_an_export_whose_step_column_is_no_integer_is_refused_with_its_row(tmp_path):
    (tmp_path / "m.csv").write_text("step,loss\n0,1.0\n1.5,2.0\n")
    result = invoke("import", tmp_path / "m.csv", tmp_path / "run")
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        f"Error: {tmp_path / 'm.csv'}: row 2: the step column 'step' holds 1.5, not an integer: name the "
        "step column with --step-col"
    )


def test_an_mlflow_run_imports_every_value_and_infinities_come_back_as_dbl_max(tmp_path):
    mlflow = pytest.importorskip("mlflow")
    from mlflow.entities import Metric, Param

    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("exp-m", artifact_location=str(tmp_path / "artifacts"))
    run = client.create_run(experiment, run_name="trainer")
    rng = np.random.default_rng(7)
    loss = rng.normal(size=40)
    loss[5], loss[6] = np.inf, -np.inf
    client.log_batch(
        run.info.run_id,
        metrics=[Metric("loss", float(v), 1_700_000_000_000 + s, s) for s, v in enumerate(loss)],
        params=[Param("lr", "0.001")],
    )
    imported("mlflow", tmp_path / "run", "--tracking-uri", uri, "--experiment", "exp-m")
    got = raw(tmp_path / "run")
    want = np.clip(loss, -DBL_MAX, DBL_MAX)  # MLflow's SQL store keeps +-inf as +-DBL_MAX
    assert got["step"].to_list() == list(range(40))
    assert same_bits(got["value"].to_numpy(), want)
    assert got["timestamp"].to_list() == [(1_700_000_000_000 + s) / 1000 for s in range(40)]
    assert set(got["process"]) == {"trainer"}
    by_id = tmp_path / "by_id"
    imported("mlflow", by_id, "--tracking-uri", uri, "--run-id", run.info.run_id)
    assert json.loads((by_id / "run.json").read_text())["config"] == {"lr": "0.001"}


def test_upload_to_tensorboard_then_import_gives_back_reduce_as_float32(tmp_path):
    run = tmp_path / "rl_run"
    shutil.copytree(SAMPLE, run)
    result = invoke("upload", run, "--to", "tensorboard", "--logdir", tmp_path / "tb")
    assert result.exit_code == 0, result.output
    imported(tmp_path / "tb", tmp_path / "back")
    want = reduce_run(run).sort("key", "step")
    got = reduce_run(tmp_path / "back").sort("key", "step")
    assert got.select("key", "step").rows() == want.select("key", "step").rows()
    narrowed = want["value"].to_numpy().astype(np.float32).astype(np.float64)
    assert same_bits(got["value"].to_numpy(), narrowed)
