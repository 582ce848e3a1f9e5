// GDN lab: the Gated DeltaNet recurrence's kernels of the patched tree (gated_delta_net.cu, included
// as it is) launched directly at the 27B's shapes, without building llama.cpp: 48 heads of 128, q / k
// on 16 heads, the scalar gate, q and k normalised in the kernel (MC_FUSE_GDN_L2, the 27B's path),
// one sequence, 1 or more tokens. A step's 48 launches (one a layer, each layer's own state in and out,
// 3 MB each way, as in the model) timed by events; each kernel's outputs (attention and the final
// state) against the wide kernel's (the default at 2+ tokens) or the stock one's (at one token), and
// against the recurrence computed in double on the host (null in the JSON: a value that is not finite).
// Variants: stock (patch 0017's CH = 0), staged (CH = 16, MC_GDN_STAGE), wide (MC_GDN_WIDE, the default
// at 2+ tokens), and at 2+ tokens wide2 / wide4 (MC_GDN_COLS=2 / 4, patch 0073: 2 or 4 columns a lane).
// Output: one JSON object a line.
// Usage: gdn_lab REPEATS TOKENS [TOKENS ...] (bench/gpu/gdn_lab.py compiles it against a patched tree;
// the host functions the op's launcher names are stubs here that stop the program: none of them runs)
#include "gated_delta_net.cu"
#define LAB_GGML_STUBS
#include "lab_common.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

// the rest of the launcher's host dependencies (the common ones in lab_common.cuh)
int ggml_cuda_mc_env_int(const char * name, int, int, int) {
    lab_unreachable(name);
}
bool ggml_is_contiguous_rows(const struct ggml_tensor *) {
    lab_unreachable("ggml_is_contiguous_rows");
}


static constexpr int LAB_SV = 128, LAB_H = 48, LAB_HK = 16, LAB_LAYERS = 48;
static constexpr int LAB_ROW = 2 * LAB_HK * LAB_SV + LAB_H * LAB_SV;  // q, k, v of a token: 10,240 floats
// the model's L2 normalisation (unit q and k): RMS_NORM(eps), then SCALE(1 / sqrt(128)); with unit keys
// and beta < 1 the recurrence stays bounded over any number of tokens
static const float LAB_EPS = 1e-6f, LAB_L2S = 1.0f / sqrtf((float) LAB_SV);

struct lab_bufs {
    float *              qkv, *g, *beta, *out;
    std::vector<float *> s_in, s_out;  // a layer's state in and out
};

static void launch(const std::string & variant, const lab_bufs & b, int layer, int n) {
    const int64_t sq1 = LAB_SV, sq2 = LAB_ROW, sq3 = (int64_t) LAB_ROW * n;
    const int64_t sb1 = 1, sb2 = LAB_H, sb3 = (int64_t) LAB_H * n;
    const uint3   neqk1 = init_fastdiv_values(LAB_HK), rq3 = init_fastdiv_values(1);
    const float   scale = 1.0f / sqrtf((float) LAB_SV), eps = LAB_EPS, l2s = LAB_L2S;
    const float * q = b.qkv, *k = b.qkv + LAB_HK * LAB_SV, *v = b.qkv + 2 * LAB_HK * LAB_SV;
    const int64_t slot = (int64_t) LAB_SV * LAB_SV * LAB_H;
    const int     ch   = n < MC_GDN_CHUNK ? n : MC_GDN_CHUNK;
    const dim3    block(32, 4);
    if (variant == "stock" || variant == "staged") {
        const bool   staged = variant == "staged";
        const size_t smem   = staged ? sizeof(float) * mc_gdn_stage_floats(LAB_SV, false, ch, 4) : 0;
        auto kernel = staged ? gated_delta_net_cuda<LAB_SV, false, false, MC_GDN_CHUNK, true> :
                               gated_delta_net_cuda<LAB_SV, false, false, 0, true>;
        kernel<<<dim3(LAB_H, 1, LAB_SV / 4), block, smem>>>(q, k, v, b.g, b.beta, b.s_in[layer], b.out,
                                                             b.s_out[layer], LAB_H, n, 1, sq1, sq2, sq3, sq1, sq2,
                                                             sq3, sb1, sb2, sb3, neqk1, rq3, scale, slot, 1, eps, l2s,
                                                             0);  // no PDL here: patch 0049's trigger off
    } else {  // wide, wide2, wide4: MC_GDN_COLS 1, 2, 4 (patch 0073), blocks as its launcher makes them
        const int  cpl   = variant == "wide4" ? 4 : variant == "wide2" ? 2 : 1;
        const int  warps = cpl == 4 ? 2 : 4;
        const int  ncb   = warps * MC_GDN_WIDE_CPW * cpl;
        const auto kernel = cpl == 4 ? mc_gdn_wide<false, true, 4> : cpl == 2 ? mc_gdn_wide<false, true, 2> :
                                                                                mc_gdn_wide<false, true, 1>;
        const size_t smem = sizeof(float) * mc_gdn_stage_floats(LAB_SV, false, ch, ncb);
        kernel<<<dim3(LAB_H, 1, LAB_SV / ncb), dim3(32, warps), smem>>>(
            q, k, v, b.g, b.beta, b.s_in[layer], b.out, b.s_out[layer], LAB_H, n, 1, sq1, sq2, sq3, sq1, sq2, sq3,
            sb1, sb2, sb3, neqk1, rq3, scale, slot, 1, eps, l2s);
    }
    LAB_CHECK(cudaGetLastError());
}

// the largest |a - b| over the largest |b|; infinite where a holds a value that is not finite
static double rel_diff(const std::vector<float> & a, const std::vector<float> & b) {
    double d = 0.0, m = 0.0;
    for (size_t i = 0; i < a.size(); i++) {
        if (!std::isfinite(a[i])) {
            return INFINITY;
        }
        d = std::max(d, (double) std::fabs(a[i] - b[i]));
        m = std::max(m, (double) std::fabs(b[i]));
    }
    return m > 0.0 ? d / m : d;
}

// a number for the JSON line: null where it is not finite (JSON has no inf / nan)
static std::string jnum(const double x) {
    if (!std::isfinite(x)) {
        return "null";
    }
    char buf[32];
    snprintf(buf, sizeof(buf), "%.3e", x);
    return buf;
}

// the recurrence in double on the host, the formulas of the stock loop, for one layer's state s0
// ([head][col][i]) and n tokens: outputs [token][head][col], the final state ([head][col][i])
static void host_reference(const std::vector<float> & qkv, const std::vector<float> & g,
                           const std::vector<float> & beta, const std::vector<float> & s0, const int n,
                           const float scale, std::vector<float> & out, std::vector<float> & state) {
    out.assign((size_t) n * LAB_H * LAB_SV, 0.0f);
    state.assign(s0.size(), 0.0f);
    std::vector<double> m((size_t) LAB_SV * LAB_SV), qn(LAB_SV), kn(LAB_SV);
    auto normalised = [&](const float * x, std::vector<double> & y) {
        double ssq = 0.0;
        for (int i = 0; i < LAB_SV; i++) {
            ssq += (double) x[i] * x[i];
        }
        const double sc = LAB_L2S / std::sqrt(ssq / LAB_SV + LAB_EPS);
        for (int i = 0; i < LAB_SV; i++) {
            y[i] = sc * x[i];
        }
    };
    for (int h = 0; h < LAB_H; h++) {
        const int hk = h % LAB_HK;
        for (size_t e = 0; e < m.size(); e++) {
            m[e] = s0[(size_t) h * m.size() + e];
        }
        for (int t = 0; t < n; t++) {
            const float * row = qkv.data() + (size_t) t * LAB_ROW;
            normalised(row + hk * LAB_SV, qn);
            normalised(row + (LAB_HK + hk) * LAB_SV, kn);
            const float * v  = row + 2 * LAB_HK * LAB_SV + h * LAB_SV;
            const double  gv = std::exp((double) g[(size_t) t * LAB_H + h]), bt = beta[(size_t) t * LAB_H + h];
            for (int col = 0; col < LAB_SV; col++) {
                double * mc = m.data() + (size_t) col * LAB_SV;
                double   kv = 0.0, o = 0.0;
                for (int i = 0; i < LAB_SV; i++) {
                    kv += mc[i] * kn[i];
                }
                const double delta = (v[col] - gv * kv) * bt;
                for (int i = 0; i < LAB_SV; i++) {
                    mc[i] = gv * mc[i] + kn[i] * delta;
                    o += mc[i] * qn[i];
                }
                out[((size_t) t * LAB_H + h) * LAB_SV + col] = (float) (o * scale);
            }
        }
        for (size_t e = 0; e < m.size(); e++) {
            state[(size_t) h * m.size() + e] = (float) m[e];
        }
    }
}


int main(int argc, char ** argv) {
    const int repeats = argc >= 3 ? atoi(argv[1]) : 0;
    if (repeats < 1) {
        fprintf(stderr, "usage: gdn_lab REPEATS TOKENS [TOKENS ...] (REPEATS >= 1; TOKENS 1..2048)\n");
        return 2;
    }
    std::vector<int> tokens;
    for (int i = 2; i < argc; i++) {
        const int n = atoi(argv[i]);
        if (n < 1 || n > 2048) {
            fprintf(stderr, "TOKENS %s: expected 1..2048\n", argv[i]);
            return 2;
        }
        tokens.push_back(n);
    }
    const int        nmax = *std::max_element(tokens.begin(), tokens.end());
    const size_t     sbytes = sizeof(float) * LAB_SV * LAB_SV * LAB_H;
    lab_bufs         b;
    std::mt19937     rng(7);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> h((size_t) LAB_ROW * nmax);
    for (float & x : h) {
        x = nd(rng);
    }
    LAB_CHECK(cudaMalloc(&b.qkv, h.size() * sizeof(float)));
    LAB_CHECK(cudaMemcpy(b.qkv, h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice));
    std::vector<float> hg((size_t) LAB_H * nmax), hb(hg.size());
    for (size_t i = 0; i < hg.size(); i++) {
        hg[i] = -0.05f - 0.5f * std::fabs(nd(rng));           // log decays (negative)
        hb[i] = 1.0f / (1.0f + std::exp(-nd(rng)));           // beta in (0, 1)
    }
    LAB_CHECK(cudaMalloc(&b.g, hg.size() * sizeof(float)));
    LAB_CHECK(cudaMalloc(&b.beta, hb.size() * sizeof(float)));
    LAB_CHECK(cudaMemcpy(b.g, hg.data(), hg.size() * sizeof(float), cudaMemcpyHostToDevice));
    LAB_CHECK(cudaMemcpy(b.beta, hb.data(), hb.size() * sizeof(float), cudaMemcpyHostToDevice));
    LAB_CHECK(cudaMalloc(&b.out, sizeof(float) * LAB_SV * LAB_H * nmax));
    std::vector<float> hs((size_t) LAB_SV * LAB_SV * LAB_H);
    for (float & x : hs) {
        x = 0.1f * nd(rng);
    }
    for (int l = 0; l < LAB_LAYERS; l++) {
        float *in, *out;
        LAB_CHECK(cudaMalloc(&in, sbytes));
        LAB_CHECK(cudaMalloc(&out, sbytes));
        LAB_CHECK(cudaMemcpy(in, hs.data(), sbytes, cudaMemcpyHostToDevice));
        b.s_in.push_back(in);
        b.s_out.push_back(out);
    }
    cudaEvent_t e0, e1;
    LAB_CHECK(cudaEventCreate(&e0));
    LAB_CHECK(cudaEventCreate(&e1));
    for (const int n : tokens) {
        // the reference first: what the launcher runs by default (stock at one token, wide at more)
        using names = std::vector<std::string>;
        const names variants = n == 1 ? names{ "stock", "staged", "wide" } :
                                        names{ "wide", "staged", "stock", "wide2", "wide4" };
        const size_t       nout = (size_t) LAB_SV * LAB_H * n;
        std::vector<float> ref_out, ref_state, host_out, host_state;
        host_reference(h, hg, hb, hs, n, 1.0f / sqrtf((float) LAB_SV), host_out, host_state);
        for (const std::string & v : variants) {
            launch(v, b, 0, n);  // the outputs of layer 0, against the reference's
            LAB_CHECK(cudaDeviceSynchronize());
            const std::vector<float> o = lab_fetch<float>(b.out, nout), s = lab_fetch<float>(b.s_out[0], hs.size());
            if (ref_out.empty()) {
                ref_out   = o;
                ref_state = s;
            }
            for (int l = 0; l < 3 * LAB_LAYERS; l++) {  // warm up
                launch(v, b, l % LAB_LAYERS, n);
            }
            LAB_CHECK(cudaEventRecord(e0));
            for (int r = 0; r < repeats; r++) {
                for (int l = 0; l < LAB_LAYERS; l++) {
                    launch(v, b, l, n);
                }
            }
            LAB_CHECK(cudaEventRecord(e1));
            LAB_CHECK(cudaEventSynchronize(e1));
            float ms = 0.0f;
            LAB_CHECK(cudaEventElapsedTime(&ms, e0, e1));
            printf("{\"variant\": \"%s\", \"tokens\": %d, \"us\": %.3f, \"step_ms\": %.4f, \"out_rel\": %s, "
                   "\"state_rel\": %s, \"host_out_rel\": %s, \"host_state_rel\": %s}\n",
                   v.c_str(), n, 1000.0 * ms / (repeats * LAB_LAYERS), ms / repeats, jnum(rel_diff(o, ref_out)).c_str(),
                   jnum(rel_diff(s, ref_state)).c_str(), jnum(rel_diff(o, host_out)).c_str(),
                   jnum(rel_diff(s, host_state)).c_str());
            fflush(stdout);
        }
    }
    return 0;
}
