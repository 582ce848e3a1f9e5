"""The persistent verify product (mc_pmr_q4_0, patch 0032, MC_MMR_PERSIST): an emulation of how its CTAs
share a group's work, with the expressions taken from mc-mmv.cu. A group's units are (64-row tile,
chunk of 4 quads), u = tile * nch + chunk; CTA i takes the run [i per, min((i + 1) per, nunits)). At a
tile's last chunk in a run the CTA writes the tile whole to dst, or (a tile split between CTAs) its
part to its slot 2 i + (the run's first tile ? 0 : 1), and the tile's last CTA to arrive adds the
parts of CTAs t nch / per .. ((t + 1) nch - 1) / per in CTA order, finding each part's slot with
mc_pmr_slot. The emulation must give: every unit computed once, in the order it was requested; each
tile written once, whole or from parts that cover its chunks exactly; the parts' CTAs consecutive and
their count the kernel's nparts; no slot written twice; every CTA a run of at least one unit; and the
sums equal to a plain sum. This machine has no GPU: the GPU run compares the kernel's outputs with
mc_mmr_q4_0's (the mmr lab's checksums; test-backend-ops under MC_MMR_PERSIST)."""

from __future__ import annotations

import random
import re

import pytest

from tests.ggml_patches.test_cuda_kernels import c_body

STAGES = 3


@pytest.fixture(scope="module")
def source(patched) -> str:
    return (patched / "ggml/src/ggml-cuda/mc-mmv.cu").read_text()


@pytest.fixture(scope="module")
def pitch(source) -> int:
    """MC_PMR_PITCH: the floats a column of the warps' sums takes in mc_pmr_reduce's stage."""
    return int(re.search(r"#define MC_PMR_PITCH \(MC_MMQ_ROWS \+ (\d+)\)", source).group(1)) + 64


def test_the_source_has_the_emulated_expressions(source):
    kernel = c_body(source, "static __global__ void mc_pmr_q4_0(")
    for expr in (
        "const int     u_begin   = (int) blockIdx.x * per;",
        "const int     nrun      = min(nunits, u_begin + per) - u_begin;",
        "const int t0 = u_begin / nch;",
        "const int c0 = u_begin - t0 * nch;",
        "if (cc == nch - 1 || j == nrun - 1) {",
        "if (first == 0 && cc == nch - 1) {",
        "const int part   = 2 * (int) blockIdx.x + (ct == t0 ? 0 : 1);",
        "const int p0     = ct * nch / per;",
        "const int nparts = ((ct + 1) * nch - 1) / per - p0 + 1;",
        "mc_pmr_finish<NT>(partials, dst, stride, bias, ncols, nr, ct, p0, nparts, per, nch);",
        # the request cursor runs STAGES - 1 units ahead, into the stage read one unit before
        "if (j + STAGES - 1 < nrun) {",
        "const int sr = s == 0 ? STAGES - 1 : s - 1;",
    ):
        assert expr in kernel, expr
    slot = c_body(source, "static __host__ __device__ __forceinline__ int mc_pmr_slot(")
    assert "return (cta * per) / nch == t ? 0 : 1;" in slot
    finish = c_body(source, "static __device__ __forceinline__ void mc_pmr_finish(")
    assert (
        "const float * slot = partials + (int64_t) (2 * p + mc_pmr_slot(p, t, per, nch)) * NCP * MC_MMQ_ROWS;"
        in (finish)
    )
    assert "x[e] += v[u][e];  // CTA order" in finish
    plan = c_body(source, "static mc_pmr_plan mc_pmr_plan_for(")
    for expr in (
        "p.ntiles             = mc_group_tiles(grp, rows);",
        "const int least      = (p.nunits + slots - 1) / slots;",
        "const int whole      = (p.ntiles + slots - 1) / slots * p.nch;",
        "const int cost = 10 * per + (per % p.nch != 0 ? 2 * split : 0);",
        "if (per == least || cost <= best_cost) {",
        "p.ctas = (p.nunits + p.per - 1) / p.per;",
    ):
        assert expr in plan, expr
    assert 'mc_env_int("MC_MMR_PERSIST_SPLIT", 0, 100, 10)' in plan


def plan_for(ntiles: int, nch: int, slots: int, split: int = 10) -> tuple[int, int]:
    """mc_pmr_plan_for: (units a CTA, CTAs)."""
    nunits = ntiles * nch
    least = -(-nunits // slots)
    whole = -(-ntiles // slots) * nch
    best = best_cost = 0
    for per in range(least, whole + 1):
        cost = 10 * per + (2 * split if per % nch else 0)
        if per == least or cost <= best_cost:
            best, best_cost = per, cost
    return best, -(-nunits // best)


def slot_of(p: int, t: int, per: int, nch: int) -> int:
    """mc_pmr_slot."""
    return 0 if (p * per) // nch == t else 1


def emulate(ntiles: int, nch: int, per: int, ctas: int, rng: random.Random, slot_rule=slot_of) -> None:
    """The kernel's walk over every CTA's run, then every split tile's finisher; asserts as it goes."""
    nunits = ntiles * nch
    value = [[rng.uniform(-1, 1) for _ in range(nch)] for _ in range(ntiles)]  # a chunk's contribution
    written: dict[int, float] = {}  # tile -> its output
    slots: dict[int, float] = {}  # partial slot -> its part
    parts: dict[int, list[tuple[int, int, int]]] = {}  # split tile -> (cta, first chunk, last chunk)
    computed: list[tuple[int, int]] = []
    for cta in range(ctas):
        u_begin = cta * per
        nrun = min(nunits, u_begin + per) - u_begin
        assert nrun >= 1, (cta, u_begin, nunits)
        t0, c0 = divmod(u_begin, nch)
        # the requests: STAGES - 1 before the loop, then one a unit, STAGES - 1 ahead, unit j into stage
        # j % STAGES
        it, ic = t0, c0
        requested: list[tuple[int, int, int]] = []
        for s in range(STAGES - 1):
            if s < nrun:
                requested.append((it, ic, s))
                ic += 1
                if ic == nch:
                    ic, it = 0, it + 1
        ct, cc, first, s, acc = t0, c0, c0, 0, 0.0
        for j in range(nrun):
            if j + STAGES - 1 < nrun:
                sr = STAGES - 1 if s == 0 else s - 1
                requested.append((it, ic, sr))
                ic += 1
                if ic == nch:
                    ic, it = 0, it + 1
            assert requested[j] == (ct, cc, s), (cta, j)  # the stage read holds this unit
            computed.append((ct, cc))
            acc += value[ct][cc]
            if cc == nch - 1 or j == nrun - 1:
                if first == 0 and cc == nch - 1:
                    assert ct not in written and ct not in parts
                    written[ct] = acc
                else:
                    part = 2 * cta + (0 if ct == t0 else 1)
                    assert part not in slots, (cta, ct)
                    slots[part] = acc
                    parts.setdefault(ct, []).append((cta, first, cc))
                acc = 0.0
            cc += 1
            if cc == nch:
                cc, first, ct = 0, 0, ct + 1
            s = (s + 1) % STAGES
        assert len(requested) == nrun
    assert computed == [divmod(u, nch) for u in range(nunits)]
    for t, got in parts.items():  # the finisher of each split tile
        p0 = t * nch // per
        nparts = ((t + 1) * nch - 1) // per - p0 + 1
        assert [c for c, _, _ in got] == list(range(p0, p0 + nparts)), t
        chunks = [c for _, lo, hi in got for c in range(lo, hi + 1)]
        assert chunks == list(range(nch)), t
        total = 0.0
        for p in range(p0, p0 + nparts):
            total += slots[2 * p + slot_rule(p, t, per, nch)]
        written[t] = total
    assert sorted(written) == list(range(ntiles))
    for t in range(ntiles):
        assert written[t] == pytest.approx(sum(value[t]), abs=1e-9)


# the verify step's groups of the 27B (64-row tiles, chunks of 512 values of K) on an H200 (132 SMs)
GROUPS = {
    "gdn_in": (258, 10),
    "attn_in": (224, 10),
    "out": (80, 12),
    "ffn_gate_up": (544, 10),
    "ffn_down": (80, 34),
}


@pytest.mark.parametrize("slots", [264, 132, 170, 1])
def test_the_27b_groups_are_shared_out_exactly(slots):
    rng = random.Random(slots)
    for ntiles, nch in GROUPS.values():
        per, ctas = plan_for(ntiles, nch, slots)
        assert ctas <= slots
        emulate(ntiles, nch, per, ctas, rng)


def test_random_shapes_are_shared_out_exactly():
    rng = random.Random(7)
    for _ in range(300):
        ntiles, nch, slots = rng.randint(1, 300), rng.randint(1, 40), rng.randint(1, 300)
        per, ctas = plan_for(ntiles, nch, slots, split=rng.choice([0, 5, 10, 30, 100]))
        assert ctas <= slots
        emulate(ntiles, nch, per, ctas, rng)


def test_the_plan_on_an_h200():
    """The units a CTA the cost picks on 264 slots: whole tiles where a split saves less than its cost
    (the GDN and attention inputs: 10 chunks, no split), stream-K where waves would idle SMs."""
    got = {g: plan_for(*shape, 264) for g, shape in GROUPS.items()}
    assert got == {
        "gdn_in": (10, 258),
        "attn_in": (10, 224),
        "out": (4, 240),
        "ffn_gate_up": (21, 260),
        "ffn_down": (11, 248),
    }
    # with splits free, the attention inputs would be split (9 chunks a CTA over 249 CTAs)
    assert plan_for(224, 10, 264, split=0) == (9, 249)


def test_a_wrong_slot_rule_is_caught():
    """The emulation is not vacuous: a finisher that reads every part from its CTA's first slot (right
    only where runs start on the tile) adds another tile's part or a slot never written."""
    per, ctas = plan_for(*GROUPS["ffn_down"], 264)  # 11 chunks a CTA, tiles of 34: runs cross tiles
    with pytest.raises((AssertionError, KeyError)):
        emulate(*GROUPS["ffn_down"], per, ctas, random.Random(1), slot_rule=lambda p, t, per, nch: 0)


def test_the_sums_meet_without_bank_conflicts(pitch):
    """mc_pmr_reduce's stores: for each (row tile m, column tile n, fragment element i) a warp's 32
    lanes (g = lane / 4, t = lane % 4) store row m 16 + g (+ 8) of column n 8 + 2 t (+ 1) at column *
    MC_PMR_PITCH + row: with a pitch of 68 words the 32 lanes hit 32 banks (with 64, 4 lanes a bank)."""

    def banks(pitch: int, warp: int, m: int, n: int, i: int) -> set[int]:
        out = set()
        for lane in range(32):
            g, t = lane // 4, lane % 4
            r = m * 16 + g + (8 if i >= 2 else 0)
            col = n * 8 + 2 * t + (i & 1)
            out.add(((warp * 16 + col) * pitch + r) % 32)
        return out

    for warp in range(4):
        for m in range(4):
            for n in range(2):
                for i in range(4):
                    assert len(banks(pitch, warp, m, n, i)) == 32
    assert len(banks(64, 0, 0, 0, 0)) == 8  # the plain pitch: 4-way conflicts


@pytest.mark.parametrize(
    "mt,nt,ncols,nr", [(4, 2, 16, 64), (4, 2, 9, 48), (3, 2, 16, 48), (3, 2, 12, 32), (4, 1, 5, 64)]
)
def test_a_tiles_sums_reach_their_outputs(source, pitch, mt, nt, ncols, nr):
    """mc_pmr_reduce and mc_pmr_finish's addressing, emulated: each warp's C fragments (lane 4 g + t,
    element i of row tile m, column tile n: row m 16 + g (+ 8), column n 8 + 2 t (+ 1)) stored at the
    source's pitch, the 4 warps' sums read per (column, row) for r < nr, col < ncols; a whole tile goes
    to dst[col * stride + r], a split one to its slot at col * 64 + r, from which the finisher's index
    (col * MC_MMQ_ROWS + (i - col * nr) for output i = col * nr + r) reads it back. Every output must be
    the sum of the 4 warps' values for its (row, column), and nothing else written."""
    reduce = c_body(source, "static __device__ __forceinline__ void mc_pmr_reduce(")
    assert "const int r   = m * 16 + g + (i >= 2 ? 8 : 0);" in reduce
    assert "const int col = n * 8 + 2 * t + (i & 1);" in reduce
    assert "for (int i = threadIdx.x; i < ncols * nr; i += MC_MMQ_THREADS) {" in reduce
    assert "const int col = i / nr;\n        const int r   = i - col * nr;" in reduce
    assert "out[(int64_t) col * stride + r] = v + (bias ? bias[r] : 0.0f);" in reduce
    finish = c_body(source, "static __device__ __forceinline__ void mc_pmr_finish(")
    assert "at[e]         = i < ncols * nr ? col * MC_MMQ_ROWS + (i - col * nr) : -1;" in finish
    rng = random.Random(mt * 100 + nt * 10 + ncols)
    acc = {(w, lane, m, n, i): rng.uniform(-1, 1) for w in range(4) for lane in range(32) for m in range(mt)
           for n in range(nt) for i in range(4)}  # fmt: skip
    want: dict[tuple[int, int], float] = {}
    red: dict[int, float] = {}
    for (w, lane, m, n, i), v in acc.items():
        g, t = lane // 4, lane % 4
        r, col = m * 16 + g + (8 if i >= 2 else 0), n * 8 + 2 * t + (i & 1)
        at = (w * 8 * nt + col) * pitch + r
        assert at not in red  # no two stores to one word
        red[at] = v
        want[(r, col)] = want.get((r, col), 0.0) + v
    assert max(red) < 4 * 8 * nt * pitch  # within the space the static_assert reserves
    for stride, split in ((5120, False), (64, True)):
        out: dict[int, float] = {}
        for i in range(ncols * nr):
            col, r = divmod(i, nr)
            out[col * stride + r] = sum(red[(w * 8 * nt + col) * pitch + r] for w in range(4))
        assert len(out) == ncols * nr
        for i in range(ncols * nr):
            col = i // nr
            at = col * 64 + (i - col * nr) if split else col * stride + (i - col * nr)
            assert out[at] == pytest.approx(want[(i - col * nr, col)])
