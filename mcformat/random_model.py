"""A random-weight `qwen35` GGUF at any size, quantized blocks written directly: for speed benchmarks.

    python -m mcformat.random_model OUT.gguf [--preset 27b|tiny] [--weights q4_0|q8_0]

No float model is made: every 2-D weight is written as random quantized blocks with small scales
(Q4_0 or Q8_0; the output matrix Q6_K, as llama-quantize makes it), norms 1.0 and the other 1-D
tensors plausible values, so llama.cpp loads and runs it at the real shapes and the speed figures are
valid (the text is noise). The 27B preset has Qwen3.8 27B's shapes (hidden 5120, 64 layers of which
every 4th is full attention, FFN 17408, 24/4 heads of 256, linear attention 16 key / 48 value heads of
128, vocabulary 248,320) and writes 15.5 GB (Q4_0). Names, shapes and metadata come from the same code
as mcformat.convert, the tokenizer from the tiny model's truncated Qwen BPE padded to the vocabulary.
The file is written under a temp name and renamed when complete.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np

from mcformat.convert import write_hparams, write_tokenizer
from mcformat.tiny import TINY_CONFIG, vocab_size, write_tokenizer_files

QT = gguf.GGMLQuantizationType
PRESETS = {
    "27b": dict(
        TINY_CONFIG,
        hidden_size=5120,
        num_hidden_layers=64,
        intermediate_size=17408,
        num_attention_heads=24,
        num_key_value_heads=4,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16,
        max_position_embeddings=262144,
        vocab_size=248320,
    ),
    "tiny": dict(TINY_CONFIG, vocab_size=vocab_size()),
}
WEIGHT_TYPES = {
    "q4_0": (QT.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    "q8_0": (QT.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}


def tensor_plan(cfg: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, shape [rows, cols] or [n], kind) for every tensor, in the converter's order and
    naming; kind is 'matrix', 'output', 'norm', 'conv', 'ssm_a', 'dt'."""
    E, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    H, KV, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    KH, VH = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    KD, VD, K = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    conv_dim = 2 * KH * KD + VH * VD
    hf: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (V, E), "matrix")]
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        hf += [
            (p + "input_layernorm.weight", (E,), "norm"),
            (p + "post_attention_layernorm.weight", (E,), "norm"),
        ]
        hf += [
            (p + f"mlp.{n}_proj.weight", s, "matrix")
            for n, s in (("gate", (F, E)), ("up", (F, E)), ("down", (E, F)))
        ]
        if kind == "full_attention":
            hf += [
                (p + "self_attn.q_proj.weight", (2 * H * D, E), "matrix"),
                (p + "self_attn.k_proj.weight", (KV * D, E), "matrix"),
                (p + "self_attn.v_proj.weight", (KV * D, E), "matrix"),
                (p + "self_attn.o_proj.weight", (E, H * D), "matrix"),
                (p + "self_attn.q_norm.weight", (D,), "norm"),
                (p + "self_attn.k_norm.weight", (D,), "norm"),
            ]
        else:
            a = p + "linear_attn."
            hf += [
                (a + "in_proj_qkv.weight", (conv_dim, E), "matrix"),
                (a + "in_proj_z.weight", (VH * VD, E), "matrix"),
                (a + "in_proj_b.weight", (VH, E), "matrix"),
                (a + "in_proj_a.weight", (VH, E), "matrix"),
                (a + "conv1d.weight", (conv_dim, K), "conv"),
                (a + "dt_proj.bias", (VH,), "dt"),
                (a + "A_log", (VH,), "ssm_a"),
                (a + "norm.weight", (VD,), "norm"),
                (a + "out_proj.weight", (E, VH * VD), "matrix"),
            ]
    hf += [("model.norm.weight", (E,), "norm"), ("lm_head.weight", (V, E), "output")]
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, cfg["num_hidden_layers"])
    plan = []
    for name, shape, kind in hf:
        mapped = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise ValueError(f"tensor {name}: no qwen35 GGUF name for it")
        plan.append((mapped, shape, kind))
    return plan


class _Blocks:
    """A pool of random quantized blocks of one type; a tensor takes a run of them at a random start."""

    def __init__(self, qtype: QT, n: int, rng: np.random.Generator):
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
        if qtype == QT.Q4_0:  # half d; uint8 qs[16]
            raw[:, 0:2] = rng.uniform(0.0015, 0.0025, n).astype(np.float16).view(np.uint8).reshape(n, 2)
        elif qtype == QT.Q8_0:  # half d; int8 qs[32]
            raw[:, 0:2] = rng.uniform(0.0001, 0.0003, n).astype(np.float16).view(np.uint8).reshape(n, 2)
        elif qtype == QT.Q6_K:  # uint8 ql[128], qh[64]; int8 scales[16]; half d
            raw[:, 192:208] = rng.integers(1, 17, (n, 16), dtype=np.int8).view(np.uint8)
            raw[:, 208:210] = rng.uniform(0.00005, 0.0001, n).astype(np.float16).view(np.uint8).reshape(n, 2)
        else:
            raise ValueError(f"no random blocks for {qtype.name}")
        self.qtype, self.block, self.raw, self.rng = qtype, block, raw, rng

    def tensor(self, rows: int, cols: int) -> np.ndarray:
        need = rows * cols // self.block
        start = int(self.rng.integers(0, len(self.raw)))
        idx = (
            (start + np.arange(need)) % len(self.raw)
            if need > len(self.raw) - start
            else slice(start, start + need)
        )
        return self.raw[idx].reshape(rows, -1)


def _vector(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind in ("norm", "dt"):  # norms as stored (1 + w with w = 0), dt bias 1
        return np.ones(n, dtype=np.float32)
    if kind == "ssm_a":  # -exp(A_log), A_log in log(1..16), as the converter stores it
        return -rng.uniform(1.0, 16.0, n).astype(np.float32)
    raise ValueError(kind)


def write_random_model(out: Path, preset: str = "27b", weights: str = "q4_0", seed: int = 1234) -> Path:
    """Write the random model to `out` (temp name, then rename); returns `out`."""
    if preset not in PRESETS:
        raise ValueError(f"preset: must be one of {', '.join(PRESETS)} (got {preset!r})")
    if weights not in WEIGHT_TYPES:
        raise ValueError(f"weights: must be one of {', '.join(WEIGHT_TYPES)} (got {weights!r})")
    cfg = PRESETS[preset]
    qtype, file_type = WEIGHT_TYPES[weights]
    rng = np.random.default_rng(seed)
    plan = tensor_plan(cfg)
    pools = {qtype: _Blocks(qtype, 1 << 22, rng), QT.Q6_K: _Blocks(QT.Q6_K, 1 << 18, rng)}
    tmp = out.with_name(out.name + ".partial")
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(tmp, "qwen35")
    w.add_name(f"random qwen35 {preset} {weights}")
    write_hparams(w, cfg, file_type)
    with tempfile.TemporaryDirectory() as tok_dir:
        write_tokenizer_files(Path(tok_dir))
        write_tokenizer(w, Path(tok_dir), cfg["vocab_size"])
    # shapes and types first (the header), then the data tensor by tensor: nothing large is held
    for name, shape, kind in plan:
        if kind in ("matrix", "output"):
            qt = QT.Q6_K if kind == "output" else qtype
            block, size = gguf.GGML_QUANT_SIZES[qt]
            rows, cols = shape
            w.add_tensor_info(
                name, (rows, cols // block * size), np.dtype(np.uint8), rows * cols // block * size, qt
            )
        else:
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _name, shape, kind in plan:
        if kind in ("matrix", "output"):
            w.write_tensor_data(pools[QT.Q6_K if kind == "output" else qtype].tensor(*shape))
        elif kind == "conv":
            w.write_tensor_data(rng.normal(0.0, 0.3, shape).astype(np.float32))
        else:
            w.write_tensor_data(_vector(kind, shape[0], rng))
    w.close()
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    tmp.replace(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--preset", default="27b", choices=sorted(PRESETS))
    ap.add_argument("--weights", default="q4_0", choices=sorted(WEIGHT_TYPES))
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    t0 = time.time()
    path = write_random_model(args.out, args.preset, args.weights, args.seed)
    print(f"{path}: {path.stat().st_size} bytes in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
