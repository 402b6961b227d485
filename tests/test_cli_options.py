"""The plan's options (mode, by, every, reduce, key, ranks, steps, attempts) are declared once
in cli/options.py (``PLAN_OPTIONS``) and listed per command (``COMMAND_PLAN_OPTIONS``): the
commands Typer builds take exactly the listed ones, each with its one flag, help and default,
and no command declares one of their flags in another way unless ``OTHER_MEANINGS`` says why."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
import typer.main
import typer.models
from metriclog import options as o
from metriclog.main import app
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]


def _declared(name: str, command: str | None = None) -> tuple[str, str, object]:
    """An option's flag, help and default as cli/options.py declares them (for ``command``,
    in its own words where ``OWN_HELP`` has them: the same flag and default)."""
    kind, default = o.PLAN_OPTIONS[name]
    kind = o.OWN_HELP.get((command, name), kind)
    info = typing.get_args(kind)[1]  # Annotated[type, typer.Option(flag, ...)]
    return info.default, info.help, default


FLAGS = {_declared(name)[0]: name for name in o.PLAN_OPTIONS}
COMMANDS = typer.main.get_command(app).commands  # type: ignore[attr-defined]


def test_the_table_names_real_commands_and_options():
    assert set(o.COMMAND_PLAN_OPTIONS) <= set(COMMANDS)
    for names in o.COMMAND_PLAN_OPTIONS.values():
        assert set(names) <= set(o.PLAN_OPTIONS) and len(set(names)) == len(names)
    assert {command for command, _ in o.OTHER_MEANINGS} <= set(COMMANDS)
    assert {flag for _, flag in o.OTHER_MEANINGS} <= set(FLAGS)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_command_takes_exactly_its_listed_plan_options_as_declared(command):
    took = set()
    for param in COMMANDS[command].params:
        flags = [f for f in param.opts if f in FLAGS]
        if not flags:
            continue
        (flag,) = flags
        if (command, flag) in o.OTHER_MEANINGS:
            assert FLAGS[flag] not in o.COMMAND_PLAN_OPTIONS.get(command, ()), (command, flag)
            continue
        name = FLAGS[flag]
        took.add(name)
        declared_flag, declared_help, declared_default = _declared(name, command)
        assert param.opts == [declared_flag] and not param.secondary_opts, (command, param.opts)
        assert param.help == declared_help, (command, flag)
        assert param.default in (declared_default, getattr(declared_default, "value", object())), (
            command,
            flag,
            param.default,
        )
        assert param.name == name, (command, param.name)
    assert took == set(o.COMMAND_PLAN_OPTIONS.get(command, ())), command


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_shows_each_plan_option_once_with_its_declared_help(command):
    shown = CliRunner().invoke(app, [command, "--help"])
    assert shown.exit_code == 0, shown.output
    said = " ".join(shown.output.split())
    for name in o.COMMAND_PLAN_OPTIONS.get(command, ()):
        flag, help_text, _ = _declared(name, command)
        assert len(re.findall(rf"^\s+{flag}\b", shown.output, re.M)) == 1, (command, flag)
        assert " ".join(help_text.split()) in said, (command, flag)


def test_the_commands_name_no_plan_option_type_and_no_other_declaration_takes_their_flags():
    """cli/main.py reaches the plan's options only through ``@o.plan_options``; in
    cli/options.py, an option type with one of their flags is either the one in
    ``PLAN_OPTIONS`` or a type ``OTHER_MEANINGS`` names."""
    types = ("Mode", "ByOpt", "Every", "Reduce", "Keys", "Ranks", "Steps", "Attempts")
    for path in (ROOT / "cli").rglob("*.py"):
        if path.name != "options.py":
            assert not re.search(rf"\bo\.({'|'.join(types)})\b", path.read_text()), path
    plan_types = {id(kind) for kind, _ in o.PLAN_OPTIONS.values()}
    apart = {re.search(r"\((\w+)", why).group(1) for why in o.OTHER_MEANINGS.values()}
    own = {id(kind) for kind in o.OWN_HELP.values()}
    for name, value in vars(o).items():
        args = typing.get_args(value) if typing.get_origin(value) is typing.Annotated else ()
        infos = [a for a in args[1:] if isinstance(a, typer.models.OptionInfo)]
        if infos and infos[0].default in FLAGS:
            assert id(value) in plan_types | own or name in apart, name
    assert sorted(n for n, v in vars(o).items() if id(v) in plan_types) == sorted(types)


def test_an_option_worded_for_one_command_keeps_its_flag_and_default_and_only_it_says_so():
    """``--steps`` is the same everywhere; only upload, which has --follow, says it cannot
    count back from the last step of a live run."""
    for command, name in o.OWN_HELP:
        flag, _, default = _declared(name)
        assert _declared(name, command)[::2] == (flag, default)
    for command in COMMANDS:
        shown = " ".join(CliRunner().invoke(app, [command, "--help"]).output.split())
        assert ("(not with --follow)" in shown) == (command == "upload"), command
        assert "upload --follow" not in shown, command


def test_a_command_s_plan_options_reach_it(tmp_path):
    """The options a command takes through the table are the ones it uses: a bad --steps is
    the usage error naming --steps, and --key filters keys' rows."""
    bad = CliRunner().invoke(app, ["reduce", "sample_logs/rl_run", "--steps", "x:y"])
    assert bad.exit_code == 2 and "--steps" in bad.output, bad.output
    listed = CliRunner().invoke(app, ["keys", "sample_logs/rl_run", "--key", "trainer/*", "--format", "csv"])
    assert listed.exit_code == 0, listed.output
    keys = [line.split(",")[0] for line in listed.stdout.splitlines()[1:]]
    assert keys and all(k.startswith("trainer/") for k in keys), keys
