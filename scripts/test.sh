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
#    (promtool), deployment checks and the real-Prometheus integration test.
# Build folders: build/ (CPU), build-cuda/, build-hip/ (override with BUILD_DIR).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${BUILD_DIR:-$ROOT/build}"
JOBS="${JOBS:-$(nproc)}"

"$ROOT/scripts/install-deps.sh"

step() { printf '\n==== %s\n' "$*"; }

NVCC="$(command -v nvcc || true)"
[ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
if [ -n "$NVCC" ]; then
  step "CUDA build (compile + link; GPU tests run on a GPU host, see BENCHMARKS.md)"
  cmake -S "$ROOT" -B "$BUILD-cuda" -G Ninja -DFUSEDLAYER_CUDA=ON -DCMAKE_CUDA_COMPILER="$NVCC" \
    -DFUSEDLAYER_BUILD_SERVER=OFF -DCMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST
  cmake --build "$BUILD-cuda" -j"$JOBS"
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

step "tests"
ctest --test-dir "$BUILD" --output-on-failure -j"$JOBS"
