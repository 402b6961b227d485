"""Journals: the open tail of a source, read up to its last whole, intact frame."""

from __future__ import annotations

from typing import Any

import polars as pl

from metric_core.format.segment import SegmentMeta
from metric_core.offline.read.discover import take_attempt, writer_meta
from metric_core.offline.read.jsonl import read_jsonl
from metric_core.offline.read.parquet import scan_parquet
from metric_core.offline.read.report import FileReport, ReadReport, Shutdown, rel
from metric_core.offline.read.validate import BAD_TIME, POLARS_SCHEMA, plausible
from metric_core.offline.storage import RunPath, raise_store_failure


def read_journal(path: RunPath, rep: FileReport, report: ReadReport) -> pl.LazyFrame | None:
    from metric_core.format import journal  # pyarrow: only for runs that hold a journal

    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return _read_sealed_replacement(path, rep, report)
    except OSError as exc:
        raise_store_failure(path, exc)
        rep.unreadable = str(exc)
        return None
    decoded = journal.decode(data)
    if decoded.problems and decoded.table is None:
        rep.unreadable = "; ".join(decoded.problems)
        return None
    if decoded.process is not None and decoded.rank is not None:
        rep.source = (decoded.process, decoded.rank)
        if decoded.shutdown is not None:
            attempt = decoded.attempt.get("attempt")
            report.shutdowns.append(Shutdown(decoded.process, decoded.rank, decoded.shutdown, attempt))
    rep.dropped = decoded.dropped
    rep.attempt = decoded.attempt.get("attempt")
    rep.attempt_started = decoded.attempt.get("attempt_started")
    rep.attempt_first_step = decoded.attempt.get("attempt_first_step", decoded.first_flush)
    rep.life = decoded.life if decoded.version >= 4 else None  # older writers record no life
    take_damage(decoded, rep, decoded.truncated_records, report)
    if decoded.unknown_codes:
        rep.skip("key code without a key definition", decoded.unknown_codes)
    if decoded.table is None or decoded.table.num_rows == 0:
        return None
    df = pl.from_arrow(decoded.table)
    assert isinstance(df, pl.DataFrame)
    ok = df.select(plausible(pl.col("timestamp"))).to_series()
    if not ok.all():
        rep.skip(BAD_TIME, int((~ok).sum()))
        df = df.filter(ok)
        if df.height == 0:
            return None
    rep.records += df.height
    rep.keys, rep.hashed = decoded.pairs, True
    rep.steps = (int(df["step"].min()), int(df["step"].max()))  # type: ignore[arg-type]
    rep.timestamps = (float(df["timestamp"].min()), float(df["timestamp"].max()))  # type: ignore[arg-type]
    return df.lazy().cast(POLARS_SCHEMA)  # type: ignore[arg-type]


def take_damage(decoded: Any, rep: FileReport, cut: int, report: ReadReport) -> None:
    """What decoding a journal (``journal.Decoded``) found wrong, as skips of its file: a
    damaged frame, and a last frame cut short (``cut``: the records its header declared).
    A last frame cut short that held no record to count (a heartbeat's, samples, or one
    cut inside its header) is said as a notice, not a skip (``--strict`` lets it be). The
    readers of records and of samples say them alike."""
    for problem in decoded.problems:
        rep.skip(problem, 0)
    if decoded.truncated:
        rep.truncated = True
        if cut:
            rep.skip(UNFINISHED, cut)
        else:
            report.notices.append(f"{rel(rep.path, report.run_dir)}: {CUT_WRITE}")


UNFINISHED = "unfinished write at the end (the writer was killed mid-write, or is writing now)"
CUT_WRITE = (
    "its last write was cut short (the writer was killed mid-write, or is writing now): "
    "that write is not read"
)


def _read_sealed_replacement(path: RunPath, rep: FileReport, report: ReadReport) -> pl.LazyFrame | None:
    """A journal that vanished after it was listed: its writer sealed it meanwhile, so read
    the sealed segment that names it (which the listing, made before, did not hold)."""
    for suffix in (".parquet", ".jsonl"):
        sealed = path.with_suffix(suffix)
        meta = writer_meta(sealed)
        if isinstance(meta, SegmentMeta) and meta.supersedes == path.name:
            rep.path, rep.format = sealed, suffix.lstrip(".")
            take_attempt(rep, meta)
            if suffix == ".parquet":
                frame, trusted, _ = scan_parquet(sealed, meta, rep, report)
                return frame if trusted else None
            return read_jsonl(sealed, meta, rep, report)
    rep.unreadable = "deleted while it was being read, and no sealed segment replaces it"
    return None
