"""Patch 0068 (MC_ADD_NORM_PRELOAD, default 1: runs CO / CQ on H100s): the residual add + RMS norm x
weight (mc_add_rms_norm_mul_f32: 48 a decode step after the Gated DeltaNet output projections, split over 8
blocks a row; 127 a 16-token verify step, one block a row) reads every column's two inputs before it stores
the first sum. In the loop it had, a column's reads wait for the column before it to be stored: the sum
may be an input's memory (the one-block form may write it in place), so the compiler keeps that order,
and a row of 5,120 values on 1,024 threads was 5 round trips to L2 one after another. Checked here: the
reads before the stores in the form under the setting (in the source and in the PTX, where the form
without it interleaves them), the same statements in both forms (the same additions and the squares summed
in the same order: the same bits), the setting's name, default and launch argument. The GPU run:
test-backend-ops MC_ADD_RMS_NORM_MUL under the setting, the logits (the same bytes expected), the decode and
16-token steps."""

from __future__ import annotations

import re

import pytest

from tests.ggml_patches.test_cuda_kernels import c_body, compile_cuda

KERNEL = "static __global__ void mc_add_rms_norm_mul_f32("


def forms(norm: str) -> tuple[str, str]:
    kernel = c_body(norm, KERNEL)
    start = kernel.index("    if (mc_pre) {")
    other = kernel.index("    } else {", start)
    end = kernel.index("extern __shared__ float s_sum[];", other)
    return kernel[start:other], kernel[other:end]


def test_the_form_under_the_setting_reads_every_column_before_the_first_store(patched):
    norm = (patched / "ggml/src/ggml-cuda/norm.cu").read_text()
    pre, old = forms(norm)
    read, store = "xv[k] = a[col] + b[col];", "sum[col] = xv[k];"
    assert pre.count(read) == 1 and pre.count(store) == 1 and pre.index(read) < pre.index(store)
    assert pre.count("for (int k = 0; k < MC_NORM_CACHED; ++k) {") == 2  # two loops, each unrolled
    assert pre.count("#pragma unroll") == 2
    # the same statements in both forms: the sum, its eighth stored, the squares in the columns' order
    for line in (read, store, "if (split == 1 || col / (ncols / split) == part) {", "tmp += xv[k] * xv[k];"):
        assert line in pre and line in old, line
    assert pre.index("tmp += xv[k] * xv[k];") > pre.index(store)  # after the store, as in the form without it
    assert old.index(read) < old.index(store) < old.index("tmp += xv[k] * xv[k];")


def test_the_setting_is_read_once_and_passed_to_every_form(patched):
    norm = (patched / "ggml/src/ggml-cuda/norm.cu").read_text()
    assert "const int mc_wpf, const mc_preh_out ph, const int mc_pre) {" in c_body(norm, KERNEL)
    host = c_body(norm, "bool ggml_cuda_mc_add_rms_norm_mul(")
    assert (
        'static const int pre = ggml_cuda_mc_env_int("MC_ADD_NORM_PRELOAD", 0, 1, 1);' in host
    )  # off until measured
    assert host.count("ggml_cuda_kernel_launch(kernel, params,") == 1 and "ph, pre);" in host


def ptx_order(ptx: str, entry: str) -> list[str]:
    body = ptx[ptx.index(f".entry {entry}") :]
    body = body[: body.index("\n}\n")]
    return re.findall(r"(ld\.global|st\.global)", body)


@pytest.mark.parametrize("arch", ["90"])
def test_the_ptx_has_the_reads_first_under_the_setting(patched, arch, tmp_path):
    """The split form (decode): 8 weight loads and 8 x 2 input loads before the first store in one form;
    the other stores a sum between each column's two loads and the next column's."""
    out = compile_cuda(patched, "norm.cu", arch, tmp_path, "--keep", "--keep-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    ptx = (tmp_path / "norm.ptx").read_text()
    entry = next(m for m in re.findall(r"\.entry (_Z23mc_add_rms_norm_mul_f32ILi1024ELb1ELi8E\w+)", ptx))
    seq = ptx_order(ptx, entry)
    first_store = seq.index("st.global")
    assert seq[:first_store] == ["ld.global"] * 24, seq[:30]  # the weight's 8, then a and b's 8 each
    # later, the form without the setting: two loads, a store, two loads, a store ...
    rest = "".join("L" if s == "ld.global" else "S" for s in seq[first_store:])
    assert "LLSLLSLLSLLSLLSLLSLLSLLS" in rest, rest
