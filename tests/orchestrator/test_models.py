"""The model registry: auto choice, bundled model, and the no-network fallback."""

from __future__ import annotations

import pytest

from orchestrator import models


def test_auto_on_cpu_is_the_bundled_gemma(gemma_path):
    resolved = models.resolve("auto", gpu=False)
    assert resolved.name == "gemma3-270m"
    assert resolved.path == gemma_path
    assert resolved.path.stat().st_size == 253_113_024
    assert resolved.note == ""


def test_a_path_is_used_as_is(tiny_qwen35_path):
    resolved = models.resolve(str(tiny_qwen35_path), gpu=False)
    assert resolved.path == tiny_qwen35_path


def test_unknown_name_lists_the_registry():
    with pytest.raises(
        models.ModelNotFound,
        match=r"gemma3-270m, qwen3\.8-27b-mc-q4_0, qwen3\.8-27b-mc, qwen3\.8-27b-mc-q8_0, tiny-qwen35",
    ):
        models.resolve("llama-9000", gpu=False)


def test_gpu_default_without_network_falls_back_in_one_line(monkeypatch, tmp_path, free_port, gemma_path):
    monkeypatch.setenv("MC_MODELS_DIR", str(tmp_path))
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port}")  # nothing listens there
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(models, "bundled_gemma", lambda: gemma_path)
    resolved = models.resolve("auto", gpu=True)
    assert resolved.name == "gemma3-270m"
    assert "\n" not in resolved.note
    assert "Qwen3.8 27B" in resolved.note and f"127.0.0.1:{free_port} is unreachable" in resolved.note
    assert "bundled Gemma 3 270M" in resolved.note


def test_offline_setting_never_tries_the_network(monkeypatch, tmp_path, gemma_path):
    monkeypatch.setenv("MC_MODELS_DIR", str(tmp_path))
    monkeypatch.setattr(models, "_download", lambda entry: pytest.fail("offline mode must not download"))
    monkeypatch.setattr(models, "bundled_gemma", lambda: gemma_path)
    resolved = models.resolve("qwen3.8-27b-mc", gpu=True, offline=True)
    assert resolved.name == "gemma3-270m" and "offline mode" in resolved.note


def test_bundled_gemma_is_assembled_under_a_temp_name_then_renamed(monkeypatch, tmp_path):
    monkeypatch.setenv("MC_MODELS_DIR", str(tmp_path))
    path = models.bundled_gemma()
    assert path.parent == tmp_path and path.stat().st_size == 253_113_024
    assert not list(tmp_path.glob("*.partial"))


def test_gpu_default_downloads_from_the_hub_when_published(monkeypatch, tmp_path):
    from tests.mcformat.fake_hub import FakeHub

    entry = models.REGISTRY[models.GPU_DEFAULT]
    with FakeHub({entry.repo_id: {entry.filename: b"GGUF" + bytes(1000)}}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("MC_MODELS_DIR", str(tmp_path))
        resolved = models.resolve("auto", gpu=True)
    assert resolved.name == "qwen3.8-27b-mc-q4_0" and resolved.note == ""
    assert resolved.path.name == "Qwen3.8-27B-MC-Q4_0.gguf" and resolved.path.read_bytes()[:4] == b"GGUF"
    assert models.resolve("auto", gpu=True, offline=True).path == resolved.path  # found locally now


def test_an_unpublished_repo_falls_back_saying_why(monkeypatch, tmp_path, gemma_path):
    from tests.mcformat.fake_hub import FakeHub

    with FakeHub({}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("MC_MODELS_DIR", str(tmp_path))
        monkeypatch.setattr(models, "bundled_gemma", lambda: gemma_path)
        resolved = models.resolve("auto", gpu=True)
    assert resolved.name == "gemma3-270m" and "no repository" in resolved.note


def test_the_gpu_default_is_the_quant_the_patched_kernels_run_and_the_builder_makes():
    """Only Q4_0 weights take the patched GPU products (docs/architecture.md), so the default on a GPU
    is the Q4_0 MC weights, and the weights builder makes that file unless told otherwise (the CLI's
    build-weights too); Q4_K_M stays by name."""
    from mcformat.builder import BuildPlan
    from mcformat.quantize import DEFAULT_QUANTS
    from orchestrator.cli import build_parser

    default = models.REGISTRY[models.GPU_DEFAULT]
    quant = default.filename.removesuffix(".gguf").rsplit("-", 1)[1]
    assert quant == "Q4_0" and "Q4_0" in default.title
    assert quant in DEFAULT_QUANTS and BuildPlan.quants == DEFAULT_QUANTS
    args = build_parser().parse_args(["build-weights", "SRC", "--out", "OUT"])
    assert args.quants.split(",") == list(DEFAULT_QUANTS)
    # the other MC weights share its repository, each a quant the builder makes
    for name in ("qwen3.8-27b-mc", "qwen3.8-27b-mc-q8_0"):
        entry = models.REGISTRY[name]
        assert entry.repo_id == default.repo_id
        assert entry.filename.removesuffix(".gguf").rsplit("-", 1)[1] in DEFAULT_QUANTS
