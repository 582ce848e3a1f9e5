"""MC_MMV_GROUP's graph step (ggml-cuda/mc-group.h, patch 0003) on a real ggml graph computed on the
CPU: the products of one input move up beside its first one, nothing moves past a node that writes
into the input, and the graph's outputs are bit-identical before and after. The CUDA side (one
launch for the moved products) is checked on a GPU by test-backend-ops' MC_MUL_MAT_GROUP cases and
the 27B's logits in bench/gpu/side_by_side.sh."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import llama_cpp
import pytest

HARNESS = Path(__file__).parent / "mc_group_harness.cpp"


@pytest.fixture(scope="module")
def harness(patched, tmp_path_factory) -> Path:
    cxx = shutil.which("g++")
    assert cxx, "g++ is needed (the project's own llama.cpp build needs it too)"
    lib = Path(llama_cpp.__file__).parent / "lib"  # this venv's ggml, built from the same pinned tree
    exe = tmp_path_factory.mktemp("h") / "harness"
    inc = [f"-I{patched / 'ggml' / d}" for d in ("include", "src", "src/ggml-cuda")]
    cmd = [
        cxx, "-std=c++17", "-O1", *inc, str(HARNESS),
        f"-L{lib}", "-lggml-cpu", "-lggml-base", f"-Wl,-rpath,{lib}", "-o", str(exe),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return exe


def run(harness: Path, ncols: int) -> dict[str, str]:
    out = subprocess.run([str(harness), str(ncols)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return dict(line.split(": ", 1) for line in out.stdout.splitlines())


def test_an_inputs_products_move_beside_its_first_one(harness):
    r = run(harness, 2)
    before, after = r["before"].split(), r["after"].split()
    assert sorted(before) == sorted(after)  # the same nodes
    # the Gated DeltaNet-like input: qkv, alpha, beta side by side; the f32 product is not a candidate
    i = after.index("qkv")
    assert after[i : i + 3] == ["qkv", "alpha", "beta"]
    assert after.index("f32_product") > i + 3
    # the product after the in-place write to its input stays after it
    assert after.index("late") > after.index("X_scaled") > after.index("beta")
    # attention-like: q, v, k side by side, their consumers after them in their order
    j = after.index("q")
    assert after[j : j + 3] == ["q", "v", "k"]
    assert after.index("q_norm") < after.index("v_scaled") < after.index("k_norm")
    assert int(r["moved"]) == 4  # alpha, beta, v, k
    assert r["outputs"] == "8 differ: 0"


def test_more_columns_than_the_kernels_take_move_nothing(harness):
    r = run(harness, 20)
    assert r["before"] == r["after"]
    assert r["moved"] == "0"
    assert r["outputs"] == "8 differ: 0"
