#!/usr/bin/env python3
"""Milliseconds of each llama.cpp call in a pause/resume, alone: the state size pass,
llama_state_seq_get_data into a reused buffer (page-locked where a CUDA device is present),
llama_memory_seq_rm, and llama_state_seq_set_data into another sequence. The KV cells' bookkeeping
(CPU work, the same on every backend) shows up here next to the copies.

    python bench/state_calls.py MODEL.gguf [--depths 8192,32768] [--kv f16,q8_0] [--gpu-layers N]
        [--json OUT.json]

Defaults: the tiny qwen35 model (generated), depths 8192 and 32768, f16 KV, CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import orchestrator  # noqa: E402, F401  (loads llama.cpp before numpy)
from bench.engine_cpu import cpu_name, git_commit  # noqa: E402
from bench.gpu.engine_gpu import swap_breakdown  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", type=Path)
    ap.add_argument("--depths", default="8192,32768")
    ap.add_argument("--kv", default="f16")
    ap.add_argument("--gpu-layers", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args()
    model = args.model
    if model is None:
        from mcformat.tiny import ensure_tiny_qwen35

        model = ensure_tiny_qwen35(Path(tempfile.gettempdir()) / "mc-tiny-qwen35")
    from orchestrator.backend import build_info

    res: dict = {
        "git_commit": git_commit(),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{cpu_name()} ({platform.machine()})",
        "backend": dataclasses.asdict(build_info()),
        "model": str(model),
        "command": " ".join(sys.argv),
        "figures": {},
    }
    print(f"{'kv':<6}{'depth':>7}{'bytes':>13}{'size ms':>9}{'get ms':>9}{'rm ms':>8}{'set ms':>9}")
    for kv in args.kv.split(","):
        for depth in [int(d) for d in args.depths.split(",")]:
            fig = swap_breakdown(model, depth, kv, repeats=args.repeats, n_gpu_layers=args.gpu_layers)
            res["figures"][f"{kv}_{depth}"] = fig
            print(
                f"{kv:<6}{depth:>7}{fig['bytes']:>13}{fig['size_ms']:>9.2f}{fig['get_ms']:>9.2f}"
                f"{fig['rm_ms']:>8.2f}{fig['set_ms']:>9.2f}",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
