"""`megacapybara serve` end to end: a real server process, the real bundled model, real clients."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest


class ServerProcess:
    def __init__(self, port: int, *args: str):
        cmd = [sys.executable, "-m", "orchestrator", "serve", "--port", str(port), "--ctx", "2048", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.stderr_lines: list[str] = []
        self._drain = threading.Thread(target=self._read_stderr, daemon=True)
        self._drain.start()
        line = self.proc.stdout.readline()  # printed once the model is loaded
        if "serving" not in line:
            self.stop()
            raise RuntimeError(f"server did not start: {line!r} {''.join(self.stderr_lines)}")
        self.url = line.split(" at ")[1].strip()

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self.stderr_lines.append(line)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(gemma_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = ServerProcess(port)
    yield srv
    srv.stop()


def _post(url: str, body: dict | bytes, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_startup_log_shows_the_patch_series_hash(server, build_script):
    assert any(f"patch series {build_script.series_hash()[:16]}" in ln for ln in server.stderr_lines)


def test_chat_completion_returns_real_text(server):
    status, body = _post(
        server.url + "/chat/completions",
        {"model": "gemma3-270m", "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 16,
         "temperature": 0},
    )  # fmt: skip
    assert status == 200
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"].strip()
    assert choice["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] >= 1
    assert (
        body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    )


def test_openai_client_chat_and_stream(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url, api_key="unused")
    msgs = [{"role": "user", "content": "The capital of France is"}]
    full = client.chat.completions.create(model="gemma3-270m", messages=msgs, max_tokens=12, temperature=0)
    text = full.choices[0].message.content
    stream = client.chat.completions.create(
        model="gemma3-270m", messages=msgs, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text and text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_health_and_models(server):
    with urllib.request.urlopen(server.url.removesuffix("/v1") + "/health", timeout=10) as resp:
        assert json.loads(resp.read())["status"] == "ok"
    with urllib.request.urlopen(server.url + "/models", timeout=10) as resp:
        assert json.loads(resp.read())["data"][0]["id"] == "gemma3-270m"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, "body"),
        ({"messages": "hi"}, 400, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-9"}, 404, "model"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_p": 3}, 422, "top_p"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ],
)
def test_bad_requests_get_openai_errors_naming_the_field(server, body, status, param):
    code, err = _post(server.url + "/chat/completions", body)
    assert code == status
    assert err["error"]["param"] == param
    assert param.split("[")[0] in err["error"]["message"]
