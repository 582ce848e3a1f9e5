#!/usr/bin/env bash
# The GPU machine's calls as named plans, kept in the repository: the per-session scripts in the
# git-ignored .device/ were lost with a checkout twice (a first call found none; a restarted session
# had to write them again). Each plan resumes where a call cut short left it (the same command again;
# exit 3 asks for that) and leaves at most 8 files in $OUT (what the device tool brings back).
#
# usage, from the repository root:   OUT=DIR bash bench/gpu/calls.sh PLAN [ARGS...] [deadline_seconds]
#
#   sbs                      stock against patched at the defaults (bench/gpu/side_by_side.sh: builds,
#                            decode at 0 / 4k / 32k, verify, 12 sequences, test-backend-ops, the engine's
#                            pause / resume unless MC_SBS_ENGINE=0; the patched verify also with the
#                            repacked copies the engine uses, verify16_over_1_patched-vcopies, unless
#                            MC_SBS_VARIANTS is set), then a step trace of the defaults
#                            ($OUT/trace_defaults.json). Two calls of ~570 s on a fresh machine.
#   setting NAME=VAR=VAL[,VAR=VAL...] [OPS]
#                            one setting of the patched build against its defaults: logits under it (the
#                            summary's logits_patched_vNAME_vs_patched, same_bytes), test-backend-ops of OPS
#                            (a comma list, default MUL_MAT) under it, warm rounds alternating the two
#                            (MC_CALLS_ROUNDS, default 8, tg at 0 / 4k: $OUT/warm.json; then 3 rounds at 32k
#                            and verify 1 / 16: $OUT/warm32k.json), and the step traces of both lined up
#                            ($OUT/trace_compare.json: {NAME: comparison}; MC_CALLS_TRACE_K=16: one
#                            sequence's 16-token verify steps at depth 512 traced instead, the defaults'
#                            trace in $OUT/trace_on-k16.json). Uses the state's build where it
#                            holds this series (after `sbs`), else builds the patched tree alone.
#   settings OPS NAME=VAR=VAL[,...] NAME2=... ...
#                            the same for several settings at once: each one's logits and OPS, the
#                            defaults and all of them alternating in the same rounds, each one's trace
#                            against the defaults ($OUT/trace_compare.json: {name: comparison}); a
#                            setting's logits also against each setting whose VAR=VAL are a part of its
#                            own (logits_patched_vNAME_vs_patched_vNAME2: name the copies alone beside the
#                            copies with a change, and the change's bytes are told apart from the copies')
#
#   builds [OPS]             the prebuilt patched programs (the archive in .device, as the settings plans
#                            take them) against the same series built on this machine (MC_SBS_PREBUILT=0,
#                            the state $MC_STATE-built, the model shared): both logits (builds.json:
#                            same_bytes), OPS (default MC_ADD_RMS_NORM_MUL) on each, warm rounds
#                            alternating the two programs (MC_CALLS_ROUNDS, default 6: tg at 0 / 4k and
#                            verify 1 / 16 at 512: $OUT/warm.json, through warm_repeats.py's MC_WARM_BENCH)
#                            and both decode steps traced and lined up ($OUT/trace_compare.json: {built:
#                            comparison}): whether figures taken on the archive's programs are a device
#                            build's. One call on a warm machine (~250 s of build there).
#
#   MC_CALLS_LEAN=1 (setting / settings): after the logits and OPS, only one sequence's verify at depth
#   512 (1 and 16 tokens) in MC_CALLS_ROUNDS (default 4) alternating rounds ($OUT/warmv.json), no decode
#   rounds, no traces: one fresh-machine call (~275 s build + ~60 s a round of three settings) for a
#   session whose refused tries left ~500 s (run CJ). MC_CALLS_LEAN_TRACE=1 adds the defaults' steps
#   traced after the rounds ($OUT/trace_on.json: decode steps, or with MC_CALLS_TRACE_K=K the K-token
#   verify steps as trace_on-kK.json; ~40 s), the one trace a card that is seldom lent should bring back;
#   =2 also the first named setting's verify steps of MC_CALLS_TRACE_K tokens (16 where that is 1) at
#   depth 512 ($OUT/trace_NAME-kK.json, ~40 s more): with the copies first, the step the issue's verify
#   figure times, kernel by kernel, for the next change should that figure miss
#
#   MC_CALLS_GPU=NAME (any plan): only on a GPU whose name holds NAME (case aside, e.g. H200): on any
#   other, or with no name from nvidia-smi, the call stops at once with exit 4, before anything is built,
#   generated or written, so a call that wanted the one card and got another costs only the machine's
#   start (a call naming a kind may get either card)
#
# Needs .device/ as side_by_side.sh does (python3 bench/gpu/prepare_device.py). MC_STATE as there
# (default /tmp/mcs). The plan's commands go to $OUT/calls.log. The setting / settings plans build the
# patched tree alone, sbs stock and patched, unless .device/ holds bench/gpu/prebuild.py's archive for
# this series and the GPU's arch and it passes its check there: side_by_side.sh then takes the patched
# programs from it (settings: no build, ~80 s of model generation instead of 210-330 s of build on a
# fresh machine; sbs: stock's build alone, ~180-230 s).
set -u
: "${OUT:?set OUT to the folder for results}"
if [ -n "${MC_CALLS_GPU:-}" ]; then
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)
  if [ -z "$gpu" ]; then
    echo "MC_CALLS_GPU=$MC_CALLS_GPU: nvidia-smi named no GPU here: stopped before anything ran"
    exit 4
  fi
  if ! grep -qiF -- "$MC_CALLS_GPU" <<< "$gpu"; then
    echo "MC_CALLS_GPU=$MC_CALLS_GPU: this machine's GPU is '$gpu': stopped before anything ran"
    exit 4
  fi
  echo "MC_CALLS_GPU=$MC_CALLS_GPU: '$gpu'"
fi
PLAN=${1:-}
shift || true
ROOT=$(pwd)
S=${MC_STATE:-/tmp/mcs}
last=${*: -1}
case $last in '' | *[!0-9]*) DEADLINE=570 ;; *) DEADLINE=$last; set -- "${@:1:$(($# - 1))}" ;; esac
log() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$OUT/calls.log"; }
left() { echo $((DEADLINE - SECONDS)); }
MODEL=${MC_BENCH_MODEL:-$S/random-27b-${MC_SBS_WEIGHTS:-q4_0}.gguf}
BENCH=$S/patched/mc_gpu_bench

sbs() {  # side_by_side.sh with what is left, keeping 15 s for this script's own end
  log "side_by_side.sh: MC_SBS_BUILDS=${MC_SBS_BUILDS:-stock,patched} MC_SBS_MEASURE=${MC_SBS_MEASURE:-default}" \
    "MC_SBS_VARIANTS=${MC_SBS_VARIANTS:-} MC_SBS_ENGINE=${MC_SBS_ENGINE:-1}"
  bash "$ROOT/bench/gpu/side_by_side.sh" $(($(left) - 15))
}

phase() {  # name, seconds it needs, command...: once per state (a marker), skipped when time is short
  local name=$1 need=$2; shift 2
  [ -f "$S/calls-$name.done" ] && return 0
  if [ "$(left)" -lt "$need" ]; then log "$name needs ${need} s, $(left) left: call again"; exit 3; fi
  log "$name: $*"
  timeout $(($(left) - 5)) "$@" && touch "$S/calls-$name.done" || {
    log "$name stopped (exit $?)"; exit 3; }
}

gather_compares() {  # suffix, names...: $S/compare-NAMEsuffix.json as one file, $OUT/trace_compare.json
  python3 - "$OUT/trace_compare.json" "$S" "$@" <<'PY'
import json, pathlib, sys
out, state, ts, names = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
files = {n: state / f"compare-{n}{ts}.json" for n in names}
found = {n: json.loads(f.read_text()) for n, f in files.items() if f.exists()}
out.write_text(json.dumps(found, indent=1) + "\n")
PY
}

case $PLAN in
  sbs)
    mkdir -p "$OUT" "$S"
    # the issue's verify figure as the engine runs it: the patched build's verify 1..16 also with the
    # weights' repacked copies (repacked_weights=auto sets MC_MMH_REPACK=3), unless variants are given
    if [ -z "${MC_SBS_VARIANTS+x}" ]; then
      export MC_SBS_VARIANTS=vcopies:MC_MMH_REPACK=3 MC_SBS_VARIANT_MEASURE_vcopies=verify1
    fi
    sbs; rc=$?
    [ $rc = 0 ] || exit $rc
    phase trace-defaults 90 python3 "$ROOT/bench/gpu/step_trace.py" trace --bench "$BENCH" --model "$MODEL" \
      --tokens 64 --json "$OUT/trace_defaults.json" --csv "$S/trace-defaults.csv"
    ;;
  builds)
    [ $# -le 1 ] || { echo "builds: expected at most OPS (a comma list of test-backend-ops ops), got '$*'"; exit 2; }
    OPS=${1:-MC_ADD_RMS_NORM_MUL}
    S2=$S-built
    ARCHIVES=${MC_SBS_PREBUILT_DIR:-$ROOT/.device}
    compgen -G "$ARCHIVES/prebuilt-patched-*.tar.xz" > /dev/null || {
      echo "builds: no prebuilt archive in $ARCHIVES (python3 bench/gpu/prebuild.py makes one): nothing to set" \
        "a device build against"
      exit 2; }
    mkdir -p "$OUT" "$S"
    export MC_SBS_BUILDS=patched MC_SBS_MEASURE=logits MC_SBS_OPS=$OPS MC_SBS_ENGINE=0 MC_SBS_VARIANTS=
    sbs; rc=$?
    [ $rc = 0 ] || exit $rc
    [ -f "$S/patched.prebuilt" ] || {
      log "builds: the state $S holds no prebuilt programs" \
        "(no archive for this series in .device, or its check failed)"
      exit 2; }
    MC_STATE=$S2 MC_SBS_PREBUILT=0 MC_BENCH_MODEL=$MODEL sbs; rc=$?
    [ $rc = 0 ] || exit $rc
    BUILT=$S2/patched/mc_gpu_bench
    python3 - "$ROOT/bench/gpu" "$S" "$S2" "$OUT/builds.json" <<'PY'
import json, shutil, sys
from pathlib import Path

sys.path.insert(0, sys.argv[1])
from sbs_summary import compare_logits

s, s2, out = Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
for ext in ("bin", "out"):  # the device build's logits beside the archive's, as a build of their own
    shutil.copy2(s2 / f"patched-logits.{ext}", s / f"built-logits.{ext}")
res = {"logits_built_vs_prebuilt": compare_logits(s, "built", "patched")}
out.write_text(json.dumps(res, indent=1) + "\n")
print(res)
PY
    phase warm-builds 120 python3 "$ROOT/bench/gpu/warm_repeats.py" --bench "$BENCH" --model "$MODEL" \
      --setting prebuilt= --setting "built=MC_WARM_BENCH=$BUILT" --rounds "${MC_CALLS_ROUNDS:-6}" \
      --measure tg:0,4096:64 --measure verify:512:1:1,16 --json "$OUT/warm.json" --deadline $(($(left) - 60))
    TRACE=(python3 "$ROOT/bench/gpu/step_trace.py" trace --model "$MODEL" --tokens 64)
    for B in prebuilt built; do
      P=$BENCH; [ $B = prebuilt ] || P=$BUILT
      phase "trace-$B" 40 "${TRACE[@]}" --bench "$P" --json "$S/trace-$B.json" --csv "$S/trace-$B.csv"
    done
    phase compare-built 10 python3 "$ROOT/bench/gpu/step_trace.py" compare "$S/trace-prebuilt.json" \
      "$S/trace-built.json" --json "$S/compare-built.json"
    gather_compares "" built
    ;;
  setting | settings)
    # setting NAME=VARS [OPS] is settings OPS NAME=VARS: one or more settings (NAME=VAR=VAL[,VAR=VAL...]) of
    # the patched build, each against its defaults and the others in the same alternating rounds
    if [ "$PLAN" = setting ]; then
      ARGS=("${1:-}"); OPS=${2:-MUL_MAT}
    else
      OPS=${1:-}; shift || true; ARGS=("$@")
      [ -n "$OPS" ] && [ ${#ARGS[@]} -gt 0 ] || { echo "settings: expected OPS NAME=VAR=VAL[,...] ..."; exit 2; }
    fi
    NAMES=() VARIANTS= WARMSET=(--setting on=)
    for ARG in "${ARGS[@]}"; do
      NAME=${ARG%%=*} SETTINGS=${ARG#*=}
      case $NAME in '' | on | *[!A-Za-z0-9_]*)
        echo "setting: expected NAME=VAR=VAL[,VAR=VAL...] with NAME of letters, digits and _ (not on), got '$ARG'"
        exit 2 ;;
      esac
      for kv in ${SETTINGS//,/ }; do
        case $kv in [A-Za-z_]*=*) ;; *) echo "setting $NAME: '$kv' is not VAR=VALUE"; exit 2 ;; esac
      done
      [ -n "$SETTINGS" ] || { echo "setting $NAME: no VAR=VALUE given"; exit 2; }
      case " ${NAMES[*]} " in *" $NAME "*) echo "setting $NAME: named twice"; exit 2 ;; esac
      NAMES+=("$NAME")
      VARIANTS+=${VARIANTS:+,}v$NAME:${SETTINGS//,/+}
      export "MC_SBS_VARIANT_OPS_v$NAME=$OPS"
      WARMSET+=(--setting "$NAME=$SETTINGS")
    done
    TK=${MC_CALLS_TRACE_K:-1}  # the traced steps: 1 decode steps, K one sequence's K-token verify steps
    case $TK in '' | *[!0-9]* | 0*)
      echo "MC_CALLS_TRACE_K: expected a whole number >= 1 (1: decode steps, K: K-token verify steps), got '$TK'"
      exit 2 ;;
    esac
    LEAN=${MC_CALLS_LEAN:-0}
    case $LEAN in 0 | 1) ;; *) echo "MC_CALLS_LEAN: expected 0 or 1 (1: verify rounds only), got '$LEAN'"; exit 2 ;; esac
    LEAN_TRACE=${MC_CALLS_LEAN_TRACE:-0}
    case $LEAN_TRACE in 0 | 1 | 2) ;; *)
      echo "MC_CALLS_LEAN_TRACE: expected 0, 1 or 2 (1: a lean plan traces the defaults' steps too," \
        "2: and the first setting's verify steps), got '$LEAN_TRACE'"
      exit 2 ;;
    esac
    KEY=$(IFS=-; echo "${NAMES[*]}")  # the phases' markers: this list of settings
    mkdir -p "$OUT" "$S"
    # a state holding this series' builds with stock (after sbs) is used as it is; else the patched build alone
    if [ ! -f "$S/build-for.txt" ] || [ "$(awk '{print $2}' "$S/build-for.txt")" = 0 ]; then
      export MC_SBS_BUILDS=${MC_SBS_BUILDS:-patched}
    fi
    export MC_SBS_MEASURE=logits MC_SBS_OPS=$OPS MC_SBS_ENGINE=0 MC_SBS_VARIANT_MEASURE=logits,ops
    export MC_SBS_VARIANTS=$VARIANTS
    sbs; rc=$?
    [ $rc = 0 ] || exit $rc
    WARM=(python3 "$ROOT/bench/gpu/warm_repeats.py" --bench "$BENCH" --model "$MODEL" "${WARMSET[@]}")
    within() { local d=$(($(left) - $1)); echo $((d < 30 ? 30 : d)); }  # a round deadline, keeping $1 s
    TRACE=(python3 "$ROOT/bench/gpu/step_trace.py" trace --bench "$BENCH" --model "$MODEL" --tokens 64)
    TS=  # the traces' and markers' suffix: none for decode steps
    [ "$TK" = 1 ] || { TRACE+=(--k "$TK" --depth 512); TS=-k$TK; }
    if [ "$LEAN" = 1 ]; then
      phase "warmv-$KEY" 60 "${WARM[@]}" --rounds "${MC_CALLS_ROUNDS:-4}" --measure verify:512:1:1,16 \
        --json "$OUT/warmv.json" --deadline "$(within $((10 + 45 * LEAN_TRACE)))"
      if [ "$LEAN_TRACE" != 0 ]; then  # the defaults' steps alone (the card's own span and kernels)
        phase "trace-on$TS" 40 "${TRACE[@]}" --json "$S/trace-on$TS.json" --csv "$S/trace-on$TS.csv"
        cp "$S/trace-on$TS.json" "$OUT/trace_on$TS.json"
      fi
      if [ "$LEAN_TRACE" = 2 ]; then  # the first setting's verify steps (K tokens, 16 for decode's 1)
        VTRACE=("${TRACE[@]}") VS=$TS
        [ "$TK" != 1 ] || { VTRACE+=(--k 16 --depth 512); VS=-k16; }
        NAME=${ARGS[0]%%=*} SETTINGS=${ARGS[0]#*=}
        TSET=(); for kv in ${SETTINGS//,/ }; do TSET+=(--setting "$kv"); done
        phase "trace-$NAME$VS" 40 "${VTRACE[@]}" "${TSET[@]}" --json "$S/trace-$NAME$VS.json" \
          --csv "$S/trace-$NAME$VS.csv"
        cp "$S/trace-$NAME$VS.json" "$OUT/trace_$NAME$VS.json"
      fi
      log "plan $PLAN done (lean)"
      exit 0
    fi
    phase "warm-$KEY" 120 "${WARM[@]}" --rounds "${MC_CALLS_ROUNDS:-8}" --measure tg:0,4096:64 \
      --json "$OUT/warm.json" --deadline "$(within $((90 + 60 * ${#NAMES[@]})))"
    phase "warm32k-$KEY" 100 "${WARM[@]}" --rounds 3 --measure tg:32768:32 --measure verify:512:1:1,16 \
      --json "$OUT/warm32k.json" --deadline "$(within $((30 + 30 * ${#NAMES[@]})))"
    phase "trace-on$TS" 40 "${TRACE[@]}" --json "$S/trace-on$TS.json" --csv "$S/trace-on$TS.csv"
    for ARG in "${ARGS[@]}"; do
      NAME=${ARG%%=*} SETTINGS=${ARG#*=}
      TSET=(); for kv in ${SETTINGS//,/ }; do TSET+=(--setting "$kv"); done
      phase "trace-$NAME$TS" 40 "${TRACE[@]}" "${TSET[@]}" --json "$S/trace-$NAME$TS.json" \
        --csv "$S/trace-$NAME$TS.csv"
      phase "compare-$NAME$TS" 10 python3 "$ROOT/bench/gpu/step_trace.py" compare "$S/trace-on$TS.json" \
        "$S/trace-$NAME$TS.json" --json "$S/compare-$NAME$TS.json"
    done
    # one file back for all of them (the device tool brings back at most 8): {name: the comparison}, and
    # the defaults' own trace of verify steps (there is no sbs trace of those)
    [ -z "$TS" ] || cp "$S/trace-on$TS.json" "$OUT/trace_on$TS.json"
    gather_compares "$TS" "${NAMES[@]}"
    ;;
  *)
    echo "usage: OUT=DIR bash bench/gpu/calls.sh sbs|builds [OPS]|setting NAME=VAR=VAL[,...] [OPS]|settings OPS NAME=VAR=VAL[,...]..." \
      "[deadline_seconds]"
    exit 2 ;;
esac
log "plan $PLAN done"
