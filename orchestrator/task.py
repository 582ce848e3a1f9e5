"""A task's runtime state, owned by the engine thread.

Token bookkeeping: `tokens` is the prompt followed by every sampled token; `n_past` of them are in
the KV cache (the task's cells). A decoding task has exactly one token more than `n_past`: the
last sampled one, fed at the next step (it is not part of a saved state; the task keeps it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from orchestrator.engine import TaskReader, TextStream
from orchestrator.llama import Sampler
from orchestrator.loop_guard import LoopGuard
from orchestrator.scheduler import Phase, TaskView
from orchestrator.types import GenerationRequest, TaskState, Usage


@dataclass(eq=False)
class Task:
    request: GenerationRequest
    reader: TaskReader | None  # None for a cached session
    tokens: list[int]
    stream: TextStream
    guard: LoopGuard
    since: float  # when it last started waiting, or was last made resident
    phase: Phase = Phase.WAITING
    state: TaskState = TaskState.WAITING
    seq: int | None = None  # its sequence (slot) while resident
    n_past: int = 0
    n_cached: int = 0  # prompt tokens taken over from a cached session
    n_generated: int = 0
    sampler: Sampler | None = None
    created: float = 0.0
    logprobs: list = field(default_factory=list)
    device_seed: int = 0  # the seed of its draws in the graph (DeviceSampler): its own, else random

    @property
    def id(self) -> int:
        return self.request.task_id

    @property
    def n_prompt(self) -> int:
        return len(self.request.prompt_tokens)

    @property
    def prefill_left(self) -> int:
        return max(0, self.n_prompt - self.n_past)

    def view(self) -> TaskView:
        return TaskView(self.id, self.phase, self.n_past, self.prefill_left, self.since)

    def usage(self) -> Usage:
        return Usage(self.n_prompt, self.n_generated, self.n_cached)

    def kv_tokens(self) -> list[int]:
        """The tokens whose state the KV cache (or a saved state) holds."""
        return self.tokens[: self.n_past]


def top_logprobs(logits: np.ndarray, token: int, n: int) -> dict:
    """OpenAI-style logprob of the chosen token and the top `n` alternatives, from raw logits."""
    shifted = logits.astype(np.float64) - float(logits.max())
    logz = np.log(np.exp(shifted).sum())
    top = np.argpartition(-shifted, n)[:n] if n > 0 else np.empty(0, dtype=np.int64)
    top = top[np.argsort(-shifted[top])]
    return {
        "token": int(token),
        "logprob": float(shifted[token] - logz),
        "top": [(int(t), float(shifted[t] - logz)) for t in top],
    }
