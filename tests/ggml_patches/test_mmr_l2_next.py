"""Patch 0038 (MC_MMR_L2_NEXT_KB, off by default): each block of the 2..16-column product on the
repacked copies (mc_mmr_q4_0) ends by requesting into L2 the first KB of each 16-row tile of the next two
Q4_0 products' copies. A prefetch changes no result, so what is checked here is where the requests go:
the emulated blocks' requests cover every tile of the next copy once, at the tile's start, with the
chosen length, for grids larger and smaller than the tile count; and the source does what the emulation
does (the kernel's loop, the chooser's arithmetic, the request set around the launches and cleared after,
the plan built for either setting). The GPU run measures whether it helps (bench/NOTES.md)."""

from __future__ import annotations

import re

import pytest

from tests.ggml_patches.test_cuda_kernels import c_body

TILE = 1152  # MC_MMR_TILE_BYTES: 16 rows x 4 Q4_0 blocks (1,024 bytes of quants, 128 of scales)


def chosen_bytes(kb: int, k: int) -> tuple[int, int]:
    """mc_mmr_next_choose's (tile_bytes, bytes) for a copy of K columns and MC_MMR_L2_NEXT_KB = kb."""
    tile_bytes = k // 128 * TILE
    return tile_bytes, min(kb * 1024, tile_bytes) // 16 * 16


def emulate(grid_x: int, grid_y: int, threads: int, tiles: int, tile_bytes: int, nbytes: int) -> list:
    """mc_mmr_prefetch_next for one copy: every block's threads' requests as (offset, bytes)."""
    nb = grid_x * grid_y
    out = []
    for by in range(grid_y):
        for bx in range(grid_x):
            bid = by * grid_x + bx
            for tid in range(threads):
                t = bid + tid * nb
                while t < tiles:
                    out.append((t * tile_bytes, nbytes))
                    t += nb * threads
    return out


@pytest.mark.parametrize(
    ("grid", "rows", "k", "kb"),
    [
        ((258, 1), 5120, 6144, 64),  # the GDN input's grid, then the output projection (5,120 x 6,144)
        ((80, 3), 17408, 5120, 64),  # an output projection's K-split grid, then the FFN gate (or up)
        ((726, 1), 5120, 17408, 16),  # the gate + up, then ffn_down: 320 tiles over 726 blocks
        ((80, 3), 16512, 5120, 4096),  # more than a tile asked: the whole tile, once
        ((1, 1), 4096, 512, 1),  # one block: its threads take every tile (32 rows of 128 threads' loop)
    ],
)
def test_every_tile_of_the_next_copy_once_from_its_start(grid, rows, k, kb):
    tile_bytes, nbytes = chosen_bytes(kb, k)
    tiles = rows // 16
    reqs = emulate(grid[0], grid[1], 128, tiles, tile_bytes, nbytes)
    assert sorted(o for o, _ in reqs) == [t * tile_bytes for t in range(tiles)]
    assert {b for _, b in reqs} == {nbytes}
    assert nbytes % 16 == 0 and 0 < nbytes <= tile_bytes
    assert nbytes == min(kb * 1024, tile_bytes)  # K % 128 == 0: a tile is a multiple of 16 bytes
    # the blocks share the work: none asks for more than its share of tiles, rounded up
    per_block = -(-tiles // (grid[0] * grid[1]))
    counts: dict[int, int] = {}
    nb = grid[0] * grid[1]
    for o, _ in reqs:
        t = o // tile_bytes
        counts[t % nb] = counts.get(t % nb, 0) + 1
    assert max(counts.values()) <= per_block


# one layer of the 27B's graph as the evaluation meets its Q4_0 products (other nodes between them do not
# change the plan): a GDN layer's four inputs, its output projection, the FFN; then the next layer
LAYER = ["qkv", "z", "alpha", "beta", "out", "gate", "up", "down"]


def plan(nodes: list[str], keep: int) -> list[list[str]]:
    """ggml_cuda_mc_next_weights_plan: for each node, the next `keep` Q4_0 products after it."""
    out, cur = [], []
    for name in reversed(nodes):
        out.append(list(cur))
        cur = [name, *cur][:keep]
    return out[::-1]


def choose(cands: list[str], own: set[str]) -> list[str]:
    """mc_mmr_next_choose: the first two candidates that are none of the launch's own (all have copies)."""
    return [c for c in cands if c not in own][:2]


def test_each_launch_prefetches_the_next_two_launches_products():
    """With MC_GROUP_MAX + 2 = 6 candidates a node, every launch of a layer names the products after its
    own group; with the two the plan kept before, the GDN input's launch (four products: its candidates
    its own) would find none and the FFN gate + up's one."""
    nodes = LAYER + [f"{n}'" for n in LAYER]
    p6, p2 = plan(nodes, 6), plan(nodes, 2)
    groups = [({"qkv", "z", "alpha", "beta"}, 0), ({"out"}, 4), ({"gate", "up"}, 5), ({"down"}, 7)]
    want = [["out", "gate"], ["gate", "up"], ["down", "qkv'"], ["qkv'", "z'"]]
    for (own, first), names in zip(groups, want, strict=True):
        assert choose(p6[first], own) == names, (own, p6[first])
    assert choose(p2[0], groups[0][0]) == []  # the old plan: the GDN input prefetched nothing
    assert choose(p2[5], groups[2][0]) == ["down"]


def assert_has(body: str, texts: list[str]) -> None:
    for text in texts:
        assert text in body, text


def test_the_source_prefetches_as_emulated(patched):
    mc = (patched / "ggml" / "src" / "ggml-cuda" / "mc-mmv.cu").read_text()
    # not inlined (inlined, the 48-row form spilled: test_cuda_kernels checks every form for spills)
    helper = c_body(mc, "static __device__ __noinline__ void mc_mmr_prefetch_next(const mc_mmr_next nx) {")
    assert_has(
        helper,
        [
            'const int nb  = MC_SREG("nctaid.x") * MC_SREG("nctaid.y");',
            'const int bid = MC_SREG("ctaid.y") * MC_SREG("nctaid.x") + MC_SREG("ctaid.x");',
            'const int tid = MC_SREG("tid.x");',
            'const int nt  = MC_SREG("ntid.x");',
            "for (int t = bid + tid * nb; t < tiles; t += nb * nt) {",
            "mc_prefetch_l2(p + (int64_t) t * tb, bytes);",
            "const char * p     = i == 0 ? nx.ptr[0] : nx.ptr[1];",
            "const int    bytes = i == 0 ? nx.bytes[0] : nx.bytes[1];",
        ],
    )
    # the kernel takes the request by value and issues it last, after the K slices' finish
    kernel = c_body(mc, "static __global__ void mc_mmr_q4_0(")
    assert "const int flags, const mc_mmr_next next) {" in kernel
    tail = kernel[kernel.index("mc_mmq_ksplit_finish<") :]
    # unguarded (the request's own loop returns at once when empty), and the kernel's last statement
    assert re.search(r"stride_col_dst\);\n(    //[^\n]*\n)*    mc_mmr_prefetch_next\(next\);$", tail), tail
    # the chooser: the setting's range, each tile's bytes as emulated, only fresh copies of other matrices
    assert 'mc_env_int("MC_MMR_L2_NEXT_KB", 0, 4096, 0)' in mc
    choose = c_body(mc, "static mc_mmr_next mc_mmr_next_choose(const mc_mm_group & grp) {")
    assert_has(
        choose,
        [
            "if (kb == 0 || mc_mmr_count.load() == 0) {",
            "for (const ggml_tensor * c : mc_next_here.c) {",
            "if (c == nullptr || n == 2) {",
            "mine = mine || (const char *) c->data == grp.vx[q];",
            "it->second.stale",
            "const int64_t tile_bytes = it->second.k / 128 * MC_MMR_TILE_BYTES;",
            "nx.bytes[n]      = (int) (std::min((int64_t) kb * 1024, tile_bytes) / 16 * 16);",
            "nx.tiles[n]      = (int) (it->second.rows / 16);",
        ],
    )
    # the plan of the next products is built for either setting and keeps MC_GROUP_MAX + 2 of them, the
    # nearest first (as plan() below)
    plan = c_body(mc, "void ggml_cuda_mc_next_weights_plan(")
    assert "if (mc_next_mb() == 0 && mc_mmr_next_kb() == 0) {" in plan
    group_h = (patched / "ggml" / "src" / "ggml-cuda" / "mc-group.h").read_text()
    assert "#define MC_NEXT_CANDIDATES (MC_GROUP_MAX + 2)" in mc and "#define MC_GROUP_MAX 4 " in group_h
    assert_has(
        plan,
        [
            "mc_next_plan[i]        = cur;",
            "for (int j = MC_NEXT_CANDIDATES - 1; j > 0; --j) {",
            "cur.c[j] = cur.c[j - 1];",
            "cur.c[0] = nd->src[0];",
        ],
    )
    assert plan.index("mc_next_plan[i]        = cur;") < plan.index("cur.c[0] = nd->src[0];")
    # mc_mmr_run sets the request from the launch's original weights before its launches, clears it after
    run = c_body(mc, "static bool mc_mmr_run(")
    first = run.index("mc_mmr_next_req = mc_mmr_next_choose(grp_in);")
    assert first < run.index("mc_mmr_launch<1, 3, true>") and "!mc_mmr_take(grp, k)" in run[:first]
    last = run.rindex("mc_mmr_launch<2, 2, false>")
    assert run.index("mc_mmr_next_req = mc_mmr_next();", last) > last
    # every launch of the kernel passes it: the library's launcher the thread's request, the lab nothing
    assert "mc_kernel_flags(), stream, mc_mmr_next_req);" in c_body(mc, "static void mc_mmr_launch_mt(")
    start = c_body(mc, "static void mc_mmr_start(")
    assert "cudaStream_t stream, const mc_mmr_next & next = mc_mmr_next()) {" in start
    assert "ncols, nquads, per, flags, next);" in start
