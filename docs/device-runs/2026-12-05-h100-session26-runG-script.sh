#!/usr/bin/env bash
# Session 26, run G: main against the two prepared finalize variants, one card, interleaved passes.
# ys = mhc_finalize_decode_stride26.patch (decode instance: one y source, stride 26 at compile time);
# sp = mhc_finalize_split_pointer.patch (ReduceSplits advances one pointer per batch, every instance).
# Graph replay, cold L2, medians (bench_mhc_gpu's own method); then ncu of the finalize in the graph
# (executed instructions, cycles, stall reasons) and each variant's bits (gpu_mhc_tests in full).
set -uo pipefail
mkdir -p /tmp/g && tar xJf .gpu-packG/gpu_bundle.tar.xz -C /tmp/g
cd /tmp/g
export LD_LIBRARY_PATH=$PWD/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
echo "columns: binary pass C T fused_us unfused_us floor_us fused_%bw L"
for pass in 1 2; do for v in main ys sp; do
  b=./bench_$v; [ $v = main ] && b=./bench_mhc_gpu
  for ct in 7168:1 7168:16 7168:64 7168:128 7168:1024 7168:4096 5120:64 4096:1 4096:64; do
    timeout 60 $b --C ${ct%%:*} --T ${ct##*:} | sed -n "s/^ *[0-9]/$v $pass &/p"
  done
  timeout 60 $b --C 7168 --T 1 --mode normal | sed -n "s/^ *[0-9]/$v-normal $pass &/p"
  timeout 60 $b --C 7168 --T 64 --mode normal | sed -n "s/^ *[0-9]/$v-normal $pass &/p"
done; done
M="smsp__inst_executed.sum,sm__cycles_elapsed.max,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio"
for v in main ys sp; do for ct in 7168:1 7168:64; do
  b=./bench_$v; [ $v = main ] && b=./bench_mhc_gpu
  echo "== ncu $v C=${ct%%:*} T=${ct##*:}: the pass and the finalize in the graph (launches 446-447)"
  timeout 90 ncu --clock-control none -k regex:Mhc --launch-skip 446 --launch-count 2 --metrics "$M" \
    $b --C ${ct%%:*} --T ${ct##*:} 2>&1 | grep -E "^  void|inst_executed|cycles_elapsed|stalled_" | sed 's/(FusedParams).*\|(FinalizeParams).*/&/'
done; done
for v in ys sp; do
  echo "== gpu_mhc_tests_$v"
  timeout 120 ./gpu_mhc_tests_$v --gtest_brief=1 2>&1 | tail -3
done
