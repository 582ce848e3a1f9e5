"""Residency: which task holds which sequence of the context, moving states to and from the
SwapPool, and the cached sessions kept for reuse. Engine thread only."""

from __future__ import annotations

import logging
import time

from orchestrator import events as ev
from orchestrator.llama import Context
from orchestrator.scheduler import Phase
from orchestrator.swap import SwapFull, SwapPool
from orchestrator.task import Task

log = logging.getLogger(__name__)


class Residency:
    """Sequence slots (allocate/free with asserted invariants), saved states and sessions.

    A *holder* is a task or a cached session (a finished task whose reader is None).
    """

    def __init__(self, ctx: Context, swap: SwapPool, events: ev.EventBus, n_slots: int, max_sessions: int):
        self.ctx, self.swap, self.events = ctx, swap, events
        self.n_slots = n_slots
        self.max_sessions = max_sessions
        self.free_seqs = list(range(n_slots))
        self.sessions: list[Task] = []  # least recently used first

    # ---- sequences ----

    def take_seq(self) -> int:
        seq = self.free_seqs.pop(0)  # FIFO: a resumed task usually lands in another sequence
        assert self.ctx.seq_pos_max(seq) == -1, f"sequence {seq} is not empty"
        return seq

    def release_seq(self, holder: Task) -> None:
        assert holder.seq is not None and holder.seq not in self.free_seqs
        self.ctx.seq_rm(holder.seq)
        self.free_seqs.append(holder.seq)
        holder.seq = None

    # ---- moving states ----

    def save(self, holder: Task) -> None:
        """Copy the holder's sequence into the pool (the sequence stays until `release_seq`).
        Raises SwapFull when the pool cannot take it."""
        t0 = time.perf_counter()
        buf = self.swap.acquire(self.ctx.state_size(holder.seq))
        n = self.ctx.state_save(holder.seq, buf)
        try:
            if n == 0:
                raise SwapFull(f"llama_state_seq_get_data wrote nothing for sequence {holder.seq}")
            where = self.swap.put(holder.id, buf, n)
        except SwapFull:
            self.swap.release(buf)
            raise
        self.events.publish(ev.Swapped(holder.id, "pause", n, 1000 * (time.perf_counter() - t0), where))

    def load(self, event_id: int, key: int, seq: int) -> bool:
        """Restore the saved state `key` into the empty sequence `seq`; the state leaves the pool."""
        t0 = time.perf_counter()
        where = self.swap.where(key)
        buf, n = self.swap.take(key)
        ok = self.ctx.state_load(seq, buf, n)
        self.swap.release(buf)
        self.events.publish(ev.Swapped(event_id, "resume", n, 1000 * (time.perf_counter() - t0), where))
        if not ok:
            log.error("restoring state %d into sequence %d failed", key, seq)
            self.ctx.seq_rm(seq)
        return ok

    def pause(self, holder: Task, now: float) -> None:
        """Save and free the holder's sequence. A session the pool cannot take is dropped; for a
        task, SwapFull propagates and the task keeps its sequence."""
        try:
            self.save(holder)
        except SwapFull:
            if holder.reader is not None:
                raise
            self.release_seq(holder)  # a cached session is only an optimisation
            self.sessions.remove(holder)
            return
        self.release_seq(holder)
        holder.phase, holder.since = Phase.PAUSED, now

    def resume(self, task: Task, now: float) -> bool:
        task.seq = self.take_seq()
        if not self.load(task.id, task.id, task.seq):
            self.free_seqs.append(task.seq)
            task.seq = None
            return False
        task.phase, task.since = Phase.RESIDENT, now
        return True

    def admit(self, task: Task, now: float) -> int:
        """Give a waiting task a sequence, taking over or restoring the longest cached session
        that its prompt extends. Returns the number of prompt tokens reused."""
        session = self.find_session(task.request.prompt_tokens)
        if session is not None and session.phase is Phase.CACHED:
            task.seq, session.seq = session.seq, None  # take over its sequence as it is
        else:
            task.seq = self.take_seq()
            if session is not None and not self.load(task.id, session.id, task.seq):
                self.sessions.remove(session)
                session = None
        if session is not None:
            task.n_past = task.n_cached = session.n_past
            self.sessions.remove(session)
        task.phase, task.since = Phase.RESIDENT, now
        return task.n_cached

    def drop(self, holder: Task) -> None:
        """Forget whatever the holder has: its sequence or its saved state."""
        if holder.phase in (Phase.RESIDENT, Phase.CACHED) and holder.seq is not None:
            self.release_seq(holder)
        elif holder.phase is Phase.PAUSED:
            self.swap.drop(holder.id)

    # ---- sessions ----

    def find_session(self, prompt: tuple[int, ...]) -> Task | None:
        """The cached session with the longest state that is a prefix of `prompt` (leaving at least
        the prompt's last token to prefill: the task needs its logits)."""
        best = None
        for s in self.sessions:
            n = s.n_past
            longer = best is None or n > best.n_past
            if 0 < n < len(prompt) and longer and tuple(s.tokens[:n]) == prompt[:n]:
                best = s
        return best

    def keep_session(self, task: Task) -> None:
        """Keep a finished task's state for reuse; past `max_sessions`, the oldest is dropped."""
        if self.max_sessions == 0 or task.phase not in (Phase.RESIDENT, Phase.PAUSED):
            self.drop(task)
            return
        task.reader, task.sampler = None, None
        if task.phase is Phase.RESIDENT:
            task.phase = Phase.CACHED
        task.since = time.monotonic()
        self.sessions.append(task)
        while len(self.sessions) > self.max_sessions:
            self.drop(self.sessions.pop(0))

    def resident_sessions(self) -> list[Task]:
        return [s for s in self.sessions if s.phase is Phase.CACHED]

    def session(self, tid: int) -> Task | None:
        return next((s for s in self.sessions if s.id == tid), None)
