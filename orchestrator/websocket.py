"""The websocket face, `/ws` (flask-sock): the engine's typed events, and generations over the same
socket. Every message is one JSON object with a "type"; docs/websocket.md lists them with examples.

One thread per socket receives; one sender thread owns the socket's writes (events, tokens and
replies all go through its queue, so frames never interleave); each generation is read by its own
thread. Closing the socket cancels the generations it started.
"""

from __future__ import annotations

import json
import logging
import queue
import threading

from flask import Flask
from flask_sock import Sock
from simple_websocket import ConnectionClosed

from orchestrator import openai_api as api
from orchestrator.engine import Engine, TaskReader
from orchestrator.types import FinishEvent, InvalidRequest, SamplingParams, TokenEvent

log = logging.getLogger(__name__)


def register_websocket(app: Flask, engine: Engine, defaults: SamplingParams) -> None:
    sock = Sock(app)

    @sock.route("/ws")
    def ws(socket):
        _Connection(socket, engine, defaults).serve()


class _Connection:
    def __init__(self, socket, engine: Engine, defaults: SamplingParams):
        self.socket, self.engine, self.defaults = socket, engine, defaults
        self.outbox: queue.Queue[dict | None] = queue.Queue()
        self.readers: dict[int, TaskReader] = {}
        self.events = engine.events.subscribe()
        self.closed = threading.Event()

    def serve(self) -> None:
        threads = [threading.Thread(target=f, daemon=True) for f in (self._send_loop, self._event_loop)]
        for t in threads:
            t.start()
        self.outbox.put({"type": "hello", "model": self.engine.info.id})
        try:
            while not self.closed.is_set():
                raw = self.socket.receive(timeout=1.0)
                if raw is not None:
                    self._handle(raw)
        except ConnectionClosed:
            pass
        finally:
            self.closed.set()
            self.events.close()
            for reader in list(self.readers.values()):
                reader.cancel()
            self.outbox.put(None)

    def _handle(self, raw: str | bytes) -> None:
        ref = None
        try:
            msg = json.loads(raw)
            if not isinstance(msg, dict):
                raise InvalidRequest("message", "must be a JSON object with a type")
            ref = msg.get("id")
            kind = msg.get("type")
            if kind == "generate":
                self._generate(msg, ref)
            elif kind == "cancel":
                self.engine.cancel(int(msg.get("task_id", -1)))
            else:
                raise InvalidRequest("type", f"must be generate or cancel (got {kind!r})")
        except json.JSONDecodeError as exc:
            self.outbox.put(
                {"type": "error", "id": ref, **api.error_body(f"malformed JSON ({exc})", 400, "message")}
            )
        except InvalidRequest as exc:
            self.outbox.put({"type": "error", "id": ref, **api.error_body(str(exc), exc.status, exc.field)})

    def _generate(self, msg: dict, ref) -> None:
        body = {k: v for k, v in msg.items() if k not in ("type", "id")}
        if "messages" in body:
            request = api.chat_request(body, self.engine, self.defaults)
        else:
            request = api.completion_request(body, self.engine, self.defaults)
        reader = self.engine.submit(request)
        self.readers[reader.task_id] = reader
        self.outbox.put({"type": "accepted", "id": ref, "task_id": reader.task_id})
        threading.Thread(target=self._forward, args=(reader, ref), daemon=True).start()

    def _forward(self, reader: TaskReader, ref) -> None:
        for event in reader:
            if isinstance(event, TokenEvent) and event.text:
                self.outbox.put({"type": "token", "id": ref, "task_id": event.task_id, "text": event.text})
            elif isinstance(event, FinishEvent):
                out = event.to_json()
                out["finish_reason"] = api.FINISH_REASONS[event.reason]
                self.outbox.put({**out, "id": ref})
        self.readers.pop(reader.task_id, None)

    def _event_loop(self) -> None:
        while not self.closed.is_set():
            try:
                event = self.events.get(timeout=0.5)
            except queue.Empty:
                continue
            self.outbox.put({"type": "event", "event": event.to_json()})

    def _send_loop(self) -> None:
        while (msg := self.outbox.get()) is not None:
            try:
                self.socket.send(json.dumps(msg))
            except ConnectionClosed:
                self.closed.set()
                return
