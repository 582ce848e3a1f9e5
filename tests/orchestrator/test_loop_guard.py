"""The loop guard: detection, the two stages, tool calls, and no false stops on normal text."""

from __future__ import annotations

import csv
import http
import inspect
import json
import keyword
import string
import textwrap
import token

import numpy as np
import pytest

from orchestrator.llama import ContextParams
from orchestrator.llama_engine import EngineConfig, LlamaEngine
from orchestrator.loop_guard import LoopGuard, LoopGuardConfig
from orchestrator.types import GenerationRequest, SamplingParams, StopReason, TokenEvent


def feed(guard: LoopGuard, tokens, texts=None) -> list:
    texts = texts or [""] * len(tokens)
    return [a for t, s in zip(tokens, texts, strict=True) if (a := guard.observe(t, s)) is not None]


def test_detects_the_smallest_period_after_enough_copies():
    guard = LoopGuard(LoopGuardConfig(min_period=3, repeats=4))
    unit = [5, 6, 7, 8, 9]
    actions = feed(guard, [1, 2] + unit * 3 + unit[:-1])
    assert actions == []  # three copies and a bit: not yet
    actions = feed(guard, [unit[-1]])
    assert [(a.action, a.period) for a in actions] == [("penalty", 5)]


def test_penalty_rises_per_copy_then_stops_at_the_cap():
    cfg = LoopGuardConfig(min_period=3, repeats=4, penalty_step=0.25, penalty_cap=2.0)
    guard = LoopGuard(cfg)
    actions = feed(guard, [10, 11, 12] * 12)
    kinds = [a.action for a in actions]
    assert kinds[:4] == ["penalty"] * 4
    assert [round(a.penalty, 2) for a in actions[:4]] == [1.25, 1.5, 1.75, 2.0]
    assert kinds[4] == "stop"


def test_penalty_applies_to_the_looping_tokens_only():
    guard = LoopGuard(LoopGuardConfig(min_period=2, repeats=3))
    feed(guard, [3, 4] * 3)
    logits = np.array([1.0, 1.0, 1.0, 2.0, -2.0, 1.0], dtype=np.float32)
    guard.apply(logits)
    p = guard.penalty
    assert p > 1.0
    np.testing.assert_allclose(logits, [1.0, 1.0, 1.0, 2.0 / p, -2.0 * p, 1.0], rtol=1e-6)


def test_penalty_is_held_while_the_loop_may_return_then_relaxes():
    cfg = LoopGuardConfig(window=64, min_period=3, repeats=3)
    guard = LoopGuard(cfg)
    feed(guard, [1, 2, 3] * 3)
    assert guard.penalty > 1.0
    actions = feed(guard, list(range(100, 100 + 31)))  # 31 quiet tokens: held
    assert actions == [] and guard.penalty > 1.0
    actions = feed(guard, [999])
    assert [a.action for a in actions] == ["relax"] and guard.penalty == 1.0


def test_short_units_are_content_unless_they_run_on():
    guard = LoopGuard(LoopGuardConfig(window=128, min_period=4, repeats=4))
    assert feed(guard, [7, 8] * 12) == []  # "0, 0, 0, ..." in a short run
    actions = feed(guard, [9] * 40)  # one token 32+ times: window / 4
    assert actions and actions[0].period == 1


def test_identical_tool_calls_escalate_and_stop():
    guard = LoopGuard(LoopGuardConfig(repeats=3))
    call = '<tool_call>{"name": "ls", "arguments": {}}</tool_call>'
    actions = []
    for i in range(3):
        chunk = [f"thinking {i} ", call]
        actions += feed(guard, [100 + 2 * i, 101 + 2 * i], chunk)
    assert [a.action for a in actions] == ["penalty", "stop"]


def test_disabled_guard_does_nothing():
    guard = LoopGuard(LoopGuardConfig(enabled=False))
    assert feed(guard, [1, 2, 3, 4] * 50) == []


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"repeats": 1}, "loop_repeats"),
        ({"min_period": 200}, "loop_min_period"),
        ({"penalty_cap": 1.0}, "cap"),
    ],
)
def test_bad_config_names_the_setting(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LoopGuardConfig(**kwargs)


def normal_texts() -> dict[str, str]:
    """Normal text an agent writes: real code with legitimately similar lines, tables, prose."""
    texts = {name: inspect.getsource(mod) for name, mod in
             [("http", http), ("token", token), ("keyword", keyword), ("string", string), ("json", json),
              ("textwrap", textwrap), ("csv", csv)]}  # fmt: skip
    texts["table"] = "| name | value |\n| --- | --- |\n" + "".join(
        f"| item{i} | {i * i} |\n" for i in range(60)
    )
    texts["grid"] = "grid = [\n" + "".join("    [0, 0, 0, 0, 0, 0, 0, 0],\n" for _ in range(12)) + "]\n"
    texts["prose"] = inspect.getdoc(textwrap.TextWrapper) + "\n" + inspect.getdoc(json.JSONDecoder)
    return texts


def test_false_stop_rate_is_zero_on_normal_text(gemma_path):
    from orchestrator.llama import Model

    with Model(gemma_path) as model:
        stops = {}
        for name, text in normal_texts().items():
            guard = LoopGuard(LoopGuardConfig())
            actions = feed(guard, model.tokenize(text, add_special=False))
            stops[name] = sum(a.action == "stop" for a in actions)
    assert stops == dict.fromkeys(stops, 0)


def test_the_guard_breaks_or_stops_gemmas_greedy_loop(gemma_path):
    prompt = "The capital of France is"

    def run(enabled: bool):
        ctx = ContextParams(n_ctx=1024, n_seq_max=1, n_threads=2)
        engine = LlamaEngine(
            str(gemma_path), EngineConfig(context=ctx, loop_guard=LoopGuardConfig(enabled=enabled))
        )
        try:
            req = GenerationRequest(
                tuple(engine.tokenize(prompt)), SamplingParams(temperature=0.0, max_tokens=400)
            )
            reader = engine.submit(req)
            tokens = [e.token for e in reader if isinstance(e, TokenEvent) and e.token >= 0]
            return tokens, reader.finish
        finally:
            engine.close()

    def loops_at_the_end(tokens) -> bool:
        guard = LoopGuard(LoopGuardConfig())
        feed(guard, tokens[-256:])
        return guard.period() > 0

    plain, finish = run(False)
    assert finish.reason is StopReason.LENGTH and loops_at_the_end(plain)  # the loop is real
    guarded, finish = run(True)
    # stopped (LOOP), or broken: it ended by itself (end-of-generation) or no longer loops
    assert finish.reason in (StopReason.LOOP, StopReason.STOP) or not loops_at_the_end(guarded)
    assert len(guarded) < len(plain) or not loops_at_the_end(guarded)
