#!/usr/bin/env python3
"""Where page-locked host memory lands and how fast it copies to and from the GPU, by binding.

For each way of allocating a page-locked buffer (the thread as it is, bound to the GPU's local
CPUs, bound to the other CPUs): the buffer's pages by NUMA node and the host->device and
device->host copy bandwidth (GB/s, best of a few). Tells whether the swap pool's binding
(`orchestrator/numa.py`) matters on this host.

    python3 bench/gpu/numa_probe.py [--mib 1024] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from orchestrator import numa


def copy_gb_s(dst, src, repeats: int) -> float:
    import torch

    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return src.numel() / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.mib < 1 or args.repeats < 1:
        ap.error(f"--mib and --repeats must be whole numbers >= 1 (got {args.mib}, {args.repeats})")
    import torch

    res: dict = numa.describe(0)
    local = numa.gpu_node(0)[2]
    allowed = os.sched_getaffinity(0)
    n = args.mib << 20
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    ways = {"unbound": None, "local": local, "remote": (allowed - local) if local else None}
    for name, cpus in ways.items():
        if name != "unbound" and not cpus:
            continue
        with numa.bound_to(cpus) as bound:
            t = time.perf_counter()
            host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            alloc_s = time.perf_counter() - t
        host.fill_(1)
        res[name] = {
            "bound": bound,
            "alloc_s": round(alloc_s, 3),
            "pages_by_node": numa.pages_by_node(host.data_ptr()),
            "h2d_gb_s": round(copy_gb_s(dev, host, args.repeats), 1),
            "d2h_gb_s": round(copy_gb_s(host, dev, args.repeats), 1),
        }
        print(name, res[name], flush=True)
        del host
    print(json.dumps(res), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
