"""Patch 0040: mc_mmr_q4_0's loop keeps each chunk's stage, its phase's parity and the stage of the
chunk STAGES - 1 ahead as counters that step (instead of c % STAGES, c / STAGES and (c + STAGES - 1) %
STAGES: the 64-row form's 3 stages made each a division by 3), and the warp's mbarriers' shared
address computed once; mc_mbar_wait reads the clock (its trap's timeout) only once a first try has
failed. The counters are emulated here against the expressions they replace, for the stage counts the
kernel is built with and more; the source is checked to be what is emulated. This machine has no GPU:
the time is measured by the mmr lab, with and without the patch (kernel_lab.py --without 0040)."""

from __future__ import annotations

import pytest

from tests.ggml_patches.test_cuda_kernels import assert_statements, c_body, mmr_kernel


def counters(stages: int, nchunks: int) -> list[tuple[int, int, int]]:
    """The loop's (st, parity, nx) at each chunk, stepped as the kernel steps them."""
    st, parity, nx = 0, 0, stages - 1
    out = []
    for _ in range(nchunks):
        out.append((st, parity, nx))
        nx = st
        st += 1
        if st == stages:
            st = 0
            parity ^= 1
    return out


@pytest.mark.parametrize("stages", [2, 3, 4, 5])
def test_the_counters_are_the_expressions_they_replace(stages):
    for c, got in enumerate(counters(stages, 97)):
        assert got == (c % stages, (c // stages) & 1, (c + stages - 1) % stages), (stages, c, got)


def test_the_source_is_what_is_emulated(patched):
    source, kernel = mmr_kernel(patched)
    assert_statements(
        kernel,
        (
            "const uint32_t bars = mc_smem_addr(&mc_bars[warp][0]);",
            "mc_mbar_arrive_expect_at(bars + 8 * s, bulk_bytes);",
            "int      st     = 0;",
            "uint32_t parity = 0;",
            "int      nx     = STAGES - 1;",
            "mc_mbar_wait_at(bars + 8 * st, parity);",
            "issue_w(c + STAGES - 1, nx);",
            "issue_y(c + STAGES - 1, nx);",
            "mc_mmr_chunk<NT, BULK, MT>(smem + st * STAGE + warp * WARP_STAGE, lane, g, acc);",
            "nx = st;",
            "if (++st == STAGES) {",
            "parity ^= 1u;",
        ),
    )
    # every copy of the kernel counts on the warp's barrier of the stage it fills
    assert kernel.count("mc_bulk_copy_at(") == 3 and "mc_bulk_copy(" not in kernel
    code = "\n".join(line.split("//")[0] for line in kernel.splitlines())  # the comments name them
    assert "c % STAGES" not in code and "c / STAGES" not in code
    # the barrier array's stride is what bars + 8 * s assumes
    assert "__shared__ uint64_t                  mc_bars[MC_MMQ_WARPS][STAGES];" in kernel
    wait = c_body(source, "static __device__ __forceinline__ void mc_mbar_wait_at(")
    first, clock = wait.index("if (done()) {"), wait.index("const long long t0 = clock64();")
    assert first < clock < wait.index("while (!done()) {") < wait.index("__trap();")
    # the pointer forms are the address forms
    assert "mc_mbar_wait_at(mc_smem_addr(bar), parity);" in source
    assert "mc_mbar_arrive_expect_at(mc_smem_addr(bar), bytes);" in source
    assert "mc_bulk_copy_at(dst, src, bytes, mc_smem_addr(bar));" in source
