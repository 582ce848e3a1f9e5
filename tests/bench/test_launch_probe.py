"""bench/gpu/launch_probe.py's decode-step plan (the launch sizes it streams on the GPU) matches the
27B's Q4_0 products as mcformat/random_model.py writes them: 256 launches, every product matrix's
bytes once (the embedding table is gathered, not streamed; the Q6_K output is not a Q4_0 launch)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mcformat.random_model import PRESETS, tensor_plan

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "launch_probe.py"


def load():
    spec = importlib.util.spec_from_file_location("launch_probe", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_plan_streams_every_product_matrix_once():
    mod = load()
    launches = mod.decode_launches()
    assert len(launches) == 256  # the patched build's launches a decode step (bench/NOTES.md)
    matrices = [
        (n, s) for n, s, kind in tensor_plan(PRESETS["27b"]) if kind == "matrix" and n.startswith("blk.")
    ]
    want = sum(int(r * k * 18 / 32) for _, (r, k) in matrices)
    assert sum(b for _, b in launches) == want
    # every 4th layer is full attention, as the preset's layer types say
    types = PRESETS["27b"]["layer_types"]
    attn = {int(name.split(".")[0]) for name, _ in launches if name.endswith("attn_qkv")}
    assert attn == {i for i, t in enumerate(types) if t == "full_attention"}
