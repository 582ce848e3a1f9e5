"""bench/engine_steps.py: an engine run on the tiny qwen35 with its steps timed (decode call, host work
after the logits, the rest) writes its JSON and table, and every generated token passes the timers;
--bare also times the same decodes without the engine; --sampling device chooses the tokens in the graph."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_engine_steps_times_every_step(tiny_qwen35_path, tmp_path):
    out = tmp_path / "steps.json"
    cmd = [sys.executable, str(ROOT / "bench" / "engine_steps.py"), str(tiny_qwen35_path),
           "--tasks", "3", "--prompt", "8", "--gen", "6", "--bare", "--json", str(out)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["tasks"] == 3 and res["agg_tok_s"] > 0
    assert res["rows"] == 3 * 6  # one logits row per generated token of each task
    assert res["decodes"] >= 6  # at least the prefill step and one step per further token
    # the per-step figures are over the decode steps (one token for each task); the prefill apart
    assert res["decode_steps"] + res["prefill_decodes"] == res["decodes"] and res["prefill_decodes"] >= 1
    # tokens 2..6 of each task: up to 5 pure decode steps (fewer where a late prompt shared a step)
    assert 1 <= res["decode_steps"] <= 5 and res["prefill_ms"] > 0
    assert res["decode_ms_per_step"] > 0 and res["after_logits_ms_per_step"] > 0
    total = res["decode_ms_per_step"] + res["after_logits_ms_per_step"] + res["rest_ms_per_step"]
    assert abs(total - res["step_ms"]) < 0.01
    assert 0 <= res["graph_reused"] < res["decodes"]  # the first step builds its graph
    assert res["cuda_graph_log"] == {}  # no CUDA here: no CUDA-graph messages
    assert res["bare_decode_ms_per_step"] > 0  # the same decodes without the engine
    assert res["device_rows"] == 0  # on the CPU the engine chooses greedy tokens on the host
    assert "decode ms" in run.stdout
    # --sampling device: every token's argmax ran in the graph (backend sampling, patch 0010)
    run = subprocess.run([*cmd[:-3], "--sampling", "device", "--json", str(out)], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["rows"] == res["device_rows"] == 3 * 6


def test_engine_steps_rejects_bad_counts(tmp_path):
    script = str(ROOT / "bench" / "engine_steps.py")
    cmd = [sys.executable, script, str(tmp_path / "none.gguf"), "--tasks", "0"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--tasks must be >= 1" in run.stderr
    run = subprocess.run([*cmd[:-1], "1", "--threads", "0"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--threads must be >= 1 (got 0)" in run.stderr
