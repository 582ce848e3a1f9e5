"""Typed engine events and the bus that fans them out to subscribers (the websocket face).

The engine thread publishes; a subscriber reads from its own bounded queue. A slow subscriber
loses its oldest events rather than ever blocking the engine.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Event:
    """Base: every event has a type name and a wall-clock timestamp."""

    def to_json(self) -> dict:
        return {"type": self.kind, **asdict(self)}

    @property
    def kind(self) -> str:
        return _KINDS[type(self)]


@dataclass(frozen=True)
class TaskStateChanged(Event):
    task_id: int
    state: str  # TaskState value
    reason: str | None = None  # StopReason value when state is "done"
    ts: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Swapped(Event):
    """A task's state moved to (pause) or from (resume) the swap pool."""

    task_id: int
    direction: str  # "pause" or "resume"
    bytes: int
    ms: float
    where: str  # "ram" or "disk"
    ts: float = field(default_factory=time.time)


@dataclass(frozen=True)
class LoopGuardAction(Event):
    """Stage 1 ("penalty": the repetition penalty on the looping tokens changed) or stage 2 ("stop")."""

    task_id: int
    action: str  # "penalty", "relax" or "stop"
    period: int  # tokens per repetition of the loop (0 when relaxing)
    penalty: float
    ts: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Throughput(Event):
    """Periodic engine figures over the last window."""

    tok_s: float  # generated tokens per second, all tasks together
    prefill_tok_s: float
    running: int
    waiting: int
    paused: int
    swap_bytes: int
    ts: float = field(default_factory=time.time)


_KINDS = {
    TaskStateChanged: "task_state",
    Swapped: "swap",
    LoopGuardAction: "loop_guard",
    Throughput: "throughput",
}


class Subscription:
    """One subscriber's queue; iterate or call get()."""

    def __init__(self, bus: EventBus, maxsize: int):
        self._bus = bus
        self.queue: queue.Queue[Event] = queue.Queue(maxsize)
        self.dropped = 0

    def offer(self, event: Event) -> None:
        while True:
            try:
                self.queue.put_nowait(event)
                return
            except queue.Full:
                try:
                    self.queue.get_nowait()
                    self.dropped += 1
                except queue.Empty:
                    pass

    def get(self, timeout: float | None = None) -> Event:
        return self.queue.get(timeout=timeout)

    def close(self) -> None:
        self._bus.unsubscribe(self)


class EventBus:
    def __init__(self):
        self._subs: list[Subscription] = []
        self._lock = threading.Lock()

    def subscribe(self, maxsize: int = 10_000) -> Subscription:
        sub = Subscription(self, maxsize)
        with self._lock:
            self._subs.append(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)

    def publish(self, event: Event) -> None:
        with self._lock:
            subs = list(self._subs)
        for sub in subs:
            sub.offer(event)
