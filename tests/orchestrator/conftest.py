"""A real `megacapybara serve` process for the HTTP and websocket tests."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest


class ServerProcess:
    """`python -m orchestrator serve --port 0 ARGS`, up once it prints its URL."""

    def __init__(self, *args: str):
        cmd = [sys.executable, "-m", "orchestrator", "serve", "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.stderr_lines: list[str] = []
        threading.Thread(target=self._read_stderr, daemon=True).start()
        line = self.proc.stdout.readline()  # printed once the model is loaded
        if "serving" not in line:
            self.stop()
            raise RuntimeError(f"server did not start: {line!r} {''.join(self.stderr_lines)}")
        self.url = line.split(" at ")[1].strip()  # http://127.0.0.1:PORT/v1
        self.base = self.url.removesuffix("/v1")

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self.stderr_lines.append(line)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.base + path, timeout=30) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()


def post(
    url: str, body: dict | bytes, headers: dict | None = None, timeout: float = 120
) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a POST; HTTP errors are returned, not raised."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), dict(err.headers)


@pytest.fixture(scope="module")
def server(gemma_path):
    srv = ServerProcess("--ctx", "4096", "--slots", "12")
    yield srv
    srv.stop()
