"""MC_MMV_L2_NEXT_MB (patch 0003, reworked by patch 0039): which later products' weights a launch asks
into L2 once its blocks are done, and which bytes. Emulated here as mc-mmv.cu has it: the graph's
plan of the next Q4_0 products from each node (MC_NEXT_CANDIDATES of them, so that a grouped launch
of up to MC_GROUP_MAX products finds the first one after its own), the choice of a request
(mc_next_choose: the next product's bytes up to the budget, the rest of the budget from the one after
it), its pieces (mc_next_pieces: spread evenly over each matrix, or its first bytes), and the blocks'
requests (mc_prefetch_next: each piece once, inside the weights). Patch 0041 adds the gap rule
(MC_MMV_L2_NEXT_GAP: a launch asks only where enough nodes that launch kernels lie between its last
own product and the product it would ask for) and the per-thread form (MC_MMV_L2_NEXT_LSU: the same
pieces as one prefetch instruction a line, handed out over every thread of the launch). This machine
has no GPU: whether it pays is measured in the graph (bench/NOTES.md)."""

from __future__ import annotations

import itertools

import pytest

from tests.ggml_patches.test_cuda_kernels import assert_statements, c_body

MC_GROUP_MAX = 4  # mc-group.h
MC_NEXT_CANDIDATES = MC_GROUP_MAX + 2
MC_NEXT_UNIT = 2048


VIEW = "(view)"  # a node that launches no kernel (a view, a reshape, an empty tensor)


def plan(nodes: list[str | None]) -> list[list[tuple[str | None, int]]]:
    """ggml_cuda_mc_next_weights_plan: for each node, the weights of the next MC_NEXT_CANDIDATES
    products after it with their nodes' indices (a node is a product's weights' name, None for any
    other op, VIEW for one that launches nothing)."""
    out: list[list[tuple[str | None, int]]] = [[] for _ in nodes]
    cur: list[tuple[str | None, int]] = [(None, 0)] * MC_NEXT_CANDIDATES
    for i in range(len(nodes) - 1, -1, -1):
        out[i] = list(cur)
        if nodes[i] not in (None, VIEW):
            cur = [(nodes[i], i), *cur[:-1]]
    return out


def work(nodes: list[str | None]) -> list[int]:
    """mc_next_work: [i] = the nodes before node i that launch kernels."""
    out = [0]
    for n in nodes:
        out.append(out[-1] + (n != VIEW))
    return out


def gap(w: list[int], a: int, b: int) -> int:
    """mc_next_gap: the nodes that launch kernels strictly between node a and node b."""
    return w[b] - w[a + 1] if 0 <= a < b < len(w) else 0


MC_NEXT_RANGES = 2


def choose(
    here: list[tuple[str | None, int]],
    own: list[str],
    sizes: dict[str, int],
    mb: int,
    at: int = -1,
    w: list[int] | None = None,
    gap_min: int = 0,
    skip: bool = False,
) -> list[tuple[str, int, int]]:
    """mc_next_choose for a launch at node at: the candidates that are none of the launch's own
    matrices (nor the range before again), in order, each with its bytes to prefetch and its span
    (multiples of 16), until the budget (mb MiB) or MC_NEXT_RANGES ranges are used; nothing where
    the first of them lies fewer than gap_min launching nodes after the launch's last own product;
    skip (MC_MMV_L2_NEXT_SKIP): the first passed over, each range at most half the budget."""
    left = mb << 20
    share = left // MC_NEXT_RANGES if skip else left
    out: list[tuple[str, int, int]] = []
    last = at
    passed = False
    for c, node in here:
        if len(out) == MC_NEXT_RANGES or left < 16:
            break
        if c is None:
            continue
        if c in own:
            last = max(last, node)
            continue
        if out and out[-1][0] == c:
            continue
        if not passed:
            if gap(w or [], last, node) < gap_min:
                return []
            passed = True
            if skip:
                continue
        span = sizes[c] // 16 * 16
        total = min(span, left, share) // 16 * 16
        out.append((c, total, span))
        left -= total
    return out


def pieces(total: int, span: int, spread: bool) -> tuple[int, int, int]:
    """mc_next_pieces for one range: (stride, unit, pieces), (0, 0, 0) for none."""
    if total < 16 or span < total:
        return 0, 0, 0
    unit = min(MC_NEXT_UNIT, total)
    n = total // unit
    stride = span // n // 16 * 16 if spread else unit
    return stride, unit, n


def requests(ranges: list[tuple[int, int, int]], grid: tuple[int, int]) -> list[tuple[int, int, int]]:
    """mc_prefetch_next over a launch's blocks, its two loops as written: block b (blockIdx.y gridDim.x
    + blockIdx.x) asks for pieces b, b + blocks, ... of range 0, then goes on with the same step into
    range 1's pieces; as (range, offset, bytes)."""
    (s0, u0, n0), (s1, u1, n1) = (ranges + [(0, 0, 0)] * MC_NEXT_RANGES)[:MC_NEXT_RANGES]
    blocks = grid[0] * grid[1]
    out = []
    for by in range(grid[1]):
        for bx in range(grid[0]):
            i = by * grid[0] + bx
            while i < n0:
                out.append((0, i * s0, u0))
                i += blocks
            i -= n0
            while i < n1:
                out.append((1, i * s1, u1))
                i += blocks
    return out


def lines(ranges: list[tuple[int, int, int]], grid: tuple[int, int], threads: int, line: int):
    """mc_prefetch_lines over a launch (MC_MMV_L2_NEXT_LSU): the lines of all pieces of both ranges
    numbered in order, thread t of block b taking lines b threads + t, then every all-th; as (range,
    offset) of each prefetch instruction."""
    (s0, u0, n0), (s1, u1, n1) = (ranges + [(0, 0, 0)] * MC_NEXT_RANGES)[:MC_NEXT_RANGES]
    per0, per1 = (u0 + line - 1) // line, (u1 + line - 1) // line
    every = grid[0] * grid[1] * threads
    out = []
    for b in range(grid[0] * grid[1]):
        for t in range(threads):
            j = b * threads + t
            while j < n0 * per0:
                p = j // per0
                out.append((0, p * s0 + (j - p * per0) * line))
                j += every
            j -= n0 * per0
            while j < n1 * per1:
                p = j // per1
                out.append((1, p * s1 + (j - p * per1) * line))
                j += every
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
    mib = 1 << 20
    assert choose(here[qkv], own, sizes, 16) == [("l0.out", 16 * mib, 17_694_720)]
    # a budget past the output projection goes on into the gate
    rest = 32 * mib - 17_694_720
    assert choose(here[qkv], own, sizes, 32) == [
        ("l0.out", 17_694_720, 17_694_720),
        ("l0.gate", rest, 17_694_720),
    ]
    # with two candidates, as before patch 0039, the group found only its own
    assert choose(here[qkv][:2], own, sizes, 16) == []
    # the fused gate + up asks for ffn_down (its gate's matrix is its own), ffn_down for the next layer
    assert choose(here[nodes.index("l0.gate")], ["l0.gate", "l0.up"], sizes, 16)[0][0] == "l0.down"
    assert choose(here[nodes.index("l0.down")], ["l0.down"], sizes, 16)[0][0] == "l1.qkv"
    assert choose(here[len(nodes) - 1], ["l1.down"], sizes, 16) == []  # the graph's last product
    assert choose(here[qkv], own, sizes, 0) == []  # MC_MMV_L2_NEXT_MB=0: nothing


def test_the_gap_rule_keeps_the_launches_before_long_runs_of_small_kernels():
    layer = gdn_layer(0)
    # the views between the group and its small kernels launch nothing: they do not count
    nodes = [*layer[:5], VIEW, VIEW, *layer[5:], *gdn_layer(1)]
    here, w = plan(nodes), work(nodes)
    sizes = {n: 17_694_720 for n in nodes if n not in (None, VIEW)}
    owns = {
        "l0.qkv": ["l0.qkv", "l0.z", "l0.beta", "l0.alpha"],
        "l0.out": ["l0.out"],
        "l0.gate": ["l0.gate", "l0.up"],
        "l0.down": ["l0.down"],
    }
    asks = {
        gap_min: {
            n: bool(choose(here[nodes.index(n)], own, sizes, 16, at=nodes.index(n), w=w, gap_min=gap_min))
            for n, own in owns.items()
        }
        for gap_min in (0, 1, 2, 5, 6)
    }
    assert all(asks[0].values())  # 0: every launch asks (patch 0039)
    # 5 small kernels after the grouped inputs (the views not counted); 1 after the output projection
    # (add + norm), after the gate + up (the glu; the up's node is the launch's own) and after ffn_down
    # (the next layer's norm)
    assert asks[1] == {"l0.qkv": True, "l0.out": True, "l0.gate": True, "l0.down": True}
    assert asks[2] == {"l0.qkv": True, "l0.out": False, "l0.gate": False, "l0.down": False}
    assert asks[5] == {"l0.qkv": True, "l0.out": False, "l0.gate": False, "l0.down": False}
    assert asks[6] == {"l0.qkv": False, "l0.out": False, "l0.gate": False, "l0.down": False}
    # what the group asks for is unchanged by the rule where it asks
    i = nodes.index("l0.qkv")
    own = ["l0.qkv", "l0.z", "l0.beta", "l0.alpha"]
    assert choose(here[i], own, sizes, 32, at=i, w=w, gap_min=5) == choose(here[i], own, sizes, 32)


def test_skipping_passes_the_next_product_over_and_halves_the_budget():
    """MC_MMV_L2_NEXT_SKIP (patch 0042): the output projection after a GDN layer's inputs requests its
    own weights before its PDL wait, so the request goes to the FFN's gate and up, half the budget each;
    the gap rule still looks at the gap before the next product."""
    nodes = gdn_layer(0) + gdn_layer(1)
    here, w = plan(nodes), work(nodes)
    sizes = {n: 50_135_040 for n in nodes if n}
    sizes["l0.out"] = 17_694_720
    i = nodes.index("l0.qkv")
    own = ["l0.qkv", "l0.z", "l0.beta", "l0.alpha"]
    mib = 1 << 20
    assert choose(here[i], own, sizes, 32, at=i, w=w, skip=True) == [
        ("l0.gate", 16 * mib, 50_135_040),
        ("l0.up", 16 * mib, 50_135_040),
    ]
    assert choose(here[i], own, sizes, 32, at=i, w=w, gap_min=5, skip=True)[0][0] == "l0.gate"
    assert choose(here[i], own, sizes, 32, at=i, w=w, gap_min=6, skip=True) == []  # the gap before out
    # a budget of 1 MiB: half of it each
    assert [t for _, t, _ in choose(here[i], own, sizes, 1, at=i, w=w, skip=True)] == [mib // 2, mib // 2]
    # without the setting: as before
    assert choose(here[i], own, sizes, 32, at=i, w=w)[0] == ("l0.out", 17_694_720, 17_694_720)


@pytest.mark.parametrize("spread", [True, False])
@pytest.mark.parametrize("mb", [1, 8, 16, 32, 64])
@pytest.mark.parametrize("span", [17_694_720, 50_135_040, 100_270_080, 2_949_120, 1_040, 16])
def test_each_piece_is_asked_once_inside_the_weights(spread, mb, span):
    total = min(span, mb << 20) // 16 * 16
    stride, unit, n = pieces(total, span, spread)
    assert unit % 16 == 0 and stride % 16 == 0 and n * unit == total // unit * unit
    assert total - n * unit < unit  # all of the request but less than a piece
    second = pieces(4096, 50_135_040, spread)  # a second range beside it
    for grid in [(264, 1), (640, 1), (80, 3), (1, 1)]:
        for ranges in ([(stride, unit, n)], [(stride, unit, n), second]):
            got = requests(ranges, grid)
            assert len(got) == sum(r[2] for r in ranges) and len(set(got)) == len(got)
            assert len({off for k, off, _ in got if k == 0}) == n
            limit = (span, 50_135_040)
            assert all(off % 16 == 0 and off >= 0 and off + b <= limit[k] for k, off, b in got)
    ends = sorted(i * stride for i in range(n))
    assert all(b - a >= unit for a, b in itertools.pairwise(ends))  # no byte twice
    if spread:  # evenly over the whole span: a piece every n-th of it, rounded down to 16 bytes
        assert span // n - 16 < stride <= span // n
    else:  # the first bytes
        assert ends[-1] + unit == n * unit


@pytest.mark.parametrize("line", [128, 32])
@pytest.mark.parametrize("mb", [1, 16, 32])
def test_the_per_thread_form_asks_for_every_line_of_every_piece_once(line, mb):
    span, span1 = 17_694_720, 100_270_080
    total = min(span, mb << 20) // 16 * 16
    first = pieces(total, span, True)
    second = pieces(max(0, (mb << 20) - total) or 4096, span1, True)
    for ranges in ([first], [first, second], [pieces(1_040, 1_040, True)]):
        for grid, threads in [((264, 1), 256), ((640, 1), 128), ((3, 2), 32)]:
            got = lines(ranges, grid, threads, line)
            assert len(got) == len(set(got))  # each line once
            for k, (stride, unit, n) in enumerate(ranges):
                want = {p * stride + o for p in range(n) for o in range(0, unit, line)}
                assert {off for r, off in got if r == k} == want  # every line of every piece
                # each inside its piece, so inside the weights
                assert all(off % 16 == 0 and off + min(line, unit) <= span1 for r, off in got if r == k)


# MC_MMV_L2_NEXT_*: name, range, default (measured in runs BE / BF: every one off, bench/NOTES.md)
SETTINGS = (
    '"MC_MMV_L2_NEXT_MB", 0, 64, 0',
    '"MC_MMV_L2_NEXT_SPREAD", 0, 1, 1',
    '"MC_MMV_L2_NEXT_KEEP", 0, 1, 0',
    '"MC_MMV_L2_NEXT_LSU", 0, 2, 0',
    '"MC_MMV_L2_NEXT_GAP", 0, 1000, 0',
    '"MC_MMV_L2_NEXT_SKIP", 0, 1, 0',
)

# the statements of mc-mmv.cu the emulation above transcribes, by the head of their function
STATEMENTS = {
    "static mc_next_args mc_next_pieces(": (
        "if (r.ptr[k] == nullptr || r.total[k] < 16 || r.span[k] < r.total[k]) {",
        "a.unit[k]   = std::min(MC_NEXT_UNIT, r.total[k]);",
        "a.pieces[k] = r.total[k] / a.unit[k];",
        "a.stride[k] = spread ? r.span[k] / a.pieces[k] / 16 * 16 : a.unit[k];",
    ),
    "template <bool KEEP> static __device__ __forceinline__ void mc_prefetch_ranges(": (
        "const int blocks = (int) (gridDim.x * gridDim.y);",
        "int       i      = (int) (blockIdx.y * gridDim.x + blockIdx.x);",
        "for (; i < pf.pieces[0]; i += blocks) {",
        "KEEP ? mc_prefetch_l2_keep(pf.ptr[0] + i * pf.stride[0], pf.unit[0]) :",
        "mc_prefetch_l2(pf.ptr[0] + i * pf.stride[0], pf.unit[0]);",
        "for (i -= pf.pieces[0]; i < pf.pieces[1]; i += blocks) {",
        "KEEP ? mc_prefetch_l2_keep(pf.ptr[1] + i * pf.stride[1], pf.unit[1]) :",
        "mc_prefetch_l2(pf.ptr[1] + i * pf.stride[1], pf.unit[1]);",
    ),
    "static mc_next_request mc_next_choose(": (
        "int64_t         left   = (int64_t) mc_next_mb() << 20;",
        "const int64_t   share  = mc_next_skip() ? left / MC_NEXT_RANGES : left;",
        "int             last   = mc_next_node;",
        "bool            passed = false;",
        "for (int j = 0; j < MC_NEXT_CANDIDATES; ++j) {",
        "if (k == MC_NEXT_RANGES || left < 16) {",
        "bool mine = (const char *) c->data == vgate;",
        "last = std::max(last, mc_next_here.at[j]);",
        "if ((uintptr_t) c->data % 16 != 0 || (k > 0 && (const char *) c->data == r.ptr[k - 1])) {",
        "if (!passed) {",
        "if (mc_next_gap(last, mc_next_here.at[j]) < mc_next_gap_min()) {",
        "passed = true;",
        "if (mc_next_skip()) {",
        "r.span[k]  = (int64_t) ggml_nbytes(c) / 16 * 16;",
        "r.total[k] = (int) (std::min(r.span[k], std::min(left, share)) / 16 * 16);",
        "left -= r.total[k];",
    ),
    # the per-thread form's instruction (MC_MMV_L2_NEXT_KEEP: evict_last) and its line (LSU=1: 128
    # bytes, 2: a 32-byte sector); the bulk form's evict_last request; the node being evaluated
    "template <bool KEEP> static __device__ __forceinline__ void mc_prefetch_line(": (
        'asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(p) : "memory");',
        'asm volatile("prefetch.global.L2 [%0];" ::"l"(p) : "memory");',
    ),
    "static mc_next_args mc_next_now(": ("a.line                   = lsu == 1 ? 128 : lsu == 2 ? 32 : 0;",),
    "static __device__ __forceinline__ void mc_prefetch_l2_keep(": (
        'asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));',
        "cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;",
    ),
    "void ggml_cuda_mc_next_weights_at(": ("mc_next_node  = in ? node_index : -1;",),
    "static int mc_next_gap(": (
        "const bool in = a >= 0 && a < b && b < (int) mc_next_work.size();",
        "return in ? mc_next_work[b] - mc_next_work[a + 1] : 0;",
    ),
    "static bool mc_next_launches(": (
        "case GGML_OP_NONE:",
        "case GGML_OP_VIEW:",
        "case GGML_OP_RESHAPE:",
        "case GGML_OP_PERMUTE:",
        "case GGML_OP_TRANSPOSE:",
        "return false;",
        "return !ggml_is_empty(t);",
    ),
    "void ggml_cuda_mc_next_weights_plan(": (
        "mc_next_work.assign(n + 1, 0);",
        "mc_next_work[i + 1]    = mc_next_work[i] + (mc_next_launches(nd) ? 1 : 0);",
        "cur.c[k]  = cur.c[k - 1];",
        "cur.at[k] = cur.at[k - 1];",
        "cur.c[0]  = nd->src[0];",
        "cur.at[0] = i;",
    ),
    "template <bool KEEP> static __device__ __forceinline__ void mc_prefetch_lines(": (
        "const int threads = (int) (blockDim.x * blockDim.y);",
        "const int all     = (int) (gridDim.x * gridDim.y) * threads;",
        "const int tid     = (int) (threadIdx.y * blockDim.x + threadIdx.x);",
        "int       j       = (int) (blockIdx.y * gridDim.x + blockIdx.x) * threads + tid;",
        "const int per0    = (pf.unit[0] + pf.line - 1) / pf.line;",
        "const int per1    = (pf.unit[1] + pf.line - 1) / pf.line;",
        "for (; j < pf.pieces[0] * per0; j += all) {",
        "const int p = j / per0;",
        "mc_prefetch_line<KEEP>(pf.ptr[0] + p * pf.stride[0] + (j - p * per0) * pf.line);",
        "for (j -= pf.pieces[0] * per0; j < pf.pieces[1] * per1; j += all) {",
        "const int p = j / per1;",
        "mc_prefetch_line<KEEP>(pf.ptr[1] + p * pf.stride[1] + (j - p * per1) * pf.line);",
    ),
}


def test_the_source_is_what_is_emulated(patched):
    source = (patched / "ggml/src/ggml-cuda/mc-mmv.cu").read_text()
    assert "#define MC_NEXT_CANDIDATES (MC_GROUP_MAX + 2)" in source
    assert f"#define MC_NEXT_UNIT {MC_NEXT_UNIT}" in source
    assert f"#define MC_GROUP_MAX {MC_GROUP_MAX}" in (patched / "ggml/src/ggml-cuda/mc-group.h").read_text()
    assert f"#define MC_NEXT_RANGES {MC_NEXT_RANGES}" in source
    # each function's statements that the emulation above transcribes
    for head, lines in STATEMENTS.items():
        assert_statements(c_body(source, head), lines)
    # thread 0 of each block, or every thread for the per-thread form; a call (inlined, a verify kernel
    # at its register bound spilled)
    call = c_body(source, "static __device__ __noinline__ void mc_prefetch_next(const mc_next_args pf) {")
    assert call.index("if (pf.line > 0) {") < call.index("mc_prefetch_lines<true>(pf);")
    assert call.index("mc_prefetch_lines<false>(pf);") < call.index("} else if (threadIdx.x == 0) {")
    assert call.index("} else if (threadIdx.x == 0) {") < call.index("mc_prefetch_ranges<true>(pf);")
    # the settings, their ranges and defaults: the budget, the gap rule, both request forms off
    for setting in SETTINGS:
        assert f"mc_env_int({setting})" in source, setting
    # every launcher of a kernel that prefetches hands it the request; the persistent kernel too
    assert source.count("mc_prefetch_next(pf);") == 3
    pmv = c_body(source, "static __global__ void mc_pmv_q4_0(")
    assert pmv.index("mc_prefetch_next(a.pf);") > pmv.rindex("parity ^= 1u;")  # after its last piece
    assert "a.pf          = mc_next_now();" in source
