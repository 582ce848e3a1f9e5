"""MC_MMR_DECODE (patch 0021, `mc_mmr1_q4_0`): a NumPy emulation of the one-column kernel on the
repacked copies, transcribed from mc-mmv.cu: a block's 16-row tile, its warps' K quads (w, w + 4,
...), each lane's two quant pieces and its row pair's scale piece at the offsets the kernel reads,
the two dp4a of word t's low and high nibbles against q8_1's words t and 4 + t, Q4_0's offset split
as 2 d s a lane, the sums over a row's 4 lanes and the 4 warps, and the fused gate. The result must
equal vec_dot_q4_0_q8_1's arithmetic over whole blocks. The kernel itself runs on a GPU
(test-backend-ops MUL_MAT / MUL_MAT_VEC_FUSION with MC_MMR_DECODE=1 MC_MMH_REPACK=2)."""

from __future__ import annotations

import numpy as np
import pytest

from .test_mmr_layout import TILE, q4_0_rows, repack

AHEAD = 4  # MC_MMR1_AHEAD: only the load order depends on it


def q8_1(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """quantize_q8_1 of one column: per 32 values d = amax / 127, qs = round(x / d), s = sum(x)."""
    b = x.reshape(-1, 32)
    d = np.abs(b).max(axis=1) / 127
    qs = np.where(d[:, None] > 0, np.round(b / np.where(d > 0, d, 1)[:, None]), 0).astype(np.int8)
    return qs, d.astype(np.float16).astype(np.float64), b.sum(axis=1).astype(np.float16).astype(np.float64)


def reference(w: np.ndarray, rows: int, k: int, qs, d, s) -> np.ndarray:
    """vec_dot_q4_0_q8_1 over whole blocks: d4 (sumi dy - 8 s)."""
    blocks = w.reshape(rows, k // 32, 18)
    d4 = blocks[:, :, 0:2].copy().view(np.float16).astype(np.float64)[:, :, 0]
    q = blocks[:, :, 2:].astype(np.int64)
    vals = np.concatenate([q & 15, q >> 4], axis=2)  # element i: low nibble of byte i, 16 + i: high
    sumi = (vals * qs.astype(np.int64)[None]).sum(axis=2)
    return (d4 * (sumi * d[None] - 8 * s[None])).sum(axis=1)


def dp4a(a: int, b: np.ndarray) -> int:
    """unsigned bytes of a times signed bytes of b (the nibbles are 0..15)."""
    return int(sum(((a >> (8 * i)) & 255) * int(b[i]) for i in range(4)))


def emulate(copy: np.ndarray, rows: int, k: int, qs, d, s) -> np.ndarray:
    """mc_mmr1_q4_0 over every tile of one product: lane 4 g + t of warp w."""
    nquads = k // 128
    out = np.zeros(rows)
    for tile in range(rows // 16):
        base = tile * nquads * TILE
        red = np.zeros((4, 16))
        for warp in range(4):
            nmine = (nquads - warp + 3) // 4 if nquads > warp else 0
            acc = np.zeros((32, 2))
            for i in range(nmine):
                quad = warp + 4 * i
                off = base + quad * TILE
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    scales = copy[off + 1024 + g * 16 : off + 1024 + g * 16 + 16].copy().view(np.float16)
                    for h in range(2):
                        piece = (
                            copy[off + 512 * h + lane * 16 : off + 512 * h + lane * 16 + 16]
                            .copy()
                            .view(np.uint32)
                        )
                        for j in range(4):
                            kb = 4 * quad + j
                            word = int(piece[j])
                            ylo = qs[kb, 4 * t : 4 * t + 4]
                            yhi = qs[kb, 16 + 4 * t : 16 + 4 * t + 4]
                            sumi = dp4a(word & 0x0F0F0F0F, ylo) + dp4a((word >> 4) & 0x0F0F0F0F, yhi)
                            acc[lane, h] += float(scales[4 * h + j]) * (sumi * d[kb] - 2.0 * s[kb])
            for lane in range(0, 32, 4):  # the 4 lanes t of row pair g: shuffles xor 1, 2
                g = lane // 4
                for h in range(2):
                    red[warp, g + 8 * h] = acc[lane : lane + 4, h].sum()
        out[tile * 16 : tile * 16 + 16] = red.sum(axis=0)
    return out


@pytest.mark.parametrize("rows,k", [(16, 512), (32, 1024), (48, 2560), (16, 5120)])
def test_the_decode_kernel_on_the_copies_computes_the_product(rows, k):
    rng = np.random.default_rng(rows + k)
    w = q4_0_rows(rng, rows, k)
    x = rng.standard_normal(k)
    qs, d, s = q8_1(x)
    copy = repack(w, rows, k)
    np.testing.assert_allclose(
        emulate(copy, rows, k, qs, d, s), reference(w, rows, k, qs, d, s), rtol=1e-9, atol=1e-9
    )


def test_the_gate_takes_its_own_copy():
    """GATE: the up and gate copies summed separately, then the GLU (SwiGLU: x * silu(g))."""
    rng = np.random.default_rng(3)
    rows, k = 32, 1024
    up, gate = q4_0_rows(rng, rows, k), q4_0_rows(rng, rows, k)
    qs, d, s = q8_1(rng.standard_normal(k))
    x = emulate(repack(up, rows, k), rows, k, qs, d, s)
    gs = emulate(repack(gate, rows, k), rows, k, qs, d, s)
    got = x * gs / (1 + np.exp(-gs))
    want_x, want_g = reference(up, rows, k, qs, d, s), reference(gate, rows, k, qs, d, s)
    np.testing.assert_allclose(got, want_x * want_g / (1 + np.exp(-want_g)), rtol=1e-9, atol=1e-9)


def test_a_whole_block_offset_per_lane_fails():
    """The offset must be split over the row's 4 lanes: 8 d s in every lane counts it four times."""
    rng = np.random.default_rng(9)
    rows, k = 16, 512
    w = q4_0_rows(rng, rows, k)
    qs, d, s = q8_1(rng.standard_normal(k))
    right = emulate(repack(w, rows, k), rows, k, qs, d, s)
    wrong = emulate(repack(w, rows, k), rows, k, qs, d, 4 * s)  # as if each lane subtracted 8 d s
    want = reference(w, rows, k, qs, d, s)
    np.testing.assert_allclose(right, want, rtol=1e-9, atol=1e-9)
    assert not np.allclose(wrong, want)
