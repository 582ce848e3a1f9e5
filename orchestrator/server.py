"""The HTTP face: an OpenAI-compatible Flask app over an Engine.

Handlers only parse, `submit()`, and read the task's events from its reader; they never touch
llama.cpp. A client that goes away mid-stream cancels its task.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator

from flask import Flask, Response, jsonify, request
from werkzeug.exceptions import HTTPException
from werkzeug.serving import BaseWSGIServer, make_server

from orchestrator import openai_api as api
from orchestrator.engine import Engine, TaskReader
from orchestrator.types import FinishEvent, InvalidRequest, SamplingParams, TokenEvent
from orchestrator.websocket import register_websocket

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 8 * 1024 * 1024


def create_app(engine: Engine, api_key: str = "", defaults: SamplingParams | None = None) -> Flask:
    """The Flask app serving `engine`; `api_key` non-empty requires `Authorization: Bearer`;
    `defaults` are the sampling values of requests that leave them out."""
    defaults = defaults or SamplingParams()
    app = Flask("megacapybara")
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES

    @app.before_request
    def _auth():
        # everything but /health; browsers cannot set headers on a websocket: ?api_key= there
        given = request.headers.get("Authorization", "") == f"Bearer {api_key}"
        given = given or (request.path == "/ws" and request.args.get("api_key") == api_key)
        if api_key and request.path != "/health" and not given:
            return _error("missing or wrong API key (Authorization: Bearer <key>)", 401)
        return None

    @app.errorhandler(InvalidRequest)
    def _invalid(exc: InvalidRequest):
        resp = _error(str(exc), exc.status, exc.field)
        if exc.status == 503:
            resp.headers["Retry-After"] = "2"
        return resp

    @app.errorhandler(HTTPException)
    def _http(exc: HTTPException):
        if exc.code == 413:
            return _error(f"request body is over {MAX_BODY_BYTES} bytes", 413)
        return _error(exc.description or exc.name, exc.code or 500)

    @app.get("/health")
    def health():
        return jsonify({"status": "ok", "model": engine.info.id})

    @app.get("/metrics")
    def metrics():
        lines = []
        for name, value in engine.metrics().items():
            kind = "counter" if name.endswith("_total") else "gauge"
            lines += [f"# TYPE {name} {kind}", f'{name}{{model="{engine.info.id}"}} {value}']
        return Response("\n".join(lines) + "\n", mimetype="text/plain; version=0.0.4")

    @app.get("/slots")
    def slots():
        return jsonify({"object": "list", "data": engine.slots()})

    @app.get("/v1/models")
    def models():
        info = engine.info
        card = {"id": info.id, "object": "model", "created": info.created, "owned_by": "megacapybara"}
        return jsonify({"object": "list", "data": [card]})

    @app.post("/v1/chat/completions")
    def chat_completions():
        body = _json_body()
        gen = api.chat_request(body, engine, defaults)
        reader = engine.submit(gen)
        rid, model = api.new_id("chatcmpl"), engine.info.id
        if body.get("stream"):
            return _sse(_chat_stream(reader, rid, model, _include_usage(body), engine))
        events = list(reader)
        text = "".join(e.text for e in events if isinstance(e, TokenEvent))
        lps = [
            api.logprob_entry(engine, e.logprob) for e in events if isinstance(e, TokenEvent) and e.logprob
        ]
        return jsonify(
            api.chat_response(
                rid, model, text, reader.finish, lps if gen.sampling.logprobs is not None else None
            )
        )

    @app.post("/v1/completions")
    def completions():
        body = _json_body()
        reader = engine.submit(api.completion_request(body, engine, defaults))
        rid, model = api.new_id("cmpl"), engine.info.id
        if body.get("stream"):
            return _sse(_completion_stream(reader, rid, model))
        text, finish = reader.text()
        return jsonify(api.completion_response(rid, model, text, finish))

    register_websocket(app, engine, defaults)
    return app


def _error(message: str, status: int, param: str | None = None) -> Response:
    resp = jsonify(api.error_body(message, status, param))
    resp.status_code = status
    return resp


def _json_body() -> dict:
    try:
        body = json.loads(request.get_data(cache=False) or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest("body", f"malformed JSON ({exc})") from None
    if not isinstance(body, dict):
        raise InvalidRequest("body", "must be a JSON object")
    return body


def _include_usage(body: dict) -> bool:
    opts = body.get("stream_options")
    return isinstance(opts, dict) and bool(opts.get("include_usage"))


def _sse(events: Iterator[dict]) -> Response:
    def gen():
        for event in events:
            yield f"data: {json.dumps(event)}\n\n"
        yield "data: [DONE]\n\n"

    return Response(gen(), mimetype="text/event-stream", headers={"Cache-Control": "no-cache"})


def _stream_events(reader: TaskReader) -> Iterator[TokenEvent | FinishEvent]:
    """The reader's events; if the client disconnects (generator closed), cancel the task."""
    finished = False
    try:
        for event in reader:
            finished = isinstance(event, FinishEvent)
            yield event
    finally:
        if not finished:
            reader.cancel()


def _chat_stream(
    reader: TaskReader, rid: str, model: str, include_usage: bool, engine: Engine
) -> Iterator[dict]:
    yield api.chat_chunk(rid, model, {"role": "assistant", "content": ""})
    for event in _stream_events(reader):
        if isinstance(event, TokenEvent):
            if event.text or event.logprob:
                chunk = api.chat_chunk(rid, model, {"content": event.text})
                if event.logprob:
                    chunk["choices"][0]["logprobs"] = {"content": [api.logprob_entry(engine, event.logprob)]}
                yield chunk
            continue
        yield api.chat_chunk(rid, model, {}, api.FINISH_REASONS[event.reason])
        if include_usage:
            yield {**api.chat_chunk(rid, model, {}), "choices": [], "usage": event.usage.to_json()}


def _completion_stream(reader: TaskReader, rid: str, model: str) -> Iterator[dict]:
    for event in _stream_events(reader):
        if isinstance(event, TokenEvent) and event.text:
            yield {"id": rid, "object": "text_completion", "model": model,
                   "choices": [{"index": 0, "text": event.text, "finish_reason": None}]}  # fmt: skip
        elif isinstance(event, FinishEvent):
            reason = api.FINISH_REASONS[event.reason]
            yield {"id": rid, "object": "text_completion", "model": model,
                   "choices": [{"index": 0, "text": "", "finish_reason": reason}]}  # fmt: skip


def _loading_app(environ, start_response):
    """Answers every request while the model loads."""
    body = json.dumps(api.error_body("the model is still loading", 503)).encode()
    start_response("503 Service Unavailable", [("Content-Type", "application/json"), ("Retry-After", "5")])
    return [body]


def bind_server(host: str, port: int) -> BaseWSGIServer:
    """Bind the listening socket now (raises OSError if the port is taken); answers 503 until
    `server.app` is replaced by `create_app(...)`. Threaded: one thread per client."""
    # werkzeug exits the process itself when its own bind fails: bind here and hand it the socket
    with socket.create_server((host, port)) as sock:
        return make_server(host, port, _loading_app, threaded=True, fd=sock.fileno())
