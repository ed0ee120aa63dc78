#!/usr/bin/env bash
# Session 22, run 1 (run from the bundle as .gpu-pack/run1.sh): branch lane-token-chunks (token chunks of a large mHC call with overlapped
# copies) on the H200: its GPU suites (gpu_lanes_tests with the new chunked-vs-one-launch test,
# server_residual_session_tests, gpu_cuda_ipc_tests), memcheck of the lanes suite, samebits against
# main's server (da8ad8e = 42a4943's server code), then the A/B: main ("base"), chunks of >= 2 MiB
# ("2m", the branch), chunks of >= 1 MiB ("1m", the branch with kTokenChunkBytes = 1 MiB),
# interleaved, two passes; TCP rows and the shm row.
set -uo pipefail
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
ROOT_OUT=$OUT
STEPS="tests samebits" bash ./run_device.sh; echo "tests+samebits rc=$?"
timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 ./gpu_lanes_tests --gtest_brief=1 \
  --gtest_filter='-*TruncatedObjectNeverFaults*' > "$ROOT_OUT/memcheck-lanes.log" 2>&1
echo "memcheck gpu_lanes_tests rc=$?"; grep -E "ERROR SUMMARY|PASSED|FAILED" "$ROOT_OUT/memcheck-lanes.log" | head -5
cp fusedlayer_server fusedlayer_server_2m
: > "$ROOT_OUT/ab-all.log"
for pass in 1 2; do
  for v in base 2m 1m; do
    passes=new; [ $v = base ] && passes=base
    [ $v != base ] && cp "fusedlayer_server_$v" fusedlayer_server
    OUT=$ROOT_OUT/ab-$v-$pass STEPS=ab AB_PASSES=$passes AB_SECONDS=3 \
      AB_ROWS="mhc:64:1 mhc:128:1 mhc:64:4 mhc:1:1 swa:64:1" AB_SHM_ROWS="mhc:64:1" bash ./run_device.sh > /dev/null 2>&1
    echo "######## $v pass $pass (rc=$?)" >> "$ROOT_OUT/ab-all.log"
    cat "$ROOT_OUT/ab-$v-$pass/ab.log" >> "$ROOT_OUT/ab-all.log"
  done
done
cp fusedlayer_server_2m fusedlayer_server
cat "$ROOT_OUT/ab-all.log"
