#!/usr/bin/env bash
# Session 26, run J command 1: main's bundle (0a25971's binaries: the Sinkhorn first step of 0214df2),
# run_device.sh steps tests and sanitize; the verdicts and the mixes margins on the console.
set -uo pipefail
rm -rf /tmp/b && mkdir -p /tmp/b && tar xJf .gpu-pack/gpu_bundle.tar.xz -C /tmp/b
STEPS="tests sanitize" bash /tmp/b/run_device.sh 2>&1 | grep -vE "^\[ info \]" | tail -60
echo "== mixes margins and info lines (gpu_mhc_tests)"
grep -E "mixes margin|normal y vs" $OUT/tests.log | sort | uniq | head -30
echo "== sanitizer verdicts"; cat $OUT/sanitizers.log
# keep only the two summary logs (the device tool returns a limited number of files)
find $OUT -type f ! -name tests.log ! -name sanitizers.log -delete
