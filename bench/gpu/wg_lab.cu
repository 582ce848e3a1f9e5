// WG lab: a prototype of the verify step's 16-column Q4_0 product on Hopper's asynchronous warpgroup
// MMAs (sm_90a `wgmma`), standalone (no patched ggml source), on the 27B's step product groups, against a
// host reference. Not part of the patch series: it answers one question before a kernel is written
// for the library: does a wgmma form beat the mma.sync form's 7.76 ms a step (bench/gpu/kernel_lab.py mmr,
// run AD) at 16 columns?
//
// The form (bench/NOTES.md, nineteenth session): a CTA of WG warpgroups owns WG row tiles of 64 rows and
// a slice of K; thread 0 fills STAGES shared-memory stages with one bulk copy a row tile (the weights
// repacked so a stage of SB Q4_0 blocks is contiguous) and one for the activations (f16, already in
// the wgmma B operand's core-matrix layout); each warp expands its 16 rows' nibbles into the A fragment
// in registers (the mma.sync m16k16 layout: thread 4g + t holds rows g, g + 8, k 2t, 2t + 1, 2t + 8,
// 2t + 9), exact q - 8 in f16, times the block's scale (one rounding), so the MMAs accumulate the whole
// K slice in f32 with no per-block step; two `wgmma.mma_async m64n16k16` a block (low nibbles, high
// nibbles: the k order inside a block is permuted the same way in A and B). The MMAs of a stage run
// while the warps expand the next stage's nibbles (one commit group a stage, waits one group behind).
// K slices write partial sums; the last CTA of a row tile (an atomic counter it resets) adds them in
// slice order, so the result does not depend on timing (as the library's tensor-core kernel does).
//
// The B operand's layout (no swizzle, K-major): core matrices of 8 columns x 8 k (16 bytes a column),
// core (n / 8, k / 8) at (n / 8) * 256 + (k / 8) * 128 bytes of a 512-byte k16 tile. Which descriptor
// field holds which of the two strides is checked at run time: both assignments are tried on the first
// group and the one matching the host reference is kept (the JSON says which; none matching is a failure).
//
// Usage: wg_lab REPEATS [WG] (WG 1 or 2 warpgroups a CTA, default 1). Output: one JSON object a line.
// Needs sm_90a (nvcc -gencode=arch=compute_90a,code=sm_90a); elsewhere the kernel is empty and the
// program says so.
#include "lab_common.cuh"

#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WG_OK 1
#endif

static constexpr int WG_TILE_ROWS  = 64;
static constexpr int WG_TILE_BYTES = 1152;  // 64 rows x one Q4_0 block: 1,024 bytes of quants, 128 of scales
static constexpr int WG_B_BYTES    = 1024;  // 16 columns x 32 k in f16: two 512-byte k16 tiles
static constexpr int WG_COLS       = 16;
#ifndef WG_SB_SET
#define WG_SB_SET 4
#endif
#ifndef WG_STAGES_SET
#define WG_STAGES_SET 6
#endif
static constexpr int WG_SB         = WG_SB_SET;      // Q4_0 blocks a stage (nvcc -DWG_SB_SET=N to try others)
static constexpr int WG_STAGES     = WG_STAGES_SET;  // stages (-DWG_STAGES_SET=N)
static constexpr int LAB_SETS      = 8;     // weight sets a group, cycled: each group's sets exceed the L2

struct q4_0_block {
    half    d;
    uint8_t qs[16];
};
static_assert(sizeof(q4_0_block) == 18, "Q4_0 block");

// ---- layouts (tests/bench/test_wg_layout.py emulates the same index arithmetic in NumPy) ----

// the physical k (0..15 inside a block's half) that the MMA's k index kk (0..15) stands for: thread t of
// a quad holds physical k 4t .. 4t + 3 (one 32-bit word of quants) as MMA k 2t, 2t + 1, 2t + 8, 2t + 9
static __host__ __device__ inline int wg_phys_k(const int kk) {
    const int t = (kk % 8) / 2, h = kk / 8, e = kk % 2;
    return 4 * t + 2 * h + e;
}

// repack: row tile rt, block kb -> tile at (rt * nkb + kb) * 1152; quants: warp w, lane 4g + t: the words
// t of rows 16w + g and 16w + g + 8 at (w * 32 + lane) * 8; scales: (d of row 16w + g, of 16w + g + 8) at
// 1024 + (w * 8 + g) * 4
static __global__ void wg_repack(const q4_0_block * w, char * out, const int nrows, const int nkb) {
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;  // one (tile, block, warp, lane)
    const int     ntiles = (nrows + WG_TILE_ROWS - 1) / WG_TILE_ROWS;
    if (i >= (int64_t) ntiles * nkb * 128) {
        return;
    }
    const int lane = (int) (i % 32), warp = (int) (i / 32 % 4);
    const int64_t tb = i / 128;  // tile * nkb + block
    const int kb = (int) (tb % nkb), rt = (int) (tb / nkb);
    const int g = lane / 4, t = lane % 4;
    char *    tile = out + tb * WG_TILE_BYTES;
    for (int h = 0; h < 2; h++) {
        const int row = rt * WG_TILE_ROWS + 16 * warp + g + 8 * h;
        uint32_t  word = 0;
        half      d    = __float2half(0.0f);
        if (row < nrows) {
            const q4_0_block & b = w[(int64_t) row * nkb + kb];
            word = (uint32_t) b.qs[4 * t] | (uint32_t) b.qs[4 * t + 1] << 8 | (uint32_t) b.qs[4 * t + 2] << 16 |
                   (uint32_t) b.qs[4 * t + 3] << 24;
            d = b.d;
        }
        ((uint32_t *) tile)[(warp * 32 + lane) * 2 + h] = word;
        if (t == 0) {
            ((half *) (tile + 1024))[(warp * 8 + g) * 2 + h] = d;
        }
    }
}

// activations: x[col * k + i] (f32) -> per block kb two k16 tiles (low half of the block's k, high half),
// element (n, kk) of a tile at (n / 8) * 256 + (kk / 8) * 128 + (n % 8) * 16 + (kk % 8) * 2 bytes, holding
// x[n][32 kb + 16 part + wg_phys_k(kk)] in f16; columns past ncols are zero
static __global__ void wg_convert_x(const float * x, half * out, const int k, const int ncols) {
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;  // one f16 of the output
    if (i >= (int64_t) k * WG_COLS) {
        return;
    }
    const int kb = (int) (i / 512), part = (int) (i / 256 % 2), e = (int) (i % 256);
    const int n  = (e / 128) * 8 + (e % 64) / 8, kk = ((e / 64) % 2) * 8 + e % 8;
    const int src = 32 * kb + 16 * part + wg_phys_k(kk);
    out[i] = __float2half(n < ncols ? x[(int64_t) n * k + src] : 0.0f);
}

// ---- Hopper primitives (inline PTX) ----
#ifdef WG_OK
static __device__ __forceinline__ uint32_t wg_smem(const void * p) {
    return (uint32_t) __cvta_generic_to_shared(p);
}
static __device__ __forceinline__ void wg_bar_init(uint64_t * bar, const int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(wg_smem(bar)), "r"(count) : "memory");
}
static __device__ __forceinline__ void wg_bar_expect(uint64_t * bar, const uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(wg_smem(bar)), "r"(bytes) : "memory");
}
static __device__ __forceinline__ void wg_bulk(void * dst, const void * src, const uint32_t bytes, uint64_t * bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     wg_smem(dst)),
                 "l"(src), "r"(bytes), "r"(wg_smem(bar))
                 : "memory");
}
static __device__ __forceinline__ void wg_bar_wait(uint64_t * bar, const uint32_t parity) {
    const long long t0 = clock64();
    for (;;) {
        uint32_t done;
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(wg_smem(bar)), "r"(parity)
            : "memory");
        if (done) {
            return;
        }
        if (clock64() - t0 > (1ll << 34)) {
            __trap();  // a stage that never fills (bytes announced and delivered disagree): a bug
        }
    }
}
// the B operand's descriptor: start address, the two core-matrix strides, no swizzle
static __device__ __forceinline__ uint64_t wg_desc(const void * p, const uint32_t lbo, const uint32_t sbo) {
    return (uint64_t) ((wg_smem(p) & 0x3FFFF) >> 4) | (uint64_t) (lbo >> 4) << 16 | (uint64_t) (sbo >> 4) << 32;
}
static __device__ __forceinline__ void wg_mma(float (&d)[8], const uint32_t (&a)[4], const uint64_t desc) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, "
        "%12, 1, 1, 1, 0;"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
static __device__ __forceinline__ void wg_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
static __device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N> static __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// the accumulators are read only after the last wait (no instruction but the MMAs may touch them while a
// group is in flight: ptxas would wait there, C7517 at -Xptxas -v)
static __device__ __forceinline__ void wg_keep(float (&d)[8]) {
#pragma unroll
    for (int i = 0; i < 8; i++) {
        asm volatile("" : "+f"(d[i])::"memory");
    }
}

// a quant word's low (HI false) or high nibbles as two f16x2 of q - 8: bytes 0, 1 -> pair 0 (MMA k 2t, 2t + 1),
// bytes 2, 3 -> pair 1 (MMA k 2t + 8, 2t + 9); each pair times d (one rounding)
template <bool HI>
static __device__ __forceinline__ void wg_expand(const uint32_t w, const half2 d, uint32_t & p0, uint32_t & p1) {
    uint32_t x = __byte_perm(w, 0, 0x4140), y = __byte_perm(w, 0, 0x4342);
    if (HI) {
        x >>= 4;
        y >>= 4;
    }
    const uint32_t m = 0x000F000F, magic = 0x64006400;  // 1024 + q as f16
    uint32_t       hx, hy;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(hx) : "r"(x), "r"(m), "r"(magic));  // (x & m) | magic
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(hy) : "r"(y), "r"(m), "r"(magic));
    const half2 off = __half2half2(__ushort_as_half(0x6408));  // 1032
    const half2 vx  = __hmul2(__hsub2(*(const half2 *) &hx, off), d);
    const half2 vy  = __hmul2(__hsub2(*(const half2 *) &hy, off), d);
    p0 = *(const uint32_t *) &vx;
    p1 = *(const uint32_t *) &vy;
}
#endif

// grid: (row tiles / WG, K slices); nkb Q4_0 blocks a row, kslice_blocks a slice (nkb and kslice_blocks
// multiples of WG_SB); y: nrows x 16 f32, column-major (y[col * nrows + row]); with K slices, partials
// (slices x 16 x nrows) and one counter a CTA column (zero, and left zero)
template <int WG>
__launch_bounds__(128 * WG)
static __global__ void wg_mm(const char * w, const half * x, float * y, const int nrows, const int nkb,
                             const int kslice_blocks, const uint32_t lbo, const uint32_t sbo, float * partials,
                             unsigned int * counters) {
#ifdef WG_OK
    constexpr int STAGE = WG * WG_SB * WG_TILE_BYTES + WG_SB * WG_B_BYTES;
    extern __shared__ __align__(128) char wg_smem_buf[];
    __shared__ __align__(8) uint64_t bars[WG_STAGES];

    const int tid = threadIdx.x, wgi = tid / 128, warp = (tid / 32) % 4, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    const int rt0 = blockIdx.x * WG;
    const int kb0 = blockIdx.y * kslice_blocks, kb1 = min(nkb, kb0 + kslice_blocks);
    const int nchunks = (kb1 - kb0) / WG_SB;

    if (tid == 0) {
        for (int s = 0; s < WG_STAGES; s++) {
            wg_bar_init(&bars[s], 1);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    // thread 0: chunk c (SB blocks from kb0 + c SB) into stage c % STAGES: WG weight runs and the activations
    auto issue = [&](const int c) {
        const int      kb    = kb0 + c * WG_SB;
        constexpr int  nb    = WG_SB;  // slices are whole chunks (the host checks K)
        char *         st    = wg_smem_buf + (c % WG_STAGES) * STAGE;
        const uint32_t bytes = (uint32_t) (WG * nb * WG_TILE_BYTES + nb * WG_B_BYTES);
        wg_bar_expect(&bars[c % WG_STAGES], bytes);
        for (int r = 0; r < WG; r++) {
            wg_bulk(st + r * WG_SB * WG_TILE_BYTES, w + ((int64_t) (rt0 + r) * nkb + kb) * WG_TILE_BYTES,
                    (uint32_t) (nb * WG_TILE_BYTES), &bars[c % WG_STAGES]);
        }
        wg_bulk(st + WG * WG_SB * WG_TILE_BYTES, (const char *) x + (int64_t) kb * WG_B_BYTES,
                (uint32_t) (nb * WG_B_BYTES), &bars[c % WG_STAGES]);
    };
    if (tid == 0) {
        for (int c = 0; c < min(WG_STAGES, nchunks); c++) {
            issue(c);
        }
    }

    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        acc[i] = 0.0f;
    }
    for (int c = 0; c < nchunks; c++) {
        // [block][low / high nibbles][fragment register]: ptxas keeps them until the MMAs reading them are
        // done (it serializes the MMAs, and says so at -Xptxas -v, where it cannot)
        uint32_t   a[WG_SB][2][4];
        char *     st = wg_smem_buf + (c % WG_STAGES) * STAGE;
        wg_bar_wait(&bars[c % WG_STAGES], (uint32_t) ((c / WG_STAGES) & 1));
        const char * tile = st + wgi * WG_SB * WG_TILE_BYTES;
#pragma unroll
        for (int b = 0; b < WG_SB; b++) {
            const uint2 q  = *(const uint2 *) (tile + b * WG_TILE_BYTES + (warp * 32 + lane) * 8);
            const half2 dd = *(const half2 *) (tile + b * WG_TILE_BYTES + 1024 + (warp * 8 + g) * 4);
            const half2 d0 = __half2half2(__low2half(dd)), d1 = __half2half2(__high2half(dd));
            wg_expand<false>(q.x, d0, a[b][0][0], a[b][0][2]);  // row g
            wg_expand<false>(q.y, d1, a[b][0][1], a[b][0][3]);  // row g + 8
            wg_expand<true>(q.x, d0, a[b][1][0], a[b][1][2]);
            wg_expand<true>(q.y, d1, a[b][1][1], a[b][1][3]);
        }
        wg_fence();
        const char * bt = st + WG * WG_SB * WG_TILE_BYTES;
#pragma unroll
        for (int b = 0; b < WG_SB; b++) {
            wg_mma(acc, a[b][0], wg_desc(bt + b * WG_B_BYTES, lbo, sbo));
            wg_mma(acc, a[b][1], wg_desc(bt + b * WG_B_BYTES + 512, lbo, sbo));
        }
        wg_commit();
        // the MMAs of chunk c - 1 are done (one group may stay in flight): its stage can be refilled and
        // its fragment registers rewritten
        wg_wait<1>();
        __syncthreads();
        if (tid == 0 && c >= 1 && c - 1 + WG_STAGES < nchunks) {
            issue(c - 1 + WG_STAGES);
        }
    }
    wg_wait<0>();
    wg_keep(acc);

    // the accumulators: rows 16 warp + g (+ 8), columns 8 i + 2 t (+ 1)
    const int row0 = (rt0 + wgi) * WG_TILE_ROWS + 16 * warp + g;
    if (partials == nullptr) {
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const int row = row0 + 8 * ((e % 4) / 2), col = 8 * (e / 4) + 2 * t + e % 2;
            if (row < nrows) {
                y[(int64_t) col * nrows + row] = acc[e];
            }
        }
        return;
    }
    const int64_t plane = (int64_t) WG_COLS * nrows;
#pragma unroll
    for (int e = 0; e < 8; e++) {
        const int row = row0 + 8 * ((e % 4) / 2), col = 8 * (e / 4) + 2 * t + e % 2;
        if (row < nrows) {
            partials[blockIdx.y * plane + (int64_t) col * nrows + row] = acc[e];
        }
    }
    __threadfence();
    __shared__ int last;
    __syncthreads();
    if (tid == 0) {
        last = atomicAdd(&counters[blockIdx.x], 1u) == gridDim.y - 1;
    }
    __syncthreads();
    if (!last) {
        return;
    }
    __threadfence();
#pragma unroll
    for (int e = 0; e < 8; e++) {
        const int row = row0 + 8 * ((e % 4) / 2), col = 8 * (e / 4) + 2 * t + e % 2;
        if (row < nrows) {
            float sum = 0.0f;
            for (int sl = 0; sl < (int) gridDim.y; sl++) {
                sum += __ldcg(partials + sl * plane + (int64_t) col * nrows + row);
            }
            y[(int64_t) col * nrows + row] = sum;
        }
    }
    if (tid == 0) {
        counters[blockIdx.x] = 0;
    }
#else
    (void) w, (void) x, (void) y, (void) nrows, (void) nkb, (void) kslice_blocks, (void) lbo, (void) sbo;
    (void) partials, (void) counters;
#endif
}

// ---- the host side ----

static void fill_random(std::vector<q4_0_block> & w, uint32_t seed) {
    for (size_t i = 0; i < w.size(); i++) {
        uint32_t h = (uint32_t) i * 2654435761u ^ seed;
        w[i].d     = __float2half(0.001f + (float) (h % 1000) * 1e-5f);
        for (int j = 0; j < 16; j++) {
            h          = h * 1664525u + 1013904223u;
            w[i].qs[j] = (uint8_t) (h >> 24);
        }
    }
}

struct wg_group {
    const char * name;
    int          rows, k, launches;  // rows: the products of one launch stacked (one input)
};

// one group's buffers: LAB_SETS repacked weight sets, the activations (f32 and converted), the output,
// the K slices' partials and counters, and set 0's weights and the activations on the host
struct wg_state {
    std::vector<char *>     w;
    half *                  x  = nullptr;
    float *                 xf = nullptr;
    float *                 y  = nullptr;
    float *                 partials = nullptr;
    unsigned int *          counters = nullptr;
    int                     nkb = 0, ctas = 0, kslices = 1, kslice_blocks = 0;
    std::vector<q4_0_block> host_w;
    std::vector<float>      host_x;
};

// K slices: fewest waves x (chunks a CTA + 2), as the library's tensor-core launcher chooses
static void wg_slices(wg_state & s, const int nctas_x, const int cap) {
    const int nch  = s.nkb / WG_SB;
    double    best = 1e30;
    for (int ks = 1; ks <= 8; ks++) {
        const int    per  = (nch + ks - 1) / ks;
        const double cost = (double) ((nctas_x * ks + cap - 1) / cap) * (per + 2);
        if (cost < best) {
            best = cost, s.kslice_blocks = per * WG_SB;
        }
    }
    s.kslices = (s.nkb + s.kslice_blocks - 1) / s.kslice_blocks;
    s.ctas    = nctas_x;
}

static void wg_setup(const wg_group & g, const size_t gi, const int wg, const int cap, wg_state & s) {
    s.nkb            = g.k / 32;
    const int ntiles = (g.rows + WG_TILE_ROWS - 1) / WG_TILE_ROWS;
    wg_slices(s, (ntiles + wg - 1) / wg, cap);
    q4_0_block * plain;
    LAB_CHECK(cudaMalloc(&plain, (size_t) g.rows * s.nkb * sizeof(q4_0_block)));
    const size_t rep_bytes = (size_t) ((ntiles + wg - 1) / wg * wg) * s.nkb * WG_TILE_BYTES;  // zeros past rows
    for (int set = 0; set < LAB_SETS; set++) {
        std::vector<q4_0_block> h((size_t) g.rows * s.nkb);
        fill_random(h, (uint32_t) (gi * 131 + set * 7919 + 1));
        LAB_CHECK(cudaMemcpy(plain, h.data(), h.size() * sizeof(q4_0_block), cudaMemcpyHostToDevice));
        char * rep;
        LAB_CHECK(cudaMalloc(&rep, rep_bytes));
        LAB_CHECK(cudaMemset(rep, 0, rep_bytes));
        const int64_t items = (int64_t) ntiles * s.nkb * 128;
        wg_repack<<<(unsigned) ((items + 255) / 256), 256>>>(plain, rep, g.rows, s.nkb);
        LAB_CHECK(cudaGetLastError());
        s.w.push_back(rep);
        if (set == 0) {
            s.host_w = h;
        }
    }
    LAB_CHECK(cudaFree(plain));
    s.host_x.resize((size_t) WG_COLS * g.k);
    for (size_t i = 0; i < s.host_x.size(); i++) {
        const uint32_t hh = ((uint32_t) i * 2246822519u) ^ (uint32_t) gi;
        s.host_x[i]       = __half2float(__float2half((float) (hh % 2001) / 1000.0f - 1.0f));
    }
    LAB_CHECK(cudaMalloc(&s.xf, s.host_x.size() * sizeof(float)));
    LAB_CHECK(cudaMemcpy(s.xf, s.host_x.data(), s.host_x.size() * sizeof(float), cudaMemcpyHostToDevice));
    LAB_CHECK(cudaMalloc(&s.x, (size_t) WG_COLS * g.k * sizeof(half)));
    wg_convert_x<<<(unsigned) (((int64_t) WG_COLS * g.k + 255) / 256), 256>>>(s.xf, s.x, g.k, WG_COLS);
    LAB_CHECK(cudaGetLastError());
    LAB_CHECK(cudaMalloc(&s.y, (size_t) WG_COLS * g.rows * sizeof(float)));
    if (s.kslices > 1) {
        LAB_CHECK(cudaMalloc(&s.partials, (size_t) s.kslices * WG_COLS * g.rows * sizeof(float)));
        LAB_CHECK(cudaMalloc(&s.counters, (size_t) s.ctas * sizeof(unsigned int)));
        LAB_CHECK(cudaMemset(s.counters, 0, (size_t) s.ctas * sizeof(unsigned int)));
    }
}

// the lab's kernel and launch settings; convert: the activations' f16 conversion before the product,
// as the library launches it
struct wg_runner {
    void (*kernel)(const char *, const half *, float *, int, int, int, uint32_t, uint32_t, float *, unsigned int *);
    int      threads = 128;
    size_t   smem    = 0;
    uint32_t lbo = 128, sbo = 256;  // the K-direction core stride in the leading byte offset (swapped if wrong)

    void launch(const wg_group & g, wg_state & s, const int set, const bool convert = false) const {
        if (convert) {
            const int64_t n = (int64_t) WG_COLS * g.k;
            wg_convert_x<<<(unsigned) ((n + 255) / 256), 256>>>(s.xf, s.x, g.k, WG_COLS);
        }
        kernel<<<dim3(s.ctas, s.kslices), threads, smem>>>(s.w[set], s.x, s.y, g.rows, s.nkb, s.kslice_blocks, lbo,
                                                           sbo, s.partials, s.counters);
    }

    // the largest error on sampled rows against the host reference in double (relative to the sum of
    // the terms' magnitudes); outputs poisoned with NaN first, so one left unwritten shows
    double check(const wg_group & g, wg_state & s) const {
        LAB_CHECK(cudaMemset(s.y, 0xff, (size_t) WG_COLS * g.rows * sizeof(float)));
        launch(g, s, 0);
        LAB_CHECK(cudaDeviceSynchronize());
        const std::vector<float> y = lab_fetch<float>(s.y, (size_t) WG_COLS * g.rows);
        double                   worst = 0.0;
        for (int i = 0; i < 97; i++) {
            const int row = i == 0 ? 0 : (i == 1 ? g.rows - 1 : (int) ((uint64_t) i * 2654435761u % g.rows));
            for (int col = 0; col < WG_COLS; col++) {
                double ref = 0.0, mag = 0.0;
                for (int j = 0; j < 32 * s.nkb; j++) {
                    const q4_0_block & b  = s.host_w[(size_t) row * s.nkb + j / 32];
                    const int          jj = j % 32;
                    const int          q  = jj < 16 ? (b.qs[jj] & 15) : (b.qs[jj - 16] >> 4);
                    const double       t  = __half2float(b.d) * (q - 8) * s.host_x[(size_t) col * g.k + j];
                    ref += t;
                    mag += fabs(t);
                }
                const double got = y[(size_t) col * g.rows + row];
                worst = std::max(worst, std::isfinite(got) ? fabs(got - ref) / (mag + 1e-30) : 1e30);
            }
        }
        return worst;
    }
};

// a step's launches of each group, cycling through the weight sets: per group ms (summed over repeats)
static float wg_time_step(const wg_runner & run, const std::vector<wg_group> & plan, std::vector<wg_state> & gs,
                          const int repeats, const bool convert, std::vector<float> & group_ms) {
    return lab_time_groups(
        repeats, plan.size(), [&](size_t gi) { return plan[gi].launches; },
        [&](size_t gi, int l) { run.launch(plan[gi], gs[gi], l % LAB_SETS, convert); }, group_ms);
}

int main(int argc, char ** argv) {
    const int repeats = argc >= 2 ? atoi(argv[1]) : 0;
    const int wg      = argc >= 3 ? atoi(argv[2]) : 1;
    if (argc < 2 || argc > 3 || repeats < 1 || (wg != 1 && wg != 2)) {
        fprintf(stderr, "usage: wg_lab REPEATS [WG] (REPEATS >= 1; WG 1 or 2 warpgroups a CTA)\n");
        return 2;
    }
    int dev = 0, cc_major = 0, cc_minor = 0, nsm = 0;
    LAB_CHECK(cudaGetDevice(&dev));
    LAB_CHECK(cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, dev));
    LAB_CHECK(cudaDeviceGetAttribute(&cc_minor, cudaDevAttrComputeCapabilityMinor, dev));
    LAB_CHECK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, dev));
    if (cc_major != 9 || cc_minor != 0) {
        fprintf(stderr, "wg_lab: needs an sm_90 GPU (H100 / H200), this one is sm_%d%d\n", cc_major, cc_minor);
        return 3;
    }
    // the 27B's verify step: its product groups (rows of one input stacked; GDN input padded to 64)
    const std::vector<wg_group> plan = {
        { "gdn_in", 16512, 5120, 48 },  { "attn_in", 14336, 5120, 16 }, { "out", 5120, 6144, 64 },
        { "ffn_gate_up", 34816, 5120, 64 }, { "ffn_down", 5120, 17408, 64 },
    };
    wg_runner run;
    run.kernel  = wg == 1 ? wg_mm<1> : wg_mm<2>;
    run.threads = 128 * wg;
    run.smem    = WG_STAGES * ((size_t) wg * WG_SB * WG_TILE_BYTES + WG_SB * WG_B_BYTES);
    LAB_CHECK(cudaFuncSetAttribute(run.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) run.smem));
    int occupancy = 0;
    LAB_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occupancy, run.kernel, run.threads, run.smem));
    if (occupancy < 1) {
        fprintf(stderr, "wg_lab: the kernel does not fit an SM (%zu bytes of shared memory)\n", run.smem);
        return 1;
    }
    std::vector<wg_state> gs(plan.size());
    for (size_t gi = 0; gi < plan.size(); gi++) {
        if (plan[gi].k % (32 * WG_SB) != 0) {
            fprintf(stderr, "wg_lab: %s: K %d is not a multiple of %d (whole stages only)\n", plan[gi].name,
                    plan[gi].k, 32 * WG_SB);
            return 1;
        }
        wg_setup(plan[gi], gi, wg, occupancy * nsm, gs[gi]);
    }
    LAB_CHECK(cudaDeviceSynchronize());

    const double tol = 2e-3;  // f16 weights d (q - 8): one rounding each, 2^-11 relative
    double       err = run.check(plan[0], gs[0]);
    printf("{\"kind\": \"layout\", \"lbo\": %u, \"sbo\": %u, \"max_rel\": %.3e}\n", run.lbo, run.sbo, err);
    if (!(err <= tol)) {
        std::swap(run.lbo, run.sbo);
        err = run.check(plan[0], gs[0]);
        printf("{\"kind\": \"layout\", \"lbo\": %u, \"sbo\": %u, \"max_rel\": %.3e}\n", run.lbo, run.sbo, err);
    }
    bool ok = true;
    for (size_t gi = 0; gi < plan.size(); gi++) {
        const double e = gi == 0 ? err : run.check(plan[gi], gs[gi]);
        ok             = ok && e <= tol;
        printf("{\"kind\": \"check\", \"group\": \"%s\", \"k_slices\": %d, \"ctas\": %d, \"max_rel\": %.3e, "
               "\"ok\": %s}\n",
               plan[gi].name, gs[gi].kslices, gs[gi].ctas * gs[gi].kslices, e, e <= tol ? "true" : "false");
    }
    if (!ok) {
        fprintf(stderr, "wg_lab: the products differ from the host reference (max relative error above %.0e)\n", tol);
        return 1;
    }
    std::vector<float> group_ms(plan.size(), 0.0f), unused(plan.size(), 0.0f);
    wg_time_step(run, plan, gs, 2, false, unused);  // warm-up
    const float step_ms      = wg_time_step(run, plan, gs, repeats, false, group_ms);
    const float step_conv_ms = wg_time_step(run, plan, gs, repeats, true, unused);
    for (size_t gi = 0; gi < plan.size(); gi++) {
        const double us    = 1000.0 * group_ms[gi] / (repeats * plan[gi].launches);
        const double bytes = (double) plan[gi].rows * plan[gi].k / 32 * 18;
        printf("{\"kind\": \"group\", \"group\": \"%s\", \"launches\": %d, \"us\": %.3f, \"tb_s\": %.3f}\n",
               plan[gi].name, plan[gi].launches, us, bytes / us * 1e-6);
    }
    printf("{\"kind\": \"step\", \"columns\": 16, \"wg\": %d, \"ctas_per_sm\": %d, \"step_ms\": %.4f, "
           "\"step_ms_with_convert\": %.4f}\n",
           wg, occupancy, step_ms, step_conv_ms);
    return 0;
}
