"""The record framings of foreign logs, read record by record with their checksums verified.

* TFRecord (TensorBoard's event files): each record is ``u64 length``, ``u32 masked
  CRC-32C of the length``, the data, ``u32 masked CRC-32C of the data`` (little-endian).
* LevelDB's log (a W&B offline run's ``run-<id>.wandb``, after its 7-byte header
  ``:W&B`` + magic + version): 32 KiB blocks of chunks, each ``u32 checksum``, ``u16
  length``, ``u8 type`` (1 full, 2 first, 3 middle, 4 last), the payload; a block's tail
  shorter than a chunk header is padding. Unlike LevelDB's own (a masked CRC-32C), wandb's
  checksum is the plain CRC-32 of the type byte and the payload (``zlib.crc32``), as its
  files show.

CRC-32C is computed by the ``crc32c`` package (hardware instructions where the CPU has
them, the same package tensorboardX itself uses when it is installed; the ``tensorboard``
extra installs it, as W&B's framing does not need it). Both readers read
as they go, a record at a time, so a file of any size is read in bounded memory; a last
record cut short (a file still being written) ends the file with a warning, never an error.
"""

from __future__ import annotations

import functools
import struct
import zlib
from collections.abc import Callable, Iterator
from typing import BinaryIO

from metric_core.errors import MissingDependencyError

Warn = Callable[[str], None]

_MASK_DELTA = 0xA282EAD8
_TF_HEADER = struct.Struct("<QI")
_U32 = struct.Struct("<I")

WANDB_MAGIC = b":W&B"
WANDB_HEADER = 7
LEVELDB_BLOCK = 32 * 1024
_CHUNK = struct.Struct("<IHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def crc32c(data: bytes | memoryview) -> int:
    """CRC-32C (Castagnoli) of ``data``.

    >>> hex(crc32c(b"123456789"))
    '0xe3069283'
    """
    return int(_crc32c()(data))


@functools.cache
def _crc32c() -> Callable[[bytes | memoryview], int]:
    try:
        import crc32c
    except ImportError:
        raise MissingDependencyError(
            "reading TensorBoard event files needs crc32c: pip install 'metriclog[tensorboard]'"
        ) from None
    return crc32c.crc32c  # type: ignore[no-any-return]


def masked_crc32c(data: bytes | memoryview) -> int:
    """TFRecord's masked CRC-32C: the CRC rotated right by 15 bits, plus a constant."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def tfrecords(f: BinaryIO, name: str, warn: Warn) -> Iterator[tuple[int, bytes]]:
    """Each record of a TFRecord file, with its byte offset. A record whose data fails its
    checksum is skipped and said; one whose length fails it ends the file (nothing after
    it can be found), said; a record cut short at the end is said."""
    offset = 0
    while True:
        head = f.read(_TF_HEADER.size)
        if not head:
            return
        if len(head) < _TF_HEADER.size:
            warn(_torn(name, offset, len(head)))
            return
        length, crc = _TF_HEADER.unpack(head)
        if masked_crc32c(head[:8]) != crc:
            warn(
                f"{name}: the record at byte {offset:,} fails its length checksum (CRC-32C): the file is "
                "damaged there and nothing after it can be read; restore the file from a copy to import "
                "the rest"
            )
            return
        body = f.read(length + _U32.size)
        if len(body) < length + _U32.size:
            warn(_torn(name, offset, len(head) + len(body)))
            return
        data = body[:length]
        if masked_crc32c(data) != _U32.unpack_from(body, length)[0]:
            warn(
                f"{name}: the record at byte {offset:,} ({length:,} bytes) fails its data checksum "
                "(CRC-32C): it is damaged and skipped"
            )
        else:
            yield offset, data
        offset += _TF_HEADER.size + length + _U32.size


def leveldb_records(f: BinaryIO, name: str, warn: Warn) -> Iterator[tuple[int, bytes]]:
    """Each record of a W&B transaction log, with the byte offset of its first chunk. A
    chunk that fails its checksum loses the rest of its block (its length cannot be
    trusted) and the record it belonged to, said; a chunk cut short at the end is said."""
    header = f.read(WANDB_HEADER)
    if header[:4] != WANDB_MAGIC:
        raise ValueError(f"{name} is not a W&B run file (it does not start with ':W&B')")
    block_start = 0
    block = header + f.read(LEVELDB_BLOCK - WANDB_HEADER)
    pos = WANDB_HEADER
    parts: list[bytes] = []
    first = 0
    while True:
        if len(block) - pos < _CHUNK.size:
            if len(block) < LEVELDB_BLOCK:  # the file's end
                if parts or block[pos:].strip(b"\0"):
                    warn(_torn(name, first if parts else block_start + pos, len(block) - pos))
                return
            block_start += LEVELDB_BLOCK
            block = f.read(LEVELDB_BLOCK)
            pos = 0
            continue
        crc, length, kind = _CHUNK.unpack_from(block, pos)
        if crc == 0 and length == 0 and kind == 0:  # zeros a writer left: the rest of the block
            pos = len(block) if len(block) < LEVELDB_BLOCK else LEVELDB_BLOCK
            continue
        end = pos + _CHUNK.size + length
        if end > len(block):
            if len(block) < LEVELDB_BLOCK:
                warn(_torn(name, first if parts else block_start + pos, len(block) - pos))
                return
            end = LEVELDB_BLOCK + 1  # a length past its block: damaged, handled below
        if end > LEVELDB_BLOCK or wandb_chunk_crc(block[pos + 6 : end]) != crc:
            lost = " and the record it began" if parts else ""
            warn(
                f"{name}: the chunk at byte {block_start + pos:,} fails its checksum: the rest of its block "
                f"({LEVELDB_BLOCK - pos:,} bytes){lost} is skipped"
            )
            parts = []
            pos = LEVELDB_BLOCK
            continue
        payload = block[pos + _CHUNK.size : end]
        if kind in (FULL, FIRST):
            if parts:
                warn(f"{name}: a record begun at byte {first:,} has no end: skipped")
            parts, first = [payload], block_start + pos
        elif kind in (MIDDLE, LAST) and parts:
            parts.append(payload)
        elif kind in (MIDDLE, LAST):
            warn(f"{name}: the chunk at byte {block_start + pos:,} continues a record whose start was lost")
        pos = end
        if kind in (FULL, LAST) and parts:
            yield first, b"".join(parts)
            parts = []


def wandb_chunk_crc(type_and_payload: bytes) -> int:
    """The checksum of a W&B log chunk: CRC-32 (not LevelDB's CRC-32C) of its type byte and payload."""
    return zlib.crc32(type_and_payload)


def _torn(name: str, offset: int, size: int) -> str:
    return (
        f"{name}: the last record, at byte {offset:,}, is cut short ({size:,} bytes of it are there): the "
        "file is still being written, or was cut; everything before it is imported"
    )
