#!/usr/bin/env python3
"""Cross-check of mcformat.evaluate against llama.cpp's own `llama-perplexity --kl-divergence`
(stock, built from the same pinned source), on the tiny qwen35 model and its quantized variants,
same corpus text, same chunking. Writes bench/results/kl-crosscheck.json and prints a table.

    .venv/bin/python bench/kl_crosscheck.py [--n-ctx 256] [--chunks 4]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import orchestrator  # noqa: E402, F401  (loads llama.cpp first)
from bench.engine_cpu import cpu_name, git_commit  # noqa: E402
from mcformat.evaluate import evaluate, stdlib_corpus  # noqa: E402
from mcformat.quantize import quantize  # noqa: E402
from mcformat.tiny import ensure_tiny_qwen35  # noqa: E402
from orchestrator.backend import llama_tools  # noqa: E402

VARIANTS = ("Q8_0", "Q4_K_M", "Q2_K")
# llama-perplexity stores the base log-probabilities as uint16 (quantized), so its figures can
# differ from an exact computation in the last digits: agreement within these bounds
TOLERANCE = {"kld_mean_rel": 0.02, "kld_mean_abs": 1e-5, "same_top_p_abs": 0.005, "ppl_ratio_rel": 0.002}


def perplexity_tool() -> Path:
    return llama_tools(["llama-perplexity"]) / "llama-perplexity"


def llama_perplexity(
    tool: Path, model: Path, text: Path, base: Path, n_ctx: int, chunks: int, kl: bool
) -> dict:
    cmd = [
        str(tool),
        "-m",
        str(model),
        "-f",
        str(text),
        "-c",
        str(n_ctx),
        "-b",
        str(n_ctx),
        "-ub",
        str(n_ctx),
        "--chunks",
        str(chunks),
        "-t",
        str(os.cpu_count() or 2),
        "-fa",
        "on",
        "--kl-divergence-base",
        str(base),
    ]
    if kl:
        cmd.append("--kl-divergence")
    log = subprocess.run(cmd, capture_output=True, text=True, check=True)
    out = log.stdout + log.stderr
    if not kl:
        return {}

    def grab(pattern: str) -> float:
        return float(re.search(pattern, out).group(1))

    return {
        "kld_mean": grab(r"Mean\s+KLD:\s+([0-9.eE+-]+)"),
        "kld_median": grab(r"Median\s+KLD:\s+([0-9.eE+-]+)"),
        "kld_p99": grab(r"99\.0%\s+KLD:\s+([0-9.eE+-]+)"),
        "same_top_p": grab(r"Same top p:\s+([0-9.eE+-]+)") / 100.0,
        "ppl_ratio": grab(r"Mean PPL\(Q\)/PPL\(base\)\s+:\s+([0-9.eE+-]+)"),
    }


def agrees(mc, lp: dict) -> bool:
    t = TOLERANCE
    kl_ok = abs(mc.kl_mean - lp["kld_mean"]) <= max(t["kld_mean_abs"], t["kld_mean_rel"] * lp["kld_mean"])
    top_ok = abs(mc.top1 - lp["same_top_p"]) <= t["same_top_p_abs"]
    ppl_ok = abs(mc.ppl_ratio - lp["ppl_ratio"]) <= t["ppl_ratio_rel"] * lp["ppl_ratio"]
    return kl_ok and top_ok and ppl_ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "kl-crosscheck.json"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mc-klcheck-"))
    ref = ensure_tiny_qwen35(work / "tiny")
    corpus = stdlib_corpus()
    text = work / "corpus.txt"
    text.write_text(corpus.text)
    tool, base = perplexity_tool(), work / "base.kld"
    llama_perplexity(tool, ref, text, base, args.n_ctx, args.chunks, kl=False)
    rows = []
    for q in VARIANTS:
        model = quantize(ref, work / f"{q}.gguf", q)
        mc = evaluate(ref, model, corpus, n_ctx=args.n_ctx, n_chunks=args.chunks)
        lp = llama_perplexity(tool, model, text, base, args.n_ctx, args.chunks, kl=True)
        rows.append(
            {
                "variant": q,
                "mc_kld_mean": mc.kl_mean,
                "llama_perplexity_kld_mean": lp["kld_mean"],
                "mc_kld_median": mc.kl_median,
                "llama_perplexity_kld_median": lp["kld_median"],
                "mc_kld_p99": mc.kl_p99,
                "llama_perplexity_kld_p99": lp["kld_p99"],
                "mc_same_top_p": mc.top1,
                "llama_perplexity_same_top_p": lp["same_top_p"],
                "mc_ppl_ratio": mc.ppl_ratio,
                "llama_perplexity_ppl_ratio": lp["ppl_ratio"],
                "tokens": mc.tokens,
                "tolerance": TOLERANCE,
                "agree": agrees(mc, lp),
            }
        )
    result = {
        "git_commit": git_commit(),
        "machine": cpu_name(),
        "date": time.strftime("%Y-%m-%d"),
        "model": "tiny qwen35 (mcformat.tiny, seed 0), BF16 reference",
        "corpus": corpus.id,
        "n_ctx": args.n_ctx,
        "chunks": args.chunks,
        "tool": "llama-perplexity (stock, pinned source)",
        "variants": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{'variant':<8}{'KLD mc':>11}{'KLD l-p':>11}{'top1 mc':>9}{'top1 l-p':>9}"
        f"{'PPLr mc':>9}{'PPLr l-p':>9}  agree"
    )
    for r in rows:
        print(
            f"{r['variant']:<8}{r['mc_kld_mean']:>11.6f}{r['llama_perplexity_kld_mean']:>11.6f}"
            f"{r['mc_same_top_p']:>9.4f}{r['llama_perplexity_same_top_p']:>9.4f}"
            f"{r['mc_ppl_ratio']:>9.5f}{r['llama_perplexity_ppl_ratio']:>9.5f}  {r['agree']}"
        )
    if not all(r["agree"] for r in rows):
        sys.exit("mcformat.evaluate and llama-perplexity disagree beyond the tolerance")


if __name__ == "__main__":
    main()
