"""The host sampler chain (orchestrator.llama.Sampler) on real llama.cpp samplers: a chain that starts
with top-k takes only a superset of the top k logits, and picks the same tokens as with the whole
vocabulary; what has no top-k, or penalties before it, takes the whole vocabulary."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.llama import Sampler
from orchestrator.types import SamplingParams

N_VOCAB = 262_144 + 77  # not a multiple of the 256-logit groups


def _logits(rng, scale: float) -> np.ndarray:
    x = (rng.standard_normal(N_VOCAB) * scale).astype(np.float32)
    x[rng.integers(0, N_VOCAB, 12)] += np.float32(6 * scale)  # a few outliers above the rest
    return x


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, seed=1),  # the server's defaults: top-k 40, top-p 0.95, min-p 0.05
        SamplingParams(temperature=1.5, top_k=300, top_p=0.99, min_p=0.0, seed=2),
        SamplingParams(temperature=0.3, top_k=1, seed=3),
    ],
)
def test_top_k_superset_picks_the_whole_vocabulary_s_tokens(params):
    rng = np.random.default_rng(7)
    fast, full = Sampler(params, N_VOCAB), Sampler(params, N_VOCAB)
    full.top_k_first = False  # the whole vocabulary, as before
    assert fast.top_k_first
    picks = []
    for step in range(60):
        logits = _logits(rng, scale=(0.5, 2.0, 8.0)[step % 3])
        ids = fast._top_k_superset(logits)
        top_k = np.argsort(-logits, kind="stable")[: params.top_k]
        assert ids is not None and ids.shape[0] >= params.top_k and np.isin(top_k, ids).all()
        assert ids.shape[0] < N_VOCAB // 10  # a small part of the vocabulary
        a, b = fast.sample(logits.copy()), full.sample(logits.copy())
        assert a == b
        picks.append(a)
    assert len(set(picks)) > 1  # sampled, not a constant


def test_what_cannot_take_a_superset_takes_the_whole_vocabulary():
    rng = np.random.default_rng(3)
    logits = _logits(rng, 1.0)
    penalized = Sampler(SamplingParams(temperature=0.8, repeat_penalty=1.1), N_VOCAB)
    assert not penalized.top_k_first  # penalties run before top-k
    no_k = Sampler(SamplingParams(temperature=0.8, top_k=0, top_p=0.5, seed=4), N_VOCAB)
    assert not no_k.top_k_first
    assert 0 <= no_k.sample(logits.copy()) < N_VOCAB
    s = Sampler(SamplingParams(temperature=0.8, top_k=2000, seed=5), N_VOCAB)
    assert s._top_k_superset(logits) is None  # more than the 1,024 groups: no threshold
    nan = logits.copy()
    nan[: N_VOCAB // 2] = np.nan  # every group holds a NaN of the first half: no threshold
    assert Sampler(SamplingParams(temperature=0.8, top_k=600), N_VOCAB)._top_k_superset(nan) is None
    masked = np.full(N_VOCAB, -np.inf, dtype=np.float32)
    masked[[5, 900, 70_000]] = [1.0, 3.0, 2.0]  # three allowed tokens: fewer than k finite groups
    k40 = Sampler(SamplingParams(temperature=0.8, seed=6), N_VOCAB)
    assert k40._top_k_superset(masked) is None
    assert k40.sample(masked.copy()) in (5, 900, 70_000)


def test_a_peaked_distribution_without_top_k_gives_its_top_token():
    logits = np.zeros(N_VOCAB, dtype=np.float32)
    logits[123_456] = 40.0  # p ~ 1 for that token: top-p keeps it alone
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0, seed=8), N_VOCAB)
    assert {s.sample(logits.copy()) for _ in range(5)} == {123_456}
