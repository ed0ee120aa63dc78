#!/usr/bin/env bash
# Builds fusedlayer and runs the full test suite. This is the README's test command and what CI runs.
#
#   scripts/test.sh
#
# 1. installs the Debian 12 packages it needs (scripts/install-deps.sh),
# 2. compiles the CUDA backend (when nvcc is present) and the HIP backend (Debian's hipcc, gfx90a):
#    compile and link only, since neither GPU exists on a CI machine,
# 3. builds the CPU build (library, server, client, tests, benchmarks) and runs every test with ctest:
#    kernel contract suites, weight/manifest tests, end-to-end gRPC tests, metrics lint
#    (promtool), deployment checks and the real-Prometheus integration test; then the Python client
#    (scripts/test-python.sh): installed as the README says, its pytest suite against real servers,
#    and examples/whole_model.py,
# 4. sanitizers (scripts/sanitize.sh): the WHOLE test suite again, built with ASan+UBSan (GCC) and run
#    with ctest (leaks are failures); the concurrency tests and the concurrency-heavy end-to-end
#    gRPC suites built with ThreadSanitizer and run,
# 5. fuzzing (scripts/fuzz.sh): the libFuzzer targets (clang, ASan+UBSan) for request validation
#    (shared-memory references included), the safetensors reader, the manifest parser, a
#    WeightSetHeader given to the weight-set builder, and the token and identity file parsers, each
#    for FUZZ_SECONDS (default 60) from the seed corpus in tests/fuzz/corpus/,
# 6. the CPU image (scripts/test-image.sh): built from the Dockerfile with Docker or podman, started
#    read-only and non-root as deploy/k8s runs it, and checked (health, HEALTHCHECK on a non-default
#    port, mHC + SWA calls, a manifest weight set on a read-only mount, /metrics, SIGTERM drain).
#    The CUDA image cannot be built without its base image: its runtime package list is checked
#    against the CUDA build's libraries instead (step 2).
# Any failure stops the script with a non-zero exit. The per-stage wall times are printed at the end.
# On a 2-core machine without a GPU but with nvcc (a clean clone, 3,891 s in all): steps
# 1-3 took 1,404 s, ASan 1,163, TSan 545, fuzzing 459 and the image 309. CI's limit is 90 minutes;
# most of the time is compiling, three times over (CPU, ASan, TSan), which is why the server and
# client suites' own code is compiled at -Og -g1 (tests/CMakeLists.txt; 4,372 s in all without it).
#
#   FUSEDLAYER_SKIP_SANITIZERS=1 scripts/test.sh    quick local run: skips steps 4-5 (CI never sets it)
#   FUSEDLAYER_SKIP_IMAGE=1 scripts/test.sh         skips step 6 (CI never sets it)
#   FUZZ_SECONDS=N                                  fuzzing time per target
#
# Build folders: build/ (CPU), build-cuda/, build-hip/ (override with BUILD_DIR), build-asan/,
# build-tsan/, build-fuzz/ (see the scripts).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${BUILD_DIR:-$ROOT/build}"
JOBS="${JOBS:-$(nproc)}"
# ctest runs twice as many tests as there are cores: most of them wait on servers, timeouts and
# sockets (the CPU ctest kept 2 cores about a third busy at -j2), and the few that compute hard
# (the soak) take more than one slot (tests/CMakeLists.txt).
CTEST_JOBS="${CTEST_JOBS:-$((JOBS * 2))}"

T0=$SECONDS
TIMES=()
"$ROOT/scripts/install-deps.sh"

# The compiler cache (ccache, wired in CMakeLists.txt): paths relative to the checkout and no
# working directory in the hash, so the CUDA tree's host objects (server, client, tests: compiled
# with the same flags) are the CPU tree's, and a second checkout on the same machine reuses both.
# CCACHE_DIR is left to ccache's default (~/.cache/ccache), kept between runs on a warm machine.
# Precompiled headers (cmake/precompiled_headers.cmake) are cacheable only with this sloppiness.
export CCACHE_BASEDIR="$ROOT" CCACHE_NOHASHDIR=1 CCACHE_SLOPPINESS=pch_defines,time_macros
command -v ccache >/dev/null && ccache --zero-stats >/dev/null

step() { printf '\n==== %s\n' "$*"; }

# The CPU image's build (step 6) starts now, in the background at the lowest CPU priority: its
# package downloads and its compile fill the time the other stages leave idle (most of the ctest
# runs wait on servers, timeouts and sockets), and it takes little from them where they compute.
# Its log is printed, and its exit status checked, in step 6.
IMAGE_BUILD_PID=""
if [ "${FUSEDLAYER_SKIP_IMAGE:-0}" != 1 ]; then
  IMAGE_STATE="$(mktemp -d "${TMPDIR:-/tmp}/fusedlayer-image.XXXXXX")"
  # A run that fails before step 6 stops the build: its own process group (setsid), engine
  # included; test-image.sh's exit handler then removes what it made.
  trap '[ -z "$IMAGE_BUILD_PID" ] || kill -TERM -- "-$IMAGE_BUILD_PID" 2>/dev/null; rm -rf "$IMAGE_STATE"' EXIT
  IMAGE_BUILD_T0=$SECONDS
  setsid nice -n 19 env BUILD_DIR="$BUILD" "$ROOT/scripts/test-image.sh" --build-only="$IMAGE_STATE" \
    > "$IMAGE_STATE/build.log" 2>&1 &
  IMAGE_BUILD_PID=$!
fi

NVCC="$(command -v nvcc || true)"
[ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
if [ -n "$NVCC" ]; then
  step "CUDA build (compile + link; GPU tests run on a GPU host, see BENCHMARKS.md)"
  cmake -S "$ROOT" -B "$BUILD-cuda" -G Ninja -DFUSEDLAYER_CUDA=ON -DCMAKE_CUDA_COMPILER="$NVCC" \
    -DFUSEDLAYER_BUILD_SERVER=OFF -DCMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST
  cmake --build "$BUILD-cuda" -j"$JOBS"
  # The CUDA-built server must start and serve /metrics on a machine without a GPU (it picks the
  # CPU backend). Linking libcublasLt once broke exactly this (its TLS starved civetweb's threads).
  step "CUDA-built server: starts and serves /metrics (CPU backend here: no GPU)"
  cmake -S "$ROOT" -B "$BUILD-cuda" -DFUSEDLAYER_BUILD_SERVER=ON > /dev/null
  cmake --build "$BUILD-cuda" -j"$JOBS" --target fusedlayer_server fusedctl
  "$BUILD-cuda/server/fusedlayer_server" --demo_weights --address=127.0.0.1:50391 \
    --metrics_address=127.0.0.1:50392 > "$BUILD-cuda/server-start.log" 2>&1 &
  cuda_server=$!
  ok=0
  for _ in $(seq 1 60); do
    if curl -fsS http://127.0.0.1:50392/metrics 2>/dev/null | grep -q '^fusedlayer_build_info{.*backend="cpu"'; then ok=1; break; fi
    kill -0 "$cuda_server" 2>/dev/null || break
    sleep 0.5
  done
  kill -TERM "$cuda_server" 2>/dev/null; wait "$cuda_server" 2>/dev/null || true
  if [ "$ok" != 1 ]; then cat "$BUILD-cuda/server-start.log"; echo "FAIL: the CUDA-built server did not serve /metrics"; exit 1; fi
  echo "CUDA-built server served /metrics (backend cpu)"
  # The CUDA image cannot be built here (no nvidia/cuda base image): check its runtime package list
  # against what these CUDA-built binaries link (readelf NEEDED) and dlopen (cuBLASLt).
  step "CUDA image: runtime package list covers the CUDA build's shared libraries"
  /usr/bin/python3 "$ROOT/tests/deploy/check_manifests.py" runtime-libs cuda "$BUILD-cuda"
else
  step "CUDA build skipped: no nvcc on this machine"
fi

step "HIP build (Debian hipcc, gfx90a; compile + link only)"
cmake -S "$ROOT" -B "$BUILD-hip" -G Ninja -DFUSEDLAYER_CUDA=OFF -DFUSEDLAYER_HIP=ON \
  -DFUSEDLAYER_BUILD_SERVER=OFF -DCMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST
cmake --build "$BUILD-hip" -j"$JOBS"

step "CPU build"
cmake -S "$ROOT" -B "$BUILD" -G Ninja -DFUSEDLAYER_CUDA=OFF
cmake --build "$BUILD" -j"$JOBS"

step "CPU image: runtime package list covers the CPU build's shared libraries"
/usr/bin/python3 "$ROOT/tests/deploy/check_manifests.py" runtime-libs cpu "$BUILD"

# The Python client's stage runs beside ctest: both mostly wait on the servers they start (each on
# ports the kernel picks), and neither writes to the build tree. Its output goes to a file, printed
# after ctest's; a failure of either fails the run, once both have finished.
step "tests (ctest), and beside them the Python client: install (README), pytest against real servers, examples/whole_model.py"
PY_LOG="$(mktemp "${TMPDIR:-/tmp}/fusedlayer-python.XXXXXX")"
t=$SECONDS
"$ROOT/scripts/test-python.sh" "$BUILD" > "$PY_LOG" 2>&1 &
py_pid=$!
ctest_rc=0
ctest --test-dir "$BUILD" --output-on-failure --no-tests=error -j"$CTEST_JOBS" || ctest_rc=$?
TIMES+=("cpu build + tests (and GPU compile checks): $((SECONDS - T0)) s")
py_rc=0
wait "$py_pid" || py_rc=$?
step "Python client (ran beside ctest): its output"
cat "$PY_LOG"
rm -f "$PY_LOG"
TIMES+=("python client install + pytest + example, beside ctest: $((SECONDS - t)) s from ctest's start")
[ "$ctest_rc" = 0 ] || { echo "FAIL: ctest (exit $ctest_rc)"; exit 1; }
[ "$py_rc" = 0 ] || { echo "FAIL: the Python client stage (scripts/test-python.sh, exit $py_rc)"; exit 1; }

timed() { local name="$1" t=$SECONDS; shift; "$@"; TIMES+=("$name: $((SECONDS - t)) s"); }

if [ "${FUSEDLAYER_SKIP_SANITIZERS:-0}" = 1 ]; then
  step "sanitizer stages SKIPPED (FUSEDLAYER_SKIP_SANITIZERS=1; CI runs them)"
else
  timed "asan+ubsan build + whole ctest" env JOBS="$JOBS" CTEST_JOBS="$CTEST_JOBS" "$ROOT/scripts/sanitize.sh" asan
  timed "tsan build + concurrency tests" env JOBS="$JOBS" CTEST_JOBS="$CTEST_JOBS" "$ROOT/scripts/sanitize.sh" tsan
fi

# Step 6 before step 5: what is left of the image build then runs at full speed, and the fuzzers
# get the cores to themselves (each target's FUZZ_SECONDS are wall time).
if [ "${FUSEDLAYER_SKIP_IMAGE:-0}" = 1 ]; then
  step "image stage SKIPPED (FUSEDLAYER_SKIP_IMAGE=1; CI runs it)"
else
  step "CPU image: built with Docker or podman in the background since the start (its log below)"
  t=$SECONDS
  rc=0
  wait "$IMAGE_BUILD_PID" || rc=$?
  IMAGE_BUILD_PID=""
  cat "$IMAGE_STATE/build.log"
  [ "$rc" = 0 ] || { echo "FAIL: the CPU image build failed (exit $rc)"; exit 1; }
  TIMES+=("cpu image build: $((SECONDS - IMAGE_BUILD_T0)) s from the start, in the background; waited for it $((SECONDS - t)) s")
  step "CPU image: run read-only, check (scripts/test-image.sh)"
  timed "cpu image container checks" env BUILD_DIR="$BUILD" "$ROOT/scripts/test-image.sh" --check-built="$IMAGE_STATE"
fi

if [ "${FUSEDLAYER_SKIP_SANITIZERS:-0}" = 1 ]; then
  step "fuzz stage SKIPPED (FUSEDLAYER_SKIP_SANITIZERS=1; CI runs it)"
else
  timed "fuzz build + ${FUZZ_SECONDS:-60} s per target" env JOBS="$JOBS" FUZZ_SECONDS="${FUZZ_SECONDS:-60}" \
    "$ROOT/scripts/fuzz.sh"
fi

step "all stages passed ($((SECONDS - T0)) s in all)"
printf '  %s\n' "${TIMES[@]}"
command -v ccache >/dev/null && ccache --show-stats 2>/dev/null | grep -E '^ *(Hits|Misses):' | sed 's/^ */  ccache /'
