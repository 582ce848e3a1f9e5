"""Patch 0060 (MC_FUSE_GATE_CONT, on by default since run CG): qwen35's attention gate is every other 256
values of the joint q + gate projection, made contiguous by a CONT (a launch, 0.83 us in run CC's trace)
before the fused sigmoid x attention (the UNARY + MUL kernel, which with MC_PREQ writes the output
projection's q8_1 blocks). The fused kernel already takes a row pitch for its unary operand, so it reads
the view's rows in place: one launch where two ran, the same values in the same order (the same bits).
Checked here: the call's pitches, the guards (the CONT's one reader, the layouts, the product apart from
the gate's rows) and the allocation dependency that keeps the projection alive until the product; the
GPU run compares it with the CPU backend (test-backend-ops MC_GATE_CONT) and the logits with it off."""

from __future__ import annotations

from tests.ggml_patches.test_cuda_kernels import c_body


def test_the_fused_kernel_reads_the_view_s_rows_at_their_pitch(patched):
    unary = (patched / "ggml/src/ggml-cuda/unary.cu").read_text()
    impl = c_body(unary, "static bool mc_gate_cont_impl(")
    assert (
        "unary_gated_cuda<op>((const float *) x->data, (const float *) other->data, "
        "(float *) mul_node->data, k, x->ne[0]," in impl
    )
    assert "(int64_t) (x->nb[1] / sizeof(float)), x->ne[0], ctx.stream(), q8, ph);" in impl
    # the kernel: element i of row i / n at row * o0 (the unary operand) and row * o1 (the other factor)
    kernel = c_body(unary, "static __global__ void unary_gated_op_kernel(")
    assert "const int64_t j0 = (i / n) * o0 + (i % n);" in kernel
    assert "const float v = op(ggml_cuda_cast<float>(x[j0])) * ggml_cuda_cast<float>(g[j1]);" in kernel
    fits = c_body(unary, "bool ggml_cuda_mc_gate_cont_fits(")
    # rows at one pitch across all dimensions, so row r sits at r * o0
    assert "x->nb[2] == x->ne[1] * x->nb[1] && x->nb[3] == x->ne[2] * x->nb[2]" in fits
    assert "ggml_is_contiguous(other)" in fits and "ggml_is_contiguous(mul_node)" in fits


def test_the_gate_is_fused_only_where_the_cont_has_one_reader_and_nothing_overlaps(patched):
    main = (patched / "ggml/src/ggml-cuda/ggml-cuda.cu").read_text()
    fuse = c_body(main, "static int mc_try_gate_cont(")
    assert 'ggml_cuda_mc_env_int("MC_FUSE_GATE_CONT", 0, 1, 1) == 1' in fuse
    assert "!ggml_node_has_n_uses(cgraph, i, 1)" in fuse
    assert "const bool free = mc_disjoint(mul, x) && mc_same_or_disjoint(mul, other);" in fuse
    assert fuse.index("if (!free) {") < fuse.index("ggml_cuda_mc_gate_cont(*ctx, x, other, mul,")
    assert "ggml_cuda_mc_preq_commit(*ctx, mul, mc_pq);" in fuse
    nodes = c_body(main, "static bool mc_gate_cont_nodes(")
    assert "cont->op != GGML_OP_CONT || un->op != GGML_OP_UNARY || un->src[0] != cont" in nodes
    deps = c_body(main, "static void mc_gate_cont_alloc_deps(")
    assert "params->add_alloc_dep(params->user_data, x, cgraph->nodes[i + 2]);" in deps
    assert "mc_gate_cont_alloc_deps(cgraph, params);" in c_body(
        main, "static void ggml_backend_cuda_graph_optimize("
    )
    try_fuse = c_body(main, "static int ggml_cuda_try_fuse(")
    assert try_fuse.index("const int gate = mc_try_gate_cont(cuda_ctx, cgraph, i);") < try_fuse.index(
        "ggml_cuda_op_unary_mul(*cuda_ctx, node, cgraph->nodes[i + 1], mc_pq.q8, mc_ph.out)"
    )
    tests = (patched / "tests/test-backend-ops.cpp").read_text()
    for case in ("(1)", "(4)", "(12)", "(3, GGML_UNARY_OP_SILU)"):
        assert f"test_cases.emplace_back(new test_mc_gate_cont{case});" in tests
