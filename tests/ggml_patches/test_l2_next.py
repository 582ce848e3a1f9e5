"""MC_MMV_L2_NEXT_MB (patch 0003, reworked by patch 0039): which later product's weights a launch asks
into L2 once its blocks are done, and which bytes. Emulated here as mc-mmv.cu has it: the graph's
plan of the next Q4_0 products from each node (MC_NEXT_CANDIDATES of them, so that a grouped launch
of up to MC_GROUP_MAX products finds the first one after its own), the choice of a request
(mc_next_choose), its pieces (mc_next_pieces: spread evenly over the weights, or their first bytes),
and the blocks' requests (mc_prefetch_next: each piece once, inside the weights). This machine has no
GPU: whether it pays is measured in the graph (bench/NOTES.md)."""

from __future__ import annotations

import itertools

import pytest

from tests.ggml_patches.test_cuda_kernels import c_body

MC_GROUP_MAX = 4  # mc-group.h
MC_NEXT_CANDIDATES = MC_GROUP_MAX + 2
MC_NEXT_UNIT = 2048


def plan(nodes: list[str | None]) -> list[list[str | None]]:
    """ggml_cuda_mc_next_weights_plan: for each node, the weights of the next MC_NEXT_CANDIDATES
    products after it (a node is a product's weights' name or None for any other op)."""
    out: list[list[str | None]] = [[] for _ in nodes]
    cur: list[str | None] = [None] * MC_NEXT_CANDIDATES
    for i in range(len(nodes) - 1, -1, -1):
        out[i] = list(cur)
        if nodes[i] is not None:
            cur = [nodes[i], *cur[:-1]]
    return out


def choose(
    here: list[str | None], own: list[str], sizes: dict[str, int], mb: int
) -> tuple[str | None, int, int]:
    """mc_next_choose: the first candidate that is none of the launch's own matrices, its bytes to
    prefetch (at most mb MiB) and its span (both multiples of 16)."""
    for c in here:
        if c is None or c in own:
            continue
        span = sizes[c] // 16 * 16
        return c, min(span, mb << 20) // 16 * 16, span
    return None, 0, 0


def pieces(total: int, span: int, spread: bool) -> tuple[int, int, int]:
    """mc_next_pieces: (stride, unit, pieces), (0, 0, 0) for no request."""
    if total < 16 or span < total:
        return 0, 0, 0
    unit = min(MC_NEXT_UNIT, total)
    n = total // unit
    stride = span // n // 16 * 16 if spread else unit
    return stride, unit, n


def requests(stride: int, unit: int, n: int, grid: tuple[int, int]) -> list[tuple[int, int]]:
    """mc_prefetch_next over a launch's blocks: block b (blockIdx.y gridDim.x + blockIdx.x) asks for
    pieces b, b + blocks, ... as (offset, bytes)."""
    blocks = grid[0] * grid[1]
    out = []
    for by in range(grid[1]):
        for bx in range(grid[0]):
            out += [(i * stride, unit) for i in range(by * grid[0] + bx, n, blocks)]
    return out


def gdn_layer(layer: int) -> list[str | None]:
    """A Gated DeltaNet layer's nodes at one token as the graph orders them: four input products
    (grouped into one launch), the small kernels, the output projection, the gated FFN."""
    p = f"l{layer}."
    return [
        None,  # norm
        p + "qkv",
        p + "z",
        p + "beta",
        p + "alpha",
        None,  # conv
        None,  # concat
        None,  # gates
        None,  # recurrence
        None,  # gated norm
        p + "out",
        None,  # add + norm
        p + "gate",
        p + "up",
        None,  # glu
        p + "down",
    ]


def test_a_grouped_launch_asks_for_the_product_after_its_own():
    nodes = gdn_layer(0) + gdn_layer(1)
    here = plan(nodes)
    sizes = {n: 17_694_720 for n in nodes if n}
    qkv = nodes.index("l0.qkv")
    own = ["l0.qkv", "l0.z", "l0.beta", "l0.alpha"]
    assert choose(here[qkv], own, sizes, 16)[0] == "l0.out"
    # with two candidates, as before patch 0039, the group found only its own
    assert choose(here[qkv][:2], own, sizes, 16)[0] is None
    # the fused gate + up asks for ffn_down (its gate's matrix is its own), ffn_down for the next layer
    assert choose(here[nodes.index("l0.gate")], ["l0.gate", "l0.up"], sizes, 16)[0] == "l0.down"
    assert choose(here[nodes.index("l0.down")], ["l0.down"], sizes, 16)[0] == "l1.qkv"
    assert choose(here[len(nodes) - 1], ["l1.down"], sizes, 16)[0] is None  # the graph's last product


@pytest.mark.parametrize("spread", [True, False])
@pytest.mark.parametrize("mb", [1, 8, 16, 32, 64])
@pytest.mark.parametrize("span", [17_694_720, 50_135_040, 100_270_080, 2_949_120, 1_040, 16])
def test_each_piece_is_asked_once_inside_the_weights(spread, mb, span):
    total = min(span, mb << 20) // 16 * 16
    stride, unit, n = pieces(total, span, spread)
    assert unit % 16 == 0 and stride % 16 == 0 and n * unit == total // unit * unit
    assert total - n * unit < unit  # all of the request but less than a piece
    for grid in [(264, 1), (640, 1), (80, 3), (1, 1)]:
        got = requests(stride, unit, n, grid)
        assert len(got) == n and len({off for off, _ in got}) == n
        assert all(off % 16 == 0 and off >= 0 and off + b <= span for off, b in got)
    ends = sorted(i * stride for i in range(n))
    assert all(b - a >= unit for a, b in itertools.pairwise(ends))  # no byte twice
    if spread:  # evenly over the whole span: a piece every n-th of it, rounded down to 16 bytes
        assert span // n - 16 < stride <= span // n
    else:  # the first bytes
        assert ends[-1] + unit == n * unit


def test_the_source_is_what_is_emulated(patched):
    source = (patched / "ggml/src/ggml-cuda/mc-mmv.cu").read_text()
    assert "#define MC_NEXT_CANDIDATES (MC_GROUP_MAX + 2)" in source
    assert f"#define MC_NEXT_UNIT {MC_NEXT_UNIT}" in source
    assert f"#define MC_GROUP_MAX {MC_GROUP_MAX}" in (patched / "ggml/src/ggml-cuda/mc-group.h").read_text()
    body = c_body(source, "static mc_next_args mc_next_pieces(")
    for line in (
        "if (r.ptr == nullptr || r.total < 16 || r.span < r.total) {",
        "a.unit   = std::min(MC_NEXT_UNIT, r.total);",
        "a.pieces = r.total / a.unit;",
        "a.stride = spread ? r.span / a.pieces / 16 * 16 : a.unit;",
    ):
        assert line in body, line
    device = c_body(source, "static __device__ __forceinline__ void mc_prefetch_next(")
    for line in (
        "const int blocks = (int) (gridDim.x * gridDim.y);",
        "for (int i = (int) (blockIdx.y * gridDim.x + blockIdx.x); i < pf.pieces; i += blocks) {",
        "mc_prefetch_l2(pf.ptr + i * pf.stride, pf.unit);",
    ):
        assert line in device, line
    chooser = c_body(source, "static mc_next_request mc_next_choose(")
    assert "for (const ggml_tensor * c : mc_next_here.c) {" in chooser
    assert "r.span  = (int64_t) ggml_nbytes(c) / 16 * 16;" in chooser
    assert "r.total = (int) (std::min(r.span, (int64_t) mb << 20) / 16 * 16);" in chooser
    planner = c_body(source, "void ggml_cuda_mc_next_weights_plan(")
    assert "cur.c[k] = cur.c[k - 1];" in planner and "cur.c[0] = nd->src[0];" in planner
    assert 'mc_env_int("MC_MMV_L2_NEXT_SPREAD", 0, 1, 1) == 1' in source
    assert 'mc_env_int("MC_MMV_L2_NEXT_MB", 0, 64, 0)' in source  # off until measured
    # every launcher of a kernel that prefetches hands it the request; the persistent kernel too
    assert source.count("mc_prefetch_next(pf);") == 3
    pmv = c_body(source, "static __global__ void mc_pmv_q4_0(")
    assert pmv.index("mc_prefetch_next(a.pf);") > pmv.rindex("parity ^= 1u;")  # after its last piece
    assert "a.pf          = mc_next_now();" in source
