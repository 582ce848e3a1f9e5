"""`megacapybara bench`: single-stream prefill and decode speed of a model on this machine."""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from pathlib import Path

from orchestrator.backend import build_info, check_backend
from orchestrator.llama import Batch, Context, ContextParams, Model


def _prefill(ctx: Context, batch: Batch, tokens: list[int]) -> None:
    for start in range(0, len(tokens), batch.capacity):
        batch.clear()
        for i, tok in enumerate(tokens[start : start + batch.capacity]):
            batch.add(tok, start + i, 0, start + i == len(tokens) - 1)
        ctx.decode(batch)


def _step(ctx: Context, batch: Batch, token: int, pos: int) -> None:
    batch.clear()
    batch.add(token, pos, 0, True)
    ctx.decode(batch)


def measure(model: Model, params: ContextParams, n_prompt: int, n_gen: int) -> dict:
    """Prefill `n_prompt` tokens, then time `n_gen` single-token decode steps (fixed tokens, no
    sampling: the model's speed, like llama-bench); warm-up steps are not timed."""
    tokens = (model.tokenize("The quick brown fox jumps over the lazy dog. ") * n_prompt)[:n_prompt]
    with Context(model, params) as ctx, Batch(params.n_batch) as batch:
        _prefill(ctx, batch, tokens[:8])  # warm-up: first-use allocations, graph building
        for i in range(2):
            _step(ctx, batch, tokens[i], 8 + i)
        ctx.synchronize()
        ctx.clear()
        t0 = time.perf_counter()
        _prefill(ctx, batch, tokens)
        ctx.synchronize()  # a GPU finishes after llama_decode returns
        t_prefill = time.perf_counter() - t0
        _step(ctx, batch, tokens[0], n_prompt)  # the first single-token step after a prefill is slower
        ctx.synchronize()
        t0 = time.perf_counter()
        for i in range(1, n_gen + 1):
            _step(ctx, batch, tokens[i % len(tokens)], n_prompt + i)
        ctx.synchronize()
        t_decode = time.perf_counter() - t0
    return {
        "prompt_tokens": n_prompt,
        "gen_tokens": n_gen,
        "prefill_tok_s": n_prompt / t_prefill,
        "decode_tok_s": n_gen / t_decode,
        "decode_ms_per_token": 1000.0 * t_decode / n_gen,
    }


def run_bench(settings, resolved, n_prompt: int, n_gen: int, json_out: str | None) -> dict:
    check_backend()
    from orchestrator.llama_engine import context_from_settings

    base = context_from_settings(settings)  # one sequence: single-stream speed
    params = dataclasses.replace(base, n_ctx=max(settings.ctx, n_prompt + n_gen + 32), n_seq_max=1)
    with Model(resolved.path, settings.gpu_layers) as model:
        figures = measure(model, params, n_prompt, n_gen)
    info = build_info()
    result = {
        "model": resolved.name,
        "backend": info.backend,
        "patch_series": info.patch_series,
        "machine": platform.node(),
        "threads": settings.threads,
        "date": time.strftime("%Y-%m-%d"),
        **figures,
    }
    print(f"{'model':<16}{'prefill tok/s':>15}{'decode tok/s':>14}{'ms/token':>10}")
    print(f"{resolved.name:<16}{figures['prefill_tok_s']:>15.1f}{figures['decode_tok_s']:>14.1f}"
          f"{figures['decode_ms_per_token']:>10.2f}")  # fmt: skip
    if json_out:
        Path(json_out).write_text(json.dumps(result, indent=2))
    return result
