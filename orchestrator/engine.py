"""The Engine interface, the per-request reader, and the one-at-a-time engine of the foundation.

HTTP handlers never touch llama.cpp: they `submit()` a GenerationRequest and read its events
from the returned TaskReader (a queue), so a slow client never stalls the engine thread. The
many-slot engine (unified KV, scheduler, swap) implements the same interface.
"""

from __future__ import annotations

import abc
import codecs
import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from orchestrator.backend import check_backend
from orchestrator.llama import Batch, Context, ContextParams, Model, Sampler
from orchestrator.types import (
    FinishEvent,
    GenerationRequest,
    InvalidRequest,
    StopReason,
    TokenEvent,
    Usage,
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
    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        """The prompt text for chat `messages` with the model's chat template."""

    @property
    @abc.abstractmethod
    def info(self) -> ModelInfo: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the engine thread and free every native object."""


class _TextStream:
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


class SimpleEngine(Engine):
    """One task at a time on one sequence. The foundation's engine, behind the Engine interface."""

    def __init__(self, model_path: str, params: ContextParams, n_gpu_layers: int = 0, model_id: str = ""):
        check_backend()
        t0 = time.monotonic()
        self._model = Model(model_path, n_gpu_layers)
        self._ctx = Context(self._model, params)
        self._batch = Batch(params.n_batch)
        log.info("loaded %s (%s) in %.2f s", model_path, self._model.description(), time.monotonic() - t0)
        self._info = ModelInfo(
            model_id or self._model.path.stem,
            str(self._model.path),
            self._ctx.n_ctx,
            self._model.n_vocab,
            int(time.time()),
        )
        self._queue: queue.Queue[tuple[GenerationRequest, TaskReader] | None] = queue.Queue()
        self._cancelled: set[int] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="mc-engine", daemon=True)
        self._thread.start()

    @property
    def info(self) -> ModelInfo:
        return self._info

    def tokenize(self, text: str) -> list[int]:
        return self._model.tokenize(text)

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        return self._model.apply_chat_template(messages)

    def submit(self, request: GenerationRequest) -> TaskReader:
        if len(request.prompt_tokens) >= self._ctx.n_ctx:
            raise InvalidRequest(
                "prompt",
                f"is {len(request.prompt_tokens)} tokens, over the context budget of {self._ctx.n_ctx}",
            )
        reader = TaskReader(request.task_id, self)
        self._queue.put((request, reader))
        return reader

    def cancel(self, task_id: int) -> None:
        with self._lock:
            self._cancelled.add(task_id)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._batch.close()
        self._ctx.close()
        self._model.close()

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            request, reader = item
            try:
                reader.put(self._run(request, reader))
            except Exception as exc:  # one failed task must not stop the engine
                log.exception("task %d failed", request.task_id)
                usage = Usage(len(request.prompt_tokens), 0)
                reader.put(FinishEvent(request.task_id, StopReason.ERROR, usage, str(exc)))
            with self._lock:
                self._cancelled.discard(request.task_id)

    def _is_cancelled(self, task_id: int) -> bool:
        with self._lock:
            return task_id in self._cancelled

    def _prefill(self, tokens: tuple[int, ...]) -> None:
        self._ctx.clear()
        for start in range(0, len(tokens), self._batch.capacity):
            self._batch.clear()
            chunk = tokens[start : start + self._batch.capacity]
            for i, tok in enumerate(chunk):
                is_last = start + i == len(tokens) - 1
                self._batch.add(tok, start + i, 0, is_last)
            self._ctx.decode(self._batch)

    def _run(self, request: GenerationRequest, reader: TaskReader) -> FinishEvent:
        tid, sp = request.task_id, request.sampling
        self._prefill(request.prompt_tokens)
        stream = _TextStream(self._model, sp.stop)
        pos, n_out, reason = len(request.prompt_tokens), 0, StopReason.LENGTH
        with Sampler(sp, self._model.n_vocab) as sampler:
            while n_out < sp.max_tokens and pos < self._ctx.n_ctx:
                if self._is_cancelled(tid):
                    reason = StopReason.CANCELLED
                    break
                token = sampler.sample(self._ctx, self._batch.n_tokens - 1)
                n_out += 1
                if self._model.is_eog(token):
                    reason = StopReason.STOP
                    break
                reader.put(TokenEvent(tid, token, stream.push(token)))
                if stream.stopped:
                    reason = StopReason.STOP
                    break
                self._batch.clear()
                self._batch.add(token, pos, 0, True)
                self._ctx.decode(self._batch)
                pos += 1
        tail = stream.flush()
        if tail:
            reader.put(TokenEvent(tid, -1, tail))
        return FinishEvent(tid, reason, Usage(len(request.prompt_tokens), n_out))
