"""Patch 0063 (MC_FUSE_CONV_TOKENS, on by default since run CJ; 0: off): patch 0057's conv step in one launch
for 2..32 tokens of each sequence (a 16-token verify step runs it as four launches: the window's
CONCAT, the CPY of its last 3 columns into the cache, SSM_CONV + SiLU, the gates). Thread c slides a
window over its channel's tokens; stock's ssm_conv_f32 keeps the same window as a ring buffer. Checked
here: that both hand each token's taps the same values in the same order and leave the same state
(an emulation of both index schemes), the kernel's statements, the guard's conditions, and that the
kernel compiles for both targets without spills; the real graph's 16-token shapes are checked in
tests/ggml_patches/test_conv_step_graph.py. The GPU run compares it with the CPU backend
(test-backend-ops MC_CONV_STEP) and the logits with it off (run CJ: the same bytes)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.ggml_patches.test_cuda_kernels import assert_statements, c_body, kernel_reports

D_CONV = 4


def stock_taps(ext: list[float], n_t: int) -> list[list[float]]:
    """ssm_conv_f32 at n_t <= 32: each token's window values in the order its sum takes them (tap j
    from 0), read from the window ext = state (3 columns) + tokens through its ring buffer x[d_conv]."""
    x = [0.0] * D_CONV
    taps = []
    for i in range(n_t):
        if i == 0:
            for j in range(D_CONV):
                x[j] = ext[j]
        else:
            x[(i - 1) % D_CONV] = ext[i + D_CONV - 1]
        taps.append([x[(i + j) % D_CONV] for j in range(D_CONV)])
    return taps


def sliding_taps(state: list[float], tokens: list[float]) -> tuple[list[list[float]], list[float]]:
    """mc_conv_steps: win[0..2] the state, then per token win[3] = the token, the taps win[0..3], the
    window shifted by one; the state written after the last token is win[0..2]."""
    win = [*state, 0.0]
    taps = []
    for tok in tokens:
        win[D_CONV - 1] = tok
        taps.append(list(win))
        for j in range(D_CONV - 1):
            win[j] = win[j + 1]
    return taps, win[: D_CONV - 1]


@pytest.mark.parametrize("n_t", [1, 2, 3, 4, 5, 16, 32])
def test_the_sliding_window_takes_stocks_taps_in_stocks_order_and_leaves_the_same_state(n_t):
    rng = np.random.default_rng(n_t)
    ext = [float(v) for v in rng.standard_normal(D_CONV - 1 + n_t).astype(np.float32)]
    taps, new_state = sliding_taps(ext[: D_CONV - 1], ext[D_CONV - 1 :])
    assert taps == stock_taps(ext, n_t)
    # the cache's update: the window's last 3 columns (the graph's tail view from column n_t)
    assert new_state == ext[n_t : n_t + D_CONV - 1]
    # so the float32 sums, taken in the same order from 0 with the zero bias added, are the same bits
    w = rng.standard_normal(D_CONV).astype(np.float32)

    def sums(per_token: list[list[float]]) -> list[np.float32]:
        out = []
        for values in per_token:
            acc = np.float32(0.0)
            for j in range(D_CONV):
                acc = np.float32(acc + np.float32(values[j]) * w[j])
            out.append(np.float32(acc + np.float32(0.0)))
        return out

    assert [s.tobytes() for s in sums(taps)] == [s.tobytes() for s in sums(stock_taps(ext, n_t))]


def test_the_kernel_reads_before_it_writes_and_sums_as_the_emulation(patched):
    """The state's 3 values are read before anything is written and written back after the last token
    (so the update may be the rows read); each token is read before its output is written (so the
    output may be the tokens' memory, element for element); the statements the emulation transcribes
    (one token's step in mc_conv_slide since patch 0067, which both forms of the kernel call)."""
    source = (patched / "ggml/src/ggml-cuda/ssm-conv.cu").read_text()
    kernel = c_body(source, "static __global__ void mc_conv_steps(")
    read, loop = kernel.index("win[j] = st[j];"), kernel.index("for (int t = 0; t < n_t; ++t) {")
    out = kernel.index("yc[t * y_nb1] = mc_conv_slide<NC>(win, wc, xc[t * x_nb0]);")
    update = kernel.index("so[j] = win[j];")
    assert kernel.index("ggml_cuda_pdl_sync();") < read < loop < out < update
    assert kernel.index("ggml_cuda_pdl_lc();") < kernel.index("ggml_cuda_pdl_sync();")
    assert "if (mc_conv_gates_part(gates, channels)) {" in kernel  # the gates' blocks, as patch 0057's kernel
    slide = c_body(source, "static __device__ __forceinline__ float mc_conv_slide(")
    token, shift = slide.index("win[NC - 1] = xin;"), slide.index("win[j] = win[j + 1];")
    assert (
        token
        < slide.index("sumf += win[j] * wc[j];")
        < shift
        < slide.index("return ggml_cuda_op_silu_single(sumf);")
    )
    assert_statements(
        slide,
        (
            "float sumf  = 0.0f;",
            "sumf += win[j] * wc[j];",
            "sumf += 0.0f;  // ssm_conv_f32's bias term without a bias",
        ),
    )
    # the launcher: the several-token kernel for n_t > 1, patch 0057's unchanged for one token
    launch = c_body(source, "void ggml_cuda_mc_conv_step(")
    assert "const int n_t = (int) (concat->ne[0] - (weight->ne[0] - 1));" in launch
    assert (
        launch.index("if (n_t > 1) {")
        < launch.index("mc_conv_steps<4, false>")
        < launch.index("mc_conv_step<4>, params,")
    )
    fits = c_body(source, "bool ggml_cuda_mc_conv_step_fits(")
    assert "concat->ne[0] >= 4 && concat->ne[0] <= 3 + MC_CONV_TOKENS_MAX" in fits
    assert "#define MC_CONV_TOKENS_MAX 32" in source


def test_the_guard_takes_several_tokens_by_default_and_only_with_their_shapes(patched):
    main = (patched / "ggml/src/ggml-cuda/ggml-cuda.cu").read_text()
    fuse = c_body(main, "static int mc_try_conv_step(")
    assert 'ggml_cuda_mc_env_int("MC_FUSE_CONV_TOKENS", 0, 1, 1) == 1' in fuse  # on since run CJ; 0: off
    assert "if (!(n_t == 1 || (tokens_on && n_t >= 2 && n_t <= 32)) || x->nb[0] % fs != 0) {" in fuse
    assert "cat->ne[0] != nc - 1 + n_t" in fuse and "tail->view_offs != n_t * fs" in fuse
    assert "conv->ne[1] != n_t" in fuse and "silu->nb[1] % fs != 0" in fuse
    # the output on the tokens' memory only element for element: its token stride is theirs
    assert "(n_t == 1 || silu->nb[1] == x->nb[0]);" in fuse
    assert "x->ne[0] != 1" not in fuse and "tail->view_offs != fs " not in fuse
    tests = (patched / "tests/test-backend-ops.cpp").read_text()
    assert "new test_mc_conv_step(10240, 1, true, 48, 16));" in tests  # a verify step with the gates
    assert "new test_mc_conv_step(1152, 1, true, 0, 33));" in tests  # past 32 tokens: stock's kernels


@pytest.mark.parametrize("arch", ["90", "120"])
def test_the_several_token_kernel_compiles_without_spills(patched, arch, tmp_path):
    found = kernel_reports(patched, "ssm-conv.cu", arch, tmp_path, r"_Z13mc_conv_stepsILi4ELb[01]EE\w+")
    # both forms (patch 0067's PRE holds the 32 tokens' inputs in registers)
    assert len(found) == 2 and all(f[0] == "0" and int(f[1]) <= 80 for f in found), found
