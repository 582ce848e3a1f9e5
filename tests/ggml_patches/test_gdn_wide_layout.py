"""Patch 0022 (MC_GDN_WIDE, the default at 2+ tokens): the Gated DeltaNet recurrence with a warp on 4
columns, 8 lanes a column and 16 rows a lane. A NumPy emulation of the kernel's indexing (which lane
holds which state rows, which lanes each token's two sums cross, where the staged chunk keeps v, which
snapshot slot a token writes) must equal the recurrence computed row by row; a kernel reading another
lane group's sums must not. Checked on a GPU by test-backend-ops GATED_DELTA_NET / MC_GDN_LAYER (the
default) and by the GDN lab (bench/gpu/kernel_lab.py gdn: against the recurrence in double on the host)."""

import numpy as np
import pytest

S_V, CPW, WARPS, CHUNK = 128, 4, 4, 16
LPC = 32 // CPW  # lanes a column
RPL = S_V // LPC  # rows a lane


def lane_rows(r: int) -> np.ndarray:
    """rows 32 j + 4 r + e of lane r of a column: float4 e at j * 4 * LPC + 4 r."""
    return np.array([j * 4 * LPC + 4 * r + e for j in range(RPL // 4) for e in range(4)])


def reference(s0, q, k, v, g, beta, scale, keep):
    """The stock recurrence, one head: s0 [col][i] (M[col][i] = S[i][col]), tokens along axis 0."""
    m = s0.astype(np.float64).copy()
    out, snaps = [], {}
    n = q.shape[0]
    for t in range(n):
        gv = np.exp(g[t])
        kv = m @ k[t]
        delta = (v[t] - gv * kv) * beta[t]
        m = gv * m + np.outer(delta, k[t])
        out.append(m @ q[t] * scale)
        slot = n - 1 - t
        if 0 <= slot < keep:
            snaps[slot] = m.copy()
    return np.array(out), m, snaps


def emulate(s0, q, k, v, g, beta, scale, keep, group_xor=1):
    """mc_gdn_wide for one head and one sequence: blocks of 16 columns, warp w's lane l on column
    16 b + 4 w + l // 8 and rows lane_rows(l % 8); the sums cross lanes l ^ 1, l ^ 2, l ^ 4 (group_xor
    scales the offsets: 8 would reach another column's lanes and must fail)."""
    n = q.shape[0]
    ncb = WARPS * CPW
    out = np.zeros((n, S_V))
    state = np.zeros((S_V, S_V))
    snaps = {}
    for b in range(S_V // ncb):
        for w in range(WARPS):
            lanes = range(32)
            cols = [b * ncb + w * CPW + lane // LPC for lane in lanes]
            rows = [lane_rows(lane % LPC) for lane in lanes]
            s = [s0[cols[lane]][rows[lane]].astype(np.float64) for lane in lanes]
            for t0 in range(0, n, CHUNK):
                nt = min(CHUNK, n - t0)
                # the stage's v: [nt][ncb], column c0 + e % ncb of token t0 + e // ncb
                st_v = np.array([v[t0 + e // ncb][b * ncb + e % ncb] for e in range(nt * ncb)])
                for tt in range(nt):
                    t = t0 + tt
                    gv = np.exp(g[t])
                    part = [s[lane] @ k[t][rows[lane]] for lane in lanes]
                    kv = butterfly(part, group_xor)
                    for lane in lanes:
                        cb = w * CPW + lane // LPC
                        delta = (st_v[tt * ncb + cb] - gv * kv[lane]) * beta[t]
                        s[lane] = gv * s[lane] + k[t][rows[lane]] * delta
                    attn = butterfly([s[lane] @ q[t][rows[lane]] for lane in lanes], group_xor)
                    for lane in lanes:
                        if lane % LPC == 0:
                            out[t][cols[lane]] = attn[lane] * scale
                    slot = n - 1 - t
                    if 0 <= slot < keep:
                        snap = snaps.setdefault(slot, np.zeros((S_V, S_V)))
                        for lane in lanes:
                            snap[cols[lane]][rows[lane]] = s[lane]
            for lane in lanes:
                state[cols[lane]][rows[lane]] = s[lane]
    return out, state, snaps


def butterfly(vals, group_xor):
    """__shfl_xor_sync with offsets 1, 2, 4 (x group_xor) over 32 lanes, each adding its partner's."""
    vals = list(vals)
    o = 1
    while o < LPC:
        vals = [vals[lane] + vals[(lane ^ (o * group_xor)) % 32] for lane in range(32)]
        o <<= 1
    return vals


@pytest.mark.parametrize(("n", "keep"), [(16, 1), (17, 3), (2, 1)])
def test_the_wide_mapping_computes_the_recurrence(n, keep):
    rng = np.random.default_rng(n * 7 + keep)
    s0 = rng.standard_normal((S_V, S_V)) * 0.1
    q, k = rng.standard_normal((n, S_V)) * 0.1, rng.standard_normal((n, S_V)) * 0.1
    v, g, beta = rng.standard_normal((n, S_V)), -rng.random(n), rng.random(n)
    scale = 1 / np.sqrt(S_V)
    want_out, want_state, want_snaps = reference(s0, q, k, v, g, beta, scale, keep)
    out, state, snaps = emulate(s0, q, k, v, g, beta, scale, keep)
    np.testing.assert_allclose(out, want_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(state, want_state, rtol=1e-10, atol=1e-12)
    assert sorted(snaps) == sorted(want_snaps) == list(range(min(keep, n)))
    for slot, m in want_snaps.items():
        np.testing.assert_allclose(snaps[slot], m, rtol=1e-10, atol=1e-12)
    bad, _, _ = emulate(s0, q, k, v, g, beta, scale, keep, group_xor=8)
    assert not np.allclose(bad, want_out, rtol=1e-3, atol=1e-6)


def test_every_state_element_has_one_owner():
    """Each (column, row) of a head's state is held by exactly one lane of one warp of one block."""
    owners = np.zeros((S_V, S_V), int)
    for b in range(S_V // (WARPS * CPW)):
        for w in range(WARPS):
            for lane in range(32):
                owners[b * WARPS * CPW + w * CPW + lane // LPC][lane_rows(lane % LPC)] += 1
    assert (owners == 1).all()
