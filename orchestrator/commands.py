"""Settings written back out: "copy as command" lines for POSIX sh and Windows .bat, and TOML.

Every text made here parses back to exactly the same Settings (tests round-trip every setting):
`split_command(command_line(s, shell), shell)` gives the argv that `megacapybara serve` parses.
"""

from __future__ import annotations

import dataclasses
import json
import shlex

from orchestrator.settings import Settings, flag_name

SHELLS = {"sh": "bats/serve.sh", "bat": r"bats\serve.bat"}


def to_argv(settings: Settings, everything: bool = False) -> list[str]:
    """CLI arguments that reproduce `settings` (only the non-default ones unless `everything`)."""
    argv = []
    for f in dataclasses.fields(Settings):
        value = getattr(settings, f.name)
        if not everything and value == f.default:
            continue
        if isinstance(value, bool):
            argv.append(flag_name(f.name) if value else "--no-" + flag_name(f.name)[2:])
        else:
            argv += [flag_name(f.name), repr(value) if isinstance(value, float) else str(value)]
    return argv


def command_line(settings: Settings, shell: str, everything: bool = False) -> str:
    """One line that serves with `settings`, for `shell` "sh" or "bat"."""
    if shell not in SHELLS:
        raise ValueError(f"shell: must be one of {', '.join(SHELLS)} (got {shell!r})")
    quote = shlex.quote if shell == "sh" else _bat_quote
    return " ".join([SHELLS[shell], *(quote(a) for a in to_argv(settings, everything))])


def split_command(line: str, shell: str) -> list[str]:
    """The arguments after the script name of a line made by `command_line`."""
    words = shlex.split(line) if shell == "sh" else _bat_split(line)
    return words[1:]


def _bat_quote(arg: str) -> str:
    """cmd.exe quoting: %% for %, and double quotes (doubled inside) around anything special."""
    arg = arg.replace("%", "%%")
    if arg and not any(c in arg for c in ' \t"&|<>^()'):
        return arg
    return '"' + arg.replace('"', '""') + '"'


def _bat_split(line: str) -> list[str]:
    words, cur, quoted, i, started = [], [], False, 0, False
    while i < len(line):
        c = line[i]
        if c == "%" and line[i : i + 2] == "%%":
            cur.append("%")
            i += 2
            started = True
            continue
        if c == '"':
            if quoted and line[i : i + 2] == '""':
                cur.append('"')
                i += 2
                continue
            quoted, started = not quoted, True
        elif c in " \t" and not quoted:
            if started:
                words.append("".join(cur))
            cur, started = [], False
        else:
            cur.append(c)
            started = True
        i += 1
    if started:
        words.append("".join(cur))
    return words


def to_toml(settings: Settings, everything: bool = True) -> str:
    """A TOML config file (`--config FILE`) holding `settings`."""
    lines = ["# MegaCapybara settings: megacapybara serve --config THIS_FILE"]
    for f in dataclasses.fields(Settings):
        value = getattr(settings, f.name)
        if not everything and value == f.default:
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str):
            text = json.dumps(value, ensure_ascii=False)  # JSON string escapes are valid TOML
        else:
            text = repr(value)
        lines.append(f"{f.name} = {text}")
    return "\n".join(lines) + "\n"
