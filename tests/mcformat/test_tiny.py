"""The tiny qwen35 model: deterministic, of the real architecture, loadable and generating."""

from __future__ import annotations

import hashlib

import gguf
import numpy as np
import pytest

from mcformat import convert, safetensors, tiny


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_checkpoint_and_gguf_are_deterministic(tmp_path, tiny_qwen35_path):
    again = tiny.ensure_tiny_qwen35(tmp_path / "again")
    assert _sha(again) == _sha(tiny_qwen35_path)
    assert _sha(again.parent / "hf" / "model.safetensors") == _sha(
        tiny_qwen35_path.parent / "hf" / "model.safetensors"
    )
    other = tiny.ensure_tiny_qwen35(tmp_path / "seed1", seed=1)
    assert _sha(other) != _sha(tiny_qwen35_path)


def test_checkpoint_is_bf16_hugging_face_layout(tiny_qwen35_path):
    hf = tiny_qwen35_path.parent / "hf"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (hf / name).is_file()
    tensors = safetensors.read(hf / "model.safetensors")
    assert {dtype for dtype, _ in tensors.values()} == {"BF16"}
    assert "model.layers.0.linear_attn.A_log" in tensors
    assert "model.layers.3.self_attn.q_proj.weight" in tensors


def test_gguf_has_both_layer_kinds_of_the_real_architecture(tiny_qwen35_path):
    reader = gguf.GGUFReader(tiny_qwen35_path)
    assert reader.fields["general.architecture"].contents() == "qwen35"
    assert reader.fields["qwen35.full_attention_interval"].contents() == 4
    names = {t.name for t in reader.tensors}
    for layer in range(3):  # Gated DeltaNet layers
        assert {
            f"blk.{layer}.ssm_a",
            f"blk.{layer}.ssm_conv1d.weight",
            f"blk.{layer}.attn_qkv.weight",
        } <= names
    assert {"blk.3.attn_q.weight", "blk.3.attn_k.weight", "blk.3.attn_q_norm.weight"} <= names
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.ffn_up.weight"] == gguf.GGMLQuantizationType.BF16
    assert types["blk.0.ssm_conv1d.weight"] == gguf.GGMLQuantizationType.F32
    assert types["output_norm.weight"] == gguf.GGMLQuantizationType.F32


def test_tiny_qwen35_loads_and_generates_greedily_the_same_twice(tiny_qwen35_path):
    from orchestrator.llama import ContextParams
    from orchestrator.llama_engine import EngineConfig, LlamaEngine
    from orchestrator.types import GenerationRequest, SamplingParams, StopReason

    engine = LlamaEngine(str(tiny_qwen35_path), EngineConfig(context=ContextParams(n_ctx=512, n_batch=64)))
    try:
        prompt = tuple(engine.tokenize("def fibonacci(n):\n    return"))
        runs = []
        for _ in range(2):
            reader = engine.submit(GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=24)))
            tokens = [e.token for e in reader if hasattr(e, "token")]
            runs.append(tokens)
            assert reader.finish.reason in (StopReason.LENGTH, StopReason.STOP)
        assert runs[0] == runs[1]
        assert len(runs[0]) >= 1
    finally:
        engine.close()


def test_v_head_reorder_is_grouped_to_tiled():
    # 2 K heads, 3 V heads per K head, head dim 1: grouped [G0v0 G0v1 G0v2 G1v0 G1v1 G1v2]
    grouped = np.arange(6)
    assert convert._reorder_v_heads(grouped, 0, 2, 3, 1).tolist() == [0, 3, 1, 4, 2, 5]


def test_truncated_checkpoint_is_a_clear_error(tmp_path, tiny_qwen35_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    src = tiny_qwen35_path.parent / "hf"
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (hf / name).write_bytes((src / name).read_bytes())
    data = (src / "model.safetensors").read_bytes()
    (hf / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(safetensors.SafetensorsError, match="truncated"):
        convert.convert_checkpoint(hf, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


def test_wrong_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(convert.ConvertError, match="supported are Qwen3_5ForCausalLM"):
        convert.convert_checkpoint(tmp_path, tmp_path / "out.gguf")


def test_bf16_round_trip_rounds_to_nearest():
    x = np.array([1.0, -2.5, 3.14159, 1e-8], dtype=np.float32)
    back = safetensors.bf16_to_f32(safetensors.f32_to_bf16(x))
    assert np.allclose(back, x, rtol=1 / 128)
    assert back[0] == 1.0 and back[1] == -2.5
