// MMR lab: the patched tree's Q4_0 products (mc-mmv.cu) launched directly on the 27B's step product
// groups, without building llama.cpp. COLUMNS 9..16 (a verify step): the repacked tensor-core kernel
// mc_mmr_q4_0 in the form MC_MMR_FORM picks (3 = bulk copies on Hopper) with the launcher's own K-slice
// cost model (mc_mmq_kslices), weights repacked by mc_mmr_repack, activations converted by
// mc_mmr_convert_y. COLUMNS 1 (a decode step): the dp4a kernel mc_mmv_q4_0 through its own launcher
// (mc_mmv_launch; the FFN's gate and up in one launch with the SwiGLU, as decode runs them) on q8_1
// activations. Random weights in LAB_SETS sets a group, cycled, so they stream from memory as in a
// step. A step's 256 launches timed by events (no CUDA graph and no PDL: compare settings with each
// other here, and the winners in the real step). Each group's output checksum is printed so two
// settings' runs can be compared (bench/gpu/kernel_lab.py mmr does). The settings the kernels read
// from the environment (MC_MMR_*, MC_MMV_*) apply as in the library. Output: one JSON object a line.
// MC_MMR_FORM=4 (patch 0025): the warpgroup kernel mc_mmw_q4_0 on the copies in its own order
// (mc_mmr_repack's layout 1), its activations by mc_mmw_convert_y, K slices as a cluster
// (mc_mmw_launch_kernel; MC_MMW_KSLICES_MAX caps them) (sm_90 and a lab built for 90a; else the
// program says so and exits 2). The bulk form's launches choose the narrower forms as mc_mmr_launch does
// (mc_mmr_rows_form; MC_MMR_ROWS32=0: never); their groups' k_slices read 200 (48-row tiles) or 100
// (32-row) + the slices. MC_MMR_QMAJOR=1 (patch 0038): the copies made and read in the quad-major layout.
// COLUMNS 1: the library's persistent decode kernel (patch 0031, mc_pmv_q4_0; on by default, MC_MMV_PERSIST=0:
// mc_mmv_q4_0 throughout) through the same launcher; MC_LAB_PMV_COPIES=1: that kernel's copies and waits alone where it runs (outputs 0:
// a bound; the groups it declines, mc_pmv_worth, on mc_mmv_q4_0 as in a step).
// MC_LAB_Q6K=1 (COLUMNS 9..16): the verify step's Q6_K output product alone (lab_q6k); MC_LAB_Q6K_HOST
// 1: each launch followed by the outputs' copy to page-locked host memory (as llama.cpp copies the
// logits after the graph), 2: the kernel writes that memory itself (patch 0035, MC_LOGITS_SINK_DIRECT).
// Usage: mmr_lab REPEATS COLUMNS (COLUMNS 1 or 9..16); mmr_lab plan NSM OCC64 OCC48 OCC32 (no GPU: the
// verify step's launch plans for that GPU's SMs and each row-tile form's blocks an SM); mmr_lab pmvplan
// CTAS STAGE_KB (no GPU: the persistent kernel's pieces)
#include "mc-mmv.cu"
#define LAB_GGML_STUBS
#define LAB_MMV
#include "lab_common.cuh"

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

static constexpr int LAB_SETS = 8;  // weight sets a group, cycled: each group's sets exceed the L2

// random Q6_K blocks: 6-bit quants, sub-block scales and the block's scale from a hash (the scale small
// positive f16: finite sums)
static __global__ void lab_fill_q6_K(block_q6_K * w, const int64_t nblocks, const uint32_t seed) {
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= nblocks) {
        return;
    }
    uint32_t h = (uint32_t) i * 2654435761u ^ seed;
    w[i].d     = __float2half(0.0005f + (float) (h % 1000) * 1e-6f);
    for (int j = 0; j < QK_K / 2; j++) {
        h          = h * 1664525u + 1013904223u;
        w[i].ql[j] = (uint8_t) (h >> 24);
    }
    for (int j = 0; j < QK_K / 4; j++) {
        h          = h * 1664525u + 1013904223u;
        w[i].qh[j] = (uint8_t) (h >> 24);
    }
    for (int j = 0; j < QK_K / 16; j++) {
        h              = h * 1664525u + 1013904223u;
        w[i].scales[j] = (int8_t) (h >> 25);  // 0..127
    }
}

// MC_LAB_Q6K=1 (COLUMNS 9..16): the verify step's Q6_K output product instead of the Q4_0 groups: patch
// 0016's mc_mmq_q6_K on the 27B's 248,320 x 5,120 output matrix (1.04 GB, random blocks), its activations
// quantized once (mc_q6km_quantize), the kernel's attributes as the library sets them
// (mc_q6km_attributes: MC_MMQ_Q6K_CARVEOUT, patch 0033) and its form as the library picks it
// (MC_MMQ_Q6K_FRAG, MC_MMQ_Q6K_LAYOUT of patch 0037: mc_q6km_frag, mc_q6km_layout; mc_q6km_smem);
// REPEATS launches timed by events (no PDL), then the same lines as a step ("group" out_q6k, its
// checksum). host: MC_LAB_Q6K_HOST (0: the device output alone, 1: a copy to page-locked host memory
// after each launch, 2: the kernel writes the host memory too; the checksum is then the host memory's)
constexpr int64_t lab_q6k_nrows = 248320, lab_q6k_k = 5120;  // the 27B's output matrix
constexpr int64_t lab_q6k_row_bytes = lab_q6k_k / QK_K * (int64_t) sizeof(block_q6_K);

template <bool FRAG, int L>
static int lab_q6k_form(const int repeats, const int ncols, const int host) {
    constexpr int64_t nrows     = lab_q6k_nrows, k = lab_q6k_k;
    constexpr int     nblocks   = (int) (k / QK_K);
    constexpr int64_t row_bytes = lab_q6k_row_bytes;
    int               dev       = 0;
    LAB_CHECK(cudaGetDevice(&dev));
    char *   w;
    float *  x;
    int8_t * yq;
    float *  yd;
    float *  dst;
    LAB_CHECK(cudaMalloc(&w, nrows * row_bytes));
    LAB_CHECK(cudaMalloc(&x, sizeof(float) * 16 * k));
    LAB_CHECK(cudaMalloc(&yq, (size_t) 16 * k));
    LAB_CHECK(cudaMalloc(&yd, sizeof(float) * 16 * nblocks));
    LAB_CHECK(cudaMalloc(&dst, sizeof(float) * 16 * nrows));
    float * dsth = nullptr;  // page-locked, mapped under unified addressing: the kernel can write it
    if (host > 0) {
        LAB_CHECK(cudaMallocHost(&dsth, sizeof(float) * ncols * nrows));
        std::fill(dsth, dsth + (size_t) ncols * nrows, 0.0f);
    }
    const int64_t nb = nrows * nblocks;
    lab_fill_q6_K<<<(unsigned) ((nb + 255) / 256), 256>>>((block_q6_K *) w, nb, 7u);
    lab_fill_f32<<<(unsigned) ((16 * k + 255) / 256), 256>>>(x, 16 * k, 11u);
    mc_q6km_quantize<FRAG><<<(unsigned) ((ncols * nblocks + 7) / 8), 256>>>(x, yq, yd, (int) k, k, ncols);
    LAB_CHECK(cudaGetLastError());
    mc_q6km_attributes<2, FRAG, L>(dev);
    const auto   kernel = mc_mmq_q6_K<2, FRAG, L>;
    const size_t smem   = mc_q6km_smem(row_bytes);
    int          occupancy = 0;
    LAB_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occupancy, kernel, MC_MMQ_THREADS, smem));
    const dim3 grid((unsigned) (nrows / MC_Q6KM_ROWS));
    auto       launch = [&]() {
        kernel<<<grid, MC_MMQ_THREADS, smem>>>(w, yq, yd, dst, host == 2 ? dsth : nullptr, (int) nrows, ncols,
                                               nblocks, row_bytes, (int) nrows, mc_kernel_flags());
        if (host == 1) {
            LAB_CHECK(cudaMemcpyAsync(dsth, dst, sizeof(float) * ncols * nrows, cudaMemcpyDeviceToHost));
        }
    };
    launch();
    LAB_CHECK(cudaDeviceSynchronize());
    const std::vector<float> h = host > 0 ? std::vector<float>(dsth, dsth + (size_t) ncols * nrows) :
                                            lab_fetch<float>(dst, (size_t) ncols * nrows);
    double                   sum = 0.0, sq = 0.0;
    for (const float v : h) {
        sum += v;
        sq += (double) v * v;
    }
    printf("{\"kind\": \"check\", \"group\": \"out_q6k\", \"k_slices\": 1, \"sum\": %.9e, \"sumsq\": %.9e}\n", sum, sq);
    launch();
    std::vector<float> group_ms(1, 0.0f);
    const float        ms = lab_time_groups(
        repeats, 1, [](size_t) { return 1; }, [&](size_t, int) { launch(); }, group_ms);
    printf("{\"kind\": \"group\", \"group\": \"out_q6k\", \"launches\": 1, \"us\": %.3f}\n",
           1000.0f * group_ms[0] / repeats);
    printf("{\"kind\": \"step\", \"columns\": %d, \"form\": 6, \"layout\": %d, \"frag\": %d, \"smem\": %zu, "
           "\"blocks_per_sm\": %d, \"step_ms\": %.4f}\n",
           ncols, L, FRAG ? 1 : 0, smem, occupancy, ms);
    return 0;
}

static int lab_q6k(const int repeats, const int ncols, const int host) {
    const int layout = mc_q6km_layout(lab_q6k_row_bytes);  // as the library picks it for that matrix
    if (mc_q6km_frag()) {
        return layout == 2 ? lab_q6k_form<true, 2>(repeats, ncols, host) :
               layout == 1 ? lab_q6k_form<true, 1>(repeats, ncols, host) :
                             lab_q6k_form<true, 0>(repeats, ncols, host);
    }
    return layout == 2 ? lab_q6k_form<false, 2>(repeats, ncols, host) :
           layout == 1 ? lab_q6k_form<false, 1>(repeats, ncols, host) :
                         lab_q6k_form<false, 0>(repeats, ncols, host);
}

struct lab_group {
    std::vector<int> rows;
    int              k;
    int              launches;  // a verify step's launches of this group
    const char *     name;
};

struct lab_set {
    std::vector<char *>  copies;  // a product's weights (repacked for the tensor-core kernel)
    std::vector<float *> dst;
    char *               gate = nullptr;  // decode's FFN: the gate's weights beside the up's
};

// the 27B's step (64 layers, every 4th full attention): its product groups; decode runs the FFN's
// gate and up as one launch of the gated kernel (one product here, its gate beside it)
static std::vector<lab_group> lab_plan(const bool decode) {
    return {
        { { 10240, 6144, 48, 48 }, 5120, 48, "gdn_in" },
        { { 12288, 1024, 1024 }, 5120, 16, "attn_in" },
        { { 5120 }, 6144, 64, "out" },
        { decode ? std::vector<int>{ 17408 } : std::vector<int>{ 17408, 17408 }, 5120, 64, "ffn_gate_up" },
        { { 5120 }, 17408, 64, "ffn_down" },
    };
}

// the weight bytes a launch of a group reads (a decode step's FFN launch reads the gate's rows beside
// the up's; the repacked copies of a verify step hold the same bytes as the Q4_0 rows)
static int64_t lab_group_bytes(const lab_group & g, const bool decode) {
    int64_t rows = 0;
    for (const int r : g.rows) {
        rows += r;
    }
    const int64_t mats = decode && std::string(g.name) == "ffn_gate_up" ? 2 : 1;
    return mats * rows * (g.k / QK4_0) * (int64_t) sizeof(block_q4_0);
}

// a group's products' row counts (what the launch plans read of it)
static mc_mm_group lab_rows_group(const lab_group & g) {
    mc_mm_group grp;
    grp.n = (int) g.rows.size();
    for (int p = 0; p < grp.n; p++) {
        grp.nrows[p] = g.rows[p];
    }
    return grp;
}

// the persistent decode kernel's pieces for a group (mc_pmv_choose; the FFN's gate rows beside the up
// rows: two matrices a piece)
static mc_pmv_plan lab_pmv_plan_for(const lab_group & g, const int ctas, const int stage_limit) {
    const int nblocks = g.k / QK4_0;
    const int nw      = std::string(g.name) == "ffn_gate_up" ? 2 : 1;
    return mc_pmv_choose(lab_rows_group(g), nw, nblocks, (int64_t) nblocks * sizeof(block_q4_0), ctas, stage_limit);
}

// a whole number, nothing after it
static bool lab_whole(const char * text, int & v) {
    char * end = nullptr;
    v          = (int) strtol(text, &end, 10);
    return end != text && *end == '\0';
}

// mmr_lab plan NSM OCC64 OCC48 OCC32: the verify step's launch plans (the bulk form's row-tile form and
// K slices, as mc_mmr_launch chooses them) for a GPU of NSM SMs holding OCC64 / OCC48 / OCC32 blocks of
// the 64- / 48- / 32-row forms, without a GPU: one JSON line a group
static int lab_print_plans(char ** argv) {
    int  v[4];
    bool whole = true;
    for (int i = 0; i < 4; i++) {
        whole = lab_whole(argv[2 + i], v[i]) && whole;
    }
    const int nsm = v[0], occ64 = v[1], occ48 = v[2], occ32 = v[3];
    if (!whole || nsm < 1 || occ64 < 1 || occ48 < 0 || occ32 < 0) {
        fprintf(stderr, "usage: mmr_lab plan NSM OCC64 OCC48 OCC32 (NSM, OCC64 >= 1; OCC48, OCC32 >= 0)\n");
        return 2;
    }
    for (const lab_group & g : lab_plan(false)) {
        mc_mm_group grp    = lab_rows_group(g);  // mc_mmr_plan sets its tiles
        const int nquads = g.k / 128;
        const int mt     = mc_mmr_rows_form(grp, nquads, occ64, occ48, occ32, nsm);
        const int occ    = mt == 4 ? occ64 : (mt == 3 ? occ48 : occ32);
        int       nt     = 0;
        const int ks     = mc_mmr_plan(grp, mt, nquads, occ * nsm, nt);
        printf("{\"kind\": \"plan\", \"group\": \"%s\", \"rows\": %d, \"tiles\": %d, \"k_slices\": %d}\n", g.name,
               16 * mt, nt, ks);
    }
    return 0;
}

// mmr_lab pmvplan CTAS STAGE_KB: the persistent decode kernel's pieces (MC_MMV_PERSIST, patch 0031) for
// the decode step's groups on CTAS CTAs with stages of at most STAGE_KB kilobytes, without a GPU: one
// JSON line a group
static int lab_print_pmv_plans(char ** argv) {
    int ctas = 0, kb = 0;
    if (!lab_whole(argv[2], ctas) || !lab_whole(argv[3], kb) || ctas < 1 || kb < 4 || kb > 64) {
        fprintf(stderr, "usage: mmr_lab pmvplan CTAS STAGE_KB (CTAS >= 1; STAGE_KB 4..64)\n");
        return 2;
    }
    for (const lab_group & g : lab_plan(true)) {
        const mc_pmv_plan pl = lab_pmv_plan_for(g, ctas, kb * 1024);
        if (pl.rs == 0) {
            fprintf(stderr, "mmr_lab: no piece shape fits K = %d in %d KB stages\n", g.k, kb);
            return 2;
        }
        printf("{\"kind\": \"pmvplan\", \"group\": \"%s\", \"rows_a_piece\": %d, \"pieces\": %d, "
               "\"busiest\": %d, \"persistent\": %s}\n", g.name, pl.rs, pl.npieces, (pl.npieces + ctas - 1) / ctas,
               mc_pmv_worth(pl, ctas, mc_pmv_get_settings().min_pieces, mc_pmv_get_settings().max_wpr) ? "true"
                                                                                                        : "false");
    }
    return 0;
}

int main(int argc, char ** argv) {
    if (argc == 6 && std::string(argv[1]) == "plan") {
        return lab_print_plans(argv);
    }
    if (argc == 4 && std::string(argv[1]) == "pmvplan") {
        return lab_print_pmv_plans(argv);
    }
    const int repeats = argc == 3 ? atoi(argv[1]) : 0;
    const int ncols   = argc == 3 ? atoi(argv[2]) : 0;
    if (repeats < 1 || (ncols != 1 && (ncols < 9 || ncols > 16))) {
        fprintf(stderr, "usage: mmr_lab REPEATS COLUMNS (REPEATS >= 1; COLUMNS 1: decode's dp4a kernel, "
                        "9..16: the verify step's two-tile repacked form)\n");
        return 2;
    }
    if (mc_env_int("MC_LAB_Q6K", 0, 1, 0) == 1) {
        if (ncols == 1) {
            fprintf(stderr, "mmr_lab: MC_LAB_Q6K=1 times the verify step's Q6_K product: COLUMNS 9..16\n");
            return 2;
        }
        return lab_q6k(repeats, ncols, mc_env_int("MC_LAB_Q6K_HOST", 0, 2, 0));
    }
    const bool decode = ncols == 1;
    const std::vector<lab_group> plan = lab_plan(decode);
    int dev = 0, nsm = 0;
    LAB_CHECK(cudaGetDevice(&dev));
    LAB_CHECK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, dev));
    // MC_MMR_FORM as the library reads it: 1, 3 or 4 (patch 0025's warpgroup kernel, sm_90 GPUs and a lab
    // built for 90a: kernel_lab.py mmr --arch 90a; its probe says whether this build holds its code)
    const int form = mc_mmr_form();
    cudaDeviceProp prop;
    LAB_CHECK(cudaGetDeviceProperties(&prop, dev));
    const bool bulk = form != 1 && prop.major >= 9;
    bool       wgmma = false;
    if (form == 4 && !decode) {
        int * flag;
        int   found = 0;
        LAB_CHECK(cudaMalloc(&flag, sizeof(int)));
        mc_mmw_probe<<<1, 1>>>(flag);
        LAB_CHECK(cudaMemcpy(&found, flag, sizeof(int), cudaMemcpyDeviceToHost));
        wgmma = found == 1 && prop.major == 9 && prop.minor == 0;
        if (!wgmma) {
            fprintf(stderr, "mmr_lab: MC_MMR_FORM=4 needs an sm_90 GPU and the lab built for 90a (--arch 90a)\n");
            return 2;
        }
    }
    const auto kernel = bulk ? mc_mmr_q4_0<2, 3, true> : mc_mmr_q4_0<2, 3, false>;
    const auto       wkernel = mc_mmw_q4_0;
    const size_t     smem    = (wgmma ? (size_t) MC_MMW_STAGES * MC_MMW_STAGE : (size_t) 3 * MC_MMQ_WARPS * MC_MMR_ITEMS(2) * 512) +
                        MC_SMEM_PAD;
    int              occupancy = 0;
    if (wgmma) {
        LAB_CHECK(cudaFuncSetAttribute(wkernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem));
        LAB_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occupancy, wkernel, MC_MMQ_THREADS, smem));
    } else {
        LAB_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem));
        LAB_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occupancy, kernel, MC_MMQ_THREADS, smem));
    }
    occupancy = std::max(1, occupancy);
    // the narrower forms' occupancy (48 and 32 rows: mc_mmr_launch's choice, mc_mmr_rows_form, MC_MMR_ROWS32)
    constexpr int S = MC_MMR_NARROW_STAGES, B = MC_MMR_NARROW_MINB;
    const auto    kernel48 = mc_mmr_q4_0<2, S, true, 3, B>;
    const auto    kernel32 = mc_mmr_q4_0<2, S, true, 2, B>;
    const size_t  smem48 = mc_mmr_smem<2, S, true, 3>(), smem32 = mc_mmr_smem<2, S, true, 2>();
    int           occupancy48 = 0, occupancy32 = 0;
    if (bulk && !wgmma) {
        LAB_CHECK(cudaFuncSetAttribute(kernel48, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem48));
        LAB_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occupancy48, kernel48, MC_MMQ_THREADS, smem48));
        LAB_CHECK(cudaFuncSetAttribute(kernel32, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem32));
        LAB_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occupancy32, kernel32, MC_MMQ_THREADS, smem32));
    }

    // weights (four sets a group, repacked), activations (f16, the converter's order), outputs, partials
    std::vector<std::vector<lab_set>> sets(plan.size());
    std::vector<half *>               ys(plan.size());
    std::vector<block_q8_1 *>         yq(plan.size());
    size_t                            max_partials = 0;
    char *                            scratch      = nullptr;
    size_t                            scratch_size = 0;
    for (size_t gi = 0; gi < plan.size(); gi++) {
        const lab_group & g      = plan[gi];
        const int         nquads = g.k / 128;
        int               rows   = 0;
        for (int r : g.rows) {
            rows += r;
        }
        max_partials = std::max(max_partials, (size_t) 64 * 16 * rows);  // up to 64 K slices
        for (int s = 0; s < LAB_SETS; s++) {
            lab_set set;
            for (size_t p = 0; p < g.rows.size(); p++) {
                const int64_t nblocks = (int64_t) g.rows[p] * (g.k / QK4_0);
                const size_t  bytes   = (size_t) nblocks * sizeof(block_q4_0);
                if (bytes > scratch_size) {
                    LAB_CHECK(cudaFree(scratch));
                    LAB_CHECK(cudaMalloc(&scratch, bytes));
                    scratch_size = bytes;
                }
                char * copy;
                LAB_CHECK(cudaMalloc(&copy, bytes));
                const uint32_t seed = (uint32_t) (gi * 131 + s * 17 + p);
                if (decode) {  // the original layout
                    lab_fill_q4_0<<<(unsigned) ((nblocks + 255) / 256), 256>>>((block_q4_0 *) copy, nblocks, seed);
                    if (std::string(g.name) == "ffn_gate_up") {
                        LAB_CHECK(cudaMalloc(&set.gate, bytes));
                        lab_fill_q4_0<<<(unsigned) ((nblocks + 255) / 256), 256>>>((block_q4_0 *) set.gate, nblocks,
                                                                                  seed ^ 0x5bd1e995u);
                    }
                } else {
                    lab_fill_q4_0<<<(unsigned) ((nblocks + 255) / 256), 256>>>((block_q4_0 *) scratch, nblocks, seed);
                    const int64_t npieces = (int64_t) g.rows[p] / 16 * nquads * 72;
                    mc_mmr_repack<<<(unsigned) ((npieces + 255) / 256), 256>>>(
                        scratch, copy, (int64_t) (g.k / QK4_0) * sizeof(block_q4_0), nquads, npieces,
                        wgmma ? 1 : (mc_mmr_qmajor() ? 2 : 0));  // the layout the launches read
                }
                LAB_CHECK(cudaGetLastError());
                float * d;
                LAB_CHECK(cudaMalloc(&d, sizeof(float) * 16 * g.rows[p]));
                set.copies.push_back(copy);
                set.dst.push_back(d);
            }
            sets[gi].push_back(set);
        }
        float * x;
        LAB_CHECK(cudaMalloc(&x, sizeof(float) * g.k * ncols));
        lab_fill_f32<<<(unsigned) ((g.k * ncols + 255) / 256), 256>>>(x, (int64_t) g.k * ncols, (uint32_t) gi);
        const int nblocks = g.k / QK4_0;
        if (decode) {
            LAB_CHECK(cudaMalloc(&yq[gi], sizeof(block_q8_1) * nblocks));
            lab_quantize_q8_1<<<(unsigned) ((nblocks + 7) / 8), 256>>>(x, yq[gi], nblocks);
        } else {
            LAB_CHECK(cudaMalloc(&ys[gi], sizeof(half) * 16 * g.k));
            if (wgmma) {  // the warpgroup kernel's B layout (mc_mmw_convert_y), else the f16 form's order
                mc_mmw_convert_y<<<(unsigned) ((16 * g.k + 255) / 256), 256>>>(x, ys[gi], g.k, g.k, ncols);
            } else {
                mc_mmr_convert_y<<<(unsigned) ((nblocks * 16 * 4 + 255) / 256), 256>>>(x, ys[gi], nblocks, g.k, ncols, 16);
            }
        }
        LAB_CHECK(cudaGetLastError());
    }
    // decode: the library's persistent kernel (patch 0031; MC_MMV_PERSIST=0: off) runs through mc_mmv_launch;
    // MC_LAB_PMV_COPIES=1 that kernel's copies and waits alone (outputs 0: its structure's bound) where
    // it runs ("persistent" true below)
    const int copies_only = decode ? mc_env_int("MC_LAB_PMV_COPIES", 0, 1, 0) : 0;
    if (decode && (mc_pmv_on() || copies_only)) {
        const mc_pmv_settings st = mc_pmv_get_settings();
        for (const lab_group & g : plan) {
            const int         ctas = mc_pmv_ctas_for<false, true>(st, g.k / QK4_0);  // as the library's launch
            const mc_pmv_plan pl   = lab_pmv_plan_for(g, ctas, st.stage_bytes);
            const bool on = pl.rs > 0 && mc_pmv_worth(pl, ctas, st.min_pieces, st.max_wpr);  // else mc_mmv_q4_0
            printf("{\"kind\": \"pmv\", \"group\": \"%s\", \"ctas\": %d, \"stages\": %d, \"stage_bytes\": %d, "
                   "\"rows_a_piece\": %d, \"pieces\": %d, \"persistent\": %s, \"yshared\": %d}\n", g.name, ctas,
                   st.stages, st.stage_bytes, pl.rs, pl.npieces, on ? "true" : "false", st.yshared);
        }
    }
    float * partials;
    LAB_CHECK(cudaMalloc(&partials, sizeof(float) * max_partials));
    LAB_CHECK(cudaFree(scratch));
    LAB_CHECK(cudaDeviceSynchronize());

    unsigned int launches = 0;
    auto         launch   = [&](const size_t gi, const int s) -> int {
        const lab_group & g = plan[gi];
        mc_mm_group       grp;
        grp.n = (int) g.rows.size();
        for (int p = 0; p < grp.n; p++) {
            grp.vx[p]             = sets[gi][s].copies[p];
            grp.dst[p]            = sets[gi][s].dst[p];
            grp.nrows[p]          = g.rows[p];
            grp.stride_col_dst[p] = g.rows[p];
        }
        if (decode) {
            const int     nblocks   = g.k / QK4_0;
            const int64_t row_bytes = (int64_t) nblocks * sizeof(block_q4_0);
            if (copies_only) {
                const char * gate = sets[gi][s].gate;
                const bool   ok   = gate ? mc_pmv_launch<true, false>(grp, gate, yq[gi], GGML_GLU_OP_SWIGLU, 0.0f,
                                                                      nblocks, row_bytes, nullptr)
                                         : mc_pmv_launch<false, false>(grp, nullptr, yq[gi], 0, 0.0f, nblocks,
                                                                       row_bytes, nullptr);
                if (ok) {
                    return 1;
                }
                // declined (mc_pmv_worth, its "persistent" above): the library's kernel, as in a step
            }
            if (sets[gi][s].gate != nullptr) {
                mc_mmv_launch<1, true>(grp, sets[gi][s].gate, yq[gi], nullptr, nullptr, GGML_GLU_OP_SWIGLU, 0.0f,
                                       nblocks, row_bytes, nblocks, nullptr);
            } else {
                mc_mmv_launch<1, false>(grp, nullptr, yq[gi], nullptr, nullptr, 0, 0.0f, nblocks, row_bytes, nblocks,
                                        nullptr);
            }
            return 1;
        }
        const int ntiles  = mc_group_tiles(grp, MC_MMQ_ROWS);
        const int nquads  = g.k / 128;
        if (wgmma) {  // as mc_mmw_launch: K slices in quads, a cluster of them (no PDL here)
            const int per = mc_mmw_kslice_quads(ntiles, nquads, occupancy * nsm);
            const int gy  = (nquads + per - 1) / per;
            mc_mmw_launch_kernel(dim3(ntiles, gy, 1), smem, 0, false, grp, ys[gi], nullptr, ncols, nquads, per,
                                 mc_kernel_flags());
            return gy;
        }
        const int region = (int) (launches++ % MC_MMQ_COUNTER_REGIONS);
        int       nt     = ntiles;
        const int mt = bulk && !wgmma ? mc_mmr_rows_form(grp, nquads, occupancy, occupancy48, occupancy32, nsm) : 4;
        if (mt != 4) {
            const int ks = mc_mmr_plan(grp, mt, nquads, (mt == 3 ? occupancy48 : occupancy32) * nsm, nt);
            float *   p  = ks > 1 ? partials : nullptr;
            if (mt == 3) {
                mc_mmr_start<2, S, true, 3, B>(grp, nt, ks, ys[gi], p, region, nullptr, ncols, nquads,
                                               mc_kernel_flags(), nullptr);
            } else {
                mc_mmr_start<2, S, true, 2, B>(grp, nt, ks, ys[gi], p, region, nullptr, ncols, nquads,
                                               mc_kernel_flags(), nullptr);
            }
            return (mt == 3 ? 200 : 100) + ks;  // the narrower forms: 200 (48 rows) or 100 (32) + the K slices
        }
        const int ks = mc_mmr_plan(grp, 4, nquads, occupancy * nsm, nt);
        if (bulk) {
            mc_mmr_start<2, 3, true, 4, 2>(grp, nt, ks, ys[gi], ks > 1 ? partials : nullptr, region, nullptr, ncols,
                                           nquads, mc_kernel_flags(), nullptr);
        } else {
            mc_mmr_start<2, 3, false, 4, 2>(grp, nt, ks, ys[gi], ks > 1 ? partials : nullptr, region, nullptr, ncols,
                                            nquads, mc_kernel_flags(), nullptr);
        }
        return ks;
    };
    // the first set's outputs: a checksum a group (sum and sum of squares over every product's outputs)
    for (size_t gi = 0; gi < plan.size(); gi++) {
        const int          ks = launch(gi, 0);
        double             sum = 0.0, sq = 0.0;
        LAB_CHECK(cudaDeviceSynchronize());
        for (size_t p = 0; p < plan[gi].rows.size(); p++) {
            std::vector<float> h((size_t) 16 * plan[gi].rows[p]);
            LAB_CHECK(cudaMemcpy(h.data(), sets[gi][0].dst[p], h.size() * sizeof(float), cudaMemcpyDeviceToHost));
            for (int c = 0; c < ncols; c++) {
                for (int r = 0; r < plan[gi].rows[p]; r++) {
                    const double v = h[(size_t) c * plan[gi].rows[p] + r];
                    sum += v;
                    sq += v * v;
                }
            }
        }
        printf("{\"kind\": \"check\", \"group\": \"%s\", \"k_slices\": %d, \"sum\": %.9e, \"sumsq\": %.9e}\n",
               plan[gi].name, ks, sum, sq);
    }
    // a step: each group's launches, cycling through its weight sets
    for (int warm = 0; warm < 2; warm++) {
        for (size_t gi = 0; gi < plan.size(); gi++) {
            for (int l = 0; l < plan[gi].launches; l++) {
                launch(gi, l % LAB_SETS);
            }
        }
    }
    std::vector<float> group_ms(plan.size(), 0.0f);
    const float        step_ms = lab_time_groups(
        repeats, plan.size(), [&](size_t gi) { return plan[gi].launches; },
        [&](size_t gi, int l) { launch(gi, l % LAB_SETS); }, group_ms);
    for (size_t gi = 0; gi < plan.size(); gi++) {
        printf("{\"kind\": \"group\", \"group\": \"%s\", \"launches\": %d, \"us\": %.3f, \"bytes\": %lld}\n",
               plan[gi].name, plan[gi].launches, 1000.0f * group_ms[gi] / (repeats * plan[gi].launches),
               (long long) lab_group_bytes(plan[gi], decode));
    }
    printf("{\"kind\": \"step\", \"columns\": %d, \"form\": %d, \"blocks_per_sm\": %d, \"step_ms\": %.4f}\n", ncols,
           decode ? 0 : (bulk ? 3 : 1), decode ? 0 : occupancy, step_ms);
    return 0;
}
