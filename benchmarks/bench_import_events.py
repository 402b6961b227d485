"""`metriclog import` of a large TensorBoard event file: time, records a second, peak RSS.

Writes one event file of about --mb MiB (events of 10 scalars each, as
``tensorboardX.SummaryWriter.add_scalars`` would log a step's values, framed by
tensorboardX's own ``RecordWriter``), then runs ``metriclog import`` on it in a child
process under GNU time. Also prints the CRC-32C throughput of the ``crc32c`` package the
importer uses against the table-driven pure-Python CRC-32C that tensorboard ships
(``tensorboard.compat.tensorflow_stub.pywrap_tensorflow.crc32c``), on 1 MiB.

Usage: python benchmarks/bench_import_events.py [--mb 1024] [--dir DIR]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KEYS = 10


def write_events(path: Path, mib: int) -> int:
    """An event file of about ``mib`` MiB; the number of scalars written."""
    from tensorboardX.proto import event_pb2, summary_pb2
    from tensorboardX.record_writer import RecordWriter

    writer = RecordWriter(str(path))
    writer.write(event_pb2.Event(wall_time=1.7e9, file_version="brain.Event:2").SerializeToString())
    written = step = 0
    tags = [f"train/metric_{k}" for k in range(KEYS)]
    while written < mib << 20:
        values = [summary_pb2.Summary.Value(tag=t, simple_value=step * 0.001 + k) for k, t in enumerate(tags)]
        data = event_pb2.Event(
            wall_time=1.7e9 + step * 0.01, step=step, summary=summary_pb2.Summary(value=values)
        ).SerializeToString()
        writer.write(data)
        written += len(data) + 16
        step += 1
    writer.close()
    return step * KEYS


def crc_throughput() -> tuple[float, float]:
    """MiB/s of the crc32c package and of tensorboard's table-driven Python CRC-32C."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import crc32c as table_driven

    from metric_core.offline.importers.framing import crc32c

    data = bytes(range(256)) * 4096  # 1 MiB
    start = time.perf_counter()
    for _ in range(200):
        crc32c(data)
    package = 200 / (time.perf_counter() - start)
    start = time.perf_counter()
    assert table_driven(data) == crc32c(data)
    table = 1 / (time.perf_counter() - start)
    return package, table


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=1024)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    package, table = crc_throughput()
    print(
        f"CRC-32C: crc32c package {package:,.0f} MiB/s, tensorboard's table-driven Python {table:,.2f} MiB/s"
    )
    root = args.dir or Path(tempfile.mkdtemp())
    tb = root / "tb"
    tb.mkdir(parents=True, exist_ok=True)
    event = tb / "events.out.tfevents.1700000000.bench"
    start = time.perf_counter()
    scalars = write_events(event, args.mb)
    size = event.stat().st_size
    print(f"wrote {size / 2**20:,.0f} MiB, {scalars:,} scalars in {time.perf_counter() - start:.0f} s")
    run = root / "run"
    shutil.rmtree(run, ignore_errors=True)
    command = [str(Path(sys.executable).with_name("metriclog")), "import", str(tb), str(run)]
    start = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-f", "RSS_KB=%M", *command], capture_output=True, text=True)
    wall = time.perf_counter() - start
    rss = next(line for line in proc.stderr.splitlines() if line.startswith("RSS_KB="))
    assert proc.returncode == 0, proc.stderr
    print(
        f"import: {wall:.1f} s, {scalars / wall:,.0f} scalars/s, {size / 2**20 / wall:,.1f} MiB/s, "
        f"peak RSS {int(rss.split('=')[1]) / 1024:,.0f} MiB"
    )
    if args.dir is None:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
