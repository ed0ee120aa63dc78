#!/usr/bin/env bash
# Where a compute call's server time goes on the GPU (device machine; no Nsight Systems there):
# the server of a bundle runs with cupti_trace.cc injected (CUDA_INJECTION64_PATH) while
# `fusedctl bench` calls it at concurrency 1, batching off; timeline.py then prints the medians of
# the calls' GPU timelines and the CUDA runtime calls per call, beside the bench's `stages p50` line.
#
#   OUT=/tmp/o bash bench/experiments/cupti_trace/run.sh BUNDLE_DIR
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
B="$(cd "${1:?extracted gpu bundle}" && pwd)"
OUT="${OUT:?set OUT}"
CUDA=/usr/local/cuda
INC="$(dirname "$(find $CUDA/ -name cupti_activity.h | head -1)")"
LIB="$(dirname "$(find $CUDA/ -name 'libcupti.so' | head -1)")"
newest() { grep -o "$1[0-9]*\b" "$INC/cupti_activity.h" | sort -V | tail -1; }
g++ -O2 -shared -fPIC -std=c++17 -DKERNEL_RECORD="$(newest CUpti_ActivityKernel)" \
  -DMEMCPY_RECORD="$(newest CUpti_ActivityMemcpy)" -I"$INC" -I$CUDA/include "$HERE/cupti_trace.cc" \
  -L"$LIB" -lcupti -Wl,-rpath,"$LIB" -o /tmp/libcupti_trace.so || exit 1
cd "$B"
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for c in "swa 64 50191" "mhc 64 50193" "mhc 1 50195"; do
  set -- $c
  name=$1-$2
  CUDA_INJECTION64_PATH=/tmp/libcupti_trace.so CUPTI_TRACE_OUT=/tmp/trace-$name.csv \
    ./fusedlayer_server --demo_weights --backend=cuda --address=127.0.0.1:$3 \
    --metrics_address=127.0.0.1:$(($3 + 1)) --max_batch_tokens=0 > "$OUT/trace-$name-server.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 60); do ./fusedctl health --target=127.0.0.1:$3 >/dev/null 2>&1 && break; sleep 0.5; done
  { echo "== $name: fusedctl bench --op=$1 --tokens=$2 --concurrency=1, server traced by CUPTI"
    ./fusedctl bench --target=127.0.0.1:$3 --op=$1 --weight_set=v4-pro/demo --tokens=$2 --concurrency=1 --duration=3s
  } > "$OUT/trace-$name.txt" 2>&1
  kill -TERM $pid; wait $pid
  sleep 1
  python3 "$HERE/timeline.py" /tmp/trace-$name.csv >> "$OUT/trace-$name.txt" 2>&1
done
cat "$OUT"/trace-*.txt
