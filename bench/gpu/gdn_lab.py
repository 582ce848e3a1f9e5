#!/usr/bin/env python3
"""The GDN lab (bench/gpu/gdn_lab.cu): the patched tree's Gated DeltaNet recurrence kernels (stock,
staged, MC_GDN_WIDE=1 "wide", MC_GDN_WIDE=2 "chunked") launched directly at the 27B's shapes, a step's
48 launches timed by events, each kernel's outputs against the default's. No llama.cpp build: the
sdist is unpacked, the patch series applied and gated_delta_net.cu compiled into the lab (~1 min on
a fresh GPU machine against ~5 for the side-by-side build). Writes JSON and prints a table.

usage (on the GPU machine; nvcc): python3 bench/gpu/gdn_lab.py --json OUT.json [--tokens 1,16]
    [--repeats 50] [--sdist .device/llama_cpp_python-0.3.36.tar.gz | --src PATCHED/vendor/llama.cpp]"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
STUB = ROOT / "tests" / "ggml_patches" / "cuda_stub"  # cuBLAS names for a toolkit without cuBLAS


def parse(lines: list[str]) -> list[dict]:
    return [json.loads(line) for line in (x.strip() for x in lines) if line.startswith("{")]


def table(rows: list[dict]) -> str:
    lines = [f"{'variant':<9}{'tokens':>7}{'us':>10}{'step ms':>9}{'out rel':>11}{'state rel':>11}"]
    for r in rows:
        lines.append(
            f"{r['variant']:<9}{r['tokens']:>7}{r['us']:>10.2f}{r['step_ms']:>9.3f}"
            f"{r['out_rel']:>11.2e}{r['state_rel']:>11.2e}"
        )
    return "\n".join(lines)


def tokens_arg(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or any(not 1 <= v <= 64 for v in values):
        raise SystemExit(f"--tokens {text!r}: expected a comma list of token counts, each 1..64")
    return values


def patched_tree(sdist: Path, work: Path) -> Path:
    """The sdist unpacked under work with the patch series applied; its vendor/llama.cpp."""
    spec = importlib.util.spec_from_file_location("mc_build_script", ROOT / "ggml-patches" / "build.py")
    build = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = build
    spec.loader.exec_module(build)
    top = build.unpack(sdist, work)
    build.apply_series(top)
    return top / "vendor" / "llama.cpp"


def compile_cmd(nvcc: str, tree: Path, exe: Path, arch: str) -> list[str]:
    cmd = [nvcc, "-std=c++17", "-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}"]
    cuda_include = Path(shutil.which(nvcc) or nvcc).resolve().parent.parent / "include"
    if not (cuda_include / "cublas_v2.h").exists():
        cmd.append(f"-I{STUB}")
    for sub in ("ggml/include", "ggml/src", "ggml/src/ggml-cuda"):
        cmd.append(f"-I{tree / sub}")
    return [*cmd, str(HERE / "gdn_lab.cu"), "-o", str(exe)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="where to write the results")
    ap.add_argument("--tokens", default="1,16", help="token counts a step (comma list, each 1..64)")
    ap.add_argument("--repeats", type=int, default=50, help="timed steps (48 launches each) a variant")
    ap.add_argument("--sdist", default=".device/llama_cpp_python-0.3.36.tar.gz", help="the pinned sdist")
    ap.add_argument("--src", default="", help="an already patched vendor/llama.cpp (skips the sdist)")
    ap.add_argument("--nvcc", default=os.environ.get("NVCC", "nvcc"))
    ap.add_argument("--arch", default="90", help="CUDA arch to build for (90: H100 / H200)")
    ap.add_argument("--commit", default="", help="the tree's git commit, recorded in the JSON")
    ap.add_argument("--timeout", type=float, default=240, help="seconds the program may run")
    a = ap.parse_args()
    tokens = tokens_arg(a.tokens)
    if a.repeats < 1:
        raise SystemExit(f"--repeats {a.repeats}: must be at least 1")
    if not a.arch.rstrip("a").isdigit():
        raise SystemExit(f"--arch {a.arch!r}: expected a CUDA arch number such as 90 or 120")
    work = Path(tempfile.mkdtemp(prefix="gdn_lab"))
    if a.src:
        tree = Path(a.src)
        if not (tree / "ggml" / "src" / "ggml-cuda" / "gated_delta_net.cu").exists():
            raise SystemExit(f"--src {a.src}: no ggml/src/ggml-cuda/gated_delta_net.cu there")
    else:
        if not Path(a.sdist).exists():
            hint = "python3 ggml-patches/build.py --pack-sdist ..."
            raise SystemExit(f"--sdist {a.sdist}: no such file ({hint})")
        tree = patched_tree(Path(a.sdist), work)
    exe = work / "gdn_lab"
    subprocess.run(compile_cmd(a.nvcc, tree, exe, a.arch), check=True)
    args = [str(exe), str(a.repeats), *map(str, tokens)]
    try:
        res = subprocess.run(args, capture_output=True, text=True, check=False, timeout=a.timeout)
    except subprocess.TimeoutExpired as e:
        raise SystemExit(f"gdn_lab ran past --timeout {a.timeout} s") from e
    rows = parse(res.stdout.splitlines())
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
        "rows": rows,
    }
    if res.returncode != 0:  # the rows before the failure are kept
        out["error"] = f"gdn_lab exited {res.returncode}: {res.stderr.strip()[-2000:]}"
    Path(a.json).write_text(json.dumps(out, indent=1))
    print(table(rows))
    if res.returncode != 0:
        raise SystemExit(out["error"])


if __name__ == "__main__":
    main()
