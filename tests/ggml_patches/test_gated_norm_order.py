"""Patch 0025 (MC_FUSE_GATED_NORM): the gated norm's kernel sums a 128-wide row's squares as
(s0 + s2) + (s1 + s3), s_k being one warp's butterfly sum of columns 32 k .. 32 k + 31, and claims the
same float32 result as the cached norm it replaces (patch 0009: a 256-thread block, one value a thread,
each warp's butterfly, then a butterfly over the 8 warp sums padded with zeros). Emulated here in
float32, lane by lane, over random rows: equal bit for bit; summing the warps in plain order must
differ somewhere (so the check can fail)."""

import numpy as np


def butterfly(v: np.ndarray) -> np.ndarray:
    """warp_reduce_sum over 32 lanes (xor shuffles 16, 8, 4, 2, 1), float32, every lane's result."""
    v = v.astype(np.float32).copy()
    lanes = np.arange(32)
    for off in (16, 8, 4, 2, 1):
        v = (v + v[lanes ^ off]).astype(np.float32)
    return v


def cached_norm_sum(x: np.ndarray) -> np.float32:
    """block_reduce<SUM, 256> over threads t holding x[t]^2 (t < 128) or 0."""
    sq = np.zeros(256, np.float32)
    sq[:128] = (x * x).astype(np.float32)
    warp_sums = [butterfly(sq[32 * w : 32 * w + 32])[0] for w in range(8)]
    second = np.zeros(32, np.float32)
    second[:8] = warp_sums
    return butterfly(second)[0]


def gated_norm_sum(x: np.ndarray) -> np.float32:
    cols = [x[32 * k : 32 * k + 32] for k in range(4)]
    s = [butterfly((c * c).astype(np.float32))[0] for c in cols]
    return np.float32(np.float32(s[0] + s[2]) + np.float32(s[1] + s[3]))


def test_the_gated_norm_sums_in_the_cached_norms_order():
    rng = np.random.default_rng(25)
    plain_differs = False
    for _ in range(2000):
        x = (rng.standard_normal(128) * rng.uniform(0.01, 100)).astype(np.float32)
        want = cached_norm_sum(x)
        assert gated_norm_sum(x).tobytes() == want.tobytes()
        s = [butterfly((x[32 * k : 32 * k + 32] ** 2).astype(np.float32))[0] for k in range(4)]
        plain = np.float32(np.float32(np.float32(s[0] + s[1]) + s[2]) + s[3])
        plain_differs |= plain.tobytes() != want.tobytes()
    assert plain_differs
