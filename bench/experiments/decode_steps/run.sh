#!/usr/bin/env bash
# Where a small call's `decode` stage (and the lane's copy_in / device stages) go on the GPU host
# (issue 12: SWA M = 64 server p50 target 60 us, decode ~45 us of its ~90 us there; 10-16 us on
# the CPU backend here). A measurement build of the server (step_timer.h, decode_steps.patch) runs
# beside main's server, two interleaved passes, each at concurrency 1: SWA M = 64, mHC T = 1 and
# mHC T = 64. The measurement build's stderr has one `[steps]` line of medians per 2000 calls.
#
# Build (this machine), then run on the device machine (carry [".gpu-pack"]):
#   git apply bench/experiments/decode_steps/decode_steps.patch
#   ninja -C build-cuda fusedlayer_server && cp build-cuda/server/fusedlayer_server /tmp/fusedlayer_server_steps
#   git apply -R bench/experiments/decode_steps/decode_steps.patch && ninja -C build-cuda fusedlayer_server
#   GPU_TARGETS="fusedlayer_server fusedctl" EXTRA_EXES="/tmp/fusedlayer_server_steps:fusedlayer_server_steps" \
#     bash scripts/gpu/build_and_bundle.sh
#   device: mkdir -p /tmp/b && tar xJf .gpu-pack/gpu_bundle.tar.xz -C /tmp/b &&
#           OUT=$OUT bash bench/experiments/decode_steps/run.sh /tmp/b > $OUT/console.log 2>&1
# The same run then takes the CUPTI timeline of main's server (bench/experiments/cupti_trace).
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
B="$(cd "${1:?extracted gpu bundle}" && pwd)"
OUT="${OUT:?set OUT}"
cd "$B"
export LD_LIBRARY_PATH=$B/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
lscpu | grep -E "Model name|^CPU\(s\)"
start() {
  ./$1 --demo_weights --backend=cuda --address=127.0.0.1:$2 --metrics_address=127.0.0.1:$(($2 + 1)) > "$OUT/$3.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 60); do ./fusedctl health --target=127.0.0.1:$2 --service=fusedlayer.mhc >/dev/null 2>&1 && break; sleep 1; done
}
port=50400
for pass in 1 2; do
  for exe in fusedlayer_server fusedlayer_server_steps; do
    port=$((port + 2))
    start $exe $port server-$exe-$pass
    for row in "swa 64 6" "mhc 1 6" "mhc 64 10"; do
      set -- $row
      echo "## pass $pass $exe $1 T=$2"
      ./fusedctl bench --target=127.0.0.1:$port --op=$1 --weight_set=v4-pro/demo --tokens=$2 --concurrency=1 \
        --duration=${3}s | grep -E "stages|latency|requests"
    done
    kill -TERM $pid
    wait $pid
    grep "\[steps\]" "$OUT/server-$exe-$pass.log"
  done
done
echo "######## CUPTI timeline (main's server)"
OUT=$OUT timeout 200 bash "$HERE/../cupti_trace/run.sh" "$B" > /dev/null 2>&1
cat "$OUT"/trace-*.txt | grep -v "^requests\|^bench" | head -150
echo "decode_steps done"
