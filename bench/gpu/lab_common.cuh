// Shared by the lab programs (copy_lab.cu, gdn_lab.cu, mmr_lab.cu, wg_lab.cu): a CUDA call that fails stops
// the program with its place and message; a step's launches timed group by group (lab_time_groups); with LAB_GGML_STUBS (the labs that include a patched ggml-cuda
// source file), the host functions of libggml-base / ggml-cuda that the included launchers name and
// both labs need, as stubs that stop the program (the labs launch the kernels themselves, so none runs),
// except ggml_cuda_get_device, which the launch helper the launchers share calls, and ggml_cuda_info
// (the device's shape), which the persistent decode kernel's launcher reads
#pragma once
#include <cuda_runtime.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define LAB_CHECK(x)                                                                              \
    do {                                                                                          \
        cudaError_t e_ = (x);                                                                     \
        if (e_ != cudaSuccess) {                                                                  \
            fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));          \
            exit(1);                                                                              \
        }                                                                                         \
    } while (0)

// n values of type T from device memory
template <typename T> static std::vector<T> lab_fetch(const void * d, size_t n) {
    std::vector<T> h(n);
    LAB_CHECK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
}

// a step timed group by group with events, repeats times: launch(gi, l) for l < launches(gi) of each of
// ngroups groups; each group's ms added to group_ms[gi]; returns the step's ms, the mean over the repeats
template <typename N, typename L>
static float lab_time_groups(const int repeats, const size_t ngroups, N launches, L launch,
                             std::vector<float> & group_ms) {
    cudaEvent_t e0, e1;
    LAB_CHECK(cudaEventCreate(&e0));
    LAB_CHECK(cudaEventCreate(&e1));
    float step_ms = 0.0f;
    for (int r = 0; r < repeats; r++) {
        for (size_t gi = 0; gi < ngroups; gi++) {
            LAB_CHECK(cudaEventRecord(e0));
            for (int l = 0; l < launches(gi); l++) {
                launch(gi, l);
            }
            LAB_CHECK(cudaEventRecord(e1));
            LAB_CHECK(cudaEventSynchronize(e1));
            float ms = 0.0f;
            LAB_CHECK(cudaEventElapsedTime(&ms, e0, e1));
            group_ms[gi] += ms;
            step_ms += ms;
        }
    }
    LAB_CHECK(cudaGetLastError());
    LAB_CHECK(cudaEventDestroy(e0));
    LAB_CHECK(cudaEventDestroy(e1));
    return step_ms / repeats;
}

#ifdef LAB_GGML_STUBS
[[noreturn]] static void lab_unreachable(const char * name) {
    fprintf(stderr, "lab: %s called (a launcher's host dependency; the lab should not reach it)\n", name);
    exit(1);
}

// a CUDA call the library checks failed (CUDA_CHECK): say which, as ggml does (run AP's labs read the
// error as a host dependency reached: "invalid argument called", from cudaFuncSetAttribute)
void ggml_cuda_error(const char * stmt, const char * func, const char * file, int line, const char * msg) {
    fprintf(stderr, "lab: CUDA error: %s\n  in %s at %s:%d\n  %s\n", msg, func, file, line, stmt);
    exit(1);
}

// real, the fields the launchers the labs call read (NVIDIA's cc as ggml-cuda.cu sets it: 100 major +
// 10 minor; SMs; shared memory a block, with and without opt-in), once
const ggml_cuda_device_info & ggml_cuda_info() {
    static const ggml_cuda_device_info info = [] {
        ggml_cuda_device_info in{};
        LAB_CHECK(cudaGetDeviceCount(&in.device_count));
        in.physical_device_count = in.device_count;
        for (int id = 0; id < in.device_count && id < GGML_CUDA_MAX_DEVICES; id++) {
            cudaDeviceProp prop;
            LAB_CHECK(cudaGetDeviceProperties(&prop, id));
            in.devices[id].cc        = 100 * prop.major + 10 * prop.minor;
            in.devices[id].nsm       = prop.multiProcessorCount;
            in.devices[id].smpb      = prop.sharedMemPerBlock;
            in.devices[id].smpbo     = prop.sharedMemPerBlockOptin;
            in.devices[id].warp_size = prop.warpSize;
        }
        return in;
    }();
    return info;
}

void ggml_cuda_set_device(int) {
    lab_unreachable("ggml_cuda_set_device");
}

// real: ggml_cuda_kernel_launch asks it (PDL) before every launch through the launchers the labs call
int ggml_cuda_get_device() {
    int id = 0;
    LAB_CHECK(cudaGetDevice(&id));
    return id;
}

void ggml_abort(const char * file, int, const char *, ...) {
    lab_unreachable(file);
}

bool ggml_are_same_stride(const struct ggml_tensor *, const struct ggml_tensor *) {
    lab_unreachable("ggml_are_same_stride");
}

int64_t ggml_nelements(const struct ggml_tensor *) {
    lab_unreachable("ggml_nelements");
}

int64_t ggml_nrows(const struct ggml_tensor *) {
    lab_unreachable("ggml_nrows");
}

bool ggml_is_contiguous(const struct ggml_tensor *) {
    lab_unreachable("ggml_is_contiguous");
}

bool ggml_are_same_shape(const struct ggml_tensor *, const struct ggml_tensor *) {
    lab_unreachable("ggml_are_same_shape");
}

enum ggml_glu_op ggml_get_glu_op(const struct ggml_tensor *) {
    lab_unreachable("ggml_get_glu_op");
}

size_t ggml_type_size(enum ggml_type) {
    lab_unreachable("ggml_type_size");
}

// a setting out of range is reported as the library would
void ggml_log_internal(enum ggml_log_level, const char * format, ...) {
    va_list args;
    va_start(args, format);
    vfprintf(stderr, format, args);
    va_end(args);
}
#endif

#ifdef LAB_MMV
// LAB_MMV, the labs that include mc-mmv.cu (mmr_lab.cu, pstep_lab.cu): the rest of its launchers' host
// dependencies, never called by a lab, and the random weights and activations both labs fill
void quantize_row_q8_1_cuda(const float *, const int32_t *, void *, ggml_type, int64_t, int64_t, int64_t, int64_t,
                            int64_t, int64_t, int64_t, int64_t, cudaStream_t) {
    lab_unreachable("quantize_row_q8_1_cuda");
}
const block_q8_1 * ggml_cuda_mc_preq_take(const ggml_backend_cuda_context &, const ggml_tensor *) {
    lab_unreachable("ggml_cuda_mc_preq_take");  // patch 0052 (MC_PREQ): only a graph has pre-quantized blocks
}
const half * ggml_cuda_mc_preh_take(const ggml_backend_cuda_context &, const ggml_tensor *) {
    return nullptr;  // patch 0065 (MC_PREH): only a graph's norms write the f16 form; the labs convert
}
std::unique_ptr<ggml_cuda_pool> ggml_backend_cuda_context::new_pool_for_device(int, int) {
    lab_unreachable("new_pool_for_device");
}
ggml_backend_buffer_type_t ggml_backend_buffer_get_type(ggml_backend_buffer_t) {
    lab_unreachable("ggml_backend_buffer_get_type");
}
enum ggml_backend_buffer_usage ggml_backend_buffer_get_usage(ggml_backend_buffer_t) {
    lab_unreachable("ggml_backend_buffer_get_usage");
}
ggml_backend_buffer_type_t ggml_backend_cuda_buffer_type(int) {
    lab_unreachable("ggml_backend_cuda_buffer_type");
}
int ggml_graph_n_nodes(struct ggml_cgraph *) {
    lab_unreachable("ggml_graph_n_nodes");
}
struct ggml_tensor * ggml_graph_node(struct ggml_cgraph *, int) {
    lab_unreachable("ggml_graph_node");
}
bool ggml_is_empty(const struct ggml_tensor *) {
    lab_unreachable("ggml_is_empty");
}
size_t ggml_nbytes(const struct ggml_tensor *) {
    lab_unreachable("ggml_nbytes");
}
size_t ggml_row_size(enum ggml_type, int64_t) {
    lab_unreachable("ggml_row_size");
}

// random Q4_0 blocks: quants from a hash, scales small positive f16 (finite sums)
static __global__ void lab_fill_q4_0(block_q4_0 * w, const int64_t nblocks, const uint32_t seed) {
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= nblocks) {
        return;
    }
    uint32_t h = (uint32_t) i * 2654435761u ^ seed;
    w[i].d     = __float2half(0.001f + (float) (h % 1000) * 1e-5f);
#pragma unroll
    for (int j = 0; j < QK4_0 / 2; j++) {
        h           = h * 1664525u + 1013904223u;
        w[i].qs[j]  = (uint8_t) (h >> 24);
    }
}

static __global__ void lab_fill_f32(float * x, const int64_t n, const uint32_t seed) {
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const uint32_t h = ((uint32_t) i * 2246822519u) ^ seed;
        x[i]             = (float) (h % 2001) / 1000.0f - 1.0f;
    }
}

// one column of f32 activations to q8_1 (a warp a block of 32: d = max |x| / 127, s = d * sum of q)
static __global__ void lab_quantize_q8_1(const float * x, block_q8_1 * y, const int nblocks) {
    const int b    = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (b >= nblocks) {
        return;
    }
    const float v   = x[b * QK8_1 + lane];
    float       amax = fabsf(v);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, o));
    }
    const float d = amax / 127.0f;
    const int   q = amax == 0.0f ? 0 : (int) roundf(v / d);
    int         sum = q;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        sum += __shfl_xor_sync(0xffffffff, sum, o);
    }
    y[b].qs[lane] = (int8_t) q;
    if (lane == 0) {
        y[b].ds = make_half2(__float2half(d), __float2half(d * (float) sum));
    }
}
#endif
