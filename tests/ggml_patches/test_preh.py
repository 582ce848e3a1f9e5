"""Patch 0065 (MC_PREH, default 1 since run CL: the same logits bytes, the 16-token step -0.35 ms): the
kernels that compute a product's input at 2..16 columns (the fused residual add + RMS norm, the Gated
DeltaNet's gated norm, the attention's sigmoid gate, the FFN's SwiGLU) write it in the f16 fragment order
that the repacked copies' kernel reads, so mc_mmr_run skips mc_mmr_convert_y's launch (256 a 16-token step
of the 27B, 3.6 us each in run CK's trace on an H100). Checked here: that the producer's index puts every
value where the conversion puts it, with the same rounding and the same zero padding (an emulation of
both, their statements held against the source); the record's wiring (written after the PDL wait,
committed by the producers, taken by the product only where it matches, cleared around each graph); the
kernels compile for both targets without spills (test_cuda_kernels.py's unary.cu check); and, on the tiny
qwen35's real 16-token graph, that each norm's output reaches its products as the plan's scan needs. On a
GPU: test-backend-ops MC_NORM_MUL_MAT / MC_GATE_MUL_MAT / MC_GLU_MUL_MAT with MC_PREH=1 MC_MMH_REPACK=2,
and the logits against the copies alone (the same bytes expected)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.ggml_patches.test_conv_step_graph import _decode_step_nodes, _op_names
from tests.ggml_patches.test_cuda_kernels import assert_statements, c_body

QK = 32


def conversion_layout(x: np.ndarray, ncp: int) -> np.ndarray:
    """mc_mmr_convert_y_at: thread i = (block b, column c of ncp, t) writes 8 halves at i * 8: the
    block's values 4 t, 4 t + 2, 4 t + 1, 4 t + 3, then the same + 16; zeros for columns past ncols."""
    ncols, k = x.shape
    y = np.zeros(k // QK * ncp * 4 * 8, dtype=np.float16)
    for i in range(k // QK * ncp * 4):
        t, c, b = i % 4, i // 4 % ncp, i // (4 * ncp)
        if c < ncols:
            base = b * QK + 4 * t
            f = [x[c, base + o] for o in (0, 2, 1, 3, 16, 18, 17, 19)]
            y[i * 8 : i * 8 + 8] = np.array(f, dtype=np.float32).astype(np.float16)
    return y


def preh_index(e: int, c: int, ncp: int) -> int:
    """mc_preh_index (mc-preq.cuh)."""
    j = e % QK
    q = j % 4
    return ((e // QK * ncp + c) * 4 + (j % 16) // 4) * 8 + (j // 16) * 4 + (q & 1) * 2 + (q >> 1)


def producer_layout(x: np.ndarray, ncp: int, k: int) -> np.ndarray:
    """mc_preh_store for every flat index f of the producer's output (any order: each index once):
    column f / k, element f % k; column 0's writer adds the padding columns' zeros. Starts from NaNs,
    so a place nobody writes shows."""
    ncols = x.shape[0]
    y = np.full(k // QK * ncp * 4 * 8, np.nan, dtype=np.float16)
    flat = x.reshape(-1)
    for f in np.random.default_rng(0).permutation(flat.size):
        c, e = int(f) // k, int(f) % k
        y[preh_index(e, c, ncp)] = np.float16(flat[f])  # __float2half_rn: round to nearest even
        if c == 0:
            for p in range(ncols, ncp):
                y[preh_index(e, p, ncp)] = np.float16(0.0)
    return y


@pytest.mark.parametrize("ncols,k", [(4, 512), (5, 1024), (8, 512), (9, 5120), (12, 6144), (16, 5120)])
def test_the_producer_puts_every_value_where_the_conversion_does(ncols, k):
    rng = np.random.default_rng(ncols * 1000 + k)
    x = (rng.standard_normal((ncols, k)) * 3).astype(np.float32)
    ncp = 8 if ncols <= 8 else 16  # mc_mmr_run's padding
    want = conversion_layout(x, ncp)
    got = producer_layout(x, ncp, k)
    assert not np.isnan(got).any()
    assert got.tobytes() == want.tobytes()


def test_the_emulations_transcribe_the_source(patched):
    cuda = patched / "ggml/src/ggml-cuda"
    mmv = (cuda / "mc-mmv.cu").read_text()
    convert = c_body(mmv, "static __device__ __forceinline__ void mc_mmr_convert_y_at(")
    assert_statements(
        convert,
        (
            "const int t = i % 4;",
            "const int c = i / 4 % ncp;",
            "const int b = i / (4 * ncp);",
            "uint4 v = make_uint4(0, 0, 0, 0);",
            "float         f[8] = { xb[0], xb[2], xb[1], xb[3], xb[16], xb[18], xb[17], xb[19] };",
            "h[0] = __floats2half2_rn(f[0], f[1]);",
            "*(uint4 *) (y + (int64_t) i * 8) = v;",
        ),
    )
    assert "const int ncp     = ncols <= 8 ? 8 : 16;" in c_body(mmv, "static bool mc_mmr_run(")
    preq = (cuda / "mc-preq.cuh").read_text()
    index = c_body(preq, "static __device__ __forceinline__ int mc_preh_index(")
    assert (
        "return ((e / QK4_0 * ncp + c) * 4 + (j % 16) / 4) * 8 + (j / 16) * 4 + (q & 1) * 2 + (q >> 1);"
        in index
    )
    store = c_body(preq, "static __device__ __forceinline__ void mc_preh_store(")
    assert_statements(
        store,
        (
            "const int c = f / ph.k;",
            "const int e = f - c * ph.k;",
            "ph.y[mc_preh_index(e, c, ph.ncp)] = __float2half_rn(v);",
            "for (int p = ph.ncols; p < ph.ncp; ++p) {",
            "ph.y[mc_preh_index(e, p, ph.ncp)] = __float2half_rn(0.0f);",
        ),
    )
    assert "#define MC_PREH_DEFAULT 1" in preq  # on since run CL (bench/NOTES.md, 47th session)


def test_the_producers_write_after_their_wait_and_the_product_takes_only_a_match(patched):
    cuda = patched / "ggml/src/ggml-cuda"
    norm = c_body((cuda / "norm.cu").read_text(), "static __global__ void mc_add_rms_norm_mul_f32(")
    gated = c_body((cuda / "unary.cu").read_text(), "static __global__ void mc_gated_norm_f32(")
    unary = (cuda / "unary.cu").read_text()
    glu = c_body(unary, "static __global__ void unary_gated_op_kernel(")
    for kernel, store, out in (
        (norm, "mc_preh_store(ph, (int) (row * ncols + col), v);", "dst[col]"),
        (gated, "mc_preh_store(ph, row * ncols + col, v);", "dst[col]"),
        (glu, "mc_preh_store(ph, (int) i, v);", "dst[i] = ggml_cuda_cast<T>(v);"),  # the gates and the SwiGLU
    ):
        # the buffer's previous readers have ended once the wait returns: one buffer is enough
        assert kernel.index("ggml_cuda_pdl_sync();") < kernel.index(store)
        assert kernel.index(out) < kernel.index(store)  # the value the f32 output holds
    main = (cuda / "ggml-cuda.cu").read_text()
    plan = c_body(main, "mc_preh_plan_t ggml_cuda_mc_preh_plan(")
    assert 'ggml_cuda_mc_env_int("MC_PREH", 0, 1, MC_PREH_DEFAULT)' in plan
    assert_statements(
        plan,
        (
            "const int     j    = mc_scan_readers(cgraph, i_last, out, [&](const ggml_tensor * nd) {",
            "ggml_nelements(y) != n || !ggml_is_contiguous(y) || y->ne[2] != 1 || y->ne[3] != 1 ||",
            "!ggml_cuda_mc_mmr_reads_f16(ctx, nd)) {",
            "plan.out.ncp   = cols <= 8 ? 8 : 16;  // mc_mmr_run's padding",
            "plan.until     = j;",
        ),
    )
    take = c_body(main, "const half * ggml_cuda_mc_preh_take(")
    assert_statements(
        take,
        (
            "ctx.mc_preh_data == nullptr || src1->data != ctx.mc_preh_data || ctx.mc_node < 0 ||",
            "ctx.mc_node >= ctx.mc_preh_until || ctx.curr_stream_no != 0 || src1->type != GGML_TYPE_F32 ||",
            "src1->ne[0] != ctx.mc_preh_k || src1->ne[1] != ctx.mc_preh_cols || src1->ne[2] != 1 || ",
        ),
    )
    # both producers always launch with the form they were given, then commit it (a no-op without one)
    assert_statements(
        main,
        (
            "probe != 2, pq.q8, split, ph.out)) {",
            "ggml_cuda_mc_preh_commit(*ctx, mul, ph);",
            "out, mc_pq.q8,\n                                    mc_ph.out)) {",
            "ggml_cuda_mc_preh_commit(*cuda_ctx, out, mc_ph);",
            "mc_pq.q8, mc_ph.out)) {  // MC_PREQ as the UNARY + MUL",  # the strided gate (patch 0060)
            "ggml_cuda_mc_preh_commit(*ctx, mul, mc_ph);",
            "cgraph->nodes[i + 1], mc_pq.q8, mc_ph.out)) {  // MegaCapybara: MC_PREQ",  # UNARY + MUL
            "ggml_cuda_mc_preh_commit(*cuda_ctx, cgraph->nodes[i + 1], mc_ph);",
            "cuda_ctx->mc_preh_data = nullptr;          // MegaCapybara: MC_PREH, nothing in f16 yet",
            "cuda_ctx->mc_preh_data = nullptr;  // MegaCapybara: MC_PREH",
            "CUDA_CHECK(cudaFree(mc_preh_buf));",
        ),
    )
    # the SwiGLU (a node of its own at 2..16 columns): computed with the form where its products read it
    swiglu = c_body(main, "static bool ggml_cuda_mc_preh_swiglu(")
    assert_statements(
        swiglu,
        (
            "ggml_get_glu_op(glu) != GGML_GLU_OP_SWIGLU || glu->type != GGML_TYPE_F32",
            "if (plan.out.y == nullptr) {",
            "ggml_cuda_op_swiglu(ctx, glu, plan.out);",
            "ggml_cuda_mc_preh_commit(ctx, glu, plan);",
        ),
    )
    loop = main[main.index("const int mc_glu = ggml_cuda_mc_glu_mmr(*cuda_ctx, cgraph, i);") :]
    at = loop.index("if (!is_concurrent_event_active && ggml_cuda_mc_preh_swiglu(*cuda_ctx, cgraph, i)) {")
    assert at < loop.index("bool ok = ggml_cuda_compute_forward(*cuda_ctx, node);")
    assert "nullptr, ph);  // MegaCapybara: MC_PREH (ph.y set only for f32)" in unary
    # the product: the form in place of the conversion, never for the GLU's (its values are computed there)
    run = c_body((cuda / "mc-mmv.cu").read_text(), "static bool mc_mmr_run(")
    take_at = run.index("const half * y = glu ? nullptr : ggml_cuda_mc_preh_take(ctx, src1);")
    assert take_at < run.index("if (y == nullptr) {") < run.index("ggml_cuda_kernel_launch(mc_mmr_convert_y,")
    tests = (patched / "tests/test-backend-ops.cpp").read_text()
    assert "new test_mc_norm_mul_mat(GGML_TYPE_Q4_0, true, 5120, n));" in tests
    assert "new test_mc_gate_mul_mat(GGML_TYPE_Q4_0, true, 128, 48, 16, 5120, false, true));" in tests
    assert "new test_mc_gate_mul_mat(GGML_TYPE_Q4_0, false, 256, 24, 16, 5120));" in tests


def test_the_model_s_norms_reach_their_16_column_products_within_the_scan(tiny_qwen35_path):
    """The plan follows a producer's output through the next 64 nodes to the products that read it whole
    as (K, 16), stopping at a node that writes over it: on the real verify-shaped graph, every product whose
    input a MUL (the norms x their weights, the gated norm, the attention's gate) or the FFN's SwiGLU
    computed reads that output's own data, contiguous, within the window, with no write over it between."""
    names = _op_names()
    nodes = _decode_step_nodes(tiny_qwen35_path, 16)
    by_ptr = {n["ptr"]: n for n in nodes}
    noop = {"RESHAPE", "TRANSPOSE", "VIEW", "PERMUTE", "NONE"}

    def base(ptr: int) -> dict:  # the node that computed a view's memory (ggml keeps the root in view_src)
        n = by_ptr[ptr]
        return by_ptr.get(n["view_src"], n) if n["view_src"] else n

    def overlaps(a: dict, b: dict) -> bool:
        return a["data"] < b["data"] + b["bytes"] and b["data"] < a["data"] + a["bytes"]

    index = {n["ptr"]: i for i, n in enumerate(nodes)}
    fed: dict[str, int] = {}
    for i, mm in enumerate(nodes):
        if names[mm["op"]] != "MUL_MAT" or len(mm["src"]) < 2:
            continue
        y = by_ptr.get(mm["src"][1])
        if y is None or y["ne"][1] != 16:
            continue
        prod = base(y["ptr"])
        if names[prod["op"]] not in ("MUL", "GLU") or prod["ptr"] not in index:
            continue
        p = index[prod["ptr"]]
        # what the plan's scan and the take ask for
        assert y["data"] == prod["data"] and y["ne"][0] * y["ne"][1] == np.prod(prod["ne"]), mm["name"]
        assert y["nb"][0] == 4 and y["nb"][1] == 4 * y["ne"][0] and y["ne"][2] == y["ne"][3] == 1
        assert i - p <= 64, (mm["name"], i - p)
        for between in nodes[p + 1 : i]:
            if names[between["op"]] in noop or between["empty"]:
                continue
            assert not overlaps(between, prod), (between["name"], prod["name"])
        fed[names[prod["op"]]] = fed.get(names[prod["op"]], 0) + 1
    # the norms, the gated norm and the attention's gate (MUL), the FFN's SwiGLU (GLU): each layer has both
    layers = sum(1 for n in nodes if names[n["op"]] == "GLU")
    assert layers >= 2 and fed.get("GLU") == layers, fed
    assert fed.get("MUL", 0) >= 3 * layers, fed
