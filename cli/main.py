"""``metriclog``: reduce, upload and diagnose the raw metric streams of a run.

Each command takes its options, makes one metric_core call and prints the result
(``output``). Errors are mapped by type: a ``PlanError`` is a usage error (exit 2), any
other ``MetricLogError`` or an ``OSError`` one ``Error: ...`` line and exit 1. Anything
else is a bug: its traceback, once, and a line saying it is one, exit 1.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer
import typer.core

from metric_core.errors import MetricLogError, PlanError, spell_options
from metric_core.metric import LoggingMode
from metric_core.offline.storage import check_target

from . import options as o
from . import output, tuning
from .start import STOPPED, catch_stops, stopping

DIFFERENT = 5  # diff's exit code for runs that differ (1 means they could not be compared)
BUG = "this is a bug in metriclog, not in the run or the command: please report it, with the traceback above"


class _Command(typer.core.TyperCommand):
    """A command whose usage line names its argument plainly (``RUN_DIR``, not ``{RUN_DIR}``)."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [
            p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in super().collect_usage_pieces(ctx)
        ]


class _Group(typer.core.TyperGroup):
    """The commands, whose usage errors (``Error: Invalid value for ...``) are wrapped at the
    terminal's width as every other message is."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except typer.TyperException as exc:  # click's usage errors, shown by typer on the way out
            show = getattr(exc, "show", None)
            if show is not None:
                exc.show = lambda file=None: output.show_wrapped(show, file)  # type: ignore[attr-defined]
            raise


app = typer.Typer(
    cls=_Group,
    name="metriclog",
    help="Reduce, upload and diagnose the raw metric streams that metric_core writes.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion, --show-completion
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    if value:
        from metric_core.offline.engine import exact

        from . import __version__

        typer.echo(f"metriclog {__version__} (exact sums: {exact.path()})")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool | None,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
    ] = None,
) -> None:
    """Reduce, upload and diagnose the raw metric streams that metric_core writes."""


@contextmanager
def command_run(numpy_api: bool = True) -> Iterator[None]:
    """A command's work. First, polars' hand-over to numpy, which a stop landing in it would
    turn into a panic (``fetch_numpy_api``; not for ``upload``, which reads in a child
    forked before polars loads, and fetches it once the child is done); then expected
    failures become one line on stderr and an exit code, never a traceback."""
    output.new_command()
    if numpy_api:
        from metric_core.offline.read import fetch_numpy_api

        fetch_numpy_api()
    try:
        yield
    except PlanError as exc:
        raise typer.BadParameter(exc.text(o.as_flag)) from None
    except BrokenPipeError:  # the reader went away (`| head`): nothing more to say to it
        _quiet_stdout()
        raise typer.Exit(code=0) from None
    except MetricLogError as exc:
        output.error(exc.text(o.as_flag))
        raise typer.Exit(code=1) from None
    except OSError as exc:
        output.error(output.os_error_text(exc))
        raise typer.Exit(code=1) from None


@app.command(cls=_Command, short_help="Compute a logging mode offline from a run's raw records.")
@o.plan_options("reduce")
def reduce(
    run_dir: o.RunDir,
    plan_options: o.PlanOptions = o.PLAN_DEFAULTS,
    out: o.OutFile = None,
    form: o.FormatOpt = None,
    limit: o.Limit = None,
    tail: o.Tail = None,
    wide: o.Wide = False,
    strict: o.Strict = False,
    follow_symlinks: o.FollowSymlinks = False,
    engine: o.EngineOpt = o.Engine.LOCAL,
    ray_address: o.RayAddress = None,
) -> None:
    """Compute a logging mode offline from a run's raw records.

    A table on a terminal; CSV into a pipe (every row); --format and --out choose.

    Example:

    \b
        metriclog reduce runs/exp1 --mode per_rank_reduce --reduce 'policy/latency_s=p99' --out latency.csv
    """
    from metric_core.offline.engine import pivot_wide, run_plan

    with command_run():
        plan = plan_options.plan()
        o.rows(limit, tail, out, form)
        if wide and plan_options.mode is LoggingMode.PER_RANK_NO_REDUCE:
            raise PlanError("--wide needs a reducing mode (global_reduce or per_rank_reduce)")
        check_target(None if out == "-" else out)
        with output.read_progress() as progress:
            result = run_plan(
                run_dir,
                plan,
                strict=strict,
                follow_symlinks=follow_symlinks,
                on_read=output.said_skips,
                on_progress=progress,
                engine=engine,
                ray_address=ray_address,
            )
            frames = pivot_wide(result.batches(), plan) if wide else result.batches()  # written as it comes
            output.emit(
                frames, form=form and form.value, out=out, limit=limit, tail=tail,
                derived=f"reduce --mode {plan_options.mode.value}", run_dir=run_dir,
            )  # fmt: skip
        for note in result.unmatched:
            output.say("warning", note.text(o.as_flag))


@app.command(cls=_Command, short_help="Upload a logging mode of a run to W&B, TensorBoard files or MLflow.")
@o.plan_options("upload")
def upload(
    runs: o.Runs,
    project: o.Project = None,
    to: o.ToOpt = o.To.WANDB,
    logdir: o.Logdir = None,
    uri: o.TrackingUri = None,  # --tracking-uri
    experiment: o.Experiment = None,
    entity: o.Entity = None,
    group: o.Group = None,
    name: o.Name = None,
    per_rank_share_run: o.ShareRun = False,
    offline: o.Offline = False,
    dry_run: o.DryRun = False,
    force_new: o.ForceNew = False,
    plan_options: o.PlanOptions = o.PLAN_DEFAULTS,
    strict: o.Strict = False,
    follow_symlinks: o.FollowSymlinks = False,
    follow: o.FollowOpt = False,
    until_idle: o.UntilIdle = None,
    interval: o.Interval = o.FOLLOW_INTERVAL,
    sources: o.Sources = None,
    let_go_after: o.LetGoAfter = None,
    restart_grace: o.FollowRestartGrace = o.RESTART_GRACE,
    wait: o.Wait = False,
    connect_timeout: o.ConnectTimeout = None,
    engine: o.EngineOpt = o.Engine.LOCAL,
    ray_address: o.RayAddress = None,
    sample_top: o.SampleTop = None,
    sample_bottom: o.SampleBottom = None,
    sample_by: o.SampleBy = None,
    sample_random: o.SampleRandom = None,
    sample_seed: o.SampleSeed = 0,
    no_samples: o.NoSamples = False,
    tables: o.SampleTablesOpt = o.SampleTables.PER_STEP,
    alert: o.Alert = None,
    alert_on: o.AlertOn = None,
    on_alert: o.OnAlert = None,
) -> None:
    """Upload a logging mode of a run to W&B, TensorBoard or MLflow (idempotent, resumable).

    Several runs go one after the other, each as if uploaded alone; one that fails does not
    stop the others, and the exit code is the worst of theirs. With --follow (one run), upload
    it live, beside the job that writes it. Each key of samples
    (Reduce.SAMPLE) goes as a W&B table per step, in that step's row: by default the top 2
    and bottom 2 by reward where the samples have it, else 4 at random (--sample-tables
    incremental: torchforge's incremental {key}_table instead, for a recent W&B server).

    Examples:

    \b
        metriclog upload runs/exp1 --project rl --mode per_rank_reduce --offline
        metriclog upload 'runs/seed*' --project rl --group seeds
        metriclog upload runs/exp1 --project rl --follow
        metriclog upload runs/exp1 --to tensorboard --logdir tb --mode per_rank_reduce
        metriclog upload runs/exp1 --to mlflow --experiment rl
    """
    from metric_core.offline.upload import upload_runs

    report = output.RunsReport()
    alerts = output.EventCommands(on_alert, runs[0], option="--on-alert", kind="alert")
    with command_run(numpy_api=False), alerts:
        alarms = o.alarms(alert, alert_on, on_alert)
        following = o.follow(follow, interval, until_idle, sources, let_go_after, restart_grace, wait, alarms)
        with output.upload_events(alerts.run) as events, output.read_progress() as progress:
            upload_runs(
                runs,
                plan_options.plan(),
                o.destination(to, project, entity, offline, connect_timeout, logdir, uri, experiment),
                **report.callbacks(),
                name=name,
                group=group,
                share_run=per_rank_share_run,
                dry_run=dry_run,
                force_new=force_new,
                strict=strict,
                follow_symlinks=follow_symlinks,
                events=events,
                on_progress=progress,
                follow=following,
                engine=engine,
                ray_address=ray_address,
                samples=o.sample_choice(
                    sample_top, sample_bottom, sample_by, sample_random, sample_seed, no_samples, tables
                ),
            )
    raise typer.Exit(report.code)


@app.command(cls=_Command, short_help="Tell what happened in a crashed or hung run.")
@o.plan_options("inspect")
def inspect(
    run_dir: o.RunDir,
    plan_options: o.PlanOptions = o.PLAN_DEFAULTS,
    json_out: o.Json = False,
    form: o.InspectFormat = None,
    pause_after: o.PauseAfter = None,
    follow_symlinks: o.FollowSymlinks = False,
) -> None:
    """Tell what happened in a crashed or hung run: how each attempt of each source ended,
    which failed first, where the job paused and was stuck; per-source health, then a verdict.

    --format json (or --json) prints the whole report as one JSON object; csv and jsonl the
    per-source table, a row a source.

    Example:

    \b
        metriclog inspect runs/exp1 --json
    """
    from metric_core.offline.inspect import inspect_run

    with command_run(), output.read_progress() as progress:
        report = inspect_run(
            run_dir,
            follow_symlinks=follow_symlinks,
            attempts=plan_options.attempts,
            on_read=output.said_skips,
            on_progress=progress,
            pause_after=pause_after,
        )
        if json_out or form is o.Format.JSON:
            typer.echo(report.to_json())
        elif form in (o.Format.CSV, o.Format.JSONL):
            output.write_stdout(iter([output.sources_frame(report)]), form.value)
        else:
            output.print_inspect(report)


@app.command(cls=_Command, short_help="Plot keys of a run, or several runs with bands, to PNG, SVG or PDF.")
@o.plan_options("plot")
def plot(
    runs: o.Runs,
    key: o.PlotKeys,
    out: o.PngFile,
    plan_options: o.PlanOptions = o.PLAN_DEFAULTS,
    follow_symlinks: o.FollowSymlinks = False,
    smooth: o.Smooth = 0.0,
    band: o.Band = "std",
    group_by: o.GroupBy = None,
    keep_missing: o.KeepMissing = False,
    label: o.Labels = None,
    engine: o.EngineOpt = o.Engine.LOCAL,
    ray_address: o.RayAddress = None,
) -> None:
    """Plot keys of a run to a PNG, SVG or PDF, marking where sources stopped and values went
    non-finite; of several runs, a line per group (the mean across its runs) and a band.

    Examples:

    \b
        metriclog plot runs/exp1 --key 'trainer/*' --mode per_rank_reduce --out trainer.png
        metriclog plot 'runs/lr*' --key eval/reward --group-by config.lr --band stderr --out sweep.png
    """
    from metric_core.offline.compare import expand_runs
    from metric_core.offline.plot import plot_run, plot_runs

    with command_run(), output.read_progress() as progress:
        plan = plan_options.plan(keys=key)
        check_target(out)
        dirs = expand_runs(runs)
        shared = {
            "follow_symlinks": follow_symlinks, "on_read": output.said_skips, "on_progress": progress,
            "smooth": smooth, "engine": engine, "ray_address": ray_address,
        }  # fmt: skip
        if len(dirs) == 1 and group_by is None:
            warn = lambda text: output.say("warning", text)  # noqa: E731
            plot_run(dirs[0], plan, out, on_warning=warn, spelling=o.as_flag, **shared)
        else:
            grouping = {"group_by": group_by, "keep_missing": keep_missing, "labels": label, "band": band}
            plot_runs(dirs, plan, out, **grouping, **shared)
    output.say("info", f"wrote {out}")


@app.command(cls=_Command, short_help="List the keys of a run: reductions, records, sources, steps.")
@o.plan_options("keys")
def keys(
    run_dir: o.RunDir,
    plan_options: o.PlanOptions = o.PLAN_DEFAULTS,
    follow_symlinks: o.FollowSymlinks = False,
    out: o.OutFile = None,
    form: o.FormatOpt = None,
    json_out: o.KeysJson = False,
    limit: o.Limit = None,
    tail: o.Tail = None,
) -> None:
    """List every key of a run: its reduction, records, sources, first and last step and time,
    and how many of its values are NaN or infinite. The writer's sealed files answer from
    their metadata once their checksums verify; other files are read once.

    A row a key: a table on a terminal, CSV into a pipe; --format json (or --json) prints one
    JSON array of objects, jsonl an object a line.

    Example:

    \b
        metriclog keys runs/exp1 --key 'trainer/*' --format json | jq '.[].key'
    """
    from metric_core.offline.keys import key_frames

    with command_run():
        o.rows(limit, tail, out, form)
        check_target(None if out == "-" else out)
        with output.read_progress() as progress:
            found = key_frames(
                run_dir, keys=plan_options.key or (), follow_symlinks=follow_symlinks,
                attempts=plan_options.attempts,
                on_read=output.said_skips, on_progress=progress,
            )  # fmt: skip
        output.emit(
            found, form="json" if json_out else form and form.value, out=out, limit=limit, tail=tail,
            derived="keys", run_dir=run_dir,
        )  # fmt: skip


@app.command(cls=_Command, short_help="List a run's samples (Reduce.SAMPLE), or some per step.")
@o.plan_options("samples")
def samples(
    run_dir: o.RunDir,
    plan_options: o.PlanOptions = o.PLAN_DEFAULTS,
    top: o.Top = 0,
    bottom: o.Bottom = 0,
    by: o.By_ = None,
    random: o.Random = 0,
    seed: o.Seed = 0,
    attempts: o.SampleAttempts = "rewind",
    out: o.OutFile = None,
    form: o.FormatOpt = None,
    limit: o.Limit = None,
    tail: o.Tail = None,
) -> None:
    """List the samples recorded with Reduce.SAMPLE: every one, or some per key and step.

    A row a sample: step, rank, process, timestamp, key, then a column a field (lists and
    dicts as JSON text). A table on a terminal, CSV into a pipe; --format and --out choose.

    Example:

    \b
        metriclog samples runs/exp1 --key 'rollout/*' --top 2 --bottom 2 --by reward
    """
    from metric_core.offline.samples import select_samples

    with command_run():
        o.rows(limit, tail, out, form)
        check_target(None if out == "-" else out)
        frame, read = select_samples(
            run_dir, keys=plan_options.key or (), ranks=plan_options.ranks or (), steps=plan_options.steps,
            attempts=attempts,
            top=top, bottom=bottom, by=by, random=random, seed=seed, on_read=output.said_skips,
        )  # fmt: skip
        for note in read.notes:
            output.say("warning", spell_options(note, o.as_flag))
        output.emit(
            frame, form=form and form.value, out=out, limit=limit, tail=tail,
            derived="samples", run_dir=run_dir, table=output.print_samples,
        )  # fmt: skip


@app.command(cls=_Command, short_help="Follow a run while it is written; catch hung sources.")
@o.plan_options("watch")
def watch(
    run_dir: o.RunDir,
    interval: o.Interval = 2.0,
    on_stall: o.OnStall = None,
    exit_on_stall: o.ExitOnStall = False,
    stall_after: o.StallAfter = None,
    restart_grace: o.RestartGrace = o.RESTART_GRACE,
    plan_options: o.PlanOptions = o.PLAN_DEFAULTS,
    follow_symlinks: o.FollowSymlinks = False,
    wait: o.Wait = False,
    alert: o.Alert = None,
    alert_on: o.AlertOn = None,
    on_alert: o.OnAlert = None,
) -> None:
    """Follow a run while it is written: its sources' state, the ones that hang or die, and
    alarms on the values (--alert).

    On a terminal, a table of the sources redrawn in place; into a pipe or a file, a line each
    time a source appears or its state changes (stalls, deaths and restarts: on stderr).

    Exit 0 once every source finished, 4 once every source finished or died (or ranks of
    world_size never wrote) and no restart came within --restart-grace, 3 on a stall with
    --exit-on-stall, 130 on Ctrl-C.

    Example:

    \b
        metriclog watch runs/exp1 --on-stall 'echo "$METRICLOG_PROCESS hung in $METRICLOG_WHERE"'
        metriclog watch runs/exp1 --alert 'train/loss: nonfinite' --alert 'train/grad_norm > 100'
    """
    from metric_core.offline.watch import STOPPED, watch_run

    commands = output.EventCommands(on_stall, run_dir, option="--on-stall")
    alerts = output.EventCommands(on_alert, run_dir, option="--on-alert", kind="alert")
    with command_run(), output.WatchDisplay() as show, commands, alerts:
        alarms = o.alarms(alert, alert_on, on_alert)
        commands.relay = alerts.relay = show.live is not None
        try:
            result = watch_run(
                run_dir,
                interval=interval,
                on_poll=show.poll,
                on_stall=commands.run,
                on_note=show.note,
                on_waiting=show.waiting,
                exit_on_stall=exit_on_stall,
                stall_after=stall_after,
                restart_grace=o.grace(restart_grace),
                follow_symlinks=follow_symlinks,
                attempts=plan_options.attempts,
                wait=wait,
                alarms=alarms,
                on_alert=alerts.run,
            )
        except KeyboardInterrupt:
            raise typer.Exit(STOPPED) from None
    raise typer.Exit(result.code)


@app.command("import", cls=_Command, short_help="Import a run another tool logged: TensorBoard, W&B, MLflow.")
def import_(
    src: o.Source,
    run_dir: o.ImportDir,
    reduce: o.ImportReduce = "mean",
    step_col: o.StepCol = "step",
    time_col: o.TimeCol = None,
    key_col: o.KeyCol = None,
    value_col: o.ValueCol = None,
    tracking_uri: o.TrackingUri = None,
    experiment: o.SourceExperiment = None,
    run_id: o.MlflowRunId = None,
) -> None:
    """Import a run another tool logged into RUN_DIR, as metriclog's records, so every command reads it:
    TensorBoard event files, W&B offline runs, MLflow runs, CSV, JSONL or Parquet exports. Importing the
    same source again adds nothing.

    Examples:

    \b
        metriclog import tb_logs/exp1 runs/exp1
        metriclog import wandb/offline-run-20261207_010203-abc123 runs/abc123
        metriclog import mlflow runs/exp2 --tracking-uri sqlite:///mlruns.db --experiment exp2
        metriclog import metrics.csv runs/exp3 --step-col iteration
    """
    from metric_core.offline.importers import import_source

    with command_run():
        result = import_source(
            src, run_dir, reduction=reduce, tracking_uri=tracking_uri, experiment=experiment, run_id=run_id,
            step_col=step_col, time_col=time_col, key_col=key_col, value_col=value_col,
            on_warning=lambda text: output.say("warning", text),
        )  # fmt: skip
    output.print_import(result)


@app.command(cls=_Command, short_help="Statistics across runs (seeds, a sweep) per step and key, exactly.")
@o.plan_options("compare")
def compare(
    runs: o.Runs,
    group_by: o.GroupBy = None,
    keep_missing: o.KeepMissing = False,
    label: o.Labels = None,
    across: o.Across = None,
    common: o.Common = False,
    plan_options: o.PlanOptions = o.PLAN_DEFAULTS,
    out: o.OutFile = None,
    form: o.FormatOpt = None,
    limit: o.Limit = None,
    tail: o.Tail = None,
    wide: o.Wide = False,
    to: o.CompareTo = None,
    project: o.Project = None,
    entity: o.Entity = None,
    offline: o.Offline = False,
    connect_timeout: o.ConnectTimeout = None,
    logdir: o.Logdir = None,
    uri: o.TrackingUri = None,  # --tracking-uri
    experiment: o.Experiment = None,
    dry_run: o.DryRun = False,
    force_new: o.ForceNew = False,
    strict: o.Strict = False,
    follow_symlinks: o.FollowSymlinks = False,
    engine: o.EngineOpt = o.Engine.LOCAL,
    ray_address: o.RayAddress = None,
) -> None:
    """Reduce each run as reduce does, then per step (or window from each run's start) and key,
    across the runs of each group: mean, std, std_sample, stderr, min, max, median, count.

    Means and spreads are exact (correctly rounded), the same bits in any order of the runs.
    A row per (group, step, key); --format, --out and --wide as reduce's. With --to, the
    result goes to W&B, TensorBoard or MLflow instead, a run per group (sent once).

    Examples:

    \b
        metriclog compare 'runs/lr*_seed*' --group-by config.lr --key 'eval/*' --across mean,stderr,count
        metriclog compare 'runs/lr*_seed*' --group-by config.lr --to mlflow --experiment sweep
    """
    from metric_core.offline.compare import ACROSS, compare_runs

    with command_run():
        plan = plan_options.plan()
        o.rows(limit, tail, out, form)
        where = (project, entity, offline, connect_timeout, logdir, uri, experiment, dry_run, force_new)
        to_send = o.sent_to(
            to, {"--out": out, "--format": form, "--limit": limit, "--tail": tail, "--wide": wide}, *where
        )
        check_target(None if out == "-" else out)
        with output.read_progress() as progress:
            result = compare_runs(
                runs, plan, across=across or ACROSS, group_by=group_by, keep_missing=keep_missing,
                labels=label, common=common, strict=strict, follow_symlinks=follow_symlinks,
                on_read=output.said_skips, on_progress=progress, engine=engine, ray_address=ray_address,
            )  # fmt: skip
        if to_send is not None:
            raise typer.Exit(_send_comparison(result, to_send, dry_run, force_new))
        output.emit(
            result.wide() if wide else result.frame, form=form and form.value, out=out, limit=limit,
            tail=tail, derived="compare", run_dir=None,
        )  # fmt: skip
        for note in result.notes:
            output.say("note", spell_options(note, o.as_flag))


def _send_comparison(result: Any, to: Any, dry_run: bool, force_new: bool) -> int:
    """compare --to: the notes first, then what went (``print_upload``); its exit code."""
    from metric_core.offline.upload.comparison import send_comparison

    for note in result.notes:
        output.say("note", spell_options(note, o.as_flag))
    with output.upload_events() as events:
        sent = send_comparison(result, to, dry_run=dry_run, force_new=force_new, events=events)
    return output.print_upload(sent)


@app.command(cls=_Command, short_help="Where two runs differ, key by key; exit 5 when they do.")
@o.plan_options("diff")
def diff(
    run_a: o.RunA,
    run_b: o.RunB,
    rtol: o.Rtol = None,
    atol: o.Atol = None,
    form: o.DiffFormat = None,
    plan_options: o.PlanOptions = o.PLAN_DEFAULTS,
    strict: o.Strict = False,
    follow_symlinks: o.FollowSymlinks = False,
    engine: o.EngineOpt = o.Engine.LOCAL,
    ray_address: o.RayAddress = None,
) -> None:
    """Reduce both runs as reduce does and say, per key, the first step where they differ, the
    largest difference and where, and the keys and steps only one has.

    Equal means bit for bit (NaN equals NaN, -0.0 differs from 0.0), or within --rtol/--atol
    (then -0.0 equals 0.0). Exit 0 when equal, 5 when not, 1 when the runs could not be read.

    Example:

    \b
        metriclog diff runs/before runs/after --key 'trainer/*' --format json
    """
    from metric_core.offline.diff import diff_runs

    from .diff_report import print_diff

    with command_run():
        plan = plan_options.plan()
        with output.read_progress() as progress:
            report = diff_runs(
                run_a, run_b, plan, rtol=rtol, atol=atol, strict=strict, follow_symlinks=follow_symlinks,
                on_read=output.said_skips, on_progress=progress, engine=engine, ray_address=ray_address,
            )  # fmt: skip
        try:
            if form == "json":
                typer.echo(report.to_json())
            else:
                print_diff(report)
        except BrokenPipeError:  # the reader went away (`| head`): the verdict is still the exit code
            _quiet_stdout()
    raise typer.Exit(0 if report.equal else DIFFERENT)


def main() -> None:
    """The commands, run with stops caught (``start``): a stop by SIGTERM is a Ctrl-C, so
    what a command made in temporary directories and half-written files is removed on the
    way out. An unexpected error is a bug: its traceback once, one line saying so, exit 1."""
    catch_stops()
    tuning.apply()
    every = app.registered_commands
    app.registered_commands = _asked(sys.argv[1:2]) or every
    try:
        app()
    except KeyboardInterrupt:  # before typer took the command, or a second stop in its cleanup
        sys.exit(STOPPED)
    except Exception as exc:
        if not stopping():
            _report_bug(exc)
            sys.exit(1)
        # The stop landed inside a library that made its KeyboardInterrupt an error of its
        # own (pydantic building wandb's models on import): stopped, not broken. Anything
        # else that failed on the way out is still said.
        if "KeyboardInterrupt" not in repr(exc) and not _chained_interrupt(exc):
            output.error(output.gist(exc))
        sys.exit(STOPPED)
    finally:
        app.registered_commands = every


def _asked(first: list[str]) -> list[Any]:
    """The command the first argument names, to build alone: typer builds every command's
    options on each start, ~40 ms of CPU (a tenth of a small command's). The top level's
    help, shell completion and a mistyped name get them all."""
    if any(name.endswith("_COMPLETE") for name in os.environ):
        return []
    return [c for c in app.registered_commands if first == [c.name or _command_name(c.callback)]]


def _command_name(callback: Any) -> str:
    return typer.main.get_command_name(callback.__name__)


def _report_bug(exc: BaseException) -> None:
    """An unexpected error's traceback, printed here rather than by the interpreter's hook: a
    library may have chained a hook of its own to it (wandb's prints the traceback, then
    calls the one it found), and the report is one traceback."""
    import traceback

    traceback.print_exception(exc)
    sys.stderr.flush()
    output.error(BUG)


def _chained_interrupt(exc: BaseException | None) -> bool:
    while exc is not None:
        if isinstance(exc, KeyboardInterrupt):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush of a closed pipe is silent."""
    with contextlib.suppress(OSError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
