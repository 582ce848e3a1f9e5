"""The patch series: applies to the pristine sdist, fails loudly naming a broken patch, is keyed
by its hash, and the installed backend is the one built from it."""

from __future__ import annotations

import shutil

import pytest


@pytest.fixture(scope="module")
def sdist(build_script):
    return build_script.fetch_sdist(build_script.cache_root())


@pytest.fixture
def pristine(build_script, sdist, tmp_path):
    return build_script.unpack(sdist, tmp_path / "src")


def test_series_applies_to_the_pristine_sdist(build_script, pristine):
    applied = build_script.apply_series(pristine)
    assert applied == [p.name for p in build_script.read_series()]
    assert (pristine / "vendor/llama.cpp/src/mc-build-info.cpp").is_file()
    assert "MC_BUILD_COMMON" in (pristine / "CMakeLists.txt").read_text()


def test_a_broken_patch_fails_naming_the_patch(build_script, pristine, tmp_path):
    patches = tmp_path / "series-copy"
    shutil.copytree(build_script.PATCH_DIR / "patches", patches / "patches")
    broken = patches / "patches" / "0099-broken.patch"
    broken.write_text(
        "--- a/CMakeLists.txt\n+++ b/CMakeLists.txt\n@@ -1,2 +1,2 @@\n"
        "-this line is not in the file\n+neither is this\n context that does not exist\n"
    )
    series = (build_script.PATCH_DIR / "series").read_text() + "0099-broken.patch\n"
    (patches / "series").write_text(series)
    with pytest.raises(build_script.PatchError, match=r"patch 0099-broken\.patch does not apply"):
        build_script.apply_series(pristine, patches)


def test_a_missing_patch_file_is_named(build_script, tmp_path):
    (tmp_path / "patches").mkdir()
    (tmp_path / "series").write_text("# comment\n0001-gone.patch\n")
    with pytest.raises(build_script.PatchError, match=r"0001-gone\.patch"):
        build_script.read_series(tmp_path)


def test_series_hash_changes_with_any_patch_byte(build_script, tmp_path):
    shutil.copytree(
        build_script.PATCH_DIR, tmp_path / "p", ignore=shutil.ignore_patterns("*.py", "__pycache__")
    )
    before = build_script.series_hash(tmp_path / "p")
    assert before == build_script.series_hash()
    target = build_script.read_series(tmp_path / "p")[-1]
    target.write_bytes(target.read_bytes() + b"\n")
    assert build_script.series_hash(tmp_path / "p") != before


def test_cache_key_and_cmake_args_per_backend(build_script):
    h = build_script.series_hash()
    cuda = build_script.BuildTarget("cuda", "90;120", h)
    assert cuda.key == f"0.3.36-{h[:16]}-cuda-90-120"
    assert "-DGGML_CUDA=ON" in cuda.cmake_args()
    assert "-DCMAKE_CUDA_ARCHITECTURES=90;120" in cuda.cmake_args()
    assert "-DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL" in cuda.cmake_args()
    cpu = build_script.BuildTarget("cpu", "portable", h)
    assert "-DGGML_NATIVE=OFF" in cpu.cmake_args()
    assert f"-DMC_PATCH_SERIES_HASH={h}" in cpu.cmake_args()
    assert cpu.key != cuda.key
    assert not any("AMX" in a.upper() for a in cpu.cmake_args())  # portable: no -march=native


def test_native_cpu_builds_leave_out_amx_and_key_on_it(build_script, monkeypatch):
    """-march=native builds add NATIVE_CPU_FLAGS (x86: no AMX, whose tile kernels died with SIGILL
    on a VM that reports AMX) to C and C++ alike, and the flags are part of the cache key."""
    h = build_script.series_hash()
    monkeypatch.setattr(build_script, "NATIVE_CPU_FLAGS", "-mno-amx-int8")
    native = build_script.BuildTarget("cpu", build_script.cpu_tag(), h)
    assert "-DGGML_NATIVE=ON" in native.cmake_args()
    assert "-DCMAKE_C_FLAGS=-mno-amx-int8" in native.cmake_args()
    assert "-DCMAKE_CXX_FLAGS=-mno-amx-int8" in native.cmake_args()
    assert all(" " not in a for a in native.cmake_args())  # CMAKE_ARGS is split at spaces
    assert "-DCMAKE_CXX_FLAGS=-mno-amx-int8" in build_script.BuildTarget("cuda", "90", h).cmake_args()
    monkeypatch.setattr(build_script, "NATIVE_CPU_FLAGS", "")
    assert build_script.cpu_tag() != native.arch
    assert not any("FLAGS" in a for a in build_script.BuildTarget("cpu", native.arch, h).cmake_args())


def test_cuda_architectures_default_and_override(build_script, monkeypatch):
    monkeypatch.setattr(build_script.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(build_script, "gpu_compute_caps", lambda: ["89"])
    monkeypatch.delenv("MC_CUDA_ARCH", raising=False)
    assert build_script.choose_target("auto", None, False).arch == "90;120;89"
    assert build_script.choose_target("cuda", "120", False).arch == "120"
    monkeypatch.setattr(build_script, "gpu_compute_caps", lambda: [])
    assert build_script.choose_target("auto", None, False).backend == "cpu"
    with pytest.raises(build_script.BuildError, match="--backend must be one of"):
        build_script.choose_target("rocm", None, False)


def test_installed_backend_is_the_patched_build_of_this_series(build_script):
    from orchestrator.backend import build_info

    info = build_info()
    assert info.patch_series == build_script.series_hash()
    assert info.llama_cpp_python == build_script.VERSION
    assert info.backend in ("cpu", "cuda")


def test_sync_tree_rewrites_only_changed_files(build_script, tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "d").mkdir(parents=True)
    (src / "d" / "a.txt").write_text("a")
    (src / "b.txt").write_text("b")
    assert build_script.sync_tree(src, dst) == 2
    (src / "b.txt").write_text("b2")
    (dst / "stale.txt").write_text("x")
    assert build_script.sync_tree(src, dst) == 1
    assert (dst / "b.txt").read_text() == "b2"
    assert not (dst / "stale.txt").exists()
