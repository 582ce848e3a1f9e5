#!/usr/bin/env bash
# MegaCapybara on an NVIDIA GPU machine without network: build and install the patched CUDA wheel,
# smoke-test it on the tiny qwen35 model (CPU vs GPU), then benchmark a random-weight 27B qwen35.
#
# usage, from the repository root:  OUT=DIR bash bench/gpu/device_foundation.sh [deadline_seconds]
#
# Needs in .device/ (git-ignored): llama_cpp_python-0.3.36.tar.gz (python ggml-patches/build.py
# --pack-sdist), whl/ with the diskcache and gguf wheels, gen_qwen35_gguf.py. Needs nvcc, cmake,
# ninja and scikit-build-core in python3's environment.
#
# MC_ONLY_ENGINE=1 skips the smoke test and the single-stream benches; MC_ENGINE_ARGS passes
# arguments to bench/gpu/engine_gpu.py (which writes its JSON straight into $OUT).
#
# Idempotent: state lives in $MC_STATE (default /tmp/mcf) and marker files there, so a call that
# runs out of its deadline is resumed by the next call with the same command. The CUDA build
# and the 27B model generation run in the background (setsid) and outlive a call. Every call
# copies what it has into $OUT: steps.log env.txt build.log run.log smoke.json bench-27b*.json.
set -u
DEADLINE=${1:-570}
ROOT=$(pwd)
S=${MC_STATE:-/tmp/mcf}
: "${OUT:?set OUT to the folder for results}"
MODEL=${MC_BENCH_MODEL:-/tmp/q27.gguf}
CACHE=${MC_BUILD_CACHE:-/tmp/mc-cache}
SDIST=.device/llama_cpp_python-0.3.36.tar.gz
mkdir -p "$S" "$OUT"
export PATH=/usr/local/cuda/bin:$PATH PYTHONUNBUFFERED=1
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_NO_INDEX=1

log() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$S/steps.log"; }
left() { echo $((DEADLINE - SECONDS)); }
ship() {
  for f in steps.log env.txt build.log run.log smoke.json bench-27b.json bench-27b-kvq8.json; do
    [ -f "$S/$f" ] && cp -f "$S/$f" "$OUT/$f"
  done
  return 0
}
trap ship EXIT
log "=== call start in $ROOT, deadline ${DEADLINE}s"

if [ ! -f "$S/env.txt" ]; then
  { date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv;
    nvidia-smi; nvcc --version; cmake --version | head -1; echo "ninja $(ninja --version)";
    python3 --version; echo "nproc $(nproc)"; free -g; df -h /tmp;
    python3 -c 'import torch, numpy; print("torch", torch.__version__, "numpy", numpy.__version__)';
  } > "$S/env.txt" 2>&1
fi

# (a) the pure-Python wheels the image lacks
if [ ! -f "$S/whl.done" ]; then
  python3 -m pip install -q --no-index --no-deps .device/whl/*.whl >> "$S/run.log" 2>&1 \
    && touch "$S/whl.done" || { log "wheel install FAILED"; tail -20 "$S/run.log"; exit 1; }
  log "wheels installed: $(ls .device/whl)"
fi

# (b) the patched CUDA build, in the background; run from a copy under $S so that a later call's
# fresh working tree cannot pull files from under it
BUILD_CMD="python3 ggml-patches/build.py --python python3 --backend cuda --offline --sdist $SDIST --cache-dir $CACHE --jobs 16"
if [ ! -f "$S/build.started" ]; then
  rm -rf "$S/src" && mkdir -p "$S/src/.device" && cp -r ggml-patches "$S/src/" && cp "$SDIST" "$S/src/.device/"
  touch "$S/build.started"
  log "build started: $BUILD_CMD"
  # PIP_VERBOSE shows CMake's and ninja's output, so the log shows progress ([n/N] lines)
  setsid nohup env PIP_VERBOSE=1 bash -c 'cd "$1/src" && t0=$(date +%s.%N) && $2 > "$1/build.log" 2>&1; rc=$?;
    echo "$t0 $(date +%s.%N)" > "$1/build.times"; echo $rc > "$1/build.rc"' _ "$S" "$BUILD_CMD" \
    < /dev/null > /dev/null 2>&1 &
fi

# (d) the random 27B model, in the background at low priority while the build runs (one core of 16,
# mostly writing 15 GB). The vocabulary comes from the same sdist the build unpacks.
if [ ! -f "$S/gen.started" ]; then
  mkdir -p "$S/vocab" && tar xzf "$SDIST" -C "$S/vocab" --wildcards '*/models/ggml-vocab-qwen35.gguf'
  VOCAB=$(ls "$S"/vocab/*/vendor/llama.cpp/models/ggml-vocab-qwen35.gguf)
  cp .device/gen_qwen35_gguf.py "$S/gen_qwen35_gguf.py"
  touch "$S/gen.started"
  GEN_CMD="python3 .device/gen_qwen35_gguf.py $MODEL --preset 27b --vocab-gguf $VOCAB --out-type q6_k"
  log "gen started (nice 19): $GEN_CMD"
  setsid nohup bash -c 'cd "$1" && t0=$(date +%s.%N) && nice -n 19 python3 gen_qwen35_gguf.py "$2" --preset 27b \
    --vocab-gguf "$3" --out-type q6_k > gen.log 2>&1; rc=$?; echo "$t0 $(date +%s.%N)" > gen.times; echo $rc > gen.rc' \
    _ "$S" "$MODEL" "$VOCAB" < /dev/null > /dev/null 2>&1 &
fi

# wait for the build, logging progress once a minute
last=0
while [ ! -f "$S/build.rc" ] && [ "$(left)" -gt 25 ]; do
  sleep 5
  if [ $((SECONDS - last)) -ge 60 ]; then
    last=$SECONDS
    log "building: $(grep -aoE '\[[0-9]+/[0-9]+\]' "$S/build.log" 2>/dev/null | tail -1) gen.rc=$(cat "$S/gen.rc" 2>/dev/null)"
  fi
done
if [ ! -f "$S/build.rc" ]; then log "build still running; call again with the same command"; exit 3; fi
if [ "$(cat "$S/build.rc")" != 0 ]; then
  log "BUILD FAILED (exit $(cat "$S/build.rc"))"; grep -a -iE "error|fail" "$S/build.log" | head -30; tail -60 "$S/build.log"; exit 1
fi
if [ ! -f "$S/build.seconds" ]; then
  read -r t0 t1 < "$S/build.times"
  python3 -c "print(round($t1 - $t0, 1))" > "$S/build.seconds"
  log "build done: $(cat "$S/build.seconds") s in all; $(grep -a 'wheel built in' "$S/build.log"); $(grep -a 'installed:' "$S/build.log")"
fi
# Work-around (MC_PRELOAD_STDCXX=0 turns it off): this CUDA build's libggml-cuda.so exports its own
# copy of libstdc++ symbols (std::basic_ostream::_M_insert<long>, std::codecvt...); when numpy is
# imported before llama_cpp (orchestrator/llama.py does), libllama's llama_model::print_info() binds
# to that copy and crashes with SIGSEGV inside llama_model_load_from_file. Loading the system
# libstdc++ first makes every std:: symbol resolve to it.
if [ "${MC_PRELOAD_STDCXX:-1}" = 1 ]; then
  LIBDIR=$(python3 -c 'import importlib.util as u, os; print(os.path.dirname(u.find_spec("llama_cpp").origin))')/lib
  STDCXX=$(ldd "$LIBDIR/libllama.so" | awk '/libstdc\+\+/ {print $3}')
  export LD_PRELOAD=$STDCXX
  log "LD_PRELOAD=$LD_PRELOAD (libggml-cuda.so exports $(nm -DC --defined-only "$LIBDIR/libggml-cuda.so" | grep -c 'std::') std:: symbols)"
fi
python3 -c 'from orchestrator.backend import build_info; print("build_info:", build_info())' 2>&1 | tee -a "$S/steps.log"

# (c) smoke test: tiny qwen35, CPU vs GPU
if [ ! -f "$S/smoke.ok" ] && [ -z "${MC_ONLY_ENGINE:-}" ] && [ "$(left)" -gt 90 ]; then
  log "smoke: python3 bench/gpu/smoke_tiny.py --tiny-dir /tmp/tiny --json smoke.json"
  echo "=== smoke" >> "$S/run.log"
  timeout $(( $(left) - 10 )) python3 bench/gpu/smoke_tiny.py --tiny-dir /tmp/tiny --json "$S/smoke.json" \
    --expect-backend cuda --expect-arch 90,120 2>&1 | tee -a "$S/run.log" | grep -a '^\[smoke\]'
  rc=${PIPESTATUS[0]}
  log "smoke exit $rc"
  [ "$rc" = 0 ] && touch "$S/smoke.ok"
fi

# wait for the model
while [ ! -f "$S/gen.rc" ] && [ "$(left)" -gt 60 ]; do sleep 2; done
if [ ! -f "$S/gen.rc" ]; then log "gen still running; call again"; exit 3; fi
if [ "$(cat "$S/gen.rc")" != 0 ]; then log "GEN FAILED"; tail -20 "$S/gen.log"; exit 1; fi
if ! grep -q '^=== gen' "$S/run.log" 2>/dev/null; then
  { echo "=== gen: $(awk '{printf "%.1f s", $2 - $1}' "$S/gen.times")"; cat "$S/gen.log"; stat -c '%s bytes %n' "$MODEL"; } >> "$S/run.log"
  log "gen done: $(awk '{printf "%.1f s", $2 - $1}' "$S/gen.times"), $(stat -c '%s bytes' "$MODEL")"
fi

# (e) single-stream prefill/decode through MegaCapybara's Python path
bench() {  # name, then extra flags
  local name=$1; shift
  [ -f "$S/$name.done" ] && return 0
  if [ "$(left)" -lt 100 ]; then log "skip $name (left $(left) s)"; return 1; fi
  local cmd="python3 -m orchestrator bench --model $MODEL --ctx 4096 --flash-attn on --prompt-tokens 512 --gen-tokens 128 $* --json $S/$name.json"
  log "$name: $cmd"
  echo "=== $name: $cmd" >> "$S/run.log"
  local t0=$SECONDS
  timeout $(( $(left) - 10 )) $cmd >> "$S/run.log" 2>&1
  local rc=$?
  log "$name exit $rc in $((SECONDS - t0)) s: $(tail -1 "$S/run.log")"
  [ $rc -eq 0 ] && touch "$S/$name.done"
}
if [ -z "${MC_ONLY_ENGINE:-}" ]; then
  bench bench-27b
  bench bench-27b-kvq8 --cache-type-k q8_0 --cache-type-v q8_0
fi

# per-token decode times through the same Python wrappers: how much is warm-up (graph capture).
# llama_decode returns before the GPU has finished (llama.cpp synchronizes lazily, when logits are
# read), so every timed step ends with llama_synchronize, as llama-bench does. (The 2026-11-29 run
# of this step timed without it: its decode medians are valid, its prefill figures are not.)
if [ ! -f "$S/profile.done" ] && [ -z "${MC_ONLY_ENGINE:-}" ] && [ "$(left)" -gt 90 ]; then
  log "decode profile (per-token times, f16 KV)"
  echo "=== decode profile" >> "$S/run.log"
  timeout $(( $(left) - 10 )) python3 - "$MODEL" >> "$S/run.log" 2>&1 <<'EOF' && touch "$S/profile.done"
import json, statistics, sys, time
from orchestrator.backend import llama
from orchestrator.llama import Batch, Context, ContextParams, Model
params = ContextParams(n_ctx=4096, n_batch=512, n_threads=16, flash_attn="on")
with Model(sys.argv[1], 999) as model, Context(model, params) as ctx, Batch(512) as batch:
    toks = (model.tokenize("The quick brown fox jumps over the lazy dog. ") * 512)[:512]
    for i, t in enumerate(toks):
        batch.add(t, i, 0, i == 511)
    ctx.decode(batch); llama().llama_synchronize(ctx.ptr)
    ms = []
    for i in range(256):
        batch.clear(); batch.add(toks[i % 512], 512 + i, 0, True)
        t0 = time.perf_counter(); ctx.decode(batch); llama().llama_synchronize(ctx.ptr); ms.append(1000 * (time.perf_counter() - t0))
    pre = []
    for r in range(3):  # prefill of 512 tokens into an emptied cache, after the first
        ctx.clear(); batch.clear()
        for i, t in enumerate(toks):
            batch.add(t, i, 0, i == 511)
        t0 = time.perf_counter(); ctx.decode(batch); llama().llama_synchronize(ctx.ptr); pre.append(time.perf_counter() - t0)
out = {"first_8_ms": [round(x, 2) for x in ms[:8]], "median_ms_all": statistics.median(ms),
       "median_ms_after_8": statistics.median(ms[8:]), "mean_ms_after_8": statistics.fmean(ms[8:]),
       "tok_s_median_after_8": 1000 / statistics.median(ms[8:]), "mean_ms_first_128": statistics.fmean(ms[:128]),
       "prefill512_tok_s_repeats": [round(512 / x, 1) for x in pre]}
print("PROFILE", json.dumps(out))
EOF
  log "$(grep -a '^PROFILE' "$S/run.log" | tail -1)"
fi
# (f) the engine: aggregate decode with 1/4/12 concurrent tasks; pause/resume at 8k and 32k tokens
if [ ! -f "$S/engine.done" ] && [ "$(left)" -gt 60 ]; then
  log "engine: python3 bench/gpu/engine_gpu.py $MODEL --json $S/engine-gpu.json"
  echo "=== engine" >> "$S/run.log"
  timeout $(( $(left) - 10 )) python3 bench/gpu/engine_gpu.py "$MODEL" --json "$OUT/engine-gpu.json" ${MC_ENGINE_ARGS:-} 2>&1 \
    | grep -av INFO | tee -a "$S/run.log"
  [ "${PIPESTATUS[0]}" = 0 ] && touch "$S/engine.done"
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv >> "$S/env.txt" 2>&1
log "=== call end"
