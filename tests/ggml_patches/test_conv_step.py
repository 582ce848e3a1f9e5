"""Patch 0057 (MC_FUSE_CONV_STEP, on by default since run CF): a Gated DeltaNet layer's one-token
convolution step (CONCAT of the conv state and the token, the CPY of the window's last 3 columns back
into the cache's rows, SSM_CONV, SiLU) and the layer's gates in one launch. This machine has no GPU:
the kernel is compiled for both targets (no spills), its statements are checked against the stock
kernels' order (the same bits), and the fusion's guards against the memory it may not share. The GPU
run compares it with the CPU backend (test-backend-ops MC_CONV_STEP) and the logits with it off."""

from __future__ import annotations

import pytest

from tests.ggml_patches.test_cuda_kernels import assert_statements, c_body, kernel_reports


@pytest.mark.parametrize("arch", ["90", "120"])
def test_the_conv_step_compiles_without_spills(patched, arch, tmp_path):
    found = kernel_reports(patched, "ssm-conv.cu", arch, tmp_path, r"_Z12mc_conv_stepILi4EE\w+")
    assert len(found) == 1 and found[0][0] == "0" and int(found[0][1]) <= 64, found


def test_the_conv_step_reads_its_window_before_writing_and_sums_as_stock(patched):
    """Thread c reads its channel's 3 state values and the token before writing the state's 3 updated
    values and its output (so the update may be the rows it read and the output the token's memory,
    element for element); the window itself is not written (its two readers are fused); the sum over
    the taps from tap 0 with the zero bias added, then SiLU: ssm_conv_f32's order at one token."""
    source = (patched / "ggml/src/ggml-cuda/ssm-conv.cu").read_text()
    kernel = c_body(source, "static __global__ void mc_conv_step(")
    read, token = kernel.index("win[j] = st[j];"), kernel.index("win[NC - 1] = x[s * x_nb2 + c * x_nb1];")
    update, out = kernel.index("so[j] = win[j + 1];"), kernel.index("y[s * y_nb2 + c] = ")
    assert kernel.index("ggml_cuda_pdl_sync();") < read < token < update < out
    assert "window_out" not in kernel and "wo[j]" not in kernel
    assert kernel.index("ggml_cuda_pdl_lc();") < kernel.index("ggml_cuda_pdl_sync();")
    assert_statements(
        kernel,
        (
            "sumf += win[j] * wc[j];",
            "sumf += 0.0f;  // ssm_conv_f32's bias term without a bias",
            "y[s * y_nb2 + c] = ggml_cuda_op_silu_single(sumf);",
            "if (mc_conv_gates_part(gates, channels)) {",
        ),
    )
    # the gates' blocks (a helper shared with patch 0063's several-token kernel)
    gates = c_body(source, "static __device__ __forceinline__ bool mc_conv_gates_part(")
    assert "mc_gdn_gate_one(gates.alpha, gates.dt, gates.a, gates.beta_raw, gates.g, gates.beta, i, " in gates
    assert gates.index("ggml_cuda_pdl_sync();") < gates.index("mc_gdn_gate_one(")
    stock = c_body(source, "static __global__ void ssm_conv_f32(")
    assert_statements(
        stock,
        (
            "sumf += x[(i + j) % d_conv] * w[j];",  # at i = 0: x[j] * w[j], j from 0
            "sumf += b;",
            "y_block[i * stride_y + tid] = apply_silu ? ggml_cuda_op_silu_single(sumf) : sumf;",
        ),
    )
    # the gates' formulas shared with mc_gdn_gates (one function, not a copy)
    header = (patched / "ggml/src/ggml-cuda/gated_delta_net.cuh").read_text()
    gate = c_body(header, "static __device__ __forceinline__ void mc_gdn_gate_one(")
    assert "const float sp = x > 20.0f ? x : logf(1.0f + expf(x));" in gate
    assert "beta[i]        = 1.0f / (1.0f + expf(-br));" in gate
    gdn = (patched / "ggml/src/ggml-cuda/gated_delta_net.cu").read_text()
    assert "mc_gdn_gate_one(alpha, dt, a, beta_raw, g, beta, i, heads);" in c_body(
        gdn, "static __global__ void mc_gdn_gates("
    )


def test_the_conv_step_is_fused_only_where_nothing_is_shared(patched):
    """On by default; the state's update in place only element for element (the rows read, the same
    pitch) and the SiLU's output on the token likewise, otherwise apart; the gates join only where their
    inputs and outputs touch nothing the conv step writes or reads."""
    main = (patched / "ggml/src/ggml-cuda/ggml-cuda.cu").read_text()
    fuse = c_body(main, "static int mc_try_conv_step(")
    assert 'ggml_cuda_mc_env_int("MC_FUSE_CONV_STEP", 0, 1, 1) == 1' in fuse
    assert (
        "const bool in_place  = dst->data == state->data && state->nb[1] == (size_t) (nc - 1) * fs && "
        "state->nb[2] == dst->nb[1];"
    ) in fuse
    # the window unwritten: fused only where the tail view and the convolution are its one readers
    assert (
        "if (!ggml_node_has_n_uses(cgraph, i, 2) || tail_i < 0 || "
        "ggml_node_get_use_count(cgraph, tail_i) != 1" in fuse
    )
    # the SiLU's output on the token's memory element for element (what the allocator does in the
    # model: tests/ggml_patches/test_conv_step_graph.py), otherwise apart
    assert (
        "const bool silu_on_x = silu->data == x->data && x->nb[1] == fs && silu->nb[2] == x->nb[2] &&" in fuse
    )  # (and, for several tokens (patch 0063), the same token stride)
    assert "!(silu_on_x || mc_disjoint(silu, x))" in fuse
    assert (
        "if (!(in_place || mc_disjoint(dst, state)) || !mc_disjoint(dst, x) || !mc_disjoint(dst, w)" in fuse
    )
    assert "mc_disjoint(cat" not in fuse and "mc_disjoint(dst, cat)" not in fuse
    # and on the GPU the token's columns stay allocated until the layer's recurrence (an allocation
    # dependency, planned before the buffers), so the SiLU's output never lands across part of them
    deps = c_body(main, "static void mc_conv_step_alloc_deps(")
    assert "params->add_alloc_dep(params->user_data, x, until);" in deps
    assert "if (cgraph->nodes[k]->op == GGML_OP_GATED_DELTA_NET) {" in deps
    optimize = c_body(main, "static void ggml_backend_cuda_graph_optimize(")
    assert "mc_conv_step_alloc_deps(cgraph, params);" in optimize
    assert "apart = apart && mc_disjoint(out, t);" in fuse and "apart = apart && mc_disjoint(in, t);" in fuse
    assert fuse.index("if (apart) {") < fuse.index("last = gl;")
    assert "const int conv = mc_try_conv_step(cuda_ctx, cgraph, i);" in main
    tests = (patched / "tests/test-backend-ops.cpp").read_text()
    assert "new test_mc_conv_step(10240, 3, false));  // rows overlapping, not in place: not fused" in tests
    # the gates right after the SiLU, as in the model, so the fused launch takes them too
    assert "new test_mc_conv_step(10240, 12, true, 48));" in tests
    start = tests.index("struct test_mc_conv_step : public test_case {")
    case = tests[start : tests.index("\n};\n", start)]
    assert "ggml_tensor * g    = ggml_mul(ctx, ggml_softplus(ctx, ggml_add(ctx, alpha, dt)), a);" in case
    assert case.index("ggml_silu(ctx, ggml_ssm_conv(ctx, cat, w))") < case.index("ggml_sigmoid(ctx, braw)")
