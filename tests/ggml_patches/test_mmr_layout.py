"""MC_MMH_REPACK (patch 0015): a byte-level emulation of the repacked tensor-core kernel's data
movement, transcribed from mc-mmv.cu: the repack of Q4_0 rows into 1,152-byte tiles
(mc_mmr_repack), the activations' f16 fragment order (mc_mmr_convert_y), every thread's 16-byte
copies into its shared-memory slots (addresses as mc_mmr_q4_0 computes them: wsrc, ssrc, ysrc and the
per-chunk offsets) or, MC_MMR_FORM=3, a warp's bulk copies of whole tiles and of its activations, the
reads back at the kernel's offsets, the nibble expansion, the m16n8k16 fragment layouts (PTX ISA),
the sums over warps and K slices. The result must equal a float64 product of the dequantized weights
and the f16-rounded activations. MC_MMR_OFFSET (patch 0020, with the bulk copies): the weights enter
the MMAs raw (1024 + q, 1024 + 16 q), the activations' high halves are stored divided by 16, and
each block's first MMA starts at the f32 correction that mc_mmr_convert_y writes after the
activations. This machine has no GPU: the GPU run compares the kernel itself
against the CPU backend (test-backend-ops with MC_MMH_REPACK=2)."""

from __future__ import annotations

import numpy as np
import pytest

TILE = 1152
ROWS = 64  # MC_MMQ_ROWS
WARPS = 4


def q4_0_rows(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    """Random Q4_0 rows as bytes: per block a little-endian f16 scale, then 16 qs bytes."""
    nb = k // 32
    out = np.zeros((rows, nb * 18), np.uint8)
    d = (rng.random((rows, nb)) * 0.1 + 0.01).astype(np.float16)
    qs = rng.integers(0, 256, (rows, nb, 16), dtype=np.uint8)
    blocks = out.reshape(rows, nb, 18)
    blocks[:, :, 0:2] = d.view(np.uint8).reshape(rows, nb, 2)
    blocks[:, :, 2:] = qs
    return out


def dequant(w: np.ndarray, rows: int, k: int) -> np.ndarray:
    b = w.reshape(rows, k // 32, 18)
    d = b[:, :, 0:2].copy().view(np.float16).astype(np.float64)[:, :, 0]
    qs = b[:, :, 2:].astype(np.int64)
    vals = np.concatenate([qs & 15, qs >> 4], axis=2) - 8  # element j: low nibble of byte j, j + 16: high
    return (vals * d[:, :, None]).reshape(rows, k)


def repack(src: np.ndarray, rows: int, k: int) -> np.ndarray:
    """mc_mmr_repack, piece by piece."""
    nquads = k // 128
    row_bytes = k // 32 * 18
    flat = src.reshape(-1)
    dst = np.zeros(rows * row_bytes, np.uint8)
    npieces = rows // 16 * nquads * 72
    for i in range(npieces):
        tile, p = divmod(i, 72)
        mt, q = divmod(tile, nquads)
        out = np.zeros(16, np.uint8)
        if p < 64:
            g, t = p % 32 // 4, p % 4
            row = (16 * mt + g + 8 * (p // 32)) * row_bytes + 4 * q * 18
            for j in range(4):
                for b in range(4):
                    out[4 * j + b] = flat[row + j * 18 + 2 + 4 * t + b]
        else:
            g = p - 64
            for h in range(2):
                row = (16 * mt + g + 8 * h) * row_bytes + 4 * q * 18
                for j in range(4):
                    out[8 * h + 2 * j : 8 * h + 2 * j + 2] = flat[row + j * 18 : row + j * 18 + 2]
        at = tile * TILE + p * 16
        dst[at : at + 16] = out
    return dst


def convert_y(x: np.ndarray, ncp: int, offset: bool = False) -> np.ndarray:
    """mc_mmr_convert_y: x is [ncols, k] f32; returns the f16 buffer as bytes. offset: the high
    halves divided by 16, and after the halves one f32 correction per (block, column), summed in f32
    over the 4 threads of a block and column as the kernel's two shuffles do."""
    ncols, k = x.shape
    nblocks = k // 32
    y = np.zeros(nblocks * ncp * 4 * 8, np.float16)
    part = np.zeros(nblocks * ncp * 4, np.float32)
    hs = np.float32(0.0625 if offset else 1.0)
    for i in range(nblocks * ncp * 4):
        t, c, b = i % 4, i // 4 % ncp, i // (4 * ncp)
        if c < ncols:
            xb = x[c, b * 32 + 4 * t :]
            lo, hi = [xb[0], xb[2], xb[1], xb[3]], [xb[16] * hs, xb[18] * hs, xb[17] * hs, xb[19] * hs]
            h = np.array(lo + hi, np.float16)
            y[i * 8 : i * 8 + 8] = h
            f = h.astype(np.float32)
            s_lo = (f[0] + f[1]) + (f[2] + f[3])
            s_hi = (f[4] + f[5]) + (f[6] + f[7])
            part[i] = -(np.float32(1032) * s_lo + np.float32(1152) * s_hi)
    if not offset:
        return y.view(np.uint8)
    p = part.reshape(-1, 4)  # lane t: s += s(t ^ 1); s += s(t ^ 2): lane 0 ends with (p0 + p1) + (p2 + p3)
    corr = ((p[:, 0] + p[:, 1]) + (p[:, 2] + p[:, 3])).astype(np.float32)
    return np.concatenate([y.view(np.uint8), corr.view(np.uint8)])


def expand(word: int) -> tuple[list[float], list[float]]:
    """mc_mmh_expand: lo[0] = bytes 0, 2 low nibbles, lo[1] = bytes 1, 3; hi the high nibbles; q - 8."""
    b = [(word >> (8 * i)) & 255 for i in range(4)]
    lo = [[(b[0] & 15) - 8, (b[2] & 15) - 8], [(b[1] & 15) - 8, (b[3] & 15) - 8]]
    hi = [[(b[0] >> 4) - 8, (b[2] >> 4) - 8], [(b[1] >> 4) - 8, (b[3] >> 4) - 8]]
    return lo, hi


def expand_raw(word: int) -> tuple[list[float], list[float]]:
    """mc_mmh_expand_raw: the same pairs as raw f16 operands, 1024 + q (low) and 1024 + 16 q (high)."""
    b = [(word >> (8 * i)) & 255 for i in range(4)]
    lo = [[1024 + (b[0] & 15), 1024 + (b[2] & 15)], [1024 + (b[1] & 15), 1024 + (b[3] & 15)]]
    hi = [[1024 + (b[0] & 0xF0), 1024 + (b[2] & 0xF0)], [1024 + (b[1] & 0xF0), 1024 + (b[3] & 0xF0)]]
    return lo, hi


def mma(a: list, b: list) -> list:
    """m16n8k16 over a warp: a[lane] = 4 registers of 2 values, b[lane] = 2 registers of 2 values;
    returns c[lane] = 4 sums (PTX ISA fragment layouts)."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for r, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
            A[row, col], A[row, col + 1] = a[lane][r]
        for r, kk in enumerate([2 * t, 2 * t + 8]):
            B[kk, g], B[kk + 1, g] = b[lane][r]
    C = A @ B
    out = []
    for lane in range(32):
        g, t = lane // 4, lane % 4
        out.append([C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]])
    return out


def run_kernel(
    copy: np.ndarray,
    ybytes: np.ndarray,
    rows: int,
    k: int,
    ncols: int,
    nt: int,
    ks: int,
    bulk: bool = False,
    offset: bool = False,
) -> np.ndarray:
    """mc_mmr_q4_0 with one product, grid (row tiles, ks K slices); returns dst [ncols, rows]. bulk:
    MC_MMR_FORM=3 (lane 0 copies each row tile and the warp's activations as spans), else every
    thread copies its own 16-byte pieces into its own slots. offset: MC_MMR_OFFSET (bulk only),
    the corrections copied as one more span after the stage's items."""
    assert bulk or not offset
    ncp = 8 * nt
    nquads = k // 128
    nchunks_all = nquads // 4
    per = (nchunks_all + ks - 1) // ks
    mt_stride = nquads * TILE
    y_chunk = 16 * ncp * 64
    cr_at = (9 + 4 * nt) * 512  # MC_MMR_ITEMS(NT) * 512
    cr_bytes = 4 * ncp * 4  # MC_MMR_CORR_BYTES(NT)
    warp_stage = cr_at + cr_bytes  # MC_MMR_WARP_STAGE(NT)
    corr_base = k // 32 * ncp * 64  # the corrections after the halves (bytes)
    partial = np.zeros((ks, ncols, rows))
    for tile in range((rows + ROWS - 1) // ROWS):
        row0 = tile * ROWS
        nr = min(ROWS, rows - row0)
        nmt = nr // 16
        for slice_ in range(ks):
            c_begin = slice_ * per
            nchunks = min(nchunks_all, c_begin + per) - c_begin
            acc = np.zeros((WARPS, WARPS, nt, 32, 4))  # [warp][m][n][lane][i]
            for c in range(nchunks):
                for warp in range(WARPS):
                    st = np.zeros(warp_stage, np.uint8)  # this warp's stage
                    wsrc0 = (row0 // 16) * mt_stride + (4 * c_begin + warp) * TILE  # + lane * 16
                    ysrc0 = (4 * c_begin + warp) * 4 * ncp * 64
                    if bulk:
                        w = wsrc0 + c * 4 * TILE
                        for m in range(nmt):
                            st[m * TILE : (m + 1) * TILE] = copy[w + m * mt_stride : w + m * mt_stride + TILE]
                        yc = ysrc0 + c * y_chunk
                        st[4 * TILE : 4 * TILE + 4 * nt * 512] = ybytes[yc : yc + 4 * nt * 512]
                        if offset:  # crwarp + c * CR_CHUNK
                            cc = corr_base + (4 * c_begin + warp) * 4 * ncp * 4 + c * 16 * ncp * 4
                            st[cr_at : cr_at + cr_bytes] = ybytes[cc : cc + cr_bytes]
                    else:
                        for lane in range(32):
                            mine = lane * 16
                            wsrc = wsrc0 + lane * 16
                            sm = lane // 8
                            ssrc = wsrc - lane * 16 + sm * mt_stride + 1024 + (lane % 8) * 16
                            ysrc = ysrc0 + lane * 16
                            w = wsrc + c * 4 * TILE
                            for m in range(4):
                                if m < nmt:
                                    for h in range(2):
                                        a0 = w + m * mt_stride + 512 * h
                                        st[mine + (2 * m + h) * 512 :][:16] = copy[a0 : a0 + 16]
                            if sm < nmt:
                                a0 = ssrc + c * 4 * TILE
                                st[mine + 8 * 512 :][:16] = copy[a0 : a0 + 16]
                            for j in range(4):
                                for n in range(nt):
                                    a0 = ysrc + c * y_chunk + j * ncp * 64 + n * 512
                                    st[mine + (9 + j * nt + n) * 512 :][:16] = ybytes[a0 : a0 + 16]
                    # the reads, at the kernel's offsets (Q_AT, SC_AT, SC_M, Y_AT), and the arithmetic
                    q_at, sc_m, y_at = (TILE, TILE, 4 * TILE) if bulk else (1024, 128, 9 * 512)
                    for m in range(nmt):
                        a_lo: dict[int, list] = {j: [] for j in range(4)}
                        a_hi: dict[int, list] = {j: [] for j in range(4)}
                        dd: dict[int, list] = {j: [] for j in range(4)}
                        for lane in range(32):
                            g = lane // 4
                            sc_at = (1024 if bulk else 8 * 512) + g * 16
                            w0 = st[m * q_at + lane * 16 :][:16].view(np.uint32)
                            w1 = st[m * q_at + 512 + lane * 16 :][:16].view(np.uint32)
                            sc = st[sc_at + m * sc_m :][:16].view(np.float16).astype(np.float64)
                            # d[j] = (row g, row g + 8): sc.x = (g: j0, j1), .y = (g: j2, j3), .z / .w: g + 8
                            for j in range(4):
                                lo0, hi0 = (expand_raw if offset else expand)(int(w0[j]))
                                lo1, hi1 = (expand_raw if offset else expand)(int(w1[j]))
                                a_lo[j].append([lo0[0], lo1[0], lo0[1], lo1[1]])
                                a_hi[j].append([hi0[0], hi1[0], hi0[1], hi1[1]])
                                dd[j].append((sc[j], sc[4 + j]))
                        for j in range(4):
                            for n in range(nt):
                                at = y_at + (j * nt + n) * 512
                                bf = [st[at + lane * 16 :][:16].view(np.float16).astype(np.float64)
                                      for lane in range(32)]  # fmt: skip
                                cs_lo = mma(a_lo[j], [[(b[0], b[1]), (b[2], b[3])] for b in bf])
                                cs_hi = mma(a_hi[j], [[(b[4], b[5]), (b[6], b[7])] for b in bf])
                                crs = st[cr_at:warp_stage].view(np.float32).astype(np.float64)
                                for lane in range(32):
                                    d0, d1 = dd[j][lane]
                                    cs = np.add(cs_lo[lane], cs_hi[lane])
                                    if offset:  # the first MMA's start: columns 8 n + 2 t, 8 n + 2 t + 1
                                        c0 = crs[j * ncp + 8 * n + 2 * (lane % 4) :][:2]
                                        cs = cs + np.array([c0[0], c0[1], c0[0], c0[1]])
                                    acc[warp, m, n, lane] += [d0 * cs[0], d0 * cs[1], d1 * cs[2], d1 * cs[3]]
            # mc_mmq_reduce_warps: row m * 16 + g (+ 8), column n * 8 + 2 t + (i & 1)
            for m in range(nmt):
                for n in range(nt):
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        for i in range(4):
                            r = m * 16 + g + (8 if i >= 2 else 0)
                            col = n * 8 + 2 * t + (i & 1)
                            if col < ncols and r < nr:
                                partial[slice_, col, row0 + r] += acc[:, m, n, lane, i].sum()
    return partial.sum(axis=0)


@pytest.mark.parametrize("bulk", [False, True])
@pytest.mark.parametrize(
    ("rows", "k", "ncols", "ks"),
    [(80, 1024, 12, 1), (48, 1024, 6, 2), (64, 512, 16, 1)],
)
def test_the_repacked_kernel_computes_the_product(rows, k, ncols, ks, bulk):
    rng = np.random.default_rng(rows + k + ncols)
    w = q4_0_rows(rng, rows, k)
    x = rng.standard_normal((ncols, k)).astype(np.float32)
    nt = 1 if ncols <= 8 else 2
    got = run_kernel(repack(w, rows, k), convert_y(x, 8 * nt), rows, k, ncols, nt, ks, bulk)
    want = x.astype(np.float16).astype(np.float64) @ dequant(w, rows, k).T
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)


def offset_activations(x: np.ndarray) -> np.ndarray:
    """The activations as MC_MMR_OFFSET's MMAs see them: elements 0..15 of each block f16-rounded,
    16..31 as 16 x f16(y / 16) (the same but below f16's normal range)."""
    y = x.astype(np.float16).astype(np.float64)
    hi = (x.reshape(x.shape[0], -1, 32)[:, :, 16:] * np.float32(0.0625)).astype(np.float16)
    y.reshape(x.shape[0], -1, 32)[:, :, 16:] = hi.astype(np.float64) * 16
    return y


@pytest.mark.parametrize(
    ("rows", "k", "ncols", "ks"),
    [(80, 1024, 12, 1), (48, 1024, 6, 2), (64, 512, 16, 1), (16, 512, 1, 1)],
)
def test_the_offset_form_computes_the_product(rows, k, ncols, ks):
    """MC_MMR_OFFSET: raw operands, each block's first MMA started at its f32 correction. Against the
    float64 product the only error left is the corrections' f32 rounding (~1e-7 of ~1,000 x a
    block's activation sums): a few 1e-6 of the result at most."""
    rng = np.random.default_rng(rows + k + ncols + 1)
    w = q4_0_rows(rng, rows, k)
    x = rng.standard_normal((ncols, k)).astype(np.float32)
    x[:, ::97] *= 1e-4  # some activations below f16's normal range once divided by 16
    nt = 1 if ncols <= 8 else 2
    yb = convert_y(x, 8 * nt, offset=True)
    assert yb.size == k // 32 * 8 * nt * (64 + 4)
    got = run_kernel(repack(w, rows, k), yb, rows, k, ncols, nt, ks, bulk=True, offset=True)
    want = offset_activations(x) @ dequant(w, rows, k).T
    scale = np.abs(x.astype(np.float64)) @ np.abs(dequant(w, rows, k)).T  # the sums' magnitude
    assert np.all(np.abs(got - want) <= 2e-6 * scale), np.max(np.abs(got - want) / scale)
    # and without the corrections the sums are off by ~1,000 x the activations' block sums
    bad = run_kernel(repack(w, rows, k), np.concatenate([yb[: yb.size - k // 32 * 8 * nt * 4],
                                                         np.zeros(k // 32 * 8 * nt * 4, np.uint8)]),
                     rows, k, ncols, nt, ks, bulk=True, offset=True)  # fmt: skip
    assert np.max(np.abs(bad - want) / scale) > 1.0


def test_the_repack_moves_every_byte_once():
    """The tiles are a permutation of the matrix's bytes: same size, same multiset of bytes."""
    rng = np.random.default_rng(7)
    w = q4_0_rows(rng, 32, 512)
    r = repack(w, 32, 512)
    assert r.size == w.size
    assert np.array_equal(np.sort(r), np.sort(w.reshape(-1)))
