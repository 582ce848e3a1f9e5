"""MC_MMH_REPACK (patch 0015): a byte-level emulation of the repacked tensor-core kernel's data
movement, transcribed from mc-mmv.cu: the repack of Q4_0 rows into 1,152-byte tiles
(mc_mmr_repack), the activations' f16 fragment order (mc_mmr_convert_y), every thread's 16-byte
copies into its shared-memory slots (addresses as mc_mmr_q4_0 computes them: wsrc, ssrc, ysrc and the
per-chunk offsets) or, MC_MMR_FORM=3, a warp's bulk copies of whole tiles and of its activations, the
reads back at the kernel's offsets, the nibble expansion, the m16n8k16 fragment layouts (PTX ISA),
the sums over warps and K slices. The result must equal a float64 product of the dequantized weights
and the f16-rounded activations. This machine has no GPU: the GPU run compares the kernel itself
against the CPU backend (test-backend-ops with MC_MMH_REPACK=2)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.ggml_patches.test_cuda_kernels import assert_statements, c_body, mmr_kernel

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


def repack(src: np.ndarray, rows: int, k: int, qmajor: bool = False) -> np.ndarray:
    """mc_mmr_repack, piece by piece: layout 0 (tile (mt, q) at mt * nquads + q) or, qmajor, layout 2
    (patch 0038, MC_MMR_QMAJOR: at q * nmt + mt)."""
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
        at = ((q * (rows // 16) + mt) if qmajor else tile) * TILE + p * 16
        dst[at : at + 16] = out
    return dst


def convert_y(x: np.ndarray, ncp: int) -> np.ndarray:
    """mc_mmr_convert_y: x is [ncols, k] f32; returns the f16 buffer as bytes."""
    ncols, k = x.shape
    nblocks = k // 32
    y = np.zeros(nblocks * ncp * 4 * 8, np.float16)
    for i in range(nblocks * ncp * 4):
        t, c, b = i % 4, i // 4 % ncp, i // (4 * ncp)
        if c < ncols:
            xb = x[c, b * 32 + 4 * t :]
            y[i * 8 : i * 8 + 8] = [xb[0], xb[2], xb[1], xb[3], xb[16], xb[18], xb[17], xb[19]]
    return y.view(np.uint8)


def expand(word: int) -> tuple[list[float], list[float]]:
    """mc_mmh_expand: lo[0] = bytes 0, 2 low nibbles, lo[1] = bytes 1, 3; hi the high nibbles; q - 8."""
    b = [(word >> (8 * i)) & 255 for i in range(4)]
    lo = [[(b[0] & 15) - 8, (b[2] & 15) - 8], [(b[1] & 15) - 8, (b[3] & 15) - 8]]
    hi = [[(b[0] >> 4) - 8, (b[2] >> 4) - 8], [(b[1] >> 4) - 8, (b[3] >> 4) - 8]]
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


def chunk(
    st: np.ndarray, yst: np.ndarray, nmt: int, nt: int, q_at: int, sc0: int, sc_m: int, acc: np.ndarray
):
    """mc_mmr_chunk_y: a warp's chunk from its stage st (row tile m's quants at m * q_at, its scales
    at sc0 + g * 16 + m * sc_m) and the activations yst (piece j * nt + n at 512 bytes each) into
    acc [m][n][lane][i]."""
    for m in range(nmt):
        a_lo: dict[int, list] = {j: [] for j in range(4)}
        a_hi: dict[int, list] = {j: [] for j in range(4)}
        dd: dict[int, list] = {j: [] for j in range(4)}
        for lane in range(32):
            g = lane // 4
            w0 = st[m * q_at + lane * 16 :][:16].view(np.uint32)
            w1 = st[m * q_at + 512 + lane * 16 :][:16].view(np.uint32)
            sc = st[sc0 + g * 16 + m * sc_m :][:16].view(np.float16).astype(np.float64)
            # d[j] = (row g, row g + 8): sc.x = (g: j0, j1), .y = (g: j2, j3), .z / .w: g + 8
            for j in range(4):
                lo0, hi0 = expand(int(w0[j]))
                lo1, hi1 = expand(int(w1[j]))
                a_lo[j].append([lo0[0], lo1[0], lo0[1], lo1[1]])
                a_hi[j].append([hi0[0], hi1[0], hi0[1], hi1[1]])
                dd[j].append((sc[j], sc[4 + j]))
        for j in range(4):
            for n in range(nt):
                at = (j * nt + n) * 512
                bf = [yst[at + lane * 16 :][:16].view(np.float16).astype(np.float64) for lane in range(32)]
                cs_lo = mma(a_lo[j], [[(b[0], b[1]), (b[2], b[3])] for b in bf])
                cs_hi = mma(a_hi[j], [[(b[4], b[5]), (b[6], b[7])] for b in bf])
                for lane in range(32):
                    d0, d1 = dd[j][lane]
                    cs = np.add(cs_lo[lane], cs_hi[lane])
                    acc[m, n, lane] += [d0 * cs[0], d0 * cs[1], d1 * cs[2], d1 * cs[3]]


def blocks(rows: int, tile_rows: int, nunits: int, ks: int):
    """The grid (row tiles of tile_rows, ks K slices of nunits chunks) as the launcher cuts it:
    (row0, nr, slice, c_begin, nchunks) for each block."""
    per = (nunits + ks - 1) // ks
    for row0 in range(0, rows, tile_rows):
        for slice_ in range(ks):
            c_begin = slice_ * per
            yield row0, min(tile_rows, rows - row0), slice_, c_begin, min(nunits, c_begin + per) - c_begin


def c_place(lane: int, i: int) -> tuple[int, int]:
    """Where C fragment element i of a lane lies in its 16 x 8 tile: (row, column)."""
    g, t = lane // 4, lane % 4
    return g + (8 if i >= 2 else 0), 2 * t + (i & 1)


def reduce_warps(acc: np.ndarray, out: np.ndarray, row0: int, nr: int, ncols: int):
    """mc_mmq_reduce_warps: the warps' sums acc [warp][m][n][lane][i] added into out [col, row] at
    row row0 + m * 16 + g (+ 8), column n * 8 + 2 t + (i & 1), within nr rows and ncols columns."""
    for m in range(nr // 16):
        for n in range(acc.shape[2]):
            for lane in range(32):
                for i in range(4):
                    r, col = c_place(lane, i)
                    r, col = m * 16 + r, n * 8 + col
                    if col < ncols and r < nr:
                        out[col, row0 + r] += acc[:, m, n, lane, i].sum()


def run_kernel(
    copy: np.ndarray,
    ybytes: np.ndarray,
    rows: int,
    k: int,
    ncols: int,
    nt: int,
    ks: int,
    bulk: bool = False,
    qmajor: bool = False,
) -> np.ndarray:
    """mc_mmr_q4_0 with one product, grid (row tiles, ks K slices); returns dst [ncols, rows]. bulk:
    MC_MMR_FORM=3 (lane 0 copies each row tile and the warp's activations as spans), else every
    thread copies its own 16-byte pieces into its own slots. qmajor: MC_FLAG_QMAJOR, the copies in
    layout 2 (the row tiles of a quad one tile apart; bulk: the block's row tiles one copy)."""
    ncp = 8 * nt
    nquads = k // 128
    mt_stride = TILE if qmajor else nquads * TILE  # between the row tiles of a quad
    q_stride = rows // 16 * TILE if qmajor else TILE  # between the quads of a row tile
    y_chunk = 16 * ncp * 64
    warp_stage = (9 + 4 * nt) * 512
    partial = np.zeros((ks, ncols, rows))
    for row0, nr, slice_, c_begin, nchunks in blocks(rows, ROWS, nquads // 4, ks):
        nmt = nr // 16
        acc = np.zeros((WARPS, WARPS, nt, 32, 4))  # [warp][m][n][lane][i]
        for c in range(nchunks):
            for warp in range(WARPS):
                st = np.zeros(warp_stage, np.uint8)  # this warp's stage
                wsrc0 = (row0 // 16) * mt_stride + (4 * c_begin + warp) * q_stride  # + lane * 16
                ysrc0 = (4 * c_begin + warp) * 4 * ncp * 64
                if bulk and qmajor:  # one run of the block's nmt row tiles
                    w = wsrc0 + c * 4 * q_stride
                    st[: nmt * TILE] = copy[w : w + nmt * TILE]
                    yc = ysrc0 + c * y_chunk
                    st[4 * TILE : 4 * TILE + 4 * nt * 512] = ybytes[yc : yc + 4 * nt * 512]
                elif bulk:
                    w = wsrc0 + c * 4 * q_stride
                    for m in range(nmt):
                        st[m * TILE : (m + 1) * TILE] = copy[w + m * mt_stride : w + m * mt_stride + TILE]
                    yc = ysrc0 + c * y_chunk
                    st[4 * TILE : 4 * TILE + 4 * nt * 512] = ybytes[yc : yc + 4 * nt * 512]
                else:
                    for lane in range(32):
                        mine = lane * 16
                        wsrc = wsrc0 + lane * 16
                        sm = lane // 8
                        ssrc = wsrc - lane * 16 + sm * mt_stride + 1024 + (lane % 8) * 16
                        ysrc = ysrc0 + lane * 16
                        w = wsrc + c * 4 * q_stride
                        for m in range(4):
                            if m < nmt:
                                for h in range(2):
                                    a0 = w + m * mt_stride + 512 * h
                                    st[mine + (2 * m + h) * 512 :][:16] = copy[a0 : a0 + 16]
                        if sm < nmt:
                            a0 = ssrc + c * 4 * q_stride
                            st[mine + 8 * 512 :][:16] = copy[a0 : a0 + 16]
                        for j in range(4):
                            for n in range(nt):
                                a0 = ysrc + c * y_chunk + j * ncp * 64 + n * 512
                                st[mine + (9 + j * nt + n) * 512 :][:16] = ybytes[a0 : a0 + 16]
                # the reads, at the kernel's offsets (Q_AT, SC_AT, SC_M, Y_AT), and the arithmetic
                q_at, sc_m, y_at = (TILE, TILE, 4 * TILE) if bulk else (1024, 128, 9 * 512)
                sc0 = 1024 if bulk else 8 * 512
                chunk(st, st[y_at:], nmt, nt, q_at, sc0, sc_m, acc[warp])
        reduce_warps(acc, partial[slice_], row0, nr, ncols)
    return partial.sum(axis=0)


@pytest.mark.parametrize("qmajor", [False, True])
@pytest.mark.parametrize("bulk", [False, True])
@pytest.mark.parametrize(
    ("rows", "k", "ncols", "ks"),
    [(80, 1024, 12, 1), (48, 1024, 6, 2), (64, 512, 16, 1)],
)
def test_the_repacked_kernel_computes_the_product(rows, k, ncols, ks, bulk, qmajor):
    rng = np.random.default_rng(rows + k + ncols)
    w = q4_0_rows(rng, rows, k)
    x = rng.standard_normal((ncols, k)).astype(np.float32)
    nt = 1 if ncols <= 8 else 2
    copy = repack(w, rows, k, qmajor)
    got = run_kernel(copy, convert_y(x, 8 * nt), rows, k, ncols, nt, ks, bulk, qmajor)
    want = x.astype(np.float16).astype(np.float64) @ dequant(w, rows, k).T
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("qmajor", [False, True])
def test_the_repack_moves_every_byte_once(qmajor):
    """The tiles are a permutation of the matrix's bytes: same size, same multiset of bytes; in
    layout 2 the same tiles as in layout 0, each at q * nmt + mt instead of mt * nquads + q."""
    rng = np.random.default_rng(7)
    rows, k = 48, 1024
    w = q4_0_rows(rng, rows, k)
    r = repack(w, rows, k, qmajor)
    assert r.size == w.size
    assert np.array_equal(np.sort(r), np.sort(w.reshape(-1)))
    if qmajor:
        nmt, nquads = rows // 16, k // 128
        tiles0 = repack(w, rows, k).reshape(nmt, nquads, TILE)
        assert np.array_equal(r.reshape(nquads, nmt, TILE), tiles0.transpose(1, 0, 2))


def ksplit_finish(partials: np.ndarray, ncols: int, nrows: int, row0: int, nr: int, e_n: int, u_n: int):
    """mc_mmq_ksplit_finish's read-back as patch 0026 writes it (the tile's last CTA, 128 threads):
    thread tid takes outputs i0 + e * 128 (e < E) from i0 = tid in steps of E * 128, output i being
    column i / nr, row i % nr; it loads U slices' partials of its E outputs, then adds them slice by
    slice into sums from zero. Returns dst (columns x nrows, NaN where not written) and, per output,
    the slices in the order they were added."""
    ks = partials.shape[0]
    dst = np.full((ncols, nrows), np.nan, np.float32)
    order: dict[tuple[int, int], list[int]] = {}
    flat = partials.reshape(ks, -1)
    for tid in range(128):
        for i0 in range(tid, ncols * nr, e_n * 128):
            outs = []
            for e in range(e_n):
                i = i0 + e * 128
                outs.append((i // nr, i - (i // nr) * nr) if i < ncols * nr else None)
            x = [np.float32(0)] * e_n
            for s0 in range(0, ks, u_n):
                v = [
                    [
                        flat[s0 + u, o[0] * nrows + row0 + o[1]] if s0 + u < ks and o else np.float32(0)
                        for o in outs
                    ]
                    for u in range(u_n)
                ]
                for u in range(u_n):
                    for e, o in enumerate(outs):
                        if s0 + u < ks:
                            x[e] = np.float32(x[e] + v[u][e])
                            if o:
                                order.setdefault(o, []).append(s0 + u)
            for e, o in enumerate(outs):
                if o:
                    assert np.isnan(dst[o[0], row0 + o[1]]), "written twice"
                    dst[o[0], row0 + o[1]] = x[e]
    return dst, order


@pytest.mark.parametrize(
    ("ncols", "nr", "ks"), [(16, 64, 3), (12, 48, 5), (9, 16, 2), (16, 64, 8), (1, 64, 4)]
)
def test_the_batched_read_back_writes_each_output_once_in_slice_order(ncols, nr, ks):
    """Patch 0026: every output of the tile written once, its slices added in order 0..ks-1 from
    zero, so the sums equal the one-output-one-slice loop's to the bit (run AL: logits unchanged);
    rows outside the tile untouched."""
    rng = np.random.default_rng(ncols * 100 + nr + ks)
    nrows, row0 = 160, 64
    partials = rng.standard_normal((ks, ncols, nrows)).astype(np.float32)
    dst, order = ksplit_finish(partials, ncols, nrows, row0, nr, 4, 4)
    ref = np.zeros((ncols, nrows), np.float32)
    for s in range(ks):  # the (1, 1) loop: one slice at a time, in order, in f32
        ref = (ref + partials[s]).astype(np.float32)
    tile = dst[:, row0 : row0 + nr]
    assert np.array_equal(tile, ref[:, row0 : row0 + nr])
    assert np.isnan(np.delete(dst, np.s_[row0 : row0 + nr], axis=1)).all()
    assert len(order) == ncols * nr and all(v == list(range(ks)) for v in order.values())


def test_the_source_reads_the_copies_as_emulated(patched):
    """Patch 0038 (MC_MMR_QMAJOR): the statements the emulation above transcribes for layout 2, as the
    kernel, the repack and the launchers have them; the copies are made in the layout the launches read."""
    source, kernel = mmr_kernel(patched)
    assert_statements(
        kernel,
        (
            "const bool    qmajor    = (flags & MC_FLAG_QMAJOR) != 0;",
            "const int64_t mt_stride = qmajor ? MC_MMR_TILE_BYTES : (int64_t) nquads * MC_MMR_TILE_BYTES;",
            "qmajor ? (int64_t) (mc_pick(grp.nrows, seg) / 16) * MC_MMR_TILE_BYTES : MC_MMR_TILE_BYTES;",
            "(int64_t) (4 * c_begin + warp) * q_stride + lane * 16;",
            "const char * w = wtile + c * 4 * q_stride;",
            "mc_bulk_copy_at(wstage + s * STAGE, w, nmt * MC_MMR_TILE_BYTES, bars + 8 * s);",
            "const char * w = wsrc + c * 4 * q_stride;",
            "mc_copy16(mine + s * STAGE + 8 * 512, ssrc + c * 4 * q_stride);",
        ),
    )
    assert "at = (int64_t) q * nmt + mt;" in c_body(source, "static __global__ void mc_mmr_repack(")
    assert "#define MC_FLAG_QMAJOR 4" in source and 'mc_env_int("MC_MMR_QMAJOR", 0, 1, 1)' in source
    start = c_body(source, "static void mc_mmr_start(")
    assert "flags | (mc_mmr_qmajor() ? MC_FLAG_QMAJOR : 0));" in start
    # the copies: layout 1 for the warpgroup form (which then runs every launch), else 2 where set
    assert "mc_mmw_on(ctx.device) ? 1 : (mc_mmr_qmajor() ? 2 : 0));" in source
    lab = (Path(__file__).resolve().parents[2] / "bench" / "gpu" / "mmr_lab.cu").read_text()
    assert "wgmma ? 1 : (mc_mmr_qmajor() ? 2 : 0));" in lab
