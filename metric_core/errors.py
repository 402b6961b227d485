"""The exceptions metric_core raises on purpose. Every one derives from MetricLogError.

The command line maps them by type: ``PlanError`` is a usage error (exit 2), every other
``MetricLogError`` means the data or the request could not be served (exit 1).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

# The parameters of the Python API a message may name, written ``{name}`` in it: the
# library says ``ranks=``, the command line ``--ranks `` (``said``).
OPTIONS = frozenset(
    [
        "mode",
        "by",
        "every",
        "reduce",
        "keys",
        "ranks",
        "steps",
        "attempts",
        "out",
        "strict",
        "share_run",
        "project",
        "entity",
        "group",
        "name",
    ]
)


def in_python(name: str) -> str:
    return f"{name}="


def spell(text: str, spelled: Callable[[str], str]) -> str:
    """``text`` with each ``{option}`` spelled by ``spelled``, and each ``{option!}`` (a flag
    given) as ``option=True`` in Python, ``--option`` on the command line."""

    def one(m: re.Match[str]) -> str:
        name, flag = m.group(1), m.group(2)
        if name not in OPTIONS:
            return m.group(0)
        said = spelled(name)
        return (said + "True" if said.endswith("=") else said.rstrip()) if flag else said

    return re.sub(r"\{(\w+)(!?)\}", one, text)


class MetricLogError(Exception):
    """Root of every error metriclog raises on purpose; the CLI maps it to exit code 1.

    A message that names options is kept as a template (``template``), so each caller can
    say it in its own words: ``said(spelled)``.
    """

    template: str | None = None

    def said(self, spelled: Callable[[str], str]) -> str:
        """The message, with the options it names spelled by ``spelled``."""
        return str(self) if self.template is None else spell(self.template, spelled)

    def _name_options(self, template: str) -> None:
        self.template = template
        Exception.__init__(self, spell(template, in_python))

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
    """record_metric or flush was called before metric_core.init()."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"{what} was called before metric_core.init(run_dir): "
            "call metric_core.init() once per process before recording metrics."
        )


class ConfigError(MetricLogError):
    """A backend or writer configuration that cannot work, with what to do instead."""


class NoDataError(MetricLogError):
    """A run directory (or a filtered selection of it) holds no readable record."""

    def __init__(self, where: str, why: str) -> None:
        self.where = where
        self._name_options(f"no readable metric record in {where}: {why}")


class FilteredOutError(NoDataError):
    """The run has records, but the filters (keys, ranks, steps) left none: ``why`` names them."""

    def __init__(self, where: str, why: str) -> None:
        self.where = where
        self._name_options(f"no record in {where} matches the filters{why}")


class MixedReductionError(MetricLogError):
    """The same key was recorded with different reductions by different sources."""

    def __init__(self, key: str, origins: dict[str, list[str]]) -> None:
        self.key = key
        self.origins = origins
        where = "; ".join(f"{red} by {', '.join(srcs)}" for red, srcs in sorted(origins.items()))
        self._name_options(
            f"key '{key}' is recorded with more than one reduction ({where}). "
            f"Choose one with {{reduce}}'{key}=STAT'."
        )


class UnknownReductionError(MetricLogError):
    """Records carry a reduction metriclog does not know; ``keys`` maps each such key to it."""

    def __init__(self, keys: dict[str, str]) -> None:
        self.keys = keys
        shown = ", ".join(f"'{k}' ({r!r})" for k, r in list(keys.items())[:5])
        more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
        first = next(iter(keys))
        self._name_options(
            f"key(s) recorded with a reduction metriclog does not know: {shown}{more}; choose a "
            f"statistic for each, e.g. {{reduce}}'{first}=mean'"
        )


class StrictModeError(MetricLogError):
    """--strict was given and the reader skipped records or files; ``summary`` says which."""

    def __init__(self, summary: str) -> None:
        self.summary = summary
        self._name_options("{strict!}: records or files were skipped (see above)")


class PlanError(MetricLogError):
    """A request that cannot be turned into a plan (bad statistic, pattern, range): a usage error.

    ``option`` is the parameter at fault as the Python API names it (``ranks``), ``value``
    what it was given, and ``message`` what is wrong with it, as a predicate:
    ``ranks='1-x' is not ...`` in Python, ``--ranks '1-x' is not ...`` on the command line.
    """

    def __init__(self, message: str, *, option: str | None = None, value: object = None) -> None:
        self.message, self.option, self.value = message, option, value
        where = f"{{{option}!}}" if value is True else f"{{{option}}}{value!r}"  # a flag, or a value
        self._name_options(message if option is None else f"{where} {message}")


class UnmatchedError(MetricLogError):
    """Strict reading, and a filter or ``reduce`` pattern matched no record (``notes`` say which)."""

    def __init__(self, notes: list[PlanError]) -> None:
        self.notes = notes
        self._name_options("{strict!}: " + "; ".join(n.template or str(n) for n in notes))


class RequestError(MetricLogError):
    """A well-formed request this run cannot serve: too many keys to plot, an output of unknown type."""


class MissingDependencyError(MetricLogError):
    """An optional package a feature needs is not installed; the message names the install."""


class CollectorClosedError(MetricLogError):
    """A collector was used after ``shutdown()``."""


class UnsafePathError(MetricLogError):
    """metriclog would have to write through a symlink it did not make."""


class RunChangedError(MetricLogError):
    """A file of the run changed (or vanished) between the check of it and the query over it."""


class UploadError(MetricLogError):
    """W&B could not be reached or refused the upload; the ledger says what was sent."""


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
