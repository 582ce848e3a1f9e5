"""The downloader against a local server speaking the hub's protocol (HF_ENDPOINT)."""

from __future__ import annotations

import os
import shutil

import pytest

from mcformat.download import DownloadError, download, list_weights
from tests.mcformat.fake_hub import FakeHub

REPO = "megacapybara/Tiny-MC-GGUF"
FILES = {"tiny-Q8_0.gguf": os.urandom(3_000_000), "tiny-Q2_K.gguf": os.urandom(1_000_000), "README.md": b"hi"}


@pytest.fixture
def hub(monkeypatch):
    with FakeHub({REPO: FILES}) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield server


def test_lists_the_gguf_weights_with_sizes_and_checksums(hub):
    files = list_weights(REPO)
    assert [f.path for f in files] == ["tiny-Q2_K.gguf", "tiny-Q8_0.gguf"]
    assert files[1].size == 3_000_000 and len(files[1].sha256) == 64


def test_downloads_verifies_and_places_in_the_models_folder(hub, tmp_path):
    path = download(REPO, "tiny-Q8_0.gguf", tmp_path)
    assert path == tmp_path / "megacapybara--Tiny-MC-GGUF" / "tiny-Q8_0.gguf"
    assert path.read_bytes() == FILES["tiny-Q8_0.gguf"]


def test_a_broken_download_resumes_where_it_stopped(monkeypatch, tmp_path):
    # huggingface_hub writes in 10 MiB pieces: a 24 MiB file cut after 21 MiB resumes at 20 MiB
    big = {"big-Q8_0.gguf": os.urandom(24 << 20)}
    with FakeHub({REPO: big}, cut_first_get_at=21 << 20) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        path = download(REPO, "big-Q8_0.gguf", tmp_path)
        gets = [r for r in server.requests if r[0] == "GET"]
    assert path.read_bytes() == big["big-Q8_0.gguf"]
    assert gets[0][2] is None and gets[1][2] == f"bytes={20 << 20}-"  # the second GET asked for the rest


def test_missing_repo_and_file_are_clear_errors(hub, tmp_path):
    with pytest.raises(DownloadError, match=r"no repository 'nobody/nothing'"):
        list_weights("nobody/nothing")
    with pytest.raises(DownloadError, match=r"has no GGUF file 'tiny-Q5\.gguf'"):
        download(REPO, "tiny-Q5.gguf", tmp_path)


def test_no_network_is_a_clear_error(monkeypatch, tmp_path, free_port):
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port}")
    with pytest.raises(DownloadError, match=r"cannot reach http://127\.0\.0\.1"):
        list_weights(REPO)


def test_no_disk_space_is_refused_before_downloading(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 1000))
    with pytest.raises(DownloadError, match=r"no disk space: tiny-Q8_0\.gguf needs 3,000,000 bytes"):
        download(REPO, "tiny-Q8_0.gguf", tmp_path)
    assert not [r for r in hub.requests if r[0] == "GET"]
