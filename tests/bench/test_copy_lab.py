"""bench/gpu/copy_lab.py: its verify-step plan is the 27B's Q4_0 product launches (launch_probe's plan,
rows rounded down to the lab's 64-row tiles), its step totals weight each shape by its launches, and
copy_lab.cu compiles for sm_90a and refuses bad arguments with a clear message."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[2] / "bench" / "gpu"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, GPU / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_plan_is_a_verify_steps_product_launches():
    lab, probe = load("copy_lab"), load("launch_probe")
    plan = lab.step_shapes()
    assert sum(plan.values()) == len(probe.decode_launches()) == 256
    assert all(rows % 64 == 0 and k % 512 == 0 for rows, k in plan)
    lab_bytes = sum(n * rows * k * 18 // 32 for (rows, k), n in plan.items())
    # the Gated DeltaNet input group's 16,480 rows run as 16,448 in the lab: 32 rows x 48 layers
    rounding = 48 * 32 * 5120 * 18 // 32
    assert lab_bytes + rounding == sum(b for _, b in probe.decode_launches())


def test_step_totals_weight_each_shape_by_its_launches():
    lab = load("copy_lab")
    plan = {(64, 512): 3, (128, 512): 1}
    lines = [
        "not json",
        '{"structure": "warp", "stages": 3, "y": true, "blocks_per_sm": 2, "rows": 64, "k": 512, "us": 2.0}',
        '{"structure": "warp", "stages": 3, "y": true, "blocks_per_sm": 2, "rows": 128, "k": 512, "us": 4.0}',
        # measured at one shape only: no step total
        '{"structure": "block", "stages": 6, "y": false, "blocks_per_sm": 2, "rows": 64, "k": 512, "us": 1}',
    ]
    totals = lab.step_totals(lab.parse(lines), plan)
    assert len(totals) == 1
    t = totals[0]
    assert t["step_ms"] == pytest.approx((3 * 2.0 + 4.0) / 1000)
    weight_bytes = (3 * 64 + 128) * 512 * 18 // 32
    assert t["tb_s"] == pytest.approx(weight_bytes / 10.0 / 1e6, abs=1e-3)
    assert "warp" in lab.table(totals)


def test_the_lab_compiles_and_refuses_bad_arguments(tmp_path):
    nvcc = shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None
    )
    if nvcc is None:
        pytest.skip("no nvcc on this machine")
    exe = tmp_path / "copy_lab"
    cmd = [
        nvcc,
        "-std=c++17",
        "-O3",
        "-gencode=arch=compute_90a,code=sm_90a",
        str(GPU / "copy_lab.cu"),
        "-o",
        str(exe),
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    for args, msg in (([], "usage"), (["3", "100:512"], "multiple of 64"), (["0", "64:512"], "usage")):
        res = subprocess.run([str(exe), *args], capture_output=True, text=True, check=False)
        assert res.returncode == 2 and msg in res.stderr, (args, res.stderr)


def test_bad_driver_arguments_are_clear_errors(monkeypatch):
    lab = load("copy_lab")
    for argv, msg in (
        (["--json", "x.json", "--repeats", "0"], "--repeats 0"),
        (["--json", "x.json", "--arch", "80"], "--arch '80'"),
        (["--json", "x.json", "--arch", "9x"], "--arch '9x'"),
    ):
        monkeypatch.setattr("sys.argv", ["copy_lab.py", *argv])
        with pytest.raises(SystemExit) as e:
            lab.main()
        assert msg in str(e.value)
