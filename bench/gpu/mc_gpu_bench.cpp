// Steady-state timings of one llama.cpp build on one GPU, for bench/gpu/side_by_side.sh.
// Built against the libllama of the build under test (stock or patched), so both builds run the
// same measuring code.
//
//   mc_gpu_bench tg      MODEL DEPTHS N          single-stream decode at each depth (tokens before);
//                                                call_ms: the part of a step until llama_decode returns
//   mc_gpu_bench verify  MODEL DEPTH SEQS SIZES  one decode of SEQS sequences x k tokens, all logits
//                                                (MC_BENCH_LOGITS=last: each sequence's last token's
//                                                only, to see what the other rows' logits cost)
//   mc_gpu_bench profile MODEL DEPTH STEPS [K] [SEQS]  STEPS decodes of K tokens (default 1; K > 1:
//                                                all logits, a verify step) for each of SEQS sequences
//                                                (default 1) inside a profiler range
//                                                (cudaProfilerStart/Stop; run under ncu
//                                                --profile-from-start off)
//   mc_gpu_bench logits  MODEL OUT.bin           fixed tokens, teacher-forced: the logits of a 64-token
//                                                prefill's last token, of 8 single-token steps and of
//                                                one 16-token step (all rows), then of 12 sequences
//                                                (32-token prompts, 6 steps), float32 rows to OUT.bin
//
// DEPTHS and SIZES are comma lists. Every timed decode ends with llama_synchronize (llama_decode
// returns before the GPU is done), after warm-up decodes of the same shape. Output: one JSON object
// per line on stdout ("kind" names the measurement); logs go to stderr.
#include "llama.h"

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

namespace {

// warnings, and the patches' one-line notices of what a setting did ("MC_FUSE_CONV_STEP: ...")
void quiet_log(ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_WARN || strncmp(text, "MC_", 3) == 0) {
        fputs(text, stderr);
    }
}

std::vector<int> parse_list(const char * s) {
    std::vector<int> out;
    std::stringstream ss(s);
    std::string t;
    while (std::getline(ss, t, ',')) {
        if (!t.empty()) {
            out.push_back(atoi(t.c_str()));
        }
    }
    return out;
}

double median(std::vector<double> v) {
    if (v.empty()) {
        return 0.0;
    }
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double now_ms() {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Bench {
    llama_model *   model = nullptr;
    llama_context * ctx   = nullptr;
    llama_batch     batch{};
    int             n_vocab = 0;
    unsigned        rng     = 42;

    Bench(const char * path, int n_ctx, int n_seq, int n_batch_max) {
        llama_log_set(quiet_log, nullptr);
        llama_backend_init();
        auto mp         = llama_model_default_params();
        mp.n_gpu_layers = 999;
        model           = llama_model_load_from_file(path, mp);
        if (!model) {
            fprintf(stderr, "mc_gpu_bench: cannot load %s\n", path);
            exit(1);
        }
        auto cp            = llama_context_default_params();
        cp.n_ctx           = n_ctx;
        cp.n_batch         = std::max(2048, n_batch_max);
        cp.n_ubatch        = 512;
        cp.n_seq_max       = n_seq;
        cp.kv_unified      = true;
        cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
        const char * kv    = getenv("MC_KV_TYPE");  // f16 (default) or q8_0
        if (kv && strcmp(kv, "q8_0") == 0) {
            cp.type_k = GGML_TYPE_Q8_0;
            cp.type_v = GGML_TYPE_Q8_0;
        }
        ctx = llama_init_from_model(model, cp);
        if (!ctx) {
            fprintf(stderr, "mc_gpu_bench: cannot create a context of %d tokens\n", n_ctx);
            exit(1);
        }
        n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
        batch   = llama_batch_init(std::max(2048, n_batch_max), 0, n_seq);
    }

    ~Bench() {
        llama_batch_free(batch);
        llama_free(ctx);
        llama_model_free(model);
        llama_backend_free();
    }

    int token() {
        rng = rng * 1664525u + 1013904223u;
        return (int) ((rng >> 8) % (unsigned) n_vocab);
    }

    // n tokens for each of seqs sequences at positions pos0.., logits for all or for each sequence's last
    void fill(int seqs, int n, int pos0, bool all_logits) {
        batch.n_tokens = 0;
        for (int s = 0; s < seqs; s++) {
            for (int i = 0; i < n; i++) {
                const int j       = batch.n_tokens++;
                batch.token[j]    = token();
                batch.pos[j]      = pos0 + i;
                batch.n_seq_id[j] = 1;
                batch.seq_id[j][0] = s;
                batch.logits[j]   = all_logits || i == n - 1;
            }
        }
    }

    void decode() {
        if (llama_decode(ctx, batch) != 0) {
            fprintf(stderr, "mc_gpu_bench: llama_decode failed (%d tokens)\n", batch.n_tokens);
            exit(1);
        }
    }

    // prefill depth tokens into sequences 0..seqs-1 (the first is prefilled, the others copy it)
    void prefill(int depth, int seqs) {
        llama_memory_clear(llama_get_memory(ctx), true);
        for (int pos = 0; pos < depth;) {
            const int n = std::min(2048, depth - pos);
            fill(1, n, pos, false);
            decode();
            pos += n;
        }
        for (int s = 1; s < seqs && depth > 0; s++) {
            llama_memory_seq_cp(llama_get_memory(ctx), 0, s, -1, -1);
        }
        llama_synchronize(ctx);
    }

    // median ms of `iters` decodes of seqs x n tokens after `warm` untimed ones; positions advance.
    // call_ms (if given): the median ms until llama_decode returned, before the synchronize: the host's
    // side of a step up to its graph's launch (the rest of the step is the GPU's, then the hand-over)
    double time_steps(int seqs, int n, int & pos, bool all_logits, int warm, int iters, double * call_ms = nullptr) {
        std::vector<double> ts, cs;
        for (int it = 0; it < warm + iters; it++) {
            fill(seqs, n, pos, all_logits);
            const double t0 = now_ms();
            decode();
            const double tc = now_ms();
            llama_synchronize(ctx);
            const double t1 = now_ms();
            pos += n;
            if (it >= warm) {
                ts.push_back(t1 - t0);
                cs.push_back(tc - t0);
            }
        }
        if (call_ms) {
            *call_ms = median(cs);
        }
        return median(ts);
    }
};

int cmd_tg(int argc, char ** argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: mc_gpu_bench tg MODEL DEPTHS N\n");
        return 2;
    }
    const auto depths = parse_list(argv[3]);
    const int  n      = atoi(argv[4]);
    const int  maxd   = *std::max_element(depths.begin(), depths.end());
    Bench      b(argv[2], maxd + n + 64, 1, 1);
    for (int d : depths) {
        b.prefill(d, 1);
        int          pos = d;
        double       call = 0.0;
        const double ms   = b.time_steps(1, 1, pos, false, 8, n, &call);
        printf("{\"kind\": \"tg\", \"depth\": %d, \"n\": %d, \"median_ms\": %.4f, \"tok_s\": %.2f, \"call_ms\": %.4f}\n",
               d, n, ms, 1000.0 / ms, call);
        fflush(stdout);
    }
    return 0;
}

int cmd_verify(int argc, char ** argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: mc_gpu_bench verify MODEL DEPTH SEQS SIZES\n");
        return 2;
    }
    const int  depth = atoi(argv[3]);
    const int  seqs  = atoi(argv[4]);
    const auto sizes = parse_list(argv[5]);
    const int  maxn  = *std::max_element(sizes.begin(), sizes.end());
    const int  iters = 20;
    const int  warm  = 3;
    const char * which = getenv("MC_BENCH_LOGITS");  // all (default) or last
    if (which && strcmp(which, "all") != 0 && strcmp(which, "last") != 0) {
        fprintf(stderr, "MC_BENCH_LOGITS=%s: expected all or last\n", which);
        return 2;
    }
    const bool all = !(which && strcmp(which, "last") == 0);
    // every size starts again from the prefilled depth, so the context holds depth + one size's steps
    Bench b(argv[2], (depth + (warm + iters) * maxn + 64) * seqs, seqs, seqs * maxn);
    for (int k : sizes) {
        b.prefill(depth, seqs);
        int          pos = depth;
        const double ms  = b.time_steps(seqs, k, pos, all, warm, iters);
        printf("{\"kind\": \"verify\", \"depth\": %d, \"seqs\": %d, \"k\": %d, \"logits\": \"%s\", \"median_ms\": %.4f}\n",
               depth, seqs, k, all ? "all" : "last", ms);
        fflush(stdout);
    }
    return 0;
}

int cmd_profile(int argc, char ** argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: mc_gpu_bench profile MODEL DEPTH STEPS [K] [SEQS]\n");
        return 2;
    }
    const int depth = atoi(argv[3]);
    const int steps = atoi(argv[4]);
    const int k     = argc > 5 ? std::max(1, atoi(argv[5])) : 1;
    const int seqs  = argc > 6 ? std::max(1, atoi(argv[6])) : 1;
    Bench     b(argv[2], (depth + (steps + 8) * k + 64) * seqs, seqs, seqs * k);
    b.prefill(depth, seqs);
    int pos = depth;
    b.time_steps(seqs, k, pos, k > 1, 8, 0);  // warm-up: the CUDA graph is captured by now
    // the CUDA runtime is already loaded by the backend: take its profiler switches from there
    using fn_t  = int (*)();
    void * rt   = dlopen("libcudart.so", RTLD_NOW | RTLD_NOLOAD);
    for (const char * name : { "libcudart.so.13", "libcudart.so.12" }) {
        if (!rt) {
            rt = dlopen(name, RTLD_NOW | RTLD_NOLOAD);
        }
    }
    fn_t start = rt ? (fn_t) dlsym(rt, "cudaProfilerStart") : nullptr;
    fn_t stop  = rt ? (fn_t) dlsym(rt, "cudaProfilerStop") : nullptr;
    if (!start || !stop) {
        fprintf(stderr, "mc_gpu_bench: the CUDA runtime is not loaded; profiling the whole run\n");
    }
    if (start) {
        start();
    }
    const double ms = b.time_steps(seqs, k, pos, k > 1, 0, steps);
    if (stop) {
        stop();
    }
    printf("{\"kind\": \"profile\", \"depth\": %d, \"steps\": %d, \"k\": %d, \"seqs\": %d, \"median_ms\": %.4f}\n",
           depth, steps, k, seqs, ms);
    return 0;
}

int cmd_logits(int argc, char ** argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: mc_gpu_bench logits MODEL OUT.bin\n");
        return 2;
    }
    const int seqs = 12;  // the second part: 12 sequences decoded together
    Bench     b(argv[2], 1024, seqs, seqs * 32);
    FILE * f = fopen(argv[3], "wb");
    if (!f) {
        fprintf(stderr, "mc_gpu_bench: cannot write %s\n", argv[3]);
        return 1;
    }
    auto dump = [&](int rows) {
        llama_synchronize(b.ctx);
        for (int i = rows; i > 0; i--) {
            fwrite(llama_get_logits_ith(b.ctx, -i), sizeof(float), b.n_vocab, f);
        }
    };
    b.prefill(0, 1);
    b.fill(1, 64, 0, false);
    b.decode();
    dump(1);
    int pos = 64;
    for (int i = 0; i < 8; i++, pos++) {
        b.fill(1, 1, pos, true);
        b.decode();
        dump(1);
    }
    b.fill(1, 16, pos, true);
    b.decode();
    dump(16);
    // 12 sequences: a 32-token prompt each in one batch (fresh recurrent states), then 6 steps of one
    // token each (the states read and written in the cache: patch 0006), every sequence's logits
    b.prefill(0, 1);
    b.fill(seqs, 32, 0, false);
    b.decode();
    dump(seqs);
    for (int i = 0; i < 6; i++) {
        b.fill(seqs, 1, 32 + i, true);
        b.decode();
        dump(seqs);
    }
    fclose(f);
    printf("{\"kind\": \"logits\", \"rows\": %d, \"n_vocab\": %d, \"path\": \"%s\"}\n", 25 + 7 * seqs,
           b.n_vocab, argv[3]);
    return 0;
}

}  // namespace

int main(int argc, char ** argv) {
    const std::string cmd = argc > 1 ? argv[1] : "";
    if (cmd == "tg") {
        return cmd_tg(argc, argv);
    }
    if (cmd == "verify") {
        return cmd_verify(argc, argv);
    }
    if (cmd == "profile") {
        return cmd_profile(argc, argv);
    }
    if (cmd == "logits") {
        return cmd_logits(argc, argv);
    }
    fprintf(stderr, "usage: mc_gpu_bench tg|verify|profile|logits MODEL ...\n");
    return 2;
}
