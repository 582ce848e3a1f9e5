"""OpenAI request parsing and response shaping, free of Flask: JSON in, typed objects out."""

from __future__ import annotations

import dataclasses
import time
import uuid

from orchestrator.engine import Engine
from orchestrator.types import FinishEvent, GenerationRequest, InvalidRequest, SamplingParams, StopReason

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
# OpenAI's finish_reason for each stop reason; the loop guard's stop is reported as "loop".
FINISH_REASONS = {
    StopReason.STOP: "stop",
    StopReason.LENGTH: "length",
    StopReason.LOOP: "loop",
    StopReason.CANCELLED: "cancelled",
    StopReason.ERROR: "error",
}
_NUMBER_FIELDS = {
    "temperature": float,
    "top_p": float,
    "min_p": float,
    "presence_penalty": float,
    "frequency_penalty": float,
    "repeat_penalty": float,
    "top_k": int,
    "seed": int,
    "max_tokens": int,
}


def _typed(body: dict, name: str, kind: type):
    value = body.get(name)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (kind is int and not isinstance(value, int))
    ):
        raise InvalidRequest(name, f"must be a{'n integer' if kind is int else ' number'} (got {value!r})")
    return kind(value)


def sampling_from(body: dict, defaults: SamplingParams) -> SamplingParams:
    """SamplingParams from an OpenAI request body over the server's defaults; InvalidRequest
    names a bad field."""
    values = {k: v for k, kind in _NUMBER_FIELDS.items() if (v := _typed(body, k, kind)) is not None}
    if (v := _typed(body, "max_completion_tokens", int)) is not None:
        values["max_tokens"] = v
    wants = body.get("logprobs")
    if wants not in (None, True, False):
        raise InvalidRequest("logprobs", f"must be true or false (got {wants!r})")
    top = _typed(body, "top_logprobs", int)
    if top is not None and wants is not True:
        raise InvalidRequest("top_logprobs", "needs logprobs: true")
    if wants is True:
        values["logprobs"] = top or 0
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise InvalidRequest("stop", "must be a string or a list of strings")
        values["stop"] = tuple(stop)
    return dataclasses.replace(defaults, **values)


def _message_text(i: int, message) -> dict[str, str]:
    if not isinstance(message, dict):
        raise InvalidRequest(f"messages[{i}]", "must be an object with role and content")
    role, content = message.get("role"), message.get("content")
    if role not in CHAT_ROLES:
        raise InvalidRequest(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)} (got {role!r})")
    if isinstance(content, list):  # content parts: only text is supported
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
            raise InvalidRequest(f"messages[{i}].content", "only text content parts are supported")
        content = "".join(parts)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise InvalidRequest(f"messages[{i}].content", "must be a string or a list of text parts")
    return {"role": role, "content": content}


def check_model(body: dict, engine: Engine) -> None:
    model = body.get("model")
    if model is not None and model != engine.info.id:
        raise InvalidRequest(
            "model", f"model {model!r} is not served here; this server serves {engine.info.id!r}", 404
        )


def chat_request(body: dict, engine: Engine, defaults: SamplingParams) -> GenerationRequest:
    """A GenerationRequest from a /v1/chat/completions body."""
    check_model(body, engine)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages", "must be a non-empty list of {role, content} objects")
    chat = [_message_text(i, m) for i, m in enumerate(messages)]
    try:
        prompt = engine.chat_prompt(chat)
    except ValueError as exc:
        raise InvalidRequest("messages", str(exc)) from None
    sampling = sampling_from(body, defaults)
    return GenerationRequest(tuple(engine.tokenize(prompt)), sampling)


def completion_request(body: dict, engine: Engine, defaults: SamplingParams) -> GenerationRequest:
    """A GenerationRequest from a /v1/completions body (prompt as a string)."""
    check_model(body, engine)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise InvalidRequest("prompt", "must be a non-empty string")
    return GenerationRequest(tuple(engine.tokenize(prompt)), sampling_from(body, defaults))


def logprob_entry(engine: Engine, logprob: dict) -> dict:
    """OpenAI chat `logprobs.content` item from an engine TokenEvent.logprob."""

    def item(token: int, lp: float) -> dict:
        text = engine.token_text(token)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    entry = item(logprob["token"], logprob["logprob"])
    entry["top_logprobs"] = [item(t, lp) for t, lp in logprob["top"]]
    return entry


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def chat_response(rid: str, model: str, text: str, finish: FinishEvent, logprobs: list | None = None) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": {"content": logprobs} if logprobs is not None else None,
                "finish_reason": FINISH_REASONS[finish.reason],
            }
        ],
        "usage": finish.usage.to_json(),
    }


def chat_chunk(rid: str, model: str, delta: dict, finish_reason: str | None = None) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }


def completion_response(rid: str, model: str, text: str, finish: FinishEvent) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "text": text, "finish_reason": FINISH_REASONS[finish.reason], "logprobs": None}
        ],
        "usage": finish.usage.to_json(),
    }


def error_body(message: str, status: int, param: str | None = None) -> dict:
    kind = {404: "not_found_error", 413: "request_too_large", 503: "server_busy"}.get(
        status, "invalid_request_error"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
