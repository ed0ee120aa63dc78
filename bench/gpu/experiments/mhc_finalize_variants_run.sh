#!/usr/bin/env bash
# Device script for the prepared finalize variants (mhc_finalize_decode_stride26.patch, "ys", and
# mhc_finalize_split_pointer.patch, "sp"; session 25, not yet run: no device time was left). Bundle,
# from the repository root (carry [".gpu-packG"]):
#   mkdir -p /tmp/stG && cp build-cuda/bench/gpu/bench_mhc_gpu /tmp/stG/bench_main
#   cp <patched build>/bench/gpu/bench_mhc_gpu /tmp/stG/bench_ys
#   cp <patched build>/tests/gpu/gpu_mhc_tests /tmp/stG/gpu_mhc_tests_ys
#   (and, built with mhc_finalize_split_pointer.patch instead, bench_sp and gpu_mhc_tests_sp)
#   bash ../shared/tools/bundle-runtime.sh /tmp/bG /tmp/stG/* && mkdir -p .gpu-packG
#   tar cJf .gpu-packG/bundle.tar.xz -C /tmp/bG .
# Runs: main against each variant (graph replay, cold L2, medians, two interleaved passes; decode
# sizes, one large T, normal mode at T = 1), then each variant's bits (gpu_mhc_tests in full) and
# memcheck / racecheck of its seam tests.
set -uo pipefail
mkdir -p /tmp/g && tar xJf .gpu-packG/bundle.tar.xz -C /tmp/g
cd /tmp/g
export LD_LIBRARY_PATH=$PWD/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
echo "columns: binary pass C T fused_us unfused_us floor_us fused_%bw L"
for pass in 1 2; do for v in main ys sp; do
  [ -x ./bench_$v ] || continue
  for ct in 7168:1 7168:16 7168:64 7168:128 7168:1024 5120:64 4096:64 4096:1; do
    timeout 60 ./bench_$v --C ${ct%%:*} --T ${ct##*:} | sed -n "s/^ *[0-9]/$v $pass &/p"
  done
  timeout 60 ./bench_$v --C 7168 --T 1 --mode normal | sed -n "s/^ *[0-9]/$v-normal $pass &/p"
done; done
for v in ys sp; do
  [ -x ./gpu_mhc_tests_$v ] || continue
  echo "== gpu_mhc_tests_$v"
  timeout 100 ./gpu_mhc_tests_$v --gtest_brief=1 2>&1 | tail -3
  for tool in memcheck racecheck; do
    echo "== $tool gpu_mhc_tests_$v (one-token, chained, seam variants, graph replay)"
    timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 ./gpu_mhc_tests_$v --gtest_brief=1 \
      --gtest_filter='*OneToken*:*Chained*:*SeamVariants*:*Graph*' 2>&1 | grep -E "SUMMARY|PASSED|FAILED"
  done
done
