"""The order ggml gives the nodes of the test-backend-ops cases of patches 0059 (MC_ATTN_PRO) and 0060
(MC_GATE_CONT), and what the CUDA fusions' guards then see: a case whose graph the guard refuses would
pass on the GPU without testing the fused kernel (the first MC_CONV_STEP guard passed its cases yet never
fused in the model). The graphs are built here with this venv's ggml (libggml-base, through ctypes, no
tensor data), as the C++ cases build them, and walked as ggml-cuda.cu walks them: views, reshapes,
permutes and empty nodes skipped."""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp
import pytest

from tests.ggml_patches.test_conv_step_graph import _Tensor

P = ctypes.c_void_p


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", P), ("no_alloc", ctypes.c_bool)]


@pytest.fixture(scope="module")
def g():
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    sig = {
        "ggml_init": (P, [_InitParams]),
        "ggml_free": (None, [P]),
        "ggml_new_tensor_1d": (P, [P, ctypes.c_int, ctypes.c_int64]),
        "ggml_new_tensor_2d": (P, [P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]),
        "ggml_new_tensor_3d": (P, [P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]),
        "ggml_view_2d": (P, [P, P, ctypes.c_int64, ctypes.c_int64, ctypes.c_size_t, ctypes.c_size_t]),
        "ggml_view_3d": (P, [P, P, *[ctypes.c_int64] * 3, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t]),
        "ggml_reshape_3d": (P, [P, P, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]),
        "ggml_permute": (P, [P, P, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]),
        "ggml_rms_norm": (P, [P, P, ctypes.c_float]),
        "ggml_mul": (P, [P, P, P]),
        "ggml_rope_multi": (
            P,
            [P, P, P, P, ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
            + [ctypes.c_float] * 6,
        ),
        "ggml_set_rows": (P, [P, P, P, P]),
        "ggml_flash_attn_ext": (P, [P, P, P, P, P, ctypes.c_float, ctypes.c_float, ctypes.c_float]),
        "ggml_cont_2d": (P, [P, P, ctypes.c_int64, ctypes.c_int64]),
        "ggml_unary": (P, [P, P, ctypes.c_int]),
        "ggml_new_graph": (P, [P]),
        "ggml_build_forward_expand": (None, [P, P]),
        "ggml_graph_n_nodes": (ctypes.c_int, [P]),
        "ggml_graph_node": (P, [P, ctypes.c_int]),
        "ggml_op_name": (ctypes.c_char_p, [ctypes.c_int]),
        "ggml_type_name": (ctypes.c_char_p, [ctypes.c_int]),
        "ggml_unary_op_name": (ctypes.c_char_p, [ctypes.c_int]),
    }
    for name, (res, args) in sig.items():
        getattr(lib, name).restype = res
        getattr(lib, name).argtypes = args
    return lib


def _enum(fn, name: str) -> int:
    for i in range(128):
        s = fn(i)
        if s is not None and s.decode() == name:
            return i
    raise AssertionError(name)


def _nodes(g, ctx, out) -> list[tuple[str, int]]:
    """The graph's nodes in order: (op name, tensor address)."""
    gf = g.ggml_new_graph(ctx)
    g.ggml_build_forward_expand(gf, out)
    return [
        (g.ggml_op_name(ctypes.cast(n, ctypes.POINTER(_Tensor)).contents.op).decode(), n)
        for n in (g.ggml_graph_node(gf, i) for i in range(g.ggml_graph_n_nodes(gf)))
    ]


def _real(nodes):
    """ggml-cuda.cu's real nodes (ggml_cuda_is_view_or_noop skipped) with their indices."""
    return [
        (i, op)
        for i, (op, _) in enumerate(nodes)
        if op not in ("VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE", "NONE")
    ]


@pytest.fixture
def ctx(g):
    c = g.ggml_init(_InitParams(64 * 1024 * 1024, None, True))
    yield c
    g.ggml_free(c)


@pytest.mark.parametrize("tokens", [1, 4, 12])
def test_mc_attn_pro_s_case_has_the_chains_its_guard_takes(g, ctx, tokens):
    """test_mc_attn_pro (test-backend-ops.cpp): q's RMS_NORM, MUL, ROPE consecutive (stock's three-node
    fusion), then only views until k's RMS_NORM, MUL, ROPE, VIEW, SET_ROWS (consecutive: stock's five-node
    one), then only views until v's SET_ROWS: mc_try_attn_pro's walk."""
    f32, f16 = _enum(g.ggml_type_name, "f32"), _enum(g.ggml_type_name, "f16")
    i32, i64 = _enum(g.ggml_type_name, "i32"), _enum(g.ggml_type_name, "i64")
    d, nh, nkv, n_kv, n_rot = 256, 24, 4, 256, 64
    sections = (ctypes.c_int * 4)(11, 11, 10, 0)
    rope = lambda x, pos: g.ggml_rope_multi(  # noqa: E731
        ctx, x, pos, None, n_rot, sections, 40, 0, 1e7, 1.0, 0.0, 1.0, 32.0, 1.0
    )
    qfull = g.ggml_new_tensor_3d(ctx, f32, 2 * d, nh, tokens)
    qf = ctypes.cast(qfull, ctypes.POINTER(_Tensor)).contents
    qx = g.ggml_view_3d(ctx, qfull, d, nh, tokens, qf.nb[1], qf.nb[2], 0)
    pos = g.ggml_new_tensor_1d(ctx, i32, 4 * tokens)
    q = rope(g.ggml_mul(ctx, g.ggml_rms_norm(ctx, qx, 1e-6), g.ggml_new_tensor_1d(ctx, f32, d)), pos)
    kx = g.ggml_new_tensor_3d(ctx, f32, d, nkv, tokens)
    k = rope(g.ggml_mul(ctx, g.ggml_rms_norm(ctx, kx, 1e-6), g.ggml_new_tensor_1d(ctx, f32, d)), pos)
    kt = ctypes.cast(k, ctypes.POINTER(_Tensor)).contents
    kcache = g.ggml_new_tensor_2d(ctx, f16, d * nkv, n_kv)
    k_out = g.ggml_set_rows(
        ctx,
        kcache,
        g.ggml_view_2d(ctx, k, d * nkv, tokens, kt.nb[2], 0),
        g.ggml_new_tensor_1d(ctx, i64, tokens),
    )
    vcache = g.ggml_new_tensor_2d(ctx, f16, d * nkv, n_kv)
    v_out = g.ggml_set_rows(
        ctx, vcache, g.ggml_new_tensor_2d(ctx, f32, d * nkv, tokens), g.ggml_new_tensor_1d(ctx, i64, tokens)
    )
    kk = g.ggml_permute(ctx, g.ggml_reshape_3d(ctx, k_out, d, nkv, n_kv), 0, 2, 1, 3)
    vv = g.ggml_permute(ctx, g.ggml_reshape_3d(ctx, v_out, d, nkv, n_kv), 0, 2, 1, 3)
    out = g.ggml_flash_attn_ext(ctx, g.ggml_permute(ctx, q, 0, 2, 1, 3), kk, vv, None, 0.0625, 0.0, 0.0)
    nodes = _nodes(g, ctx, out)
    real = _real(nodes)
    ops = [op for _, op in real]
    assert ops == [
        "RMS_NORM",
        "MUL",
        "ROPE",
        "RMS_NORM",
        "MUL",
        "ROPE",
        "SET_ROWS",
        "SET_ROWS",
        "FLASH_ATTN_EXT",
    ]
    (qn, _), (qm, _), (qr, _), (kn, _) = real[0], real[1], real[2], real[3]
    assert (qm, qr) == (qn + 1, qn + 2)  # the three-node fusion's adjacency
    assert [op for op, _ in nodes[kn : kn + 5]] == ["RMS_NORM", "MUL", "ROPE", "VIEW", "SET_ROWS"]
    assert nodes[kn + 4][1] == k_out and real[7][0] > kn + 4 and nodes[real[7][0]][1] == v_out
    assert nodes[qr][1] == q


@pytest.mark.parametrize("tokens", [1, 4, 12])
def test_mc_gate_cont_s_case_has_the_nodes_its_guard_takes(g, ctx, tokens):
    """test_mc_gate_cont: CONT, UNARY, MUL at consecutive indices (mc_gate_cont_nodes), the CONT's source
    the strided view of the joint projection."""
    f32 = _enum(g.ggml_type_name, "f32")
    sigmoid = _enum(g.ggml_unary_op_name, "SIGMOID")
    d, nh = 256, 24
    qfull = g.ggml_new_tensor_3d(ctx, f32, 2 * d, nh, tokens)
    qf = ctypes.cast(qfull, ctypes.POINTER(_Tensor)).contents
    gate = g.ggml_cont_2d(
        ctx, g.ggml_view_3d(ctx, qfull, d, nh, tokens, qf.nb[1], qf.nb[2], d * 4), d * nh, tokens
    )
    att = g.ggml_new_tensor_2d(ctx, f32, d * nh, tokens)
    out = g.ggml_mul(ctx, att, g.ggml_unary(ctx, gate, sigmoid))
    nodes = _nodes(g, ctx, out)
    ops = [op for op, _ in nodes]
    i = ops.index("CONT")
    assert ops[i : i + 3] == ["CONT", "UNARY", "MUL"] and nodes[i + 2][1] == out
    x = ctypes.cast(nodes[i][1], ctypes.POINTER(_Tensor)).contents.src[0]
    xt = ctypes.cast(x, ctypes.POINTER(_Tensor)).contents
    # the fits test: rows of ne0 at one pitch (2 x 256 floats) across heads and tokens
    assert xt.nb[1] == 2 * d * 4 and xt.nb[2] == xt.ne[1] * xt.nb[1]
