"""Patch 0070 (mc-gdn-fused-sums, MC_GDN_FUSED_SUMS, default 0 until measured on a GPU): a token of the
Gated DeltaNet recurrence on mc_gdn_wide's mapping (mc_gdn_wide at 2+ tokens, mc_gdn_one at one) with
its sums in one round: attn = g (S . q) + delta (k . q) over the state before the update, S . k, S . q
and k . q reduced across the column's lanes together, where the stock order ran S . k, the update,
then the updated S . q (two dependent rounds of multiply-adds and shuffles). The recurrence's equality
is checked by the emulation in test_gdn_wide_layout.py (fused=True) and its float32 error against the
two-round form's there; on a GPU by test-backend-ops GATED_DELTA_NET / MC_GDN_LAYER under each setting
and by the GDN lab's widefs variant (bench/gpu/kernel_lab.py gdn: against the recurrence in double on
the host)."""

from __future__ import annotations

from tests.ggml_patches.test_cuda_kernels import c_body


def test_the_step_has_both_forms_and_the_fused_one_reduces_three_sums_together(patched):
    gdn = (patched / "ggml/src/ggml-cuda/gated_delta_net.cu").read_text()
    step = c_body(gdn, "template <int RPL, int LPC, bool FS = false>")
    fused = step[step.index("if constexpr (FS) {") : step.index("return g_val * sq + delta * kq;")]
    # the three sums from the state before the update, in one loop
    for line in ("pk[i % 4] += s[i] * kr[i];", "pq[i % 4] += s[i] * qr[i];", "pkq[i % 4] += kr[i] * qr[i];"):
        assert line in fused
    # one shuffle loop carries all three
    loop = fused[fused.index("for (int o = 1; o < LPC; o <<= 1) {") :]
    loop = loop[: loop.index("}")]
    for name in ("kv", "sq", "kq"):
        assert f"{name} += __shfl_xor_sync(0xffffffff, {name}, o);" in loop
    # the update follows delta, and the output takes no sum of the updated state
    assert fused.index("const float delta = (v_col - g_val * kv) * beta_val;") < fused.index(
        "s[i] = g_val * s[i] + kr[i] * delta;"
    )
    # the two-round form stays after it (FS false: MC_GDN_FUSED_SUMS=0)
    rest = step[step.index("return g_val * sq + delta * kq;") :]
    assert "a[i % 4] += s[i] * qr[i];" in rest


def test_the_setting_picks_the_form_for_both_kernels(patched):
    gdn = (patched / "ggml/src/ggml-cuda/gated_delta_net.cu").read_text()
    launch = c_body(gdn, "static void launch_gated_delta_net(")
    assert 'static const bool fs = ggml_cuda_mc_env_int("MC_GDN_FUSED_SUMS", 0, 1, 0) == 1;' in launch
    for kernel in (
        "mc_gdn_one<true, true>",
        "mc_gdn_one<true, false>",
        "mc_gdn_one<false, true>",
        "mc_gdn_one<false, false>",
        "mc_gdn_wide<keep_rs_t, true, true>",
        "mc_gdn_wide<keep_rs_t, false, false>",
    ):
        assert kernel in launch
    one = c_body(
        gdn, "template <bool L2, bool FS = false>\n__global__ void __launch_bounds__(256) mc_gdn_one("
    )
    assert "mc_gdn_wide_step<RPL, LPC, FS>(s, kr, qr, g_val, beta_val, v_col);" in one
    wide = c_body(
        gdn,
        "template <bool keep_rs_t, bool L2, bool FS = false>\n"
        "__global__ void __launch_bounds__(128) mc_gdn_wide(",
    )
    assert "mc_gdn_wide_step<RPL, LPC, FS>(s, kr, qr, g_val, beta_val, v_col);" in wide
