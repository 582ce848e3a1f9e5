#!/usr/bin/env python3
"""False-stop rate of the loop guard on normal generations of Gemma 3 270M.

Each prompt (code and prose) is generated with sampling and the guard off; generations that
loop are set aside, judged without the guard: the end is exactly periodic, or one line makes up
a third of the lines, 5 times or more. The guard (default settings) then replays every
remaining, normal generation token by token: any "stop" is a false stop. The same is done for
normal texts (standard-library code with similar lines, a table, a grid of identical rows).
Writes bench/results/loop-guard-false-stops.json and prints the rates.

    .venv/bin/python bench/loop_guard_false_stops.py [--samples 3] [--max-tokens 200]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import orchestrator  # noqa: E402, F401
from bench.engine_cpu import cpu_name, git_commit  # noqa: E402
from orchestrator.llama import ContextParams  # noqa: E402
from orchestrator.llama_engine import EngineConfig, LlamaEngine  # noqa: E402
from orchestrator.loop_guard import LoopGuard, LoopGuardConfig  # noqa: E402
from orchestrator.models import bundled_gemma  # noqa: E402
from orchestrator.types import GenerationRequest, SamplingParams, TokenEvent  # noqa: E402
from tests.orchestrator.test_loop_guard import normal_texts  # noqa: E402

PROMPTS = [
    'def parse_config(path):\n    """Read a TOML config file and return a dict."""\n',
    "class Vector:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    "    def __add__(self, other):\n",
    "import unittest\n\n\nclass TestMath(unittest.TestCase):\n    def test_add(self):\n"
    "        self.assertEqual(1 + 1, 2)\n\n",
    "SELECT name, email FROM users WHERE",
    "The history of the printing press begins",
    "Here is a recipe for lentil soup. Ingredients:",
    "Dear hiring manager,\n\nI am writing to apply for",
    "# Installation\n\nTo install the package, run",
    "Capybaras are the largest rodents in the world. They live",
    "const express = require('express');\nconst app = express();\n\napp.get('/', (req, res) => {",
]


def replay_stops(tokens: list[int]) -> int:
    guard = LoopGuard(LoopGuardConfig())
    return sum(1 for t in tokens if (a := guard.observe(t)) is not None and a.action == "stop")


def loops_at_end(tokens: list[int]) -> bool:
    guard = LoopGuard(LoopGuardConfig())
    for t in tokens[-256:]:
        guard.observe(t)
    return guard.period() > 0


def degenerate(text: str) -> bool:
    """A generation that keeps writing the same line: one line 5+ times and a third of all lines
    (judged on the text, independently of the guard)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if len(lines) < 6:
        return False
    top = max(lines.count(ln) for ln in set(lines))
    return top >= 5 and top * 3 >= len(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=3, help="seeds per prompt")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "loop-guard-false-stops.json"))
    args = ap.parse_args()
    ctx = ContextParams(n_ctx=4096, n_batch=512, n_seq_max=4, flash_attn="on")
    engine = LlamaEngine(
        str(bundled_gemma()), EngineConfig(context=ctx, loop_guard=LoopGuardConfig(enabled=False))
    )
    gens = []
    try:
        for prompt in PROMPTS:
            for seed in range(args.samples):
                sp = SamplingParams(temperature=0.7, top_p=0.95, seed=seed, max_tokens=args.max_tokens)
                reader = engine.submit(GenerationRequest(tuple(engine.tokenize(prompt)), sp))
                gens.append([e.token for e in reader if isinstance(e, TokenEvent) and e.token >= 0])
    finally:
        engine.close()
    from orchestrator.llama import Model

    with Model(bundled_gemma()) as model:
        texts = {k: model.tokenize(v, add_special=False) for k, v in normal_texts().items()}
        decoded = [b"".join(model.token_bytes(t) for t in g).decode(errors="replace") for g in gens]
    is_loop = [loops_at_end(g) or degenerate(d) for g, d in zip(gens, decoded, strict=True)]
    looping = [g for g, bad in zip(gens, is_loop, strict=True) if bad]
    normal = [g for g, bad in zip(gens, is_loop, strict=True) if not bad]
    gen_stops = sum(replay_stops(g) > 0 for g in normal)
    caught = sum(replay_stops(g) > 0 for g in looping)
    text_stops = {k: replay_stops(v) for k, v in texts.items()}
    result = {
        "git_commit": git_commit(),
        "machine": cpu_name(),
        "date": time.strftime("%Y-%m-%d"),
        "model": "gemma-3-270m-q4_k_m (base)",
        "sampling": "temperature 0.7, top_p 0.95, seeds 0..samples-1",
        "generations": len(gens),
        "looping_generations_set_aside": len(looping),
        "normal_generations": len(normal),
        "normal_generation_tokens": sum(map(len, normal)),
        "false_stops_generations": gen_stops,
        "looping_generations_the_guard_would_stop": caught,
        "false_stop_rate_generations": gen_stops / max(1, len(normal)),
        "texts": {k: len(v) for k, v in texts.items()},
        "false_stops_texts": text_stops,
        "guard": LoopGuardConfig().__dict__,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"generations: {len(gens)} ({len(looping)} looping set aside), normal {len(normal)} with "
        f"{result['normal_generation_tokens']} tokens: false stops {gen_stops} "
        f"(rate {result['false_stop_rate_generations']:.3f})"
    )
    print(f"texts: {sum(text_stops.values())} false stops over {sum(map(len, texts.values()))} tokens")


if __name__ == "__main__":
    main()
