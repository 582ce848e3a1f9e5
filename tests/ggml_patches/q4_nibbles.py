"""The Q4_0 dot product with a block's high nibbles left in place (the pstep lab's MC_LAB_PSTEP_NIB and
patch 0044's mc_q4_0_dot), emulated: the same integer sums as the shifted nibbles'."""

from __future__ import annotations

import numpy as np


def check_high_nibbles_in_place() -> None:
    """A Q4_0 word's high nibbles left in place (v & 0xF0F0F0F0: 16 x each, read unsigned by
    dp4a.u32.s32) against the signed q8_1 activations sum 16 x the products, and one arithmetic shift a
    block gives the shifted nibbles' integer sum exactly, negative sums included: on every nibble value
    against the activations' extremes and on random blocks."""
    rng = np.random.default_rng(7)

    def dp4a(a_bytes, b_bytes, c):  # four byte products added to c
        return c + int(np.dot(a_bytes.astype(np.int64), b_bytes.astype(np.int64)))

    def block(v_words, u):  # v: 4 uint32 words of nibbles, u: 8 int8x4 activation words
        nib = v_words.view(np.uint8).reshape(4, 4)
        ref = lo = hi = 0
        for i in range(4):
            ref = dp4a(nib[i] & 0x0F, u[i], ref)
            ref = dp4a(nib[i] >> 4, u[i + 4], ref)
            lo = dp4a(nib[i] & 0x0F, u[i], lo)
            hi = dp4a(nib[i] & 0xF0, u[i + 4], hi)  # unsigned bytes 0..240
        assert hi % 16 == 0
        return ref, lo + (hi >> 4)

    for q in range(16):
        for y in (-128, -1, 0, 1, 127):
            v = np.full(4, q * 0x11111111, dtype=np.uint32)
            u = np.full((8, 4), y, dtype=np.int8)
            ref, got = block(v, u)
            assert got == ref, (q, y)
    for _ in range(500):
        v = rng.integers(0, 2**32, size=4, dtype=np.uint64).astype(np.uint32)
        u = rng.integers(-128, 128, size=(8, 4), dtype=np.int64).astype(np.int8)
        ref, got = block(v, u)
        assert got == ref
