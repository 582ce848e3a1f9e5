"""Patch 0063 (MC_NORM_PRO, off by default until measured): the RMS norm x weight before a one-token
product (after its residual add or not) computed in the persistent product kernel's prologue instead of a
launch of its own, one boundary of the decode step's chain fewer for each of the 27B's 128 such norms.

Checked here: that the prologue's order of operations (256 threads, each standing for four of the norm
kernel's 1,024) gives the norm kernels' sum of squares, scale and outputs to the bit, on a float32
emulation of both orders (the GPU contracts `tmp += x * x` into a fused multiply-add in both kernels
alike; the emulation checks the order, which is what differs); that the kernel code transcribes the
norm kernels' statements; the host's conditions and fallbacks (a norm is left to a product only where
that product is the next node, and launched as before wherever the persistent kernel does not take it);
the test-backend-ops cases. The kernel's instances compile without spills for sm_90 and sm_120 in
test_cuda_kernels.py; the GPU run compares them with the CPU backend and the logits with the setting off."""

from __future__ import annotations

import numpy as np
import pytest

from tests.ggml_patches.test_cuda_kernels import assert_statements, c_body, compile_cuda


def _butterfly(lanes: np.ndarray) -> np.float32:
    """warp_reduce_sum over 32 float32 lanes (xor shuffles 16, 8, 4, 2, 1): lane 0's result (every lane
    ends with the same value: each level adds the same two partial sums, in either order)."""
    x = lanes.astype(np.float32).copy()
    for off in (16, 8, 4, 2, 1):
        x = (x + x[np.arange(32) ^ off]).astype(np.float32)
    assert np.all(x.view(np.uint32) == x[0].view(np.uint32))
    return x[0]


def _norm_kernel(x: np.ndarray) -> np.float32:
    """The 1,024-thread norm kernels' sum of squares: thread t sums columns t + 1024 k in k order, each
    warp's butterfly, then block_reduce's second stage over the 32 warps' sums."""
    n = x.size
    part = np.zeros(1024, np.float32)
    for t in range(1024):
        tmp = np.float32(0.0)
        for col in range(t, n, 1024):
            tmp = np.float32(tmp + np.float32(x[col] * x[col]))
        part[t] = tmp
    warps = np.array([_butterfly(part[32 * w : 32 * w + 32]) for w in range(32)], np.float32)
    return _butterfly(warps)


def _prologue(x: np.ndarray, c: int = 1) -> np.float32:
    """mc_npro_run<C>'s order: thread t (of 256) of a cluster's CTA rank r holds xv = x[t + 256 i] for the
    i = m + 4 k of its m in [r 4 / C, (r + 1) 4 / C); for each m it sums i = m + 4 k in k order, that sum
    goes through its warp's butterfly into slot warp + 8 m of every CTA's red; then the 32 sums' butterfly
    (each CTA alike). Every slot is written once."""
    n = x.size
    ni = n // 256
    red = np.full(32, np.nan, np.float32)
    mine = [(r, m) for r in range(c) for m in range(r * 4 // c, (r + 1) * 4 // c)]
    assert sorted(m for _, m in mine) == [0, 1, 2, 3]
    for w in range(8):
        for _r, m in mine:
            lanes = np.zeros(32, np.float32)
            for lane in range(32):
                t = 32 * w + lane
                xv = [x[t + 256 * i] for i in range(ni)]
                tmp = np.float32(0.0)
                for k in range(6):  # MC_NPRO_MAX_I / 4
                    if m + 4 * k < ni:
                        tmp = np.float32(tmp + np.float32(xv[m + 4 * k] * xv[m + 4 * k]))
                lanes[lane] = tmp
            assert np.isnan(red[w + 8 * m])
            red[w + 8 * m] = _butterfly(lanes)
    return _butterfly(red)


@pytest.mark.parametrize("ncols", [1024, 4096, 5120, 6144])
@pytest.mark.parametrize("add", [False, True])
def test_the_prologue_sums_as_the_norm_kernel_does_to_the_bit(ncols, add):
    rng = np.random.default_rng(ncols + add)
    a = rng.standard_normal(ncols).astype(np.float32) * np.float32(3.0)
    x = (a + rng.standard_normal(ncols).astype(np.float32)).astype(np.float32) if add else a
    # values of very different sizes: a summation order that differed would show in the low bits
    x[::97] *= np.float32(1000.0)
    want = _norm_kernel(x)
    for c in (1, 2, 4):  # MC_NORM_PRO 1, 2, 3: every CTA, clusters of 2 and of 4
        got = _prologue(x, c)
        assert want.view(np.uint32) == got.view(np.uint32), (c, want, got)
    # and the outputs: scale * x * w with the same scale, element by element, then the same quantization
    w = rng.uniform(0.5, 1.5, ncols).astype(np.float32)
    scale = np.float32(1.0) / np.sqrt(np.float32(want / np.float32(ncols)) + np.float32(1e-6))
    v_kernel = (np.float32(scale) * x * w).astype(np.float32)
    v_prologue = np.array([np.float32(np.float32(scale) * x[c]) * w[c] for c in range(ncols)], np.float32)
    assert np.array_equal(v_kernel.view(np.uint32), v_prologue.view(np.uint32))


def test_a_thread_s_values_are_the_norm_threads_it_stands_for():
    """Thread t's values t + 256 i (in a cluster of C, its rank's i = m + 4 k) are the columns of the norm's
    threads t + 256 m (columns t + 256 m + 1,024 k) and the elements lane (t % 32) of the blocks warp + 8 i
    it quantizes; over a cluster's ranks each value once, and each block's outputs written by one CTA of
    the grid (mc_npro_run's `(col / QK8_1) % nclus == blockIdx.x / C`)."""
    for ncols in (1024, 4096, 5120, 6144):
        ni = ncols // 256
        for c in (1, 2, 4):
            mpc = 4 // c
            for t in (0, 31, 32, 255):
                warp, lane = divmod(t, 32)
                held = []
                for r in range(c):  # mc_npro_run's loops: i = rank MPC + mm + 4 k
                    mine = [r * mpc + mm + 4 * k for k in range(6) for mm in range(mpc)]
                    mine = [i for i in mine if i < ni]
                    norm = {
                        t + 256 * m + 1024 * k
                        for m in range(r * mpc, (r + 1) * mpc)
                        for k in range(8)
                        if t + 256 * m + 1024 * k < ncols
                    }
                    assert {t + 256 * i for i in mine} == norm
                    held += mine
                assert sorted(held) == list(range(ni))
                blocks = {((t + 256 * i) // 32, (t + 256 * i) % 32) for i in held}
                assert blocks == {(warp + 8 * i, lane) for i in range(ni)}
        for c in (1, 2, 4):  # the side outputs: each block by one CTA of a 264-CTA grid
            grid, nclus = 264, 264 // c
            writers: dict[int, list[int]] = {}
            for cta in range(grid):
                r = cta % c
                for w in range(8):
                    for i in range(ni):
                        if (i % 4) // (4 // c) == r and (w + 8 * i) % nclus == cta // c:
                            writers.setdefault(w + 8 * i, []).append(cta)
            assert sorted(writers) == list(range(ncols // 32))
            assert all(len(v) == 1 for v in writers.values())


def test_the_prologue_transcribes_the_norm_kernels(patched):
    preq = (patched / "ggml/src/ggml-cuda/mc-preq.cuh").read_text()
    norm = (patched / "ggml/src/ggml-cuda/norm.cu").read_text()
    run = c_body(preq, "static __device__ __forceinline__ void mc_npro_run(")
    cached = c_body(norm, "static __global__ void rms_norm_f32(")
    add = c_body(norm, "static __global__ void mc_add_rms_norm_mul_f32(")
    # the norms' statements
    assert_statements(
        cached,
        (
            "tmp += xv[k] * xv[k];",
            "const float mean = tmp / ncols;",
            "const float scale = rsqrtf(mean + eps);",
            "const float v = scale * xv[k] * mv[k];",
            "mc_preq_store(mc_q8, q8_base + col, v);",
        ),
    )
    assert_statements(add, ("xv[k] = a[col] + b[col];", "tmp += xv[k] * xv[k];", "sum[col] = xv[k];"))
    assert "block_reduce<block_reduce_method::SUM, block_size>(tmp, s_sum)" in cached + add
    # the prologue's, in the same order
    assert_statements(
        run,
        (
            "const int i = rank * MPC + mm + 4 * k;",
            "xv[mm + MPC * k] = p.b != nullptr ? p.a[col] + p.b[col] : p.a[col];",
            "const int m   = rank * MPC + mm;",
            "tmp += xv[mm + MPC * k] * xv[mm + MPC * k];",
            "tmp = warp_reduce_sum<WARP_SIZE>(tmp);",
            "*mc_npro_at<C>(red + warp + (MC_NPRO_THREADS / WARP_SIZE) * m, q) = tmp;",
            "const float tot   = warp_reduce_sum<WARP_SIZE>(red[lane]);",
            "const float mean  = tot / p.ncols;",
            "const float scale = rsqrtf(mean + p.eps);",
            "const float v   = scale * xv[mm + MPC * k] * wv[mm + MPC * k];",
            "mc_preq_store(mc_npro_at<C>(yq, q), col, v);",
            "p.out[col] = v;",
            "p.sum[col] = xv[mm + MPC * k];",
            "mc_preq_store(p.q8, col, v);",
            "if ((col / QK8_1) % nclus == (int) blockIdx.x / C) {",  # each block by one CTA
        ),
    )
    # clusters: the wait for the kernel's arrive before the first store into another CTA's memory, the
    # cluster's barrier before the sums are read and at the end (1: the block's)
    assert run.index("mc_npro_cluster_wait();") < run.index("*mc_npro_at<C>(red")
    assert run.index("mc_npro_sync<C>();") < run.index("red[lane]")
    assert run.rstrip().endswith("mc_npro_sync<C>();")
    sync = c_body(preq, "template <int C> static __device__ __forceinline__ void mc_npro_sync(")
    assert "mc_npro_cluster_sync();" in sync and "__syncthreads();" in sync
    assert (
        "barrier.cluster.arrive.release.aligned;" in preq and "barrier.cluster.wait.acquire.aligned;" in preq
    )
    assert 'asm volatile("mapa.u64 %0, %1, %2;"' in preq
    assert 'ggml_cuda_mc_env_int("MC_NORM_PRO", 0, 3, 0)' in preq  # off until measured
    assert "#define MC_NPRO_MAX_I   24" in preq and "#define MC_NPRO_THREADS 256" in preq


def test_the_kernel_runs_the_prologue_after_its_wait_and_reads_its_blocks(patched):
    mmv = (patched / "ggml/src/ggml-cuda/mc-mmv.cu").read_text()
    kernel = c_body(mmv, "static __global__ void mc_pmv_q4_0(")
    assert "static_assert(NP == 0 || (MATH && !YS), \"the prologue's blocks take YS's place\");" in kernel
    wait = kernel.index("ggml_cuda_pdl_sync();")
    early = kernel.index("if (a.np.w_early) {")
    prologue = kernel.index("mc_npro_run<NP>(a.np, wv, (block_q8_1 *) ys, npro_red);")
    assert early < wait < prologue  # the model's weight before the wait, the activations after it
    assert kernel.index("mc_npro_cluster_arrive();") < wait  # clusters: this CTA has started
    loads = kernel.index("mc_load_q8_1_pair<true>(ys + kb,")
    assert prologue < loads < kernel.index("mc_load_q8_1_smem(ys + kt,")
    assert prologue < kernel.index(
        "__syncthreads();  // the barriers initialized before anyone waits on them"
    )
    launch = c_body(mmv, "static bool mc_pmv_launch_as(")
    assert "mc_pmv_smem(st, nblocks, YS || NP > 0)" in launch and "a.np = *np;" in launch
    assert "mc_pmv_q4_0<GATE, MATH, YS, NP>" in launch
    # clusters: whole ones, all resident at once (the persistent CTAs wait on each other's rows), PDL kept
    assert "ctas = ctas / NP * NP;" in launch and "!mc_pmv_clusters_fit<GATE, MATH, NP>(smem, ctas)" in launch
    fit = c_body(mmv, "template <bool GATE, bool MATH, int C> static bool mc_pmv_clusters_fit(")
    assert "cudaOccupancyMaxActiveClusters(&n, mc_pmv_q4_0<GATE, MATH, false, C>, &cfg)" in fit
    assert "return most * C >= ctas;" in fit
    clusters = c_body(mmv, "static void mc_pmv_launch_clusters(")
    assert (
        "cudaLaunchAttributeClusterDimension" in clusters
        and "attrs[nattrs].val.clusterDim.x = c;" in clusters
    )
    assert "cudaLaunchAttributeProgrammaticStreamSerialization" in clusters
    head = "static bool mc_pmv_launch(const mc_mm_group & grp, const char * vgate, const block_q8_1 * y, "
    persist = c_body(mmv, head + "const int")
    for level, c in (("level == 3 ?", 4), ("level == 2 ?", 2)):
        assert f"{level} mc_pmv_launch_as<GATE, MATH, false, {c}>(" in persist
    assert "mc_pmv_launch_as<GATE, MATH, false, 1>(" in persist


def test_the_host_leaves_a_norm_only_to_the_next_product_and_launches_it_otherwise(patched):
    main = (patched / "ggml/src/ggml-cuda/ggml-cuda.cu").read_text()
    mmv = (patched / "ggml/src/ggml-cuda/mc-mmv.cu").read_text()
    assert "return ggml_cuda_mc_norm_pro() >= 1;" in main  # mc-preq.cuh: off until measured
    defer = c_body(main, "static bool mc_npro_defer(")
    for rule in (
        "pq.q8 == nullptr",  # the norm's blocks planned (a product reads them)
        "ctx.mc_npro_node >= 0",
        "mc_probe_norm() != 0",
        "k < 1024 || k % MC_NPRO_THREADS != 0 || k > (int64_t) MC_NPRO_THREADS * MC_NPRO_MAX_I",
        "!mc_disjoint(add, in)",  # every CTA reads the whole row
        "const int j = mc_next_real_node(cgraph, i_last);",
        "j >= pq.until || !mc_npro_product(cgraph->nodes[j], mul)",
    ):
        assert rule in defer, rule
    product = c_body(main, "static bool mc_npro_product(")
    assert "p->src[0]->type == GGML_TYPE_Q4_0" in product and "ggml_nrows(y) == 1" in product
    # both fused norms: the add + norm only in its split form (no output an input)
    assert "if (split && mc_npro_defer(*ctx, cgraph, i + 2, add, norm, mul, pq)) {" in main
    assert (
        "if (mc_npro_defer(*cuda_ctx, cgraph, i + 1, nullptr, node, cgraph->nodes[i + 1], mc_pq)) {" in main
    )
    # the fallbacks: the product's blocks taken as MC_PREQ's launch the norm first; the mc entry point
    # launches it where it returns without the product; the main loop where another node comes first, and
    # a product that did neither stops the program
    take = c_body(main, "const block_q8_1 * ggml_cuda_mc_preq_take(")
    assert take.index("ggml_cuda_mc_npro_settle(ctx, src1);") < take.index("return")
    entry = c_body(mmv, "bool ggml_cuda_mc_mmv(")
    assert "~npro_guard() { ggml_cuda_mc_npro_settle(ctx, src1); }" in entry
    assert entry.index("guard{ ctx, src1 };") < entry.index("return false;")
    assert "MC_NORM_PRO: the product of a deferred norm neither computed nor launched it" in main
    settle = c_body(main, "void ggml_cuda_mc_npro_settle(")
    again = (
        "ggml_cuda_mc_add_rms_norm_mul(ctx, ctx.mc_npro_add, ctx.mc_npro_norm, ctx.mc_npro_mul, true, q8, "
    )
    assert again + "true)" in settle and "q8, ctx.mc_npro_split);" in settle
    run = c_body(mmv, "static void mc_mmv_run(")
    claim = run.index("ggml_cuda_mc_npro_claim(ctx);")
    assert (
        run.index("ggml_cuda_mc_npro_args(ctx, src1, np)")
        < claim
        < run.index("ggml_cuda_mc_npro_settle(ctx, src1);")
    )
    assert claim < run.index("mc_mmr_run(")  # before any path that reads the f32 input
    # the inputs stay allocated until the product that reads them
    assert "mc_norm_pro_alloc_deps(cgraph, params);   // MegaCapybara: MC_NORM_PRO" in main


def test_the_gpu_cases_are_in_test_backend_ops(patched):
    ops = (patched / "tests/test-backend-ops.cpp").read_text()
    case = c_body(ops, "struct test_mc_norm_pro : public test_case {")
    assert 'return "MC_NORM_PRO";' in case and "bool run_whole_graph() override { return true; }" in case
    gated = "ggml_glu_split(ctx, ggml_mul_mat(ctx, wg, normed), ggml_mul_mat(ctx, wu, normed), "
    assert gated + "GGML_GLU_OP_SWIGLU)" in case
    assert "ggml_concat(ctx, ggml_concat(ctx, h, second, 0), normed, 0)" in case
    for args in ("(add, true, 5120, 17408)", "(add, false, 5120, 16384)", "(true, false, 4096, 16384)"):
        assert f"new test_mc_norm_pro{args}" in ops, args


def test_the_cluster_instances_compile_for_a_gpu_before_hopper(patched, tmp_path):
    """The build adds the machine's own GPU to sm_90 / sm_120 (an RTX 4090 is sm_89): there the cluster
    instances, never launched before Hopper, compile to a trap instead of failing the build (the first
    form's static_assert did)."""
    out = compile_cuda(patched, "mc-mmv.cu", "89", tmp_path, "-O1")
    assert out.returncode == 0, out.stderr[-3000:]
