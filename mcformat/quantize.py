"""Quantized variants of a GGUF with llama.cpp's own quantizer (llama_model_quantize)."""

from __future__ import annotations

import os
from pathlib import Path

# llama_ftype values of llama.h for the quant types the builder offers
FTYPES = {"Q8_0": 7, "Q6_K": 18, "Q5_K_M": 17, "Q4_K_M": 15, "Q4_0": 2, "Q3_K_M": 12, "Q2_K": 10}


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
