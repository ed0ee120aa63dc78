#!/usr/bin/env bash
# Sanitizer builds of the test suite (part of CI: scripts/test.sh runs this).
#
#   scripts/sanitize.sh [asan|tsan|all]      (default: all)
#
# asan: the WHOLE test suite (kernel contracts, weights, server units, end-to-end gRPC, client,
#       deploy checks, Prometheus integration) built with ASan+UBSan (-DFUSEDLAYER_SANITIZE=ON) and run
#       with ctest, leak checking on. Debug build type at -O1: asserts stay on, and -O1 keeps the
#       contract suites (millions of elements per case) fast enough for 2 CI cores, where -O0 is not.
#       The server and client suites' own code is at -Og -g1 in every build (tests/CMakeLists.txt).
# tsan: the concurrency tests and the concurrency-heavy gRPC end-to-end suites built with
#       ThreadSanitizer (only their targets are built). gRPC-free: Concurrency.*
#       (tests/server/concurrency_test.cc: producers on the executor while it stops, the CPU thread
#       pool, WeightStore readers vs. publish/replace/unload), Executor.*, Dispatcher.*,
#       WeightStoreTest.*, WeightManager* (the last reference to a weight set freed on the executor
#       from another thread), IdleWatch.* (the LoadWeights idle watch's thread), Pipeline.*
#       (tests/server/pipeline_test.cc: device lanes, pinned staging and op calls on the asynchronous
#       lane test backend). End to end, a real server and clients in one process or a server binary:
#       batching (server_batching_tests), shared memory (server_shared_memory_tests), call rings
#       (server_call_ring_tests: the poller, handover and executor threads on one ring), reliability:
#       drain, cancellation, LoadWeights limits and faults, admission by bytes
#       (server_reliability_tests), authentication and TLS (server_security_tests), shadow
#       verification's shared messages (server_shadow_e2e_tests), residual sessions (server_residual_session_tests:
#       the store's reaper thread, a session held from a gRPC thread to an executor worker).
#       Debian's Abseil and gRPC are not TSan-instrumented. What makes their synchronisation visible:
#       server/common/annotated_mutex.h (our absl::Mutex locks), proto/fusedlayer/wire/tsan_grpc_handoff.cc
#       (linked into every TSan target: absl::Mutex/CondVar as libgrpc uses them, and gRPC's callback
#       operations from start to completion), proto/fusedlayer/wire/tsan_annotations.h (our reactors' hand-offs)
#       and tests/fuzz/tsan.supp (libc interceptors called from inside those libraries; nothing of
#       ours) - docs/operations.md, "Sanitizers and fuzzing". Not here: server_e2e_tests (functional
#       RPC coverage, long to build; clean under TSan when measured) and server_unix_socket_tests (its
#       fusedctl bench echo-floor server, a bidi generic reactor inside libgrpc++, still gets reports:
#       docs/operations.md). TSan turns the CPU ISA clones off (FUSEDLAYER_CPU_ISA_CLONES=OFF): their
#       ifunc resolvers run before TSan's runtime is up.
# Build folders: build-asan/, build-tsan/ (override with ASAN_BUILD_DIR / TSAN_BUILD_DIR).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
JOBS="${JOBS:-$(nproc)}"
# Twice the cores: most tests wait on servers and sockets (scripts/test.sh says more).
CTEST_JOBS="${CTEST_JOBS:-$((JOBS * 2))}"
WHAT="${1:-all}"
step() { printf '\n==== %s\n' "$*"; }

# -g1: line tables and function names, all a sanitizer report's stack needs, in about a quarter less
# compile time than -g (the suites' own files are -g1 already: tests/CMakeLists.txt).
COMMON=(-G Ninja -DFUSEDLAYER_CUDA=OFF -DFUSEDLAYER_HIP=OFF -DFUSEDLAYER_BUILD_BENCH=OFF
        -DCMAKE_BUILD_TYPE=Debug "-DCMAKE_CXX_FLAGS_DEBUG=-O1 -g1" "-DCMAKE_C_FLAGS_DEBUG=-O1 -g1"
        -DCMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST)

if [ "$WHAT" = all ] || [ "$WHAT" = asan ]; then
  B="${ASAN_BUILD_DIR:-$ROOT/build-asan}"
  step "ASan+UBSan build of the whole test suite ($B)"
  cmake -S "$ROOT" -B "$B" "${COMMON[@]}" -DFUSEDLAYER_SANITIZE=ON -DFUSEDLAYER_TSAN=OFF
  cmake --build "$B" -j"$JOBS"
  step "ASan+UBSan: ctest (whole suite)"
  # detect_leaks: every leak fails the test. abort_on_error/halt_on_error: a report is a failure even
  # where a test harness would catch the exit code of a child. The server binary tests start
  # fusedlayer_server itself, which inherits these options. No detect_stack_use_after_return: with
  # GCC 12 its fake stack frames break the 64-byte-aligned spills of the AVX-512 clone of the SWA GEMM
  # micro-kernel (swa_cpu_gemm.cc TileKernel: SEGV on an aligned vector access, only with that
  # option; the same binary passes without it and the clang fuzz build runs the kernel with it).
  ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:strict_string_checks=1:check_initialization_order=1:strict_init_order=1" \
  UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
    ctest --test-dir "$B" --output-on-failure --no-tests=error -j"$CTEST_JOBS"
fi

if [ "$WHAT" = all ] || [ "$WHAT" = tsan ]; then
  B="${TSAN_BUILD_DIR:-$ROOT/build-tsan}"
  step "TSan build of the concurrency tests and the concurrency-heavy e2e suites ($B)"
  cmake -S "$ROOT" -B "$B" "${COMMON[@]}" -DFUSEDLAYER_TSAN=ON -DFUSEDLAYER_SANITIZE=OFF
  cmake --build "$B" -j"$JOBS" --target server_concurrency_tests server_unit_tests weights_tests server_pipeline_tests \
    server_batching_tests server_shared_memory_tests server_reliability_tests server_security_tests \
    server_shadow_e2e_tests server_residual_session_tests server_cuda_shared_memory_tests server_unix_socket_tests \
    server_call_ring_tests server_multi_device_tests
  step "TSan: ctest (executor, thread pool, WeightStore, dispatcher, lanes and staging; e2e: batching, shm, reliability, security, shadow, residual sessions, CUDA shm, call rings, several devices, the server's own unix listener)"
  # halt_on_error + exitcode: the first report fails the test; the server binaries the e2e tests
  # start inherit the options. tests/fuzz/tsan.supp: only libc interceptors called from inside
  # Debian's gRPC, protobuf, Abseil and OpenSSL (policy in its header: races in fusedlayer code are
  # fixed, never suppressed). Cancelled calls included: OnDone acquires the call's reference count
  # and OnCancel releases to OnDone (proto/fusedlayer/wire/tsan_annotations.h, docs/operations.md).
  TSAN_OPTIONS="halt_on_error=1:exitcode=66:second_deadlock_stack=1:suppressions=$ROOT/tests/fuzz/tsan.supp" \
    ctest --test-dir "$B" --output-on-failure --no-tests=error -j"$CTEST_JOBS" \
      -R '^(Concurrency\.|Executor\.|Dispatcher\.|WeightStoreTest\.|WeightManager[./]|IdleWatch\.|Pipeline\.|ExecutorBatching\.|ServerBatching\.|SharedMemory\.|SharedMemoryTokens\.|Reliability\.|LoadWeightsFaults\.|LoadWeightsLimits\.|SecurityTest\.|TokenFile\.|ClientToken\.|IdentityFile\.|TokenAuth\.|TransportSecurity\.|ShadowE2E\.|ShadowFaults\.|ResidualSession(Tokens)?\.|CudaSharedMemory(Tokens)?\.|CallRing(Identities)?\.|MultiDevice\.|UnixSocketTest\.(ServesBoth|AbstractSocket|PeersAre|TokensAre|StaleSocket|BadUnix))'
fi
