"""Exact or refused (docs/format.md): an integer float64 would round never passes for another.

The writer refuses an integer value past 2**53 in magnitude, whatever its type, with a
``ValueError`` naming the key; what it accepts reads back as the integer recorded (compared
as Python ints, which hold them exactly). Every reader refuses a step or rank outside
int64, naming the file and its line, where it used to clamp it to int64's end.
"""

from __future__ import annotations

import asyncio
import decimal
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from metriclog.main import app
from typer.testing import CliRunner

import metric_core
from metric_core import MetricCollector, scan_run

runner = CliRunner()
EDGE = 2**53


class TensorLike:
    """What the writer sees of a 0-d torch tensor: ``item()`` gives the Python number."""

    def __init__(self, value):
        self.value = value

    def item(self):
        return self.value

    def __float__(self):  # a tensor converts to float: the array would round it
        return float(self.value)


PAST = [
    EDGE + 1,
    -(EDGE + 1),
    2**63 - 1,
    -(2**63),
    2**64,
    np.int64(EDGE + 1),
    np.int64(-(2**63)),
    np.uint64(2**64 - 1),
    np.array(2**60 + 1, dtype=np.int64),
    np.array(2**63 + 5, dtype=np.uint64),
    TensorLike(EDGE + 1),
]
KEPT = [EDGE, -EDGE, EDGE - 1, np.int64(EDGE), np.uint64(EDGE), np.int32(-(2**31)), True, 7, np.array(EDGE)]


def _read_back(run: Path) -> list[tuple[str, float]]:
    frame = scan_run(run).frame.collect().sort("timestamp")
    return list(zip(frame["key"].to_list(), frame["value"].to_list(), strict=True))


@pytest.mark.parametrize(
    "value",
    PAST,
    ids=[
        f"{type(v).__name__}:{int(np.asarray(v).item()) if not isinstance(v, TensorLike) else v.value}"
        for v in PAST
    ],
)
def test_record_metric_refuses_an_integer_past_2_53_naming_key_and_value(tmp_path, value):
    metric_core.init(tmp_path, rank=0, process_name="trainer")
    as_int = int(value.value if isinstance(value, TensorLike) else np.asarray(value).item())
    with pytest.raises(ValueError) as raised:
        metric_core.record_metric("tokens/total", value, metric_core.Reduce.SUM)
    said = str(raised.value)
    assert "'tokens/total'" in said and str(as_int) in said and "float(value)" in said
    metric_core.record_metric("tokens/total", 1, metric_core.Reduce.SUM)
    metric_core.flush(0)
    metric_core.shutdown()
    assert _read_back(tmp_path) == [("tokens/total", 1.0)]  # the refused value left no record


def test_integers_float64_holds_are_kept_and_read_back_exactly(tmp_path):
    metric_core.init(tmp_path, rank=0, process_name="trainer")
    for i, value in enumerate(KEPT):
        metric_core.record_metric(f"k{i}", value, metric_core.Reduce.SUM)
    metric_core.flush(0)
    metric_core.shutdown()
    got = dict(_read_back(tmp_path))
    for i, value in enumerate(KEPT):
        exact = int(np.asarray(value).item())
        assert got[f"k{i}"] == exact and int(got[f"k{i}"]) == exact  # as Python ints: no rounding


def test_the_collector_and_push_refuse_it_too(tmp_path):
    c = MetricCollector(tmp_path, rank=0, process_name="trainer")
    with pytest.raises(ValueError, match="metric 'steps_seen': the integer 9007199254740993 is past 2"):
        c.record("steps_seen", EDGE + 1)
    with pytest.raises(ValueError, match="metric 'ids': the integer 18446744073709551615"):
        c.push(metric_core.Metric("ids", np.uint64(2**64 - 1), metric_core.Reduce.MAX))
    c.record("steps_seen", EDGE)
    c.flush(0)
    c.shutdown()
    assert _read_back(tmp_path) == [("steps_seen", float(EDGE))]


def test_torchforge_record_metric_refuses_it(tmp_path, monkeypatch):
    from metric_core import torchforge

    monkeypatch.setenv("METRICLOG_DIR", str(tmp_path))
    mlogger = torchforge.MetricCollector()
    asyncio.run(mlogger.init_backends(None, {}, process_name="trainer"))
    try:
        with pytest.raises(ValueError, match="metric 'tokens': the integer 9223372036854775807 is past 2"):
            torchforge.record_metric("tokens", 2**63 - 1, torchforge.Reduce.SUM)
        torchforge.record_metric("tokens", np.int64(EDGE - 3), torchforge.Reduce.SUM)
        asyncio.run(mlogger.flush(0))
    finally:
        asyncio.run(mlogger.shutdown())
    assert _read_back(tmp_path) == [("tokens", float(EDGE - 3))]


def test_other_numbers_still_go_as_before(tmp_path):
    """Only integers are checked: floats, numpy floats, Decimal take float64 as they always did."""
    metric_core.init(tmp_path, rank=0, process_name="trainer")
    given = [1e300, np.float32(0.1), np.float64(2.0**60), decimal.Decimal("0.5"), np.bool_(True)]
    for i, value in enumerate(given):
        metric_core.record_metric(f"k{i}", value)
    with pytest.raises(TypeError, match="metric 'bad': value 'x' of type str is not a number"):
        metric_core.record_metric("bad", "x")
    metric_core.flush(0)
    metric_core.shutdown()
    got = dict(_read_back(tmp_path))
    assert [got[f"k{i}"] for i in range(len(given))] == [1e300, float(np.float32(0.1)), 2.0**60, 0.5, 1.0]


# -- readers: a step (or rank) outside int64 is refused, in every format --------------------

OUT_OF_INT64 = [-(2**63) - 1, 2**63, 2**64 + 7, -(10**30)]


def _record(step, **over) -> dict:
    return {
        "key": "loss",
        "value": 1.0,
        "reduction": "mean",
        "step": step,
        "timestamp": 1.7e9,
        "rank": 0,
        **over,
    }


def _lines(path: Path, records: list) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))


def _steps(run: Path) -> list[int]:
    return sorted(scan_run(run).frame.collect()["step"].to_list())


@pytest.mark.parametrize("step", OUT_OF_INT64)
def test_a_jsonl_step_outside_int64_is_refused_with_its_line(tmp_path, step):
    _lines(tmp_path / "a.jsonl", [_record(0), _record(step), _record(2**63 - 1), _record(-(2**63))])
    scan = scan_run(tmp_path)
    assert _steps(tmp_path) == [-(2**63), 0, 2**63 - 1]  # the ends of int64 are steps; past them, none
    assert "a.jsonl: 1 record(s) skipped: line 2: 'step' is outside int64" in scan.report.summary()


def test_a_step_outside_int64_as_text_a_float_or_in_the_slow_path_is_refused(tmp_path):
    """Spelled as a string, as a float token, and in a file only the line-by-line reader
    parses (a line that is no JSON beside them)."""
    _lines(
        tmp_path / "a.jsonl",
        [_record("-9223372036854775809"), _record(-9.3e18), _record(1e19), _record("5"), _record(6.0)],
    )
    _lines(tmp_path / "b.jsonl", ["{not json", _record(-(2**63) - 1), _record(7), _record(2**63, rank=2**63)])
    scan = scan_run(tmp_path)
    assert _steps(tmp_path) == [5, 6, 7]
    summary = scan.report.summary()
    assert "a.jsonl: 3 record(s) skipped: line 1: 'step' is outside int64" in summary
    assert "b.jsonl: 3 record(s) skipped: line 1: not valid JSON; line 2: 'step' is outside int64" in summary


@pytest.mark.parametrize(
    "column",
    [
        pa.array([0, 2**63, 2**64 - 1], pa.uint64()),
        pa.array(["0", "-9223372036854775809", "9223372036854775808"], pa.string()),
        pa.array([0.0, -(2.0**63), 1e19], pa.float64()),
        pa.array(
            [decimal.Decimal(0), decimal.Decimal(-(2**63) - 1), decimal.Decimal(2**63)], pa.decimal128(38, 0)
        ),
    ],
    ids=["uint64", "string", "float64", "decimal128"],
)
def test_a_parquet_step_outside_int64_is_refused(tmp_path, column):
    table = pa.table(
        {
            "key": ["loss"] * 3,
            "value": [1.0, 2.0, 3.0],
            "reduction": ["mean"] * 3,
            "step": column,
            "timestamp": [1.7e9] * 3,
            "rank": [0] * 3,
        }
    )
    pq.write_table(table, tmp_path / "other.parquet")
    scan = scan_run(tmp_path)
    assert scan.frame.collect()["value"].to_list() == [1.0]  # step 0 only
    told = "'step' is null or not an integer in int64's range"
    assert f"other.parquet: 2 record(s) skipped: row 1: {told}; row 2: {told}" in scan.report.summary()


def test_the_commands_say_it_and_go_on(tmp_path):
    _lines(tmp_path / "a.jsonl", [_record(0), _record(-(2**63) - 1)])
    for command in (["reduce", str(tmp_path)], ["keys", str(tmp_path)], ["inspect", str(tmp_path)]):
        result = runner.invoke(app, command)
        assert result.exit_code == 0, result.output
        assert "a.jsonl: 1 record(s) skipped: line 2: 'step' is outside int64" in result.output
        assert "Traceback" not in result.output
