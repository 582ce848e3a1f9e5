"""Quantized variants of a GGUF with llama.cpp's own quantizer: llama_model_quantize through the
bindings, or, with an importance matrix, llama.cpp's `llama-imatrix` and `llama-quantize` programs
built from the pinned source (the C API cannot take an importance matrix from Python)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

# llama_ftype values of llama.h for the quant types the builder offers
FTYPES = {"Q8_0": 7, "Q6_K": 18, "Q5_K_M": 17, "Q4_K_M": 15, "Q4_0": 2, "Q3_K_M": 12, "Q2_K": 10}
# what the weights builder makes unless told: Q4_0 is the quant the patched GPU kernels run (the server's
# default on a GPU, orchestrator/models.py)
DEFAULT_QUANTS = ("Q8_0", "Q6_K", "Q4_K_M", "Q4_0", "Q2_K")


class QuantizeError(RuntimeError):
    pass


def quantize(src: Path, out: Path, qtype: str, threads: int | None = None) -> Path:
    """Write `src` quantized to `qtype` as `out` (temp name, then rename). Raises QuantizeError."""
    if qtype not in FTYPES:
        raise QuantizeError(f"quant type: must be one of {', '.join(FTYPES)} (got {qtype!r})")
    from orchestrator.backend import llama

    lc = llama()
    params = lc.llama_model_quantize_default_params()
    params.ftype = FTYPES[qtype]
    params.nthread = threads or os.cpu_count() or 2
    tmp = out.with_name(f".{out.name}.partial")
    rc = lc.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise QuantizeError(f"llama_model_quantize failed ({rc}) for {src} -> {qtype}")
    tmp.replace(out)
    return out


def llama_tools() -> Path:
    """Folder of llama-imatrix and llama-quantize (stock, pinned source)."""
    from orchestrator.backend import BackendError
    from orchestrator.backend import llama_tools as build_tools

    try:
        return build_tools(["llama-imatrix", "llama-quantize"])
    except BackendError as exc:
        raise QuantizeError(str(exc)) from None


def compute_imatrix(model: Path, text: Path, out: Path, n_ctx: int = 512, chunks: int = 16) -> Path:
    """An importance matrix of `model` over the calibration `text` (llama-imatrix), as `out`."""
    tmp = out.with_name(f".{out.name}.partial.gguf")
    cmd = [
        str(llama_tools() / "llama-imatrix"),
        "-m",
        str(model),
        "-f",
        str(text),
        "-o",
        str(tmp),
        "-c",
        str(n_ctx),
        "--chunks",
        str(chunks),
        "-t",
        str(os.cpu_count() or 2),
        "--no-ppl",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise QuantizeError(f"llama-imatrix failed: {proc.stderr.strip()[-400:]}")
    tmp.replace(out)
    return out


def quantize_with_imatrix(src: Path, out: Path, qtype: str, imatrix: Path) -> Path:
    """`src` quantized to `qtype` guided by `imatrix` (llama-quantize), as `out`."""
    if qtype not in FTYPES:
        raise QuantizeError(f"quant type: must be one of {', '.join(FTYPES)} (got {qtype!r})")
    tmp = out.with_name(f".{out.name}.partial")
    cmd = [
        str(llama_tools() / "llama-quantize"),
        "--imatrix",
        str(imatrix),
        str(src),
        str(tmp),
        qtype,
        str(os.cpu_count() or 2),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise QuantizeError(f"llama-quantize {qtype} failed: {proc.stderr.strip()[-400:]}")
    tmp.replace(out)
    return out
