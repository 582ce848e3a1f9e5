"""The Engine interface, the per-request reader, and the text stream of a task.

HTTP handlers never touch llama.cpp: they `submit()` a GenerationRequest and read its events
from the returned TaskReader (a queue), so a slow client never stalls the engine thread.
LlamaEngine (llama_engine.py) implements the interface; a router over several engines could too.
"""

from __future__ import annotations

import abc
import codecs
import logging
import queue
from collections.abc import Iterator
from dataclasses import dataclass

from orchestrator.events import EventBus
from orchestrator.llama import Model
from orchestrator.types import (
    FinishEvent,
    GenerationRequest,
    TokenEvent,
)

log = logging.getLogger(__name__)

Event = TokenEvent | FinishEvent


class TaskReader:
    """The reading end of one task: iterate for events; the last one is a FinishEvent."""

    def __init__(self, task_id: int, engine: Engine):
        self.task_id = task_id
        self._engine = engine
        self._events: queue.Queue[Event] = queue.Queue()
        self.finish: FinishEvent | None = None

    def put(self, event: Event) -> None:
        self._events.put(event)

    def __iter__(self) -> Iterator[Event]:
        while self.finish is None:
            event = self._events.get()
            if isinstance(event, FinishEvent):
                self.finish = event
            yield event

    def text(self) -> tuple[str, FinishEvent]:
        """Wait for the end; returns (all text, the finish event)."""
        parts = [e.text for e in self if isinstance(e, TokenEvent)]
        return "".join(parts), self.finish

    def cancel(self) -> None:
        self._engine.cancel(self.task_id)


@dataclass(frozen=True)
class ModelInfo:
    id: str
    path: str
    n_ctx: int
    n_vocab: int
    created: int


class Engine(abc.ABC):
    """Runs generations on one model. Thread-safe: any thread may submit, cancel or tokenize."""

    @abc.abstractmethod
    def submit(self, request: GenerationRequest) -> TaskReader:
        """Queue a generation; its events arrive on the returned reader.

        Raises InvalidRequest if the request cannot run here (e.g. longer than the context).
        """

    @abc.abstractmethod
    def cancel(self, task_id: int) -> None:
        """Stop a task at its next step (finish reason CANCELLED); unknown ids are ignored."""

    @abc.abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Tokens of `text` with the model's special-token handling."""

    @abc.abstractmethod
    def token_text(self, token: int) -> str:
        """The text of one token (special tokens included), for logprobs."""

    @abc.abstractmethod
    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        """The prompt text for chat `messages` with the model's chat template."""

    @property
    @abc.abstractmethod
    def info(self) -> ModelInfo: ...

    @property
    @abc.abstractmethod
    def events(self) -> EventBus:
        """The bus of typed engine events (orchestrator.events) for the websocket face."""

    @abc.abstractmethod
    def slots(self) -> list[dict]:
        """Every open task: id, state, tokens, resident/swapped/waiting, seconds open."""

    @abc.abstractmethod
    def metrics(self) -> dict[str, float]:
        """Counters and gauges for /metrics: names to numbers (see docs/http.md)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the engine thread and free every native object."""


class TextStream:
    """Turns sampled tokens into text: complete UTF-8 only, stop strings cut and held back."""

    def __init__(self, model: Model, stops: tuple[str, ...]):
        self._model = model
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = stops
        self._held = ""
        self.stopped = False

    def push(self, token: int) -> str:
        self._held += self._decoder.decode(self._model.token_bytes(token))
        for stop in self._stops:
            at = self._held.find(stop)
            if at >= 0:
                self.stopped = True
                out, self._held = self._held[:at], ""
                return out
        keep = max((self._partial_stop(s) for s in self._stops), default=0)
        out, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        return out

    def flush(self) -> str:
        out, self._held = self._held + self._decoder.decode(b"", final=True), ""
        return "" if self.stopped else out

    def _partial_stop(self, stop: str) -> int:
        """Length of the longest tail of the held text that is a prefix of `stop`."""
        for n in range(min(len(stop) - 1, len(self._held)), 0, -1):
            if self._held.endswith(stop[:n]):
                return n
        return 0
