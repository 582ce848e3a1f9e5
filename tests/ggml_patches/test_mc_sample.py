"""Patch 0012 (mc_sample) on the CPU build: a backend sampler whose parameters change between decodes
(top-k 1..64 -> top-p -> min-p -> temperature -> a draw) picks the argmax at temperature 0, draws
only tokens the host chain could keep, at their probabilities, and replays its draws from a seed."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from orchestrator.backend import BackendError
from orchestrator.llama import Batch, Context, ContextParams, DeviceSampler, Model
from orchestrator.types import SamplingParams


@pytest.fixture(scope="module")
def setup(gemma_path):
    with Model(gemma_path) as model:
        params = ContextParams(n_ctx=256, n_batch=64, n_seq_max=1, n_threads=2, flash_attn="on")
        with Context(model, params) as ctx, Batch(64) as batch:
            sampler = DeviceSampler()
            try:
                assert ctx.set_sampler(0, sampler)
                ctx.set_raw_logits(0, True)  # the raw row too, to check against
                toks = model.tokenize("Once upon a time")
                for i, t in enumerate(toks):
                    batch.add(t, i, 0, i == len(toks) - 1)
                yield ctx, batch, sampler, len(toks) - 1
            finally:
                ctx.close()
                sampler.close()


def _draws(setup, params: SamplingParams, n: int, seed: int = 1, skip: int = 0):
    """n draws of the prompt's next token (decoded again each time), and the raw logits row."""
    ctx, batch, sampler, row = setup
    sampler.set(params, seed, skip)
    out = []
    for _ in range(n):
        ctx.seq_rm(0)
        ctx.decode(batch)
        out.append(ctx.sampled_token(row))
    return out, ctx.logits(row).copy()


def _host_keep(logits: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The tokens llama.cpp's host chain top_k, top_p, min_p keeps, and their probabilities after
    the temperature."""
    order = np.argsort(-logits, kind="stable")[: p.top_k]
    v = logits[order].astype(np.float64)
    p1 = np.exp(v - v.max())
    p1 /= p1.sum()
    keep = (np.cumsum(p1) - p1 < p.top_p) & (p1 >= p.min_p * p1[0])
    keep[0] = True
    ids, v = order[keep], v[keep]
    q = np.exp((v - v.max()) / p.temperature)
    return ids, q / q.sum()


def test_temperature_zero_is_the_argmax(setup):
    draws, logits = _draws(setup, SamplingParams(temperature=0.0), 3)
    assert draws == [int(logits.argmax())] * 3


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=8, top_p=1.0, min_p=0.0),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05),  # the server's kind of defaults
        SamplingParams(temperature=2.0, top_k=64, top_p=0.5, min_p=0.0),
    ],
)
def test_draws_follow_the_host_chain_s_distribution(setup, params):
    n = 300
    draws, logits = _draws(setup, params, n, seed=11)
    ids, probs = _host_keep(logits, params)
    counts = Counter(draws)
    assert set(counts) <= set(ids.tolist())  # nothing the host chain would drop
    for t, p in zip(ids.tolist(), probs, strict=True):
        assert abs(counts[t] / n - p) < 4 * np.sqrt(p * (1 - p) / n) + 0.01, (t, counts[t] / n, p)


def test_a_seed_and_a_skip_replay_the_draws(setup):
    params = SamplingParams(temperature=1.5, top_k=64, top_p=1.0, min_p=0.0)
    first, _ = _draws(setup, params, 12, seed=5)
    again, _ = _draws(setup, params, 12, seed=5)
    later, _ = _draws(setup, params, 7, seed=5, skip=5)
    other, _ = _draws(setup, params, 12, seed=6)
    assert first == again and later == first[5:] and other != first


def test_parameters_out_of_range_are_refused():
    sampler = DeviceSampler()
    try:
        assert DeviceSampler.max_k() == 64
        with pytest.raises(BackendError, match=r"top_k 1\.\.64"):
            sampler.set(SamplingParams(temperature=0.8, top_k=65), 1)
        with pytest.raises(BackendError, match=r"top_k 1\.\.64"):
            sampler.set(SamplingParams(temperature=0.8, top_k=0), 1)
        # greedy takes any top-k / top-p / min-p; top_p 0 and min_p 1 keep the top token alone
        sampler.set(SamplingParams(temperature=0.0, top_k=500, top_p=0.0, min_p=1.0), 1)
        sampler.set(SamplingParams(temperature=0.8, top_p=0.0), 1)
        sampler.set(SamplingParams(temperature=0.8, min_p=1.0), 1)
    finally:
        sampler.close()
    assert DeviceSampler.takes(SamplingParams(temperature=0.8))  # top-k 40
    assert DeviceSampler.takes(SamplingParams(temperature=0.0, top_k=0))  # greedy: any top-k
    assert not DeviceSampler.takes(SamplingParams(temperature=0.8, top_k=0))  # the whole vocabulary
    assert not DeviceSampler.takes(SamplingParams(temperature=0.8, top_k=100))
    assert not DeviceSampler.takes(SamplingParams(temperature=0.8, repeat_penalty=1.1))
