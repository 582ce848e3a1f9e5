#!/usr/bin/env python3
"""GPU smoke test of the patched build: the tiny qwen35 model on the CPU and on the GPU must agree.

Makes the tiny random-weight `qwen35` model (mcformat.tiny), then in one child process per role
decodes the same 32-token prompt with logits for every position, and generates a greedy 16-token
continuation through `orchestrator.llama_engine.LlamaEngine`:

  cpu   n_gpu_layers=0 with the GPU hidden (CUDA_VISIBLE_DEVICES=""): a pure CPU reference. With
        the GPU visible, llama.cpp would still run the large matrix products of a 32-token batch
        on it (operation offload), so n_gpu_layers=0 alone is not a CPU-only run.
  gpu   n_gpu_layers=999: every layer on the GPU.
  ngl0  n_gpu_layers=0 with the GPU visible (weights in host memory, offload allowed): for information.

Reports, for gpu and ngl0 against cpu: max |delta logit|, relative L2 error ||x - cpu|| / ||cpu|| over all
32 positions and for the last one, how many positions' argmax agree, and whether the greedy
continuations are identical. Also prints orchestrator.backend.build_info().

    python3 bench/gpu/smoke_tiny.py [--tiny-dir /tmp/tiny] [--json OUT.json]
                                    [--expect-backend cuda] [--expect-arch 90,120]

Exit status 0 when every check passes, 1 otherwise (the JSON says which failed).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PROMPT = (
    "The capybara is the largest living rodent. It lives in savannas and dense forests near water, "
    "in groups of ten to twenty, and it is a good swimmer that can stay under water for minutes."
)
N_PROMPT = 32
N_GEN = 16
N_CTX, N_BATCH, FLASH_ATTN = 512, 64, "on"
ROLES = {"cpu": (0, True), "gpu": (999, False), "ngl0": (0, False)}  # n_gpu_layers, hide the GPU
MAX_REL_L2 = 2e-2  # BF16 weights: CPU and CUDA round activations differently


def prompt_tokens(model) -> list[int]:
    tokens = model.tokenize(PROMPT)
    while len(tokens) < N_PROMPT:
        tokens += tokens
    return tokens[:N_PROMPT]


def run_role(role: str, model_path: Path, out_dir: Path) -> None:
    """Child process: logits of every prompt position and a greedy continuation, to out_dir."""
    import numpy as np

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            text = record.getMessage()
            if any(k in text for k in ("offload", "CUDA", "GPU", "device", "backend")):
                lines.append(text)

    native = logging.getLogger("llama.cpp")
    native.setLevel(logging.DEBUG)
    native.addHandler(Keep())
    native.propagate = False

    from orchestrator.backend import build_info, llama
    from orchestrator.llama import Batch, Context, ContextParams, Model
    from orchestrator.llama_engine import EngineConfig, LlamaEngine
    from orchestrator.types import GenerationRequest, SamplingParams, TokenEvent

    n_gpu_layers = ROLES[role][0]
    params = ContextParams(n_ctx=N_CTX, n_batch=N_BATCH, flash_attn=FLASH_ATTN)
    t0 = time.perf_counter()
    with Model(model_path, n_gpu_layers) as model:
        tokens = prompt_tokens(model)
        with Context(model, params) as ctx, Batch(params.n_batch) as batch:
            for i, tok in enumerate(tokens):
                batch.add(tok, i, 0, True)
            t1 = time.perf_counter()
            ctx.decode(batch)
            t_decode = time.perf_counter() - t1
            logits = np.stack([ctx.logits(i).copy() for i in range(len(tokens))])
    np.save(out_dir / f"{role}.npy", logits)

    engine = LlamaEngine(str(model_path), EngineConfig(context=params), n_gpu_layers)
    try:
        request = GenerationRequest(tuple(tokens), SamplingParams(temperature=0.0, max_tokens=N_GEN))
        reader = engine.submit(request)
        gen, text = [], []
        for event in reader:
            if isinstance(event, TokenEvent):
                if event.token >= 0:
                    gen.append(event.token)
                text.append(event.text)
        finish = reader.finish
    finally:
        engine.close()
    info = {
        "role": role,
        "n_gpu_layers": n_gpu_layers,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "supports_gpu_offload": bool(llama().llama_supports_gpu_offload()),
        "build_info": asdict(build_info()),
        "prompt_tokens": tokens,
        "prompt_decode_ms": 1000.0 * t_decode,
        "seconds": time.perf_counter() - t0,
        "continuation": gen,
        "continuation_text": "".join(text),
        "finish_reason": finish.reason.value,
        "native_log": lines[:40],
    }
    (out_dir / f"{role}.json").write_text(json.dumps(info, indent=2))


def compare(ref, other) -> dict:
    import numpy as np

    ref64, oth64 = ref.astype(np.float64), other.astype(np.float64)
    diff = oth64 - ref64
    return {
        "finite": bool(np.isfinite(other).all()),
        "max_abs_delta_logit": float(np.abs(diff).max()),
        "rel_l2_all_positions": float(np.linalg.norm(diff) / np.linalg.norm(ref64)),
        "rel_l2_last_position": float(np.linalg.norm(diff[-1]) / np.linalg.norm(ref64[-1])),
        "max_abs_delta_logit_last_position": float(np.abs(diff[-1]).max()),
        "argmax_agree_positions": int((ref.argmax(1) == other.argmax(1)).sum()),
        "argmax_agree_last_position": bool(ref[-1].argmax() == other[-1].argmax()),
        "ref_logit_abs_max": float(np.abs(ref64).max()),
        "ref_logit_std": float(ref64.std()),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny-dir", type=Path, default=Path("/tmp/tiny"))
    ap.add_argument("--json", type=Path, default=None, help="write the report here too")
    ap.add_argument("--expect-backend", default="cuda")
    ap.add_argument("--expect-arch", default="90,120")
    ap.add_argument("--role", choices=list(ROLES), help=argparse.SUPPRESS)  # child process
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.role:
        run_role(args.role, args.model, args.out_dir)
        return 0

    import numpy as np

    from mcformat.tiny import ensure_tiny_qwen35

    t0 = time.perf_counter()
    model_path = ensure_tiny_qwen35(args.tiny_dir)
    report: dict = {"model": str(model_path), "make_tiny_seconds": time.perf_counter() - t0}
    report["settings"] = {"n_ctx": N_CTX, "n_batch": N_BATCH, "flash_attn": FLASH_ATTN,
                          "n_prompt": N_PROMPT, "n_gen": N_GEN}  # fmt: skip
    roles, logits = {}, {}
    with tempfile.TemporaryDirectory(prefix="mc-smoke-") as tmp:
        for role, (_, hide_gpu) in ROLES.items():
            env = dict(os.environ)
            if hide_gpu:
                env["CUDA_VISIBLE_DEVICES"] = ""
            cmd = [sys.executable, __file__, "--role", role, "--model", str(model_path), "--out-dir", tmp]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            if proc.returncode != 0 or not (Path(tmp) / f"{role}.json").is_file():
                roles[role] = {"error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-3000:]}
                print(
                    f"[smoke] role {role} FAILED (exit {proc.returncode}):\n{proc.stderr[-3000:]}", flush=True
                )
                continue
            roles[role] = json.loads((Path(tmp) / f"{role}.json").read_text())
            logits[role] = np.load(Path(tmp) / f"{role}.npy")
            print(f"[smoke] role {role}: {roles[role]['seconds']:.1f} s, "
                  f"continuation {roles[role]['continuation']}", flush=True)  # fmt: skip
    report["roles"] = roles
    report["build_info"] = next((r["build_info"] for r in roles.values() if "build_info" in r), None)

    checks = {}
    bi = report["build_info"] or {}
    checks["backend"] = bi.get("backend") == args.expect_backend
    checks["arch"] = bi.get("arch") == args.expect_arch
    for role in ("gpu", "ngl0"):
        if "cpu" in logits and role in logits:
            cmp = compare(logits["cpu"], logits[role])
            cmp["same_prompt_tokens"] = roles[role]["prompt_tokens"] == roles["cpu"]["prompt_tokens"]
            a, b = roles["cpu"]["continuation"], roles[role]["continuation"]
            cmp["continuation_identical"] = a == b
            diverge = [i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y]
            cmp["continuation_common_prefix"] = diverge[0] if diverge else min(len(a), len(b))
            report[f"{role}_vs_cpu"] = cmp
    g = report.get("gpu_vs_cpu")
    checks["gpu_ran"] = g is not None
    if g:
        checks["finite"] = g["finite"]
        checks["rel_l2"] = g["rel_l2_all_positions"] < MAX_REL_L2
        checks["argmax_last"] = g["argmax_agree_last_position"]
    report["checks"] = checks
    report["pass"] = all(checks.values())

    print(f"[smoke] build_info: {json.dumps(report['build_info'])}")
    for role in ("gpu", "ngl0"):
        c = report.get(f"{role}_vs_cpu")
        if c:
            print(f"[smoke] {role} vs cpu: max|dlogit| {c['max_abs_delta_logit']:.3e}  "
                  f"rel L2 {c['rel_l2_all_positions']:.3e} (last {c['rel_l2_last_position']:.3e})  "
                  f"argmax agree {c['argmax_agree_positions']}/{N_PROMPT} "
                  f"(last {c['argmax_agree_last_position']})  "
                  f"continuation identical {c['continuation_identical']} "
                  f"(common prefix {c['continuation_common_prefix']})")  # fmt: skip
    print(f"[smoke] checks {checks} -> {'PASS' if report['pass'] else 'FAIL'}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
