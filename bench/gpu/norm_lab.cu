// Norm lab: patches 0024 (MC_FUSE_NORM_Q8) and 0025 (MC_FUSE_GATED_NORM) checked and timed on the GPU
// without building llama.cpp: the patched tree's norm.cu, quantize.cu and unary.cu included as they are,
// their kernels launched directly at the 27B's decode shapes.
//   add:   the fused add + norm + weight kernel over a 5,120 row, then quantize_q8_1 on its output (the
//          default path: two launches), against the same kernel writing the q8_1 blocks itself (one)
//   gated: a Gated DeltaNet layer's gated norm over 48 heads of 128 (x a strided view, as the model's):
//          the cached norm, the fused SiLU-multiply and quantize_q8_1 (three launches), against
//          mc_gated_norm_f32 writing its output and the q8_1 blocks (one)
// Each pair's outputs must be equal bit for bit (the fused kernels claim the arithmetic of the ones
// they replace). Timing: a step's launches back to back (128 add norms, 48 gated norms), no PDL, no
// CUDA graph; the launch count is what the fusions remove. Output: one JSON object a line.
// Usage: norm_lab REPEATS
#include "norm.cu"
#include "quantize.cu"
#include "unary.cu"
#define LAB_GGML_STUBS
#include "lab_common.cuh"

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

// the rest of the launchers' host dependencies (the common ones in lab_common.cuh), never called by
// the lab: it launches the kernels itself
bool ggml_are_same_shape(const struct ggml_tensor *, const struct ggml_tensor *) {
    lab_unreachable("ggml_are_same_shape");
}
size_t ggml_element_size(const struct ggml_tensor *) {
    lab_unreachable("ggml_element_size");
}
enum ggml_unary_op ggml_get_unary_op(const struct ggml_tensor *) {
    lab_unreachable("ggml_get_unary_op");
}
bool ggml_is_contiguous_1(const struct ggml_tensor *) {
    lab_unreachable("ggml_is_contiguous_1");
}

static constexpr int   LAB_N = 5120, LAB_HEADS = 48, LAB_HD = 128, LAB_XS = 160;  // x rows 160 apart
static constexpr float LAB_EPS = 1e-6f;

static float * upload(const std::vector<float> & h) {
    float * d;
    LAB_CHECK(cudaMalloc(&d, h.size() * sizeof(float)));
    LAB_CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice));
    return d;
}

template <typename T> static T * dalloc(size_t bytes) {
    void * d;
    LAB_CHECK(cudaMalloc(&d, bytes));
    return (T *) d;
}


// quantize_q8_1 over one column of n values (its own launcher's grid)
static void quantize(const float * x, block_q8_1 * y, const int n) {
    const dim3 grid((n + CUDA_QUANTIZE_BLOCK_SIZE - 1) / CUDA_QUANTIZE_BLOCK_SIZE, 1, 1);
    quantize_q8_1<<<grid, CUDA_QUANTIZE_BLOCK_SIZE>>>(x, y, n, n, n, n, n, 1, init_fastdiv_values(1));
}

// the byte-for-byte comparison of two device buffers
static bool same(const void * a, const void * b, size_t bytes) {
    const std::vector<char> ha = lab_fetch<char>(a, bytes), hb = lab_fetch<char>(b, bytes);
    return memcmp(ha.data(), hb.data(), bytes) == 0;
}

template <typename F> static double time_ms(F && step, const int repeats) {
    cudaEvent_t e0, e1;
    LAB_CHECK(cudaEventCreate(&e0));
    LAB_CHECK(cudaEventCreate(&e1));
    for (int r = 0; r < 3; r++) {
        step();
    }
    LAB_CHECK(cudaEventRecord(e0));
    for (int r = 0; r < repeats; r++) {
        step();
    }
    LAB_CHECK(cudaEventRecord(e1));
    LAB_CHECK(cudaEventSynchronize(e1));
    LAB_CHECK(cudaGetLastError());
    float ms = 0.0f;
    LAB_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    return ms / repeats;
}

int main(int argc, char ** argv) {
    const int repeats = argc == 2 ? atoi(argv[1]) : 0;
    if (repeats < 1) {
        fprintf(stderr, "usage: norm_lab REPEATS (REPEATS >= 1)\n");
        return 2;
    }
    std::mt19937                    rng(24);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    auto                            randn = [&](size_t n, float s) {
        std::vector<float> v(n);
        for (float & x : v) {
            x = s * nd(rng);
        }
        return v;
    };

    // ---- add: ADD -> RMS_NORM -> MUL over one 5,120 row, then its q8_1 form ----
    {
        float *      a = upload(randn(LAB_N, 1.0f)), *b = upload(randn(LAB_N, 1.0f)), *w = upload(randn(LAB_N, 0.5f));
        const size_t fb = LAB_N * sizeof(float), qb = LAB_N / QK8_1 * sizeof(block_q8_1);
        float *      sum0 = dalloc<float>(fb), *sum1 = dalloc<float>(fb), *y0 = dalloc<float>(fb), *y1 = dalloc<float>(fb);
        block_q8_1 * q0 = dalloc<block_q8_1>(qb), *q1 = dalloc<block_q8_1>(qb);
        const size_t smem    = 32 * sizeof(float);
        auto         two     = [&] {
            mc_add_rms_norm_mul_f32<1024><<<1, 1024, smem>>>(a, b, sum0, w, y0, LAB_N, LAB_EPS, nullptr);
            quantize(y0, q0, LAB_N);
        };
        auto one = [&] { mc_add_rms_norm_mul_f32<1024><<<1, 1024, smem>>>(a, b, sum1, w, y1, LAB_N, LAB_EPS, q1); };
        two();
        one();
        LAB_CHECK(cudaDeviceSynchronize());
        const bool   equal = same(sum0, sum1, fb) && same(y0, y1, fb) && same(q0, q1, qb);
        const double t2 = time_ms([&] { for (int l = 0; l < 128; l++) { two(); } }, repeats);
        const double t1 = time_ms([&] { for (int l = 0; l < 128; l++) { one(); } }, repeats);
        printf("{\"case\": \"add\", \"launches\": 128, \"separate_ms\": %.4f, \"fused_ms\": %.4f, \"bit_identical\": %s}\n",
               t2, t1, equal ? "true" : "false");
        fflush(stdout);
    }

    // ---- gated: RMS_NORM(x) * w times SILU(z) over 48 heads of 128, then its q8_1 form ----
    {
        const int    n  = LAB_HEADS * LAB_HD;
        float *      xs = upload(randn((size_t) LAB_HEADS * LAB_XS, 1.0f)), *z = upload(randn(n, 2.0f));
        float *      w  = upload(randn(LAB_HD, 0.5f));
        const size_t fb = n * sizeof(float), qb = n / QK8_1 * sizeof(block_q8_1);
        float *      yn = dalloc<float>(fb), *g0 = dalloc<float>(fb), *g1 = dalloc<float>(fb);
        block_q8_1 * q0 = dalloc<block_q8_1>(qb), *q1 = dalloc<block_q8_1>(qb);
        const uint3 one_packed = init_fastdiv_values(1);
        auto        three      = [&] {
            // the default path: the cached norm times w (norm.cu's launcher: 256 threads, 128 columns)
            rms_norm_f32<256, true, false, false, true><<<dim3(LAB_HEADS, 1, 1), 256, 32 * sizeof(float)>>>(
                xs, yn, LAB_HD, LAB_XS, (int64_t) LAB_HEADS * LAB_XS, (int64_t) LAB_HEADS * LAB_XS, LAB_EPS, w, 0, 0,
                0, init_fastdiv_values(LAB_HD), one_packed, one_packed, one_packed, nullptr, 0, 0, 0,
                make_uint3(0, 0, 0), make_uint3(0, 0, 0), make_uint3(0, 0, 0), make_uint3(0, 0, 0), 1.0f);
            // then silu(z) * that (unary.cu's fused SiLU-multiply), then quantize_q8_1
            unary_gated_op_kernel<op_silu, float><<<(n + CUDA_GLU_BLOCK_SIZE - 1) / CUDA_GLU_BLOCK_SIZE,
                                                    CUDA_GLU_BLOCK_SIZE>>>(z, yn, g0, n, LAB_HD, LAB_HD, LAB_HD);
            quantize(g0, q0, n);
        };
        auto fused = [&] {
            mc_gated_norm_f32<<<LAB_HEADS / 4, 4 * WARP_SIZE>>>(xs, w, z, g1, LAB_HEADS, LAB_XS, LAB_HD, LAB_EPS, q1);
        };
        three();
        fused();
        LAB_CHECK(cudaDeviceSynchronize());
        const bool   equal = same(g0, g1, fb) && same(q0, q1, qb);
        const double t3 = time_ms([&] { for (int l = 0; l < 48; l++) { three(); } }, repeats);
        const double t1 = time_ms([&] { for (int l = 0; l < 48; l++) { fused(); } }, repeats);
        printf("{\"case\": \"gated\", \"launches\": 48, \"separate_ms\": %.4f, \"fused_ms\": %.4f, \"bit_identical\": %s}\n",
               t3, t1, equal ? "true" : "false");
        fflush(stdout);
    }
    return 0;
}
