#!/usr/bin/env python3
"""What the launch boundaries of a decode step cost a pure weight stream, with no arithmetic: the
27B's Q4_0 products as one decode step launches them (256 launches, grouped as the patched build
groups them: a Gated DeltaNet layer's qkv / z / beta / alpha, attention's q / k / v, the FFN's gate
and up; then each layer's output and down projections), each launch a read-only streaming kernel
over that launch's bytes, replayed as a CUDA graph; against one launch over all the bytes. The gap
is the part of the decode goal's distance that a kernel doing the arithmetic cannot close while a
step is one launch a product. Also the floor of a small kernel (a chain of tiny dependent kernels
in a graph), the cost of each of the other kernels a step launches. Writes JSON and prints a table.

usage (on the GPU machine; torch and triton): python3 bench/gpu/launch_probe.py --json OUT.json"""

from __future__ import annotations

import argparse
import json
import os

Q4_0_BYTES_PER_WEIGHT = 18 / 32
HIDDEN, FFN, LAYERS = 5120, 17408, 64
# rows of the products, by what they read (the Qwen3.8 27B shapes of mcformat/random_model.py)
GDN_IN = (10240, 6144, 48, 48)  # attn_qkv, attn_gate (z), ssm_beta, ssm_alpha: one input
ATTN_IN = (12288, 1024, 1024)  # attn_q (with its gate), attn_k, attn_v: one input
OUT_PROJ = (HIDDEN, 6144)  # ssm_out / attn_output: [rows, K]
SMALL_CHAIN = 1000


def decode_launches() -> list[tuple[str, int]]:
    """(what, bytes) of each Q4_0 product launch of one decode step, in order; every 4th layer is full
    attention. The Q6_K output matrix is not a Q4_0 launch and is left out."""
    out: list[tuple[str, int]] = []
    q4 = lambda rows, k: int(rows * k * Q4_0_BYTES_PER_WEIGHT)  # noqa: E731
    for layer in range(LAYERS):
        if layer % 4 == 3:
            out.append((f"{layer}.attn_qkv", sum(q4(r, HIDDEN) for r in ATTN_IN)))
            out.append((f"{layer}.attn_output", q4(*OUT_PROJ)))
        else:
            out.append((f"{layer}.gdn_in", sum(q4(r, HIDDEN) for r in GDN_IN)))
            out.append((f"{layer}.ssm_out", q4(*OUT_PROJ)))
        out.append((f"{layer}.ffn_gate_up", 2 * q4(FFN, HIDDEN)))
        out.append((f"{layer}.ffn_down", q4(HIDDEN, FFN)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True)
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args()
    if a.repeats < 1:
        raise SystemExit(f"--repeats: at least 1, got {a.repeats}")

    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def stream(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + offs, mask=offs < n, other=0)
        tl.store(out_ptr + pid, tl.sum(v, axis=0))

    block = 4096  # int32: 16 KB a program, as a block of the decode kernel takes ~18 KB a stage
    launches = decode_launches()
    sizes = [b // 4 * 4 for _, b in launches]
    total = sum(sizes)
    buf = torch.empty(total // 4, dtype=torch.int32, device="cuda")
    buf.random_(-(2**31), 2**31 - 1)
    outs = torch.empty(total // 4 // block + len(sizes), dtype=torch.int32, device="cuda")
    views, at = [], 0
    for b in sizes:
        views.append(buf[at // 4 : (at + b) // 4])
        at += b

    def run_all():
        for v in views:
            stream[(triton.cdiv(v.numel(), block),)](v, outs, v.numel(), BLOCK=block)

    def run_one():
        stream[(triton.cdiv(buf.numel(), block),)](buf, outs, buf.numel(), BLOCK=block)

    def graph_of(fn):
        fn()  # compile and warm up outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return g

    def median_ms(g) -> float:
        times = []
        for _ in range(a.repeats):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            g.replay()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        return sorted(times)[len(times) // 2]

    g_all, g_one = graph_of(run_all), graph_of(run_one)
    ms_all, ms_one = median_ms(g_all), median_ms(g_one)
    # the same bytes again, to check the two are stable against each other
    ms_all2, ms_one2 = median_ms(g_all), median_ms(g_one)
    # the small kernels between the products: a chain of tiny dependent kernels (5,120-float adds) in a
    # graph, the floor of each of a step's ~750 non-product kernels
    x, y = torch.randn(HIDDEN, device="cuda"), torch.randn(HIDDEN, device="cuda")

    def chain():
        z = x
        for _ in range(SMALL_CHAIN):
            z = z + y
        return z

    chain_ms = median_ms(graph_of(chain))
    res = {
        "kind": "launch_probe",
        "small_kernel_chain": {
            "kernels": SMALL_CHAIN,
            "ms": round(chain_ms, 4),
            "us_each": round(chain_ms / SMALL_CHAIN * 1e3, 3),
        },
        "gpu": torch.cuda.get_device_name(),
        "launches": len(sizes),
        "bytes": total,
        "block_bytes": 4 * block,
        "one_launch_ms": [round(ms_one, 4), round(ms_one2, 4)],
        "step_launches_ms": [round(ms_all, 4), round(ms_all2, 4)],
        "one_launch_tb_s": round(total / (min(ms_one, ms_one2) / 1e3) / 1e12, 3),
        "step_launches_tb_s": round(total / (min(ms_all, ms_all2) / 1e3) / 1e12, 3),
        "per_launch_cost_us": round((min(ms_all, ms_all2) - min(ms_one, ms_one2)) * 1e3 / len(sizes), 2),
        "launch_bytes": {name: b for (name, _), b in zip(launches[:4], sizes[:4], strict=True)},
    }
    with open(a.json + ".tmp", "w") as f:
        json.dump(res, f, indent=1)
    os.replace(a.json + ".tmp", a.json)
    print(f"{'':<34}{'ms':>10}{'TB/s':>8}")
    print(f"{'one launch over all':<34}{min(ms_one, ms_one2):>10.3f}{res['one_launch_tb_s']:>8.3f}")
    step = f"{len(sizes)} launches (a decode step)"
    print(f"{step:<34}{min(ms_all, ms_all2):>10.3f}{res['step_launches_tb_s']:>8.3f}")
    print(f"per launch: {res['per_launch_cost_us']} us; {total / 1e9:.2f} GB")
    print(f"a tiny kernel in a chain of {SMALL_CHAIN} in a graph: {res['small_kernel_chain']['us_each']} us")


if __name__ == "__main__":
    main()
