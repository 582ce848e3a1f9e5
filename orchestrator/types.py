"""What crosses the engine's boundary: requests in, events out. Typed, validated, JSON-able."""

from __future__ import annotations

import enum
import itertools
from dataclasses import asdict, dataclass, field

_task_ids = itertools.count(1)


class InvalidRequest(ValueError):
    """A request field is wrong; `field` names it, the message says what is allowed."""

    def __init__(self, field_name: str, message: str, status: int = 400):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.status = status


class TaskState(enum.Enum):
    """Lifecycle of a task (ARCHITECTURE: WAITING -> PREFILLING -> DECODING -> (PAUSED) -> DONE)."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    PAUSED = "paused"
    DONE = "done"


class StopReason(enum.Enum):
    """Why a generation ended. The loop guard's stop is a reason of its own, not a flag."""

    STOP = "stop"  # end-of-generation token or a stop string
    LENGTH = "length"  # max_tokens reached, or the context budget
    LOOP = "loop"  # the loop guard stopped a repeating generation
    CANCELLED = "cancelled"
    ERROR = "error"


def _check_range(name: str, value, lo, hi) -> None:
    if not (lo <= value <= hi):
        raise InvalidRequest(name, f"must be between {lo} and {hi} (got {value})", status=422)


@dataclass(frozen=True)
class SamplingParams:
    """Per-task sampling. temperature 0 means greedy."""

    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    seed: int | None = None
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 512
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: off; n >= 0: the chosen token's logprob and the top n

    @property
    def has_penalties(self) -> bool:
        """Repetition, presence or frequency penalties: they need the task's history."""
        return self.repeat_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    @property
    def is_greedy(self) -> bool:
        """Temperature 0 and no penalties: the next token is the argmax of the logits."""
        return self.temperature <= 0.0 and not self.has_penalties

    def __post_init__(self) -> None:
        _check_range("temperature", self.temperature, 0.0, 5.0)
        _check_range("top_p", self.top_p, 0.0, 1.0)
        _check_range("top_k", self.top_k, 0, 1_000_000)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("repeat_penalty", self.repeat_penalty, 0.0, 10.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_range("max_tokens", self.max_tokens, 1, 10_000_000)
        if self.seed is not None:
            _check_range("seed", self.seed, 0, 2**32 - 2)
        if self.logprobs is not None:
            _check_range("top_logprobs", self.logprobs, 0, 20)
        if len(self.stop) > 16 or any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequest("stop", "must be up to 16 non-empty strings")


@dataclass(frozen=True)
class GenerationRequest:
    """One generation: a prompt already as tokens, and how to sample its continuation."""

    prompt_tokens: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    task_id: int = field(default_factory=lambda: next(_task_ids))

    def __post_init__(self) -> None:
        if not self.prompt_tokens:
            raise InvalidRequest("prompt", "must not be empty")


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_json(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(frozen=True)
class TokenEvent:
    """New text of a task. `text` may be empty while bytes of a UTF-8 character are pending."""

    task_id: int
    token: int
    text: str
    logprob: dict | None = None  # {"token", "logprob", "top": [(token, logprob), ...]} when asked for

    def to_json(self) -> dict:
        return {"type": "token", **asdict(self)}


@dataclass(frozen=True)
class FinishEvent:
    """The last event of a task."""

    task_id: int
    reason: StopReason
    usage: Usage
    error: str | None = None

    def to_json(self) -> dict:
        return {
            "type": "finish",
            "task_id": self.task_id,
            "reason": self.reason.value,
            "usage": self.usage.to_json(),
            "error": self.error,
        }
