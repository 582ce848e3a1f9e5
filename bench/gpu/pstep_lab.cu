// PSTEP lab: a decode step's Q4_0 products on persistent CTAs with no launch boundaries between them, a
// standalone prototype (not in the patch series) of the first slice of a layer-persistent decode step.
// The 27B's 64 layers (every 4th full attention) x 4 product groups (the GDN or attention input, the
// out projection, the FFN's gate + up with its SwiGLU, ffn_down) = 256 tasks over 13.7 GB of distinct
// random weights (nothing in L2 between steps), in the step's order. Each CTA streams its share of
// every task (contiguous pieces of whole rows, as the library's persistent decode kernel mc_pmv_q4_0
// does, with its piece plan mc_pmv_choose and its arithmetic) through ONE ring of bulk-copy stages that
// runs across task boundaries: the weights do not depend on the activations, so the next task's first
// pieces are in flight while the CTA waits at the grid barrier that stands where the small kernels
// (norms, the convolution, the recurrence, attention, the residual adds) would run. The barrier's wait
// can be lengthened to model their time: MC_LAB_PSTEP_GAP_NS after every task, MC_LAB_PSTEP_CORE_NS
// after each layer's input group (the GDN / attention core, the long chain); the ring keeps streaming
// through the wait until its stages are full. The activations are fixed (one q8_1 vector a K), so the
// lab measures the weight streaming, not the data flow.
// Settings (environment): MC_LAB_PSTEP_SCOPE (0: a launch per task, the library's structure without
// PDL; 1: a launch per layer; 2, default: one launch for the step), MC_LAB_PSTEP_STAGES (2..12,
// default 8), MC_LAB_PSTEP_STAGE_KB (8..64, default 24), MC_LAB_PSTEP_CTAS (CTAs an SM, 1..2, default
// 1), MC_LAB_PSTEP_WARPS (8, default, or 16 a CTA: more warps to hide the arithmetic's latency; 16
// rows a piece where they fit a stage), MC_LAB_PSTEP_RPW (1, default, or 2 rows a warp a piece: two
// independent sums a lane, twice the rows a piece), MC_LAB_PSTEP_FORM (0, default: the warps meet a
// piece; 1: they do not, DEC below; with RPW 1), MC_LAB_PSTEP_NIB (1, with FORM 1: the high nibbles
// through dp4a.u32.s32, ps_q4_0_dot), MC_LAB_PSTEP_GAP_NS / MC_LAB_PSTEP_CORE_NS (0..1000000,
// default 0), MC_LAB_PSTEP_NOBAR (1: no barrier waits, the barriers' cost; the outputs are the same,
// the activations being fixed), MC_LAB_PSTEP_MATH (1, default; 0: the copies and waits alone, outputs
// 0: a bound; 2: the arithmetic alone on whatever the stages hold, no copies and no waits for them:
// the other bound, outputs meaningless).
// Usage: pstep_lab REPEATS (timed steps after two untimed); pstep_lab plan CTAS STAGE_KB [WARPS [RPW]]
// (no GPU: each group's pieces and the step's tasks and bytes). Output: one JSON object a line: the settings, each
// group's plan, each group's checksum over the step's outputs with the largest difference from a
// reference in double (relative to the group's RMS), the step's ms and bytes.
#include "mc-mmv.cu"
#define LAB_GGML_STUBS
#define LAB_MMV
#include "lab_common.cuh"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define PS_MAX_STAGES 12
#define PS_MAX_TASKS  256  // a launch's tasks at most (the 27B's step)

// one task: a group's products (a launch of the library's), its pieces and activations
struct ps_task {
    const char *       w[MC_GROUP_MAX];  // Q4_0 rows (the gated FFN: the up rows)
    const char *       gate;             // the gated FFN's gate rows, else nullptr
    float *            dst[MC_GROUP_MAX];
    const block_q8_1 * y;
    int                n;  // products
    int                nrows[MC_GROUP_MAX];
    int                piece_begin[MC_GROUP_MAX];
    int                npieces;
    int                nblocks;  // Q4_0 blocks a row
    int                row_bytes;
    int                rs;          // rows a piece
    long long          gap_cycles;  // the barrier's extra wait before this task (a launch's first: none)
};

struct ps_args {
    const ps_task * tasks;
    int             t0, t1;  // this launch's tasks
    unsigned *      ctr;     // arrivals, one a CTA a task, never reset: the launch starts at base
    unsigned        base;
    int             stages;
    int             stage_bytes;
    int             wait;  // 0 (MC_LAB_PSTEP_NOBAR=1): no barrier waits, the tasks' order alone (its cost)
};

static __device__ __forceinline__ unsigned ps_load_acquire(const unsigned * p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// this CTA's pieces of task T: [first, first + count), the CTAs' counts differing by at most one
static __device__ __forceinline__ void ps_range(const ps_task & T, int & first, int & count) {
    first = (int) ((int64_t) blockIdx.x * T.npieces / gridDim.x);
    count = (int) ((int64_t) (blockIdx.x + 1) * T.npieces / gridDim.x) - first;
}

// piece p of T: its product s and first row
static __device__ __forceinline__ void ps_locate(const ps_task & T, const int p, int & s, int & row0) {
    s         = 0;
    int first = 0;
#pragma unroll
    for (int i = 1; i < MC_GROUP_MAX; ++i) {
        if (i < T.n && p >= T.piece_begin[i]) {
            s     = i;
            first = T.piece_begin[i];
        }
    }
    row0 = (p - first) * T.rs;
}

// the piece after (s, row0): a product's pieces are whole rows from row 0, its last one partial
static __device__ __forceinline__ void ps_step(const ps_task & T, int & s, int & row0) {
    row0 += T.rs;
    if (row0 >= T.nrows[s]) {
        ++s;
        row0 = 0;
    }
}

// mc_q4_0_dot with the high nibbles left in place (NIB, MC_LAB_PSTEP_NIB=1): v & 0xF0F0F0F0 holds 16 x
// each high nibble, unsigned, so dp4a.u32.s32 against the signed activations sums 16 x their products;
// shifted back once a block, the integer sum is the same as mc_q4_0_dot's (exact: a multiple of 16), so
// the result is too. One shift less an int (4 a block) and two independent chains of 4 instead of one
// of 8 (tests/ggml_patches/q4_nibbles.py checks the identity on every nibble and activation value). Run BL:
// the arithmetic alone -3.1%; since patch 0044 the library's mc_q4_0_dot (NIB 0) has the same form
static __device__ __forceinline__ int ps_dp4a_us(const int a, const int b, const int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

template <bool NIB>
static __device__ __forceinline__ float ps_q4_0_dot(const float d4, const int (&v)[4], const int (&u)[8],
                                                   const float2 ds) {
    if (!NIB) {
        return mc_q4_0_dot(d4, v, u, ds);
    }
    int lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        lo = ggml_cuda_dp4a(v[i] & 0x0F0F0F0F, u[i], lo);
        hi = ps_dp4a_us(v[i] & (int) 0xF0F0F0F0, u[i + 4], hi);
    }
    return d4 * ((lo + (hi >> 4)) * ds.x - 8.0f * ds.y);
}

// named barrier 1 + r (r < 8) of n threads: the ids as immediates, so that the kernel holds 9 of an
// SM's barriers, not all 16 (a register id makes the compiler reserve every one)
static __device__ __forceinline__ void ps_row_barrier(const int r, const int n) {
    switch (r) {
        case 0: asm volatile("bar.sync 1, %0;" ::"r"(n) : "memory"); break;
        case 1: asm volatile("bar.sync 2, %0;" ::"r"(n) : "memory"); break;
        case 2: asm volatile("bar.sync 3, %0;" ::"r"(n) : "memory"); break;
        case 3: asm volatile("bar.sync 4, %0;" ::"r"(n) : "memory"); break;
        case 4: asm volatile("bar.sync 5, %0;" ::"r"(n) : "memory"); break;
        case 5: asm volatile("bar.sync 6, %0;" ::"r"(n) : "memory"); break;
        case 6: asm volatile("bar.sync 7, %0;" ::"r"(n) : "memory"); break;
        default: asm volatile("bar.sync 8, %0;" ::"r"(n) : "memory"); break;
    }
}

// W warps a CTA; RPW rows a warp a piece (MC_LAB_PSTEP_RPW: a piece is (W / wpr) x RPW rows, wpr warps
// a row); MODE: MC_LAB_PSTEP_MATH. The current task's descriptor sits in shared memory (the consumers'
// copy, read by every thread: broadcast loads, ~one register each) and a piece's product and row step
// from the CTA's first piece of the task instead of being searched for (run BI's ncu profile of the
// first form: ~340 instructions a warp a piece, half of them bookkeeping, and 62% of its L1 sectors
// excess from every thread reading the descriptor from global memory).
// DEC (MC_LAB_PSTEP_FORM=1): the warps do not wait for each other a piece (run BJ: 2.7 of the 9 cycles
// between a warp's issues at the piece's CTA barrier). Each warp counts itself done with a stage; the
// last of the W refills it (the copy for the piece `stages` later in the CTA's sequence, found from
// the sequence index through a table of the CTA's pieces a task, so that any warp can issue it); a
// row on several warps meets on a named barrier of those warps alone, its partial sums a stage apart
template <int MODE, int W, int RPW, bool DEC, bool NIB = false>
__launch_bounds__(W * WARP_SIZE, 1)
static __global__ void ps_kernel(const ps_args a) {
    extern __shared__ __align__(16) char ps_smem_raw[];
    __shared__ uint64_t bars[PS_MAX_STAGES];
    __shared__ float    red[DEC ? PS_MAX_STAGES : 1][W][2 * RPW];
    __shared__ ps_task  cur, icur;  // the consumers' task and the issue cursor's (thread 0's)
    __shared__ int      done[PS_MAX_STAGES];  // DEC: the warps done with a stage's piece
    __shared__ int      pre[PS_MAX_TASKS + 1];  // DEC: the CTA's pieces before each task of the launch
    constexpr bool MATH   = MODE != 0;
    constexpr bool COPIES = MODE != 2;
    char *    smem = mc_smem_lines(ps_smem_raw);
    const int tid  = threadIdx.x;
    const int warp = tid / WARP_SIZE;
    const int lane = tid % WARP_SIZE;

    // piece (s, row0) of T into that stage: its rows of the product (and, gated, of the gate beside them)
    auto copy_piece = [&](const ps_task & T, const int s, const int row0, const int stage) {
        const int      rows  = min(T.rs, T.nrows[s] - row0);
        char *         st    = smem + stage * a.stage_bytes;
        const uint32_t bytes = (uint32_t) (rows * T.row_bytes);
        mc_mbar_arrive_expect(&bars[stage], T.gate ? 2 * bytes : bytes);
        mc_bulk_copy(st, T.w[s] + (int64_t) row0 * T.row_bytes, bytes, &bars[stage]);
        if (T.gate) {
            mc_bulk_copy(st + T.rs * T.row_bytes, T.gate + (int64_t) row0 * T.row_bytes, bytes, &bars[stage]);
        }
    };
    // the issue cursor (thread 0): the CTA's pieces of tasks t0..t1 in order, one sequence for the ring
    int  it = a.t0 - 1, ii = 0, in = 0, is = 0, irow = 0;
    auto issue_next = [&](const int stage) {
        if (!COPIES) {
            return;
        }
        while (ii >= in) {
            if (it + 1 >= a.t1) {
                return;
            }
            ++it;
            icur = a.tasks[it];
            int first;
            ps_range(icur, first, in);
            ps_locate(icur, first, is, irow);
            ii = 0;
        }
        copy_piece(icur, is, irow, stage);
        ++ii;
        ps_step(icur, is, irow);
    };
    const int ntasks = a.t1 - a.t0;
    auto      issue_seq = [&](const int j, const int stage) {  // DEC: the CTA's j-th piece, by any thread
        if (!COPIES || j >= pre[ntasks]) {
            return;
        }
        int lo = 0, hi = ntasks - 1;  // the last task k with pre[k] <= j (tasks without pieces skipped)
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (pre[mid] <= j) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        const ps_task & T = a.tasks[a.t0 + lo];
        int             first, n, s, row0;
        ps_range(T, first, n);
        ps_locate(T, first + j - pre[lo], s, row0);
        copy_piece(T, s, row0, stage);
    };
    if (DEC) {
        for (int k = tid; k < ntasks; k += blockDim.x) {
            int first, n;
            ps_range(a.tasks[a.t0 + k], first, n);
            pre[k + 1] = n;
        }
        __syncthreads();
    }
    if (tid == 0) {
        for (int i = 0; i < a.stages; ++i) {
            mc_mbar_init(&bars[i], 1);
            done[i] = 0;
        }
        if (DEC) {
            pre[0] = 0;
            for (int k = 1; k <= ntasks; ++k) {
                pre[k] += pre[k - 1];
            }
            for (int i = 0; i < a.stages; ++i) {
                issue_seq(i, i);
            }
        } else {
            for (int i = 0; i < a.stages; ++i) {
                issue_next(i);
            }
        }
    }
    __syncthreads();

    int      stage  = 0;
    uint32_t parity = 0;
    for (int t = a.t0; t < a.t1; ++t) {
        if (tid == 0) {
            if (t > a.t0 && a.wait) {  // every CTA done with the task before (and the small kernels after it)
                const unsigned  target = a.base + (unsigned) (t - a.t0) * gridDim.x;
                const long long c0     = clock64();
                while (ps_load_acquire(a.ctr) < target) {
                    if (clock64() - c0 > (1ll << 34)) {
                        __trap();  // a CTA that never arrives (not co-resident: a bug), not a hang
                    }
                }
                const long long g0 = clock64();
                while (clock64() - g0 < a.tasks[t].gap_cycles) {
                }
            }
            cur = a.tasks[t];
        }
        __syncthreads();
        const ps_task & T    = cur;
        const int       wpr  = W * RPW / T.rs;
        const int       r    = warp / wpr;  // this warp's first row of a piece; the others W / wpr apart
        const int       q    = warp % wpr;  // its part of the row
        const int       rgap = W / wpr;
        const bool      gate = T.gate != nullptr;
        int             u[MC_PMV_J][8];
        float2          ds[MC_PMV_J];
#pragma unroll
        for (int jp = 0; jp < MC_PMV_J / 2; ++jp) {
            const int kb = 2 * (q * WARP_SIZE + lane + WARP_SIZE * wpr * jp);
            if (MATH && kb < T.nblocks) {
                mc_load_q8_1_pair<false>(T.y + kb, u[2 * jp], ds[2 * jp], u[2 * jp + 1], ds[2 * jp + 1]);
            }
        }
        int first, n, s, row0;
        ps_range(T, first, n);
        ps_locate(T, first, s, row0);
        for (int i = 0; i < n; ++i) {
            const int rows = min(T.rs, T.nrows[s] - row0);
            if (COPIES) {
                mc_mbar_wait(&bars[stage], parity);
            }
            const char * st = smem + stage * a.stage_bytes;
            float        acc[RPW], accg[RPW];
#pragma unroll
            for (int k = 0; k < RPW; ++k) {
                acc[k]  = 0.0f;
                accg[k] = 0.0f;
            }
            if (MATH) {
#pragma unroll
                for (int jp = 0; jp < MC_PMV_J / 2; ++jp) {
                    const int kb = 2 * (q * WARP_SIZE + lane + WARP_SIZE * wpr * jp);
                    if (kb < T.nblocks) {  // nblocks is even: the pair is whole
#pragma unroll
                        for (int k = 0; k < RPW; ++k) {
                            const int rr = r + k * rgap;
                            if (rr < rows) {
                                const char * wrow = st + rr * T.row_bytes + kb * mc_q4_0_bytes;
                                int          v0[4], v1[4];
                                float        d0, d1;
                                mc_q4_0_unpack2(wrow, v0, v1, d0, d1);
                                acc[k] += ps_q4_0_dot<NIB>(d0, v0, u[2 * jp], ds[2 * jp]);
                                acc[k] += ps_q4_0_dot<NIB>(d1, v1, u[2 * jp + 1], ds[2 * jp + 1]);
                                if (gate) {
                                    mc_q4_0_unpack2(wrow + T.rs * T.row_bytes, v0, v1, d0, d1);
                                    accg[k] += ps_q4_0_dot<NIB>(d0, v0, u[2 * jp], ds[2 * jp]);
                                    accg[k] += ps_q4_0_dot<NIB>(d1, v1, u[2 * jp + 1], ds[2 * jp + 1]);
                                }
                            }
                        }
                    }
                }
            }
#pragma unroll
            for (int k = 0; k < RPW; ++k) {
                acc[k] = warp_reduce_sum<WARP_SIZE>(acc[k]);
                if (gate) {
                    accg[k] = warp_reduce_sum<WARP_SIZE>(accg[k]);
                }
            }
            if (wpr > 1) {
                float(&rd)[W][2 * RPW] = red[DEC ? stage : 0];
                if (lane == 0) {
#pragma unroll
                    for (int k = 0; k < RPW; ++k) {
                        rd[warp][2 * k]     = acc[k];
                        rd[warp][2 * k + 1] = accg[k];
                    }
                }
                if (DEC) {  // the row's warps alone (consecutive: warp = r wpr + q)
                    ps_row_barrier(r, wpr * WARP_SIZE);
                } else {
                    __syncthreads();
                }
                if (q == 0 && lane == 0) {
                    for (int j = 1; j < wpr; ++j) {
#pragma unroll
                        for (int k = 0; k < RPW; ++k) {
                            acc[k] += rd[warp + j][2 * k];
                            accg[k] += rd[warp + j][2 * k + 1];
                        }
                    }
                }
            }
            if (q == 0 && lane == 0) {
#pragma unroll
                for (int k = 0; k < RPW; ++k) {
                    const int rr = r + k * rgap;
                    if (rr < rows) {
                        T.dst[s][row0 + rr] = gate ? mc_mmv_glu(acc[k], accg[k], GGML_GLU_OP_SWIGLU, 0.0f) : acc[k];
                    }
                }
            }
            if (DEC) {  // this warp is done with the stage; the last of the W refills it
                __syncwarp();
                if (lane == 0) {
                    __threadfence_block();
                    if (atomicAdd(&done[stage], 1) == W - 1) {
                        done[stage] = 0;
                        issue_seq(pre[t - a.t0] + i + a.stages, stage);
                    }
                }
            } else {
                __syncthreads();  // every warp is done with this stage (and with red): refill it
                if (tid == 0) {
                    issue_next(stage);
                }
            }
            if (++stage == a.stages) {
                stage = 0;
                parity ^= 1u;
            }
            ps_step(T, s, row0);
        }
        __syncthreads();  // the CTA's outputs of task t written; cur read by all
        if (tid == 0) {
            __threadfence();
            atomicAdd(a.ctr, 1u);
        }
    }
}

// the reference: a thread a row, in double (the gated FFN: up x silu(gate))
static __global__ void ps_reference(const char * w, const char * gate, const block_q8_1 * y, const int nblocks,
                                    const int row_bytes, const int nrows, double * out) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= nrows) {
        return;
    }
    double acc[2] = { 0.0, 0.0 };
    for (int m = 0; m < (gate ? 2 : 1); ++m) {
        const block_q4_0 * wb = (const block_q4_0 *) ((m ? gate : w) + (int64_t) row * row_bytes);
        for (int b = 0; b < nblocks; ++b) {
            const float2 e    = __half22float2(y[b].ds);
            int          sumi = 0;
            for (int j = 0; j < QK4_0 / 2; ++j) {
                sumi += (wb[b].qs[j] & 15) * y[b].qs[j] + (wb[b].qs[j] >> 4) * y[b].qs[j + QK4_0 / 2];
            }
            acc[m] += (double) __half2float(wb[b].d) * ((double) e.x * sumi - 8.0 * (double) e.y);
        }
    }
    out[row] = gate ? acc[0] * (acc[1] / (1.0 + exp(-acc[1]))) : acc[0];
}

struct ps_group {
    std::vector<int> rows;
    int              k;
    int              nw;  // matrices a piece: 2 for the gated FFN
    const char *     name;
};

enum { PS_GDN_IN, PS_ATTN_IN, PS_OUT, PS_GATE_UP, PS_DOWN, PS_NGROUPS };

// the 27B's product groups (decode: the FFN's gate and up in one task, the gate's rows beside the up's)
static const std::vector<ps_group> & ps_groups() {
    static const std::vector<ps_group> g = {
        { { 10240, 6144, 48, 48 }, 5120, 1, "gdn_in" },
        { { 12288, 1024, 1024 }, 5120, 1, "attn_in" },
        { { 5120 }, 6144, 1, "out" },
        { { 17408 }, 5120, 2, "ffn_gate_up" },
        { { 5120 }, 17408, 1, "ffn_down" },
    };
    return g;
}

// the step's tasks by group, in order: 64 layers, every 4th full attention
static std::vector<int> ps_step_order() {
    std::vector<int> order;
    for (int l = 0; l < 64; ++l) {
        order.insert(order.end(), { l % 4 == 3 ? PS_ATTN_IN : PS_GDN_IN, PS_OUT, PS_GATE_UP, PS_DOWN });
    }
    return order;
}

static int64_t ps_row_bytes(const ps_group & g) {
    return (int64_t) (g.k / QK4_0) * sizeof(block_q4_0);
}

static int64_t ps_group_bytes(const ps_group & g) {
    int64_t rows = 0;
    for (const int r : g.rows) {
        rows += r;
    }
    return g.nw * rows * ps_row_bytes(g);
}

// the pieces of g for CTAs of w warps, rpw rows a warp: mc_pmv_choose's rule (the least work on the
// busiest CTA, ties to more rows a piece; a piece within a stage, a lane's blocks within MC_PMV_J), for
// w = 8, rpw = 1 that function itself (the library's plan)
static mc_pmv_plan ps_plan(const ps_group & g, const int w, const int rpw, const int ctas, const int stage_bytes) {
    mc_mm_group grp;
    grp.n = (int) g.rows.size();
    for (int p = 0; p < grp.n; ++p) {
        grp.nrows[p] = g.rows[p];
    }
    const int     nblocks   = g.k / QK4_0;
    const int64_t row_bytes = ps_row_bytes(g);
    if (w == MC_PMV_WARPS && rpw == 1) {
        return mc_pmv_choose(grp, g.nw, nblocks, row_bytes, ctas, stage_bytes);
    }
    mc_pmv_plan best;
    int64_t     best_cost = -1;
    for (int rs = w * rpw; rs >= rpw; rs /= 2) {  // w * rpw / rs warps a row
        if ((int64_t) g.nw * rs * row_bytes > stage_bytes || WARP_SIZE * (w * rpw / rs) * MC_PMV_J < nblocks) {
            continue;
        }
        mc_pmv_plan pl;
        pl.rs = rs;
        for (int i = 0; i < grp.n; ++i) {
            pl.piece_begin[i] = pl.npieces;
            pl.npieces += (grp.nrows[i] + rs - 1) / rs;
        }
        const int64_t cost = (int64_t) ((pl.npieces + ctas - 1) / ctas) * (g.nw * rs * row_bytes + MC_PMV_PIECE_COST);
        if (best_cost < 0 || cost < best_cost) {
            best      = pl;
            best_cost = cost;
        }
    }
    return best;
}

// pstep_lab plan CTAS STAGE_KB [WARPS [RPW]]: each group's pieces, the step's tasks and weight bytes,
// without a GPU
static int ps_print_plans(const int argc, char ** argv) {
    int  v[4] = { 0, 0, 8, 1 };  // CTAS, STAGE_KB, WARPS, RPW
    bool ok   = true;
    for (int i = 2; i < argc; ++i) {
        char * e     = nullptr;
        v[i - 2] = (int) strtol(argv[i], &e, 10);
        ok       = ok && e != argv[i] && *e == '\0';
    }
    const int ctas = v[0], kb = v[1], w = v[2], rpw = v[3];
    if (!ok || ctas < 1 || kb < 8 || kb > 64 || (w != 8 && w != 16) || (rpw != 1 && rpw != 2)) {
        fprintf(stderr, "usage: pstep_lab plan CTAS STAGE_KB [WARPS [RPW]] (CTAS >= 1; STAGE_KB 8..64; WARPS 8 or "
                        "16; RPW 1 or 2)\n");
        return 2;
    }
    for (const ps_group & g : ps_groups()) {
        const mc_pmv_plan pl = ps_plan(g, w, rpw, ctas, kb * 1024);
        if (pl.rs == 0) {
            fprintf(stderr, "pstep_lab: no piece shape fits K = %d in %d KB stages\n", g.k, kb);
            return 2;
        }
        printf("{\"kind\": \"plan\", \"group\": \"%s\", \"rows_a_piece\": %d, \"pieces\": %d, \"bytes\": %lld}\n",
               g.name, pl.rs, pl.npieces, (long long) ps_group_bytes(g));
    }
    int64_t bytes = 0;
    const std::vector<int> order = ps_step_order();
    for (const int gi : order) {
        bytes += ps_group_bytes(ps_groups()[gi]);
    }
    printf("{\"kind\": \"steplan\", \"tasks\": %zu, \"bytes\": %lld}\n", order.size(), (long long) bytes);
    return 0;
}

// the kernel for MC_LAB_PSTEP_MATH, _RPW, _FORM and _NIB
template <int W> static auto ps_pick(const int math, const int rpw, const int form, const int nib) {
    if (nib == 1) {
        return math == 2 ? ps_kernel<2, W, 1, true, true> :
               math      ? ps_kernel<1, W, 1, true, true> :
                           ps_kernel<0, W, 1, true>;
    }
    if (form == 1) {
        return math == 2 ? ps_kernel<2, W, 1, true> : math ? ps_kernel<1, W, 1, true> : ps_kernel<0, W, 1, true>;
    }
    if (rpw == 2) {
        return math == 2 ? ps_kernel<2, W, 2, false> : math ? ps_kernel<1, W, 2, false> : ps_kernel<0, W, 2, false>;
    }
    return math == 2 ? ps_kernel<2, W, 1, false> : math ? ps_kernel<1, W, 1, false> : ps_kernel<0, W, 1, false>;
}

// each group's checksum over the step's outputs and its largest difference from the reference in double
// (relative to the group's RMS), one JSON line a group
static void ps_print_checks(const std::vector<ps_group> & groups, const std::vector<int> & order,
                            const std::vector<ps_task> & tasks) {
    std::vector<double> sum(groups.size()), sumsq(groups.size()), worst(groups.size()), refsq(groups.size());
    std::vector<int64_t> count(groups.size());
    double *             ref;
    LAB_CHECK(cudaMalloc(&ref, sizeof(double) * 17408));
    std::vector<std::vector<std::pair<std::vector<float>, std::vector<double>>>> outs(groups.size());
    for (size_t t = 0; t < tasks.size(); ++t) {
        const ps_task & T  = tasks[t];
        const int       gi = order[t];
        for (int p = 0; p < T.n; ++p) {
            const std::vector<float> h = lab_fetch<float>(T.dst[p], T.nrows[p]);
            ps_reference<<<(unsigned) ((T.nrows[p] + 127) / 128), 128>>>(T.w[p], T.gate, T.y, T.nblocks, T.row_bytes,
                                                                          T.nrows[p], ref);
            LAB_CHECK(cudaGetLastError());
            const std::vector<double> hr = lab_fetch<double>(ref, T.nrows[p]);
            for (int i = 0; i < T.nrows[p]; ++i) {
                sum[gi] += h[i];
                sumsq[gi] += (double) h[i] * h[i];
                refsq[gi] += hr[i] * hr[i];
            }
            count[gi] += T.nrows[p];
            outs[gi].emplace_back(h, hr);
        }
    }
    for (size_t gi = 0; gi < groups.size(); ++gi) {
        const double rms = std::sqrt(refsq[gi] / std::max<int64_t>(1, count[gi]));
        for (const auto & [h, hr] : outs[gi]) {
            for (size_t i = 0; i < h.size(); ++i) {
                worst[gi] = std::max(worst[gi], std::fabs(h[i] - hr[i]) / std::max(rms, 1e-30));
            }
        }
        auto num = [](const double v) {  // JSON: null where the value is not finite (MATH=2's outputs)
            char buf[32];
            snprintf(buf, sizeof(buf), std::isfinite(v) ? "%.9e" : "null", v);
            return std::string(buf);
        };
        printf("{\"kind\": \"check\", \"group\": \"%s\", \"sum\": %s, \"sumsq\": %s, \"ref_rel\": %s}\n",
               groups[gi].name, num(sum[gi]).c_str(), num(sumsq[gi]).c_str(), num(worst[gi]).c_str());
    }
}

// the step's tasks in order, each with its own random weights and outputs, the activations one q8_1
// vector a K, the modelled waits in clock cycles; returns the step's weight bytes
static int64_t ps_build_tasks(const std::vector<ps_group> & groups, const std::vector<mc_pmv_plan> & plans,
                              const std::vector<int> & order, const int gap_ns, const int core_ns, const int clock_khz,
                              std::vector<ps_task> & tasks) {
    std::vector<block_q8_1 *> ys(groups.size());
    for (size_t gi = 0; gi < groups.size(); ++gi) {
        const int nb = groups[gi].k / QK4_0;
        float *   x;
        LAB_CHECK(cudaMalloc(&x, sizeof(float) * groups[gi].k));
        LAB_CHECK(cudaMalloc(&ys[gi], sizeof(block_q8_1) * nb));
        lab_fill_f32<<<(unsigned) ((groups[gi].k + 255) / 256), 256>>>(x, groups[gi].k, 101u + (uint32_t) gi);
        lab_quantize_q8_1<<<(unsigned) ((nb + 7) / 8), 256>>>(x, ys[gi], nb);
        LAB_CHECK(cudaGetLastError());
        LAB_CHECK(cudaDeviceSynchronize());
        LAB_CHECK(cudaFree(x));
    }
    tasks.assign(order.size(), ps_task{});
    int64_t  step_bytes = 0;
    uint32_t seed       = 1;
    auto     fill       = [&](const ps_group & g, const int rows) {
        char *        w;
        const int64_t nb = (int64_t) rows * (g.k / QK4_0);
        LAB_CHECK(cudaMalloc(&w, nb * sizeof(block_q4_0)));
        lab_fill_q4_0<<<(unsigned) ((nb + 255) / 256), 256>>>((block_q4_0 *) w, nb, seed++ * 2654435761u);
        return w;
    };
    const long long cycles_a_ns_x1000 = clock_khz;  // cycles = ns x kHz / 1e6
    for (size_t t = 0; t < order.size(); ++t) {
        const ps_group &    g  = groups[order[t]];
        const mc_pmv_plan & pl = plans[order[t]];
        ps_task &           T  = tasks[t];
        T                      = ps_task{};
        T.n                    = (int) g.rows.size();
        for (int p = 0; p < T.n; ++p) {
            T.w[p]           = fill(g, g.rows[p]);
            T.nrows[p]       = g.rows[p];
            T.piece_begin[p] = pl.piece_begin[p];
            LAB_CHECK(cudaMalloc(&T.dst[p], sizeof(float) * g.rows[p]));
        }
        T.gate      = g.nw == 2 ? fill(g, g.rows[0]) : nullptr;
        T.y         = ys[order[t]];
        T.npieces   = pl.npieces;
        T.nblocks   = g.k / QK4_0;
        T.row_bytes = (int) ps_row_bytes(g);
        T.rs        = pl.rs;
        const bool after_core = t > 0 && (order[t - 1] == PS_GDN_IN || order[t - 1] == PS_ATTN_IN);
        T.gap_cycles = (long long) (after_core ? core_ns : gap_ns) * cycles_a_ns_x1000 / 1000000;
        step_bytes += ps_group_bytes(g);
    }
    return step_bytes;
}

int main(int argc, char ** argv) {
    if (argc >= 4 && argc <= 6 && std::string(argv[1]) == "plan") {
        return ps_print_plans(argc, argv);
    }
    char *    end     = nullptr;
    const int repeats = argc == 2 ? (int) strtol(argv[1], &end, 10) : 0;
    if (argc != 2 || *end != '\0' || repeats < 1) {
        fprintf(stderr, "usage: pstep_lab REPEATS (REPEATS >= 1) | pstep_lab plan CTAS STAGE_KB\n");
        return 2;
    }
    const int scope       = mc_env_int("MC_LAB_PSTEP_SCOPE", 0, 2, 2);
    const int stages      = mc_env_int("MC_LAB_PSTEP_STAGES", 2, PS_MAX_STAGES, 8);
    const int stage_bytes = mc_env_int("MC_LAB_PSTEP_STAGE_KB", 8, 64, 24) * 1024;
    const int per_sm      = mc_env_int("MC_LAB_PSTEP_CTAS", 1, 2, 1);
    const int gap_ns      = mc_env_int("MC_LAB_PSTEP_GAP_NS", 0, 1000000, 0);
    const int core_ns     = mc_env_int("MC_LAB_PSTEP_CORE_NS", 0, 1000000, 0);
    const int math        = mc_env_int("MC_LAB_PSTEP_MATH", 0, 2, 1);
    const int warps       = mc_env_int("MC_LAB_PSTEP_WARPS", 8, 16, 8);
    const int nobar       = mc_env_int("MC_LAB_PSTEP_NOBAR", 0, 1, 0);
    const int rpw         = mc_env_int("MC_LAB_PSTEP_RPW", 1, 2, 1);
    const int form        = mc_env_int("MC_LAB_PSTEP_FORM", 0, 1, 0);
    const int nib         = mc_env_int("MC_LAB_PSTEP_NIB", 0, 1, 0);
    if (form == 1 && rpw != 1) {
        fprintf(stderr, "pstep_lab: MC_LAB_PSTEP_FORM=1 runs one row a warp a piece (MC_LAB_PSTEP_RPW=1)\n");
        return 2;
    }
    if (nib == 1 && form != 1) {
        fprintf(stderr, "pstep_lab: MC_LAB_PSTEP_NIB=1 runs with MC_LAB_PSTEP_FORM=1 only\n");
        return 2;
    }
    if (warps != 8 && warps != 16) {
        fprintf(stderr, "pstep_lab: MC_LAB_PSTEP_WARPS=%d: 8 or 16\n", warps);
        return 2;
    }

    int dev = 0, nsm = 0, clock_khz = 0, coop = 0;
    LAB_CHECK(cudaGetDevice(&dev));
    LAB_CHECK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, dev));
    LAB_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, dev));
    LAB_CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev));
    cudaDeviceProp prop;
    LAB_CHECK(cudaGetDeviceProperties(&prop, dev));
    if (prop.major < 9) {
        fprintf(stderr, "pstep_lab: needs Hopper or newer (bulk copies); this GPU is sm_%d%d\n", prop.major,
                prop.minor);
        return 2;
    }
    const auto kernel = warps == 16 ? ps_pick<16>(math, rpw, form, nib) : ps_pick<8>(math, rpw, form, nib);
    const size_t smem   = (size_t) stages * stage_bytes + MC_SMEM_PAD;
    LAB_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem));
    int occupancy = 0;
    LAB_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occupancy, kernel, warps * WARP_SIZE, smem));
    if (occupancy < per_sm) {
        fprintf(stderr, "pstep_lab: %d CTAs an SM asked, %d fit (%d stages of %d KB: %zu bytes a CTA)\n", per_sm,
                occupancy, stages, stage_bytes / 1024, smem);
        return 2;
    }
    if (scope > 0 && !coop) {
        fprintf(stderr, "pstep_lab: this GPU has no cooperative launch (the grid barrier needs it)\n");
        return 2;
    }
    const int ctas = per_sm * nsm;

    // the plans, then the tasks
    const std::vector<ps_group> & groups = ps_groups();
    const std::vector<int>        order  = ps_step_order();
    std::vector<mc_pmv_plan>      plans;
    for (const ps_group & g : groups) {
        plans.push_back(ps_plan(g, warps, rpw, ctas, stage_bytes));
        if (plans.back().rs == 0) {
            fprintf(stderr, "pstep_lab: no piece shape fits K = %d in %d KB stages\n", g.k, stage_bytes / 1024);
            return 2;
        }
        printf("{\"kind\": \"plan\", \"group\": \"%s\", \"rows_a_piece\": %d, \"pieces\": %d}\n", g.name,
               plans.back().rs, plans.back().npieces);
    }
    std::vector<ps_task> tasks;
    const int64_t step_bytes = ps_build_tasks(groups, plans, order, gap_ns, core_ns, clock_khz, tasks);
    LAB_CHECK(cudaGetLastError());
    ps_task *  dtasks;
    unsigned * ctr;
    LAB_CHECK(cudaMalloc(&dtasks, sizeof(ps_task) * tasks.size()));
    LAB_CHECK(cudaMemcpy(dtasks, tasks.data(), sizeof(ps_task) * tasks.size(), cudaMemcpyHostToDevice));
    LAB_CHECK(cudaMalloc(&ctr, sizeof(unsigned)));
    LAB_CHECK(cudaMemset(ctr, 0, sizeof(unsigned)));
    LAB_CHECK(cudaDeviceSynchronize());
    printf("{\"kind\": \"pstep\", \"scope\": %d, \"ctas\": %d, \"ctas_per_sm\": %d, \"stages\": %d, "
           "\"stage_bytes\": %d, \"gap_ns\": %d, \"core_ns\": %d, \"math\": %d, \"warps\": %d, \"nobar\": %d, "
           "\"rpw\": %d, \"form\": %d, \"nib\": %d, \"clock_khz\": %d}\n",
           scope, ctas, per_sm, stages, stage_bytes, gap_ns, core_ns, math, warps, nobar, rpw, form, nib, clock_khz);

    unsigned base = 0;  // the counter's value: every CTA arrives once a task
    auto     launch = [&](const int t0, const int t1) {
        ps_args a{ dtasks, t0, t1, ctr, base, stages, stage_bytes, nobar ? 0 : 1 };
        base += (unsigned) (ctas * (t1 - t0));
        if (scope == 0) {
            kernel<<<ctas, warps * WARP_SIZE, smem>>>(a);
        } else {
            void * params[] = { &a };
            LAB_CHECK(
                cudaLaunchCooperativeKernel((const void *) kernel, ctas, warps * WARP_SIZE, params, smem, nullptr));
        }
    };
    const int ntasks = (int) tasks.size();
    if (ntasks > PS_MAX_TASKS) {  // a launch's tasks index the kernel's table (DEC): the step is one launch
        fprintf(stderr, "pstep_lab: %d tasks, more than the kernel's table holds (%d)\n", ntasks, PS_MAX_TASKS);
        return 2;
    }
    auto      step   = [&]() {
        const int span = scope == 0 ? 1 : (scope == 1 ? 4 : ntasks);
        for (int t = 0; t < ntasks; t += span) {
            launch(t, std::min(ntasks, t + span));
        }
    };
    if (base + 2u * (unsigned) (repeats + 2) * ctas * ntasks < base) {
        fprintf(stderr, "pstep_lab: REPEATS %d too many for the arrival counter\n", repeats);
        return 2;
    }
    step();
    step();
    LAB_CHECK(cudaGetLastError());
    LAB_CHECK(cudaDeviceSynchronize());
    cudaEvent_t e0, e1;
    LAB_CHECK(cudaEventCreate(&e0));
    LAB_CHECK(cudaEventCreate(&e1));
    LAB_CHECK(cudaEventRecord(e0));
    for (int r = 0; r < repeats; ++r) {
        step();
    }
    LAB_CHECK(cudaEventRecord(e1));
    LAB_CHECK(cudaEventSynchronize(e1));
    LAB_CHECK(cudaGetLastError());
    float ms = 0.0f;
    LAB_CHECK(cudaEventElapsedTime(&ms, e0, e1));

    ps_print_checks(groups, order, tasks);
    printf("{\"kind\": \"step\", \"step_ms\": %.4f, \"bytes\": %lld, \"tasks\": %d}\n", ms / repeats,
           (long long) step_bytes, ntasks);
    return 0;
}
