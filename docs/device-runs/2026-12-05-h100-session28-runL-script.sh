# session 28 run L: the three commands, each run as 'bash .gpu-pack/runL<k>.sh' with carry [.gpu-pack] (the bundle of scripts/gpu/build_and_bundle.sh at 8599a5c)
# ---- runL1.sh
#!/usr/bin/env bash
# Session 28, run L command 1: main's bundle (8599a5c: session 27's batching, drain, shm, session and CUDA IPC fixes, session 28's two
# residual-session fixes, pinned-bytes and admission fixes), run_device.sh steps tests, sanitize, serversan; verdicts on the console.
set -uo pipefail
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
rm -rf /tmp/b && mkdir -p /tmp/b && tar xJf .gpu-pack/gpu_bundle.tar.xz -C /tmp/b
SECONDS=0
STEPS="tests sanitize serversan" bash /tmp/b/run_device.sh 2>&1 | grep -vE "^\[ info \]" | tail -70
echo "run_device rc=${PIPESTATUS[0]} after ${SECONDS} s"
echo "== sanitizer verdicts"; cat $OUT/sanitizers.log
find $OUT -type f ! -name tests.log ! -name sanitizers.log ! -name serversan.log -delete
# ---- runL2.sh
#!/usr/bin/env bash
# Session 28, run L command 2: the same bundle, run_device.sh steps dataplane and sessions (issue 12's
# end-to-end rows with their echo floors, batching and lanes A/B; issue 13's residual-session rows).
set -uo pipefail
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
[ -x /tmp/b/run_device.sh ] || { rm -rf /tmp/b && mkdir -p /tmp/b && tar xJf .gpu-pack/gpu_bundle.tar.xz -C /tmp/b; }
SECONDS=0
STEPS="dataplane sessions" bash /tmp/b/run_device.sh > /tmp/l2.console 2>&1; rc=$?
echo "run_device rc=$rc after ${SECONDS} s"; grep -vE "^\[ info \]" /tmp/l2.console | grep -E "^==|DIFFER|fail|FAIL" | head
find $OUT -type f ! -name dataplane.log ! -name sessions.log -delete
# ---- runL3.sh
#!/usr/bin/env bash
# Session 28, run L command 3: the same bundle, run_device.sh steps shm and cudaipc: system shared
# memory byte-for-byte against TCP and its rows, CUDA IPC rows (issue 13), each beside TCP and the echo floor.
set -uo pipefail
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
[ -x /tmp/b/run_device.sh ] || { rm -rf /tmp/b && mkdir -p /tmp/b && tar xJf .gpu-pack/gpu_bundle.tar.xz -C /tmp/b; }
SECONDS=0
STEPS="shm cudaipc" bash /tmp/b/run_device.sh > /tmp/l3.console 2>&1; rc=$?
echo "run_device rc=$rc after ${SECONDS} s"; grep -vE "^\[ info \]" /tmp/l3.console | grep -E "^==|same bits|DIFFER|fail|FAIL" | head -50
find $OUT -type f ! -name shm.log ! -name cudaipc.log -delete
