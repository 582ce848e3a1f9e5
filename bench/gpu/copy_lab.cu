// Copy lab: how fast can the 16-column repacked Q4_0 product's weights (patch 0015's layout: tiles of
// 16 rows x 4 blocks, 1,152 bytes, tile (mt, q) at (mt * nquads + q) * 1152) reach shared memory on
// this GPU, under different copy structures, with no arithmetic at all. Run Z (MC_MMR_PROBE) measured
// the kernel's own copy path at 2.33 TB/s (weights only) against 4.03 TB/s for plain streaming
// kernels; this program tells which structure closes that gap before a kernel is written around it.
//
// Structures (each with and without the activations' copies, 16 x 512 f16 a chunk):
//   warp:    the kernel's today: 4 warps a block, each with its own stages; lane 0 of each warp issues
//            one bulk copy per row tile (4 x 1,152 bytes) and one for its 4 KB of activations; a block
//            is a 64-row tile x one K slice (the launcher's cost model picks the slices)
//   block:   one producer warp a block fills block-wide stages (4 copies of 4 x 1,152 contiguous bytes,
//            one of 16 KB of activations); 4 consumer warps release each stage; same grid as warp
//   persist: block's structure on a grid of resident blocks only, each taking an even, contiguous range
//            of (row tile, chunk) units across tile boundaries, its copies never draining between tiles
//   cluster: block's structure with the activations shared: a cluster of CL blocks on adjacent row
//            tiles (the same K slice); rank 0's producer copies each chunk's 16 KB of activations once,
//            multicast into every block of the cluster, once every block has released that stage
//   ldg:     plain 16-byte loads into registers (the streaming reference)
// With math (the second set of rows): the consumers also run the kernel's arithmetic on each stage
// (mc_mmr_chunk's: Q4_0 nibbles to exact f16 q - 8, two mma.sync m16n8k16 per block and column tile,
// an FFMA per sum with the block scale; 16 columns), so that a structure is judged where the copies
// compete with the arithmetic for the SM, as in the kernel. The sums are not checked (the weights are
// random bytes); only the time is measured.
// Output: one JSON object a line: structure, stages, y, math, cluster, blocks_per_sm, shape, us a
// launch, TB/s of weights. Needs sm_90 or newer (bulk copies; sm_90a for the multicast). Usage: copy_lab REPEATS ROWS:K [ROWS:K ...]
// (bench/gpu/copy_lab.py passes the 27B's product shapes and sums a step)
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "lab_common.cuh"

#define TILE 1152

static __device__ __forceinline__ uint32_t saddr(const void * p) {
    return (uint32_t) __cvta_generic_to_shared(p);
}

static __device__ __forceinline__ void bar_init(uint64_t * b, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(saddr(b)), "r"(count) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

static __device__ __forceinline__ void bar_expect(uint64_t * b, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(saddr(b)), "r"(bytes) : "memory");
}

static __device__ __forceinline__ void bar_arrive(uint64_t * b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(saddr(b)) : "memory");
}

// waits for the phase of the given parity; CLUSTER: acquire at cluster scope (arrivals from peer
// blocks). A phase that never completes (a bug) traps after ~2^32 cycles instead of hanging the lab
template <bool CLUSTER = false> static __device__ __forceinline__ void bar_wait(uint64_t * b, uint32_t parity) {
    const long long t0   = clock64();
    uint32_t        done = 0;
    while (!done) {
        if (CLUSTER) {
            asm volatile(
                "{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2; "
                "selp.u32 %0, 1, 0, p; }"
                : "=r"(done)
                : "r"(saddr(b)), "r"(parity)
                : "memory");
        } else {
            asm volatile(
                "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                : "=r"(done)
                : "r"(saddr(b)), "r"(parity)
                : "memory");
        }
        if (!done && clock64() - t0 > (1ll << 32)) {
            __trap();
        }
    }
}

static __device__ __forceinline__ void bulk(void * dst, const void * src, uint32_t bytes, uint64_t * b) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     saddr(dst)),
                 "l"(src), "r"(bytes), "r"(saddr(b))
                 : "memory");
}

// multicast: the same bytes into the same offset of every block of the cluster in mask, each block's
// own mbarrier at bar's offset told of them
static __device__ __forceinline__ void bulk_mc(void * dst, const void * src, uint32_t bytes, uint64_t * b,
                                               uint16_t mask) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, "
        "[%3], %4;" ::"r"(saddr(dst)),
        "l"(src), "r"(bytes), "r"(saddr(b)), "h"(mask)
        : "memory");
}

// one arrival on the mbarrier at b's offset in block rank of the cluster
static __device__ __forceinline__ void bar_arrive_remote(uint64_t * b, uint32_t rank) {
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(saddr(b)), "r"(rank));
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}

static __device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

static __device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

// the kernel's arithmetic (mc_mmr_chunk, 16 columns): 4 row tiles at t + m * mstride (quants, then
// scales at + 1024), the activations' 4 x 2 pieces of 512 bytes at yst
static __device__ __forceinline__ uint32_t nibbles(uint32_t x, uint32_t mask) {
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(x), "r"(mask), "r"(0x64006400u));
    return r;
}

static __device__ __forceinline__ void expand(uint32_t x, uint32_t (&lo)[2], uint32_t (&hi)[2]) {
    const half2    c1032 = __half2half2(__ushort_as_half(0x6408));
    const half2    s16   = __half2half2(__ushort_as_half(0x2C00));
    const half2    m72   = __half2half2(__ushort_as_half(0xD480));
    const uint32_t x8    = x >> 8;
    const uint32_t l0 = nibbles(x, 0x000F000F), l1 = nibbles(x8, 0x000F000F);
    const uint32_t h0 = nibbles(x, 0x00F000F0), h1 = nibbles(x8, 0x00F000F0);
    const half2    r0 = __hsub2(*(const half2 *) &l0, c1032);
    const half2    r1 = __hsub2(*(const half2 *) &l1, c1032);
    const half2    r2 = __hfma2(*(const half2 *) &h0, s16, m72);
    const half2    r3 = __hfma2(*(const half2 *) &h1, s16, m72);
    lo[0]             = *(const uint32_t *) &r0;
    lo[1]             = *(const uint32_t *) &r1;
    hi[0]             = *(const uint32_t *) &r2;
    hi[1]             = *(const uint32_t *) &r3;
}

template <bool ZERO>
static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    if (ZERO) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%10, %10, %10, %10};"
            : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

static __device__ __forceinline__ void chunk(const char * t, const int mstride, const char * yst, const int lane,
                                             float (&acc)[4][2][4]) {
    const int g = lane / 4;
    uint4     bf[4][2];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int n = 0; n < 2; ++n) {
            bf[j][n] = *(const uint4 *) (yst + (j * 2 + n) * 512 + lane * 16);
        }
    }
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        const uint4    q0 = *(const uint4 *) (t + m * mstride + lane * 16);
        const uint4    q1 = *(const uint4 *) (t + m * mstride + 512 + lane * 16);
        const uint4    sc = *(const uint4 *) (t + m * mstride + 1024 + g * 16);
        const uint32_t w0[4] = { q0.x, q0.y, q0.z, q0.w };
        const uint32_t w1[4] = { q1.x, q1.y, q1.z, q1.w };
        const float2   dg01  = __half22float2(*(const half2 *) &sc.x);
        const float2   dg23  = __half22float2(*(const half2 *) &sc.y);
        const float2   dh01  = __half22float2(*(const half2 *) &sc.z);
        const float2   dh23  = __half22float2(*(const half2 *) &sc.w);
        const float    d[4][2] = { { dg01.x, dh01.x }, { dg01.y, dh01.y }, { dg23.x, dh23.x }, { dg23.y, dh23.y } };
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            uint32_t lo[2][2], hi[2][2];
            expand(w0[j], lo[0], hi[0]);
            expand(w1[j], lo[1], hi[1]);
            const uint32_t a_lo[4] = { lo[0][0], lo[1][0], lo[0][1], lo[1][1] };
            const uint32_t a_hi[4] = { hi[0][0], hi[1][0], hi[0][1], hi[1][1] };
#pragma unroll
            for (int n = 0; n < 2; ++n) {
                float cs[4];
                mma<true>(cs, a_lo, bf[j][n].x, bf[j][n].y);
                mma<false>(cs, a_hi, bf[j][n].z, bf[j][n].w);
                acc[m][n][0] = fmaf(d[j][0], cs[0], acc[m][n][0]);
                acc[m][n][1] = fmaf(d[j][0], cs[1], acc[m][n][1]);
                acc[m][n][2] = fmaf(d[j][1], cs[2], acc[m][n][2]);
                acc[m][n][3] = fmaf(d[j][1], cs[3], acc[m][n][3]);
            }
        }
    }
}

// keeps the sums alive (never true for real data: the bytes are random, the sums finite or not)
static __device__ __forceinline__ void keep(const float (&acc)[4][2][4], unsigned acc_bits, unsigned * sink) {
    float s = 0.0f;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                s += acc[m][n][i];
            }
        }
    }
    if (__float_as_uint(s) == 0x7fc01234u || acc_bits == 0x9e3779b9u) {
        sink[0] = __float_as_uint(s) ^ acc_bits;
    }
}

struct job {
    const char * w;       // the repacked weights
    const char * y;       // activations: 4,096 bytes a K quad
    int          nquads;  // K / 128
    int          ntiles;  // rows / 64
    int          per;     // chunks (4 quads) a K slice (warp, block)
    unsigned *   sink;
};

// the kernel's copy path (MC_MMR_FORM=3) with the arithmetic left out
template <int STAGES, bool Y, bool MATH> __global__ void __launch_bounds__(128, 2) k_warp(const job j) {
    constexpr int WS = 4 * TILE + (Y ? 4096 : 0);  // a warp's stage
    extern __shared__ __align__(128) char sm[];
    __shared__ uint64_t bars[4][STAGES];
    const int      warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int      nchunks = j.nquads / 4;
    const int      c0 = blockIdx.y * j.per;
    const int      n  = min(nchunks, c0 + j.per) - c0;
    const int64_t  mts = (int64_t) j.nquads * TILE;
    const char *   w0  = j.w + (int64_t) blockIdx.x * 4 * mts + (int64_t) (4 * c0 + warp) * TILE;
    const char *   y0  = j.y + (int64_t) (4 * c0 + warp) * 4096;
    char *         st  = sm + warp * WS;
    if (lane == 0) {
        for (int s = 0; s < STAGES; ++s) {
            bar_init(&bars[warp][s], 1);
        }
    }
    __syncwarp();
    auto issue = [&](int c, int s) {
        if (lane == 0) {
            bar_expect(&bars[warp][s], WS);
            for (int m = 0; m < 4; ++m) {
                bulk(st + s * 4 * WS + m * TILE, w0 + (int64_t) c * 4 * TILE + m * mts, TILE, &bars[warp][s]);
            }
            if (Y) {
                bulk(st + s * 4 * WS + 4 * TILE, y0 + (int64_t) c * 16384, 4096, &bars[warp][s]);
            }
        }
    };
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < n) {
            issue(s, s);
        }
    }
    unsigned acc = 0;
    float    sums[4][2][4] = {};
    for (int c = 0; c < n; ++c) {
        bar_wait(&bars[warp][c % STAGES], (c / STAGES) & 1);
        __syncwarp();
        if (MATH) {
            // the kernel issues the next copies before its arithmetic (into the stage read a chunk ago)
            if (c + STAGES - 1 < n) {
                issue(c + STAGES - 1, (c + STAGES - 1) % STAGES);
            }
            const char * sc = st + (c % STAGES) * 4 * WS;
            chunk(sc, TILE, sc + 4 * TILE, lane, sums);
            __syncwarp();
            continue;
        }
        acc += *(volatile unsigned *) (st + (c % STAGES) * 4 * WS + lane * 4);
        __syncwarp();
        if (c + STAGES - 1 < n) {
            issue(c + STAGES - 1, (c + STAGES - 1) % STAGES);
        }
    }
    keep(sums, acc, j.sink);
}

// a producer warp (warp 4) fills block-wide stages; warps 0..3 consume. PERSIST: units (tile, chunk)
// split evenly over the grid; else the warp kernel's grid (tile, K slice). CL > 1: clusters of CL
// blocks along the row tiles (the grid padded to a multiple of CL; a padding block copies no
// weights), the activations multicast by rank 0 once every block of the cluster has freed the stage
template <int STAGES, bool Y, bool PERSIST, bool MATH, int CL>
__global__ void __launch_bounds__(160, 2) k_block(const job j) {
    static_assert(!(PERSIST && CL > 1) && (CL == 1 || Y), "clusters share the activations of one K slice");
    constexpr int SB = 16 * TILE + (Y ? 16384 : 0);
    extern __shared__ __align__(128) char sm[];
    __shared__ uint64_t full[STAGES], empty[STAGES], cluster_empty[STAGES];
    const int     warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int     nchunks = j.nquads / 4;
    int64_t       u0, u1;
    if (PERSIST) {
        const int64_t units = (int64_t) j.ntiles * nchunks;
        u0                  = units * blockIdx.x / gridDim.x;
        u1                  = units * (blockIdx.x + 1) / gridDim.x;
    } else {
        const int c0 = blockIdx.y * j.per;
        u0           = (int64_t) blockIdx.x * nchunks + c0;
        u1           = (int64_t) blockIdx.x * nchunks + min(nchunks, c0 + j.per);
    }
    const int      n      = (int) (u1 - u0);
    const bool     has_w  = (int) blockIdx.x < j.ntiles || PERSIST;
    const uint32_t rank   = CL > 1 ? cluster_rank() : 0;
    const uint32_t wbytes = has_w ? 16 * TILE : 0;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            bar_init(&full[s], 1);
            bar_init(&empty[s], 4);
            bar_init(&cluster_empty[s], CL);
        }
    }
    if (CL > 1) {
        cluster_sync();  // every block's barriers exist before any multicast or remote arrival
    } else {
        __syncthreads();
    }
    unsigned acc = 0;
    float    sums[4][2][4] = {};
    if (warp == 4) {
        if (lane == 0) {
            for (int i = 0; i < n; ++i) {
                const int s = i % STAGES;
                if (i >= STAGES) {
                    bar_wait(&empty[s], ((i / STAGES) - 1) & 1);
                    if (CL > 1) {
                        bar_arrive_remote(&cluster_empty[s], 0);
                    }
                }
                bar_expect(&full[s], wbytes + (Y ? 16384 : 0));
                const int64_t u    = u0 + i;
                const int64_t tile = u / nchunks;
                const int     c    = (int) (u % nchunks);
                if (has_w) {
                    for (int m = 0; m < 4; ++m) {
                        bulk(sm + s * SB + m * 4 * TILE, j.w + ((tile * 4 + m) * j.nquads + 4 * c) * TILE, 4 * TILE,
                             &full[s]);
                    }
                }
                if (Y && CL == 1) {
                    bulk(sm + s * SB + 16 * TILE, j.y + (int64_t) c * 16384, 16384, &full[s]);
                } else if (Y && rank == 0) {
                    if (i >= STAGES) {
                        bar_wait<true>(&cluster_empty[s], ((i / STAGES) - 1) & 1);
                    }
                    bulk_mc(sm + s * SB + 16 * TILE, j.y + (int64_t) c * 16384, 16384, &full[s], (1u << CL) - 1);
                }
            }
        }
    } else {
        for (int i = 0; i < n; ++i) {
            const int s = i % STAGES;
            bar_wait(&full[s], (i / STAGES) & 1);
            if (MATH) {
                chunk(sm + s * SB + warp * TILE, 4 * TILE, sm + s * SB + 16 * TILE + warp * 4096, lane, sums);
            } else {
                acc += *(volatile unsigned *) (sm + s * SB + warp * 4 * TILE + lane * 4);
            }
            __syncwarp();
            if (lane == 0) {
                bar_arrive(&empty[s]);
            }
        }
    }
    if (CL > 1) {
        cluster_sync();  // no block leaves while a peer may still copy into it or arrive on its barriers
    }
    keep(sums, acc, j.sink);
}

__global__ void k_ldg(const uint4 * p, const int64_t n, unsigned * sink) {
    unsigned      acc    = 0;
    const int64_t stride = (int64_t) gridDim.x * blockDim.x;
    int64_t       i      = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            v[u] = __ldcs(p + i + u * stride);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
        }
    }
    for (; i < n; i += stride) {
        const uint4 v = __ldcs(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) {
        sink[0] = acc;
    }
}

__global__ void k_fill(uint32_t * p, const int64_t n) {
    for (int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t) gridDim.x * blockDim.x) {
        uint32_t x = (uint32_t) i * 2654435761u;
        x ^= x >> 15;
        p[i] = x * 2246822519u;
    }
}

// the launcher's K-slice choice (mc_mmq_kslices): the fewest waves x (chunks a slice + 3)
static int kslices(int ntiles, int nchunks, int slots) {
    int    best      = 1;
    double best_cost = 1e30;
    for (int ks = 1; ks <= std::min(nchunks, 16); ++ks) {
        const int    per   = (nchunks + ks - 1) / ks;
        const int    ks_n  = (nchunks + per - 1) / per;
        const int    waves = (ntiles * ks_n + slots - 1) / slots;
        const double cost  = (double) waves * (per + 3);
        if (cost < best_cost - 1e-9) {
            best_cost = cost;
            best      = ks_n;
        }
    }
    return best;
}

struct shape {
    int rows, k;
};

typedef void (*launch_fn)(const job &, int nsm, int bps, size_t smem, cudaStream_t);

template <int STAGES, bool Y, bool MATH>
static void run_warp(const job & j, int nsm, int bps, size_t smem, cudaStream_t s) {
    const int ks = kslices(j.ntiles, j.nquads / 4, bps * nsm);
    job       jj = j;
    jj.per       = (j.nquads / 4 + ks - 1) / ks;
    k_warp<STAGES, Y, MATH><<<dim3(j.ntiles, (j.nquads / 4 + jj.per - 1) / jj.per), 128, smem, s>>>(jj);
}

template <int STAGES, bool Y, bool PERSIST, bool MATH, int CL>
static void run_block(const job & j, int nsm, int bps, size_t smem, cudaStream_t s) {
    job jj = j;
    if (PERSIST) {
        k_block<STAGES, Y, true, MATH, 1><<<bps * nsm, 160, smem, s>>>(jj);
        return;
    }
    const int ks = kslices(j.ntiles, j.nquads / 4, bps * nsm);
    jj.per       = (j.nquads / 4 + ks - 1) / ks;
    const dim3 grid((j.ntiles + CL - 1) / CL * CL, (j.nquads / 4 + jj.per - 1) / jj.per);
    if (CL == 1) {
        k_block<STAGES, Y, false, MATH, CL><<<grid, 160, smem, s>>>(jj);
        return;
    }
    cudaLaunchConfig_t   cfg = {};
    cudaLaunchAttribute  attr[1];
    attr[0].id               = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = CL;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.gridDim              = grid;
    cfg.blockDim             = dim3(160);
    cfg.dynamicSmemBytes     = smem;
    cfg.stream               = s;
    cfg.attrs                = attr;
    cfg.numAttrs             = 1;
    LAB_CHECK(cudaLaunchKernelEx(&cfg, k_block<STAGES, Y, false, MATH, CL>, jj));
}

struct config {
    const char * name;
    int          stages;
    bool         y;
    bool         math;
    int          cluster;
    size_t       need;  // shared memory a block needs
    const void * kernel;
    launch_fn    fn;
};

#define WARP(ST, Y, M, NEED) { "warp", ST, Y, M, 1, NEED, (const void *) k_warp<ST, Y, M>, run_warp<ST, Y, M> }
#define BLOCK(NAME, ST, Y, P, M, CL, NEED) \
    { NAME, ST, Y, M, CL, NEED, (const void *) k_block<ST, Y, P, M, CL>, run_block<ST, Y, P, M, CL> }

// us a launch of launch(i) over repeats launches on st, after 3 untimed ones (i: which region)
template <typename F> static double time_us(F launch, int repeats, cudaStream_t st, cudaEvent_t e0, cudaEvent_t e1) {
    for (int i = 0; i < 3; ++i) {
        launch(i);
    }
    LAB_CHECK(cudaEventRecord(e0, st));
    for (int i = 0; i < repeats; ++i) {
        launch(i + 3);
    }
    LAB_CHECK(cudaEventRecord(e1, st));
    LAB_CHECK(cudaEventSynchronize(e1));
    LAB_CHECK(cudaGetLastError());
    float ms = 0;
    LAB_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    return 1000.0 * ms / repeats;
}

// launch i's weights: a region of the arena of its own (4 KB aligned), so no launch finds the last
// one's bytes in L2
static char * region(char * arena, size_t arena_bytes, size_t bytes, int i) {
    const int n = (int) (arena_bytes / bytes) - 1;
    return arena + ((size_t) (i % n) * bytes + 4095) / 4096 * 4096;
}

static void print_row(const config & cf, int bps, const shape & sh, double us) {
    const size_t bytes = (size_t) sh.rows * sh.k / 32 * 18;
    printf("{\"structure\": \"%s\", \"stages\": %d, \"y\": %s, \"math\": %s, \"cluster\": %d, \"blocks_per_sm\": %d, "
           "\"rows\": %d, \"k\": %d, \"us\": %.3f, \"tb_s\": %.4f}\n",
           cf.name, cf.stages, cf.y ? "true" : "false", cf.math ? "true" : "false", cf.cluster, bps, sh.rows, sh.k, us,
           bytes / us / 1e6);
    fflush(stdout);
}

int main(int argc, char ** argv) {
    const int repeats = argc > 1 ? atoi(argv[1]) : 0;
    std::vector<shape> shapes;
    for (int i = 2; i < argc; ++i) {
        shape sh = { 0, 0 };
        if (sscanf(argv[i], "%d:%d", &sh.rows, &sh.k) != 2 || sh.rows < 64 || sh.rows % 64 || sh.k < 512 ||
            sh.k % 512) {
            fprintf(stderr, "shape %s: expected ROWS:K, ROWS a multiple of 64, K a multiple of 512\n", argv[i]);
            return 2;
        }
        if ((size_t) sh.rows * sh.k / 32 * 18 > ((size_t) 1 << 30)) {
            fprintf(stderr, "shape %s: more than 1 GiB of weights\n", argv[i]);
            return 2;
        }
        shapes.push_back(sh);
    }
    if (repeats < 1 || shapes.empty()) {
        fprintf(stderr, "usage: copy_lab REPEATS ROWS:K [ROWS:K ...] (REPEATS at least 1)\n");
        return 2;
    }
    int dev = 0, nsm = 0, smem_sm = 0;
    LAB_CHECK(cudaGetDevice(&dev));
    LAB_CHECK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, dev));
    LAB_CHECK(cudaDeviceGetAttribute(&smem_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
    const size_t             arena  = (size_t) 3 << 30;  // launches walk through it: no L2 reuse
    char *                   w      = nullptr;
    char *                   y      = nullptr;
    unsigned *               sink   = nullptr;
    LAB_CHECK(cudaMalloc(&w, arena));
    int max_quads = 0;
    for (const shape & sh : shapes) {
        max_quads = std::max(max_quads, sh.k / 128);
    }
    LAB_CHECK(cudaMalloc(&y, (size_t) max_quads * 4096));
    LAB_CHECK(cudaMalloc(&sink, 64));
    k_fill<<<1024, 256>>>((uint32_t *) w, (int64_t) (arena / 4));
    k_fill<<<64, 256>>>((uint32_t *) y, (int64_t) max_quads * 1024);
    LAB_CHECK(cudaDeviceSynchronize());
    cudaStream_t st;
    LAB_CHECK(cudaStreamCreate(&st));
    cudaEvent_t e0, e1;
    LAB_CHECK(cudaEventCreate(&e0));
    LAB_CHECK(cudaEventCreate(&e1));

    const size_t ws = 4 * TILE, wsy = 4 * TILE + 4096, sb = 16 * TILE, sby = 16 * TILE + 16384;
    const std::vector<config> configs = {
        // the copies alone
        WARP(3, true, false, 3 * 4 * wsy),
        WARP(3, false, false, 3 * 4 * ws),
        WARP(4, false, false, 4 * 4 * ws),
        WARP(6, false, false, 6 * 4 * ws),
        WARP(5, true, false, 5 * 4 * wsy),
        BLOCK("block", 3, true, false, false, 1, 3 * sby),
        BLOCK("block", 3, false, false, false, 1, 3 * sb),
        BLOCK("block", 6, false, false, false, 1, 6 * sb),
        BLOCK("persist", 3, true, true, false, 1, 3 * sby),
        BLOCK("persist", 3, false, true, false, 1, 3 * sb),
        BLOCK("persist", 6, false, true, false, 1, 6 * sb),
        BLOCK("persist", 2, true, true, false, 1, 2 * sby),
        BLOCK("cluster", 3, true, false, false, 2, 3 * sby),
        BLOCK("cluster", 3, true, false, false, 4, 3 * sby),
        // with the kernel's arithmetic
        WARP(3, true, true, 3 * 4 * wsy),
        BLOCK("block", 3, true, false, true, 1, 3 * sby),
        BLOCK("block", 2, true, false, true, 1, 2 * sby),
        BLOCK("persist", 3, true, true, true, 1, 3 * sby),
        BLOCK("cluster", 3, true, false, true, 2, 3 * sby),
        BLOCK("cluster", 3, true, false, true, 4, 3 * sby),
        BLOCK("cluster", 2, true, false, true, 2, 2 * sby),
    };
    const int max_block = 227 * 1024;
    for (const config & cf : configs) {
        for (int bps : { 1, 2, 3 }) {
            // shared memory a block asks for: what it needs, or more so that only bps fit an SM
            const size_t smem = std::max(cf.need, (size_t) (smem_sm / bps - 2048));
            if (smem > (size_t) max_block || cf.need > (size_t) (smem_sm / bps - 1024)) {
                continue;
            }
            if (bps == 1 && cf.need <= (size_t) (smem_sm / 2 - 1024)) {
                continue;  // one block an SM only where two do not fit
            }
            LAB_CHECK(cudaFuncSetAttribute(cf.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem));
            for (const shape & sh : shapes) {
                const size_t bytes  = (size_t) sh.rows * sh.k / 32 * 18;
                const job    j      = { w, y, sh.k / 128, sh.rows / 64, 0, sink };
                auto         launch = [&](int i) {
                    job ji = j;
                    ji.w   = region(w, arena, bytes, i);
                    cf.fn(ji, nsm, bps, smem, st);
                };
                print_row(cf, bps, sh, time_us(launch, repeats, st, e0, e1));
            }
        }
    }
    for (const shape & sh : shapes) {  // the streaming reference
        const size_t bytes  = (size_t) sh.rows * sh.k / 32 * 18;
        auto         launch = [&](int i) {
            k_ldg<<<nsm * 8, 256, 0, st>>>((const uint4 *) region(w, arena, bytes, i), (int64_t) (bytes / 16), sink);
        };
        const config ldg = { "ldg", 0, false, false, 1, 0, nullptr, nullptr };
        print_row(ldg, 8, sh, time_us(launch, repeats, st, e0, e1));
    }
    return 0;
}
