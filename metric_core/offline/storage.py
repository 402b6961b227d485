"""Where a run lives: a local directory, or a prefix in object storage.

A local path (or a ``file://`` URL) stays a ``pathlib.Path``. An ``s3://``, ``gs://`` or
``az://`` URL becomes a ``UPath`` (universal_pathlib over fsspec): the one listing layer,
which also reads the small files whole (run.json, JSONL, journals). Parquet files are read
by polars and pyarrow themselves from the URL, in byte ranges (the footer, then the row
groups a query needs). Each takes credentials and endpoints from its store's standard
environment (``AWS_ENDPOINT_URL``, ``AWS_PROFILE``, ``GOOGLE_APPLICATION_CREDENTIALS``,
``AZURE_STORAGE_ACCOUNT_NAME``, ...); metriclog never prints them.

The packages are optional extras (``metriclog[s3]``, ``[gcs]``, ``[azure]``), imported only for a URL.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import io
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Union
from urllib.parse import unquote, urlsplit

from metric_core.errors import (
    MetricLogError,
    MissingDependencyError,
    NoDataError,
    RequestError,
    RunChangedError,
    StorageError,
    opt,
)

if TYPE_CHECKING:
    from upath import UPath

RunPath = Union[Path, "UPath"]

# scheme -> the fsspec package that serves it, and the extra that installs it
SCHEMES = {
    "s3": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"),
    "gcs": ("gcsfs", "gcs"),
    "az": ("adlfs", "azure"),
    "abfs": ("adlfs", "azure"),
    "abfss": ("adlfs", "azure"),
}


def run_path(location: str | os.PathLike[str]) -> RunPath:
    """``location`` as a path: a ``Path`` when it is local, else a ``UPath``."""
    if not isinstance(location, str):
        return location if _is_upath(location) else Path(location)  # type: ignore[return-value]
    scheme, sep, rest = location.partition("://")
    if not sep or not scheme.isalnum():
        return Path(location)
    scheme = scheme.lower()
    if scheme == "file":
        url = urlsplit(location)
        if url.netloc not in ("", "localhost"):
            raise RequestError(f"{location}: a file:// URL names a path on this machine, not on {url.netloc}")
        return Path(unquote(url.path))
    if scheme not in SCHEMES:
        raise RequestError(
            f"{location}: metriclog reads local paths and file://, s3://, gs:// and az:// URLs, not {scheme}://"
        )
    try:
        import fsspec
        from upath import UPath

        fsspec.get_filesystem_class(scheme)
    except ImportError:
        package, extra = SCHEMES[scheme]
        raise MissingDependencyError(
            f"{location}: {scheme}:// URLs need {package} and universal-pathlib: "
            f"pip install 'metriclog[{extra}]'"
        ) from None
    return UPath(f"{scheme}://{rest}".rstrip("/") or location)


def _is_upath(path: object) -> bool:
    return type(path).__module__.startswith("upath")


def is_remote(path: object) -> bool:
    """Whether ``path`` is in object storage (a ``UPath``), not on a local filesystem."""
    return not isinstance(path, Path)


def name_of(path: RunPath) -> str:
    """A run directory's own name: its folder's, or its prefix's last part (a bucket's name
    for a run at the root of a bucket)."""
    if isinstance(path, Path):
        return path.resolve().name
    return path.name or str(path.path).strip("/").rsplit("/", 1)[-1]


def source(path: RunPath) -> str:
    """What polars and pyarrow are given to read ``path``: its local path or URL."""
    return str(path)


def open_read(path: RunPath) -> BinaryIO:
    """``path`` opened to read a part of it: a remote file is fetched in 1 MiB ranges as it is
    read (not the 5-50 MiB fsspec reads ahead by default)."""
    if isinstance(path, Path):
        return open(path, "rb")
    return io.BufferedReader(path.open("rb", cache_type="none"), 1 << 20)  # type: ignore[type-var]


# Each object's (bytes, mtime in ns) as the newest listing of its run gave them: asked
# again for a footer's cache key, an object listed is not asked for (a request each).
_listed: dict[str, tuple[int, int]] = {}


# Schemes pyarrow reads from a URL itself; for the others it is handed a file fsspec opens.
_ARROW_URLS = ("s3", "gs", "gcs")


@contextlib.contextmanager
def arrow_source(path: RunPath) -> Iterator[str | BinaryIO]:
    """What pyarrow is given to read ``path``: its path, or its URL where pyarrow reads the
    store itself (S3, GCS; in byte ranges), else a file opened through fsspec (Azure:
    pyarrow takes no az:// URL), closed after."""
    if isinstance(path, Path) or path.protocol in _ARROW_URLS:
        yield str(path)
        return
    with path.open("rb", cache_type="none") as f:  # pyarrow asks for the ranges it needs
        yield f


def size_and_mtime(path: RunPath) -> tuple[int, int]:
    """A file's bytes and modification time in ns (an object's, to the second or better)."""
    if not isinstance(path, Path) and str(path) in _listed:
        return _listed[str(path)]
    st = path.stat()
    return st.st_size, int(getattr(st, "st_mtime_ns", 0) or st.st_mtime * 1e9)


def listing(root: UPath, unnamed: list[tuple[str, str]] | None = None) -> Iterator[UPath]:
    """Every object below ``root``, once: one listing call (object storage has no
    directories to walk, no symlinks and no loops); their bytes and mtimes are kept for
    ``size_and_mtime``. An object whose key no path names (a key ending in "/" that holds
    bytes, a "." or ".." part) cannot be read as a path: it is left out, and put in
    ``unnamed`` as (its URL, why). Raises
    ``NoDataError`` when nothing is stored below it, ``StorageError`` when its bucket is missing."""
    with storage_errors(root):
        root.fs.invalidate_cache(root.path)  # a poll's listing is the store's now, as are its ETags
        try:
            found = root.fs.find(root.path, detail=True)
        except FileNotFoundError:  # s3fs, for a bucket that is not there
            found = {}
        if not found:
            bucket = root.path.split("/")[0]
            if not root.fs.exists(bucket):
                raise StorageError(
                    f"{root}: the bucket {bucket} does not exist (or these credentials cannot see it): "
                    "check the URL"
                )
    objects = {key: info for key, info in found.items() if info.get("type") != "directory"}
    if not objects:
        raise NoDataError(str(root), "nothing is stored under it")
    below = str(root).rstrip("/") + "/"
    for gone in [k for k in _listed if k.startswith(below)]:  # this listing replaces the last
        del _listed[gone]
    for key, info in sorted(objects.items()):
        name = key[len(root.path) :].lstrip("/")
        why = _no_path(name, int(info.get("size") or 0))
        if why is not None:
            if unnamed is not None and why:
                unnamed.append((f"{str(root).rstrip('/')}/{name}", why))
            continue
        path = root.joinpath(name)
        _listed[str(path)] = (int(info.get("size") or 0), _mtime_ns(info))
        yield path


def _no_path(name: str, size: int) -> str | None:
    """Why no path names the object ``name`` (below a run's prefix), '' for a folder marker
    (an empty object whose key ends in "/", as consoles make for folders), None if one does."""
    if name.endswith("/"):
        return "" if size == 0 else "its key ends in '/', which no path names: not read"
    if any(part in (".", "..") for part in name.split("/")):
        return "its key has a '.' or '..' part, which no path names: not read"
    return None


def _mtime_ns(info: dict[str, Any]) -> int:
    """An object's modification time in ns, as its fsspec backend lists it (s3fs
    ``LastModified``, gcsfs ``mtime`` or an ISO ``updated``, adlfs ``last_modified``);
    0 when it lists none."""
    for field in ("LastModified", "mtime", "last_modified", "updated"):
        value: Any = info.get(field)
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
        if isinstance(value, datetime.datetime):
            return int(value.timestamp() * 1e9)
    return 0


def not_a_directory(root: Path) -> str:
    """Why the local path ``root`` is no directory to read: it does not exist, it is a file,
    or it is a symlink that reaches none (a loop of symlinks, or a link to nothing)."""
    try:
        root.stat()
    except OSError as exc:
        try:
            target = os.readlink(root)
        except OSError:
            return "it does not exist"
        if exc.errno == errno.ELOOP:
            return f"it is a symlink to {target}, a loop of symlinks that never reaches a directory"
        return f"it is a symlink to {target}, which does not exist"
    return "it is not a directory"


def missing_run(root: RunPath) -> NoDataError | None:
    """The error of a run directory that is not there (a bucket prefix is there once an
    object is below it), with ``--wait`` as the way to wait for its job; None when it is."""
    if isinstance(root, Path):
        there = root.exists()
    else:
        try:
            there = next(iter(listing(root)), None) is not None
        except NoDataError:
            there = False
    if there:
        return None
    return NoDataError(
        str(root),
        "it does not exist: check the path, or give " + opt("wait", flag=True) + " to wait for the job to "
        "create it",
    )


def listed_below(folder: UPath) -> list[UPath]:
    """The objects below ``folder`` that the newest listing of a run holding it found (no
    request of its own: a run's listing names every object of it)."""
    below = str(folder).rstrip("/") + "/"
    return [folder.joinpath(key[len(below) :]) for key in sorted(_listed) if key.startswith(below)]


def newest_listed(root: UPath) -> float:
    """When anything below ``root`` was last stored, by its newest listing (epoch seconds;
    the wall clock for a store that lists no times): the time a copy of a live run last
    brought news, what its silences are judged against."""
    below = str(root).rstrip("/") + "/"
    newest = max((mtime for key, (_, mtime) in _listed.items() if key.startswith(below)), default=0)
    return newest / 1e9 if newest else time.time()


@contextlib.contextmanager
def storage_errors(where: RunPath) -> Iterator[None]:
    """The store's failures (a missing bucket, refused or missing credentials, an endpoint
    that does not answer) under ``where``, a URL, as one ``StorageError`` naming it and
    what to check. Anything else (a local path's errors, a bug) passes unchanged."""
    try:
        yield
    except MetricLogError:
        raise
    except Exception as exc:
        raise_store_failure(where, exc)
        raise


def raise_store_failure(path: RunPath, exc: BaseException) -> None:
    """Raise ``exc`` as a ``StorageError`` if it is the store's failure on ``path``, a URL:
    an object the store refuses is not a damaged file to skip, it fails the command."""
    if not is_remote(path) or not isinstance(exc, (OSError, *_client_errors())):
        return
    if type(exc).__name__ == "FileExpired" or isinstance(exc, FileNotFoundError):  # a copy in progress?
        raise RunChangedError(
            f"{path} was replaced or removed since the run was listed (a copy in progress?): run again"
        ) from None
    raise StorageError(f"{path}: {explain_store_failure(exc)}") from None


def is_store_failure(exc: BaseException) -> bool:
    """Whether an error out of a polars or pyarrow query is its cloud reader's."""
    text = str(exc)
    return text.startswith("object-store error") or "AWS Error" in text


def _client_errors() -> tuple[type[BaseException], ...]:
    """The error bases of the store clients loaded (none shares a base with the others)."""
    bases = [
        ("botocore.exceptions", "BotoCoreError"),
        ("botocore.exceptions", "ClientError"),
        ("aiohttp", "ClientError"),
        ("google.auth.exceptions", "GoogleAuthError"),
        ("google.api_core.exceptions", "GoogleAPIError"),
        ("azure.core.exceptions", "AzureError"),
    ]
    return tuple(getattr(sys.modules[m], name) for m, name in bases if m in sys.modules)


def _first_line(exc: BaseException) -> str:
    """The gist of a store's error: its first line, without the XML body a server sent."""
    text = str(exc).strip() or type(exc).__name__
    text = text.splitlines()[0].split("<?xml")[0].rstrip(" :")
    return text if len(text) <= 300 else text[:297] + "..."


# What the clients say when a store does not answer, or refuses the credentials (phrases,
# never a path or a bucket's name, which may hold any word).
_NO_ANSWER = (
    "Could not connect to the endpoint",
    "Cannot connect to host",
    "tcp connect error",
    "error sending request",
)
_DENIED = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "403 Forbidden", "AccessDenied")


def explain_store_failure(exc: BaseException) -> str:
    """What a store failure means, in one line, and what to check."""
    name = type(exc).__name__
    text = _first_line(exc)
    if "storage class" in str(exc) or "InvalidObjectState" in str(exc):  # in the server's XML too
        return f"archived ({text}): restore it from its storage class (e.g. Glacier) before reading it"
    if "Connect" in name or "Timeout" in name or any(p in text for p in _NO_ANSWER):  # any class
        return (
            f"the storage endpoint did not answer ({text}): check the endpoint (e.g. AWS_ENDPOINT_URL) "
            "and the network"
        )
    if "Credential" in name or "Unable to locate credentials" in text:
        return (
            f"no usable credentials ({text}): set them in the environment "
            "(e.g. AWS_ACCESS_KEY_ID, AWS_PROFILE)"
        )
    if isinstance(exc, PermissionError) or any(p in text for p in _DENIED):
        return f"access denied ({text}): check the credentials in the environment"
    if isinstance(exc, FileNotFoundError) or "NoSuchBucket" in text or "404 Not Found" in text:
        return f"not found ({text}): check the bucket and the path"
    return f"{name}: {text}"


def check_target(location: str | os.PathLike[str] | None) -> None:
    """Before a long read: that a local file to write (``--out``) is not a directory, and
    that a URL to write to is in a bucket that exists (a local file's folders are made when
    it is written)."""
    target = None if location is None else run_path(location)
    if isinstance(target, Path) and target.is_dir():
        raise MetricLogError(
            f"--out {location}: is a directory: name a file to write, e.g. {target / 'out'}{target.suffix}"
        )
    if target is None or isinstance(target, Path):
        return
    bucket = target.path.split("/")[0]
    with storage_errors(target):
        if not target.fs.exists(bucket):
            raise StorageError(
                f"{target}: the bucket {bucket} does not exist (or these credentials cannot see it): "
                "check the URL"
            )


@contextlib.contextmanager
def written_at(target: RunPath) -> Iterator[Path]:
    """Where to write files meant for ``target``: ``target`` itself when it is local; for a
    URL, a local file in a temporary folder whose files (``target`` and any marker beside
    it) are then stored next to ``target``, each in one request: an object appears whole or
    not at all, as a local file renamed into place does."""
    if isinstance(target, Path):
        yield target
        return
    with tempfile.TemporaryDirectory(prefix="metriclog-out-") as tmp:
        local = Path(tmp) / target.name
        yield local
        with storage_errors(target):
            for made in sorted(Path(tmp).iterdir(), key=lambda p: p == local):  # its marker first
                target.fs.put_file(str(made), (target.parent / made.name).path)
