#!/usr/bin/env bash
# Device script for the prepared finalize variants (mhc_finalize_decode_stride26.patch, "ys", and
# mhc_finalize_split_pointer.patch, "sp"; session 25; both measured slower in session 26: MHC_GPU_NOTES.md, split-load round).
# Bundle with the project's own script, from the repository root, after building each patched tree
# (cmake --build <dir> --target bench_mhc_gpu gpu_mhc_tests):
#   GPU_TARGETS="bench_mhc_gpu" GPU_PACK=.gpu-packG GPU_STAGE=.gpuG EXTRA_EXES="<ys build>/bench/gpu/bench_mhc_gpu:bench_ys
#     <ys build>/tests/gpu/gpu_mhc_tests:gpu_mhc_tests_ys <sp build>/bench/gpu/bench_mhc_gpu:bench_sp
#     <sp build>/tests/gpu/gpu_mhc_tests:gpu_mhc_tests_sp" scripts/gpu/build_and_bundle.sh
# and run it with carry [".gpu-packG"] (main's benchmark is the bundle's bench_mhc_gpu).
# Runs: main against each variant (graph replay, cold L2, medians, two interleaved passes; decode
# sizes, one large T, normal mode at T = 1), then each variant's bits (gpu_mhc_tests in full) and
# memcheck / racecheck of its seam tests.
set -uo pipefail
mkdir -p /tmp/g && tar xJf .gpu-packG/gpu_bundle.tar.xz -C /tmp/g
cd /tmp/g
export LD_LIBRARY_PATH=$PWD/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
echo "columns: binary pass C T fused_us unfused_us floor_us fused_%bw L"
for pass in 1 2; do for v in main ys sp; do
  b=./bench_$v; [ $v = main ] && b=./bench_mhc_gpu
  [ -x $b ] || continue
  for ct in 7168:1 7168:16 7168:64 7168:128 7168:1024 5120:64 4096:64 4096:1; do
    timeout 60 $b --C ${ct%%:*} --T ${ct##*:} | sed -n "s/^ *[0-9]/$v $pass &/p"
  done
  timeout 60 $b --C 7168 --T 1 --mode normal | sed -n "s/^ *[0-9]/$v-normal $pass &/p"
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
