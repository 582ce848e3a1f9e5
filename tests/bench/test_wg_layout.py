"""bench/gpu/wg_lab.cu's index arithmetic, emulated in NumPy: the weights' repacking, the activations'
core-matrix layout, the byte selectors and nibble expansion of the A fragments, and the MMA as the PTX
ISA documents its operands (A: the m16k16 fragment of each warp; B: core matrices of 8 x 16 bytes
addressed by the descriptor's K-direction (leading) and N-direction (stride) byte offsets; D: rows
g / g + 8, columns 2t, 2t + 1 of each 8) must give W x for one 64-row tile over several blocks; and
patch 0025's library form, which reads the same operands out of the copies' tiles (mc_mmr_repack's
layout, in its interleaved order). What only the GPU can tell (that the hardware reads the operands
this way) the lab checks against a host reference on the H200; this test keeps the arithmetic both
rely on honest."""

from __future__ import annotations

import numpy as np

TILE_ROWS, TILE_BYTES, B_BYTES, COLS = 64, 1152, 1024, 16
LBO, SBO = 128, 256  # the lab's first choice: K-direction core stride, N-direction core stride


def phys_k(kk: int) -> int:
    t, h, e = (kk % 8) // 2, kk // 8, kk % 2
    return 4 * t + 2 * h + e


def repack(qs: np.ndarray, d: np.ndarray) -> np.ndarray:
    """qs [rows, nkb, 16] uint8, d [rows, nkb] float16 -> the lab's tiles, as wg_repack writes them."""
    rows, nkb, _ = qs.shape
    out = np.zeros(((rows + 63) // 64) * nkb * TILE_BYTES, np.uint8)
    for rt in range((rows + 63) // 64):
        for kb in range(nkb):
            tile = out[(rt * nkb + kb) * TILE_BYTES :][:TILE_BYTES]
            words = tile[:1024].view(np.uint32)
            scales = tile[1024:].view(np.float16)
            for warp in range(4):
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    for h in range(2):
                        row = rt * 64 + 16 * warp + g + 8 * h
                        b = qs[row, kb, 4 * t : 4 * t + 4].astype(np.uint32)
                        words[(warp * 32 + lane) * 2 + h] = b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24
                        if t == 0:
                            scales[(warp * 8 + g) * 2 + h] = d[row, kb]
    return out


def convert_x(x: np.ndarray) -> np.ndarray:
    """x [16, k] float32 -> the f16 B tiles, as wg_convert_x writes them (by its flat index)."""
    k = x.shape[1]
    out = np.zeros(k * COLS, np.float16)
    for i in range(k * COLS):
        kb, part, e = i // 512, i // 256 % 2, i % 256
        n, kk = (e // 128) * 8 + (e % 64) // 8, ((e // 64) % 2) * 8 + e % 8
        out[i] = x[n, 32 * kb + 16 * part + phys_k(kk)]
    return out


def byte_perm(a: int, sel: int) -> int:
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [0, 0, 0, 0]
    return sum(src[(sel >> (4 * i)) & 0xF] << (8 * i) for i in range(4))


def expand(word: int, d: np.float16, hi: bool) -> tuple[np.ndarray, np.ndarray]:
    """wg_expand: two f16 pairs (first element in the low half) of d (q - 8)."""
    pairs = []
    for sel in (0x4140, 0x4342):
        v = byte_perm(word, sel) >> (4 if hi else 0)
        h = (v & 0x000F000F) | 0x64006400
        halves = np.array([h & 0xFFFF, h >> 16], np.uint16).view(np.float16)
        pairs.append(((halves - np.float16(1032)).astype(np.float16) * d).astype(np.float16))
    return pairs[0], pairs[1]


def a_matrix(fetch, part: int) -> np.ndarray:
    """A warpgroup's A operand (64 rows x the MMA's 16 k) as its threads build it: fetch(warp, lane)
    gives the quant words of rows g, g + 8 and their scales; part 1: the high nibbles."""
    amat = np.zeros((64, 16))
    for warp in range(4):
        for lane in range(32):
            g, t = lane // 4, lane % 4
            w0, w1, d0, d1 = fetch(warp, lane)
            a0, a2 = expand(w0, d0, part == 1)  # row g: k 2t, 2t + 1 / 2t + 8, 2t + 9
            a1, a3 = expand(w1, d1, part == 1)  # row g + 8
            r = 16 * warp + g
            amat[r, 2 * t : 2 * t + 2], amat[r, 2 * t + 8 : 2 * t + 10] = a0, a2
            amat[r + 8, 2 * t : 2 * t + 2], amat[r + 8, 2 * t + 8 : 2 * t + 10] = a1, a3
    return amat


def b_matrix(bt: np.ndarray, lbo: int = LBO, sbo: int = SBO) -> np.ndarray:
    """A 512-byte k16 tile of activations as the descriptor addresses it (16 k x 16 columns)."""

    def at(kk: int, n: int) -> float:
        off = (n // 8) * sbo + (kk // 8) * lbo + (n % 8) * 16 + (kk % 8) * 2
        return float(bt[off : off + 2].view(np.float16)[0])

    return np.array([[at(kk, n) for n in range(COLS)] for kk in range(16)])


def mma_tile(
    tile_bytes: np.ndarray, btile: np.ndarray, nkb: int, lbo: int = LBO, sbo: int = SBO
) -> np.ndarray:
    """The lab kernel's loop for one warpgroup (one 64-row tile) over nkb blocks, the MMA as documented."""
    acc = np.zeros((64, COLS))
    bbytes = btile.view(np.uint8)
    for kb in range(nkb):
        tile = tile_bytes[kb * TILE_BYTES :][:TILE_BYTES]
        words, scales = tile[:1024].view(np.uint32), tile[1024:].view(np.float16)

        def fetch(warp: int, lane: int, words=words, scales=scales) -> tuple:
            i, g = (warp * 32 + lane) * 2, lane // 4
            return (
                int(words[i]),
                int(words[i + 1]),
                scales[(warp * 8 + g) * 2],
                scales[(warp * 8 + g) * 2 + 1],
            )

        for part in range(2):
            bt = bbytes[kb * B_BYTES + part * 512 :][:512]
            acc += a_matrix(fetch, part) @ b_matrix(bt, lbo, sbo)
    return acc


def test_the_lab_layouts_compute_w_times_x():
    rng = np.random.default_rng(7)
    nkb = 3
    qs = rng.integers(0, 256, (64, nkb, 16), dtype=np.uint8)
    d = rng.uniform(0.001, 0.02, (64, nkb)).astype(np.float16)
    x = rng.uniform(-1, 1, (COLS, 32 * nkb)).astype(np.float16).astype(np.float32)
    # the reference: Q4_0 as ggml lays it out (low nibbles k 0..15, high nibbles k 16..31)
    q = np.concatenate([qs & 15, qs >> 4], axis=2).astype(np.float64) - 8
    w = (q * d[..., None].astype(np.float64)).astype(np.float16).astype(np.float64).reshape(64, 32 * nkb)
    ref = w @ x.T.astype(np.float64)
    got = mma_tile(repack(qs, d), convert_x(x), nkb)
    assert np.allclose(got, ref, rtol=1e-9, atol=1e-9)
    # a wrong assumption must show: the two strides swapped
    swapped = mma_tile(repack(qs, d), convert_x(x), nkb, lbo=SBO, sbo=LBO)
    assert not np.allclose(swapped, ref, rtol=1e-3, atol=1e-3)


def test_the_k_permutation_is_one_to_one_and_matches_the_fragment():
    assert sorted(phys_k(kk) for kk in range(16)) == list(range(16))
    # thread t's word holds physical k 4t .. 4t + 3; the fragment holds MMA k 2t, 2t + 1, 2t + 8, 2t + 9
    for t in range(4):
        assert [phys_k(kk) for kk in (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9)] == [
            4 * t + i for i in range(4)
        ]


def tile_at(mt: int, q: int, nmt: int, nquads: int, interleave: bool) -> int:
    """mc_mmr_repack's tile index of (16-row tile mt, quad q): mt * nquads + q, or interleaved (patch
    0025) 4 (mt / 4) nquads + q nsub + mt % 4, nsub the 64 rows' tiles (fewer in the last 64)."""
    if not interleave:
        return mt * nquads + q
    nsub = min(4, nmt - mt // 4 * 4)
    return mt // 4 * 4 * nquads + q * nsub + mt % 4


def repack_copies(qs: np.ndarray, d: np.ndarray, interleave: bool = False) -> np.ndarray:
    """The library's copies (mc_mmr_repack, patch 0015): tile (16-row tile mt, quad q) at tile_at * 1152;
    piece p < 64 (lane 4 g + t, half h = p / 32): byte 4 j + b = qs byte 4 t + b of block 4 q + j of row
    16 mt + g + 8 h; piece 64 + g: halves 4 h + j = d of block 4 q + j of row 16 mt + g + 8 h."""
    rows, nkb, _ = qs.shape
    nquads = nkb // 4
    out = np.zeros(rows // 16 * nquads * TILE_BYTES, np.uint8)
    for mt in range(rows // 16):
        for q in range(nquads):
            tile = out[tile_at(mt, q, rows // 16, nquads, interleave) * TILE_BYTES :][:TILE_BYTES]
            for p in range(64):
                g, t, h = p % 32 // 4, p % 4, p // 32
                for j in range(4):
                    tile[p * 16 + 4 * j : p * 16 + 4 * j + 4] = qs[
                        16 * mt + g + 8 * h, 4 * q + j, 4 * t : 4 * t + 4
                    ]
            for g in range(8):
                halves = tile[1024 + g * 16 : 1024 + g * 16 + 16].view(np.float16)
                for h in range(2):
                    for j in range(4):
                        halves[4 * h + j] = d[16 * mt + g + 8 * h, 4 * q + j]
    return out


def test_the_interleaved_copies_hold_the_same_tiles():
    """The interleaved order is a permutation of the plain one's tiles: the same bytes, the same size,
    each 64 rows' quad one contiguous run of its tiles (the rows not a multiple of 64 included)."""
    for nmt, nquads in ((7, 3), (8, 2), (1, 5), (5, 1)):
        at = [tile_at(mt, q, nmt, nquads, True) for mt in range(nmt) for q in range(nquads)]
        assert sorted(at) == list(range(nmt * nquads))
        for mt0 in range(0, nmt, 4):
            for q in range(nquads):
                run = [tile_at(mt, q, nmt, nquads, True) for mt in range(mt0, min(nmt, mt0 + 4))]
                assert run == list(range(run[0], run[0] + len(run)))


def test_the_library_form_reads_the_copies_layout():
    """Patch 0025's kernel (mc_mmw_q4_0) on the interleaved copies: the CTA at row0 (nmt tiles) reads
    quad c's nmt * 1152 bytes at (row0 / 16) nquads * 1152 + c nmt * 1152 in one bulk copy; warp w reads
    tile w of it at lane * 16 (row g), 512 + lane * 16 (row g + 8) and 1024 + g * 16 (the 8 scales),
    block j of the quad being word j of each piece; the activations as mc_mmw_convert_y writes them
    (the lab's). 112 rows: a second CTA of 3 tiles."""
    rng = np.random.default_rng(11)
    rows, nkb = 112, 8  # two CTAs (64 and 48 rows), two quads
    qs = rng.integers(0, 256, (rows, nkb, 16), dtype=np.uint8)
    d = rng.uniform(0.001, 0.02, (rows, nkb)).astype(np.float16)
    x = rng.uniform(-1, 1, (COLS, 32 * nkb)).astype(np.float16).astype(np.float32)
    q = np.concatenate([qs & 15, qs >> 4], axis=2).astype(np.float64) - 8
    w = (q * d[..., None].astype(np.float64)).astype(np.float16).astype(np.float64).reshape(rows, 32 * nkb)
    ref = w @ x.T.astype(np.float64)
    copies, bt, nquads = repack_copies(qs, d, interleave=True), convert_x(x).view(np.uint8), nkb // 4
    got = np.zeros((rows, COLS))
    for row0 in range(0, rows, 64):
        nmt = min(64, rows - row0) // 16
        for kb in range(nkb):
            quad, j = kb // 4, kb % 4
            stage = copies[(row0 // 16 * nquads + quad * nmt) * TILE_BYTES :][: nmt * TILE_BYTES]

            def fetch(warp: int, lane: int, stage=stage, j=j, nmt=nmt) -> tuple:
                if warp >= nmt:  # past the rows: the kernel's zero fragments
                    return 0, 0, np.float16(0), np.float16(0)
                tile = stage[warp * TILE_BYTES :][:TILE_BYTES]
                w0 = int(tile[lane * 16 : lane * 16 + 16].view(np.uint32)[j])
                w1 = int(tile[512 + lane * 16 : 512 + lane * 16 + 16].view(np.uint32)[j])
                sc = tile[1024 + lane // 4 * 16 :][:16].view(np.float16)
                return w0, w1, sc[j], sc[4 + j]

            for part in range(2):
                got[row0 : row0 + 64] += (
                    a_matrix(fetch, part) @ b_matrix(bt[kb * B_BYTES + part * 512 :][:512])
                )[: min(64, rows - row0)]
    assert np.allclose(got, ref, rtol=1e-9, atol=1e-9)
