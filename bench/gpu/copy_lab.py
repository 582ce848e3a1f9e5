#!/usr/bin/env python3
"""The copy lab (bench/gpu/copy_lab.cu): how fast each copy structure brings the 16-column repacked
product's weights into shared memory, with no arithmetic and then with the kernel's arithmetic, at
the 27B's product shapes; summed over a verify step's launches (the shapes x how often a step
launches each) against the kernel's own structure ("warp", 3 stages, with activations), plain
streaming loads ("ldg"), and blocks sharing their activations by multicast ("cluster"). Writes JSON
and prints a table.

usage (on the GPU machine; nvcc): python3 bench/gpu/copy_lab.py --json OUT.json [--repeats 40]"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
HIDDEN, FFN, LAYERS = 5120, 17408, 64
ATTN_EVERY = 4  # every 4th layer is full attention, the others Gated DeltaNet


def step_shapes() -> dict[tuple[int, int], int]:
    """(rows, K) of each Q4_0 product launch of a 27B verify step -> launches a step. Rows rounded down
    to the lab's 64-row tiles (the Gated DeltaNet input group's 16,480 rows: 16,448)."""
    gdn_in = 10240 + 6144 + 48 + 48  # attn_qkv, attn_gate, ssm_beta, ssm_alpha: one group
    attn_in = 12288 + 1024 + 1024  # attn_q (with its gate), attn_k, attn_v
    attn_layers = LAYERS // ATTN_EVERY
    plan = {
        (gdn_in // 64 * 64, HIDDEN): LAYERS - attn_layers,
        (attn_in // 64 * 64, HIDDEN): attn_layers,
        (HIDDEN, 6144): LAYERS,  # ssm_out / attn_output
        (2 * FFN, HIDDEN): LAYERS,  # ffn gate + up, one group
        (HIDDEN, FFN): LAYERS,  # ffn down
    }
    return plan


def parse(lines: list[str]) -> list[dict]:
    rows = []
    for line in lines:
        line = line.strip()
        if line.startswith("{"):
            rows.append(json.loads(line))
    return rows


def step_totals(rows: list[dict], plan: dict[tuple[int, int], int]) -> list[dict]:
    """Each structure's verify-step total: the sum over the plan's launches of its time at that shape;
    only structures measured at every shape."""
    by: dict[tuple, dict[tuple[int, int], float]] = {}
    for r in rows:
        key = (
            r["structure"],
            r["stages"],
            r["y"],
            r.get("math", False),
            r.get("cluster", 1),
            r["blocks_per_sm"],
        )
        by.setdefault(key, {})[(r["rows"], r["k"])] = r["us"]
    weight_bytes = sum(n * rows * k * 18 // 32 for (rows, k), n in plan.items())
    out = []
    for (structure, stages, y, math, cluster, bps), us in by.items():
        if not all(s in us for s in plan):
            continue
        total_us = sum(n * us[s] for s, n in plan.items())
        out.append(
            {
                "structure": structure,
                "stages": stages,
                "y": y,
                "math": math,
                "cluster": cluster,
                "blocks_per_sm": bps,
                "step_ms": round(total_us / 1000, 3),
                "tb_s": round(weight_bytes / total_us / 1e6, 3),
            }
        )
    return sorted(out, key=lambda r: (r["math"], r["step_ms"]))


def table(totals: list[dict]) -> str:
    head = f"{'structure':<10}{'stages':>7}{'acts':>6}{'math':>6}{'cluster':>8}{'blk/SM':>7}"
    lines = [head + f"{'step ms':>10}{'TB/s':>8}"]
    for t in totals:
        acts = "yes" if t["y"] else "no"
        math = "yes" if t.get("math") else "no"
        lines.append(
            f"{t['structure']:<10}{t['stages']:>7}{acts:>6}{math:>6}{t.get('cluster', 1):>8}"
            f"{t['blocks_per_sm']:>7}{t['step_ms']:>10.3f}{t['tb_s']:>8.3f}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="where to write the results")
    ap.add_argument("--repeats", type=int, default=40, help="timed launches a shape (at least 1)")
    ap.add_argument("--nvcc", default=os.environ.get("NVCC", "nvcc"))
    ap.add_argument(
        "--arch", default="90a", help="CUDA arch: 90a (H100/H200) or newer (bulk copies, multicast)"
    )
    ap.add_argument("--commit", default="", help="the tree's git commit, recorded in the JSON")
    ap.add_argument("--timeout", type=float, default=240, help="seconds the program may run")
    a = ap.parse_args()
    if a.repeats < 1:
        raise SystemExit(f"--repeats {a.repeats}: must be at least 1")
    digits = a.arch.rstrip("af")
    if not digits.isdigit() or int(digits) < 90 or len(a.arch) - len(digits) > 1:
        raise SystemExit(f"--arch {a.arch!r}: expected 90a, 100a, 120a or another Hopper-or-newer arch")
    exe = Path(tempfile.mkdtemp(prefix="copy_lab")) / "copy_lab"
    src = HERE / "copy_lab.cu"
    cmd = [
        a.nvcc,
        "-std=c++17",
        "-O3",
        f"-gencode=arch=compute_{a.arch},code=sm_{a.arch}",
        str(src),
        "-o",
        str(exe),
    ]
    subprocess.run(cmd, check=True)
    plan = step_shapes()
    args = [str(exe), str(a.repeats), *(f"{r}:{k}" for r, k in plan)]
    try:
        res = subprocess.run(args, capture_output=True, text=True, check=False, timeout=a.timeout)
    except subprocess.TimeoutExpired as e:
        raise SystemExit(f"copy_lab ran past --timeout {a.timeout} s (a hung structure?)") from e
    rows = parse(res.stdout.splitlines())
    totals = step_totals(rows, plan)
    try:
        query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
        gpu = subprocess.run(query, capture_output=True, text=True, check=False).stdout.strip()
    except FileNotFoundError:
        gpu = ""
    out = {
        "gpu": gpu,
        "date": datetime.date.today().isoformat(),
        "commit": a.commit,
        "command": " ".join(sys.argv),
        "plan": {f"{r}x{k}": n for (r, k), n in plan.items()},
        "step_totals": totals,
        "launches": rows,
    }
    if res.returncode != 0:  # the rows before the failure are kept
        out["error"] = f"copy_lab exited {res.returncode}: {res.stderr.strip()[-2000:]}"
    Path(a.json).write_text(json.dumps(out, indent=1))
    print(table(totals))
    if res.returncode != 0:
        raise SystemExit(out["error"])


if __name__ == "__main__":
    main()
