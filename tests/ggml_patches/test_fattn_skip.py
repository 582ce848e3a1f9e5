"""Patch 0062 (MC_FATTN_SKIP_MASKED, on by default since run CI: +0.8% at depth 0): llama.cpp pads the
KV cells a step attends over to 256, so one token's attention at a short depth (the vector kernel, patch
0050's rule up to 4,096 cells) computes whole tiles of padding that the mask hides. With the setting each
warp of the vector kernel passes over its 32 cells of a tile when the mask is -inf on all of them.
Everything a warp does in the tile loop is on its own cells, and hidden cells change nothing: their scores
are -inf, the running maximum stays, the rescale is expf(0) = 1 and their weights expf(-inf) = 0. Checked
here: that argument on an emulation of the loop's update in float32 (bit for bit), the kernel's
statements, the launcher's condition, and that the skipping instance compiles for both targets without
spills; the GPU run compares it with the CPU backend (test-backend-ops MC_FATTN_PAD) and the logits with
it off."""

from __future__ import annotations

import numpy as np
import pytest

from tests.ggml_patches.test_cuda_kernels import c_body, kernel_reports

OFFSET = np.float32(3.0 * 0.6931)  # FATTN_KQ_MAX_OFFSET


def _warp_loop(scores: np.ndarray, values: np.ndarray, skip: bool) -> tuple:
    """One warp's part of the vector kernel's tile loop for one column, in float32: per tile its 32 cells'
    scores (mask added, -inf where hidden) and V rows; returns (max, per-lane sums, V accumulator)."""
    kq_max = np.float32(-np.finfo(np.float32).max / 2)
    kq_sum = np.zeros(32, np.float32)
    vkq = np.zeros(values.shape[-1], np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for s, v in zip(scores, values, strict=True):
            if skip and np.all(np.isneginf(s)):
                continue
            new_max = np.float32(max(kq_max, np.max(s + OFFSET)))
            scale = np.float32(np.exp(np.float32(kq_max - new_max)))
            kq_max = new_max
            w = np.exp((s - kq_max).astype(np.float32)).astype(np.float32)
            kq_sum = (kq_sum * scale + w).astype(np.float32)
            vkq = (vkq * scale).astype(np.float32)
            for k in range(32):  # the V rows in the kernel's order
                vkq = (vkq + w[k] * v[k]).astype(np.float32)
    return np.float32(kq_max), kq_sum, vkq


@pytest.mark.parametrize("n_used", [1, 31, 32, 33, 64, 100, 128])
def test_passing_over_hidden_cells_changes_no_bit(n_used):
    rng = np.random.default_rng(n_used)
    tiles, d = 8, 16  # 8 tiles of one warp's 32 cells, V rows of 16 values
    scores = rng.uniform(-4, 4, (tiles, 32)).astype(np.float32)
    mask = np.full((tiles, 32), -np.inf, np.float32)
    mask.reshape(-1)[:n_used] = rng.uniform(-1, 1, n_used)
    values = rng.uniform(-1, 1, (tiles, 32, d)).astype(np.float32)
    masked = scores + mask
    assert sum(np.all(np.isneginf(t)) for t in masked) > 0  # something to pass over
    full = _warp_loop(masked, values, skip=False)
    skipped = _warp_loop(masked, values, skip=True)
    for a, b in zip(full, skipped, strict=True):
        assert np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


def test_the_kernel_passes_over_a_warp_s_cells_only_where_the_mask_hides_them_all(patched):
    vec = (patched / "ggml/src/ggml-cuda/fattn-vec.cuh").read_text()
    kernel = c_body(vec, "static __global__ void flash_attn_ext_vec(")
    assert "bool use_logit_softcap, bool mc_skip = false> // D == head size" in vec
    loop = kernel[kernel.index("for (int k_VKQ_0 = blockIdx.y*nthreads;") :]
    skip = loop[loop.index("if constexpr (mc_skip) {") :]
    # before the tile's scores: the vote decides the whole warp's iteration
    assert loop.index("if constexpr (mc_skip) {") < loop.index("float KQ_reg[ncols];")
    assert "bool live = mask == nullptr;" in skip
    assert "__half_as_ushort(maskh[j*ne11 + tid]) != 0xFC00u" in skip  # -inf in f16, this thread's cell
    assert "(ncols == 1 || ic0 + j < int(ne01.z))" in skip  # columns past the queries do not count
    assert "if (!__any_sync(0xFFFFFFFF, live)) {\n                continue;" in skip
    # a warp's work in the loop is its own 32 cells: the scores' rows and the V rows it reads
    assert "const int i_KQ = threadIdx.y*WARP_SIZE + " in loop
    assert "const int k = threadIdx.y*WARP_SIZE + k0 + " in loop
    body = loop[: loop.index("if (sinks && blockIdx.y == 0) {")]
    assert "__syncthreads()" not in body  # no block barrier in the loop a skipping warp would miss


def test_the_skipping_instance_runs_only_for_one_query_with_a_mask_unless_turned_off(patched):
    vec = (patched / "ggml/src/ggml-cuda/fattn-vec.cuh").read_text()
    case = c_body(vec, "void ggml_cuda_flash_attn_ext_vec_case(")
    one = case[case.index("if (Q->ne[1] == 1) {") : case.index("constexpr int cols_per_block = 2;")]
    assert 'ggml_cuda_mc_env_int("MC_FATTN_SKIP_MASKED", 0, 1, 1) == 1' in one  # default on
    assert "if (mc_skip && dst->src[3] != nullptr) {" in one
    assert "use_logit_softcap, true>(ctx, dst);" in one
    assert one.index("constexpr bool use_logit_softcap = false;") < one.index("mc_skip")
    impl = c_body(vec, "void ggml_cuda_flash_attn_ext_vec_case_impl(")
    assert "flash_attn_ext_vec<D, cols_per_block, type_K, type_V, use_logit_softcap, mc_skip>;" in impl


@pytest.mark.parametrize("arch", ["90", "120"])
def test_the_skipping_instance_compiles_without_spills(patched, arch, tmp_path):
    (tmp_path / "template-instances").mkdir()  # the object file's folder
    reports = kernel_reports(
        patched,
        "template-instances/fattn-vec-instance-f16-f16.cu",
        arch,
        tmp_path,
        r"_Z18flash_attn_ext_vecILi256ELi1EL9ggml_type1ELS0_1ELb0ELb1E\w+",
    )
    assert len(reports) == 1, reports
    spills, registers = reports[0]
    assert spills == "0" and int(registers) <= 255, reports
