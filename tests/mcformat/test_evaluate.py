"""Quality evaluation on the tiny qwen35: figures ordered the way quantization should order them."""

from __future__ import annotations

import pytest

from mcformat.evaluate import evaluate, stdlib_corpus
from mcformat.quantize import QuantizeError, quantize

CHUNKS = dict(n_ctx=256, n_chunks=2)


@pytest.fixture(scope="module")
def variants(tiny_qwen35_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("variants")
    return {q: quantize(tiny_qwen35_path, out / f"{q}.gguf", q) for q in ("Q8_0", "Q4_K_M", "Q2_K")}


@pytest.fixture(scope="module")
def corpus():
    return stdlib_corpus()


def test_a_model_against_itself_is_perfect(tiny_qwen35_path, corpus):
    f = evaluate(tiny_qwen35_path, tiny_qwen35_path, corpus, **CHUNKS)
    assert f.kl_mean == pytest.approx(0.0, abs=1e-9) and f.top1 == 1.0 and f.ppl_ratio == pytest.approx(1.0)
    assert f.tokens == 2 * (256 - 1 - 128)


def test_weight_quants_are_ordered_q8_0_q4_k_m_q2_k(tiny_qwen35_path, variants, corpus):
    kl = {q: evaluate(tiny_qwen35_path, path, corpus, **CHUNKS) for q, path in variants.items()}
    assert kl["Q8_0"].kl_mean < kl["Q4_K_M"].kl_mean < kl["Q2_K"].kl_mean
    assert kl["Q8_0"].top1 > kl["Q4_K_M"].top1 > kl["Q2_K"].top1
    assert kl["Q8_0"].kl_p99 < kl["Q2_K"].kl_p99
    sizes = {q: p.stat().st_size for q, p in variants.items()}
    assert sizes["Q8_0"] > sizes["Q4_K_M"] > sizes["Q2_K"]


def test_q8_0_kv_is_closer_than_q4_0_kv(tiny_qwen35_path, corpus):
    q8 = evaluate(tiny_qwen35_path, tiny_qwen35_path, corpus, cache_type="q8_0", **CHUNKS)
    q4 = evaluate(tiny_qwen35_path, tiny_qwen35_path, corpus, cache_type="q4_0", **CHUNKS)
    assert 0.0 < q8.kl_mean < q4.kl_mean


def test_unknown_quant_type_is_named(tiny_qwen35_path, tmp_path):
    with pytest.raises(QuantizeError, match="must be one of Q8_0"):
        quantize(tiny_qwen35_path, tmp_path / "x.gguf", "Q9_X")
    assert not list(tmp_path.iterdir())
