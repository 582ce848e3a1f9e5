"""Patch 0019's `mc_gdn_cols` (MC_GDN_STAGE=2): a NumPy emulation of its addressing (the staged,
padded q / k vectors, the lane -> (column, rows) mapping, the two 4-lane sums, the chunks, the
snapshot slots and the in-place L2 normalisation) against the Gated DeltaNet recurrence written
directly. The kernel itself runs on a GPU (test-backend-ops GATED_DELTA_NET and MC_GDN_LAYER); this
checks, on any machine, that the index arithmetic the CUDA source uses computes the recurrence."""

from __future__ import annotations

import numpy as np
import pytest

S_V = 128
CH = 16  # MC_GDN_CHUNK
QS = 144  # MC_GDN_COLS_QS


def pad(i: int) -> int:
    """A staged vector's element i sits at i + 4 (i / 32): lane p's 32 values at 36 p."""
    return i + 4 * (i // 32)


def reference(q, k, v, g, beta, s0, scale, keep):
    """out[t, h, col] and the last `keep` states, the recurrence as ggml's CPU op defines it (S[i][col])."""
    n_tokens, heads = v.shape[0], v.shape[1]
    out = np.zeros((n_tokens, heads, S_V))
    snaps = []
    for h in range(heads):
        s = s0[h].T.copy()  # stored M[col][i] = S[i][col]
        hs = []
        for t in range(n_tokens):
            gv = np.exp(g[t, h])
            kv = s.T @ k[t, h]  # kv[col] = sum_i S[i][col] k[i]
            delta = (v[t, h] - gv * kv) * beta[t, h]
            s = gv * s + np.outer(k[t, h], delta)
            out[t, h] = (s.T @ q[t, h]) * scale
            hs.append(s.T.copy())
        snaps.append(hs)
    return out, snaps


def emulate(q, k, v, g, beta, s0, scale, keep, l2=None):
    """mc_gdn_cols for one sequence: every block (head, column group z) and lane as the CUDA source
    addresses them; q / k may be given before their normalisation (l2 = (eps, scale))."""
    n_tokens, heads = v.shape[0], v.shape[1]
    out = np.zeros((n_tokens, heads, S_V))
    state = np.zeros((heads, S_V, S_V))  # [head][col][i]
    slots = {}
    for h in range(heads):
        for z in range(S_V // 32):
            # each lane's 32 state values: lane 4 c + p of warp w holds column z 32 + 8 w + c, rows 32 p ..
            lanes = [(w, c, p) for w in range(4) for c in range(8) for p in range(4)]
            st = {ln: s0[h][z * 32 + 8 * ln[0] + ln[1], 32 * ln[2] : 32 * ln[2] + 32].copy() for ln in lanes}
            chs = min(CH, n_tokens)
            for t0 in range(0, n_tokens, CH):
                nt = min(CH, n_tokens - t0)
                st_q = np.full(chs * QS, np.nan)
                st_k = np.full(chs * QS, np.nan)
                st_v = np.full(chs * 32, np.nan)
                for e in range(nt * S_V):
                    tt, i = divmod(e, S_V)
                    st_q[tt * QS + pad(i)] = q[t0 + tt, h, i]
                    st_k[tt * QS + pad(i)] = k[t0 + tt, h, i]
                for e in range(nt * 32):
                    st_v[e] = v[t0 + e // 32, h, z * 32 + e % 32]
                if l2 is not None:
                    eps, l2s = l2
                    for vec in range(2 * nt):
                        buf, base = (st_q, vec * QS) if vec < nt else (st_k, (vec - nt) * QS)
                        idx = [base + r * 36 + lane for r in range(4) for lane in range(32)]
                        x = buf[idx]
                        sc = 1.0 / np.sqrt(np.sum(x * x) / S_V + eps)
                        buf[idx] = l2s * (sc * x)
                for tt in range(nt):
                    t = t0 + tt
                    gv, bv = np.exp(g[t, h]), beta[t, h]
                    # the 4 lanes of a column: their partial sums, then the 2-step shuffle sum
                    for w in range(4):
                        for c in range(8):
                            bcol = 8 * w + c
                            col = z * 32 + bcol
                            parts = [(p, st_k[tt * QS + 36 * p : tt * QS + 36 * p + 32]) for p in range(4)]
                            kv = sum(np.dot(st[(w, c, p)], kr) for p, kr in parts)
                            delta = (st_v[tt * 32 + bcol] - gv * kv) * bv
                            at = 0.0
                            for p, kr in parts:
                                qr = st_q[tt * QS + 36 * p : tt * QS + 36 * p + 32]
                                st[(w, c, p)] = gv * st[(w, c, p)] + kr * delta
                                at += np.dot(st[(w, c, p)], qr)
                            out[t, h, col] = at * scale
                            slot = n_tokens - 1 - t
                            if keep > 1 and 0 <= slot < keep:
                                for p in range(4):
                                    slots.setdefault((slot, h), np.zeros((S_V, S_V)))[
                                        col, 32 * p : 32 * p + 32
                                    ] = st[(w, c, p)]
            for (w, c, p), vals in st.items():
                state[h, z * 32 + 8 * w + c, 32 * p : 32 * p + 32] = vals
    return out, state, slots


@pytest.mark.parametrize("n_tokens,keep", [(1, 1), (5, 1), (16, 1), (20, 1), (20, 4), (33, 20)])
def test_the_column_groups_compute_the_recurrence(n_tokens, keep):
    rng = np.random.default_rng(n_tokens * 7 + keep)
    heads = 2
    q = rng.standard_normal((n_tokens, heads, S_V)) / np.sqrt(S_V)
    k = rng.standard_normal((n_tokens, heads, S_V)) / np.sqrt(S_V)
    v = rng.standard_normal((n_tokens, heads, S_V))
    g = -rng.uniform(0.01, 0.5, (n_tokens, heads))
    beta = rng.uniform(0, 1, (n_tokens, heads))
    s0 = rng.standard_normal((heads, S_V, S_V)) * 0.1  # [head][col][i]
    want, snaps = reference(q, k, v, g, beta, s0, 0.088, keep)
    got, state, slots = emulate(q, k, v, g, beta, s0, 0.088, keep)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)
    for h in range(heads):
        np.testing.assert_allclose(state[h], snaps[h][-1], rtol=1e-9, atol=1e-9)
        for slot in range(min(keep, n_tokens) if keep > 1 else 0):
            np.testing.assert_allclose(slots[(slot, h)], snaps[h][n_tokens - 1 - slot], rtol=1e-9, atol=1e-9)


def test_the_in_place_l2_normalisation_matches_the_graphs_nodes():
    """q and k given before RMS_NORM(eps / n) -> SCALE(1 / sqrt(n)) (qwen35's L2 norm): normalised in the
    staged vectors, the recurrence equals the one on the nodes' outputs."""
    rng = np.random.default_rng(5)
    n_tokens, heads, eps = 18, 2, 1e-6
    q_raw = rng.standard_normal((n_tokens, heads, S_V)) * 3
    k_raw = rng.standard_normal((n_tokens, heads, S_V)) * 3

    def nodes(x):  # rms_norm(x, eps / n) * (1 / sqrt(n))
        return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps / S_V)) / np.sqrt(S_V)

    v = rng.standard_normal((n_tokens, heads, S_V))
    g = -rng.uniform(0.01, 0.5, (n_tokens, heads))
    beta = rng.uniform(0, 1, (n_tokens, heads))
    s0 = rng.standard_normal((heads, S_V, S_V)) * 0.1
    want, _ = reference(nodes(q_raw), nodes(k_raw), v, g, beta, s0, 0.088, 1)
    got, _, _ = emulate(q_raw, k_raw, v, g, beta, s0, 0.088, 1, l2=(eps / S_V, 1 / np.sqrt(S_V)))
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)


def test_a_wrong_padding_fails_the_emulation():
    """The emulation is sensitive to the layout: reading lane p's values at 32 p (no padding) fails."""
    global pad
    keep_pad = pad
    try:
        pad = lambda i: i  # noqa: E731 - the staged vectors unpadded, the reads still at 36 p
        rng = np.random.default_rng(1)
        q = rng.standard_normal((3, 1, S_V))
        k = rng.standard_normal((3, 1, S_V))
        v = rng.standard_normal((3, 1, S_V))
        g = -rng.uniform(0.01, 0.5, (3, 1))
        beta = rng.uniform(0, 1, (3, 1))
        s0 = rng.standard_normal((1, S_V, S_V)) * 0.1
        want, _ = reference(q, k, v, g, beta, s0, 1.0, 1)
        got, _, _ = emulate(q, k, v, g, beta, s0, 1.0, 1)
        assert not np.allclose(got, want, equal_nan=False)
    finally:
        pad = keep_pad
