"""Patch 0038, MC_MMR_YSPLIT: mc_mmr_q4_0 with its activations in a ring of their own (YST stages on
their own mbarriers) beside STAGES weight stages. The warp's schedule, transcribed from the kernel
(the prologue's copies, then per chunk: both waits, the next copies into the slots the previous chunk
freed, the chunk's reads), run against mbarriers emulated phase by phase, for every chunk count a
block meets: each chunk reads its own weights and activations, no copy lands in a slot before its
previous contents are read, and every wait's parity names the phase that carries its chunk. Then the
shared memory the forms ask for: the 48-row form keeps 3 blocks an SM and the 64-row form 2 on an
H200 (what they buy: twice / 1.5 times the weight bytes in flight), and a GPU with ~100 KB a block
(RTX 5090) falls back to the forms without the split. This machine has no GPU: the GPU run checks the
kernel itself (test-backend-ops with MC_MMH_REPACK=2 MC_MMR_YSPLIT=1, the step's logits)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.ggml_patches.test_cuda_kernels import c_body

ROOT = Path(__file__).resolve().parents[2]

TILE = 1152
WARPS = 4
PAD = 128


class Barrier:
    """An mbarrier of one arrival a phase: phases complete in order once their copies land."""

    def __init__(self) -> None:
        self.completed = 0  # phases completed
        self.pending: list[tuple[int, int]] = []  # (slot, chunk) of the copies of the open phase

    def arrive_expect(self, slot: int, chunk: int) -> None:
        assert not self.pending, "a second arrival before the phase completed"
        self.pending.append((slot, chunk))

    def wait(self, parity: int, land) -> None:
        # try_wait.parity P returns once the phase of parity P completed: the current one has the other
        if (self.completed & 1) == parity:
            assert self.pending, "a wait on a phase nothing will complete: it would hang"
            for slot, chunk in self.pending:
                land(slot, chunk)
            self.pending.clear()
            self.completed += 1
        assert (self.completed & 1) != parity


def run_warp(nchunks: int, stages: int, yst: int) -> list[tuple[int, int]]:
    """The warp's chunks as mc_mmr_q4_0 (BULK, YST < STAGES) runs them; returns (weights chunk,
    activations chunk) each read found."""
    w_slots: list[int | None] = [None] * stages  # chunk whose weights a slot holds
    y_slots: list[int | None] = [None] * yst
    w_read = [True] * stages  # the slot's contents were read (or it is empty)
    y_read = [True] * yst
    bars = [Barrier() for _ in range(stages)]
    ybars = [Barrier() for _ in range(yst)]

    def land_w(slot: int, chunk: int) -> None:
        assert w_read[slot], f"weights of chunk {chunk} over unread chunk {w_slots[slot]}"
        w_slots[slot], w_read[slot] = chunk, False

    def land_y(slot: int, chunk: int) -> None:
        assert y_read[slot], f"activations of chunk {chunk} over unread chunk {y_slots[slot]}"
        y_slots[slot], y_read[slot] = chunk, False

    def issue_w(c: int, s: int) -> None:
        assert w_read[s] or w_slots[s] is None
        bars[s].arrive_expect(s, c)

    def issue_y(c: int, s: int) -> None:
        assert y_read[s] or y_slots[s] is None
        ybars[s].arrive_expect(s, c)

    for s in range(stages - 1):  # weights first, then (after the PDL wait) the activations
        if s < nchunks:
            issue_w(s, s)
    for s in range(stages - 1):
        if s < nchunks and s < yst - 1:
            issue_y(s, s)
    seen = []
    for c in range(nchunks):
        bars[c % stages].wait((c // stages) & 1, land_w)
        ybars[c % yst].wait((c // yst) & 1, land_y)
        # __syncwarp: chunk c - 1's slots are read; then the copies into them
        if c + stages - 1 < nchunks:
            issue_w(c + stages - 1, (c + stages - 1) % stages)
        if c + yst - 1 < nchunks:
            issue_y(c + yst - 1, (c + yst - 1) % yst)
        seen.append((w_slots[c % stages], y_slots[c % yst]))
        w_read[c % stages] = y_read[c % yst] = True
    assert all(not b.pending for b in bars + ybars), "copies issued and never waited for"
    return seen


@pytest.mark.parametrize(("stages", "yst"), [(3, 2), (4, 2), (4, 3)])
@pytest.mark.parametrize("nchunks", [1, 2, 3, 4, 5, 7, 10, 11, 12, 34])
def test_each_chunk_reads_its_own_weights_and_activations(nchunks, stages, yst):
    # the 27B's blocks: 4 chunks (an output projection's K slice), 10 (the GDN and attention inputs,
    # the FFN's gate + up), 11 / 12 (ffn_down's slices), 34 (ffn_down unsplit)
    assert run_warp(nchunks, stages, yst) == [(c, c) for c in range(nchunks)]


def test_the_source_runs_the_emulated_schedule(patched):
    """The statements the emulation transcribes, as the kernel has them."""
    source = (patched / "ggml/src/ggml-cuda/mc-mmv.cu").read_text()
    kernel = c_body(source, "static __global__ void mc_mmr_q4_0(")
    for line in (
        "constexpr bool YS = YST != STAGES;",
        "static_assert(!YS || (BULK && YST >= 2 && YST < STAGES)",
        "if (s < nchunks && s < YST - 1) {",
        "mc_mbar_wait(&mc_bars[warp][c % STAGES], (uint32_t) (c / STAGES) & 1);",
        "mc_mbar_wait(&mc_ybars[warp][c % YST], (uint32_t) (c / YST) & 1);",
        "issue_w(c + STAGES - 1, s);",
        "if (YS && c + YST - 1 < nchunks) {",
        "issue_y(c + YST - 1, (c + YST - 1) % YST);",
        "mc_mbar_arrive_expect(&mc_ybars[warp][s], Y_WARP);",
        "mc_bulk_copy(ystage + s * Y_STAGE, ywarp + c * Y_CHUNK, Y_WARP, &mc_ybars[warp][s]);",
        "const uint32_t bulk_bytes = (uint32_t) (nmt * MC_MMR_TILE_BYTES + (YS ? 0 : Y_WARP));",
        "char *         ystage     = smem + STAGES * STAGE + warp * Y_WARP;",
    ):
        assert line in kernel, line
    # the weights' copies of a chunk in the split form: its own weight barrier only
    loop = kernel[kernel.index("for (int c = 0; c < nchunks; ++c) {") :]
    assert loop.index("if constexpr (!YS) {") < loop.index("issue_y(c + STAGES - 1, s);")


def smem(nt: int, stages: int, mt: int, yst: int) -> int:
    """mc_mmr_smem for the bulk form."""
    if yst == stages:
        return stages * WARPS * (mt * TILE + 4 * nt * 512) + PAD
    return WARPS * (stages * mt * TILE + yst * 4 * nt * 512) + PAD


def blocks_an_sm(dynamic: int, per_sm: int, per_block: int, static: int = 256, reserved: int = 1024) -> int:
    if dynamic > per_block:
        return 0
    return per_sm // (dynamic + static + reserved)


def test_the_split_forms_keep_their_blocks_an_sm(patched):
    source = (patched / "ggml/src/ggml-cuda/mc-mmv.cu").read_text()
    for define in ("MC_MMR_YSPLIT_W64 4", "MC_MMR_YSPLIT_W48 3", "MC_MMR_YSPLIT_Y   2"):
        assert f"#define {define}" in source, define
    h200 = {"per_sm": 233_472, "per_block": 232_448}  # 228 KB an SM, 227 KB a block
    rtx5090 = {"per_sm": 102_400, "per_block": 101_376}
    # the forms without the split, as the launcher runs them on the H200
    assert blocks_an_sm(smem(2, 3, 4, 3), **h200) == 2
    assert blocks_an_sm(smem(2, 2, 3, 2), **h200) == 3
    # the split forms: the same blocks an SM, more weight stages
    assert smem(2, 4, 4, 2) == 106_624 and blocks_an_sm(smem(2, 4, 4, 2), **h200) == 2
    assert smem(2, 3, 3, 2) == 74_368 and blocks_an_sm(smem(2, 3, 3, 2), **h200) == 3
    # weight bytes in flight a warp while it reads one chunk: (stages - 1) x its tiles
    assert (4 - 1) * 4 * TILE / ((3 - 1) * 4 * TILE) == 1.5 and (3 - 1) * 3 * TILE / ((2 - 1) * 3 * TILE) == 2
    # a block of the 64-row split form does not fit the RTX 5090's ~99 KB: the launcher's test falls back
    assert smem(2, 4, 4, 2) > rtx5090["per_block"]
    dispatch = c_body(source, "static void mc_mmr_bulk_dispatch(")
    assert "const size_t  smpbo = ggml_cuda_info().devices[ggml_cuda_get_device()].smpbo;" in dispatch
    assert "if (mc_mmr_ysplit() && smpbo >= mc_mmr_smem<2, W64, true, 4, Y>()) {" in dispatch
    assert "mc_mmr_rows_dispatch<2, STAGES, STAGES, MC_MMR_NARROW_STAGES, MC_MMR_NARROW_STAGES>" in dispatch
    # the library's launcher and the mmr lab choose their forms through that one dispatch
    launcher = c_body(source, "static void mc_mmr_launch(")
    assert "mc_mmr_bulk_dispatch<STAGES>(grp, nquads, [&](auto s, auto mt, auto minb, auto yst" in launcher
    lab = (ROOT / "bench" / "gpu" / "mmr_lab.cu").read_text()
    assert "mc_mmr_bulk_dispatch<3>(grp, nquads, [&](auto st, auto mt, auto minb, auto yst" in lab
    assert "mc_mmr_rows_form(" not in lab[lab.index("auto         launch   = [&](const size_t gi") :]
