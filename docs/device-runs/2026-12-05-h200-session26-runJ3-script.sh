#!/usr/bin/env bash
# Session 26, run J command 3: main's bundle (0058d6b's binaries: the kernels of 96c121c, the registry
# change of bc4d03e), run_device.sh steps tests, sanitize and serversan; verdicts on the console.
set -uo pipefail
rm -rf /tmp/b && mkdir -p /tmp/b && tar xJf .gpu-pack/gpu_bundle.tar.xz -C /tmp/b
STEPS="tests sanitize serversan" bash /tmp/b/run_device.sh 2>&1 | grep -vE "^\[ info \]" | tail -70
echo "== sanitizer verdicts"; cat $OUT/sanitizers.log
find $OUT -type f ! -name tests.log ! -name sanitizers.log ! -name serversan.log -delete
