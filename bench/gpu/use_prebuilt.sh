#!/usr/bin/env bash
# Take bench/gpu/prebuild.py's archive (the patched programs built on the CPU machine) as a state's
# patched build, after checking that it runs on this machine: every library found by the loader here
# (another image's glibc or a missing cuBLAS shows there) and one patched op's cases passing on the
# GPU. Used by side_by_side.sh before it would build; on any failure it builds there as before.
#
# usage: bash bench/gpu/use_prebuilt.sh STATE ARCHIVE [BACKEND [SERIES_HASH]]
#   BACKEND: test-backend-ops' -b (CUDA0); SERIES_HASH: the patch series the archive must be built from
# exit 0: STATE/patched holds the programs, the mc-mmv object sits where the SASS step finds it,
#         STATE/build-times.txt and STATE/prebuilt-manifest.json say what was taken;
# exit 1: not taken (the reason on stdout); nothing of it is left in STATE.
set -u
S=${1:?STATE}
A=${2:?ARCHIVE}
DEV=${3:-CUDA0}
WANT=${4:-}
CHECK_OP=MC_ADD_RMS_NORM_MUL  # a patched op, 7 cases in a second
tmp=$S/prebuilt.tmp
t0=$SECONDS
fail() { echo "prebuilt $(basename "$A") not used: $*"; rm -rf "$tmp" "$tmp.err"; exit 1; }
[ -f "$A" ] || fail "no such file"
rm -rf "$tmp" && mkdir -p "$tmp" || fail "cannot make $tmp"
tar xJf "$A" -C "$tmp" 2> "$tmp.err" || fail "cannot unpack it ($(head -c 300 "$tmp.err"))"
rm -f "$tmp.err"
for p in mc_gpu_bench test-backend-ops llama-batched-bench; do
  [ -x "$tmp/patched/$p" ] || fail "no patched/$p in it"
done
[ -f "$tmp/MANIFEST.json" ] || fail "no MANIFEST.json in it"
if [ -n "$WANT" ] && ! grep -q "\"series_hash\": \"$WANT\"" "$tmp/MANIFEST.json"; then
  fail "built from another patch series than ${WANT:0:16} ($(grep -o '"series_hash": "[0-9a-f]\{16\}' "$tmp/MANIFEST.json"))"
fi
lacking=$(cd "$tmp/patched" && LD_LIBRARY_PATH=$tmp/patched ldd ./* 2>&1 | grep -E "not found" | sed 's/^[[:space:]]*//' |
  sort -u | head -5)
[ -z "$lacking" ] || fail "the loader here lacks: $(echo "$lacking" | tr '\n' ';' | sed 's/;$//')"
out=$(LD_LIBRARY_PATH=$tmp/patched timeout 120 "$tmp/patched/test-backend-ops" test -b "$DEV" -o "$CHECK_OP" 2>&1)
rc=$?
echo "$out" > "$S/prebuilt-check.out"
[ $rc = 0 ] && echo "$out" | grep -qE "[0-9]+/[0-9]+ tests passed" ||
  fail "test-backend-ops -o $CHECK_OP exit $rc: $(echo "$out" | grep -E "FAIL|error|passed" | head -3 | tr '\n' ' ')"
mkdir -p "$S/patched" "$S/build/ggml/src/ggml-cuda/CMakeFiles/ggml-cuda.dir" || fail "cannot make $S/patched"
cp -a "$tmp/patched/." "$S/patched/" || fail "cannot copy to $S/patched"
[ ! -f "$tmp/obj/mc-mmv.cu.o" ] || cp "$tmp/obj/mc-mmv.cu.o" "$S/build/ggml/src/ggml-cuda/CMakeFiles/ggml-cuda.dir/"
cp "$tmp/MANIFEST.json" "$S/prebuilt-manifest.json"
{ echo "patched_prebuilt $(basename "$A")"; echo "patched_prebuilt_check_s $((SECONDS - t0))"; } > "$S/build-times.txt"
rm -rf "$tmp"
echo "prebuilt $(basename "$A") taken: $CHECK_OP passed here in $((SECONDS - t0)) s"
