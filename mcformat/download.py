"""Downloading MC weights from a Hugging Face repository (huggingface_hub), checked and placed in
the models folder. `HF_ENDPOINT` points the client at another hub (the tests run a local one).

Errors are DownloadError with one clear line: no network, no such repository or file, not
enough disk space, or a file whose size or sha256 does not match what the hub lists (it is
deleted rather than kept).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit


class DownloadError(RuntimeError):
    pass


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    sha256: str | None  # of an LFS file (all GGUF weights are)


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def _explain(exc: Exception, repo_id: str, filename: str | None = None) -> DownloadError:
    from huggingface_hub import errors

    if isinstance(exc, errors.RepositoryNotFoundError):
        return DownloadError(f"no repository {repo_id!r} on {endpoint()} (or it is private)")
    if isinstance(exc, errors.EntryNotFoundError | errors.RemoteEntryNotFoundError):
        return DownloadError(f"repository {repo_id!r} has no file {filename!r}")
    if isinstance(exc, errors.LocalEntryNotFoundError | OSError) or "connect" in type(exc).__name__.lower():
        return DownloadError(f"cannot reach {endpoint()}: no network? ({type(exc).__name__})")
    return DownloadError(f"download from {endpoint()} failed: {exc}")


def check_reachable(timeout_s: float = 3.0) -> None:
    """A quick TCP probe, so that no network is an answer in seconds, not the client's retries."""
    url = urlsplit(endpoint())
    try:
        with socket.create_connection(
            (url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout_s
        ):
            pass
    except OSError as exc:
        raise DownloadError(f"cannot reach {endpoint()}: no network? ({exc.strerror or exc})") from None


def list_weights(repo_id: str) -> list[RemoteFile]:
    """The GGUF files of a repository with their sizes and checksums."""
    from huggingface_hub import HfApi

    check_reachable()
    try:
        entries = list(HfApi(endpoint=endpoint()).list_repo_tree(repo_id, recursive=True, expand=True))
    except Exception as exc:
        raise _explain(exc, repo_id) from None
    files = []
    for e in entries:
        if getattr(e, "path", "").endswith(".gguf") and hasattr(e, "size"):
            lfs = getattr(e, "lfs", None)
            files.append(RemoteFile(e.path, e.size, lfs.sha256 if lfs else None))
    return sorted(files, key=lambda f: f.path)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


def download(repo_id: str, filename: str, models_dir: Path) -> Path:
    """Download `filename` (resuming a partial download), verify it, return its path."""
    from huggingface_hub import hf_hub_download

    remote = {f.path: f for f in list_weights(repo_id)}.get(filename)
    if remote is None:
        raise DownloadError(f"repository {repo_id!r} has no GGUF file {filename!r}")
    dest = models_dir / repo_id.replace("/", "--")
    dest.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(dest).free
    if free < remote.size:
        raise DownloadError(
            f"no disk space: {filename} needs {remote.size:,} bytes, {dest} has {free:,} free"
        )
    try:
        path = Path(hf_hub_download(repo_id, filename, local_dir=dest, endpoint=endpoint()))
    except Exception as exc:
        raise _explain(exc, repo_id, filename) from None
    size = path.stat().st_size
    if size != remote.size or (remote.sha256 and sha256_of(path) != remote.sha256):
        path.unlink(missing_ok=True)
        raise DownloadError(
            f"{filename}: downloaded {size:,} bytes whose size or sha256 does not match the hub's"
        )
    return path
