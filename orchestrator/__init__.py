"""MegaCapybara's engine: many agents on one model, one GPU, one unified KV budget."""

import contextlib

__version__ = "0.1.0"

# Load llama.cpp's shared libraries before anything imports numpy: with the CUDA build made on the
# H200 image (g++ 13.3 from /opt/gcc), loading numpy first made every model load segfault in
# libstdc++ code that libggml-cuda.so exports (bench/NOTES.md, 2026-11-29). The cause in the
# build is not settled; this order avoids it.
with contextlib.suppress(ImportError):  # before `make setup`: the CLI says so when a model is needed
    import llama_cpp as _llama_cpp  # noqa: F401
