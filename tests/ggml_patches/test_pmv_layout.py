"""The persistent one-column kernel (mc_pmv_q4_0, patch 0031): a byte-level emulation of how its lanes
read a stage, with the word indices, the byte selector and the block indices taken from mc-mmv.cu.
A lane reads a pair of Q4_0 blocks (36 bytes from an even block) as nine 32-bit words
(mc_q4_0_unpack2), and the pair's q8_1 activations (72 bytes) as nine 64-bit words
(mc_load_q8_1_pair). Weights: the first block's quants are bytes 2..5 of words i, i + 1
(__byte_perm), its scale the low half of word 0; the second block's quants are words 5..8, its scale
the high half of word 4. Activations: 18 32-bit words ds0, qs0 (8), ds1, qs1 (8). The emulation must
give every block's 16 quant bytes and scale as ggml lays out block_q4_0 (half d, uint8 qs[16]), every
q8_1 block's quant words and (d, s) as block_q8_1 lays them out, every block of a row to exactly one
lane of the row's warps, the 32 lanes' loads of one instruction in 32 different banks, and the row's
product equal to a float64 product of the dequantized row and activations. This machine has no GPU:
the GPU run compares the kernel itself against the CPU backend (test-backend-ops MUL_MAT /
MUL_MAT_VEC_FUSION / MC_MUL_MAT_GROUP under MC_MMV_PERSIST=1)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.ggml_patches.test_cuda_kernels import KERNEL_HEAD, c_body

BLOCK = 18  # block_q4_0: half d, uint8 qs[16]
J = 6  # MC_PMV_J
WARP = 32


@pytest.fixture(scope="module")
def layout(patched) -> dict:
    """The kernel's reads as written in mc-mmv.cu: the selector, the words of each part, the lane's
    pairs (any change to them must be made here too, and pass)."""
    source = (patched / "ggml/src/ggml-cuda/mc-mmv.cu").read_text()
    unpack = c_body(source, "static __device__ __forceinline__ void mc_q4_0_unpack2(")
    sel = re.search(r"v0\[i\] = \(int\) __byte_perm\(x\[i\], x\[i \+ 1\], (0x[0-9a-fA-F]+)\);", unpack)
    assert sel, unpack
    assert "v1[i] = (int) x[5 + i];" in unpack
    assert "(unsigned short) (x[0] & 0xFFFFu)" in unpack and "(unsigned short) (x[4] >> 16)" in unpack
    assert "for (int i = 0; i < 9; ++i) {\n        x[i] = w[i];" in unpack
    kernel = c_body(source, KERNEL_HEAD)
    assert "const int kb = 2 * (q * WARP_SIZE + lane + WARP_SIZE * wpr * jp);" in kernel
    assert "mc_q4_0_unpack2(wrow + kb * mc_q4_0_bytes, v0, v1, d0, d1);" in kernel
    # the activations from global memory into registers, or (YS) from shared memory at each pair
    in_registers = "mc_load_q8_1_pair<false>(a.y + kb, u[2 * jp], ds[2 * jp], u[2 * jp + 1], ds[2 * jp + 1]);"
    assert in_registers in kernel
    assert "mc_load_q8_1_pair<true>(ys + kb, y0, e0, y1, e1);" in kernel
    assert "#define MC_PMV_J 6 " in source
    load = c_body(source, "static __device__ __forceinline__ void mc_load_q8_1_pair(")
    assert "for (int k = 0; k < 9; ++k) {\n        const uint2 v = SHARED ? p[k] : __ldg(p + k);" in load
    assert "w[2 * k]      = (int) v.x;" in load and "w[2 * k + 1]  = (int) v.y;" in load
    u = re.search(r"u0\[i\] = w\[(\d+) \+ i\];\s+u1\[i\] = w\[(\d+) \+ i\];", load)
    d = re.findall(r"ds(\d) = __half22float2\(\*\(const half2 \*\) &w\[(\d+)\]\);", load)
    assert u and len(d) == 2, load
    return {
        "selector": int(sel.group(1), 16),
        "u": (int(u.group(1)), int(u.group(2))),
        "ds": {int(b): int(w) for b, w in d},
    }


def byte_perm(x: int, y: int, s: int) -> int:
    """__byte_perm(x, y, s) (CUDA math API): byte n of the result is byte (s >> 4n) & 7 of y:x."""
    pool = (x & 0xFFFFFFFF) | ((y & 0xFFFFFFFF) << 32)
    return sum(((pool >> (8 * ((s >> (4 * n)) & 7))) & 0xFF) << (8 * n) for n in range(4))


def unpack2(row: np.ndarray, kb: int, selector: int):
    """mc_q4_0_unpack2 at block kb of row (bytes): nine little-endian words from byte 18 kb."""
    off = kb * BLOCK
    assert off % 4 == 0  # an even block: the words are aligned
    x = [int(v) for v in row[off : off + 36].view("<u4")]
    v0 = [byte_perm(x[i], x[i + 1], selector) for i in range(4)]
    v1 = [x[5 + i] for i in range(4)]
    d0 = np.array([x[0] & 0xFFFF], np.uint16).view(np.float16)[0]
    d1 = np.array([x[4] >> 16], np.uint16).view(np.float16)[0]
    return v0, v1, float(d0), float(d1), [off // 4 + i for i in range(9)]


def load_q8_1_pair(y: np.ndarray, kb: int, layout: dict):
    """mc_load_q8_1_pair at block kb of y (bytes of block_q8_1: half2 ds = (d, s), int8 qs[32]): nine
    64-bit words from byte 36 kb, as 18 32-bit words, the source's word indices."""
    off = kb * 36
    assert off % 8 == 0  # an even block where y is 8-byte aligned: whole 64-bit words
    w = y[off : off + 72].view("<u8")
    words = [int(v) >> (32 * h) & 0xFFFFFFFF for v in w for h in (0, 1)]
    u = [[words[layout["u"][b] + i] for i in range(8)] for b in (0, 1)]
    half2 = [np.array([words[layout["ds"][b]]], np.uint32).view(np.float16) for b in (0, 1)]
    ds = [h.astype(float).tolist() for h in half2]
    return u, ds


def test_the_activation_pairs_are_the_blocks_words(layout):
    """Every lane's two q8_1 blocks: the quants as 8 int words each (qs bytes 4 i..4 i + 3) and (d, s)."""
    rng = np.random.default_rng(3)
    nblocks = 544
    y = np.zeros((nblocks, 36), np.uint8)
    y[:, 0:4] = (rng.random((nblocks, 2)) - 0.5).astype(np.float16).view(np.uint8).reshape(nblocks, 4)
    y[:, 4:] = rng.integers(0, 256, (nblocks, 32), dtype=np.uint8)
    flat = y.reshape(-1)
    for kb in range(0, nblocks, 2):
        u, ds = load_q8_1_pair(flat, kb, layout)
        for b in (0, 1):
            assert u[b] == [int(v) for v in y[kb + b, 4:].view("<u4")], (kb, b)
            assert ds[b] == y[kb + b, 0:4].view(np.float16).astype(float).tolist(), (kb, b)


def q4_0_row(rng: np.random.Generator, nblocks: int) -> np.ndarray:
    b = np.zeros((nblocks, BLOCK), np.uint8)
    b[:, 0:2] = (rng.random(nblocks) * 0.02 + 0.001).astype(np.float16).view(np.uint8).reshape(nblocks, 2)
    b[:, 2:] = rng.integers(0, 256, (nblocks, 16), dtype=np.uint8)
    return b.reshape(-1)


@pytest.mark.parametrize(("k", "wpr"), [(5120, 1), (6144, 2), (5120, 2), (17408, 4)])
def test_every_lane_reads_its_blocks_whole_and_conflict_free(layout, k, wpr):
    """K = 5,120 / 6,144 / 17,408 with a row on 1, 2 or 4 warps (8-, 4- and 2-row pieces)."""
    rng = np.random.default_rng(k + wpr)
    nblocks = k // 32
    row = q4_0_row(rng, nblocks)
    blocks = row.reshape(nblocks, BLOCK)
    seen = np.zeros(nblocks, int)
    for q in range(wpr):
        for jp in range(J // 2):
            words = []
            for lane in range(WARP):
                kb = 2 * (q * WARP + lane + WARP * wpr * jp)
                if kb >= nblocks:
                    continue
                v0, v1, d0, d1, w = unpack2(row, kb, layout["selector"])
                for blk, v, d in ((kb, v0, d0), (kb + 1, v1, d1)):
                    want = blocks[blk, 2:].view("<u4")
                    assert [int(a) for a in want] == v, (k, wpr, blk)
                    assert d == float(blocks[blk, 0:2].view(np.float16)[0])
                    seen[blk] += 1
                words.append(w)
            for i in range(9):  # one load instruction: word i of every active lane
                banks = [w[i] % 32 for w in words]
                assert len(set(banks)) == len(banks), (k, wpr, q, jp, i)
    assert (seen == 1).all(), np.flatnonzero(seen != 1)[:8]


def test_the_row_product_matches_float64(layout):
    """mc_q4_0_dot on the unpacked words with q8_1 activations (d * sum(q), the - 8 * sum(y) offset term)
    summed over the row's blocks equals the float64 product of the dequantized row (x = d (q - 8),
    block_q4_0's nibble order: low nibbles values 0..15, high 16..31) and the q8_1 activations."""
    rng = np.random.default_rng(7)
    nblocks = 160
    row = q4_0_row(rng, nblocks)
    blocks = row.reshape(nblocks, BLOCK)
    qy = rng.integers(-127, 128, (nblocks, 32)).astype(np.int64)
    dy = rng.random(nblocks) * 0.05
    total = 0.0
    for kb in range(0, nblocks, 2):
        v0, v1, d0, d1, _ = unpack2(row, kb, layout["selector"])
        for blk, v, d in ((kb, v0, d0), (kb + 1, v1, d1)):
            sumi = 0
            for i in range(4):
                lo = [(v[i] >> (8 * n)) & 0x0F for n in range(4)]
                hi = [(v[i] >> (8 * n + 4)) & 0x0F for n in range(4)]
                sumi += sum(a * b for a, b in zip(lo, qy[blk, 4 * i : 4 * i + 4], strict=True))
                sumi += sum(a * b for a, b in zip(hi, qy[blk, 16 + 4 * i : 16 + 4 * i + 4], strict=True))
            total += d * (sumi * dy[blk] - 8.0 * dy[blk] * qy[blk].sum())
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float64)[:, 0]
    qs = blocks[:, 2:].astype(np.int64)
    x = np.concatenate([(qs & 15) - 8, (qs >> 4) - 8], axis=1) * d[:, None]
    want = float((x * (qy * dy[:, None])).sum())
    assert total == pytest.approx(want, rel=1e-9)
