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
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import orchestrator  # noqa: E402, F401  (loads llama.cpp before numpy: see orchestrator/__init__.py)
from bench.engine_cpu import engine_aggregate, git_commit, swap_figures  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--json", required=True)
    ap.add_argument("--tasks", default="1,4,12")
    ap.add_argument("--depths", default="8192,32768")
    args = ap.parse_args()
    res: dict = {"git_commit": git_commit(), "date": time.strftime("%Y-%m-%d"), "model": str(args.model)}
    for n in [int(t) for t in args.tasks.split(",") if t]:
        res[f"agg_tok_s_{n}"] = engine_aggregate(args.model, n, 128, 128, n_gpu_layers=999)
        print(f"engine, {n:>2} tasks: {res[f'agg_tok_s_{n}']:.1f} tok/s", flush=True)
        Path(args.json).write_text(json.dumps(res, indent=2))
    res["swap_pinned"] = _pinned_probe()
    print(f"swap pool pinned: {res['swap_pinned']}", flush=True)
    for kv in ("f16", "q8_0"):
        for depth in [int(d) for d in args.depths.split(",") if d]:
            fig = swap_figures(args.model, depth, repeats=5, n_gpu_layers=999, kv=kv)
            res[f"swap_{kv}_{depth}"] = fig
            print(
                f"swap {kv} {depth}: pause {fig['pause_ms']:.1f} ms, resume {fig['resume_ms']:.1f} ms, "
                f"{fig['state_bytes'] / 1e9:.3f} GB",
                flush=True,
            )
            Path(args.json).write_text(json.dumps(res, indent=2))


def _pinned_probe() -> bool:
    """Whether the engine's SwapPool gets page-locked buffers here."""
    from orchestrator.llama_engine import _want_pinned

    return _want_pinned(999)


if __name__ == "__main__":
    main()
