"""What ``metriclog diff`` prints: a row per key that differs, then the verdict."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .output import echo_prose, print_rows

if TYPE_CHECKING:
    from metric_core.offline.diff import DiffReport

# What a narrow terminal loses first of the table (then columns from the right).
DIFF_DROPPED_FIRST = ("largest_b", "largest_a", "differing", "only_in_b", "only_in_a")


def print_diff(report: DiffReport) -> None:
    """The keys that differ (values printed whole: the last digit and the sign of a zero
    count), the keys only one run has, and whether the runs are equal."""
    at = report.bucket
    rows = []
    for d in report.differences:
        rows.append(
            {
                "key": d.key,
                **({"process": d.process} if d.process is not None else {}),
                f"first {at}": _said(d.first),
                "a": _said(d.first_a),
                "b": _said(d.first_b),
                "largest": _said(d.largest),
                f"at {at}": _said(d.largest_at),
                "largest_a": _said(d.largest_a),
                "largest_b": _said(d.largest_b),
                "differing": d.differing,
                "only_in_a": _steps(d.only_in_a),
                "only_in_b": _steps(d.only_in_b),
                **({"reductions": " vs ".join(d.reductions)} if d.reductions else {}),
            }
        )
    echo_prose(f"a: {report.run_a}\nb: {report.run_b}")
    if rows:
        print_rows(rows, max_rows=1000, drop_first=DIFF_DROPPED_FIRST, keep=("key",), whole="--format json")
    for side, keys in (("a", report.keys_only_in_a), ("b", report.keys_only_in_b)):
        if keys:
            echo_prose(f"keys only in {side}: {', '.join(keys)}")
    how = (
        "bit for bit (NaN equals NaN; -0.0 differs from 0.0)"
        if report.rtol is None
        else f"within --rtol {report.rtol:g} --atol {report.atol:g}"
    )
    if report.equal:
        echo_prose(f"equal, {how}: {report.keys_compared} key(s)")
    else:
        differing = len({d.key for d in report.differences})
        echo_prose(f"the runs differ, {how}: {differing} of the {report.keys_compared} key(s) both hold")


def _said(value: Any) -> str:
    """A value as Python writes it back: every digit, and the sign of a zero."""
    return "" if value is None else repr(value)


def _steps(steps: list[Any]) -> str:
    if not steps:
        return ""
    return f"{len(steps)} ({_said(steps[0])}..{_said(steps[-1])})" if len(steps) > 1 else _said(steps[0])
