"""The scheduling policy: a pure function from task snapshots to one step's plan.

Objective: aggregate tokens/s. Every resident task decodes or prefills every step (one batch),
so throughput grows with the number of resident tasks: among tasks that are not starving, the
cheapest (fewest KV cells) are admitted first, and an unprotected resident task that blocks two
or more waiting ones is paused for them ("five short tasks before one long one").

Bound: a task that has waited `age_bound_s` is *starving*. Starving tasks are served first, in
the order they started waiting, pausing resident tasks as needed; a task made resident is
protected from pausing for `quantum_s`. So a task waits at most
    age_bound_s + ceil(T / k) * quantum_s
where T is the number of open tasks and k how many fit in the slots and cells at once (k = 1 in
the worst case, every task needing the whole budget). docs/architecture.md states the argument.

Cells: `committed` cells of a resident task are those it holds plus those its pending prompt and
its next token need. The plan keeps the sum of committed cells within the budget, so a decode
never fails for lack of KV space.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field


class Phase(enum.Enum):
    WAITING = "waiting"  # not started: no cells, nothing saved
    RESIDENT = "resident"  # holds a sequence slot and its cells; runs every step
    PAUSED = "paused"  # state saved in the swap pool; needs `cells` on resume
    CACHED = "cached"  # a finished conversation kept resident for session reuse; never runs


@dataclass(frozen=True)
class TaskView:
    """What the policy sees of one task."""

    id: int
    phase: Phase
    cells: int  # KV cells held (resident/cached) or needed on resume (paused)
    prefill_left: int = 0  # prompt tokens not yet in the KV cache
    since: float = 0.0  # waiting/paused: when it started waiting; resident: when it was admitted

    @property
    def committed(self) -> int:
        """Cells this task will hold after its prompt and its next token."""
        return self.cells if self.phase is Phase.CACHED else self.cells + self.prefill_left + 1


@dataclass(frozen=True)
class Budget:
    n_slots: int  # sequences of the context (n_seq_max)
    n_cells: int  # KV cells shared by all sequences (n_ctx)
    n_batch: int  # tokens per step
    chunk: int  # most prompt tokens of one task per step
    age_bound_s: float = 2.0
    quantum_s: float = 0.5

    def wait_bound_s(self, n_tasks: int, fit_at_once: int) -> float:
        """The promised bound on any task's wait (see module docstring)."""
        return self.age_bound_s + math.ceil(n_tasks / max(1, fit_at_once)) * self.quantum_s


@dataclass
class Plan:
    pause: list[int] = field(default_factory=list)  # resident/cached -> paused (or dropped, if cached)
    resume: list[int] = field(default_factory=list)  # paused -> resident
    admit: list[int] = field(default_factory=list)  # waiting -> resident
    decode: list[int] = field(default_factory=list)  # resident tasks with their prompt done
    prefill: dict[int, int] = field(default_factory=dict)  # resident task -> prompt tokens this step

    @property
    def n_tokens(self) -> int:
        return len(self.decode) + sum(self.prefill.values())


class _State:
    """The scheduler's working copy: who is resident and how many cells are committed."""

    def __init__(self, views: list[TaskView], budget: Budget, now: float):
        self.budget, self.now = budget, now
        self.resident = {v.id: v for v in views if v.phase in (Phase.RESIDENT, Phase.CACHED)}
        self.plan = Plan()

    @property
    def free_slots(self) -> int:
        return self.budget.n_slots - len(self.resident)

    @property
    def free_cells(self) -> int:
        return self.budget.n_cells - sum(v.committed for v in self.resident.values())

    def fits(self, v: TaskView) -> bool:
        return self.free_slots >= 1 and self.free_cells >= v.committed

    def protected(self, v: TaskView) -> bool:
        return v.phase is Phase.RESIDENT and self.now - v.since < self.budget.quantum_s

    def bring_in(self, v: TaskView) -> None:
        (self.plan.resume if v.phase is Phase.PAUSED else self.plan.admit).append(v.id)
        self.resident[v.id] = TaskView(v.id, Phase.RESIDENT, v.cells, v.prefill_left, self.now)

    def evict(self, v: TaskView) -> None:
        self.plan.pause.append(v.id)
        del self.resident[v.id]

    def victims(self, allow_protected: bool = False) -> list[TaskView]:
        """Resident tasks in the order they would be paused: cached sessions (least recent first),
        then the largest unprotected running tasks."""
        cached = sorted((v for v in self.resident.values() if v.phase is Phase.CACHED), key=lambda v: v.since)
        running = [v for v in self.resident.values() if v.phase is Phase.RESIDENT]
        running = [v for v in running if allow_protected or not self.protected(v)]
        return cached + sorted(running, key=lambda v: (-v.cells, v.since))

    def make_room(self, need: TaskView, pool: list[TaskView]) -> bool:
        """Evict from `pool` (in order) until `need` fits; all or nothing."""
        chosen, slots, cells = [], self.free_slots, self.free_cells
        for v in pool:
            if slots >= 1 and cells >= need.committed:
                break
            chosen.append(v)
            slots, cells = slots + 1, cells + v.committed
        if slots < 1 or cells < need.committed:
            return False
        for v in chosen:
            self.evict(v)
        return True


def _starving(v: TaskView, budget: Budget, now: float) -> bool:
    return now - v.since >= budget.age_bound_s


def schedule(views: list[TaskView], budget: Budget, now: float) -> Plan:
    """One step's plan. Pure: same inputs, same plan.

    Raises ValueError if a task can never fit (its committed cells exceed the whole budget):
    the engine stops such tasks before asking.
    """
    for v in views:
        if v.committed > budget.n_cells and v.phase is not Phase.CACHED:
            raise ValueError(f"task {v.id} needs {v.committed} cells, over the budget of {budget.n_cells}")
    st = _State(views, budget, now)
    outside = [v for v in views if v.phase in (Phase.WAITING, Phase.PAUSED)]
    starving = sorted((v for v in outside if _starving(v, budget, now)), key=lambda v: v.since)
    others = sorted(
        (v for v in outside if not _starving(v, budget, now)), key=lambda v: (v.committed, v.since)
    )
    for v in starving:  # bounded wait: served first, pausing unprotected tasks if needed
        if st.fits(v) or st.make_room(v, st.victims()):
            st.bring_in(v)
    _admit_cheapest(st, others)
    _keep_within_budget(st)
    _assign_work(st)
    return st.plan


def _admit_cheapest(st: _State, candidates: list[TaskView]) -> None:
    """Throughput: cheapest first; cached sessions give way to any task; one unprotected
    running task gives way when that lets two or more in."""
    cached = [v for v in st.victims() if v.phase is Phase.CACHED]
    blocked = []
    for v in candidates:
        if st.fits(v) or st.make_room(v, cached):
            st.bring_in(v)
            cached = [c for c in cached if c.id in st.resident]
        else:
            blocked.append(v)
    if len(blocked) < 2:
        return
    running = [v for v in st.victims() if v.phase is Phase.RESIDENT]
    if not running:
        return
    victim = running[0]  # the largest unprotected running task
    slots, cells = st.free_slots + 1, st.free_cells + victim.committed
    gain = []
    for v in blocked:
        if slots >= 1 and cells >= v.committed:
            gain.append(v)
            slots, cells = slots - 1, cells - v.committed
    if len(gain) >= 2:
        st.evict(victim)
        for v in gain:
            st.bring_in(v)


def _keep_within_budget(st: _State) -> None:
    """Decoding tasks grow a cell per step: pause until the committed cells fit again."""
    while st.free_cells < 0:
        pool = st.victims() or st.victims(allow_protected=True)
        running = [v for v in st.resident.values() if v.phase is Phase.RESIDENT]
        if not pool or (len(running) <= 1 and pool[0].phase is Phase.RESIDENT):
            break  # a lone task: the engine stops it at the budget (LENGTH)
        st.evict(pool[0])


def _assign_work(st: _State) -> None:
    """Every resident task decodes; the rest of the step's tokens go to prompt chunks, oldest first."""
    running = sorted((v for v in st.resident.values() if v.phase is Phase.RESIDENT), key=lambda v: v.since)
    st.plan.decode = [v.id for v in running if v.prefill_left == 0]
    room = st.budget.n_batch - len(st.plan.decode)
    for v in running:
        if v.prefill_left and room > 0:
            n = min(v.prefill_left, st.budget.chunk, room)
            st.plan.prefill[v.id] = n
            room -= n
