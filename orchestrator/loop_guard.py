"""The two-stage loop guard of one task.

Detection: after each token, for every period p up to `window // repeats`, a run counter holds how
many consecutive tokens equal the token p positions earlier. A loop of period p is present when
that run covers `repeats - 1` further copies of a p-token unit (run >= p * (repeats - 1)) and p is
the smallest such period. Units shorter than `min_period` ("0, 0, 0", "-----") are content
unless they run on for `window // 4` tokens (one token over and over is a loop too). Identical
`<tool_call>` blocks in a row count as a loop of the call's length too.

Stage 1: while a loop persists, the repetition penalty on the tokens of the repeating unit rises
by `penalty_step` per further copy of the unit (applied to the logits llama.cpp-style: positive
logits divided, negative multiplied). It is held while the loop may return (one more copy of the unit counts
as a return) and relaxes to none after `window // 2` tokens without it.
Stage 2: a loop still present with the penalty at `penalty_cap` stops the task (reason LOOP).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class LoopGuardConfig:
    enabled: bool = True
    window: int = 256  # recent tokens examined
    min_period: int = 4  # shorter repeating units are content, not loops
    repeats: int = 4  # copies of the unit in a row that make a loop
    penalty_step: float = 0.1
    penalty_cap: float = 2.0

    def __post_init__(self) -> None:
        if not (2 <= self.repeats <= 64):
            raise ValueError(f"loop_repeats: must be between 2 and 64 (got {self.repeats})")
        if not (1 <= self.min_period <= self.window // self.repeats):
            raise ValueError(f"loop_min_period: must be between 1 and window/repeats (got {self.min_period})")
        if not (0.0 < self.penalty_step <= 1.0):
            raise ValueError(f"loop_penalty_step: must be in (0, 1] (got {self.penalty_step})")
        if not (1.0 < self.penalty_cap <= 10.0):
            raise ValueError(f"loop_penalty_cap: must be in (1, 10] (got {self.penalty_cap})")


@dataclass(frozen=True)
class GuardAction:
    action: str  # "penalty", "relax" or "stop"
    period: int
    penalty: float


class LoopGuard:
    """Observe a task's tokens; `apply()` its current penalty to the next logits."""

    def __init__(self, config: LoopGuardConfig):
        self.cfg = config
        self.max_period = config.window // config.repeats
        self._hist = np.full(self.max_period, -1, dtype=np.int64)  # _hist[k]: token k+1 positions back
        self._run = np.zeros(self.max_period, dtype=np.int64)
        self._periods = np.arange(1, self.max_period + 1)
        # short units ("-----", one token over and over) count only as a long run: window / 4 tokens
        copies = self._periods * (config.repeats - 1)
        self._need = np.where(
            self._periods < config.min_period, np.maximum(copies, config.window // 4), copies
        )
        self._recent: list[int] = []
        self.penalty = 1.0
        self.tokens = np.empty(0, dtype=np.int64)  # the tokens under penalty
        self._text = ""  # text since the last complete tool call
        self._n_seen = 0
        self._last_call: str | None = None
        self._last_call_at = 0
        self._same_calls = 0
        self._tool_loop = False
        self._active = 0  # period of the loop under penalty
        self._quiet = 0  # tokens since that loop last showed

    def period(self) -> int:
        """The loop's period in tokens, or 0 when there is no loop now.

        A new loop needs `repeats` copies of its unit; a loop already caught counts as back after
        a single further copy, so breaking it for a moment does not reset the guard."""
        p = self._active
        if p and self._run[p - 1] >= p:
            return p
        looping = np.flatnonzero(self._run >= self._need)
        if looping.size == 0:
            return 0
        p = int(self._periods[looping[0]])
        # a multiple of a shorter unit (8 = 4 x "0, ") is that unit, with that unit's rule
        shorter = np.flatnonzero(self._run[: p - 1] >= p * (self.cfg.repeats - 1))
        if shorter.size:
            d = int(shorter[0])
            return d + 1 if self._run[d] >= self._need[d] else 0
        return p

    def observe(self, token: int, text: str = "") -> GuardAction | None:
        """Record one generated token (and its text); returns what the guard did, if anything."""
        if not self.cfg.enabled:
            return None
        self._run = np.where(self._hist == token, self._run + 1, 0)
        self._hist = np.roll(self._hist, 1)
        self._hist[0] = token
        self._recent = [*self._recent, token][-self.cfg.window :]
        self._n_seen += 1
        if text and (action := self._observe_tool_calls(text)):
            return action
        if period := self.period():
            if period != self._active or self._run[period - 1] % period == 0:
                return self._escalate(period)  # a new loop, or one more full copy of its unit
            self._quiet = 0
            return None
        return None if self._tool_loop else self._relax()

    def _observe_tool_calls(self, text: str) -> GuardAction | None:
        """Identical tool calls in a row: each repeat raises the penalty a share of the way to the
        cap; the `repeats`-th identical call stops the task."""
        self._text = (self._text + text)[-16384:]
        match = TOOL_CALL.search(self._text)
        if match is None:
            return None
        call, self._text = match.group(1).strip(), self._text[match.end() :]
        period = min(self._n_seen - self._last_call_at, len(self._recent))
        self._last_call_at = self._n_seen
        self._same_calls = self._same_calls + 1 if call == self._last_call else 1
        self._last_call = call
        self._tool_loop = self._same_calls >= 2
        if self._same_calls >= self.cfg.repeats:
            return GuardAction("stop", period, self.penalty)
        if not self._tool_loop:
            return None
        self._add_tokens(self._recent[-period:])
        share = (self._same_calls - 1) / (self.cfg.repeats - 1)
        self.penalty = 1.0 + (self.cfg.penalty_cap - 1.0) * share
        return GuardAction("penalty", period, self.penalty)

    def _add_tokens(self, unit: list[int]) -> None:
        self.tokens = np.unique(np.concatenate([self.tokens, np.asarray(unit, dtype=np.int64)]))

    def _escalate(self, period: int) -> GuardAction:
        self._active, self._quiet = period, 0
        if self.penalty >= self.cfg.penalty_cap - 1e-9:
            return GuardAction("stop", period, self.penalty)
        self._add_tokens(self._recent[-period:])
        self.penalty = min(self.cfg.penalty_cap, self.penalty + self.cfg.penalty_step)
        return GuardAction("penalty", period, self.penalty)

    def _relax(self) -> GuardAction | None:
        """Hold the penalty while the loop may come back; drop it after `window // 2` quiet tokens."""
        if self.penalty <= 1.0:
            return None
        self._quiet += 1
        if self._quiet < self.cfg.window // 2:
            return None
        self.penalty, self.tokens, self._active = 1.0, np.empty(0, dtype=np.int64), 0
        return GuardAction("relax", 0, 1.0)

    def penalizing(self) -> bool:
        """Whether `apply()` changes the next logits (a penalty is in force on some tokens)."""
        return self.penalty > 1.0 and self.tokens.size > 0

    def apply(self, logits: np.ndarray) -> None:
        """Penalize the looping tokens in `logits` [n_vocab] in place."""
        if not self.penalizing():
            return
        sel = logits[self.tokens]
        logits[self.tokens] = np.where(sel > 0, sel / self.penalty, sel * self.penalty)
