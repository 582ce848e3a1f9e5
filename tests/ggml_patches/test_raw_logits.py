"""Patch 0010 (raw logits per sequence) on the CPU build, through the engine's own wrappers: with a
backend greedy chain on every sequence, a sequence's token comes from the graph and its logits are
copied to the host only when it asks for them (mc_set_raw_logits), without re-attaching anything."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.backend import BackendError
from orchestrator.llama import Batch, Context, ContextParams, DeviceGreedy, Model


@pytest.fixture(scope="module")
def gemma(gemma_path):
    with Model(gemma_path) as model:
        yield model


def _prompts(model):
    return [model.tokenize(p) for p in ("Once upon a time", "The capital of France is")]


def _decode(ctx, batch, prompts, first_pos=None, tokens=None):
    """Both sequences in one batch: their prompts (first step) or one token each; the rows."""
    batch.clear()
    rows = []
    for seq, toks in enumerate(prompts if tokens is None else [[t] for t in tokens]):
        start = 0 if first_pos is None else first_pos[seq]
        for i, t in enumerate(toks):
            row = batch.add(t, start + i, seq, i == len(toks) - 1)
        rows.append(row)
    ctx.decode(batch)
    return rows


def test_tokens_from_the_graph_and_raw_logits_on_request(gemma):
    params = ContextParams(n_ctx=256, n_batch=64, n_seq_max=2, n_threads=2, flash_attn="on")
    prompts = _prompts(gemma)
    pos = [len(p) for p in prompts]
    with Context(gemma, params) as host, Context(gemma, params) as dev, Batch(64) as batch:
        chains = [DeviceGreedy(), DeviceGreedy()]
        try:
            assert all(dev.set_sampler(seq, chains[seq]) for seq in (0, 1))
            ref_rows = _decode(host, batch, prompts)
            ref = [host.logits(r).copy() for r in ref_rows]
            dev.set_raw_logits(1, True)  # sequence 1 samples on the host, sequence 0 in the graph
            rows = _decode(dev, batch, prompts)
            assert [dev.sampled_token(r) for r in rows] == [int(x.argmax()) for x in ref]
            # one sequence asked: the step's rows all come back (as with a sequence without sampler)
            for r, want in zip(rows, ref, strict=True):
                np.testing.assert_allclose(dev.logits(r), want, rtol=0, atol=1e-4)

            # the next step: one token each; sequence 0 now asks for raw logits, sequence 1 not
            nxt = [int(x.argmax()) for x in ref]
            ref_rows = _decode(host, batch, prompts, pos, nxt)
            ref = [host.logits(r).copy() for r in ref_rows]
            dev.set_raw_logits(0, True)
            dev.set_raw_logits(1, False)
            rows = _decode(dev, batch, prompts, pos, nxt)
            assert [dev.sampled_token(r) for r in rows] == [int(x.argmax()) for x in ref]
            for r, want in zip(rows, ref, strict=True):
                np.testing.assert_allclose(dev.logits(r), want, rtol=0, atol=1e-4)

            # neither asks: no logits copied, the buffer keeps the last step's rows
            last = [dev.logits(r).copy() for r in rows]
            dev.set_raw_logits(0, False)
            nxt2 = [dev.sampled_token(r) for r in rows]
            rows = _decode(dev, batch, prompts, [p + 1 for p in pos], nxt2)
            assert all(isinstance(dev.sampled_token(r), int) for r in rows)
            assert all(np.array_equal(last[i], dev.logits(r)) for i, r in enumerate(rows))
            with pytest.raises(BackendError, match="sequence 5"):
                dev.set_raw_logits(5, True)
        finally:
            dev.close()
            for chain in chains:
                chain.close()
