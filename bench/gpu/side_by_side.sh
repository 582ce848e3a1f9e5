#!/usr/bin/env bash
# Stock llama.cpp vs MegaCapybara's patched llama.cpp (same pinned version) on one NVIDIA GPU, in one
# run: single-stream decode at depth 0 / 4k / 32k, verify cost (1 sequence and 12 sequences x k
# tokens), aggregate decode at 1-16 sequences (llama-batched-bench), the patched kernels'
# correctness (test-backend-ops, CUDA vs CPU), optionally an ncu kernel profile of one decode step,
# then page-locked memory by NUMA binding (bench/gpu/numa_probe.py), MegaCapybara's engine (12 tasks,
# pause/resume at 8k / 32k, f16 and q8_0 KV) and the copy bandwidths. Writes bench/results-style JSON and prints the table.
#
# usage, from the repository root:   OUT=DIR bash bench/gpu/side_by_side.sh [deadline_seconds]
#
# Needs: nvcc, cmake, ninja, g++, python3 with torch (for the bandwidth figures and the engine's
# page-locked pool), numpy and gguf; the llama-cpp-python sdist (`python ggml-patches/build.py
# --pack-sdist .device/llama_cpp_python-0.3.36.tar.gz`, done here when missing and pip has network;
# MC_SDIST overrides), and, for the engine,
# the diskcache and gguf wheels in .device/whl/ where pip has no network (MC_SBS_WHEELS; python3
# bench/gpu/prepare_device.py puts the sdist and the wheels in .device/ on a machine with network). The 27B model:
# MC_BENCH_MODEL names an existing qwen35 GGUF, else `python3 -m mcformat.random_model` writes a
# random-weight one at the Qwen3.8 27B shapes (MC_SBS_WEIGHTS: q4_0, the default, or q8_0; the
# output matrix Q6_K), 15.5 GB for Q4_0.
#
# One build tree: stock first (programs and shared libraries copied to $S/stock), then the patch
# series on top and an incremental rebuild (copied to $S/patched), so the two differ only by the
# patches. The build and the model generation run in the background (setsid) and outlive a call;
# every step leaves a marker file, so running the same command again resumes (a call that ends
# with exit 3 asks for that). The state folder keeps the patch series and the builds it holds
# (build-for.txt): a call from a tree with another series, or asking for a stock build the folder
# does not have, is refused (exit 2) instead of measuring the old build.
#
# Settings (environment): MC_STATE (default /tmp/mcs), MC_CUDA_ARCH (default: this GPU's),
# MC_SBS_BUILDS (stock,patched), MC_SBS_PROFILE (builds to profile with ncu, e.g. stock),
# MC_SBS_PROFILE_K (tokens of the profiled step, a comma list, default 1; 16: a verify step; 12x1:
# 12 sequences of one token each), MC_SBS_PROFILE_SETTINGS (a space list of VAR=VAL[+VAR=VAL] settings
# to profile under, "default" for none; default: default),
# MC_SBS_KDETAIL (a kernel-name regex, e.g. mc_mmq: ncu's speed-of-light, occupancy, warp-state,
# memory and instruction-statistics sections, and the warps stalled per issued instruction by
# reason, of the first MC_SBS_KDETAIL_COUNT (24) matching launches in a step of MC_SBS_KDETAIL_K
# (16) tokens, for each build in MC_SBS_KDETAIL_BUILDS (default patched); MC_SBS_KDETAIL_SETTINGS:
# a space list of VAR=VAL[+VAR=VAL] settings to run it under too, "default" for none); the patched build's
# mc-mmv.cu SASS (cuobjdump, where the machine has it),
# MC_SBS_ENGINE (1: run the engine part), MC_SBS_ENGINE_REPACKED (engine_gpu.py arguments for a second
# engine run with repacked_weights MC_SBS_ENGINE_REPACKED_MODE, default on: patch 0015's copies; the first
# run has the engine's default, auto; e.g. "--tasks 12 --depths none --breakdown , --skip-sampled"),
# MC_SBS_OPS (ops checked by test-backend-ops; the default covers every patched op and fusion),
# MC_SBS_VARIANTS (settings of the patched build to measure too, a comma list of NAME:VAR=VAL[+VAR=VAL]
# with NAME starting with v, e.g. vnomma:MC_MMV_MMA_MIN_COLS=99; a bare number N means
# vN:MC_MMV_VARIANT=N; e.g. vng:MC_MMV_GROUP=0 measures the patched build without the grouping),
# MC_SBS_VARIANT_MEASURE (what to measure for each: logits,tg,verify1,ops (test-backend-ops of the
# MC_SBS_OPS list, or MC_SBS_VARIANT_OPS_<name>, under the setting); also verify12, batched;
# MC_SBS_VARIANT_MEASURE_<name> for one; MC_SBS_VARIANT_STEP_CAP: the most seconds one of their steps runs),
# MC_SBS_LABS (kernel labs on the patched tree right after the build: gdn, mmr1, mmr9..mmr16;
# MC_SBS_LAB_TOKENS for gdn's token counts),
# MC_SBS_COMMIT (the git commit to record, default this tree's HEAD), MC_SBS_PREBUILT (0: build the patched
# tree here even where the folder MC_SBS_PREBUILT_DIR, default .device, holds bench/gpu/prebuild.py's archive
# for this series and arch),
# MC_SBS_MEASURE (logits,tg,verify1,verify12,batched), MC_SBS_DRAWS (processes each verify measure
# runs, one after another, default 3: the figure is their median, the spread between processes of
# one build ~3-7% at 16 tokens, larger than within one), MC_SBS_ENGINE_NEED (seconds the engine part
# must have left to start, default 240), MC_ENGINE_ARGS (for bench/gpu/engine_gpu.py,
# default --tasks 12), MC_SBS_WEIGHTS (q4_0 or q8_0 random model), MC_SBS_BACKEND (cpu: the same
# flow without a GPU, to check this script).
set -u
DEADLINE=${1:-570}
ROOT=$(pwd)
S=${MC_STATE:-/tmp/mcs}
: "${OUT:?set OUT to the folder for results}"
DRAWS=${MC_SBS_DRAWS:-3}  # checked before anything is built or fetched
case $DRAWS in '' | *[!0-9]*) DRAWS_OK=0 ;; *) DRAWS_OK=$(( 10#$DRAWS >= 1 )) ;; esac
[ "$DRAWS_OK" = 1 ] || { echo "MC_SBS_DRAWS=$DRAWS: expected a whole number of at least 1"; exit 2; }
DRAWS=$(( 10#$DRAWS ))
# a command run DRAWS times, one process after another (each draw's JSON lines follow the last's)
REPEAT=(bash -c 'n=$1; shift; for _ in $(seq "$n"); do "$@" || exit; done' draws "$DRAWS")
# A state folder is measured as it stands once built: one built from another patch series, or without
# the stock build this call asks for, would give that build's figures under this tree's commit (run
# BD's third call measured the previous commit's patched-only build so). Refused before anything runs.
series_hash() { (cd "$1" && python3 -c 'import build; print(build.series_hash())'); }  # of a ggml-patches dir
ST=${MC_STATE:-/tmp/mcs}
if [ -f "$ST/build-for.txt" ]; then
  read -r HAD_HASH HAD_STOCK < "$ST/build-for.txt"
  WANT_HASH=$(series_hash ggml-patches) || WANT_HASH=
  case ",${MC_SBS_BUILDS:-stock,patched}," in *,stock,*) WANT_STOCK=1 ;; *) WANT_STOCK=0 ;; esac
  AGAIN="use another MC_STATE (MC_BENCH_MODEL=<its model file> keeps the model) or remove it"
  if [ -z "$WANT_HASH" ]; then
    echo "cannot compute this tree's patch series hash (python3 ggml-patches/build.py)"; exit 2
  elif [ "$WANT_HASH" != "$HAD_HASH" ]; then
    echo "MC_STATE=$ST holds a build of patch series ${HAD_HASH:0:16}, this tree's is ${WANT_HASH:0:16}: $AGAIN"
    exit 2
  elif [ "$WANT_STOCK" = 1 ] && [ "$HAD_STOCK" != 1 ]; then
    echo "MC_STATE=$ST was built without stock (MC_SBS_BUILDS=patched), this call measures stock: $AGAIN"
    exit 2
  fi
fi
SDIST=${MC_SDIST:-.device/llama_cpp_python-0.3.36.tar.gz}
if [ ! -f "$SDIST" ]; then  # a machine with network: fetch the pinned sdist and pack it
  mkdir -p "$(dirname "$SDIST")" && python3 ggml-patches/build.py --pack-sdist "$SDIST" || { echo "no sdist at $SDIST"; exit 1; }
fi
SDIST=$(readlink -f "$SDIST")
WEIGHTS=${MC_SBS_WEIGHTS:-q4_0}  # the random model's weights: q4_0 or q8_0 (output Q6_K either way)
MODEL=${MC_BENCH_MODEL:-$S/random-27b-$WEIGHTS.gguf}
# The GPU machine has no network: what its python lacks comes as wheels in $WHEELS
# (bench/gpu/prepare_device.py puts them there). Checked before anything is built: the random model
# needs gguf, the engine llama_cpp's diskcache; without them a call failed only after its build (run BG).
WHEELS=${MC_SBS_WHEELS:-.device/whl}
need_module() {  # module, why: importable here or its wheel in $WHEELS, else refuse
  python3 -c "import $1" 2> /dev/null || ls "$WHEELS"/"$1"-*.whl > /dev/null 2>&1 || {
    echo "$2 needs the python module $1: not importable here and no $WHEELS/$1-*.whl" \
      "(run python3 bench/gpu/prepare_device.py where there is network, then call again)"; exit 2; }
}
[ -f "$MODEL" ] || need_module gguf "the random model ($MODEL)"
[ "${MC_SBS_ENGINE:-1}" = 1 ] && need_module diskcache "the engine part (MC_SBS_ENGINE=1)"
BUILDS=${MC_SBS_BUILDS:-stock,patched}
PROFILE=${MC_SBS_PROFILE:-}
MC_SBS_PROFILE_K=${MC_SBS_PROFILE_K:-1}
OPS=${MC_SBS_OPS:-MUL_MAT,MUL_MAT_VEC_FUSION,MC_MUL_MAT_GROUP,GATED_DELTA_NET,GATED_DELTA_NET_CACHE_FUSION,MC_GDN_LAYER,SSM_CONV,RMS_NORM,RMS_NORM_MUL_ADD,MC_ADD_RMS_NORM_MUL,CONCAT,MC_GLU_MUL_MAT,RMS_NORM_MUL_ROPE,ROPE_SET_ROWS,MC_ATTN_PRO,MC_CONV_STEP,MC_FATTN_PAD,MC_FATTN_FEW,MC_FFN,MC_GATE_CONT,MC_GATE_MUL_MAT,MC_NORM_MUL_MAT}
MEASURE=,${MC_SBS_MEASURE:-logits,tg,verify1,verify12,batched},  # which measurements per build
ENGINE_ARGS=${MC_ENGINE_ARGS:---tasks 12}
mkdir -p "$S" "$OUT"
export PATH=/usr/local/cuda/bin:$PATH PYTHONUNBUFFERED=1
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
BACKEND=${MC_SBS_BACKEND:-cuda}  # cpu: the same flow without a GPU (to check this script)
if [ "$BACKEND" = cuda ]; then
  ARCH=${MC_CUDA_ARCH:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)}
  BACKEND_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$ARCH"
else
  ARCH=native BACKEND_ARGS="-DGGML_NATIVE=ON"
fi
# test-backend-ops only for the patched build (the series changes it; only the patched one runs it)
TARGETS_STOCK="llama ggml llama-batched-bench"
TARGETS="$TARGETS_STOCK test-backend-ops"

log() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$S/steps.log"; }
left() { echo $((DEADLINE - SECONDS)); }
ship() {  # three files: the device tool brings back only a few
  python3 "$ROOT/bench/gpu/sbs_summary.py" "$S" --out "$OUT/summary.json" > "$OUT/summary.txt" 2>&1
  (cd "$S" && tar czf "$OUT/state.tar.gz" $(ls *.log *.out *.err *.json *.txt 2>/dev/null))
  tail -45 "$OUT/summary.txt"
  return 0
}
trap ship EXIT
# the commit recorded: MC_SBS_COMMIT where the caller knows it better than this copy's git (a tree
# sent to another machine can carry a stale .git: the H200 runs read an older HEAD several times)
COMMIT=${MC_SBS_COMMIT:-$(git -C "$ROOT" rev-parse HEAD 2>/dev/null)}
# the MC_ settings this call's measurements run under (the defaults' literals aside): a call may export
# some (calls.sh sbs after a setting won), and the summary records each call's
SETTINGS=$(env | grep -E '^MC_[A-Z0-9_]+=' | grep -vE '^MC_(SBS_|STATE=|BENCH_MODEL=|CALLS_|SDIST=|CUDA_ARCH=)' |
  sort | tr '\n' ' ')
log "=== call start in $ROOT (commit ${COMMIT:0:10}), deadline ${DEADLINE}s, settings: ${SETTINGS:-none}"

if [ ! -f "$S/env.txt" ]; then
  { date -u +%FT%TZ; echo "commit $COMMIT";
    git -C "$ROOT" status --short 2>/dev/null | head -20;
    nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total,clocks.max.sm --format=csv;
    nvcc --version | tail -2; cmake --version | head -1; echo "ninja $(ninja --version)"; g++ --version | head -1;
    python3 --version; echo "nproc $(nproc)"; free -g | head -2;
  } > "$S/env.txt" 2>&1
  echo "$ARCH" > "$S/arch.txt"
fi

# pure-Python wheels the machine lacks (no network there)
if [ ! -f "$S/whl.done" ] && ls "$WHEELS"/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps "$WHEELS"/*.whl >> "$S/run.log" 2>&1 && touch "$S/whl.done"
fi

# ---- the build: stock, then the patch series on top (background) ----
# build.sh is written again by every call until the build is done, and skips the parts it finished,
# so a call with a fixed script resumes a failed build on a warm machine.
if [ -f "$S/build.rc" ] && [ "$(cat "$S/build.rc")" != 0 ] && [ ! -f "$S/build.retried" ]; then
  log "the last build failed: retrying once ($(tail -1 "$S/build.log"))"
  touch "$S/build.retried"; rm -f "$S/build.rc" "$S/build.started"
fi
if [ ! -f "$S/build.started" ]; then
  if [ ! -d "$S/src" ]; then
    mkdir -p "$S/src" && tar xzf "$SDIST" -C "$S/src" || { log "cannot unpack $SDIST"; exit 1; }
  fi
  mkdir -p "$S/stock" "$S/patched"
  SRCROOT=$(ls -d "$S"/src/*/ | head -1)
  rm -rf "$S/ggml-patches" && cp -r ggml-patches "$S/ggml-patches"
  cp bench/gpu/mc_gpu_bench.cpp "$S/"
  HASH=$(series_hash "$S/ggml-patches")
  case ",$BUILDS," in *,stock,*) BUILD_STOCK=1 ;; *) BUILD_STOCK=0 ;; esac
  echo "$HASH $BUILD_STOCK" > "$S/build-for.txt"  # what the state holds (checked by every later call)
  # the patched build made on the CPU machine (bench/gpu/prebuild.py) for this series and this GPU's
  # arch, where it passes its check here (bench/gpu/use_prebuilt.sh); MC_SBS_PREBUILT=0: build here.
  # With stock in the call, only stock is built here (build.sh skips the patched build)
  PREBUILT=${MC_SBS_PREBUILT_DIR:-$ROOT/.device}/prebuilt-patched-${HASH:0:16}-sm$ARCH.tar.xz
  TAKEN=0
  if [ "$BACKEND" = cuda ] && [ "${MC_SBS_PREBUILT:-1}" = 1 ] && [ -f "$PREBUILT" ]; then
    MSG=$(bash "$ROOT/bench/gpu/use_prebuilt.sh" "$S" "$PREBUILT" CUDA0 "$HASH") && TAKEN=1
    log "$MSG"
  fi
  [ $TAKEN = 0 ] || touch "$S/patched.prebuilt"
  if [ $TAKEN = 1 ]; then
    # the archive's mc_gpu_bench is the measuring source of the day prebuild.py ran (its key is the series
    # alone): this tree's is built against the archive's libraries instead (seconds), so that a change to
    # the measuring needs no new archive; where it does not build, the archive's stays (logged)
    BL=${SRCROOT}vendor/llama.cpp t0=$SECONDS
    if g++ -O2 -std=c++17 -I"$BL/include" -I"$BL/ggml/include" "$S/mc_gpu_bench.cpp" -L"$S/patched" -lllama -lggml \
         -lggml-base -ldl -Wl,-rpath-link,"$S/patched" -Wl,--disable-new-dtags,-rpath,'$ORIGIN' \
         -o "$S/patched/mc_gpu_bench.new" 2> "$S/bench-build.err"; then
      mv -f "$S/patched/mc_gpu_bench.new" "$S/patched/mc_gpu_bench"
      echo "patched_bench_rebuilt_s $((SECONDS - t0))" >> "$S/build-times.txt"
      log "mc_gpu_bench built from this tree's source against the archive's libraries"
    else
      rm -f "$S/patched/mc_gpu_bench.new"
      log "mc_gpu_bench from this tree's source did not build, the archive's kept: $(head -c 300 "$S/bench-build.err")"
    fi
  fi
  if [ $TAKEN = 1 ] && [ $BUILD_STOCK = 0 ]; then
    # the source tree patched as the build would leave it (the kernel labs compile from it)
    for p in $(grep -v '^#' "$S/ggml-patches/series"); do
      patch -p1 --forward --batch --silent -d "$SRCROOT" < "$S/ggml-patches/patches/$p" > /dev/null ||
        { log "patch $p failed on the source tree (the labs' copy)"; break; }
    done
    touch "$S/patches.applied" "$S/build.started"
    echo 0 > "$S/build.rc"
  fi
fi
if [ ! -f "$S/build.started" ]; then
  cat > "$S/build.sh" <<EOF
set -u
L=${SRCROOT}vendor/llama.cpp
t0=\$(date +%s)
cmake -S \$L -B $S/build -G Ninja $BACKEND_ARGS -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
  -DLLAMA_BUILD_APP=OFF -DBUILD_SHARED_LIBS=ON -DCMAKE_SKIP_BUILD_RPATH=ON \
  -DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL \
  -DMC_PATCH_SERIES_HASH=$HASH -DMC_BUILD_BACKEND=$BACKEND -DMC_BUILD_ARCH=$ARCH -DMC_PACKAGE_VERSION=0.3.36 || exit 1
stage() {  # copy the build's programs and libraries to \$1, and build the measuring program there
  cp -f $S/build/bin/*.so* $S/build/bin/llama-batched-bench \$1/ &&
  { [ ! -f $S/build/bin/test-backend-ops ] || cp -f $S/build/bin/test-backend-ops \$1/; } &&
  g++ -O2 -std=c++17 -I\$L/include -I\$L/ggml/include $S/mc_gpu_bench.cpp -L\$1 -lllama -lggml -lggml-base -ldl \
    -Wl,-rpath-link,\$1 -Wl,--disable-new-dtags,-rpath,'\$ORIGIN' -o \$1/mc_gpu_bench
}
if [ ! -f $S/stock.done ] && [ $BUILD_STOCK = 1 ]; then  # MC_SBS_BUILDS without stock: patched only
  cmake --build $S/build -j \$(nproc) --target $TARGETS_STOCK || exit 1
  stage $S/stock || exit 1
  echo "stock_build_s \$((\$(date +%s) - t0))" >> $S/build-times.txt  # after a prebuilt's lines
  touch $S/stock.done
fi
t1=\$(date +%s)
if [ ! -f $S/patches.applied ]; then
  for p in \$(grep -v '^#' $S/ggml-patches/series); do
    patch -p1 --forward --batch -d $SRCROOT < $S/ggml-patches/patches/\$p || { echo "patch \$p failed"; exit 1; }
  done
  touch $S/patches.applied
fi
[ ! -f $S/patched.prebuilt ] || exit 0  # the patched programs came from the archive; the source is patched (labs)
cmake $S/build > /dev/null || exit 1  # a patch may add source files: configure again
cmake --build $S/build -j \$(nproc) --target $TARGETS || exit 1
stage $S/patched || exit 1
echo "patched_rebuild_s \$((\$(date +%s) - t1))" >> $S/build-times.txt
EOF
  touch "$S/build.started"
  log "build started (arch $ARCH, series $HASH)"
  setsid nohup bash -c "bash $S/build.sh > $S/build.log 2>&1; echo \$? > $S/build.rc" < /dev/null > /dev/null 2>&1 &
fi

# ---- the model (background, low priority): mcformat.random_model, quantized blocks written directly ----
if [ ! -f "$MODEL" ] && [ ! -f "$S/gen.started" ]; then
  touch "$S/gen.started"
  log "model generation started: $MODEL (random qwen35 27B, $WEIGHTS)"
  setsid nohup bash -c "cd $ROOT && nice -n 19 python3 -m mcformat.random_model $MODEL --preset 27b --weights $WEIGHTS \
    > $S/gen.log 2>&1; echo \$? > $S/gen.rc" < /dev/null > /dev/null 2>&1 &
fi

last=0
while [ ! -f "$S/build.rc" ] && [ "$(left)" -gt 30 ]; do
  sleep 5
  if [ $((SECONDS - last)) -ge 60 ]; then
    last=$SECONDS
    log "building: $(grep -aoE '\[[0-9]+/[0-9]+\]' "$S/build.log" 2>/dev/null | tail -1)"
  fi
done
[ -f "$S/build.rc" ] || { log "build still running; call again with the same command"; exit 3; }
if [ "$(cat "$S/build.rc")" != 0 ]; then
  log "BUILD FAILED"; grep -a -iE "error|failed" "$S/build.log" | head -30; tail -30 "$S/build.log"; exit 1
fi
[ -f "$S/build.logged" ] || { log "build done: $(tr '\n' ' ' < "$S/build-times.txt")"; touch "$S/build.logged"; }
while [ ! -f "$MODEL" ] && [ ! -f "$S/gen.rc" ] && [ "$(left)" -gt 60 ]; do sleep 2; done
if [ -f "$S/gen.rc" ] && [ "$(cat "$S/gen.rc")" != 0 ]; then log "MODEL GENERATION FAILED"; tail "$S/gen.log"; exit 1; fi
[ -f "$S/gen.rc" ] || [ -f "$MODEL" ] || { log "model still being written; call again"; exit 3; }
stat -c '%s' "$MODEL" > "$S/model-bytes.txt"

# ---- the measurements: each step once, with a marker ----
step() {  # name, minimum seconds needed, command...
  local name=$1 need=$2; shift 2
  [ -f "$S/$name.done" ] && return 0
  if [ "$(left)" -lt "$need" ]; then log "not enough time for $name; call again"; exit 3; fi
  log "$name: $*"
  local t0=$SECONDS limit=$(( $(left) - 10 ))
  # a variant's step stops at MC_SBS_VARIANT_STEP_CAP seconds (a kernel that hangs costs no more)
  [ -n "${STEP_CAP:-}" ] && [ "$STEP_CAP" -lt "$limit" ] && limit=$STEP_CAP
  timeout "$limit" "$@" > "$S/$name.out" 2> "$S/$name.err"
  local rc=$?
  log "$name exit $rc in $((SECONDS - t0)) s"
  [ $rc = 0 ] && touch "$S/$name.done" || tail -5 "$S/$name.err"
}
[ "$BACKEND" = cuda ] && step bandwidth 30 python3 "$ROOT/bench/gpu/bandwidth.py"
# the kernel labs first (MC_SBS_LABS, e.g. "gdn mmr16 mmr1"): the patched tree's kernels launched
# directly (bench/gpu/kernel_lab.py), a minute or two, kept if a later step runs out of time
if [ "$BACKEND" = cuda ] && [ -n "${MC_SBS_LABS:-}" ]; then
  LABSRC=$(ls -d "$S"/src/*/ | head -1)vendor/llama.cpp
  for lab in $MC_SBS_LABS; do
    case $lab in
      gdn) step lab-gdn 120 python3 "$ROOT/bench/gpu/kernel_lab.py" gdn --src "$LABSRC" --json "$S/lab-gdn.json" \
             --tokens "${MC_SBS_LAB_TOKENS:-1,2,4,8,16,32,512}" ;;
      mmr1 | mmr9 | mmr1[0-6]) step "lab-$lab" 150 python3 "$ROOT/bench/gpu/kernel_lab.py" mmr --src "$LABSRC" \
             --json "$S/lab-$lab.json" --columns "${lab#mmr}" ;;
      *) log "MC_SBS_LABS: $lab is not one of gdn, mmr1, mmr9 .. mmr16; skipped" ;;
    esac
  done
fi
# one GPU: llama.cpp would split the model over every visible GPU
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
want() { case "${2:-$MEASURE}" in *",$1,"*) return 0 ;; esac; return 1; }  # name [,list,]
for B in ${BUILDS//,/ }; do
  export LD_LIBRARY_PATH=$S/$B
  want logits && step "$B-logits" 60 "$S/$B/mc_gpu_bench" logits "$MODEL" "$S/$B-logits.bin"
  want tg && step "$B-tg" 150 "$S/$B/mc_gpu_bench" tg "$MODEL" 0,4096,32768 64
  want verify1 && step "$B-verify1" $((60 + 20 * DRAWS)) "${REPEAT[@]}" "$S/$B/mc_gpu_bench" verify "$MODEL" 512 1 \
    1,2,4,8,16,32,64
  want verify12 && step "$B-verify12" $((60 + 20 * DRAWS)) "${REPEAT[@]}" "$S/$B/mc_gpu_bench" verify "$MODEL" 512 12 \
    1,2,4,8,16
  want batched && step "$B-batched" 60 "$S/$B/llama-batched-bench" -m "$MODEL" -c 16384 -b 2048 -ub 512 \
    -npp 512 -ntg 128 -npl 1,2,4,8,12,16 -ngl 99 -fa on --output-format jsonl
  if [ "$B" = patched ] && [ "$BACKEND" = cuda ]; then
    # the patched kernels' machine code (SASS), for reading instruction counts per byte offline
    MCOBJ=$(find "$S/build" -name 'mc-mmv.cu.o' 2>/dev/null | head -1)
    [ -n "$MCOBJ" ] && command -v cuobjdump > /dev/null && step "$B-sass" 30 cuobjdump -sass "$MCOBJ"
    for op in ${OPS//,/ }; do
      step "$B-ops-$op" 30 "$S/$B/test-backend-ops" test -b CUDA0 -o "$op"
    done
  fi
  # the kernel-level figures (ncu) before the settings' variants: a call cut short keeps them
  if [ -n "${MC_SBS_KDETAIL:-}" ] && [ "$BACKEND" = cuda ] && want "$B" ",${MC_SBS_KDETAIL_BUILDS:-patched},"; then
    for item in ${MC_SBS_KDETAIL_SETTINGS:-default}; do  # e.g. "default MC_MMQ_VARIANT=wk"
      kname=$B-kdetail; kenv=()
      [ "$item" = default ] || { kname=$B-kdetail-${item//[^A-Za-z0-9]/_}; read -ra kenv <<< "${item//+/ }"; }
      step "$kname" 90 env "${kenv[@]}" ncu --clock-control none --profile-from-start off \
        --kernel-name "regex:$MC_SBS_KDETAIL" --launch-count "${MC_SBS_KDETAIL_COUNT:-24}" \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
        --section ComputeWorkloadAnalysis --section LaunchStats --section InstructionStats \
        --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' --csv --page details \
        "$S/$B/mc_gpu_bench" profile "$MODEL" 512 1 "${MC_SBS_KDETAIL_K:-16}"
    done
  fi
  case ",$PROFILE," in *",$B,"*)
    for K in ${MC_SBS_PROFILE_K//,/ }; do  # one decode step of K tokens (K > 1: a verify step); SxK: S sequences
      seqs=1; case $K in *x*) seqs=${K%%x*}; K=${K#*x} ;; esac
      name=$B-profile; [ "$K" = 1 ] || name=$B-profile-k$K; [ "$seqs" = 1 ] || name=$B-profile-s${seqs}k$K
      for item in ${MC_SBS_PROFILE_SETTINGS:-default}; do  # e.g. "default MC_MMH_REPACK=1"
        pname=$name; penv=()
        [ "$item" = default ] || { pname=$name-${item//[^A-Za-z0-9]/_}; read -ra penv <<< "${item//+/ }"; }
        step "$pname" 90 env "${penv[@]}" ncu --clock-control none --cache-control none --profile-from-start off \
          --metrics gpu__time_duration.sum --print-units base --csv --page raw "$S/$B/mc_gpu_bench" profile "$MODEL" 512 1 "$K" "$seqs"
      done
    done ;;
  esac
  if [ "$B" = patched ] && [ -n "${MC_SBS_VARIANTS:-}" ]; then  # kernel variants: settings of the patched build
    STEP_CAP=${MC_SBS_VARIANT_STEP_CAP:-}
    for item in ${MC_SBS_VARIANTS//,/ }; do
      case "$item" in
        *:*) v=${item%%:*} settings=${item#*:} ;;
        *) v=v$item settings=MC_MMV_VARIANT=$item ;;  # a bare number: MC_MMV_VARIANT
      esac
      per=MC_SBS_VARIANT_MEASURE_$v  # one variant's own list, e.g. MC_SBS_VARIANT_MEASURE_vyq=logits,tg,ops
      vmeasure=,${!per:-${MC_SBS_VARIANT_MEASURE:-logits,tg,verify1,ops}},
      for kv in ${settings//+/ }; do export "${kv?}"; done
      log "variant $v: $settings"
      want logits "$vmeasure" && step "$B-$v-logits" 60 "$S/$B/mc_gpu_bench" logits "$MODEL" "$S/$B-$v-logits.bin"
      want tg "$vmeasure" && step "$B-$v-tg" 150 "$S/$B/mc_gpu_bench" tg "$MODEL" 0,4096,32768 64
      want verify1 "$vmeasure" && step "$B-$v-verify1" $((60 + 10 * DRAWS)) "${REPEAT[@]}" "$S/$B/mc_gpu_bench" \
        verify "$MODEL" 512 1 1,2,4,8,12,16
      want verify12 "$vmeasure" && step "$B-$v-verify12" $((60 + 10 * DRAWS)) "${REPEAT[@]}" "$S/$B/mc_gpu_bench" \
        verify "$MODEL" 512 12 1,2,4
      want batched "$vmeasure" && step "$B-$v-batched" 150 "$S/$B/llama-batched-bench" -m "$MODEL" -c 16384 -b 2048 -ub 512 \
        -npp 512 -ntg 128 -npl 1,2,4,8,12,16 -ngl 99 -fa on --output-format jsonl
      vops=MC_SBS_VARIANT_OPS_$v  # one variant's own test-backend-ops list, e.g. MC_SBS_VARIANT_OPS_vg2=GATED_DELTA_NET
      vops=${!vops:-$OPS}
      [ "$BACKEND" = cuda ] && want ops "$vmeasure" && for op in ${vops//,/ }; do
        step "$B-$v-ops-$op" 30 "$S/$B/test-backend-ops" test -b CUDA0 -o "$op"
      done
      for kv in ${settings//+/ }; do unset "${kv%%=*}"; done
    done
    STEP_CAP=
  fi
  unset LD_LIBRARY_PATH
done

# ---- MegaCapybara's engine on the patched build ----
# first where page-locked memory lands by NUMA binding and how fast it copies (the swap pool binds)
[ "$BACKEND" = cuda ] && [ "${MC_SBS_ENGINE:-1}" = 1 ] &&
  step numa 60 python3 "$ROOT/bench/gpu/numa_probe.py" --json "$S/numa.json"
if [ "${MC_SBS_ENGINE:-1}" = 1 ] && [ ! -f "$S/engine.done" ]; then
  SRCROOT=$(ls -d "$S"/src/*/ | head -1)
  if [ "$(left)" -lt "${MC_SBS_ENGINE_NEED:-240}" ]; then log "not enough time for the engine; call again"; exit 3; fi
  export LLAMA_CPP_LIB_PATH=$S/patched LD_LIBRARY_PATH=$S/patched PYTHONPATH=$SRCROOT:$ROOT
  # the libstdc++ check: numpy and torch loaded before llama.cpp, then a model load (it crashed in
  # llama_model::print_info when libggml-cuda.so exported its own libstdc++ copy)
  if ! python3 -c 'import numpy, torch, sys, llama_cpp as L
p = L.llama_model_default_params(); p.vocab_only = True
m = L.llama_model_load_from_file(sys.argv[1].encode(), p); assert m; print("abi check: ok")' "$MODEL" >> "$S/engine.log" 2>&1; then
    export LD_PRELOAD=$(ldd "$S/patched/libllama.so" | awk '/libstdc\+\+/ {print $3}')
    log "abi check FAILED (numpy/torch first); the engine runs with LD_PRELOAD=$LD_PRELOAD"
  else
    log "abi check ok: numpy and torch first, then a model load, without LD_PRELOAD"
  fi
  log "engine: bench/gpu/engine_gpu.py on the patched build"
  timeout $(( $(left) - 10 )) python3 -c 'import numpy, torch, runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name="__main__")' \
    bench/gpu/engine_gpu.py "$MODEL" $ENGINE_ARGS --json "$S/engine.json" 2>&1 | grep -av INFO | tee -a "$S/engine.log"
  [ "${PIPESTATUS[0]}" = 0 ] && touch "$S/engine.done"
  unset LLAMA_CPP_LIB_PATH LD_LIBRARY_PATH PYTHONPATH  # LD_PRELOAD (if the check set it) stays for the next run
fi
# MC_SBS_ENGINE_REPACKED=ARGS: the engine once more with repacked_weights MC_SBS_ENGINE_REPACKED_MODE
# (default on; the first run has the engine's default, auto) in its own process (the library reads
# the setting once), e.g. "--tasks 12 --depths none --breakdown , --skip-sampled"
if [ "${MC_SBS_ENGINE:-1}" = 1 ] && [ -f "$S/engine.done" ] && [ -n "${MC_SBS_ENGINE_REPACKED:-}" ] &&
   [ ! -f "$S/engine-repacked.done" ]; then
  SRCROOT=$(ls -d "$S"/src/*/ | head -1)
  if [ "$(left)" -lt "${MC_SBS_ENGINE_NEED:-240}" ]; then log "not enough time for the repacked engine; call again"; exit 3; fi
  export LLAMA_CPP_LIB_PATH=$S/patched LD_LIBRARY_PATH=$S/patched PYTHONPATH=$SRCROOT:$ROOT
  log "engine, repacked weights ${MC_SBS_ENGINE_REPACKED_MODE:-on}: bench/gpu/engine_gpu.py $MC_SBS_ENGINE_REPACKED"
  timeout $(( $(left) - 10 )) python3 -c 'import numpy, torch, runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name="__main__")' \
    bench/gpu/engine_gpu.py "$MODEL" $MC_SBS_ENGINE_REPACKED --repacked-weights "${MC_SBS_ENGINE_REPACKED_MODE:-on}" --json "$S/engine-repacked.json" 2>&1 | grep -av INFO | tee -a "$S/engine.log"
  [ "${PIPESTATUS[0]}" = 0 ] && touch "$S/engine-repacked.done"
  unset LLAMA_CPP_LIB_PATH LD_LIBRARY_PATH PYTHONPATH
fi
unset LD_PRELOAD
nm -DC --defined-only "$S/patched/libggml-$BACKEND.so" 2>/dev/null | grep -c 'std::' > "$S/stdcxx-symbols.txt"
log "=== call end"
