"""Patch 0059 (MC_FUSE_ATTN_PRO, on by default since run CG): an attention layer's prologue (q's RMS norm
x weight + M-RoPE, k's with its f16 cache store, v's cache store) in one launch where three ran. This
machine has no GPU: the kernel is compiled for both targets (no spills), its parts are checked to be the
stock fused kernel's row function and k_set_rows' conversion (the same bits), and the fusion's guards
(the chains' order, the buffers each part writes apart from what the others read). The GPU run compares
it with the CPU backend (test-backend-ops MC_ATTN_PRO: q after the rope and both caches) and the logits
with it off, and its notices say whether the model's graph fused."""

from __future__ import annotations

import pytest

from tests.ggml_patches.test_cuda_kernels import c_body, kernel_reports


@pytest.mark.parametrize("arch", ["90", "120"])
def test_the_prologue_compiles_without_spills(patched, arch, tmp_path):
    found = kernel_reports(patched, "rope.cu", arch, tmp_path, r"_Z11mc_attn_proILb[01]E6__half\w+")
    assert len(found) == 2 and all(s == "0" and int(r) <= 64 for s, r in found), found


def test_the_parts_are_the_stock_kernels_statements(patched):
    """q's and k's blocks run the fused norm + rope's row function, the one the stock kernel now calls
    with its block's indices (and the channel count it read from gridDim.y); v's threads convert an
    element as k_set_rows does; one PDL trigger at the start, v's wait before its first read."""
    rope = (patched / "ggml/src/ggml-cuda/rope.cu").read_text()
    stock = c_body(rope, "static __global__ void rms_norm_mul_rope_f32(")
    call = "rms_norm_mul_rope_row<block_size, has_ff, D>(blockIdx.x, blockIdx.y, blockIdx.z, gridDim.y, x, "
    assert call in stock
    row = c_body(rope, "static __device__ __forceinline__ void rms_norm_mul_rope_row(")
    assert "gridDim" not in row and "blockIdx" not in row  # the indices are arguments
    assert "mc_rope_multi_theta_base(pos, channel, nchannels, i0, theta_scale, sections," in row
    kernel = c_body(rope, "static __global__ void mc_attn_pro(")
    assert kernel.index("ggml_cuda_pdl_lc();") < kernel.index("mc_attn_pro_row<has_ff, float>(q, b, mc_wpf);")
    assert kernel.index("mc_attn_pro_row<has_ff, float>(q, b, mc_wpf);") < kernel.index(
        "mc_attn_pro_row<has_ff, DC>(k, b - nq, mc_wpf);"
    )
    store = "((DC *) v.dst)[v.idx[r * v.s10] * v.s1 + c] = ggml_cuda_cast<DC>(v.src[r * v.s01 + c]);"
    assert kernel.index("ggml_cuda_pdl_sync();") < kernel.index(store)
    set_rows = (patched / "ggml/src/ggml-cuda/set-rows.cu").read_text()
    assert "ggml_cuda_cast<dst_t>(src0_row[i00])" in c_body(set_rows, "static __global__ void k_set_rows(")
    helper = c_body(rope, "static __device__ __forceinline__ void mc_attn_pro_row(")
    call = "rms_norm_mul_rope_row<256, has_ff, D>(r % j.nrows, (r / j.nrows) % j.nchannels, "
    assert call + "r / (j.nrows * j.nchannels)," in helper
    # one place computes the fused kernel's arguments, for the stock launch and this one
    assert "mc_norm_rope_job_make(rms_norm, mul, rope, set_rows);" in c_body(
        rope, "void ggml_cuda_op_rms_norm_mul_rope_fused("
    )
    fits = c_body(rope, "bool ggml_cuda_mc_attn_pro_fits(")
    assert "q_rope->ne[0] < 1024 && k_rope->ne[0] < 1024" in fits  # the 256-thread row function
    assert "t == GGML_TYPE_F16" in fits


def test_the_prologue_is_fused_only_where_its_parts_share_nothing(patched):
    """On by default; the q chain as stock's three-node fusion (not its five-node one), then k's
    five-node chain and v's store in either order with nothing but views between; what each part writes
    apart from what the others read and from each other; a notice either way."""
    main = (patched / "ggml/src/ggml-cuda/ggml-cuda.cu").read_text()
    fuse = c_body(main, "static int mc_try_attn_pro(")
    assert 'ggml_cuda_mc_env_int("MC_FUSE_ATTN_PRO", 0, 1, 1) == 1' in fuse
    assert "j    = mc_next_real_node(cgraph, j + 4);" in fuse and "} else {\n            break;" in fuse
    assert "free = free && mc_disjoint(qr, in) && mc_disjoint(vs, in);" in fuse  # k's reads
    assert "free = free && mc_disjoint(qr, in) && mc_disjoint(ks, in);" in fuse  # v's reads
    assert "free = free && mc_disjoint(ks, in) && mc_disjoint(vs, in);" in fuse  # q's reads
    assert "free = free && mc_disjoint(qr, ks) && mc_disjoint(qr, vs) && mc_disjoint(ks, vs);" in fuse
    launch = "ggml_cuda_op_mc_attn_pro(*ctx, qn, qm, qr, kn, km, kr, ks, vs);"
    assert fuse.index("if (!free) {") < fuse.index(launch)
    assert "return std::max(k_at + 4, v_at) - i;" in fuse
    try_fuse = c_body(main, "static int ggml_cuda_try_fuse(")
    assert try_fuse.index("const int pro = mc_try_attn_pro(cuda_ctx, cgraph, i);") < try_fuse.index(
        "ggml_cuda_op_rms_norm_mul_rope_fused(*cuda_ctx, node, cgraph->nodes[i + 1], cgraph->nodes[i + 2], "
        "cgraph->nodes[i + 4]);"
    )
    tests = (patched / "tests/test-backend-ops.cpp").read_text()
    start = tests.index("struct test_mc_attn_pro : public test_case {")
    case = tests[start : tests.index("\n};\n", start)]
    assert "return { q_out, k_out, v_out };" in case  # the three parts' results compared
    assert "GGML_ROPE_TYPE_IMROPE" in case and "ggml_flash_attn_ext(" in case
    for tokens in (1, 4, 12):
        assert f"test_cases.emplace_back(new test_mc_attn_pro({tokens}));" in tests
