"""TensorBoard event files: read record by record (``framing.tfrecords``), never sampled.

Each folder holding event files is one source (its path below the imported folder is the
process name, rank 0); its files are read in the order written. A scalar is a summary
value's ``simple_value`` (float32, widened to float64 exactly) or a one-element float
tensor (``torch.utils.tensorboard`` with ``new_style``, TF2's ``tf.summary.scalar``: kept
at its own precision); text summaries become samples ``{"text": ...}``. Images,
histograms, audio and other plugins' tensors are counted and said, not imported.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from metric_core.errors import MissingDependencyError
from metric_core.offline.importers.framing import tfrecords
from metric_core.offline.importers.source import Importer, Item, Stream, Text, Warn, file_identity, hidden

_FLOAT_TENSORS = {1: ("float_val", "<f"), 2: ("double_val", "<d"), 19: ("half_val", "<e")}
_BFLOAT16 = 14
_STRING = 7
_STAMP = re.compile(r"tfevents\.(\d+(?:\.\d+)?)")


def event_files(folder: Path) -> list[Path]:
    """The event files below ``folder`` (not hidden: a writer's work in progress)."""
    return [p for p in folder.rglob("*.tfevents.*") if p.is_file() and not hidden(p, folder)]


class TensorBoardImporter(Importer):
    kind = "tensorboard"

    def __init__(self, warn: Warn, path: Path) -> None:
        super().__init__(warn)
        self.root = path.parent if path.is_file() else path
        files = [path] if path.is_file() else event_files(path)
        self.folders: dict[Path, list[Path]] = {}
        for file in sorted(files, key=_written_order):
            self.folders.setdefault(file.parent, []).append(file)
        self.name = self.root.resolve().name

    def identity(self) -> dict[str, Any]:
        files = [file_identity(f, self.root) for fs in self.folders.values() for f in fs]
        return {"kind": self.kind, "files": sorted(files)}

    def streams(self) -> Iterator[Stream]:
        event_type = _event_type()
        for folder, files in sorted(self.folders.items()):
            process = folder.relative_to(self.root).as_posix()
            yield Stream(self.name if process == "." else process, 0, self._items(files, event_type))

    def _items(self, files: list[Path], event_type: Any) -> Iterator[Item]:
        plugins: dict[str, str] = {}  # a tag's plugin: TF2 writes its metadata with its first value only
        for file in files:
            name = str(file)
            with file.open("rb") as f:
                for offset, data in tfrecords(f, name, self.warn):
                    event = event_type()
                    try:
                        event.ParseFromString(data)
                    except Exception:  # protobuf's DecodeError: the record is no event
                        self.warn(
                            f"{name}: the record at byte {offset:,} is not a TensorBoard event: skipped"
                        )
                        self.skipped["records that are no event"] += 1
                        continue
                    what = event.WhichOneof("what")
                    if what == "summary":
                        yield from self._values(event, plugins)
                    elif what != "file_version":
                        self.skipped[f"events of kind {what or 'none'}"] += 1

    def _values(self, event: Any, plugins: dict[str, str]) -> Iterator[Item]:
        step, wall = event.step, event.wall_time
        for value in event.summary.value:
            kind = value.WhichOneof("value")
            if kind == "simple_value":
                yield (step, value.tag, value.simple_value, wall)
                continue
            if kind != "tensor":
                self.skipped[f"{kind or 'empty'} summaries (not imported)"] += 1
                continue
            plugin = value.metadata.plugin_data.plugin_name
            if plugin:
                plugins[value.tag] = plugin
            plugin = plugins.get(value.tag, "")
            tensor = value.tensor
            if plugin == "text" and tensor.dtype == _STRING:
                texts = [s.decode("utf-8", errors="replace") for s in tensor.string_val]
                yield Text(step, value.tag, wall, {"text": texts[0] if len(texts) == 1 else texts})
                continue
            number = _scalar(tensor) if plugin in ("", "scalars") else None
            if number is None:
                self.skipped[f"{plugin or 'tensor'} summaries (not imported)"] += 1
            else:
                yield (step, value.tag, number, wall)


def _event_type() -> Any:
    """The ``Event`` protobuf: tensorboard's compiled protos where installed (they load nothing
    else), else tensorboardX's."""
    try:
        from tensorboard.compat.proto import event_pb2
    except ImportError:
        from metric_core.offline.tensorboardx import import_tensorboardx

        try:
            import_tensorboardx()
            from tensorboardX.proto import event_pb2  # type: ignore[no-redef]
        except ImportError:
            raise MissingDependencyError(
                "importing TensorBoard event files needs tensorboardX: pip install 'metriclog[tensorboard]'"
            ) from None
    return event_pb2.Event


def _scalar(tensor: Any) -> float | None:
    """A one-element float tensor's value, exactly; None for anything else."""
    if sum(1 for d in tensor.tensor_shape.dim if d.size != 1):
        return None
    if tensor.dtype == _BFLOAT16:  # its 16 bits in half_val, or in tensor_content
        if tensor.tensor_content:
            if len(tensor.tensor_content) != 2:
                return None
            bits = struct.unpack("<H", tensor.tensor_content)[0]
        elif len(tensor.half_val) == 1:
            bits = tensor.half_val[0] & 0xFFFF
        else:
            return None
        return float(struct.unpack("<f", struct.pack("<I", bits << 16))[0])
    if tensor.dtype not in _FLOAT_TENSORS:
        return None
    field, fmt = _FLOAT_TENSORS[tensor.dtype]
    if tensor.tensor_content:
        if len(tensor.tensor_content) != struct.calcsize(fmt):
            return None
        return float(struct.unpack(fmt, tensor.tensor_content)[0])
    values = list(getattr(tensor, field))
    if len(values) != 1:
        return None
    if field == "half_val":  # float16's bits, in an int32
        return float(struct.unpack("<e", struct.pack("<H", values[0] & 0xFFFF))[0])
    return float(values[0])


def _written_order(path: Path) -> tuple[str, float, str]:
    """Files of a folder in the order written: by the time in their names, then by name."""
    stamp = _STAMP.search(path.name)
    return (str(path.parent), float(stamp.group(1)) if stamp else 0.0, path.name)
