"""Convert a Hugging Face Qwen3.5-family checkpoint (`Qwen3_5ForCausalLM`, llama.cpp arch `qwen35`)
to GGUF, without transformers.

Mirrors the tensor transforms of llama.cpp's own converter (conversion/qwen.py,
Qwen3_5TextModel): `A_log -> -exp(A_log)`, `dt_bias -> ssm_dt.bias`, conv1d squeezed, RMSNorm
weights `+1` (except the DeltaNet output norm), linear-attention V heads reordered from grouped
to tiled order, and 1-D/norm/conv tensors kept in F32. Output is written to a temp name and
renamed when complete.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np

from mcformat import safetensors

OUT_TYPES = {
    "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
}
SUPPORTED_ARCHS = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")


class ConvertError(ValueError):
    """The checkpoint cannot be converted; the message names the file or field."""


def load_checkpoint(folder: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(text config, {name: float32 array}) of a safetensors checkpoint folder."""
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ConvertError(f"{folder}: no config.json (not a Hugging Face checkpoint folder)")
    config = json.loads(cfg_path.read_text())
    archs = config.get("architectures") or []
    if not any(a in SUPPORTED_ARCHS for a in archs):
        raise ConvertError(f"config.json architectures {archs}: supported are {', '.join(SUPPORTED_ARCHS)}")
    config = config.get("text_config", config)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConvertError(f"{folder}: no .safetensors files")
    tensors = {}
    for path in files:
        for name, (dtype, arr) in safetensors.read(path).items():
            data = safetensors.bf16_to_f32(arr) if dtype == "BF16" else np.asarray(arr, dtype=np.float32)
            tensors[name.replace("model.language_model.", "model.")] = data
    return config, tensors


def _reorder_v_heads(x: np.ndarray, axis: int, n_k: int, n_v_per_k: int, head_dim: int) -> np.ndarray:
    """Grouped-by-K-head V order [G0v0, G0v1, G1v0, ...] -> tiled [G0v0, G1v0, G0v1, ...]."""
    x = np.moveaxis(x, axis, 0)
    rest = x.shape[1:]
    x = x.reshape(n_k, n_v_per_k, head_dim, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.moveaxis(x, 0, axis)


def transform(name: str, data: np.ndarray, cfg: dict) -> tuple[str, np.ndarray]:
    """One HF tensor -> (HF name for the tensor map, data) with llama.cpp's qwen35 transforms."""
    n_k, n_v = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    kd, vd = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    per_k = n_v // n_k
    if "linear_attn." in name and n_k != n_v:
        if ".in_proj_qkv." in name:
            qk = 2 * n_k * kd
            data = np.concatenate([data[:qk], _reorder_v_heads(data[qk:], 0, n_k, per_k, vd)])
        elif ".in_proj_z." in name:
            data = _reorder_v_heads(data, 0, n_k, per_k, vd)
        elif ".in_proj_b." in name or ".in_proj_a." in name or name.endswith((".A_log", ".dt_bias")):
            data = _reorder_v_heads(data, 0, n_k, per_k, 1)
        elif ".conv1d." in name:
            qk = 2 * n_k * kd
            data = np.concatenate([data[:qk], _reorder_v_heads(data[qk:], 0, n_k, per_k, vd)])
        elif ".out_proj." in name:
            data = _reorder_v_heads(data, 1, n_k, per_k, vd)
    if name.endswith(".A_log"):
        data = -np.exp(data)
    elif name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif ".conv1d." in name:
        data = data.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        data = data + 1.0
    return name, data


def write_hparams(w: gguf.GGUFWriter, cfg: dict, file_type: gguf.LlamaFileType) -> None:
    rope = cfg.get("rope_parameters") or {}
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    sections = list(rope.get("mrope_section", [11, 11, 10]))
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10_000_000.0)))
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))
    w.add_rope_dimension_sections(sections + [0] * (4 - len(sections)))
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(cfg["linear_key_head_dim"])
    w.add_ssm_group_count(cfg["linear_num_key_heads"])
    w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
    w.add_file_type(file_type)


def write_tokenizer(w: gguf.GGUFWriter, folder: Path, n_vocab: int) -> None:
    tok_path = folder / "tokenizer.json"
    if not tok_path.is_file():
        raise ConvertError(f"{folder}: no tokenizer.json")
    tok = json.loads(tok_path.read_text())
    model = tok["model"]
    if model.get("type") != "BPE":
        raise ConvertError(f"{tok_path}: model type {model.get('type')!r}, expected BPE")
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [gguf.TokenType.UNUSED] * n_vocab
    for text, i in model["vocab"].items():
        tokens[i], types[i] = text, gguf.TokenType.NORMAL
    for added in tok["added_tokens"]:
        i = added["id"]
        tokens[i] = added["content"]
        types[i] = gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    tcfg_path = folder / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text()) if tcfg_path.is_file() else {}
    ids = {t: i for i, t in enumerate(tokens)}
    if tcfg.get("eos_token") in ids:
        w.add_eos_token_id(ids[tcfg["eos_token"]])
    if tcfg.get("pad_token") in ids:
        w.add_pad_token_id(ids[tcfg["pad_token"]])
    w.add_add_bos_token(bool(tcfg.get("add_bos_token", False)))
    if tcfg.get("chat_template"):
        w.add_chat_template(tcfg["chat_template"])


def _tensor_type(gguf_name: str, data: np.ndarray, out_type: str) -> gguf.GGMLQuantizationType:
    """1-D tensors, norms, conv kernels and non-.weight tensors stay F32, like llama.cpp's converter."""
    if data.ndim <= 1 or gguf_name.endswith("_norm.weight") or ".ssm_conv1d." in gguf_name:
        return gguf.GGMLQuantizationType.F32
    if not gguf_name.endswith(".weight"):
        return gguf.GGMLQuantizationType.F32
    return OUT_TYPES[out_type][0]


def _encode(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    if qtype == gguf.GGMLQuantizationType.BF16:
        return safetensors.f32_to_bf16(data)
    if qtype == gguf.GGMLQuantizationType.F16:
        return data.astype(np.float16)
    return np.ascontiguousarray(data, dtype=np.float32)


def convert_checkpoint(folder: Path, out: Path, out_type: str = "bf16", name: str | None = None) -> Path:
    """Convert the checkpoint at `folder` to a GGUF file at `out` (temp name, then rename)."""
    if out_type not in OUT_TYPES:
        raise ConvertError(f"out_type: must be one of {', '.join(OUT_TYPES)} (got {out_type!r})")
    cfg, tensors = load_checkpoint(Path(folder))
    n_layers = cfg["num_hidden_layers"]
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, n_layers)
    tmp = out.with_name(out.name + ".partial")
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(tmp, "qwen35")
    w.add_name(name or Path(folder).name)
    write_hparams(w, cfg, OUT_TYPES[out_type][1])
    write_tokenizer(w, Path(folder), cfg["vocab_size"])
    for hf_name in sorted(tensors):
        if hf_name.startswith("mtp."):
            continue  # the MTP head is converted by the speculative-decoding work
        mapped, data = transform(hf_name, tensors[hf_name], cfg)
        gguf_name = name_map.get_name(mapped, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ConvertError(f"tensor {hf_name}: no qwen35 GGUF name for it")
        qtype = _tensor_type(gguf_name, data, out_type)
        w.add_tensor(gguf_name, _encode(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    tmp.replace(out)
    return out
