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
//   ldg:     plain 16-byte loads into registers (the streaming reference)
// Output: one JSON object a line: structure, stages, y, blocks_per_sm, shape, us a launch, TB/s of
// weights. Needs sm_90 or newer (bulk copies). Usage: copy_lab REPEATS ROWS:K [ROWS:K ...]
// (bench/gpu/copy_lab.py passes the 27B's product shapes and sums a step)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define TILE 1152
#define CHECK(x)                                                                                    \
    do {                                                                                            \
        cudaError_t e_ = (x);                                                                       \
        if (e_ != cudaSuccess) {                                                                    \
            fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));            \
            exit(1);                                                                                \
        }                                                                                           \
    } while (0)

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

static __device__ __forceinline__ void bar_wait(uint64_t * b, uint32_t parity) {
    uint32_t done = 0;
    while (!done) {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(saddr(b)), "r"(parity)
            : "memory");
    }
}

static __device__ __forceinline__ void bulk(void * dst, const void * src, uint32_t bytes, uint64_t * b) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     saddr(dst)),
                 "l"(src), "r"(bytes), "r"(saddr(b))
                 : "memory");
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
template <int STAGES, bool Y> __global__ void k_warp(const job j) {
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
    for (int c = 0; c < n; ++c) {
        bar_wait(&bars[warp][c % STAGES], (c / STAGES) & 1);
        __syncwarp();
        acc += *(volatile unsigned *) (st + (c % STAGES) * 4 * WS + lane * 4);
        __syncwarp();
        if (c + STAGES - 1 < n) {
            issue(c + STAGES - 1, (c + STAGES - 1) % STAGES);
        }
    }
    if (acc == 0x9e3779b9u) {
        j.sink[0] = acc;
    }
}

// a producer warp (warp 4) fills block-wide stages; warps 0..3 consume. PERSIST: units (tile, chunk)
// split evenly over the grid; else the warp kernel's grid (tile, K slice)
template <int STAGES, bool Y, bool PERSIST> __global__ void k_block(const job j) {
    constexpr int SB = 16 * TILE + (Y ? 16384 : 0);
    extern __shared__ __align__(128) char sm[];
    __shared__ uint64_t full[STAGES], empty[STAGES];
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
    const int n = (int) (u1 - u0);
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            bar_init(&full[s], 1);
            bar_init(&empty[s], 4);
        }
    }
    __syncthreads();
    if (warp == 4) {
        if (lane == 0) {
            for (int i = 0; i < n; ++i) {
                const int s = i % STAGES;
                if (i >= STAGES) {
                    bar_wait(&empty[s], ((i / STAGES) - 1) & 1);
                }
                bar_expect(&full[s], SB);
                const int64_t u    = u0 + i;
                const int64_t tile = u / nchunks;
                const int     c    = (int) (u % nchunks);
                for (int m = 0; m < 4; ++m) {
                    bulk(sm + s * SB + m * 4 * TILE, j.w + ((tile * 4 + m) * j.nquads + 4 * c) * TILE, 4 * TILE,
                         &full[s]);
                }
                if (Y) {
                    bulk(sm + s * SB + 16 * TILE, j.y + (int64_t) c * 16384, 16384, &full[s]);
                }
            }
        }
        return;
    }
    unsigned acc = 0;
    for (int i = 0; i < n; ++i) {
        const int s = i % STAGES;
        bar_wait(&full[s], (i / STAGES) & 1);
        acc += *(volatile unsigned *) (sm + s * SB + warp * 4 * TILE + lane * 4);
        __syncwarp();
        if (lane == 0) {
            bar_arrive(&empty[s]);
        }
    }
    if (acc == 0x9e3779b9u) {
        j.sink[0] = acc;
    }
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

template <int STAGES, bool Y> static void run_warp(const job & j, int nsm, int bps, size_t smem, cudaStream_t s) {
    const int ks = kslices(j.ntiles, j.nquads / 4, bps * nsm);
    job       jj = j;
    jj.per       = (j.nquads / 4 + ks - 1) / ks;
    k_warp<STAGES, Y><<<dim3(j.ntiles, (j.nquads / 4 + jj.per - 1) / jj.per), 128, smem, s>>>(jj);
}

template <int STAGES, bool Y, bool PERSIST>
static void run_block(const job & j, int nsm, int bps, size_t smem, cudaStream_t s) {
    job jj = j;
    if (PERSIST) {
        k_block<STAGES, Y, true><<<bps * nsm, 160, smem, s>>>(jj);
        return;
    }
    const int ks = kslices(j.ntiles, j.nquads / 4, bps * nsm);
    jj.per       = (j.nquads / 4 + ks - 1) / ks;
    k_block<STAGES, Y, false><<<dim3(j.ntiles, (j.nquads / 4 + jj.per - 1) / jj.per), 160, smem, s>>>(jj);
}

struct config {
    const char * name;
    int          stages;
    bool         y;
    size_t       need;  // shared memory a block needs
    const void * kernel;
    launch_fn    fn;
};

// us a launch of launch(i) over repeats launches on st, after 3 untimed ones (i: which region)
template <typename F> static double time_us(F launch, int repeats, cudaStream_t st, cudaEvent_t e0, cudaEvent_t e1) {
    for (int i = 0; i < 3; ++i) {
        launch(i);
    }
    CHECK(cudaEventRecord(e0, st));
    for (int i = 0; i < repeats; ++i) {
        launch(i + 3);
    }
    CHECK(cudaEventRecord(e1, st));
    CHECK(cudaEventSynchronize(e1));
    CHECK(cudaGetLastError());
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    return 1000.0 * ms / repeats;
}

// launch i's weights: a region of the arena of its own (4 KB aligned), so no launch finds the last
// one's bytes in L2
static char * region(char * arena, size_t arena_bytes, size_t bytes, int i) {
    const int n = (int) (arena_bytes / bytes) - 1;
    return arena + ((size_t) (i % n) * bytes + 4095) / 4096 * 4096;
}

static void print_row(const char * name, int stages, bool y, int bps, const shape & sh, double us) {
    const size_t bytes = (size_t) sh.rows * sh.k / 32 * 18;
    printf("{\"structure\": \"%s\", \"stages\": %d, \"y\": %s, \"blocks_per_sm\": %d, \"rows\": %d, \"k\": %d, "
           "\"us\": %.3f, \"tb_s\": %.4f}\n",
           name, stages, y ? "true" : "false", bps, sh.rows, sh.k, us, bytes / us / 1e6);
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
    CHECK(cudaGetDevice(&dev));
    CHECK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, dev));
    CHECK(cudaDeviceGetAttribute(&smem_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
    const size_t             arena  = (size_t) 3 << 30;  // launches walk through it: no L2 reuse
    char *                   w      = nullptr;
    char *                   y      = nullptr;
    unsigned *               sink   = nullptr;
    CHECK(cudaMalloc(&w, arena));
    int max_quads = 0;
    for (const shape & sh : shapes) {
        max_quads = std::max(max_quads, sh.k / 128);
    }
    CHECK(cudaMalloc(&y, (size_t) max_quads * 4096));
    CHECK(cudaMalloc(&sink, 64));
    k_fill<<<1024, 256>>>((uint32_t *) w, (int64_t) (arena / 4));
    k_fill<<<64, 256>>>((uint32_t *) y, (int64_t) max_quads * 1024);
    CHECK(cudaDeviceSynchronize());
    cudaStream_t st;
    CHECK(cudaStreamCreate(&st));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));

    const size_t ws = 4 * TILE, wsy = 4 * TILE + 4096, sb = 16 * TILE, sby = 16 * TILE + 16384;
    const std::vector<config> configs = {
        { "warp", 3, true, 3 * 4 * wsy, (const void *) k_warp<3, true>, run_warp<3, true> },
        { "warp", 3, false, 3 * 4 * ws, (const void *) k_warp<3, false>, run_warp<3, false> },
        { "warp", 4, false, 4 * 4 * ws, (const void *) k_warp<4, false>, run_warp<4, false> },
        { "warp", 6, false, 6 * 4 * ws, (const void *) k_warp<6, false>, run_warp<6, false> },
        { "warp", 5, true, 5 * 4 * wsy, (const void *) k_warp<5, true>, run_warp<5, true> },
        { "block", 3, true, 3 * sby, (const void *) k_block<3, true, false>, run_block<3, true, false> },
        { "block", 3, false, 3 * sb, (const void *) k_block<3, false, false>, run_block<3, false, false> },
        { "block", 6, false, 6 * sb, (const void *) k_block<6, false, false>, run_block<6, false, false> },
        { "persist", 3, true, 3 * sby, (const void *) k_block<3, true, true>, run_block<3, true, true> },
        { "persist", 3, false, 3 * sb, (const void *) k_block<3, false, true>, run_block<3, false, true> },
        { "persist", 6, false, 6 * sb, (const void *) k_block<6, false, true>, run_block<6, false, true> },
        { "persist", 2, true, 2 * sby, (const void *) k_block<2, true, true>, run_block<2, true, true> },
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
            CHECK(cudaFuncSetAttribute(cf.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem));
            for (const shape & sh : shapes) {
                const size_t bytes  = (size_t) sh.rows * sh.k / 32 * 18;
                const job    j      = { w, y, sh.k / 128, sh.rows / 64, 0, sink };
                auto         launch = [&](int i) {
                    job ji = j;
                    ji.w   = region(w, arena, bytes, i);
                    cf.fn(ji, nsm, bps, smem, st);
                };
                print_row(cf.name, cf.stages, cf.y, bps, sh, time_us(launch, repeats, st, e0, e1));
            }
        }
    }
    for (const shape & sh : shapes) {  // the streaming reference
        const size_t bytes  = (size_t) sh.rows * sh.k / 32 * 18;
        auto         launch = [&](int i) {
            k_ldg<<<nsm * 8, 256, 0, st>>>((const uint4 *) region(w, arena, bytes, i), (int64_t) (bytes / 16), sink);
        };
        print_row("ldg", 0, false, 8, sh, time_us(launch, repeats, st, e0, e1));
    }
    return 0;
}
