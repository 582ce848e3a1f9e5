"""Bad CLI input: one line on stderr, non-zero exit, and nothing started."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True, timeout=timeout
    )


def _one_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_unknown_flag():
    proc = _run("serve", "--no-such-flag")
    assert proc.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in _one_line(proc)


def test_unknown_subcommand():
    proc = _run("fly")
    assert proc.returncode == 2
    assert "invalid choice: 'fly'" in _one_line(proc)


def test_missing_model_file(tmp_path):
    proc = _run("serve", "--model", str(tmp_path / "nope.gguf"))
    assert proc.returncode == 1
    line = _one_line(proc)
    assert "nope.gguf" in line and "not a registry name" in line


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--port", "70000", "port: must be between 0 and 65535"),
        ("--port", "eighty", "--port: must be int"),
        ("--cache-type-k", "q3_k", "cache_type_k: must be one of f16, bf16, q8_0"),
    ],
)
def test_bad_setting_value_names_the_setting(flag, value, expected):
    proc = _run("serve", flag, value)
    assert proc.returncode == 2
    assert expected in _one_line(proc)


def test_bad_environment_variable_names_it(monkeypatch):
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "serve"],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "MC_CTX": "lots"},
        timeout=60,
    )
    assert proc.returncode == 2
    assert "MC_CTX: must be int" in _one_line(proc)


def test_port_in_use(free_port):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", free_port))
        busy.listen()
        proc = _run("serve", "--port", str(free_port), "--log-level", "error")
    assert proc.returncode == 1
    assert f"port: cannot listen on 127.0.0.1:{free_port}" in _one_line(proc)


def test_planned_subcommands_say_so():
    proc = _run("launch")
    assert proc.returncode == 2
    assert "not available yet" in _one_line(proc)
