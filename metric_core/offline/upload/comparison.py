"""``compare --to``: a comparison of runs (``compare.CompareResult``) sent to W&B, TensorBoard
or MLflow through the destination contract (``destination``), as runs of its own.

* One destination run per group of the comparison (one in all without ``--group-by``),
  named ``compare-<id>`` (``<id>``: the first 8 hex digits of the comparison's identity),
  and ``compare-<id>/<group_by>=<value>`` per group, so each group is a line of its own in
  every tracker. In W&B they share the group ``compare-<id>``; in TensorBoard each is a
  folder of ``logdir`` (``compare-<id>/config.lr=0.001``).
* A metric per key and statistic: ``<key>/<stat>`` (``per_rank_reduce``:
  ``<key>/<process>/<stat>``), at the comparison's step (``--by time``: its window's number,
  its offset in seconds as its time); a statistic with no value (``std_sample`` of one run)
  is left out of its row.
* Tagged with the runs it came from: W&B's config (``metriclog.compared_runs``: label, run
  id and directory of each) and tags (the labels); MLflow's tags
  (``metriclog.compared_runs``, ``metriclog.compared_labels``, ``metriclog.group_by``,
  ``metriclog.group``) and the config as params.
* Idempotent: the comparison's identity is a hash of the sorted source run ids (run.json's
  ``run_id``, else the run directory's absolute path), the plan, ``--group-by``,
  ``--across`` and ``--common``; each run's id adds the destination and the group. A second
  send of the same comparison finds its runs finished in the ledger (the user cache's,
  keyed by the identity; TensorBoard's beside its event files) and sends nothing.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from metric_core.offline.upload.destination import (
    Destination,
    RunOutcome,
    UploadEvents,
    find_entry,
    send_runs,
)
from metric_core.offline.upload.ledger import Ledger, only_upload
from metric_core.offline.upload.runs import (
    PlannedRuns,
    limit_warnings,
    run_config,
    run_id_for,
    safe_keys,
    wide_run,
)

if TYPE_CHECKING:
    from metric_core.offline.compare import CompareResult
    from metric_core.offline.upload import UploadResult

WANDB_TAG = 64  # W&B's longest tag


def send_comparison(
    result: CompareResult,
    to: Destination,
    *,
    dry_run: bool = False,
    force_new: bool = False,
    events: UploadEvents | None = None,
) -> UploadResult:
    """Send ``result`` to ``to`` as a run per group (module docstring); with ``dry_run``,
    only say what would go. A comparison sent before is skipped (``force_new``: sent again
    under fresh ids).

    >>> from metric_core.offline.compare import compare_runs
    >>> from metric_core.offline.upload import WandB
    >>> r = compare_runs(["sample_logs/rl_run"], keys=["trainer/loss"], across=["mean", "count"])
    >>> sent = send_comparison(r, WandB("demo"), dry_run=True)
    >>> [(run.name[:8], run.keys) for run in sent.plan.runs]
    [('compare-', ['trainer/loss/count', 'trainer/loss/mean'])]
    """
    from metric_core.offline.upload import UploadResult, report_planned

    events = events or UploadEvents()
    to.check(name=None, group=None)
    to, dry_run = to.ready(events, dry_run)
    identity = comparison_identity(result)
    groups = plan_comparison(result, identity, to.request(None, None, run_name=comparison_name(identity)))
    everything = PlannedRuns([run for planned in groups for run in planned.runs], identity=identity)
    everything.key_mapping = {k: v for planned in groups for k, v in planned.key_mapping.items()}
    everything.warnings = limit_warnings(everything.runs)
    report_planned(everything, events)
    if dry_run:
        ledger = to.ledger(None, identity, create=False)
        would = [(run, to.decide(run, find_entry(ledger, run, to), force_new)) for run in everything.runs]
        return UploadResult(
            everything, [RunOutcome(r, d.action, d.run_id, 0, d.message) for r, d in would], True
        )
    to.load_client()
    ledger = to.ledger(None, identity)
    assert ledger is not None
    request = json.dumps(to.request(None, None, run_name=""), sort_keys=True)
    with only_upload(
        ledger.path.parent, _digest(request + identity), f"the comparison {everything.runs[0].group}"
    ):
        ledger = Ledger(ledger.path)  # as the send that held the lock before left it
        sent = [send_runs(planned, ledger, to, force_new=force_new, events=events) for planned in groups]
    return UploadResult(everything, [outcome for outcomes in sent for outcome in outcomes])


def comparison_identity(result: CompareResult) -> str:
    """What makes two comparisons the same: the sorted source run ids, the plan, the grouping,
    the statistics and ``common``."""
    shape = {
        "runs": sorted(result.run_ids),
        "plan": result.plan.as_dict(),
        "group_by": result.group_column,
        "across": list(result.across),
        "common": result.common,
    }
    return _digest(json.dumps(shape, sort_keys=True, default=str))


def comparison_name(identity: str) -> str:
    return f"compare-{identity[:8]}"


def plan_comparison(result: CompareResult, identity: str, request: dict[str, Any]) -> list[PlannedRuns]:
    """A ``PlannedRuns`` of one run per group of ``result`` (its config and tags naming that
    group's runs), nothing sent."""
    import polars as pl

    from metric_core.offline.compare import bucket_column

    bucket = bucket_column(result.plan)
    key = _digest(json.dumps({**request, "comparison": identity}, sort_keys=True))
    base = comparison_name(identity)
    process = "process" in result.frame.columns
    long = pl.concat(
        [
            result.frame.select(
                (pl.col(result.group_column) if result.group_column else pl.lit(None)).alias("group"),
                bucket,
                (
                    pl.format("{}/{}/" + stat, "key", "process")
                    if process
                    else pl.format("{}/" + stat, "key")
                ).alias("key"),
                pl.col(stat).cast(pl.Float64).alias("value"),
            )
            for stat in result.across
        ],
        how="vertical_relaxed",
    ).drop_nulls("value")
    mapping = safe_keys(long["key"].unique().sort().to_list())
    long = long.with_columns(pl.col("key").replace_strict(mapping))
    out = []
    values = list(dict.fromkeys(g for _, _, g in result.runs))
    for value in values:
        part = long.filter(pl.col("group").is_null() if value is None else pl.col("group") == value)
        name = base if result.group_column is None else f"{base}/{result.group_column}={_said(value)}"
        run = wide_run(run_id_for(identity, key, _said(value)), name, base, None, part.drop("group"), bucket)
        runs = [
            (label, run_id, run_dir)
            for (label, run_dir, group), run_id in zip(result.runs, result.run_ids, strict=True)
            if group == value
        ]
        planned = PlannedRuns(
            [run], identity=identity, key_mapping={k: v for k, v in mapping.items() if k != v}
        )
        facts = {
            "compared_runs": [{"label": lb, "run_id": ri, "run_dir": rd} for lb, ri, rd in runs],
            "group_by": result.group_column,
            "group": value,
            "across": list(result.across),
            "common": result.common,
        }
        planned.config = run_config({}, result.plan, **facts)
        planned.meta = {
            "compared_runs": [ri for _, ri, _ in runs],
            "compared_labels": [lb for lb, _, _ in runs],
            **({"group_by": result.group_column, "group": _said(value)} if result.group_column else {}),
        }
        planned.tags = ["metriclog-compare", *(lb[:WANDB_TAG] for lb, _, _ in runs)]
        out.append(planned)
    return out


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _said(value: Any) -> str:
    return "missing" if value is None else str(value)
