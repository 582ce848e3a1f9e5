"""Patch 0057 (MC_FUSE_CONV_STEP) against the graph the model really builds: the tiny qwen35 decodes on
this machine's CPU backend while the scheduler's eval callback reports every node of a one-token step
(op, sources, memory). The first form of the fusion asked for the SiLU's output apart from the token's
columns, but ggml-alloc gives the convolution's output the token projection's freed memory, so it never
fused in the model (run CD's trace on the H200 showed the same 820 kernels with it on). This test
checks, on the real graph and its real buffers, everything the CUDA guard checks: the order, the
window's two readers, and the memory the fused kernel may share."""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp
import pytest


class _Tensor(ctypes.Structure):
    pass


# ggml.h's struct ggml_tensor (GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64, GGML_MAX_SRC 10, GGML_MAX_NAME 64)
_Tensor._fields_ = [
    ("type", ctypes.c_int32),
    ("buffer", ctypes.c_void_p),
    ("ne", ctypes.c_int64 * 4),
    ("nb", ctypes.c_size_t * 4),
    ("op", ctypes.c_int32),
    ("op_params", ctypes.c_int32 * 16),
    ("flags", ctypes.c_int32),
    ("src", ctypes.c_void_p * 10),
    ("view_src", ctypes.c_void_p),
    ("view_offs", ctypes.c_size_t),
    ("data", ctypes.c_void_p),
    ("name", ctypes.c_char * 64),
    ("extra", ctypes.c_void_p),
    ("padding", ctypes.c_char * 8),
]


def _op_names() -> dict[int, str]:
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    lib.ggml_op_name.restype = ctypes.c_char_p
    lib.ggml_op_name.argtypes = [ctypes.c_int]
    names = {}
    for op in range(200):  # GGML_OP_COUNT is not exported: read names until the table's end
        name = lib.ggml_op_name(op)
        if name is None or name == b"":
            break
        names[op] = name.decode()
    return names


def _decode_step_nodes(model: Path, last_tokens: int = 1) -> list[dict]:
    """Every node of the third step after an 8-token prompt, in the order computed: one-token steps, the
    third of last_tokens tokens (16: a verify step's shape)."""
    steps: list[list[dict]] = [[]]

    def callback(t, ask, _user):
        if ask:
            return True
        x = ctypes.cast(t, ctypes.POINTER(_Tensor)).contents
        empty = any(v == 0 for v in x.ne)
        steps[-1].append(
            {
                "ptr": ctypes.cast(t, ctypes.c_void_p).value,
                "name": x.name.decode(),
                "op": x.op,
                "ne": list(x.ne),
                "nb": list(x.nb),
                "data": x.data or 0,
                "bytes": 0 if empty else max((x.ne[d] - 1) * x.nb[d] for d in range(4)) + x.nb[0],
                "src": [s for s in x.src if s],
                "view_src": x.view_src or 0,
                "view_offs": x.view_offs,
                "empty": empty,
            }
        )
        return True

    cb = llama_cpp.ggml_backend_sched_eval_callback(callback)
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    model_ptr = llama_cpp.llama_model_load_from_file(str(model).encode(), mparams)
    assert model_ptr
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_threads = 256, 64, 64, 2
    params.cb_eval = cb
    ctx = llama_cpp.llama_init_from_model(model_ptr, params)
    assert ctx
    try:
        prompt = (llama_cpp.llama_token * 8)(*range(5, 13))
        assert llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(prompt, 8)) == 0
        for k in range(3):
            steps.append([])
            n = last_tokens if k == 2 else 1
            toks = (llama_cpp.llama_token * n)(*range(13 + k, 13 + k + n))
            assert llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(toks, n)) == 0
    finally:
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model_ptr)
    return steps[-1]


def _disjoint(a: dict, b: dict) -> bool:
    return a["data"] + a["bytes"] <= b["data"] or b["data"] + b["bytes"] <= a["data"]


@pytest.mark.parametrize("n_t", [1, 16])  # 16: patch 0063 (MC_FUSE_CONV_TOKENS), a verify step
def test_the_model_s_conv_step_meets_the_fusion_s_guards(tiny_qwen35_path, n_t):
    names = _op_names()
    nodes = _decode_step_nodes(tiny_qwen35_path, n_t)
    by_ptr = {n["ptr"]: n for n in nodes}
    uses: dict[int, int] = {}
    for n in nodes:
        for s in n["src"]:
            uses[s] = uses.get(s, 0) + 1
    noop = {"RESHAPE", "TRANSPOSE", "VIEW", "PERMUTE", "NONE"}

    def real_after(i: int) -> int:
        j = i + 1
        while nodes[j]["empty"] or names[nodes[j]["op"]] in noop:
            j += 1
        return j

    concats = [
        i for i, n in enumerate(nodes) if names[n["op"]] == "CONCAT" and n["name"].startswith("conv_input-")
    ]
    assert concats, "no recurrent layer's conv window in the step"
    overlapping = 0
    for i in concats:
        cat = nodes[i]
        j1 = real_after(i)
        j2 = real_after(j1)
        j3 = real_after(j2)
        cpy, conv, silu = nodes[j1], nodes[j2], nodes[j3]
        # the order the guard reads: the window, its tail copied to the cache, the convolution, its SiLU
        ops = [names[cpy["op"]], names[conv["op"]], names[silu["op"]]]
        assert ops == ["CPY", "SSM_CONV", "UNARY"], cat["name"]
        assert conv["src"][0] == cat["ptr"] and silu["src"][0] == conv["ptr"]
        # the window's two readers: the tail view (read by the copy alone) and the convolution
        tail = by_ptr[cpy["src"][0]]
        assert tail["view_src"] == cat["ptr"] and uses[cat["ptr"]] == 2 and uses[tail["ptr"]] == 1
        state, x = by_ptr[cat["src"][0]], by_ptr[cat["src"][1]]
        dst = by_ptr[cpy["src"][1]]
        # the shapes the guard asks for: n_t tokens after the state's 3 columns, the tail from column n_t
        assert x["ne"][0] == n_t and cat["ne"][0] == 3 + n_t and conv["ne"][1] == n_t and x["nb"][0] % 4 == 0
        assert tail["view_offs"] == n_t * 4 and tail["ne"][0] == 3 and state["ne"][0] == 3
        # the memory the fused kernel shares: the state's update in place, element for element ...
        in_place = dst["data"] == state["data"] and state["nb"][1] == 3 * 4 and state["nb"][2] == dst["nb"][1]
        assert in_place or _disjoint(dst, state)
        # ... and the SiLU's output on the token's memory element for element, or apart from it
        silu_on_x = silu["data"] == x["data"] and x["nb"][1] == 4 and silu["nb"][2] == x["nb"][2]
        silu_on_x = silu_on_x and (n_t == 1 or silu["nb"][1] == x["nb"][0])
        assert silu_on_x or _disjoint(silu, x)
        overlapping += int(silu_on_x)
        for a, b in ((dst, x), (dst, silu), (silu, state)):  # (the weight is in the model's buffer)
            assert _disjoint(a, b), (a["name"], b["name"])
    # the case the first guard refused is the model's: the allocator reuses the token's columns (here, on
    # the CPU backend; on the GPU the token's columns stay allocated to the recurrence, so apart there)
    if n_t == 1:
        assert overlapping == len(concats), (overlapping, len(concats))
