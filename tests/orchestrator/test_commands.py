"""One schema, many faces: every setting survives CLI -> "copy as command" (sh and .bat) -> CLI,
and settings -> TOML -> settings."""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator import cli, commands
from orchestrator.settings import Settings, SettingsError, load_config


def _other_value(f: dataclasses.Field):
    """A valid value different from the default, awkward where possible (spaces, quotes, %)."""
    meta, default = f.metadata, f.default
    if meta["choices"]:
        return next((c for c in meta["choices"] if c != default), default)  # a placeholder has one choice
    if isinstance(default, bool):
        return not default
    if isinstance(default, float):
        return default + 0.25 if default + 0.25 <= meta["hi"] else meta["lo"]
    if isinstance(default, int):
        return default + 1 if default + 1 <= meta["hi"] else meta["lo"]
    return 'C:\\Program Files\\my "models"\\50% q4.gguf'


SETTINGS = [f for f in dataclasses.fields(Settings)]


def _parse(argv: list[str]) -> Settings:
    args = cli.build_parser().parse_args(["serve", *argv])
    return Settings.load({f.name: getattr(args, f.name) for f in SETTINGS}, env={})


@pytest.mark.parametrize("shell", ["sh", "bat"])
@pytest.mark.parametrize("field", SETTINGS, ids=[f.name for f in SETTINGS])
def test_every_setting_round_trips_through_a_copied_command(field, shell):
    settings = dataclasses.replace(Settings.load({}, env={}), **{field.name: _other_value(field)})
    line = commands.command_line(settings, shell)
    assert "\n" not in line
    assert _parse(commands.split_command(line, shell)) == settings


@pytest.mark.parametrize("shell", ["sh", "bat"])
def test_all_settings_at_once_round_trip(shell):
    settings = Settings.load({f.name: _other_value(f) for f in SETTINGS}, env={})
    line = commands.command_line(settings, shell, everything=True)
    assert _parse(commands.split_command(line, shell)) == settings


def test_toml_round_trip(tmp_path):
    settings = Settings.load({f.name: _other_value(f) for f in SETTINGS}, env={})
    path = tmp_path / "mc.toml"
    path.write_text(commands.to_toml(settings))
    assert Settings.load({}, env={}, config=path) == settings


def test_precedence_default_config_env_cli(tmp_path):
    path = tmp_path / "mc.toml"
    path.write_text("port = 9001\nctx = 4096\nslots = 3\n")
    s = Settings.load({"port": 9003}, env={"MC_CTX": "2048"}, config=path)
    assert (s.port, s.ctx, s.slots) == (9003, 2048, 3)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("prot = 1\n", "unknown setting 'prot'"),
        ('port = "80"\n', "port must be int"),
        ("offline = 1\n", "offline must be bool"),
        ("port = \n", "is not valid TOML"),
    ],
)
def test_bad_config_file_names_the_key(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SettingsError, match=message):
        load_config(path)


def test_print_command_from_the_cli_parses_back():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator",
            "serve",
            "--slots",
            "3",
            "--no-loop-guard",
            "--print-command",
            "sh",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip()
    assert line == "bats/serve.sh --slots 3 --no-loop-guard"
    assert _parse(commands.split_command(line, "sh")).slots == 3


def test_unknown_shell_is_refused():
    with pytest.raises(ValueError, match="shell: must be one of sh, bat"):
        commands.command_line(Settings.load({}, env={}), "fish")


@pytest.mark.parametrize("preset", ["agents12", "huge-context", "lossless"])
def test_bats_presets_are_valid_settings_and_the_same_on_both_shells(preset):
    root = Path(__file__).resolve().parents[2] / "bats"
    sh = (root / f"{preset}.sh").read_bytes().decode()
    bat = (root / f"{preset}.bat").read_bytes().decode()
    sh_args = shlex.split(re.search(r'serve\.sh" (.*) "\$@"', sh).group(1))
    bat_args = commands.split_command("x " + re.search(r'serve\.bat" (.*) %\*', bat).group(1), "bat")
    assert sh_args == bat_args
    settings = _parse(sh_args)
    assert settings != Settings.load({}, env={})
    assert "\r\n" in bat and "\r\n" not in sh
