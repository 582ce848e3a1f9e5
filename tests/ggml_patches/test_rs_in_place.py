"""Patch 0006: a Gated DeltaNet model's recurrent states (the delta-rule state and the conv state)
are read where they live in the cache when every sequence of a step reads the cell it writes back
to, instead of being gathered into a copy first. Checked on the tiny qwen35 with real llama.cpp on
the CPU: several sequences decoded together, a copied sequence (its first step reads another
cell), removed and restored sequences and a new one (a zeroed state) give bit-identical logits
with the in-place reads and with `MC_RS_GATHER=1` (always gather, stock llama.cpp's graph), and
the in-place reads did happen (llama.cpp's debug log says so per graph)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import logging, sys
import numpy as np
from orchestrator.llama import Batch, Context, ContextParams, Model, llama

messages = []  # llama.cpp's log lines, which the backend routes to this logger at DEBUG
class Keep(logging.Handler):
    def emit(self, record):
        messages.append(record.getMessage())
native = logging.getLogger("llama.cpp")
native.setLevel(logging.DEBUG)
native.addHandler(Keep())

model = Model(sys.argv[1])
ctx = Context(model, ContextParams(n_ctx=1024, n_batch=256, n_seq_max=4, n_threads=2))
batch = Batch(256)
pos = {}
last = {}
rows = []

def step(seqs):
    # one token for each sequence in `seqs` (its last argmax), logits kept in order
    batch.clear()
    for s in seqs:
        batch.add(last[s], pos[s], s, True)
        pos[s] += 1
    ctx.decode(batch)
    for i, s in enumerate(seqs):
        lg = ctx.logits(i).copy()
        rows.append(lg)
        last[s] = int(lg.argmax())

def prefill(prompts):
    batch.clear()
    outs = []
    for s, toks in prompts.items():
        for j, t in enumerate(toks):
            row = batch.add(t, j, s, j == len(toks) - 1)
        outs.append((row, s))
        pos[s] = len(toks)
    ctx.decode(batch)
    for i, s in outs:
        lg = ctx.logits(i).copy()
        rows.append(lg)
        last[s] = int(lg.argmax())

rng = np.random.default_rng(7)
n_vocab = model.n_vocab
prefill({s: [int(t) for t in rng.integers(1, n_vocab, 5 + 3 * s)] for s in range(3)})
for _ in range(6):
    step([0, 1, 2])
# a copied sequence: its first step reads sequence 0's cell
llama().llama_memory_seq_cp(ctx.memory, 0, 3, -1, -1)
pos[3], last[3] = pos[0], last[0]
for _ in range(4):
    step([0, 1, 2, 3])
# sequence 2 saved, removed and restored; sequence 1 removed
buf = np.zeros(ctx.state_size(2), dtype=np.uint8)
n = ctx.state_save(2, buf)
assert n > 0
ctx.seq_rm(2)
ctx.seq_rm(1)
for _ in range(2):
    step([0, 3])
assert ctx.state_load(2, buf, n)
for _ in range(3):
    step([0, 2, 3])
# a new sequence next to running ones (its state starts from zero)
prefill({1: [int(t) for t in rng.integers(1, n_vocab, 4)]})
for _ in range(4):
    step([0, 1, 2, 3])
np.save(sys.argv[2], np.stack(rows))
print(sum("read in place" in m for m in messages))
"""


def run(model: Path, out: Path, gather: bool) -> int:
    env = {k: v for k, v in os.environ.items() if k != "MC_RS_GATHER"}
    if gather:
        env["MC_RS_GATHER"] = "1"
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model), str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return int(r.stdout.strip().splitlines()[-1])


def test_states_read_in_place_give_the_same_logits(tiny_qwen35_path, tmp_path):
    in_place = run(tiny_qwen35_path, tmp_path / "view.npy", gather=False)
    gathered = run(tiny_qwen35_path, tmp_path / "gather.npy", gather=True)
    a, b = np.load(tmp_path / "view.npy"), np.load(tmp_path / "gather.npy")
    assert a.shape == b.shape and a.shape[0] == 3 + 18 + 16 + 4 + 9 + 1 + 16
    assert np.isfinite(a).all()
    assert np.array_equal(a, b)  # bit-identical, every step of every sequence
    assert in_place >= 1  # graphs that read the states in place were built
    assert gathered == 0  # MC_RS_GATHER=1: never
