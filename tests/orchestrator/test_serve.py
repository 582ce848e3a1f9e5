"""`megacapybara serve` end to end: a real server process, the real bundled model, real clients."""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.orchestrator.conftest import post


def _post(url: str, body: dict | bytes) -> tuple[int, dict]:
    status, data, _ = post(url, body)
    return status, data


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
