"""``metriclog``: reduce, upload and diagnose the raw metric streams of a run.

Each command parses its options, makes one metric_core call and prints the result;
metric_core errors become one ``Error: ...`` line on stderr and exit code 1.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from metric_core.errors import MetricLogError

app = typer.Typer(
    name="metriclog",
    help="Reduce, upload and diagnose the raw metric streams that metric_core writes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

T = TypeVar("T")


@app.callback()
def _root() -> None:
    """Reduce, upload and diagnose the raw metric streams that metric_core writes."""


class Mode(str, Enum):
    global_reduce = "global_reduce"
    per_rank_reduce = "per_rank_reduce"
    per_rank_no_reduce = "per_rank_no_reduce"


class By(str, Enum):
    step = "step"
    time = "time"


RunDir = Annotated[
    Path,
    typer.Argument(
        metavar="RUN_DIR", help="Run directory holding *.parquet / *.jsonl files.", show_default=False
    ),
]
FollowOpt = Annotated[
    bool,
    typer.Option(
        "--follow-symlinks",
        help="Also read files and directories that symlinks in RUN_DIR lead to outside it.",
    ),
]
ModeOpt = Annotated[Mode, typer.Option("--mode", help="Logging mode to compute.")]
ByOpt = Annotated[By, typer.Option("--by", help="Group by training step or by wall-clock window.")]
EveryOpt = Annotated[
    str | None,
    typer.Option("--every", metavar="DURATION", help="Window length with --by time: 10s, 500ms, 5m, 1h."),
]
ReduceOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--reduce",
        metavar="PATTERN=STAT",
        help="PATTERN=STAT: reduce matching keys with STAT (mean, sum, max, min, std, "
        "count, median, pNN, first, last). Repeatable; the last match wins.",
    ),
]
KeyOpt = Annotated[
    list[str] | None,
    typer.Option("--key", metavar="PATTERN", help="Only keys matching this glob. Repeatable."),
]
RanksOpt = Annotated[
    str | None, typer.Option("--ranks", metavar="RANKS", help="Only these ranks, e.g. 0,2-5.")
]
StepsOpt = Annotated[
    str | None,
    typer.Option(
        "--steps", metavar="START:STOP", help="Only steps START:STOP (STOP excluded), e.g. 100:200."
    ),
]
StrictOpt = Annotated[bool, typer.Option("--strict", help="Exit 1 if any record or file had to be skipped.")]


def fail(message: str) -> typer.Exit:
    typer.echo(f"Error: {message}", err=True)
    return typer.Exit(code=1)


@contextmanager
def errors_to_exit() -> Iterator[None]:
    """Expected failures: one line on stderr and exit 1, never a traceback."""
    try:
        yield
    except MetricLogError as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(f"{exc.filename or ''}: {exc.strerror or exc}".lstrip(": ")) from None
    except Exception as exc:
        if not type(exc).__module__.startswith("polars"):
            raise
        # The reader checks every file before the query; this is a file that changed since.
        first = str(exc).splitlines()[0]
        raise fail(
            f"reading the run failed: {first}. Did a file change during the read? Run again."
        ) from None


def report_skips(scan: Any, strict: bool) -> None:
    summary = scan.report.summary()
    if summary:
        typer.echo(f"warning: {summary}", err=True)
        if strict:
            raise fail("--strict: records or files were skipped (see above)")


def _plan(
    mode: Mode,
    by: By,
    every: str | None,
    reduce: list[str] | None,
    key: list[str] | None,
    ranks: str | None,
    steps: str | None,
) -> Any:
    """The reduce plan the shared options ask for; bad syntax is a usage error (exit 2)."""
    from metric_core.plan import make_plan

    return usage(
        lambda: make_plan(
            mode=mode.value,
            by=by.value,
            every=every,
            reduce=reduce or (),
            keys=key or (),
            ranks=ranks or (),
            steps=steps,
        )
    )


def usage(call: Callable[[], T]) -> T:
    """Parse an option value; a bad one is a usage error (exit 2)."""
    from metric_core.plan import PlanError

    try:
        return call()
    except PlanError as exc:
        raise typer.BadParameter(str(exc)) from None


@app.command()
def reduce(
    run_dir: RunDir,
    follow_symlinks: FollowOpt = False,
    mode: ModeOpt = Mode.global_reduce,
    by: ByOpt = By.step,
    every: EveryOpt = None,
    reduce: ReduceOpt = None,
    key: KeyOpt = None,
    ranks: RanksOpt = None,
    steps: StepsOpt = None,
    out: Annotated[
        Path | None, typer.Option("--out", metavar="FILE", help="Write to FILE.parquet, .csv or .jsonl.")
    ] = None,
    wide: Annotated[
        bool, typer.Option("--wide", help="One row per step (per source), one column per key.")
    ] = False,
    strict: StrictOpt = False,
) -> None:
    """Compute a logging mode offline from a run's raw records.

    Example:

        metriclog reduce runs/exp1 --mode per_rank_reduce --reduce 'policy/latency_s=p99' --out latency.csv
    """
    from cli.output import print_table, write_frame
    from metric_core.reader import scan_run
    from metric_core.reduce import execute, pivot_wide

    plan = _plan(mode, by, every, reduce, key, ranks, steps)
    if wide and plan.mode.value == "per_rank_no_reduce":
        raise typer.BadParameter("--wide needs a reducing mode (global_reduce or per_rank_reduce)")
    with errors_to_exit():
        scan = scan_run(run_dir, follow_symlinks=follow_symlinks)
        report_skips(scan, strict)
        result = execute(plan, scan)
        for warning in result.warnings:
            typer.echo(f"warning: {warning}", err=True)
        frame = pivot_wide(result.frame, plan) if wide else result.frame
        if out is None:
            print_table(frame)
        else:
            write_frame(frame, out)
            typer.echo(f"wrote {frame.height} row(s) to {out}", err=True)


@app.command()
def upload(
    run_dir: RunDir,
    project: Annotated[str, typer.Option("--project", metavar="PROJECT", help="W&B project.")],
    entity: Annotated[
        str | None, typer.Option("--entity", metavar="ENTITY", help="W&B entity (team or user).")
    ] = None,
    group: Annotated[
        str | None, typer.Option("--group", metavar="GROUP", help="W&B group [default: --name].")
    ] = None,
    name: Annotated[
        str | None,
        typer.Option("--name", metavar="NAME", help="Run name [default: the run directory's name]."),
    ] = None,
    mode: ModeOpt = Mode.global_reduce,
    per_rank_share_run: Annotated[
        bool,
        typer.Option("--per-rank-share-run", help="Per-rank modes: one shared run, keys {key}/{process}."),
    ] = False,
    offline: Annotated[
        bool, typer.Option("--offline", help="Write W&B offline runs, to sync later with `wandb sync`.")
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the runs, rows and keys; upload nothing.")
    ] = False,
    force_new: Annotated[
        bool, typer.Option("--force-new", help="Upload finished runs again under fresh ids.")
    ] = False,
    by: ByOpt = By.step,
    every: EveryOpt = None,
    reduce: ReduceOpt = None,
    key: KeyOpt = None,
    ranks: RanksOpt = None,
    steps: StepsOpt = None,
    strict: StrictOpt = False,
    follow_symlinks: FollowOpt = False,
) -> None:
    """Upload a logging mode of a run to Weights & Biases (idempotent, resumable).

    Example:

        metriclog upload runs/exp1 --project rl --mode per_rank_reduce --offline
    """
    from cli import background
    from metric_core import upload as up

    plan = _plan(mode, by, every, reduce, key, ranks, steps)
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("WANDB_CONSOLE", "off")
    if not dry_run and not offline and not up.has_credentials():
        raise fail(
            "not logged in to W&B: run `wandb login` (or set WANDB_API_KEY), "
            "or write offline runs with --offline and `wandb sync` them later"
        )
    prepare = functools.partial(
        _plan_upload,
        run_dir,
        plan,
        strict,
        follow_symlinks,
        name=name or run_dir.resolve().name,
        group=group,
        share_run=per_rank_share_run,
    )
    if dry_run:
        _print_upload_plan(prepare())
        typer.echo("dry run: nothing was uploaded", err=True)
        return
    # wandb takes about half a second to import: this process does it while a child
    # process reads and reduces the run (cli/background.py)
    pending = background.start(prepare)
    import wandb  # noqa: F401

    upload_plan = pending()
    with errors_to_exit():
        ledger = up.Ledger.for_run_dir(run_dir, upload_plan.identity)
        wandb_dir = None if os.environ.get("WANDB_DIR") else ledger.path.parent
        with _progress() as progress:
            outcomes = up.upload_plan(
                upload_plan,
                ledger,
                project=project,
                entity=entity,
                offline=offline,
                force_new=force_new,
                wandb_dir=wandb_dir,
                progress=progress,
            )
        for o in outcomes:
            if o.message:
                typer.echo(o.message, err=True)
            if o.action != "skipped":
                typer.echo(
                    f"{o.action} {o.run.name} ({o.run_id}): {o.rows_sent} rows, {len(o.run.keys)} keys",
                    err=True,
                )
        synced = [o.sync_dir for o in outcomes if o.sync_dir]
        if synced:
            typer.echo("offline runs written; upload them with:\n  wandb sync " + " ".join(synced), err=True)


def _plan_upload(run_dir: Path, plan: Any, strict: bool, follow_symlinks: bool, **mapping: Any) -> Any:
    """Read and reduce the run, map it to W&B runs, and say what the user should know."""
    from metric_core import upload as up
    from metric_core.reader import scan_run
    from metric_core.reduce import execute

    with errors_to_exit():
        scan = scan_run(run_dir, follow_symlinks=follow_symlinks)
        report_skips(scan, strict)
        upload_plan = up.plan_upload(execute(plan, scan), **mapping)
    for original, safe in upload_plan.key_mapping.items():
        typer.echo(
            f"note: key '{original}' is uploaded as '{safe}' (W&B would reject or mangle it)", err=True
        )
    for warning in upload_plan.warnings:
        typer.echo(f"warning: {warning}", err=True)
    return upload_plan


def _print_upload_plan(upload_plan: Any) -> None:
    import polars as pl

    from cli.output import print_table

    print_table(
        pl.DataFrame(
            [
                {"id": r.run_id, "name": r.name, "group": r.group, "rows": r.rows, "keys": len(r.keys)}
                for r in upload_plan.runs
            ]
        )
    )


@app.command()
def inspect(
    run_dir: RunDir,
    follow_symlinks: FollowOpt = False,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print one JSON object instead of the table.")
    ] = False,
) -> None:
    """Tell what happened in a crashed or hung run: per-source health, then a verdict.

    Example:

        metriclog inspect runs/exp1 --json
    """
    from metric_core.inspect import inspect_run, to_json, verdict
    from metric_core.reader import scan_run

    with errors_to_exit():
        scan = scan_run(run_dir, follow_symlinks=follow_symlinks)
        report_skips(scan, strict=False)
        report = inspect_run(scan)
    if json_out:
        typer.echo(to_json(report))
        return
    _print_sources(report)
    typer.echo("")
    for line in verdict(report):
        typer.echo(line)


@app.command()
def plot(
    run_dir: RunDir,
    key: Annotated[
        list[str], typer.Option("--key", metavar="PATTERN", help="Keys to plot (glob). Repeatable.")
    ],
    out: Annotated[Path, typer.Option("--out", metavar="FILE.png", help="Where to write the PNG.")],
    mode: ModeOpt = Mode.global_reduce,
    by: ByOpt = By.step,
    every: EveryOpt = None,
    reduce: ReduceOpt = None,
    ranks: RanksOpt = None,
    steps: StepsOpt = None,
    follow_symlinks: FollowOpt = False,
) -> None:
    """Plot keys of a run to a PNG, marking where sources stopped and values went non-finite.

    Example:

        metriclog plot runs/exp1 --key 'trainer/*' --mode per_rank_reduce --out trainer.png
    """
    from metric_core.plot import plot_run
    from metric_core.reader import scan_run

    plan = _plan(mode, by, every, reduce, key, ranks, steps)
    if out.suffix.lower() != ".png":
        raise typer.BadParameter(f"--out {out}: the plot is a PNG; name it FILE.png")
    with errors_to_exit():
        scan = scan_run(run_dir, follow_symlinks=follow_symlinks)
        report_skips(scan, strict=False)
        plot_run(scan, plan, out)
    typer.echo(f"wrote {out}", err=True)


def _print_sources(report: dict[str, Any]) -> None:
    from datetime import datetime

    import polars as pl

    from cli.output import print_table

    def local(ts: float) -> str:
        return datetime.fromtimestamp(ts).strftime("%m-%d %H:%M:%S")

    rows = [
        {
            "process": s["process"],
            "rank": s["rank"],
            "files": s["files"],
            "records": s["records"],
            "skipped": s["skipped"],
            "truncated": "yes" if s["truncated"] else "",
            "keys": s["keys"],
            "steps": f"{s['first_step']}-{s['last_step']}",
            "first": local(s["first_timestamp"]),
            "last": local(s["last_timestamp"]),
            "lag": f"{s['lag_s']:.1f} s",
            "status": s["status"],
        }
        for s in report["sources"]
    ]
    typer.echo(f"run {report['name']} ({report['run_dir']}), world_size {report['world_size'] or 'unknown'}")
    print_table(pl.DataFrame(rows), max_rows=1000)


@contextmanager
def _progress() -> Iterator[Any]:
    """A progress bar per W&B run (rows, rows/s, ETA) on stderr, when it is a terminal."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    class RowRate(ProgressColumn):
        def render(self, task: Any) -> Text:
            return Text(f"{task.speed:,.0f} rows/s" if task.speed else "")

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        RowRate(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=False) as bars:

        def start(run: Any, done: int) -> Callable[[int], None]:
            task = bars.add_task(run.name, total=run.rows, completed=done)
            return lambda n: bars.update(task, completed=n)

        yield start


# The commands stream a few columns of many small files into a group-by. For that, polars'
# streaming engine holds far less memory with one file in flight, smaller morsels and a
# larger table of groups, and jemalloc with one arena; as fast, measured with
# benchmarks/bench_reduce.py. Set before polars loads; a value the user set is kept.
ENGINE_SETTINGS = {
    "POLARS_NUM_READERS_PRE_INIT": "1",
    "POLARS_MAX_CONCURRENT_SCANS": "1",
    "POLARS_IDEAL_MORSEL_SIZE": "20000",
    "POLARS_HOT_TABLE_SIZE": "1048576",
}
JEMALLOC = "_RJEM_MALLOC_CONF"  # polars adds its own settings before these


def main() -> None:
    if "polars" not in sys.modules:
        for name, value in ENGINE_SETTINGS.items():
            os.environ.setdefault(name, value)
        conf = os.environ.get(JEMALLOC, "")
        if "narenas" not in conf:  # inherited from a parent that imported polars, or the user's
            os.environ[JEMALLOC] = f"{conf},narenas:1".lstrip(",")
    app()


if __name__ == "__main__":
    sys.exit(main())
