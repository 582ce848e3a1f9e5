"""A tiny random-weight model of the real `qwen35` architecture, made deterministically in seconds.

Same structure as Qwen3.8 27B (Gated DeltaNet layers with a full-attention layer every 4th,
gated attention output, MRoPE sections, untied output) at toy sizes, with more linear-attention
value heads than key heads so the converter's head reordering is exercised. Written as a
Hugging Face style BF16 checkpoint (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json) and converted to GGUF by mcformat.convert.

The tokenizer is a truncated Qwen BPE (assets/tiny-qwen-tokenizer.json): the first byte-level
tokens and merges of llama.cpp's ggml-vocab-qwen35.gguf plus the chat special tokens.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np

from mcformat import safetensors

ASSETS = Path(__file__).resolve().parent / "assets"
TOKENIZER_ASSET = ASSETS / "tiny-qwen-tokenizer.json"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "full_attention_interval": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "mtp_num_hidden_layers": 0,
}


def make_tokenizer_asset(vocab_gguf: Path, n_vocab: int = 8192, out: Path = TOKENIZER_ASSET) -> None:
    """Write the truncated Qwen tokenizer from llama.cpp's ggml-vocab-qwen35.gguf (run once)."""
    import gguf

    fields = gguf.GGUFReader(vocab_gguf).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    merges = fields["tokenizer.ggml.merges"].contents()
    n_base = n_vocab - len(SPECIAL_TOKENS)
    # merge i of a byte-level BPE vocabulary produces token 256 + i: truncation stays consistent
    assert all(
        a + b == tokens[256 + i] for i, (a, b) in enumerate(m.split(" ") for m in merges[: n_base - 256])
    )
    vocab = {tok: i for i, tok in enumerate(tokens[:n_base])}
    added = [_added(tok, n_base + i) for i, tok in enumerate(SPECIAL_TOKENS)]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_tokenizer_json(vocab, merges[: n_base - 256], added), ensure_ascii=False))


def _added(content: str, token_id: int) -> dict:
    flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
    return {"id": token_id, "content": content, **flags, "special": True}


def _tokenizer_json(vocab: dict, merges: list[str], added: list[dict]) -> dict:
    split = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False},
                byte_level,
            ],
        },
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "byte_fallback": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def vocab_size() -> int:
    data = json.loads(TOKENIZER_ASSET.read_text())
    return len(data["model"]["vocab"]) + len(data["added_tokens"])


def random_weights(config: dict, n_vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Float32 weights with Hugging Face Qwen3.5 names and shapes ([out, in] for matrices)."""
    rng = np.random.default_rng(seed)
    E, F = config["hidden_size"], config["intermediate_size"]
    H, KV, D = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    KH, VH = config["linear_num_key_heads"], config["linear_num_value_heads"]
    KD, VD, K = (
        config["linear_key_head_dim"],
        config["linear_value_head_dim"],
        config["linear_conv_kernel_dim"],
    )
    conv_dim = 2 * KH * KD + VH * VD

    def mat(rows, cols):
        return rng.normal(0.0, 1.0 / np.sqrt(cols), (rows, cols)).astype(np.float32)

    def norm(n):  # Qwen3.5 RMSNorm computes x * (1 + w): store small w around 0
        return rng.normal(0.0, 0.02, n).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.normal(0.0, 1.0, (n_vocab, E)).astype(np.float32)}
    for i, kind in enumerate(config["layer_types"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(E)
        w[p + "post_attention_layernorm.weight"] = norm(E)
        w[p + "mlp.gate_proj.weight"] = mat(F, E)
        w[p + "mlp.up_proj.weight"] = mat(F, E)
        w[p + "mlp.down_proj.weight"] = mat(E, F)
        if kind == "full_attention":
            w[p + "self_attn.q_proj.weight"] = mat(2 * H * D, E)  # query and output gate
            w[p + "self_attn.k_proj.weight"] = mat(KV * D, E)
            w[p + "self_attn.v_proj.weight"] = mat(KV * D, E)
            w[p + "self_attn.o_proj.weight"] = mat(E, H * D)
            w[p + "self_attn.q_norm.weight"] = norm(D)
            w[p + "self_attn.k_norm.weight"] = norm(D)
        else:
            a = p + "linear_attn."
            w[a + "in_proj_qkv.weight"] = mat(conv_dim, E)
            w[a + "in_proj_z.weight"] = mat(VH * VD, E)
            w[a + "in_proj_b.weight"] = mat(VH, E)
            w[a + "in_proj_a.weight"] = mat(VH, E)
            w[a + "conv1d.weight"] = rng.normal(0.0, 0.3, (conv_dim, 1, K)).astype(np.float32)
            w[a + "dt_bias"] = np.ones(VH, dtype=np.float32)
            w[a + "A_log"] = np.log(rng.uniform(1.0, 16.0, VH)).astype(np.float32)
            w[a + "norm.weight"] = np.ones(VD, dtype=np.float32)
            w[a + "out_proj.weight"] = mat(E, VH * VD)
    w["model.norm.weight"] = norm(E)
    w["lm_head.weight"] = mat(n_vocab, E)
    return w


def write_checkpoint(out_dir: Path, seed: int = 0) -> Path:
    """Write the tiny BF16 checkpoint folder; returns it. Same seed, same bytes."""
    n_vocab = vocab_size()
    config = dict(TINY_CONFIG, vocab_size=n_vocab, eos_token_id=n_vocab - 1, pad_token_id=n_vocab - 3)
    weights = random_weights(config, n_vocab, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {name: ("BF16", safetensors.f32_to_bf16(arr)) for name, arr in sorted(weights.items())}
    safetensors.write(out_dir / "model.safetensors", tensors, {"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer_files(out_dir)
    return out_dir


def write_tokenizer_files(out_dir: Path) -> None:
    """The tiny tokenizer as Hugging Face files (tokenizer.json, tokenizer_config.json) in `out_dir`."""
    shutil.copyfile(TOKENIZER_ASSET, out_dir / "tokenizer.json")
    tok_config = {
        "chat_template": CHAT_TEMPLATE,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "add_bos_token": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))


def ensure_tiny_qwen35(folder: Path, seed: int = 0) -> Path:
    """The tiny model's BF16 GGUF under `folder` (checkpoint in folder/hf), made if missing."""
    from mcformat.convert import convert_checkpoint

    gguf_path = folder / "tiny-qwen35-bf16.gguf"
    if not gguf_path.is_file():
        hf = write_checkpoint(folder / "hf", seed)
        convert_checkpoint(hf, gguf_path, out_type="bf16")
    return gguf_path


def main() -> None:
    ap = argparse.ArgumentParser(description="Make the tiny qwen35 test model (checkpoint + GGUF).")
    ap.add_argument("out", type=Path, help="output folder")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--make-tokenizer-asset", type=Path, metavar="VOCAB_GGUF", help="regenerate the tokenizer asset"
    )
    args = ap.parse_args()
    if args.make_tokenizer_asset:
        make_tokenizer_asset(args.make_tokenizer_asset)
    print(ensure_tiny_qwen35(args.out, args.seed))


if __name__ == "__main__":
    main()
