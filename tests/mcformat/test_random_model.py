"""The random-weight qwen35 writer: real shapes and types, loads and runs in llama.cpp."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from mcformat.random_model import PRESETS, tensor_plan, write_random_model


def test_the_27b_plan_has_the_real_model_shapes():
    plan = tensor_plan(PRESETS["27b"])
    # Qwen3.8 27B as llama.cpp loads it: 851 tensors, 26.896 B parameters
    assert len(plan) == 851
    assert sum(int(np.prod(shape)) for _, shape, _ in plan) == 26_895_998_464
    names = {name: shape for name, shape, _ in plan}
    assert names["blk.0.attn_qkv.weight"] == (10240, 5120)  # 2 x 16 key heads + 48 value heads of 128
    assert names["blk.3.attn_q.weight"] == (12288, 5120)  # every 4th layer: full attention, query + gate
    assert names["output.weight"] == (248320, 5120)


@pytest.mark.parametrize("weights", ["q4_0", "q8_0"])
def test_a_tiny_random_model_loads_and_decodes(tmp_path, weights):
    from orchestrator.llama import Batch, Context, ContextParams, Model

    path = write_random_model(tmp_path / "m.gguf", "tiny", weights)
    assert not (tmp_path / "m.gguf.partial").exists()
    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type for t in reader.tensors}
    want = gguf.GGMLQuantizationType[weights.upper()]
    assert types["blk.0.ffn_down.weight"] == want and types["token_embd.weight"] == want
    assert types["output.weight"] == gguf.GGMLQuantizationType.Q6_K
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    with Model(str(path), 0) as model, Context(model, ContextParams(n_ctx=256)) as ctx, Batch(64) as batch:
        for i, t in enumerate(model.tokenize("The capital of France is")):
            batch.add(t, i, 0, True)
        ctx.decode(batch)
        logits = ctx.logits(0)
        assert np.isfinite(logits).all() and logits.std() > 0


def test_bad_arguments_name_the_allowed_values(tmp_path):
    with pytest.raises(ValueError, match="preset: must be one of 27b, tiny"):
        write_random_model(tmp_path / "x.gguf", "70b")
    with pytest.raises(ValueError, match="weights: must be one of q4_0, q8_0"):
        write_random_model(tmp_path / "x.gguf", "tiny", "q2_k")
