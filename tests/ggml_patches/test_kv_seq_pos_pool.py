"""Patch 0014 (the KV cells' per-sequence (pos, cell) trees take their nodes from a pool of the cells
object): a sequence saved, removed and restored into another sequence id, over and over, keeps its
smallest and largest position, leaves a sequence beside it alone, saves to the same bytes every cycle,
and decodes on to the logits and positions it gave before the swap. With one unified cache (one pool
for every sequence) and with a stream a sequence (a pool each: a restore lands in another pool); for
the tiny qwen35 (KV cells and recurrent state) and the bundled Gemma 3 270M (attention alone, its
sliding-window cache, so its smallest position is a cell's, not the recurrent state's: a save leaves
out the cells outside the window, so a restored sequence starts at the window's first position). Gemma's
restored sequence does not decode on to its pre-save logits with or without this patch (max difference
1.9 on this CPU, the series before 0014 alike): only the qwen35 is held to them here."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.backend import llama
from orchestrator.llama import Batch, Context, ContextParams, Model

N_CELLS = 600  # sequence 0's positions 0..599
N_SIDE = 300  # sequence 2's positions 0..299, decoded between sequence 0's chunks


def _pos_range(ctx: Context, seq: int) -> tuple[int, int]:
    lc = llama()
    return int(lc.llama_memory_seq_pos_min(ctx.memory, seq)), int(
        lc.llama_memory_seq_pos_max(ctx.memory, seq)
    )


def _fill(ctx: Context, batch: Batch) -> None:
    """Sequence 0 in three chunks of 200 with sequence 2's chunks of 100 between, so in a unified
    cache their cells interleave."""
    for chunk in range(3):
        for seq, n, start in ((0, 200, 200 * chunk), (2, 100, 100 * chunk)):
            batch.clear()
            for i in range(start, start + n):
                batch.add(100 + (i * (seq + 1)) % 700, i, seq, False)
            ctx.decode(batch)


def _next(ctx: Context, batch: Batch, seq: int) -> tuple[np.ndarray, tuple[int, int]]:
    """The logits of one more token on `seq`, and its positions after it."""
    batch.clear()
    batch.add(42, N_CELLS, seq, True)
    ctx.decode(batch)
    return ctx.logits(0).copy(), _pos_range(ctx, seq)


@pytest.fixture(params=["qwen35-f16", "qwen35-q8_0", "gemma-f16"])
def model_kv(request, tiny_qwen35_path, gemma_path):
    name, kv = request.param.split("-")
    return (tiny_qwen35_path if name == "qwen35" else gemma_path), kv, name == "qwen35"


@pytest.mark.parametrize("unified", [True, False], ids=["unified", "streams"])
def test_restore_cycles_keep_positions_bytes_and_logits(model_kv, unified):
    path, kv, resumes_exactly = model_kv
    with Model(path) as model:
        params = ContextParams(n_ctx=3 * 1024, n_batch=256, n_seq_max=3, n_threads=2, flash_attn="on",
                               cache_type_k=kv, cache_type_v=kv, kv_unified=unified)  # fmt: skip
        with Context(model, params) as ctx, Batch(256) as batch:
            _fill(ctx, batch)
            span, side = _pos_range(ctx, 0), _pos_range(ctx, 2)
            assert span[1] == N_CELLS - 1 and side[1] == N_SIDE - 1
            first = np.empty(ctx.state_size(0), np.uint8)
            n = ctx.state_save(0, first)
            assert n == first.nbytes > N_CELLS * 8
            before, span_before = _next(ctx, batch, 0)
            assert ctx.seq_rm(0)
            assert _pos_range(ctx, 0) == (-1, -1)
            # the records carry the sequence id, so each id's saves are compared with its first
            saved = {0: first}
            restored = None
            for cycle in range(6):
                dst = 1 - cycle % 2  # 1, 0, 1, ...
                assert ctx.state_load(dst, first, n), cycle
                restored = restored or _pos_range(ctx, dst)
                assert restored[1] == span[1] and restored[0] >= span[0]
                assert _pos_range(ctx, dst) == restored, cycle
                assert _pos_range(ctx, 1 - dst) == (-1, -1), cycle
                assert _pos_range(ctx, 2) == side, cycle
                again = np.empty_like(first)
                assert ctx.state_save(dst, again) == n, cycle
                assert np.array_equal(saved.setdefault(dst, again), again), cycle
                assert ctx.seq_rm(dst)
                assert _pos_range(ctx, dst) == (-1, -1), cycle
            assert ctx.state_load(1, first, n)
            after, span_after = _next(ctx, batch, 1)
            assert span_after[1] == span_before[1] == N_CELLS
            assert _pos_range(ctx, 2) == side
            if not resumes_exactly:
                return
            # not bit for bit: the restored cells may sit elsewhere in the cache (CPU attention sums
            # in another order, LLAMA-NOTES), so close, and the same next token
            np.testing.assert_allclose(after, before, rtol=0, atol=2e-2)
            assert after.argmax() == before.argmax()
