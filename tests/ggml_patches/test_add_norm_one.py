"""Patch 0069 (mc-add-norm-one): patch 0061's split residual add + RMS norm x weight (8 blocks a row, each
writing an eighth of the row and of the next product's q8_1 blocks) is off by default. At one row (a
decode step) it made the FFN's gate + up product after it start later: runs CX / CY on an H100, series
3f955902, the 64-token trace's span -98.2 us without it (all at that product; the one-block form and a
quantize launch cost about what the split launch did), decode +2.9 tok/s at depth 0 paired (12 of 12
rounds), +4.5 at 4k, +2.3 at 32k, verify1 -0.11 ms. And a second switch, MC_ADD_NORM_PREQ (default 0,
not yet measured on a GPU): the one-block form writes its product's q8_1 blocks at MC_PREQ=3 too, as it
does at MC_PREQ=2, in place of that quantize launch. The GPU check is test-backend-ops MC_NORM_MUL_MAT
(the add + norm into a product reading its blocks) and MC_ADD_RMS_NORM_MUL under the setting, and the
logits (the same quantize statements on the same values: the same bytes)."""

from __future__ import annotations

from tests.ggml_patches.test_cuda_kernels import c_body


def test_the_split_is_off_by_default_and_still_a_setting(patched):
    main = (patched / "ggml/src/ggml-cuda/ggml-cuda.cu").read_text()
    setting = c_body(main, "static bool mc_add_norm_split_on(")
    assert "static const bool on" in setting  # read once
    assert 'ggml_cuda_mc_env_int("MC_ADD_NORM_SPLIT", 0, 1, 0) == 1' in setting
    # the allocation dependency follows the setting: off by default, so inputs are freed as before
    deps = c_body(main, "static void mc_add_norm_alloc_deps(")
    assert "mc_add_norm_split_on() && i + 2 < cgraph->n_nodes" in deps


def test_the_one_block_form_writes_the_blocks_at_level_3_only_with_its_setting(patched):
    main = (patched / "ggml/src/ggml-cuda/ggml-cuda.cu").read_text()
    setting = c_body(main, "static bool mc_add_norm_preq_on(")
    assert "static const bool on" in setting
    assert 'ggml_cuda_mc_env_int("MC_ADD_NORM_PREQ", 0, 1, 0) == 1' in setting
    fuse = c_body(main, "static int mc_try_add_rms_norm(")
    plan = fuse.index("const int pq_max = split || mc_add_norm_preq_on() ? 3 : 2;")
    take = fuse.index("ggml_cuda_mc_preq_plan(*ctx, cgraph, i + 2, mul, 2, pq_max);")
    launch = fuse.index("ggml_cuda_mc_add_rms_norm_mul(*ctx, add, norm, mul, probe != 2, pq.q8, split, ")
    assert plan < take < launch
    # the product takes the blocks only where the kernel wrote them (the launch returns whether it did)
    assert "ggml_cuda_mc_preq_commit(*ctx, mul, pq);" in fuse[launch:]
    # the level-3 plan's own split (patch 0055's 8 for the plain norm) is not the add + norm's: its launch
    # takes only the blocks' address and its own split flag
    norm = (patched / "ggml/src/ggml-cuda/norm.cu").read_text()
    host = c_body(norm, "bool ggml_cuda_mc_add_rms_norm_mul(")
    assert "ggml_nrows(add) * (split ? MC_NORM_SPLIT : 1)" in host
    assert "q8 = ncols % QK8_1 == 0 ? q8 : nullptr;" in host
    assert "return q8 != nullptr;" in host


def test_the_one_block_kernel_stores_the_blocks_for_every_column(patched):
    norm = (patched / "ggml/src/ggml-cuda/norm.cu").read_text()
    kernel = c_body(norm, "static __global__ void mc_add_rms_norm_mul_f32(")
    guard = kernel.index("if (col < ncols && (split == 1 || col / (ncols / split) == part)) {")
    store = kernel.index("mc_preq_store(q8, row * ncols + col, v);")
    assert guard < store  # at split == 1 every column of the row passes the guard
    assert "if (q8 != nullptr) {" in kernel[guard:store]
