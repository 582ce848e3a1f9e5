"""The CUDA kernels of the patch series compile for the two targets (sm_90 H100/H200, sm_120 RTX
5090) without register spills. Correctness and speed are checked on a GPU by bench/gpu/side_by_side.sh
(test-backend-ops, CUDA vs CPU, with cases for these shapes; logits of the patched vs the stock
build); this machine has nvcc but no GPU and no cuBLAS, so a stub header stands in for cublas_v2.h."""

from __future__ import annotations

import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.ggml_patches.q4_nibbles import check_high_nibbles_in_place

STUB = Path(__file__).parent / "cuda_stub"


# fattn.cu's flags: the K-V type pairs of the vector kernel that ggml's CMake defines (its default list on)
_FA_TYPES = ("F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "BF16")
_FA_ON = {("F16", "F16"), ("Q4_0", "Q4_0"), ("Q8_0", "Q8_0"), ("BF16", "BF16")}
FATTN_FLAGS = ["--extended-lambda"] + [
    f"-DGGML_CUDA_FA_{k}_{v}={int((k, v) in _FA_ON)}" for k in _FA_TYPES for v in _FA_TYPES
]


def compile_cuda(
    patched: Path, name: str, arch: str, out_dir: Path, *flags: str
) -> subprocess.CompletedProcess[str]:
    """nvcc -c of the patched tree's ggml-cuda/NAME for sm_ARCH (skips where nvcc is missing)."""
    nvcc = shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None
    )
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    cuda = patched / "ggml" / "src" / "ggml-cuda"
    cmd = [
        nvcc, "-std=c++17", "-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}", *flags,
        f"-I{STUB}", f"-I{patched / 'ggml' / 'include'}", f"-I{patched / 'ggml' / 'src'}", f"-I{cuda}",
        "-c", str(cuda / name), "-o", str(out_dir / (name + ".o")),
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.mark.parametrize("arch", ["90", "120"])
def test_mc_mmv_compiles_without_spills(patched, arch, tmp_path):
    out = compile_cuda(patched, "mc-mmv.cu", arch, tmp_path, "-Xptxas", "-v")
    assert out.returncode == 0, out.stderr[-3000:]
    # ptxas reports each kernel: its name, then stack/spill figures, then registers
    report = out.stderr
    kernels = re.findall(r"Compiling entry function '(_Z\d+mc_mmv_q4_0\w+)'", report)
    # the dp4a kernel: 1..16 columns and the fused gate for one column
    assert len(kernels) == 17, kernels
    # one and two columns and the fused gate: at most 80 registers, so that 6 blocks of 128 threads fit
    # an SM (65,536 / 768 = 85, allocated in steps of 8); patch 0020's MC_MMV_PRE (on) must not cost one
    name = r"Compiling entry function '_Z\d+mc_mmv_q4_0ILi(\d+)ELb(\d)E\w+'.*?Used (\d+) registers"
    small = [(nc, gate, int(r)) for nc, gate, r in re.findall(name, report, re.S) if nc in ("1", "2")]
    assert len(small) == 3 and all(r <= 80 for *_, r in small), small
    source = (patched / "ggml/src/ggml-cuda/mc-mmv.cu").read_text()
    assert 'mc_env_int("MC_MMV_PRE", 0, 1, 1)' in source
    # the int8 tensor-core kernel: one and two tiles of 8 columns, rows split over warps
    # (MC_MMQ_VARIANT=rows, stages of 8 blocks) or K split over warps (wk, stages of 16 blocks)
    mma = re.findall(r"Compiling entry function '(_Z\d+mc_mmq_q4_0\w+)'", report)
    assert len(mma) == 4, mma
    assert sum("Li16ELb1E" in k for k in mma) == 2, mma
    # the f16 forms: one and two tiles of 8 columns x (4 stages, 3 blocks per SM: the default; 4
    # stages, 4 blocks, B fragments straight from global memory: f16d), and the activation converter.
    # Template arguments: columns / 8, stages, blocks per SM, DY. (f16o, f16p, f16t, f16m: measured
    # slower, dropped.) Each takes a group of products (MC_MMV_GROUP) as its first parameter.
    name = r"_Z\d+mc_mmh_q4_0ILi(\d)ELi(\d)ELi(\d)ELb(\d)EEv11mc_mm_group"
    mmh = re.findall(f"Compiling entry function '{name}", report)
    forms = [("4", "3", "0"), ("4", "4", "1")]
    assert sorted(mmh) == sorted((nt, *f) for nt in ("1", "2") for f in forms), mmh
    assert report.count("Compiling entry function '_Z16mc_mmh_convert_y") == 1
    # MC_MMH_REPACK (patch 0015): the repacked form, (columns / 8, stages, bulk copies): one and two
    # tiles with 3 stages and 2 blocks per SM (registers: 65,536 / 256 = 256 a thread), two tiles with 2
    # stages (GPUs with ~100 KB of shared memory a block), each with per-thread copies or (MC_MMR_FORM=3)
    # the warp's bulk copies on mbarriers; the repack and the activation converter. Template arguments
    # (columns / 8, stages, bulk, row tiles of 16 a block, blocks an SM): those of 64 rows and 2 blocks
    # an SM, and (patches 0028 / 0029) the 48- and 32-row forms for products of more than one wave: two
    # tiles, 2 stages, bulk copies, 3 blocks an SM (sm_90: 65,536 / 384 = 170 registers, allocated in
    # steps of 8; sm_120, whose shared memory holds fewer blocks, asks the compiler for 2)
    name = r"entry function '_Z11mc_mmr_q4_0ILi(\d)ELi(\d)ELb(\d)ELi(\d)ELi(\d)EE\w+'.*?Used (\d+) registers"
    mmr = re.findall(name, report, re.S)
    forms = sorted((nt, st, bulk) for nt, st, bulk, mt, _, _ in mmr if mt == "4")
    assert forms == sorted((nt, st, b) for nt, st in (("1", "3"), ("2", "2"), ("2", "3")) for b in "01"), mmr
    assert all(int(r) <= 255 and minb == "2" for _, _, _, mt, minb, r in mmr if mt == "4"), mmr
    narrow = [(nt, st, bulk, mt, minb, int(r)) for nt, st, bulk, mt, minb, r in mmr if mt != "4"]
    assert sorted(f[:5] for f in narrow) == [("2", "2", "1", mt, "3") for mt in ("2", "3")], mmr
    assert all(f[5] <= (168 if arch == "90" else 255) for f in narrow), mmr
    assert "MC_MMR_MINB_CAP 2" in source and "__CUDA_ARCH__ >= 1200" in source
    assert 'mc_env_int("MC_MMR_ROWS32", 0, 1, 1)' in source
    # MC_MMR_BALANCE, MC_MMR_STAGES=2, MC_MMR_PAIRS=1, MC_MMR_DECODE=1, MC_MMR_OFFSET, MC_MMR_TAIL,
    # MC_MMR_SPLIT_ACC, MC_MMR_FOLD, MC_MMR_YREG, MC_MMR_RS and MC_MMR_WS (run AA: a producer warp
    # filling block-wide stages, alone or in clusters sharing the activations by multicast) (measured
    # slower or no faster, dropped): no kernels, template forms or converter arguments of their own
    for dropped in ("mc_mmr_bal", "mc_mmr_pair", "mc_mmr1", "mc_mmr_rs", "mc_mmr_ws"):
        assert f"{dropped}_q4_0" not in report, dropped
    assert not re.search(r"_Z11mc_mmr_q4_0ILi\dELi\dELb\dELb", report)
    for setting in ("SPLIT_ACC", "FOLD", "YREG", "RS", "WS"):
        assert f"MC_MMR_{setting}" not in source, setting
    assert "MC_MMQ_KSLICES_MAX" not in source
    # MC_MMR_PROBE (runs Z / Z2: the kernel with parts of its work left out, wrong results): a
    # diagnostic, removed after its measurements (commit 7fe531f has it)
    assert "MC_MMR_PROBE" not in source
    assert ("1", "2", "1") not in forms
    assert "Compiling entry function '_Z13mc_mmr_repack" in report
    assert "Compiling entry function '_Z16mc_mmr_convert_yPKfP6__halfilii" in report
    # Q6_K at one column (the output matrix): one kernel, registers for its 6 blocks of 128 threads
    # per SM (65,536 / 768 = 85, allocated in steps of 8)
    q6k = re.findall(r"Compiling entry function '_Z11mc_mmv_q6_K\w+'.*?Used (\d+) registers", report, re.S)
    assert len(q6k) == 1 and int(q6k[0]) <= 80, q6k
    # Q6_K at 2..16 columns (patch 0016): one and two tiles of 8 columns, each with the activations in
    # their own order and in the B fragments' (patch 0030, MC_MMQ_Q6K_FRAG), in patch 0037's three
    # layouts (MC_MMQ_Q6K_LAYOUT: 16-bit loads, 32-bit where the blocks start on a word, and that with
    # the even / odd rows), registers for 3 blocks of 128 threads an SM (65,536 / 384 = 170, allocated
    # in steps of 8), and the activations' int8 quantizer in both orders
    name = r"Compiling entry function '_Z11mc_mmq_q6_KILi(\d)ELb(\d)ELi(\d)EE\w+'.*?Used (\d+) registers"
    q6km = re.findall(name, report, re.S)
    want = sorted((nt, f, lay) for nt in "12" for f in "01" for lay in "012")
    assert sorted((nt, f, lay) for nt, f, lay, _ in q6km) == want, q6km
    assert all(int(r) <= 168 for *_, r in q6km), q6km
    assert "Compiling entry function '_Z16mc_q6km_quantizeILb0E" in report
    assert "Compiling entry function '_Z16mc_q6km_quantizeILb1E" in report
    # the persistent one-column kernel (patch 0031, MC_MMV_PERSIST): plain and gated, with its arithmetic
    # (the copies-only form is the mmr lab's), the activations in registers (registers for 2 CTAs of 256
    # threads an SM: 65,536 / 512) or in shared memory (MC_MMV_PERSIST_YSMEM: 3 CTAs, 65,536 / 768 = 85,
    # allocated in steps of 8)
    name = r"Compiling entry function '_Z11mc_pmv_q4_0ILb(\d)ELb(\d)ELb(\d)EE\w+'.*?Used (\d+) registers"
    pmv = re.findall(name, report, re.S)
    assert sorted((g, m, y) for g, m, y, _ in pmv) == [
        ("0", "1", "0"),
        ("0", "1", "1"),
        ("1", "1", "0"),
        ("1", "1", "1"),
    ], pmv
    assert all(int(r) <= (80 if y == "1" else 128) for *_, y, r in pmv), pmv
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills and all(s == ("0", "0") for s in spills), spills


def test_the_warpgroup_form_compiles_for_sm_90a_and_is_wired(patched, tmp_path):
    """Patch 0025 (MC_MMR_FORM=4, off by default: measured slower than form 3, bench/NOTES.md): the
    copies' products on sm_90a's asynchronous warpgroup MMAs. For sm_90a the kernel holds the MMAs
    (66 registers, no spills, 4 CTAs of 128 threads an SM); elsewhere (sm_90, sm_120: the tests
    above) it compiles to nothing, and the host runs it only where a probe kernel, launched once a
    device outside graph capture, says the build holds its code; else form 3 with a warning. The
    copies are made in the form's own order then, and its K slices are one thread-block cluster."""
    out = compile_cuda(patched, "mc-mmv.cu", "90a", tmp_path, "-Xptxas", "-v")
    assert out.returncode == 0, out.stderr[-3000:]
    name = r"function '(_Z11mc_mmw_q4_0\w+)' for 'sm_90a'.*?(\d+) bytes spill stores.*?Used (\d+) registers"
    mmw = re.findall(name, out.stderr, re.S)
    assert len(mmw) == 1 and mmw[0][1] == "0" and int(mmw[0][2]) <= 128, mmw
    # ptxas may wait on the MMAs only on the stage wait's trap path (one place), not in the loop
    assert out.stderr.count("warpgroup.wait is injected") <= 1, out.stderr
    assert "warpgroup.arrive is injected" not in out.stderr
    # every kernel of the file declares the one dynamic shared-memory symbol with the same alignment
    assert "specified alignment" not in out.stderr
    assert "Compiling entry function '_Z16mc_mmw_convert_y" in out.stderr
    source = (patched / "ggml/src/ggml-cuda/mc-mmv.cu").read_text()
    assert 'mc_env_int("MC_MMR_FORM", 1, 4, 3)' in source  # 3 stays the default
    on = c_body(source, "static bool mc_mmw_on(")
    assert "mc_mmr_form() == 4 && mc_mmw_ok[device] == 2" in on
    assert "if (mc_mmw_on(ctx.device))" in c_body(source, "static bool mc_mmr_run(")
    # the copies in the form's order (layout 1) exactly where the form runs them (the same test); else
    # patch 0038's quad-major layout where MC_MMR_QMAJOR asks for it
    assert "mc_mmw_on(ctx.device) ? 1 : (mc_mmr_qmajor() ? 2 : 0));" in source
    prepare = c_body(source, "void ggml_cuda_mc_repack_prepare(")
    assert "cc == GGML_CUDA_CC_HOPPER" in prepare and "mc_mmw_probe<<<" in prepare
    assert prepare.index("mc_mmw_probe<<<") < prepare.index("cudaStreamSynchronize")
    # the probe settles the form before any copy of this graph is made
    assert prepare.index("mc_mmw_ok[ctx.device] = ") < prepare.index("ggml_graph_n_nodes")
    kernel = c_body(source, "static __global__ void mc_mmw_q4_0(")
    # weights' first stages before the PDL wait, activations after; the stage refilled only after its
    # MMAs are done; K slices summed over the cluster's shared memory in slice order, and no CTA
    # leaves before the others have read it
    assert kernel.index("issue_w(c)") < kernel.index("ggml_cuda_pdl_sync()") < kernel.index("issue_y(c)")
    assert kernel.index("wgmma.wait_group.sync.aligned 1") < kernel.index("issue_w(c - 1 + MC_MMW_STAGES)")
    tail = kernel[kernel.index("wgmma.wait_group.sync.aligned 0") :]
    assert tail.count("mc_cluster_sync()") == 2 and "mc_ld_cluster(p, (uint32_t) s)" in tail
    assert "atomic" not in kernel and "partials" not in kernel
    launch = c_body(source, "static void mc_mmw_launch_kernel(")
    assert "cudaLaunchAttributeClusterDimension" in launch and "clusterDim.y = grid.y" in launch
    assert "MC_MMW_MAX_SLICES 8" in source  # the portable cluster size
    assert "std::min(mc_mmq_kslices(ntiles, nquads, slots), ks_max)" in source


def test_bulk_copies_land_on_128_byte_lines(patched):
    """Patch 0024: the kernels that fill shared memory with bulk copies address their stages from the
    dynamic shared memory's first 128-byte boundary (the static mbarriers before it leave it 16-byte
    aligned: a copy there reached L2 as one request a 32-byte sector, run AJ), and their launchers
    allocate the padding."""
    source = (patched / "ggml/src/ggml-cuda/mc-mmv.cu").read_text()
    helper = c_body(source, "static __device__ __forceinline__ char * mc_smem_lines(")
    assert "(128u - (mc_smem_addr(p) & 127u)) & 127u" in helper and "#define MC_SMEM_PAD 128" in source
    for head in ("static __global__ void mc_mmr_q4_0(", "static __global__ void mc_mmw_q4_0("):
        kernel = c_body(source, head)
        assert "char * const                         smem = mc_smem_lines(mc_smem);" in kernel, head
        assert re.search(r"\bmc_smem\s*\+", kernel) is None, head  # no stage from the unaligned base
    wlaunch = c_body(source, "static void mc_mmw_launch(")
    assert re.search(r"constexpr size_t smem\s+=.*\+ MC_SMEM_PAD;", wlaunch)
    # mc_mmr_q4_0's launches (every row-tile form) take their size from one function, which adds the pad
    sizes = c_body(source, "static constexpr size_t mc_mmr_smem(")
    assert "mc_mmr_warp_stage(NT, BULK, MT) + MC_SMEM_PAD;" in sizes
    assert "mc_mmr_smem<NT, STAGES, BULK, MT>(), stream);" in c_body(source, "static void mc_mmr_start(")
    # the dispatch picks 3 stages of two column tiles only where a block gets them with the pad
    run = c_body(source, "static bool mc_mmr_run(")
    assert "(size_t) 3 * MC_MMQ_WARPS * MC_MMR_ITEMS(2) * 512 + MC_SMEM_PAD;" in run
    assert run.count("smpbo") == 1
    # patch 0031's persistent one-column kernel likewise: its stages from the aligned base, its launcher
    # allocating the pad
    pmv = c_body(source, "static __global__ void mc_pmv_q4_0(")
    assert "char *    smem = mc_smem_lines(mc_smem_raw);" in pmv
    assert re.search(r"\bmc_smem_raw\s*\+", pmv) is None
    sizes = c_body(source, "static size_t mc_pmv_smem(")
    assert "return (size_t) st.stages * st.stage_bytes + y + MC_SMEM_PAD;" in sizes
    # the activations' copy (YSMEM) past the stages: 128-byte aligned too (stage_bytes is a multiple of 128)
    assert "((size_t) nblocks * sizeof(block_q8_1) + 127) / 128 * 128" in sizes
    assert "(const block_q8_1 *) (smem + a.stages * a.stage_bytes);" in pmv
    plaunch = c_body(source, "static bool mc_pmv_launch_as(")
    assert "const size_t          smem = mc_pmv_smem(st, nblocks, YS);" in plaunch
    # every bulk copy (but the helper's definition) is made in one of those three kernels
    spans = []
    for head in (
        "static __global__ void mc_mmr_q4_0(",
        "static __global__ void mc_mmw_q4_0(",
        "static __global__ void mc_pmv_q4_0(",
    ):
        start = source.index(head)
        spans.append((start, source.index("\n}\n", start)))
    # (mc_bulk_copy_at, patch 0040, takes the barrier's address; mc_bulk_copy's body is one call of it)
    calls = [m.start() for m in re.finditer(r"\bmc_bulk_copy(_at)?\(", source)]
    helpers = [
        source.index("void mc_bulk_copy(") + len("void "),
        source.index("void mc_bulk_copy_at(") + len("void "),
        source.index("mc_bulk_copy_at(dst, src, bytes, mc_smem_addr(bar));"),
    ]
    inside = [c for c in calls if any(a < c < b for a, b in spans)]
    assert len(inside) >= 7 and sorted([*inside, *helpers]) == calls


def test_the_k_slices_last_cta_loads_its_partials_together_in_slice_order(patched):
    """Patch 0026: the tile's last CTA loads E outputs' partials of U slices before adding any (the
    loads no longer wait on each other one output at a time), and adds them in slice order into sums
    that start at zero, as the one-at-a-time loop did (the same results to the bit: run AL's logits
    equal run AJ's); the f16 form (registers short) keeps that loop."""
    source = (patched / "ggml/src/ggml-cuda/mc-mmv.cu").read_text()
    start = source.index("template <int E = 4, int U = 4>\nstatic __device__ void mc_mmq_ksplit_finish(")
    body = source[start : source.index("\n}\n", start)]
    batched = body[body.index("} else {") :]
    loads = batched.index("__ldcg(partials + at)")
    adds = batched.index("x[e] += v[u][e];  // slice order")
    # every load of a round before the first add; slices outer (u), outputs inner (e), rounds of U
    assert loads < adds and "for (int s0 = 0; s0 < ks; s0 += U)" in batched
    assert batched.index("for (int u = 0; u < U; ++u)", loads) < adds
    assert "x[e]        = 0.0f;" in batched and "if (s0 + u < ks)" in batched
    assert "for (int s = 0; s < ks; ++s)" in body[: body.index("} else {")]  # the (1, 1) loop
    calls = re.findall(r"mc_mmq_ksplit_finish(<[^>]+>)?\(dst,\s+partials", source)
    # mc_mmq_q4_0, the f16 form (mc_mmh), the copies' form (patch 0027: 8 outputs a thread, a 16-column
    # tile's 1,024 sums in one round; the narrower forms of patch 0029: 4, within their registers)
    assert calls == ["", "<1, 1>", "<MT == 4 ? 8 : 4, 4>"], calls


def test_the_narrow_row_tile_forms_have_test_backend_ops_cases(patched):
    """Patches 0028 / 0029: test-backend-ops holds products that take the narrower row tiles on the
    copies (run with MC_MMH_REPACK=2 on a GPU): the FFN's gate + up group at 12 and 16 columns and a
    34,816-row matrix, whose last 48-row tiles are partial (32 and 16 rows)."""
    tests = (patched / "tests/test-backend-ops.cpp").read_text()
    for case in (
        "test_mc_mul_mat_group(GGML_TYPE_Q4_0, {17408, 17408}, 12, 5120)",
        "test_mc_mul_mat_group(GGML_TYPE_Q4_0, {17408, 17408}, 16, 5120)",
        "test_mul_mat(GGML_TYPE_Q4_0, GGML_TYPE_F32, 34816, 16, 5120, {1, 1}, {1, 1})",
    ):
        assert case in tests, case
    assert 17408 % 48 == 32 and 34816 % 48 == 16  # the partial last tiles the docstring names


def test_the_k_slices_counter_is_one_release_acquire_atomic(patched):
    """Patch 0027: the K slices' finish orders every thread's partials before the tile's counter with
    the block's barrier and thread 0's release-acquire atomic (CUTLASS's split-K semaphore pattern),
    and thread 0's acquire before every thread's reads of the partials with the second barrier,
    instead of a full fence in every thread before and after a relaxed atomic."""
    source = (patched / "ggml/src/ggml-cuda/mc-mmv.cu").read_text()
    atom = c_body(source, "static __device__ __forceinline__ unsigned int mc_atom_add_acq_rel(")
    assert 'asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], %2;"' in atom
    body = c_body(source, "template <int E = 4, int U = 4>\nstatic __device__ void mc_mmq_ksplit_finish(")
    head = body[: body.index("const int64_t slice_stride")]
    assert "__threadfence" not in head
    first, second = (m.start() for m in re.finditer(r"__syncthreads\(\);", head))
    counter = head.index("is_last = mc_atom_add_acq_rel(counter, 1u) == gridDim.y - 1;")
    assert first < counter < second < head.index("if (!is_last)")


def test_the_q6k_activations_fragment_order_matches_its_emulation(patched):
    """Patch 0030 (MC_MMQ_Q6K_FRAG, on by default since patch 0037): the quantizer's stores and the
    kernel's 16-byte loads are the ones tests/ggml_patches/test_q6km_layout.py emulates (store /
    load_words), and the setting picks both instances of the kernel and the quantizer together."""
    source = (patched / "ggml/src/ggml-cuda/mc-mmv.cu").read_text()
    quant = c_body(source, "template <bool FRAG>\nstatic __global__ void mc_q6km_quantize(")
    assert "const int off = FRAG ? 64 * (sb / 4) + 16 * (2 * (lane % 2)) + 4 * (sb % 4) : lane * 8;" in quant
    assert "*(char4 *) (qb + (FRAG ? 16 : 4)) = hi;" in quant
    head = "template <int NT, bool FRAG>\nstatic __device__ __forceinline__ void mc_q6km_load_y("
    load = c_body(source, head)
    assert "const int4 w      = *(const int4 *) (blk + 64 * i + 16 * t);" in load
    assert "yb[nt][s] = *(const int *) (blk + 4 * t + 16 * s);" in load
    launch = c_body(source, "template <int NT, bool FRAG, int L>\nstatic bool mc_mmq_q6_K_launch(")
    assert "mc_mmq_q6_K<NT, FRAG, L>" in launch and "mc_q6km_quantize<FRAG>" in launch
    # on by default since patch 0037 (run AZ: the product 21% faster in the mmr lab, the same sums)
    assert 'mc_env_int("MC_MMQ_Q6K_FRAG", 0, 1, 1) == 1' in c_body(source, "static bool mc_q6km_frag(")
    pick = c_body(source, "static bool mc_mmq_q6_K_pick(")
    assert "mc_mmq_q6_K_launch<2, true, L>" in pick and "mc_mmq_q6_K_launch<2, false, L>" in pick
    try_ = c_body(source, "static bool mc_mmq_q6_K_try(")
    assert "const bool frag   = mc_q6km_frag();" in try_
    assert "const int  layout = mc_q6km_layout(row_bytes);" in try_
    for layout in "012":
        assert f"mc_mmq_q6_K_pick<{layout}>(ctx, src0, src1, dst, smem, frag)" in try_


def test_the_persistent_one_column_kernel_is_wired_and_falls_back(patched):
    """Patch 0031 (MC_MMV_PERSIST, on by default since run AQ measured decode +5.4%): one column's products
    (plain, grouped, the gated FFN) go to the persistent kernel unless the setting is 0 or something rules
    it out (biases, a GPU before Hopper or a build without its code, rows or weights not 16-byte
    aligned, no piece shape that fits the stages), else to mc_mmv_q4_0 as before; its first stages are
    requested before the PDL wait and the activations read after it; its stage waits and refills keep
    the ring's order."""
    source = (patched / "ggml/src/ggml-cuda/mc-mmv.cu").read_text()
    assert 'mc_env_int("MC_MMV_PERSIST", 0, 1, 1)' in source
    launch = c_body(source, "template <int NC, bool GATE>\nstatic bool mc_mmv_launch(")
    hook = launch.index("if constexpr (NC == 1) {")
    assert "mc_pmv_on() && !x_bias && !gate_bias &&" in launch[hook:]
    persist = launch.index("mc_pmv_launch<GATE, true>(")
    # (patch 0054: returns whether the gated product's q8_1 blocks were written, never by mc_mmv_q4_0)
    assert hook < persist < launch.index("return q8_done;") < launch.index("mc_mmv_q4_0<NC, GATE>")
    assert launch.rstrip().endswith("return false;")
    # the definition (a declaration before mc_mmv_launch has the same head up to its parameters)
    head = "static bool mc_pmv_launch(const mc_mm_group & grp, const char * vgate, const block_q8_1 * y, "
    run = c_body(source, head + "const int glu_op,")
    run += c_body(source, "static bool mc_pmv_launch_as(")
    for rule in (
        "cc < GGML_CUDA_CC_HOPPER || ggml_cuda_highest_compiled_arch(cc) < GGML_CUDA_CC_HOPPER",
        "row_bytes % 16 != 0",
        "(uintptr_t) y % 8 != 0",
        "(uintptr_t) grp.vx[i] % 16 != 0",
        "if (plan.rs == 0 || !mc_pmv_worth(plan, ctas, st.min_pieces, st.max_wpr)) {",
        "if (ctas < 1) {",
        # the activations in shared memory: one bulk copy, so 16-byte aligned
        "return (uintptr_t) y % 16 == 0 &&",
    ):
        assert rule in run, rule
    assert 'mc_env_int("MC_MMV_PERSIST_YSMEM", 0, 1, 0)' in source
    assert 'mc_env_int("MC_MMV_PERSIST_CTAS", 1, 3, 2)' in source
    # where it runs: a row on at most MC_MMV_PERSIST_MAX_WPR (2) warps, at least MC_MMV_PERSIST_MIN_PIECES
    # (6) pieces a CTA
    worth = c_body(source, "static bool mc_pmv_worth(")
    assert "MC_PMV_WARPS / plan.rs <= max_wpr && plan.npieces >= (int64_t) min_pieces * ctas" in worth
    assert 'mc_env_int("MC_MMV_PERSIST_MAX_WPR", 1, MC_PMV_WARPS, 2)' in source
    assert 'mc_env_int("MC_MMV_PERSIST_MIN_PIECES", 0, 64, 6)' in source
    assert 'mc_env_int("MC_MMV_PERSIST_STAGES", 2, MC_PMV_MAX_STAGES, 3)' in source
    # the dynamic shared memory allowed: the block's limit less the kernel's static part (the limit
    # itself is refused as an invalid argument: run AP's first calls)
    ctas = c_body(source, "template <bool GATE, bool MATH, bool YS> static int mc_pmv_ctas(")
    assert "CUDA_SET_SHARED_MEMORY_LIMIT(kernel, (int) dev.smpbo - static_bytes);" in ctas
    assert "cudaFuncGetAttributes(&attr, kernel)" in ctas and "attr.sharedSizeBytes" in ctas
    kernel = c_body(source, KERNEL_HEAD)
    first, pdl = kernel.index("issue(i, i);"), kernel.index("ggml_cuda_pdl_sync();")
    load_y = "mc_load_q8_1_pair<false>(a.y + kb, u[2 * jp], ds[2 * jp], u[2 * jp + 1], ds[2 * jp + 1]);"
    assert first < pdl < kernel.index(load_y)
    # YS: the activations' copy after the PDL wait, waited on by every thread before the first piece
    copy_y = kernel.index("mc_bulk_copy((void *) ys, a.y, (uint32_t) a.ybytes, ybar);")
    wait_y = kernel.index("mc_mbar_wait(ybar, 0);")
    assert pdl < copy_y < wait_y < kernel.index("for (int i = 0; i < n; ++i) {")
    assert "mc_load_q8_1_pair<true>(ys + kb, y0, e0, y1, e1);" in kernel
    loop = kernel[kernel.index("for (int i = 0; i < n; ++i) {") :]
    wait = loop.index("mc_mbar_wait(&bars[stage], parity);")
    last_sync = loop.rindex("__syncthreads();")
    refill = loop.index("issue(i + a.stages, stage);")
    # the stage and parity step as i does (i % stages, (i / stages) & 1), after the refill of that stage
    step = loop.index("if (++stage == a.stages) {\n            stage = 0;\n            parity ^= 1u;")
    assert wait < last_sync < refill < step
    assert "int      stage     = 0;\n    uint32_t parity    = 0;" in kernel


def byte_perm(x: int, y: int, sel: int) -> int:
    """CUDA's __byte_perm(x, y, sel): byte i of the result is byte (sel >> 4 i) & 7 of y:x."""
    pool = (x | y << 32).to_bytes(8, "little")
    return int.from_bytes(bytes(pool[(sel >> 4 * i) & 7] for i in range(4)), "little")


def pmv_pair_end(nblocks: int, wpr: int, slots: int = 6) -> int:
    """mc_pmv_pair_end (patch 0043), transcribed: the test below checks the source has its statements."""
    rnd = 2 * 32 * wpr
    full = nblocks // rnd
    rest = nblocks - full * rnd
    return full * rnd if 0 < rest <= 32 * wpr and 2 * full < slots - 1 else nblocks


def test_the_persistent_kernels_tail_takes_every_block_once_one_a_lane(patched):
    """Patch 0043 (MC_MMV_PERSIST_TAIL, on by default since run BM: decode +1.4%): the blocks past the
    last whole round of pairs go one a lane. For every row length the plan allows (32 wpr MC_PMV_J >=
    nblocks) and every warps-a-row: each block is taken once, by a pair or by one lane's tail; a lane's
    pairs leave the last activation slot to its tail block; the tail is one round; on two warps a row a
    warp's lanes read their tail blocks' words on distinct banks. The 27B's rows (K = 5,120 on one and
    two warps, 6,144 on two) take the tail and issue fewer rounds. A block's unpacking from any index
    (odd ones 2 bytes past a word) gives its quants and scale. The source holds the statements
    transcribed here."""
    slots = 6
    for wpr in (1, 2, 4, 8):
        for nblocks in range(2, 32 * wpr * slots + 1, 2):
            pe = pmv_pair_end(nblocks, wpr, slots)
            taken = [0] * nblocks
            for q in range(wpr):
                for lane in range(32):
                    used = []
                    for jp in range(slots // 2):
                        kb = 2 * (q * 32 + lane + 32 * wpr * jp)
                        if kb < pe:
                            taken[kb] += 1
                            taken[kb + 1] += 1
                            used += [2 * jp, 2 * jp + 1]
                    kt = pe + lane * wpr + q
                    if kt < nblocks:
                        taken[kt] += 1
                        assert slots - 1 not in used, (nblocks, wpr, q, lane)
            assert taken == [1] * nblocks, (nblocks, wpr)
            assert nblocks - pe <= 32 * wpr
    # a warp's rounds in blocks a lane (a pair's round 2, the tail's 1): without the tail, with it
    for nblocks, wpr, before, after in ((160, 1, 6, 5), (160, 2, 4, 3), (192, 2, 4, 3)):
        pe = pmv_pair_end(nblocks, wpr)
        assert pe < nblocks and 2 * (pe // (64 * wpr)) + 1 == after < before, (nblocks, wpr)
    for nblocks, q in ((160, 0), (160, 1), (192, 0), (192, 1)):  # two warps a row: warp q's tail lanes
        pe = pmv_pair_end(nblocks, 2)
        kts = [pe + lane * 2 + q for lane in range(32) if pe + lane * 2 + q < nblocks]
        words = [(18 * kt - (kt & 1) * 2) // 4 for kt in kts]  # each load i reads word + i
        assert kts and len({w % 32 for w in words}) == len(words), (nblocks, q)
    rng = random.Random(7)
    row = bytes(rng.randrange(256) for _ in range(18 * 8))
    for kb in range(8):
        at = 18 * kb - (kb & 1) * 2
        x = [int.from_bytes(row[at + 4 * i : at + 4 * i + 4], "little") for i in range(5)]
        sel = 0x7654 if kb & 1 else 0x5432
        v = [byte_perm(x[i], x[i + 1], sel) for i in range(4)]
        assert v == [
            int.from_bytes(row[18 * kb + 2 + 4 * i : 18 * kb + 6 + 4 * i], "little") for i in range(4)
        ]
        d = byte_perm(x[0], 0, 0x4432 if kb & 1 else 0x4410)
        assert d == int.from_bytes(row[18 * kb : 18 * kb + 2], "little")
    source = (patched / "ggml/src/ggml-cuda/mc-mmv.cu").read_text()
    assert_statements(
        c_body(source, "static int mc_pmv_pair_end(const int nblocks, const int wpr) {"),
        (
            "const int round = 2 * WARP_SIZE * wpr;",
            "const int full  = nblocks / round;",
            "const int rest  = nblocks - full * round;",
            "return rest > 0 && rest <= WARP_SIZE * wpr && 2 * full < MC_PMV_J - 1 ? full * round : nblocks;",
        ),
    )
    assert_statements(
        c_body(source, "static __device__ __forceinline__ void mc_q4_0_unpack1("),
        (
            "const uint32_t * w   = (const uint32_t *) (wb - (kb & 1) * 2);",
            "const uint32_t   sel = (kb & 1) ? 0x7654u : 0x5432u;",
            "v[i] = (int) __byte_perm(x[i], x[i + 1], sel);",
            "__byte_perm(x[0], 0u, (kb & 1) ? 0x4432u : 0x4410u)",
        ),
    )
    kernel = c_body(source, KERNEL_HEAD)
    assert_statements(
        kernel,
        (
            "const int kt  = a.pair_end + lane * wpr + q;",
            "const int kb = 2 * (q * WARP_SIZE + lane + WARP_SIZE * wpr * jp);",
            "if (MATH && kb < a.pair_end) {",
            "mc_load_q8_1(a.y + kt, u[MC_PMV_J - 1], ds[MC_PMV_J - 1]);",
            "if (kb < a.pair_end) {",
            "if (kt < a.nblocks) {",
            "mc_q4_0_unpack1(wrow + a.rs * a.row_bytes, kt, v, d);",
        ),
    )
    assert "#define MC_PMV_J 6 " in source
    assert 'mc_env_int("MC_MMV_PERSIST_TAIL", 0, 1, 1)' in source
    assert (
        "a.pair_end    = YS || !st.tail ? nblocks : mc_pmv_pair_end(nblocks, MC_PMV_WARPS / plan.rs);"
        in source
    )


def pmv_plan(
    rows: list[int], nw: int, nblocks: int, ctas: int, stage_limit: int = 24 * 1024
) -> tuple[int, int]:
    """mc_pmv_choose (patch 0031), transcribed: (rows a piece, pieces) for a group of products with rows
    rows, nw matrices a piece (2: the gated FFN) and nblocks Q4_0 blocks a row; (0, 0) where none fits.
    The test below checks the source has its statements."""
    row_bytes = 18 * nblocks
    best, best_cost = (0, 0), -1
    for rs in (8, 4, 2, 1):
        wpr = 8 // rs
        if nw * rs * row_bytes > stage_limit or 32 * wpr * 6 < nblocks:
            continue
        npieces = sum((r + rs - 1) // rs for r in rows)
        cost = ((npieces + ctas - 1) // ctas) * (nw * rs * row_bytes + 2048)
        if best_cost < 0 or cost < best_cost:
            best, best_cost = (rs, npieces), cost
    return best


def pmv_worth(rs: int, npieces: int, ctas: int, min_pieces: int = 6, max_wpr: int = 2) -> bool:
    """mc_pmv_worth, transcribed."""
    return 8 // rs <= max_wpr and npieces >= min_pieces * ctas


# the 27B's one-column products (bench/gpu/mmr_lab.cu's plan): rows, matrices a piece, K, a bias
PMV_27B = {
    "gdn_in": ([10240, 6144, 48, 48], 1, 5120, False),
    "attn_in": ([12288, 1024, 1024], 1, 5120, False),
    "out": ([5120], 1, 6144, True),  # the GDN / attention output projection, the residual add fused
    "ffn_gate_up": ([17408], 2, 5120, False),
    "ffn_down": ([5120], 1, 17408, True),
}


def test_the_persistent_kernels_plans_for_the_27b(patched):
    """Which of the 27B's one-column products run on the persistent kernel (patch 0031's plan and
    worth rules; a product with a fused bias never does: the output projections and ffn_down, which
    carry the residual add, stay on mc_mmv_q4_0. Patch 0071 gave the persistent kernel the bias, was
    level in run DE and was taken out). On an H100 / H200 (132 SMs, 2 CTAs each: 264) the inputs and
    the gated FFN do; the output projections would not even with no bias (4.8 pieces a CTA, below 6),
    nor ffn_down (a row on 4 warps) unless MC_MMV_PERSIST_MAX_WPR=4. On an RTX 5090 (170 SMs, one
    72 KB CTA each) the output projections would pass the pieces rule: their bias keeps them off there.
    The source holds the rules transcribed here."""

    def persistent(ctas: int, max_wpr: int, bias_too: bool = False) -> set[str]:
        out = set()
        for name, (rows, nw, k, bias) in PMV_27B.items():
            rs, npieces = pmv_plan(rows, nw, k // 32, ctas)
            if rs and pmv_worth(rs, npieces, ctas, max_wpr=max_wpr) and (bias_too or not bias):
                out.add(name)
        return out

    base = {"gdn_in", "attn_in", "ffn_gate_up"}
    assert persistent(264, 2) == persistent(264, 4) == persistent(170, 2) == persistent(170, 4) == base
    # what a bias on the kernel would move (run DE's pb: ffn_down, measured level)
    assert persistent(264, 2, bias_too=True) == base
    assert persistent(264, 4, bias_too=True) == base | {"ffn_down"}
    assert persistent(170, 2, bias_too=True) == base | {"out"}
    assert pmv_plan([5120], 1, 17408 // 32, 264) == (2, 2560)
    assert pmv_plan([5120], 1, 6144 // 32, 264) == (4, 1280)  # 4.8 pieces a CTA: below 6
    assert pmv_plan([17408], 2, 5120 // 32, 264) == (4, 4352)  # 2 warps a row, at any MAX_WPR
    source = (patched / "ggml/src/ggml-cuda/mc-mmv.cu").read_text()
    assert_statements(
        c_body(source, "static mc_pmv_plan mc_pmv_choose("),
        (
            "for (int rs = 8; rs >= 1; rs /= 2) {",
            "const int wpr = MC_PMV_WARPS / rs;",
            "if ((int64_t) nw * rs * row_bytes > stage_limit || WARP_SIZE * wpr * MC_PMV_J < nblocks) {",
            "p.npieces += (grp.nrows[i] + rs - 1) / rs;",
            "const int64_t cost = (int64_t) ((p.npieces + ctas - 1) / ctas) * (nw * rs * row_bytes + "
            "MC_PMV_PIECE_COST);",
            "if (best_cost < 0 || cost < best_cost) {",
        ),
    )
    assert "#define MC_PMV_PIECE_COST 2048" in source and "#define MC_PMV_WARPS 8" in source
    assert 'mc_env_int("MC_MMV_PERSIST_STAGE_KB", 4, 64, 24) * 1024' in source
    assert 'mc_env_int("MC_MMV_PERSIST_MIN_PIECES", 0, 64, 6)' in source
    launch = c_body(source, "template <int NC, bool GATE>\nstatic bool mc_mmv_launch(")
    assert "mc_pmv_on() && !x_bias && !gate_bias &&" in launch


def test_the_q4_0_dot_keeps_the_high_nibbles_in_place(patched):
    """Patch 0044 (no setting: the same integer sums, so the same floats): mc_q4_0_dot, the one- and
    few-column Q4_0 kernels' and the persistent kernel's dot product of a block, sums the high nibbles
    in place through dp4a.u32.s32 and shifts once a block on NVIDIA GPUs from sm_61 on; elsewhere the
    shifted form. The identity, emulated; the source holds the statements emulated."""
    check_high_nibbles_in_place()
    source = (patched / "ggml/src/ggml-cuda/mc-mmv.cu").read_text()
    dot = c_body(source, "static __device__ __forceinline__ float mc_q4_0_dot(")
    assert_statements(
        dot,
        (
            "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 610 && !defined(GGML_USE_HIP) && "
            "!defined(GGML_USE_MUSA)",
            "lo = ggml_cuda_dp4a(v[i] & 0x0F0F0F0F, u[i], lo);",
            'asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(hi) : "r"(v[i] & (int) 0xF0F0F0F0), '
            '"r"(u[i + 4]), "r"(hi));',
            "const int sumi = lo + (hi >> 4);",
            "sumi = ggml_cuda_dp4a((v[i] >> 4) & 0x0F0F0F0F, u[i + 4], sumi);",
            "return d4 * (sumi * ds.x - 8.0f * ds.y);",
        ),
    )


# the persistent kernel's definition (patch 0031)
KERNEL_HEAD = (
    "template <bool GATE, bool MATH, bool YS>\n__launch_bounds__(MC_PMV_WARPS * WARP_SIZE, YS ? 3 : 2)"
)


def kernel_reports(patched: Path, name: str, arch: str, out_dir: Path, mangled: str) -> list[tuple[str, str]]:
    """Compile ggml-cuda/NAME for sm_ARCH with ptxas -v; (spill stores, registers) of each entry function
    whose mangled name matches the regex MANGLED."""
    out = compile_cuda(patched, name, arch, out_dir, "-Xptxas", "-v")
    assert out.returncode == 0, out.stderr[-3000:]
    report = rf"function '{mangled}'.*?(\d+) bytes spill stores.*?Used (\d+) registers"
    return re.findall(report, out.stderr, re.S)


def c_body(source: str, head: str) -> str:
    """The text of the C++ function (or kernel) whose definition starts with head, up to its closing
    brace at the start of a line."""
    start = source.index(head)
    return source[start : source.index("\n}\n", start)]


def mmr_kernel(patched: Path) -> tuple[str, str]:
    """mc-mmv.cu's text and the body of its verify kernel, mc_mmr_q4_0."""
    source = (patched / "ggml/src/ggml-cuda/mc-mmv.cu").read_text()
    return source, c_body(source, "static __global__ void mc_mmr_q4_0(")


def assert_statements(body: str, lines: tuple[str, ...]) -> None:
    """Each of lines is in body (a source's statements that a test's emulation transcribes)."""
    for line in lines:
        assert line in body, line


@pytest.mark.parametrize("arch", ["90", "120"])
def test_the_cached_rms_norm_compiles(patched, arch, tmp_path):
    """Patch 0009 (the cached rms_norm, the default; MC_NORM_PREFETCH=0 off): the multiply-only
    rms_norm's cached form, and patch 0019's residual add + norm + weight in one kernel
    (MC_FUSE_ADD_NORM), each for 256- and 1,024-thread blocks (the fused one also without its
    reduction, patch 0046's diagnostic), compile without spills and within the 64 registers a
    1,024-thread block allows; their test-backend-ops cases are in the tree."""
    out = compile_cuda(patched, "norm.cu", arch, tmp_path, "-Xptxas", "-v")
    assert out.returncode == 0, out.stderr[-3000:]
    # (patch 0055's split form, 8 blocks a row, is the cached 1,024-thread form's second instance)
    forms = {r"_Z12rms_norm_f32ILi(\d+)ELb1ELb0ELb0ELb1ELi\d+E": ["1024", "1024", "256"]}
    # (patch 0061's split form, 8 blocks a row, the 1,024-thread reducing form's second instance)
    forms[r"_Z23mc_add_rms_norm_mul_f32ILi(\d+ELb\d)E"] = ["1024ELb0", "1024ELb1", "1024ELb1"]
    forms[r"_Z23mc_add_rms_norm_mul_f32ILi(\d+ELb\d)E"] += ["256ELb0", "256ELb1"]
    for kernel, expected in forms.items():
        found = re.findall(f"entry function '{kernel}\\w+'.*?Used (\\d+) registers", out.stderr, re.S)
        assert sorted(b for b, _ in found) == expected, (kernel, found)
        assert all(int(r) <= 64 for _, r in found), (kernel, found)
    spills = re.findall(r"(\d+) bytes spill stores", out.stderr)
    assert spills and set(spills) == {"0"}, spills
    tests = (patched / "tests/test-backend-ops.cpp").read_text()
    assert "MegaCapybara (the cached rms_norm, default; MC_NORM_PREFETCH=0 off)" in tests
    assert "struct test_mc_add_rms_norm_mul : public test_case" in tests


def test_the_norm_probe_is_a_read_once_diagnostic_of_the_norms_between_products(patched):
    """Patch 0046 (MC_PROBE_NORM, a diagnostic like MC_PROBE_SKIP: wrong results when set): read once
    (0..3, default 0) with a warning when set; 1 takes the fused add + norm's nodes without a launch,
    2 launches that kernel without its reduction, 3 takes the stock norm + weight of one row of 1,024
    or more values without a launch; 0 launches them as before."""
    main = (patched / "ggml/src/ggml-cuda/ggml-cuda.cu").read_text()
    probe = c_body(main, "static int mc_probe_norm(")
    assert main.count('"MC_PROBE_NORM"') == 1
    assert 'ggml_cuda_mc_env_int("MC_PROBE_NORM", 0, 3, 0)' in probe
    assert "a diagnostic, the results are wrong" in probe
    fuse = main.index("static int mc_try_add_rms_norm(")
    body = main[fuse : main.index("return 2;", fuse)]
    assert "const int probe = mc_probe_norm();" in body
    assert "if (probe != 1) {" in body
    # (patch 0052 passes its pre-quantized blocks, MC_PREQ, to both calls)
    assert "ggml_cuda_mc_add_rms_norm_mul(*ctx, add, norm, mul, probe != 2, pq.q8, split, ph.out)" in body
    stock = main.index("ggml_cuda_op_rms_norm_fused(*cuda_ctx, node, cgraph->nodes[i + 1], mc_pq.q8, mc_pq")
    skip = "if (mc_probe_norm() == 3 && ggml_nrows(node) == 1 && node->ne[0] >= 1024) {"
    assert skip in main[stock - 450 : stock]
    norm = (patched / "ggml/src/ggml-cuda/norm.cu").read_text()
    assert "if constexpr (REDUCE) {" in norm
    assert "reduce ? mc_add_rms_norm_mul_f32<1024, true> : mc_add_rms_norm_mul_f32<1024, false>" in norm


@pytest.mark.parametrize("arch", ["90", "120"])
def test_the_split_argmax_compiles(patched, arch, tmp_path):
    """Patch 0011: argmax of long rows over many blocks (a block's share, then a warp a row) compiles
    for sm_90 / sm_120 without spills, beside the stock kernel; its test-backend-ops cases (248,320
    and 151,936 columns, 1 and 12 rows, and both sides of the split threshold) are in the tree."""
    out = compile_cuda(patched, "argmax.cu", arch, tmp_path, "-Xptxas", "-v")
    assert out.returncode == 0, out.stderr[-3000:]
    for name in ("_Z15mc_argmax_parts", "_Z15mc_argmax_final", "_Z10argmax_f32"):
        assert f"Compiling entry function '{name}" in out.stderr, name
    spills = re.findall(r"(\d+) bytes spill stores", out.stderr)
    assert spills and set(spills) == {"0"}, spills
    tests = (patched / "tests/test-backend-ops.cpp").read_text()
    assert "for (int64_t ne0 : { 248320, 151936, 16384, 16383 })" in tests


@pytest.mark.parametrize("arch", ["90", "120"])
def test_the_staged_gated_delta_net_compiles(patched, arch, tmp_path):
    """Patches 0017 / 0019: the Gated DeltaNet recurrence for two or more tokens stages chunks of 16
    tokens in shared memory (MC_GDN_STAGE), and with a scalar gate can take q and k before their L2
    normalisation (MC_FUSE_GDN_L2); every head size (16..128), scalar and vector gate, with and
    without snapshots, has a stock and a staged instance, the scalar gate each with and without the
    normalisation; the scalar-gate instances of 128-thread blocks stay within 40 registers (12 blocks
    an SM: the 27B's 48 heads x 32 blocks in one wave on an H200); the gates kernel (MC_FUSE_GDN_GATES)
    is there; nothing spills; the test-backend-ops cases for the 27B's shapes are in."""
    out = compile_cuda(patched, "gated_delta_net.cu", arch, tmp_path, "-Xptxas", "-v")
    assert out.returncode == 0, out.stderr[-3000:]
    name = r"function '_Z20gated_delta_net_cudaILi(\d+)ELb(\d)ELb(\d)ELi(\d+)ELb(\d)E\w+'.*?Used (\d+) "
    found = re.findall(name + "registers", out.stderr, re.S)
    kinds = sorted(f[:5] for f in found)
    sizes = ("16", "32", "64", "128")
    want = [(sv, "0", keep, ch, l2) for sv in sizes for keep in "01" for ch in ("0", "16") for l2 in "01"]
    want += [(sv, "1", keep, ch, "0") for sv in sizes for keep in "01" for ch in ("0", "16")]
    assert kinds == sorted(want), kinds
    # (head size 16: 64-thread blocks, so 12 of them allow 85 registers)
    assert all(int(f[5]) <= 40 for f in found if f[1] == "0" and f[0] != "16"), found
    assert "Compiling entry function '_Z12mc_gdn_gates" in out.stderr
    # MC_GDN_WIDE (patch 0022, the default at 2+ tokens): the 4-columns-a-warp staged kernel, with and
    # without snapshots and the in-kernel normalisation, within 64 registers (8 blocks an SM) and no
    # spills; patch 0073's 2 and 4 columns a lane (MC_GDN_COLS), asked one block an SM, within 192
    # registers (blocks of 4 and 2 warps: 4 and 5 an SM), no spills either (the file's check below)
    name = r"function '_Z11mc_gdn_wideILb(\d)ELb(\d)ELi(\d)E\w+'"
    name += r".*?(\d+) bytes spill stores.*?Used (\d+) registers"
    wide = re.findall(name, out.stderr, re.S)
    assert sorted(w[:3] for w in wide) == [(a, b, c) for a in "01" for b in "01" for c in "124"], wide
    assert all(int(w[4]) <= 64 and w[3] == "0" for w in wide if w[2] == "1"), wide
    assert all(int(w[4]) <= 192 and w[3] == "0" for w in wide), wide
    # MC_GDN_ONE (patch 0056): the one-token kernel with and without the normalisation, within 80
    # registers (its 384 blocks need 3 an SM)
    one = re.findall(r"function '_Z10mc_gdn_oneILb(\d)E\w+'.*?Used (\d+) registers", out.stderr, re.S)
    assert sorted(o[0] for o in one) == ["0", "1"] and all(int(o[1]) <= 80 for o in one), one
    source = (patched / "ggml" / "src" / "ggml-cuda" / "gated_delta_net.cu").read_text()
    assert 'ggml_cuda_mc_env_int("MC_GDN_WIDE", 0, 1, 1)' in source
    # MC_GDN_WIDE=2 (the chunked form, measured no faster than the staged kernel, dropped): not there
    assert "mc_gdn_chunked" not in out.stderr and "mc_gdn_chunked" not in source
    # patch 0023: the staged q / k in 16-byte copies where the rows are aligned, 4-byte ones otherwise
    assert "cp_async_cg_16<0>(ggml_cuda_cvta_generic_to_shared(dst), src)" in source
    assert "((sq1 | sq2 | sq3) & 3) == 0" in source
    # MC_GDN_STAGE=2 (the column-group kernel, measured slower, dropped): not there
    assert "mc_gdn_cols" not in out.stderr
    spills = re.findall(r"(\d+) bytes spill stores", out.stderr)
    assert spills and set(spills) == {"0"}, spills
    tests = (patched / "tests/test-backend-ops.cpp").read_text()
    assert "MegaCapybara (MC_GDN_STAGE)" in tests
    assert "test_gated_delta_net(GGML_TYPE_F32, 16, 128, 17, 2, 3)" in tests
    assert "struct test_mc_gdn_layer : public test_case" in tests


@pytest.mark.parametrize("arch", ["90", "120"])
def test_the_narrow_concat_compiles(patched, arch, tmp_path):
    """Patch 0018: concatenation along dim 0 into rows of at most 64 elements (a recurrent layer's conv
    state and its new tokens) one thread an element, for elements of 1, 2, 4 and 8 bytes, compiles
    without spills beside the stock kernels; its test-backend-ops cases (the transposed token view at
    the 27B's 10,240 channels, 1 and 16 tokens, 12 sequences, rows of 64 and 65) are in the tree."""
    out = compile_cuda(patched, "concat.cu", arch, tmp_path, "-Xptxas", "-v")
    assert out.returncode == 0, out.stderr[-3000:]
    narrow = re.findall(r"Compiling entry function '_Z16mc_concat_narrowI(\w)E", out.stderr)
    assert sorted(narrow) == ["h", "j", "m", "t"], narrow  # uint8, uint32, uint64, uint16
    assert "Compiling entry function '_Z15concat_non_cont" in out.stderr
    spills = re.findall(r"(\d+) bytes spill stores", out.stderr)
    assert spills and set(spills) == {"0"}, spills
    tests = (patched / "tests/test-backend-ops.cpp").read_text()
    assert "struct test_mc_concat_conv : public test_case" in tests
    assert "new test_mc_concat_conv(4, 1000, 62, 2)" in tests


def test_the_patched_ggml_cuda_compiles(patched, tmp_path):
    """ggml-cuda.cu with the series' hunks (the mc-mmv dispatch before mul_mat_q, the grouping's
    reorder and launch, the next-weights hints, the small fusions) compiles for sm_90, ~20 s here;
    mmvq.cu's six-line hook is left to the GPU build (90 s here)."""
    out = compile_cuda(
        patched, "ggml-cuda.cu", "90", tmp_path, "-DGGML_CUDA_USE_GRAPHS"
    )  # as CMake's default
    assert out.returncode == 0, out.stderr[-3000:]
    main = (patched / "ggml" / "src" / "ggml-cuda" / "ggml-cuda.cu").read_text()
    # MC_MMV_L2_NEXT_MB: the plan before the node loop, the candidates named before each node's compute
    plan = main.index("ggml_cuda_mc_next_weights_plan(cgraph);")
    at = main.index("ggml_cuda_mc_next_weights_at(i);", plan)
    assert at < main.index("ggml_cuda_try_fuse(cuda_ctx, cgraph, i)", at)
    assert main.index("ggml_cuda_mc_next_weights_end();", at) > at
    # MC_MMV_GROUP: the reorder opens the graph's optimize step (before the buffers are planned); the
    # grouped launch comes after the stock fusions and before the node's own compute
    opt = main.index("static void ggml_backend_cuda_graph_optimize(")
    reorder = main.index("ggml_cuda_mc_group_reorder(cgraph);", opt)
    assert reorder < main.index("enable_graph_optimization", opt)
    # MC_MMH_REPACK: the copies made before the graph compute decides on a CUDA-graph capture; every
    # write into a CUDA buffer marks copies there stale, and freeing the buffer frees them
    compute = main.index("static enum ggml_status ggml_backend_cuda_graph_compute(")
    prepare = main.index("ggml_cuda_mc_repack_prepare(*cuda_ctx, cgraph);", compute)
    assert prepare < main.index("cudaStreamBeginCapture", compute)
    free_buffer = main.index("static void ggml_backend_cuda_buffer_free_buffer(")
    assert main.index(
        "ggml_cuda_mc_repack_forget(ctx->dev_ptr, buffer->size, true);", free_buffer
    ) < main.index("delete ctx;", free_buffer)
    assert (
        main.count("ggml_cuda_mc_repack_forget(") == 9
    )  # free, memset, set, set 2d, copy, clear, 2 async, copy async
    fuse = main.index("ggml_cuda_try_fuse(cuda_ctx, cgraph, i)")
    group = main.index("ggml_cuda_mc_mmv_group(*cuda_ctx, cgraph, i)", fuse)
    assert group < main.index("ggml_cuda_compute_forward(*cuda_ctx, node)", group)
    # patch 0019: the ADD-started fusions open ggml_cuda_try_fuse (after GGML_CUDA_DISABLE_FUSION's check);
    # MC_FUSE_GDN_L2 plans before the node loop, skips the normalisation nodes before any fusion, hands
    # the plan to both recurrence paths and clears it at the end of the evaluation
    try_fuse = main.index("static int ggml_cuda_try_fuse(")
    disable = main.index("GGML_CUDA_DISABLE_FUSION", try_fuse)
    add_fusions = main.index("mc_try_add_rms_norm(cuda_ctx, cgraph, i)", try_fuse)
    assert disable < add_fusions < main.index("mc_try_gdn_gates(cuda_ctx, cgraph, i)", try_fuse)
    l2_plan = main.index("mc_gdn_l2_plan_graph(cgraph, stream_ctx.concurrent_events.empty());")
    assert plan < l2_plan < main.index("mc_gdn_l2_skip.count(node)", l2_plan) < fuse
    assert main.index("mc_gdn_l2_plan.clear();", fuse) > fuse
    # MC_PROBE_SKIP (patch 0021, a timing diagnostic; wrong results when set): the named ops' nodes
    # are left out before any fusion or grouping could take them, read once from the environment
    probe = main.index("if (mc_probe_skip(node))", l2_plan)
    assert main.index("mc_gdn_l2_skip.count(node)", l2_plan) < probe < fuse
    assert main.count('getenv("MC_PROBE_SKIP")') == 1
    assert "ggml_cuda_op_gated_delta_net(ctx, dst, mc_gdn_l2_for(dst));" in main
    assert "fused_state_cpy, mc_gdn_l2_for(node));" in main


def test_the_dispatch_reaches_the_kernel(patched):
    """Both entry points route to ggml_cuda_mc_mmv: the mmvq path (1..8 columns, fused gate) and the
    general mul_mat path (up to 16 columns, before mul_mat_q); from MC_MMV_DEFAULT_MMA_MIN_COLS
    columns on it launches the tensor-core kernel."""
    mmvq = (patched / "ggml/src/ggml-cuda/mmvq.cu").read_text()
    main = (patched / "ggml/src/ggml-cuda/ggml-cuda.cu").read_text()
    assert "ggml_cuda_mc_mmv(ctx, src0, src1, dst, fusion)" in mmvq
    at = main.index("ggml_cuda_mc_mmv(ctx, src0, src1, dst, nullptr)")
    assert at < main.index("ggml_cuda_mul_mat_q(ctx, src0, src1, nullptr, dst);", at)
    mc = (patched / "ggml/src/ggml-cuda/mc-mmv.cu").read_text()
    assert "ncols >= mc_mmq_min_cols()" in mc
    entry = mc.index("bool ggml_cuda_mc_mmv(ggml_backend_cuda_context & ctx")
    # Q6_K weights (the output matrix) take the same entry: one column its one-column kernel, 2..16
    # the tensor-core kernel (patch 0016), or nothing (stock)
    q6k = mc.index("return src1->ne[1] == 1 ? mc_mmv_q6_K_try(ctx, src0, src1, dst, fusion) :", entry)
    many = mc.index("mc_mmq_q6_K_try(ctx, src0, src1, dst, fusion);", q6k)
    assert q6k < many < mc.index("mc_mmv_supported(", entry)
    tests = (patched / "tests/test-backend-ops.cpp").read_text()
    assert "MegaCapybara mc-mmv.cu" in tests
    assert "new test_mul_mat(GGML_TYPE_Q6_K, GGML_TYPE_F32, m, 1, k" in tests
    assert "new test_mul_mat(GGML_TYPE_Q6_K, GGML_TYPE_F32, 1024, n, 5120" in tests  # n = 2..17
    assert tests.count("new test_mc_mul_mat_group(") >= 4  # grouped products, compared on every column count


def test_the_q6k_carveout_setting_is_read_once_and_set_before_the_occupancy_check(patched):
    """Patch 0033 (MC_MMQ_Q6K_CARVEOUT, unset by default: the driver's split): the 2..16-column Q6_K
    product asks for that share of shared memory, once a device and kernel, before the launcher's check
    for at least 2 blocks an SM (a carveout too small for 2 spans falls back to stock)."""
    source = (patched / "ggml/src/ggml-cuda/mc-mmv.cu").read_text()
    attributes = c_body(source, "static void mc_q6km_attributes(")
    assert 'mc_env_int("MC_MMQ_Q6K_CARVEOUT", -1, 100, -1)' in attributes
    attr = attributes.index("cudaFuncAttributePreferredSharedMemoryCarveout, carveout")
    assert attributes.index("if (carveout >= 0) {") < attr
    assert "carveout_set[device] = true;" in attributes
    # the launcher (and bench/gpu/mmr_lab.cu's Q6_K mode) set them before the occupancy check
    launch = c_body(source, "static bool mc_mmq_q6_K_launch(")
    at = launch.index("mc_q6km_attributes<NT, FRAG, L>(ggml_cuda_get_device());")
    assert at < launch.index("if (mc_blocks_per_sm((const void *) kernel")


def test_the_glu_runs_in_the_next_products_conversion_only_where_nothing_else_reads_it(patched):
    """Patch 0034 (MC_FUSE_GLU_MMR, off by default until measured): a SwiGLU whose one use is the next
    node's product on a repacked copy (9..16 columns) is computed by that product's f16 conversion
    (silu(x) * up, as unary.cu computes it, from the same 8 elements a thread converts), and the GLU's
    launch is skipped; the hook runs before the stock fusions, outside concurrent regions, and the
    product declines before launching anything where it cannot (no fresh copy, the warpgroup form)."""
    cuda = (patched / "ggml/src/ggml-cuda").resolve()
    source = (cuda / "mc-mmv.cu").read_text()
    assert 'mc_env_int("MC_FUSE_GLU_MMR", 0, 1, 0) == 1' in source
    entry = c_body(source, "int ggml_cuda_mc_glu_mmr(")
    for rule in [
        "ggml_get_glu_op(glu) != GGML_GLU_OP_SWIGLU",
        "mm->src[1] != glu",
        "!ggml_node_has_n_uses(cgraph, i, 1)",
        "u == nullptr",
        "!ggml_are_same_shape(a, glu) || !ggml_are_same_shape(u, glu)",
        "ncols < mc_mmr_min_cols() || ncols > 16",
        "!mc_mmv_supported(ctx, mm->src[0], glu, mm, MC_MMQ_MIN_ROWS)",
        "return mc_mmr_run(ctx, grp, glu, nullptr, ctx.stream(), &in) ? 1 : 0;",
    ]:
        assert rule in entry, rule
    run = c_body(source, "static bool mc_mmr_run(")
    decline = run.index("if (ncols > 16 || (glu && mc_mmw_on(ctx.device)) || !mc_mmr_take(grp, k)) {")
    assert decline < run.index("ggml_cuda_kernel_launch(")
    assert run.index("if (glu) {") < run.index("ggml_cuda_kernel_launch(mc_mmr_convert_y_glu,")
    conv = c_body(source, "static __device__ __forceinline__ void mc_mmr_convert_y_at(")
    x_elems = "{ xb[0], xb[2], xb[1], xb[3], xb[16], xb[18], xb[17], xb[19] }"
    u_elems = "{ ub[0], ub[2], ub[1], ub[3], ub[16], ub[18], ub[17], ub[19] }"
    assert x_elems in conv and u_elems in conv
    assert "f[j] = ggml_cuda_op_silu_single(f[j]) * u[j];" in conv
    unary = (cuda / "unary.cu").read_text()  # the GLU's own kernel: the same silu
    op_silu = c_body(unary, "static __device__ __forceinline__ float op_silu(")
    assert "return ggml_cuda_op_silu_single(x);" in op_silu
    main = (cuda / "ggml-cuda.cu").read_text()
    hook = main.index("const int mc_glu = ggml_cuda_mc_glu_mmr(*cuda_ctx, cgraph, i);")
    assert main.rindex("if (!is_concurrent_event_active) {  // MegaCapybara: MC_FUSE_GLU_MMR", 0, hook) < hook
    assert hook < main.index("int nodes_to_skip = ggml_cuda_try_fuse(cuda_ctx, cgraph, i);", hook)
    ops = (patched / "tests" / "test-backend-ops.cpp").read_text()
    assert 'return "MC_GLU_MUL_MAT";' in ops
    assert "new test_mc_glu_mul_mat(GGML_TYPE_Q4_0, 5120, n, 17408)" in ops


def test_the_early_trigger_is_read_once_and_comes_before_each_wait(patched):
    """Patch 0049 (MC_EARLY_TRIGGER, 0 or 1, default 1): the one-token conv state's concat (stock's and
    patch 0018's narrow kernel), the Gated DeltaNet recurrence and rope_multi trigger the next launch
    (PDL) at their start when it is set, before their own wait, so that only the next launch moves;
    the launches that go through PDL pass the setting, the plain ones 0."""
    cuda = patched / "ggml/src/ggml-cuda"
    header = (cuda / "mc-mmv.cuh").read_text()
    read = 'ggml_cuda_mc_env_int("MC_EARLY_TRIGGER", 0, 1, 1)'
    assert read in c_body(header, "static inline int ggml_cuda_mc_early_trigger() {")
    sources = {name: (cuda / name).read_text() for name in ("concat.cu", "gated_delta_net.cu", "rope.cu")}
    assert sum(s.count('"MC_EARLY_TRIGGER"') for s in sources.values()) == 0  # read in the header alone
    kernels = (
        ("concat.cu", "static __global__ void __launch_bounds__(CUDA_CONCAT_BLOCK_SIZE) concat_cont("),
        ("concat.cu", "    mc_concat_narrow("),
        ("gated_delta_net.cu", "gated_delta_net_cuda(const float * q,"),
        ("gated_delta_net.cu", "__global__ void __launch_bounds__(256) mc_gdn_one("),  # patch 0056
        ("rope.cu", "static __global__ void rope_multi("),
    )
    for name, head in kernels:
        body = c_body(sources[name], head)
        trigger = body.index("if (early) {  // MC_EARLY_TRIGGER\n        ggml_cuda_pdl_lc();\n    }")
        assert trigger < body.index("ggml_cuda_pdl_sync();"), head
    concat = sources["concat.cu"]
    assert concat.count("ggml_cuda_mc_early_trigger()") == 2  # the dim-0 launch and the narrow one
    assert concat.count("(x, y, dst, ne00, ne01, ne02, ne0, ne1, ne2, 0);") == 2  # dims 1 and 2, no PDL
    assert sources["gated_delta_net.cu"].count("l2 ? l2->scale : 1.0f, ggml_cuda_mc_early_trigger());") == 5
    assert sources["rope.cu"].count("is_imrope, inplace,\n            ggml_cuda_mc_early_trigger());") == 2


def test_the_vector_attention_for_one_token_is_a_read_once_setting(patched):
    """Patch 0050 (MC_FATTN_VEC_DECODE, KV cells, default 4096; 0: stock's choice): with tensor cores,
    one token of one sequence over at most that many KV cells goes to the vector kernel wherever that
    kernel applies, ahead of stock's choice (the MMA kernel at GQA > 4 with 256-wide heads, which
    measured faster at 32k: run BU); longer contexts keep stock's choice."""
    fattn = (patched / "ggml/src/ggml-cuda/fattn.cu").read_text()
    assert fattn.count('"MC_FATTN_VEC_DECODE"') == 1
    best = c_body(fattn, "static best_fattn_kernel ggml_cuda_get_best_fattn_kernel(")
    turing = best.index("if (turing_mma_available(cc)")
    rule = best.index(
        "if (can_use_vector_kernel && Q->ne[1] == 1 && Q->ne[3] == 1 && K->ne[1] <= mc_vec_decode) {"
    )
    assert turing < rule < best.index("if (can_use_vector_kernel) {", turing)
    assert 'ggml_cuda_mc_env_int("MC_FATTN_VEC_DECODE", 0, 1 << 24, 4096)' in best[turing:rule]


@pytest.mark.parametrize("name", ["rope.cu", "fattn.cu"])
def test_the_early_trigger_and_vector_attention_sources_compile(patched, name, tmp_path):
    """rope.cu (patch 0049's rope_multi) and fattn.cu (patch 0050's rule) compile for sm_90; concat.cu
    and gated_delta_net.cu are compiled, without spills, by the tests of patches 0018 and 0017."""
    out = compile_cuda(patched, name, "90", tmp_path, *FATTN_FLAGS)
    assert out.returncode == 0, out.stderr[-3000:]


def test_the_norm_rope_fusion_takes_m_rope_behind_a_read_once_setting(patched):
    """Patch 0051 (MC_NORM_ROPE_MULTI, 0 or 1, default 1): stock's fused RMS_NORM + MUL + ROPE (+ VIEW +
    SET_ROWS) kernel takes M-RoPE and interleaved M-RoPE (qwen35's attention) as well; the angles come
    from one helper that stock's rope_multi now calls too, so both paths compute them with the same
    statements; stock's ROPE + VIEW + SET_ROWS kernel (no norm) still refuses M-RoPE, which it cannot
    write; test-backend-ops has cases at the 27B's attention shapes (Q's strided view, K into f16)."""
    cuda = patched / "ggml/src/ggml-cuda"
    header = (cuda / "mc-mmv.cuh").read_text()
    setting = c_body(header, "static inline bool ggml_cuda_mc_norm_rope_multi(const int mode) {")
    assert 'ggml_cuda_mc_env_int("MC_NORM_ROPE_MULTI", 0, 1, 1)' in setting
    assert "mode == GGML_ROPE_TYPE_MROPE || mode == GGML_ROPE_TYPE_IMROPE" in setting  # vision never
    rope = (cuda / "rope.cu").read_text()
    assert rope.count("mc_rope_multi_theta_base(") == 3  # the helper, rope_multi, the fused kernel
    multi = c_body(rope, "static __global__ void rope_multi(")
    assert "sections.v[0] + sections.v[1]" not in multi  # the helper's statements alone
    # the fused kernel's row (patch 0059 made it a device function, with the kernel's channel count)
    fused = c_body(rope, "static __device__ __forceinline__ void rms_norm_mul_rope_row(")
    assert "mc_rope_multi_theta_base(pos, channel, nchannels, i0, theta_scale, sections," in fused
    op = c_body(rope, "static mc_norm_rope_job mc_norm_rope_job_make(")  # its arguments (patch 0059)
    assert "j.is_neox = (mode & GGML_ROPE_TYPE_NEOX) || j.mrope != 0;" in op
    main = (cuda / "ggml-cuda.cu").read_text()
    set_rows = c_body(main, "static bool ggml_cuda_should_fuse_rope_set_rows(")
    assert "!(after_norm && ggml_cuda_mc_norm_rope_multi(mode))" in set_rows
    assert main.count("ggml_cuda_should_fuse_rope_set_rows(rope, view, set_rows, /*after_norm=*/true)") == 1
    assert main.count("ggml_cuda_should_fuse_rope_set_rows(rope, view, set_rows)") == 1  # rope alone
    norm = c_body(main, "static bool ggml_cuda_should_fuse_rms_norm_mul_rope(")
    assert "!ggml_cuda_mc_norm_rope_multi(mode)" in norm
    tests = (patched / "tests/test-backend-ops.cpp").read_text()
    assert "GGML_TYPE_F16, 64, true));" in tests and "GGML_TYPE_F16, 64, false));" in tests


@pytest.mark.parametrize("arch", ["90", "120"])
def test_the_fused_norm_rope_compiles_without_spills(patched, arch, tmp_path):
    """rope.cu with patch 0051 compiles for both targets, the fused kernel's forms without spills."""
    out = compile_cuda(patched, "rope.cu", arch, tmp_path, "-Xptxas=-v")
    assert out.returncode == 0, out.stderr[-3000:]
    fused = re.findall(
        r"Compiling entry function '(_Z21rms_norm_mul_rope_f32\w+)'.*?(\d+) bytes spill stores",
        out.stderr,
        re.S,
    )
    assert len(fused) == 8, fused  # 256 / 1,024 threads x frequency factors or not x f32 / f16 out
    assert {spill for _, spill in fused} == {"0"}, fused


def test_pre_quantized_activations_are_written_by_their_producers_and_taken_by_the_products(patched):
    """Patch 0052 (MC_PREQ, 0..2, default 1): the kernel computing a one-column product's input writes
    its q8_1 blocks too: the fused UNARY + MUL (qwen35's gated norm output and sigmoid gate, level 1)
    and the fused RMS norms x weight (level 2), with quantize_q8_1's statements on the same lanes'
    values, so the blocks are its bits; the product (mc_mmv_run's q8_1 path, the Q6_K output) takes
    them only for the data, length and graph nodes the producer's plan recorded, and quantizes itself
    otherwise; the plan scans the following nodes for such a product and stops at one writing over the
    data; each node sets the context's node index, and every graph starts and ends with none recorded."""
    cuda = patched / "ggml/src/ggml-cuda"
    header = (cuda / "mc-preq.cuh").read_text()
    store = c_body(header, "static __device__ __forceinline__ void mc_preq_store(")
    stock = c_body((cuda / "quantize.cu").read_text(), "static __global__ void quantize_q8_1(")
    # stock's statements (one value a lane, the warp's butterflies), which the helper transcribes
    assert_statements(
        stock,
        (
            "sum  = warp_reduce_sum<QK8_1>(sum);",
            "const float  d = amax / 127.0f;",
            "const int8_t q = amax == 0.0f ? 0 : roundf(xi / d);",
            "y[ib].ds = make_half2(d, sum);",
        ),
    )
    assert_statements(
        store,
        (
            "const float sum  = warp_reduce_sum<QK8_1>(xi);",
            "const float d    = amax / 127.0f;",
            "y[i / QK8_1].qs[i % QK8_1] = amax == 0.0f ? 0 : (int8_t) roundf(xi / d);",
            "y[i / QK8_1].ds = make_half2(d, sum);",
            "__reduce_max_sync(0xFFFFFFFFu, __float_as_uint(fabsf(xi)))",
            "const float amax = warp_reduce_max<QK8_1>(fabsf(xi));",  # before Ampere
        ),
    )
    assert "#define MC_PREQ_DEFAULT 3 " in header  # level 3 since run CB (patch 0055)
    main = (cuda / "ggml-cuda.cu").read_text()
    assert main.count('"MC_PREQ"') == 1
    plan = c_body(main, "mc_preq_plan_t ggml_cuda_mc_preq_plan(")
    assert 'ggml_cuda_mc_env_int("MC_PREQ", 0, 3, MC_PREQ_DEFAULT)' in plan
    assert "level_on < level || level_on > max_level || ctx.curr_stream_no != 0 || ctx.mc_node < 0" in plan
    # the scan (shared with MC_PREH's plan since patch 0065): views pass, then the caller's readers, and the
    # first node writing over out ends it
    scan = c_body(main, "static int mc_scan_readers(")
    assert scan.index("ggml_cuda_is_view_or_noop(n) || reads(n)") < scan.index("break;  // writes over out")
    assert "std::min(cgraph->n_nodes, i_last + 1 + MC_PREQ_SCAN)" in scan and "return j;" in scan
    assert "const int j    = mc_scan_readers(cgraph, i_last, out, [&](const ggml_tensor * n) {" in plan
    assert "y->type == GGML_TYPE_F32 && y->ne[0] == k && ggml_nrows(y) == 1;" in plan
    assert "plan.until = j;" in plan and "if (!used) {" in plan
    take = c_body(main, "const block_q8_1 * ggml_cuda_mc_preq_take(")
    assert_statements(
        take,
        (
            "src1->data != ctx.mc_preq_data",
            "ctx.mc_node >= ctx.mc_preq_until",
            "ctx.curr_stream_no != 0",
            "src1->ne[0] != ctx.mc_preq_k || ggml_nrows(src1) != 1",
        ),
    )
    # producers: the plan's blocks passed in, the record committed only where the kernel wrote them
    for call, level in (
        ("ggml_cuda_op_unary_mul(*cuda_ctx, node, cgraph->nodes[i + 1], mc_pq.q8, mc_ph.out)", ", 1);"),
        (
            "ggml_cuda_op_rms_norm_fused(*cuda_ctx, node, cgraph->nodes[i + 1], mc_pq.q8, mc_pq.split)",
            ", 2);",
        ),
        # (patch 0061: level 2, or up to 3 where the add + norm is split over 8 blocks a row; patch 0069: or
        # with MC_ADD_NORM_PREQ, test_add_norm_one.py)
        (
            "ggml_cuda_mc_add_rms_norm_mul(*ctx, add, norm, mul, probe != 2, pq.q8, split, ph.out)",
            ", 2, pq_max);",
        ),
    ):
        at = main.index(call)
        before = main[main.rindex("\n", 0, main.rindex("\n", 0, at)) : at]
        assert level in before, call
        assert "ggml_cuda_mc_preq_commit(" in main[at : at + 200], call
    loop = main[main.index("ggml_cuda_mc_next_weights_plan(cgraph);") :]
    assert loop.index("cuda_ctx->mc_preq_data = nullptr;") < loop.index("cuda_ctx->mc_node = i;")
    end = loop.index("ggml_cuda_mc_next_weights_end();")
    assert "cuda_ctx->mc_node      = -1;" in loop[end : end + 200]
    # the kernels: whole warps, the f32 output's own value quantized
    unary = (cuda / "unary.cu").read_text()
    gated = c_body(unary, "static __global__ void unary_gated_op_kernel(")
    assert "dst[i] = ggml_cuda_cast<T>(v);" in gated and "mc_preq_store(q8, i, v);" in gated
    assert "q8 = k % QK8_1 == 0 && ggml_is_contiguous(mul_node) ? q8 : nullptr;" in unary
    norm = (cuda / "norm.cu").read_text()
    assert "mc_preq_store(mc_q8, q8_base + col, v);" in c_body(norm, "static __global__ void rms_norm_f32(")
    assert "mc_preq_store(q8, row * ncols + col, v);" in c_body(
        norm, "static __global__ void mc_add_rms_norm_mul_f32("
    )
    assert norm.count("q8 = ncols % QK8_1 == 0 ? q8 : nullptr;") == 2
    # the cached form alone; every other launch passes nullptr (patch 0058: then the prefetch setting)
    assert norm.count("1.0f, q8, ggml_cuda_mc_w_prefetch());") == 1
    # the products: the blocks where taken, else the quantization as before
    mmv = (cuda / "mc-mmv.cu").read_text()
    assert mmv.count("ggml_cuda_mc_preq_take(ctx, src1)") == 2
    run = c_body(mmv, "static void mc_mmv_run(")
    assert "ncols == 1 ? ggml_cuda_mc_preq_take(ctx, src1) : nullptr;" in run
    assert run.index("if (pre == nullptr) {") < run.index("quantize_row_q8_1_cuda(")
    tests = (patched / "tests/test-backend-ops.cpp").read_text()
    assert "new test_mc_gate_mul_mat(GGML_TYPE_Q4_0, true, 128, 48, 1, 5120));" in tests
    assert "new test_mc_gate_mul_mat(GGML_TYPE_Q4_0, false, 256, 24, 1, 5120));" in tests
    assert "new test_mc_norm_mul_mat(GGML_TYPE_Q4_0, add, 5120, 1));" in tests


@pytest.mark.parametrize("arch", ["90", "120"])
def test_the_pre_quantizing_producers_compile_without_spills(patched, arch, tmp_path):
    """unary.cu with patch 0052 compiles for both targets, the gated kernels without spills, and patch
    0053's gated norm in its two forms (up to 4 and 8 warps' worth of columns) too (norm.cu's forms:
    test_the_cached_rms_norm_compiles; ggml-cuda.cu: test_the_patched_ggml_cuda_compiles). Both also
    write patch 0065's f16 form (MC_PREH), so this is its producers' check in unary.cu as well."""
    out = compile_cuda(patched, "unary.cu", arch, tmp_path, "-Xptxas=-v")
    assert out.returncode == 0, out.stderr[-3000:]
    gated = re.findall(
        r"Compiling entry function '(_Z21unary_gated_op_kernel\w+)'.*?(\d+) bytes spill stores",
        out.stderr,
        re.S,
    )
    assert any("P10block_q8_1" in name for name, _ in gated), gated
    assert gated and {spill for _, spill in gated} == {"0"}, gated
    forms = re.findall(
        r"Compiling entry function '_Z17mc_gated_norm_f32ILi(\d)E\w+'.*?(\d+) bytes spill stores",
        out.stderr,
        re.S,
    )
    assert sorted(forms) == [("4", "0"), ("8", "0")], forms
