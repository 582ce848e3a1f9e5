"""Patch 0032 (MC_LOGITS_SINK): llama.cpp hands the logits' host copy to the backend that computes them
before the graph runs (a CUDA backend copies them in slices during the output product). Here, on the CPU
build, the hand-over is offered and declined (the CPU registry has no such entry), so every step's
logits must still arrive exactly as without it; its settings are read with a clear warning. The CUDA
side's wiring is checked in the source (test_cuda_kernels.py compiles it); its speed and its logits
against the copy after the graph are measured on a GPU (bench/gpu/side_by_side.sh, warm_repeats.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.ggml_patches.test_cuda_kernels import assert_statements, c_body

ROOT = Path(__file__).resolve().parents[2]

# three steps of one sequence: an 8-token prompt with every row's logits (8 x 262,144 floats, 8 MiB:
# over the hand-over's default 2 MiB), one token (1 MiB: under it), then 4 tokens with every row's
SCRIPT = r"""
import hashlib, logging, sys
from orchestrator.llama import Batch, Context, ContextParams, Model
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)  # llama.cpp's log lines (at DEBUG here)
with Model(sys.argv[1]) as model, Batch(16) as batch:
    params = ContextParams(n_ctx=128, n_batch=16, n_seq_max=1, n_threads=2, flash_attn="on")
    with Context(model, params) as ctx:
        toks = model.tokenize("The quick brown fox jumps over the lazy")[:8]
        pos = 0
        for step in (toks, [toks[-1]], toks[:4]):
            batch.clear()
            rows = [batch.add(t, pos + i, 0, True) for i, t in enumerate(step)]
            pos += len(step)
            ctx.decode(batch)
            h = hashlib.sha256(b"".join(ctx.logits(r).tobytes() for r in rows)).hexdigest()
            print("step", len(step), h, flush=True)
"""


def _run(gemma_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("MC_LOGITS_SINK")}
    full.update(env, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(gemma_path)], capture_output=True, text=True, env=full, timeout=300
    )


@pytest.fixture(scope="module")
def plain(gemma_path):
    out = _run(gemma_path, MC_LOGITS_SINK="0")
    assert out.returncode == 0, out.stderr[-2000:]
    steps = re.findall(r"^step (\d+) ([0-9a-f]{64})$", out.stdout, re.M)
    assert [n for n, _ in steps] == ["8", "1", "4"]
    assert len({h for _, h in steps}) == 3  # three different steps' logits
    return steps


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"MC_LOGITS_SINK_MIN_KB": "1"},
        {"MC_LOGITS_SINK": "1"},
        {"MC_LOGITS_SINK_SMALL": "1"},  # patch 0064: the one-token step's copy offered for a direct write
        {"MC_LOGITS_SINK_SMALL": "1", "MC_LOGITS_SINK": "0"},
    ],
)
def test_every_step_keeps_its_logits_where_the_hand_over_is_declined(gemma_path, plain, env):
    out = _run(gemma_path, **env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.findall(r"^step (\d+) ([0-9a-f]{64})$", out.stdout, re.M) == plain
    assert "MC_LOGITS_SINK" not in out.stderr


@pytest.mark.parametrize(
    ("env", "warning"),
    [
        ({"MC_LOGITS_SINK": "2"}, "MC_LOGITS_SINK=2: expected a whole number in 0..1; using 1"),
        ({"MC_LOGITS_SINK": "on"}, "MC_LOGITS_SINK=on: expected a whole number in 0..1; using 1"),
        (
            {"MC_LOGITS_SINK_MIN_KB": "0"},
            "MC_LOGITS_SINK_MIN_KB=0: expected a whole number in 1..16777216; using 2048",
        ),
        ({"MC_LOGITS_SINK_SMALL": "2"}, "MC_LOGITS_SINK_SMALL=2: expected 0 or 1; using 0"),
        ({"MC_LOGITS_SINK_SMALL": "yes"}, "MC_LOGITS_SINK_SMALL=yes: expected 0 or 1; using 0"),
    ],
)
def test_a_bad_setting_is_named_with_its_allowed_values(gemma_path, plain, env, warning):
    out = _run(gemma_path, **env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert warning in out.stderr
    assert re.findall(r"^step (\d+) ([0-9a-f]{64})$", out.stdout, re.M) == plain


def test_the_hand_over_is_wired_around_the_graph_compute(patched):
    """llama-context: the destination set per ubatch (only where the logits would be copied), handed
    over right before the graph compute and collected right after it (failure included), cleared
    after the ubatch; the copy after the graph skipped only when the backend says it issued it."""
    ctx = (patched / "src" / "llama-context.cpp").read_text()
    proc = ctx.index("llm_graph_result * llama_context::process_ubatch(")
    arm = ctx.index("mc_sink_arm(res);", proc)
    compute = ctx.index("const auto status = graph_compute(res->get_gf(), ubatch.n_tokens > 1);", arm)
    collect = ctx.index("mc_sink_collect();", compute)
    assert arm < compute < collect < ctx.index("if (status != GGML_STATUS_SUCCESS)", compute)
    decode = ctx.index("int llama_context::decode(const llama_batch_ext & batch_inp)")
    dst = ctx.index("mc_sink_dst   = logits.data + n_outputs_prev*n_vocab;", decode)
    assert ctx.index("needs_raw_logits(ubatch, sampling.samplers, sampling.raw_logits)", decode) < dst
    call = ctx.index("const auto * res = process_ubatch(", dst)
    assert ctx.index("mc_sink_dst = nullptr;", call) < ctx.index("if (!res) {", call)
    skip = ctx.index("if (!mc_sink_taken) {", call)
    assert skip < ctx.index("ggml_backend_tensor_get_async(backend_res, t_logits, logits_out", skip)
    # the entry points are looked up by name in the backend's registry (no CUDA symbol in libllama)
    assert '"ggml_backend_mc_set_host_sink"' in ctx and '"ggml_backend_mc_host_sink_done"' in ctx
    cuda = (patched / "ggml" / "src" / "ggml-cuda" / "ggml-cuda.cu").read_text()
    reg = cuda.index("static void * ggml_backend_cuda_reg_get_proc_address(")
    assert cuda.index('"ggml_backend_mc_set_host_sink"', reg) < cuda.index(
        '"ggml_backend_mc_host_sink_done"', reg
    )
    # a captured graph holds the copy, so only page-locked memory is taken
    setter = cuda.index("static bool ggml_backend_cuda_mc_set_host_sink(")
    assert cuda.index("attr.type != cudaMemoryTypeHost", setter) < reg


def test_the_slices_cover_every_row_and_column_once():
    """mc_mmq_q6_K_launch's slicing (whole 16-row tiles, MC_LOGITS_SINK_SLICES launches at most) and its
    2D copies (rows r0 .. r0 + rn of every column, the column pitch nrows floats on both sides): every
    output float reaches its own host float once, for the 27B's vocabulary and odd shapes."""
    rows = 16
    for nrows, ncols, slices in [(248320, 16, 4), (248320, 12, 8), (262144, 2, 3), (1000, 5, 16), (17, 9, 4),
                                 (248320, 16, 1), (40, 16, 16)]:  # fmt: skip
        tiles = (nrows + rows - 1) // rows
        per = (tiles + slices - 1) // slices
        seen = bytearray(nrows * ncols)
        launches = 0
        t0 = 0
        while t0 < tiles:
            r0 = t0 * rows
            rn = min(per * rows, nrows - r0)
            assert r0 % 16 == 0 and rn > 0
            for c in range(ncols):  # host float (r0 + c * nrows) .. + rn, from the same device floats
                for r in range(r0, r0 + rn):
                    seen[c * nrows + r] += 1
            launches += 1
            t0 += per
        assert launches <= slices
        assert seen == bytearray([1]) * (nrows * ncols), (nrows, ncols, slices)


def test_the_slices_are_launched_and_joined_as_emulated(patched):
    mc = (patched / "ggml" / "src" / "ggml-cuda" / "mc-mmv.cu").read_text()
    launch = mc.index("static bool mc_mmq_q6_K_launch(")
    body = mc[launch : mc.index("static bool mc_mmq_q6_K_try(", launch)]
    for text in [
        "const int64_t per    = sink && !direct ? (tiles + mc_sink_slices() - 1) / mc_sink_slices() : tiles;",
        "for (int64_t t0 = 0; t0 < tiles; t0 += per, ++slice) {",
        "const int64_t r0 = t0 * MC_Q6KM_ROWS;",
        "const int64_t rn = std::min(per * MC_Q6KM_ROWS, nrows - r0);",
        "copies.push_back({ done, (float *) sk.host + r0, nrows * sizeof(float), "
        "(const float *) dst->data + r0,",
        "dst->nb[1], rn * sizeof(float), (size_t) ncols });",
    ]:
        assert text in body, text
    # each slice's event right after its launch; the copies issued after the last slice (in a capture:
    # the graph's memcpy nodes), then the sink marked as copied
    kernel = body.index("ggml_cuda_kernel_launch(kernel,", body.index("for (int64_t t0 = 0;"))
    record = body.index("CUDA_CHECK(cudaEventRecord(done, stream));", kernel)
    assert record < body.index("copies.push_back(", record)
    issue = body.index("if (sink && !direct) {\n        ctx.mc_sink_issue(copies);\n    }")
    assert record < issue < body.index("sk.issued = true;", issue)
    assert 'mc_env_int("MC_LOGITS_SINK_SLICES", 1, ggml_backend_cuda_context::MC_SINK_MAX_SLICES, 4)' in mc
    # the form that left the copies to each launch of a captured graph (MC_LOGITS_SINK_GRAPH=1, measured
    # no faster in run AV) is taken out
    assert "MC_LOGITS_SINK_GRAPH" not in mc and "cudaEventRecordExternal" not in mc
    # a copy waits for its slice's event on the second stream; the main stream for the last copy
    common = (patched / "ggml" / "src" / "ggml-cuda" / "common.cuh").read_text()
    issue = common.index("void mc_sink_issue(const std::vector<ggml_cuda_mc_sink_copy> & copies) {")
    wait = common.index("CUDA_CHECK(cudaStreamWaitEvent(side, c.done, 0));", issue)
    copy = common.index(
        "CUDA_CHECK(cudaMemcpy2DAsync(c.dst, c.dpitch, c.src, c.spitch, c.width, c.height,", wait
    )
    join = common.index("CUDA_CHECK(cudaEventRecord(copied, side));", copy)
    assert join < common.index("CUDA_CHECK(cudaStreamWaitEvent(main, copied, 0));", join)


def test_a_captured_copy_is_replayed_only_to_the_same_host_memory(patched):
    """ggml-cuda.cu: another host copy (or none) than the one a graph was captured with counts as a
    change (so that graph is not replayed); the copy at the end of the graph that computes the tensor
    where the product did not issue it; the capture remembers whether it holds the copy and a replay
    says so."""
    cuda = (patched / "ggml" / "src" / "ggml-cuda" / "ggml-cuda.cu").read_text()
    compute = cuda.index("static enum ggml_status ggml_backend_cuda_graph_compute(")
    changed = cuda.index("graph->mc_sink_host != sk.host", compute)
    assert cuda.index("ggml_cuda_graph_update_required(cuda_ctx, cgraph);", compute) < changed
    assert changed < cuda.index("if (!graph->warmup_complete) {", changed)
    evaluate = cuda.index("static void ggml_cuda_graph_evaluate_and_capture(")
    finish = cuda.index("ggml_cuda_mc_sink_finish(cuda_ctx, cgraph);", evaluate)
    assert cuda.index("ggml_cuda_mc_next_weights_end();", evaluate) < finish
    end = cuda.index("CUDA_CHECK(cudaStreamEndCapture(cuda_ctx->stream(), &graph->graph));", finish)
    assert (
        cuda.index("graph->mc_sink_issued = cuda_ctx->mc_sink.issued && !mc_sink_issued_before;", end) > end
    )
    launch = cuda.index("CUDA_CHECK(cudaGraphLaunch(graph->instance, cuda_ctx->stream()));", end)
    issued = cuda.index("if (graph->mc_sink_issued) {", launch)
    assert launch < issued < cuda.index("cuda_ctx->mc_sink.issued = true;", issued)
    assert "mc_sink_copies" not in cuda and "mc_sink_deferred" not in cuda


def test_the_direct_form_writes_each_logit_once_where_the_copy_would_put_it():
    """Patch 0035 (MC_LOGITS_SINK_DIRECT=1): one launch of mc_mmq_q6_K over every tile, each block's
    write loop (thread i of 256 takes sums i, i + 256, ..: row i % 16 of the tile, column i / 16) storing
    to dsth at dst's own offset (column c * stride + row0 + r; the sink takes only a contiguous output,
    so the stride is nrows floats, the host copy's column pitch): every host float written once, with its
    own (row, column)'s sum."""
    rows = 16
    for nrows, ncols in [(248320, 16), (248320, 12), (1000, 9), (17, 16), (40, 2)]:
        nt = 1 if ncols <= 8 else 2
        i = np.arange(8 * nt * rows)  # the loop's sums over the block's threads, in any order
        r, c = i % rows, i // rows
        row0 = np.arange((nrows + rows - 1) // rows)[:, None] * rows
        keep = (r[None, :] < nrows - row0) & (c[None, :] < ncols)
        at = (c[None, :] * nrows + row0 + r[None, :])[keep]  # the host float each store writes
        sum_row = (row0 + r[None, :])[keep]
        sum_col = np.broadcast_to(c[None, :], keep.shape)[keep]
        assert np.array_equal(np.bincount(at, minlength=nrows * ncols), np.ones(nrows * ncols, np.int64))
        assert np.array_equal(at % nrows, sum_row) and np.array_equal(at // nrows, sum_col)


def test_the_direct_form_is_wired_as_emulated(patched):
    mc = (patched / "ggml" / "src" / "ggml-cuda" / "mc-mmv.cu").read_text()
    kernel = mc.index("static __global__ void mc_mmq_q6_K(")
    assert mc.index("float * dst, float * dsth,", kernel) < mc.index("{", kernel)
    store = mc.index("dst[(int64_t) c * stride_col_dst + row0 + r] = x;", kernel)
    host = mc.index("if (dsth != nullptr) {", store)
    assert (
        host < mc.index("dsth[(int64_t) c * stride_col_dst + row0 + r] = x;", host) < mc.index("\n}\n", store)
    )
    launch = mc.index("static bool mc_mmq_q6_K_launch(")
    body = mc[launch : mc.index("static bool mc_mmq_q6_K_try(", launch)]
    # only a contiguous output of the whole tensor (the stride is the host copy's pitch), direct only
    # where the host memory has a device address; then one launch, no events and no copies
    sink = body.index(
        "const bool    sink   = sk.tensor == dst && !sk.issued && sk.bytes == ggml_nbytes(dst) &&"
    )
    assert body.index("ggml_is_contiguous(dst)", sink) < body.index(
        ";", body.index("ggml_is_contiguous(dst)", sink)
    )
    direct = "const bool    direct = sink && mc_sink_direct() == 1 && sk.host_dev != nullptr;"
    assert body.index(direct) < body.index("const int64_t per    = sink && !direct ?")
    assert "direct ? (float *) sk.host_dev + r0 : (float *) nullptr, (int) rn," in body
    assert "if (sink && !direct) {  // rows r0 .. r0 + rn of every column: a 2D copy" in body
    assert "if (sink && !direct) {\n        ctx.mc_sink_issue(copies);\n    }" in body
    # both forms tell llama.cpp its copy is made, after the copies are issued
    issued = body.index("if (sink) {  // the copy is made (or, direct, the product writes the host)")
    assert body.index("ctx.mc_sink_issue(copies);") < issued < body.index("sk.issued = true;", issued)
    assert 'mc_env_int("MC_LOGITS_SINK_DIRECT", 0, 1, 1)' in mc
    # the device address is the page-locked memory's own, taken after the check that it is page-locked
    cuda = (patched / "ggml" / "src" / "ggml-cuda" / "ggml-cuda.cu").read_text()
    setter = cuda.index("static bool ggml_backend_cuda_mc_set_host_sink(")
    typed = cuda.index("attr.type != cudaMemoryTypeHost", setter)
    assert typed < cuda.index("ctx->mc_sink = { tensor, host, bytes, false, attr.devicePointer };", typed)
    common = (patched / "ggml" / "src" / "ggml-cuda" / "common.cuh").read_text()
    struct = common.index("struct mc_host_sink {")
    assert common.index("void *              host_dev = nullptr;", struct) < common.index(
        "} mc_sink;", struct
    )


def test_a_small_copy_is_handed_over_for_a_direct_write_only(patched):
    """Patch 0064 (MC_LOGITS_SINK_SMALL=1, off until measured): a copy under MC_LOGITS_SINK_MIN_KB (a
    one-token step's 970 KiB of logits) is offered through an entry of its own, which the CUDA backend
    takes only where the page-locked memory has a device address and marks direct-only: the one-column
    output product writes each logit to the host beside its output (and says the copy is made), the
    2..16-column product takes it only in its direct form, and the end of the graph never copies it, so
    where no product writes it llama.cpp copies after the graph as before."""
    ctx = (patched / "src" / "llama-context.cpp").read_text()
    arm = ctx[
        ctx.index("void llama_context::mc_sink_arm(") : ctx.index("void llama_context::mc_sink_collect(")
    ]
    assert "const bool   small_ok  = mc_logits_sink_small();" in arm  # read every ubatch: a bad value named
    assert "(small && !small_ok)" in arm
    assert 'small ? "ggml_backend_mc_set_host_sink_direct" : "ggml_backend_mc_set_host_sink"' in arm
    small = c_body(ctx, "static bool mc_logits_sink_small() {")
    assert "return false;" in small and "mc_logits_sink_min_bytes() != SIZE_MAX" in small  # off by default
    cuda = (patched / "ggml" / "src" / "ggml-cuda" / "ggml-cuda.cu").read_text()
    direct = c_body(cuda, "static bool ggml_backend_cuda_mc_set_host_sink_direct(")
    assert (
        direct.index("if (!ggml_backend_cuda_mc_set_host_sink(backend, tensor, host, bytes)) {")
        < direct.index("if (ctx->mc_sink.host_dev == nullptr) {")
        < direct.index("ctx->mc_sink = {};")
        < direct.index("ctx->mc_sink.direct_only = true;")
    )
    reg = cuda.index("static void * ggml_backend_cuda_reg_get_proc_address(")
    assert cuda.index('"ggml_backend_mc_set_host_sink_direct"', reg) < cuda.index(
        '"ggml_backend_comm_init"', reg
    )
    finish = c_body(cuda, "static void ggml_cuda_mc_sink_finish(")
    assert "if (sk.tensor == nullptr || sk.issued || sk.direct_only) {" in finish
    common = (patched / "ggml" / "src" / "ggml-cuda" / "common.cuh").read_text()
    assert "bool                direct_only = false;" in common
    mc = (patched / "ggml" / "src" / "ggml-cuda" / "mc-mmv.cu").read_text()
    kernel = mc.index("static __global__ void mc_mmv_q6_K(")
    assert mc.index("float * dst, float * dsth, const int nrows,", kernel) < mc.index("{", kernel)
    store = mc.index("dst[row0 + tid] = x;", kernel)
    assert store < mc.index("if (dsth != nullptr) {", store) < mc.index("dsth[row0 + tid] = x;", store)
    pick = c_body(mc, "static float * mc_sink_direct_dst(")
    assert_statements(
        pick,
        (
            "sk.tensor == dst",
            "!sk.issued",
            "sk.bytes == ggml_nbytes(dst)",
            "ggml_is_contiguous(dst)",
            "ctx.curr_stream_no == 0",
            "sk.host_dev != nullptr",
            "mc_sink_direct() == 1",
        ),
    )
    one = c_body(mc, "static bool mc_mmv_q6_K_try(")
    launch = one.index("ggml_cuda_kernel_launch(mc_mmv_q6_K,")
    assert one.index("float *    dsth = mc_sink_direct_dst(ctx, dst);") < launch
    assert (
        one.index("dsth, (int) nrows,", launch)
        < one.index("if (dsth != nullptr) {", launch)
        < one.index("ctx.mc_sink.issued = true;", launch)
    )
    many = mc[mc.index("static bool mc_mmq_q6_K_launch(") : mc.index("static bool mc_mmq_q6_K_try(")]
    assert "(!sk.direct_only || (mc_sink_direct() == 1 && sk.host_dev != nullptr))" in many
