"""The scheduling policy alone, driven by a simulated engine with a fake clock."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest

from orchestrator.scheduler import Budget, Phase, TaskView, schedule

STEP_S = 0.05


@dataclass
class SimTask:
    id: int
    prompt: int
    gen: int
    arrival: float
    phase: Phase = Phase.WAITING
    cells: int = 0
    prefilled: int = 0
    generated: int = 0
    since: float = 0.0
    first_served: float | None = None
    done_at: float | None = None
    max_wait: float = 0.0

    def view(self) -> TaskView:
        return TaskView(self.id, self.phase, self.cells, self.prompt - self.prefilled, self.since)


class Sim:
    """Applies plans like the engine would: cells grow by the tokens fed; a task ends after `gen` tokens."""

    def __init__(self, budget: Budget, tasks: list[SimTask]):
        self.budget, self.tasks, self.now, self.steps = budget, {t.id: t for t in tasks}, 0.0, 0
        for t in tasks:
            t.since = t.arrival

    def open_tasks(self) -> list[SimTask]:
        return [t for t in self.tasks.values() if t.done_at is None and t.arrival <= self.now]

    def step(self) -> None:
        plan = schedule([t.view() for t in self.open_tasks()], self.budget, self.now)
        resident = [t for t in self.open_tasks() if t.phase is Phase.RESIDENT]
        assert len(resident) - len(plan.pause) + len(plan.admit) + len(plan.resume) <= self.budget.n_slots
        for tid in plan.pause:
            t = self.tasks[tid]
            t.phase, t.since = Phase.PAUSED, self.now
        for tid in plan.admit + plan.resume:
            t = self.tasks[tid]
            t.max_wait = max(t.max_wait, self.now - t.since)
            t.phase, t.since = Phase.RESIDENT, self.now
            t.first_served = self.now if t.first_served is None else t.first_served
        assert plan.n_tokens <= self.budget.n_batch
        for tid, n in plan.prefill.items():
            self.tasks[tid].prefilled += n
            self.tasks[tid].cells += n
        for tid in plan.decode:
            t = self.tasks[tid]
            t.cells += 1
            t.generated += 1
            if t.generated >= t.gen:
                t.done_at = self.now
        held = sum(t.cells for t in self.tasks.values() if t.phase is Phase.RESIDENT and t.done_at is None)
        assert held <= self.budget.n_cells, "a decode would have failed for lack of KV cells"
        self.now += STEP_S
        self.steps += 1

    def run(self, max_steps: int = 100_000) -> None:
        while any(t.done_at is None for t in self.tasks.values()):
            self.step()
            assert self.steps < max_steps, "the simulation did not finish"
        for t in self.tasks.values():  # waits still open at the end count too
            assert t.done_at is not None


def test_burst_of_30_tasks_on_12_slots_all_finish_within_the_bound():
    budget = Budget(n_slots=12, n_cells=4096, n_batch=256, chunk=64, age_bound_s=1.0, quantum_s=0.25)
    rng = random.Random(7)
    tasks = [SimTask(i, rng.randint(20, 200), rng.randint(10, 80), 0.0) for i in range(30)]
    sim = Sim(budget, tasks)
    sim.run()
    bound = budget.wait_bound_s(len(tasks), fit_at_once=12)
    assert max(t.max_wait for t in tasks) <= bound + STEP_S
    assert all(t.generated == t.gen for t in tasks)


def test_no_task_waits_longer_than_the_bound_under_a_tight_budget():
    # every task needs most of the budget: one at a time (k = 1)
    budget = Budget(n_slots=4, n_cells=600, n_batch=128, chunk=128, age_bound_s=0.5, quantum_s=0.2)
    tasks = [SimTask(i, 300, 40, arrival=0.01 * i) for i in range(8)]
    sim = Sim(budget, tasks)
    sim.run()
    bound = budget.wait_bound_s(len(tasks), fit_at_once=1)
    waits = [t.max_wait for t in tasks]
    assert max(waits) <= bound + STEP_S, waits


def test_five_short_tasks_are_not_held_behind_one_long_one():
    # the long task holds almost the whole budget: at most one short task fits beside it
    budget = Budget(n_slots=12, n_cells=950, n_batch=256, chunk=256, age_bound_s=5.0, quantum_s=0.2)
    long = SimTask(0, 900, 40, arrival=0.0)
    shorts = [SimTask(i, 40, 20, arrival=0.01) for i in range(1, 6)]
    sim = Sim(budget, [long, *shorts])
    sim.run()
    assert max(t.done_at for t in shorts) < long.done_at
    assert all(t.max_wait <= budget.quantum_s + 2 * STEP_S for t in shorts)  # far below the 5 s age bound
    assert long.max_wait > 0  # it was paused for them
    assert long.generated == long.gen


def test_short_tasks_arriving_together_with_a_long_one_go_first():
    budget = Budget(n_slots=12, n_cells=1000, n_batch=512, chunk=512, age_bound_s=5.0, quantum_s=0.2)
    views = [TaskView(0, Phase.WAITING, 0, 900, 0.0)] + [
        TaskView(i, Phase.WAITING, 0, 40, 0.0) for i in range(1, 6)
    ]
    plan = schedule(views, budget, now=0.0)
    assert sorted(plan.admit) == [1, 2, 3, 4, 5]


def test_starving_task_preempts_after_the_quantum():
    budget = Budget(n_slots=1, n_cells=1000, n_batch=64, chunk=64, age_bound_s=1.0, quantum_s=0.5)
    running = TaskView(1, Phase.RESIDENT, 100, 0, since=0.0)
    waiting = TaskView(2, Phase.PAUSED, 50, 0, since=0.0)
    assert schedule([running, waiting], budget, now=0.4).resume == []  # not starving yet
    plan = schedule([running, waiting], budget, now=1.0)
    assert plan.pause == [1] and plan.resume == [2] and plan.decode == [2]


def test_decode_growth_pauses_someone_instead_of_failing():
    budget = Budget(n_slots=4, n_cells=100, n_batch=64, chunk=64, age_bound_s=10.0, quantum_s=0.0)
    views = [TaskView(1, Phase.RESIDENT, 50, 0, 0.0), TaskView(2, Phase.RESIDENT, 49, 0, 0.0)]
    plan = schedule(views, budget, now=1.0)
    assert plan.pause == [1]  # the larger one
    assert plan.decode == [2]


def test_cached_sessions_give_way_first():
    budget = Budget(n_slots=2, n_cells=100, n_batch=64, chunk=64)
    views = [TaskView(1, Phase.CACHED, 60, 0, 0.0), TaskView(2, Phase.WAITING, 0, 50, 0.0)]
    plan = schedule(views, budget, now=0.0)
    assert plan.pause == [1] and plan.admit == [2] and plan.prefill == {2: 50}


def test_prefill_is_chunked_and_shares_the_step_with_decodes():
    budget = Budget(n_slots=4, n_cells=4000, n_batch=100, chunk=64)
    views = [
        TaskView(1, Phase.RESIDENT, 10, 0, 0.0),
        TaskView(2, Phase.RESIDENT, 0, 1000, 0.1),
        TaskView(3, Phase.RESIDENT, 0, 1000, 0.2),
    ]
    plan = schedule(views, budget, now=1.0)
    assert plan.decode == [1]
    assert plan.prefill == {2: 64, 3: 35}
    assert plan.n_tokens == 100


def test_a_task_over_the_whole_budget_is_refused():
    budget = Budget(n_slots=2, n_cells=100, n_batch=64, chunk=64)
    with pytest.raises(ValueError, match="over the budget of 100"):
        schedule([TaskView(1, Phase.WAITING, 0, 200, 0.0)], budget, now=0.0)


def test_bound_formula():
    budget = Budget(n_slots=12, n_cells=1, n_batch=1, chunk=1, age_bound_s=2.0, quantum_s=0.5)
    assert budget.wait_bound_s(30, 12) == 2.0 + math.ceil(30 / 12) * 0.5
