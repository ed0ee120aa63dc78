#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, ASan+UBSan) and runs each for a bounded time on a copy of its
# seed corpus (tests/fuzz/corpus/<target>/; the repository is never modified). Part of CI
# (scripts/test.sh). Fails on any crash, sanitizer report, leak, timeout or OOM.
#
#   scripts/fuzz.sh                     FUZZ_SECONDS per target (default 60)
#   scripts/fuzz.sh fuzz_manifest       one target
#   scripts/fuzz.sh --configure-only    (used by tests/fuzz/make_corpus.sh)
#
# A crash leaves its reproducer in $FUZZ_ARTIFACTS (default build-fuzz/artifacts/<target>/);
# replay it with: build-fuzz/tests/fuzz/<target> <file>
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${FUZZ_BUILD_DIR:-$ROOT/build-fuzz}"
JOBS="${JOBS:-$(nproc)}"
SECONDS_PER_TARGET="${FUZZ_SECONDS:-60}"
ARTIFACTS="${FUZZ_ARTIFACTS:-$BUILD/artifacts}"
step() { printf '\n==== %s\n' "$*"; }

CLANG="${FUZZ_CLANG:-$(command -v clang-14 || command -v clang)}"
CLANGXX="${FUZZ_CLANGXX:-$(command -v clang++-14 || command -v clang++)}"
# Debug at -O1: asserts on, fast enough to execute thousands of inputs per second. -g1: line tables
# and function names for the reports' stacks, in less compile time than -g.
cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_C_COMPILER="$CLANG" -DCMAKE_CXX_COMPILER="$CLANGXX" \
  -DFUSEDLAYER_FUZZ=ON -DFUSEDLAYER_CUDA=OFF -DFUSEDLAYER_HIP=OFF -DFUSEDLAYER_BUILD_TESTS=OFF \
  -DFUSEDLAYER_BUILD_BENCH=OFF -DCMAKE_BUILD_TYPE=Debug "-DCMAKE_CXX_FLAGS_DEBUG=-O1 -g1" \
  "-DCMAKE_C_FLAGS_DEBUG=-O1 -g1" >/dev/null
[ "${1:-}" = "--configure-only" ] && exit 0

TARGETS=("$@")
[ ${#TARGETS[@]} -eq 0 ] && TARGETS=(fuzz_safetensors fuzz_manifest fuzz_request_validation fuzz_weight_set_header
                                     fuzz_auth_files fuzz_wire_reader)

step "fuzz: build ${TARGETS[*]} (clang, libFuzzer + ASan + UBSan)"
cmake --build "$BUILD" -j"$JOBS" --target "${TARGETS[@]}"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/fusedlayer-fuzz.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
# One libFuzzer process per target, JOBS of them at a time: each target still gets its
# SECONDS_PER_TARGET of one core, and on CI's 2 cores the stage takes half the wall time.
# -timeout: an input running over 10 s is a hang; -rss_limit_mb: a 2 GB input-driven allocation is
# a bug (the decoders size every allocation from validated shapes). No -fork/-jobs inside a target:
# its workers would compete with the other targets for the same cores.
run_target() {
  local t=$1
  mkdir -p "$WORK/$t" "$ARTIFACTS/$t"
  cp -r "$ROOT/tests/fuzz/corpus/$t/." "$WORK/$t/"
  local rc=0
  "$BUILD/tests/fuzz/$t" -max_total_time="$SECONDS_PER_TARGET" -timeout=10 -rss_limit_mb=2048 \
    -max_len=65536 -print_final_stats=1 -artifact_prefix="$ARTIFACTS/$t/" "$WORK/$t" 2>"$WORK/$t.log" || rc=$?
  echo "$rc" > "$WORK/$t.rc"
}
step "fuzz: ${TARGETS[*]} for ${SECONDS_PER_TARGET}s each, $JOBS at a time"
running=0
for t in "${TARGETS[@]}"; do
  if [ "$running" -ge "$JOBS" ]; then wait -n || true; running=$((running - 1)); fi
  run_target "$t" &
  running=$((running + 1))
done
wait || true
failed=0
for t in "${TARGETS[@]}"; do
  step "fuzz: $t"
  if [ "$(cat "$WORK/$t.rc" 2>/dev/null || echo missing)" != 0 ]; then
    tail -n 80 "$WORK/$t.log"
    echo "fuzz: $t FAILED (exit $(cat "$WORK/$t.rc" 2>/dev/null || echo missing)); reproducer(s) in $ARTIFACTS/$t/ (replay: $BUILD/tests/fuzz/$t FILE)" >&2
    failed=1
    continue
  fi
  grep -E '^(#[0-9]+.*DONE|stat::number_of_executed_units|stat::peak_rss_mb|INFO: seed corpus)' "$WORK/$t.log" || true
done
[ "$failed" = 0 ] || exit 1
step "fuzz: all targets ran ${SECONDS_PER_TARGET}s without a finding"
