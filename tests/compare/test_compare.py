"""`megacapybara compare` on three quantizations of the tiny qwen35: table, CSV/JSON, plots."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from mcformat.quantize import quantize


@pytest.fixture(scope="module")
def three(tiny_qwen35_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("cmp-in")
    return [quantize(tiny_qwen35_path, out / f"tiny-{q}.gguf", q) for q in ("Q8_0", "Q4_K_M", "Q2_K")]


def _run(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "orchestrator", "compare", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def test_compare_prints_the_table_and_writes_csv_json_and_plots(three, tiny_qwen35_path, tmp_path):
    proc = _run(*map(str, three), "--reference", str(tiny_qwen35_path), "--out", str(tmp_path),
                "--ctx", "256", "--chunks", "1")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:4] == ["file", "GB", "bpw", "KL"]
    assert [ln.split()[0] for ln in lines[2:5]] == ["tiny-Q8_0", "tiny-Q4_K_M", "tiny-Q2_K"]
    rows = json.loads((tmp_path / "compare.json").read_text())
    assert rows[0]["kl_mean"] < rows[1]["kl_mean"] < rows[2]["kl_mean"]
    assert rows[0]["bits_per_weight"] > rows[1]["bits_per_weight"] > rows[2]["bits_per_weight"]
    assert all(r["decode_tok_s"] > 0 for r in rows)
    with open(tmp_path / "compare.csv") as f:
        assert [r["name"] for r in csv.DictReader(f)] == ["tiny-Q8_0", "tiny-Q4_K_M", "tiny-Q2_K"]
    for png in ("kl_vs_size.png", "top1_vs_size.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_a_missing_file_is_one_line(tiny_qwen35_path, tmp_path):
    proc = _run(str(tmp_path / "nope.gguf"), "--reference", str(tiny_qwen35_path))
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"megacapybara compare: error: no such file: {tmp_path / 'nope.gguf'}"
