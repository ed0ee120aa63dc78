#!/usr/bin/env bash
# Runs on the GPU host from the bundle (.gpu/, see build_and_bundle.sh). Logs go to $OUT.
#   bash .gpu/run_device.sh            everything: suites, sanitizers, benchmarks, torch peers, server smoke
#   STEPS="tests smoke" bash .gpu/run_device.sh    a subset (tests sanitize bench torch smoke dataplane shadow ab
#                                                  samebits abclient sessions shm cudaipc devices profile
#                                                  mhcncu serversan; twogpu on a host with 2 GPUs)
#   SUITES="gpu_swa_tests swa_contract_tests"     the test suites the tests step runs (default: all)
# The run fails (exit 1) when the GPU or the CUDA backend is missing, a suite it asks for is not in
# the bundle, a test fails or skips, or any step's command fails.
set -uo pipefail
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-"tests sanitize serversan bench torch smoke dataplane sessions shm cudaipc devices shadow"}  # and "ab" (needs a baseline server, below)
want() { [[ " $STEPS " == *" $1 "* ]]; }
# start_server PORT METRICS_PORT LOG [extra flags...]: a CUDA-backend server with the demo weights in
# the background (pid in $pid), returning once its health check answers (or after 60 s).
# A server that never answers fails the run (a server that cannot open the GPU exits at startup).
start_server() {
  local port=$1 mport=$2 log=$3; shift 3
  ./fusedlayer_server --demo_weights --backend=cuda --address=127.0.0.1:$port \
    --metrics_address=127.0.0.1:$mport "$@" > "$log" 2>&1 &
  pid=$!
  for _ in $(seq 1 60); do ./fusedctl health --target=127.0.0.1:$port --service=fusedlayer.mhc >/dev/null 2>&1 && return 0; sleep 1; done
  echo "FAILED: the server on :$port did not answer its health check within 60 s ($log)"; failed=1
}
# must CMD...: runs a step's command; a non-zero exit fails the run and is named in the step's log.
must() { "$@" || { local rc=$?; echo "FAILED (rc=$rc): $*"; failed=1; }; }
# stop_server LOG: SIGTERM, then the drain must end with exit 0.
stop_server() {
  kill -TERM $pid; wait $pid; local rc=$?
  echo "server exit rc=$rc" >> "$1"
  [ $rc -eq 0 ] || { echo "FAILED: server exited $rc after SIGTERM ($1)"; failed=1; }
}
# gtest_verdict NAME RC LOG: a suite passes only with exit status 0, a "[  PASSED  ]" line and no
# "[  SKIPPED ]" line (the GPU suites skip themselves where no device answers; gtest 1.12 has no
# --gtest_fail_if_no_test, so a skipped test is caught here), and at least one test run.
gtest_verdict() {
  local name=$1 rc=$2 log=$3
  if [ "$rc" -ne 0 ]; then echo "FAILED: $name rc=$rc"; return 1; fi
  if grep -q '^\[  SKIPPED \]' "$log"; then echo "FAILED: $name skipped tests:"; grep '^\[  SKIPPED \]' "$log"; return 1; fi
  if ! grep -q '^\[  PASSED  \] [1-9]' "$log"; then echo "FAILED: $name ran no test"; return 1; fi
}

# Every failing suite, sanitizer run or step sets `failed`; the script exits non-zero at the end.
failed=0
# The GPU must answer before anything runs: without it every GPU suite would skip and the contract
# suites would run on the CPU backend only (AvailableBackends() leaves out a backend whose device
# does not open), and the run would pass having tested nothing on the GPU.
if ! nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader > "$OUT/device.txt" 2>&1 \
   || ! [ -s "$OUT/device.txt" ]; then
  cat "$OUT/device.txt"; echo "FAILED: nvidia-smi found no GPU"; failed=1
fi
cat "$OUT/device.txt"
# same_bits A B LOG: each A*.safetensors against the file of the same name after prefix B, byte for
# byte; a line each on the console and in LOG. A difference or a missing file fails the run. (The
# loop writes to a file, not a pipe, so that `failed` is set in this shell, not in a subshell.)
same_bits() {
  local a=$1 b=$2 log=$3 f n
  for f in "$a"*.safetensors; do
    n=${f#"$a"}
    if [ -s "$f" ] && cmp -s "$f" "$b$n"; then echo "same bits: $n"; else echo "DIFFER: $n"; failed=1; fi
  done > /tmp/same_bits.txt
  tee -a "$log" < /tmp/same_bits.txt
}

if want tests; then
  # server_residual_session_tests: its OnTheDefaultBackend case runs on the CUDA backend here.
  # server_batching_tests: only its OnTheDefaultBackend case (batched requests bitwise the same
  # requests alone, on the CUDA backend); the rest compares with the CPU library and runs in CI.
  # gpu_cuda_ipc_tests: two processes, itself the client and the bundled fusedlayer_server.
  # SUITES names the suites this run asks for (default: all of them; a bundle built with a subset of
  # GPU_TARGETS passes its own list). A suite asked for and absent from the bundle fails the run.
  for t in ${SUITES:-mhc_contract_tests swa_contract_tests gpu_mhc_tests gpu_swa_tests gpu_lanes_tests \
           server_residual_session_tests server_batching_tests gpu_cuda_ipc_tests}; do
    [ -x ./$t ] || { echo "FAILED: $t is not in this bundle"; failed=1; continue; }
    # The contract suites are instantiated per AvailableBackends(): the cuda instances must be there.
    if [ $t = mhc_contract_tests ] || [ $t = swa_contract_tests ]; then
      ./$t --gtest_list_tests | grep -q 'cuda' || { echo "FAILED: $t has no cuda backend instances (the CUDA backend did not open)"; failed=1; }
    fi
    # (The session suite's fusedctl case runs the build tree's fusedctl, which the bundle does not
    # have; the bench rows below run the bundled one.)
    filter=""; [ $t = server_residual_session_tests ] && filter="--gtest_filter=-*Fusedctl*"
    [ $t = server_batching_tests ] && filter="--gtest_filter=*OnTheDefaultBackend*"
    echo "== $t" >> "$OUT/tests.log"; timeout 240 ./$t --gtest_brief=1 $filter > /tmp/$t.log 2>&1; rc=$?
    cat /tmp/$t.log >> "$OUT/tests.log"; echo "$t rc=$rc"; tail -3 /tmp/$t.log
    # A failure's own lines on the console too, so they survive when only the console of a run
    # comes back (a run with the sanitizers' logs can leave tests.log behind).
    gtest_verdict $t $rc /tmp/$t.log | tee -a "$OUT/tests.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || { failed=1; grep -B2 -A14 -E "Failure|FAILED  \]" /tmp/$t.log | head -80; }
  done
fi
# sanitize NAME TOOL ARGS...: one compute-sanitizer run, its full report in $OUT/sanitizer-NAME.log.
# It passes only with exit status 0 and a summary line that reports 0 errors (memcheck) or
# 0 hazards (racecheck: hazards are warnings, which --error-exitcode does not count). The runs
# below go in parallel (background jobs; mostly host-bound references and instrumentation), each
# verdict a line in $OUT/sanitizers.log, checked after they all finish.
sanitize() {
  local name=$1 tool=$2; shift 2
  local log="$OUT/sanitizer-$name.log"
  timeout 200 compute-sanitizer --tool "$tool" --error-exitcode 9 "$@" > "$log" 2>&1; local rc=$?
  local summary; summary=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$log" | tail -1)
  local ok=1
  [ $rc -eq 0 ] || ok=0
  grep -q '^\[  SKIPPED \]' "$log" && ok=0  # a test that skipped checked nothing
  case "$tool" in
    memcheck) [[ "$summary" == *"ERROR SUMMARY: 0 errors"* ]] || ok=0 ;;
    racecheck) [[ "$summary" == *"RACECHECK SUMMARY: 0 hazards"* ]] || ok=0 ;;
  esac
  echo "== $name ($tool): rc=$rc ${summary:-no summary} -> $([ $ok -eq 1 ] && echo PASS || echo FAIL)" | tee -a "$OUT/sanitizers.log"
}
if want sanitize; then
  sanitize memcheck-gpu_mhc_tests memcheck ./gpu_mhc_tests --gtest_brief=1 &
  # Every kernel of both paths (SeamVariants: 16- and 32-token tiles, aux, no norm weight, normal
  # mode; GraphReplayMatchesEager: C = 5120). The old filter '*Fused*:*Shifted*' matched only
  # FusedSupportReasons, which launches nothing.
  sanitize racecheck-gpu_mhc_tests racecheck ./gpu_mhc_tests --gtest_brief=1 --gtest_filter='*SeamVariants*:*Graph*:*Chained*' &
  # BackendIdentityAndErrors asks for 2^60 bytes on purpose (ResourceExhausted): memcheck counts
  # that failed cudaMalloc as 2 API errors, so it is left out here.
  sanitize memcheck-gpu_swa_tests memcheck ./gpu_swa_tests --gtest_brief=1 --gtest_filter='-*BackendIdentityAndErrors*' &
  sanitize memcheck-swa_contract_tests memcheck ./swa_contract_tests --gtest_brief=1 --gtest_filter='*cuda*' &
  # Lanes: four streams at once through pinned staging (stream-ordered allocation, async copies,
  # one event wait each): an early reuse of staging or device memory is a memcheck error.
  sanitize memcheck-gpu_lanes_tests memcheck ./gpu_lanes_tests --gtest_brief=1 \
    --gtest_filter='-*TruncatedObjectNeverFaults*' &
  # That test page-locks a mapping that reaches past its object's end, which must fail
  # (cudaHostRegister: invalid argument, on purpose); memcheck counts a failed API call as an error
  # (2: the call and the cudaGetLastError that clears it), so it runs apart with API error reports
  # off. Memory errors of its copies from the truncated object are still reported and fail the run.
  sanitize memcheck-gpu_lanes_page_lock memcheck --report-api-errors no ./gpu_lanes_tests \
    --gtest_brief=1 --gtest_filter='*TruncatedObjectNeverFaults*' &
  # The SWA graph/fused tests run cuBLASLt's wq_b GEMM (nvjet_sm90_qqtst_*: closed source,
  # warp-specialised; its producer and consumer warps are ordered by mbarriers). racecheck reports
  # 32 hazards there (potential WAR on shared memory between those warps; the tests' outputs are
  # bitwise stable, graph replay == eager) and none in our kernels (shared/evidence/2026-12-01-
  # h200.md, re-checked 2026-12-02). --kernel-name-exclude kns=nvjet cannot be used to skip it:
  # compute-sanitizer then fails with "Internal Sanitizer Error: failed to handle a hardware
  # exception" and the test sees error 700. So every kernel is checked, and the run passes only if
  # the tests pass and every race report names an nvjet_* kernel on both sides (counted).
  racecheck_known_cublaslt() {
    local name=$1; shift
    local log="$OUT/sanitizer-$name.log"
    timeout 200 compute-sanitizer --tool racecheck "$@" > "$log" 2>&1; local rc=$?
    local summary; summary=$(grep -E "RACECHECK SUMMARY" "$log" | tail -1)
    local ours; ours=$(grep -E "access at " "$log" | grep -vcE "access at nvjet_[A-Za-z0-9_]+\+0x")
    local theirs; theirs=$(grep -cE "Race reported between .* access at nvjet_" "$log")
    local ok=1
    [ -n "$summary" ] || ok=0
    [ "$ours" -eq 0 ] || ok=0
    grep -q "\[  PASSED  \]" "$log" || ok=0
    grep -q "\[  FAILED  \]\|Internal Sanitizer Error" "$log" && ok=0
    grep -q '^\[  SKIPPED \]' "$log" && ok=0
    # rc 0, or the sanitizer's error exit code when every report is in cuBLASLt.
    [ $rc -eq 0 ] || [ $rc -eq 9 ] || ok=0
    echo "== $name (racecheck): rc=$rc ${summary:-no summary}; reports outside cuBLASLt: $ours, in cuBLASLt" \
      "(nvjet_*): $theirs -> $([ $ok -eq 1 ] && echo PASS || echo FAIL)" | tee -a "$OUT/sanitizers.log"
  }
  racecheck_known_cublaslt racecheck-gpu_swa_tests --error-exitcode 9 ./gpu_swa_tests --gtest_brief=1 \
    --gtest_filter='*Graph*:*Fused*' &
  wait
  # Every run above passed (seven; a binary missing from the bundle fails its run).
  [ "$(grep -c -- '-> PASS' "$OUT/sanitizers.log")" -eq 7 ] || failed=1
fi
# bench: with bench_mhc_gpu_base in the bundle (build_and_bundle.sh BASE_BENCH=...), the old and new
# mHC benchmark run interleaved, base/new MHC_AB_PASSES times (default 2), for each size in
# BENCH_MHC_SIZES ("C:T ..."; default the full table), every row tagged with its binary and pass.
mhc_bench() {  # mhc_bench BINARY TAG (a run that fails fails the whole run: pipefail gives its status)
  if [ -n "${BENCH_MHC_SIZES:-}" ]; then
    for ct in $BENCH_MHC_SIZES; do
      timeout 100 "$1" --C "${ct%%:*}" --T "${ct##*:}" | sed -n "s/^ *[0-9]/$2 &/p" \
        || { echo "FAILED: $1 --C ${ct%%:*} --T ${ct##*:}"; failed=1; }
    done
  else
    timeout 200 "$1" ${BENCH_MHC_ARGS:-} | sed "s/^ *[0-9]/$2 &/" || { echo "FAILED: $1"; failed=1; }
  fi
}
if want bench; then
  # Both benchmarks must be in the bundle (bench_swa_gpu is not run with BENCH_MHC_SIZES).
  { for b in ./bench_mhc_gpu ./bench_swa_gpu; do [ -x $b ] || { echo "FAILED: $b is not in this bundle"; failed=1; }; done
    if [ -x ./bench_mhc_gpu_base ]; then
      echo "== bench_mhc_gpu: base (old) and new interleaved; columns: binary pass C T fused_us unfused_us floor_us fused_%bw L"
      for pass in $(seq 1 "${MHC_AB_PASSES:-2}"); do mhc_bench ./bench_mhc_gpu_base "base $pass"; mhc_bench ./bench_mhc_gpu "new $pass"; done
    elif [ -x ./bench_mhc_gpu ]; then
      echo "== bench_mhc_gpu"; mhc_bench ./bench_mhc_gpu new
    fi
    if [ -x ./bench_swa_gpu ] && [ -z "${BENCH_MHC_SIZES:-}" ]; then
      echo "== bench_swa_gpu"; must timeout 150 ./bench_swa_gpu ${BENCH_SWA_ARGS:-}
    fi; } > "$OUT/bench.log" 2>&1; cat "$OUT/bench.log"
fi
# mhcncu: ncu of the mHC kernels (cold caches, clocks as found) for each "C:T" of MHC_NCU_SIZES, one
# eager launch per path, with the base binary too when the bundle has it.
if want mhcncu; then
  for bin in ./bench_mhc_gpu_base ./bench_mhc_gpu; do
    [ -x $bin ] || continue
    for ct in ${MHC_NCU_SIZES:-7168:4096}; do
      echo "== ncu $bin C=${ct%%:*} T=${ct##*:}"
      timeout 120 ncu --clock-control none --cache-control all --section SpeedOfLight --section Occupancy \
        --section LaunchStats "$bin" --once --C "${ct%%:*}" --T "${ct##*:}" 2>&1 \
        | grep -E "^  void|^  [A-Za-z].*\(|Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Grid Size|Dynamic Shared|fused_us|^ +[0-9]+ +[0-9]+ "
    done
  done > "$OUT/mhc-ncu.log" 2>&1; cat "$OUT/mhc-ncu.log"
fi
if want torch; then
  # The peers, then the mHC seam's practical floor on this card (a copy of the same bytes).
  { PYTHONUNBUFFERED=1 timeout 150 python3 torch_mhc_peer.py --quick; PYTHONUNBUFFERED=1 timeout 120 python3 torch_peers.py --quick
    PYTHONUNBUFFERED=1 timeout 120 python3 torch_seam_copy_floor.py; } > "$OUT/torch.log" 2>&1; tail -50 "$OUT/torch.log"
fi
if want smoke; then
  echo "== server smoke (CUDA backend, demo weights)"
  start_server 50151 50152 "$OUT/server.log"
  { C="--target=127.0.0.1:50151"
    must ./fusedctl info $C; must ./fusedctl health $C --service=fusedlayer.swa
    must ./fusedctl seam $C --weight_set=v4-pro/demo --tokens=64
    must ./fusedctl swa $C --weight_set=v4-pro/demo --tokens=64
    must ./fusedctl seam $C --weight_set=v41-flash/demo --tokens=8 --path=force_unfused
    must ./fusedctl bench $C --op=mhc --weight_set=v4-pro/demo --tokens=64 --concurrency=4 --duration=10s
    must ./fusedctl bench $C --op=swa --weight_set=v4-pro/demo --tokens=64 --concurrency=4 --duration=10s
    python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:50152/metrics').read().decode())" \
      | grep -E '^fusedlayer_(op_executions_total|op_fallbacks_total\{op="mhc",reason="client_forced_unfused"|fused_kernel_available|build_info|weights_resident)' \
        || { echo "FAILED: metrics missing from /metrics"; failed=1; }
  } > "$OUT/smoke.log" 2>&1
  stop_server "$OUT/smoke.log"
  cat "$OUT/smoke.log"
  # A/B of the request staging allocator (docs/operations.md): the same benches with plain
  # cudaMalloc/cudaFree per request buffer.
  echo "== server smoke, FUSEDLAYER_NO_GPU_STAGING_POOL=1 (plain allocation, for comparison)"
  FUSEDLAYER_NO_GPU_STAGING_POOL=1 start_server 50171 50172 "$OUT/server-nopool.log"
  { C="--target=127.0.0.1:50171"
    must ./fusedctl bench $C --op=mhc --weight_set=v4-pro/demo --tokens=64 --concurrency=4 --duration=10s
    must ./fusedctl bench $C --op=swa --weight_set=v4-pro/demo --tokens=64 --concurrency=4 --duration=10s
  } > "$OUT/smoke-nopool.log" 2>&1
  stop_server "$OUT/smoke-nopool.log"
  cat "$OUT/smoke-nopool.log"
fi
# The data path (BENCHMARKS.md, "End to end over gRPC"): each row beside its transport floor
# (fusedctl bench --echo_floor: a bare gRPC echo of the same byte counts over the same channel
# options, from the same run), and dynamic batching on (--max_batch_tokens=64, the default) and off (0) at
# concurrency 16 with T = 1 decode requests.
# Residual sessions: x only per call, the state in device memory, against the same
# request inline (TCP row) and the echo floor of the session's own bytes. Target: bytes per mHC
# call <= 0.25x a plain call, p50 accordingly lower.
if want sessions; then
  echo "== residual sessions"
  start_server 50191 50192 "$OUT/server-sessions.log"
  { C="--target=127.0.0.1:50191"
    must ./fusedctl bench $C --op=mhc --weight_set=v4-pro/demo --tokens=64 --concurrency=1 --duration=6s --transport=session --echo_floor
    must ./fusedctl bench $C --op=mhc --weight_set=v4-pro/demo --tokens=1 --concurrency=1 --duration=6s --transport=session --echo_floor
    must ./fusedctl bench $C --op=mhc --weight_set=v4-pro/demo --tokens=64 --concurrency=16 --duration=6s --transport=session
    python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:50192/metrics').read().decode())" \
      | grep -E '^fusedlayer_residual_session' \
        || { echo "FAILED: metrics missing from /metrics"; failed=1; }
  } >> "$OUT/sessions.log" 2>&1
  stop_server "$OUT/sessions.log"
fi
# System shared memory on one server: first the outputs of each op through a registered
# region against the same inputs inline over TCP (fusedctl --seed, compared byte for byte), then the
# bench rows, each of which runs the shm row, the same request inline over TCP and the echo floor of
# both byte counts. Target: mHC C = 7168 T = 64 round trip p50 <= 400 us.
if want shm; then
  echo "== system shared memory"
  start_server 50187 50188 "$OUT/server-shm.log" --allow_shared_memory
  { C="--target=127.0.0.1:50187"
    for t in 1 7 64 300; do
      for transport in tcp shm; do
        ./fusedctl seam $C --weight_set=v4-pro/demo --tokens=$t --seed=$((100 + t)) --capture_aux --transport=$transport \
          --output=/tmp/shm-$transport-mhc-$t.safetensors > /dev/null || echo "seam T=$t over $transport failed"
        ./fusedctl seam $C --weight_set=v41-flash/demo --tokens=$t --seed=$((200 + t)) --mode=normal --transport=$transport \
          --output=/tmp/shm-$transport-mhcnormal-$t.safetensors > /dev/null || echo "seam normal T=$t over $transport failed"
        ./fusedctl swa $C --weight_set=v4-pro/demo --tokens=$t --seed=$((300 + t)) --transport=$transport \
          --output=/tmp/shm-$transport-swa-$t.safetensors > /dev/null || echo "swa T=$t over $transport failed"
      done
    done
  } > "$OUT/shm.log" 2>&1
  same_bits /tmp/shm-tcp- /tmp/shm-shm- "$OUT/shm.log"
  grep -q "failed" "$OUT/shm.log" && failed=1
  { C="--target=127.0.0.1:50187"
    for pass in 1 2; do
      echo "---- pass $pass"
      must ./fusedctl bench $C --op=mhc --weight_set=v4-pro/demo --tokens=64 --concurrency=1 --duration=5s --transport=shm --echo_floor
      must ./fusedctl bench $C --op=mhc --weight_set=v4-pro/demo --tokens=1 --concurrency=1 --duration=5s --transport=shm --echo_floor
      must ./fusedctl bench $C --op=swa --weight_set=v4-pro/demo --tokens=64 --concurrency=1 --duration=5s --transport=shm --echo_floor
    done
    must ./fusedctl bench $C --op=mhc --weight_set=v4-pro/demo --tokens=64 --concurrency=16 --duration=5s --transport=shm
    python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:50188/metrics').read().decode())" \
      | grep -E '^fusedlayer_shared_memory' \
        || { echo "FAILED: metrics missing from /metrics"; failed=1; }
  } >> "$OUT/shm.log" 2>&1
  stop_server "$OUT/shm.log"
fi
# CUDA shared memory: the tensors in this host's device memory, used by the server's
# kernels in place, against the same request inline (TCP row) and the echo floor of its bytes.
# Targets: mHC C = 7168 T = 64 p50 <= 80 us, T = 1 <= 40 us, SWA M = 64 <= 40 us.
if want cudaipc; then
  echo "== CUDA shared memory"
  start_server 50195 50196 "$OUT/server-cudaipc.log" --allow_cuda_shared_memory
  { C="--target=127.0.0.1:50195"
    for pass in 1 2; do
      echo "---- pass $pass"
      must ./fusedctl bench $C --op=mhc --weight_set=v4-pro/demo --tokens=64 --concurrency=1 --duration=5s --transport=cuda_ipc --echo_floor
      must ./fusedctl bench $C --op=mhc --weight_set=v4-pro/demo --tokens=1 --concurrency=1 --duration=5s --transport=cuda_ipc
      must ./fusedctl bench $C --op=swa --weight_set=v4-pro/demo --tokens=64 --concurrency=1 --duration=5s --transport=cuda_ipc
    done
    must ./fusedctl bench $C --op=mhc --weight_set=v4-pro/demo --tokens=64 --concurrency=16 --duration=5s --transport=cuda_ipc
    # Large calls: T = 4096 (300 MB inline, its TCP row beside it) and T = 16384, whose 1.2 GB of
    # outputs are over the 1 GiB message limit inline (that row is refused) but run by reference.
    must ./fusedctl bench $C --op=mhc --weight_set=v4-pro/demo --tokens=4096 --concurrency=1 --duration=5s --transport=cuda_ipc
    must ./fusedctl bench $C --op=mhc --weight_set=v4-pro/demo --tokens=16384 --concurrency=1 --duration=5s --transport=cuda_ipc
    python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:50196/metrics').read().decode())" \
      | grep -E '^fusedlayer_cuda_shared_memory' \
        || { echo "FAILED: metrics missing from /metrics"; failed=1; }
  } >> "$OUT/cudaipc.log" 2>&1
  stop_server "$OUT/cudaipc.log"
fi
# devices: one server for the host's GPUs (--devices). Every GPU this process sees serves, and one
# index past the last is listed too: it must fail its start-up check, be left out and reported by
# info (the server serves on the others), and a call naming it must be INVALID_ARGUMENT. Each
# serving GPU runs the calls that name it (the report's device_id), a CUDA IPC call runs on its
# memory's GPU, and the op series carry the device label.
if want devices; then
  echo "== devices"
  n=$(nvidia-smi -L | wc -l)
  ids=$(seq -s, 0 "$n")
  start_server 50211 50212 "$OUT/server-devices.log" --devices="$ids" --allow_cuda_shared_memory
  { C="--target=127.0.0.1:50211"
    must ./fusedctl info $C | tee "$OUT/devices-info.txt"
    for i in $(seq 0 $((n - 1))); do
      grep -Eq "^  cuda:$i +device_id $i  NVIDIA" "$OUT/devices-info.txt" || { echo "FAILED: cuda:$i is not listed as serving"; failed=1; }
      ./fusedctl seam $C --weight_set=v4-pro/demo --tokens=64 --device_id=$i > "$OUT/devices-seam-$i.txt" 2>&1 \
        || { echo "FAILED: seam on device $i"; failed=1; }
      cat "$OUT/devices-seam-$i.txt"
      grep -q "(device_id $i)" "$OUT/devices-seam-$i.txt" || { echo "FAILED: the seam named device $i ran elsewhere"; failed=1; }
      must ./fusedctl swa $C --weight_set=v4-pro/demo --tokens=64 --device_id=$i
    done
    grep -Eq "^  cuda:$n +device_id $n  NOT SERVING" "$OUT/devices-info.txt" \
      || { echo "FAILED: cuda:$n (no such GPU) is not reported as left out"; failed=1; }
    if ./fusedctl seam $C --weight_set=v4-pro/demo --tokens=8 --device_id=$n > "$OUT/devices-absent.txt" 2>&1; then
      echo "FAILED: a call naming the absent device $n succeeded"; failed=1
    fi
    cat "$OUT/devices-absent.txt"
    grep -q INVALID_ARGUMENT "$OUT/devices-absent.txt" || { echo "FAILED: not INVALID_ARGUMENT"; failed=1; }
    ./fusedctl seam $C --weight_set=v4-pro/demo --tokens=64 --transport=cuda_ipc > "$OUT/devices-ipc.txt" 2>&1 \
      || { echo "FAILED: seam over CUDA IPC"; failed=1; }
    cat "$OUT/devices-ipc.txt"
    grep -q "(device_id 0)" "$OUT/devices-ipc.txt" || { echo "FAILED: the CUDA IPC call did not run on GPU 0"; failed=1; }
    must ./fusedctl bench $C --op=mhc --weight_set=v4-pro/demo --tokens=64 --concurrency=16 --duration=5s --transport=cuda_ipc
    must ./fusedctl bench $C --op=mhc --weight_set=v4-pro/demo --tokens=64 --concurrency=16 --duration=5s
    python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:50212/metrics').read().decode())" \
      | grep -E '^fusedlayer_(op_executions_total|weights_resident_bytes).*device="cuda:0"' \
        || { echo "FAILED: no device=\"cuda:0\" op series in /metrics"; failed=1; }
  } > "$OUT/devices.log" 2>&1
  stop_server "$OUT/devices.log"
  cat "$OUT/devices.log"
fi
# twogpu (a host with 2 GPUs or more; not in the default STEPS): one server for two GPUs against the
# same server on one, and two servers (one per GPU) behind the client's round_robin. mHC T = 64 and
# SWA M = 64 at concurrency 16, inline and over CUDA shared memory (there two fusedctl processes of
# concurrency 8, each with its tensors on its own GPU, --cuda_device; on the one-GPU server both on
# GPU 0); the throughputs side by side in twogpu.log. And the same seeded calls on GPU 0 and GPU 1
# must give the same bits.
if want twogpu; then
  echo "== two GPUs"
  [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { echo "FAILED: twogpu needs 2 GPUs"; failed=1; }
  two_ipc() {  # two_ipc TARGET OP GPU_A GPU_B: two concurrent c8 CUDA IPC benches
    ./fusedctl bench --target=$1 --op=$2 --weight_set=v4-pro/demo --tokens=64 --concurrency=8 --duration=8s \
      --transport=cuda_ipc --cuda_device=$3 > "$OUT/twogpu-ipc-a.txt" 2>&1 & local p=$!
    ./fusedctl bench --target=$1 --op=$2 --weight_set=v4-pro/demo --tokens=64 --concurrency=8 --duration=8s \
      --transport=cuda_ipc --cuda_device=$4 > "$OUT/twogpu-ipc-b.txt" 2>&1 || { echo "FAILED: ipc bench on GPU $4"; failed=1; }
    wait $p || { echo "FAILED: ipc bench on GPU $3"; failed=1; }
    cat "$OUT/twogpu-ipc-a.txt" "$OUT/twogpu-ipc-b.txt"
  }
  { for devices in 0,1 0; do
      echo "---- one server, --devices=$devices"
      start_server 50231 50232 "$OUT/server-twogpu-$devices.log" --devices=$devices --allow_cuda_shared_memory
      C="--target=127.0.0.1:50231"
      must ./fusedctl info $C
      for op in mhc swa; do
        must ./fusedctl bench $C --op=$op --weight_set=v4-pro/demo --tokens=64 --concurrency=16 --duration=8s
        if [ $devices = 0,1 ]; then two_ipc 127.0.0.1:50231 $op 0 1; else two_ipc 127.0.0.1:50231 $op 0 0; fi
      done
      if [ $devices = 0,1 ]; then
        for g in 0 1; do
          must ./fusedctl seam $C --weight_set=v4-pro/demo --tokens=64 --seed=7 --device_id=$g --output=/tmp/twogpu-$g-mhc.safetensors
          must ./fusedctl swa $C --weight_set=v4-pro/demo --tokens=64 --seed=7 --device_id=$g --output=/tmp/twogpu-$g-swa.safetensors
        done
        same_bits /tmp/twogpu-0- /tmp/twogpu-1- "$OUT/twogpu.log"
      fi
      stop_server "$OUT/twogpu.log"
    done
    echo "---- two servers, one per GPU, the client's round_robin over both"
    start_server 50241 50242 "$OUT/server-twogpu-a.log" --devices=0; pa=$pid
    start_server 50243 50244 "$OUT/server-twogpu-b.log" --devices=1; pb=$pid
    for op in mhc swa; do
      must ./fusedctl bench --target=ipv4:127.0.0.1:50241,127.0.0.1:50243 --lb_policy=round_robin --op=$op \
        --weight_set=v4-pro/demo --tokens=64 --concurrency=16 --duration=8s
    done
    pid=$pa; stop_server "$OUT/twogpu.log"
    pid=$pb; stop_server "$OUT/twogpu.log"
  } >> "$OUT/twogpu.log" 2>&1
  cat "$OUT/twogpu.log"
fi
# serversan: the server process itself under compute-sanitizer memcheck (its lanes, staging, the
# kernels it launches, the IPC openings, the stream's stores of ring completions) while fusedctl
# drives every transport (call rings included) and both paths;
# passes with 0 errors in the report written when the server exits (SIGTERM: drain, then exit).
if want serversan; then
  echo "== server under compute-sanitizer memcheck"
  log="$OUT/sanitizer-server-memcheck.log"
  compute-sanitizer --tool memcheck --error-exitcode 9 ./fusedlayer_server --demo_weights --backend=cuda \
    --address=127.0.0.1:50201 --metrics_address=127.0.0.1:50202 --allow_shared_memory --allow_cuda_shared_memory \
    --allow_call_rings > "$log" 2>&1 &
  pid=$!
  for _ in $(seq 1 240); do ./fusedctl health --target=127.0.0.1:50201 --service=fusedlayer.mhc >/dev/null 2>&1 && break; sleep 1; done
  { C="--target=127.0.0.1:50201"
    # ring_cuda_ipc: completions stored by the lane's stream after the kernels (cuStreamWriteValue32).
    for transport in tcp shm cuda_ipc ring ring_cuda_ipc; do
      must ./fusedctl seam $C --weight_set=v4-pro/demo --tokens=64 --transport=$transport
      must ./fusedctl seam $C --weight_set=v4-pro/demo --tokens=3 --transport=$transport --path=force_unfused
      must ./fusedctl swa $C --weight_set=v4-pro/demo --tokens=64 --transport=$transport
    done
    must ./fusedctl seam $C --weight_set=v4-pro/demo --session=s --stage=first --tokens=16
    must ./fusedctl seam $C --weight_set=v4-pro/demo --session=s --return_state
    must ./fusedctl seam $C --weight_set=v4-pro/demo --tokens=1100              # the large-T finalize instances
    must ./fusedctl seam $C --weight_set=v41-flash/demo --tokens=1300 --mode=normal
    must ./fusedctl bench $C --op=mhc --weight_set=v4-pro/demo --tokens=16 --concurrency=4 --duration=3s
    must ./fusedctl bench $C --op=swa --weight_set=v4-pro/demo --tokens=16 --concurrency=4 --duration=3s --transport=cuda_ipc
  } > "$OUT/serversan.log" 2>&1
  # The server itself gets the SIGTERM (compute-sanitizer, $pid, waits for it and then reports).
  pkill -TERM -x fusedlayer_serv; wait $pid; rc=$?
  summary=$(grep -E "ERROR SUMMARY" "$log" | tail -1)
  ok=1; [ $rc -eq 0 ] && [[ "$summary" == *"ERROR SUMMARY: 0 errors"* ]] || ok=0
  echo "== server (memcheck): rc=$rc ${summary:-no summary} -> $([ $ok -eq 1 ] && echo PASS || echo FAIL)" | tee -a "$OUT/sanitizers.log"
  [ $ok -eq 1 ] || failed=1
  grep -cE "^(seam|swa|bench|request|requests) " "$OUT/serversan.log" || true
  grep -iE "error|failed|refused" "$OUT/serversan.log" | head -20
fi
if want dataplane; then
  echo "== data path: end-to-end rows with their echo floor; batching on/off"
  for batching in 64 0; do
    start_server 50181 50182 "$OUT/server-dataplane-$batching.log" --max_batch_tokens=$batching
    { C="--target=127.0.0.1:50181"
      echo "---- --max_batch_tokens=$batching"
      if [ "$batching" = 64 ]; then
        must ./fusedctl bench $C --op=mhc --weight_set=v4-pro/demo --tokens=64 --concurrency=1 --duration=6s --echo_floor
        must ./fusedctl bench $C --op=mhc --weight_set=v4-pro/demo --tokens=64 --concurrency=16 --duration=6s --echo_floor
        must ./fusedctl bench $C --op=mhc --weight_set=v4-pro/demo --tokens=1 --concurrency=1 --duration=6s --echo_floor
        must ./fusedctl bench $C --op=swa --weight_set=v4-pro/demo --tokens=64 --concurrency=1 --duration=6s --echo_floor
        must ./fusedctl bench $C --op=swa --weight_set=v4-pro/demo --tokens=64 --concurrency=16 --duration=6s --echo_floor
      fi
      must ./fusedctl bench $C --op=mhc --weight_set=v4-pro/demo --tokens=1 --concurrency=16 --duration=6s
      must ./fusedctl bench $C --op=swa --weight_set=v4-pro/demo --tokens=1 --concurrency=16 --duration=6s
      python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:50182/metrics').read().decode())" \
        | grep -E '^fusedlayer_batch_(requests|tokens)_(sum|count)' \
          || { echo "FAILED: metrics missing from /metrics"; failed=1; }
    } >> "$OUT/dataplane.log" 2>&1
    stop_server "$OUT/dataplane.log"
  done
  # Device lanes A/B (docs/operations.md "Device lanes"): the same binary with one
  # lane (the serial data path) and the default (auto = 4), batching off so only the lanes differ.
  # Targets: server p50 mHC T = 64 <= 0.5 ms, SWA M = 64 <= 60 us, req/s at c16 >= 3x c1.
  for lanes in 1 0; do
    start_server 50185 50186 "$OUT/server-dataplane-lanes-$lanes.log" --max_batch_tokens=0 --device_lanes=$lanes
    { C="--target=127.0.0.1:50185"
      echo "---- --device_lanes=$lanes (0 = auto), --max_batch_tokens=0"
      grep -h "device lanes:" "$OUT/server-dataplane-lanes-$lanes.log" || true
      for op in mhc swa; do
        for conc in 1 4 16; do
          must ./fusedctl bench $C --op=$op --weight_set=v4-pro/demo --tokens=64 --concurrency=$conc --duration=5s
        done
      done
      must ./fusedctl bench $C --op=mhc --weight_set=v4-pro/demo --tokens=1 --concurrency=16 --duration=5s
      python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:50186/metrics').read().decode())" \
        | grep -E '^fusedlayer_host_staging_' \
          || { echo "FAILED: metrics missing from /metrics"; failed=1; }
    } >> "$OUT/dataplane.log" 2>&1
    stop_server "$OUT/dataplane.log"
  done
  # The same A/B on the CPU backend (2 threads, like the CI machine; this host is otherwise idle).
  for batching in 64 0; do
    start_server 50183 50184 "$OUT/server-dataplane-cpu-$batching.log" --backend=cpu --cpu_threads=2 \
      --max_batch_tokens=$batching
    { C="--target=127.0.0.1:50183"
      echo "---- CPU backend, 2 threads, --max_batch_tokens=$batching"
      must ./fusedctl bench $C --op=mhc --weight_set=v4-pro/demo --tokens=1 --concurrency=16 --duration=6s
      must ./fusedctl bench $C --op=mhc --weight_set=v4-pro/demo --tokens=1 --concurrency=1 --duration=4s
    } >> "$OUT/dataplane.log" 2>&1
    stop_server "$OUT/dataplane.log"
  done
  cat "$OUT/dataplane.log"
fi
if want shadow; then
  echo "== shadow verification on the GPU (CUDA backend, demo weights, sample rate 1, verify)"
  start_server 50161 50162 "$OUT/shadow-server.log" --shadow_sample_rate=1
  { C="--target=127.0.0.1:50161"
    for ws in v4-pro/demo v41-flash/demo; do
      for T in 1 7 64 300; do
        ./fusedctl seam $C --weight_set=$ws --tokens=$T > /dev/null || echo "seam $ws T=$T failed"
        ./fusedctl seam $C --weight_set=$ws --tokens=$T --mode=normal > /dev/null || echo "seam normal $ws T=$T failed"
        ./fusedctl seam $C --weight_set=$ws --tokens=$T --capture_aux > /dev/null || echo "seam aux $ws T=$T failed"
        ./fusedctl swa $C --weight_set=$ws --tokens=$T > /dev/null || echo "swa $ws T=$T failed"
        sleep 0.2
      done
    done
    ./fusedctl seam $C --weight_set=v4-pro/demo --tokens=64 --verify | grep -i -E "verif|mismatch|compared" | head -12
    ./fusedctl swa $C --weight_set=v4-pro/demo --tokens=64 --verify | grep -i -E "verif|mismatch|compared" | head -12
    sleep 2
    python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:50162/metrics').read().decode())" \
      | grep -E '^fusedlayer_shadow_(comparisons_total|mismatches_total|dropped_total|errors_total)' | grep -v ' 0$'
  } > "$OUT/shadow.log" 2>&1
  stop_server "$OUT/shadow.log"
  cat "$OUT/shadow.log"
  grep -q " failed$" "$OUT/shadow.log" && failed=1
fi
# Old and new server in one session (METHOD.md: compare binaries on the same machine, back to back):
# the bundle carries a baseline server as fusedlayer_server_base (build_and_bundle.sh BASE_SERVER=...).
# Each row runs against the baseline and then the new server, same flags, same client; the new
# server's rows also get their echo floor. AB_ROWS / AB_SECONDS / AB_FLAGS (both servers) override the
# defaults; AB_NEW_FLAGS adds a third pass of the new server with those flags (e.g. --device_lanes=1);
# AB_PASSES (e.g. "base new base new") interleaves the servers, so a drift of the host shows up;
# AB_FLOOR_ALL=1 gives every row of the new server its echo floor (by default only concurrency 1);
# AB_SHM_ROWS (same form as AB_ROWS) runs those rows over --transport=shm on both servers too, and
# AB_IPC_ROWS over --transport=cuda_ipc.
if want ab; then
  if [ ! -x ./fusedlayer_server_base ]; then
    echo "== ab: no fusedlayer_server_base in this bundle (build_and_bundle.sh BASE_SERVER=...)"; failed=1
  else
    ab_seconds=${AB_SECONDS:-4}
    ab_rows=${AB_ROWS:-"mhc:64:1 mhc:64:16 mhc:1:1 mhc:1:16 swa:64:1 swa:64:16 swa:1:16"}
    echo "== ab: baseline vs new server (${ab_seconds} s per row): $ab_rows" | tee "$OUT/ab.log"
    passes="base new"; [ -n "${AB_NEW_FLAGS:-}" ] && passes="base new new+"
    passes=${AB_PASSES:-$passes}
    for which in $passes; do
      server=./fusedlayer_server; [ "$which" = base ] && server=./fusedlayer_server_base
      extra=""; [ "$which" = new+ ] && extra="$AB_NEW_FLAGS"
      [ "$which" != new+ ] && [ -n "${AB_SHM_ROWS:-}" ] && extra="--allow_shared_memory"
      [ "$which" != new+ ] && [ -n "${AB_IPC_ROWS:-}" ] && extra="$extra --allow_cuda_shared_memory"
      [ "$which" = new+ ] && echo "---- new+ = new server with $AB_NEW_FLAGS" >> "$OUT/ab.log"
      # shellcheck disable=SC2086
      $server --demo_weights --backend=cuda --address=127.0.0.1:50191 --metrics_address=127.0.0.1:50192 \
        ${AB_FLAGS:-} $extra > "$OUT/server-ab-$which.log" 2>&1 &
      pid=$!
      for _ in $(seq 1 60); do ./fusedctl health --target=127.0.0.1:50191 --service=fusedlayer.mhc >/dev/null 2>&1 && break; sleep 1; done
      for row in $ab_rows; do
        IFS=: read -r op tokens conc <<< "$row"
        echo "---- $which $op T=$tokens c=$conc" >> "$OUT/ab.log"
        floor=""; [ "$which" = new ] && { [ "$conc" = 1 ] || [ -n "${AB_FLOOR_ALL:-}" ]; } && floor=--echo_floor
        ./fusedctl bench --target=127.0.0.1:50191 --op=$op --weight_set=v4-pro/demo --tokens=$tokens \
          --concurrency=$conc --duration=${ab_seconds}s $floor >> "$OUT/ab.log" 2>&1 || echo "bench failed" >> "$OUT/ab.log"
      done
      if [ "$which" != new+ ]; then
        for transport in shm cuda_ipc; do
          rows=${AB_SHM_ROWS:-}; [ $transport = cuda_ipc ] && rows=${AB_IPC_ROWS:-}
          for row in $rows; do
            IFS=: read -r op tokens conc <<< "$row"
            echo "---- $which $transport $op T=$tokens c=$conc" >> "$OUT/ab.log"
            ./fusedctl bench --target=127.0.0.1:50191 --op=$op --weight_set=v4-pro/demo --tokens=$tokens \
              --concurrency=$conc --duration=${ab_seconds}s --transport=$transport >> "$OUT/ab.log" 2>&1 || echo "bench failed" >> "$OUT/ab.log"
          done
        done
      fi
      kill -TERM $pid; wait $pid; echo "$which server exit rc=$?" >> "$OUT/ab.log"
    done
    cat "$OUT/ab.log"
  fi
fi
# samebits: the new server's outputs against the baseline server's (fusedlayer_server_base), same
# inputs (fusedctl --seed), compared byte for byte: for a change of the data path, not the kernels.
if want samebits; then
  if [ ! -x ./fusedlayer_server_base ]; then
    echo "== samebits: no fusedlayer_server_base in this bundle"; failed=1
  else
    echo "== samebits: new vs baseline server outputs, same seeds" | tee "$OUT/samebits.log"
    for which in base new; do
      server=./fusedlayer_server; [ "$which" = base ] && server=./fusedlayer_server_base
      $server --demo_weights --backend=cuda --address=127.0.0.1:50193 --metrics_address=127.0.0.1:50194 \
        > "$OUT/server-samebits-$which.log" 2>&1 &
      pid=$!
      for _ in $(seq 1 60); do ./fusedctl health --target=127.0.0.1:50193 --service=fusedlayer.mhc >/dev/null 2>&1 && break; sleep 1; done
      C="--target=127.0.0.1:50193"
      for t in 1 7 64 300; do
        ./fusedctl seam $C --weight_set=v4-pro/demo --tokens=$t --seed=$((100 + t)) --capture_aux \
          --output=/tmp/sb-$which-mhc-$t.safetensors >> "$OUT/samebits.log" 2>&1 || failed=1
        ./fusedctl seam $C --weight_set=v41-flash/demo --tokens=$t --seed=$((200 + t)) --mode=normal \
          --output=/tmp/sb-$which-mhcnormal-$t.safetensors >> "$OUT/samebits.log" 2>&1 || failed=1
        ./fusedctl swa $C --weight_set=v4-pro/demo --tokens=$t --seed=$((300 + t)) \
          --output=/tmp/sb-$which-swa-$t.safetensors >> "$OUT/samebits.log" 2>&1 || failed=1
      done
      kill -TERM $pid; wait $pid
    done
    same_bits /tmp/sb-base- /tmp/sb-new- "$OUT/samebits.log"
  fi
fi
# abclient: the client side of the round trip on the new server: fusedctl bench with shared
# requests (tensor data sent by reference, the default) and with --copy_requests (protobuf
# serialization per call), interleaved, each shared row with its echo floor.
if want abclient; then
  start_server 50195 50196 "$OUT/server-abclient.log"
  echo "== abclient: shared vs serialized requests (${AB_SECONDS:-4} s per row)" | tee "$OUT/abclient.log"
  abc_rows=${ABC_ROWS:-mhc:64:1 mhc:1:1 swa:64:1}
  for row in $abc_rows; do
    IFS=: read -r op tokens conc <<< "$row"
    for pass in 1 2; do
      for mode in shared serialized; do
        extra="--echo_floor"; [ "$mode" = serialized ] && extra="--copy_requests"
        echo "---- $mode $op T=$tokens c=$conc pass $pass" >> "$OUT/abclient.log"
        ./fusedctl bench --target=127.0.0.1:50195 --op=$op --weight_set=v4-pro/demo --tokens=$tokens \
          --concurrency=$conc --duration=${AB_SECONDS:-4}s $extra >> "$OUT/abclient.log" 2>&1 || echo "bench failed" >> "$OUT/abclient.log"
      done
    done
  done
  stop_server "$OUT/abclient.log"
fi
# Where a small CUDA shared-memory call's server time goes on the host (decode ~30-40 us):
# a CPU profile of the server during an mHC T = 1 bench, and its system calls. Needs perf / strace
# in the bundle (not bundled by default: build_and_bundle.sh's PROFILE_TOOLS=1) and a server with
# its symbol table (the same switch keeps it).
if want profile; then
  echo "== profile: CUDA shared-memory call, server side"
  start_server 50197 50198 "$OUT/server-profile.log" --allow_cuda_shared_memory
  { C="--target=127.0.0.1:50197"
    ./fusedctl bench $C --op=mhc --weight_set=v4-pro/demo --tokens=1 --concurrency=1 --duration=2s --transport=cuda_ipc
    ./fusedctl bench $C --op=mhc --weight_set=v4-pro/demo --tokens=1 --concurrency=1 --duration=12s --transport=cuda_ipc &
    bench=$!
    sleep 4
    if [ -x ./perf ]; then
      timeout 20 ./perf record -F 4999 -g -o /tmp/perf.data -p $pid -- sleep 3 2>&1 | tail -2
      ./perf report -i /tmp/perf.data --stdio --no-children --sort symbol --percent-limit 0.4 2>/dev/null | grep -v "^$" | head -250
      echo "---- by thread"
      ./perf report -i /tmp/perf.data --stdio --no-children --sort comm --percent-limit 1 2>/dev/null | grep -v "^#" | grep -v "^$" | head -30
    else
      echo "no perf in this bundle"
    fi
    # strace detaches on SIGINT and writes its summary.
    if [ -x ./strace ]; then timeout -s INT 3 ./strace -c -f -p $pid -o /tmp/strace.txt; cat /tmp/strace.txt; fi
    wait $bench
  } >> "$OUT/profile.log" 2>&1
  stop_server "$OUT/profile.log"
fi
echo "run_device: failed=$failed"
exit $failed
