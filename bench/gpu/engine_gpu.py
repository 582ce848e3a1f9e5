#!/usr/bin/env python3
"""MegaCapybara's engine on a GPU: aggregate decode tok/s with 1, 4 and 12 concurrent tasks, and
pause/resume milliseconds of one task at 8k and 32k tokens with f16 and q8_0 KV (its KV and
recurrent state through the SwapPool, in ordinary pageable host memory for now).

    python3 bench/gpu/engine_gpu.py MODEL.gguf --json OUT.json

Stock figures to compare with (same GPU, random 27B qwen35, llama-batched-bench 512+128): B=1 98.5,
4 274.7, 12 435.1 tok/s; state save/restore pageable f16 8k 89/128 ms, 32k 287/415 ms (DEVICE.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import orchestrator  # noqa: E402, F401  (loads llama.cpp before numpy: see orchestrator/__init__.py)
from bench.engine_cpu import engine_aggregate, git_commit, swap_figures  # noqa: E402
from orchestrator import numa  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--json", required=True)
    ap.add_argument("--tasks", default="1,4,12")
    ap.add_argument("--depths", default="8192,32768")
    ap.add_argument("--breakdown", default="32768", help="depths at which to time the llama.cpp calls alone")
    ap.add_argument("--prealloc-mb", type=int, default=3072, help="swap arena reserved at start (0: none)")
    ap.add_argument(
        "--sampled-only",
        action="store_true",
        help="only the 12-task steps with sampled tasks (temperature 0.8: chains one after the other, "
        "on the sampling threads, in the graph) and greedy ones through patch 0012's sampler",
    )
    ap.add_argument(
        "--skip-sampled", action="store_true", help="leave out the sampled / mc-sampler 12-task steps"
    )
    ap.add_argument(
        "--repacked-weights",
        choices=("auto", "on", "off"),
        default="auto",
        help="the engine's repacked_weights setting (patch 0015's copies; auto: the engine's default, "
        "copies while a quarter of the GPU's memory stays free; the library reads it once per process)",
    )
    ap.add_argument(
        "--skip-steps",
        action="store_true",
        help="leave out the greedy 12-task step breakdowns and the bare decode loop (the aggregate, "
        "the sampled steps and the swap figures still run)",
    )
    args = ap.parse_args()
    import bench.engine_cpu

    bench.engine_cpu.REPACKED_WEIGHTS = args.repacked_weights
    res: dict = {"git_commit": git_commit(), "date": time.strftime("%Y-%m-%d"), "model": str(args.model)}
    res["repacked_weights"] = args.repacked_weights
    res["numa"] = numa.describe(0)
    print(f"numa: {res['numa']}", flush=True)
    from bench.engine_steps import measure

    # sampled tasks (top-k 40, top-p 0.95, min-p 0.05): their chains run on the host from the logits
    # then in the graph (patch 0012's sampler), and greedy tasks through it against the argmax chain
    runs = [
        ("steps_12_sampled_serial", dict(temperature=0.8, sampling_threads=1)),
        ("steps_12_sampled_pool", dict(temperature=0.8, sampling_threads=0)),
        ("steps_12_sampled_mc", dict(temperature=0.8, device_sampler="mc")),
        ("steps_12_greedy_mc", dict(temperature=0.0, device_sampler="mc")),
    ]
    for name, kw in [] if args.skip_sampled else runs:
        fig = measure(args.model, 12, 128, 128, 999, sync=True, **kw)
        res[name] = fig
        print(f"engine steps, 12 tasks, synchronized, {kw}: {fig}", flush=True)
        Path(args.json).write_text(json.dumps(res, indent=2))
    if args.sampled_only:
        return
    for n in [int(t) for t in args.tasks.split(",") if t and t != "none"]:
        res[f"agg_tok_s_{n}"] = engine_aggregate(args.model, n, 128, 128, n_gpu_layers=999)
        print(f"engine, {n:>2} tasks: {res[f'agg_tok_s_{n}']:.1f} tok/s", flush=True)
        Path(args.json).write_text(json.dumps(res, indent=2))
    if not args.skip_steps:
        steps_breakdown(args.model, res, Path(args.json))
    for kv in ("f16", "q8_0"):
        for depth in [int(d) for d in args.breakdown.split(",") if d]:
            fig = swap_breakdown(args.model, depth, kv)
            res[f"swap_calls_{kv}_{depth}"] = fig
            print(f"llama.cpp calls alone, {kv} {depth}: {fig}", flush=True)
            Path(args.json).write_text(json.dumps(res, indent=2))
    res["swap_pinned"] = _pinned_probe()
    print(f"swap pool pinned: {res['swap_pinned']}", flush=True)
    # what the engines made here set for the library (patch 0015; the first one's value counts)
    res["mc_mmh_repack"] = os.environ.get("MC_MMH_REPACK")
    Path(args.json).write_text(json.dumps(res, indent=2))
    for kv in ("f16", "q8_0"):
        for depth in [int(d) for d in args.depths.split(",") if d and d != "none"]:
            fig = swap_figures(
                args.model, depth, repeats=5, n_gpu_layers=999, kv=kv, prealloc_bytes=args.prealloc_mb << 20
            )
            res[f"swap_{kv}_{depth}"] = fig
            print(
                f"swap {kv} {depth}: pause {fig['pause_ms']:.1f} ms, resume {fig['resume_ms']:.1f} ms, "
                f"{fig['state_bytes'] / 1e9:.3f} GB, first pause {fig['first_pause_ms']:.1f} ms",
                flush=True,
            )
            Path(args.json).write_text(json.dumps(res, indent=2))


def steps_breakdown(model: Path, res: dict, out: Path) -> None:
    """The 12-task step breakdowns (greedy tasks): not synchronized and synchronized, host sampling,
    4 llama.cpp threads, and the same decodes in a bare loop; each figure into res and out."""
    from bench.engine_steps import bare_decode_ms, measure

    # where a 12-task engine step goes (the decode call, the host work after the logits, the rest)
    res["steps_12"] = measure(model, 12, 128, 128, 999, sync=False)
    print(f"engine steps, 12 tasks: {res['steps_12']}", flush=True)
    # the same with the device synchronized inside the decode timer: 'after' is then host work alone
    res["steps_12_sync"] = measure(model, 12, 128, 128, 999, sync=True)
    print(f"engine steps, 12 tasks, synchronized: {res['steps_12_sync']}", flush=True)
    # greedy tokens chosen on the host from the copied logits (the engine's default on a GPU chooses
    # them in the graph, patch 0010): the same two figures
    res["steps_12_host"] = measure(model, 12, 128, 128, 999, sync=False, device_sampling=False)
    print(f"engine steps, 12 tasks, host sampling: {res['steps_12_host']}", flush=True)
    res["steps_12_sync_host"] = measure(model, 12, 128, 128, 999, sync=True, device_sampling=False)
    print(f"engine steps, 12 tasks, synchronized, host sampling: {res['steps_12_sync_host']}", flush=True)
    # the same with 4 llama.cpp CPU threads (mc_gpu_bench's default) against every core
    res["steps_12_sync_t4"] = measure(model, 12, 128, 128, 999, sync=True, threads=4)
    print(f"engine steps, 12 tasks, synchronized, 4 threads: {res['steps_12_sync_t4']}", flush=True)
    # the same decodes in a bare loop (no engine, no reader threads) in this process
    res["bare_decode_ms_12"] = bare_decode_ms(model, 12, 128, 128, 999)
    print(f"bare decode loop, 12 sequences: {res['bare_decode_ms_12']} ms a step", flush=True)
    out.write_text(json.dumps(res, indent=2))


def swap_breakdown(model: Path, depth: int, kv: str, repeats: int = 5, n_gpu_layers: int = 999) -> dict:
    """Median ms of each llama.cpp call of a pause/resume alone (no engine around them): the state
    size pass, llama_state_seq_get_data into a reused page-locked buffer, clearing the sequence, and
    llama_state_seq_set_data back into another sequence."""
    import statistics

    from orchestrator.backend import llama
    from orchestrator.llama import Batch, Context, ContextParams, Model
    from orchestrator.swap import SwapPool

    params = ContextParams(
        n_ctx=depth + 256, n_batch=512, n_seq_max=2, flash_attn="on", cache_type_k=kv, cache_type_v=kv
    )
    pool = SwapPool(64 << 30, pinned=n_gpu_layers > 0 and _pinned_probe())
    with Model(str(model), n_gpu_layers) as m, Context(m, params) as ctx, Batch(512) as batch:
        toks = (m.tokenize("Capybaras are the largest rodents in the world. ") * (depth // 8 + 1))[:depth]
        for p0 in range(0, depth, 512):
            batch.clear()
            for i, t in enumerate(toks[p0 : p0 + 512]):
                batch.add(t, p0 + i, 0, False)
            ctx.decode(batch)
        llama().llama_synchronize(ctx.ptr)
        size = ctx.state_size(0)
        t = time.perf_counter()
        buf = pool.acquire(size)
        alloc_ms = 1000 * (time.perf_counter() - t)
        rows: dict[str, list[float]] = {"size_ms": [], "get_ms": [], "rm_ms": [], "set_ms": []}
        for r in range(repeats):
            src, dst = r % 2, (r + 1) % 2
            t0 = time.perf_counter()
            n = ctx.state_size(src)
            t1 = time.perf_counter()
            got = ctx.state_save(src, buf)
            t2 = time.perf_counter()
            ctx.seq_rm(src)
            t3 = time.perf_counter()
            ok = ctx.state_load(dst, buf, got)
            llama().llama_synchronize(ctx.ptr)
            t4 = time.perf_counter()
            assert got == n and ok, (got, n, ok)
            for key, a, b in (("size_ms", t0, t1), ("get_ms", t1, t2), ("rm_ms", t2, t3), ("set_ms", t3, t4)):
                rows[key].append(1000 * (b - a))
    out = {k: round(statistics.median(v), 2) for k, v in rows.items()}
    # where the buffer's pages are (NUMA node: pages), and whether it was allocated bound to the GPU's CPUs
    out.update(bytes=n, alloc_pinned_ms=round(alloc_ms, 1), numa_bound=pool.numa_bound,
               pages_by_node=pool.pages_by_node(buf))  # fmt: skip
    pool.close()
    out["get_gb_s"] = round(n / out["get_ms"] / 1e6, 1)
    out["set_gb_s"] = round(n / out["set_ms"] / 1e6, 1)
    return out


def _pinned_probe() -> bool:
    """Whether the engine's SwapPool gets page-locked buffers here."""
    from orchestrator.llama_engine import _want_pinned

    return _want_pinned(999)


if __name__ == "__main__":
    main()
