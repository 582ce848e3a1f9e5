"""bench/gpu/engine_gpu.py end to end on this CPU with the tiny qwen35 (a CPU build keeps the layers on
the CPU): the repacked_weights setting it is given reaches the engines it makes and the JSON, the
aggregate is measured, and every figure it prints is in the JSON; a bad value is refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_engine_gpu(model: Path, out: Path, repack: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "bench/gpu/engine_gpu.py", str(model), "--json", str(out), "--tasks", "2",
        "--depths", "none", "--breakdown", ",", "--skip-steps", "--skip-sampled", "--prealloc-mb", "0",
        "--repacked-weights", repack,
    ]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_engine_gpu_records_the_repack_setting_and_its_figures(tiny_qwen35_path, tmp_path):
    out = tmp_path / "engine.json"
    run = run_engine_gpu(tiny_qwen35_path, out, "off")
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["repacked_weights"] == "off"
    assert res["mc_mmh_repack"] == "0"  # set by the engines it made, from their EngineConfig
    assert res["agg_tok_s_2"] > 0
    assert res["swap_pinned"] is False  # no CUDA here: the swap pool stays pageable
    assert f"engine,  2 tasks: {res['agg_tok_s_2']:.1f} tok/s" in run.stdout


def test_engine_gpu_passes_on_to_the_engines(tiny_qwen35_path, tmp_path):
    out = tmp_path / "engine.json"
    run = run_engine_gpu(tiny_qwen35_path, out, "on")
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["repacked_weights"] == "on" and res["mc_mmh_repack"] == "1"


def test_engine_gpu_refuses_an_unknown_repack_setting(tiny_qwen35_path, tmp_path):
    run = run_engine_gpu(tiny_qwen35_path, tmp_path / "engine.json", "yes")
    assert run.returncode == 2
    assert "--repacked-weights: invalid choice: 'yes' (choose from 'auto', 'on', 'off')" in run.stderr
    assert not (tmp_path / "engine.json").exists()
