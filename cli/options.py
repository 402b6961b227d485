"""The command line's option types, shared by the commands that take them."""

from __future__ import annotations

import difflib
import functools
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import PurePosixPath
from typing import Annotated, Any, TypeVar

import typer

from metric_core.errors import MetricLogError
from metric_core.metric import LoggingMode
from metric_core.metric import Reduce as Reduction
from metric_core.offline.plan import By, Engine, ReducePlan, make_plan
from metric_core.offline.results import RESULT_SUFFIXES

RunDir = Annotated[
    str,
    typer.Argument(
        metavar="RUN_DIR",
        help="Run directory holding *.parquet, *.jsonl and *.journal files: a path, or an s3://, gs://, "
        "az:// or file:// URL.",
        show_default=False,
    ),
]
FollowSymlinks = Annotated[
    bool,
    typer.Option(
        "--follow-symlinks",
        help="Also read files and directories that symlinks in RUN_DIR lead to outside it.",
    ),
]
E = TypeVar("E", bound=Enum)

# How the command line spells the Python API's parameters (``MetricLogError.text``).
FLAGS = {"keys": "--key", "share_run": "--per-rank-share-run"}


def as_flag(name: str) -> str:
    """A Python API parameter as a message on the command line names it: ``ranks`` ->
    ``--ranks `` (``MetricLogError.text``), ``keys`` -> ``--key ``."""
    return FLAGS.get(name, "--" + name.replace("_", "-")) + " "


def spelling(text: str) -> str:
    """How a choice is compared: ``GLOBAL_REDUCE``, ``global-reduce`` and ``global_reduce`` alike
    (an enum's member name, as a torchforge user writes it, or its value with ``-`` or ``_``).

    >>> spelling(" Global-Reduce ")
    'global_reduce'
    """
    return text.strip().lower().replace("-", "_")


def not_a_choice(text: str, values: list[str]) -> str:
    """The message for a value that is none of ``values``: they are named, and the near ones
    are offered ("did you mean").

    >>> not_a_choice("Sums", ["sum", "max"])
    "'Sums' is not one of sum, max; did you mean 'sum'?"
    >>> not_a_choice("PER", ["global", "per_rank", "per_step"])
    "'PER' is not one of global, per_rank, per_step; did you mean 'per_rank' or 'per_step'?"
    """
    said = spelling(text)
    near = [v for v in values if said and spelling(v).startswith(said)]
    if not near:
        spelled = {spelling(v): v for v in values}
        near = [spelled[m] for m in difflib.get_close_matches(said, list(spelled), 1)]
    hint = "; did you mean " + " or ".join(f"'{v}'" for v in near) + "?" if near else ""
    return f"'{text}' is not one of {', '.join(values)}{hint}"


# typer 0.29 keeps what an option's parser returns; before, it looks the result up among the
# enum's values (a member's str() is not one). pyproject.toml keeps typer below 0.29.
TYPER_TAKES_MEMBERS = tuple(int(part) for part in typer.__version__.split(".")[:2]) >= (0, 29)


def choice(flag: str, kind: type[E] | tuple[str, ...], help: str) -> Any:
    """An option taking one of the values of the enum ``kind`` (or of a tuple of strings),
    spelled as its value or its member name, in any case, with ``-`` or ``_`` (``--mode
    GLOBAL_REDUCE``, ``global-reduce``, ``global_reduce``); another value is said plainly,
    with the near ones, instead of pydantic's "Value error, ..."."""
    members = list(kind) if isinstance(kind, type) else []
    values = [m.value for m in members] if members else list(kind)
    by_spelling = {spelling(v): v for v in values}
    for m in members:
        by_spelling.setdefault(spelling(m.name), m.value)

    def parse(text: Any) -> Any:
        if text is None:  # an unset option without a default (typer parses defaults too)
            return None
        if members and isinstance(text, kind):
            text = text.value
        value = by_spelling.get(spelling(str(text)))
        if value is None:
            raise typer.BadParameter(not_a_choice(str(text), values))
        if members and TYPER_TAKES_MEMBERS:
            return kind(value)  # type: ignore[operator]
        return value  # typer makes it the member of the option's enum, by its value

    return typer.Option(flag, parser=parse, metavar=f"<{'|'.join(values)}>", help=help)


def _attempts(text: str) -> str:
    """``--attempts``: ``rewind`` and ``all`` spelled in any case; anything else is an attempt id."""
    keyword = spelling(text)
    return keyword if keyword in ("rewind", "all") else text


Mode = Annotated[LoggingMode, choice("--mode", LoggingMode, "Logging mode to compute.")]


EngineOpt = Annotated[
    Engine,
    choice(
        "--engine",
        Engine,
        "Where the plan runs: this machine's threads, or Ray tasks (pip install 'metriclog[ray]'); "
        "the same bits either way.",
    ),
]
RayAddress = Annotated[
    str | None,
    typer.Option(
        "--ray-address",
        metavar="ADDRESS",
        help="With --engine ray: the cluster to use (default: RAY_ADDRESS, else a local one started for the "
        "command).",
    ),
]
ByOpt = Annotated[By, choice("--by", By, "Group by training step or by wall-clock window.")]
Every = Annotated[
    str | None,
    typer.Option(
        "--every",
        metavar="DURATION",
        help="Window length with --by time: 10s, 500ms, 5m, 1h (a bare number: seconds).",
    ),
]
Reduce = Annotated[
    list[str] | None,
    typer.Option(
        "--reduce",
        metavar="PATTERN=STAT",
        help="PATTERN=STAT: reduce matching keys with STAT (mean, sum, max, min, std, "
        "count, median, pNN, first, last; pNN: numpy's linear percentile, NN from 0 to 100). "
        "Repeatable; the last match wins.",
    ),
]
Keys = Annotated[
    list[str] | None,
    typer.Option("--key", metavar="PATTERN", help="Only keys matching this glob. Repeatable."),
]
Ranks = Annotated[str | None, typer.Option("--ranks", metavar="RANKS", help="Only these ranks, e.g. 0,2-5.")]
_STEPS_HELP = (
    "Only steps START:STOP (STOP excluded), e.g. 100:200. A negative number counts back from the last "
    "step, as Python slices do: -5: is the last 5 steps, :-1 all but the last"
)
Steps = Annotated[str | None, typer.Option("--steps", metavar="START:STOP", help=_STEPS_HELP + ".")]
UploadSteps = Annotated[  # a live run has no last step yet
    str | None, typer.Option("--steps", metavar="START:STOP", help=_STEPS_HELP + " (not with --follow).")
]
Strict = Annotated[bool, typer.Option("--strict", help="Exit 1 if any record or file had to be skipped.")]


def _suffixed(*suffixes: str, stdout: bool = False) -> Callable[[str | None], str | None]:
    """A check that ``--out`` names a file of a type the command writes (before any read);
    ``stdout``: ``-`` too."""

    def check(path: str | None) -> str | None:
        if path is None or (stdout and path == "-"):
            return path
        if PurePosixPath(path).suffix.lower() not in suffixes:
            also = " (or - for stdout)" if stdout else ""
            raise typer.BadParameter(f"'{path}': name a file ending in {', '.join(suffixes)}{also}")
        return path

    return check


OutFile = Annotated[
    str | None,
    typer.Option(
        "--out",
        metavar="FILE",
        callback=_suffixed(*RESULT_SUFFIXES, stdout=True),
        help="Write to FILE.parquet, .csv, .json or .jsonl (folders are created; an s3://, gs:// or az:// "
        "URL is written whole at the end); - writes to stdout in --format (CSV by default).",
    ),
]


class Format(str, Enum):
    TABLE = "table"
    CSV = "csv"
    JSON = "json"
    JSONL = "jsonl"


FormatOpt = Annotated[
    Format | None,
    choice(
        "--format",
        Format,
        "How rows go to stdout: table (the default on a terminal), csv (the default into a pipe), "
        "json (one array of objects, a row each) or jsonl (an object a line). Every format but table "
        "prints every row.",
    ),
]
Limit = Annotated[int | None, typer.Option("--limit", metavar="N", min=0, help="Only the first N rows.")]
Tail = Annotated[int | None, typer.Option("--tail", metavar="N", min=0, help="Only the last N rows.")]


def rows(limit: int | None, tail: int | None, out: str | None = None, form: Format | None = None) -> None:
    """``--limit`` and ``--tail`` exclude each other; ``--format`` is stdout's, and a file's
    format comes from its suffix. Rows for a stdout the process started without (``>&-``)
    are refused before any read: they would go to no one."""
    from .start import STARTED_CLOSED

    if limit is not None and tail is not None:
        raise typer.BadParameter("give --limit or --tail, not both")
    if form is not None and out not in (None, "-"):
        raise typer.BadParameter(
            f"--format chooses what goes to stdout; --out {out} writes by its suffix: give one of them",
            param_hint="--format",
        )
    if out in (None, "-") and "stdout" in STARTED_CLOSED:  # after the usage errors (exit 2)
        raise MetricLogError(
            "standard output is closed (>&-): the rows would go to no one; write them to a file "
            "with --out FILE, or send stdout to a pipe or a file"
        )


Attempts = Annotated[
    str,
    typer.Option(
        "--attempts",
        metavar="rewind|all|ID",
        parser=_attempts,
        help="A restarted source's attempts: rewind (a restart replaces the records from its first "
        "step on), all (keep every attempt), or an attempt id (only it).",
    ),
]
Wide = Annotated[bool, typer.Option("--wide", help="One row per step (per source), one column per key.")]

# upload, plot, compare and diff
Runs = Annotated[
    list[str],
    typer.Argument(
        metavar="RUN...",
        help="Run directories, each a path or an s3://, gs://, az:// or file:// URL; a quoted glob "
        "('runs/seed*') is expanded here, and @FILE reads one run a line.",
        show_default=False,
    ),
]
RunA = Annotated[str, typer.Argument(metavar="RUN_A", help="The first run directory.", show_default=False)]
RunB = Annotated[str, typer.Argument(metavar="RUN_B", help="The run compared with it.", show_default=False)]
Across = Annotated[
    str | None,
    typer.Option(
        "--across",
        metavar="STATS",
        help="Statistics across the runs, comma-separated: mean, std (population: divided by n), "
        "std_sample (sample: divided by n-1), stderr (std_sample/sqrt(n)), min, max, median, count (the "
        "runs holding the row) [default: all of them].",
    ),
]
GroupBy = Annotated[
    str | None,
    typer.Option(
        "--group-by",
        metavar="KEY",
        help="A group of runs per exact value of this dotted key of run.json (config.lr), in a column "
        "so named.",
    ),
]
KeepMissing = Annotated[
    bool,
    typer.Option("--keep-missing", help="With --group-by: runs without the key form a group of their own."),
]
Labels = Annotated[
    list[str] | None,
    typer.Option(
        "--label",
        metavar="NAME",
        help="Name the runs: one --label a run, in their order [default: each run directory's name].",
    ),
]
Common = Annotated[bool, typer.Option("--common", help="Only the rows every run of the group holds.")]
Rtol = Annotated[
    float | None,
    typer.Option(
        "--rtol",
        metavar="R",
        min=0.0,
        help="Equal when |a-b| <= max(atol, R*max(|a|,|b|)) [default: equal bit for bit; NaN equals NaN].",
    ),
]
Atol = Annotated[
    float | None,
    typer.Option("--atol", metavar="A", min=0.0, help="Equal when |a-b| <= A (with --rtol: the larger)."),
]
Band = Annotated[
    str,
    choice(
        "--band",
        ("std", "stderr", "minmax"),
        "With several runs: the band around each group's mean: std (mean ± population std), stderr "
        "(mean ± standard error) or minmax (lowest to highest run).",
    ),
]
DiffFormat = Annotated[
    str | None,
    choice(
        "--format", ("table", "json"), "table (the default) or json: the whole report as one JSON object."
    ),
]

# upload
Project = Annotated[
    str | None, typer.Option("--project", metavar="PROJECT", help="W&B project (needed with --to wandb).")
]


class To(str, Enum):
    WANDB = "wandb"
    TENSORBOARD = "tensorboard"
    MLFLOW = "mlflow"


ToOpt = Annotated[
    To,
    choice(
        "--to",
        To,
        "Where the runs go: W&B (the default), TensorBoard event files under --logdir, or an MLflow "
        "tracking store (--tracking-uri, --experiment).",
    ),
]
Logdir = Annotated[
    str | None,
    typer.Option("--logdir", metavar="DIR", help="With --to tensorboard: the folder TensorBoard reads."),
]
TrackingUri = Annotated[
    str | None,
    typer.Option(
        "--tracking-uri",
        metavar="URI",
        help="MLflow's tracking store: where upload and compare --to mlflow write, where import reads "
        "[default: MLFLOW_TRACKING_URI, else sqlite:///mlruns.db].",
    ),
]
Experiment = Annotated[
    str | None,
    typer.Option(
        "--experiment", metavar="NAME", help="With --to mlflow: the experiment [default: metriclog]."
    ),
]


def destination(
    to: To,
    project: str | None,
    entity: str | None,
    offline: bool,
    connect_timeout: float | None,
    logdir: str | None,
    tracking_uri: str | None = None,
    experiment: str | None = None,
) -> Any:
    """``upload_run``'s ``to`` from upload's options; an option of another destination is a
    usage error."""
    from pathlib import Path

    from metric_core.offline.upload import MLflow, TensorBoard, WandB

    given = {
        "--project": project, "--entity": entity, "--offline": offline or None,
        "--connect-timeout": connect_timeout, "--logdir": logdir, "--tracking-uri": tracking_uri,
        "--experiment": experiment,
    }  # fmt: skip
    owner = {"--logdir": To.TENSORBOARD, "--tracking-uri": To.MLFLOW, "--experiment": To.MLFLOW}
    for flag, value in given.items():
        if value is not None and owner.get(flag, To.WANDB) is not to:
            whose = owner.get(flag, To.WANDB)
            if whose is To.WANDB:
                raise typer.BadParameter(f"{flag} is W&B's: not with --to {to.value}", param_hint=flag)
            raise typer.BadParameter(f"{flag} works only with --to {whose.value}", param_hint=flag)
    if to is To.TENSORBOARD:
        if logdir is None:
            raise typer.BadParameter("--to tensorboard writes under --logdir DIR: give it", param_hint="--to")
        return TensorBoard(Path(logdir))
    if to is To.MLFLOW:
        return MLflow(tracking_uri, experiment or "metriclog")
    if project is None:
        raise typer.BadParameter("name the W&B project: --project P", param_hint="--project")
    os.environ.setdefault("WANDB_SILENT", "true")  # wandb's own messages are not the command's
    os.environ.setdefault("WANDB_CONSOLE", "off")
    if connect_timeout is None:
        return WandB(project, entity, offline)
    return WandB(project, entity, offline, connect_timeout=connect_timeout)


# compare --to
CompareTo = Annotated[
    To | None,
    choice(
        "--to",
        To,
        "Send the result, instead of printing it, to W&B, TensorBoard event files under --logdir, or an "
        "MLflow tracking store: a run of its own per group, tagged with the runs it came from "
        "(docs/compare.md).",
    ),
]


def sent_to(to: To | None, printed: dict[str, Any], *where: Any) -> Any:
    """compare's destination (``destination`` of ``where``: its options), or None without
    ``--to``, when its options are a usage error; with ``--to``, the options that choose how
    the result is printed (``printed``) are one too."""
    if to is None:
        given = [flag for flag, value in zip(DESTINATION_FLAGS, where, strict=True) if value]
        if given:
            raise typer.BadParameter(f"{given[0]} works only with --to", param_hint=given[0])
        return None
    shown = [flag for flag, value in printed.items() if value not in (None, False)]
    if shown:
        raise typer.BadParameter(
            f"{shown[0]} chooses how the result is printed, and --to sends it: give one of them",
            param_hint=shown[0],
        )
    return destination(to, *where[:-2])


# destination's options and compare's --dry-run and --force-new, in sent_to's order
DESTINATION_FLAGS = (
    "--project", "--entity", "--offline", "--connect-timeout", "--logdir", "--tracking-uri", "--experiment",
    "--dry-run", "--force-new",
)  # fmt: skip


Entity = Annotated[str | None, typer.Option("--entity", metavar="ENTITY", help="W&B entity (team or user).")]
Group = Annotated[
    str | None,
    typer.Option("--group", metavar="GROUP", help="W&B group of a per-rank mode's runs [default: --name]."),
]
Name = Annotated[
    str | None, typer.Option("--name", metavar="NAME", help="Run name [default: the run directory's name].")
]
ShareRun = Annotated[
    bool, typer.Option("--per-rank-share-run", help="Per-rank modes: one shared run, keys {key}/{process}.")
]
Offline = Annotated[
    bool, typer.Option("--offline", help="Write W&B offline runs, to sync later with `wandb sync`.")
]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Print the runs, rows and keys; upload nothing.")]
ForceNew = Annotated[bool, typer.Option("--force-new", help="Upload finished runs again under fresh ids.")]

# inspect and plot
Json = Annotated[
    bool, typer.Option("--json", help="Print the report as one JSON object instead of the table.")
]
KeysJson = Annotated[
    bool,
    typer.Option("--json", help="Print the rows as one JSON array of objects, a key each (--format json)."),
]
InspectFormat = Annotated[
    Format | None,
    choice(
        "--format",
        Format,
        "table (the report, the default), json (the report as one JSON object, as --json), or "
        "csv/jsonl: the per-source table, a row a source.",
    ),
]
PlotKeys = Annotated[
    list[str], typer.Option("--key", metavar="PATTERN", help="Keys to plot (glob). Repeatable.")
]
PngFile = Annotated[
    str,
    typer.Option(
        "--out",
        metavar="FILE",
        callback=_suffixed(".png", ".svg", ".pdf"),
        help="Where to write the plot: FILE.png, .svg or .pdf (folders are created; an s3://, gs:// or "
        "az:// URL is written whole at the end).",
    ),
]
Smooth = Annotated[
    float,
    typer.Option(
        "--smooth",
        metavar="W",
        min=0.0,
        max=0.999,
        help="Smooth each line as TensorBoard's slider does (W: the weight of the past, 0 to 0.999); the "
        "line as recorded stays, faint.",
    ),
]


# The plan's options, declared once (sqlite-utils' ``output_options`` is the model): each
# one's type (flag, help) and default, and which commands take which. A command takes its
# share as one parameter, ``plan_options: PlanOptions = PLAN_DEFAULTS``, and ``@plan_options("reduce")``
# puts the options in its place (tests/test_cli_options.py holds this).
PLAN_OPTIONS: dict[str, tuple[Any, Any]] = {
    "mode": (Mode, LoggingMode.GLOBAL_REDUCE),
    "by": (ByOpt, By.STEP),
    "every": (Every, None),
    "reduce": (Reduce, None),
    "key": (Keys, None),
    "ranks": (Ranks, None),
    "steps": (Steps, None),
    "attempts": (Attempts, "rewind"),
}
_EVERY_PLAN_OPTION = tuple(PLAN_OPTIONS)
COMMAND_PLAN_OPTIONS: dict[str, tuple[str, ...]] = {
    "reduce": _EVERY_PLAN_OPTION,
    "upload": _EVERY_PLAN_OPTION,
    "compare": _EVERY_PLAN_OPTION,
    "diff": _EVERY_PLAN_OPTION,
    "plot": ("mode", "by", "every", "reduce", "ranks", "steps", "attempts"),  # its --key: PlotKeys
    "keys": ("key", "attempts"),
    "samples": ("key", "steps", "ranks"),
    "inspect": ("attempts",),
    "watch": ("attempts",),
}
# A plan option whose help a command words its own way (the same option otherwise).
OWN_HELP: dict[tuple[str, str], Any] = {("upload", "steps"): UploadSteps}
# A plan option's flag that a command takes in another sense, declared apart on purpose.
OTHER_MEANINGS: dict[tuple[str, str], str] = {
    ("plot", "--key"): "the keys to plot (PlotKeys): required",
    ("samples", "--by"): "the field samples are ranked by (By_)",
    ("samples", "--attempts"): "rewind or all, no attempt id (SampleAttempts)",
    ("import", "--reduce"): "the reduction imported records carry (ImportReduce)",
}


@dataclass(frozen=True)
class PlanOptions:
    """The plan options a command took (those it does not take keep their defaults)."""

    mode: LoggingMode = LoggingMode.GLOBAL_REDUCE
    by: By = By.STEP
    every: str | None = None
    reduce: list[str] | None = None
    key: list[str] | None = None
    ranks: str | None = None
    steps: str | None = None
    attempts: str = "rewind"

    def plan(self, *, keys: list[str] | None = None) -> ReducePlan:
        """The plan they ask for (``keys``: a command's own --key, plot's); bad syntax raises
        ``PlanError`` (a usage error)."""
        return make_plan(
            mode=self.mode,
            by=self.by,
            every=self.every,
            reduce=self.reduce or (),
            keys=(self.key if keys is None else keys) or (),
            ranks=self.ranks or (),
            steps=self.steps,
            attempts=self.attempts,
        )


PLAN_DEFAULTS = PlanOptions()  # what a command's ``plan_options`` stands for until decorated
F = TypeVar("F", bound=Callable[..., Any])


def plan_options(command: str) -> Callable[[F], F]:
    """A command's plan options (``COMMAND_PLAN_OPTIONS[command]``), in the place of its
    ``plan_options`` parameter, handed to it as one ``PlanOptions``."""
    names = COMMAND_PLAN_OPTIONS[command]

    def decorate(func: F) -> F:
        signature = inspect.signature(func, eval_str=True)
        params: list[inspect.Parameter] = []
        for param in signature.parameters.values():
            if param.name != "plan_options":
                params.append(param)
                continue
            for name in names:
                kind, default = PLAN_OPTIONS[name]
                kind = OWN_HELP.get((command, name), kind)
                params.append(inspect.Parameter(name, param.kind, default=default, annotation=kind))

        @functools.wraps(func)
        def command_with_plan_options(**given: Any) -> Any:
            taken = PlanOptions(**{name: given.pop(name) for name in names})
            return func(plan_options=taken, **given)

        command_with_plan_options.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        command_with_plan_options.__annotations__ = {p.name: p.annotation for p in params}
        return command_with_plan_options  # type: ignore[return-value]

    return decorate


# samples
Top = Annotated[
    int, typer.Option("--top", metavar="N", min=0, help="Per step, the N samples highest by --by.")
]
Bottom = Annotated[
    int, typer.Option("--bottom", metavar="N", min=0, help="Per step, the N samples lowest by --by.")
]
By_ = Annotated[
    str | None,
    typer.Option(
        "--by",
        metavar="FIELD",
        help="The field --top and --bottom rank by (samples where it is missing or NaN are left out).",
    ),
]
Random = Annotated[
    int,
    typer.Option(
        "--random", metavar="N", min=0, help="Per step, N samples at random (numpy's default_rng(--seed))."
    ),
]
Seed = Annotated[int, typer.Option("--seed", metavar="S", help="The seed of --random.")]
SampleAttempts = Annotated[
    str,
    choice(
        "--attempts",
        ("rewind", "all"),
        "A restarted source's attempts: rewind (a restart replaces the samples from its first "
        "step on) or all.",
    ),
]


# upload's samples
SampleTop = Annotated[
    int | None,
    typer.Option(
        "--sample-top", metavar="N", min=0, help="Samples per step and key: N highest by --sample-by."
    ),
]
SampleBottom = Annotated[
    int | None, typer.Option("--sample-bottom", metavar="N", min=0, help="... and N lowest by --sample-by.")
]
SampleBy = Annotated[
    str | None,
    typer.Option("--sample-by", metavar="FIELD", help="The field samples rank by (default: reward)."),
]
SampleRandom = Annotated[
    int | None,
    typer.Option("--sample-random", metavar="N", min=0, help="Samples per step and key: N at random."),
]
SampleSeed = Annotated[
    int, typer.Option("--sample-seed", metavar="S", help="The seed of the random samples.")
]
NoSamples = Annotated[bool, typer.Option("--no-samples", help="Upload no samples (Reduce.SAMPLE).")]


class SampleTables(str, Enum):
    PER_STEP = "per-step"
    INCREMENTAL = "incremental"


SampleTablesOpt = Annotated[
    SampleTables,
    choice(
        "--sample-tables",
        SampleTables,
        "How samples go to W&B: per-step (a table a step and key, in that step's row; the default) or "
        "incremental (torchforge's shape: one INCREMENTAL table {key}_table a key that each step adds "
        "its samples to, and an IMMUTABLE table of them all under the key when the run finishes). "
        "Incremental tables need a recent W&B server (W&B Server 0.70 or later; wandb.ai has them).",
    ),
]


def sample_choice(
    top: int | None,
    bottom: int | None,
    by: str | None,
    random: int | None,
    seed: int,
    none: bool,
    tables: SampleTables = SampleTables.PER_STEP,
) -> Any:
    """upload's sample options as a ``SampleChoice``."""
    from metric_core.offline.samples import SampleChoice

    if random is not None and (top is not None or bottom is not None):
        raise typer.BadParameter("give --sample-top/--sample-bottom or --sample-random, not both")
    return SampleChoice(
        top=top, bottom=bottom, by=by, random=random, seed=seed, enabled=not none, tables=tables.value
    )


# inspect
def _duration(least: float) -> Any:
    """A parser of a duration option (``10s``, ``500ms``, ``2m``; a plain number is seconds)."""

    def parse(text: str) -> float:
        from metric_core.errors import PlanError
        from metric_core.offline.plan import parse_duration

        try:
            seconds = parse_duration(text)
        except PlanError:
            raise typer.BadParameter(f"{text!r} is not a duration like 10s, 500ms, 5m or 1h") from None
        if seconds < least:
            raise typer.BadParameter(f"{text!r} is shorter than {least:g} s")
        return seconds

    return parse


PauseAfter = Annotated[
    float | None,
    typer.Option(
        "--pause-after",
        metavar="DURATION",
        parser=_duration(1.0),
        help="A source that takes no step for this long is paused (default: 10 s, or 10 times its step "
        "time if longer; a plain number is seconds, at least 1). Steps are timed to the second in "
        "sealed files.",
    ),
]


# watch
Interval = Annotated[
    float,
    typer.Option("--interval", metavar="SECONDS", min=0.05, help="Seconds between two looks at the run."),
]
OnStall = Annotated[
    str | None,
    typer.Option(
        "--on-stall",
        metavar="CMD",
        help="Run CMD (a shell command) once per stall (the sources that went silent together), with "
        "METRICLOG_PROCESS, METRICLOG_RANK and METRICLOG_WHERE (the rank the others wait for; empty when "
        "none stands apart), METRICLOG_PROCESSES (all of them, it first), METRICLOG_LAST_STEP, "
        "METRICLOG_SILENT_S, METRICLOG_STACKS (stack dumps, when any) and METRICLOG_RUN_DIR.",
    ),
]
StallAfter = Annotated[
    float | None,
    typer.Option(
        "--stall-after",
        metavar="DURATION",
        parser=_duration(0.1),
        help="A live source silent this long is stalled (default: 10 s, 10 times its step time, or twice "
        "its longest pause, whichever is longest; a plain number is seconds).",
    ),
]
ExitOnStall = Annotated[
    bool, typer.Option("--exit-on-stall", help="Stop at the first stall, with exit code 3.")
]


Alert = Annotated[
    list[str] | None,
    typer.Option(
        "--alert",
        metavar="RULE",
        help="Alarm on values (repeatable): 'KEY: nonfinite', 'KEY > X', 'KEY < X', 'KEY: drop X% over N "
        "steps', 'KEY: spike K sigma' (KEY: a pattern as --key takes it). One alarm per episode.",
    ),
]
AlertOn = Annotated[
    str | None,
    choice(
        "--alert-on",
        ("raw", "global"),
        "Judge each step's global reduction once every live rank flushed it (global, the default), "
        "or every raw value of every rank as it lands (raw).",
    ),
]
OnAlert = Annotated[
    str | None,
    typer.Option(
        "--on-alert",
        metavar="CMD",
        help="Run CMD (a shell command) once per alarm, with METRICLOG_KEY, METRICLOG_STEP, METRICLOG_VALUE, "
        "METRICLOG_PROCESS and METRICLOG_RANK (the first rank it was seen on, when known), METRICLOG_RULE "
        "and METRICLOG_RUN_DIR.",
    ),
]


# upload --follow
FOLLOW_INTERVAL = 2.0  # upload's --interval default
FollowOpt = Annotated[
    bool,
    typer.Option(
        "--follow",
        help="Upload the run while its job writes it, and end when every source shut down, or every "
        "source finished or died and no restart came within --restart-grace (docs/live.md). Every other "
        "option works with it.",
    ),
]
UntilIdle = Annotated[
    str | None,
    typer.Option(
        "--until-idle",
        metavar="DURATION",
        help="With --follow: also end once nothing was written for DURATION (10s, 5m; a plain number is "
        "seconds), uploading everything.",
    ),
]
Sources = Annotated[
    int | None,
    typer.Option(
        "--sources",
        metavar="N",
        min=1,
        help="With --follow: no global step or window is complete before N sources wrote "
        "(default: run.json's world_size).",
    ),
]


LetGoAfter = Annotated[
    str | None,
    typer.Option(
        "--let-go-after",
        metavar="DURATION",
        help="With --follow: a live source silent for DURATION, or a rank that has not written DURATION "
        "after the first record, stops holding the global steps (by default it holds them until it steps, "
        "dies or finishes). If it writes again, the runs are written anew.",
    ),
]
RestartGrace = Annotated[
    str,
    typer.Option(
        "--restart-grace",
        metavar="DURATION",
        help="Once every source finished or died, wait this long for the job to be restarted (a new "
        "attempt) before ending (0: end at once).",
    ),
]
FollowRestartGrace = Annotated[
    str,
    typer.Option(
        "--restart-grace",
        metavar="DURATION",
        help="With --follow: once every source finished or died, wait this long for the job to be "
        "restarted (a new attempt) before ending (0: end at once), and as long for ranks of world_size "
        "that never wrote.",
    ),
]
RESTART_GRACE = "60s"


Wait = Annotated[
    bool,
    typer.Option(
        "--wait",
        help="Wait for RUN_DIR to be created (the job may not have started); without it, a path that "
        "does not exist is an error.",
    ),
]


ConnectTimeout = Annotated[
    float | None,
    typer.Option(
        "--connect-timeout",
        metavar="SECONDS",
        min=0.5,
        help="How long W&B may take to start a run before it is called unreachable (default 10).",
    ),
]


def follow(
    on: bool,
    interval: float,
    until_idle: str | None,
    sources: int | None,
    let_go_after: str | None = None,
    restart_grace: str = RESTART_GRACE,
    wait: bool = False,
    alerts: Any = None,
) -> Any:
    """``upload_run``'s ``follow``, or None without ``--follow`` (its options alone are a usage error);
    ``alerts``: the ``--alert`` rules' ``Alarms``, or None."""
    from metric_core.offline.plan import parse_duration
    from metric_core.offline.upload import Follow

    if not on:
        given = [
            f
            for f, v in (
                ("--until-idle", until_idle),
                ("--sources", sources),
                ("--let-go-after", let_go_after),
            )
            if v is not None
        ]
        given += ["--interval"] if interval != FOLLOW_INTERVAL else []
        given += ["--wait"] if wait else []
        given += ["--restart-grace"] if restart_grace != RESTART_GRACE else []
        given += ["--alert"] if alerts is not None else []
        if given:
            verb = "works" if len(given) == 1 else "work"
            raise typer.BadParameter(f"{' and '.join(given)} {verb} only with --follow", param_hint=given[0])
        return None
    idle = parse_duration(until_idle, option="until_idle") if until_idle is not None else None
    let_go = parse_duration(let_go_after, option="let_go_after") if let_go_after is not None else None
    grace_s = grace(restart_grace)
    return Follow(
        interval=interval,
        until_idle=idle,
        sources=sources,
        let_go_after=let_go,
        restart_grace=grace_s,
        wait=wait,
        alarms=alerts,
    )


def alarms(rules: list[str] | None, on: str | None, on_alert: str | None) -> Any:
    """``--alert`` and ``--alert-on`` as ``Alarms``, or None without a rule (then ``--alert-on``
    or ``--on-alert`` is an error: it would never be used)."""
    from metric_core.offline.alerts import FORMS, Alarms, AlertRuleError, parse_rule

    if not rules:
        given = "--alert-on" if on is not None else "--on-alert" if on_alert is not None else None
        if given is not None:
            raise AlertRuleError(f"{given} works only with --alert: add --alert RULE (one of {FORMS})")
        return None
    return Alarms([parse_rule(r) for r in rules], on=on or "global")


def grace(restart_grace: str) -> float:
    """``--restart-grace`` in seconds (0 allowed: end at once)."""
    from metric_core.offline.plan import parse_duration

    return (
        0.0 if restart_grace.strip() in ("0", "0s") else parse_duration(restart_grace, option="restart_grace")
    )


# import: where a run another tool logged is read from, and how
Source = Annotated[
    str,
    typer.Argument(
        metavar="SRC",
        help="A TensorBoard event file or a folder of them, a W&B offline run (offline-run-* or its "
        "run-*.wandb), a .csv, .jsonl or .parquet export, or mlflow (with --tracking-uri and --experiment "
        "or --run-id).",
        show_default=False,
    ),
]
ImportDir = Annotated[
    str,
    typer.Argument(
        metavar="RUN_DIR",
        help="The run directory to write (new, or holding this import).",
        show_default=False,
    ),
]
ImportReduce = Annotated[
    str,
    choice(
        "--reduce",
        tuple(r.value for r in Reduction if r is not Reduction.SAMPLE),
        "The reduction every imported record carries (reduce can choose another per key).",
    ),
]
StepCol = Annotated[
    str, typer.Option("--step-col", metavar="COLUMN", help="CSV/JSONL/Parquet: the step column.")
]
TimeCol = Annotated[
    str | None,
    typer.Option(
        "--time-col",
        metavar="COLUMN",
        help="CSV/JSONL/Parquet: the wall-time column, epoch seconds [default: the file's modification "
        "time].",
    ),
]
KeyCol = Annotated[
    str | None,
    typer.Option(
        "--key-col",
        metavar="COLUMN",
        help="CSV/JSONL/Parquet in long form: the column naming the metric (with --value-col) [default: wide "
        "form, every other numeric column a metric].",
    ),
]
ValueCol = Annotated[
    str | None, typer.Option("--value-col", metavar="COLUMN", help="Long form: the column of the values.")
]
SourceExperiment = Annotated[
    str | None,
    typer.Option("--experiment", metavar="NAME", help="MLflow: import every run of this experiment."),
]
MlflowRunId = Annotated[str | None, typer.Option("--run-id", metavar="ID", help="MLflow: import this run.")]
