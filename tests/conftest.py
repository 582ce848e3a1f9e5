"""Shared fixtures: real models (the bundled Gemma 3 270M, the tiny qwen35) and the build script."""

from __future__ import annotations

import importlib.util
import socket
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def build_script():
    """ggml-patches/build.py as a module (its folder name is not importable)."""
    spec = importlib.util.spec_from_file_location("mc_build_script", ROOT / "ggml-patches" / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    from orchestrator.models import bundled_gemma

    return bundled_gemma()


@pytest.fixture(scope="session")
def tiny_qwen35_path(tmp_path_factory) -> Path:
    from mcformat.tiny import ensure_tiny_qwen35

    return ensure_tiny_qwen35(tmp_path_factory.mktemp("tiny-qwen35"))


@pytest.fixture
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
