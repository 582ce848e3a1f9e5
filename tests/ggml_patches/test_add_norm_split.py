"""Patch 0061 (MC_ADD_NORM_SPLIT; on by default from run CG, off since patch 0069): the residual add + RMS
norm x weight (64 a step of the 27B: after each layer's output projection and after each FFN) runs on one
block a row, 5.14 us in run CC's trace after the GDN output projection, and does not write the next
product's q8_1 blocks (patch 0055 spread the plain norm's over 8 blocks a row, +0.8 to +1.1%; the add +
norm stayed one block because it may write its sum over its input). With the setting 8 blocks a row each
compute the whole row's sum and squares as the one block does (the same bits) and write an eighth of the
sum, the output and its q8_1 blocks; no output may then alias an input, which an allocation dependency
ensures and the fusion's guard checks. The GPU run compares test-backend-ops MC_ADD_RMS_NORM_MUL and
MC_NORM_MUL_MAT (the add, the norm and the product reading its blocks) under it, and the logits."""

from __future__ import annotations

from tests.ggml_patches.test_cuda_kernels import c_body


def test_each_block_sums_the_whole_row_and_writes_its_eighth(patched):
    norm = (patched / "ggml/src/ggml-cuda/norm.cu").read_text()
    kernel = c_body(norm, "static __global__ void mc_add_rms_norm_mul_f32(")
    assert "const int64_t row  = blockIdx.x / split;" in kernel
    # every block: the whole row's sum and squares, in the one block's order
    read = kernel.index("xv[k] = a[col] + b[col];")
    assert kernel.index("tmp += xv[k] * xv[k];") > read
    # each block stores its eighth of the sum (both of patch 0068's forms: the reads first or interleaved)
    eighth = "if (split == 1 || col / (ncols / split) == part) {\n                    sum[col] = xv[k];"
    assert kernel.count(eighth) == 2
    assert "if (col < ncols && (split == 1 || col / (ncols / split) == part)) {" in kernel
    reduce = kernel.index("tmp = block_reduce<block_reduce_method::SUM, block_size>(tmp, s_sum);")
    assert reduce < kernel.index("dst[col]      = v;")
    fits = c_body(norm, "bool ggml_cuda_mc_add_norm_split_fits(")
    assert "add->ne[0] % (QK8_1 * MC_NORM_SPLIT) == 0" in fits  # an eighth of a row: whole warps
    host = c_body(norm, "bool ggml_cuda_mc_add_rms_norm_mul(")
    assert "split           ? mc_add_rms_norm_mul_f32<1024, true, MC_NORM_SPLIT> :" in host
    assert "ggml_nrows(add) * (split ? MC_NORM_SPLIT : 1)" in host


def test_the_split_is_taken_only_where_no_output_is_an_input(patched):
    main = (patched / "ggml/src/ggml-cuda/ggml-cuda.cu").read_text()
    setting = c_body(main, "static bool mc_add_norm_split_on(")
    assert 'ggml_cuda_mc_env_int("MC_ADD_NORM_SPLIT", 0, 1, 0) == 1' in setting  # patch 0069: default 0
    fuse = c_body(main, "static int mc_try_add_rms_norm(")
    split = fuse[fuse.index("const bool split =") : fuse.index("if (probe != 1) {")]
    apart = ("mc_disjoint(add, x0)", "mc_disjoint(add, x1)", "mc_disjoint(mul, x0)", "mc_disjoint(mul, x1);")
    assert all(term in split for term in apart)
    # the product's blocks at MC_PREQ=3 when split (the one-block form writes them at 2 alone, or at 3 too
    # with patch 0069's MC_ADD_NORM_PREQ)
    assert "const int pq_max = split || mc_add_norm_preq_on() ? 3 : 2;" in fuse
    assert "ggml_cuda_mc_preq_plan(*ctx, cgraph, i + 2, mul, 2, pq_max);" in fuse
    deps = c_body(main, "static void mc_add_norm_alloc_deps(")
    assert "params->add_alloc_dep(params->user_data, x, mul);" in deps
    optimize = c_body(main, "static void ggml_backend_cuda_graph_optimize(")
    assert "mc_add_norm_alloc_deps(cgraph, params);" in optimize


def test_patch_0066_limits_the_split_to_a_number_of_rows(patched):
    """Patch 0066 (MC_ADD_NORM_SPLIT_ROWS, default 1: decode only): the split form only up to that many rows,
    so that a verify step's 16 rows run one block a row (16 blocks of 1,024 threads instead of 128) while
    one-token decode keeps its split (runs CM / CN: the 16-token step -0.11 ms, the same logits bytes); the
    split itself is off by default since patch 0069."""
    main = (patched / "ggml/src/ggml-cuda/ggml-cuda.cu").read_text()
    fuse = c_body(main, "static int mc_try_add_rms_norm(")
    assert 'ggml_cuda_mc_env_int("MC_ADD_NORM_SPLIT_ROWS", 1, 65536, 1)' in fuse
    split = fuse[fuse.index("const bool split =") : fuse.index("if (probe != 1) {")]
    assert "ggml_nrows(add) <= split_rows &&" in split
    # the allocation dependency stays for every row count: a one-block form with it only keeps inputs longer
    deps = c_body(main, "static void mc_add_norm_alloc_deps(")
    assert "split_rows" not in deps
