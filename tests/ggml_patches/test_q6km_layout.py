"""Q6_K at 2..16 columns (mc_mmq_q6_K, patch 0016): a byte-level emulation of the kernel's reads,
transcribed from mc-mmv.cu: the activations quantized to int8 with one scale per 256 values
(mc_q6km_quantize), each warp's Q6_K blocks (w, w + 4, ...) of a 16-row span, the words every lane
reads at the kernel's byte offsets (ql, qh, scales), the 6-bit unpacking, the int8 m16n8k16
fragment layouts (PTX ISA: A rows g and g + 8 x k 4t..4t+3, B k 4t..4t+3 x column g, C rows g, g + 8 x
columns 2t, 2t + 1), the int32 sums times the sub-block scales, the floats times d and the column
scale, the sum over warps. The result must equal a float64 product of ggml's own dequantization of
the rows (dequantize_row_q6_K's element order, written independently below) and the dequantized
activations. This machine has no GPU: the GPU run compares the kernel itself against the CPU backend
(test-backend-ops MUL_MAT, Q6_K cases of 2..17 columns)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.ggml_patches.test_cuda_kernels import c_body

BLOCK = 210  # ql[128], qh[64], scales[16] (int8), d (f16)
ROWS = 16  # MC_Q6KM_ROWS
WARPS = 4


def q6_k_rows(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    nb = k // 256
    out = np.zeros((rows, nb, BLOCK), np.uint8)
    out[:, :, :192] = rng.integers(0, 256, (rows, nb, 192), dtype=np.uint8)
    out[:, :, 192:208] = rng.integers(-128, 128, (rows, nb, 16)).astype(np.int8).view(np.uint8)
    d = (rng.random((rows, nb)) * 0.01 + 0.001).astype(np.float16)
    out[:, :, 208:210] = d.view(np.uint8).reshape(rows, nb, 2)
    return out.reshape(rows, nb * BLOCK)


def dequant(w: np.ndarray, rows: int, k: int) -> np.ndarray:
    """dequantize_row_q6_K (ggml-quants.c): two halves of 128; y[l], y[l + 32], y[l + 64], y[l + 96]
    from ql[l] low, ql[l + 32] low, ql[l] high, ql[l + 32] high and qh[l] bits 0-1, 2-3, 4-5, 6-7,
    scales sc[l / 16 + 0, 2, 4, 6]."""
    b = w.reshape(rows, k // 256, BLOCK)
    out = np.zeros((rows, k // 256, 256))
    d = b[:, :, 208:210].copy().view(np.float16).astype(np.float64)[:, :, 0]
    for half in range(2):
        ql = b[:, :, 64 * half : 64 * half + 64].astype(np.int64)
        qh = b[:, :, 128 + 32 * half : 128 + 32 * half + 32].astype(np.int64)
        sc = b[:, :, 192 + 8 * half : 192 + 8 * half + 8].view(np.int8).astype(np.int64)
        for i in range(32):
            is_ = i // 16
            q1 = ((ql[:, :, i] & 15) | ((qh[:, :, i] >> 0 & 3) << 4)) - 32
            q2 = ((ql[:, :, i + 32] & 15) | ((qh[:, :, i] >> 2 & 3) << 4)) - 32
            q3 = ((ql[:, :, i] >> 4) | ((qh[:, :, i] >> 4 & 3) << 4)) - 32
            q4 = ((ql[:, :, i + 32] >> 4) | ((qh[:, :, i] >> 6 & 3) << 4)) - 32
            for j, q in enumerate((q1, q2, q3, q4)):
                out[:, :, 128 * half + i + 32 * j] = d * sc[:, :, is_ + 2 * j] * q
    return out.reshape(rows, k)


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """mc_q6km_quantize: per column and 256 values, d = amax / 127, q = round(x * 127 / amax)."""
    ncols, k = x.shape
    blocks = x.reshape(ncols, k // 256, 256).astype(np.float32)
    amax = np.abs(blocks).max(axis=2)
    s = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(blocks * s[:, :, None]).astype(np.int8)
    return q.reshape(ncols, k), (amax / np.float32(127)).astype(np.float32)


def lds_b2(span: np.ndarray, off: np.ndarray) -> np.ndarray:
    """mc_lds_b2: two 16-bit loads, little-endian, at a 2-byte aligned offset."""
    assert np.all(off % 2 == 0)
    b = [span[off + i].astype(np.int64) for i in range(4)]
    return b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24


def q6km_ld(span: np.ndarray, off, al: bool, trace: list | None = None) -> np.ndarray:
    """mc_q6km_ld<AL> (patch 0037): AL one 32-bit load (the offset must be a word's), else mc_lds_b2's
    two 16-bit loads. trace: each load instruction's 32 lane offsets appended (for the bank count)."""
    off = np.broadcast_to(np.asarray(off, np.int64), (32,))
    if al:
        assert np.all(off % 4 == 0), "a 32-bit load off a word"
    if trace is not None:
        trace.extend([off] if al else [off, off + 2])
    return lds_b2(span, off)


def layout_for(requested: int, row_bytes: int) -> int:
    """mc_q6km_layout: 2 (the MMA's rows on the block's even / odd rows) where row_bytes % 16 == 8, 1 (32-bit
    loads for the warps whose blocks start on a word) where row_bytes % 4 == 0, else 0."""
    if requested == 2 and row_bytes % 16 == 8:
        return 2
    return 1 if requested >= 1 and row_bytes % 4 == 0 else 0


def place(tile: np.ndarray, here: int, row_bytes: int, layout: int):
    """A block's shared memory as the kernel fills it (the span, and at least the warps' sums), and the
    block's rows that are the MMA's rows g and g + 8 (layouts 0 / 1: g and g + 8; 2: 2 g and 2 g + 1)."""
    g = np.arange(8)
    smem = np.zeros(max(ROWS * row_bytes, WARPS * 16 * ROWS * 4), np.uint8)
    smem[: here * row_bytes] = tile[: here * row_bytes]
    return smem, (2 * g, 2 * g + 1) if layout == 2 else (g, g + 8)


def wavefronts(offsets: np.ndarray) -> int:
    """Shared-memory wavefronts of one load instruction: the most distinct words any of the 32 banks
    holds among the lanes' words (the same word in several lanes is one read)."""
    banks: dict[int, set[int]] = {}
    for w in (np.asarray(offsets) // 4).tolist():
        banks.setdefault(w % 32, set()).add(w)
    return max(len(v) for v in banks.values())


def vsubss4_20(x: np.ndarray) -> np.ndarray:
    """__vsubss4(x, 0x20202020) as 4 int8 lanes (values 0..63, no saturation): the kernel's unpacking
    before patch 0036, kept here as the reference for its replacement."""
    lanes = np.stack([(x >> (8 * i)) & 255 for i in range(4)], axis=-1)
    assert lanes.max() < 64
    return lanes - 32


def int8_lanes(x: np.ndarray) -> np.ndarray:
    lanes = np.stack([(x >> (8 * i)) & 255 for i in range(4)], axis=-1)
    return lanes - 256 * (lanes >= 128)


def q6_4x_less32(lo_word: np.ndarray, hf: np.ndarray, nib: int, q: int) -> np.ndarray:
    """mc_q6_4x_less32<NIB, Q> (patch 0036) on 32-bit words: the ql word shifted left (NIB 0) or right
    (NIB 1) by 2 and masked to bits 2..5 of each byte, OR the flipped qh word (qh ^ 0xAAAAAAAA) shifted
    left by 6 - 2 Q and masked to bits 6..7; 4 int8 lanes."""
    lo = ((lo_word << 2) if nib == 0 else (lo_word >> 2)) & 0x3C3C3C3C
    return int8_lanes(lo | ((hf << (6 - 2 * q)) & 0xC0C0C0C0))


def emulate(
    w: np.ndarray,
    yq: np.ndarray,
    yd: np.ndarray,
    rows: int,
    k: int,
    layout: int = 0,
    trace: list | None = None,
) -> np.ndarray:
    """mc_mmq_q6_K<NT, FRAG, L> over every block of 16 rows: returns dst [ncols, rows]. layout: the
    MC_MMQ_Q6K_LAYOUT asked for (lowered as mc_q6km_layout does); trace: the shared loads' offsets."""
    ncols = yq.shape[0]
    nt_count = 1 if ncols <= 8 else 2
    nblocks = k // 256
    row_bytes = nblocks * BLOCK
    dst = np.full((ncols, rows), np.nan)
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    layout = layout_for(layout, row_bytes)
    for row0 in range(0, rows, ROWS):
        here = min(ROWS, rows - row0)
        tile = np.zeros(ROWS * row_bytes, np.uint8)  # rows past a partial tile: left as they are (zeros)
        tile[: here * row_bytes] = w[row0 : row0 + here].reshape(-1)
        span, (row_a, row_b) = place(tile, here, row_bytes, layout)
        base_a, base_b = row_a * row_bytes, row_b * row_bytes
        red = np.zeros((WARPS, 8 * nt_count, ROWS))
        for warp in range(WARPS):
            acc = np.zeros((nt_count, 32, 4))
            al = layout >= 1 and warp % 2 == 0  # warps 0 and 2: their blocks start on a word
            for kb in range(warp, nblocks, WARPS):
                pa = base_a[g] + kb * BLOCK
                pb = base_b[g] + kb * BLOCK
                isum = np.zeros((nt_count, 32, 4), np.int64)
                # the 16 int8 sub-block scales of each row, as 4 words (once a block)
                sca = [q6km_ld(span, pa + 192 + 4 * i, al, trace) for i in range(4)]
                scb = [q6km_ld(span, pb + 192 + 4 * i, al, trace) for i in range(4)]
                for h in range(2):
                    for is_ in range(2):
                        l_ = 16 * is_ + 4 * t
                        la = [
                            q6km_ld(span, pa + h * 64 + l_, al, trace),
                            q6km_ld(span, pa + h * 64 + 32 + l_, al, trace),
                        ]
                        lb = [
                            q6km_ld(span, pb + h * 64 + l_, al, trace),
                            q6km_ld(span, pb + h * 64 + 32 + l_, al, trace),
                        ]
                        hfa = q6km_ld(span, pa + 128 + h * 32 + l_, al, trace) ^ 0xAAAAAAAA
                        hfb = q6km_ld(span, pb + 128 + h * 32 + l_, al, trace) ^ 0xAAAAAAAA
                        for q in range(4):
                            s = 8 * h + 2 * q + is_
                            # patch 0036: 4 (x - 32), word q & 1, nibble q >> 1 (the sums 4x, d / 4 below)
                            a0 = q6_4x_less32(la[q & 1], hfa, q >> 1, q)
                            a1 = q6_4x_less32(lb[q & 1], hfb, q >> 1, q)
                            # the scales: byte s % 4 of word s / 4, sign-extended
                            sa = (sca[s // 4] >> (8 * (s % 4))) & 255
                            sb = (scb[s // 4] >> (8 * (s % 4))) & 255
                            sa, sb = sa - 256 * (sa >= 128), sb - 256 * (sb >= 128)
                            # the fragments as matrices: A[16 x 16] from (a0, a1), B[16 x 8] per column tile
                            A = np.zeros((16, 16), np.int64)
                            A[g[:, None], 4 * t[:, None] + np.arange(4)] = a0
                            A[g[:, None] + 8, 4 * t[:, None] + np.arange(4)] = a1
                            for nt in range(nt_count):
                                col = np.minimum(nt * 8 + g, ncols - 1)
                                base = kb * 256 + 16 * s + 4 * t
                                bfrag = yq[col[:, None], base[:, None] + np.arange(4)].astype(np.int64)
                                B = np.zeros((16, 8), np.int64)
                                B[4 * t[:, None] + np.arange(4), g[:, None]] = bfrag
                                C = A @ B
                                rows_c = [g, g, g + 8, g + 8]
                                cols_c = [2 * t, 2 * t + 1, 2 * t, 2 * t + 1]
                                c = np.stack([C[r, cc] for r, cc in zip(rows_c, cols_c, strict=True)], axis=1)
                                isum[nt] += c * np.stack([sa, sa, sb, sb], axis=1)
                da = 0.25 * np.array([span[p + 208 : p + 210].view(np.float16)[0] for p in pa], np.float64)
                db = 0.25 * np.array([span[p + 208 : p + 210].view(np.float16)[0] for p in pb], np.float64)
                for nt in range(nt_count):
                    d0 = yd[np.minimum(nt * 8 + 2 * t, ncols - 1), kb]
                    d1 = yd[np.minimum(nt * 8 + 2 * t + 1, ncols - 1), kb]
                    acc[nt, :, 0] += isum[nt, :, 0] * (da * d0)
                    acc[nt, :, 1] += isum[nt, :, 1] * (da * d1)
                    acc[nt, :, 2] += isum[nt, :, 2] * (db * d0)
                    acc[nt, :, 3] += isum[nt, :, 3] * (db * d1)
            for nt in range(nt_count):
                for i in range(4):
                    r = (row_a if i < 2 else row_b)[g]  # the block's row of the MMA's row g or g + 8
                    c = nt * 8 + 2 * t + i % 2
                    red[warp, c, r] = acc[nt, :, i]
        for c in range(ncols):
            dst[c, row0 : row0 + here] = red[:, c, :here].sum(axis=0)
    return dst


@pytest.mark.parametrize(("rows", "k", "ncols"), [(40, 1280, 2), (32, 512, 9), (16, 1024, 16), (24, 768, 8)])
def test_q6km_emulation_matches_dequantized_product(rows, k, ncols):
    rng = np.random.default_rng(rows * 1000 + ncols)
    w = q6_k_rows(rng, rows, k)
    x = rng.standard_normal((ncols, k)).astype(np.float32)
    yq, yd = quantize(x)
    got = emulate(w, yq, yd, rows, k, layout=2)
    y_deq = yq.astype(np.float64).reshape(ncols, k // 256, 256) * yd.astype(np.float64)[:, :, None]
    want = y_deq.reshape(ncols, k) @ dequant(w, rows, k).T
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9 * np.abs(want).max())
    # and the int8 activations stay close to the f32 ones (one scale per 256 values, as the CPU's q8_K)
    exact = x.astype(np.float64) @ dequant(w, rows, k).T
    assert np.abs(got - exact).max() < 0.02 * np.abs(exact).max()


def store(yq: np.ndarray, frag: bool, swap: bool = False) -> np.ndarray:
    """mc_q6km_quantize's stores (its quantized values given): per (column, 256 values) lane l writes its
    8 values 8 l .. 8 l + 7 as two 4-byte words; FRAG (patch 0030) at 64 (s / 4) + 16 (2 (l % 2)) +
    4 (s % 4) and 16 bytes after it, with s = l / 2, else at 8 l and 8 l + 4. swap: a wrong order (i and j
    exchanged), which the test must catch. Every byte is written once (checked)."""
    ncols, k = yq.shape
    out = np.zeros(ncols * k, np.int8)
    written = np.zeros(ncols * k, np.int64)
    for c in range(ncols):
        for b in range(k // 256):
            base = c * k + b * 256
            for lane in range(32):
                s = lane // 2
                i, j = (s % 4, s // 4) if swap else (s // 4, s % 4)
                off = 64 * i + 16 * (2 * (lane % 2)) + 4 * j if frag else lane * 8
                vals = yq[c, b * 256 + lane * 8 : b * 256 + lane * 8 + 8]
                for half, step in ((0, 0), (1, 16 if frag else 4)):
                    at = base + off + step
                    out[at : at + 4] = vals[4 * half : 4 * half + 4]
                    written[at : at + 4] += 1
    assert np.all(written == 1)
    return out.reshape(ncols, k)


def load_words(buf: np.ndarray, col: int, kb: int, t: int, frag: bool) -> np.ndarray:
    """mc_q6km_load_y for one lane (its t) and column: the 16 words yb[s] as 4 bytes each; FRAG: 4 16-byte
    loads at 64 i + 16 t (words 4 i .. 4 i + 3), else a word at 4 t + 16 s."""
    blk = buf[col, kb * 256 : kb * 256 + 256]
    if frag:
        return np.concatenate([blk[64 * i + 16 * t : 64 * i + 16 * t + 16].reshape(4, 4) for i in range(4)])
    return np.stack([blk[4 * t + 16 * s : 4 * t + 16 * s + 4] for s in range(16)])


def test_the_fragment_order_gives_every_lane_the_same_words():
    """Patch 0030 (MC_MMQ_Q6K_FRAG): the activations stored in the B fragments' order and read as 16-byte
    loads give every lane the same 16 words as the plain order's 4-byte loads: the kernel's products and
    sums are the same to the bit (its emulation above holds for both). Each word is the B fragment's
    k 4t..4t+3 of sub-block s: values 16 s + 4 t + b. A store with the word index's two parts exchanged
    fails it."""
    rng = np.random.default_rng(30)
    yq, _ = quantize(rng.standard_normal((3, 768)).astype(np.float32))
    plain, frag, wrong = store(yq, False), store(yq, True), store(yq, True, swap=True)
    assert np.array_equal(plain, yq)  # the plain order is the values' own
    for col in range(3):
        for kb in range(3):
            for t in range(4):
                at = kb * 256 + 4 * t
                want = np.stack([yq[col, at + 16 * s : at + 16 * s + 4] for s in range(16)])
                assert np.array_equal(load_words(plain, col, kb, t, False), want)
                assert np.array_equal(load_words(frag, col, kb, t, True), want)
    bad = [
        not np.array_equal(load_words(wrong, c, kb, t, True), load_words(plain, c, kb, t, False))
        for c in range(3)
        for kb in range(3)
        for t in range(4)
    ]
    assert any(bad)


def test_the_shifted_unpacking_is_four_times_the_saturating_one_for_every_byte():
    """Patch 0036: every (ql byte, qh byte) pair, both nibbles and all four qh bit pairs: the new A bytes
    are exactly 4 x the old __vsubss4 ones (so the int32 sums are 4x and d / 4 gives the same floats:
    both factors are powers of two), and they fit int8 (4 (x - 32) in -128..124). Not flipping qh's bits,
    or flipping the wrong ones, fails it."""
    lo, hi = np.meshgrid(np.arange(256, dtype=np.int64), np.arange(256, dtype=np.int64))
    lo, hi = lo.ravel(), hi.ravel()
    # the same byte in all four lanes of a word, and a word of four different bytes
    words_lo = lo * 0x01010101
    words_hi = hi * 0x01010101
    mixed_lo = (lo | np.roll(lo, 1) << 8 | np.roll(lo, 7) << 16 | np.roll(lo, 77) << 24).astype(np.int64)
    mixed_hi = (hi | np.roll(hi, 3) << 8 | np.roll(hi, 11) << 16 | np.roll(hi, 101) << 24).astype(np.int64)
    for wl, wh in ((words_lo, words_hi), (mixed_lo, mixed_hi)):
        for q in range(4):
            nib, word = q >> 1, wl
            old = vsubss4_20(((word >> (4 * nib)) & 0x0F0F0F0F) | ((wh >> (2 * q)) & 0x03030303) << 4)
            new = q6_4x_less32(word, wh ^ 0xAAAAAAAA, nib, q)
            assert np.array_equal(new, 4 * old), q
            assert new.min() >= -128 and new.max() <= 124
            for bad in (wh, wh ^ 0x55555555):
                assert not np.array_equal(q6_4x_less32(word, bad, nib, q), 4 * old)
    # a Q6_K block's sums stay in int32: 16 sub-blocks x sub-block scale 128 x 16 values x 128 x 127
    assert 16 * 128 * 16 * 128 * 127 < 2**31


def test_the_kernel_unpacks_as_emulated(patched):
    """The source's calls match the emulation above: word q & 1, nibble q >> 1, qh flipped once, d / 4;
    no saturating subtraction left in the block's loop."""
    mc = (patched / "ggml" / "src" / "ggml-cuda" / "mc-mmv.cu").read_text()
    helper = mc.index("static __device__ __forceinline__ int mc_q6_4x_less32(")
    assert mc.index("(NIB == 0 ? lo_word << 2 : lo_word >> 2) & 0x3C3C3C3Cu;", helper) < mc.index(
        "return (int) (lo | ((hf << (6 - 2 * Q)) & 0xC0C0C0C0u));", helper
    )
    body = c_body(mc, "static __device__ __forceinline__ void mc_q6km_block(")
    for text in [
        "mc_q6km_ld<AL>((const char *) ba->qh + h * 32 + l) ^ 0xAAAAAAAAu;",
        "mc_q6km_ld<AL>((const char *) bb->qh + h * 32 + l) ^ 0xAAAAAAAAu;",
        "const int a0 = q == 0 ? mc_q6_4x_less32<0, 0>(la[0], hfa) :",
        "q == 1 ? mc_q6_4x_less32<0, 1>(la[1], hfa) :",
        "q == 2 ? mc_q6_4x_less32<1, 2>(la[0], hfa) :",
        "mc_q6_4x_less32<1, 3>(la[1], hfa);",
        "const int a1 = q == 0 ? mc_q6_4x_less32<0, 0>(lb[0], hfb) :",
        "q == 1 ? mc_q6_4x_less32<0, 1>(lb[1], hfb) :",
        "q == 2 ? mc_q6_4x_less32<1, 2>(lb[0], hfb) :",
        "mc_q6_4x_less32<1, 3>(lb[1], hfb);",
        "const float da = 0.25f * __half2float(ba->d);",
        "const float db = 0.25f * __half2float(bb->d);",
    ]:
        assert text in body, text
    assert "__vsubss4" not in body


@pytest.mark.parametrize(
    ("rows", "k", "ncols", "layouts"),
    [
        (40, 1024, 16, (0, 1, 2)),  # row_bytes 840: 8 mod 16; a partial tile of 8 rows
        (21, 2048, 9, (0, 1)),  # 1,680: layout 2 falls back to 1; a partial tile of 5
        (32, 512, 12, (0, 1)),  # 420
        (19, 768, 3, (0,)),  # 630: 2 mod 4, every layout falls back to 0
        (16, 5120, 16, (0, 1, 2)),  # the 27B's output matrix
    ],
)
def test_every_layout_gives_the_same_sums(rows, k, ncols, layouts):
    """Patch 0037 (MC_MMQ_Q6K_LAYOUT): the rows read with 32-bit loads where their blocks start on a word
    (1), and with the MMA's rows on the block's even / odd rows (2), give the same outputs as with 16-bit
    loads (0), to the bit (the same words, sums and order; every 32-bit load's offset is checked to be a
    word's); the layout each matrix gets is the one its row_bytes allows."""
    rng = np.random.default_rng(k + rows)
    w = q6_k_rows(rng, rows, k)
    yq, yd = quantize(rng.standard_normal((ncols, k)).astype(np.float32))
    row_bytes = k // 256 * BLOCK
    assert sorted({layout_for(r, row_bytes) for r in (0, 1, 2)}) == list(layouts)
    base = emulate(w, yq, yd, rows, k, layout=0)
    for layout in (1, 2):
        assert np.array_equal(emulate(w, yq, yd, rows, k, layout=layout), base), layout
    want = yq.astype(np.float64).reshape(ncols, k // 256, 256) * yd.astype(np.float64)[:, :, None]
    np.testing.assert_allclose(
        base, want.reshape(ncols, k) @ dequant(w, rows, k).T, rtol=1e-9, atol=1e-9 * 50
    )


def test_word_loads_and_the_even_odd_rows_at_the_27b_shape():
    """The 27B's output matrix (K = 5,120: 4,200-byte rows): with layouts 1 / 2 warps 0 and 2 load each
    word once instead of as two halves, a quarter fewer shared loads for the block. The span's pitch
    (1,050 words: 26 banks) puts rows g and g + 5 (or g + 6) on the same banks, 1.75 wavefronts a load
    for layouts 0 / 1, as ncu measured on the H200 (36.0 M wavefronts for 21.0 M loads: 1.71); layout 2's
    even rows start on 8 distinct multiples of 4 banks and its odd rows on 8 distinct 2 mod 4: one
    wavefront each. Pairing rows g and g + 8 as before with the even / odd mapping's pitch rule would not
    (a mutation below)."""
    rng = np.random.default_rng(5120)
    rows, k, ncols = 16, 5120, 16
    w = q6_k_rows(rng, rows, k)
    yq, yd = quantize(rng.standard_normal((ncols, k)).astype(np.float32))
    counts = {}
    for layout in (0, 1, 2):
        trace: list = []
        emulate(w, yq, yd, rows, k, layout=layout, trace=trace)
        counts[layout] = (len(trace), sum(wavefronts(o) for o in trace))
    (loads0, waves0), (loads1, waves1), (loads2, waves2) = counts[0], counts[1], counts[2]
    assert loads1 == loads2 == loads0 * 3 // 4
    assert waves0 / loads0 == pytest.approx(1.75) and waves1 / loads1 == pytest.approx(1.75)
    assert waves2 == loads2
    # the bank groups of one load for each mapping: 8 rows' 4-word groups must not overlap
    row_words = 5120 // 256 * BLOCK // 4
    for rows_of_g, distinct in (
        ((2 * np.arange(8)), True),
        (2 * np.arange(8) + 1, True),
        (np.arange(8), False),
    ):
        banks = ((rows_of_g * row_words)[:, None] + np.arange(4)) % 32
        assert (len(set(banks.ravel().tolist())) == 32) == distinct


def test_the_kernel_reads_words_as_emulated(patched):
    """The source's layout code matches the emulation: the lowering, the span's size (shared with the
    mmr lab), the MMA rows' block rows, the 32-bit loads for warps 0 and 2 only with layouts 1 / 2, none
    of mc_lds_b2 left in the block."""
    mc = (patched / "ggml" / "src" / "ggml-cuda" / "mc-mmv.cu").read_text()
    for text in [
        'static const int v = mc_env_int("MC_MMQ_Q6K_LAYOUT", 0, 2, 2);',
        "return v == 2 && row_bytes % 16 == 8 ? 2 : v >= 1 && row_bytes % 4 == 0 ? 1 : 0;",
        "const char * ra = mc_smem + (L == 2 ? 2 * g : g) * row_bytes;",
        "const char * rb = mc_smem + (L == 2 ? 2 * g + 1 : g + 8) * row_bytes;",
        "const int r = L == 2 ? 2 * g + i / 2 : g + 8 * (i / 2);  // the block's row",
        "return std::max((size_t) MC_Q6KM_ROWS * row_bytes, (size_t) MC_MMQ_WARPS * 16 * MC_Q6KM_ROWS * "
        "sizeof(float));",
        "if (L >= 1 && warp % 2 == 0) {",
        "mc_q6km_warp<NT, FRAG, L >= 1>(acc, ra, rb, yq, yd, ncols, nblocks, warp, g, t);",
        "mc_q6km_warp<NT, FRAG, false>(acc, ra, rb, yq, yd, ncols, nblocks, warp, g, t);",
    ]:
        assert text in mc, text
    assert "mc_lds_b2(" not in c_body(mc, "static __device__ __forceinline__ void mc_q6km_block(")
    assert "return *(const int *) p;" in c_body(mc, "static __device__ __forceinline__ int mc_q6km_ld(")
