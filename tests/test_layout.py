"""The house: what a training rank loads, thin commands, one list of public names."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import metric_core

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("polars", "wandb", "matplotlib", "typer", "pandas", "click", "rich", "torch")


def loaded_by(code: str) -> set[str]:
    """The top-level modules a fresh interpreter holds after running ``code``."""
    script = f"import sys\n{code}\nprint(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.splitlines()[-1].split())


def test_a_training_rank_loads_nothing_heavy(tmp_path):
    """Every path of the writer: both formats, NaN, push(), a per-rank reduce backend and
    a raw-stream backend (a second file writer, fed Arrow batches), return_state."""
    for file_format in ("parquet", "jsonl"):
        loaded = loaded_by(
            "import metric_core\n"
            "from metric_core.writer.segments import RawFileWriter\n"
            f"mirror = RawFileWriter({str(tmp_path / 'mirror' / file_format)!r}, process='m', rank=0)\n"
            f"metric_core.init({str(tmp_path / file_format)!r}, file_format={file_format!r}, "
            "backends={'console': {'logging_mode': 'per_rank_reduce'}, 'mirror': mirror})\n"
            "for step in range(3):\n"
            "    metric_core.record_metric('loss', 0.5)\n"
            "    metric_core.record_metric('gn', float('nan'), metric_core.Reduce.MAX)\n"
            "    metric_core.get_collector().push(metric_core.Metric('lr', 1e-4))\n"
            "    metric_core.flush(step, return_state=True)\n"
            "metric_core.shutdown()"
        )
        assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))
        assert (tmp_path / file_format / f"rank0.r0.00000.{file_format}").exists()  # it was sealed


@pytest.mark.parametrize("mode", ["per_rank_reduce", "global_reduce"])
def test_a_torchforge_rank_loads_nothing_heavy(tmp_path, mode):
    """metric_core.torchforge's path: torchforge's calls and a console backend. In
    ``global_reduce`` mode its printer, a child, reads the run with polars; rank 0 itself
    starts it, waits for it, and loads none of that."""
    loaded = loaded_by(
        "import asyncio, os\n"
        f"os.environ['METRICLOG_DIR'] = {str(tmp_path / 'run')!r}\n"
        "from metric_core.torchforge import Reduce, get_or_create_metric_logger, record_metric\n"
        "async def main():\n"
        "    mlogger = await get_or_create_metric_logger(process_name='trainer')\n"
        f"    await mlogger.init_backends.call_one({{'console': {{'logging_mode': {mode!r}}}}})\n"
        "    for step in range(3):\n"
        "        record_metric('loss', 0.5, Reduce.MEAN)\n"
        "        await mlogger.flush.call_one(step, return_state=True)\n"
        "    await mlogger.shutdown.call_one()\n"
        "asyncio.run(main())"
    )
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))
    assert (tmp_path / "run" / "trainer_r0.r0.00000.parquet").exists()  # it was sealed


def test_a_rank_that_times_on_the_cpu_loads_no_torch(tmp_path):
    """torchforge's Tracer and trace, CPU-timed: torch stays unloaded even where installed
    (only a "gpu" timer or track_memory import it)."""
    loaded = loaded_by(
        "import asyncio, os\n"
        f"os.environ['METRICLOG_DIR'] = {str(tmp_path / 'run')!r}\n"
        "from metric_core.torchforge import Tracer, trace\n"
        "tracer = Tracer('rollout')\n"
        "tracer.start(); tracer.step('generate'); tracer.stop()\n"
        "with trace('train') as t:\n"
        "    t.step('forward')\n"
        "@trace('ref')\n"
        "async def ref():\n"
        "    return 1\n"
        "asyncio.run(ref())"
    )
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))
    assert list((tmp_path / "run").glob("*.parquet"))  # the timings were recorded


def test_a_rank_that_checks_its_sidecar_options_loads_nothing_heavy():
    loaded = loaded_by(
        "from metric_core.writer.sidecar import sidecar_command\n"
        "sidecar_command('run', {'project': 'p', 'mode': 'per_rank_reduce', 'by': 'time', 'every': '10s',"
        " 'reduce': {'lat': 'p99'}, 'until_idle': '5m'})"
    )
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))


def test_the_writer_side_and_the_ground_floor_import_no_offline_module():
    """Statically too: no module of the writer side or the ground floor names polars,
    the offline side or the command line in an import, even a deferred one. One exception:
    the sidecar checks its options with the plan's own parsers (``offline.plan``, pure
    Python: ``loaded_by`` below holds it light), so a bad one fails in ``init()``."""
    allowed = {("sidecar.py", "metric_core.offline.plan")}
    offenders = []
    ground = [
        *(p for p in (ROOT / "metric_core").glob("*.py") if p.name != "__init__.py"),
        *(ROOT / "metric_core" / "format").rglob("*.py"),  # the on-disk format: the ground floor too
    ]
    writer_side = [
        *(ROOT / "metric_core" / "writer").rglob("*.py"),
        *(ROOT / "metric_core" / "torchforge").rglob("*.py"),
    ]
    for path in [*ground, *writer_side]:
        for line, name in imports_of(path):
            if (path.name, name) in allowed:
                continue
            if name.split(".")[0] in ("polars", "matplotlib", "typer", "pandas") or name.startswith(
                ("metric_core.offline", "metriclog")
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert offenders == []


def imports_of(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` names in an import, deferred ones too: (line, module)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.lineno, node.module))
    return out


def test_the_readers_import_nothing_of_the_upload():
    """The reading of a run (``offline/read``: files, scans, the tail a follower reads) is
    the ground the commands stand on; uploading stands on it, never the other way."""
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in (ROOT / "metric_core" / "offline" / "read").rglob("*.py")
        for line, name in imports_of(path)
        if name.startswith("metric_core.offline.upload")
    ]
    assert offenders == []


def command_bodies() -> list[tuple[str, int]]:
    """Each command of cli/main.py and the lines of its body after its docstring."""
    tree = ast.parse((ROOT / "cli" / "main.py").read_text())
    out = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any(
            isinstance(d, ast.Call) and getattr(d.func, "attr", "") == "command" for d in node.decorator_list
        ):
            body = node.body[1:] if isinstance(node.body[0], ast.Expr) else node.body
            out.append((node.name, body[-1].end_lineno - body[0].lineno + 1))
    return out


def test_every_command_body_is_thin():
    bodies = command_bodies()
    commands = {"reduce", "upload", "inspect", "plot", "watch", "samples", "keys", "compare", "diff"}
    assert {name for name, _ in bodies} == commands | {"import_"}
    assert [(name, n) for name, n in bodies if n > 30] == []


def test_the_public_names_are_one_list_and_all_load():
    for name in metric_core.__all__:
        assert getattr(metric_core, name) is not None, name
    readme = (ROOT / "README.md").read_text()
    named = set(re.findall(r"metric_core\.([A-Za-z_]+)\(", readme))
    assert named <= set(metric_core.__all__), named - set(metric_core.__all__)


def test_the_command_line_installs_as_metriclog(tmp_path):
    import metriclog

    def run(*args: str) -> subprocess.CompletedProcess[str]:  # outside the checkout
        return subprocess.run(
            [sys.executable, *args], capture_output=True, text=True, timeout=60, cwd=tmp_path
        )

    version = run("-m", "metriclog", "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() in {
        f"metriclog {metriclog.__version__} (exact sums: {path})" for path in ("compiled", "pure numpy")
    }
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", metriclog.__version__)
    no_cli = run("-c", "import cli")  # no top-level package of that name is installed
    assert "No module named 'cli'" in no_cli.stderr


def test_the_command_line_loads_only_what_a_command_needs(tmp_path):
    """Start-up is most of a small command's time: no polars, numpy or pyarrow to parse
    options, and no wandb (nor pandas) to reduce sealed Parquet into Parquet. (pyarrow's
    Parquet reader is what verifies a sealed segment's page checksums: 0.07 s to import.)"""
    assert not loaded_by("import metriclog.main") & {"polars", "numpy", "pyarrow", "wandb"}
    run = tmp_path / "run"
    loaded_by(  # a run of sealed segments only
        "import metric_core\n"
        f"metric_core.init({str(run)!r}); metric_core.record_metric('a', 1.0); metric_core.shutdown()"
    )
    loaded = loaded_by(
        "from metriclog.main import app\n"
        f"app(['reduce', {str(run)!r}, '--out', {str(tmp_path / 'x.parquet')!r}], standalone_mode=False)"
    )
    assert "polars" in loaded and not loaded & {"wandb", "pandas"}


def test_every_package_of_the_source_is_in_the_package_list():
    """pyproject.toml lists the packages a wheel holds: one left out installs without it
    (an editable install, as the tests run, would not notice)."""
    listed = re.search(r"^packages = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    assert listed is not None
    named = set(re.findall(r'"([\w.]+)"', listed.group(1)))
    found = {".".join(i.parent.relative_to(ROOT).parts) for i in (ROOT / "metric_core").rglob("__init__.py")}
    # cli/ installs as metriclog (package-dir)
    found |= {
        ".".join(("metriclog", *i.parent.relative_to(ROOT / "cli").parts))
        for i in (ROOT / "cli").rglob("__init__.py")
    }
    assert found == named
