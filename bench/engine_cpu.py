#!/usr/bin/env python3
"""Engine benchmark on this CPU: aggregate decode tok/s of MegaCapybara's engine with 1, 4 and 12
concurrent tasks on Gemma 3 270M, beside stock llama.cpp's llama-batched-bench (built from the same
pinned source) and the one-at-a-time path of llama-cpp-python's `Llama`; pause/resume ms and
state bytes per token for Gemma (4k-token task) and the tiny qwen35.

    .venv/bin/python bench/engine_cpu.py [--out bench/results/engine-cpu.json] [--quick]

Writes JSON (with git commit, machine and date) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orchestrator.backend import llama_tools  # noqa: E402
from orchestrator.events import Swapped  # noqa: E402
from orchestrator.llama import ContextParams  # noqa: E402
from orchestrator.llama_engine import EngineConfig, LlamaEngine  # noqa: E402
from orchestrator.loop_guard import LoopGuardConfig  # noqa: E402
from orchestrator.models import bundled_gemma  # noqa: E402
from orchestrator.types import GenerationRequest, SamplingParams, TokenEvent  # noqa: E402

THREADS = os.cpu_count() or 2
# EngineConfig.repacked_weights of every engine made here (bench/gpu/engine_gpu.py --repacked-weights)
REPACKED_WEIGHTS = "auto"
N_PROMPT, N_GEN = 128, 128


def engine_context(n_tasks: int, n_prompt: int, n_gen: int, threads: int = THREADS) -> ContextParams:
    """The context engine_aggregate gives the engine for n_tasks tasks (also bench/engine_steps.py's
    bare decode loop)."""
    return ContextParams(
        n_ctx=max(4096, n_tasks * (n_prompt + n_gen + 8)),
        n_batch=2048,
        n_seq_max=max(n_tasks, 1),
        n_threads=threads,
        flash_attn="on",
    )


def task_prompts(tokenize, n_tasks: int, n_prompt: int) -> list[list[int]]:
    """engine_aggregate's prompts: n_prompt tokens each, the first token then a window of a repeated
    sentence shifted by one per task (also bench/engine_steps.py's bare loop)."""
    words = tokenize("The quick brown fox jumps over the lazy dog. " * 64)
    return [[words[0], *words[1 + i : n_prompt + i]] for i in range(n_tasks)]


def engine_aggregate(
    model: Path,
    n_tasks: int,
    n_prompt: int,
    n_gen: int,
    n_gpu_layers: int = 0,
    threads: int = THREADS,
    device_sampling: bool | None = None,
    temperature: float = 0.0,
    sampling_threads: int = 0,
    device_sampler: str = "greedy",
) -> float:
    """Generated tokens per second over the decode phase, all tasks together. Greedy (chosen in the
    graph or on the host per `device_sampling`, None: the engine's default), or with `temperature`
    > 0 sampled on the host with the default chain (top-k 40, top-p 0.95, min-p 0.05), task i with
    seed i, on `sampling_threads` (0: the engine's default); `device_sampler` "mc": patch 0012's
    sampler in the graph for greedy and sampled tasks."""
    ctx = engine_context(n_tasks, n_prompt, n_gen, threads)
    cfg = EngineConfig(
        context=ctx,
        chunk=2048,
        loop_guard=LoopGuardConfig(enabled=False),
        max_sessions=0,
        device_sampling=device_sampling,
        sampling_threads=sampling_threads,
        device_sampler=device_sampler,
        repacked_weights=REPACKED_WEIGHTS,
    )
    engine = LlamaEngine(str(model), cfg, n_gpu_layers)
    try:
        prompts = task_prompts(engine.tokenize, n_tasks, n_prompt)
        readers = [
            engine.submit(
                GenerationRequest(tuple(p), SamplingParams(temperature=temperature, max_tokens=n_gen, seed=i))
            )
            for i, p in enumerate(prompts)
        ]
        stamps = [[] for _ in readers]  # arrival time of each token, read by one thread per task

        def drain(i: int) -> None:
            stamps[i] = [time.perf_counter() for e in readers[i] if isinstance(e, TokenEvent)]

        threads = [threading.Thread(target=drain, args=(i,)) for i in range(n_tasks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # decode phase: from the moment every task has its first token to the last token of all
        start = max(s[0] for s in stamps)
        end = max(s[-1] for s in stamps)
        return sum(sum(1 for t in s if t > start) for s in stamps) / (end - start)
    finally:
        engine.close()


def batched_bench(model: Path, bin_dir: Path, npl: list[int]) -> dict[int, float]:
    """S_TG (generation tok/s over all sequences) of llama-batched-bench for each parallel count."""
    cmd = [
        str(bin_dir / "llama-batched-bench"),
        "-m",
        str(model),
        "-c",
        str(max(npl) * (N_PROMPT + N_GEN) + 64),
        "-b",
        "2048",
        "-ub",
        "512",
        "-npp",
        str(N_PROMPT),
        "-ntg",
        str(N_GEN),
        "-npl",
        ",".join(map(str, npl)),
        "-t",
        str(THREADS),
        "-fa",
        "on",
        "--output-format",
        "jsonl",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {int(r["pl"]): float(r["speed_tg"]) for r in rows}


def one_at_a_time(model: Path, n_tasks: int) -> float:
    """Stock llama-cpp-python `Llama`: requests one after another; generated tokens / wall time."""
    from llama_cpp import Llama

    llm = Llama(str(model), n_ctx=1024, n_threads=THREADS, verbose=False, flash_attn=True)
    words = "The quick brown fox jumps over the lazy dog. " * 16
    t0, total = time.perf_counter(), 0
    for i in range(n_tasks):
        out = llm.create_completion(f"{i} {words}", max_tokens=N_GEN, temperature=0.0)
        total += out["usage"]["completion_tokens"]
    wall = time.perf_counter() - t0
    llm.close()
    return total / wall


def swap_figures(
    model: Path,
    n_prompt: int,
    repeats: int = 7,
    n_gpu_layers: int = 0,
    kv: str = "f16",
    prealloc_bytes: int = 0,
) -> dict:
    """Pause/resume ms (median) and state bytes of one task holding `n_prompt` tokens; the first
    pause apart (it allocates its buffer unless `prealloc_bytes` reserved an arena at start)."""
    ctx = ContextParams(
        n_ctx=n_prompt + 256,
        n_batch=512,
        n_seq_max=2,
        n_threads=THREADS,
        flash_attn="on",
        cache_type_k=kv,
        cache_type_v=kv,
    )
    cfg = EngineConfig(
        context=ctx,
        chunk=512,
        loop_guard=LoopGuardConfig(enabled=False),
        max_sessions=0,
        swap_dir=Path(tempfile.mkdtemp()),
        swap_prealloc_bytes=prealloc_bytes,
        repacked_weights=REPACKED_WEIGHTS,
    )
    engine = LlamaEngine(str(model), cfg, n_gpu_layers)
    try:
        words = engine.tokenize("Capybaras are the largest rodents in the world. " * (n_prompt // 8))
        prompt = tuple(words[:n_prompt])
        sub = engine.events.subscribe()
        reader = engine.submit(
            GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=4 * repeats))
        )
        n = 0
        for event in reader:
            if isinstance(event, TokenEvent) and n < repeats:
                n += 1
                engine.pause(reader.task_id)
        swaps = [
            e for e in iter(lambda: None if sub.queue.empty() else sub.get(), None) if isinstance(e, Swapped)
        ]
        pauses = [s for s in swaps if s.direction == "pause"]
        resumes = [s for s in swaps if s.direction == "resume"]
        nbytes = statistics.median(s.bytes for s in pauses)
        return {
            "pause_ms": statistics.median(s.ms for s in pauses),
            "resume_ms": statistics.median(s.ms for s in resumes),
            "state_bytes": int(nbytes),
            "state_bytes_per_token": nbytes / n_prompt,
            "n_swaps": len(pauses),
            "first_pause_ms": pauses[0].ms,
            "prealloc_bytes": prealloc_bytes,
            "pool_allocations": engine.swap.grown,
        }
    finally:
        engine.close()


def git_commit() -> str:
    return subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()


def cpu_name() -> str:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    found = re.search(r"model name\s*:\s*(.+)", text)
    return found.group(1) if found else platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "engine-cpu.json"))
    ap.add_argument("--tools-bin", help="folder with llama-batched-bench (default: build it, stock)")
    args = ap.parse_args()
    gemma = bundled_gemma()
    from mcformat.tiny import ensure_tiny_qwen35

    tiny = ensure_tiny_qwen35(Path(tempfile.mkdtemp()) / "tiny")
    bin_dir = Path(args.tools_bin) if args.tools_bin else llama_tools(["llama-batched-bench"])
    res: dict = {
        "git_commit": git_commit(),
        "machine": f"{cpu_name()}, {THREADS} threads",
        "date": time.strftime("%Y-%m-%d"),
        "model": gemma.name,
        "n_prompt": N_PROMPT,
        "n_gen": N_GEN,
    }
    for n in (1, 4, 12):
        res[f"agg_tok_s_{n}"] = engine_aggregate(gemma, n, N_PROMPT, N_GEN)
    for n, v in batched_bench(gemma, bin_dir, [1, 4, 12]).items():
        res[f"batched_bench_tok_s_{n}"] = v
    res["one_at_a_time_tok_s"] = one_at_a_time(gemma, 4)
    g = swap_figures(gemma, 4096)
    res.update(
        pause_ms_4k=g["pause_ms"],
        resume_ms_4k=g["resume_ms"],
        state_bytes_per_token=g["state_bytes_per_token"],
        state_bytes_4k=g["state_bytes"],
    )
    q = swap_figures(tiny, 1024)
    res.update(
        pause_ms_qwen35_tiny=q["pause_ms"],
        resume_ms_qwen35_tiny=q["resume_ms"],
        state_bytes_qwen35_tiny_1k=q["state_bytes"],
    )
    res["ratio_12_vs_batched_bench"] = res["agg_tok_s_12"] / res["batched_bench_tok_s_12"]
    res["ratio_12_vs_one_at_a_time"] = res["agg_tok_s_12"] / res["one_at_a_time_tok_s"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print_table(res)


def print_table(res: dict) -> None:
    print(f"{'tasks':>6} {'engine tok/s':>13} {'batched-bench':>14} {'ratio':>6}")
    for n in (1, 4, 12):
        e, b = res[f"agg_tok_s_{n}"], res[f"batched_bench_tok_s_{n}"]
        print(f"{n:>6} {e:>13.1f} {b:>14.1f} {e / b:>6.2f}")
    print(
        f"one-at-a-time Llama: {res['one_at_a_time_tok_s']:.1f} tok/s; engine at 12 is "
        f"{res['ratio_12_vs_one_at_a_time']:.2f}x"
    )
    print(
        f"Gemma 4k task: pause {res['pause_ms_4k']:.2f} ms, resume {res['resume_ms_4k']:.2f} ms, "
        f"{res['state_bytes_per_token']:.0f} B/token; "
        f"tiny qwen35 1k: resume {res['resume_ms_qwen35_tiny']:.2f} ms"
    )


if __name__ == "__main__":
    main()
