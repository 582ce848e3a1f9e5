"""Patch 0022 (MC_GDN_WIDE, the default at 2+ tokens): the Gated DeltaNet recurrence with a warp on 4
columns, 8 lanes a column and 16 rows a lane; patch 0073 (MC_GDN_COLS): 2 or 4 columns a lane. A NumPy
emulation of the kernel's indexing (which lane holds which state rows, which lanes each token's two
sums cross, where the staged chunk keeps v, which snapshot slot a token writes, which lane writes an
output) must equal the recurrence computed row by row; a kernel reading another lane group's sums must
not. Checked on a GPU by test-backend-ops GATED_DELTA_NET / MC_GDN_LAYER and by the GDN lab
(bench/gpu/kernel_lab.py gdn: wide, wide2, wide4 against the recurrence in double on the host)."""

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


def emulate(s0, q, k, v, g, beta, scale, keep, group_xor=1, cpl=1, warps=WARPS):
    """mc_gdn_wide for one head and one sequence: blocks of warps x 4 x cpl columns, warp w's lane l on
    columns b ncb + (4 w + l // 8) cpl + c (c < cpl, patch 0073's MC_GDN_COLS) and rows lane_rows(l % 8);
    the sums cross lanes l ^ 1, l ^ 2, l ^ 4 (group_xor scales the offsets: 8 would reach another
    column group's lanes and must fail); lane c of a group writes its column c's output."""
    n = q.shape[0]
    ncb = warps * CPW * cpl
    out = np.zeros((n, S_V))
    state = np.zeros((S_V, S_V))
    snaps = {}
    lanes = range(32)
    for b in range(S_V // ncb):
        for w in range(warps):
            first = [(w * CPW + lane // LPC) * cpl for lane in lanes]  # the lane's first column in the block
            rows = [lane_rows(lane % LPC) for lane in lanes]
            s = {
                (lane, c): s0[b * ncb + first[lane] + c][rows[lane]].astype(np.float64)
                for lane in lanes
                for c in range(cpl)
            }
            for t0 in range(0, n, CHUNK):
                nt = min(CHUNK, n - t0)
                # the stage's v: [nt][ncb], column c0 + e % ncb of token t0 + e // ncb
                st_v = np.array([v[t0 + e // ncb][b * ncb + e % ncb] for e in range(nt * ncb)])
                for tt in range(nt):
                    t = t0 + tt
                    gv = np.exp(g[t])
                    for c in range(cpl):
                        part = [s[lane, c] @ k[t][rows[lane]] for lane in lanes]
                        kv = butterfly(part, group_xor)
                        for lane in lanes:
                            delta = (st_v[tt * ncb + first[lane] + c] - gv * kv[lane]) * beta[t]
                            s[lane, c] = gv * s[lane, c] + k[t][rows[lane]] * delta
                        attn = butterfly([s[lane, c] @ q[t][rows[lane]] for lane in lanes], group_xor)
                        for lane in lanes:
                            if lane % LPC == c:
                                out[t][b * ncb + first[lane] + c] = attn[lane] * scale
                    slot = n - 1 - t
                    if 0 <= slot < keep:
                        snap = snaps.setdefault(slot, np.zeros((S_V, S_V)))
                        for (lane, c), vals in s.items():
                            snap[b * ncb + first[lane] + c][rows[lane]] = vals
            for (lane, c), vals in s.items():
                state[b * ncb + first[lane] + c][rows[lane]] = vals
    return out, state, snaps


def butterfly(vals, group_xor):
    """__shfl_xor_sync with offsets 1, 2, 4 (x group_xor) over 32 lanes, each adding its partner's."""
    vals = list(vals)
    o = 1
    while o < LPC:
        vals = [vals[lane] + vals[(lane ^ (o * group_xor)) % 32] for lane in range(32)]
        o <<= 1
    return vals


@pytest.mark.parametrize(("cpl", "warps"), [(1, 4), (2, 4), (4, 2)])
@pytest.mark.parametrize(("n", "keep"), [(16, 1), (17, 3), (2, 1)])
def test_the_wide_mapping_computes_the_recurrence(n, keep, cpl, warps):
    rng = np.random.default_rng(n * 7 + keep)
    s0 = rng.standard_normal((S_V, S_V)) * 0.1
    q, k = rng.standard_normal((n, S_V)) * 0.1, rng.standard_normal((n, S_V)) * 0.1
    v, g, beta = rng.standard_normal((n, S_V)), -rng.random(n), rng.random(n)
    scale = 1 / np.sqrt(S_V)
    want_out, want_state, want_snaps = reference(s0, q, k, v, g, beta, scale, keep)
    out, state, snaps = emulate(s0, q, k, v, g, beta, scale, keep, cpl=cpl, warps=warps)
    np.testing.assert_allclose(out, want_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(state, want_state, rtol=1e-10, atol=1e-12)
    assert sorted(snaps) == sorted(want_snaps) == list(range(min(keep, n)))
    for slot, m in want_snaps.items():
        np.testing.assert_allclose(snaps[slot], m, rtol=1e-10, atol=1e-12)
    bad, _, _ = emulate(s0, q, k, v, g, beta, scale, keep, group_xor=8, cpl=cpl, warps=warps)
    assert not np.allclose(bad, want_out, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize(("cpl", "warps"), [(1, 4), (2, 4), (4, 2)])
def test_every_state_element_has_one_owner(cpl, warps):
    """Each (column, row) of a head's state is held by exactly one lane of one warp of one block."""
    owners = np.zeros((S_V, S_V), int)
    ncb = warps * CPW * cpl
    for b in range(S_V // ncb):
        for w in range(warps):
            for lane in range(32):
                for c in range(cpl):
                    owners[b * ncb + (w * CPW + lane // LPC) * cpl + c][lane_rows(lane % LPC)] += 1
    assert (owners == 1).all()


def test_the_columns_a_lane_are_a_read_once_setting_with_the_emulated_indexing(patched):
    """Patch 0073 (MC_GDN_COLS, 1, 2 or 4, default 1): the kernel's statements are the emulation's, and
    the launcher gives 4 columns a lane two warps a block, 1 or 2 four; 3 is named and 1 runs."""
    source = (patched / "ggml/src/ggml-cuda/gated_delta_net.cu").read_text()
    # CPL 1 keeps patch 0022's bounds (its machine code); 2 and 4 ask one block an SM (no spills)
    head = "__global__ void __launch_bounds__(CPL == 4 ? 64 : 128, CPL == 1 ? 0 : 1) mc_gdn_wide("
    kernel = source[source.index(head) :]
    kernel = kernel[: kernel.index("\n}\n")]
    for line in (
        "const int      ncb      = blockDim.y * MC_GDN_WIDE_CPW * CPL;  // columns a block",
        "const int      cb       = (threadIdx.y * MC_GDN_WIDE_CPW + lane / LPC) * CPL;",
        "const int      col      = blockIdx.z * ncb + cb;",
        "const float4 x  = *(const float4 *) (curr_state + c * S_v + j * 4 * LPC + 4 * r);",
        "const float v_col = st_v[tt * ncb + cb + c];",
        "if (r == c) {",
        "attn_data[col + c] = attn * scale;",
        "*(float4 *) (out + c * S_v + j * 4 * LPC + 4 * r) =",
        "*(float4 *) (state + c * S_v + j * 4 * LPC + 4 * r) =",
    ):
        assert line in kernel, line
    launcher = source[source.index("static const int cpl = [] {") :]
    launcher = launcher[: launcher.index("return;")]
    assert 'ggml_cuda_mc_env_int("MC_GDN_COLS", 1, 4, 1)' in launcher
    assert "MC_GDN_COLS=3: the values allowed are 1, 2 and 4; using 1" in launcher
    assert "const int    warps = cpl == 4 ? 2 : num_warps;" in launcher
    assert "const int    ncb   = warps * MC_GDN_WIDE_CPW * cpl;" in launcher
    assert "dim3(H, n_seqs, 128 / ncb), dim3(32, warps, 1)" in launcher
