"""Quality of a GGUF against its BF16 original: KL divergence, top-1 agreement, RMS delta-p and
perplexity ratio, on a fixed corpus, the way llama.cpp's `llama-perplexity --kl-divergence` does.

Method (matching llama-perplexity): the corpus is tokenized once (BOS first), cut into chunks of
`n_ctx` tokens; each chunk is decoded from an empty cache with the BOS token at its start, and the
second half of each chunk is scored (logits at positions n_ctx/2 .. n_ctx-2 predicting the next
token; the first half is context). Per scored position: KL(ref ||
cand) over the full vocabulary, whether the most likely tokens agree, and the probability of the
actual next token under both. The reference and the candidate run chunk by chunk side by side, so
no logits are stored.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from mcformat.metadata import Figures

# Code is what agents write: Python standard-library sources (present wherever Python is), in a
# fixed order; docstrings inside give prose.
CORPUS_FILES = (
    "textwrap.py",
    "string.py",
    "csv.py",
    "json/decoder.py",
    "json/encoder.py",
    "shlex.py",
    "fnmatch.py",
    "heapq.py",
    "bisect.py",
    "difflib.py",
    "argparse.py",
    "pathlib.py",
)


@dataclass(frozen=True)
class Corpus:
    id: str  # names the text: Python version and a hash of the bytes
    text: str


def stdlib_corpus(max_chars: int = 400_000) -> Corpus:
    root = Path(sysconfig.get_paths()["stdlib"])
    text = "\n\n".join((root / name).read_text(encoding="utf-8") for name in CORPUS_FILES)[:max_chars]
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    return Corpus(f"py{sys.version_info.major}{sys.version_info.minor}-stdlib-{digest}", text)


CALIBRATION_FILES = ("functools.py", "enum.py", "typing.py", "collections/__init__.py", "dataclasses.py")


def calibration_text(max_chars: int = 300_000) -> str:
    """Text for importance matrices: other standard-library modules than the evaluation corpus,
    so that quantization is not tuned on the text it is then measured on."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return "\n\n".join((root / name).read_text(encoding="utf-8") for name in CALIBRATION_FILES)[:max_chars]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """[n, n_vocab] float32 -> float64 log-probabilities."""
    x = logits.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


@dataclass
class _Acc:
    kl: list
    same_top: int = 0
    dp2: float = 0.0
    nll_ref: float = 0.0
    nll_cand: float = 0.0
    n: int = 0

    def add(self, ref: np.ndarray, cand: np.ndarray, nxt: np.ndarray) -> None:
        """ref, cand: log-probabilities [n, n_vocab]; nxt: the actual next tokens [n]."""
        p = np.exp(ref)
        self.kl.extend((p * (ref - cand)).sum(axis=1).tolist())
        self.same_top += int((ref.argmax(axis=1) == cand.argmax(axis=1)).sum())
        rows = np.arange(len(nxt))
        lr, lc = ref[rows, nxt], cand[rows, nxt]
        self.dp2 += float(((np.exp(lc) - np.exp(lr)) ** 2).sum())
        self.nll_ref -= float(lr.sum())
        self.nll_cand -= float(lc.sum())
        self.n += len(nxt)

    def figures(self) -> Figures:
        kl = np.maximum(np.asarray(self.kl), 0.0)
        ppl_ref, ppl_cand = np.exp(self.nll_ref / self.n), np.exp(self.nll_cand / self.n)
        return Figures(
            kl_mean=float(kl.mean()),
            kl_median=float(np.median(kl)),
            kl_p99=float(np.percentile(kl, 99)),
            kl_p999=float(np.percentile(kl, 99.9)),
            top1=self.same_top / self.n,
            rms_dp=float(np.sqrt(self.dp2 / self.n)),
            ppl_ratio=float(ppl_cand / ppl_ref),
            tokens=self.n,
        )


class _Runner:
    """One model and one context, giving logits of the second half of a chunk."""

    def __init__(self, path: Path, n_ctx: int, cache_type: str, yarn_factor: float, n_gpu_layers: int):
        from orchestrator.llama import Batch, Context, ContextParams, Model

        self.model = Model(path, n_gpu_layers)
        params = ContextParams(
            n_ctx=n_ctx,
            n_batch=n_ctx,
            n_threads=os.cpu_count() or 2,
            flash_attn="on",
            cache_type_k=cache_type,
            cache_type_v=cache_type,
            yarn_factor=yarn_factor,
        )
        self.ctx = Context(self.model, params)
        self.batch = Batch(n_ctx)

    def logits(self, chunk: list[int], first: int) -> np.ndarray:
        """Logits [len(chunk) - 1 - first, n_vocab] at positions first .. len(chunk) - 2."""
        self.ctx.clear()
        self.batch.clear()
        for i, tok in enumerate(chunk):
            self.batch.add(tok, i, 0, first <= i < len(chunk) - 1)
        self.ctx.decode(self.batch)
        return np.stack([self.ctx.logits(i).copy() for i in range(first, len(chunk) - 1)])

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()
        self.model.close()


def evaluate(
    reference: Path,
    candidate: Path,
    corpus: Corpus,
    n_ctx: int = 512,
    n_chunks: int = 4,
    cache_type: str = "f16",
    yarn_factor: float = 1.0,
    n_gpu_layers: int = 0,
) -> Figures:
    """Figures of `candidate` (a GGUF, run with this KV cache type and YaRN factor) against
    `reference` (the BF16 GGUF, f16 KV, no YaRN) on `n_chunks` chunks of `n_ctx` tokens."""
    ref = _Runner(reference, n_ctx, "f16", 1.0, n_gpu_layers)
    cand = _Runner(candidate, n_ctx, cache_type, yarn_factor, n_gpu_layers)
    try:
        tokens = ref.model.tokenize(corpus.text, add_special=True, parse_special=False)
        bos = ref.model.bos_if_added()
        acc, first = _Acc([]), n_ctx // 2
        for c in tqdm(
            range(min(n_chunks, len(tokens) // n_ctx)), desc=f"evaluate {candidate.name}", disable=None
        ):
            chunk = tokens[c * n_ctx : (c + 1) * n_ctx]
            if bos is not None:  # like llama-perplexity: every chunk starts with BOS
                chunk[0] = bos
            nxt = np.asarray(chunk[first + 1 :], dtype=np.int64)
            acc.add(log_softmax(ref.logits(chunk, first)), log_softmax(cand.logits(chunk, first)), nxt)
        if acc.n == 0:
            raise ValueError(f"corpus {corpus.id} is shorter than one chunk of {n_ctx} tokens")
        return acc.figures()
    finally:
        ref.close()
        cand.close()
