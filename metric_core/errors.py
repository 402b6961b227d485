"""The exceptions metric_core raises on purpose. Every one derives from MetricLogError.

The command line maps them by type: ``PlanError`` is a usage error (exit 2), every other
``MetricLogError`` means the data or the request could not be served (exit 1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Option:
    """An option of the API a message names: ``ranks`` (``flag``: given without a value)."""

    name: str
    flag: bool = False


class Message(str):
    """Text that names options, kept as its parts (text, and ``Option``) so that each
    caller says them in its own words: the library ``ranks=``, the command line
    ``--ranks `` (``text(spelling)``). As a ``str`` it is the library's wording.

    Built with ``opt`` and ``+`` (``"give " + opt("ranks") + "'0-3'"``), never by
    formatting: an f-string or ``str.join`` gives the library's wording, and the parts are
    gone (``Message.joined`` keeps them).
    """

    parts: tuple[str | Option, ...]

    def __new__(cls, *parts: str | Option) -> Message:
        flat: list[str | Option] = []
        for part in parts:
            if isinstance(part, Message):
                flat.extend(part.parts)
            elif isinstance(part, Option):
                flat.append(part)
            else:
                flat.append(str(part))
        message = super().__new__(cls, _spelled(flat, as_keyword))
        message.parts = tuple(flat)
        return message

    def text(self, spelling: Callable[[str], str]) -> str:
        """The message, each option it names spelled by ``spelling`` (``as_keyword``, ``as_flag``)."""
        return _spelled(self.parts, spelling)

    def __add__(self, other: object) -> Message:
        return Message(self, other) if isinstance(other, str) else NotImplemented

    def __radd__(self, other: object) -> Message:
        return Message(other, self) if isinstance(other, str) else NotImplemented

    def __reduce__(self) -> Any:  # pickled with its parts (upload's reading child, Ray)
        return (Message, self.parts)

    @staticmethod
    def joined(separator: str, items: Iterable[str]) -> Message:
        """``separator.join(items)``, keeping the options the items name."""
        parts: list[str | Option] = []
        for i, item in enumerate(items):
            if i:
                parts.append(separator)
            parts.append(item)
        return Message(*parts)


def opt(name: str, *, flag: bool = False) -> Message:
    """Where a message names the option ``name`` (``flag``: given without a value)."""
    return Message(Option(name, flag))


def as_keyword(name: str) -> str:
    return f"{name}="


def spell_options(text: str, spelling: Callable[[str], str]) -> str:
    """``text`` with the options it names spelled by ``spelling`` (a plain ``str`` names
    none); a flag as ``option=True`` in Python, ``--option`` on the command line."""
    return text.text(spelling) if isinstance(text, Message) else str(text)


def _spelled(parts: Iterable[str | Option], spelling: Callable[[str], str]) -> str:
    out = []
    for part in parts:
        if isinstance(part, Option):
            said = spelling(part.name)
            if part.flag:
                said = said + "True" if said.endswith("=") else said.rstrip()
            out.append(said)
        else:
            out.append(part)
    return "".join(out)


class MetricLogError(Exception):
    """Root of every error metriclog raises on purpose; the CLI maps it to exit code 1.

    A message that names options (a ``Message``) is kept as ``template``, so each caller
    can say it in its own words: ``text(spelling)``.
    """

    template: Message | None = None

    def __init__(self, *args: Any) -> None:
        if len(args) == 1 and isinstance(args[0], Message):
            self.template = args[0]
            args = (str(args[0]),)
        super().__init__(*args)

    def text(self, spelling: Callable[[str], str]) -> str:
        """The message, with the options it names spelled by ``spelling``."""
        return str(self) if self.template is None else self.template.text(spelling)

    # What the reader skipped before this error, when it came after a run was read in
    # another process (upload's reading child): the caller says it before the error.
    read_summary: str = ""

    def __reduce__(self) -> Any:
        # Picklable whatever the subclass's __init__ takes: the upload reads its run in a
        # child process, and an error there is raised again in the parent.
        return (_restore, (type(self), self.args, self.__dict__))


def _restore(cls: type[MetricLogError], args: tuple[Any, ...], state: dict[str, Any]) -> MetricLogError:
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class NotInitializedError(MetricLogError):
    """record_metric or flush was called before metric_core.init(), or after the
    shutdown() that ended it; ``ended`` names what that shutdown ended (None: no init yet)."""

    def __init__(self, what: str, *, ended: str | None = None) -> None:
        self.what, self.ended = what, ended
        if ended is None:
            super().__init__(
                f"{what} was called before metric_core.init(run_dir): "
                "call metric_core.init() once per process before recording metrics."
            )
        else:
            super().__init__(
                f"{what} was called after metric_core.shutdown() ended the recording of {ended}: "
                "call metric_core.init(run_dir) again to record more (it starts a new attempt of "
                "the source)."
            )


class NonFiniteError(MetricLogError, ValueError):
    """``record_metric`` of a NaN or an infinity under ``init(on_nonfinite="raise")``, for a
    key ``nonfinite_keys`` matches: raised after the value is recorded (it is written)."""

    def __init__(self, key: str, value: float, step: int) -> None:
        self.key, self.value, self.step = key, value, step
        super().__init__(
            f"metric '{key}' is {value} at step {step} (init(on_nonfinite='raise'); the value is recorded "
            "and written: flush() or shutdown() as the job ends)"
        )


class ConfigError(MetricLogError):
    """A backend or writer configuration that cannot work, with what to do instead."""


class NoDataError(MetricLogError):
    """A run directory (or a filtered selection of it) holds no readable record. ``over``:
    its writers' attempts all ended before recording one ("finished": each shut down
    cleanly; "died": one did not), None where that is not known (or one still runs)."""

    def __init__(self, where: str, why: str, over: str | None = None) -> None:
        self.where = where
        self.over = over
        super().__init__(f"no readable metric record in {where}: " + why)


class FilteredOutError(NoDataError):
    """The run has records, but the filters (keys, ranks, steps) left none: ``why`` names them."""

    def __init__(self, where: str, why: str) -> None:
        self.where = where
        MetricLogError.__init__(self, f"no record in {where} matches the filters" + why)


class NoSamplesError(NoDataError):
    """A run directory holds no sample (``Reduce.SAMPLE``) to list: ``why`` says what it holds."""

    def __init__(self, where: str, why: str) -> None:
        self.where = where
        MetricLogError.__init__(self, f"no sample (Reduce.SAMPLE) in {where}: " + why)


class UnknownReductionError(MetricLogError):
    """Records carry a reduction metriclog does not know; ``keys`` maps each such key to it."""

    def __init__(self, keys: dict[str, str]) -> None:
        self.keys = keys
        shown = ", ".join(f"'{k}' ({r!r})" for k, r in list(keys.items())[:5])
        more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
        first = next(iter(keys))
        super().__init__(
            f"key(s) recorded with a reduction metriclog does not know: {shown}{more}; choose a "
            f"statistic for each, e.g. " + opt("reduce") + f"'{first}=mean'"
        )


class StrictModeError(MetricLogError):
    """--strict was given and the reader skipped records or files; ``summary`` says which."""

    def __init__(self, summary: str) -> None:
        self.summary = summary
        super().__init__(opt("strict", flag=True) + ": records or files were skipped (see above)")


class PlanError(MetricLogError):
    """A request that cannot be turned into a plan (bad statistic, pattern, range): a usage error.

    ``option`` is the parameter at fault as the Python API names it (``ranks``), ``value``
    what it was given, and ``message`` what is wrong with it, as a predicate:
    ``ranks='1-x' is not ...`` in Python, ``--ranks '1-x' is not ...`` on the command line.
    """

    def __init__(self, message: str, *, option: str | None = None, value: object = None) -> None:
        self.message, self.option, self.value = message, option, value
        if option is None:
            super().__init__(message)
        else:  # a flag given, or an option's value
            where = opt(option, flag=True) if value is True else opt(option) + repr(value)
            super().__init__(where + " " + message)


class UnmatchedError(MetricLogError):
    """Strict reading, and a filter or ``reduce`` pattern matched no record (``notes`` say which)."""

    def __init__(self, notes: list[PlanError]) -> None:
        self.notes = notes
        super().__init__(
            opt("strict", flag=True) + ": " + Message.joined("; ", (n.template or str(n) for n in notes))
        )


class RequestError(MetricLogError):
    """A well-formed request this run cannot serve: too many keys to plot, an output of unknown type."""


class SourceError(MetricLogError):
    """``metriclog import``: a source that cannot be read (missing, of no known kind, or
    damaged beyond reading), or a run directory that holds another run; the message names
    the file and what to do."""


class MissingDependencyError(MetricLogError):
    """An optional package a feature needs is not installed; the message names the install."""


class CollectorClosedError(MetricLogError):
    """A collector was used after ``shutdown()``."""


class UnsafePathError(MetricLogError):
    """metriclog would have to write through a symlink it did not make."""


class RunChangedError(MetricLogError):
    """A file of the run changed (or vanished) between the check of it and the query over it."""


class StorageError(MetricLogError):
    """Object storage refused or could not serve a request: a missing bucket, credentials
    missing or refused, an endpoint that does not answer (the message says which)."""


class UploadError(MetricLogError):
    """W&B could not be reached or refused the upload; the ledger says what was sent."""


class DamagedRunJsonError(UploadError):
    """run.json is damaged (not JSON, or its fields fail its checksum): an upload takes the
    run's identity from its ``run_id`` and refuses to make up another."""

    def __init__(self, path: str, why: str) -> None:
        self.path = path
        super().__init__(
            f"{path}: {why}. An upload derives its run ids from run.json's run_id, and does not make "
            "up another identity (the runs of earlier uploads would not be found, and the run would "
            "be uploaded again beside them). Restore run.json from a copy; or, if it was edited on "
            'purpose and its run_id is still the run\'s, make it valid JSON without its "checksum" field'
        )


class NotLoggedInError(UploadError):
    """An online upload without W&B credentials."""

    def __init__(self) -> None:
        super().__init__(
            "not logged in to W&B: run `wandb login` (or set WANDB_API_KEY), "
            "or write offline runs with --offline and `wandb sync` them later"
        )


class WriteError(MetricLogError):
    """Records could not be made durable. They stay in memory and are written at the next try.

    ``path`` is the file or directory that failed, ``kept`` how many records wait in memory.
    """

    def __init__(self, message: str, *, path: str, kept: int = 0) -> None:
        self.path = path
        self.kept = kept
        super().__init__(message)


class DiskFullError(WriteError):
    """The file system of the run directory is full (or over quota)."""


class RunDirGoneError(WriteError):
    """The run directory (or the open segment in it) was deleted while the writer ran."""


class RecordsDroppedError(WriteError):
    """Writing failed for so long that records were dropped from memory; the gap is recorded."""


class MetricLogWarning(UserWarning):
    """A problem that metriclog handled and reports: a write that failed and recovered, ..."""


def warn(message: str) -> None:
    """Issue a MetricLogWarning attributed to the first caller outside metric_core."""
    import sys
    import warnings

    level = 2  # warnings.warn counts from this function; 2 is its caller
    frame: Any = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("metric_core"):
        level += 1
        frame = frame.f_back
    warnings.warn(message, MetricLogWarning, stacklevel=level)
