#!/usr/bin/env bash
# Session 22, run 4 (run from the bundle as .gpu-pack/run2.sh; PROFILE_TOOLS=1 bundle): where the decode stage of a small call goes on the GPU host (issue 12: SWA M = 64
# server p50 target 60 us; decode is ~50 us of its ~97 us there, 10-14 us on the CPU backend). perf
# on main's server (42a4943's code) under fusedctl bench at concurrency 1: SWA M = 64, then mHC T = 1.
set -uo pipefail
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
./fusedlayer_server --demo_weights --backend=cuda --address=127.0.0.1:50197 --metrics_address=127.0.0.1:50198 > $OUT/server.log 2>&1 &
pid=$!
for _ in $(seq 1 60); do ./fusedctl health --target=127.0.0.1:50197 --service=fusedlayer.mhc >/dev/null 2>&1 && break; sleep 1; done
for row in "swa 64" "mhc 1"; do
  set -- $row
  echo "######## $1 T=$2"
  ./fusedctl bench --target=127.0.0.1:50197 --op=$1 --weight_set=v4-pro/demo --tokens=$2 --concurrency=1 --duration=2s | grep -E "stages|latency"
  ./fusedctl bench --target=127.0.0.1:50197 --op=$1 --weight_set=v4-pro/demo --tokens=$2 --concurrency=1 --duration=9s > /tmp/bench.txt 2>&1 &
  bench=$!
  sleep 2
  timeout 20 ./perf record -F 9999 -g -o /tmp/perf-$1.data -p $pid -- sleep 4 2>&1 | tail -1
  wait $bench; grep -E "stages|latency|requests" /tmp/bench.txt
  echo "---- by thread"
  ./perf report -i /tmp/perf-$1.data --stdio --no-children --sort comm --percent-limit 1 2>/dev/null | grep -v "^#" | grep -v "^$" | head -12
  echo "---- inclusive (children), by symbol"
  ./perf report -i /tmp/perf-$1.data --stdio --children --sort symbol --percent-limit 0.7 -g none 2>/dev/null | grep -v "^#" | grep -v "^$" | head -120
  echo "---- callers of the decode path"
  ./perf report -i /tmp/perf-$1.data --stdio --children --sort symbol -G --percent-limit 3 \
    --symbol-filter=ServeCompute 2>/dev/null | grep -v "^#" | grep -v "^$" | head -150
done
kill -TERM $pid; wait $pid; echo "server exit rc=$?"
