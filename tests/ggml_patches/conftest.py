"""The pinned llama.cpp with the patch series applied, shared by the tests here."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def patched(build_script, tmp_path_factory):
    src = build_script.unpack(
        build_script.fetch_sdist(build_script.cache_root()), tmp_path_factory.mktemp("s") / "src"
    )
    build_script.apply_series(src)
    return src / "vendor" / "llama.cpp"
