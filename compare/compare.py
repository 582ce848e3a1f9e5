"""Side-by-side quality and speed of any GGUF files of one base model (MC weights, Unsloth quants,
...) against the BF16 reference: the same evaluation as the weights builder (mcformat.evaluate),
plus file size, bits per weight and decode tok/s on this machine. Output: a terminal table,
CSV and JSON, and PNG plots (KL vs size, top-1 vs size).
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import gguf
import numpy as np

from mcformat.evaluate import Corpus, evaluate, stdlib_corpus
from mcformat.metadata import Figures


@dataclass(frozen=True)
class Entry:
    name: str
    path: str
    size_bytes: int
    bits_per_weight: float
    decode_tok_s: float
    figures: Figures

    def flat(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "figures"}
        return {**out, **asdict(self.figures)}


def bits_per_weight(path: Path) -> float:
    """File bits over parameters (header included: the figure users compare)."""
    params = sum(int(np.prod(t.shape)) for t in gguf.GGUFReader(path).tensors)
    return 8.0 * path.stat().st_size / params


def decode_speed(path: Path, n_gpu_layers: int) -> float:
    from orchestrator.bench import measure
    from orchestrator.llama import ContextParams, Model

    params = ContextParams(n_ctx=512, n_batch=256, n_threads=os.cpu_count() or 2, flash_attn="on")
    with Model(path, n_gpu_layers) as model:
        return measure(model, params, n_prompt=64, n_gen=32)["decode_tok_s"]


def compare(
    paths: list[Path],
    reference: Path,
    corpus: Corpus | None = None,
    n_ctx: int = 512,
    n_chunks: int = 4,
    n_gpu_layers: int = 0,
    speed: bool = True,
) -> list[Entry]:
    """Evaluate every file against `reference`; entries in the order given."""
    corpus = corpus or stdlib_corpus()
    entries = []
    for path in paths:
        figures = evaluate(reference, path, corpus, n_ctx, n_chunks, n_gpu_layers=n_gpu_layers)
        tok_s = decode_speed(path, n_gpu_layers) if speed else float("nan")
        entries.append(
            Entry(path.stem, str(path), path.stat().st_size, bits_per_weight(path), tok_s, figures)
        )
    return entries


def table(entries: list[Entry]) -> str:
    head = f"{'file':<28}{'GB':>8}{'bpw':>7}{'KL mean':>10}{'KL p99':>9}{'top-1':>8}{'PPL ratio':>10}"
    head += f"{'tok/s':>8}"
    lines = [head, "-" * len(head)]
    for e in entries:
        f = e.figures
        lines.append(
            f"{e.name[:27]:<28}{e.size_bytes / 1e9:>8.3f}{e.bits_per_weight:>7.2f}{f.kl_mean:>10.5f}"
            f"{f.kl_p99:>9.4f}{f.top1:>8.3f}{f.ppl_ratio:>10.4f}{e.decode_tok_s:>8.1f}"
        )
    return "\n".join(lines)


def write_outputs(entries: list[Entry], out: Path) -> list[Path]:
    """compare.csv, compare.json and the two plots in `out`; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    rows = [e.flat() for e in entries]
    with open(out / "compare.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / "compare.json").write_text(json.dumps(rows, indent=2) + "\n")
    return [out / "compare.csv", out / "compare.json", *_plots(entries, out)]


def _plots(entries: list[Entry], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    unit, scale = ("GB", 1e9) if max(e.size_bytes for e in entries) >= 1e9 else ("MB", 1e6)
    for key, label, title, log in (
        ("kl_mean", "mean KL divergence vs BF16 (lower is better)", "KL divergence vs file size", True),
        ("top1", "top-1 agreement with BF16 (higher is better)", "Top-1 agreement vs file size", False),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
        sizes = [e.size_bytes / scale for e in entries]
        values = [getattr(e.figures, key) for e in entries]
        ax.plot(sizes, values, "o")
        for e, x, y in zip(entries, sizes, values, strict=True):
            ax.annotate(e.name, (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
        if log and all(v > 0 for v in values):
            ax.set_yscale("log")
        ax.set_xlabel(f"file size ({unit})")
        ax.set_ylabel(label)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        path = out / f"{key.replace('_mean', '')}_vs_size.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths
