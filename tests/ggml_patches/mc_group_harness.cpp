// MegaCapybara test harness: mc_group_reorder (ggml-cuda/mc-group.h) on a CPU graph shaped like a
// Gated DeltaNet layer's input projections and an attention layer's q / k / v
#include "ggml.h"
#include "ggml-cpu.h"
#include "mc-group.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

static std::mt19937 rng(1234);

static ggml_tensor * weight(ggml_context * ctx, ggml_type type, int k, int rows, const char * name) {
    ggml_tensor * w = ggml_new_tensor_2d(ctx, type, k, rows);
    std::vector<float> f((size_t) k * rows);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (float & v : f) {
        v = u(rng);
    }
    if (type == GGML_TYPE_F32) {
        memcpy(w->data, f.data(), f.size() * sizeof(float));
    } else {
        ggml_quantize_chunk(type, f.data(), w->data, 0, rows, k, nullptr);
    }
    ggml_set_name(w, name);
    return w;
}

static ggml_tensor * input(ggml_context * ctx, int k, int n, const char * name) {
    ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, n);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (int64_t i = 0; i < ggml_nelements(x); ++i) {
        ((float *) x->data)[i] = u(rng);
    }
    ggml_set_name(x, name);
    return x;
}

int main(int argc, char ** argv) {
    const int n = argc > 1 ? atoi(argv[1]) : 2;  // columns (tokens); more than 16: nothing may move
    const int K = 512;
    ggml_init_params ip = { (size_t) 256 << 20, nullptr, false };
    ggml_context * ctx = ggml_init(ip);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    std::vector<ggml_tensor *> outs;
    auto out = [&](ggml_tensor * t, const char * name) {
        ggml_set_name(t, name);
        ggml_set_output(t);
        ggml_build_forward_expand(gf, t);
        outs.push_back(t);
    };

    // a Gated DeltaNet layer's input X feeds qkv, alpha, beta and z with other nodes between them
    ggml_tensor * X = ggml_rms_norm(ctx, input(ctx, K, n, "x"), 1e-6f);
    ggml_set_name(X, "X");
    out(ggml_silu(ctx, ggml_mul_mat(ctx, weight(ctx, GGML_TYPE_Q4_0, K, 256, "w_qkv"), X)), "qkv_silu");
    ggml_set_name(gf->nodes[gf->n_nodes - 2], "qkv");
    ggml_tensor * alpha = ggml_mul_mat(ctx, weight(ctx, GGML_TYPE_Q4_0, K, 48, "w_alpha"), X);
    ggml_set_name(alpha, "alpha");
    out(ggml_softplus(ctx, alpha), "alpha_sp");
    ggml_tensor * fw = ggml_mul_mat(ctx, weight(ctx, GGML_TYPE_F32, K, 64, "w_f32"), X);  // not Q4_0: stays
    ggml_set_name(fw, "f32_product");
    out(ggml_sigmoid(ctx, fw), "f32_sig");
    ggml_tensor * beta = ggml_mul_mat(ctx, weight(ctx, GGML_TYPE_Q4_0, K, 48, "w_beta"), X);
    ggml_set_name(beta, "beta");
    out(ggml_sigmoid(ctx, beta), "beta_sig");
    // X changed in place: a product after it reads the new values and must stay after it (the group
    // above has room for a fourth product)
    ggml_tensor * X2 = ggml_scale_inplace(ctx, X, 2.0f);
    ggml_set_name(X2, "X_scaled");
    ggml_build_forward_expand(gf, X2);
    ggml_tensor * late = ggml_mul_mat(ctx, weight(ctx, GGML_TYPE_Q4_0, K, 64, "w_late"), X);
    ggml_set_name(late, "late");
    ggml_build_forward_expand(gf, late);
    outs.push_back(late);
    ggml_set_output(late);

    // attention: q (then its norm), v, k on one input Y
    ggml_tensor * Y = ggml_rms_norm(ctx, input(ctx, K, n, "y"), 1e-6f);
    ggml_set_name(Y, "Y");
    ggml_tensor * q = ggml_mul_mat(ctx, weight(ctx, GGML_TYPE_Q4_0, K, 512, "w_q"), Y);
    ggml_set_name(q, "q");
    out(ggml_rms_norm(ctx, q, 1e-6f), "q_norm");
    ggml_tensor * v = ggml_mul_mat(ctx, weight(ctx, GGML_TYPE_Q4_0, K, 64, "w_v"), Y);
    ggml_set_name(v, "v");
    out(ggml_scale(ctx, v, 0.5f), "v_scaled");
    ggml_tensor * k = ggml_mul_mat(ctx, weight(ctx, GGML_TYPE_Q4_0, K, 64, "w_k"), Y);
    ggml_set_name(k, "k");
    out(ggml_rms_norm(ctx, k, 1e-6f), "k_norm");

    auto order = [&] {
        std::string s;
        for (int i = 0; i < gf->n_nodes; ++i) {
            s += std::string(i ? " " : "") + ggml_get_name(gf->nodes[i]);
        }
        return s;
    };
    auto compute = [&] {
        std::vector<std::vector<float>> r;
        ggml_graph_compute_with_ctx(ctx, gf, 1);
        for (ggml_tensor * t : outs) {
            r.emplace_back((float *) t->data, (float *) t->data + ggml_nelements(t));
        }
        return r;
    };
    printf("before: %s\n", order().c_str());
    const auto r0    = compute();
    const int  moved = mc_group_reorder(gf, 16, 16);
    printf("after: %s\n", order().c_str());
    printf("moved: %d\n", moved);
    const auto r1 = compute();
    size_t differ = 0;
    for (size_t i = 0; i < r0.size(); ++i) {
        differ += memcmp(r0[i].data(), r1[i].data(), r0[i].size() * sizeof(float)) != 0;
    }
    printf("outputs: %zu differ: %zu\n", r0.size(), differ);
    ggml_free(ctx);
    return 0;
}
