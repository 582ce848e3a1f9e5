"""The weights builder on the tiny qwen35 BF16 checkpoint: outputs, metadata, resume, bad sources."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from mcformat import builder
from mcformat import metadata as mc
from mcformat.evaluate import stdlib_corpus


def _plan(src, out, **kw):
    args = dict(
        quants=("Q8_0", "Q4_K_M", "Q2_K"), kv_types=("f16", "q4_0"), n_ctx=256, n_chunks=1, name="tiny"
    )
    return builder.BuildPlan(src, out, **{**args, **kw})


@pytest.fixture(scope="module")
def source(tiny_qwen35_path):
    return tiny_qwen35_path.parent / "hf"


@pytest.fixture(scope="module")
def built(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("mc-build")
    data = builder.build(_plan(source, out), stdlib_corpus())
    return out, data


def test_builder_outputs_load_and_carry_ordered_figures(built):
    from orchestrator.llama import Model

    out, data = built
    assert data["outputs"] == ["tiny-Q8_0.gguf", "tiny-Q4_K_M.gguf", "tiny-Q2_K.gguf"]
    kl = {}
    for name in data["outputs"]:
        meta = mc.read(out / name)
        assert meta.base_model == "tiny" and meta.source_sha256 == data["steps"]["source"]["sha256"]
        q = name.removeprefix("tiny-").removesuffix(".gguf")
        kl[q] = meta.stats_for(mc.Setting(q, context=256)).figures.kl_mean
        kv4 = meta.stats_for(mc.Setting(q, "q4_0", "q4_0", context=256)).figures.kl_mean
        assert kv4 >= kl[q] * 0.999  # q4_0 KV never closer than f16 KV
        with Model(out / name) as model:
            assert model.n_vocab == 8192
    assert kl["Q8_0"] < kl["Q4_K_M"] < kl["Q2_K"]
    assert not [p for p in out.iterdir() if "partial" in p.name]


def test_an_interrupted_build_resumes_without_redoing_steps(source, tmp_path, monkeypatch):
    real_quantize, calls = builder.quantize, []

    def flaky(src, out, q, threads=None):
        calls.append(q)
        if q == "Q4_K_M" and calls.count(q) == 1:
            raise KeyboardInterrupt  # the user pressed Ctrl-C during the second quantization
        return real_quantize(src, out, q, threads)

    monkeypatch.setattr(builder, "quantize", flaky)
    with pytest.raises(KeyboardInterrupt):
        builder.build(_plan(source, tmp_path, kv_types=("f16",)), stdlib_corpus())
    steps = json.loads((tmp_path / "manifest.json").read_text())["steps"]
    assert set(steps) == {"source", "convert", "quantize:Q8_0"}
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]

    monkeypatch.setattr(builder, "convert_checkpoint", lambda *a, **k: pytest.fail("convert ran again"))
    data = builder.build(_plan(source, tmp_path, kv_types=("f16",)), stdlib_corpus())
    assert calls == ["Q8_0", "Q4_K_M", "Q4_K_M", "Q2_K"]  # Q8_0 was not quantized again
    assert len(data["outputs"]) == 3
    again = builder.build(_plan(source, tmp_path, kv_types=("f16",)), stdlib_corpus())  # nothing left to do
    assert calls == ["Q8_0", "Q4_K_M", "Q4_K_M", "Q2_K"] and again["steps"] == data["steps"]


def test_a_truncated_source_is_a_clear_error(source, tmp_path):
    bad = tmp_path / "src"
    shutil.copytree(source, bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])
    with pytest.raises(builder.BuildError, match="corrupt or truncated"):
        builder.build(_plan(bad, tmp_path / "out"), stdlib_corpus())


def test_cli_reports_a_bad_quant_type_in_one_line(source, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator",
            "build-weights",
            str(source),
            "--out",
            str(tmp_path),
            "--quants",
            "Q9",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0 and "quants: ['Q9'] not among Q8_0" in proc.stderr


def test_importance_matrix_option(source, built, tmp_path):
    from orchestrator.llama import Model

    data = builder.build(
        _plan(source, tmp_path, quants=("Q2_K",), kv_types=("f16",), imatrix=True), stdlib_corpus()
    )
    assert data["steps"]["quantize:Q2_K"]["imatrix"] is True
    assert (tmp_path / "tiny.imatrix.gguf").is_file()
    with_imatrix = (tmp_path / "tiny-Q2_K.gguf").read_bytes()
    plain = (built[0] / "tiny-Q2_K.gguf").read_bytes()
    assert len(with_imatrix) == pytest.approx(len(plain), rel=0.01) and with_imatrix != plain
    assert mc.read(tmp_path / "tiny-Q2_K.gguf").results  # measured like any variant
    with Model(tmp_path / "tiny-Q2_K.gguf") as model:
        assert model.n_vocab == 8192
    # stock llama.cpp (llama-quantize from the unpatched pinned source) loads MC weights
    from mcformat.quantize import llama_tools

    proc = subprocess.run(
        [
            str(llama_tools() / "llama-quantize"),
            "--allow-requantize",
            str(built[0] / "tiny-Q8_0.gguf"),
            str(tmp_path / "requant.gguf"),
            "Q4_0",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-500:]
    assert "mc.results.kl_mean" in proc.stderr + proc.stdout  # it read the mc.* keys as it loaded
