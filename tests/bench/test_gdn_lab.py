"""bench/gpu/gdn_lab.py: it applies the patch series to the pinned sdist, compiles gdn_lab.cu against
that tree (the recurrence's kernels included as they are, the launcher's host dependencies stubbed),
the program refuses bad arguments with a clear message before touching a GPU, and the driver's own
argument errors are clear. The timings themselves need a GPU (bench/results, run on the H200)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[2] / "bench" / "gpu"


def load():
    spec = importlib.util.spec_from_file_location("gdn_lab", GPU / "gdn_lab.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rows_and_table():
    lab = load()
    lines = [
        "noise",
        '{"variant": "staged", "tokens": 16, "us": 20.5, "step_ms": 0.984, "out_rel": 0, "state_rel": 0}',
        '{"variant": "chunked", "tokens": 16, "us": 6.25, "step_ms": 0.3, "out_rel": 1e-6, "state_rel": 0}',
    ]
    rows = lab.parse(lines)
    assert [r["variant"] for r in rows] == ["staged", "chunked"]
    text = lab.table(rows)
    assert "chunked" in text and "20.50" in text and "1.00e-06" in text


def test_the_lab_compiles_against_the_patched_tree(build_script, tmp_path):
    nvcc = shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None
    )
    if nvcc is None:
        pytest.skip("no nvcc on this machine")
    lab = load()
    tree = lab.patched_tree(build_script.fetch_sdist(build_script.cache_root()), tmp_path / "src")
    exe = tmp_path / "gdn_lab"
    subprocess.run(lab.compile_cmd(nvcc, tree, exe, "90"), check=True, capture_output=True)
    bad = (([], "usage"), (["0", "16"], "usage"), (["3", "0"], "TOKENS 0"), (["3", "65"], "1..64"))
    for args, msg in bad:
        res = subprocess.run([str(exe), *args], capture_output=True, text=True, check=False)
        assert res.returncode == 2 and msg in res.stderr, (args, res.stderr)


def test_bad_driver_arguments_are_clear_errors(monkeypatch, tmp_path):
    lab = load()
    for argv, msg in (
        (["--json", "x.json", "--tokens", "0"], "--tokens '0'"),
        (["--json", "x.json", "--tokens", "1,x"], "--tokens '1,x'"),
        (["--json", "x.json", "--repeats", "0"], "--repeats 0"),
        (["--json", "x.json", "--arch", "9x"], "--arch '9x'"),
        (["--json", "x.json", "--src", str(tmp_path)], "no ggml/src/ggml-cuda/gated_delta_net.cu"),
        (["--json", "x.json", "--sdist", str(tmp_path / "none.tar.gz")], "no such file"),
    ):
        monkeypatch.setattr("sys.argv", ["gdn_lab.py", *argv])
        with pytest.raises(SystemExit) as e:
            lab.main()
        assert msg in str(e.value)
