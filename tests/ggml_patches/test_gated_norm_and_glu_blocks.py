"""Patches 0053 (MC_GATED_NORM: the Gated DeltaNet's gated RMS norm in one launch), 0054
(MC_PREQ_GLU: the FFN's gated product writes ffn_down's q8_1 blocks) and 0055 (MC_PREQ=3: the RMS
norms write their product's q8_1 blocks from 8 blocks a row) and 0056 (MC_GDN_ONE: a decode step's
Gated DeltaNet recurrence on 4 columns a warp). This machine has no GPU: the
kernels are compiled here (both targets, no spills), their statements checked against the source, and
the two pieces of logic a wrong line would break silently are emulated: 0053's sum of squares in the
order of the two stock kernels it replaces (so the output is their bits), 0054's runs of pieces and
their blocks (every block quantized once, by the CTA that completes it). The GPU run compares the
kernels themselves with the CPU backend (test-backend-ops MC_GATE_MUL_MAT, MC_FFN)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.ggml_patches.test_cuda_kernels import assert_statements, c_body

WARP = 32
QK = 32  # values a q8_1 block


# ---- patch 0053: the gated norm ----


def butterfly(lanes: np.ndarray) -> np.ndarray:
    """warp_reduce_sum on float32 lanes: x += shfl_xor(x, off) for off = 16, 8, 4, 2, 1."""
    x = lanes.astype(np.float32).copy()
    for off in (16, 8, 4, 2, 1):
        x = (x + x[np.arange(WARP) ^ off]).astype(np.float32)
    return x


def stock_sum_of_squares(row: np.ndarray) -> np.float32:
    """rms_norm_f32<256> (cached form) on one row of at most 256 values: thread c squares column c,
    each warp's butterfly, block_reduce's second butterfly over the 8 warps' sums (lane 0's value)."""
    sq = np.zeros(256, np.float32)
    sq[: row.size] = (row.astype(np.float32) * row.astype(np.float32)).astype(np.float32)
    sums = np.array([butterfly(sq[WARP * w : WARP * (w + 1)])[0] for w in range(8)], np.float32)
    second = np.zeros(WARP, np.float32)
    second[:8] = sums
    return butterfly(second)[0]


def kernel_sum_of_squares(row: np.ndarray, nk: int) -> np.float32:
    """mc_gated_norm_f32<NK>: lane l holds columns 32 k + l; one butterfly a k; the second butterfly
    emulated on g[8] for offsets 4, 2, 1 (h[k] = g[k] + g[k ^ off])."""
    g = np.zeros(8, np.float32)
    for k in range(nk):
        col = np.zeros(WARP, np.float32)
        part = row[WARP * k : WARP * (k + 1)].astype(np.float32)
        col[: part.size] = part
        g[k] = butterfly((col * col).astype(np.float32))[0]
    for off in (4, 2, 1):
        g = (g + g[np.arange(8) ^ off]).astype(np.float32)
    return g[0]


@pytest.mark.parametrize("ncols", [32, 64, 96, 128, 256])
def test_the_gated_norms_sum_of_squares_is_the_stock_kernels_bits(ncols):
    rng = np.random.default_rng(ncols)
    nk = 4 if ncols <= 128 else 8
    for _ in range(200):
        row = (rng.standard_normal(ncols) * rng.uniform(0.01, 100.0)).astype(np.float32)
        assert kernel_sum_of_squares(row, nk).tobytes() == stock_sum_of_squares(row).tobytes()


def test_the_gated_norm_kernel_transcribes_the_two_stock_kernels(patched):
    cuda = patched / "ggml/src/ggml-cuda"
    unary = (cuda / "unary.cu").read_text()
    kernel = c_body(unary, "static __global__ void mc_gated_norm_f32(")
    assert_statements(
        kernel,
        (
            "t += xv[k] * xv[k];  // as rms_norm_f32's thread 32 k + lane",
            "t = warp_reduce_sum(t);",
            "for (int off = 4; off > 0; off >>= 1) {",
            "h[k] = g[k] + g[k ^ off];",
            "const float mean  = g[0] / ncols;",
            "const float scale = rsqrtf(mean + eps);",
            "const float normed = scale * xv[k] * wv[k];",
            "const float v      = op_silu(zv[k]) * normed;",
            "mc_preq_store(q8, (int64_t) row * ncols + col, v);",
        ),
    )
    # the stock statements it follows: the cached norm's and the gated unary's
    norm = c_body((cuda / "norm.cu").read_text(), "static __global__ void rms_norm_f32(")
    assert "tmp += xv[k] * xv[k];" in norm and "const float v = scale * xv[k] * mv[k];" in norm
    assert "const float mean = tmp / ncols;" in norm and "const float scale = rsqrtf(mean + eps);" in norm
    gated = c_body(unary, "static __global__ void unary_gated_op_kernel(")
    assert "const float v = op(ggml_cuda_cast<float>(x[j0])) * ggml_cuda_cast<float>(g[j1]);" in gated
    # the weight before the PDL wait, x and z after it
    wait = kernel.index("ggml_cuda_pdl_sync();")
    assert kernel.index("wv[k]         = col < ncols ? w[col] : 0.0f;") < wait
    assert wait < kernel.index("xv[k]         = col < ncols ? x[col] : 0.0f;")
    fits = c_body(unary, "bool ggml_cuda_mc_gated_norm_fits(")
    assert "rms_norm->ne[0] % WARP_SIZE == 0 && rms_norm->ne[0] <= 8 * WARP_SIZE" in fits


def test_the_gated_norm_fusion_matches_the_models_graph(patched):
    """The four nodes may have views between them (qwen35's reshape of z lies between the weight's
    MUL and the SiLU), the intermediates must be read only inside, and the output may overlay an
    input only row for row; MC_GATED_NORM=0 turns it off; the fused launch returns the last node."""
    main = (patched / "ggml/src/ggml-cuda/ggml-cuda.cu").read_text()
    match = c_body(main, "static bool ggml_cuda_mc_gated_norm_match(")
    assert_statements(
        match,
        (
            'ggml_cuda_mc_env_int("MC_GATED_NORM", 0, 1, 1) == 1',
            "while (j < cgraph->n_nodes && ggml_cuda_is_view_or_noop(cgraph->nodes[j])) {",
            "ggml_get_unary_op(un) != GGML_UNARY_OP_SILU",
            "if (!ggml_can_fuse_subgraph_ext(cgraph, idx, 4, ops, outs, 1)) {",
            "(mw->src[0] == rn) == (mw->src[1] == rn)",
            "w->ne[0] != x->ne[0] || ggml_nrows(w) != 1",
            "!ggml_is_contiguous(out)",
            "!(t0 == o0 && ggml_is_contiguous(t))",
        ),
    )
    fuse = c_body(main, "static int ggml_cuda_try_fuse(")
    at = fuse.index("ggml_cuda_mc_gated_norm_match(cgraph, i, gn)")
    assert at < fuse.index("{ GGML_OP_RMS_NORM, GGML_OP_MUL, GGML_OP_ADD }")
    assert at < fuse.index("if (ggml_cuda_can_fuse(cgraph, i, { GGML_OP_RMS_NORM, GGML_OP_MUL }, {})) {")
    call = fuse[at : at + 900]  # (patch 0065: the f16 form's plan and commit beside the blocks')
    assert "ggml_cuda_mc_preq_plan(*cuda_ctx, cgraph, gn[3], out, 1)" in call
    assert "ggml_cuda_mc_preq_commit(*cuda_ctx, out, mc_pq);" in call and "return gn[3] - i;" in call
    tests = (patched / "tests/test-backend-ops.cpp").read_text()
    assert "new test_mc_gate_mul_mat(GGML_TYPE_Q4_0, true, 128, 48, 3, 5120, false, true));" in tests
    assert "z = ggml_reshape_3d(ctx, z, hd, nh, n);  // a node between the weight's MUL and the SiLU" in tests


# ---- patch 0054: ffn_down's blocks from the gated product ----


def cta_runs(npieces: int, grid: int, rs: int, nrows: int):
    """Each CTA's (p0, n, r_begin, r_end, t, order of its pieces), as mc_pmv_q4_0 computes them."""
    for cta in range(grid):
        p0 = cta * npieces // grid
        n = (cta + 1) * npieces // grid - p0
        r_begin, r_end = p0 * rs, min((p0 + n) * rs, nrows)
        t = 0
        if n > 0 and r_end % QK:
            b_start = (r_end - 1) // QK * QK
            t = (r_end - b_start) // rs if b_start > r_begin else 0
        order = [p0 + (n - t + i if i < t else i - t) for i in range(n)]
        yield p0, n, r_begin, r_end, t, order


def emulate_blocks(nrows: int, rs: int, grid: int) -> None:
    """Every 32-row block quantized exactly once: from gq by the CTA whose run holds it whole (the 32
    values there being its rows, and the next piece in another block parity), or, for a block runs
    share, after its run by the one CTA holding its last row, from the 32 staged rows the runs wrote
    (each staged by exactly one run). With the last pieces first, a run's rows of a block it shares
    at its end are written within its first t pieces."""
    npieces = nrows // rs
    nblocks = nrows // QK
    own = np.zeros(nblocks, int)
    finish = np.zeros(nblocks, int)
    staged = np.zeros(nrows, int)
    for p0, n, r_begin, r_end, t, order in cta_runs(npieces, grid, rs, nrows):
        assert sorted(order) == list(range(p0, p0 + n))
        gq = {0: [-1] * QK, 1: [-1] * QK}
        for i, p in enumerate(order):
            row0 = p * rs
            for r in range(row0, row0 + rs):
                b0 = r // QK * QK
                gq[(b0 // QK) & 1][r % QK] = r
                if b0 < r_begin or b0 + QK > r_end:
                    staged[r] += 1
                    if r_end % QK and r >= (r_end - 1) // QK * QK > r_begin:
                        assert i < t, (p0, i, t)  # the trailing shared block comes first
            end = row0 + rs
            b = (end - 1) // QK
            if end == b * QK + QK:
                if b * QK >= r_begin:
                    assert gq[b & 1] == list(range(b * QK, b * QK + QK)), (b, gq[b & 1])
                    own[b] += 1
                    if i + 1 < n:  # the next piece's writers may run before the last warp reads gq
                        assert (order[i + 1] * rs // QK) & 1 != b & 1
                else:
                    finish[b] += 1
    assert np.all(own + finish == 1), np.flatnonzero(own + finish != 1)
    for b in np.flatnonzero(finish):
        assert np.all(staged[b * QK : b * QK + QK] == 1), b
    assert staged[np.repeat(own == 1, QK)].sum() == 0  # whole blocks are not staged


@pytest.mark.parametrize(
    "nrows, rs, grid",
    [
        (17408, 4, 264),  # the 27B's FFN on an H200: 2 CTAs x 132 SMs, 4 rows a piece
        (17408, 4, 340),  # an RTX 5090's 170 SMs
        (13824, 4, 264),
        (17440, 4, 264),
        (17408, 8, 264),
        (17408, 2, 264),
        (2048, 4, 264),  # fewer pieces than CTAs: empty runs, blocks over several CTAs
        (4096, 1, 264),
    ],
)
def test_every_ffn_block_is_quantized_once(nrows, rs, grid):
    emulate_blocks(nrows, rs, grid)


def test_the_glu_blocks_are_written_as_emulated(patched):
    """The kernel's statements that emulate_blocks transcribes, the launch's conditions, and the
    host's plan (two halves of the buffer, the staging slots allocated and emptied outside a capture)."""
    cuda = patched / "ggml/src/ggml-cuda"
    mmv = (cuda / "mc-mmv.cu").read_text()
    kernel = c_body(mmv, "static __global__ void mc_pmv_q4_0(")
    assert_statements(
        kernel,
        (
            "const int  r_begin = p0 * a.rs;",
            "const int  r_end   = min((p0 + n) * a.rs, a.grp.nrows[0]);",
            "if (pq && a.q8_first && n > 0 && r_end % QK8_1 != 0) {",
            "const int b_start = (r_end - 1) / QK8_1 * QK8_1;",
            "t                 = b_start > r_begin ? (r_end - b_start) / a.rs : 0;",
            "auto piece = [&](const int i) { return p0 + (i < t ? n - t + i : i - t); };",
            "locate(piece(i), s, row0, rows);",
            "gq[(b0 / QK8_1) & 1][row % QK8_1] = v;",
            "if (b0 < r_begin || b0 + QK8_1 > r_end) {",
            "__stcg(a.q8_stg + row, __float_as_uint(v) == MC_PREQ_EMPTY ? __uint_as_float(0x7FFFFFFFu) : v);",
            "if (end == b * QK8_1 + QK8_1) {",
            "if (b * QK8_1 >= r_begin) {",
            "mc_preq_store(a.q8, (int64_t) b * QK8_1 + lane, gq[b & 1][lane]);",
            "fin_b = b;",
            "if (fin_b >= 0 && i == n - 2) {",
            "while (__float_as_uint(fin_v = __ldcv(slot)) == MC_PREQ_EMPTY) {",
            "mc_preq_store(a.q8, (int64_t) fin_b * QK8_1 + lane, fin_v);",
            "__stcg(slot, __uint_as_float(MC_PREQ_EMPTY));",
        ),
    )
    assert kernel.count("locate(piece(i), s, row0, rows);") == 2  # the copies and the arithmetic
    assert "atomicAdd" not in kernel and "__threadfence" not in kernel  # nothing waits during the run
    loop_end = kernel.rindex("parity ^= 1u;")
    assert kernel.index("while (__float_as_uint(fin_v = __ldcv(slot))") > loop_end
    assert "__syncwarp();" in kernel[loop_end:]  # the polls converge before the warp's quantization
    assert "#define MC_PREQ_EMPTY 0xFFFFFFFFu" in (cuda / "mc-preq.cuh").read_text()
    launch = c_body(mmv, "static bool mc_pmv_launch_as(")
    assert "grp.n == 1 && grp.nrows[0] % QK8_1 == 0" in launch and "QK8_1 % plan.rs == 0" in launch
    assert "*q8_done = a.q8 != nullptr;" in launch
    assert "a.q8_first = ggml_cuda_mc_preq_glu() != 2;" in launch
    header = (cuda / "mc-mmv.cuh").read_text()  # the setting read once, for both places
    read = c_body(header, "static inline int ggml_cuda_mc_preq_glu() {")
    assert 'static const int v = ggml_cuda_mc_env_int("MC_PREQ_GLU", 0, 2, 1);' in read
    run = c_body(mmv, "static void mc_mmv_run(")
    assert "*fu.q8_done = q8_done;" in run
    main = (cuda / "ggml-cuda.cu").read_text()
    plan = c_body(main, "mc_preq_plan_t ggml_cuda_mc_preq_plan(")
    assert_statements(
        plan,
        (
            "CUDA_CHECK(cudaStreamIsCapturing(ctx.stream(), &capture));",
            "2 * half * sizeof(block_q8_1) + MC_PREQ_MAX_K * sizeof(float)",
            "0xFF, MC_PREQ_MAX_K * sizeof(float)",
            "plan.q8    = (block_q8_1 *) ctx.mc_preq_buf + (1 - ctx.mc_preq_half) * half;",
        ),
    )
    take = c_body(main, "const block_q8_1 * ggml_cuda_mc_preq_take(")
    assert "ctx.mc_preq_half * (MC_PREQ_MAX_K / QK8_1)" in take
    fuse = c_body(main, "static int ggml_cuda_try_fuse(")
    at = fuse.index("ggml_cuda_mc_preq_glu() >= 1 && !ids ?")
    glu = fuse[at : at + 1200]
    assert "ggml_cuda_mc_preq_plan(*cuda_ctx, cgraph, i + 2, glu, 1)" in glu
    commit = glu.index("ggml_cuda_mc_preq_commit(*cuda_ctx, glu, mc_pq);")
    assert glu.index("ggml_cuda_mul_mat_vec_q(") < commit
    tests = (patched / "tests/test-backend-ops.cpp").read_text()
    assert "new test_mc_ffn(GGML_TYPE_Q4_0, 5120, 17408, 1, 2));" in tests
    assert "ggml_tensor * h   = ggml_rms_norm(ctx, x, 1e-6f);" in tests


# ---- patch 0055: the RMS norm x weight over 8 blocks a row (MC_PREQ=3) ----


def test_the_split_norm_writes_each_column_once_with_the_whole_rows_sum(patched):
    """Each of the split blocks computes the row's sum of squares as the single block does (the loads
    and the block reduction are not touched) and writes the columns of its eighth (whole warps, so
    whole q8_1 blocks); the split applies only where blocks are written, at MC_PREQ=3, to the norm x
    weight and not to the residual add + norm (which may write its sum over its input; patch 0061's
    setting splits that one where no output is an input)."""
    cuda = patched / "ggml/src/ggml-cuda"
    norm = (cuda / "norm.cu").read_text()
    kernel = c_body(norm, "static __global__ void rms_norm_f32(")
    assert_statements(
        kernel,
        (
            "const int nrows     = gridDim.x / split;",
            "const int row       = blockIdx.x / split;",
            "if (col < ncols && (split == 1 || col / (ncols / split) == (int) (blockIdx.x % split))) {",
            "tmp = block_reduce<block_reduce_method::SUM, block_size>(tmp, s_sum);",
        ),
    )
    # the write's guard is the only place split enters between the loads and the reduction's end
    assert "split" not in kernel[kernel.index("ggml_cuda_pdl_sync();") : kernel.index("const float mean")]
    for block in range(8):  # every column of a 5,120-value row to exactly one block, in whole warps
        cols = [c for c in range(5120) if c // (5120 // 8) == block]
        assert len(cols) == 640 and cols[0] % 32 == 0
    launch = c_body(norm, "static bool rms_norm_mul_f32_cuda(")
    assert (
        "const bool split = q8 != nullptr && mc_split == MC_NORM_SPLIT && ncols >= 1024 && "
        "ncols % (QK8_1 * MC_NORM_SPLIT) == 0;"
    ) in launch
    assert "#define MC_NORM_SPLIT 8 " in norm
    main = (cuda / "ggml-cuda.cu").read_text()
    plan = c_body(main, "mc_preq_plan_t ggml_cuda_mc_preq_plan(")
    assert "plan.split = level_on == 3 ? 8 : 1;" in plan
    # the residual add + norm: at MC_PREQ=2 only, unless patch 0061 splits it or patch 0069's setting asks
    # (test_add_norm_split.py, test_add_norm_one.py)
    assert "const int pq_max = split || mc_add_norm_preq_on() ? 3 : 2;" in main
    assert "ggml_cuda_mc_preq_plan(*ctx, cgraph, i + 2, mul, 2, pq_max);" in main


# ---- patch 0056: one token's recurrence on 4 columns a warp (MC_GDN_ONE) ----


def test_the_one_token_kernel_covers_each_row_of_a_column_once():
    """Lane r (of a column's 8) holds rows 32 j + 4 r + e (j, e < 4): every row of 128 exactly once,
    each float4 load 16-byte aligned in a row of 128 floats."""
    lpc, rpl = 8, 16
    rows = sorted(j * 4 * lpc + 4 * r + e for r in range(lpc) for j in range(rpl // 4) for e in range(4))
    assert rows == list(range(128))
    assert all((j * 4 * lpc + 4 * r) % 4 == 0 for r in range(lpc) for j in range(rpl // 4))


def test_the_one_token_kernel_is_the_stock_steps_arithmetic(patched):
    """mc_gdn_one reads the state, q and k once after the PDL wait (triggering the next launch before it
    under MC_EARLY_TRIGGER), normalises q and k as the staged kernels do, runs the delta rule's two
    sums across a column's 8 lanes and writes the state in place of where it read it (each lane its own
    values). The launcher takes it only for one token of a scalar gate at head size 128 with no
    snapshots and 16-byte aligned rows; on by default since run CC (MC_GDN_ONE=0: the stock kernel)."""
    source = (patched / "ggml/src/ggml-cuda/gated_delta_net.cu").read_text()
    kernel = c_body(source, "__global__ void __launch_bounds__(256) mc_gdn_one(")
    assert_statements(
        kernel,
        (
            "ggml_cuda_pdl_sync();",
            "const float4 x  = *(const float4 *) (curr_state + o);",
            "const float sck = rsqrtf(ssk / S_v + l2_eps);",
            "kr[i] = l2_scale * (sck * kr[i]);",
            "const float attn = mc_gdn_wide_step<RPL, LPC>(s, kr, qr, g_val, beta_val, v_col);",
            "dst[(sequence * H + h_idx) * S_v + col] = attn * scale;",
            "*(float4 *) (state + j * 4 * LPC + 4 * r) = "
            "make_float4(s[4 * j + 0], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3]);",
        ),
    )
    assert kernel.count("ggml_cuda_pdl_sync();") == 1 and "__syncthreads" not in kernel
    # the delta rule's token step, shared with mc_gdn_wide (one copy of it)
    step = c_body(source, "static __device__ __forceinline__ float mc_gdn_wide_step(")
    assert "const float delta = (v_col - g_val * kv) * beta_val;" in step
    assert "s[i] = g_val * s[i] + kr[i] * delta;" in step
    assert source.count("mc_gdn_wide_step<RPL, LPC>(s, kr, qr, g_val, beta_val, v_col);") == 1
    # patch 0073: mc_gdn_wide's columns a lane, each its own call
    assert source.count("mc_gdn_wide_step<RPL, LPC>(s[c], kr, qr, g_val, beta_val, v_col);") == 1
    assert kernel.index("ggml_cuda_pdl_lc();") < kernel.index("ggml_cuda_pdl_sync();")
    # the stock kernel's arithmetic: the same update and output (stock: one column a warp)
    stock = c_body(source, "gated_delta_net_cuda(const float * q,")
    assert "float delta_col = (v_col - g_val * kv_col) * beta_val;" in stock
    assert "s_shard[r]  = g_val * s_shard[r] + k_reg[r] * delta_col;" in stock
    launcher = c_body(source, "static void launch_gated_delta_net(")
    assert 'ggml_cuda_mc_env_int("MC_GDN_ONE", 0, 1, 1) == 1' in launcher
    assert (
        "const bool        one    = one_on && n_tokens == 1 && !keep_rs_t && !KDA && S_v == 128 && "
        "warp_size == 32 &&" in launcher
    )
    aligned = "(((uintptr_t) s_d | (uintptr_t) state_d | (uintptr_t) q_d | (uintptr_t) k_d) & 15) == 0 &&"
    assert aligned in launcher
    assert launcher.index("if (one) {") < launcher.index("if (wide) {")
    # MC_GDN_ONE_WARPS: 1, 2, 4 or 8 warps a block (4 columns each), any other value named and refused
    assert 'ggml_cuda_mc_env_int("MC_GDN_ONE_WARPS", 1, 8, 4)' in launcher
    assert "the values allowed are 1, 2, 4 and 8; using 4" in launcher
    assert "dim3(H, n_seqs, 128 / (one_warps * MC_GDN_WIDE_CPW)),\n" in launcher
    assert "dim3(32, one_warps, 1), 0, stream);" in launcher
    assert "__global__ void __launch_bounds__(256) mc_gdn_one(" in source  # 8 warps fit the bound
