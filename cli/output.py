"""Everything the commands show: tables, files, messages on stderr and progress bars."""

from __future__ import annotations

import os
import shutil
import sys
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from .options import as_flag

if TYPE_CHECKING:
    import polars as pl

    from metric_core.offline.importers import ImportResult
    from metric_core.offline.inspect import InspectReport
    from metric_core.offline.read import ReadReport
    from metric_core.offline.upload import UploadEvents, UploadResult

MAX_TABLE_ROWS = 40


# The display watch redraws in place on a terminal, while it runs: lines are printed above
# it through its console (written to the terminal beside it, they leave stale copies).
_live: Any = None


def say(kind: str, text: str) -> None:
    """A message on stderr: ``warning: ...``, ``note: ...``, ``Error: ...``, or plain
    information; wrapped at the terminal's width (``wrapped``)."""
    if _live is not None:  # rich wraps it at the width of the terminal it draws on
        from rich.text import Text

        _live.console.print(Text(_line(kind, text)))
        return
    typer.echo(wrapped(_line(kind, text), message_width(sys.stderr)), err=True)


def error(text: str) -> None:
    """A command's one ``Error: ...`` message, on stderr."""
    say("Error", text)


def _line(kind: str, text: str) -> str:
    return text if kind == "info" else f"{kind}: {text}"


def message_width(stream: Any) -> int | None:
    """The width the messages written to ``stream`` are wrapped at: ``COLUMNS`` when set (as
    rich and the tables take it), else the width of the terminal ``stream`` is; None (not
    wrapped) into a pipe or a file, where a message stays on one line for grep and logs."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    try:
        return os.get_terminal_size(stream.fileno()).columns if stream.isatty() else None
    except (AttributeError, OSError, ValueError):  # a stream with no descriptor (a test's)
        return None


# The narrowest width a message is wrapped at: on a terminal narrower than this, a word a
# line would be no easier to read than lines that run over.
MIN_WRAP = 40


def wrapped(text: str, width: int | None) -> str:
    """``text`` with each line longer than ``width`` broken at spaces, its continuation lines
    indented four more than it (messages indent their own parts by two: a continuation is
    not taken for one); a word longer than a line (a path, a URL) is never broken.

    >>> print(wrapped("warning: a message that runs past the width of the terminal", 40))
    warning: a message that runs past the
        width of the terminal
    """
    if width is None:
        return text
    import textwrap

    width = max(width, MIN_WRAP)
    out: list[str] = []
    for line in text.split("\n"):
        if _width(line) <= width:
            out.append(line)
            continue
        body = line.lstrip(" ")
        indent = line[: len(line) - len(body)]
        out += textwrap.wrap(
            body,
            width,
            initial_indent=indent,
            subsequent_indent=indent + "    ",
            break_long_words=False,
            break_on_hyphens=False,
        ) or [line]
    return "\n".join(out)


def show_wrapped(show: Callable[..., None], file: Any = None) -> None:
    """What a usage error's ``show`` prints (usage, hint, ``Error: ...``), its lines wrapped."""
    import io

    said = io.StringIO()
    show(file=said)
    out = file or sys.stderr
    typer.echo(wrapped(said.getvalue().rstrip("\n"), message_width(out)), file=out)


def echo_prose(text: str) -> None:
    """A line of a report on stdout (inspect's story, a table's notes), wrapped as messages are."""
    typer.echo(wrapped(text, message_width(sys.stdout)))


def said_skips(report: ReadReport) -> None:
    """What the reader skipped, if anything (the ``on_read`` of the library's calls)."""
    summary = report.summary(spelling=as_flag)
    if summary:
        say("warning", summary)


def write_frames(
    frames: pl.DataFrame | Iterator[pl.DataFrame],
    out: str | Path,
    *,
    derived: str,
    run_dir: str | None = None,
) -> None:
    """A result written to ``out`` (``offline.results.write_result``), and said; a warning
    first when ``out`` is inside the run directory ``run_dir``."""
    from metric_core.offline.results import is_inside, write_result

    if run_dir is not None and is_inside(out, run_dir):
        say(
            "warning",
            f"--out {out} is inside the run directory {run_dir}: metriclog marks it as a result and "
            "does not read it as data, but other tools reading the directory may",
        )
    rows = write_result(frames, out, derived=derived)
    say("info", f"wrote {rows} row(s) to {out}")


def print_frames(frames: pl.DataFrame | Iterator[pl.DataFrame], *, max_rows: int = MAX_TABLE_ROWS) -> None:
    """``print_table`` of a frame or a stream of frames: the first rows, and how many there were."""
    import polars as pl

    if isinstance(frames, pl.DataFrame):
        frames = iter([frames])
    head: list[pl.DataFrame] = []
    kept = total = 0
    for frame in frames:
        total += frame.height
        if kept < max_rows:
            head.append(frame.head(max_rows - kept))
            kept += head[-1].height
    print_table(
        pl.concat(head),
        max_rows=max_rows,
        total=total,
        drop_first=RESULT_DROPPED_FIRST,
        keep=RESULT_KEPT,
        cut=("key", "process"),
    )


def print_samples(frames: Iterator[pl.DataFrame], max_rows: int = MAX_TABLE_ROWS) -> None:
    """Samples as a table (long text cut to fit)."""
    import polars as pl

    frame = pl.concat(list(frames), how="vertical_relaxed")
    if frame.height == 0:
        say("info", "no samples (recorded with Reduce.SAMPLE) match")
        return
    text = [c for c, t in frame.schema.items() if t == pl.String]
    print_table(frame, max_rows=max_rows, cut=text, drop_first=("timestamp",), keep=("step", "key"))


def emit(
    frames: pl.DataFrame | Iterator[pl.DataFrame],
    *,
    form: str | None,
    out: str | None,
    limit: int | None,
    tail: int | None,
    derived: str,
    run_dir: str | None,
    table: Callable[..., None] = print_frames,
) -> None:
    """A data command's rows: to ``out`` (a file, by its suffix; ``-``: stdout), else to
    stdout in ``form``: ``table`` by default on a terminal, ``csv`` into a pipe. Only the
    ``limit`` first or ``tail`` last rows, in every form; notes go to stderr."""
    stream = _chosen(iter([frames]) if not isinstance(frames, Iterator) else frames, limit, tail)
    if out is not None and out != "-":
        write_frames(stream, out, derived=derived, run_dir=run_dir)
        return
    if form is None:
        form = "table" if out is None and sys.stdout.isatty() else "csv"
    if form == "table":
        table(stream, max_rows=limit or tail or MAX_TABLE_ROWS)
        return
    write_stdout(stream, form)


def _chosen(frames: Iterator[pl.DataFrame], limit: int | None, tail: int | None) -> Iterator[pl.DataFrame]:
    if limit is not None:
        left = limit
        for i, frame in enumerate(frames):
            if left <= 0 and i:
                break
            yield frame.head(left)  # the first frame always, if empty: its columns
            left -= min(left, frame.height)
        return
    if tail is not None:
        import polars as pl

        kept: list[pl.DataFrame] = []
        held = 0
        for frame in frames:  # the last ``tail`` rows, never more held than that and a frame
            kept.append(frame)
            held += frame.height
            while len(kept) > 1 and held - kept[0].height >= tail:
                held -= kept.pop(0).height
        if kept:
            yield pl.concat(kept, how="vertical_relaxed").tail(tail)  # --tail 0: the columns alone
        return
    yield from frames


def write_stdout(frames: Iterator[pl.DataFrame], form: str) -> None:
    """Rows as CSV, a JSON array or JSON lines on stdout, every one, uncut; NaN and the
    infinities as docs/format.md spells them (CSV: NaN, inf, -inf; JSON: "NaN", "Infinity")."""
    from metric_core.format.records import to_jsonl

    out = sys.stdout.buffer
    first = True
    if form == "json":
        out.write(b"[")
    for frame in frames:
        if form == "csv":
            out.write(frame.write_csv(include_header=first).encode())
        elif frame.height:
            lines = to_jsonl(frame.to_arrow())
            if form == "json":
                body = lines.rstrip(b"\n").replace(b"\n", b",\n")
                out.write((b"" if first else b",\n") + body)
            else:
                out.write(lines)
        first = first and (form != "csv" and frame.height == 0)
    if form == "json":
        out.write(b"]\n")
    out.flush()


# What a narrow terminal loses first of a result's columns (then columns from the right,
# such as --wide's keys): never what says which row it is, the key, or its value.
RESULT_DROPPED_FIRST = ("count", "reduction", "rank", "timestamp")
RESULT_KEPT = ("process", "step", "window_start", "key", "value")


PROGRESS_AFTER_S = 2.0  # a command that reads for longer shows a bar


@contextmanager
def read_progress(what: str = "reading") -> Iterator[Callable[[int, int, int, int], None] | None]:
    """A progress callback for the engine (parts done, parts, bytes done, bytes): on a
    terminal, a bar on stderr from two seconds on (bytes read, rate, time left); nothing
    otherwise."""
    import time

    if not sys.stderr.isatty():
        yield None
        return
    started = time.monotonic()
    bar: list[Any] = []

    def update(done: int, parts: int, done_bytes: int, total_bytes: int) -> None:
        if not bar:
            if time.monotonic() - started < PROGRESS_AFTER_S or done == parts:
                return
            bar.append(_byte_progress())
            bar[0].start()
            bar.append(bar[0].add_task(what, total=total_bytes))
        bar[0].update(bar[1], completed=done_bytes, description=f"{what} {done}/{parts} parts")
        if done == parts:  # the last call; also where a forked reader (upload's) stops its bar
            stop()

    def stop() -> None:
        if bar:
            bar[0].stop()
            bar.clear()

    try:
        yield update
    finally:
        stop()


def _byte_progress() -> Any:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    return Progress(*columns, console=Console(stderr=True), transient=True)


def print_table(
    df: pl.DataFrame,
    *,
    max_rows: int = MAX_TABLE_ROWS,
    total: int | None = None,
    drop_first: Sequence[str] = (),
    keep: Sequence[str] = (),
    cut: Sequence[str] = (),
    whole: str = "--out FILE.csv",
    notes: Callable[[str], None] | None = None,
) -> None:
    """A readable table that fits the terminal (``COLUMNS``, else the width of the terminal
    stdout is; into a pipe or a file with ``COLUMNS`` unset, the table is whole).

    Times (``timestamp``, ``window_start``) print as local ISO 8601, floats with 7
    significant digits, missing values as blanks. A long result (``total`` rows, when ``df``
    holds only its first ones) is cut after ``max_rows``. A table too wide loses columns,
    ``drop_first`` first, then from the right, never the first one nor those in ``keep``;
    then the long values of the ``cut`` columns (text, never a number) are shortened with
    "…", to MIN_CUT characters at least. Every cut is said, with where to find it whole
    (``whole``); a table that still does not fit is printed as it is.
    """
    import polars as pl

    total = df.height if total is None else total
    shown = _readable(df.head(max_rows))
    width = _terminal_width()
    fixed = {*shown.columns[:1], *keep}
    order = [c for c in drop_first if c in shown.columns and c not in fixed]
    order += [c for c in reversed(shown.columns) if c not in order and c not in fixed]
    text = _rendered(shown)
    left_out: list[str] = []
    while _width(text) > width and order:
        left_out.append(order.pop(0))
        shown = shown.drop(left_out[-1])
        text = _rendered(shown)
    texts = [c for c in cut if c in shown.columns]
    shortened = False
    while _width(text) > width and texts:
        longest = max(n or 0 for n in shown.select(pl.col(texts).str.len_chars().max()).row(0))
        target = max(MIN_CUT, longest - (_width(text) - width))
        if target >= longest:
            break
        shown = shown.with_columns(_shortened(pl.col(texts), target))
        shortened = True
        text = _rendered(shown)
    print(text)
    # A data command's notes go to stderr, so stdout holds the table alone; a report (inspect)
    # keeps them beside its table (``notes``).
    note = notes or (lambda line: say("note", line))
    if left_out:
        hidden = [c for c in df.columns if c in left_out]  # in the table's order
        named = ", ".join(hidden) if len(hidden) <= 8 else f"{len(hidden)} columns"
        note(f"columns not shown, for the terminal's width ({width}): {named}; {whole} has them all")
    if shortened:
        note(f"long values are cut (…) for the terminal's width ({width}); {whole} has them whole")
    if total > max_rows:
        note(f"... {total - max_rows} more row(s) not shown ({total} in all); {whole} has them all")


# The fewest characters a value is cut to (with its "…") for a narrow terminal.
MIN_CUT = 8


def _terminal_width() -> int:
    if "COLUMNS" in os.environ or sys.stdout.isatty():
        return shutil.get_terminal_size().columns
    return sys.maxsize


def _readable(df: pl.DataFrame) -> pl.DataFrame:
    """Every column as the text printed: local ISO times, 7-digit floats, blanks for nulls."""
    import polars as pl

    from metric_core.clock import local_time

    def time(v: float | None) -> str | None:
        return None if v is None else local_time(v, millis=True)

    out = []
    for name, dtype in df.schema.items():
        col = pl.col(name)
        if (name in ("timestamp", "window_start") or name.endswith("_time")) and dtype == pl.Float64:
            col = col.map_elements(time, return_dtype=pl.String)
        elif dtype == pl.Float64:
            col = col.map_elements(lambda v: f"{v:.7g}", return_dtype=pl.String)
        out.append(col.cast(pl.String).fill_null(""))
    return df.select(out)


def _rendered(df: pl.DataFrame) -> str:
    import polars as pl

    with pl.Config(
        tbl_rows=-1,
        tbl_cols=-1,
        tbl_width_chars=65_000,  # columns are chosen to fit, never squeezed by polars
        tbl_hide_dataframe_shape=True,
        tbl_hide_column_data_types=True,
        fmt_str_lengths=65_000,
    ):
        return str(df)


def _width(text: str) -> int:
    """The widest line as a terminal shows it (East Asian wide characters take two cells)."""
    return max(
        (
            sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in line)
            for line in text.splitlines()
        ),
        default=0,
    )


def _shortened(col: pl.Expr, chars: int) -> pl.Expr:
    """Values longer than ``chars`` cut in the middle, so both ends stay: names differ at
    their end as often as at their start (``GeneratorActor_r0`` -> ``Gene…_r0``)."""
    import polars as pl

    head, tail = (chars - 1) - (chars - 1) // 2, (chars - 1) // 2
    return (
        pl.when(col.str.len_chars() > chars)
        .then(col.str.slice(0, head) + "…" + col.str.tail(tail))
        .otherwise(col)
    )


def print_rows(rows: list[dict[str, Any]], *, max_rows: int = MAX_TABLE_ROWS, **fit: Any) -> None:
    """``print_table`` of a report's rows of plain values (``fit``: its ``drop_first`` and
    ``whole``); a report's notes stay beside its table, on stdout."""
    import polars as pl

    print_table(pl.DataFrame(rows), max_rows=max_rows, notes=echo_prose, **fit)


# What a narrow terminal loses first of inspect's table (the rest from the right): it
# keeps each source and its status.
INSPECT_DROPPED_FIRST = ("files", "keys", "attempts", "truncated", "skipped", "records", "first")
INSPECT_KEPT = ("rank", "state", "end")


def sources_frame(report: InspectReport) -> pl.DataFrame:
    """inspect's per-source table as data: a row a source, numbers as numbers."""
    import polars as pl

    return pl.DataFrame(
        [
            {
                "process": s.process,
                "rank": s.rank,
                "state": s.state,
                "status": s.status,
                "end": s.end,
                "lag_s": s.lag_s,
                "first_step": s.first_step,
                "last_step": s.last_step,
                "first_timestamp": s.first_timestamp,
                "last_timestamp": s.last_timestamp,
                "records": s.records,
                "skipped": s.skipped,
                "truncated": s.truncated,
                "files": s.files,
                "keys": s.keys,
                "attempts": len(s.attempts),
                "stalled": s.stalled,
            }
            for s in report.sources
        ],
        schema_overrides={"end": pl.String},
    )


def print_inspect(report: InspectReport) -> None:
    """The per-source table, then the verdict."""
    from metric_core.clock import duration, local_time

    rows = [
        {
            "process": s.process,
            "rank": s.rank,
            "state": s.state,
            "end": s.end or "",  # how its newest attempt ended
            "lag": duration(s.lag_s),
            "steps": f"{s.first_step}-{s.last_step}" if s.records else "none",
            "last": local_time(s.last_timestamp),
            "first": local_time(s.first_timestamp),
            "records": s.records,
            "skipped": s.skipped,
            "truncated": "yes" if s.truncated else "",
            "files": s.files,
            "keys": s.keys,
            "attempts": len(s.attempts) if len(s.attempts) > 1 else "",
        }
        for s in report.sources
    ]
    for column in ("attempts", "end"):  # no restart, or no end recorded: no column
        if not any(row[column] for row in rows):
            for row in rows:
                del row[column]
    echo_prose(f"run {report.name} ({report.run_dir}), world_size {report.world_size or 'unknown'}")
    print_rows(
        rows,
        max_rows=1000,
        drop_first=INSPECT_DROPPED_FIRST,
        keep=INSPECT_KEPT,
        cut=("process",),
        whole="--json",
    )
    if report.samples:
        counts = ", ".join(f"{key} {n:,}" for key, n in sorted(report.samples.items()))
        echo_prose(f"samples (Reduce.SAMPLE; `metriclog samples {report.run_dir}` lists them): {counts}")
    typer.echo("")
    for line in report.verdict(as_flag):
        echo_prose(line)


def print_upload(result: UploadResult) -> int:
    """A dry run's table of runs, or what happened to each run; the exit code (130: a
    follow stopped by Ctrl-C)."""
    followed = result.followed
    if followed is not None and followed.ended == "stopped":
        for o in result.outcomes:
            if o.action != "skipped":
                say("info", f"stopped following {o.run.name} ({o.run_id}) after {o.rows_sent} rows")
        say("info", "the same upload command with --follow continues where this one stopped")
        return 130
    if followed is not None and not result.outcomes:
        say("warning", "no record came before the end: nothing was uploaded")
    if followed is not None and followed.ended == "over":
        died = "; ".join(f"{p} (rank {r}): {why}" for (p, r), why in sorted(followed.dead.items()))
        if followed.missing:
            say(
                "info",
                f"ended: every source that wrote finished or died{f' ({died})' if died else ''}, and "
                f"{followed.missing}: no restart and no new source came within --restart-grace; the runs "
                "hold every record written",
            )
        else:
            say(
                "info",
                f"ended: every source finished or died, and no restart came within --restart-grace ({died}); "
                "the runs hold every record written",
            )
    if followed is not None and followed.ended == "idle" and not followed.all_finished:
        unfinished = sorted(
            f"{p} (rank {r})" for (p, r), s in followed.sources.items() if not (s.finished or s.static)
        )
        why = [f"{', '.join(unfinished)} did not shut down"] if unfinished else []
        if followed.missing:
            why.append(followed.missing)
        elif followed.expected > len(followed.sources):  # their count is not known: no run.json
            why.append("no run.json says how many sources the job has")
        say(
            "info",
            f"ended after --until-idle, but {'; '.join(why)}: the runs hold everything written so far and "
            "stay open in the ledger; the same command continues them if the job goes on",
        )
    if result.dry_run:
        print_rows(
            [
                {
                    "name": o.run.name,
                    "would be": o.action,
                    "rows": o.run.rows,
                    "keys": len(o.run.keys),
                    "group": o.run.group or "",
                    "id": o.run_id,
                }
                for o in result.outcomes
            ],
            max_rows=100_000,  # every run
            drop_first=("id", "group", "keys", "rows"),
            keep=("would be",),
            cut=("name", "group"),
            whole="a wider terminal (COLUMNS=200)",
        )
        for o in result.outcomes:
            echo_prose(f"keys of {o.run.name}: {', '.join(o.run.keys)}")
            if o.message:
                say("info", o.message)
        say("info", "dry run: nothing was uploaded")
        return 0
    for o in result.outcomes:
        if o.message:
            say("info", o.message)
        if o.action != "skipped":
            say("info", f"{o.action} {o.run.name} ({o.run_id}): {o.rows_sent} rows, {len(o.run.keys)} keys")
    if result.sync_dirs and followed is not None and followed.ended == "idle" and not followed.all_finished:
        say("info", "the offline runs stay open: `wandb sync` them once the same command has finished them")
    elif result.sync_dirs:
        say("info", "offline runs written; upload them with:\n  wandb sync " + " ".join(result.sync_dirs))
    return 0


@contextmanager
def upload_events() -> Iterator[UploadEvents]:
    """Messages on stderr and, when it is a terminal, a progress bar per W&B run (rows, rows/s, ETA).

    The bars start with the first run sent: a live display runs a thread, and upload reads
    the run in a forked child only while this process has no other thread.
    """
    from metric_core.offline.upload import UploadEvents

    if not sys.stderr.isatty():
        yield UploadEvents(message=say, spelling=as_flag)
        return
    bars: list[Any] = []

    def message(kind: str, text: str) -> None:
        if bars:
            bars[0].console.print(_line(kind, text), markup=False, highlight=False)
        else:
            say(kind, text)

    def start(run: Any, done: int) -> Callable[[int], None]:
        if not bars:
            bars.append(_progress())
            bars[0].start()
        task = bars[0].add_task(run.name, total=run.rows, completed=done)
        return lambda n: bars[0].update(task, completed=n)

    try:
        yield UploadEvents(message=message, progress=start, spelling=as_flag)
    finally:
        if bars:
            bars[0].stop()


def _progress() -> Any:
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
    return Progress(*columns, console=Console(stderr=True), transient=False)


class WatchDisplay:
    """What ``metriclog watch`` shows: on a terminal, a table of the sources redrawn in
    place after each poll; otherwise a line per change (a source seen, its state changed)."""

    def __init__(self) -> None:
        self.live: Any = None
        self.states: dict[tuple[str, int], str] = {}

    def __enter__(self) -> WatchDisplay:
        global _live
        if sys.stdout.isatty():
            from rich.live import Live

            self.live = _live = Live(auto_refresh=False, transient=False)
            self.live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        global _live
        if self.live is not None:
            self.live.stop()
            _live = None

    def poll(self, report: InspectReport) -> None:
        if self.live is not None:
            self.live.update(_watch_table(report), refresh=True)
            return
        from metric_core.clock import local_time
        from metric_core.offline.inspect.health import state_of, state_said

        for s in report.sources:
            state = state_of(s)
            if self.states.get((s.process, s.rank)) != state:
                self.states[(s.process, s.rank)] = state
                when = local_time(report.checked_at)
                print(f"{when} {s.process} (rank {s.rank}) {state_said(s)}", flush=True)

    def note(self, text: str) -> None:
        """A death, a restart, a dump: a line on stderr (above the table, on a terminal)."""
        say("note", text)

    def waiting(self, why: str) -> None:
        if self.live is not None:
            from rich.text import Text

            self.live.update(Text(f"waiting for records: {why}"), refresh=True)
        elif "waiting" not in self.states.values():
            self.states[("", -1)] = "waiting"
            say("info", f"waiting for records: {why}")


def _watch_table(report: InspectReport) -> Any:
    from rich.table import Table
    from rich.text import Text

    from metric_core.clock import duration, local_time
    from metric_core.offline.inspect.health import state_of

    table = Table(title=f"{report.name}: {local_time(report.checked_at)}", title_justify="left")
    for name in ("process", "rank", "state", "step", "silent", "step time"):
        table.add_column(name, justify="right" if name in ("rank", "step", "silent", "step time") else "left")
    styles = {
        "stalled": "bold red",
        "died": "bold red",
        "stopped_early": "red",
        "finished": "green",
        "running": "",
    }
    for s in report.sources:
        state = state_of(s)
        table.add_row(
            s.process,
            str(s.rank),
            Text(state, style=styles[state]),
            "" if s.last_step is None else str(s.last_step),
            duration(s.silent_s),
            duration(s.cadence_s) if s.cadence_s else "",
        )
    return table


class EventCommands:
    """``watch --on-stall CMD`` and ``--on-alert CMD``: says each event (a stall, an alarm:
    anything with ``told()``, ``who()`` and ``variables(run_dir)``) on stderr, and runs CMD
    once for it (a shell command, not waited for, with the event in its environment); waits
    for the commands at the end."""

    def __init__(self, command: str | None, run_dir: str, *, option: str, kind: str = "warning") -> None:
        self.command, self.run_dir, self.option, self.kind = command, run_dir, option, kind
        self.children: list[tuple[str, Any]] = []
        # On a terminal where watch redraws its table, a command's output goes through
        # this process's stderr (above the table): written straight to the terminal, it
        # would leave stale copies of the table behind.
        self.relay = False

    def __enter__(self) -> EventCommands:
        return self

    def __exit__(self, *exc: object) -> None:
        import subprocess

        for who, child in self.children:
            try:
                code = child.wait(timeout=STALL_COMMAND_WAIT_S)
            except subprocess.TimeoutExpired:
                waited = f"{STALL_COMMAND_WAIT_S:.0f} s"
                say("warning", f"{self.option} command for {who} still runs after {waited}; left running")
                continue
            if code:
                say("warning", f"{self.option} command for {who} exited with {code}")

    def run(self, event: Any) -> None:
        import subprocess

        say(self.kind, event.told())
        if self.command is None:
            return
        who = event.who()
        env = {**os.environ, **event.variables(str(self.run_dir))}
        if not self.relay:
            self.children.append((who, subprocess.Popen(self.command, shell=True, env=env)))
            return
        import threading

        child = subprocess.Popen(
            self.command, shell=True, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

        def relay() -> None:
            for line in child.stdout or ():
                say("info", line.rstrip("\n"))

        threading.Thread(target=relay, daemon=True).start()
        self.children.append((who, child))


# How long watch waits, at its end, for the --on-stall and --on-alert commands it started.
STALL_COMMAND_WAIT_S = 30.0


def print_import(result: ImportResult) -> None:
    """What ``metriclog import`` wrote, or that it was there already; what it skipped."""
    if not result.added:
        say("info", f"{result.run_dir} holds this import already (run_id {result.run_id}): nothing added")
        return
    for reason, count in sorted(result.skipped.items()):
        say("warning", f"not imported: {count:,} {reason}")
    for process, rank, records, samples in result.sources:
        said = f", {samples:,} samples" if samples else ""
        say("info", f"{process} (rank {rank}): {records:,} records{said}")
    say(
        "info",
        f"imported the {result.kind} run '{result.name}' into {result.run_dir} (run_id {result.run_id})",
    )
