"""Patch 0067 (MC_CONV_PRELOAD, default 1: runs CO / CQ on H100s): patch 0063's several-token conv
step reads every token's input into registers before it writes the first output. In 0063's loop a token's read
waits for the last token's output to be stored (the output may be the tokens' memory, element for
element, so the compiler keeps the order): a 16-token verify step's conv was 16 reads one after another,
5.06 us a launch (48 a step) in run CL's trace on the H200. Checked here: the reads all come before the
first store in the form taken under the setting, each token's step is the one function both forms call
(the same taps in the same order: the same bits), the setting's name and default, and that the form
compiles for both targets without spills (test_conv_tokens.py). The GPU run: test-backend-ops
MC_CONV_STEP under the setting, the logits (the same bytes expected) and the 16-token step."""

from __future__ import annotations

import re

from tests.ggml_patches.test_cuda_kernels import c_body


def preload_branch(source: str) -> str:
    kernel = c_body(source, "static __global__ void mc_conv_steps(")
    start = kernel.index("if constexpr (PRE) {")
    return kernel[start : kernel.index("} else {", start)]


def test_every_read_comes_before_the_first_store(patched):
    source = (patched / "ggml/src/ggml-cuda/ssm-conv.cu").read_text()
    pre = preload_branch(source)
    reads = [m.start() for m in re.finditer(r"xt\[t\] = xc\[t \* x_nb0\];", pre)]
    stores = [m.start() for m in re.finditer(r"yc\[t \* y_nb1\] = ", pre)]
    assert len(reads) == 1 and len(stores) == 1 and reads[0] < stores[0]
    # two loops of the kernel's most tokens, unrolled, each guarded by the step's token count: the
    # inputs stay in registers (the compile test bounds the registers and finds no spills)
    assert pre.count("for (int t = 0; t < MC_CONV_TOKENS_MAX; ++t) {") == 2
    assert pre.count("#pragma unroll") == 2 and pre.count("if (t < n_t) {") == 2
    assert "float xt[MC_CONV_TOKENS_MAX];" in pre
    # the token's step: the same function as the form without the setting
    assert "yc[t * y_nb1] = mc_conv_slide<NC>(win, wc, xt[t]);" in pre
    kernel = c_body(source, "static __global__ void mc_conv_steps(")
    assert "yc[t * y_nb1] = mc_conv_slide<NC>(win, wc, xc[t * x_nb0]);" in kernel
    # the state is read before either form and written after both
    assert kernel.index("win[j] = st[j];") < kernel.index("if constexpr (PRE) {")
    assert kernel.index("so[j] = win[j];") > kernel.rindex("mc_conv_slide<NC>")


def test_the_setting_picks_the_form_for_several_tokens_only(patched):
    source = (patched / "ggml/src/ggml-cuda/ssm-conv.cu").read_text()
    launch = c_body(source, "void ggml_cuda_mc_conv_step(")
    several = launch[launch.index("if (n_t > 1) {") : launch.index("return;")]
    assert 'ggml_cuda_mc_env_int("MC_CONV_PRELOAD", 0, 1, 1) == 1' in several  # on by default (runs CO / CQ)
    assert "pre ? mc_conv_steps<4, true> : mc_conv_steps<4, false>" in several
    assert "mc_conv_step<4>, params," in launch[launch.index("return;") :]  # one token: patch 0057's kernel
