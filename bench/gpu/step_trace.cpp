// MegaCapybara: every kernel a CUDA program runs, with its start and end on the GPU, as CSV, through
// CUPTI's activity records, including the kernels of captured CUDA graphs (node by node) and with
// programmatic dependent launches left as they are (concurrent-kernel records do not serialize).
// Nsight Systems is not on the GPU machine; this is the timeline it would give.
//
// Built as a shared library and loaded by the CUDA driver at the first CUDA call through
// CUDA_INJECTION64_PATH, so the traced program is unchanged (bench/gpu/step_trace.py builds, runs and
// reads it):
//
//   CUDA_INJECTION64_PATH=/tmp/mcs/step_trace.so MC_TRACE_OUT=/tmp/trace.csv prog ...
//
// The CSV's columns: correlation (one per launch call: a graph launch's kernels share it), graph,
// node, start_ns, end_ns, grid (x.y.z), block (x.y.z), cluster (x.y.z), name (mangled, quoted). Records are
// written as CUPTI hands over its buffers and at exit.

#include <cupti.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>

namespace {

FILE *     g_out = nullptr;
std::mutex g_mutex;
size_t     g_records = 0;

constexpr size_t BUFFER_BYTES = 8u << 20;
constexpr size_t ALIGN        = 8;

void check(const CUptiResult r, const char * what) {
    if (r != CUPTI_SUCCESS) {
        const char * msg = nullptr;
        cuptiGetResultString(r, &msg);
        fprintf(stderr, "step_trace: %s failed: %s\n", what, msg ? msg : "?");
        exit(1);
    }
}

void CUPTIAPI buffer_requested(uint8_t ** buffer, size_t * size, size_t * max_records) {
    void * p = nullptr;
    if (posix_memalign(&p, ALIGN, BUFFER_BYTES) != 0) {
        fprintf(stderr, "step_trace: out of host memory for a record buffer\n");
        exit(1);
    }
    *buffer      = (uint8_t *) p;
    *size        = BUFFER_BYTES;
    *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t * buffer, size_t, size_t valid) {
    std::lock_guard<std::mutex> lock(g_mutex);
    CUpti_Activity *            record = nullptr;
    while (valid > 0 && cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
        if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && record->kind != CUPTI_ACTIVITY_KIND_KERNEL) {
            continue;
        }
        const auto * k = (const CUpti_ActivityKernel10 *) record;
        fprintf(g_out, "%u,%u,%llu,%llu,%llu,%d.%d.%d,%d.%d.%d,%u.%u.%u,\"%s\"\n", k->correlationId, k->graphId,
                (unsigned long long) k->graphNodeId, (unsigned long long) k->start, (unsigned long long) k->end,
                k->gridX, k->gridY, k->gridZ, k->blockX, k->blockY, k->blockZ, k->clusterX, k->clusterY,
                k->clusterZ, k->name ? k->name : "?");
        ++g_records;
    }
    size_t dropped = 0;
    cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped);
    if (dropped > 0) {
        fprintf(stderr, "step_trace: %zu records dropped\n", dropped);
    }
    free(buffer);
}

void finish() {
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_out != nullptr) {
        fclose(g_out);
        g_out = nullptr;
        fprintf(stderr, "step_trace: %zu kernel records\n", g_records);
    }
}

}  // namespace

extern "C" int InitializeInjection(void) {
    const char * path = getenv("MC_TRACE_OUT");
    if (path == nullptr || *path == '\0') {
        fprintf(stderr, "step_trace: MC_TRACE_OUT (the CSV to write) is not set\n");
        return 0;
    }
    g_out = fopen(path, "w");
    if (g_out == nullptr) {
        fprintf(stderr, "step_trace: cannot write %s\n", path);
        return 0;
    }
    fprintf(g_out, "correlation,graph,node,start_ns,end_ns,grid,block,cluster,name\n");
    check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks");
    check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityEnable");
    atexit(finish);
    return 1;
}
