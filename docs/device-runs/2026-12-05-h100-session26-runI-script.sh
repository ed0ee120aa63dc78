#!/usr/bin/env bash
# Session 26, run I: main against fm (the Sinkhorn's first step with __expf and one reciprocal per
# row instead of expf and IEEE division; gates unchanged). Graph replay, cold L2, medians, three
# interleaved passes; SASS counts of the decode finalize; fm's bits and tolerances (gpu_mhc_tests and
# mhc_contract_tests in full, with the mixes margins), memcheck / racecheck of the seam tests.
set -uo pipefail
rm -rf /tmp/i && mkdir -p /tmp/i && tar xJf .gpu-packG/gpu_bundle.tar.xz -C /tmp/i
cd /tmp/i
export LD_LIBRARY_PATH=$PWD/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
echo "columns: binary pass C T fused_us unfused_us floor_us fused_%bw L"
for pass in 1 2 3; do for v in main fm; do
  for ct in 7168:1 7168:16 7168:64 7168:128 7168:1024 7168:4096 5120:1 5120:64 5120:128 4096:1 4096:64 4096:128; do
    timeout 60 ./bench_$v --C ${ct%%:*} --T ${ct##*:} | sed -n "s/^ *[0-9]/$v $pass &/p"
  done
  for T in 1 64; do timeout 60 ./bench_$v --C 7168 --T $T --mode normal | sed -n "s/^ *[0-9]/$v-normal $pass &/p"; done
done; done
F='_ZN10fusedlayer3gpu3mhc17MhcFinalizeKernelILi4ELb1ELi2EEEvNS1_14FinalizeParamsE'
for v in main fm; do
  /usr/local/cuda/bin/cuobjdump -sass -fun $F ./bench_$v > /tmp/i/sass_$v.txt 2>&1
  echo "== SASS $v decode finalize: $(grep -c '^ */\*[0-9a-f]*\*/' /tmp/i/sass_$v.txt) instructions;" \
    $(grep -oE '(BRA|CALL|FCHK|BSSY|MUFU\.[A-Z0-9]+)' /tmp/i/sass_$v.txt | sort | uniq -c | tr '\n' ' ')
done
echo "== gpu_mhc_tests (fm)"
timeout 150 ./gpu_mhc_tests --gtest_brief=1 2>&1 | grep -E "margin|info|PASSED|FAILED|tests from" | tail -20
echo "== mhc_contract_tests (fm)"
timeout 150 ./mhc_contract_tests --gtest_brief=1 2>&1 | tail -3
for tool in memcheck racecheck; do
  echo "== $tool gpu_mhc_tests (fm: one-token, chained, seam variants, batch invariance, graph replay)"
  timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 ./gpu_mhc_tests --gtest_brief=1 \
    --gtest_filter='*OneToken*:*Chained*:*SeamVariants*:*BatchInvariance*:*Graph*' 2>&1 | grep -E "SUMMARY|PASSED|FAILED|rror"
done
