#!/usr/bin/env python3
"""Where an engine step goes: N tasks decoding together, each step split into the llama_decode call,
the host work after the logits (sampling, detokenizing, handing tokens to the readers) and the rest
(scheduling, filling the batch), in ms per step, beside the aggregate tokens/s.

    python3 bench/engine_steps.py MODEL.gguf [--tasks 12] [--prompt 64] [--gen 128] [--gpu-layers 0]
                                  [--sync] [--threads N] [--bare] [--sampling default|device|host]
                                  [--temperature T] [--sampling-threads N] [--sampler greedy|mc]
                                  [--json OUT.json]

On a GPU build llama_decode returns when the step is queued, so the first logits read waits for the
device: there the 'after' figure holds that wait (set --sync to synchronize inside the decode timer).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import orchestrator  # noqa: E402, F401  (loads llama.cpp before numpy: see orchestrator/__init__.py)
from bench.engine_cpu import THREADS, engine_aggregate, engine_context, git_commit, task_prompts  # noqa: E402


def measure(
    model: Path,
    tasks: int,
    prompt: int,
    gen: int,
    gpu_layers: int,
    sync: bool,
    threads: int = 0,
    device_sampling: bool | None = None,
    temperature: float = 0.0,
    sampling_threads: int = 0,
    device_sampler: str = "greedy",
) -> dict:
    """Runs engine_aggregate with the engine's step, decode and per-token work timed. The per-step
    figures are over the decode steps alone (one token for each of the tasks: the steady state);
    the prompts' prefill decodes are counted apart (`prefill_decodes`, `prefill_ms`). Greedy tokens
    are chosen in the graph or on the host per `device_sampling` (None: the engine's default);
    `device_rows` counts the rows whose token came from the graph. With `temperature` > 0 the tasks
    are sampled on the host (engine_aggregate), on `sampling_threads` (0: the engine's default), or in
    the graph with `device_sampler` "mc" (patch 0012)."""
    import statistics

    import orchestrator.llama_engine as le
    from orchestrator.backend import llama
    from orchestrator.llama import Context

    acc: Counter = Counter()
    steps: list[dict] = []  # one record a step: its decode's tokens, decode / after-logits / step seconds
    cur: dict = {}
    decode, after, step = Context.decode, le.LlamaEngine._after_decode, le.LlamaEngine._step
    perf = llama().llama_perf_context

    def timed_decode(self, batch):
        t = time.perf_counter()
        decode(self, batch)
        if sync:
            self.synchronize()
        cur["decode"] = time.perf_counter() - t
        cur["tokens"] = batch.n_tokens
        acc["decodes"] += 1
        reused = perf(self.ptr).n_reused  # llama.cpp's count of steps that reused the last graph
        acc["reused"] += reused > acc["reused_seen"]
        acc["reused_seen"] = reused

    def timed_after(self, rows):
        t = time.perf_counter()
        try:
            return after(self, rows)
        finally:
            cur["after"] = cur.get("after", 0.0) + time.perf_counter() - t
            acc["rows"] += len(rows)
            acc["device_rows"] += sum(on_device for _, _, on_device in rows)

    def timed_step(self):
        cur.clear()
        t = time.perf_counter()
        try:
            return step(self)
        finally:
            if "decode" in cur:
                steps.append(dict(cur, step=time.perf_counter() - t))

    # ggml's CUDA-graph messages (debug level, routed to the "llama.cpp" logger by the backend): whether
    # the steps ran as a captured graph or were launched kernel by kernel
    graph_log: Counter = Counter()

    class _GraphLines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            msg = record.getMessage()
            if "CUDA graph" in msg:
                graph_log[msg.split(": ", 1)[-1].strip()] += 1

    native, handler = logging.getLogger("llama.cpp"), _GraphLines()
    level = native.level
    native.setLevel(logging.DEBUG)
    native.addHandler(handler)
    Context.decode, le.LlamaEngine._after_decode, le.LlamaEngine._step = timed_decode, timed_after, timed_step
    try:
        tok_s = engine_aggregate(
            model,
            tasks,
            prompt,
            gen,
            n_gpu_layers=gpu_layers,
            threads=threads or THREADS,
            device_sampling=device_sampling,
            temperature=temperature,
            sampling_threads=sampling_threads,
            device_sampler=device_sampler,
        )
    finally:
        Context.decode, le.LlamaEngine._after_decode, le.LlamaEngine._step = decode, after, step
        native.removeHandler(handler)
        native.setLevel(level)
    dec = [r for r in steps if r["tokens"] == tasks] or steps  # the decode steps (all, if none is pure)
    ms = {k: 1000 * statistics.mean(r.get(k, 0.0) for r in dec) for k in ("decode", "after", "step")}
    pre = [r for r in steps if r not in dec]
    return {
        "tasks": tasks,
        "threads": threads or THREADS,
        "prompt": prompt,
        "gen": gen,
        "agg_tok_s": round(tok_s, 1),
        "decodes": acc["decodes"],
        # decodes that reused the previous step's graph (else: built, allocated and, on a GPU, its
        # CUDA graph captured again)
        "graph_reused": acc["reused"],
        "temperature": temperature,
        "sampling_threads": sampling_threads,
        "device_sampler": device_sampler,
        "rows": acc["rows"],
        "device_rows": acc["device_rows"],
        "decode_steps": len(dec),
        "decode_ms_per_step": round(ms["decode"], 3),
        "decode_ms_median": round(1000 * statistics.median(r["decode"] for r in dec), 3),
        "after_logits_ms_per_step": round(ms["after"], 3),
        "rest_ms_per_step": round(ms["step"] - ms["decode"] - ms["after"], 3),
        "step_ms": round(ms["step"], 3),
        "prefill_decodes": len(pre),
        "prefill_ms": round(1000 * sum(r["decode"] for r in pre), 3),
        "cuda_graph_log": dict(graph_log),  # e.g. "CUDA graph warmup reset": n (empty on the CPU)
    }


def bare_decode_ms(
    model: Path, tasks: int, prompt: int, gen: int, gpu_layers: int, threads: int = 0
) -> float:
    """Median ms of the same decode steps without the engine: `tasks` sequences prefilled one by one
    with the engine's context parameters, then `gen` steps of one token each (the argmax of the last
    step's logits), each decode synchronized, in this thread with nothing else running."""
    import statistics

    from orchestrator.llama import Batch, Context, Model

    with Model(model, gpu_layers) as m:
        ctx = Context(m, engine_context(tasks, prompt, gen, threads or THREADS))
        batch = Batch(2048)
        try:
            prompts = task_prompts(m.tokenize, tasks, prompt)
            for s, toks in enumerate(prompts):
                batch.clear()
                for i, t in enumerate(toks):
                    batch.add(t, i, s, i == len(toks) - 1)
                ctx.decode(batch)
            last, times = [prompts[0][1]] * tasks, []
            for step in range(gen):
                batch.clear()
                for s in range(tasks):
                    batch.add(last[s], prompt + step, s, True)
                t = time.perf_counter()
                ctx.decode(batch)
                ctx.synchronize()
                times.append(time.perf_counter() - t)
                last = [int(ctx.logits(i).argmax()) for i in range(tasks)]
            return round(1000 * statistics.median(times), 3)
        finally:
            batch.close()
            ctx.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--tasks", type=int, default=12)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--gpu-layers", type=int, default=0)
    ap.add_argument("--sync", action="store_true", help="synchronize the device inside the decode timer")
    ap.add_argument(
        "--threads", type=int, default=THREADS, help="llama.cpp CPU threads (default: every core)"
    )
    ap.add_argument("--bare", action="store_true", help="also time the same decodes without the engine")
    ap.add_argument(
        "--sampling",
        choices=("default", "device", "host"),
        default="default",
        help="greedy tokens chosen in the graph (device) or on the host (default: the engine's choice)",
    )
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="> 0: sampled tasks (top-k 40, top-p 0.95, min-p 0.05)"
    )
    ap.add_argument(
        "--sampling-threads", type=int, default=0, help="threads for sampler chains (0: the engine's)"
    )
    ap.add_argument(
        "--sampler", choices=("greedy", "mc"), default="greedy", help="what runs in the graph (mc: 0012)"
    )
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.tasks < 1 or args.gen < 2 or args.prompt < 2:
        ap.error("--tasks must be >= 1, --gen and --prompt >= 2")
    if args.threads < 1:
        ap.error(f"--threads must be >= 1 (got {args.threads})")
    if not 0.0 <= args.temperature <= 5.0:
        ap.error(f"--temperature must be between 0 and 5 (got {args.temperature})")
    if args.sampling_threads < 0:
        ap.error(f"--sampling-threads must be >= 0 (got {args.sampling_threads})")
    device = {"default": None, "device": True, "host": False}[args.sampling]
    res = measure(
        args.model,
        args.tasks,
        args.prompt,
        args.gen,
        args.gpu_layers,
        args.sync,
        args.threads,
        device,
        args.temperature,
        args.sampling_threads,
        args.sampler,
    )
    if args.bare:
        res["bare_decode_ms_per_step"] = bare_decode_ms(
            args.model, args.tasks, args.prompt, args.gen, args.gpu_layers, args.threads
        )
        print(f"bare decode (no engine, synchronized): {res['bare_decode_ms_per_step']} ms a step")
    res.update(git_commit=git_commit(), date=time.strftime("%Y-%m-%d"), model=str(args.model), sync=args.sync)
    print(f"{'tasks':>5} {'tok/s':>8} {'decode ms':>10} {'after ms':>9} {'rest ms':>8} {'step ms':>8}")
    print(
        f"{res['tasks']:>5} {res['agg_tok_s']:>8} {res['decode_ms_per_step']:>10} "
        f"{res['after_logits_ms_per_step']:>9} {res['rest_ms_per_step']:>8} {res['step_ms']:>8}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
