"""The patched llama.cpp backend: loading it once, and proving it is the patched build.

`ggml-patches/build.py` builds llama-cpp-python with MegaCapybara's patch series and bakes the
series' sha256 into libllama; `mc_build_info()` (patch 0002) reports it. The engine calls
`check_backend()` at start and logs the hash, so every log shows which build is running.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import logging
import sys
import threading
from dataclasses import dataclass
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = REPO_ROOT / "ggml-patches" / "build.py"

_init_lock = threading.Lock()
_initialised = False


class BackendError(RuntimeError):
    """The installed llama.cpp cannot be used (missing, or not the patched build)."""


@dataclass(frozen=True)
class BuildInfo:
    """What the loaded libllama says about its build (see ggml-patches/patches/0002)."""

    patch_series: str  # sha256 hex of the patch series
    backend: str  # "cpu" or "cuda"
    arch: str  # CPU tag or CUDA architectures, comma-separated
    llama_cpp_python: str

    @classmethod
    def from_json(cls, text: str) -> BuildInfo:
        data = json.loads(text)
        return cls(data["patch_series"], data["backend"], data["arch"], data["llama_cpp_python"])


def llama():
    """The `llama_cpp` low-level module, with the backend initialised once per process."""
    global _initialised
    import llama_cpp

    with _init_lock:
        if not _initialised:
            _silence_native_logs(llama_cpp)
            llama_cpp.llama_backend_init()
            _initialised = True
    return llama_cpp


@cache
def build_info() -> BuildInfo:
    """Read `mc_build_info()` from the loaded libllama.

    Raises BackendError when llama_cpp is a stock build (the symbol is absent).
    """
    lib = llama().llama_cpp._lib
    fn = getattr(lib, "mc_build_info", None)
    if fn is None:
        raise BackendError(
            "llama_cpp is a stock build without MegaCapybara's patches (no mc_build_info); "
            "run `make setup` or `python ggml-patches/build.py`"
        )
    fn.restype = ctypes.c_char_p
    fn.argtypes = []
    return BuildInfo.from_json(fn().decode())


@cache
def expected_series_hash() -> str | None:
    """The hash of the patch series in this source tree, or None outside a source checkout."""
    if not BUILD_SCRIPT.is_file():
        return None
    spec = importlib.util.spec_from_file_location("mc_ggml_build", BUILD_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses in the script look their module up
    spec.loader.exec_module(module)
    return module.series_hash()


def check_backend() -> BuildInfo:
    """Log which patched build is loaded; warn when it differs from this tree's patch series."""
    info = build_info()
    log.info(
        "llama.cpp backend: patched build, patch series %s, %s (%s), llama-cpp-python %s",
        info.patch_series[:16],
        info.backend,
        info.arch,
        info.llama_cpp_python,
    )
    expected = expected_series_hash()
    if expected is not None and expected != info.patch_series:
        log.warning(
            "the installed backend was built from patch series %s but this tree has %s: run `make setup`",
            info.patch_series[:16],
            expected[:16],
        )
    return info


_LOG_CB = None  # keep the ctypes callback alive for the life of the process


def _silence_native_logs(llama_cpp) -> None:
    """Route llama.cpp's own log lines to Python logging at DEBUG (they are very chatty)."""
    global _LOG_CB
    native = logging.getLogger("llama.cpp")

    def _cb(level, text, _user):
        native.debug("%s", text.decode(errors="replace").rstrip())

    _LOG_CB = llama_cpp.llama_log_callback(_cb)
    llama_cpp.llama_log_set(_LOG_CB, ctypes.c_void_p(0))


def llama_tools(targets: list[str], stock: bool = True) -> Path:
    """The bin folder of llama.cpp's own programs (llama-perplexity, llama-imatrix, ...), built
    once from the pinned source by `ggml-patches/build.py --tools` (stock unless asked).
    Raises BackendError with the build's last words when it fails."""
    import subprocess

    cmd = [sys.executable, str(BUILD_SCRIPT), "--tools", ",".join(targets), *(["--stock"] if stock else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BackendError(f"building {', '.join(targets)} failed: {proc.stderr.strip()[-400:]}")
    return Path(proc.stdout.strip().splitlines()[-1])
