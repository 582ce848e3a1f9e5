"""Patch 0058 (MC_W_PREFETCH, on by default since runs CD / CE): the small kernels of a decode step that
read a model weight ask for it into L2 before their PDL wait. A request into L2 is a hint (the loads
after the wait are unchanged), so the checks here are where the requests stand (before the wait, under
the setting, on the ranges the kernel then reads) and that every launch passes the setting; the GPU run
compares the logits with it on and off (the same bits expected) and times it."""

from __future__ import annotations

import pytest

from tests.ggml_patches.test_cuda_kernels import c_body

# (file, the kernel's head, the request's statement)
REQUESTS = (
    ("norm.cu", "static __global__ void rms_norm_f32(",
     "ggml_cuda_mc_prefetch_l2(mul, (int) (mul_ncols_packed.z * sizeof(float)));"),
    ("norm.cu", "static __global__ void mc_add_rms_norm_mul_f32(",
     "ggml_cuda_mc_prefetch_l2(w, (int) (ncols * sizeof(float)));"),
    ("rope.cu", "static __device__ __forceinline__ void rms_norm_mul_rope_row(",  # 0059: the row's function
     "ggml_cuda_mc_prefetch_l2(mul, (int) (mul_ncols_packed.z * sizeof(float)));"),
    ("ssm-conv.cu", "static __global__ void ssm_conv_f32(",
     "ggml_cuda_mc_prefetch_l2(w_block, (int) (split_d_inner * src1_nb1));"),
    ("ssm-conv.cu", "static __global__ void mc_conv_step(",
     "ggml_cuda_mc_prefetch_l2(state + s * st_nb2 + (int64_t) blockIdx.x * blockDim.x * st_nb1,"),
    ("ssm-conv.cu", "static __global__ void mc_conv_steps(",  # patch 0063's several-token form
     "ggml_cuda_mc_prefetch_l2(state + s * st_nb2 + (int64_t) blockIdx.x * blockDim.x * st_nb1,"),
    ("gated_delta_net.cu", "static __global__ void mc_gdn_gates(",
     "ggml_cuda_mc_prefetch_l2(dt, heads * (int) sizeof(float));"),
)  # fmt: skip


@pytest.mark.parametrize(("name", "head", "request_"), REQUESTS)
def test_the_weight_is_requested_before_the_wait_under_the_setting(patched, name, head, request_):
    kernel = c_body((patched / "ggml/src/ggml-cuda" / name).read_text(), head)
    at = kernel.index(request_)
    assert at < kernel.rindex("ggml_cuda_pdl_sync();"), head  # (mc_conv_step: its gates' blocks wait earlier)
    guard = kernel.rindex("if (", 0, at)
    assert "mc_wpf" in kernel[guard:at], head  # only under MC_W_PREFETCH


def test_the_setting_is_read_once_and_every_launch_passes_it(patched):
    cuda = patched / "ggml/src/ggml-cuda"
    header = (cuda / "mc-mmv.cuh").read_text()
    setting = c_body(header, "static inline int ggml_cuda_mc_w_prefetch() {")
    assert 'ggml_cuda_mc_env_int("MC_W_PREFETCH", 0, 1, 1)' in setting
    helper = c_body(header, "static __device__ __forceinline__ void ggml_cuda_mc_prefetch_l2(")
    assert "if ((((uintptr_t) p) | (uintptr_t) bytes) % 16 == 0 && bytes > 0) {" in helper
    assert 'asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;"' in helper
    # the product kernels' own helper forwards to it: one copy of the request
    mmv = (cuda / "mc-mmv.cu").read_text()
    assert "cp.async.bulk.prefetch.L2.global" not in mmv
    assert "ggml_cuda_mc_prefetch_l2(p, bytes);" in c_body(
        mmv, "static __device__ __forceinline__ void mc_prefetch_l2("
    )
    sources = {n: (cuda / n).read_text() for n in ("norm.cu", "rope.cu", "ssm-conv.cu", "gated_delta_net.cu")}
    assert sum(s.count('"MC_W_PREFETCH"') for s in sources.values()) == 0  # read in the header alone
    norm = sources["norm.cu"]
    assert norm.count("1.0f, q8, ggml_cuda_mc_w_prefetch());") == 1  # the cached form
    assert norm.count("nullptr, 0);") == 6  # the other rms_norm_f32 launches: no request
    launch = "(float *) mul->data, ncols, eps, q8,\n" + " " * 28 + "ggml_cuda_mc_w_prefetch(), ph, pre);"
    assert launch in norm
    rope = sources["rope.cu"]
    assert rope.count("is_neox, sections, mrope, ggml_cuda_mc_w_prefetch());") == 4
    attn_pro = c_body(rope, "void ggml_cuda_op_mc_attn_pro(")  # patch 0059
    assert "const int wpf = ggml_cuda_mc_w_prefetch();" in attn_pro
    conv = sources["ssm-conv.cu"]
    launch = "n_t,\n" + " " * 72 + "ggml_cuda_mc_w_prefetch());"
    assert conv.count(launch) == 1
    main = (cuda / "ggml-cuda.cu").read_text()
    assert "gates.mc_wpf = ggml_cuda_mc_w_prefetch();  // patch 0058" in main
    gdn = sources["gated_delta_net.cu"]
    assert "(float *) beta->data, n, (int) alpha->ne[0], ggml_cuda_mc_w_prefetch());" in gdn
