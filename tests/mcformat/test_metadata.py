"""The mc.* metadata: round trip, replace, safe writes, llama.cpp still loads, stats_for."""

from __future__ import annotations

import hashlib
import shutil

import gguf
import pytest

from mcformat import metadata as mc

F16 = mc.Setting("Q8_0")
KV_Q4 = mc.Setting("Q8_0", "q4_0", "q4_0")
Q2 = mc.Setting("Q2_K", context=4096)


def _figures(kl: float) -> mc.Figures:
    return mc.Figures(kl, kl / 2, kl * 5, kl * 9, 1 - kl, kl / 3, 1 + kl, 2048)


META = mc.McMetadata(
    base_model="tiny-qwen35",
    source_sha256="ab" * 32,
    builder_version="0.1.0",
    built_date="2026-11-29",
    corpus_id="stdlib-py311-v1",
    corpus_tokens=2048,
    results=(mc.Row(F16, _figures(0.001)), mc.Row(KV_Q4, _figures(0.02)), mc.Row(Q2, _figures(0.3))),
)


@pytest.fixture
def model(tmp_path, tiny_qwen35_path):
    path = tmp_path / "tiny.gguf"
    shutil.copyfile(tiny_qwen35_path, path)
    return path


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _non_mc_fields(path) -> dict:
    fields = gguf.GGUFReader(path).fields
    return {k: str(f.contents()) for k, f in fields.items() if not k.startswith(("mc.", "GGUF."))}


def test_attach_and_read_back(model):
    before = _non_mc_fields(model)
    assert mc.read(model) is None
    mc.write(model, META)
    assert mc.read(model) == META
    assert _non_mc_fields(model) == before


def test_replace_keeps_one_copy_of_each_key(model):
    mc.write(model, META)
    newer = META.with_results([mc.Row(F16, _figures(0.005))])
    mc.write(model, newer)
    read = mc.read(model)
    assert read.stats_for(F16).figures.kl_mean == pytest.approx(0.005)
    assert len(read.results) == 3
    assert sum(1 for k in gguf.GGUFReader(model).fields if k == "mc.base_model") == 1


def test_llama_cpp_still_loads_and_generates_the_same(model, tiny_qwen35_path):
    from orchestrator.llama import Batch, Context, ContextParams, Model

    def next_token(path) -> int:
        with Model(path) as m, Context(m, ContextParams(n_ctx=256, n_batch=32)) as ctx, Batch(32) as b:
            tokens = m.tokenize("def main():")
            for i, t in enumerate(tokens):
                b.add(t, i, 0, i == len(tokens) - 1)
            ctx.decode(b)
            return int(ctx.logits(b.n_tokens - 1).argmax())

    mc.write(model, META)
    assert next_token(model) == next_token(tiny_qwen35_path)


def test_a_failed_write_leaves_the_original_untouched(model, monkeypatch):
    sha = _sha(model)

    def boom(self, tensor, tensor_endianess=None):
        raise OSError("disk full")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", boom)
    with pytest.raises(OSError, match="disk full"):
        mc.write(model, META)
    assert _sha(model) == sha
    assert sorted(p.name for p in model.parent.iterdir()) == ["tiny.gguf"]


def test_stats_for_measured_and_nearest():
    assert META.stats_for(KV_Q4).measured
    asked = mc.Setting("Q8_0", "q8_0", "q8_0")  # between f16 and q4_0 KV: not measured
    answer = META.stats_for(asked)
    assert not answer.measured and answer.nearest is not None
    assert "not measured; nearest measured: Q8_0" in answer.message()
    far = META.stats_for(mc.Setting("Q2_K", context=8192))
    assert far.nearest.setting == Q2
    assert "no measurements" in mc.McMetadata("m", "", "", "", "", 0).stats_for(F16).message()


def test_malformed_metadata_names_the_key(model):
    mc.write(model, META)
    reader = gguf.GGUFReader(model)
    writer = gguf.GGUFWriter(model.with_suffix(".bad.gguf"), "qwen35")
    for field in reader.fields.values():
        if field.name in ("general.architecture", "mc.results.kl_p99") or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        writer.add_key_value(
            field.name, field.contents(), vtype, sub_type=field.types[-1] if vtype == 9 else None
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    with pytest.raises(mc.MetadataError, match=r"lacks key mc\.results\.kl_p99"):
        mc.read(model.with_suffix(".bad.gguf"))
